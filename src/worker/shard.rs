//! Reading one leased shard: poll, evaluate, write, checkpoint, until the shard ends, the
//! lease is lost, or the replica stops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::Shared;
use crate::config::StartPosition;
use crate::rules::Coalescer;
use crate::sink::dead_letter::{DeadLetter, Reason};
use crate::sink::{write_target, write_target_pruning, AggregateStore, ShardContext, SinkError};
use crate::state::{now_ms, Checkpoint, LeaseStore, Progress};
use crate::stream::{Position, StreamError, StreamSource};
use crate::telemetry::names;

/// Why a shard reader returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardExit {
    /// Read to its end and checkpointed at SHARD_END.
    Finished,
    /// The replica is stopping; everything read was written and checkpointed.
    Stopped,
    /// Another replica owns the lease, or it could not be renewed in time.
    LeaseLost,
}

/// A running reader's handle on its lease.
pub struct ShardLease {
    pub shard_id: String,
    pub counter: u64,
    /// Epoch ms until which the lease is proven; writes stop after it.
    pub valid_until_ms: Arc<AtomicU64>,
    pub checkpoint: Option<Checkpoint>,
}

impl ShardLease {
    fn valid(&self) -> bool {
        now_ms() < self.valid_until_ms.load(Ordering::Relaxed)
    }
}

/// Most concurrent aggregate writes per batch.
const WRITE_CONCURRENCY: usize = 16;
/// GetRecords returns at most 1,000 records; larger batches gather several pages.
const GET_RECORDS_MAX: u32 = 1000;
const IDLE_MIN: Duration = Duration::from_millis(100);
/// An idle shard is polled 4 times a second, as Lambda's event source mapping does: slower
/// polling saves little and adds its period to the lag of the next record.
const IDLE_MAX: Duration = Duration::from_millis(250);

