//! Applying one evaluated batch: its dead letters, its target writes and derivations, then its
//! checkpoint. An [`Applier`] holds what outlives a batch (the write window, the letters already
//! queued); the shard reader moves it into the batch in flight and gets it back with the
//! outcome, so the next batch is read and evaluated while this one writes ([`super::shard`]).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::time::Instant;
use tracing::{error, warn};

use super::batch::{sequence_of, Evaluated, Letter};
use super::phases::{BatchPhases, Gathering};
use super::shard::{lap, persist_request, BatchOutcome, ShardLease};
use super::window::WriteWindow;
use super::Shared;
use crate::rules::{TargetDelta, TargetKey};
use crate::sink::dead_letter::{DeadLetter, Reason};
use crate::sink::expiry::{self, Expiry};
use crate::sink::pace::{Kind, Spent};
use crate::sink::{is_helper, write_target, write_target_pruning, AggregateStore, ShardContext, SinkError};
use crate::state::{now_ms, Checkpoint, LeaseStore, Progress};
use crate::stream::{Position, StreamError, StreamSource};
use crate::telemetry::names::{self, WriteOutcome};

pub(crate) mod copies;

/// Attempts at re-reading a refused record for its letter before the batch fails.
const REREAD_ATTEMPTS: u32 = 5;

/// What reading a refused record again found.
enum Reread {
    Found(Value),
    Missing(Missing),
}

/// Why a re-read did not find the record.
enum Missing {
    /// The stream answered another record first (trimmed meanwhile).
    Elsewhere,
    /// The shard ended before it.
    Ended,
    /// Only empty pages: retried, then treated as gone.
    Empty,
    /// Throttling or a 5xx: retried, then the batch fails.
    Transient,
}

