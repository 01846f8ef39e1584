//! Rebuilding rules whose definition is new or changed, and zeroing what old definitions left
//! behind (DESIGN.md, "Changing a running deployment"), inside `run`. The work is read from
//! the committed definitions ([`crate::state::definitions::Committed`]): its `rebuild` set and
//! its `retire` list. Each entry is removed (a revision-conditioned store) once it is done, so
//! a rebuild cut short by a crash or a failed round runs again, on any replica.
//! `ddb_aggregator_rule_rebuild_pending{rule}` is 1 while a rule is in the set, and
//! `ddb_aggregator_definitions_retire_pending` counts the old definitions still to be zeroed.
//! Zeroed leftovers stay (at zero) for `reconcile.remove_leftovers_after`, past the stream's
//! retention, and are then removed ([`super::protocol::remove_leftovers`]): a deleted item
//! loses its ledger, and a replay of a record it held would count the record again.
//! `ddb_aggregator_definitions_removal_pending` counts the old definitions waiting for that.
//!
//! Why this is exact: the definitions were committed only once no live replica applied the
//! old ones and no lease was held, so every record applied since is applied under the new
//! definitions. Reconcile corrects a target only when its write counter did not move between
//! its snapshot and its correction, after every record created before the truth read was
//! applied. What an old definition wrote and no current rule writes has a truth of zero; it is
//! zeroed with a write conditioned on the values read ([`super::protocol::retire_rule`]).
//!
//! Rebuilds that finish: the first pass scans the whole table; targets it left (written all
//! through it, or refused) are retried alone, pass after pass, and once their retries are
//! spent ([`next_pass`]) each one left is reported, counted in
//! `ddb_aggregator_rule_rebuild_skipped_targets_total{rule}` and handed to the scheduled
//! reconcile, and the rule is done. A target holding a user's value that is not a number
//! where a measure goes is skipped at once: no retry corrects it.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;

use tracing::{error, info, warn};

use super::protocol::{Removed, Retirement};
use super::{refusal, Options, ReconcileError, Reconciler, Report, Stored};
use crate::config::Config;
use crate::rules::fingerprint::{self, Rebuild};
use crate::rules::{Rule, TargetKey};
use crate::state::definitions::{self, Committed, Retired, Running};
use crate::state::{LeaseStore, StateError};
use crate::telemetry::names;

/// How long the targets a rule's first (full) pass left are retried alone, in passes 5 s
/// apart, before each one still left is reported and skipped: at least [`MIN_TARGET_TRIES`]
/// passes and [`RETRY_FOR_MS`], at most [`MAX_TARGET_TRIES`] passes. A pass over a few targets
/// takes seconds where record dates are to the second (the truth read, then the wait for the
/// consumer), so a target written every half minute is caught quiet within a few of them, and
/// one written every second is skipped after two minutes. DynamoDB Local dates records to the
/// minute, so there each pass waits up to a minute and the retries end after 3 or 4 passes.
pub const MIN_TARGET_TRIES: u32 = 3;
pub const RETRY_FOR_MS: u64 = 120_000;
pub const MAX_TARGET_TRIES: u32 = 30;

/// What this replica carries between rebuild steps.
#[derive(Debug, Default)]
pub struct Progress {
    /// The generation the passes below belong to: another one starts afresh.
    generation: u64,
    /// Per rule: the targets its last pass left, the passes so far, and when the first pass
    /// ended (epoch ms).
    left: BTreeMap<String, (BTreeSet<TargetKey>, u32, u64)>,
}

/// One step's end.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stepped {
    /// Nothing is left to rebuild or retire.
    pub settled: bool,
    /// Targets skipped (rule, key): the scheduled reconcile keeps trying them.
    pub skipped: Vec<(String, TargetKey)>,
    /// A pass left targets to retry alone: the next step is due soon, not after a backoff.
    pub retrying: bool,
    /// Leftovers due for removal were not all removed (an item changed, a call failed).
    pub removal_left: bool,
}

