//! Helper measures packed in the target, written by a compare-and-swap on a cached image
//! (src/packed.rs): the exhaustive check (every reachable state, no property violated, every
//! example reached) and the seeded bugs (each must be found; the shortest counterexample is
//! printed with --nocapture).

use protocol_model::check::expect_found;
use protocol_model::packed::{check_all, describe, names, PackedBugs, PackedModel};

#[test]
fn packed_values_and_their_derived_value_stay_exact() {
    for model in [PackedModel::default(), PackedModel { crashes: 2, bumps: 2, ..PackedModel::default() }] {
        let s = check_all(model.clone());
        println!("[packed] {model:?}: {} unique states in {:.1} s", s.unique_states, s.seconds);
        assert!(s.failures.is_empty(), "[packed] failed: {:?}", s.failures);
    }
}

/// The seeded-bug runs: 2 crashes and 1 reconcile write.
fn seeded(bugs: PackedBugs) -> PackedModel {
    PackedModel { crashes: 2, bumps: 1, bugs }
}

/// (u) A replay the ledger refuses entirely is taken as done: a crash between a blind write
/// and its derivation leaves the value behind the counts.
#[test]
fn u_refused_replay_not_checked() {
    expect_found("u", seeded(PackedBugs { no_replay_check: true, ..PackedBugs::default() }), names::DERIVED, describe);
}

/// (v) The CAS write is not conditioned on the write counter: a reader derives from an image
/// another reader's write has made stale.
#[test]
fn v_cas_without_the_version_condition() {
    expect_found("v", seeded(PackedBugs { no_version_condition: true, ..PackedBugs::default() }), names::DERIVED, describe);
}

/// (w) A failed derivation is taken as done: a reconcile write that advanced the counter
/// without deriving leaves the last blind write underived.
#[test]
fn w_failed_derivation_not_retried() {
    expect_found("w", seeded(PackedBugs { no_retry: true, ..PackedBugs::default() }), names::DERIVED, describe);
}
