//! An in-memory aggregate table with the same conditional ledger semantics, for unit tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::{AggregateStore, LedgerWrite, SinkError, WriteOutcome};
use crate::decimal::Decimal;
use crate::sink::ledger::FLOOR_ATTRIBUTE;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemValue {
    Num(Decimal),
    Str(String),
}

#[derive(Debug, Default)]
struct State {
    items: HashMap<Vec<String>, BTreeMap<String, MemValue>>,
    fail_next: u32,
    calls: u64,
}

#[derive(Debug, Default)]
pub struct MemoryAggregates {
    state: Mutex<State>,
}

impl MemoryAggregates {
    pub fn new() -> MemoryAggregates {
        MemoryAggregates::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numeric attributes of every item: (key values, attribute) -> value.
    pub fn numbers(&self) -> BTreeMap<(Vec<String>, String), Decimal> {
        let s = self.lock();
        let mut out = BTreeMap::new();
        for (k, item) in &s.items {
            for (a, v) in item {
                if let MemValue::Num(n) = v {
                    if !n.is_zero() {
                        out.insert((k.clone(), a.clone()), *n);
                    }
                }
            }
        }
        out
    }

    pub fn item(&self, key: &[&str]) -> Option<BTreeMap<String, MemValue>> {
        self.lock().items.get(&key.iter().map(|s| s.to_string()).collect::<Vec<_>>()).cloned()
    }

    /// Sets an attribute directly (e.g. a string where a counter should be).
    pub fn put(&self, key: &[&str], attr: &str, value: MemValue) {
        self.lock().items.entry(key.iter().map(|s| s.to_string()).collect()).or_default().insert(attr.to_string(), value);
    }

    /// The next `n` writes fail with a transient error.
    pub fn fail_next(&self, n: u32) {
        self.lock().fail_next = n;
    }

    pub fn calls(&self) -> u64 {
        self.lock().calls
    }
}

impl AggregateStore for MemoryAggregates {
    async fn apply(&self, w: &LedgerWrite) -> Result<WriteOutcome, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Transient("simulated throttling".into()));
        }
        let key: Vec<String> = w.key.iter().map(|(_, v)| v.clone()).collect();
        let item = s.items.entry(key).or_default();
        let text = |v: Option<&MemValue>| match v {
            Some(MemValue::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let entry = text(item.get(&w.entry_name));
        let floor = text(item.get(FLOOR_ATTRIBUTE));
        let entry_ok = entry.as_ref().is_none_or(|e| *e < w.first);
        let limit = w.new_floor.as_ref().or(w.shard_floor.as_ref());
        let floor_ok = match (&floor, limit) {
            (Some(f), Some(limit)) => f <= limit,
            _ => true,
        };
        if !(entry_ok && floor_ok) {
            return Ok(WriteOutcome::Stale { entry, floor });
        }
        let mut updated = item.clone();
        for (name, v) in &w.adds {
            let current = match updated.get(name) {
                None => Decimal::ZERO,
                Some(MemValue::Num(n)) => *n,
                Some(MemValue::Str(_)) => {
                    return Err(SinkError::Invalid(format!("An operand in the update expression has an incorrect data type ({name})")))
                }
            };
            let sum = current.checked_add(*v).map_err(|e| SinkError::Invalid(e.to_string()))?;
            updated.insert(name.clone(), MemValue::Num(sum));
        }
        updated.insert(w.entry_name.clone(), MemValue::Str(w.entry_value.clone()));
        for p in &w.prune {
            updated.remove(p);
        }
        if let Some(f) = &w.new_floor {
            updated.insert(FLOOR_ATTRIBUTE.to_string(), MemValue::Str(f.clone()));
        }
        let entries = updated.keys().filter(|k| k.starts_with(crate::sink::ledger::ENTRY_PREFIX)).cloned().collect();
        *item = updated;
        Ok(WriteOutcome::Applied { capacity: 1.0, entries })
    }
}
