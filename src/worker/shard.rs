//! Reading one leased shard: poll, evaluate, write, checkpoint, until the shard ends, the
//! lease is lost, or the replica stops.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use futures::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::batch::{created_ms, sequence_of, Evaluated, Letter, PendingBatch};
use super::phases::{BatchPhases, Gathering};
use super::tip::EmptyRun;
use super::window::WriteWindow;
use super::{Polling, Shared};
use crate::rules::{TargetDelta, TargetKey};
use crate::sink::dead_letter::{DeadLetter, Reason};
use crate::sink::{write_target, write_target_pruning, AggregateStore, ShardContext, SinkError};
use crate::state::{now_ms, Checkpoint, LeaseStore, Progress};
use crate::stream::{Position, StreamError, StreamSource};
use crate::telemetry::names::{self, ReadOutcome, WriteOutcome};

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
    /// Where reading starts; None: the shard is finished.
    pub start: Option<Position>,
}

impl ShardLease {
    fn valid(&self) -> bool {
        now_ms() < self.valid_until_ms.load(Ordering::Relaxed)
    }
}

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
/// GetRecords returns at most 1,000 records; larger batches gather several pages.
const GET_RECORDS_MAX: u32 = 1000;
pub const IDLE_MIN: Duration = Duration::from_millis(100);
/// An idle shard is polled 4 times a second, as Lambda's event source mapping does: slower
/// polling saves little and adds its period to the lag of the next record.
pub const IDLE_MAX: Duration = Duration::from_millis(250);

/// The time since `mark`, which moves to now.
fn lap(mark: &mut Instant) -> Duration {
    let now = Instant::now();
    let d = now.saturating_duration_since(*mark);
    *mark = now;
    d
}

