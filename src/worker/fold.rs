//! Folding sharded totals (DESIGN.md, "Hot targets"): a write to a sub-item of a `write_shards`
//! rule marks its total as due; every `aggregates.fold_interval` each replica folds the totals
//! it marked ([`crate::reconcile::sharded::fold`]), so a total lags its sub-items by about one
//! interval. Folds from several replicas are safe together: a fold only lands over a lower fold
//! sequence. A replica killed before its fold round leaves its marks in the leases of the shards
//! that wrote them (each checkpoint records them), and the next owner folds them; a finished
//! shard's are taken over by its children's owners.

use std::collections::{BTreeMap, HashMap};

use futures::StreamExt;
use std::sync::Arc;

use crate::reconcile::protocol::TargetStore;
use crate::reconcile::sharded::{fold, Folded};
use crate::rules::TargetKey;
use crate::telemetry::names;

/// A total written since its last fold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub rule: Arc<str>,
    pub shards: u16,
    /// When its oldest write not yet folded landed (epoch ms).
    pub since_ms: u64,
}

/// The totals to fold, each with its oldest unfolded write, and per shard the totals its
/// writes left unfolded: a checkpoint records those in the shard's lease
/// ([`crate::state::Lease::fold_due`]), so an owner killed before its fold round leaves them
/// to the next owner, which would otherwise never see the writes again (they are before the
/// checkpoint it starts from).
#[derive(Debug, Default)]
pub struct Folds {
    inner: std::sync::Mutex<Inner>,
    /// Woken by a mark: an idle replica's fold loop sleeps until there is something to fold.
    marked: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Inner {
    due: BTreeMap<TargetKey, Due>,
    /// Shard -> total -> the mark number of its shard's latest write to it.
    by_shard: HashMap<String, BTreeMap<TargetKey, u64>>,
    /// Marks so far: a round takes every mark up to this one.
    marks: u64,
    /// Whether this round's overflow was logged (once a round, not once a write).
    overflow_logged: bool,
}

/// Most totals waiting for a fold; past it a new one waits for its next write (or the shard's
/// next owner: the lease still records it).
pub const MAX_DUE: usize = 100_000;

/// Most unfolded totals a lease records; the rest are folded by their next write or reconcile.
pub const MAX_LEASE_DUE: usize = 1_000;

/// Most bytes of unfolded totals a lease records: a key may take 3 KB, and the lease item
/// (written at every checkpoint, read by every replica's listing) stays far below DynamoDB's
/// 400 KB.
pub const MAX_LEASE_DUE_BYTES: usize = 64 * 1024;

impl Folds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `total` as written by `shard` at `now_ms` (its oldest unfolded write is kept).
    pub fn mark(&self, total: TargetKey, rule: &Arc<str>, shards: u16, shard: &str, now_ms: u64) {
        let mut inner = self.lock();
        inner.marks += 1;
        let mark = inner.marks;
        let pending = inner.by_shard.entry(shard.to_string()).or_default();
        if pending.len() < MAX_LEASE_DUE || pending.contains_key(&total) {
            pending.insert(total.clone(), mark);
        }
        if inner.due.len() < MAX_DUE || inner.due.contains_key(&total) {
            inner.due.entry(total).or_insert_with(|| Due { rule: rule.clone(), shards, since_ms: now_ms });
        } else if !std::mem::replace(&mut inner.overflow_logged, true) {
            // Kept in the shard's lease (up to MAX_LEASE_DUE), which its next owner folds.
            tracing::warn!(
                totals = inner.due.len(),
                "too many sharded totals wait for a fold: the next are left to their next write, or their shard's next owner"
            );
        }
        drop(inner);
        self.marked.notify_one();
    }

    /// Takes every mark, with the number of the last one.
    fn take(&self) -> (BTreeMap<TargetKey, Due>, u64) {
        let mut inner = self.lock();
        inner.overflow_logged = false;
        (std::mem::take(&mut inner.due), inner.marks)
    }

    /// `total` was folded after every mark up to `upto`: no shard's lease needs it any more,
    /// unless a shard wrote it since.
    fn folded(&self, total: &TargetKey, upto: u64) {
        let mut inner = self.lock();
        for pending in inner.by_shard.values_mut() {
            if pending.get(total).is_some_and(|m| *m <= upto) {
                pending.remove(total);
            }
        }
        // Shards come and go (a split every few hours on AWS): none is kept once empty.
        inner.by_shard.retain(|_, p| !p.is_empty());
    }

    /// Puts back a mark whose fold failed, keeping the older of two writes.
    fn put_back(&self, total: TargetKey, d: Due) {
        let mut inner = self.lock();
        let e = inner.due.entry(total).or_insert_with(|| d.clone());
        e.since_ms = e.since_ms.min(d.since_ms);
    }

    pub fn is_empty(&self) -> bool {
        self.lock().due.is_empty()
    }

