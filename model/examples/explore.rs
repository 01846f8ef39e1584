//! Runs the exhaustive check with bounds from the command line (beyond what the tests run):
//!
//! ```text
//! cargo run --release --manifest-path model/Cargo.toml --example explore -- \
//!     [--crashes N] [--expiries N] [--shapes all|PC1C2,...] [--reconcile]
//! ```
//! e.g. `--crashes 2 --expiries 2 --shapes all`, or `--expiries 3 --shapes 222`.

use protocol_model::{all_shapes, check_all, ProtocolModel};

fn main() {
    let mut model = ProtocolModel { shapes: all_shapes(), symmetry: true, ..ProtocolModel::default() };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--crashes" => model.crashes = value().parse().expect("--crashes N"),
            "--expiries" => model.expiries = value().parse().expect("--expiries N"),
            "--shapes" => {
                let v = value();
                if v != "all" {
                    model.shapes = v
                        .split(',')
                        .map(|s| {
                            let d: Vec<u8> = s.bytes().map(|b| b - b'0').collect();
                            assert!(d.len() == 3 && d.iter().all(|n| (1..=2).contains(n)), "a shape is 3 digits of 1 or 2: {s}");
                            [d[0], d[1], d[2]]
                        })
                        .collect();
                }
            }
            "--reconcile" => {
                model.dynamic_production = true;
                model.corruption = true;
                model.reconcile = true;
            }
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
