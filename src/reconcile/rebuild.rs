//! Rebuilding rules whose definition is new or changed (DESIGN.md, "Measures beyond count and
//! sum"), inside `run`: the reconcile procedure over the whole table for that rule, while the
//! stream keeps being applied under the new definition, then the fingerprint is recorded.
//! `ddb_aggregator_rule_rebuild_pending{rule}` is 1 until then.
//!
//! Why this is exact: reconcile corrects a target only when its write counter did not move
//! between its snapshot and its correction, after every record created before the truth read
//! was applied; records applied meanwhile send the target to the next round. Targets of the old
//! definition that the new one no longer writes (`{date|day}` became `{date|month}`) hold no
//! truth, so the rebuild zeroes them: a target template matches every expansion of the same
//! shape, the old daily keys included. A rebuild cut short (a crash, a failed round) leaves the
//! old fingerprint, so the next start rebuilds again.

use std::collections::BTreeMap;

use tracing::{error, info, warn};

use super::{refusal, Options, Reconciler};
use crate::rules::fingerprint::{self, Rebuild};
use crate::rules::Rule;
use crate::state::LeaseStore;
use crate::telemetry::names;

/// The rules still to rebuild; None until the recorded fingerprints were read.
pub type Pending = Option<Vec<(String, Rebuild)>>;

/// Every rule's fingerprint, by name.
fn fingerprints(rules: &[Rule]) -> BTreeMap<String, String> {
    rules.iter().map(|r| (r.name.to_string(), r.fingerprint.clone())).collect()
}

/// Reads what is recorded and says which rules are due (a first start records every rule and
/// rebuilds none), showing the gauge per rule.
pub async fn due<L: LeaseStore>(leases: &L, rules: &[Rule]) -> Result<Vec<(String, Rebuild)>, crate::state::StateError> {
    let recorded = leases.rule_fingerprints().await?;
    if recorded.is_none() {
        leases.record_fingerprints(&fingerprints(rules)).await?;
        info!(rules = rules.len(), "first start: rule fingerprints recorded; a rule added or changed later is rebuilt");
    }
    let due = fingerprint::due(rules.iter().map(|r| (&*r.name, r.fingerprint.as_str())), recorded.as_ref());
    for r in rules {
        let pending = due.iter().any(|(n, _)| **n == *r.name);
        metrics::gauge!(names::RULE_REBUILD_PENDING, "rule" => r.name.to_string()).set(if pending { 1.0 } else { 0.0 });
    }
    Ok(due)
}

/// Rebuilds the due rules one by one; returns those still due (the failed one and after).
pub async fn rebuild_all(
    reconciler: &Reconciler,
    leases: &impl LeaseStore,
    due: Vec<(String, Rebuild)>,
    wait: std::time::Duration,
) -> Vec<(String, Rebuild)> {
    let rules = reconciler.config().engine.rules.clone();
    let mut left = due.clone().into_iter();
    for (name, why) in left.by_ref() {
        let Some(rule) = rules.iter().find(|r| *r.name == *name) else { continue };
        let done = match refusal(rule) {
            Some(why_not) => {
                error!(rule = %name, "{why_not}; its targets are not rebuilt after the change, and keep what the old definition wrote");
                true
            }
            None => rebuild_one(reconciler, rule, &why, wait).await,
        };
        if !done {
            let mut rest = vec![(name, why)];
            rest.extend(left);
            return rest;
        }
        let one: BTreeMap<String, String> = [(name.clone(), rule.fingerprint.clone())].into();
        if let Err(e) = leases.record_fingerprints(&one).await {
            warn!(rule = %name, error = %e, "rebuilt, but cannot record the fingerprint; the rebuild runs again");
            let mut rest = vec![(name, why)];
            rest.extend(left);
            return rest;
        }
        metrics::gauge!(names::RULE_REBUILD_PENDING, "rule" => name.clone()).set(0.0);
    }
    Vec::new()
}

/// One rule's rebuild: true when every target it found was compared and corrected.
async fn rebuild_one(reconciler: &Reconciler, rule: &Rule, why: &Rebuild, wait: std::time::Duration) -> bool {
    let what = match why {
        Rebuild::New => "added".to_string(),
        Rebuild::Changed { was } => format!("changed (was {was}, now {})", rule.fingerprint),
    };
    info!(rule = %rule.name, "rule {what}: rebuilding its targets from the items");
    let opts = Options { all: true, rule: Some(rule.name.to_string()), wait, ..Options::default() };
    match reconciler.run(&opts).await {
        Ok(r) if r.uncorrected() == 0 => {
            let per_second = r.items_read as f64 / r.elapsed.as_secs_f64().max(0.001);
            info!(
                rule = %rule.name,
                items = r.items_read,
                targets = r.targets_checked,
                drifts = r.drifts.len(),
                seconds = r.elapsed.as_secs_f64(),
                items_per_second = per_second.round(),
                "rule rebuilt"
            );
            true
        }
        Ok(r) => {
            warn!(rule = %rule.name, uncorrected = r.uncorrected(), "rebuild left targets uncorrected; it runs again");
            false
        }
        Err(e) => {
            warn!(rule = %rule.name, error = %e, "rebuild failed; it runs again");
            false
        }
    }
}

/// What a deploy of `config` would rebuild, from the fingerprints in its state table
/// (`validate --against-state`): per rule, None when unchanged. None overall: nothing is
/// recorded yet (a first start records every rule and rebuilds none).
pub async fn against_state(
    sdk: &aws_config::SdkConfig,
    config: &crate::config::Config,
) -> Result<Option<Vec<(String, Option<Rebuild>)>>, crate::state::StateError> {
    let client = aws_sdk_dynamodb::Client::new(sdk);
    let leases = crate::state::dynamodb::DynamoDbLeases::new(client, config.state.table.clone(), String::new());
    let Some(recorded) = leases.rule_fingerprints().await? else { return Ok(None) };
    let rules = &config.engine.rules;
    let due = fingerprint::due(rules.iter().map(|r| (&*r.name, r.fingerprint.as_str())), Some(&recorded));
    Ok(Some(rules.iter().map(|r| (r.name.to_string(), due.iter().find(|(n, _)| **n == *r.name).map(|(_, w)| w.clone()))).collect()))
}
