//! Writing copies ([`crate::rules::copy`]): one source change fanned out to every item its
//! rule's `to` finds, each write conditioned on the item's recorded version being older.
//!
//! Crash points (each replays the batch from its checkpoint, which runs the fan-out again):
//! before the fan-out, half way through it, and after it but before the checkpoint. Items
//! already at the change's version are skipped (their version was read with them, strongly
//! consistent on the table) or refused by the write's condition, so a replay writes only what
//! the interrupted run did not. A slow writer's older write that lands after a newer one is
//! refused the same way, and an item deleted between the query and the write is not created
//! again (the write requires the item to exist).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{self, StreamExt};
use serde_json::Value;

use super::SinkError;
use crate::rules::copy::{version_attribute, CopyChange, CopyRule, FindQuery};

pub mod dynamodb;

/// An item's key in the table: key attribute -> typed value (`{"S": "CUST#c1"}`).
pub type ItemKey = BTreeMap<String, Value>;

/// One item a fan-out query found: its key in the table, and the version of the rule's copies
/// it holds (None: none recorded).
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub key: ItemKey,
    pub version: Option<String>,
}

/// One page of a fan-out query.
#[derive(Debug, Clone, Default)]
pub struct FoundPage {
    pub items: Vec<Found>,
    /// Where the next page starts; None: this was the last.
    pub next: Option<ItemKey>,
    pub read_capacity: f64,
}

/// How one copy write ended.
#[derive(Debug, Clone, PartialEq)]
pub enum CopyOutcome {
    Written {
        capacity: f64,
    },
    /// The item holds this change's copies already, or a newer change's.
    Older,
    /// The item was deleted after the query found it.
    Gone,
    /// The table refuses the write as it is (the item would pass 400 KB): dead-lettered.
    Rejected(String),
}

/// The table that holds the copies (the source table).
pub trait CopyStore: Send + Sync + 'static {
    /// One page of the items `q` finds, from `start` (None: the first page): strongly
    /// consistent on the table, eventually consistent on an index. Each with its key in the
    /// table and the text of its attribute `version_attribute`.
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        start: Option<&'a ItemKey>,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>>;

    /// Sets `change.set`, removes `change.remove` and records `change`'s version in
    /// `version_attribute` on the item `key`, if the item exists and records no version or an
    /// older one.
    fn write<'a>(
        &'a self,
        key: &'a ItemKey,
        change: &'a CopyChange,
        version_attribute: &'a str,
    ) -> BoxFuture<'a, Result<CopyOutcome, SinkError>>;
}

/// What one source change's fan-out did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FanOut {
    /// Items the query found (the source itself left out).
    pub found: u64,
    pub written: u64,
    pub older: u64,
    pub gone: u64,
    /// Items the table refused, with why.
    pub rejected: Vec<(ItemKey, String)>,
    pub write_capacity: f64,
    pub read_capacity: f64,
}

/// Writes `change` onto every item its query finds, `in_flight` writes at a time, page by page.
/// A transient or throttled error ends the fan-out (the batch is retried, and the items already
/// written are skipped then).
pub async fn fan_out(store: &dyn CopyStore, rule: &CopyRule, change: &CopyChange, in_flight: usize) -> Result<FanOut, SinkError> {
    let attribute = version_attribute(&rule.name);
    let version = change.version.text();
    let mut out = FanOut::default();
    let mut start: Option<ItemKey> = None;
    loop {
        let page = store.find(&change.find, &attribute, start.as_ref()).await?;
        out.read_capacity += page.read_capacity;
        let due: Vec<&Found> = page.items.iter().filter(|f| f.key != change.source).collect();
        out.found += due.len() as u64;
        let (current, due): (Vec<&Found>, Vec<&Found>) =
            due.into_iter().partition(|f| f.version.as_deref().is_some_and(|v| *v >= *version));
        out.older += current.len() as u64;
        // Built in a loop, not by a lazy map: the batch's future must stay Send.
        let mut writes = Vec::with_capacity(due.len());
        let attribute = attribute.as_str();
        for f in due {
            writes.push(async move { (f, store.write(&f.key, change, attribute).await) });
        }
        let results: Vec<_> = stream::iter(writes).buffer_unordered(in_flight.max(1)).collect().await;
        for (found, result) in results {
            match result? {
                CopyOutcome::Written { capacity } => {
                    out.written += 1;
                    out.write_capacity += capacity;
                }
                CopyOutcome::Older => out.older += 1,
                CopyOutcome::Gone => out.gone += 1,
                CopyOutcome::Rejected(why) => out.rejected.push((found.key.clone(), why)),
            }
        }
        match page.next {
            Some(next) => start = Some(next),
            None => return Ok(out),
        }
    }
}

