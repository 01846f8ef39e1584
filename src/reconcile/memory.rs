//! The reconcile traits over in-memory tables: for property tests and the simulation.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::future::BoxFuture;
use serde_json::{json, Map, Value};

use super::protocol::{Correction, Placement, Removal, SourceItems, TargetItem, TargetStore};
use super::report::Stored;
use super::truth::{is_target, Truth};
use super::{Options, ReconcileError};
use crate::decimal::Decimal;
use crate::rules::copy::{CopyChange, FindQuery, SortValue};
use crate::rules::{Rule, TargetKey};
use crate::sink::copy::{CopyFix, CopyOutcome, CopyStore, Corrected, Found, FoundPage, ItemKey};
use crate::sink::derive::DeriveTarget;
use crate::sink::expiry::ExpiryChange;
use crate::sink::ledger::Ledger;
use crate::sink::memory::{MemValue, MemoryAggregates};
use crate::sink::SinkError;

/// The aggregates table as reconcile sees it, over [`MemoryAggregates`].
/// Attempts of a throttled read of one item ([`MemoryAggregates::read_item`]).
pub const READ_ATTEMPTS: u32 = 10;

pub struct MemoryTargets<'a> {
    pub store: &'a MemoryAggregates,
    pub ledger: Ledger,
    /// The table's TTL attribute, as [`crate::sink::expiry`] uses it.
    pub expiry: Option<crate::sink::expiry::Expiry>,
}

fn key_of(key: &TargetKey) -> Vec<String> {
    key.0.iter().map(|s| s.to_string()).collect()
}

impl MemoryTargets<'_> {
    /// A strongly consistent read, throttled as the store's read limit says.
    fn item(&self, key: &[String]) -> Result<TargetItem, crate::sink::SinkError> {
        self.store.read_item(key, |item| item.map(|i| self.target_item(i)).unwrap_or_default())
    }

    /// An item as reconcile reads it, from the stored attributes (read in place, not cloned
    /// twice: a simulated reconcile of everything reads every item).
    fn target_item(&self, item: &BTreeMap<String, MemValue>) -> TargetItem {
        let mut t = TargetItem { exists: true, ..Default::default() };
        let l = &self.ledger;
        let (version, measures, floor, hold, logs) =
            (l.version_name(), l.measures_name(), l.floor_name(), l.hold_name(), l.log_prefix_name());
        for (name, v) in item {
            if name == version {
                if let MemValue::Num(n) = v {
                    t.version = Some(n.to_string());
                }
            } else if name == measures {
                if let MemValue::Set(names) = v {
                    t.written = names.clone();
                }
            } else if name == floor {
                if let MemValue::Str(f) = v {
                    t.floor = Some(f.clone());
                }
            } else if name == hold {
                if let MemValue::Str(h) = v {
                    t.hold = Some(h.clone());
                }
            } else if name.starts_with(logs) {
                if let MemValue::Str(l) = v {
                    t.logs.insert(name.clone(), l.clone());
                }
            } else if name.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) {
                t.shared |= !self.ledger.is_own(name);
            } else {
                let stored = match v {
                    MemValue::Num(n) => Stored::Number(*n),
                    MemValue::Str(s) => Stored::Other(s.clone()),
                    MemValue::Set(s) => Stored::Other(format!("{s:?}")),
                    MemValue::Bin(b) => Stored::Other(format!("{b:?}")),
                };
                t.values.insert(name.clone(), stored);
            }
        }
        t
    }
}

