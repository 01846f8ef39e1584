//! Each seeded bug switches one rule of the protocol off; the checker must find the failure
//! that rule prevents. The traces are printed (run with --nocapture).

use protocol_model::{describe, find_counterexample, names, Bugs, Listing, ProtocolModel};

fn expect_found(label: &str, model: ProtocolModel, property: &'static str) {
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
}

fn with(bugs: Bugs) -> ProtocolModel {
    ProtocolModel { bugs, ..Default::default() }
}

/// (a) Writes not checked against the floor: a stalled former owner of P wakes up after P's
/// entry was pruned and applies its batch again.
#[test]
fn a_pruning_without_floor_condition_double_counts() {
    expect_found("a", with(Bugs { no_floor_check: true, ..Bugs::default() }), names::NO_DOUBLE_APPLY);
}

/// (b) O' taken from a stale view without intersecting the admitted set: P (pruned) is
/// re-admitted as a straggler, and its stalled former owner re-applies.
#[test]
fn b_stragglers_outside_admitted_set_double_count() {
    expect_found("b", with(Bugs { stragglers_unconstrained: true, ..Bugs::default() }), names::NO_DOUBLE_APPLY);
}

/// (c) No ledger-only write for a batch whose deltas cancel: a replica that applied only the
/// +1 and died leaves it counted for ever.
#[test]
fn c_skipping_ledger_only_writes_loses_exactness() {
    let model = ProtocolModel { weights: [[1, -1], [1, 1], [1, 1]], ..with(Bugs { skip_zero_writes: true, ..Bugs::default() }) };
    expect_found("c", model, names::QUIESCENT_VALUE);
}

/// (d) Checkpoint before the write: a crash in between loses the batch.
#[test]
fn d_checkpoint_before_write_loses_records() {
    let model = with(Bugs { checkpoint_before_write: true, ..Bugs::default() });
    expect_found("d", model.clone(), names::FINISHED_MEANS_APPLIED);
    expect_found("d", model, names::QUIESCENT_EXACTLY_ONCE);
}

/// (e) Pruning writes without the compare-and-set on (F, O): a write computed from an old
/// (F, O) re-admits a shard pruned meanwhile.
#[test]
fn e_pruning_without_compare_and_set_double_counts() {
    expect_found("e", with(Bugs { no_cas: true, ..Bugs::default() }), names::NO_DOUBLE_APPLY);
}

/// (f) The floor may go down: a pruned shard is admitted again.
#[test]
fn f_lowering_the_floor_double_counts() {
    expect_found("f", with(Bugs { floor_may_drop: true, ..Bugs::default() }), names::NO_DOUBLE_APPLY);
}

/// (g) O' may leave out a shard that is open: its owner is fenced before it is finished.
#[test]
fn g_incomplete_stragglers_fence_an_open_shard() {
    expect_found("g", with(Bugs { stragglers_incomplete: true, ..Bugs::default() }), names::FENCED_ONLY_IF_FINISHED);
}

fn live_reconcile(bugs: Bugs) -> ProtocolModel {
    ProtocolModel {
        shapes: vec![[2, 1, 1]],
        crashes: 0,
        expiries: 0,
        dynamic_production: true,
        corruption: true,
        reconcile: true,
        bugs,
        ..Default::default()
    }
}

/// (h) Reconcile writes without the counter condition: a stream write that lands between its
/// item read and its write is overwritten.
#[test]
fn h_unconditional_reconcile_write_introduces_drift() {
    expect_found("h", live_reconcile(Bugs { recon_unconditional: true, ..Bugs::default() }), names::VALUE_MATCHES);
}

/// (i) Reconcile reads the write counter after the truth instead of before it: a record
/// created after the truth read and applied before the counter read goes unnoticed, and the
/// correction sets the value back to the older truth.
#[test]
fn i_reconcile_reading_the_counter_after_the_truth_introduces_drift() {
    expect_found("i", live_reconcile(Bugs { recon_late_snapshot: true, ..Bugs::default() }), names::VALUE_MATCHES);
}

/// (k) Reconcile does not wait until the consumer applied what its truth saw (`--no-wait`
/// while a consumer runs): it sets the value to a truth holding a record the item lacks, and
/// the consumer then applies that record again on top.
#[test]
fn k_reconcile_without_the_wait_double_counts() {
    expect_found("k", live_reconcile(Bugs { recon_no_wait: true, ..Bugs::default() }), names::VALUE_MATCHES);
}

/// (j) The code's floor plan counts as open only the shards its lease listing shows. A listing
/// that shows a younger open shard (C2) but misses an older one (C1: its lease created after
/// the scan read that page, or by another replica after C2's) raises the floor past C1, which
/// is then fenced before it is finished.
#[test]
fn j_floor_plan_from_a_listing_that_misses_a_lease_fences_an_open_shard() {
    let model = ProtocolModel { listing: Listing::ListedAnySubset, ..ProtocolModel::default() };
    expect_found("j", model, names::FENCED_ONLY_IF_FINISHED);
}

/// (l) Stragglers by creation time, but pruning by shard: C1 (finished) shares its creation
/// time with the open straggler C2, so the item still admits C1 after its entry went, and a
/// stalled former owner of C1 applies its batch again.
#[test]
fn l_pruning_by_shard_under_time_tokens_double_counts() {
    let model = ProtocolModel { time_tokens: true, ..with(Bugs { prune_by_shard: true, ..Bugs::default() }) };
    expect_found("l", model, names::NO_DOUBLE_APPLY);
}

/// (m) A straggler kept by its id (its finished sibling of the same millisecond pruned) goes
/// back to a time token: the token re-admits the sibling, and its stalled former owner applies
/// its batch again.
#[test]
fn m_an_id_straggler_back_to_its_time_double_counts() {
    let model = ProtocolModel { time_tokens: true, ids_for_shared_times: true, ..with(Bugs { id_back_to_time: true, ..Bugs::default() }) };
    expect_found("m", model, names::NO_DOUBLE_APPLY);
}
