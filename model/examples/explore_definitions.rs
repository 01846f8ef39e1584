//! Runs the exhaustive check of the definition change (src/definitions.rs) with bounds from the
//! command line, beyond what the tests run:
//!
//! ```text
//! cargo run --release --manifest-path model/Cargo.toml --example explore_definitions -- \
//!     [--replicas OON] [--shapes 20,11,21] [--crashes N] [--lapses N] [--expiries N] \
//!     [--deadline] [--no-fence] [--no-generation-leases] [--drain] [--static] [--no-a] [--no-b]
//! ```
//! `--replicas OON`: the replicas' starting definitions (O = OLD, N = NEW), at most 3.
//! `--no-a`, `--no-b`: the commit does not check (a), or (b) (seeded bugs).

use protocol_model::definitions::{check_all, Def, RolloutModel, MAX_RECORDS, MAX_REPLICAS};

fn main() {
    let mut model = RolloutModel::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--replicas" => {
                model.configs = value()
                    .chars()
                    .map(|c| match c {
                        'O' => Def::Old,
                        'N' => Def::New,
                        _ => panic!("--replicas: O or N per replica"),
                    })
                    .collect();
                assert!(model.configs.len() <= MAX_REPLICAS, "at most {MAX_REPLICAS} replicas");
            }
            "--shapes" => {
                model.shapes = value()
                    .split(',')
                    .map(|s| {
                        let d: Vec<u8> = s.bytes().map(|b| b - b'0').collect();
                        assert!(
                            d.len() == 2 && (1..=MAX_RECORDS as u8).contains(&d[0]) && d[1] <= MAX_RECORDS as u8,
                            "a shape is P's and C's records: {s}"
                        );
                        [d[0], d[1]]
                    })
                    .collect();
            }
            "--crashes" => model.crashes = value().parse().expect("--crashes N"),
            "--lapses" => model.lapses = value().parse().expect("--lapses N"),
            "--expiries" => model.expiries = value().parse().expect("--expiries N"),
            "--deadline" => model.deadline = true,
            "--no-fence" => model.fence = false,
            "--no-generation-leases" => model.generation_leases = false,
            "--drain" => model.drain = true,
            "--static" => model.dynamic_production = false,
            "--no-a" => model.bugs.no_live_check = true,
            "--no-b" => model.bugs.no_lease_check = true,
            other => panic!("unknown flag {other}"),
        }
    }
    println!("checking {model:?}");
    let s = check_all(model, 2);
    println!("{} unique states ({} generated, depth {}) in {:.1} s", s.unique_states, s.total_states, s.max_depth, s.seconds);
    for (name, trace) in &s.discoveries {
        println!("  {name}: {} steps", trace.len());
    }
    if s.failures.is_empty() {
        println!("no property violated");
    } else {
        println!("FAILED: {:?}", s.failures);
        for (name, trace) in s.discoveries.iter().filter(|(n, _)| s.failures.contains(n)) {
            println!("{name}:");
            for (i, a) in trace.iter().enumerate() {
                println!("  {:>2}. {a}", i + 1);
            }
        }
        std::process::exit(1);
    }
}
