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

use futures::future::BoxFuture;
use futures::stream::{self, StreamExt};
use serde_json::Value;

use super::SinkError;
use crate::rules::copy::{version_attribute, CopyChange, CopyRule, FindQuery};

pub mod dynamodb;

/// An item's key in the table: key attribute -> typed value (`{"S": "CUST#c1"}`).
pub type ItemKey = BTreeMap<String, Value>;

/// One item a fan-out query found: its key in the table, the version of the rule's copies it
/// holds (None: none recorded), and the attributes the query asked for that it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub key: ItemKey,
    pub version: Option<String>,
    pub values: BTreeMap<String, Value>,
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
    /// One page of at most `limit` of the items `q` finds, from `start` (None: the first
    /// page): strongly consistent on the table, eventually consistent on an index. Each with
    /// its key in the table, the text of its attribute `version_attribute`, and the attributes
    /// `project` names that it holds.
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        project: &'a [String],
        start: Option<&'a ItemKey>,
        limit: usize,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>>;

    /// Sets `fix.set` and removes `fix.remove` on the item `key` if it exists and its
    /// `version_attribute` is still `read` (None: still absent): reconcile's correction.
    fn correct<'a>(
        &'a self,
        key: &'a ItemKey,
        fix: &'a CopyFix,
        version_attribute: &'a str,
        read: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Corrected, SinkError>>;

    /// The source item `key`, strongly consistent, with `attributes` (None: it does not exist).
    fn source<'a>(
        &'a self,
        key: &'a ItemKey,
        attributes: &'a [String],
    ) -> BoxFuture<'a, Result<Option<serde_json::Map<String, Value>>, SinkError>>;

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

/// What a correction sets and removes on a copy item.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CopyFix {
    pub set: Vec<(String, Value)>,
    pub remove: Vec<String>,
}

/// How a correction ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Corrected {
    Done {
        capacity: f64,
    },
    /// The item's version moved since it was read (a change was written: the stream keeps it),
    /// or the item was deleted.
    Changed,
    /// The table refuses it (the item would pass 400 KB).
    Rejected(String),
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
    /// The source no longer holds what the change copies: a newer change writes the rest.
    pub superseded: bool,
    /// The table refused the query itself (a key of another type than S, say): why.
    pub query_refused: Option<String>,
    /// Where the fan-out goes on (None: it reached the last page, or ended early).
    pub next: Option<ItemKey>,
    pub write_capacity: f64,
    pub read_capacity: f64,
}

/// Copies a job writes per page: the cursor moves after each.
pub const JOB_PAGE_ITEMS: usize = 100;

/// Writes `change` onto every item its query finds, page by page ([`fan_out_page`]).
pub async fn fan_out(store: &dyn CopyStore, rule: &CopyRule, change: &CopyChange, in_flight: usize) -> Result<FanOut, SinkError> {
    let mut total = FanOut::default();
    let mut start: Option<ItemKey> = None;
    loop {
        let out = fan_out_page(store, rule, change, in_flight, start.as_ref(), JOB_PAGE_ITEMS).await?;
        start = out.next.clone();
        total.add(out);
        if start.is_none() {
            return Ok(total);
        }
    }
}

impl FanOut {
    /// Adds a later page's figures; its `next` is the fan-out's.
    pub fn add(&mut self, page: FanOut) {
        self.found += page.found;
        self.written += page.written;
        self.older += page.older;
        self.gone += page.gone;
        self.rejected.extend(page.rejected);
        self.superseded |= page.superseded;
        self.query_refused = self.query_refused.take().or(page.query_refused);
        self.write_capacity += page.write_capacity;
        self.read_capacity += page.read_capacity;
        self.next = page.next;
    }
}

/// Writes `change` onto the items of one page of its query (at most `limit`, from `start`),
/// `in_flight` writes at a time; `next` says where the following page starts.
/// The page is written only if the source, read after the page, still holds what the change
/// copies ([`CopyChange::still_current`]): an item the page found existed before that read,
/// so a newer change of the source comes after it, finds the item, and writes a newer version
/// over this write or refuses it. That holds for a writer that lost its lease and wakes up
/// late, whose old values would otherwise land on items that carry no version yet.
/// A copy write that fails transiently or is throttled is retried with backoff (up to 8
/// times); one that still fails ends the fan-out (the batch or job is retried, and the items
/// already written are skipped then), as does a failed query or source read.
pub async fn fan_out_page(
    store: &dyn CopyStore,
    rule: &CopyRule,
    change: &CopyChange,
    in_flight: usize,
    start: Option<&ItemKey>,
    limit: usize,
) -> Result<FanOut, SinkError> {
    let attribute = version_attribute(&rule.name);
    let version = change.version.text();
    let mut out = FanOut::default();
    let page = match store.find(&change.find, &attribute, &[], start, limit.max(1)).await {
        Ok(page) => page,
        Err(SinkError::Invalid(why)) => {
            out.query_refused = Some(why);
            return Ok(out);
        }
        Err(e) => return Err(e),
    };
    out.read_capacity += page.read_capacity;
    let source = store.source(&change.source, &rule.source_attributes()).await?;
    if !change.still_current(&rule.current(source.as_ref())) {
        out.superseded = true;
        return Ok(out);
    }
    let due: Vec<&Found> = page.items.iter().filter(|f| f.key != change.source).collect();
    out.found += due.len() as u64;
    let (current, due): (Vec<&Found>, Vec<&Found>) = due.into_iter().partition(|f| f.version.as_deref().is_some_and(|v| *v >= *version));
    out.older += current.len() as u64;
    // Built in a loop, not by a lazy map: the batch's future must stay Send.
    let mut writes = Vec::with_capacity(due.len());
    let attribute = attribute.as_str();
    for f in due {
        // A transient failure is retried here (the write is conditioned on its version, so a
        // write that took effect is found older), not by failing the page: one page writes
        // 100 copies, and a job that restarted its page on any of them would rarely finish.
        writes.push(async move { (f, super::retrying(|| store.write(&f.key, change, attribute)).await) });
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
    out.next = page.next;
    Ok(out)
}

#[cfg(test)]
mod tests;