/// What a rebuild runs its passes and retirements with: the reconciler on DynamoDB inside
/// `run`, the same protocol over the simulation's fakes.
pub trait Passes: Sync {
    fn config(&self) -> &Config;
    /// One round of reconcile over `rule`'s targets: every one (None) or those given.
    fn pass(
        &self,
        rule: &Rule,
        targets: Option<BTreeSet<TargetKey>>,
        opts: &Options,
    ) -> impl Future<Output = Result<Report, ReconcileError>> + Send;
    /// Zeroes what `old` wrote and no rule of `current` writes ([`super::protocol::retire_rule`]).
    fn retire(&self, old: &Rule, current: &[Rule]) -> impl Future<Output = Result<Retirement, ReconcileError>> + Send;
    /// Removes what `old` left and [`Passes::retire`] zeroed ([`super::protocol::remove_leftovers`]).
    fn remove(&self, old: &Rule, current: &[Rule]) -> impl Future<Output = Result<Removed, ReconcileError>> + Send;
}

impl Passes for Reconciler {
    fn config(&self) -> &Config {
        Reconciler::config(self)
    }

    async fn pass(&self, rule: &Rule, targets: Option<BTreeSet<TargetKey>>, opts: &Options) -> Result<Report, ReconcileError> {
        match targets {
            Some(targets) => self.run_targets(&rule.name, targets, opts).await,
            None => self.run(&Options { all: true, rule: Some(rule.name.to_string()), ..opts.clone() }).await,
        }
    }

    async fn retire(&self, old: &Rule, current: &[Rule]) -> Result<Retirement, ReconcileError> {
        super::protocol::retire_rule(self, old, current).await
    }

    async fn remove(&self, old: &Rule, current: &[Rule]) -> Result<Removed, ReconcileError> {
        super::protocol::remove_leftovers(self, old, current).await
    }
}

/// Shows the committed work in the gauges (every rule of `rules`, and the retire list).
pub fn show(committed: &Committed, rules: &[Rule]) {
    for r in rules {
        let pending = committed.rebuild.contains(&*r.name);
        metrics::gauge!(names::RULE_REBUILD_PENDING, "rule" => r.name.to_string()).set(if pending { 1.0 } else { 0.0 });
    }
    metrics::gauge!(names::DEFINITIONS_RETIRE_PENDING).set(committed.to_zero() as f64);
    metrics::gauge!(names::DEFINITIONS_REMOVAL_PENDING).set(committed.to_remove() as f64);
}

/// Rebuilds the committed rebuild set and retires the retire list, one entry at a time,
/// removing each when done. Stops at the first entry that is not done yet.
pub async fn step<P: Passes, L: LeaseStore>(
    reconciler: &P,
    leases: &L,
    progress: &mut Progress,
    wait: std::time::Duration,
) -> Result<Stepped, StateError> {
    let config = reconciler.config();
    let rules = &config.engine.rules;
    let Some((committed, _)) = leases.definitions().await? else { return Ok(Stepped::default()) };
    show(&committed, rules);
    if progress.generation != committed.generation {
        *progress = Progress { generation: committed.generation, ..Progress::default() };
    }
    let mut out = Stepped { settled: committed.settled(), ..Stepped::default() };
    for name in &committed.rebuild {
        if !same_generation(leases, committed.generation).await? {
            return Ok(out);
        }
        let Some(rule) = rules.iter().find(|r| *r.name == **name) else { continue };
        let done = match refusal(rule) {
            Some(why_not) => {
                error!(rule = %name, "{why_not}; its targets are not rebuilt after the change, and keep what the old definition wrote");
                true
            }
            None => rebuild_one(reconciler, rule, progress, wait, &mut out.skipped).await,
        };
        out.retrying = progress.left.contains_key(&**name);
        if !done
            || !settle(leases, committed.generation, |c| {
                c.rebuild.remove(name);
            })
            .await?
        {
            return Ok(out);
        }
        let one: BTreeMap<String, String> = [(name.clone(), rule.fingerprint.clone())].into();
        // The fingerprints an earlier release reads: a rollback to it sees this rule as is.
        if let Err(e) = leases.record_fingerprints(&one).await {
            warn!(rule = %name, error = %e, "rebuilt, but cannot record the fingerprint for earlier releases");
        }
        metrics::gauge!(names::RULE_REBUILD_PENDING, "rule" => name.clone()).set(0.0);
    }
    if !clean_up(reconciler, leases, &committed, &mut out).await? {
        return Ok(out);
    }
    if let Some((c, _)) = leases.definitions().await? {
        show(&c, rules);
        out.settled = c.settled();
    }
    Ok(out)
}

