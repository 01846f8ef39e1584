//! The attributes of `max`, `min`, `latest` and `distinct`, derived from their helper items
//! ([`crate::rules::helper`]) after a batch's writes.
//!
//! A derivation reads the target's derivation counters (`_aggd:<namespace>:<attribute>`, one
//! per derived attribute), queries each measure's live helpers, and writes the values on
//! condition that their counters are unchanged, advancing them. Why this is exact with many
//! shards, replicas and crashes:
//! - every helper write is followed, before its batch's checkpoint moves, by a derivation of
//!   its target that succeeds; a crash in between replays the batch, which derives again (its
//!   helper writes are refused by the ledger, the derivation is not);
//! - a derivation lands only if no other landed on the same attribute since it read the
//!   counter, and it queried the helpers after that read. So the last one to land queried
//!   after every earlier one landed, hence after every helper write whose derivation landed
//!   before it: it saw them all. A view older than another derivation's can never overwrite it;
//! - a derivation need not land itself once the counter moved twice past its first read
//!   ([`covered`]): the second of those two read the counter, and so queried the helpers,
//!   after this one's helper writes. On a target that many shards write at once this bounds
//!   every attribute written alone to two writes (three rounds), where waiting for its own
//!   landing could lose for ever. Attributes go 32 to a write until one such write loses, then
//!   one to a write (a write of k loses when any of its k counters moved).
//!
//! `max`, `min` and `latest` read from a cursor (`_aggk:<namespace>:<attribute>`), so what a
//! derivation reads depends on the live helpers, not on the history of zero-count ones. The
//! cursor is the tail of a helper with no live helper before it in scan order (absent: the
//! whole range). A derivation queries from it and sets it to the first live helper (or the
//! last one it read), on condition that it is unchanged too. The only way a live helper gets
//! before the cursor is a write that raises it from zero; the derivation after that write
//! ([`Raised`]: every helper some record of the batch adds to, since a batch read again may
//! write only part of its records) is responsible for it, and only ever moves the cursor back:
//! - if it reads the cursor beyond its raised helper, it queries from that helper instead;
//!   once such a write lost, it moves the cursor back to the helper ([`AggregateStore::lower_cursor`],
//!   conditioned on the cursor still lying beyond it) before querying again;
//! - [`covered`] counts only landings after a read that saw the cursor at or before the
//!   helper, and every later read must see it so. Then either the cursor stayed at or before
//!   the helper (the second of those landings read after the helper write, queried from at
//!   or before it, and found it), or a move back put it there, after which every landing read
//!   after the move (it changed the cursor they are conditioned on) and found it; whoever moved
//!   it back counts its own landings from a read after the move.
//!   A derivation that read the cursor before the helper write and lands after it can move the
//!   cursor past the helper; the next read then sees the cursor beyond it, and starts over.

use std::collections::{BTreeMap, BTreeSet};

use super::distinct::{derive_distinct, DistinctStats, DistinctTarget, Touched};
use super::expiry::Expiry;
use super::{AggregateStore, CursorWrite, DerivationNames, Derived, DerivedWrite, HelperQuery, SinkError};
use crate::rules::helper::{self, Derive, HelperScan, Scalar};
use crate::rules::{Engine, MeasureKind, TargetDelta, TargetKey};
use crate::sink::ledger::Ledger;

/// Rounds a derivation may take before the batch gives up (and is retried from its
/// checkpoint). Four are enough: a chunk that lost is split into single attributes, and a
/// single attribute lands or is covered within three more ([`covered`]).
const ROUNDS: u32 = 8;
/// Transient failures retried within one derivation.
const TRANSIENT_RETRIES: u32 = 8;
/// Derived attributes in one write: its expressions stay under DynamoDB's 4 KB
/// ([`derived_expressions`], tested with the longest placeholders).
pub const MEASURES_PER_WRITE: usize = 32;

/// A target whose derived attributes a batch changed, with the measures to derive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeriveTarget {
    pub key: TargetKey,
    /// Expanded measure name -> how it is derived.
    pub measures: BTreeMap<String, Derive>,
    /// Of `max`, `min` and `latest`: the helpers the writes before this derivation may have
    /// raised from zero, which the cursor must not lie beyond ([`Raised`]).
    pub raised: BTreeMap<String, Raised>,
    /// Of `distinct`: the helpers whose flags the derivation reads ([`Touched`]).
    pub touched: BTreeMap<String, Touched>,
}

/// The helpers a derivation's own writes may have made live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Raised {
    /// The one first in scan order (the least for `min`, the greatest for `max` and `latest`).
    Tail(String),
    /// Any of them (reconcile's corrections): the whole range.
    Everything,
}

impl Raised {
    /// Whether it lies before a cursor (None: absent, the whole range) in `scan` order.
    pub fn before(&self, scan: HelperScan, cursor: Option<&str>) -> bool {
        match (self, cursor) {
            (_, None) => false,
            (Raised::Everything, Some(_)) => true,
            (Raised::Tail(t), Some(c)) => helper::before(scan, t, c),
        }
    }

    /// Where a query that must see it starts (None: the end of the range).
    pub fn from(&self) -> Option<&str> {
        match self {
            Raised::Tail(t) => Some(t),
            Raised::Everything => None,
        }
    }

    /// The one of two that a query must start from to see both.
    fn earlier(self, other: Raised, scan: HelperScan) -> Raised {
        match (&self, &other) {
            (Raised::Tail(a), Raised::Tail(b)) if helper::before(scan, b, a) => other,
            (Raised::Tail(_), Raised::Tail(_)) => self,
            _ => Raised::Everything,
        }
    }
}

/// The targets whose helpers are among `targets` (a batch's writes), each with the measures
/// those helpers belong to. Helpers are found by their sort key; the measure's kind by the
/// rules that wrote them.
pub fn targets_to_derive(engine: &Engine, targets: &[(TargetKey, TargetDelta)]) -> Vec<DeriveTarget> {
    let mut out: BTreeMap<TargetKey, DeriveTarget> = BTreeMap::new();
    for (key, delta) in targets {
        let Some(h) = key.0.last().filter(|_| key.0.len() > 1).and_then(|sk| helper::parse(sk)) else { continue };
        let derive = delta.contributions.iter().filter_map(|c| c.rule.as_deref()).find_map(|rule| {
            let rule = engine.rules.iter().find(|r| *r.name == *rule)?;
            rule.measures.iter().find_map(|m| match &m.kind {
                MeasureKind::Helper(hm) if m.name.matches_expansion(h.measure) => Some(hm.derive),
                _ => None,
            })
        });
        let Some(derive) = derive else { continue };
        let mut owner = key.0.to_vec();
        if let Some(last) = owner.last_mut() {
            *last = Box::from(h.owner_sk);
        }
        let owner = TargetKey(owner.into_boxed_slice());
        let t = out.entry(owner.clone()).or_insert_with(|| DeriveTarget {
            key: owner,
            measures: BTreeMap::new(),
            raised: BTreeMap::new(),
            touched: BTreeMap::new(),
        });
        t.measures.insert(h.measure.to_string(), derive);
        // Any record that adds to it, not the net: a batch read again after part of it was
        // applied writes only the rest, which may raise the helper from zero on its own.
        if derive == Derive::Distinct {
            if let Touched::Helpers(tails) = t.touched.entry(h.measure.to_string()).or_insert_with(|| Touched::Helpers(BTreeSet::new())) {
                tails.insert(h.tail.to_string());
            }
        }
        let raises =
            delta.contributions.iter().any(|c| c.values.iter().any(|(a, v)| &**a == helper::REFS && *v > crate::decimal::Decimal::ZERO));
        if raises && derive.scan() != HelperScan::Count {
            let mine = Raised::Tail(h.tail.to_string());
            let raised = match t.raised.remove(h.measure) {
                Some(other) => other.earlier(mine, derive.scan()),
                None => mine,
            };
            t.raised.insert(h.measure.to_string(), raised);
        }
    }
    out.into_values().collect()
}