/// Copy items in memory, for tests: items by key (in key order), each an attribute map of
/// typed values. Pages hold `page_size` items.
#[derive(Debug, Default)]
pub struct MemoryCopies {
    pub items: std::sync::Mutex<BTreeMap<String, serde_json::Map<String, Value>>>,
    /// The table's key attribute names, partition key first.
    pub key_names: Vec<String>,
    pub page_size: usize,
    /// Items larger than this (bytes of their JSON) are refused, as DynamoDB refuses 400 KB.
    pub max_item_bytes: usize,
}

impl MemoryCopies {
    pub fn new(key_names: &[&str]) -> Arc<MemoryCopies> {
        Arc::new(MemoryCopies {
            items: Default::default(),
            key_names: key_names.iter().map(|s| s.to_string()).collect(),
            page_size: 3,
            max_item_bytes: 400 * 1024,
        })
    }

    fn key_text(key: &ItemKey) -> String {
        serde_json::to_string(key).unwrap_or_default()
    }

    /// Puts (replaces) an item; its key attributes are read from it.
    pub fn put(&self, item: serde_json::Map<String, Value>) {
        let key: ItemKey = self.key_names.iter().filter_map(|k| Some((k.clone(), item.get(k)?.clone()))).collect();
        self.items.lock().unwrap_or_else(|e| e.into_inner()).insert(Self::key_text(&key), item);
    }

    pub fn delete(&self, key: &ItemKey) {
        self.items.lock().unwrap_or_else(|e| e.into_inner()).remove(&Self::key_text(key));
    }

    pub fn get(&self, key: &ItemKey) -> Option<serde_json::Map<String, Value>> {
        self.items.lock().unwrap_or_else(|e| e.into_inner()).get(&Self::key_text(key)).cloned()
    }

    fn matches(q: &FindQuery, item: &serde_json::Map<String, Value>) -> bool {
        let text = |name: &str| item.get(name).and_then(|v| v.get("S")).and_then(Value::as_str);
        if text(&q.partition.0) != Some(q.partition.1.as_str()) {
            return false;
        }
        match &q.sort {
            None => true,
            Some((name, crate::rules::copy::SortValue::Equals(v))) => text(name) == Some(v.as_str()),
            Some((name, crate::rules::copy::SortValue::BeginsWith(p))) => text(name).is_some_and(|s| s.starts_with(p.as_str())),
        }
    }
}

impl CopyStore for MemoryCopies {
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        start: Option<&'a ItemKey>,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        Box::pin(async move {
            let items = self.items.lock().unwrap_or_else(|e| e.into_inner());
            let after = start.map(Self::key_text);
            let mut page = FoundPage::default();
            for (k, item) in items.iter().filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a)) {
                if !Self::matches(q, item) {
                    continue;
                }
                if page.items.len() == self.page_size.max(1) {
                    page.next = page.items.last().map(|f: &Found| f.key.clone());
                    break;
                }
                let key: ItemKey = self.key_names.iter().filter_map(|n| Some((n.clone(), item.get(n)?.clone()))).collect();
                debug_assert_eq!(Self::key_text(&key), *k);
                let version = item.get(version_attribute).and_then(|v| v.get("S")).and_then(Value::as_str).map(str::to_string);
                page.items.push(Found { key, version });
            }
            Ok(page)
        })
    }

    fn write<'a>(
        &'a self,
        key: &'a ItemKey,
        change: &'a CopyChange,
        version_attribute: &'a str,
    ) -> BoxFuture<'a, Result<CopyOutcome, SinkError>> {
        Box::pin(async move {
            let mut items = self.items.lock().unwrap_or_else(|e| e.into_inner());
            let Some(item) = items.get_mut(&Self::key_text(key)) else { return Ok(CopyOutcome::Gone) };
            let version = change.version.text();
            let recorded = item.get(version_attribute).and_then(|v| v.get("S")).and_then(Value::as_str);
            if recorded.is_some_and(|r| *r >= *version) {
                return Ok(CopyOutcome::Older);
            }
            let mut next = item.clone();
            for name in &change.remove {
                next.remove(name);
            }
            for (name, value) in &change.set {
                next.insert(name.clone(), value.clone());
            }
            next.insert(version_attribute.to_string(), serde_json::json!({ "S": version }));
            let size = serde_json::to_string(&next).map_or(0, |t| t.len());
            if size > self.max_item_bytes {
                return Ok(CopyOutcome::Rejected(format!("Item size has exceeded the maximum allowed size ({size} bytes)")));
            }
            let capacity = size.div_ceil(1024).max(1) as f64;
            *item = next;
            Ok(CopyOutcome::Written { capacity })
        })
    }
}

#[cfg(test)]
mod tests;