/// The retire list, entry by entry: an old definition's leftovers are zeroed, then removed once
/// `reconcile.remove_leftovers_after` has passed since. False when an entry is not done (the
/// next step goes on from it).
async fn clean_up<P: Passes, L: LeaseStore>(
    reconciler: &P,
    leases: &L,
    committed: &Committed,
    out: &mut Stepped,
) -> Result<bool, StateError> {
    let config = reconciler.config();
    let after_ms = u64::try_from(config.remove_leftovers_after.as_millis()).unwrap_or(u64::MAX);
    for old in &committed.retire {
        if !same_generation(leases, committed.generation).await? {
            return Ok(false);
        }
        match old.zeroed_ms {
            None => {
                if !retire_one(reconciler, config, old).await {
                    return Ok(false);
                }
                let now = crate::state::now_ms();
                let zeroed = |c: &mut Committed| c.retire.iter_mut().filter(|r| r.same(old)).for_each(|r| r.zeroed_ms = Some(now));
                if !settle(leases, committed.generation, zeroed).await? {
                    return Ok(false);
                }
            }
            Some(at) if crate::state::now_ms() >= at.saturating_add(after_ms) => {
                // A removal not done does not hold back the entries after it.
                if !remove_one(reconciler, config, old).await {
                    out.removal_left = true;
                    continue;
                }
                if !settle(leases, committed.generation, |c| c.retire.retain(|r| !r.same(old))).await? {
                    return Ok(false);
                }
            }
            // Zeroed, and not due for removal yet.
            Some(_) => {}
        }
    }
    Ok(true)
}

/// Whether the committed definitions are still of `generation` (checked before each entry:
/// a rebuild or retirement of a generation that moved on would work from stale definitions).
async fn same_generation<L: LeaseStore>(leases: &L, generation: u64) -> Result<bool, StateError> {
    Ok(leases.definitions().await?.is_some_and(|(c, _)| c.generation == generation))
}

