//! The reconcile procedure over three narrow traits (the target items, the source items, the
//! stream consumer), so it runs the same on DynamoDB, in the simulation and in property tests.
//!
//! Per rule and round: (1) snapshot the targets; (2) read the truth; (3) wait until every
//! record created before the truth read was applied; (4) read each target again: if its write
//! counter moved since (1), a record was applied meanwhile, so the target is tried again in the
//! next round; otherwise the stored values reflect exactly the records the truth saw, and any
//! difference is drift, corrected on condition that the counter is still as read.
//!
//! Why (1) comes before (2): a record created after the truth read cannot have been applied
//! before (1), so an unchanged counter between (1) and (4) proves the target holds no record
//! the truth did not see (no timestamps compared: DynamoDB Local rounds them to the minute).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use futures::StreamExt;

use super::report::{Drift, Report, Stored};
use super::truth::{self, Truth};
use super::{Options, ReconcileError};
use crate::decimal::Decimal;
use crate::rules::helper::{self, Derive, HelperScan};
use crate::rules::{MeasureKind, ReconcileSource, Rule, TargetKey};
use crate::sink::derive::{DeriveTarget, Raised};
use crate::sink::distinct::Touched;
use crate::state::now_ms;
use crate::telemetry::names;

/// Targets read, queried or corrected at once.
pub const CONCURRENCY: usize = 16;

/// A target item as reconcile sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetItem {
    pub exists: bool,
    /// Every attribute that is neither a key nor reserved (`_agg...`).
    pub values: BTreeMap<String, Stored>,
    /// The write counter every ledger write and correction advances; None: never advanced.
    pub version: Option<String>,
    /// The measure attributes this deployment wrote on the item.
    pub written: BTreeSet<String>,
    /// This deployment's ledger floor on the item (`_aggfloor:<namespace>`), if any.
    pub floor: Option<String>,
    /// The item holds reserved attributes of another deployment (another ledger namespace):
    /// it is never deleted ([`removal`]).
    pub shared: bool,
    /// This deployment's reconcile hold on the item (`_agghold:<namespace>`), as stored.
    pub hold: Option<String>,
    /// This deployment's hold log attributes (`_agglog:<namespace>:...`): name -> value.
    pub logs: BTreeMap<String, String>,
}

/// A conditional write that sets attributes to the truth.
#[derive(Debug, Clone, PartialEq)]
pub struct Correction {
    /// The item's write counter as read: the write applies only if it is unchanged.
    pub seen_version: Option<String>,
    pub set: Vec<(String, Decimal)>,
    /// A floor value to raise the item's ledger floor to (its straggler set emptied): every
    /// shard created before it no longer writes (see [`fence_for`]).
    pub fence: Option<String>,
    /// When not empty, the write is conditioned on these attributes still holding these
    /// values (and on the item carrying this deployment's counter) instead of on the counter
    /// as read: zeroing what an old definition wrote on an item the current rules keep
    /// writing, whose counter moves all the time while those attributes do not ([`retire_rule`]).
    pub expect: Vec<(String, Decimal)>,
    /// A held target's correction ([`super::hold`]): also conditioned on this hold, and
    /// removing it and these log attributes.
    pub release: Option<Release>,
}

/// The hold a correction is conditioned on and removes, with its log attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub hold: String,
    pub logs: Vec<String>,
}

/// Placing a hold ([`super::hold`]): set to `value` if the item carries this deployment's
/// counter and holds no hold, or still `seen` (an expired one); `stale` log attributes (of
/// holds that ended without their owner's correction) are removed in the same write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub value: String,
    pub seen: Option<String>,
    pub stale: Vec<String>,
}

/// The aggregates table.
pub trait TargetStore: Sync {
    /// One target item, strongly consistent (absent: `exists` false).
    fn read(&self, key: &TargetKey) -> impl Future<Output = Result<TargetItem, ReconcileError>> + Send;
    /// Every existing item that is one of the rule's targets.
    fn scan(&self, rule: &Rule) -> impl Future<Output = Result<BTreeMap<TargetKey, TargetItem>, ReconcileError>> + Send;
    /// Applies `c` (and advances the counter) if the counter is still `c.seen_version`; false
    /// when it moved.
    fn correct(&self, key: &TargetKey, c: &Correction) -> impl Future<Output = Result<bool, ReconcileError>> + Send;
    /// The helper items of `owner` (of `max`, `min`, `latest`, `distinct` measures), strongly
    /// consistent. No default: a wrapper that forgot it would repair no helper and the
    /// simulation's reconcile once did exactly that.
    fn helpers(
        &self,
        rule: &Rule,
        owner: &TargetKey,
    ) -> impl Future<Output = Result<BTreeMap<TargetKey, TargetItem>, ReconcileError>> + Send;
    /// Derives `target`'s attributes from its helpers ([`crate::sink::derive`]).
    fn derive(&self, key_names: &[String], target: &DeriveTarget) -> impl Future<Output = Result<(), ReconcileError>> + Send;
    /// Removes what [`removal`] says, if its condition still holds; false when the item
    /// changed. No default: a wrapper that forgot it would remove nothing, for ever.
    fn remove(&self, key: &TargetKey, r: &Removal) -> impl Future<Output = Result<bool, ReconcileError>> + Send;
    /// Places a hold as `p` says; false when the item has no counter of this deployment or
    /// holds another hold. No default: a wrapper that forgot it would never hold a target.
    fn hold(&self, key: &TargetKey, p: &Placement) -> impl Future<Output = Result<bool, ReconcileError>> + Send;
    /// Sets a sharded target's total to `values`, with fold sequence `seq`, if the stored
    /// sequence is absent or lower ([`super::sharded`]); false when a newer fold landed. No
    /// default: a wrapper that forgot it would never fold.
    fn fold(
        &self,
        key: &TargetKey,
        values: &[(String, Decimal)],
        seq: Decimal,
    ) -> impl Future<Output = Result<bool, ReconcileError>> + Send;
    /// A retired sharded rule's total: sets `zero` to 0 and removes the fold sequence (a rule
    /// added again later starts its sub-items' counters afresh), if the item holds one.
    fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> impl Future<Output = Result<bool, ReconcileError>> + Send;
}

/// Removing what an old definition left, once zeroed and past the replay window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// Delete the item, if its write counter is still this (nothing was written since the read).
    Item { seen_version: String },
    /// Remove these attributes, if each still holds zero (and the item this deployment's
    /// counter), and drop them from the written-measures set; advances the counter.
    Attributes(Vec<String>),
}

/// The targets among `keys` (and the targets of the helper items among them) whose helper
/// measures are derived again after a round: every literal helper measure of the rule, and
/// each templated one a helper item names.
pub fn derivations(rule: &Rule, keys: &BTreeSet<TargetKey>) -> Vec<DeriveTarget> {
    let literal: BTreeMap<String, Derive> = rule
        .measures
        .iter()
        .filter_map(|m| match &m.kind {
            MeasureKind::Helper(h) if m.name.is_literal() => Some((m.name.text().to_string(), h.derive)),
            _ => None,
        })
        .collect();
    let mut out: BTreeMap<TargetKey, BTreeMap<String, Derive>> = BTreeMap::new();
    if !rule.measures.iter().any(|m| matches!(m.kind, MeasureKind::Helper(_))) {
        return Vec::new();
    }
    for key in keys {
        let owner = truth::owner_of(key);
        let entry = out.entry(owner).or_insert_with(|| literal.clone());
        if let Some(h) = key.0.last().filter(|_| key.0.len() > 1).and_then(|sk| helper::parse(sk)) {
            if let Some(d) = truth::helper_measure(rule, h.measure) {
                entry.insert(h.measure.to_string(), d);
            }
        }
    }
    // A correction may raise any helper from zero: each derivation reads the whole range,
    // and moves the cursor back to its start if another derivation lands first; `distinct`
    // (no `touched` helpers) walks every helper.
    let everything = |measures: &BTreeMap<String, Derive>| {
        measures.iter().filter(|(_, d)| d.scan() != HelperScan::Count).map(|(m, _)| (m.clone(), Raised::Everything)).collect()
    };
    out.into_iter().map(|(key, measures)| DeriveTarget { key, raised: everything(&measures), measures, touched: BTreeMap::new() }).collect()
}

