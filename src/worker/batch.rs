//! The batch being gathered, evaluated page by page as GetRecords returns it. A batch keeps
//! only what its writes, its checkpoint and its letters need: the coalesced deltas per target
//! (with each record's contribution, for a write the ledger refuses), the last sequence
//! number, the creation times for the lag histogram, and the full record of a poison one. A
//! page's records are dropped once evaluated, so memory grows with the targets a batch
//! touches, not with `batch_size` (a batch of 10,000 records held 10,000 JSON trees before).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::rules::copy::{CopyBatch, CopyChange};
use crate::rules::{shards, Coalescer, Engine, TargetDelta, TargetKey};
use crate::telemetry::names;

/// A record that will not be applied, on its way to the dead-letter queue.
#[derive(Debug, Clone)]
pub struct Letter {
    pub record: Value,
    pub sequence: String,
    pub code: String,
    pub message: String,
    pub rules: Vec<String>,
    pub variables: BTreeMap<String, String>,
    pub attempts: u32,
    /// The record could not be read again: it holds only its sequence number.
    pub cut: bool,
}

impl Letter {
    pub fn new(record: Value, code: &str, message: String, rules: Vec<String>, attempts: u32) -> Letter {
        let sequence = sequence_of(&record).to_string();
        Letter { record, sequence, code: code.to_string(), message, rules, variables: BTreeMap::new(), attempts, cut: false }
    }

    fn add_rule(&mut self, rule: &str) {
        if !self.rules.iter().any(|r| r == rule) {
            self.rules.push(rule.to_string());
        }
    }
}

/// Adds a poison record, or the rule to a record already there (one message per record).
fn push_letter(letters: &mut Vec<Letter>, new: Letter) {
    match letters.iter_mut().find(|l| l.sequence == new.sequence) {
        Some(l) => new.rules.iter().for_each(|r| l.add_rule(r)),
        None => letters.push(new),
    }
}

/// The pages of one batch, evaluated.
#[derive(Debug, Clone, Default)]
pub struct PendingBatch {
    coalescer: Coalescer,
    /// The copy rules' changes, the newest per source item ([`crate::rules::copy`]).
    copies: CopyBatch,
    pub letters: Vec<Letter>,
    pub last_seq: Option<String>,
    pub newest_ms: Option<u64>,
    /// ApproximateCreationDateTime (ms) of every record, for the lag histogram.
    pub created: Vec<u64>,
    /// Records evaluated.
    pub records: usize,
    /// Time spent evaluating the pages.
    pub evaluate: Duration,
}

/// A batch ready to write: its targets, and the rest of what was gathered (`facts`, whose
/// coalescer is then empty).
#[derive(Debug, Clone)]
pub struct Evaluated {
    pub targets: Vec<(TargetKey, TargetDelta)>,
    /// The copy rules' changes: (index of the rule in [`Engine::copies`], change, its record).
    pub copies: Vec<(usize, CopyChange, Value)>,
    pub facts: PendingBatch,
}

impl PendingBatch {
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Runs a page's records through the rules (pure but for metrics); records older than
    /// `max_age_ms` at `now` become letters of the rules whose filters match them.
    /// `shard_created_ms` (the shard's creation time) orders the copy rules' changes.
    pub fn add_page(
        &mut self,
        engine: &Engine,
        max_age_ms: Option<u64>,
        records: impl IntoIterator<Item = Value>,
        now: u64,
        shard_created_ms: Option<u64>,
    ) {
        let started = Instant::now();
        let records = records.into_iter();
        self.created.reserve(records.size_hint().0);
        let mut taken = 0;
        // A page's records are made (converted from the SDK's form) as they are taken here,
        // so evaluating includes converting.
        for record in records {
            taken += 1;
            self.add_record(engine, max_age_ms, record, now, shard_created_ms);
        }
        metrics::counter!(names::RECORDS_READ).increment(taken as u64);
        self.records += taken;
        self.evaluate += started.elapsed();
    }

