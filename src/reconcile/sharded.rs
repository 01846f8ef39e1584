//! Sharded targets (`write_shards`, [`crate::rules::shards`]) as reconcile and the fold see
//! them.
//!
//! [`Sharded`] presents each target of a sharded rule as one item to the reconcile protocol:
//! its values are the sums of its N sub-items, and its write counter is the sum of theirs.
//! Counters only grow, so the sum is unchanged between two reads exactly when every
//! sub-item's counter is: the protocol's proof (an unchanged counter from the snapshot to the
//! correction) carries over. A correction goes through sub-item 0: it sets
//! `v0 + (truth - sum)`, read again just before and conditioned on sub-item 0's counter being
//! as read. A record that lands on another sub-item after that read was created after the
//! truth read (every earlier one was applied before the comparison), so the truth does not
//! hold it, and its delta is kept, since the values add. A fence (a stream followed again)
//! is raised on every sub-item, each conditioned on its counter.
//!
//! The fold ([`fold`]) writes the sums of the N sub-items, read strongly consistent, onto the
//! unsuffixed target, with the sum of their counters as the fold's sequence, and only over a
//! lower one. A fold that read newer sub-items has a higher sequence, so an older fold never
//! overwrites a newer one, and once writes pause the last fold holds the truth.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use super::protocol::{Correction, Placement, Removal, TargetItem, TargetStore};
use super::report::Stored;
use super::ReconcileError;
use crate::decimal::Decimal;
use crate::rules::shards;
use crate::rules::{Rule, TargetKey};
use crate::sink::derive::DeriveTarget;

/// A sharded rule's targets over the aggregates table, for the reconcile protocol.
pub struct Sharded<'a, T> {
    inner: &'a T,
    n: u16,
    /// Targets read: folded once the rule's reconcile ends ([`Sharded::fold_read`]).
    read: Mutex<BTreeSet<TargetKey>>,
}

/// What one fold did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Folded {
    /// The total was written.
    Written,
    /// A fold that read newer sub-items (or the same) landed first.
    Superseded,
    /// No sub-item exists yet.
    Nothing,
}

/// The N sub-items of `key`, read strongly consistent, in index order.
async fn read_subs<T: TargetStore>(inner: &T, key: &TargetKey, n: u16) -> Result<Vec<TargetItem>, ReconcileError> {
    let reads = shards::sub_keys(key, n).into_iter().map(|k| async move { inner.read(&k).await });
    futures::future::try_join_all(reads).await
}

/// The sub-items as one item: values and counters summed, the lowest floor (absent if one
/// has none), measure names and flags joined. A value that is not a number in any sub-item
/// makes the sum one too (reported, never corrected).
pub fn summed(subs: &[TargetItem]) -> TargetItem {
    let mut out = TargetItem::default();
    let mut version: Option<Decimal> = None;
    let mut floor: Option<Option<String>> = None;
    for s in subs.iter().filter(|s| s.exists) {
        out.exists = true;
        out.shared |= s.shared;
        out.written.extend(s.written.iter().cloned());
        if let Some(v) = s.version.as_deref().and_then(|v| Decimal::parse(v).ok()) {
            version = Some(version.unwrap_or(Decimal::ZERO).checked_add(v).unwrap_or(Decimal::ZERO));
        }
        floor = Some(match floor {
            None => s.floor.clone(),
            Some(f) => f.zip(s.floor.clone()).map(|(a, b)| a.min(b)),
        });
        for (name, value) in &s.values {
            let sum = match (out.values.get(name), value) {
                (None, v) => v.clone(),
                (Some(Stored::Number(a)), Stored::Number(b)) => {
                    a.checked_add(*b).map(Stored::Number).unwrap_or_else(|e| Stored::Other(e.to_string()))
                }
                (Some(Stored::Other(o)), _) | (_, Stored::Other(o)) => Stored::Other(o.clone()),
                (Some(other), Stored::Missing) => other.clone(),
                (Some(Stored::Missing), v) => v.clone(),
            };
            out.values.insert(name.clone(), sum);
        }
    }
    out.version = version.map(|v| v.to_string());
    out.floor = floor.flatten();
    out
}

