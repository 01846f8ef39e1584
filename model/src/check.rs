//! Running a model: the exhaustive check and the shortest counterexample, shared by the
//! smaller models ([`crate::hold`], [`crate::packed`], [`crate::spill`]).

use std::fmt::Debug;
use std::hash::Hash;

use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// What an exhaustive run found.
#[derive(Debug)]
pub struct Summary {
    pub unique_states: usize,
    pub seconds: f64,
    /// `always` properties violated, and `sometimes` properties never met.
    pub failures: Vec<&'static str>,
}

/// Runs the BFS checker over every reachable state.
pub fn check_all<M>(model: M) -> Summary
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let properties = model.properties();
    let start = std::time::Instant::now();
    let checker = model.checker().spawn_bfs().join();
    let seconds = start.elapsed().as_secs_f64();
    let found: Vec<&'static str> = checker.discoveries().into_keys().collect();
    let failures = properties
        .iter()
        .filter(|p| match p.expectation {
            Expectation::Sometimes => !found.contains(&p.name),
            _ => found.contains(&p.name),
        })
        .map(|p| p.name)
        .collect();
    Summary { unique_states: checker.unique_state_count(), seconds, failures }
}

/// A shortest counterexample to `property`, as (action, state after it) steps.
pub fn find_counterexample<M>(model: M, property: &'static str) -> Option<Vec<(M::Action, M::State)>>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let path =
        model.checker().finish_when(HasDiscoveries::AnyOf([property].into_iter().collect())).spawn_bfs().join().discovery(property)?;
    let steps = path.into_vec();
    Some(steps.windows(2).map(|w| (w[0].1.clone().expect("an action between states"), w[1].0.clone())).collect())
}

/// Finds a counterexample to `property` or panics, printing it step by step (seen with
/// `--nocapture`): the seeded-bug tests. Returns its length.
pub fn expect_found<M>(label: &str, model: M, property: &'static str, describe: fn(&M::State) -> String) -> usize
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let start = std::time::Instant::now();
    let trace = find_counterexample(model, property).unwrap_or_else(|| panic!("[{label}] no counterexample"));
    println!("[{label}] '{property}' violated after {} steps (shortest; found in {:.1} s):", trace.len(), start.elapsed().as_secs_f64());
    for (i, (action, state)) in trace.iter().enumerate() {
        println!("[{label}]   {:>2}. {action:?}\n[{label}]         {}", i + 1, describe(state));
    }
    trace.len()
}
