//! Seeded bugs of the definition change (src/definitions.rs): each must be found, with the
//! shortest counterexample printed (run with --nocapture).

use protocol_model::definitions::{describe, find_counterexample, names, RebuildOrder, RolloutBugs, RolloutModel};

fn expect_found(label: &str, model: RolloutModel, property: &'static str) -> usize {
    let start = std::time::Instant::now();
    let trace = find_counterexample(model, property).unwrap_or_else(|| panic!("[{label}] no counterexample to '{property}'"));
    let mut out = format!(
        "[{label}] '{property}' violated after {} steps (shortest; found in {:.1} s):\n",
        trace.len(),
        start.elapsed().as_secs_f64()
    );
    for (i, (action, state)) in trace.iter().enumerate() {
        out.push_str(&format!("[{label}]   {:>2}. {action}\n[{label}]         {}\n", i + 1, describe(state)));
    }
    print!("{out}");
    trace.len()
}

/// The protocol as briefed: no fence, no generation leases, no drain.
fn as_briefed() -> RolloutModel {
    RolloutModel { fence: false, generation_leases: false, ..RolloutModel::default() }
}

/// (m) The commit checks neither (a) nor (b): NEW is committed while an OLD replica still
/// holds a live lease, and it keeps applying the old definition (renewal deadline assumed, no
/// heartbeat lapse: the baseline passes in the exhaustive run).
#[test]
fn m_commit_while_an_old_replica_holds_a_live_lease() {
    let bugs = RolloutBugs { no_live_check: true, no_lease_check: true };
    let model = RolloutModel { deadline: true, lapses: 0, bugs, ..as_briefed() };
    expect_found("m", model.clone(), names::OLD_NOT_AFTER_COMMIT);
    expect_found("m", model, names::OLD_STAYS_ZERO);
}

/// (n) Check, then commit: even with the renewal deadline, an OLD replica whose heartbeat had
/// lapsed renews it and takes a lease between the committer's check of (a) and (b) and its
/// commit, then applies the old definition after the commit (T_old written after its rebuild;
/// a record it checkpoints after the truth read of T_new's rebuild never reaches T_new).
#[test]
fn n_lease_taken_between_the_check_and_the_commit() {
    let model = RolloutModel { deadline: true, ..as_briefed() };
    expect_found("n", model, names::OLD_STAYS_ZERO);
}

/// (o) No renewal deadline, as briefed: an OLD replica paused with a batch writes it to T_old
/// after T_old's rebuild; and a stale OLD replica that checkpoints after the commit lets a stale
/// NEW reader apply a record T_new's rebuild already counted.
#[test]
fn o_paused_old_replica_without_fence() {
    expect_found("o", as_briefed(), names::OLD_STAYS_ZERO);
    expect_found("o", as_briefed(), names::NO_DOUBLE_NEW);
}

/// (p) The generation fence alone (takes and checkpoints not conditional on the generation),
/// even with T_old rebuilt before T_new's truth is read: a stale OLD replica takes a lease after
/// the commit, applies a record to T_old before T_old's rebuild and checkpoints it; T_new's
/// rebuild counts it, and a stale NEW reader that read it before applies it again.
#[test]
fn p_fence_without_generation_leases() {
    let model = RolloutModel { generation_leases: false, order: RebuildOrder::OldThenNew, ..RolloutModel::default() };
    expect_found("p", model, names::NO_DOUBLE_NEW);
}

/// (q) Generation leases without the fence: a paused OLD replica's write (with no checkpoint
/// after it) still lands in T_old after its rebuild.
#[test]
fn q_generation_leases_without_fence() {
    let model = RolloutModel { fence: false, ..RolloutModel::default() };
    expect_found("q", model, names::OLD_STAYS_ZERO);
}