/// The derived values one batch gives on its own, from an empty table (each helper's count is
/// the batch's delta): `simulate`'s `"value"` lines. None: nothing contributes.
pub fn values_of_batch(engine: &Engine, targets: &[(TargetKey, TargetDelta)]) -> Vec<(TargetKey, String, Option<Scalar>)> {
    let mut out = Vec::new();
    for t in targets_to_derive(engine, targets) {
        let Some((owner_sk, partition)) = t.key.0.split_last() else { continue };
        for (name, how) in &t.measures {
            let prefix = helper::prefix(owner_sk, name);
            let helpers = targets.iter().filter_map(|(k, d)| {
                let (sk, p) = k.0.split_last()?;
                let tail = sk.strip_prefix(prefix.as_str()).filter(|_| p == partition)?;
                Some((tail, d.attributes.get(helper::REFS).copied().unwrap_or(crate::decimal::Decimal::ZERO)))
            });
            out.push((t.key.clone(), name.clone(), helper::derive(*how, helpers)));
        }
    }
    out
}

/// What one derivation cost.
#[derive(Debug, Default)]
pub struct DeriveStats {
    pub queries: u64,
    /// By measure kind (`max`, ...): helper queries, and the helper items they read, live
    /// or not.
    pub reads: BTreeMap<&'static str, (u64, u64)>,
    /// Cursors moved back to a helper this derivation's writes raised.
    pub lowered: u64,
    pub writes: u64,
    pub read_capacity: f64,
    /// Of the writes that landed.
    pub write_capacity: f64,
    /// Writes that landed.
    pub landed: u64,
    /// Writes refused because another derivation moved a counter first.
    pub lost: u64,
    /// Attributes another derivation was known to have derived from a view holding this
    /// one's helper writes ([`covered`]).
    pub covered: u64,
    /// Attributes the table refused to take (the error says why): counted and logged, not
    /// retried for ever; reconcile derives them again.
    pub refused: Vec<(Vec<String>, SinkError)>,
}

impl DeriveStats {
    /// The first refused write as an error (reconcile reports it as a failed target).
    pub fn refused_as_error(self) -> Result<(), SinkError> {
        match self.refused.into_iter().next() {
            None => Ok(()),
            Some((names, e)) => Err(SinkError::Invalid(format!("{}: {e}", names.join(", ")))),
        }
    }
}

/// Whether a derivation that first read a counter as `first` (after its helper writes) can
/// stop now that it reads `now`: two derivations landed since, and the second read the counter,
/// and so queried the helpers, after `first` was read. An absent counter is 0; a counter that
/// is not a whole number covers nothing.
pub fn covered(first: Option<&str>, now: Option<&str>) -> bool {
    let number = |c: Option<&str>| c.map_or(Some(0u64), |c| c.parse().ok());
    match (number(first), number(now)) {
        (Some(first), Some(now)) => first.checked_add(2).is_some_and(|two_later| now >= two_later),
        _ => false,
    }
}

/// The update and condition of a derivation's write: value `i` is `#d{i}` (`:d{i}`), its
/// counter `#g{i}` (read as `:s{i}`), its cursor `#k{i}` (read as `:ks{i}`, set to `:kt{i}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivedExpressions {
    pub update: String,
    pub condition: String,
    /// Whether `:zero` is used (a counter this write creates).
    pub uses_zero: bool,
    /// Whether `:string` (the type name `S`) is used (a cursor read as absent).
    pub uses_string: bool,
}

pub fn derived_expressions(values: &[Derived]) -> DerivedExpressions {
    let (mut sets, mut removes, mut conditions) = (Vec::new(), Vec::new(), Vec::new());
    let mut uses_zero = false;
    let uses_string = values.iter().any(|d| d.cursor.as_ref().is_some_and(|c| c.seen.is_none()));
    for (i, d) in values.iter().enumerate() {
        if d.seen.is_some() {
            sets.push(format!("#g{i} = #g{i} + :one"));
            conditions.push(format!("#g{i} = :s{i}"));
        } else {
            uses_zero = true;
            sets.push(format!("#g{i} = if_not_exists(#g{i}, :zero) + :one"));
            conditions.push(format!("attribute_not_exists(#g{i})"));
        }
        match d.value {
            Some(_) => sets.push(format!("#d{i} = :d{i}")),
            None => removes.push(format!("#d{i}")),
        }
        if let Some(c) = &d.cursor {
            // A cursor that is not a string (someone else wrote it) reads as absent, and is
            // overwritten rather than refused round after round.
            conditions.push(match c.seen {
                Some(_) => format!("#k{i} = :ks{i}"),
                None => format!("(attribute_not_exists(#k{i}) OR NOT attribute_type(#k{i}, :string))"),
            });
            match c.to {
                Some(_) => sets.push(format!("#k{i} = :kt{i}")),
                None if c.seen.is_some() => removes.push(format!("#k{i}")),
                None => {}
            }
        }
    }
    let mut update = format!("SET {}", sets.join(", "));
    if !removes.is_empty() {
        update.push_str(&format!(" REMOVE {}", removes.join(", ")));
    }
    DerivedExpressions { update, condition: conditions.join(" AND "), uses_zero, uses_string }
}

/// One target's derivation as it goes: the attributes still to derive and what each
/// one's counter read first.
struct Progress<'a> {
    target: &'a DeriveTarget,
    key: Vec<(String, String)>,
    pk: &'a str,
    owner_sk: &'a str,
    names: DerivationNames,
    pending: BTreeSet<String>,
    first: BTreeMap<String, Option<String>>,
    /// A chunk lost a race: from then on each attribute is written alone.
    alone: bool,
    /// Attributes whose write lost a race: a cursor beyond their raised helper is now moved
    /// back before they query again.
    lost: BTreeSet<String>,
    /// The target's [`Raised`], narrowed by each query from it: the raised helpers still live
    /// when it read them lie at or after the first live one it found (none found: none is).
    raised: BTreeMap<String, Raised>,
}