/// Applies `change` to the committed definitions of `generation`, conditioned on their
/// revision (another replica may store meanwhile); false when the generation moved on.
async fn settle<L: LeaseStore>(leases: &L, generation: u64, change: impl Fn(&mut Committed)) -> Result<bool, StateError> {
    for _ in 0..8 {
        let Some((mut c, revision)) = leases.definitions().await? else { return Ok(false) };
        if c.generation != generation {
            return Ok(false);
        }
        change(&mut c);
        if leases.store_definitions(&c, Some(revision)).await? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// One pass of a rule's rebuild: true when it is done (every target compared and corrected,
/// or the ones left skipped after their retries: [`next_pass`]).
async fn rebuild_one<P: Passes>(
    reconciler: &P,
    rule: &Rule,
    progress: &mut Progress,
    wait: std::time::Duration,
    skipped: &mut Vec<(String, TargetKey)>,
) -> bool {
    let name = rule.name.to_string();
    // One round per pass: a target that changed is corrected under a hold, or retried by the
    // next pass, alone. Holds are safe here: rebuilds run only on a replica of the committed
    // definitions and protocol, which every writing replica then runs too.
    let opts = Options { wait, attempts: 1, holds: true, ..Options::default() };
    let (run, tries, since) = match progress.left.get(&name) {
        Some((targets, tries, since)) => (reconciler.pass(rule, Some(targets.clone()), &opts).await, *tries, Some(*since)),
        None => {
            info!(rule = %name, "rule added or changed: rebuilding its targets from the items");
            (reconciler.pass(rule, None, &opts).await, 0, None)
        }
    };
    let since = since.unwrap_or_else(crate::state::now_ms);
    let tries = tries.saturating_add(1);
    let report = match run {
        Ok(r) => r,
        // A failed full pass runs again. A failed targeted pass counts as a pass (a target
        // that cannot even be read must not hold the rebuild for ever): its targets are left.
        Err(e) => match progress.left.get(&name) {
            None => {
                warn!(rule = %name, error = %e, "rebuild pass failed; it runs again");
                return false;
            }
            Some((targets, _, _)) => {
                warn!(rule = %name, error = %e, passes = tries, "rebuild pass over the targets left failed");
                let not_quiet = targets.iter().map(|k| (name.clone(), k.clone())).collect();
                Report { not_quiet, ..Report::default() }
            }
        },
    };
    progress.left.remove(&name);
    let (left, unfixable) = left_by(&report);
    let pass = next_pass(left.len(), tries, crate::state::now_ms().saturating_sub(since));
    let skip: Vec<&TargetKey> = unfixable.iter().chain(left.iter().filter(|_| pass == Pass::Skip)).collect();
    for key in &skip {
        error!(rule = %name, target = ?key, passes = tries, "target could not be corrected by the rebuild; skipped (the log above says why; the scheduled reconcile keeps trying it)");
        skipped.push((name.clone(), (*key).clone()));
    }
    metrics::counter!(names::RULE_REBUILD_SKIPPED, "rule" => name.clone()).increment(skip.len() as u64);
    match pass {
        Pass::Done | Pass::Skip => {
            info!(
                rule = %name,
                items = report.items_read,
                targets = report.targets_checked,
                drifts = report.drifts.len(),
                seconds = report.elapsed.as_secs_f64(),
                passes = tries,
                skipped = skip.len(),
                "rule rebuilt"
            );
            true
        }
        Pass::Retry => {
            warn!(rule = %name, left = left.len(), passes = tries, "rebuild pass left targets that kept changing; they are retried alone");
            progress.left.insert(name, (left, tries, since));
            false
        }
    }
}

/// What follows a rebuild pass that left `left` targets, after `tries` passes, the first of
/// them `retried_ms` ago (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Done,
    Retry,
    Skip,
}

pub fn next_pass(left: usize, tries: u32, retried_ms: u64) -> Pass {
    match left {
        0 => Pass::Done,
        _ if tries < MIN_TARGET_TRIES => Pass::Retry,
        _ if retried_ms < RETRY_FOR_MS && tries < MAX_TARGET_TRIES => Pass::Retry,
        _ => Pass::Skip,
    }
}

/// The targets a pass did not correct (pure): (to retry: written all through it, refused by
/// the table, or drifted and not written; never to be corrected by a retry: holding a value
/// that is not a number where a measure goes, a user's, which reconcile never overwrites).
pub fn left_by(r: &Report) -> (BTreeSet<TargetKey>, BTreeSet<TargetKey>) {
    let unfixable: BTreeSet<TargetKey> =
        r.drifts.iter().filter(|d| matches!(d.stored, Stored::Other(_))).map(|d| d.target.clone()).collect();
    let drifted = r.drifts.iter().filter(|d| !d.corrected && !matches!(d.stored, Stored::Other(_))).map(|d| &d.target);
    let refused = r.failed.iter().map(|(_, k, _)| k);
    let retry = r.not_quiet.iter().map(|(_, k)| k).chain(refused).chain(drifted).filter(|k| !unfixable.contains(*k)).cloned().collect();
    (retry, unfixable)
}

/// An old definition read back (None, reported: it cannot be, and nothing can be zeroed or
/// removed from it).
fn old_rule(config: &Config, old: &Retired) -> Option<Rule> {
    match crate::config::rule_from_definition(&old.name, &old.definition, &config.engine.key_names) {
        Ok(r) => Some(r),
        Err(e) => {
            error!(rule = %old.name, error = %e, "cannot read an old definition back; what it wrote is left as it is");
            None
        }
    }
}

/// Removes what `old` left and its retirement zeroed, once past the replay window: true when
/// done.
async fn remove_one<P: Passes>(reconciler: &P, config: &Config, old: &Retired) -> bool {
    let Some(rule) = old_rule(config, old) else { return true };
    match reconciler.remove(&rule, &config.engine.rules).await {
        Ok(r) => {
            metrics::counter!(names::DEFINITIONS_REMOVED, "kind" => "item").increment(r.items);
            metrics::counter!(names::DEFINITIONS_REMOVED, "kind" => "attribute").increment(r.attributes);
            if r.changed.is_empty() {
                info!(
                    rule = %old.name,
                    items = r.items,
                    attributes = r.attributes,
                    refused = r.failed.len(),
                    "old definition's zeroed leftovers removed (any the table refused stay at zero; the log above names them)"
                );
                return true;
            }
            warn!(rule = %old.name, changed = r.changed.len(), "items changed while an old definition's leftovers were removed; trying again");
            false
        }
        Err(e) => {
            warn!(rule = %old.name, error = %e, "removing an old definition's leftovers failed; trying again");
            false
        }
    }
}

/// Zeroes what `old` wrote and no current rule writes: true when done (or when the old
/// definition cannot be read back, which is reported: nothing can be zeroed from it).
async fn retire_one<P: Passes>(reconciler: &P, config: &Config, old: &Retired) -> bool {
    let Some(rule) = old_rule(config, old) else { return true };
    match reconciler.retire(&rule, &config.engine.rules).await {
        Ok(r) if r.changed.is_empty() => {
            info!(rule = %old.name, items = r.items, zeroed = r.zeroed, "old definition retired: what it wrote and no current rule writes is zeroed");
            true
        }
        Ok(r) => {
            warn!(rule = %old.name, changed = r.changed.len(), zeroed = r.zeroed, "items changed while an old definition was retired; trying again");
            false
        }
        Err(e) => {
            warn!(rule = %old.name, error = %e, "retiring an old definition failed; trying again");
            false
        }
    }
}

/// What a deploy of `config` would do, from the state table (`validate --against-state`).
#[derive(Debug, Default)]
pub struct Plan {
    /// Nothing recorded yet: a first start records every rule and rebuilds none.
    pub first_start: bool,
    /// Per rule: None when unchanged.
    pub rules: Vec<(String, Option<Rebuild>)>,
    /// Old definitions whose leftovers would be zeroed (still to be, or new with this deploy).
    pub retire: Vec<Retired>,
    /// Why a deploy of these rules would never be committed, if it would not (a change of
    /// `write_shards` on a live target).
    pub never_committed: Option<definitions::WaitReason>,
    /// The copy rules differ from the committed ones: the deploy waits for the old replicas
    /// like a rule change, and rebuilds no copies.
    pub copies_changed: bool,
}

/// What a replica of `config` runs, as the definitions gate compares it with the committed.
pub fn running(config: &Config) -> Running {
    Running::new(config.engine.rules.iter().map(|r| (r.name.to_string(), r.definition.to_string())))
        .with_expiry(config.helper_expiry_attribute.clone())
        .with_copies(crate::rules::copy::definitions(&config.engine.copies))
}

/// What a deploy of `config` would rebuild and retire.
pub async fn against_state(sdk: &aws_config::SdkConfig, config: &Config) -> Result<Plan, StateError> {
    let client = aws_sdk_dynamodb::Client::new(sdk);
    let leases = crate::state::dynamodb::DynamoDbLeases::new(client, config.state.table.clone(), String::new());
    let rules = &config.engine.rules;
    let Some((committed, _)) = leases.definitions().await? else {
        // An earlier release recorded fingerprints only.
        let Some(recorded) = leases.rule_fingerprints().await? else { return Ok(Plan { first_start: true, ..Plan::default() }) };
        let due = fingerprint::due(rules.iter().map(|r| (&*r.name, r.fingerprint.as_str())), Some(&recorded));
        let rules = rules.iter().map(|r| (r.name.to_string(), due.iter().find(|(n, _)| **n == *r.name).map(|(_, w)| w.clone()))).collect();
        return Ok(Plan { rules, ..Plan::default() });
    };
    Ok(plan(&committed, rules, &running(config)))
}

/// The plan against committed definitions (pure): what committing `rules` would rebuild and
/// retire, on top of what is still pending.
pub fn plan(committed: &Committed, rules: &[Rule], running: &Running) -> Plan {
    let next = if running.runs(committed) { committed.clone() } else { definitions::next(committed, running) };
    let rules = rules
        .iter()
        .map(|r| {
            let why = next.rebuild.contains(&*r.name).then(|| match committed.rules.get(&*r.name) {
                Some(d) if d.definition != *r.definition => Rebuild::Changed { was: fingerprint::of_definition(&d.definition) },
                Some(_) => Rebuild::Changed { was: r.fingerprint.clone() },
                None => Rebuild::New,
            });
            (r.name.to_string(), why)
        })
        .collect();
    let never_committed = definitions::sharding_changed(committed, running).then_some(definitions::WaitReason::ShardingChanged);
    Plan { first_start: false, rules, retire: next.retire, never_committed, copies_changed: running.copies != committed.copies }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(yaml_change: impl Fn(String) -> String) -> Vec<Rule> {
        let text = yaml_change(include_str!("../../config/commerce.yaml").to_string());
        crate::config::Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn runs(rules: &[Rule]) -> Running {
        Running::new(rules.iter().map(|r| (r.name.to_string(), r.definition.to_string())))
    }

    fn committed(rules: &[Rule]) -> Committed {
        let running = Running::new(rules.iter().map(|r| (r.name.to_string(), r.definition.to_string())));
        let seen = definitions::Seen { committed: None, legacy: None, beats: &[], live_leases: 0, now_ms: 1 };
        match definitions::decide("a", &running, seen) {
            definitions::Gate::Commit(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pass_that_left_targets_retries_them_then_skips_them() {
        assert_eq!(next_pass(0, 1, 0), Pass::Done);
        assert_eq!(next_pass(3, 1, 0), Pass::Retry);
        // Minute-long passes (DynamoDB Local): the passes bound it.
        assert_eq!(next_pass(1, MIN_TARGET_TRIES - 1, 10 * RETRY_FOR_MS), Pass::Retry);
        assert_eq!(next_pass(1, MIN_TARGET_TRIES, RETRY_FOR_MS), Pass::Skip, "never a full scan again: the rule is done");
        // Passes of seconds: the time does.
        assert_eq!(next_pass(1, 10, RETRY_FOR_MS - 1), Pass::Retry);
        assert_eq!(next_pass(1, 10, RETRY_FOR_MS), Pass::Skip);
        assert_eq!(next_pass(1, MAX_TARGET_TRIES, 0), Pass::Skip, "bounded even on a clock that stands still");
        assert_eq!(next_pass(0, MAX_TARGET_TRIES + 3, 0), Pass::Done);
    }

    #[test]
    fn the_plan_names_the_changed_rule_and_the_old_definition_it_retires() {
        let old = rules(|t| t);
        let c = committed(&old);
        let same = plan(&c, &old, &runs(&old));
        assert!(same.rules.iter().all(|(_, why)| why.is_none()), "{same:?}");
        assert!(same.retire.is_empty());
        let new = rules(|t| t.replace("SALES#{date|day}", "MONTHLY#{date|month}"));
        let p = plan(&c, &new, &runs(&new));
        let changed: Vec<&str> = p.rules.iter().filter(|(_, w)| w.is_some()).map(|(n, _)| n.as_str()).collect();
        assert_eq!(changed, ["daily-sales"]);
        let was = old.iter().find(|r| &*r.name == "daily-sales").unwrap();
        assert_eq!(p.rules.iter().find(|(n, _)| n == "daily-sales").unwrap().1, Some(Rebuild::Changed { was: was.fingerprint.clone() }));
        assert_eq!(p.retire, vec![Retired::new("daily-sales", &was.definition)]);
        assert_eq!(p.never_committed, None);
        let sharded = rules(|t| t.replace(r#"SK: "TOTAL" }"#, r#"SK: "TOTAL", write_shards: 8 }"#));
        assert_eq!(
            plan(&c, &sharded, &runs(&sharded)).never_committed,
            Some(definitions::WaitReason::ShardingChanged),
            "validate --against-state says it"
        );
    }
}