    fn add_record(&mut self, engine: &Engine, max_age_ms: Option<u64>, record: Value, now: u64, shard_created_ms: Option<u64>) {
        let seq = sequence_of(&record);
        if !seq.is_empty() {
            self.last_seq = Some(seq.to_string());
        }
        let created = created_ms(&record);
        if let Some(ms) = created {
            self.created.push(ms);
            self.newest_ms = Some(self.newest_ms.map_or(ms, |n| n.max(ms)));
        }
        // Copy rules apply records of any age: their versions, not their age, keep a late one
        // from overwriting a newer copy, and a skipped delete would leave its copies behind.
        let copied = engine.apply_copies(&record, shard_created_ms, &mut self.copies);
        if let (Some(max), Some(ms)) = (max_age_ms, created) {
            if now.saturating_sub(ms) > max {
                let rules: Vec<String> = engine.rules.iter().filter(|r| r.filter_matches(&record)).map(|r| r.name.to_string()).collect();
                if !rules.is_empty() {
                    let message = format!("record is {} s old; source.max_record_age is {} s", now.saturating_sub(ms) / 1000, max / 1000);
                    push_letter(&mut self.letters, Letter::new(record.clone(), "too_old", message, rules, 1));
                }
                self.copy_report(engine, &record, copied);
                return;
            }
        }
        let report = engine.apply(&record, &mut self.coalescer);
        if report.matched.is_empty() && report.poisons.is_empty() && copied.matched.is_empty() {
            metrics::counter!(names::RECORDS_FILTERED).increment(1);
        }
        for rule in report.matched.iter().filter_map(|i| engine.rules.get(*i)) {
            metrics::counter!(names::RECORDS_MATCHED, "rule" => rule.name.to_string()).increment(1);
        }
        self.poisons(&record, &report.poisons);
        self.copy_report(engine, &record, copied);
    }

    /// The copy rules' matches and poisons of one record.
    fn copy_report(&mut self, engine: &Engine, record: &Value, copied: crate::rules::RecordReport) {
        for rule in copied.matched.iter().filter_map(|i| engine.copies.get(*i)) {
            metrics::counter!(names::RECORDS_MATCHED, "rule" => rule.name.to_string()).increment(1);
        }
        self.poisons(record, &copied.poisons);
    }

    fn poisons(&mut self, record: &Value, poisons: &[crate::rules::Poison]) {
        for p in poisons {
            let mut letter =
                Letter::new(record.clone(), p.code.as_str(), p.message.clone(), p.rule.iter().map(|r| r.to_string()).collect(), 1);
            letter.variables = p.variables.clone();
            push_letter(&mut self.letters, letter);
        }
    }

    /// The batch's targets, each target of a sharded rule moved to the sub-item this shard
    /// writes ([`crate::rules::shards`]).
    pub fn finish(mut self, engine: &Engine, shard_id: &str) -> Evaluated {
        let mut targets = std::mem::take(&mut self.coalescer).into_targets();
        if engine.rules.iter().any(|r| r.write_shards.is_some()) {
            for (key, delta) in &mut targets {
                if let Some(n) = sharding(engine, delta) {
                    *key = shards::sub_key(key, shards::sub_index(shard_id, n));
                }
            }
        }
        let copies = std::mem::take(&mut self.copies).into_changes().collect();
        Evaluated { targets, copies, facts: self }
    }
}

/// The `write_shards` of the rule that wrote `delta` (rules that may write one item agree on
/// it: the config refuses them otherwise).
fn sharding(engine: &Engine, delta: &TargetDelta) -> Option<u16> {
    let rule = delta.contributions.iter().find_map(|c| c.rule.as_deref())?;
    engine.rules.iter().find(|r| *r.name == *rule)?.write_shards
}

/// The record's ApproximateCreationDateTime in epoch ms.
pub use crate::stream::created_ms;

