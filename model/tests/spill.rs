//! A packed measure spilled into helper items, and targets written before packing
//! (src/spill.rs): the exhaustive check and the seeded bugs (each must be found; the shortest
//! counterexample is printed with --nocapture).

use protocol_model::check::expect_found;
use protocol_model::spill::{check_all, describe, names, SpillBugs, SpillModel};

#[test]
fn spilled_and_legacy_counts_stay_exact() {
    for model in
        [SpillModel::default(), SpillModel { crashes: 2, ..SpillModel::default() }, SpillModel { legacy: true, ..SpillModel::default() }]
    {
        let s = check_all(model.clone());
        println!("[spill] {model:?}: {} unique states in {:.1} s", s.unique_states, s.seconds);
        assert!(s.failures.is_empty(), "[spill] failed: {:?}", s.failures);
    }
}

/// (x) The spill does not copy the target's ledger entries to the helpers: a replay of a
/// record the target applied is applied again by a helper.
#[test]
fn x_spill_without_the_ledger_copy() {
    let bugs = SpillBugs { no_entry_copy: true, ..SpillBugs::default() };
    expect_found("x", SpillModel { crashes: 1, legacy: false, bugs }, names::EXACT, describe);
}

/// (y) A writer without an image writes packed deltas without the place condition: they land
/// in a target whose counts have moved to the helpers.
#[test]
fn y_packed_write_without_the_place_condition() {
    let bugs = SpillBugs { no_place_condition: true, ..SpillBugs::default() };
    expect_found("y", SpillModel { crashes: 1, legacy: false, bugs }, names::PACKED_EMPTY, describe);
}

/// (z) A target the older release wrote starts packed because no helper exists yet: the
/// replayed record's target write is refused by the ledger, and its count is lost.
#[test]
fn z_written_target_without_a_place_starts_packed() {
    let bugs = SpillBugs { unknown_is_packed: true, ..SpillBugs::default() };
    expect_found("z", SpillModel { crashes: 1, legacy: true, bugs }, names::EXACT, describe);
}