impl TargetStore for MemoryTargets<'_> {
    /// A throttled read is retried after a second, as the SDK retries a throttled GetItem, at
    /// most [`READ_ATTEMPTS`] times.
    async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
        let key = key_of(key);
        let mut attempt = 1;
        loop {
            match self.item(&key) {
                Err(crate::sink::SinkError::Throttled(_)) if attempt < READ_ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                done => return done.map_err(|e| ReconcileError::Aws(e.to_string())),
            }
        }
    }

    async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let mut out = BTreeMap::new();
        let wanted = |k: &[String]| is_target(rule, k);
        self.store.each_item(wanted, |k, item| {
            out.insert(TargetKey(k.iter().map(|s| Box::from(s.as_str())).collect()), self.target_item(item));
        });
        Ok(out)
    }

    async fn correct(&self, key: &TargetKey, c: &Correction) -> Result<bool, ReconcileError> {
        let (version, measures, hold) = (self.ledger.version_attribute(), self.ledger.measures_attribute(), self.ledger.hold_attribute());
        let fence = c.fence.as_ref().map(|f| [(self.ledger.floor_attribute(), f.clone()), (self.ledger.open_attribute(), ",".to_string())]);
        let mut remove = c.release.as_ref().map(|r| r.logs.clone()).unwrap_or_default();
        let change = crate::sink::expiry::after_correction(self.expiry.as_ref(), key, &c.set, crate::state::now_ms());
        if let Some(ExpiryChange::Remove { attribute }) = &change {
            remove.push(attribute.to_string());
        }
        let corrected = self.store.correct_if(
            &key_of(key),
            (&version, &measures),
            crate::sink::memory::Guard {
                seen: c.seen_version.as_deref(),
                expect: &c.expect,
                hold: c.release.as_ref().map(|r| (hold.as_str(), r.hold.as_str())),
            },
            &c.set,
            fence.as_ref().map_or(&[][..], |f| &f[..]),
            &remove,
        );
        // In the same write on DynamoDB; nothing runs in between here.
        if let (true, Some(ExpiryChange::Set { attribute, at })) = (corrected, change) {
            let parts: Vec<String> = key_of(key);
            let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
            self.store.put(&parts, attribute, MemValue::Num(Decimal::from_i64(i64::try_from(at).unwrap_or(i64::MAX))));
        }
        Ok(corrected)
    }

    async fn fold(&self, key: &TargetKey, values: &[(String, Decimal)], seq: Decimal) -> Result<bool, ReconcileError> {
        Ok(self.store.fold_if(&key_of(key), &self.ledger.fold_attribute(), seq, values))
    }

    async fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> Result<bool, ReconcileError> {
        Ok(self.store.reset_fold_if(&key_of(key), &self.ledger.fold_attribute(), zero))
    }

    async fn hold(&self, key: &TargetKey, p: &Placement) -> Result<bool, ReconcileError> {
        let attributes = (self.ledger.version_attribute(), self.ledger.hold_attribute());
        Ok(self.store.hold_if(&key_of(key), (&attributes.0, &attributes.1), p.seen.as_deref(), &p.value, &p.stale))
    }

    async fn helpers(&self, rule: &Rule, owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let owner = key_of(owner);
        let Some((sk, rest)) = owner.split_last() else { return Ok(BTreeMap::new()) };
        let prefix = format!("{sk}{}", crate::rules::helper::MARK);
        let mut out = BTreeMap::new();
        // A Query (its capacity is per page, not per item): not counted as reads of one item.
        for k in self.store.keys_with_prefix(rest, &prefix) {
            if is_target(rule, &k) {
                let item = self.store.with_item(&k, |item| item.map(|i| self.target_item(i)).unwrap_or_default());
                out.insert(TargetKey(k.iter().map(|s| Box::from(s.as_str())).collect()), item);
            }
        }
        Ok(out)
    }

    async fn derive(&self, key_names: &[String], target: &DeriveTarget) -> Result<(), ReconcileError> {
        crate::sink::derive::derive_target(self.store, key_names, &self.ledger, target, self.expiry.as_ref())
            .await
            .and_then(crate::sink::derive::DeriveStats::refused_as_error)
            .map_err(|e| ReconcileError::Aws(format!("deriving {:?}: {e}", target.key.0)))
    }

    async fn remove(&self, key: &TargetKey, r: &Removal) -> Result<bool, ReconcileError> {
        let version = self.ledger.version_attribute();
        Ok(match r {
            Removal::Item { seen_version } => self.store.delete_if(&key_of(key), &version, seen_version),
            Removal::Attributes(names) => self.store.remove_zeros_if(&key_of(key), (&version, &self.ledger.measures_attribute()), names),
        })
    }
}

/// A source table in memory: items (typed DynamoDB JSON) by their key values. It also holds
/// copy rules' copies ([`CopyStore`]).
#[derive(Debug, Default)]
pub struct MemorySources {
    /// The table's key attributes, partition key first.
    pub key_names: Vec<String>,
    items: Mutex<BTreeMap<Vec<String>, Map<String, Value>>>,
    /// Items a copy fan-out's query returns per page.
    pub page_size: usize,
    /// A copy write that would make an item larger than this (bytes of its JSON) is refused,
    /// as DynamoDB refuses 400 KB.
    pub max_item_bytes: usize,
}