/// The write side of one shard's reader.
pub struct Applier<S, L, A> {
    shared: Arc<Shared<S, L, A>>,
    lease: ShardLease,
    ctx: ShardContext,
    /// How many target writes of a batch are in flight at once ([`WriteWindow`]).
    window: WriteWindow,
    /// Letters (sequence number and reason) this reader already queued, so a retried batch
    /// does not queue twice.
    dead_lettered: HashSet<String>,
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> Applier<S, L, A> {
    pub fn new(shared: Arc<Shared<S, L, A>>, lease: ShardLease) -> Applier<S, L, A> {
        let ctx = ShardContext::new(&shared.ledger, &lease.shard_id);
        let window = WriteWindow::new(shared.config.write_concurrency);
        Applier { shared, lease, ctx, window, dead_lettered: HashSet::new() }
    }

    fn shard(&self) -> &str {
        &self.lease.shard_id
    }

    /// [`Applier::apply`], giving the applier back with the outcome (the batch in flight owns it).
    pub async fn run(mut self: Box<Self>, evaluated: Evaluated, at_tip: Option<u64>, gathered: Gathering) -> (Box<Self>, BatchOutcome) {
        let outcome = self.apply(evaluated, at_tip, gathered).await;
        (self, outcome)
    }

    /// Evaluates, dead-letters, writes and checkpoints one batch. Letters go out before the
    /// writes: a replica that dies in between leaves a record skipped by the ledger only
    /// after its letter is queued (a duplicate letter is fine, a missing one is not).
    pub async fn apply(&mut self, evaluated: Evaluated, at_tip: Option<u64>, gathered: Gathering) -> BatchOutcome {
        let started = Instant::now();
        let mut phases = BatchPhases {
            poll_wait: gathered.poll_wait,
            get_records: gathered.get_records,
            evaluate: evaluated.facts.evaluate,
            ..BatchPhases::default()
        };
        let mut mark = Instant::now();
        if let Err(e) = self.send_letters(&evaluated.facts.letters).await {
            return BatchOutcome::Failed(e);
        }
        phases.dead_letters = lap(&mut mark);
        if !self.lease.valid() {
            return BatchOutcome::LeaseLost;
        }
        let oldest_ms = evaluated.facts.created.iter().min().copied();
        let targets = self.writable(&evaluated, oldest_ms);
        if let Err(outcome) = self.write(&targets, self.shared.expiry(), oldest_ms).await {
            return outcome;
        }
        // Derived attributes (max, min, latest, distinct) follow their helpers before the
        // checkpoint moves: a crash in between replays the batch, which derives again.
        if let Err(e) = self.derive(&targets).await {
            return BatchOutcome::Failed(e);
        }
        // Copies after the targets, also before the checkpoint: a crash replays the batch, and
        // the copies' versions skip what was written.
        if let Err(outcome) = self.copy(&evaluated.copies).await {
            return outcome;
        }
        phases.writes = lap(&mut mark);
        // The checkpoint moves only after every target write of the batch succeeded (or its
        // record was dead-lettered).
        let checkpoint = evaluated.facts.last_seq.map(Checkpoint::Sequence);
        // With the sharded totals this shard left unfolded: an owner killed before its next
        // fold round leaves them to the next owner.
        let fold_due = self.shared.engine.rules.iter().any(|r| r.write_shards.is_some()).then(|| self.shared.folds.due_for(self.shard()));
        let progress = Progress { checkpoint: checkpoint.clone(), last_record_ms: evaluated.facts.newest_ms, at_tip_ms: at_tip, fold_due };
        match self.checkpoint(&progress).await {
            Ok(true) => {}
            Ok(false) => return BatchOutcome::LeaseLost,
            Err(e) => return BatchOutcome::Failed(e),
        }
        phases.checkpoint = lap(&mut mark);
        phases.record(self.shard(), evaluated.facts.records, evaluated.targets.len());
        self.dead_lettered.clear();
        let now = now_ms();
        for ms in &evaluated.facts.created {
            metrics::histogram!(names::END_TO_END_LAG_SECONDS).record(now.saturating_sub(*ms) as f64 / 1000.0);
        }
        self.shared.note_age(&self.lease.shard_id, |a| a.applied(evaluated.facts.newest_ms));
        metrics::histogram!(names::BATCH_DURATION_SECONDS).record((started.elapsed() + evaluated.facts.evaluate).as_secs_f64());
        BatchOutcome::Applied(checkpoint)
    }

    /// The batch's targets, less its helper items when helpers expire and its oldest record is
    /// too old to write them ([`expiry::may_write_helpers`]: a helper that expired meanwhile
    /// would count it again). Reconcile repairs those helpers instead; the batch goes on.
    fn writable<'a>(&self, evaluated: &'a Evaluated, oldest_ms: Option<u64>) -> Cow<'a, [(TargetKey, TargetDelta)]> {
        if self.shared.expiry_attribute.is_none() || expiry::may_write_helpers(oldest_ms, now_ms()) {
            return Cow::Borrowed(&evaluated.targets);
        }
        let (helpers, rest): (Vec<_>, Vec<_>) = evaluated.targets.iter().cloned().partition(|(key, _)| is_helper(key));
        if !helpers.is_empty() {
            error!(shard = %self.shard(), helpers = helpers.len(), "records too old to write to helper items (an expired helper would count them again); a reconcile of everything is requested");
            metrics::counter!(names::HELPER_WRITES_TOO_OLD).increment(helpers.len() as u64);
            self.shared.request_reconcile_everything();
        }
        Cow::Owned(rest)
    }

    async fn checkpoint(&self, progress: &Progress) -> Result<bool, SinkError> {
        if !self.lease.valid() {
            return Ok(false);
        }
        let mut attempt = 0;
        loop {
            match self.shared.leases.checkpoint(&self.lease.shard_id, &self.shared.owner, self.lease.counter, progress).await {
                Ok(ok) => return Ok(ok),
                Err(e) if e.is_retriable() && attempt < 5 => {
                    attempt += 1;
                    tokio::time::sleep(crate::sink::backoff(attempt)).await;
                }
                // The writes are in (and idempotent): a failed checkpoint only means a replay.
                Err(e) => return Err(SinkError::Transient(format!("checkpoint: {e}"))),
            }
        }
    }

    /// Writes every target of the batch. A target the table refuses is written again record
    /// by record, and the letter of a record it still refuses is sent before any later record
    /// of that target is written (a later record advances the ledger past it, so a replay
    /// after a crash would never retry it).
    async fn write(
        &mut self,
        targets: &[(TargetKey, TargetDelta)],
        expiry: Option<Expiry>,
        oldest_ms: Option<u64>,
    ) -> Result<(), BatchOutcome> {
        let shared = self.shared.clone();
        let key_names = &shared.engine.key_names;
        let store = shared.sink.as_ref();
        let ctx = ShardContext { plan: shared.floor_plan(), expiry, oldest_ms, ..self.ctx.clone() };
        let ctx = &ctx;
        let paced_by = shared.as_ref();
        let mut writes = Vec::with_capacity(targets.len());
        for (key, delta) in targets {
            let seen = shared.take_seen(key);
            writes.push(async move {
                let write = write_target_pruning(store, key_names, key, delta, ctx, seen.as_ref());
                (key, delta, paced_by.paced(key, write_kind(key), write, written).await)
            });
        }
        let in_flight = self.window.in_flight(writes.len());
        if !writes.is_empty() {
            metrics::histogram!(names::BATCH_WRITES_IN_FLIGHT).record(in_flight as f64);
        }
        let results: Vec<_> = stream::iter(writes).buffer_unordered(in_flight).collect().await;
        let throttled = results.iter().any(|(_, _, r)| match r {
            Ok(stats) => stats.throttled > 0,
            Err(e) => matches!(e, SinkError::Throttled(_)),
        });
        self.window = self.window.after(targets.len(), throttled);
        let mut first_error = None;
        let mut fenced = false;
        let mut refused = Vec::new();
        for (key, delta, r) in results {
            match r {
                Ok(stats) => {
                    fenced |= stats.fenced;
                    self.written(key, delta, stats);
                }
                Err(SinkError::Invalid(why)) => {
                    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Rejected.as_str()).increment(1);
                    warn!(shard = %self.shard(), error = %why, "aggregate write refused; retrying record by record");
                    refused.push((key, delta));
                }
                Err(e) => {
                    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Error.as_str()).increment(1);
                    first_error.get_or_insert(e);
                }
            }
        }
        for (key, delta) in refused {
            match self.isolate(key, delta, ctx).await {
                Ok(f) => fenced |= f,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if fenced {
            if let Some(outcome) = self.fenced().await {
                return Err(outcome);
            }
        }
        match first_error {
            Some(e) => Err(BatchOutcome::Failed(e)),
            None => Ok(()),
        }
    }

    /// Derives the attributes of every target whose helper items the batch wrote (or would
    /// have: a replay's helper writes are refused by the ledger, its derivations are not).
    async fn derive(&mut self, targets: &[(TargetKey, TargetDelta)]) -> Result<(), SinkError> {
        let shared = self.shared.clone();
        let shared = &shared;
        let derive = crate::sink::derive::targets_to_derive(&shared.engine, targets);
        if derive.is_empty() {
            return Ok(());
        }
        let (store, key_names, ledger) = (shared.sink.as_ref(), &shared.engine.key_names, &shared.ledger);
        let expiry = shared.expiry();
        let expiry = expiry.as_ref();
        let mut runs = Vec::with_capacity(derive.len());
        for t in &derive {
            let run = crate::sink::derive::derive_target(store, key_names, ledger, t, expiry);
            runs.push(async move { (&t.key, shared.paced(&t.key, Kind::Derivation, run, derived).await) });
        }
        let in_flight = self.window.in_flight(runs.len());
        let results: Vec<_> = stream::iter(runs).buffer_unordered(in_flight).collect().await;
        // A throttled derivation narrows the window as a throttled target write does.
        let throttled = results.iter().any(|(_, r)| matches!(r, Err(SinkError::Throttled(_))));
        self.window = self.window.after(results.len(), throttled);
        let mut first_error = None;
        for (key, r) in results {
            match r {
                Ok(stats) => {
                    metrics::counter!(names::DERIVATIONS, "outcome" => "written").increment(stats.landed);
                    metrics::counter!(names::WRITE_CAPACITY_UNITS).increment(stats.write_capacity.round() as u64);
                    shared.capacity_milli.fetch_add((stats.write_capacity * 1000.0).round() as u64, Ordering::Relaxed);
                    metrics::counter!(names::DERIVATIONS, "outcome" => "lost_race").increment(stats.lost);
                    metrics::counter!(names::DERIVATIONS, "outcome" => "covered").increment(stats.covered);
                    for (kind, (queries, items)) in &stats.reads {
                        metrics::counter!(names::DERIVATION_QUERIES, "kind" => *kind).increment(*queries);
                        metrics::counter!(names::DERIVATION_ITEMS_READ, "kind" => *kind).increment(*items);
                    }
                    for (attributes, e) in &stats.refused {
                        // Not a reason to hold the shard: the helpers are exact, and reconcile
                        // derives again.
                        tracing::error!(target_key = ?key.0, ?attributes, error = %e, "the table refused a derived attribute; it stays as it was");
                        metrics::counter!(names::DERIVATIONS, "outcome" => "refused").increment(attributes.len() as u64);
                    }
                }
                Err(e) => {
                    metrics::counter!(names::DERIVATIONS, "outcome" => "error").increment(1);
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Bookkeeping of one successful target write.
    fn written(&self, key: &TargetKey, delta: &TargetDelta, stats: crate::sink::WriteStats) {
        record_write(&self.shared, &stats);
        if let Some(seen) = stats.seen {
            self.shared.put_seen(key, seen);
        }
        let mut rules: Vec<&Arc<str>> = delta.contributions.iter().filter_map(|c| c.rule.as_ref()).collect();
        rules.dedup();
        // A sub-item stands for its total: the schedule reconciles the total, and the fold
        // writes it.
        let sub_item = crate::rules::shards::parse(key);
        for r in rules {
            if stats.expiries_set > 0 {
                metrics::counter!(names::HELPER_EXPIRIES, "rule" => r.to_string()).increment(stats.expiries_set);
            }
            match &sub_item {
                Some((total, _)) => {
                    self.shared.touch(r, total);
                    if let Some(n) = self.shared.engine.rules.iter().find(|x| x.name == *r).and_then(|x| x.write_shards) {
                        self.shared.folds.mark(total.clone(), r, n, self.shard(), crate::state::now_ms());
                    }
                }
                None => self.shared.touch(r, key),
            }
        }
    }

    /// Re-writes a target record by record after a permanent write error, so one bad record
    /// does not hold back the others; a record the table still refuses after `max_attempts`
    /// is dead-lettered at once. Returns whether a write was fenced.
    async fn isolate(&mut self, key: &TargetKey, delta: &TargetDelta, ctx: &ShardContext) -> Result<bool, SinkError> {
        let shared = self.shared.clone();
        let max_attempts = shared.config.dead_letter.as_ref().map_or(5, |d| d.max_attempts);
        let mut fenced = false;
        for single in by_record(delta) {
            let mut attempts = 0;
            loop {
                // Paced as the batch's writes are: a refused target's records go to its key one
                // by one, as many writes as records.
                let write = write_target(shared.sink.as_ref(), &shared.engine.key_names, key, &single, ctx);
                match shared.paced(key, write_kind(key), write, written).await {
                    Ok(stats) => {
                        fenced |= stats.fenced;
                        self.written(key, &single, stats);
                        break;
                    }
                    Err(SinkError::Invalid(why)) => {
                        attempts += 1;
                        if attempts >= max_attempts {
                            let mut rules: Vec<String> =
                                single.contributions.iter().filter_map(|c| c.rule.as_deref().map(str::to_string)).collect();
                            rules.dedup();
                            match single.contributions.first().and_then(|c| c.sequence.clone()) {
                                Some(seq) => {
                                    let letter = self.refused_letter(&seq, why, rules, max_attempts).await?;
                                    self.send_letters(&[letter]).await?;
                                }
                                None => {
                                    error!(shard = %self.shard(), error = %why, "a record without a sequence number was refused; it cannot be dead-lettered")
                                }
                            }
                            break;
                        }
                        tokio::time::sleep(crate::sink::backoff(attempts)).await;
                    }
                    Err(e) => {
                        // The batch is retried; with a narrower window if the table throttled.
                        self.window = self.window.after(0, matches!(e, SinkError::Throttled(_)));
                        return Err(e);
                    }
                }
            }
        }
        Ok(fenced)
    }

    /// The letter of a record whose write the table refused. A batch keeps no records once
    /// evaluated, so the record is read again from the stream. A read that fails for a while
    /// (throttling, 5xx) fails the batch, which is re-read later: nothing is lost. A record the
    /// stream no longer has (trimmed, another record in its place, the shard ended before it,
    /// or only empty pages at it, attempt after attempt) travels as its sequence number alone,
    /// marked cut, the reason saying which: a shard must not retry one record for ever.
    async fn refused_letter(&self, seq: &str, why: String, rules: Vec<String>, attempts: u32) -> Result<Letter, SinkError> {
        let mut failures = 0;
        let gone = loop {
            let missing = match self.read_one(seq).await {
                Ok(Reread::Found(record)) => return Ok(Letter::new(record, "write_rejected", why, rules, attempts)),
                Ok(Reread::Missing(missing)) => missing,
                Err(e) if e.is_retriable() && failures < REREAD_ATTEMPTS => Missing::Transient,
                Err(e) if e.is_retriable() => return Err(SinkError::Transient(format!("re-reading refused record {seq}: {e}"))),
                Err(e) => break e.to_string(),
            };
            match missing {
                Missing::Elsewhere => break "the stream returned another record in its place".to_string(),
                Missing::Ended => break "the shard ended before it".to_string(),
                Missing::Empty if failures >= REREAD_ATTEMPTS => {
                    break format!("the stream answered only empty pages at it, {} times", REREAD_ATTEMPTS + 1)
                }
                Missing::Empty | Missing::Transient => {
                    failures += 1;
                    tokio::time::sleep(crate::sink::backoff(failures)).await;
                }
            }
        };
        error!(shard = %self.shard(), sequence_number = %seq, error = %gone, "cannot read a refused record again; its letter carries only its sequence number");
        let message =
            format!("{why} (the record could not be read again from the stream: {gone}; this letter holds only its sequence number)");
        let record = json!({ "dynamodb": { "SequenceNumber": seq } });
        Ok(Letter { cut: true, ..Letter::new(record, "write_rejected", message, rules, attempts) })
    }

    /// The record `seq` of this shard, read again from an AT_SEQUENCE_NUMBER iterator.
    async fn read_one(&self, seq: &str) -> Result<Reread, StreamError> {
        let mut it = self.shared.source.iterator(&self.lease.shard_id, &Position::At(seq.to_string())).await?;
        for _ in 0..3 {
            let page = self.shared.source.records(&it, 1).await?;
            let mut records = page.records;
            if let Some(first) = records.next() {
                return Ok(if sequence_of(&first) == seq { Reread::Found(first) } else { Reread::Missing(Missing::Elsewhere) });
            }
            match page.next_iterator {
                Some(next) => it = next,
                None => return Ok(Reread::Missing(Missing::Ended)),
            }
        }
        Ok(Reread::Missing(Missing::Empty))
    }

    /// A target item refused this shard by its floor. For a stalled former owner that is the
    /// fence working. For a reader that holds the lease on this unfinished shard it breaks an
    /// invariant (every shard the floor passed is finished), e.g. after the state table was
    /// reset and the stream is replayed: the records were applied before, or else lost. It is
    /// never silent: counted, logged, and a reconcile of everything requested (written before
    /// the checkpoint moves; the batch is retried while it cannot be), which repairs either
    /// case; the shard then moves on instead of stalling for good.
    async fn fenced(&self) -> Option<BatchOutcome> {
        if !self.lease.valid() {
            return Some(BatchOutcome::LeaseLost);
        }
        metrics::counter!(names::LEDGER_FENCE_VIOLATIONS).increment(1);
        error!(shard = %self.shard(), "a target item's ledger floor refuses this shard while its lease is held and it is unfinished; a reconcile of everything is requested");
        self.shared.request_reconcile_everything();
        persist_request(&self.shared).await;
        if self.shared.reconcile_everything.load(Ordering::Relaxed) {
            return Some(BatchOutcome::Failed(SinkError::Transient("cannot record the reconcile request".into())));
        }
        None
    }

    /// Sends the letters this reader has not sent yet. A letter SQS cannot take in any form
    /// is logged with its record and counted, never a reason to stall the shard; an
    /// unavailable queue stalls it (nothing is lost).
    async fn send_letters(&mut self, letters: &[Letter]) -> Result<(), SinkError> {
        let now = i64::try_from(now_ms()).unwrap_or(0);
        let first_failed_at = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(now)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_default();
        for l in letters {
            // A record may take a letter for a rule and one per copy rule that could not write.
            let sent = format!("{}:{}:{}", l.sequence, l.code, l.rules.join(","));
            if self.dead_lettered.contains(&sent) {
                continue;
            }
            let rule = l.rules.first().cloned().unwrap_or_default();
            error!(shard = %self.shard(), sequence_number = %l.sequence, rule = %rule, reason = %l.code, queued = self.shared.dead_letters.enabled(), "poison record: {}", l.message);
            let dl = DeadLetter {
                version: 1,
                reason: Reason { code: l.code.clone(), message: l.message.clone() },
                rule,
                rules: l.rules.clone(),
                attempts: l.attempts,
                first_failed_at: first_failed_at.clone(),
                stream_arn: self.shared.stream_arn.clone(),
                shard_id: self.lease.shard_id.clone(),
                sequence_number: l.sequence.clone(),
                variables: l.variables.clone(),
                record: l.record.clone(),
                images_cut: l.cut,
            };
            match self.shared.dead_letters.send(&dl).await {
                Ok(delivery) => {
                    metrics::counter!(names::DEAD_LETTER_DELIVERIES, "form" => delivery.as_str()).increment(1);
                    if delivery == crate::sink::dead_letter::Delivery::Dropped {
                        error!(shard = %self.shard(), sequence_number = %l.sequence, record = %l.record, "SQS refused every form of the dead letter; the record is only in this log");
                    }
                }
                Err(e) => {
                    metrics::counter!(names::DEAD_LETTER_FAILURES).increment(1);
                    error!(shard = %self.shard(), sequence_number = %l.sequence, error = %e, "cannot send a dead letter; the shard waits and retries");
                    return Err(SinkError::Transient(format!("dead-letter queue: {e}")));
                }
            }
            self.dead_lettered.insert(sent);
            if self.shared.dead_letters.enabled() {
                metrics::counter!(names::DEAD_LETTERS, "reason" => l.code.clone()).increment(1);
            }
            metrics::counter!(names::RECORDS_SKIPPED, "reason" => l.code.clone()).increment(1);
        }
        Ok(())
    }
}

/// The contributions of a target, record by record: every rule's contribution of one record
/// together, since the ledger orders records, not contributions (writing one rule's part
/// alone would advance the entry and hide the other rules' parts of the same record).
pub fn by_record(delta: &TargetDelta) -> Vec<TargetDelta> {
    let mut out: Vec<TargetDelta> = Vec::new();
    for c in &delta.contributions {
        match out.last_mut() {
            Some(d) if d.contributions.first().is_some_and(|f| f.sequence == c.sequence) => d.contributions.push(c.clone()),
            _ => out.push(TargetDelta { contributions: vec![c.clone()], ..Default::default() }),
        }
    }
    out
}

fn record_write<S, L, A>(shared: &Shared<S, L, A>, stats: &crate::sink::WriteStats) {
    // Fenced and held writes are also failed conditions: count each once, as what it was.
    let stale = stats.stale.saturating_sub(u64::from(stats.fenced)).saturating_sub(stats.held);
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Fenced.as_str()).increment(u64::from(stats.fenced));
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Held.as_str()).increment(stats.held);
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Stale.as_str()).increment(stale);
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => WriteOutcome::Applied.as_str())
        .increment(stats.calls.saturating_sub(stats.stale));
    metrics::counter!(names::COALESCED_UPDATES).increment(stats.applied_records + stats.skipped_records);
    metrics::counter!(names::WRITE_CAPACITY_UNITS).increment(stats.capacity.round() as u64);
    shared.capacity_milli.fetch_add((stats.capacity * 1000.0).round() as u64, Ordering::Relaxed);
}

/// What a target write spent, for its partition key's budget.
fn written(r: &Result<crate::sink::WriteStats, SinkError>) -> Spent {
    match r {
        Ok(stats) => Spent { cost: Some(stats.capacity), throttled: stats.throttled > 0 },
        Err(e) => Spent { cost: None, throttled: matches!(e, SinkError::Throttled(_)) },
    }
}

/// The kind of a batch's write to `key`, for its partition key's budget.
fn write_kind(key: &TargetKey) -> Kind {
    if is_helper(key) {
        Kind::Helper
    } else {
        Kind::Target
    }
}

/// What a derivation spent, for its partition key's budget.
fn derived(r: &Result<crate::sink::derive::DeriveStats, SinkError>) -> Spent {
    match r {
        Ok(stats) => Spent { cost: Some(stats.write_capacity), throttled: false },
        Err(e) => Spent { cost: None, throttled: matches!(e, SinkError::Throttled(_)) },
    }
}