pub fn sequence_of(record: &Value) -> &str {
    record.pointer("/dynamodb/SequenceNumber").and_then(Value::as_str).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::Config;

    fn engine() -> Engine {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine
    }

    fn record(n: u64, customer: &str, total: &str) -> Value {
        let img = json!({"PK": {"S": format!("CUST#{customer}")}, "SK": {"S": format!("ORDER#2026-11-30#o{n}")}, "total": {"N": total}, "status": {"S": "PAID"}});
        json!({"eventName": "INSERT", "dynamodb": {"Keys": {"PK": img["PK"], "SK": img["SK"]}, "NewImage": img,
            "SequenceNumber": format!("{n:021}"), "ApproximateCreationDateTime": 1_764_460_800 + n}})
    }

    fn sums(e: Evaluated) -> Vec<(TargetKey, Vec<(String, String)>)> {
        e.targets.into_iter().map(|(k, d)| (k, d.attributes.into_iter().map(|(a, v)| (a, v.to_string())).collect())).collect()
    }

    /// Evaluating page by page gives the batch evaluating it whole would: the same sums, the
    /// last sequence number, every creation time, and each poison record's full letter.
    #[test]
    fn pages_evaluated_one_by_one_make_the_whole_batch() {
        let e = engine();
        let records: Vec<Value> =
            (1..=12).map(|n| record(n, ["c1", "c2", "c3"][(n % 3) as usize], if n == 5 { "ten" } else { "2.5" })).collect();
        let mut whole = PendingBatch::default();
        whole.add_page(&e, None, records.clone(), 0, Some(0));
        let whole = whole.finish(&e, "shardId-1");
        for cut in [1, 4, 5, 11] {
            let mut paged = PendingBatch::default();
            paged.add_page(&e, None, records[..cut].to_vec(), 0, Some(0));
            paged.add_page(&e, None, records[cut..].to_vec(), 0, Some(0));
            let paged = paged.finish(&e, "shardId-1");
            assert_eq!(
                (paged.facts.records, paged.facts.last_seq.as_deref(), &paged.facts.created),
                (12, Some("000000000000000000012"), &whole.facts.created)
            );
            assert_eq!(paged.facts.letters.len(), 1, "cut {cut}");
            assert_eq!(paged.facts.letters[0].record, records[4], "the letter carries the full record");
            assert_eq!(sums(paged), sums(whole.clone()), "cut {cut}");
        }
        assert_eq!(whole.facts.newest_ms, Some(1_764_460_812_000));
    }

    #[test]
    fn too_old_records_become_letters_of_the_rules_that_match_them() {
        let e = engine();
        let mut b = PendingBatch::default();
        let now = 1_764_460_800_000 + 3_600_000;
        b.add_page(&e, Some(60_000), vec![record(1, "c1", "1")], now, Some(0));
        let b = b.finish(&e, "shardId-1");
        assert!(b.targets.is_empty());
        assert_eq!(b.facts.letters.len(), 1);
        assert_eq!(b.facts.letters[0].code, "too_old");
        assert!(!b.facts.letters[0].rules.is_empty());
    }

    /// A copy rule applies a record of any age (versions keep a late one from winning; a
    /// skipped delete would leave its copies): no letter, and the change is in the batch.
    #[test]
    fn copy_rules_apply_records_past_max_record_age() {
        let e = engine();
        let mut b = PendingBatch::default();
        let now = 1_764_460_800_000 + 3_600_000;
        let keys = json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}});
        let old = json!({"eventName": "REMOVE", "dynamodb": {"Keys": keys, "OldImage": {"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}, "name": {"S": "Ann"}},
            "SequenceNumber": "000000000000000000005", "ApproximateCreationDateTime": 1_764_460_800}});
        b.add_page(&e, Some(60_000), vec![old], now, Some(1));
        let b = b.finish(&e, "shardId-1");
        assert!(b.facts.letters.is_empty(), "{:?}", b.facts.letters);
        assert_eq!(b.copies.len(), 1);
        assert!(b.copies[0].1.deleted);
        assert_eq!(e.copies[b.copies[0].0].name.as_ref(), "customer-name-on-orders");
    }
}
