//! Exhaustive checks of the protocol as specified: every reachable state within the bounds,
//! no property violated, every example property reachable (so the checks are not vacuous).

use protocol_model::{all_shapes, check_all, Listing, ProtocolModel, Summary};

fn report(label: &str, model: &ProtocolModel, s: &Summary) {
    println!(
        "[{label}] shapes {:?}, crashes {}, expiries {}: {} unique states ({} generated, depth {}) in {:.1} s",
        model.shapes, model.crashes, model.expiries, s.unique_states, s.total_states, s.max_depth, s.seconds
    );
    for (name, trace) in &s.discoveries {
        println!("[{label}]   {name}: reached in {} steps", trace.len());
    }
    assert!(s.failures.is_empty(), "[{label}] failed: {:?}\n{:#?}", s.failures, s.discoveries);
}

/// The ledger, floor, stragglers, leases and checkpoints: 2 replicas, P split into C1 and C2,
/// every shape of 1-2 records per shard, one crash, two lease expiries (stale owners acting
/// with old memory), pruning writes from any stale view.
#[test]
fn protocol_is_exactly_once() {
    let model = ProtocolModel { shapes: all_shapes(), crashes: 1, expiries: 2, symmetry: true, ..Default::default() };
    let s = check_all(model.clone(), 2);
    report("protocol", &model, &s);
}

/// Records whose deltas cancel out (+1 then -1 in P and C2): ledger-only writes keep a partly
/// applied batch from being counted for ever.
#[test]
fn cancelling_deltas_stay_exact() {
    let model = ProtocolModel {
        shapes: all_shapes(),
        weights: [[1, -1], [1, 1], [1, -1]],
        crashes: 1,
        expiries: 1,
        symmetry: true,
        ..Default::default()
    };
    let s = check_all(model.clone(), 2);
    report("cancelling", &model, &s);
}

/// Reconcile while the stream is live (records appear one by one), after an external
/// corruption of the value: it never makes the value worse, and a correction is exact.
#[test]
fn reconcile_never_introduces_drift() {
    let model = ProtocolModel {
        shapes: vec![[2, 1, 1], [1, 1, 2]],
        crashes: 1,
        expiries: 1,
        dynamic_production: true,
        corruption: true,
        reconcile: true,
        symmetry: true,
        ..Default::default()
    };
    let s = check_all(model.clone(), 2);
    report("reconcile", &model, &s);
}

/// The code's floor plan (open = listed and not finished, F' = a listed open shard's creation
/// time) is sound when a listing that shows a shard shows every shard created before it.
#[test]
fn floor_plan_from_creation_ordered_listing_is_sound() {
    let model = ProtocolModel {
        shapes: all_shapes(),
        crashes: 1,
        expiries: 1,
        symmetry: true,
        listing: Listing::ListedCreationPrefix,
        ..Default::default()
    };
    let s = check_all(model.clone(), 2);
    report("listed-prefix", &model, &s);
}

/// Stragglers by creation time, with the split's children created in the same millisecond
/// (the code since compact ledger entries): a finished child stays admitted while its open
/// sibling is a straggler, so its entry must stay too.
#[test]
fn stragglers_by_creation_time_with_children_of_one_millisecond_are_exactly_once() {
    let model = ProtocolModel { shapes: all_shapes(), crashes: 1, expiries: 1, symmetry: true, time_tokens: true, ..Default::default() };
    let s = check_all(model.clone(), 2);
    report("time-tokens", &model, &s);
}

/// As above, and a straggler may also be kept by its id (the code does so for a creation time
/// whose finished shards' entries outnumber its open ones): the finished sibling's entry goes,
/// and the item refuses it from then on.
#[test]
fn stragglers_by_id_for_a_shared_creation_time_are_exactly_once() {
    let model = ProtocolModel {
        shapes: all_shapes(),
        crashes: 1,
        expiries: 1,
        symmetry: true,
        time_tokens: true,
        ids_for_shared_times: true,
        ..Default::default()
    };
    let s = check_all(model.clone(), 2);
    report("ids-for-shared-times", &model, &s);
}