/// What a correction of the total (`c`, against the sum `sum`) writes on sub-item 0, whose
/// item is `first`: each attribute set to its value there plus the drift.
pub fn through_first(c: &Correction, sum: &TargetItem, first: &TargetItem) -> Result<Correction, ReconcileError> {
    let number = |item: &TargetItem, name: &str| match item.values.get(name) {
        None | Some(Stored::Missing) => Ok(Decimal::ZERO),
        Some(Stored::Number(n)) => Ok(*n),
        Some(Stored::Other(o)) => Err(ReconcileError::Data(format!("{name} holds {o:?}, not a number"))),
    };
    let mut set = Vec::with_capacity(c.set.len());
    for (name, truth) in &c.set {
        let drift = truth.checked_sub(number(sum, name)?).map_err(|e| ReconcileError::Data(format!("{name}: {e}")))?;
        let value = number(first, name)?.checked_add(drift).map_err(|e| ReconcileError::Data(format!("{name}: {e}")))?;
        set.push((name.clone(), value));
    }
    // The fence was found against the lowest floor of the sub-items; sub-item 0's own may be
    // higher, and a floor is never lowered (that would admit pruned shards again).
    let fence = c.fence.clone().filter(|f| first.floor.as_ref().is_none_or(|own| own < f));
    Ok(Correction { seen_version: first.version.clone(), set, fence, expect: Vec::new(), release: None })
}

/// Folds the sub-items of `key` into it.
pub async fn fold<T: TargetStore>(inner: &T, key: &TargetKey, n: u16) -> Result<Folded, ReconcileError> {
    let subs = read_subs(inner, key, n).await?;
    let sum = summed(&subs);
    let Some(seq) = sum.version.as_deref().and_then(|v| Decimal::parse(v).ok()) else { return Ok(Folded::Nothing) };
    let values: Vec<(String, Decimal)> =
        sum.values.iter().filter_map(|(name, v)| if let Stored::Number(n) = v { Some((name.clone(), *n)) } else { None }).collect();
    Ok(if inner.fold(key, &values, seq).await? { Folded::Written } else { Folded::Superseded })
}

impl<'a, T: TargetStore> Sharded<'a, T> {
    pub fn new(inner: &'a T, n: u16) -> Sharded<'a, T> {
        Sharded { inner, n, read: Mutex::default() }
    }

    fn note(&self, key: &TargetKey) {
        self.read.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone());
    }

    /// Folds every target this reconcile read; a failure is logged and left to the next fold.
    pub async fn fold_read(&self) {
        let keys: Vec<TargetKey> = std::mem::take(&mut *self.read.lock().unwrap_or_else(|e| e.into_inner())).into_iter().collect();
        for key in keys {
            if let Err(e) = fold(self.inner, &key, self.n).await {
                tracing::warn!(target = ?key.0, error = %e, "cannot fold a sharded target after reconciling it; the next write folds it");
            }
        }
    }
}