impl MemorySources {
    pub fn new(key_names: Vec<String>) -> MemorySources {
        MemorySources { key_names, items: Mutex::default(), page_size: 100, max_item_bytes: 400 * 1024 }
    }

    /// The item with these key values.
    pub fn get(&self, key: &[String]) -> Option<Map<String, Value>> {
        self.lock().get(key).cloned()
    }

    /// The key values of a typed key (`{"PK": {"S": "x"}, ...}`), in key order.
    fn key_values(&self, key: &ItemKey) -> Vec<String> {
        self.key_names.iter().map(|k| key.get(k).and_then(|v| v.get("S")).and_then(Value::as_str).unwrap_or("").to_string()).collect()
    }

    fn typed_key(&self, values: &[String]) -> ItemKey {
        self.key_names.iter().zip(values).map(|(k, v)| (k.clone(), json!({ "S": v }))).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<String>, Map<String, Value>>> {
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn key(&self, item: &Map<String, Value>) -> Vec<String> {
        self.key_names.iter().map(|k| item.get(k).and_then(|v| v.get("S")).and_then(Value::as_str).unwrap_or("").to_string()).collect()
    }

    /// Puts (replaces) an item; returns the one it replaced.
    pub fn put(&self, item: Map<String, Value>) -> Option<Map<String, Value>> {
        let key = self.key(&item);
        self.lock().insert(key, item)
    }

    /// Deletes the item with these key values; returns it.
    pub fn delete(&self, key: &[String]) -> Option<Map<String, Value>> {
        self.lock().remove(key)
    }

    pub fn items(&self) -> Vec<Map<String, Value>> {
        self.lock().values().cloned().collect()
    }

    /// Sets `set`, removes `remove` and records `version` (attribute, text) on `item`, unless
    /// that makes it larger than `max_item_bytes` (the refusal, as DynamoDB words it); the
    /// write capacity it takes.
    fn patch(
        &self,
        item: &mut Map<String, Value>,
        set: &[(String, Value)],
        remove: &[String],
        version: Option<(&str, &str)>,
    ) -> Result<f64, String> {
        let mut next = item.clone();
        for name in remove {
            next.remove(name);
        }
        for (name, value) in set {
            next.insert(name.clone(), value.clone());
        }
        if let Some((attribute, text)) = version {
            next.insert(attribute.to_string(), json!({ "S": text }));
        }
        let size = serde_json::to_string(&next).map_or(0, |t| t.len());
        if size > self.max_item_bytes {
            return Err(format!("Item size has exceeded the maximum allowed size ({size} bytes)"));
        }
        *item = next;
        Ok(size.div_ceil(1024).max(1) as f64)
    }
}

impl CopyStore for MemorySources {
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        project: &'a [String],
        start: Option<&'a ItemKey>,
        limit: usize,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        Box::pin(async move {
            let size = self.page_size.max(1).min(limit.max(1));
            let after = start.map(|k| self.key_values(k));
            let sort_name = self.key_names.get(1);
            let items = self.lock();
            let from = vec![q.partition.1.clone()];
            let partition = items.range(from..).take_while(|(k, _)| k.first() == Some(&q.partition.1));
            let mut page = FoundPage::default();
            for (k, item) in partition.filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a)) {
                let sort = k.get(1).map(String::as_str).unwrap_or("");
                let meets = match &q.sort {
                    None => true,
                    Some((name, _)) if Some(name) != sort_name => false,
                    Some((_, SortValue::Equals(v))) => sort == v,
                    Some((_, SortValue::BeginsWith(p))) => sort.starts_with(p.as_str()),
                };
                if !meets || q.index.is_some() || q.partition.0 != self.key_names[0] {
                    continue;
                }
                if page.items.len() == size {
                    page.next = page.items.last().map(|f: &Found| f.key.clone());
                    break;
                }
                let version = item.get(version_attribute).and_then(|v| v.get("S")).and_then(Value::as_str).map(str::to_string);
                let values = project.iter().filter_map(|a| Some((a.clone(), item.get(a)?.clone()))).collect();
                page.items.push(Found { key: self.typed_key(k), version, values });
            }
            Ok(page)
        })
    }

    fn correct<'a>(
        &'a self,
        key: &'a ItemKey,
        fix: &'a CopyFix,
        version_attribute: &'a str,
        read: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Corrected, SinkError>> {
        Box::pin(async move {
            let mut items = self.lock();
            let Some(item) = items.get_mut(&self.key_values(key)) else { return Ok(Corrected::Changed) };
            if item.get(version_attribute).and_then(|v| v.get("S")).and_then(Value::as_str) != read {
                return Ok(Corrected::Changed);
            }
            match self.patch(item, &fix.set, &fix.remove, None) {
                Ok(capacity) => Ok(Corrected::Done { capacity }),
                Err(why) => Ok(Corrected::Rejected(why)),
            }
        })
    }

    fn source<'a>(&'a self, key: &'a ItemKey, _attributes: &'a [String]) -> BoxFuture<'a, Result<Option<Map<String, Value>>, SinkError>> {
        Box::pin(async move { Ok(self.get(&self.key_values(key))) })
    }

    fn write<'a>(
        &'a self,
        key: &'a ItemKey,
        change: &'a CopyChange,
        version_attribute: &'a str,
    ) -> BoxFuture<'a, Result<CopyOutcome, SinkError>> {
        Box::pin(async move {
            let mut items = self.lock();
            let Some(item) = items.get_mut(&self.key_values(key)) else { return Ok(CopyOutcome::Gone) };
            let version = change.version.text();
            let recorded = item.get(version_attribute).and_then(|v| v.get("S")).and_then(Value::as_str);
            if recorded.is_some_and(|r| *r >= *version) {
                return Ok(CopyOutcome::Older);
            }
            match self.patch(item, &change.set, &change.remove, Some((version_attribute, &version))) {
                Ok(capacity) => Ok(CopyOutcome::Written { capacity }),
                Err(why) => Ok(CopyOutcome::Rejected(why)),
            }
        })
    }
}