/// The source table.
pub trait SourceItems: Sync {
    /// Adds to `truth` the items of partition `pk` whose sort key begins with `sk_prefix`
    /// (strongly consistent).
    fn query(
        &self,
        rule: &Rule,
        pk: &str,
        sk_prefix: Option<&str>,
        truth: &mut Truth,
    ) -> impl Future<Output = Result<(), ReconcileError>> + Send;
    /// Adds every item of the table (strongly consistent, streamed: memory does not grow with
    /// the table).
    fn scan(&self, rule: &Rule, opts: &Options, truth: &mut Truth) -> impl Future<Output = Result<(), ReconcileError>> + Send;
}

/// What the consumer's evidence showed once it was complete.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// The oldest creation time among the shards that may still write
    /// (`caught_up::fence_ms`; None: unknown).
    pub fence_ms: Option<u64>,
    /// The shards only the empty-page rule showed caught up (`caught_up::by_empty_pages`):
    /// the judgements that rest on an assumption.
    pub by_empty_pages: Vec<String>,
}

/// The stream consumer, as far as reconcile needs it.
pub trait Consumer: Sync {
    /// Returns once every record created before `after_ms` has been applied (or dead-lettered),
    /// with what showed it. Gives up after `wait` without progress.
    fn applied_before(&self, after_ms: u64, wait: Duration) -> impl Future<Output = Result<Applied, ReconcileError>> + Send;
}

/// A partition and an optional sort-key prefix.
pub type Query = (String, Option<String>);

/// The query (partition, sort-key prefix) that reads a target's source items, if the rule has
/// one and the target determines it.
pub fn query_for(rule: &Rule, target: &TargetKey) -> Option<Query> {
    let ReconcileSource::Query { pk, sk_begins_with } = &rule.reconcile else { return None };
    let vars = truth::variables_of(rule, target);
    let lookup = |name: &str| vars.get(name).map(|v| crate::rules::template::VarValue::Str(v.as_str()));
    let pk = pk.expand(lookup).ok()?;
    let sk = match sk_begins_with {
        Some(t) => Some(t.expand(lookup).ok()?),
        None => None,
    };
    Some((pk, sk))
}

/// The drifted attributes of one target: those reconcile manages ([`truth::manages`]) whose
/// stored value differs from the truth (absent counts as zero).
pub fn drifts(rule: &Rule, key: &TargetKey, want: &BTreeMap<String, Decimal>, item: &TargetItem) -> Vec<Drift> {
    let is_helper = is_helper_key(key);
    let managed = |a: &String| if is_helper { a == helper::REFS } else { truth::manages(rule, a, &item.written, want.contains_key(a)) };
    let attrs: BTreeSet<&String> = want.keys().chain(item.values.keys()).filter(|a| managed(a)).collect();
    let mut out = Vec::new();
    for attr in attrs {
        let t = want.get(attr).copied().unwrap_or(Decimal::ZERO);
        let stored = item.values.get(attr).cloned().unwrap_or(Stored::Missing);
        let same = match &stored {
            Stored::Number(n) => *n == t,
            Stored::Missing => t.is_zero(),
            Stored::Other(_) => false,
        };
        if !same {
            out.push(Drift {
                rule: rule.name.to_string(),
                target: key.clone(),
                attribute: attr.clone(),
                stored,
                truth: t,
                corrected: false,
            });
        }
    }
    out
}

/// Attributes set by one correction: its SET clause stays far below DynamoDB's 4 KB expression
/// limit however many attributes a template such as `orders_{status}` forms.
pub const MAX_SET_PER_CORRECTION: usize = 100;

/// The writes that repair `drifts` on `item`: numbers only (a value that is not a number was
/// written by someone else: reported, never overwritten), at most
/// [`MAX_SET_PER_CORRECTION`] attributes each. Each is conditioned on the counter the one
/// before leaves (every correction advances it by one). Empty: nothing to write.
/// The first one also raises the item's floor to `fence`, when given.
pub fn corrections(drifts: &[Drift], item: &TargetItem, fence: Option<&str>) -> Vec<Correction> {
    let set: Vec<(String, Decimal)> =
        drifts.iter().filter(|d| !matches!(d.stored, Stored::Other(_))).map(|d| (d.attribute.clone(), d.truth)).collect();
    let mut seen = item.version.clone();
    let mut out = Vec::new();
    for (i, chunk) in set.chunks(MAX_SET_PER_CORRECTION).enumerate() {
        let fence = fence.filter(|_| i == 0).map(str::to_string);
        out.push(Correction { seen_version: seen.clone(), set: chunk.to_vec(), fence, expect: Vec::new(), release: None });
        let before = seen.as_deref().and_then(|v| Decimal::parse(v).ok()).unwrap_or(Decimal::ZERO);
        seen = before.checked_add(Decimal::from_i64(1)).ok().map(|v| v.to_string());
    }
    out
}

/// The floor value a correction of `item` raises its floor to, if it should: the fence (the
/// oldest creation time among the shards that may still write) when it is above the item's
/// floor. A target corrected to the truth must refuse a record the truth saw that a reader of
/// a stream no longer followed (disabled and enabled again) has not applied yet: that reader
/// may be a paused process that wakes after the correction. Shards of the stream followed are
/// all created at or after the fence, so none is refused.
pub fn fence_for(item: &TargetItem, fence_ms: Option<u64>) -> Option<String> {
    let fence = crate::sink::ledger::floor_value(fence_ms?);
    item.floor.as_ref().is_none_or(|f| *f < fence).then_some(fence)
}

/// What happened to one target in a round.
enum Outcome {
    /// Compared (and corrected where drifted and allowed).
    Done(Vec<Drift>),
    /// A record was applied meanwhile: try again.
    Changed,
}

/// Reconciles `requested` targets of `rule` (None: every target the truth or the table has).
/// A sharded rule's targets are compared as the sums of their sub-items, corrected through
/// one of them, and folded again after ([`super::sharded`]).
pub async fn reconcile_rule<T: TargetStore, S: SourceItems, C: Consumer>(
    targets: &T,
    sources: &S,
    consumer: &C,
    rule: &Rule,
    requested: Option<BTreeSet<TargetKey>>,
    opts: &Options,
    report: &mut Report,
) -> Result<(), ReconcileError> {
    let Some(n) = rule.write_shards else { return reconcile_items(targets, sources, consumer, rule, requested, opts, report).await };
    let sharded = super::sharded::Sharded::new(targets, n);
    let requested = requested.map(|keys| keys.iter().map(crate::rules::shards::unsharded).collect());
    let done = reconcile_items(&sharded, sources, consumer, rule, requested, opts, report).await;
    if !opts.dry_run {
        sharded.fold_read().await;
    }
    done
}

