//! Helper measures packed in the target, written by a compare-and-swap on a cached image
//! (src/packed.rs): the exhaustive check (every reachable state, no property violated, every
//! example reached) and the seeded bugs (each must be found; the shortest counterexample is
//! printed with --nocapture).

use protocol_model::packed::{check_all, describe, find_counterexample, names, PackedBugs, PackedModel};

#[test]
fn packed_values_and_their_derived_value_stay_exact() {
    for model in [PackedModel::default(), PackedModel { crashes: 2, bumps: 2, ..PackedModel::default() }] {
        let s = check_all(model.clone());
        println!("[packed] {model:?}: {} unique states in {:.1} s", s.unique_states, s.seconds);
        assert!(s.failures.is_empty(), "[packed] failed: {:?}", s.failures);
    }
}

fn expect_found(label: &str, bugs: PackedBugs, property: &'static str) -> usize {
    let start = std::time::Instant::now();
    let model = PackedModel { crashes: 2, bumps: 1, bugs };
    let trace = find_counterexample(model, property).unwrap_or_else(|| panic!("[{label}] no counterexample"));
    println!("[{label}] '{property}' violated after {} steps (shortest; found in {:.1} s):", trace.len(), start.elapsed().as_secs_f64());
    for (i, (action, state)) in trace.iter().enumerate() {
        println!("[{label}]   {:>2}. {action:?}\n[{label}]         {}", i + 1, describe(state));
    }
    trace.len()
}

/// (u) A replay the ledger refuses entirely is taken as done: a crash between a blind write
/// and its derivation leaves the value behind the counts.
#[test]
fn u_refused_replay_not_checked() {
    expect_found("u", PackedBugs { no_replay_check: true, ..PackedBugs::default() }, names::DERIVED);
}

/// (v) The CAS write is not conditioned on the write counter: a reader derives from an image
/// another reader's write has made stale.
#[test]
fn v_cas_without_the_version_condition() {
    expect_found("v", PackedBugs { no_version_condition: true, ..PackedBugs::default() }, names::DERIVED);
}

/// (w) A failed derivation is taken as done: a reconcile write that advanced the counter
/// without deriving leaves the last blind write underived.
#[test]
fn w_failed_derivation_not_retried() {
    expect_found("w", PackedBugs { no_retry: true, ..PackedBugs::default() }, names::DERIVED);
}
