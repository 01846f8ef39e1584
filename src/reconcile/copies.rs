//! Reconciling copies (DESIGN.md section 2, "Copies kept in sync"): find the copy items that
//! differ from their source and set them to it.
//!
//! Source items carry no sequence number, so a correction cannot be ordered against the
//! stream's writes by version. For each batch of sources, reconcile
//! 1. reads every copy item, with the version of the rule's copies it holds;
//! 2. reads the sources, strongly consistent;
//! 3. waits until every record created before the source reads is applied;
//! 4. corrects each copy that differs from its source, conditioned on the copy's version still
//!    being the one read in step 1.
//!
//! A change of the source before its read was applied by step 3: it is what step 2 read, or
//! older and superseded by it (a fan-out job of such a change, still running, writes only
//! while the source holds what it copies, which is then what step 2 read). A change after the
//! read writes a newer version onto every copy it finds, and each of its writes either comes
//! after the correction (and wins by its version) or before it, when the correction's
//! condition fails: the copy moved since step 1, and is left to the stream.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::protocol::Consumer;
use super::{Options, ReconcileError};
use crate::rules::copy::{version_attribute, CopyRule, FindQuery};
use crate::sink::copy::{CopyFix, CopyStore, Corrected, Found, ItemKey, JOB_PAGE_ITEMS};
use crate::state::now_ms;
use crate::telemetry::names;

/// Sources reconciled together, at most: their copies are held in memory from step 1 to step
/// 4, and each batch waits once for the evidence (seconds where a shard is idle).
pub const SOURCES_AT_ONCE: usize = 1_000;
/// Copy items read before a batch is closed, whatever its number of sources.
pub const COPIES_AT_ONCE: usize = 20_000;

/// One copy item that differed from its source.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyDrift {
    pub rule: String,
    pub item: ItemKey,
    /// (copy attribute, what the item held, what the source holds); None: absent.
    pub attributes: Vec<(String, Option<Value>, Option<Value>)>,
    pub corrected: bool,
    /// Why it was not corrected (it changed meanwhile, or the table refused it).
    pub left: Option<String>,
}

