//! Reading one leased shard: poll, evaluate, write, checkpoint, until the shard ends, the
//! lease is lost, or the replica stops.
//!
//! With `source.read_ahead`, batches are pipelined behind the tip: while a full batch writes
//! ([`super::apply`]), the next is read and evaluated. At most one batch is in flight, and the next one's writes start only
//! after the one in flight has written and checkpointed, so a target's writes from one shard land in
//! sequence order and the checkpoint (with what reconcile reads as applied: `last_record_ms`,
//! `at_tip_ms`) only ever covers batches whose writes are done. What was read ahead is only in
//! memory: a batch in flight that fails drops it, and reading restarts at the checkpoint.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::apply::Applier;
use super::batch::PendingBatch;
use super::phases::Gathering;
use super::tip::EmptyRun;
use super::{Polling, Shared};
use crate::sink::{AggregateStore, SinkError};
use crate::state::{now_ms, Checkpoint, LeaseStore, Progress};
use crate::stream::{Page, Position, StreamError, StreamSource};
use crate::telemetry::names::{self, ReadOutcome};

/// Why a shard reader returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardExit {
    /// Read to its end and checkpointed at SHARD_END.
    Finished,
    /// The replica is stopping; the batch in flight was written and checkpointed, what was
    /// read after it is read again by the next owner.
    Stopped,
    /// Another replica owns the lease, or it could not be renewed in time.
    LeaseLost,
}

/// A running reader's handle on its lease.
#[derive(Debug, Clone)]
pub struct ShardLease {
    pub shard_id: String,
    pub counter: u64,
    /// Epoch ms until which the lease is proven; writes stop after it.
    pub valid_until_ms: Arc<AtomicU64>,
    /// Where reading starts; None: the shard is finished.
    pub start: Option<Position>,
}

impl ShardLease {
    pub(super) fn valid(&self) -> bool {
        now_ms() < self.valid_until_ms.load(Ordering::Relaxed)
    }
}

/// GetRecords returns at most 1,000 records; larger batches gather several pages.
const GET_RECORDS_MAX: u32 = 1000;
pub const IDLE_MIN: Duration = Duration::from_millis(100);
/// An idle shard is polled 4 times a second, as Lambda's event source mapping does: slower
/// polling saves little and adds its period to the lag of the next record.
pub const IDLE_MAX: Duration = Duration::from_millis(250);