    /// The totals `shard`'s writes left unfolded, as its lease records them (each key a JSON
    /// array of its values), at most [`MAX_LEASE_DUE_BYTES`] of them.
    pub fn due_for(&self, shard: &str) -> Vec<String> {
        let inner = self.lock();
        let keys = inner.by_shard.get(shard).into_iter().flat_map(|p| p.keys());
        let mut bytes = 0;
        keys.filter_map(|k| serde_json::to_string(&k.0).ok())
            .take_while(|t| {
                bytes += t.len();
                bytes <= MAX_LEASE_DUE_BYTES
            })
            .collect()
    }
}

/// The keys a lease's `fold_due` names (entries that are not a JSON array of text are skipped).
pub fn parse_due(due: &[String]) -> Vec<TargetKey> {
    due.iter()
        .filter_map(|t| serde_json::from_str::<Vec<String>>(t).ok())
        .map(|parts| TargetKey(parts.into_iter().map(String::into_boxed_str).collect()))
        .collect()
}

/// What one round did, per rule.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Round {
    pub written: u64,
    pub superseded: u64,
    pub failed: u64,
    /// Age of the oldest write the round folded, or failed to (ms).
    pub lag_ms: u64,
}

/// Folds every marked total; failed ones are marked again. Returns per rule what it did.
pub async fn fold_round<T: TargetStore>(targets: &T, folds: &Folds, now_ms: u64) -> BTreeMap<Arc<str>, Round> {
    let mut out: BTreeMap<Arc<str>, Round> = BTreeMap::new();
    let (due, upto) = folds.take();
    let results: Vec<(TargetKey, Due, Result<Folded, crate::reconcile::ReconcileError>)> = futures::stream::iter(due)
        .map(|(total, due)| async move {
            let r = fold(targets, &total, due.shards).await;
            (total, due, r)
        })
        .buffer_unordered(crate::reconcile::protocol::CONCURRENCY)
        .collect()
        .await;
    for (total, due, result) in results {
        let r = out.entry(due.rule.clone()).or_default();
        r.lag_ms = r.lag_ms.max(now_ms.saturating_sub(due.since_ms));
        match result {
            Ok(done) => {
                match done {
                    Folded::Written => r.written += 1,
                    Folded::Superseded | Folded::Nothing => r.superseded += 1,
                }
                folds.folded(&total, upto);
            }
            Err(e) => {
                tracing::warn!(rule = %due.rule, total = ?total.0, error = %e, "cannot fold a sharded total: tried again next round");
                r.failed += 1;
                folds.put_back(total, due);
            }
        }
    }
    out
}