impl CopyDrift {
    /// The item's key as `PK / SK` text.
    pub fn item_text(&self) -> String {
        self.item
            .values()
            .map(|v| v.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap_or("?"))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    /// The report's line of one attribute: what the copy held and what its source holds.
    pub fn lines(&self) -> Vec<String> {
        let text = |v: &Option<Value>| v.as_ref().map_or("-".to_string(), |v| v.to_string());
        let state = match (&self.left, self.corrected) {
            (Some(why), _) => format!("left: {why}"),
            (None, true) => "corrected".to_string(),
            (None, false) => String::new(),
        };
        self.attributes
            .iter()
            .filter(|(_, held, want)| held != want)
            .map(|(name, held, want)| {
                format!("{:<20} {:<32} {:<20} {:>14} {:>14}  {state}", self.rule, self.item_text(), name, text(held), text(want))
            })
            .collect()
    }

    /// The JSON form of `reconcile --output json`.
    pub fn json(&self) -> Value {
        let attributes: Vec<Value> = self
            .attributes
            .iter()
            .filter(|(_, held, want)| held != want)
            .map(|(name, held, want)| json!({ "attribute": name, "stored": held, "true": want }))
            .collect();
        json!({ "rule": self.rule, "copy_item": self.item, "attributes": attributes, "corrected": self.corrected, "left": self.left })
    }
}

/// What `want` (the source's copied attributes, in the rule's order) asks of a copy item that
/// holds `held` (pure): None when it holds exactly that.
pub fn fix_for(rule: &CopyRule, want: &[Option<Value>], held: &BTreeMap<String, Value>) -> Option<CopyFix> {
    let mut fix = CopyFix::default();
    for (a, w) in rule.attributes.iter().zip(want) {
        match (w, held.get(&a.copy)) {
            (Some(w), Some(h)) if w == h => {}
            (Some(w), _) => fix.set.push((a.copy.clone(), w.clone())),
            (None, Some(_)) => fix.remove.push(a.copy.clone()),
            (None, None) => {}
        }
    }
    (!fix.set.is_empty() || !fix.remove.is_empty()).then_some(fix)
}

/// Whether an item with these keys is one of `rule`'s sources: its `source_key` captures them
/// and its filter (keys only) passes.
pub fn is_source(rule: &CopyRule, keys: &ItemKey) -> bool {
    let raw = json!({ "eventSource": "aws:dynamodb", "dynamodb": { "Keys": keys } });
    rule.filter_matches(&raw) && find_query(rule, keys).is_some()
}

/// The source item the variables name for `rule` (None: they do not name all of its key).
pub fn source_for(rule: &CopyRule, vars: &BTreeMap<String, String>) -> Option<ItemKey> {
    let lookup = |name: &str| vars.get(name).map(|v| crate::rules::template::VarValue::Str(v.as_str()));
    let key: ItemKey =
        rule.source_key.iter().map(|(k, t)| Some((k.clone(), json!({ "S": t.expand(lookup).ok()? })))).collect::<Option<_>>()?;
    is_source(rule, &key).then_some(key)
}

/// Reconciles `rule`'s copies of `sources`, in batches of at most `SOURCES_AT_ONCE` sources
/// or `COPIES_AT_ONCE` copies. A source with a fan-out job pending (its id in `pending`) is
/// left out: the job writes its copies.
pub async fn reconcile_copies<C: Consumer>(
    store: &dyn CopyStore,
    consumer: &C,
    rule: &CopyRule,
    sources: &[ItemKey],
    pending: &std::collections::BTreeSet<String>,
    opts: &Options,
    report: &mut super::Report,
) -> Result<(), ReconcileError> {
    let (waiting, sources): (Vec<&ItemKey>, Vec<&ItemKey>) =
        sources.iter().partition(|s| pending.contains(&crate::rules::copy::job::job_id(&rule.name, s)));
    report.copy_sources_pending += waiting.len() as u64;
    let attribute = version_attribute(&rule.name);
    let copies: Vec<String> = rule.attributes.iter().map(|a| a.copy.clone()).collect();
    let mut held: Vec<(&ItemKey, Vec<Found>)> = Vec::new();
    let mut read = 0;
    for (i, source) in sources.iter().enumerate() {
        if let Some(find) = find_query(rule, source) {
            let found = read_all(store, &find, &attribute, &copies).await?;
            read += found.len();
            held.push((source, found));
        }
        let last = i + 1 == sources.len();
        if last || held.len() >= SOURCES_AT_ONCE || read >= COPIES_AT_ONCE {
            reconcile_batch(store, consumer, rule, std::mem::take(&mut held), opts, report).await?;
            read = 0;
        }
    }
    Ok(())
}

/// Steps 2 to 4 for sources whose copies were read (step 1).
async fn reconcile_batch<C: Consumer>(
    store: &dyn CopyStore,
    consumer: &C,
    rule: &CopyRule,
    held: Vec<(&ItemKey, Vec<Found>)>,
    opts: &Options,
    report: &mut super::Report,
) -> Result<(), ReconcileError> {
    if held.is_empty() {
        return Ok(());
    }
    let attribute = version_attribute(&rule.name);
    let mut want = Vec::with_capacity(held.len());
    let copied = rule.source_attributes();
    for (source, _) in &held {
        let item = store.source(source, &copied).await.map_err(|e| aws("reading a copy rule's source", e))?;
        want.push(rule.current(item.as_ref()));
    }
    // After the reads: the evidence covers every change they saw.
    let read_at = now_ms();
    if !opts.no_wait {
        let applied = consumer.applied_before(read_at, opts.wait).await?;
        report.judged_by_empty_pages(&applied.by_empty_pages);
    }
    for ((source, found), want) in held.iter().zip(&want) {
        let found: Vec<&Found> = found.iter().filter(|f| f.key != **source).collect();
        report.copies_checked += found.len() as u64;
        for f in found {
            let Some(fix) = fix_for(rule, want, &f.values) else { continue };
            let drift = correct(store, rule, f, want, &fix, &attribute, opts.dry_run).await?;
            report.copy_drifts.push(drift);
        }
    }
    Ok(())
}

/// Corrects one drifted copy (unless a dry run), conditioned on its version as read.
async fn correct(
    store: &dyn CopyStore,
    rule: &CopyRule,
    f: &Found,
    want: &[Option<Value>],
    fix: &CopyFix,
    attribute: &str,
    dry_run: bool,
) -> Result<CopyDrift, ReconcileError> {
    let attributes = rule.attributes.iter().zip(want).map(|(a, w)| (a.copy.clone(), f.values.get(&a.copy).cloned(), w.clone())).collect();
    let mut drift = CopyDrift { rule: rule.name.to_string(), item: f.key.clone(), attributes, corrected: false, left: None };
    metrics::counter!(names::RECONCILE_DRIFT, "rule" => rule.name.to_string()).increment(1);
    if dry_run {
        return Ok(drift);
    }
    match store.correct(&f.key, fix, attribute, f.version.as_deref()).await.map_err(|e| aws("correcting a copy", e))? {
        Corrected::Done { .. } => {
            metrics::counter!(names::RECONCILE_CORRECTIONS, "rule" => rule.name.to_string()).increment(1);
            drift.corrected = true;
        }
        Corrected::Changed => drift.left = Some("changed since it was read (the stream wrote it, or it was deleted)".into()),
        Corrected::Rejected(why) => drift.left = Some(format!("the table refused the correction: {why}")),
    }
    Ok(drift)
}

/// Every item `find` returns, with its copy attributes and version.
async fn read_all(store: &dyn CopyStore, find: &FindQuery, attribute: &str, copies: &[String]) -> Result<Vec<Found>, ReconcileError> {
    let mut out = Vec::new();
    let mut start: Option<ItemKey> = None;
    loop {
        let page = store
            .find(find, attribute, copies, start.as_ref(), JOB_PAGE_ITEMS * 10)
            .await
            .map_err(|e| aws("reading a source's copies", e))?;
        out.extend(page.items);
        match page.next {
            Some(next) => start = Some(next),
            None => return Ok(out),
        }
    }
}

/// The query that finds a source's copies, from its keys.
fn find_query(rule: &CopyRule, source: &ItemKey) -> Option<FindQuery> {
    let keys: serde_json::Map<String, Value> = source.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    rule.find_for(&keys)
}

fn aws(doing: &str, e: crate::sink::SinkError) -> ReconcileError {
    ReconcileError::Aws(format!("{doing}: {e}"))
}

#[cfg(test)]
mod tests;