impl<T: TargetStore> TargetStore for Sharded<'_, T> {
    async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
        self.note(key);
        Ok(summed(&read_subs(self.inner, key, self.n).await?))
    }

    async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let mut groups: BTreeMap<TargetKey, Vec<TargetItem>> = BTreeMap::new();
        for (key, item) in self.inner.scan(rule).await? {
            match shards::parse(&key) {
                Some((owner, _)) => groups.entry(owner).or_default().push(item),
                // A total: reconciled (and folded again) even when its sub-items are gone.
                None => {
                    groups.entry(key).or_default();
                }
            }
        }
        let out: BTreeMap<TargetKey, TargetItem> = groups.into_iter().map(|(k, subs)| (k, summed(&subs))).collect();
        self.read.lock().unwrap_or_else(|e| e.into_inner()).extend(out.keys().cloned());
        Ok(out)
    }

    async fn correct(&self, key: &TargetKey, c: &Correction) -> Result<bool, ReconcileError> {
        if c.release.is_some() {
            return Err(ReconcileError::Data("a sharded target is never held".into()));
        }
        if !c.expect.is_empty() {
            // Old definitions are retired over the table itself (`retire_rule`): their
            // sub-items are items with counters of their own, and their totals are reset.
            return Err(ReconcileError::Data("a sharded target is not retired as a whole".into()));
        }
        let subs = read_subs(self.inner, key, self.n).await?;
        let sum = summed(&subs);
        if sum.version != c.seen_version {
            return Ok(false);
        }
        if let Some(fence) = &c.fence {
            for (i, sub) in (1..self.n).zip(&subs[1..]) {
                if sub.floor.as_ref().is_none_or(|f| f < fence) {
                    let raise = Correction {
                        seen_version: sub.version.clone(),
                        set: Vec::new(),
                        fence: Some(fence.clone()),
                        expect: Vec::new(),
                        release: None,
                    };
                    if !self.inner.correct(&shards::sub_key(key, i), &raise).await? {
                        return Ok(false);
                    }
                }
            }
        }
        let Some(first) = subs.first() else { return Ok(false) };
        let write = through_first(c, &sum, first)?;
        if write.set.is_empty() && write.fence.is_none() {
            return Ok(true);
        }
        self.inner.correct(&shards::sub_key(key, 0), &write).await
    }

    async fn helpers(&self, _rule: &Rule, _owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        // A sharded rule has no helper measure (the config refuses them).
        Ok(BTreeMap::new())
    }

    async fn derive(&self, _key_names: &[String], _target: &DeriveTarget) -> Result<(), ReconcileError> {
        Ok(())
    }

    async fn remove(&self, _key: &TargetKey, _r: &Removal) -> Result<bool, ReconcileError> {
        // Leftovers are removed over the table itself (`remove_leftovers`), sub-item by sub-item.
        Err(ReconcileError::Data("a sharded target is not removed as a whole".into()))
    }

    async fn hold(&self, _key: &TargetKey, _p: &Placement) -> Result<bool, ReconcileError> {
        // Each sub-item takes about 1/N of the shards' writes: no hold is placed.
        Ok(false)
    }

    async fn fold(&self, key: &TargetKey, values: &[(String, Decimal)], seq: Decimal) -> Result<bool, ReconcileError> {
        self.inner.fold(key, values, seq).await
    }

    async fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> Result<bool, ReconcileError> {
        self.inner.reset_fold(key, zero).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::reconcile::memory::MemoryTargets;
    use crate::sink::ledger::Ledger;
    use crate::sink::memory::{MemValue, MemoryAggregates};

    fn rules(shards: Option<u16>) -> Vec<Rule> {
        let mut text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        if let Some(n) = shards {
            text = text.replace(r#"SK: "TOTAL" }"#, &format!(r#"SK: "TOTAL", write_shards: {n} }}"#));
        }
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn total() -> TargetKey {
        TargetKey(["SALES#2026-11-30", "TOTAL"].map(Box::from).into())
    }

    fn item(values: &[(&str, i64)], version: Option<i64>, floor: Option<&str>) -> TargetItem {
        TargetItem {
            exists: true,
            values: values.iter().map(|(a, v)| (a.to_string(), Stored::Number(Decimal::from_i64(*v)))).collect(),
            version: version.map(|v| v.to_string()),
            floor: floor.map(str::to_string),
            ..TargetItem::default()
        }
    }

    /// The sum of the sub-items is the stored value; the drift goes to sub-item 0 on top of
    /// its own value; a fence found against another sub-item's lower floor never lowers sub-item
    /// 0's own.
    #[test]
    fn a_correction_adds_the_drift_to_sub_item_0_and_never_lowers_its_floor() {
        let subs = [item(&[("orders", 5)], Some(3), Some("f9")), item(&[("orders", 7)], Some(2), None)];
        let sum = summed(&subs);
        assert_eq!(
            (sum.values["orders"].clone(), sum.version.as_deref(), sum.floor.as_deref()),
            (Stored::Number(Decimal::from_i64(12)), Some("5"), None)
        );
        let c = Correction {
            seen_version: Some("5".into()),
            set: vec![("orders".into(), Decimal::from_i64(10))],
            fence: Some("f5".into()),
            expect: vec![],
            release: None,
        };
        let w = through_first(&c, &sum, &subs[0]).unwrap();
        assert_eq!((w.set, w.seen_version.as_deref(), w.fence), (vec![("orders".to_string(), Decimal::from_i64(3))], Some("3"), None));
        let higher = Correction { fence: Some("fa".into()), ..c };
        assert_eq!(through_first(&higher, &sum, &subs[0]).unwrap().fence.as_deref(), Some("fa"));
    }

    /// Only a sharded rule's reconcile sees sub-items (an unsharded template that could match
    /// one never claims it); the totals are its targets too.
    #[test]
    fn sub_items_are_targets_of_their_sharded_rule_only() {
        let (plain, sharded) = (rules(None), rules(Some(4)));
        let sub = ["SALES#2026-11-30#_agg#w3", "TOTAL"];
        assert!(crate::reconcile::truth::is_target(&sharded[1], &sub));
        assert!(!crate::reconcile::truth::is_target(&sharded[1], &["SALES#2026-11-30#_agg#w4", "TOTAL"]), "index past N");
        assert!(!crate::reconcile::truth::is_target(&plain[1], &sub));
        assert!(crate::reconcile::truth::is_target(&sharded[1], &["SALES#2026-11-30", "TOTAL"]));
    }

    /// A sharded rule removed: its sub-items are zeroed as any target, and its totals (no
    /// counter: folds write them) get their values zeroed and their fold sequence removed, so a
    /// rule added again later, whose sub-items count from 1, folds over them.
    #[tokio::test]
    async fn a_removed_sharded_rule_leaves_its_totals_at_zero_and_foldable() {
        let (store, ledger) = (MemoryAggregates::new(), Ledger::new("t"));
        let targets = MemoryTargets { store: &store, ledger: ledger.clone(), expiry: None };
        for (i, orders) in [(0u16, 5i64), (2, 7)] {
            let k = shards::sub_key(&total(), i);
            let parts: Vec<&str> = k.0.iter().map(|p| &**p).collect();
            store.put(&parts, "orders", MemValue::Num(Decimal::from_i64(orders)));
            store.put(&parts, &ledger.version_attribute(), MemValue::Num(Decimal::from_i64(40)));
        }
        assert_eq!(fold(&targets, &total(), 4).await.unwrap(), Folded::Written);
        let read = |a: &str| store.item(&["SALES#2026-11-30", "TOTAL"]).and_then(|i| i.get(a).cloned());
        assert_eq!(read("orders"), Some(MemValue::Num(Decimal::from_i64(12))));
        let sharded = rules(Some(4));
        let current = vec![sharded[0].clone()];
        crate::reconcile::protocol::retire_rule(&targets, &sharded[1], &current).await.unwrap();
        assert_eq!(read("orders"), Some(MemValue::Num(Decimal::ZERO)), "the total is zeroed");
        assert_eq!(read(&ledger.fold_attribute()), None, "and its fold sequence removed");
        // The rule comes back; its first sub-item write has counter 1.
        let k = shards::sub_key(&total(), 1);
        let parts: Vec<&str> = k.0.iter().map(|p| &**p).collect();
        for i in [0u16, 2] {
            let s = shards::sub_key(&total(), i);
            store.delete_if(&s.0.iter().map(|p| p.to_string()).collect::<Vec<_>>(), &ledger.version_attribute(), "41");
        }
        store.put(&parts, "orders", MemValue::Num(Decimal::from_i64(1)));
        store.put(&parts, &ledger.version_attribute(), MemValue::Num(Decimal::from_i64(1)));
        assert_eq!(fold(&targets, &total(), 4).await.unwrap(), Folded::Written);
        assert_eq!(read("orders"), Some(MemValue::Num(Decimal::from_i64(1))));
    }
}