/// Sleeps unless cancelled; returns false when cancelled.
async fn pause(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

pub async fn read_shard<S: StreamSource, L: LeaseStore, A: AggregateStore>(
    shared: Arc<Shared<S, L, A>>,
    lease: ShardLease,
    stop: CancellationToken,
) -> ShardExit {
    let shard = lease.shard_id.clone();
    let ctx = ShardContext::new(&shard);
    let mut position = match &lease.checkpoint {
        Some(Checkpoint::ShardEnd) => return ShardExit::Finished,
        Some(Checkpoint::Sequence(s)) => Position::After(s.clone()),
        None => match shared.config.source.start_position {
            StartPosition::TrimHorizon => Position::TrimHorizon,
            StartPosition::Latest => Position::Latest,
        },
    };
    let mut iterator: Option<String> = None;
    let mut idle = IDLE_MIN;
    let mut failures: u32 = 0;
    let mut last_tip_report = 0u64;
    let mut dead_lettered = std::collections::HashSet::new();
    // Records read but not yet applied: a batch gathers pages until it holds `batch_size`
    // records or the shard's tip is reached, and at the tip waits up to `batching_window`
    // (from its oldest record) for more, as Lambda's batching window.
    // Whenever reading restarts from the checkpoint it is emptied, so no record is in a
    // batch twice.
    let batch_size = shared.config.source.batch_size as usize;
    let window = shared.config.source.batching_window;
    let mut pending: Vec<Value> = Vec::new();
    let mut pending_since: Option<Instant> = None;
    info!(shard = %shard, position = ?position, "reading shard");
    loop {
        if stop.is_cancelled() {
            return ShardExit::Stopped;
        }
        if !lease.valid() {
            warn!(shard = %shard, "lease not renewed in time; stopping reads");
            return ShardExit::LeaseLost;
        }
        let it = match iterator.take() {
            Some(it) => it,
            None => match shared.source.iterator(&shard, &position).await {
                Ok(it) => it,
                Err(StreamError::TrimmedData(why)) => {
                    if !trimmed(&shared, &shard, &why, &mut position) && !pause(idle, &stop).await {
                        return ShardExit::Stopped;
                    }
                    idle = (idle * 2).min(IDLE_MAX);
                    continue;
                }
                Err(StreamError::NotFound(why)) => {
                    warn!(shard = %shard, reason = %why, "shard no longer exists; treating it as finished");
                    return finish(&shared, &lease, &shard).await;
                }
                Err(e) => {
                    failures += 1;
                    warn!(shard = %shard, error = %e, "cannot get a shard iterator; backing off");
                    if !pause(crate::sink::backoff(failures), &stop).await {
                        return ShardExit::Stopped;
                    }
                    continue;
                }
            },
        };
        // A page shorter than the limit means the shard's tip was reached as of this call:
        // everything in the shard before `called_at` is in this page or earlier ones.
        let called_at = now_ms();
        let limit = u32::try_from(batch_size.saturating_sub(pending.len())).unwrap_or(GET_RECORDS_MAX).clamp(1, GET_RECORDS_MAX);
        let page = tokio::select! {
            _ = stop.cancelled() => return ShardExit::Stopped,
            p = shared.source.records(&it, limit) => p,
        };
        let page = match page {
            Ok(p) => p,
            Err(e) => {
                // Reading restarts from the checkpoint: what was gathered is read again.
                pending.clear();
                pending_since = None;
                let outcome = match &e {
                    StreamError::ExpiredIterator => "expired",
                    StreamError::Throttled(_) => "throttled",
                    StreamError::TrimmedData(_) => "trimmed",
                    _ => "error",
                };
                metrics::counter!(names::GET_RECORDS, "outcome" => outcome).increment(1);
                match e {
                    // Resume from the checkpoint with a fresh iterator.
                    StreamError::ExpiredIterator => {}
                    StreamError::TrimmedData(why) => {
                        if !trimmed(&shared, &shard, &why, &mut position) && !pause(idle, &stop).await {
                            return ShardExit::Stopped;
                        }
                        idle = (idle * 2).min(IDLE_MAX);
                    }
                    e => {
                        failures += 1;
                        warn!(shard = %shard, error = %e, "GetRecords failed; backing off");
                        if !pause(crate::sink::backoff(failures), &stop).await {
                            return ShardExit::Stopped;
                        }
                    }
                }
                continue;
            }
        };
        metrics::counter!(names::GET_RECORDS, "outcome" => if page.records.is_empty() { "empty" } else { "ok" }).increment(1);
        let got = page.records.len();
        let short = got < limit as usize;
        if got > 0 {
            pending_since.get_or_insert_with(Instant::now);
            pending.extend(page.records);
        }
        // A full page means more records are there right now: keep gathering (no waiting) up
        // to batch_size. A short page means the tip: apply, or wait out the window first.
        let due = !pending.is_empty()
            && (page.next_iterator.is_none()
                || pending.len() >= batch_size
                || (short && pending_since.is_some_and(|s| s.elapsed() >= window)));
        if due {
            let batch = std::mem::take(&mut pending);
            pending_since = None;
            // A page shorter than asked for: everything before `called_at` is in this batch.
            let at_tip = short.then_some(called_at);
            match apply_batch(&shared, &lease, &ctx, &batch, &mut dead_lettered, at_tip).await {
                Ok(Some(p)) => {
                    if let Some(Checkpoint::Sequence(seq)) = &p {
                        position = Position::After(seq.clone());
                    }
                    failures = 0;
                    idle = IDLE_MIN;
                }
                Ok(None) => return ShardExit::LeaseLost,
                Err(e) => {
                    failures += 1;
                    warn!(shard = %shard, error = %e, attempt = failures, "batch not applied; re-reading it from the checkpoint");
                    if !pause(crate::sink::backoff(failures), &stop).await {
                        return ShardExit::Stopped;
                    }
                    continue; // iterator stays None: re-read from `position`
                }
            }
        }
        match page.next_iterator {
            None => return finish(&shared, &lease, &shard).await,
            Some(next) => iterator = Some(next),
        }
        if let Some(since) = pending_since {
            // Gathering: poll again soon, but not past the window.
            if short && !pause(window.saturating_sub(since.elapsed()).min(IDLE_MIN), &stop).await {
                return ShardExit::Stopped;
            }
        } else if got == 0 {
            shared.set_age(&shard, 0.0);
            let now = now_ms();
            if now.saturating_sub(last_tip_report) >= shared.config.state.lease_duration.as_millis() as u64 / 2 {
                let progress = Progress { checkpoint: None, last_record_ms: None, at_tip_ms: Some(called_at) };
                if let Ok(false) = shared.leases.checkpoint(&shard, &shared.owner, lease.counter, &progress).await {
                    return ShardExit::LeaseLost;
                }
                last_tip_report = now;
            }
            if !pause(idle, &stop).await {
                return ShardExit::Stopped;
            }
            idle = (idle * 2).min(IDLE_MAX);
        }
    }
}

/// A TrimmedDataAccessException. Records were lost only when reading went on from a
/// checkpoint: the records after it were trimmed before they were applied. Then it is never
/// silent: counted, logged, a reconcile of everything scheduled, and reading restarts at the
/// oldest record. Reading from TRIM_HORIZON or LATEST there is no checkpoint to lose records
/// after (DynamoDB Local answers it for a TRIM_HORIZON iterator of an empty shard): the
/// caller just polls again. (Records that age out while a first batch is gathered from the
/// horizon of a stream older than its retention predate everything this consumer applied;
/// such a table needs the initial backfill, `reconcile --all`, in any case.) Returns whether
/// records were lost.
fn trimmed<S, L, A>(shared: &Shared<S, L, A>, shard: &str, why: &str, position: &mut Position) -> bool {
    if !matches!(position, Position::After(_)) {
        debug!(shard = %shard, reason = %why, "trimmed-data answer while reading from the start position; polling again");
        return false;
    }
    metrics::counter!(names::TRIMMED_DATA).increment(1);
    shared.trimmed_events.fetch_add(1, Ordering::Relaxed);
    shared.reconcile_everything.store(true, Ordering::Relaxed);
    error!(shard = %shard, reason = %why, "the checkpoint is beyond the stream's retention: records were lost; aggregates need a reconcile");
    *position = Position::TrimHorizon;
    true
}

async fn finish<S: StreamSource, L: LeaseStore, A: AggregateStore>(shared: &Shared<S, L, A>, lease: &ShardLease, shard: &str) -> ShardExit {
    let progress = Progress { checkpoint: Some(Checkpoint::ShardEnd), last_record_ms: None, at_tip_ms: Some(now_ms()) };
    // Bounded retries: a transient failure here just means the next owner re-reads the end.
    for attempt in 1..=5 {
        match shared.leases.checkpoint(shard, &shared.owner, lease.counter, &progress).await {
            Ok(true) => {
                info!(shard = %shard, "shard read to its end");
                let _ = shared.leases.release(shard, &shared.owner, lease.counter).await;
                return ShardExit::Finished;
            }
            Ok(false) => return ShardExit::LeaseLost,
            Err(e) => {
                warn!(shard = %shard, error = %e, "cannot checkpoint SHARD_END; retrying");
                tokio::time::sleep(crate::sink::backoff(attempt)).await;
            }
        }
    }
    ShardExit::LeaseLost
}

/// A record that will not be applied, on its way to the dead-letter queue.
struct Letter<'r> {
    record: &'r Value,
    sequence: String,
    code: String,
    message: String,
    rules: Vec<String>,
    variables: std::collections::BTreeMap<String, String>,
    attempts: u32,
}