/// Derives `target`'s attributes from its live helpers until each one landed, was covered
/// by another derivation, or was refused by the table.
pub async fn derive_target<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    ledger: &Ledger,
    target: &DeriveTarget,
    expiry: Option<&Expiry>,
) -> Result<DeriveStats, SinkError> {
    let (Some(pk), Some(owner_sk)) = (target.key.0.first(), target.key.0.last().filter(|_| target.key.0.len() > 1)) else {
        return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
    };
    let mut stats = DeriveStats::default();
    let key: Vec<(String, String)> = key_names.iter().cloned().zip(target.key.0.iter().map(|v| v.to_string())).collect();
    let names = ledger.derivation_names();
    for (name, derive) in &target.measures {
        if *derive != Derive::Distinct {
            continue;
        }
        let touched = target.touched.get(name).unwrap_or(&Touched::Everything);
        let t = DistinctTarget { key_names, key: &key, pk, owner_sk, names: &names, name, touched, expiry };
        distinct_with_retries(store, &t, &mut stats).await?;
    }
    let mut p = Progress {
        target,
        key: key_names.iter().cloned().zip(target.key.0.iter().map(|v| v.to_string())).collect(),
        pk,
        owner_sk,
        names: ledger.derivation_names(),
        pending: target.measures.iter().filter(|(_, d)| **d != Derive::Distinct).map(|(m, _)| m.clone()).collect(),
        first: BTreeMap::new(),
        alone: false,
        lost: BTreeSet::new(),
        raised: target.raised.clone(),
    };
    if p.pending.is_empty() {
        return Ok(stats);
    }
    let (mut rounds, mut transient) = (0, 0);
    while rounds < ROUNDS {
        match derive_round(store, key_names, &mut p, &mut stats).await {
            Ok(()) if p.pending.is_empty() => return Ok(stats),
            Ok(()) => rounds += 1,
            Err(e) if e.is_retriable() && transient < TRANSIENT_RETRIES => {
                transient += 1;
                tokio::time::sleep(super::backoff(transient)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(SinkError::Transient(format!("deriving {:?}: other derivations kept landing first", target.key.0)))
}

/// One `distinct` attribute ([`derive_distinct`]), transient failures retried; one the table
/// refuses is counted in `refused`.
async fn distinct_with_retries<S: AggregateStore>(store: &S, t: &DistinctTarget<'_>, stats: &mut DeriveStats) -> Result<(), SinkError> {
    let mut transient = 0;
    loop {
        let mut d = DistinctStats::default();
        let result = derive_distinct(store, t, &mut d).await;
        let reads = stats.reads.entry(Derive::Distinct.as_str()).or_default();
        (reads.0, reads.1) = (reads.0 + 1, reads.1 + d.read);
        stats.queries += 1;
        stats.read_capacity += d.read_capacity;
        stats.write_capacity += d.write_capacity;
        stats.writes += d.landed + d.lost;
        stats.landed += d.landed;
        stats.lost += d.lost;
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.is_retriable() && transient < TRANSIENT_RETRIES => {
                transient += 1;
                tokio::time::sleep(super::backoff(transient)).await;
            }
            Err(e @ SinkError::Invalid(_)) => {
                stats.refused.push((vec![t.name.to_string()], e));
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
}

/// One round: read the counters and cursors, drop the covered attributes, query the helpers
/// of the others and write them on condition, in chunks. An attribute whose cursor lies
/// beyond a helper this derivation's writes raised queries from that helper; once such a
/// write lost, it moves the cursor back first and queries in the next round.
async fn derive_round<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    p: &mut Progress<'_>,
    stats: &mut DeriveStats,
) -> Result<(), SinkError> {
    let counters = store.derivation_counters(&p.key, &p.names).await?;
    stats.read_capacity += counters.capacity;
    let now = counters.values;
    let mut due = Vec::with_capacity(p.pending.len());
    for name in p.pending.clone() {
        let Some(derive) = p.target.measures.get(&name) else { continue };
        let cursor = counters.cursors.get(&name).map(String::as_str);
        let raised = p.raised.get(&name).filter(|r| r.before(derive.scan(), cursor));
        if raised.is_some() {
            // Landings counted from here may have read that cursor and missed the helper:
            // the count for `covered` starts again at a read that saw the cursor before it.
            p.first.remove(&name);
        }
        match (raised, p.lost.contains(&name)) {
            (Some(r), true) => {
                store.lower_cursor(&p.key, &format!("{}{name}", p.names.cursors), r.from(), derive.scan()).await?;
                stats.lowered += 1;
            }
            (Some(r), false) => due.push((name, *derive, r.from().map(str::to_string), cursor.map(str::to_string), true)),
            (None, _) => {
                let first = p.first.entry(name.clone()).or_insert_with(|| now.get(&name).cloned());
                if covered(first.as_deref(), now.get(&name).map(String::as_str)) {
                    stats.covered += 1;
                    p.pending.remove(&name);
                } else {
                    due.push((name, *derive, cursor.map(str::to_string), cursor.map(str::to_string), false));
                }
            }
        }
    }
    let mut values = Vec::with_capacity(due.len());
    for (name, derive, from, seen_cursor, own) in due {
        let prefix = helper::prefix(p.owner_sk, &name);
        let scan = derive.scan();
        let from = from.as_deref().filter(|_| scan != HelperScan::Count);
        let live = store.live_helpers(&HelperQuery { key_names, pk: p.pk, prefix: &prefix, scan, from }).await?;
        stats.queries += 1;
        let reads = stats.reads.entry(derive.as_str()).or_default();
        (reads.0, reads.1) = (reads.0 + 1, reads.1 + live.read);
        stats.read_capacity += live.capacity;
        if own {
            match &live.first {
                Some(first) => p.raised.insert(name.clone(), Raised::Tail(first.clone())),
                None => p.raised.remove(&name),
            };
        }
        let value = derive.value(live.first.as_deref(), live.count);
        let cursor = (scan != HelperScan::Count).then(|| CursorWrite {
            attribute: format!("{}{name}", p.names.cursors),
            to: live.last_read.clone().or_else(|| from.map(str::to_string)),
            seen: seen_cursor,
        });
        values.push(Derived { counter: format!("{}{name}", p.names.counters), seen: now.get(&name).cloned(), value, name, cursor });
    }
    // After a chunk lost, one attribute a write: a chunk loses when any of its counters
    // moved, so k attributes together could lose 2k rounds to derivations of one each.
    let size = if p.alone { 1 } else { MEASURES_PER_WRITE };
    for chunk in values.chunks(size) {
        match write_chunk(store, p, chunk, stats).await? {
            Written::Lost if chunk.len() > 1 => p.alone = true,
            Written::Refused(_) if chunk.len() > 1 => {
                // Find the attribute the table refuses: the others of the chunk still land.
                for one in chunk.chunks(1) {
                    if let Written::Refused(e) = write_chunk(store, p, one, stats).await? {
                        stats.refused.push((vec![one[0].name.clone()], e));
                    }
                }
            }
            Written::Refused(e) => stats.refused.push((chunk.iter().map(|d| d.name.clone()).collect(), e)),
            Written::Landed | Written::Lost => {}
        }
    }
    Ok(())
}

/// How one derivation write ended.
enum Written {
    Landed,
    Lost,
    Refused(SinkError),
}

/// Writes one chunk: its attributes leave `pending` when it lands or is refused.
async fn write_chunk<S: AggregateStore>(
    store: &S,
    p: &mut Progress<'_>,
    chunk: &[Derived],
    stats: &mut DeriveStats,
) -> Result<Written, SinkError> {
    stats.writes += 1;
    let written = match store.set_derived(&DerivedWrite { key: &p.key, values: chunk }).await {
        Ok(Some(capacity)) => {
            stats.landed += 1;
            stats.write_capacity += capacity;
            Written::Landed
        }
        Ok(None) => {
            stats.lost += 1;
            p.lost.extend(chunk.iter().map(|d| d.name.clone()));
            return Ok(Written::Lost);
        }
        Err(e @ SinkError::Invalid(_)) => Written::Refused(e),
        Err(e) => return Err(e),
    };
    for d in chunk {
        p.pending.remove(&d.name);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::decimal::Decimal;
    use crate::rules::{Coalescer, TargetDelta};
    use crate::sink::memory::{MemValue, MemoryAggregates};
    use std::time::Duration;

    fn engine() -> Engine {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine
    }

    fn order(customer: &str, id: u32, total: &str, status: &str) -> serde_json::Value {
        let image = serde_json::json!({
            "PK": {"S": format!("CUST#{customer}")}, "SK": {"S": format!("ORDER#2026-11-{:02}#o{id}", 1 + id % 28)},
            "total": {"N": total}, "status": {"S": status}, "updatedAt": {"N": id.to_string()},
        });
        serde_json::json!({"eventName": "INSERT", "dynamodb": {
            "Keys": {"PK": image["PK"], "SK": image["SK"]}, "NewImage": image,
            "SequenceNumber": format!("{id:021}"), "StreamViewType": "NEW_AND_OLD_IMAGES"}})
    }

    fn batch(engine: &Engine, records: &[serde_json::Value]) -> Vec<(TargetKey, TargetDelta)> {
        let mut c = Coalescer::new();
        for r in records {
            assert!(engine.apply(r, &mut c).poisons.is_empty());
        }
        c.into_targets()
    }

    #[test]
    fn a_batch_derives_each_target_once_with_every_measure_its_helpers_touched() {
        let e = engine();
        let targets = batch(&e, &[order("c1", 1, "5", "PAID"), order("c1", 2, "9", "PENDING"), order("c2", 3, "1", "PAID")]);
        let derive = targets_to_derive(&e, &targets);
        let keys: Vec<Vec<&str>> = derive.iter().map(|d| d.key.0.iter().map(|s| &**s).collect()).collect();
        assert_eq!(keys, [vec!["CUST#c1", "PROFILE"], vec!["CUST#c2", "PROFILE"]]);
        let measures: Vec<(&str, Derive)> = derive[0].measures.iter().map(|(n, d)| (n.as_str(), *d)).collect();
        assert_eq!(
            measures,
            [
                ("activeDays", Derive::Distinct),
                ("firstOrderDay", Derive::Min),
                ("largestOrder", Derive::Max),
                ("lastStatus", Derive::Latest)
            ]
        );
    }

    async fn write(store: &MemoryAggregates, e: &Engine, targets: &[(TargetKey, TargetDelta)]) {
        let ctx = crate::sink::ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000000-00000001");
        for (k, d) in targets {
            crate::sink::write_target(store, &e.key_names, k, d, &ctx).await.unwrap();
        }
        for t in targets_to_derive(e, targets) {
            derive_target(store, &e.key_names, &Ledger::new("t"), &t, None).await.unwrap();
        }
    }

    #[tokio::test]
    async fn deleting_the_largest_order_brings_back_the_next_and_the_last_one_removes_it() {
        let e = engine();
        let store = MemoryAggregates::new();
        write(&store, &e, &batch(&e, &[order("c1", 1, "5", "PAID"), order("c1", 2, "9", "PENDING")])).await;
        let profile = || store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(9))));
        assert_eq!(profile().get("lastStatus"), Some(&MemValue::Str("PENDING".into())));
        assert_eq!(profile().get("activeDays"), Some(&MemValue::Num(Decimal::from_i64(2))));
        let mut delete = order("c1", 2, "9", "PENDING");
        delete["eventName"] = "REMOVE".into();
        delete["dynamodb"]["OldImage"] = delete["dynamodb"]["NewImage"].take();
        delete["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        delete["dynamodb"]["SequenceNumber"] = format!("{:021}", 10).into();
        write(&store, &e, &batch(&e, &[delete.clone()])).await;
        assert_eq!(profile().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(5))), "the next largest");
        assert_eq!(profile().get("lastStatus"), Some(&MemValue::Str("PAID".into())));
        assert_eq!(profile().get("activeDays"), Some(&MemValue::Num(Decimal::ONE)));
        let mut last = order("c1", 1, "5", "PAID");
        last["eventName"] = "REMOVE".into();
        last["dynamodb"]["OldImage"] = last["dynamodb"]["NewImage"].take();
        last["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        last["dynamodb"]["SequenceNumber"] = format!("{:021}", 11).into();
        write(&store, &e, &batch(&e, &[last])).await;
        for gone in ["largestOrder", "firstOrderDay", "lastStatus", "activeDays"] {
            assert_eq!(profile().get(gone), None, "{gone}: nothing contributes");
        }
        // A replay of the delete: its helper writes are refused, the derivation changes nothing.
        write(&store, &e, &batch(&e, &[delete])).await;
        assert_eq!(profile().get("largestOrder"), None);
    }

    fn profile_key() -> Vec<(String, String)> {
        vec![("PK".to_string(), "CUST#c1".to_string()), ("SK".to_string(), "PROFILE".to_string())]
    }

    fn derived(seen: Option<String>, v: i64) -> Vec<Derived> {
        let value = Some(Scalar::N(Decimal::from_i64(v)));
        vec![Derived { name: "largestOrder".into(), counter: "_aggd:t:largestOrder".into(), seen, value, cursor: None }]
    }

    #[tokio::test]
    async fn a_derivation_from_an_older_view_never_lands_after_a_newer_one() {
        let store = MemoryAggregates::new();
        let key = profile_key();
        let old = store.derivation_counters(&key, &Ledger::new("t").derivation_names()).await.unwrap().values.remove("largestOrder");
        let newer = store.derivation_counters(&key, &Ledger::new("t").derivation_names()).await.unwrap().values.remove("largestOrder");
        assert!(store.set_derived(&DerivedWrite { key: &key, values: &derived(newer, 9) }).await.unwrap().is_some());
        assert!(
            store.set_derived(&DerivedWrite { key: &key, values: &derived(old, 5) }).await.unwrap().is_none(),
            "read before the newer one landed: refused"
        );
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(9))));
        let counters = store.derivation_counters(&key, &Ledger::new("t").derivation_names()).await.unwrap().values;
        assert_eq!(counters, BTreeMap::from([("largestOrder".to_string(), "1".to_string())]));
    }

    #[test]
    fn a_raised_helper_lies_before_a_cursor_in_its_measures_scan_order() {
        let t = |s: &str| Raised::Tail(s.into());
        assert!(t("N3").before(HelperScan::First, Some("N5")), "a new minimum");
        assert!(!t("N5").before(HelperScan::First, Some("N5")), "at the cursor: seen");
        assert!(t("N9").before(HelperScan::Last, Some("N5")), "a new maximum");
        assert!(!t("N3").before(HelperScan::Last, Some("N5")));
        assert!(!t("N3").before(HelperScan::First, None), "no cursor: the whole range");
        assert!(Raised::Everything.before(HelperScan::Last, Some("N5")));
        assert!(!Raised::Everything.before(HelperScan::First, None));
        assert_eq!(t("N3").earlier(t("N1"), HelperScan::First), t("N1"));
        assert_eq!(t("N3").earlier(t("N1"), HelperScan::Last), t("N3"));
        assert_eq!(t("N3").earlier(Raised::Everything, HelperScan::First), Raised::Everything);
    }

    /// A batch that adds to a helper raises it, even when its net change is zero: read again
    /// after its -1 was applied, it writes only the +1.
    #[test]
    fn a_helper_a_record_adds_to_is_raised_whatever_the_net() {
        let e = engine();
        let mut closed = order("c1", 1, "5", "PAID");
        closed["eventName"] = "REMOVE".into();
        closed["dynamodb"]["OldImage"] = closed["dynamodb"]["NewImage"].take();
        closed["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        let mut again = order("c1", 1, "5", "PAID");
        again["dynamodb"]["SequenceNumber"] = format!("{:021}", 2).into();
        let targets = batch(&e, &[closed, again]);
        let derive = targets_to_derive(&e, &targets);
        let largest = Derive::Max.tail(&Scalar::N(Decimal::from_i64(5)), None);
        assert_eq!(derive[0].raised.get("largestOrder"), Some(&Raised::Tail(largest)), "{:?}", derive[0].raised);
        assert_eq!(derive[0].raised.get("activeDays"), None, "distinct keeps no cursor");
    }

    #[test]
    fn two_landings_after_the_first_read_cover_a_derivation_one_does_not() {
        assert!(!covered(None, None));
        assert!(!covered(None, Some("1")), "the one landing may have queried before our helper writes");
        assert!(covered(None, Some("2")));
        assert!(!covered(Some("7"), Some("8")));
        assert!(covered(Some("7"), Some("9")));
        assert!(covered(Some("7"), Some("120")));
        assert!(!covered(Some("7"), Some("7")));
        assert!(!covered(Some("x"), Some("9")), "not a number: never covered");
        assert!(!covered(Some("18446744073709551615"), Some("18446744073709551615")), "no overflow");
    }

    #[test]
    fn a_full_chunk_of_derived_attributes_fits_one_expression() {
        let values: Vec<Derived> = (0..MEASURES_PER_WRITE)
            .map(|i| Derived {
                name: format!("m{i}"),
                counter: format!("_aggd:t:m{i}"),
                seen: None,
                value: (i % 2 == 0).then(|| Scalar::S("x".into())),
                cursor: Some(CursorWrite {
                    attribute: format!("_aggk:t:m{i}"),
                    seen: (i % 2 == 1).then(|| "x".repeat(8)),
                    to: Some("y".repeat(8)),
                }),
            })
            .collect();
        let e = derived_expressions(&values);
        let limit = crate::sink::ledger::MAX_EXPRESSION_BYTES;
        assert!(e.update.len() <= limit && e.condition.len() <= limit, "{} and {} bytes", e.update.len(), e.condition.len());
        assert!(e.uses_zero && e.update.contains(" REMOVE #d1, #d3"), "{e:?}");
        let seen = derived_expressions(&derived(Some("4".into()), 1));
        assert_eq!(seen.update, "SET #g0 = #g0 + :one, #d0 = :d0");
        assert_eq!(seen.condition, "#g0 = :s0");
        assert!(!seen.uses_zero);
    }

    /// A test store's `distinct` calls: each yields first (so concurrent derivations
    /// interleave), then asks the memory store in `inner`; and its expiry calls, passed on.
    macro_rules! distinct_calls {
        () => {
            async fn helper_state(&self, key: &[(String, String)]) -> Result<(Option<crate::sink::HelperState>, f64), SinkError> {
                tokio::task::yield_now().await;
                self.inner.helper_state(key).await
            }
            async fn helper_states(&self, q: &HelperQuery<'_>) -> Result<crate::sink::HelperStates, SinkError> {
                tokio::task::yield_now().await;
                self.inner.helper_states(q).await
            }
            async fn count_transitions(&self, w: &crate::sink::TransitionWrite<'_>) -> Result<Option<f64>, SinkError> {
                tokio::task::yield_now().await;
                tokio::time::sleep(self.stall()).await;
                self.inner.count_transitions(w).await
            }
            async fn settle_count(&self, w: &crate::sink::SettleWrite<'_>) -> Result<Option<f64>, SinkError> {
                tokio::task::yield_now().await;
                self.inner.settle_count(w).await
            }
            async fn register_expiry(&self, p: &crate::sink::expiry::Pending) -> Result<f64, SinkError> {
                self.inner.register_expiry(p).await
            }
            async fn due_expiries(&self, q: &crate::sink::expiry::DueQuery<'_>) -> Result<Vec<crate::sink::expiry::Pending>, SinkError> {
                self.inner.due_expiries(q).await
            }
            async fn remove_expired(&self, p: &crate::sink::expiry::Pending) -> Result<bool, SinkError> {
                self.inner.remove_expired(p).await
            }
        };
    }

    /// A store whose every call yields first, so concurrent derivations interleave call by
    /// call (the memory store answers at once), and which refuses writes of one attribute.
    #[derive(Default)]
    struct Interleaved {
        inner: MemoryAggregates,
        refuse: Option<&'static str>,
        /// Before each write of several attributes, another derivation of one of them lands.
        race_chunks: bool,
        raced: std::sync::atomic::AtomicUsize,
        /// How long each `distinct` transaction takes to arrive (a paused process).
        stall: Duration,
    }

    impl Interleaved {
        fn stall(&self) -> Duration {
            self.stall
        }
    }

    impl AggregateStore for Interleaved {
        async fn apply(&self, w: &crate::sink::LedgerWrite) -> Result<crate::sink::WriteOutcome, SinkError> {
            tokio::task::yield_now().await;
            self.inner.apply(w).await
        }
        async fn live_helpers(&self, q: &HelperQuery<'_>) -> Result<crate::sink::LiveHelpers, SinkError> {
            tokio::task::yield_now().await;
            self.inner.live_helpers(q).await
        }
        async fn derivation_counters(&self, key: &[(String, String)], names: &DerivationNames) -> Result<crate::sink::Counters, SinkError> {
            tokio::task::yield_now().await;
            self.inner.derivation_counters(key, names).await
        }
        async fn lower_cursor(
            &self,
            key: &[(String, String)],
            attribute: &str,
            to: Option<&str>,
            scan: HelperScan,
        ) -> Result<(), SinkError> {
            tokio::task::yield_now().await;
            self.inner.lower_cursor(key, attribute, to, scan).await
        }
        async fn set_derived(&self, w: &DerivedWrite<'_>) -> Result<Option<f64>, SinkError> {
            tokio::task::yield_now().await;
            if w.values.iter().any(|d| Some(d.name.as_str()) == self.refuse) {
                return Err(SinkError::Invalid("Item size has exceeded the maximum allowed size".into()));
            }
            if self.race_chunks && w.values.len() > 1 {
                // Another derivation of one of these attributes lands first, a different one
                // each time.
                let n = self.raced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let d = &w.values[n % w.values.len()];
                let names =
                    DerivationNames { counters: String::new(), cursors: "\u{0}".into(), counts: "\u{1}".into(), walked: "\u{2}".into() };
                let seen = self.inner.derivation_counters(w.key, &names).await?.values.remove(&d.counter);
                let other = Derived { seen, ..d.clone() };
                assert!(self.inner.set_derived(&DerivedWrite { key: w.key, values: &[other] }).await?.is_some());
            }
            self.inner.set_derived(w).await
        }
        async fn expire_helper(
            &self,
            key: &[(String, String)],
            attribute: &str,
            at: u64,
            version: (&str, Option<&str>),
        ) -> Result<bool, SinkError> {
            self.inner.expire_helper(key, attribute, at, version).await
        }
        distinct_calls!();
    }

    /// `n` helpers of `measure` (a max) under the profile, valued 1..=n.
    fn put_helpers(store: &MemoryAggregates, measure: &str, n: i64) {
        for v in 1..=n {
            let sk = format!("{}{}", helper::prefix("PROFILE", measure), Derive::Max.tail(&Scalar::N(Decimal::from_i64(v)), None));
            store.put(&["CUST#c1", &sk], helper::REFS, MemValue::Num(Decimal::ONE));
        }
    }

    fn target_of(measures: impl IntoIterator<Item = String>) -> DeriveTarget {
        let key = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into_boxed_slice());
        DeriveTarget {
            key,
            measures: measures.into_iter().map(|m| (m, Derive::Max)).collect(),
            raised: BTreeMap::new(),
            touched: BTreeMap::new(),
        }
    }

    /// The tail of the `activeDays` (a `distinct`) helper of day `d`.
    fn day(d: i64) -> String {
        Derive::Distinct.tail(&Scalar::N(Decimal::from_i64(d)), None)
    }

    /// Sets the count of the `activeDays` helper of day `d` in place.
    fn set_day(store: &MemoryAggregates, d: i64, refs: i64) {
        let sk = format!("{}{}", helper::prefix("PROFILE", "activeDays"), day(d));
        store.put(&["CUST#c1", &sk], helper::REFS, MemValue::Num(Decimal::from_i64(refs)));
    }

    /// Sixteen shards raise a day each and derive at once, beside two reconciles that walk
    /// every helper; then half the days close, derived as concurrently. Each time the days
    /// equal the live helpers.
    #[tokio::test]
    async fn concurrent_transitions_and_walks_of_one_distinct_count_stay_exact() {
        let store = Interleaved::default();
        let (key_names, ledger) = (["PK".to_string(), "SK".to_string()], Ledger::new("t"));
        let set = |d: i64, refs: i64| set_day(&store.inner, d, refs);
        let target = |days: Option<i64>| {
            let mut t = target_of([]);
            t.measures.insert("activeDays".into(), Derive::Distinct);
            if let Some(d) = days {
                t.touched.insert("activeDays".into(), Touched::Helpers([day(d)].into()));
            }
            t
        };
        for (round, live) in [(0, 16), (1, 8)] {
            for d in 0..16 {
                set(d, i64::from(d < live));
            }
            let targets: Vec<DeriveTarget> = (0..16).map(|d| target(Some(d))).chain([target(None), target(None)]).collect();
            let results = futures::future::join_all(targets.iter().map(|t| derive_target(&store, &key_names, &ledger, t, None))).await;
            assert!(results.iter().all(Result::is_ok), "round {round}: {results:?}");
            let profile = store.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
            assert_eq!(profile.get("activeDays"), Some(&MemValue::Num(Decimal::from_i64(live))), "round {round}");
        }
    }

    /// A derivation that lowers 30 `distinct` helpers writes two transactions (24, then 6),
    /// and the process pauses an hour before the first arrives. The second's expiry is taken
    /// at its own time, an hour later: a helper raised and lowered again meanwhile holds
    /// records created after the derivation read it (the transition's condition cannot see
    /// them), and an expiry from the read would delete it an hour too early.
    #[tokio::test(start_paused = true)]
    async fn each_distinct_transaction_takes_its_expiry_from_its_own_time() {
        crate::state::simulate_clock(Some(1_764_460_800_000));
        let store = Interleaved::default();
        let (key_names, ledger) = (["PK".to_string(), "SK".to_string()], Ledger::new("t"));
        let (tail, set) = (day, |d: i64, refs: i64| set_day(&store.inner, d, refs));
        let mut target = target_of([]);
        target.measures.insert("activeDays".into(), Derive::Distinct);
        target.touched.insert("activeDays".into(), Touched::Helpers((0..30).map(tail).collect()));
        for d in 0..30 {
            set(d, 1);
        }
        derive_target(&store, &key_names, &ledger, &target, None).await.unwrap();
        for d in 0..30 {
            set(d, 0);
        }
        let stalling = Interleaved { inner: store.inner, stall: Duration::from_secs(3600), ..Interleaved::default() };
        let expiry = Expiry::new("expiresAt");
        let read_at = expiry.at(crate::state::now_ms());
        derive_target(&stalling, &key_names, &ledger, &target, Some(&expiry)).await.unwrap();
        let mut expiries: BTreeMap<u64, usize> = BTreeMap::new();
        for d in 0..30 {
            let sk = format!("{}{}", helper::prefix("PROFILE", "activeDays"), tail(d));
            let item = stalling.inner.item(&["CUST#c1", &sk]).unwrap();
            let Some(MemValue::Num(at)) = item.get("expiresAt") else { panic!("day {d} has no expiry: {item:?}") };
            *expiries.entry(at.to_string().parse().unwrap()).or_default() += 1;
        }
        let profile = stalling.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile.get("activeDays"), None, "no day counted");
        assert_eq!(expiries, BTreeMap::from([(read_at, 24), (read_at + 3600, 6)]), "the second transaction's expiry is an hour later");
        crate::state::simulate_clock(None);
    }

    /// A hot target: 64 shards derive it at once. Each writes at most twice (it lands, or two
    /// others land after its first read and cover it), where waiting for a landing of its own
    /// lost 32 rounds and failed its batch.
    #[tokio::test]
    async fn sixty_four_concurrent_derivations_of_one_target_each_write_at_most_twice() {
        let store = Interleaved::default();
        put_helpers(&store.inner, "largestOrder", 5);
        let target = target_of(["largestOrder".to_string()]);
        let key_names = ["PK".to_string(), "SK".to_string()];
        let ledger = Ledger::new("t");
        let runs = (0..64).map(|_| derive_target(&store, &key_names, &ledger, &target, None));
        let results = futures::future::join_all(runs).await;
        let mut covered = 0;
        for r in results {
            let stats = r.expect("every derivation finishes");
            assert!(stats.writes <= 2, "{stats:?}");
            assert_eq!(stats.landed + stats.covered, 1, "{stats:?}");
            covered += stats.covered;
        }
        assert!(covered > 0, "some were covered by others' landings");
        let profile = store.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile.get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(5))));
    }

    /// 70 templated attributes: three writes of at most 32, and one the table refuses is
    /// counted without holding back the others, those of its own chunk included.
    #[tokio::test]
    async fn many_attributes_are_written_in_chunks_and_a_refused_one_does_not_fail_the_rest() {
        let store = Interleaved { refuse: Some("largest_s69"), ..Interleaved::default() };
        let names: Vec<String> = (0..70).map(|i| format!("largest_s{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            put_helpers(&store.inner, n, 1 + i as i64);
        }
        let stats = derive_target(&store, &["PK".to_string(), "SK".to_string()], &Ledger::new("t"), &target_of(names.clone()), None)
            .await
            .expect("a refused chunk does not fail the derivation");
        let last_chunk = 70 - 2 * MEASURES_PER_WRITE;
        assert_eq!((stats.writes, stats.landed), (3 + last_chunk as u64, 2 + last_chunk as u64 - 1), "{stats:?}");
        let refused: Vec<String> = stats.refused.iter().flat_map(|(names, _)| names.clone()).collect();
        assert_eq!(refused, ["largest_s69"], "the refused chunk is split: its other attributes land");
        let profile = store.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
        for (i, n) in names.iter().enumerate() {
            let expected = (!refused.contains(n)).then(|| MemValue::Num(Decimal::from_i64(1 + i as i64)));
            assert_eq!(profile.get(n), expected.as_ref(), "{n}");
        }
    }

    /// Six attributes in one write, and before every such write a derivation of just one of
    /// them lands: together they would lose up to twelve rounds (each loss moves one counter
    /// once). Written one by one after the first loss, they all land in the next round.
    #[tokio::test]
    async fn attributes_of_a_chunk_that_lost_are_written_one_by_one() {
        let store = Interleaved { race_chunks: true, ..Interleaved::default() };
        let names: Vec<String> = (0..6).map(|i| format!("largest_s{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            put_helpers(&store.inner, n, 1 + i as i64);
        }
        let stats = derive_target(&store, &["PK".to_string(), "SK".to_string()], &Ledger::new("t"), &target_of(names.clone()), None)
            .await
            .expect("no batch fails on a busy target");
        assert_eq!((stats.writes, stats.lost, stats.landed), (7, 1, 6), "{stats:?}");
        let profile = store.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
        for (i, n) in names.iter().enumerate() {
            assert_eq!(profile.get(n), Some(&MemValue::Num(Decimal::from_i64(1 + i as i64))), "{n}");
        }
    }

    /// A counter someone overwrote with a string is refused at once (counted, logged), not
    /// lost to a race round after round until the batch fails.
    #[tokio::test]
    async fn a_counter_that_is_not_a_number_is_refused_not_raced() {
        let store = MemoryAggregates::new();
        put_helpers(&store, "largestOrder", 3);
        store.put(&["CUST#c1", "PROFILE"], "_aggd:t:largestOrder", MemValue::Str("x".into()));
        let target = target_of(["largestOrder".to_string()]);
        let stats = derive_target(&store, &["PK".to_string(), "SK".to_string()], &Ledger::new("t"), &target, None).await.unwrap();
        assert_eq!((stats.writes, stats.lost), (1, 0), "{stats:?}");
        assert_eq!(stats.refused.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), [vec!["largestOrder".to_string()]]);
    }

    const OPEN_ORDERS: &str = r#"
source: { table: orders }
state: { table: state }
aggregates: { table: aggregates }
rules:
  - name: open-orders
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures:
      oldestOpen: { min: createdAt, where: { status: { S: [OPEN] } } }
      lastStatus: { latest: status, by: updatedAt }
"#;

    /// Order `id` of c1, created at `id`, changed at `at` from `old` (None: inserted) to
    /// `new` status.
    fn change(id: u32, at: u32, old: Option<&str>, new: &str) -> serde_json::Value {
        let image = |status: &str| {
            serde_json::json!({"PK": {"S": "CUST#c1"}, "SK": {"S": format!("ORDER#o{id:06}")},
                "status": {"S": status}, "createdAt": {"N": id.to_string()}, "updatedAt": {"N": at.to_string()}})
        };
        let mut d = serde_json::json!({"Keys": {"PK": {"S": "CUST#c1"}, "SK": {"S": format!("ORDER#o{id:06}")}},
            "NewImage": image(new), "SequenceNumber": format!("{at:021}"), "StreamViewType": "NEW_AND_OLD_IMAGES"});
        if let Some(old) = old {
            d["OldImage"] = image(old);
        }
        serde_json::json!({"eventName": if old.is_some() { "MODIFY" } else { "INSERT" }, "dynamodb": d})
    }

    /// Orders open and close for ever, one at a time and oldest first: every close leaves a
    /// zero-count helper below the oldest open order, and one below the last status. Returns
    /// the items the derivations of steps `from..to` read, and their queries.
    async fn open_and_close(store: &MemoryAggregates, e: &Engine, steps: std::ops::Range<u32>) -> (u64, u64) {
        let ctx = crate::sink::ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000000-00000001");
        let (mut read, mut queries) = (0, 0);
        for i in steps {
            // Order i opens and order i - 1 (opened one step before) closes.
            let mut records = vec![change(i, 2 * i + 1, None, "OPEN")];
            if i > 0 {
                records.push(change(i - 1, 2 * i + 2, Some("OPEN"), "CLOSED"));
            }
            let targets = batch(e, &records);
            for (k, d) in &targets {
                crate::sink::write_target(store, &e.key_names, k, d, &ctx).await.unwrap();
            }
            for t in targets_to_derive(e, &targets) {
                let stats = derive_target(store, &e.key_names, &Ledger::new("t"), &t, None).await.unwrap();
                let items: u64 = stats.reads.values().map(|r| r.1).sum();
                (read, queries) = (read + items, queries + stats.queries);
            }
            let profile = store.item(&["CUST#c1", "PROFILE"]).unwrap();
            assert_eq!(profile.get("oldestOpen"), Some(&MemValue::Num(Decimal::from_i64(i64::from(i)))), "step {i}");
            let last = if i > 0 { "CLOSED" } else { "OPEN" };
            assert_eq!(profile.get("lastStatus"), Some(&MemValue::Str(last.into())), "step {i}");
        }
        (read, queries)
    }

    /// Items read per derivation depend on the live helpers: a step after 2,000 closed orders
    /// reads what a step after 200 did.
    #[tokio::test]
    async fn derivations_read_the_same_after_ten_times_the_history() {
        let e = Config::from_yaml(OPEN_ORDERS, Vec::<(String, String)>::new()).unwrap().engine;
        let store = MemoryAggregates::new();
        open_and_close(&store, &e, 0..200).await;
        let early = open_and_close(&store, &e, 200..400).await;
        open_and_close(&store, &e, 400..2000).await;
        let late = open_and_close(&store, &e, 2000..2200).await;
        println!("items read, queries: steps 200..400 {early:?}, steps 2000..2200 {late:?}");
        assert_eq!(early.1, late.1, "one query per measure and step");
        assert_eq!(early, late, "items read: {early:?} then {late:?}");
        assert!(late.0 <= 3 * late.1, "at most three items a query: {late:?}");
    }

    fn min_helper(store: &MemoryAggregates, v: i64, refs: i64) {
        let sk = format!("{}{}", helper::prefix("PROFILE", "oldestOpen"), Derive::Min.tail(&Scalar::N(Decimal::from_i64(v)), None));
        store.put(&["CUST#c1", &sk], helper::REFS, MemValue::Num(Decimal::from_i64(refs)));
    }

    fn min_state(store: &MemoryAggregates, counter: i64, value: i64, cursor: i64) {
        let tail = |v: i64| Derive::Min.tail(&Scalar::N(Decimal::from_i64(v)), None);
        store.put(&["CUST#c1", "PROFILE"], "_aggd:t:oldestOpen", MemValue::Num(Decimal::from_i64(counter)));
        store.put(&["CUST#c1", "PROFILE"], "_aggk:t:oldestOpen", MemValue::Str(tail(cursor)));
        store.put(&["CUST#c1", "PROFILE"], "oldestOpen", MemValue::Num(Decimal::from_i64(value)));
    }

    /// What other derivations do between two calls of ours.
    type Step = Box<dyn FnOnce(&MemoryAggregates) + Send>;

    /// Runs `step` on the inner store right after the first counter read.
    struct AfterFirstRead {
        inner: MemoryAggregates,
        step: std::sync::Mutex<Option<Step>>,
    }

    impl AfterFirstRead {
        fn stall(&self) -> Duration {
            Duration::ZERO
        }
    }

    impl AggregateStore for AfterFirstRead {
        async fn apply(&self, w: &crate::sink::LedgerWrite) -> Result<crate::sink::WriteOutcome, SinkError> {
            self.inner.apply(w).await
        }
        async fn live_helpers(&self, q: &HelperQuery<'_>) -> Result<crate::sink::LiveHelpers, SinkError> {
            self.inner.live_helpers(q).await
        }
        async fn derivation_counters(&self, key: &[(String, String)], names: &DerivationNames) -> Result<crate::sink::Counters, SinkError> {
            let read = self.inner.derivation_counters(key, names).await;
            let step = self.step.lock().unwrap().take();
            if let Some(step) = step {
                step(&self.inner);
            }
            read
        }
        async fn lower_cursor(
            &self,
            key: &[(String, String)],
            attribute: &str,
            to: Option<&str>,
            scan: HelperScan,
        ) -> Result<(), SinkError> {
            self.inner.lower_cursor(key, attribute, to, scan).await
        }
        async fn set_derived(&self, w: &DerivedWrite<'_>) -> Result<Option<f64>, SinkError> {
            self.inner.set_derived(w).await
        }
        async fn expire_helper(&self, k: &[(String, String)], a: &str, at: u64, v: (&str, Option<&str>)) -> Result<bool, SinkError> {
            self.inner.expire_helper(k, a, at, v).await
        }
        distinct_calls!();
    }

    fn min_target(raised: i64) -> DeriveTarget {
        let key = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into_boxed_slice());
        let tail = Derive::Min.tail(&Scalar::N(Decimal::from_i64(raised)), None);
        DeriveTarget {
            key,
            measures: BTreeMap::from([("oldestOpen".to_string(), Derive::Min)]),
            raised: BTreeMap::from([("oldestOpen".to_string(), Raised::Tail(tail))]),
            touched: BTreeMap::new(),
        }
    }

    /// Runs a derivation whose batch raised order 3, over `helpers` (value, count) and the
    /// target's (counter, value, cursor) `before`; right after its first read, two other
    /// derivations land, leaving `landings`. Returns its stats and the target's item.
    async fn raised_three(
        helpers: [(i64, i64); 3],
        before: (i64, i64, i64),
        landings: [(i64, i64, i64); 2],
    ) -> (DeriveStats, BTreeMap<String, MemValue>) {
        let store = AfterFirstRead { inner: MemoryAggregates::new(), step: std::sync::Mutex::new(None) };
        for (v, refs) in helpers {
            min_helper(&store.inner, v, refs);
        }
        min_state(&store.inner, before.0, before.1, before.2);
        *store.step.lock().unwrap() = Some(Box::new(move |inner: &MemoryAggregates| {
            for (counter, value, cursor) in landings {
                min_state(inner, counter, value, cursor);
            }
        }));
        let key_names = ["PK".to_string(), "SK".to_string()];
        let stats = derive_target(&store, &key_names, &Ledger::new("t"), &min_target(3), None).await.unwrap();
        (stats, store.inner.item(&["CUST#c1", "PROFILE"]).unwrap())
    }

    /// Our write raised order 3 below the cursor (5). A derivation that queried before that
    /// write lands after our first read (cursor 9, it saw 5 closed), and one more lands from
    /// that cursor: two landings after our first read, neither of which saw 3. We must not
    /// count ourselves covered: we move the cursor back and land 3 ourselves.
    #[tokio::test]
    async fn landings_from_a_cursor_beyond_a_raised_helper_do_not_cover_it() {
        let (stats, profile) = raised_three([(3, 1), (5, 0), (9, 1)], (0, 5, 5), [(1, 9, 9), (2, 9, 9)]).await;
        assert_eq!((stats.covered, stats.lowered, stats.lost, stats.landed), (0, 1, 1, 1), "{stats:?}");
        assert_eq!(profile.get("oldestOpen"), Some(&MemValue::Num(Decimal::from_i64(3))));
        let cursor = Derive::Min.tail(&Scalar::N(Decimal::from_i64(3)), None);
        assert_eq!(profile.get("_aggk:t:oldestOpen"), Some(&MemValue::Str(cursor)));
    }

    /// Our first read sees the cursor at our raised helper (3). Then a derivation that queried
    /// before our write lands and moves the cursor past it (9), and one more lands from there.
    /// We move the cursor back, and the landings counted before that cannot cover us.
    #[tokio::test]
    async fn a_cursor_moved_past_a_raised_helper_after_our_first_read_restarts_the_count() {
        let (stats, profile) = raised_three([(3, 1), (5, 0), (9, 1)], (0, 9, 3), [(1, 9, 9), (2, 9, 9)]).await;
        assert_eq!((stats.covered, stats.lowered, stats.landed), (0, 1, 1), "{stats:?}");
        assert_eq!(profile.get("oldestOpen"), Some(&MemValue::Num(Decimal::from_i64(3))));
    }

    /// The same two landings, but both read a cursor at or before our raised helper: they saw
    /// it, and we are covered without landing.
    #[tokio::test]
    async fn landings_that_read_a_cursor_before_a_raised_helper_cover_it() {
        let (stats, _) = raised_three([(2, 1), (3, 1), (9, 1)], (0, 2, 2), [(1, 2, 2), (2, 2, 2)]).await;
        // Our one write read before they landed, and lost; the next read finds us covered.
        assert_eq!((stats.covered, stats.lost, stats.landed, stats.lowered), (1, 1, 0, 0), "{stats:?}");
    }

    /// 64 shards each raise their own new maximum and derive at once: every one finishes,
    /// and the value is the greatest of them.
    #[tokio::test]
    async fn sixty_four_concurrent_raises_each_above_the_cursor_end_at_the_greatest() {
        let store = Interleaved::default();
        put_helpers(&store.inner, "largestOrder", 5);
        let key_names = ["PK".to_string(), "SK".to_string()];
        let ledger = Ledger::new("t");
        derive_target(&store, &key_names, &ledger, &target_of(["largestOrder".to_string()]), None).await.unwrap();
        let targets: Vec<DeriveTarget> = (6..70)
            .map(|v| {
                let tail = Derive::Max.tail(&Scalar::N(Decimal::from_i64(v)), None);
                let sk = format!("{}{tail}", helper::prefix("PROFILE", "largestOrder"));
                store.inner.put(&["CUST#c1", &sk], helper::REFS, MemValue::Num(Decimal::ONE));
                let mut t = target_of(["largestOrder".to_string()]);
                t.raised.insert("largestOrder".into(), Raised::Tail(tail));
                t
            })
            .collect();
        let results = futures::future::join_all(targets.iter().map(|t| derive_target(&store, &key_names, &ledger, t, None))).await;
        for r in results {
            let stats = r.expect("every derivation finishes");
            assert!(stats.writes <= 3, "{stats:?}");
        }
        let profile = store.inner.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile.get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(69))));
    }
}