impl SourceItems for MemorySources {
    async fn query(&self, rule: &Rule, pk: &str, sk_prefix: Option<&str>, truth: &mut Truth) -> Result<(), ReconcileError> {
        // The partition's items are a range of the key order, as a Query reads them.
        let start: Vec<String> = std::iter::once(pk).chain(sk_prefix).map(str::to_string).collect();
        let items = self.lock();
        let partition = items.range(start..).take_while(|(k, _)| k.first().is_some_and(|p| p == pk));
        for (_, item) in partition.filter(|(k, _)| sk_prefix.is_none_or(|s| k.get(1).is_some_and(|v| v.starts_with(s)))) {
            truth.add_item(rule, &self.key_names, item);
        }
        Ok(())
    }

    async fn scan(&self, rule: &Rule, _opts: &Options, truth: &mut Truth) -> Result<(), ReconcileError> {
        // Read in place (a simulated reconcile of everything reads every item, per rule).
        for item in self.lock().values() {
            truth.add_item(rule, &self.key_names, item);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::Config;

    fn rule() -> Rule {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules.remove(0)
    }

    fn order(pk: &str, sk: &str) -> Map<String, Value> {
        json!({"PK": {"S": pk}, "SK": {"S": sk}, "status": {"S": "PAID"}, "total": {"N": "1"}}).as_object().cloned().unwrap()
    }

    /// Items read by a query of `pk` (and an `SK` prefix), as the truth counts them.
    async fn queried(sources: &MemorySources, pk: &str, prefix: Option<&str>) -> u64 {
        let mut truth = Truth::default();
        sources.query(&rule(), pk, prefix, &mut truth).await.unwrap();
        truth.items
    }

    #[tokio::test]
    async fn a_query_reads_its_partition_and_prefix_only() {
        let sources = MemorySources::new(vec!["PK".into(), "SK".into()]);
        for (pk, sk) in [
            ("CUST#c1", "ORDER#2026-11-30#o1"),
            ("CUST#c1", "ORDER#2026-12-01#o2"),
            ("CUST#c1", "NOTE#1"),
            ("CUST#c1", "PROFILE"),
            ("CUST#c10", "ORDER#2026-11-30#o3"),
            ("CUST#c2", "ORDER#2026-11-30#o4"),
            ("CUST#", "ORDER#2026-11-30#o5"),
        ] {
            sources.put(order(pk, sk));
        }
        // CUST#c10 sorts between CUST#c1 and CUST#c2, and CUST# before them all.
        assert_eq!(queried(&sources, "CUST#c1", Some("ORDER#")).await, 2);
        assert_eq!(queried(&sources, "CUST#c1", None).await, 4);
        assert_eq!(queried(&sources, "CUST#c10", Some("ORDER#")).await, 1);
        assert_eq!(queried(&sources, "CUST#", None).await, 1);
        assert_eq!(queried(&sources, "CUST#c3", None).await, 0);
        assert_eq!(queried(&sources, "CUST#c1", Some("ORDER#2026-12")).await, 1);
    }

    #[tokio::test]
    async fn a_query_of_a_hash_only_table_reads_the_one_item() {
        let sources = MemorySources::new(vec!["PK".into()]);
        for pk in ["CUST#c1", "CUST#c10", "CUST#c2"] {
            sources.put(order(pk, "ORDER#2026-11-30#o1"));
        }
        assert_eq!(queried(&sources, "CUST#c1", None).await, 1);
        assert_eq!(queried(&sources, "CUST#c1", Some("ORDER#")).await, 0, "a hash-only item has no sort key to match");
    }

    /// A read throttled over the store's read limit waits for the next second, as the SDK
    /// retries, and gives up after [`READ_ATTEMPTS`].
    #[tokio::test(start_paused = true)]
    async fn a_throttled_read_is_retried_the_next_second() {
        crate::state::simulate_clock(Some(1_764_460_800_000));
        let store = MemoryAggregates::new();
        store.put(&["SALES#d", "TOTAL"], "orders", MemValue::Num(Decimal::from_i64(3)));
        let targets = MemoryTargets { store: &store, ledger: Ledger::new("t"), expiry: None };
        let key = TargetKey(vec![Box::from("SALES#d"), Box::from("TOTAL")].into_boxed_slice());
        store.set_read_limit(Some(1.0));
        let started = tokio::time::Instant::now();
        for _ in 0..2 {
            let item = targets.read(&key).await.unwrap();
            assert_eq!(item.values.get("orders"), Some(&Stored::Number(Decimal::from_i64(3))));
        }
        assert_eq!(started.elapsed(), std::time::Duration::from_secs(1), "the second read waited for the next second");
        assert_eq!(store.take_read_figures().0, 1);
        store.set_read_limit(Some(0.5));
        assert!(matches!(targets.read(&key).await, Err(ReconcileError::Aws(_))), "every attempt throttled");
        assert_eq!(store.take_read_figures().0, u64::from(READ_ATTEMPTS));
        crate::state::simulate_clock(None);
    }

    /// What goes in comes back out, and the registry's item is kept but never counted.
    #[tokio::test]
    async fn items_come_back_as_they_were_put() {
        let sources = MemorySources::new(vec!["PK".into(), "SK".into()]);
        let (first, second) = (order("CUST#c1", "ORDER#2026-11-30#o1"), order("CUST#c1", "ORDER#2026-11-30#o1"));
        let mut second = second;
        second.insert("total".into(), json!({"N": "7"}));
        assert_eq!(sources.put(first.clone()), None);
        assert_eq!(sources.put(second.clone()), Some(first));
        let registry = json!({"PK": {"S": crate::registry::KEY}, "SK": {"S": crate::registry::KEY}}).as_object().cloned().unwrap();
        sources.put(registry.clone());
        assert_eq!(sources.items(), vec![registry.clone(), second.clone()], "in key order");
        let mut truth = Truth::default();
        sources.scan(&rule(), &Options::default(), &mut truth).await.unwrap();
        assert_eq!(truth.items, 1, "the registry's item is no source item");
        let key = |i: &Map<String, Value>| ["PK", "SK"].map(|k| i[k]["S"].as_str().unwrap().to_string()).to_vec();
        assert_eq!(sources.delete(&key(&registry)), Some(registry));
        assert_eq!(sources.delete(&key(&second)), Some(second));
        assert!(sources.items().is_empty());
    }
}
