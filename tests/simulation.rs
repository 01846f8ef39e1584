//! The deterministic simulation (DESIGN.md section 4): the whole consumer (several replicas of
//! the real worker, and a second deployment on the same items) on a simulated clock over the
//! in-memory fakes, for months of stream life: shards that roll over about every 4 hours and
//! split, 24-hour retention that trims records and drops closed shards from the listing,
//! faults on every call (throttling, errors, calls that time out after they took effect,
//! expired iterators), crashes at any call, paused replicas that wake after their lease is gone,
//! rolling restarts, and an outage longer than the retention. An independent oracle computes
//! every aggregate from the source items at each quiescent point.
//!
//! Seeded: the runtime is single-threaded with paused time, the fakes are synchronous and every
//! random choice comes from the seed, so a failing seed replays exactly
//! (`SIM_SEED=... cargo test --release --test simulation -- --nocapture`).
//!
//! `scripts/simulate-scale [SECONDS]` runs seeds for a time budget at production scale;
//! `scripts/test` runs a short one.

mod sim;

/// The allocator the service runs with (src/main.rs): the simulation spends much of its time
/// allocating, as the service does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use sim::{run, Params};

/// A short run for every `scripts/test`: 4 partitions, 6 simulated days (an outage included).
#[test]
fn six_days_of_a_small_stream_stay_exact() {
    let seed = std::env::var("SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let report = run(&Params { seed, partitions: 4, days: 6, ..Params::default() });
    println!("{report}");
    report.assert_sound();
}

/// The scale run: `SIM_BUDGET_SECONDS` of seeds (at most `SIM_RUNS`), each a simulated
/// stretch of a large stream (`SIM_PARTITIONS`, `SIM_DAYS`, cut short when the budget runs
/// out); ignored unless asked for (scripts/simulate-scale).
#[test]
#[ignore]
fn scale() {
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
    let budget = std::time::Duration::from_secs(env("SIM_BUDGET_SECONDS", 600));
    let started = std::time::Instant::now();
    let mut seed = env("SIM_SEED", 1);
    let mut runs = 0;
    let max_runs = env("SIM_RUNS", u64::MAX);
    while runs == 0 || (started.elapsed() < budget && runs < max_runs) {
        let params = Params {
            seed,
            partitions: env("SIM_PARTITIONS", 200) as usize,
            days: env("SIM_DAYS", 365),
            progress: true,
            // The first run gets the whole budget (it stops early, drains and checks).
            wall_budget: Some(budget.saturating_sub(started.elapsed()).max(std::time::Duration::from_secs(1))),
            ..Params::default()
        };
        let report = run(&params);
        println!("{report}");
        report.assert_sound();
        runs += 1;
        seed += 1;
    }
    println!("simulate-scale: {runs} run(s), all sound, in {:.0} s", started.elapsed().as_secs_f64());
}