async fn reconcile_items<T: TargetStore, S: SourceItems, C: Consumer>(
    targets: &T,
    sources: &S,
    consumer: &C,
    rule: &Rule,
    requested: Option<BTreeSet<TargetKey>>,
    opts: &Options,
    report: &mut Report,
) -> Result<(), ReconcileError> {
    // A helper item is reconciled with its target (the schedule asks for what was touched).
    let mut pending = requested.map(|keys| keys.iter().map(truth::owner_of).collect::<BTreeSet<_>>());
    for round in 0..opts.attempts.max(1) {
        let before = snapshot(targets, rule, pending.as_ref()).await?;
        if round == 0 {
            count_helpers(&rule.name, &before, report);
        }
        let truth = read_truth(sources, rule, pending.as_ref(), &BTreeSet::new(), opts).await?;
        let truth_done_at = now_ms();
        report.poisons += truth.poisons.len() as u64;
        let applied =
            if !opts.dry_run && !opts.no_wait { consumer.applied_before(truth_done_at, opts.wait).await? } else { Applied::default() };
        report.judged_by_empty_pages(&applied.by_empty_pages);
        let fence_ms = applied.fence_ms;
        let mut keys: BTreeSet<TargetKey> = before.keys().cloned().collect();
        keys.extend(truth.values.keys().cloned());
        if let Some(p) = &pending {
            keys.retain(|k| p.contains(&truth::owner_of(k)));
        }
        let keys_done = keys.clone();
        if !opts.fence_all {
            // A helper at zero that the truth does not hold cannot have drifted: it is not
            // read again. A repair still compares (and fences) it.
            keys.retain(|k| truth.values.contains_key(k) || !before.get(k).is_some_and(|item| is_helper_at_zero(k, item)));
        }
        report.targets_checked += keys.len() as u64;
        let empty = BTreeMap::new();
        let outcomes: Vec<(TargetKey, Result<Outcome, ReconcileError>)> = futures::stream::iter(keys)
            .map(|key| {
                let seen = before.get(&key).cloned().unwrap_or_default();
                let want = truth.values.get(&key).unwrap_or(&empty);
                async move {
                    let outcome = compare_and_correct(targets, rule, &key, &seen, want, fence_ms, opts).await;
                    (key, outcome)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut changed = BTreeSet::new();
        for (key, outcome) in outcomes {
            match outcome {
                Ok(Outcome::Done(d)) => report.drifts.extend(d),
                // A target is tried again with its helper items.
                Ok(Outcome::Changed) => {
                    changed.insert(truth::owner_of(&key));
                }
                // One target that cannot be read or written (an item at DynamoDB's size
                // limit, a stored value of the wrong type) does not hold up the others.
                Err(e) => {
                    tracing::warn!(rule = %rule.name, target = ?key.0, error = %e, "cannot reconcile this target; the others go on");
                    metrics::counter!(names::RECONCILE_FAILED_TARGETS, "rule" => rule.name.to_string()).increment(1);
                    report.failed.push((rule.name.to_string(), key, e.to_string()));
                }
            }
        }
        if !opts.dry_run {
            derive_all(targets, rule, &keys_done, &changed, report).await;
        }
        if changed.is_empty() {
            return Ok(());
        }
        tracing::info!(rule = %rule.name, targets = changed.len(), round, "targets changed while reconciling; trying them again");
        pending = Some(changed);
    }
    let mut left = pending.unwrap_or_default();
    let with_helpers = rule.measures.iter().any(|m| matches!(m.kind, MeasureKind::Helper(_)));
    if opts.holds && !opts.dry_run && !with_helpers && rule.write_shards.is_none() && !left.is_empty() {
        // Targets written all the time: correct them under a hold.
        left = super::hold::hold_round(targets, sources, consumer, rule, left, opts, report).await?;
    }
    for key in left {
        report.not_quiet.push((rule.name.to_string(), key));
    }
    Ok(())
}

/// A sharded rule's total (written by folds only, so it has no counter): the attributes the old
/// definition folded there and no current rule writes are zeroed, and the fold sequence
/// removed unless a current rule still folds into it (a rule added again later starts its
/// sub-items' counters afresh, and its folds must land).
async fn retire_total<T: TargetStore>(
    targets: &T,
    old: &Rule,
    current: &[Rule],
    key: &TargetKey,
    item: &TargetItem,
    out: &mut Retirement,
) -> Result<(), ReconcileError> {
    if old.write_shards.is_none() || crate::rules::shards::parse(key).is_some() || !item.exists {
        return Ok(());
    }
    let zero: Vec<String> = item
        .values
        .iter()
        .filter(|(a, v)| truth::owns_attribute(old, a) && matches!(v, Stored::Number(n) if !n.is_zero()))
        .filter(|(a, _)| !current.iter().any(|c| writes(c, key, a)))
        .map(|(a, _)| a.clone())
        .collect();
    let parts: Vec<&str> = key.0.iter().map(|p| &**p).collect();
    let still_folded = current.iter().any(|c| c.write_shards.is_some() && truth::is_target(c, &parts));
    if zero.is_empty() && still_folded {
        return Ok(());
    }
    out.items += 1;
    if targets.reset_fold(key, &zero).await? {
        out.zeroed += zero.len() as u64;
    }
    Ok(())
}

/// What zeroing an old definition's leftovers did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Retirement {
    /// Items of the old definition's shapes that carry this deployment's counter.
    pub items: u64,
    /// Attributes zeroed (helper items' counts included).
    pub zeroed: u64,
    /// Items that changed between the read and the write every time: tried again later.
    pub changed: Vec<TargetKey>,
}

/// Zeroes what the old definition `old` wrote that no rule of `current` writes (DESIGN.md,
/// "Changing a running deployment"): attributes of renamed or removed measures, targets of an
/// old key shape, helper items of removed helper measures and their derived attributes, and
/// targets of removed rules. Only items that carry this deployment's write counter, and only
/// attributes the old definition managed ([`truth::manages`]), so nothing a user wrote. No
/// current rule writes these attributes and no replica applies the old definition any more
/// (the definitions were committed only once none did), so the truth of each is zero and each
/// write is conditioned on the values read, not on the item's counter, which the current
/// rules keep moving.
pub async fn retire_rule<T: TargetStore>(targets: &T, old: &Rule, current: &[Rule]) -> Result<Retirement, ReconcileError> {
    let items = targets.scan(old).await?;
    let mut out = Retirement::default();
    let mut owners = BTreeSet::new();
    for (key, item) in &items {
        if item.version.is_none() {
            retire_total(targets, old, current, key, item, &mut out).await?;
            continue;
        }
        out.items += 1;
        let zero = leftovers(old, current, key, item);
        if zero.is_empty() {
            continue;
        }
        let expect: Vec<(String, Decimal)> = zero.iter().map(|(a, v)| (a.clone(), *v)).collect();
        let set: Vec<(String, Decimal)> = zero.into_iter().map(|(a, _)| (a, Decimal::ZERO)).collect();
        let c = Correction { seen_version: None, set, fence: None, expect, release: None };
        if targets.correct(key, &c).await? {
            out.zeroed += c.set.len() as u64;
            owners.insert(truth::owner_of(key));
        } else {
            out.changed.push(key.clone());
        }
    }
    // Derived attributes of the old helper measures, from their helpers as zeroed (removed
    // when none is live), where no current rule derives the same attribute.
    let key_names: Vec<String> = old.target.iter().map(|(k, _)| k.clone()).collect();
    for mut d in derivations(old, &owners) {
        d.measures.retain(|m, _| !current.iter().any(|c| writes(c, &d.key, m)));
        if !d.measures.is_empty() {
            targets.derive(&key_names, &d).await?;
        }
    }
    Ok(out)
}

/// What removing an old definition's leftovers did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removed {
    /// Items deleted.
    pub items: u64,
    /// Attributes removed from items that stay.
    pub attributes: u64,
    /// Items that changed between the read and the write: tried again later.
    pub changed: Vec<TargetKey>,
    /// Items the table refused to change (left at zero, reported, never holding the others).
    pub failed: Vec<(TargetKey, String)>,
}

/// Removes what the old definition `old` left and [`retire_rule`] zeroed, once no replay can
/// reach it any more (the caller waits out the replay window: a deleted item loses its
/// ledger, and a late write of a record it holds would then count the record again). Every
/// write is conditioned on what was read ([`removal`]); an item is read again, strongly
/// consistent, just before it is deleted, so what was written on it since the scan keeps it.
pub async fn remove_leftovers<T: TargetStore>(targets: &T, old: &Rule, current: &[Rule]) -> Result<Removed, ReconcileError> {
    let items = targets.scan(old).await?;
    let mut out = Removed::default();
    for (key, scanned) in &items {
        if removal(old, current, key, scanned).is_none() {
            continue;
        }
        match remove_one(targets, old, current, key).await {
            Ok(Gone::Nothing) => {}
            Ok(Gone::Changed) => out.changed.push(key.clone()),
            Ok(Gone::Removed(Removal::Item { .. })) => out.items += 1,
            Ok(Gone::Removed(Removal::Attributes(a))) => out.attributes += a.len() as u64,
            Err(e) => {
                tracing::warn!(rule = %old.name, target = ?key.0, error = %e, "cannot remove this leftover; it stays at zero, the others go on");
                out.failed.push((key.clone(), e.to_string()));
            }
        }
    }
    Ok(out)
}

/// What [`remove_one`] did.
enum Gone {
    Removed(Removal),
    /// The item changed between the read and the write.
    Changed,
    /// Nothing is left to remove.
    Nothing,
}

/// Removes what [`removal`] says of `key` as it is now (read again, strongly consistent).
/// Attributes go at most [`MAX_SET_PER_CORRECTION`] per write (DynamoDB's 4 KB expression
/// limit).
async fn remove_one<T: TargetStore>(targets: &T, old: &Rule, current: &[Rule], key: &TargetKey) -> Result<Gone, ReconcileError> {
    let item = targets.read(key).await?;
    let Some(r) = removal(old, current, key, &item) else { return Ok(Gone::Nothing) };
    let writes = match &r {
        Removal::Item { .. } => vec![r.clone()],
        Removal::Attributes(names) => names.chunks(MAX_SET_PER_CORRECTION).map(|c| Removal::Attributes(c.to_vec())).collect(),
    };
    for w in &writes {
        if !targets.remove(key, w).await? {
            return Ok(Gone::Changed);
        }
    }
    Ok(Gone::Removed(r))
}

/// What is removed from `item`, of `old`'s shapes, once its leftovers are zeroed (pure).
/// Only items that carry this deployment's counter, and only what `old` managed, no current
/// rule writes, and holds zero. The item itself goes when nothing else is on it (no
/// attribute a user wrote, no value that is not zero, no other deployment's ledger) and no
/// current rule targets it; else the zero attributes go.
pub fn removal(old: &Rule, current: &[Rule], key: &TargetKey, item: &TargetItem) -> Option<Removal> {
    let seen_version = item.version.clone()?;
    let parts: Vec<&str> = key.0.iter().map(|p| &**p).collect();
    let targeted = current.iter().any(|c| truth::is_target(c, &parts));
    let is_helper = is_helper_key(key);
    if is_helper && targeted {
        return None;
    }
    let zero = |v: &Stored| matches!(v, Stored::Number(n) if n.is_zero());
    let gone: Vec<String> = old_only(old, current, key, item).filter(|(_, v)| zero(v)).map(|(a, _)| a.clone()).collect();
    // A helper's `distinct` flag goes with it: the owner's count of a removed measure is set
    // again by the walk of a rebuild that brings the measure back.
    let kept = item.values.keys().filter(|a| !(is_helper && *a == crate::sink::distinct::COUNTED)).count();
    if !targeted && !item.shared && gone.len() == kept {
        return Some(Removal::Item { seen_version });
    }
    (!gone.is_empty() && !is_helper).then_some(Removal::Attributes(gone))
}

/// Whether a target key is a helper item's (`<target SK>#_agg#<measure>#<value>`).
fn is_helper_key(key: &TargetKey) -> bool {
    key.0.last().filter(|_| key.0.len() > 1).and_then(|sk| helper::parse(sk)).is_some()
}

/// The attributes of `item` that `old` managed and no current rule writes (a helper item's:
/// its count). The caller has checked that a helper item is not a current rule's.
fn old_only<'i>(
    old: &'i Rule,
    current: &'i [Rule],
    key: &'i TargetKey,
    item: &'i TargetItem,
) -> impl Iterator<Item = (&'i String, &'i Stored)> {
    let is_helper = is_helper_key(key);
    item.values
        .iter()
        .filter(move |(a, _)| if is_helper { *a == helper::REFS } else { truth::manages(old, a, &item.written, false) })
        .filter(move |(a, _)| is_helper || !current.iter().any(|c| writes(c, key, a)))
}

