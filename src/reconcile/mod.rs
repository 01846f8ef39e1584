//! Reconcile: recompute the truth from the source items and repair drift, without ever
//! introducing drift while the stream keeps writing.
//!
//! - [`protocol`]: the procedure, over narrow traits (target items, source items, consumer);
//! - [`dynamodb`]: those traits on DynamoDB, and a consumer of its own for shards nobody owns;
//! - [`caught_up`]: the evidence that every record before the truth read was applied;
//! - [`truth`]: what the targets should hold, from the items;
//! - [`report`], [`replay`] (`dlq replay`) and [`schedule`] (inside `run`).

pub mod budget;
pub mod caught_up;
pub mod copies;
pub mod dynamodb;
pub mod hold;
pub mod memory;
pub mod protocol;
pub mod rebuild;
pub mod replay;
pub mod report;
pub mod schedule;
pub mod sharded;
pub mod truth;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::config::Config;
use crate::rules::{Rule, TtlDeletes};
pub use dynamodb::Reconciler;
pub use replay::{replay_dead_letters, ReplaySummary};
pub use report::{Drift, Report, Stored};
use truth::target_for;

/// Why reconcile failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    /// Options that do not fit the config: refused before any request (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// A DynamoDB call failed, with what was being done.
    #[error("{0}")]
    Aws(String),
    /// The stream consumer did not apply what the truth saw in time.
    #[error("{0}")]
    NotCaughtUp(String),
    /// The dead-letter queue failed.
    #[error("dead-letter queue: {0}")]
    Queue(String),
    /// An item reconcile cannot read.
    #[error("{0}")]
    Data(String),
}

/// Why reconcile refuses a rule, if it does: its filter reads fields of the stream record that
/// the source items do not hold, or it ignores TTL deletes (it still counts items that are
/// gone), so a truth recomputed from the items would be a different definition.
pub fn refusal(rule: &Rule) -> Option<String> {
    if rule.ttl_deletes == TtlDeletes::Ignore {
        return Some(format!(
            "rule {} cannot be reconciled: it has ttl_deletes: ignore, so it keeps the contributions of items the TTL service deleted, and the items that remain cannot recompute it",
            rule.name
        ));
    }
    (!rule.stream_only.is_empty()).then(|| {
        format!(
            "rule {} cannot be reconciled: its filter reads {}, which the source items do not hold (only stream records do), so a truth recomputed from the items would follow a different definition",
            rule.name,
            rule.stream_only.join(", ")
        )
    })
}

/// What to reconcile and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// Variable values (`--customer c1`): reconcile the targets they determine.
    pub vars: BTreeMap<String, String>,
    /// Every target, from a full scan (also the initial backfill).
    pub all: bool,
    pub rule: Option<String>,
    pub dry_run: bool,
    pub segments: u32,
    /// Items per second across all scan segments; None: unlimited.
    pub read_rate: Option<u32>,
    /// Longest wait for the consumer to catch up.
    pub wait: Duration,
    /// Skip the wait (no consumer will ever read this stream).
    pub no_wait: bool,
    /// Rounds for a target whose ledger keeps changing.
    pub attempts: u32,
    pub progress: bool,
    /// Fence every target compared, drifted or not (a requested repair: the stream may have
    /// changed, and a reader of the old one may still write). Drifted targets are fenced by
    /// their correction either way.
    pub fence_all: bool,
    /// Correct targets still changing after `attempts` rounds under a hold
    /// ([`hold`]); only where every writer honours holds (storage protocol 3 committed).
    pub holds: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            vars: BTreeMap::new(),
            all: false,
            rule: None,
            dry_run: false,
            segments: 4,
            read_rate: None,
            wait: Duration::from_secs(120),
            no_wait: false,
            attempts: 3,
            progress: false,
            fence_all: false,
            holds: false,
        }
    }
}

/// The copy rules a run reconciles: `--rule`'s if it names one (or none if it names another),
/// every one with `--all`, and those whose source the variable flags name.
pub fn copy_rules<'c>(config: &'c Config, opts: &Options) -> Vec<&'c crate::rules::copy::CopyRule> {
    config
        .engine
        .copies
        .iter()
        .filter(|r| opts.rule.as_ref().is_none_or(|name| *r.name == **name))
        .filter(|r| opts.all || copies::source_for(r, &opts.vars).is_some())
        .collect()
}

/// Checks options against the config before any request: known rule, variables that
/// form keys (no `#`, not empty), and at least one target determined.
pub fn check(config: &Config, opts: &Options) -> Result<Vec<Rule>, ReconcileError> {
    let copies = copy_rules(config, opts);
    let known: BTreeSet<String> = config.target_variables();
    for (k, v) in &opts.vars {
        if !known.contains(k) {
            return Err(ReconcileError::BadInput(format!(
                "--{k}: no rule's target uses {{{k}}} (variables: {})",
                known.iter().map(|v| format!("--{v}")).collect::<Vec<_>>().join(" ")
            )));
        }
        if v.is_empty() || v.contains(crate::rules::template::DELIMITER) {
            return Err(ReconcileError::BadInput(format!("--{k} {v:?}: a key part may not be empty or contain '#'")));
        }
    }
    let mut rules: Vec<Rule> = config.engine.rules.clone();
    if let Some(name) = &opts.rule {
        rules.retain(|r| *r.name == **name);
        let copy_rule = config.engine.copies.iter().any(|r| *r.name == **name);
        if copy_rule {
            return match (opts.all, opts.vars.is_empty(), copies.is_empty()) {
                (true, false, _) => Err(ReconcileError::BadInput("--all reconciles every target; leave out the variable flags".into())),
                (false, true, _) => {
                    Err(ReconcileError::BadInput("say what to reconcile: variable flags (e.g. --customer c1) or --all".into()))
                }
                (_, _, true) => Err(ReconcileError::BadInput(format!(
                    "copy rule {name}'s source is not determined by {}: give every variable of its source_key",
                    opts.vars.keys().map(|k| format!("--{k}")).collect::<Vec<_>>().join(" ")
                ))),
                _ => Ok(Vec::new()),
            };
        }
        if rules.is_empty() {
            return Err(ReconcileError::BadInput(format!(
                "--rule {name}: no such rule (rules: {})",
                config.engine.rules.iter().map(|r| r.name.to_string()).collect::<Vec<_>>().join(", ")
            )));
        }
        if let Some(why) = refusal(&rules[0]) {
            return Err(ReconcileError::BadInput(why));
        }
    }
    let refused: Vec<String> = rules.iter().filter_map(refusal).collect();
    rules.retain(|r| refusal(r).is_none());
    if rules.is_empty() && copies.is_empty() {
        return Err(ReconcileError::BadInput(refused.join("; ")));
    }
    if opts.all {
        if !opts.vars.is_empty() {
            return Err(ReconcileError::BadInput("--all reconciles every target; leave out the variable flags".into()));
        }
        return Ok(rules);
    }
    if opts.vars.is_empty() {
        return Err(ReconcileError::BadInput("say what to reconcile: variable flags (e.g. --customer c1) or --all".into()));
    }
    rules.retain(|r| target_for(r, &opts.vars).is_some());
    if rules.is_empty() && copies.is_empty() {
        return Err(ReconcileError::BadInput(format!(
            "no rule's target is determined by {}",
            opts.vars.keys().map(|k| format!("--{k}")).collect::<Vec<_>>().join(" ")
        )));
    }
    Ok(rules)
}
