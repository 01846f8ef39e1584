//! Exhaustive checks of a rule definition change during a rolling deploy (src/definitions.rs):
//! every reachable state within the bounds, no property violated, every example reached.
//! Two OLD replicas (each may be replaced by a NEW one), P alone with 2 records or P and its
//! child C with 1 each (the second and third runs: P and C only), records appearing one by one,
//! 1 crash of an OLD replica, 1 heartbeat lapse, 1 lease expiry.

use protocol_model::definitions::{check_all, RolloutBugs, RolloutModel, Summary};

fn report(label: &str, model: &RolloutModel, s: &Summary) {
    println!(
        "[{label}] shapes {:?}, replicas {:?}, crashes {}, lapses {}, expiries {}, deadline {}, fence {}, generation leases {}, drain {}, {:?}: {} unique states ({} generated, depth {}) in {:.1} s",
        model.shapes,
        model.configs,
        model.crashes,
        model.lapses,
        model.expiries,
        model.deadline,
        model.fence,
        model.generation_leases,
        model.drain,
        model.bugs,
        s.unique_states,
        s.total_states,
        s.max_depth,
        s.seconds
    );
    for (name, trace) in &s.discoveries {
        println!("[{label}]   {name}: reached in {} steps", trace.len());
    }
    for (name, trace) in s.discoveries.iter().filter(|(n, _)| s.failures.contains(n)) {
        println!("[{label}] {name}:");
        for (i, a) in trace.iter().enumerate() {
            println!("[{label}]   {:>2}. {a}", i + 1);
        }
    }
    assert!(s.failures.is_empty(), "[{label}] failed: {:?}", s.failures);
}

/// No renewal deadline (a paused replica acts later on its old batch, lease and generation):
/// exact with the generation fence on target writes and takes and checkpoints conditional on
/// the generation.
#[test]
fn rollout_without_deadline_is_exact_with_fence_and_generation_leases() {
    let model = RolloutModel::default();
    let s = check_all(model.clone(), 2);
    report("rollout", &model, &s);
}

/// With the fence and generation leases, (a) and (b) are not needed for exactness: a commit
/// while an OLD replica still works only makes its writes refused or rebuilt away.
#[test]
fn fence_and_generation_leases_are_exact_without_a_and_b() {
    let bugs = RolloutBugs { no_live_check: true, no_lease_check: true };
    let model = RolloutModel { shapes: vec![[1, 1]], bugs, ..RolloutModel::default() };
    let s = check_all(model.clone(), 2);
    report("without-a-b", &model, &s);
}

/// The renewal deadline assumed, no fence: exact when the committer marks generation 1 as
/// draining before it checks (a) and (b) and takes are conditional on the generation; and no
/// record reaches T_old after the commit.
#[test]
fn rollout_under_deadline_is_exact_with_drain() {
    let model = RolloutModel { shapes: vec![[1, 1]], deadline: true, fence: false, drain: true, ..RolloutModel::default() };
    let s = check_all(model.clone(), 2);
    report("deadline-drain", &model, &s);
}

/// The protocol as briefed (no fence, no generation leases, no drain) with the renewal deadline
/// and no heartbeat lapse: exact, and nothing reaches T_old after the commit. This is the
/// baseline of seeded bug (m).
#[test]
fn as_briefed_without_pauses_is_exact() {
    let model = RolloutModel { deadline: true, fence: false, generation_leases: false, lapses: 0, ..RolloutModel::default() };
    let s = check_all(model.clone(), 2);
    report("briefed-no-lapse", &model, &s);
}