/// Whether `rule` writes attribute `attribute` (a measure or a derived one) on `key`.
fn writes(rule: &Rule, key: &TargetKey, attribute: &str) -> bool {
    let parts: Vec<&str> = key.0.iter().map(|p| &**p).collect();
    truth::is_target(rule, &parts)
        && (truth::owns_attribute(rule, attribute)
            || rule.measures.iter().any(|m| matches!(m.kind, MeasureKind::Helper(_)) && m.name.matches_expansion(attribute)))
}

/// The attributes of `item` that `old` managed, no current rule writes, and that hold a
/// number other than zero (pure).
pub fn leftovers(old: &Rule, current: &[Rule], key: &TargetKey, item: &TargetItem) -> Vec<(String, Decimal)> {
    let parts: Vec<&str> = key.0.iter().map(|p| &**p).collect();
    if is_helper_key(key) && current.iter().any(|c| truth::is_target(c, &parts)) {
        return Vec::new();
    }
    old_only(old, current, key, item)
        .filter_map(|(a, v)| match v {
            Stored::Number(n) if !n.is_zero() => Some((a.clone(), *n)),
            _ => None,
        })
        .collect()
}

/// Whether `item` is a helper item whose count is zero (or was never written).
pub fn is_helper_at_zero(key: &TargetKey, item: &TargetItem) -> bool {
    is_helper_key(key) && !matches!(item.values.get(helper::REFS), Some(Stored::Number(n)) if !n.is_zero())
}

/// Counts the helper items among `items` by state into `report` (pure).
pub fn count_helpers(rule: &str, items: &BTreeMap<TargetKey, TargetItem>, report: &mut Report) {
    let mut count = crate::reconcile::report::HelperCount::default();
    for (_, item) in items.iter().filter(|(k, _)| is_helper_key(k)) {
        match item.values.get(helper::REFS) {
            Some(Stored::Number(n)) if *n > Decimal::ZERO => count.live += 1,
            _ => count.zero += 1,
        }
    }
    if count != Default::default() {
        let e = report.helpers.entry(rule.to_string()).or_default();
        (e.live, e.zero) = (e.live + count.live, e.zero + count.zero);
    }
}