impl Letter<'_> {
    fn add_rule(&mut self, rule: &str) {
        if !self.rules.iter().any(|r| r == rule) {
            self.rules.push(rule.to_string());
        }
    }
}

/// Adds a poison record, or the rule to a record already there (one message per record).
fn push_letter<'r>(letters: &mut Vec<Letter<'r>>, new: Letter<'r>) {
    match letters.iter_mut().find(|l| l.sequence == new.sequence) {
        Some(l) => new.rules.iter().for_each(|r| l.add_rule(r)),
        None => letters.push(new),
    }
}

/// Re-writes a target record by record after a permanent write error, so one bad record
/// does not hold back the others; returns the records the table still refuses after
/// `max_attempts`, as (sequence number, rule, error).
async fn isolate<A: AggregateStore>(
    store: &A,
    key_names: &[String],
    key: &crate::rules::TargetKey,
    delta: &crate::rules::TargetDelta,
    ctx: &ShardContext,
    max_attempts: u32,
) -> Result<Vec<(String, Option<String>, String)>, SinkError> {
    let mut refused = Vec::new();
    for c in &delta.contributions {
        let single = crate::rules::TargetDelta { contributions: vec![c.clone()], ..Default::default() };
        let mut attempts = 0;
        loop {
            match write_target(store, key_names, key, &single, ctx).await {
                Ok(_) => break,
                Err(SinkError::Invalid(why)) => {
                    attempts += 1;
                    if attempts >= max_attempts {
                        refused.push((c.sequence.clone().unwrap_or_default(), c.rule.as_deref().map(str::to_string), why));
                        break;
                    }
                    tokio::time::sleep(crate::sink::backoff(attempts)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(refused)
}

/// Evaluates and writes one batch, sends its poison records to the dead-letter queue, then
/// moves the checkpoint. Ok(None): the lease was lost (nothing checkpointed).
/// Ok(Some(checkpoint)) on success. `dead_lettered` remembers what this reader already
/// queued, so a batch retried after a failure does not queue it twice.
async fn apply_batch<S: StreamSource, L: LeaseStore, A: AggregateStore>(
    shared: &Shared<S, L, A>,
    lease: &ShardLease,
    ctx: &ShardContext,
    records: &[Value],
    dead_lettered: &mut std::collections::HashSet<String>,
    at_tip: Option<u64>,
) -> Result<Option<Option<Checkpoint>>, SinkError> {
    let started = Instant::now();
    let shard = &lease.shard_id;
    let now = now_ms();
    let max_age_ms = shared.config.source.max_record_age.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let mut batch = Coalescer::new();
    let mut letters: Vec<Letter<'_>> = Vec::new();
    let mut last_seq: Option<String> = None;
    let mut newest_ms: Option<u64> = None;
    let mut created: Vec<u64> = Vec::with_capacity(records.len());
    for record in records {
        let seq = record.pointer("/dynamodb/SequenceNumber").and_then(Value::as_str).unwrap_or("").to_string();
        if !seq.is_empty() {
            last_seq = Some(seq.clone());
        }
        let created_ms = record
            .pointer("/dynamodb/ApproximateCreationDateTime")
            .and_then(Value::as_number)
            .and_then(|n| crate::decimal::Decimal::parse(n.as_str()).ok())
            .and_then(|t| t.checked_mul(crate::decimal::Decimal::from_i64(1000)).ok())
            .and_then(|t| t.trunc_i64())
            .and_then(|t| u64::try_from(t).ok());
        if let Some(ms) = created_ms {
            created.push(ms);
            newest_ms = Some(newest_ms.map_or(ms, |n| n.max(ms)));
        }
        if let (Some(max), Some(ms)) = (max_age_ms, created_ms) {
            if now.saturating_sub(ms) > max {
                let rules: Vec<String> =
                    shared.engine.rules.iter().filter(|r| r.filter_matches(record)).map(|r| r.name.to_string()).collect();
                if !rules.is_empty() {
                    let message = format!("record is {} s old; source.max_record_age is {} s", now.saturating_sub(ms) / 1000, max / 1000);
                    push_letter(
                        &mut letters,
                        Letter {
                            record,
                            sequence: seq.clone(),
                            code: "too_old".into(),
                            message,
                            rules,
                            variables: Default::default(),
                            attempts: 1,
                        },
                    );
                }
                continue;
            }
        }
        let report = shared.engine.apply(record, &mut batch);
        for i in &report.matched {
            if let Some(rule) = shared.engine.rules.get(*i) {
                metrics::counter!(names::RECORDS_MATCHED, "rule" => rule.name.to_string()).increment(1);
            }
        }
        for p in &report.poisons {
            push_letter(
                &mut letters,
                Letter {
                    record,
                    sequence: seq.clone(),
                    code: p.code.as_str().into(),
                    message: p.message.clone(),
                    rules: p.rule.iter().map(|r| r.to_string()).collect(),
                    variables: p.variables.clone(),
                    attempts: 1,
                },
            );
        }
    }
    metrics::counter!(names::RECORDS_READ).increment(records.len() as u64);
    let targets = batch.into_targets();
    if !lease.valid() {
        return Ok(None);
    }
    let key_names = &shared.engine.key_names;
    let store = shared.sink.as_ref();
    let floor = shared.open_floor_ms.load(Ordering::Relaxed);
    let ctx = &ShardContext { open_floor: (floor > 0).then(|| crate::sink::ledger::floor_value(floor)), ..ctx.clone() };
    let mut writes = Vec::with_capacity(targets.len());
    for (key, delta) in &targets {
        let prune = shared.take_prunes(key);
        writes.push(async move { (key, delta, write_target_pruning(store, key_names, key, delta, ctx, prune).await) });
    }
    let results: Vec<_> = stream::iter(writes).buffer_unordered(WRITE_CONCURRENCY).collect().await;
    let mut first_error = None;
    let max_attempts = shared.config.dead_letter.as_ref().map_or(5, |d| d.max_attempts);
    for (key, delta, r) in results {
        match r {
            Ok(stats) => {
                record_write(shared, &stats);
                shared.add_prunes(key, stats.prunable);
                let mut rules: Vec<&str> = delta.contributions.iter().filter_map(|c| c.rule.as_deref()).collect();
                rules.dedup();
                for r in rules {
                    shared.touch(r, key);
                }
            }
            Err(SinkError::Invalid(why)) => {
                metrics::counter!(names::AGGREGATE_WRITES, "outcome" => "rejected").increment(1);
                warn!(shard = %shard, error = %why, "aggregate write refused; retrying record by record");
                match isolate(store, key_names, key, delta, ctx, max_attempts).await {
                    Ok(refused) => {
                        for (seq, rule, why) in refused {
                            if let Some(record) =
                                records.iter().find(|r| r.pointer("/dynamodb/SequenceNumber").and_then(Value::as_str) == Some(seq.as_str()))
                            {
                                let rules = rule.into_iter().collect();
                                push_letter(
                                    &mut letters,
                                    Letter {
                                        record,
                                        sequence: seq,
                                        code: "write_rejected".into(),
                                        message: why,
                                        rules,
                                        variables: Default::default(),
                                        attempts: max_attempts,
                                    },
                                );
                            }
                        }
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            Err(e) => {
                metrics::counter!(names::AGGREGATE_WRITES, "outcome" => "error").increment(1);
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    // Poison records go to the queue before the checkpoint passes them: if SQS is down the
    // shard waits here (the batch is retried from its checkpoint) and nothing is lost.
    let first_failed_at = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(i64::try_from(now).unwrap_or(0))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default();
    for l in &letters {
        let rule = l.rules.first().cloned().unwrap_or_default();
        if dead_lettered.contains(&l.sequence) {
            continue;
        }
        error!(shard = %shard, sequence_number = %l.sequence, rule = %rule, reason = %l.code, queued = shared.dead_letters.enabled(), "poison record: {}", l.message);
        let dl = DeadLetter {
            version: 1,
            reason: Reason { code: l.code.clone(), message: l.message.clone() },
            rule: rule.clone(),
            rules: l.rules.clone(),
            attempts: l.attempts,
            first_failed_at: first_failed_at.clone(),
            stream_arn: shared.stream_arn.clone(),
            shard_id: shard.clone(),
            sequence_number: l.sequence.clone(),
            variables: l.variables.clone(),
            record: l.record.clone(),
            images_cut: false,
        };
        if let Err(e) = shared.dead_letters.send(&dl).await {
            metrics::counter!(names::DEAD_LETTER_FAILURES).increment(1);
            error!(shard = %shard, sequence_number = %l.sequence, error = %e, "cannot send a dead letter; the shard waits and retries");
            return Err(SinkError::Transient(format!("dead-letter queue: {e}")));
        }
        dead_lettered.insert(l.sequence.clone());
        if shared.dead_letters.enabled() {
            metrics::counter!(names::DEAD_LETTERS, "reason" => l.code.clone()).increment(1);
        }
        metrics::counter!(names::RECORDS_SKIPPED, "reason" => l.code.clone()).increment(1);
    }
    // The checkpoint moves only after every target write of the batch succeeded (or its
    // record was dead-lettered).
    let checkpoint = last_seq.map(Checkpoint::Sequence);
    if !lease.valid() {
        return Ok(None);
    }
    let progress = Progress { checkpoint: checkpoint.clone(), last_record_ms: newest_ms, at_tip_ms: at_tip };
    let mut attempt = 0;
    loop {
        match shared.leases.checkpoint(shard, &shared.owner, lease.counter, &progress).await {
            Ok(true) => break,
            Ok(false) => return Ok(None),
            Err(e) if e.is_retriable() && attempt < 5 => {
                attempt += 1;
                tokio::time::sleep(crate::sink::backoff(attempt)).await;
            }
            // The writes are in (and idempotent): a failed checkpoint only means a replay.
            Err(e) => return Err(SinkError::Transient(format!("checkpoint: {e}"))),
        }
    }
    dead_lettered.clear();
    let now = now_ms();
    for ms in &created {
        metrics::histogram!(names::END_TO_END_LAG_SECONDS).record(now.saturating_sub(*ms) as f64 / 1000.0);
    }
    let age = newest_ms.map_or(0.0, |n| now.saturating_sub(n) as f64 / 1000.0);
    shared.set_age(shard, age);
    metrics::histogram!(names::BATCH_DURATION_SECONDS).record(started.elapsed().as_secs_f64());
    Ok(Some(checkpoint))
}

fn record_write<S, L, A>(shared: &Shared<S, L, A>, stats: &crate::sink::WriteStats) {
    // A fenced write is also a failed condition: count it once, as fenced.
    let stale = stats.stale.saturating_sub(u64::from(stats.fenced));
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => "fenced").increment(u64::from(stats.fenced));
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => "stale").increment(stale);
    metrics::counter!(names::AGGREGATE_WRITES, "outcome" => "applied").increment(stats.calls.saturating_sub(stats.stale));
    metrics::counter!(names::COALESCED_UPDATES).increment(stats.applied_records + stats.skipped_records);
    metrics::counter!(names::WRITE_CAPACITY_UNITS).increment(stats.capacity.round() as u64);
    shared.capacity_milli.fetch_add((stats.capacity * 1000.0).round() as u64, Ordering::Relaxed);
}