/// Sleeps unless cancelled; returns false when cancelled.
async fn pause(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        biased; // the stop first, and the same choice on every run (a simulation replays)
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// How long after its last records a shard is polled at `idle_min` when a poll finds nothing:
/// a record that arrives in a short lull of a busy shard waits at most `idle_min`, not the
/// idle backoff's `idle_max`.
pub const ACTIVE_FOR: Duration = Duration::from_secs(1);

/// The wait after this empty poll: `idle_min` while the shard had records within
/// [`ACTIVE_FOR`], otherwise doubling up to `idle_max` (an idle shard is polled 4 times a
/// second, as Lambda does).
pub fn next_idle(current: Duration, polling: &Polling, since_records: Option<Duration>) -> Duration {
    if since_records.is_some_and(|d| d < ACTIVE_FOR) {
        polling.idle_min
    } else {
        (current * 2).min(polling.idle_max)
    }
}

/// Whether gathered records are applied now: a full batch, the shard's end, or the tip (a
/// short page) once the batching window has passed since the oldest record.
pub fn batch_due(pending: usize, batch_size: usize, shard_end: bool, at_tip: bool, window_passed: bool) -> bool {
    pending > 0 && (shard_end || pending >= batch_size || (at_tip && window_passed))
}

/// How one batch ended.
#[derive(Debug)]
pub enum BatchOutcome {
    /// Written and checkpointed (None: the batch held no sequence number to checkpoint).
    Applied(Option<Checkpoint>),
    /// The lease was lost or could not be proven: nothing was checkpointed.
    LeaseLost,
    /// Not applied; the batch is read again from the checkpoint after a backoff.
    Failed(SinkError),
}

/// Whether the reader goes on after handling an event.
enum Flow {
    Continue,
    Exit(ShardExit),
}

/// One leased shard's reader: poll, evaluate, write, checkpoint.
pub struct ShardReader<S, L, A> {
    shared: Arc<Shared<S, L, A>>,
    lease: ShardLease,
    stop: CancellationToken,
    ctx: ShardContext,
    position: Position,
    iterator: Option<String>,
    idle: Duration,
    failures: u32,
    last_tip_report: u64,
    /// The empty pages in a row on this iterator chain: reconcile's evidence for an idle
    /// shard ([`super::tip::EmptyRun`]).
    empty_run: EmptyRun,
    /// Sequence numbers this reader already queued, so a retried batch does not queue twice.
    dead_lettered: HashSet<String>,
    /// Records read but not yet applied: a batch gathers pages until it holds `batch_size`
    /// records or the tip is reached, and at the tip waits up to `batching_window` (from its
    /// oldest record) for more, as Lambda's batching window. Emptied whenever reading
    /// restarts from the checkpoint, so no record is in a batch twice.
    pending: PendingBatch,
    pending_since: Option<Instant>,
    /// The read side of the pending batch's phases, and when the last GetRecords call ended.
    gathering: Gathering,
    last_read_end: Option<Instant>,
    /// When a GetRecords call last returned records ([`next_idle`]).
    last_records_at: Option<Instant>,
    /// Read from LATEST with no checkpoint yet: the iterator of the first page of the pending
    /// batch (everything before it is applied). A failed batch, or a read error that drops the
    /// pending records, reads again from it: a new LATEST iterator would skip them.
    latest_from: Option<String>,
    /// How many target writes of a batch are in flight at once ([`WriteWindow`]).
    window: WriteWindow,
}

pub async fn read_shard<S: StreamSource, L: LeaseStore, A: AggregateStore>(
    shared: Arc<Shared<S, L, A>>,
    lease: ShardLease,
    stop: CancellationToken,
) -> ShardExit {
    let Some(position) = lease.start.clone() else { return ShardExit::Finished };
    let ctx = ShardContext::new(&shared.ledger, &lease.shard_id);
    let idle_min = shared.polling.idle_min;
    info!(shard = %lease.shard_id, position = ?position, "reading shard");
    if crate::worker::plan::latest_taken_again(&position, lease.counter) {
        // An earlier reader started at LATEST and lost the lease (or crashed) before its first
        // checkpoint: what arrived between its start and this one may be skipped. Never silent.
        warn!(shard = %lease.shard_id, "a shard read from LATEST changed hands before its first checkpoint: records between the two readers' starts may be skipped; a reconcile of everything is requested");
        shared.request_reconcile_everything();
        persist_request(&shared).await;
    }
    let window = WriteWindow::new(shared.config.write_concurrency);
    let reader = ShardReader {
        shared,
        lease,
        stop,
        ctx,
        position,
        iterator: None,
        idle: idle_min,
        failures: 0,
        last_tip_report: 0,
        empty_run: EmptyRun::default(),
        dead_lettered: HashSet::new(),
        pending: PendingBatch::default(),
        pending_since: None,
        gathering: Gathering::default(),
        last_read_end: None,
        last_records_at: None,
        latest_from: None,
        window,
    };
    reader.run().await
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> ShardReader<S, L, A> {
    async fn run(mut self) -> ShardExit {
        loop {
            if let Flow::Exit(e) = self.step().await {
                return e;
            }
        }
    }

    fn shard(&self) -> &str {
        &self.lease.shard_id
    }

    /// One GetRecords call and what follows from it.
    async fn step(&mut self) -> Flow {
        if self.stop.is_cancelled() {
            return Flow::Exit(ShardExit::Stopped);
        }
        if !self.lease.valid() {
            warn!(shard = %self.shard(), "lease not renewed in time; stopping reads");
            return Flow::Exit(ShardExit::LeaseLost);
        }
        let it = match self.iterator.take() {
            Some(it) => it,
            None => match self.shared.source.iterator(&self.lease.shard_id, &self.position).await {
                Ok(it) => {
                    self.empty_run.reset();
                    it
                }
                Err(e) => return self.on_iterator_error(e).await,
            },
        };
        if self.position == Position::Latest && self.pending.records == 0 {
            self.latest_from = Some(it.clone());
        }
        let called_at = now_ms();
        let batch_size = self.shared.config.source.batch_size as usize;
        let limit = u32::try_from(batch_size.saturating_sub(self.pending.records)).unwrap_or(GET_RECORDS_MAX).clamp(1, GET_RECORDS_MAX);
        let call_start = Instant::now();
        let page = tokio::select! {
            biased;
            _ = self.stop.cancelled() => return Flow::Exit(ShardExit::Stopped),
            p = self.shared.source.records(&it, limit) => p,
        };
        let gap = self.last_read_end.map_or(Duration::ZERO, |end| call_start.saturating_duration_since(end));
        self.last_read_end = Some(Instant::now());
        let page = match page {
            Ok(p) => p,
            Err(e) => return self.on_read_error(e, it).await,
        };
        metrics::counter!(names::GET_RECORDS, "outcome" => if page.records.is_empty() { ReadOutcome::Empty } else { ReadOutcome::Ok }.as_str())
            .increment(1);
        let got = page.records.len();
        // A short page is not the tip (pages stop at 1 MB): only empty ones count.
        let evidence = self.empty_run.page(&self.shared.config.tip_evidence, got, called_at);
        let short = got < limit as usize;
        self.gathering.page(self.pending.records, got, gap, call_start.elapsed());
        if got > 0 {
            self.last_records_at = self.last_read_end;
            let first = page.records.iter().find_map(created_ms);
            self.shared.note_age(&self.lease.shard_id, |a| a.read(first));
            self.pending_since.get_or_insert_with(Instant::now);
            let max_age_ms = self.shared.config.source.max_record_age.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            self.pending.add_page(&self.shared.engine, max_age_ms, page.records, now_ms());
        }
        let window = self.shared.config.source.batching_window;
        let window_passed = self.pending_since.is_some_and(|s| s.elapsed() >= window);
        if batch_due(self.pending.records, batch_size, page.next_iterator.is_none(), short, window_passed) {
            let batch = std::mem::take(&mut self.pending).finish();
            self.pending_since = None;
            let gathered = std::mem::take(&mut self.gathering);
            let outcome = self.apply(batch, evidence, gathered).await;
            // The next batch's poll wait starts now, not at this page (applying is not waiting).
            self.last_read_end = Some(Instant::now());
            match outcome {
                BatchOutcome::Applied(cp) => {
                    if let Some(Checkpoint::Sequence(seq)) = cp {
                        self.position = Position::After(seq);
                    }
                    self.failures = 0;
                    self.idle = self.shared.polling.idle_min;
                }
                BatchOutcome::LeaseLost => return Flow::Exit(ShardExit::LeaseLost),
                BatchOutcome::Failed(e) => {
                    self.failures += 1;
                    warn!(shard = %self.shard(), error = %e, attempt = self.failures, "batch not applied; re-reading it from the checkpoint");
                    // Reading restarts from `position`, or, before a first checkpoint at
                    // LATEST, from the batch's first page.
                    self.iterator = self.restart_at_latest();
                    return self.pause_or_stop(crate::sink::backoff(self.failures)).await;
                }
            }
        }
        match page.next_iterator {
            None => return Flow::Exit(finish(&self.shared, &self.lease, &self.lease.shard_id).await),
            Some(next) => self.iterator = Some(next),
        }
        if let Some(since) = self.pending_since {
            // Gathering: poll again soon, but not past the window.
            if short {
                return self.pause_or_stop(window.saturating_sub(since.elapsed()).min(self.shared.polling.idle_min)).await;
            }
            return Flow::Continue;
        }
        if got == 0 {
            return self.at_tip(evidence).await;
        }
        Flow::Continue
    }

    async fn pause_or_stop(&self, d: Duration) -> Flow {
        if pause(d, &self.stop).await {
            Flow::Continue
        } else {
            Flow::Exit(ShardExit::Stopped)
        }
    }

    /// Nothing more to read: report the tip now and then (reconcile's evidence, once there is
    /// some), poll again after the idle backoff.
    async fn at_tip(&mut self, evidence: Option<u64>) -> Flow {
        self.shared.note_age(&self.lease.shard_id, |a| a.tip());
        let now = now_ms();
        let due = now.saturating_sub(self.last_tip_report) >= self.shared.config.state.lease_duration.as_millis() as u64 / 2;
        if let Some(tip) = evidence.filter(|_| due) {
            let progress = Progress { checkpoint: self.horizon_marker(), last_record_ms: None, at_tip_ms: Some(tip) };
            if let Ok(false) = self.shared.leases.checkpoint(&self.lease.shard_id, &self.shared.owner, self.lease.counter, &progress).await
            {
                return Flow::Exit(ShardExit::LeaseLost);
            }
            self.last_tip_report = now;
        }
        let flow = self.pause_or_stop(self.idle).await;
        self.idle = next_idle(self.idle, &self.shared.polling, self.last_records_at.map(|t| t.elapsed()));
        flow
    }

    /// A reader that started at the trim horizon and has applied nothing leaves that as its
    /// checkpoint where the next owner would otherwise start at LATEST and skip whatever
    /// arrives in between (reconcile's own consumer before the first `run`, say).
    fn horizon_marker(&self) -> Option<Checkpoint> {
        let from_horizon = self.lease.start == Some(Position::TrimHorizon) && self.position == Position::TrimHorizon;
        (from_horizon && self.shared.config.source.start_position == crate::config::StartPosition::Latest)
            .then_some(Checkpoint::TrimHorizon)
    }

    async fn on_iterator_error(&mut self, e: StreamError) -> Flow {
        self.shared.note_age(&self.lease.shard_id, |a| a.failed(now_ms()));
        match e {
            StreamError::TrimmedData(why) => self.on_trimmed(&why).await,
            StreamError::NoIterator(why) => {
                info!(shard = %self.shard(), reason = %why, "no iterator: the shard is closed and read");
                Flow::Exit(finish(&self.shared, &self.lease, &self.lease.shard_id).await)
            }
            StreamError::NotFound(why) => {
                // The shard left the stream before this reader reached its end: whatever it
                // held after the checkpoint is gone.
                shard_lost(&self.shared, &self.lease.shard_id, &why).await;
                Flow::Exit(finish(&self.shared, &self.lease, &self.lease.shard_id).await)
            }
            e => {
                self.failures += 1;
                warn!(shard = %self.shard(), error = %e, "cannot get a shard iterator; backing off");
                self.pause_or_stop(crate::sink::backoff(self.failures)).await
            }
        }
    }

    async fn on_read_error(&mut self, e: StreamError, it: String) -> Flow {
        self.shared.note_age(&self.lease.shard_id, |a| a.failed(now_ms()));
        if e.is_retriable() && e != StreamError::ExpiredIterator {
            // Throttling or a passing error: the iterator is still good (and for a shard
            // started at LATEST with no checkpoint yet, the only record of where it started),
            // so retry it, keeping what was gathered.
            metrics::counter!(names::GET_RECORDS, "outcome" => if matches!(e, StreamError::Throttled(_)) { ReadOutcome::Throttled } else { ReadOutcome::Error }.as_str())
                .increment(1);
            self.iterator = Some(it);
            self.failures += 1;
            warn!(shard = %self.shard(), error = %e, "GetRecords failed; backing off");
            return self.pause_or_stop(crate::sink::backoff(self.failures)).await;
        }
        // Reading restarts from the checkpoint: what was gathered is read again (before a
        // first checkpoint at LATEST, from the pending batch's first page).
        self.pending = PendingBatch::default();
        self.pending_since = None;
        if !matches!(e, StreamError::ExpiredIterator | StreamError::TrimmedData(_)) {
            self.iterator = self.restart_at_latest();
        }
        if e == StreamError::ExpiredIterator && self.position == Position::Latest {
            // Started at LATEST and not checkpointed yet: a new LATEST iterator would skip
            // whatever arrived since, so that stretch may be missing. Never silent.
            warn!(shard = %self.shard(), "iterator expired before the first checkpoint of a shard read from LATEST: records may have been skipped; a reconcile of everything is requested");
            self.shared.request_reconcile_everything();
            persist_request(&self.shared).await;
        }
        let outcome = match &e {
            StreamError::ExpiredIterator => ReadOutcome::Expired,
            StreamError::Throttled(_) => ReadOutcome::Throttled,
            StreamError::TrimmedData(_) => ReadOutcome::Trimmed,
            _ => ReadOutcome::Error,
        };
        metrics::counter!(names::GET_RECORDS, "outcome" => outcome.as_str()).increment(1);
        match e {
            // Resume from the checkpoint with a fresh iterator.
            StreamError::ExpiredIterator => Flow::Continue,
            StreamError::TrimmedData(why) => self.on_trimmed(&why).await,
            e => {
                self.failures += 1;
                warn!(shard = %self.shard(), error = %e, "GetRecords failed; backing off");
                self.pause_or_stop(crate::sink::backoff(self.failures)).await
            }
        }
    }

    /// Where reading restarts after a failure before a first checkpoint at LATEST: the pending
    /// batch's first page (None: from `position`, a checkpoint or the horizon, as ever). An
    /// iterator that expired meanwhile is answered as expired, which requests a reconcile.
    fn restart_at_latest(&self) -> Option<String> {
        (self.position == Position::Latest).then(|| self.latest_from.clone()).flatten()
    }

    async fn on_trimmed(&mut self, why: &str) -> Flow {
        let lost = trimmed(&self.shared, &self.lease.shard_id, why, &mut self.position);
        if lost {
            persist_request(&self.shared).await;
        }
        // A lost stretch behind a checkpoint: read on from the trim horizon at once. Otherwise
        // (the start position answered so) poll again after the idle backoff.
        let flow = if lost && self.position == Position::TrimHorizon { Flow::Continue } else { self.pause_or_stop(self.idle).await };
        self.idle = (self.idle * 2).min(self.shared.polling.idle_max);
        flow
    }

    /// Evaluates, dead-letters, writes and checkpoints one batch. Letters go out before the
    /// writes: a replica that dies in between leaves a record skipped by the ledger only
    /// after its letter is queued (a duplicate letter is fine, a missing one is not).
    async fn apply(&mut self, evaluated: Evaluated, at_tip: Option<u64>, gathered: Gathering) -> BatchOutcome {
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
        if let Err(outcome) = self.write(&evaluated.targets).await {
            return outcome;
        }
        // Derived attributes (max, min, latest, distinct) follow their helpers before the
        // checkpoint moves: a crash in between replays the batch, which derives again.
        if let Err(e) = self.derive(&evaluated.targets).await {
            return BatchOutcome::Failed(e);
        }
        phases.writes = lap(&mut mark);
        // The checkpoint moves only after every target write of the batch succeeded (or its
        // record was dead-lettered).
        let checkpoint = evaluated.facts.last_seq.map(Checkpoint::Sequence);
        let progress = Progress { checkpoint: checkpoint.clone(), last_record_ms: evaluated.facts.newest_ms, at_tip_ms: at_tip };
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
    async fn write(&mut self, targets: &[(TargetKey, TargetDelta)]) -> Result<(), BatchOutcome> {
        let shared = self.shared.clone();
        let key_names = &shared.engine.key_names;
        let store = shared.sink.as_ref();
        let ctx = ShardContext { plan: shared.floor_plan(), ..self.ctx.clone() };
        let ctx = &ctx;
        let mut writes = Vec::with_capacity(targets.len());
        for (key, delta) in targets {
            let seen = shared.take_seen(key);
            writes.push(async move { (key, delta, write_target_pruning(store, key_names, key, delta, ctx, seen.as_ref()).await) });
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
        let mut runs = Vec::with_capacity(derive.len());
        for t in &derive {
            runs.push(async move { (&t.key, crate::sink::derive::derive_target(store, key_names, ledger, t).await) });
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
        let mut rules: Vec<&str> = delta.contributions.iter().filter_map(|c| c.rule.as_deref()).collect();
        rules.dedup();
        for r in rules {
            self.shared.touch(r, key);
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
                match write_target(shared.sink.as_ref(), &shared.engine.key_names, key, &single, ctx).await {
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
            if let Some(first) = page.records.into_iter().next() {
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
            if self.dead_lettered.contains(&l.sequence) {
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
            self.dead_lettered.insert(l.sequence.clone());
            if self.shared.dead_letters.enabled() {
                metrics::counter!(names::DEAD_LETTERS, "reason" => l.code.clone()).increment(1);
            }
            metrics::counter!(names::RECORDS_SKIPPED, "reason" => l.code.clone()).increment(1);
        }
        Ok(())
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
    match position {
        Position::After(_) | Position::At(_) => {}
        Position::TrimHorizon => {
            debug!(shard = %shard, reason = %why, "trimmed-data answer while reading from the trim horizon; polling again");
            return false;
        }
        Position::Latest => {
            // A new LATEST iterator skips whatever arrived since this reader started (DynamoDB
            // Local answers so once records arrive on a shard that was empty). Never silent.
            warn!(shard = %shard, reason = %why, "trimmed-data answer before the first checkpoint of a shard read from LATEST: records written since may be skipped; a reconcile of everything is requested");
            shared.request_reconcile_everything();
            return true;
        }
    }
    metrics::counter!(names::TRIMMED_DATA).increment(1);
    shared.trimmed_events.fetch_add(1, Ordering::Relaxed);
    shared.request_reconcile_everything();
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

/// The shard left the stream before it was read to its end: counted, logged, and a reconcile
/// of everything requested, never silent. The request is written before the caller finishes
/// the lease, so a crash in between cannot lose both.
pub(super) async fn shard_lost<S, L: LeaseStore, A>(shared: &Shared<S, L, A>, shard: &str, why: &str) {
    metrics::counter!(names::SHARDS_LOST).increment(1);
    error!(shard = %shard, reason = %why, "the shard left the stream before it was read to its end: records were lost; aggregates need a reconcile");
    shared.request_reconcile_everything();
    persist_request(shared).await;
}

/// Writes a pending "reconcile everything" request to the state table now; on failure it
/// stays pending and the next maintenance round tries again.
pub(super) async fn persist_request<S, L: LeaseStore, A>(shared: &Shared<S, L, A>) {
    if !shared.reconcile_everything.swap(false, Ordering::Relaxed) {
        return;
    }
    if let Err(e) = shared.leases.request_reconcile(now_ms()).await {
        warn!(error = %e, "cannot record the reconcile request yet; retrying");
        shared.reconcile_everything.store(true, Ordering::Relaxed);
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