/// (1) The targets as they are before the truth is read.
async fn snapshot<T: TargetStore>(
    targets: &T,
    rule: &Rule,
    pending: Option<&BTreeSet<TargetKey>>,
) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
    let Some(keys) = pending else { return targets.scan(rule).await };
    let with_helpers = rule.measures.iter().any(|m| matches!(m.kind, MeasureKind::Helper(_)));
    let read: Vec<Result<BTreeMap<TargetKey, TargetItem>, ReconcileError>> = futures::stream::iter(keys.iter().cloned())
        .map(|k| async move {
            let mut out = if with_helpers { targets.helpers(rule, &k).await? } else { BTreeMap::new() };
            out.insert(k.clone(), targets.read(&k).await?);
            Ok(out)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    // `extend`, not `append`: append rebuilds the whole map each time (quadratic in targets).
    let mut out = BTreeMap::new();
    for part in read {
        out.extend(part?);
    }
    Ok(out)
}

/// After a round: the derived attributes of every target compared, from their helpers as the
/// round left them. A target that failed is reported, the others go on.
async fn derive_all<T: TargetStore>(
    targets: &T,
    rule: &Rule,
    keys: &BTreeSet<TargetKey>,
    changed: &BTreeSet<TargetKey>,
    report: &mut Report,
) {
    let key_names: Vec<String> = rule.target.iter().map(|(k, _)| k.clone()).collect();
    // Also the targets tried again next round: a derivation is safe at any time, and one a
    // correction of this round needs must not wait for a round that may never come.
    let _ = changed;
    let due: Vec<DeriveTarget> = derivations(rule, keys);
    let key_names = &key_names;
    let mut runs = Vec::with_capacity(due.len());
    for d in &due {
        runs.push(async move { (d.key.clone(), targets.derive(key_names, d).await) });
    }
    let results: Vec<(TargetKey, Result<(), ReconcileError>)> = futures::stream::iter(runs).buffer_unordered(CONCURRENCY).collect().await;
    for (key, r) in results {
        if let Err(e) = r {
            tracing::warn!(rule = %rule.name, target = ?key.0, error = %e, "cannot derive this target's max, min, latest or distinct");
            report.failed.push((rule.name.to_string(), key, e.to_string()));
        }
    }
}

/// (2) The truth: one query per target for query rules, else one scan.
/// `held`: targets whose per-item contributions to keep ([`Truth::by_item`]).
pub(super) async fn read_truth<S: SourceItems>(
    sources: &S,
    rule: &Rule,
    pending: Option<&BTreeSet<TargetKey>>,
    held: &BTreeSet<TargetKey>,
    opts: &Options,
) -> Result<Truth, ReconcileError> {
    let queries: Option<Vec<(TargetKey, Query)>> =
        pending.and_then(|keys| keys.iter().map(|k| query_for(rule, k).map(|q| (k.clone(), q))).collect());
    let Some(queries) = queries else {
        let mut truth = Truth { held: held.clone(), ..Truth::default() };
        sources.scan(rule, opts, &mut truth).await?;
        if let Some(keys) = pending {
            truth.values.retain(|k, _| keys.contains(&truth::owner_of(k)));
        }
        return Ok(truth);
    };
    let parts: Vec<Result<(TargetKey, Truth), ReconcileError>> = futures::stream::iter(queries)
        .map(|(key, (pk, sk))| async move {
            let mut t = Truth { held: held.clone(), ..Truth::default() };
            sources.query(rule, &pk, sk.as_deref(), &mut t).await?;
            Ok((key, t))
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut truth = Truth::default();
    for part in parts {
        let (key, mut t) = part?;
        truth.items += t.items;
        truth.poisons.append(&mut t.poisons);
        // The target's own values and its helper items'.
        t.values.retain(|k, _| truth::owner_of(k) == key);
        truth.values.extend(t.values);
        t.by_item.retain(|k, _| *k == key);
        truth.by_item.extend(t.by_item);
    }
    Ok(truth)
}

/// Before a correction of a `distinct` helper: its owner's walked mark is removed, so every
/// derivation of it walks and flips the helper's flag, even if this run ends before it derives
/// ([`crate::sink::distinct`]).
pub(super) async fn unwalk_owner<T: TargetStore>(targets: &T, rule: &Rule, key: &TargetKey) -> Result<(), ReconcileError> {
    let Some(h) = key.0.last().filter(|_| key.0.len() > 1).and_then(|sk| helper::parse(sk)) else { return Ok(()) };
    if truth::helper_measure(rule, h.measure) != Some(Derive::Distinct) {
        return Ok(());
    }
    let key_names: Vec<String> = rule.target.iter().map(|(k, _)| k.clone()).collect();
    let measure = h.measure.to_string();
    let owner = DeriveTarget {
        key: truth::owner_of(key),
        measures: BTreeMap::from([(measure.clone(), Derive::Distinct)]),
        raised: BTreeMap::new(),
        touched: BTreeMap::from([(measure, Touched::Unwalk)]),
    };
    targets.derive(&key_names, &owner).await
}

/// (4) One target: read again, compare, correct.
async fn compare_and_correct<T: TargetStore>(
    targets: &T,
    rule: &Rule,
    key: &TargetKey,
    before: &TargetItem,
    want: &BTreeMap<String, Decimal>,
    fence_ms: Option<u64>,
    opts: &Options,
) -> Result<Outcome, ReconcileError> {
    let now = targets.read(key).await?;
    if !opts.dry_run && now.version != before.version {
        return Ok(Outcome::Changed);
    }
    let mut found = drifts(rule, key, want, &now);
    let fence = fence_for(&now, fence_ms);
    if !found.is_empty() {
        metrics::counter!(names::RECONCILE_DRIFT, "rule" => rule.name.to_string()).increment(found.len() as u64);
    }
    let writes = corrections(&found, &now, fence.as_deref());
    if writes.is_empty() {
        // A repair (data was lost, or the stream changed) fences every target it compared,
        // so a record of the old stream cannot land on a value the truth already holds. Only
        // items this deployment wrote (its counter is there): the condition on it also keeps
        // the write from recreating an item deleted meanwhile.
        let fence_only = fence.filter(|_| opts.fence_all && now.version.is_some() && !opts.dry_run);
        if let Some(fence) = fence_only {
            let c =
                Correction { seen_version: now.version.clone(), set: Vec::new(), fence: Some(fence), expect: Vec::new(), release: None };
            if !targets.correct(key, &c).await? {
                return Ok(Outcome::Changed);
            }
        }
        return Ok(Outcome::Done(found));
    }
    if opts.dry_run {
        return Ok(Outcome::Done(found));
    }
    unwalk_owner(targets, rule, key).await?;
    for write in &writes {
        // A record applied in between: the attributes set so far are right (the comparison
        // held when they were written); the rest are compared again next round.
        if !targets.correct(key, write).await? {
            return Ok(Outcome::Changed);
        }
        metrics::counter!(names::RECONCILE_CORRECTIONS, "rule" => rule.name.to_string()).increment(write.set.len() as u64);
    }
    for d in found.iter_mut().filter(|d| !matches!(d.stored, Stored::Other(_))) {
        d.corrected = true;
    }
    tracing::info!(rule = %rule.name, target = ?key.0, attributes = writes.iter().map(|w| w.set.len()).sum::<usize>(), "drift corrected");
    Ok(Outcome::Done(found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn rules() -> Vec<Rule> {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn key(parts: &[&str]) -> TargetKey {
        TargetKey(parts.iter().map(|p| Box::from(*p)).collect())
    }

    fn d(v: &str) -> Decimal {
        Decimal::parse(v).unwrap()
    }

    #[test]
    fn a_query_per_target() {
        let rules = rules();
        assert_eq!(query_for(&rules[0], &key(&["CUST#c1", "PROFILE"])), Some(("CUST#c1".into(), Some("ORDER#".into()))));
        assert_eq!(query_for(&rules[1], &key(&["SALES#2026-11-30", "TOTAL"])), None, "a scan rule");
    }

    fn changed_rules() -> Vec<Rule> {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        let text = text
            .replace("SALES#{date|day}", "MONTHLY#{date|month}")
            .replace("      revenue: { sum: total }\n", "      spend: { sum: total }\n");
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn numbers(values: &[(&str, &str)]) -> BTreeMap<String, Stored> {
        values.iter().map(|(a, v)| (a.to_string(), Stored::Number(d(v)))).collect()
    }

    #[test]
    fn a_zeroed_old_target_goes_whole_unless_something_else_is_on_it() {
        let (old, new) = (rules(), changed_rules());
        let daily = old.iter().find(|r| &*r.name == "daily-sales").unwrap();
        let k = key(&["SALES#2026-11-15", "TOTAL"]);
        let zeroed = TargetItem {
            exists: true,
            values: numbers(&[("orders", "0"), ("revenue", "0")]),
            version: Some("17".into()),
            written: ["orders".to_string(), "revenue".to_string()].into(),
            floor: None,
            shared: false,
            ..Default::default()
        };
        assert_eq!(removal(daily, &new, &k, &zeroed), Some(Removal::Item { seen_version: "17".into() }));
        let mut noted = zeroed.clone();
        noted.values.insert("note".into(), Stored::Other("a user's".into()));
        let attrs = Some(Removal::Attributes(vec!["orders".into(), "revenue".into()]));
        assert_eq!(removal(daily, &new, &k, &noted), attrs, "a user's attribute keeps the item");
        let shared = TargetItem { shared: true, ..zeroed.clone() };
        assert_eq!(removal(daily, &new, &k, &shared), attrs, "another deployment's ledger keeps the item");
        let late = TargetItem { values: numbers(&[("orders", "1"), ("revenue", "0")]), ..zeroed.clone() };
        assert_eq!(removal(daily, &new, &k, &late), Some(Removal::Attributes(vec!["revenue".into()])), "a value is never removed");
        let foreign = TargetItem { version: None, ..zeroed.clone() };
        assert_eq!(removal(daily, &new, &k, &foreign), None, "not this deployment's");
        assert_eq!(removal(daily, &old, &k, &zeroed), None, "a current rule still writes it");
    }

    #[test]
    fn a_helper_at_zero_of_a_removed_measure_goes_with_its_distinct_flag() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let old = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules;
        let new =
            Config::from_yaml(&text.replace("      activeDays:", "      keptDays:"), Vec::<(String, String)>::new()).unwrap().engine.rules;
        let rule = old.iter().find(|r| r.measures.iter().any(|m| m.name.text() == "activeDays")).unwrap();
        let k = key(&["CUST#c1", &format!("{}S2026-11-02", helper::prefix("PROFILE", "activeDays"))]);
        let item = |values| TargetItem { exists: true, values, version: Some("4".into()), ..Default::default() };
        let flagged = item(numbers(&[(helper::REFS, "0"), (crate::sink::distinct::COUNTED, "1")]));
        assert_eq!(removal(rule, &new, &k, &flagged), Some(Removal::Item { seen_version: "4".into() }));
        let live = item(numbers(&[(helper::REFS, "1"), (crate::sink::distinct::COUNTED, "1")]));
        assert_eq!(removal(rule, &new, &k, &live), None, "a count above zero is never removed");
    }

    #[test]
    fn a_renamed_measure_loses_its_zero_attribute_and_keeps_the_item() {
        let (old, new) = (rules(), changed_rules());
        let customers = old.iter().find(|r| &*r.name == "customer-orders").unwrap();
        let k = key(&["CUST#c1", "PROFILE"]);
        let item = TargetItem {
            exists: true,
            values: numbers(&[("orderCount", "3"), ("revenue", "0"), ("spend", "30"), ("orders_PAID", "0")]),
            version: Some("5".into()),
            written: ["orderCount", "revenue", "spend", "orders_PAID"].iter().map(|s| s.to_string()).collect(),
            floor: None,
            shared: false,
            ..Default::default()
        };
        assert_eq!(
            removal(customers, &new, &k, &item),
            Some(Removal::Attributes(vec!["revenue".into()])),
            "orders_PAID at 0 is still a current measure's"
        );
    }

    #[test]
    fn drifts_and_the_correction_leave_users_and_strings_alone() {
        let rules = rules();
        let k = key(&["CUST#c1", "PROFILE"]);
        let item = TargetItem {
            exists: true,
            values: [
                ("orderCount".to_string(), Stored::Number(d("3"))),
                ("revenue".to_string(), Stored::Number(d("10"))),
                ("orders_PAID".to_string(), Stored::Number(d("9"))),
                ("orders_cap".to_string(), Stored::Number(d("10"))),
                ("orders_SHIPPED".to_string(), Stored::Other("many".into())),
                ("name".to_string(), Stored::Other("Ann".into())),
            ]
            .into(),
            version: Some("41".into()),
            written: ["orders_PAID".to_string()].into(),
            floor: None,
            shared: false,
            ..Default::default()
        };
        let want: BTreeMap<String, Decimal> =
            [("orderCount", "3"), ("revenue", "12.5"), ("orders_SHIPPED", "1")].iter().map(|(a, v)| (a.to_string(), d(v))).collect();
        let found = drifts(&rules[0], &k, &want, &item);
        let shown: Vec<String> = found.iter().map(|d| format!("{}: {} -> {}", d.attribute, d.stored, d.truth)).collect();
        // orders_PAID: written by the service, no item feeds it any more: zero. orders_cap: a
        // user's. openOrders/openRevenue: absent and zero in truth, no drift.
        assert_eq!(shown, ["orders_PAID: 9 -> 0", "orders_SHIPPED: \"many\" -> 1", "revenue: 10 -> 12.5"]);
        let c = corrections(&found, &item, None);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].seen_version.as_deref(), Some("41"));
        assert_eq!(c[0].set, [("orders_PAID".to_string(), d("0")), ("revenue".to_string(), d("12.5"))], "never the string");
        assert!(corrections(&found[1..2], &item, None).is_empty(), "only a string drifted: nothing to write");
    }

    #[test]
    fn many_drifted_attributes_are_corrected_in_chained_writes() {
        let k = key(&["CUST#c1", "PROFILE"]);
        let drift = |i: usize| Drift {
            rule: "r".into(),
            target: k.clone(),
            attribute: format!("orders_S{i}"),
            stored: Stored::Number(d("9")),
            truth: d("1"),
            corrected: false,
        };
        let found: Vec<Drift> = (0..250).map(drift).collect();
        let fresh = TargetItem { exists: true, ..TargetItem::default() };
        let c = corrections(&found, &fresh, None);
        let shape: Vec<(Option<&str>, usize)> = c.iter().map(|w| (w.seen_version.as_deref(), w.set.len())).collect();
        assert_eq!(shape, [(None, 100), (Some("1"), 100), (Some("2"), 50)], "each write expects the counter the one before left");
        let seen = TargetItem { version: Some("41".into()), ..fresh };
        assert_eq!(corrections(&found, &seen, None)[2].seen_version.as_deref(), Some("43"));
    }

    #[test]
    fn helper_items_are_counted_live_and_at_zero_per_rule() {
        let key = |sk: &str| TargetKey(vec![Box::from("CUST#c1"), Box::from(sk)].into_boxed_slice());
        let refs = |n: i64| TargetItem {
            values: BTreeMap::from([(helper::REFS.to_string(), Stored::Number(Decimal::from_i64(n)))]),
            ..TargetItem::default()
        };
        let items = BTreeMap::from([
            (key("PROFILE"), refs(7)),
            (key("PROFILE#_agg#largestOrder#N1"), refs(2)),
            (key("PROFILE#_agg#largestOrder#N2"), refs(0)),
            (key("PROFILE#_agg#largestOrder#N3"), refs(-1)),
            (key("PROFILE#_agg#activeDays#S1"), TargetItem::default()),
        ]);
        let mut report = Report::default();
        count_helpers("customer-orders", &items, &mut report);
        count_helpers("customer-orders", &items, &mut report);
        count_helpers("no-helpers", &BTreeMap::from([(key("PROFILE"), refs(1))]), &mut report);
        let counts: Vec<(&str, u64, u64)> = report.helpers.iter().map(|(r, c)| (r.as_str(), c.live, c.zero)).collect();
        assert_eq!(counts, [("customer-orders", 2, 6)], "the target item is not a helper; no count is zero");
    }

    #[test]
    fn a_correction_raises_the_floor_only_below_the_fence() {
        let at = |floor: Option<u64>| TargetItem { floor: floor.map(crate::sink::ledger::floor_value), ..TargetItem::default() };
        let fence = crate::sink::ledger::floor_value(500);
        assert_eq!(fence_for(&at(None), Some(500)), Some(fence.clone()), "no floor yet: every shard admitted, the old stream's too");
        assert_eq!(fence_for(&at(Some(499)), Some(500)), Some(fence));
        assert_eq!(fence_for(&at(Some(500)), Some(500)), None, "already there");
        assert_eq!(fence_for(&at(Some(900)), Some(500)), None, "never lowered: writers saw further");
        assert_eq!(fence_for(&at(Some(1)), None), None, "no fence known");
    }

    /// After a stream change, a requested repair fences the targets it compares: a paused
    /// reader of the old stream that wakes later is refused by the floor, not counted twice.
    #[tokio::test]
    async fn a_requested_repair_fences_every_target_against_older_shards() {
        use crate::sink::ledger::{admits, floor_value, open_tokens, Ledger};
        use crate::sink::memory::{MemValue, MemoryAggregates};
        let rule = rules().into_iter().find(|r| r.name.as_ref() == "customer-orders").unwrap();
        let sources = super::super::memory::MemorySources::new(vec!["PK".into(), "SK".into()]);
        let store = MemoryAggregates::new();
        let ledger = Ledger::new("t");
        for c in ["c1", "c2"] {
            let order = serde_json::json!({"PK": {"S": format!("CUST#{c}")}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": "PAID"}, "total": {"N": "5"}});
            sources.put(order.as_object().unwrap().clone());
            store.put(&[&format!("CUST#{c}"), "PROFILE"], &ledger.floor_attribute(), MemValue::Str(floor_value(100)));
            store.put(&[&format!("CUST#{c}"), "PROFILE"], &ledger.open_attribute(), MemValue::Str(",1gg,".into()));
        }
        let targets = super::super::memory::MemoryTargets { store: &store, ledger: ledger.clone(), expiry: None };
        // Both right (no fence known), then c2 drifts.
        let all = Options { all: true, ..Options::default() };
        reconcile_rule(&targets, &sources, &Quiet(None), &rule, None, &all, &mut Report::default()).await.unwrap();
        store.put(&["CUST#c2", "PROFILE"], "orderCount", MemValue::Num(d("7")));
        let (old, new) = ("shardId-00000000000000000400-0000000a", "shardId-00000000000000000500-0000000b");
        for fence_all in [false, true] {
            let opts = Options { all: true, fence_all, ..Options::default() };
            reconcile_rule(&targets, &sources, &Quiet(Some(500)), &rule, None, &opts, &mut Report::default()).await.unwrap();
            let fenced: Vec<(&str, bool, bool)> = ["c1", "c2"]
                .iter()
                .map(|c| {
                    let item = store.item(&[&format!("CUST#{c}"), "PROFILE"]).unwrap();
                    let text = |a: String| match item.get(&a) {
                        Some(MemValue::Str(t)) => Some(t.clone()),
                        _ => None,
                    };
                    let (floor, open) = (text(ledger.floor_attribute()), text(ledger.open_attribute()));
                    let admitted = |id: &str| {
                        admits(floor.as_deref(), open.as_deref(), &floor_value(crate::shard_id::created_ms(id).unwrap()), &open_tokens(id))
                    };
                    (*c, admitted(old), admitted(new))
                })
                .collect();
            // c2 drifted (7, truth 1): its correction fences. c1 was right: fenced only by a repair.
            let c1_fenced = fence_all;
            assert_eq!(fenced, [("c1", !c1_fenced, true), ("c2", false, true)], "fence_all {fence_all}");
        }
        assert_eq!(store.item(&["CUST#c2", "PROFILE"]).unwrap()["orderCount"], MemValue::Num(d("1")));
        // Only a string drifted (nothing to correct): a repair still fences the item, if this
        // deployment wrote it; an item it never wrote gets nothing (no counter, no floor).
        let order =
            serde_json::json!({"PK": {"S": "CUST#c3"}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": "PAID"}, "total": {"N": "5"}});
        sources.put(order.as_object().unwrap().clone());
        for (c, wrote) in [("c3", true), ("c4", false)] {
            store.put(&[&format!("CUST#{c}"), "PROFILE"], "orderCount", MemValue::Str("many".into()));
            if wrote {
                store.put(&[&format!("CUST#{c}"), "PROFILE"], &ledger.version_attribute(), MemValue::Num(d("4")));
            }
        }
        let opts = Options { all: true, fence_all: true, ..Options::default() };
        reconcile_rule(&targets, &sources, &Quiet(Some(500)), &rule, None, &opts, &mut Report::default()).await.unwrap();
        let floor = |c: &str| store.item(&[&format!("CUST#{c}"), "PROFILE"]).unwrap().get(&ledger.floor_attribute()).cloned();
        assert_eq!(floor("c3"), Some(MemValue::Str(floor_value(500))), "fenced though only a string drifted");
        assert_eq!(floor("c4"), None, "never written by this deployment: left alone");
    }

    /// A scheduled reconcile does not read again a helper at zero that the truth does not
    /// hold (it cannot have drifted); a repair still compares it, and a helper below zero is
    /// a drift either way.
    #[tokio::test]
    async fn helpers_at_zero_without_truth_are_compared_only_by_a_repair() {
        use crate::sink::ledger::Ledger;
        use crate::sink::memory::{MemValue, MemoryAggregates};
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let rules = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules;
        let rule = rules.into_iter().find(|r| r.name.as_ref() == "customer-orders").unwrap();
        let sources = super::super::memory::MemorySources::new(vec!["PK".into(), "SK".into()]);
        let order = serde_json::json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": "PAID"}, "total": {"N": "5"}, "updatedAt": {"N": "1"}});
        sources.put(order.as_object().unwrap().clone());
        let store = MemoryAggregates::new();
        let targets = super::super::memory::MemoryTargets { store: &store, ledger: Ledger::new("t"), expiry: None };
        let all = Options { all: true, ..Options::default() };
        reconcile_rule(&targets, &sources, &Quiet(None), &rule, None, &all, &mut Report::default()).await.unwrap();
        let helper = |v: i64| format!("PROFILE#_agg#largestOrder#{}", Derive::Max.tail(&helper::Scalar::N(Decimal::from_i64(v)), None));
        store.put(&["CUST#c1", &helper(9)], helper::REFS, MemValue::Num(Decimal::ZERO));
        store.put(&["CUST#c1", &helper(7)], helper::REFS, MemValue::Num(Decimal::from_i64(-1)));
        let mut checked = Vec::new();
        for fence_all in [false, true] {
            let mut report = Report::default();
            let opts = Options { all: true, fence_all, dry_run: true, ..Options::default() };
            reconcile_rule(&targets, &sources, &Quiet(None), &rule, None, &opts, &mut report).await.unwrap();
            let drifted: Vec<String> = report.drifts.iter().map(|d| d.target.0[1].to_string()).collect();
            assert_eq!(drifted, [helper(7)], "below zero: a drift (fence_all {fence_all})");
            checked.push(report.targets_checked);
        }
        assert_eq!(checked[1], checked[0] + 1, "only the helper at zero is left out: {checked:?}");
    }

    /// The memory fakes, with one target whose corrections DynamoDB refuses (`refused`), and
    /// one a user writes an attribute on whenever it is read (`touched`).
    struct Refusing<'a> {
        inner: super::super::memory::MemoryTargets<'a>,
        refused: TargetKey,
        touched: Option<TargetKey>,
    }

    impl TargetStore for Refusing<'_> {
        async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
            if self.touched.as_ref() == Some(key) {
                let parts: Vec<&str> = key.0.iter().map(|p| &**p).collect();
                self.inner.store.put(&parts, "note", crate::sink::memory::MemValue::Str("a user's".into()));
            }
            self.inner.read(key).await
        }
        async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
            self.inner.scan(rule).await
        }
        async fn correct(&self, key: &TargetKey, c: &Correction) -> Result<bool, ReconcileError> {
            if *key == self.refused {
                return Err(ReconcileError::Aws("ValidationException: Item size has exceeded the maximum allowed size".into()));
            }
            self.inner.correct(key, c).await
        }
        async fn helpers(&self, rule: &Rule, owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
            self.inner.helpers(rule, owner).await
        }
        async fn derive(&self, key_names: &[String], target: &DeriveTarget) -> Result<(), ReconcileError> {
            self.inner.derive(key_names, target).await
        }
        async fn remove(&self, key: &TargetKey, r: &Removal) -> Result<bool, ReconcileError> {
            self.inner.remove(key, r).await
        }
        async fn hold(&self, key: &TargetKey, p: &Placement) -> Result<bool, ReconcileError> {
            self.inner.hold(key, p).await
        }
        async fn fold(&self, key: &TargetKey, values: &[(String, Decimal)], seq: Decimal) -> Result<bool, ReconcileError> {
            self.inner.fold(key, values, seq).await
        }
        async fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> Result<bool, ReconcileError> {
            self.inner.reset_fold(key, zero).await
        }
    }

    /// A consumer that is always caught up, with this fence.
    struct Quiet(Option<u64>);

    impl Consumer for Quiet {
        async fn applied_before(&self, _after_ms: u64, _wait: Duration) -> Result<Applied, ReconcileError> {
            Ok(Applied { fence_ms: self.0, by_empty_pages: Vec::new() })
        }
    }

    #[tokio::test]
    async fn a_target_that_cannot_be_corrected_does_not_hold_up_the_others() {
        use crate::sink::memory::{MemValue, MemoryAggregates};
        let rule = rules().into_iter().find(|r| r.name.as_ref() == "customer-orders").unwrap();
        let sources = super::super::memory::MemorySources::new(vec!["PK".into(), "SK".into()]);
        let store = MemoryAggregates::new();
        for c in ["c1", "c2", "c3"] {
            let order = serde_json::json!({"PK": {"S": format!("CUST#{c}")}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": "PAID"}, "total": {"N": "5"}});
            sources.put(order.as_object().unwrap().clone());
            store.put(&[&format!("CUST#{c}"), "PROFILE"], "orderCount", MemValue::Num(d("7")));
        }
        let targets = Refusing {
            inner: super::super::memory::MemoryTargets { store: &store, ledger: crate::sink::ledger::Ledger::new("t"), expiry: None },
            refused: key(&["CUST#c2", "PROFILE"]),
            touched: None,
        };
        let mut report = Report::default();
        let opts = Options { all: true, ..Options::default() };
        reconcile_rule(&targets, &sources, &Quiet(None), &rule, None, &opts, &mut report).await.unwrap();
        for c in ["c1", "c3"] {
            assert_eq!(store.item(&[&format!("CUST#{c}"), "PROFILE"]).unwrap()["orderCount"], MemValue::Num(d("1")), "{c} corrected");
        }
        assert_eq!(store.item(&["CUST#c2", "PROFILE"]).unwrap()["orderCount"], MemValue::Num(d("7")), "c2 left as it was");
        let failed: Vec<_> = report.failed.iter().map(|(r, k, why)| (r.as_str(), k.clone(), why.contains("size"))).collect();
        assert_eq!(failed, [("customer-orders", key(&["CUST#c2", "PROFILE"]), true)]);
        assert!(report.uncorrected() >= 1, "the run reports the failure");
    }

    /// Removal after the replay window: zeroed old-shape items go, unless something was
    /// written on them after the scan (read again just before the delete); a renamed
    /// measure's zero attribute goes from an item the current rules keep.
    #[tokio::test]
    async fn zeroed_leftovers_are_removed_and_a_user_write_after_the_scan_keeps_its_item() {
        use crate::sink::memory::{MemValue, MemoryAggregates};
        let (old, new) = (rules(), changed_rules());
        let ledger = crate::sink::ledger::Ledger::new("t");
        let store = MemoryAggregates::new();
        let ours = |k: &[&str], attrs: &[(&str, &str)]| {
            for (a, v) in attrs {
                store.put(k, a, MemValue::Num(d(v)));
            }
            store.put(k, &ledger.version_attribute(), MemValue::Num(d("4")));
            store.put(k, &ledger.measures_attribute(), MemValue::Set(attrs.iter().map(|(a, _)| a.to_string()).collect()));
        };
        ours(&["SALES#2026-11-14", "TOTAL"], &[("orders", "0"), ("revenue", "0")]);
        ours(&["SALES#2026-11-15", "TOTAL"], &[("orders", "0"), ("revenue", "0")]);
        ours(&["CUST#c1", "PROFILE"], &[("orderCount", "2"), ("revenue", "0"), ("spend", "9")]);
        let targets = Refusing {
            inner: super::super::memory::MemoryTargets { store: &store, ledger: ledger.clone(), expiry: None },
            refused: key(&["none"]),
            touched: Some(key(&["SALES#2026-11-15", "TOTAL"])),
        };
        let daily = old.iter().find(|r| &*r.name == "daily-sales").unwrap();
        let r = remove_leftovers(&targets, daily, &new).await.unwrap();
        assert_eq!((r.items, r.attributes, r.changed.len(), r.failed.len()), (1, 2, 0, 0), "{r:?}");
        assert!(store.item(&["SALES#2026-11-14", "TOTAL"]).is_none(), "deleted");
        let kept = store.item(&["SALES#2026-11-15", "TOTAL"]).expect("kept: a user wrote on it after the scan");
        assert!(kept.contains_key("note") && !kept.contains_key("orders") && !kept.contains_key("revenue"), "{kept:?}");
        let customers = old.iter().find(|r| &*r.name == "customer-orders").unwrap();
        let r = remove_leftovers(&targets, customers, &new).await.unwrap();
        assert_eq!((r.items, r.attributes), (0, 1), "{r:?}");
        let profile = store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert!(!profile.contains_key("revenue") && profile["spend"] == MemValue::Num(d("9")), "{profile:?}");
        assert_eq!(profile[&ledger.measures_attribute()], MemValue::Set(["orderCount".to_string(), "spend".to_string()].into()));
    }

    /// Reconcile repairs helper items (a stale one is zeroed, missing ones created) and derives
    /// the target's max, min, latest and distinct from them: for one requested target and in a
    /// full pass (a backfill).
    #[tokio::test]
    async fn reconcile_repairs_helper_items_and_derives_from_them() {
        use crate::rules::helper::{self, Derive, Scalar};
        use crate::sink::ledger::Ledger;
        use crate::sink::memory::{MemValue, MemoryAggregates};
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let rules = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules;
        let rule = rules.iter().find(|r| r.name.as_ref() == "customer-orders").unwrap();
        let sources = super::super::memory::MemorySources::new(vec!["PK".into(), "SK".into()]);
        for (c, day, id, total, status, at) in [
            ("c1", "2026-11-29", "o1", "5", "PAID", "1"),
            ("c1", "2026-11-30", "o2", "9", "PENDING", "2"),
            ("c2", "2026-11-30", "o3", "3", "PAID", "3"),
        ] {
            let order = serde_json::json!({"PK": {"S": format!("CUST#{c}")}, "SK": {"S": format!("ORDER#{day}#{id}")},
                "status": {"S": status}, "total": {"N": total}, "updatedAt": {"N": at}});
            sources.put(order.as_object().unwrap().clone());
        }
        let store = MemoryAggregates::new();
        // c1 drifted: a deleted order of 12 still counted in its helper, and derived.
        let stale = format!("{}{}", helper::prefix("PROFILE", "largestOrder"), Derive::Max.tail(&Scalar::N(d("12")), None));
        store.put(&["CUST#c1", &stale], helper::REFS, MemValue::Num(d("1")));
        store.put(&["CUST#c1", "PROFILE"], "largestOrder", MemValue::Num(d("12")));
        let targets = super::super::memory::MemoryTargets { store: &store, ledger: Ledger::new("t"), expiry: None };
        let c1 = [key(&["CUST#c1", "PROFILE"])].into();
        let mut report = Report::default();
        reconcile_rule(&targets, &sources, &Quiet(None), rule, Some(c1), &Options::default(), &mut report).await.unwrap();
        let profile = |c: &str| store.item(&[&format!("CUST#{c}"), "PROFILE"]).unwrap_or_default();
        assert_eq!(profile("c1").get("largestOrder"), Some(&MemValue::Num(d("9"))), "{report:?}");
        assert_eq!(profile("c1").get("firstOrderDay"), Some(&MemValue::Str("2026-11-29".into())));
        assert_eq!(profile("c1").get("lastStatus"), Some(&MemValue::Str("PENDING".into())));
        assert_eq!(profile("c1").get("activeDays"), Some(&MemValue::Num(d("2"))));
        assert_eq!(store.item(&["CUST#c1", &stale]).unwrap()[helper::REFS], MemValue::Num(d("0")), "the stale helper zeroed");
        assert!(report.drifts.iter().any(|x| x.target.0[1].as_ref() == stale && x.corrected), "the helper's drift is reported");
        assert!(profile("c2").is_empty(), "only c1 was asked for");
        let all = Options { all: true, ..Options::default() };
        reconcile_rule(&targets, &sources, &Quiet(None), rule, None, &all, &mut Report::default()).await.unwrap();
        assert_eq!(profile("c2").get("largestOrder"), Some(&MemValue::Num(d("3"))), "backfilled");
        assert_eq!(profile("c2").get("lastStatus"), Some(&MemValue::Str("PAID".into())));
        assert_eq!(profile("c1").get("largestOrder"), Some(&MemValue::Num(d("9"))), "a second pass changes nothing");
    }
}