/// Folds the sharded totals this replica wrote, at most every `interval` and only once one was
/// written, until `stop` (`run` folds once more after its last batches).
pub async fn run_folds<S, L, A, T: TargetStore>(
    shared: Arc<super::Shared<S, L, A>>,
    targets: Arc<T>,
    interval: std::time::Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let rules: Vec<Arc<str>> = shared.engine.rules.iter().filter(|r| r.write_shards.is_some()).map(|r| r.name.clone()).collect();
    record_round(&rules, &BTreeMap::new());
    loop {
        if shared.folds.is_empty() {
            record_round(&rules, &BTreeMap::new());
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = shared.folds.marked.notified() => {}
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let round = fold_round(&*targets, &shared.folds, crate::state::now_ms()).await;
        record_round(&rules, &round);
    }
}

/// Counts a round in the metrics: every sharded rule's lag is set (0 when it had nothing).
pub fn record_round(rules: &[Arc<str>], round: &BTreeMap<Arc<str>, Round>) {
    for rule in rules {
        let r = round.get(rule).cloned().unwrap_or_default();
        for (outcome, n) in [("written", r.written), ("superseded", r.superseded), ("failed", r.failed)] {
            metrics::counter!(names::FOLDS, "rule" => rule.to_string(), "outcome" => outcome).increment(n);
        }
        // Held: an idle replica sets it once, then waits for a write.
        crate::telemetry::held::set(names::FOLD_LAG, vec![("rule", rule.to_string())], r.lag_ms as f64 / 1000.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decimal::Decimal;
    use crate::reconcile::memory::MemoryTargets;
    use crate::rules::shards;
    use crate::sink::ledger::Ledger;
    use crate::sink::memory::{MemValue, MemoryAggregates};

    fn total() -> TargetKey {
        TargetKey(["SALES#2026-11-30", "TOTAL"].map(Box::from).into())
    }

    fn put(store: &MemoryAggregates, ledger: &Ledger, i: u16, orders: i64, version: i64) {
        let k = shards::sub_key(&total(), i);
        let parts: Vec<&str> = k.0.iter().map(|p| &**p).collect();
        store.put(&parts, "orders", MemValue::Num(Decimal::from_i64(orders)));
        store.put(&parts, &ledger.version_attribute(), MemValue::Num(Decimal::from_i64(version)));
    }

    fn folded(store: &MemoryAggregates, ledger: &Ledger) -> (Option<MemValue>, Option<MemValue>) {
        let item = store.item(&["SALES#2026-11-30", "TOTAL"]).unwrap_or_default();
        (item.get("orders").cloned(), item.get(&ledger.fold_attribute()).cloned())
    }

    /// A round folds the sub-items' sum with the sum of their counters; an older fold (a lower
    /// sequence) never lands over a newer one, and a mark's lag is its oldest write's age.
    #[tokio::test]
    async fn a_round_folds_the_sum_and_an_older_fold_never_lands_over_a_newer() {
        let (store, ledger) = (MemoryAggregates::new(), Ledger::new("t"));
        let targets = MemoryTargets { store: &store, ledger: ledger.clone(), expiry: None };
        put(&store, &ledger, 0, 5, 3);
        put(&store, &ledger, 3, 7, 2);
        let (folds, rule): (Folds, Arc<str>) = (Folds::default(), "daily".into());
        folds.mark(total(), &rule, 4, "s1", 1_000);
        folds.mark(total(), &rule, 4, "s2", 1_500);
        assert_eq!(folds.due_for("s1"), vec![r#"["SALES#2026-11-30","TOTAL"]"#.to_string()]);
        assert_eq!(parse_due(&folds.due_for("s2")), vec![total()]);
        let round = fold_round(&targets, &folds, 2_000).await;
        assert_eq!(round[&rule], Round { written: 1, superseded: 0, failed: 0, lag_ms: 1_000 });
        let n = |v: i64| Some(MemValue::Num(Decimal::from_i64(v)));
        assert_eq!(folded(&store, &ledger), (n(12), n(5)));
        assert!(folds.is_empty());
        assert!(folds.due_for("s1").is_empty() && folds.due_for("s2").is_empty(), "folded: no lease needs it");
        // A slow fold that read the sub-items before the last write lands after a newer one.
        put(&store, &ledger, 0, 6, 4);
        folds.mark(total(), &rule, 4, "s1", 3_000);
        fold_round(&targets, &folds, 3_000).await;
        assert_eq!(folded(&store, &ledger), (n(13), n(6)));
        assert!(!store.fold_if(
            &["SALES#2026-11-30".into(), "TOTAL".into()],
            &ledger.fold_attribute(),
            Decimal::from_i64(5),
            &[("orders".into(), Decimal::from_i64(12))]
        ));
        assert!(
            !store.fold_if(
                &["SALES#2026-11-30".into(), "TOTAL".into()],
                &ledger.fold_attribute(),
                Decimal::from_i64(6),
                &[("orders".into(), Decimal::from_i64(12))]
            ),
            "an equal sequence read the same sub-items"
        );
        assert_eq!(folded(&store, &ledger), (n(13), n(6)));
        // Nothing written to a total's sub-items yet: nothing to fold.
        let empty = TargetKey(["SALES#2026-12-01", "TOTAL"].map(Box::from).into());
        folds.mark(empty.clone(), &rule, 4, "s1", 3_000);
        assert_eq!(fold_round(&targets, &folds, 3_000).await[&rule].superseded, 1);
        assert!(store.item(&["SALES#2026-12-01", "TOTAL"]).is_none());
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    fn key(day: u32) -> TargetKey {
        TargetKey([format!("SALES#2026-11-{day:02}"), "TOTAL".to_string()].map(String::into_boxed_str).into())
    }

    /// A total written again after a round took its mark stays in the shard's lease until a
    /// later round folds it; a failed fold keeps it there; at most 1,000 per lease.
    #[test]
    fn a_lease_keeps_what_no_completed_fold_covered() {
        let (folds, rule): (Folds, Arc<str>) = (Folds::default(), "daily".into());
        folds.mark(key(1), &rule, 4, "s1", 0);
        folds.mark(key(2), &rule, 4, "s1", 0);
        let (_, upto) = folds.take();
        folds.mark(key(2), &rule, 4, "s1", 0); // written while the round folds
        folds.folded(&key(1), upto);
        folds.folded(&key(2), upto);
        assert_eq!(parse_due(&folds.due_for("s1")), vec![key(2)]);
        let (_, upto) = folds.take();
        folds.folded(&key(2), upto);
        assert!(folds.due_for("s1").is_empty() && folds.lock().by_shard.is_empty(), "an empty shard is not kept");
        for d in 0..1_200u32 {
            folds.mark(TargetKey([format!("T#{d}"), "X".to_string()].map(String::into_boxed_str).into()), &rule, 4, "s2", 0);
        }
        assert_eq!(folds.due_for("s2").len(), MAX_LEASE_DUE);
        // Long keys: the lease records at most 64 KB of them.
        let long = "x".repeat(2_000);
        for d in 0..100u32 {
            folds.mark(TargetKey([format!("{long}{d}"), "X".to_string()].map(String::into_boxed_str).into()), &rule, 4, "s3", 0);
        }
        let due = folds.due_for("s3");
        assert!(due.len() > 20 && due.iter().map(String::len).sum::<usize>() <= MAX_LEASE_DUE_BYTES, "{} keys", due.len());
        assert_eq!(parse_due(&["not json".to_string(), "[1]".to_string()]), Vec::<TargetKey>::new());
    }
}
