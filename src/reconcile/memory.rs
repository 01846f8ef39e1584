//! The reconcile traits over in-memory tables: for property tests and the simulation.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::protocol::{Correction, Placement, Removal, SourceItems, TargetItem, TargetStore};
use super::report::Stored;
use super::truth::{is_target, Truth};
use super::{Options, ReconcileError};
use crate::decimal::Decimal;
use crate::rules::{Rule, TargetKey};
use crate::sink::derive::DeriveTarget;
use crate::sink::expiry::ExpiryChange;
use crate::sink::ledger::Ledger;
use crate::sink::memory::{MemValue, MemoryAggregates};

/// The aggregates table as reconcile sees it, over [`MemoryAggregates`].
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
    fn item(&self, key: &[String]) -> TargetItem {
        let parts: Vec<&str> = key.iter().map(String::as_str).collect();
        let Some(item) = self.store.item(&parts) else { return TargetItem::default() };
        let mut t = TargetItem { exists: true, ..Default::default() };
        for (name, v) in item {
            if name == self.ledger.version_attribute() {
                if let MemValue::Num(n) = v {
                    t.version = Some(n.to_string());
                }
            } else if name == self.ledger.measures_attribute() {
                if let MemValue::Set(names) = v {
                    t.written = names;
                }
            } else if name == self.ledger.floor_attribute() {
                if let MemValue::Str(f) = v {
                    t.floor = Some(f);
                }
            } else if name == self.ledger.hold_attribute() {
                if let MemValue::Str(h) = v {
                    t.hold = Some(h);
                }
            } else if name.starts_with(&self.ledger.log_prefix()) {
                if let MemValue::Str(l) = v {
                    t.logs.insert(name, l);
                }
            } else if name.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) {
                t.shared |= !self.ledger.is_own(&name);
            } else {
                let stored = match v {
                    MemValue::Num(n) => Stored::Number(n),
                    MemValue::Str(s) => Stored::Other(s),
                    MemValue::Set(s) => Stored::Other(format!("{s:?}")),
                    MemValue::Bin(b) => Stored::Other(format!("{b:?}")),
                };
                t.values.insert(name, stored);
            }
        }
        t
    }
}

impl TargetStore for MemoryTargets<'_> {
    async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
        Ok(self.item(&key_of(key)))
    }

    async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let mut out = BTreeMap::new();
        for k in self.store.keys() {
            let parts: Vec<&str> = k.iter().map(String::as_str).collect();
            if is_target(rule, &parts) {
                out.insert(TargetKey(k.iter().map(|s| Box::from(s.as_str())).collect()), self.item(&k));
            }
        }
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

    async fn hold(&self, key: &TargetKey, p: &Placement) -> Result<bool, ReconcileError> {
        let attributes = (self.ledger.version_attribute(), self.ledger.hold_attribute());
        Ok(self.store.hold_if(&key_of(key), (&attributes.0, &attributes.1), p.seen.as_deref(), &p.value, &p.stale))
    }

    async fn helpers(&self, rule: &Rule, owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let owner = key_of(owner);
        let Some((sk, rest)) = owner.split_last() else { return Ok(BTreeMap::new()) };
        let prefix = format!("{sk}{}", crate::rules::helper::MARK);
        let mut out = BTreeMap::new();
        for k in self.store.keys_with_prefix(rest, &prefix) {
            let parts: Vec<&str> = k.iter().map(String::as_str).collect();
            if is_target(rule, &parts) {
                out.insert(TargetKey(k.iter().map(|s| Box::from(s.as_str())).collect()), self.item(&k));
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

/// A source table in memory: items (typed DynamoDB JSON) by their key values.
#[derive(Debug, Default)]
pub struct MemorySources {
    /// The table's key attributes, partition key first.
    pub key_names: Vec<String>,
    items: Mutex<BTreeMap<Vec<String>, Map<String, Value>>>,
}

impl MemorySources {
    pub fn new(key_names: Vec<String>) -> MemorySources {
        MemorySources { key_names, items: Mutex::default() }
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
}

impl SourceItems for MemorySources {
    async fn query(&self, rule: &Rule, pk: &str, sk_prefix: Option<&str>, truth: &mut Truth) -> Result<(), ReconcileError> {
        let items: Vec<Map<String, Value>> = self
            .lock()
            .iter()
            .filter(|(k, _)| k.first().is_some_and(|p| p == pk) && sk_prefix.is_none_or(|s| k.get(1).is_some_and(|v| v.starts_with(s))))
            .map(|(_, i)| i.clone())
            .collect();
        for item in &items {
            truth.add_item(rule, &self.key_names, item);
        }
        Ok(())
    }

    async fn scan(&self, rule: &Rule, _opts: &Options, truth: &mut Truth) -> Result<(), ReconcileError> {
        for item in self.items() {
            truth.add_item(rule, &self.key_names, &item);
        }
        Ok(())
    }
}