/// The time since `mark`, which moves to now.
pub(super) fn lap(mark: &mut Instant) -> Duration {
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

/// Whether a due batch starts writing now: when nothing is in flight, or when it is full or
/// ends the shard. A batch due at the tip while another writes waits for it and gathers what
/// one more poll brings: cut at once it would be small, and cost a round of writes and a
/// checkpoint of its own, which at the tip adds to the lag of every record behind it.
pub fn cut_now(full: bool, shard_end: bool, busy: bool) -> bool {
    !busy || full || shard_end
}

/// Whether the next batch is read while this one (`full` or not) writes. Only behind the tip,
/// where the batch is full: at the tip the next poll finds little, and polling while the batch
/// writes costs the table about what it gains (on DynamoDB Local it raised lag p50 from 0.5 to
/// 0.8-1.3 s). Never before a first checkpoint at LATEST, where the only record of where reading
/// started is the pending batch's first page.
pub fn read_ahead(position: &Position, full: bool) -> bool {
    full && *position != Position::Latest
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

/// A batch applied: the applier back, and how the batch ended.
type Landed<S, L, A> = (Box<Applier<S, L, A>>, BatchOutcome);

/// The batch being applied.
type InFlight<S, L, A> = Pin<Box<dyn Future<Output = Landed<S, L, A>> + Send>>;

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
    /// The checkpoint of the last batch applied (or where reading started).
    position: Position,
    iterator: Option<String>,
    idle: Duration,
    failures: u32,
    last_tip_report: u64,
    /// The empty pages in a row on this iterator chain: reconcile's evidence for an idle
    /// shard ([`super::tip::EmptyRun`]).
    empty_run: EmptyRun,
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
    /// The write side, while no batch is in flight.
    applier: Option<Box<Applier<S, L, A>>>,
    /// The batch being written while the next one is read.
    in_flight: Option<InFlight<S, L, A>>,
    /// The batch in flight, finished during a read and not yet taken in.
    landed: Option<Landed<S, L, A>>,
}

pub async fn read_shard<S: StreamSource, L: LeaseStore, A: AggregateStore>(
    shared: Arc<Shared<S, L, A>>,
    lease: ShardLease,
    stop: CancellationToken,
) -> ShardExit {
    let Some(position) = lease.start.clone() else { return ShardExit::Finished };
    let idle_min = shared.polling.idle_min;
    info!(shard = %lease.shard_id, position = ?position, "reading shard");
    if crate::worker::plan::latest_taken_again(&position, lease.counter) {
        // An earlier reader started at LATEST and lost the lease (or crashed) before its first
        // checkpoint: what arrived between its start and this one may be skipped. Never silent.
        warn!(shard = %lease.shard_id, "a shard read from LATEST changed hands before its first checkpoint: records between the two readers' starts may be skipped; a reconcile of everything is requested");
        shared.request_reconcile_everything();
        persist_request(&shared).await;
    }
    let applier = Box::new(Applier::new(shared.clone(), lease.clone()));
    let reader = ShardReader {
        shared,
        lease,
        stop,
        position,
        iterator: None,
        idle: idle_min,
        failures: 0,
        last_tip_report: 0,
        empty_run: EmptyRun::default(),
        pending: PendingBatch::default(),
        pending_since: None,
        gathering: Gathering::default(),
        last_read_end: None,
        last_records_at: None,
        latest_from: None,
        applier: Some(applier),
        in_flight: None,
        landed: None,
    };
    reader.run().await
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> ShardReader<S, L, A> {
    async fn run(mut self) -> ShardExit {
        loop {
            if let Flow::Exit(e) = self.step().await {
                // A batch still in flight finishes (writes and checkpoint) before the reader
                // returns, as a batch applied inline did; what was read ahead is read again
                // by the next owner.
                return match self.land().await {
                    Some(BatchOutcome::LeaseLost) => ShardExit::LeaseLost,
                    _ => e,
                };
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
                Err(e) => {
                    if let Err(flow) = self.settle().await {
                        return flow;
                    }
                    return self.on_iterator_error(e).await;
                }
            },
        };
        if self.position == Position::Latest && self.pending.records == 0 {
            self.latest_from = Some(it.clone());
        }
        let called_at = now_ms();
        let batch_size = self.shared.config.source.batch_size as usize;
        let limit = u32::try_from(batch_size.saturating_sub(self.pending.records)).unwrap_or(GET_RECORDS_MAX).clamp(1, GET_RECORDS_MAX);
        let call_start = Instant::now();
        let Some(page) = self.read_page(&it, limit).await else { return Flow::Exit(ShardExit::Stopped) };
        let gap = self.last_read_end.map_or(Duration::ZERO, |end| call_start.saturating_duration_since(end));
        self.last_read_end = Some(Instant::now());
        // The batch in flight may have finished during the call; if it failed, this page is
        // dropped with everything else read after its checkpoint.
        if self.landed.is_some() {
            if let Err(flow) = self.settle().await {
                return flow;
            }
        }
        let page = match page {
            Ok(p) => p,
            Err(e) => {
                if let Err(flow) = self.settle().await {
                    return flow;
                }
                return self.on_read_error(e, it).await;
            }
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
            let first = page.records.first_created_ms();
            self.shared.note_age(&self.lease.shard_id, |a| a.read(first));
            self.pending_since.get_or_insert_with(Instant::now);
            let max_age_ms = self.shared.config.source.max_record_age.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            let created = crate::shard_id::created_ms(&self.lease.shard_id);
            self.pending.add_page(&self.shared.engine, max_age_ms, page.records, now_ms(), created);
        }
        let window = self.shared.config.source.batching_window;
        let window_passed = self.pending_since.is_some_and(|s| s.elapsed() >= window);
        if batch_due(self.pending.records, batch_size, page.next_iterator.is_none(), short, window_passed) {
            let full = self.pending.records >= batch_size;
            let outcome = if cut_now(full, page.next_iterator.is_none(), self.in_flight.is_some()) {
                self.launch_due(evidence).await
            } else {
                // At the tip with a batch in flight: wait for it, then poll once more, so that
                // what arrived meanwhile joins this batch.
                self.settle().await
            };
            if let Err(flow) = outcome {
                return flow;
            }
        }
        match page.next_iterator {
            None => {
                if let Err(flow) = self.settle().await {
                    return flow;
                }
                return Flow::Exit(finish(&self.shared, &self.lease, &self.lease.shard_id).await);
            }
            Some(next) => self.iterator = Some(next),
        }
        if let Some(since) = self.pending_since {
            // Gathering: poll again soon, but not past the window.
            if short {
                if let Err(flow) = self.settle().await {
                    return flow;
                }
                return self.pause_or_stop(window.saturating_sub(since.elapsed()).min(self.shared.polling.idle_min)).await;
            }
            return Flow::Continue;
        }
        if got == 0 {
            if let Err(flow) = self.settle().await {
                return flow;
            }
            return self.at_tip(evidence).await;
        }
        Flow::Continue
    }

    /// The pending batch is due: the batch in flight lands first (batches write one after the
    /// other), then this one starts writing, and reading goes on meanwhile if [`read_ahead`]
    /// says so (a full batch, not before a first checkpoint at LATEST: a failed batch there is
    /// read again from its first page's iterator, [`Self::restart_at_latest`]).
    async fn launch_due(&mut self, evidence: Option<u64>) -> Result<(), Flow> {
        self.settle().await?;
        let full = self.pending.records >= self.shared.config.source.batch_size as usize;
        if self.stop.is_cancelled() {
            // Stopping: this batch is read again by the next owner.
            return Err(Flow::Exit(ShardExit::Stopped));
        }
        let batch = std::mem::take(&mut self.pending).finish(&self.shared.engine, &self.lease.shard_id);
        self.pending_since = None;
        let gathered = std::mem::take(&mut self.gathering);
        // Nothing is in flight now. The applier is back whenever nothing is; a fresh one (a new
        // write window, no memory of letters sent) would be as correct.
        let applier = self.applier.take().unwrap_or_else(|| Box::new(Applier::new(self.shared.clone(), self.lease.clone())));
        self.in_flight = Some(Box::pin(applier.run(batch, evidence, gathered)));
        if !(self.shared.config.source.read_ahead && read_ahead(&self.position, full)) {
            self.settle().await?;
        }
        // The next batch's poll wait starts now, not at this page.
        self.last_read_end = Some(Instant::now());
        Ok(())
    }

    /// One GetRecords call. The batch in flight goes on meanwhile; if it finishes first, it
    /// waits in `landed`. None: the replica is stopping.
    async fn read_page(&mut self, it: &str, limit: u32) -> Option<Result<Page, StreamError>> {
        let shared = self.shared.clone();
        let read = shared.source.records(it, limit);
        tokio::pin!(read);
        let stop = &self.stop;
        let in_flight = &mut self.in_flight;
        loop {
            let busy = in_flight.is_some();
            tokio::select! {
                biased; // the stop first, and the same choice on every run (a simulation replays)
                _ = stop.cancelled() => return None,
                done = async {
                    match in_flight.as_mut() {
                        Some(f) => f.await,
                        None => std::future::pending().await,
                    }
                }, if busy => {
                    *in_flight = None;
                    self.landed = Some(done);
                }
                page = &mut read => return Some(page),
            }
        }
    }

    /// Waits for the batch in flight, if any, and gives its applier back to the reader.
    async fn land(&mut self) -> Option<BatchOutcome> {
        if let Some(batch) = self.in_flight.take() {
            self.landed = Some(batch.await);
        }
        let (applier, outcome) = self.landed.take()?;
        self.applier = Some(applier);
        Some(outcome)
    }

    /// Waits for the batch in flight, if any, and takes in its outcome. Err: the flow after a
    /// batch that was not applied.
    async fn settle(&mut self) -> Result<(), Flow> {
        match self.land().await {
            None => Ok(()),
            Some(outcome) => self.take_in(outcome).await,
        }
    }

    async fn take_in(&mut self, outcome: BatchOutcome) -> Result<(), Flow> {
        match outcome {
            BatchOutcome::Applied(cp) => {
                if let Some(Checkpoint::Sequence(seq)) = cp {
                    self.position = Position::After(seq);
                }
                self.failures = 0;
                self.idle = self.shared.polling.idle_min;
                Ok(())
            }
            BatchOutcome::LeaseLost => Err(Flow::Exit(ShardExit::LeaseLost)),
            BatchOutcome::Failed(e) => {
                self.failures += 1;
                warn!(shard = %self.shard(), error = %e, attempt = self.failures, "batch not applied; re-reading it from the checkpoint");
                // Whatever was read after it goes too. Reading restarts from `position`, or,
                // before a first checkpoint at LATEST, from the batch's first page.
                self.pending = PendingBatch::default();
                self.pending_since = None;
                self.gathering = Gathering::default();
                self.iterator = self.restart_at_latest();
                Err(self.pause_or_stop(crate::sink::backoff(self.failures)).await)
            }
        }
    }

    // `&mut self`: a reader with a batch in flight is Send but not Sync.
    async fn pause_or_stop(&mut self, d: Duration) -> Flow {
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
            let progress = Progress { checkpoint: self.horizon_marker(), last_record_ms: None, at_tip_ms: Some(tip), fold_due: None };
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
    // The totals still unfolded stay in the finished lease: a child's owner folds them.
    let fold_due = shared.engine.rules.iter().any(|r| r.write_shards.is_some()).then(|| shared.folds.due_for(shard));
    let progress = Progress { checkpoint: Some(Checkpoint::ShardEnd), last_record_ms: None, at_tip_ms: Some(now_ms()), fold_due };
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
