//! The hold and log that correct a target written every second (src/hold.rs): the exhaustive
//! check (every reachable state, no property violated, both examples reached) and the seeded
//! bugs (each must be found; the shortest counterexample is printed with --nocapture).

use protocol_model::hold::{check_all, describe, find_counterexample, names, HoldBugs, HoldModel};

#[test]
fn the_hold_protocol_corrects_a_busy_target_exactly() {
    for model in [HoldModel::default(), HoldModel { crashes: 2, expiries: 2, runs: 3, ..HoldModel::default() }] {
        let s = check_all(model.clone());
        println!("[hold] {model:?}: {} unique states in {:.1} s", s.unique_states, s.seconds);
        assert!(s.failures.is_empty(), "[hold] failed: {:?}", s.failures);
    }
}

fn expect_found(label: &str, bugs: HoldBugs) -> usize {
    let start = std::time::Instant::now();
    let model = HoldModel { bugs, ..HoldModel::default() };
    let trace = find_counterexample(model, names::EXACT).unwrap_or_else(|| panic!("[{label}] no counterexample"));
    println!(
        "[{label}] '{}' violated after {} steps (shortest; found in {:.1} s):",
        names::EXACT,
        trace.len(),
        start.elapsed().as_secs_f64()
    );
    for (i, (action, state)) in trace.iter().enumerate() {
        println!("[{label}]   {:>2}. {action:?}\n[{label}]         {}", i + 1, describe(state));
    }
    trace.len()
}

/// (q) Writers do not log while the hold stands: a record applied after the truth read is
/// missing from the correction.
#[test]
fn q_writers_do_not_log() {
    expect_found("q", HoldBugs { no_log: true, ..HoldBugs::default() });
}

/// (r) The hold is set after the truth read: a record created and applied in between is in
/// neither the truth nor the log.
#[test]
fn r_hold_after_the_truth_read() {
    expect_found("r", HoldBugs { hold_after_truth: true, ..HoldBugs::default() });
}

/// (s) A writer over an expired hold leaves it (and writes no log): the owner's correction
/// still finds its hold and misses that write.
#[test]
fn s_expired_hold_left_in_place() {
    expect_found("s", HoldBugs { expired_hold_kept: true, ..HoldBugs::default() });
}

/// (t) Neither the read nor the correction checks the hold is its own: a write that removed
/// the expired hold (and its log) is missed.
#[test]
fn t_hold_not_checked() {
    expect_found("t", HoldBugs { no_hold_check: true, ..HoldBugs::default() });
}
