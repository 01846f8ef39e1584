//! What the simulated world does to each call: the replica's fate (dead: the call never
//! returns, before or after it took effect; paused: it waits, then goes through) and seeded
//! faults (errors before the call, time-outs after it took effect, expired iterators).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddb_aggregator::rules::copy::job::{CopyJob, StoredJob};
use ddb_aggregator::rules::copy::{CopyChange, FindQuery};
use ddb_aggregator::rules::helper::HelperScan;
use ddb_aggregator::sink::copy::{CopyFix, CopyOutcome, CopyStore, Corrected, FoundPage, ItemKey};
use ddb_aggregator::sink::expiry::{DueQuery, Pending};
use ddb_aggregator::sink::{
    AggregateStore, Counters, DerivationNames, DerivedWrite, HelperQuery, HelperState, HelperStates, LedgerWrite, LiveHelpers, SettleWrite,
    SinkError, TransitionWrite, WriteOutcome,
};
use ddb_aggregator::state::definitions::{Beat, Committed};
use ddb_aggregator::state::{now_ms, JobStep, Lease, LeaseStore, LeaseView, Progress, StateError};
use ddb_aggregator::stream::{Page, Position, ShardInfo, StreamError, StreamSource};
use futures::future::BoxFuture;

/// The payload a crashed replica's task unwinds with ([`gate`]).
struct Crashed;

/// One replica process, as the world sees it.
#[derive(Debug, Default)]
pub struct Fate {
    /// Crashed: every call ends its task there ([`gate`]), without effect.
    pub dead: AtomicBool,
    /// Paused (GC, SIGSTOP) until this epoch ms: calls wait, then go through.
    pub paused_until: AtomicU64,
}

/// Seeded faults shared by every call of the simulation.
#[derive(Debug)]
pub struct Faults {
    rng: Mutex<fastrand::Rng>,
    /// The chance per call, as f64 bits.
    rate: AtomicU64,
    pub injected: AtomicU64,
    pub calls: AtomicU64,
    /// Simulated milliseconds each call takes to answer after it took effect (0: none). With
    /// none, a reader behind runs batches back to back within one simulated millisecond, so
    /// the writes a key takes "in one second" are bounded only by the throttle.
    latency_ms: AtomicU64,
}

/// A fault for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Refused before it took effect (throttling, 5xx).
    Before,
    /// Took effect, but the caller sees a time-out.
    After,
}

impl Faults {
    pub fn new(seed: u64, rate: f64) -> Faults {
        Faults {
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            rate: AtomicU64::new(rate.to_bits()),
            injected: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            latency_ms: AtomicU64::new(0),
        }
    }

    pub fn set_latency_ms(&self, ms: u64) {
        self.latency_ms.store(ms, Ordering::Relaxed);
    }

    pub fn set_rate(&self, rate: f64) {
        self.rate.store(rate.to_bits(), Ordering::Relaxed);
    }

    fn draw(&self) -> Fault {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut r = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        if r.f64() >= f64::from_bits(self.rate.load(Ordering::Relaxed)) {
            return Fault::None;
        }
        self.injected.fetch_add(1, Ordering::Relaxed);
        if r.bool() {
            Fault::Before
        } else {
            Fault::After
        }
    }
}

/// The replica's fate at a call boundary: ends the calling task when dead (as the process
/// would be gone), waits out a pause.
async fn gate(fate: &Fate) {
    loop {
        if fate.dead.load(Ordering::Relaxed) {
            // Unwinds the task without the panic hook's message; tokio ends the task there.
            // A task that waited for ever instead kept the crashed replica's whole state
            // (its readers, caches and engine) until the end of the run: gigabytes in a year.
            std::panic::resume_unwind(Box::new(Crashed));
        }
        let until = fate.paused_until.load(Ordering::Relaxed);
        let now = now_ms();
        if until <= now {
            return;
        }
        tokio::time::sleep(Duration::from_millis(until - now)).await;
    }
}

/// Runs one call under the replica's fate and a drawn fault; `refused` and `timed_out` make
/// the caller's error for the two kinds of fault.
async fn call<T, E, F: std::future::Future<Output = Result<T, E>>>(
    fate: &Fate,
    faults: &Faults,
    inner: F,
    refused: impl FnOnce() -> E,
    timed_out: impl FnOnce() -> E,
) -> Result<T, E> {
    gate(fate).await;
    let fault = faults.draw();
    if fault == Fault::Before {
        return Err(refused());
    }
    let out = inner.await;
    let latency = faults.latency_ms.load(Ordering::Relaxed);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    // A crash right after the call took effect: the caller never learns of it.
    gate(fate).await;
    if fault == Fault::After {
        return Err(timed_out());
    }
    out
}

pub struct Source<S> {
    pub inner: Arc<S>,
    pub fate: Arc<Fate>,
    pub faults: Arc<Faults>,
}

impl<S: StreamSource> StreamSource for Source<S> {
    async fn shards(&self) -> Result<Vec<ShardInfo>, StreamError> {
        let t = || StreamError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.shards(), t, t).await
    }
    async fn iterator(&self, shard_id: &str, position: &Position) -> Result<String, StreamError> {
        let t = || StreamError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.iterator(shard_id, position), t, t).await
    }
    async fn records(&self, iterator: &str, limit: u32) -> Result<Page, StreamError> {
        call(
            &self.fate,
            &self.faults,
            self.inner.records(iterator, limit),
            || StreamError::Throttled("simulated".into()),
            || StreamError::ExpiredIterator,
        )
        .await
    }
}

pub struct Leases<L> {
    pub inner: Arc<L>,
    pub fate: Arc<Fate>,
    pub faults: Arc<Faults>,
}

fn state_fault() -> StateError {
    StateError::Transient("simulated".into())
}

impl<L: LeaseStore> LeaseStore for Leases<L> {
    async fn prepare(&self, create: bool) -> Result<(), StateError> {
        self.inner.prepare(create).await
    }
    async fn list(&self) -> Result<Vec<Lease>, StateError> {
        call(&self.fate, &self.faults, self.inner.list(), state_fault, state_fault).await
    }
    async fn refresh(&self, view: &mut LeaseView) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.refresh(view), state_fault, state_fault).await
    }
    async fn create(&self, lease: &Lease) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.create(lease), state_fault, state_fault).await
    }
    async fn take(&self, lease: &Lease, owner: &str, expires_at_ms: u64) -> Result<Option<Lease>, StateError> {
        call(&self.fate, &self.faults, self.inner.take(lease, owner, expires_at_ms), state_fault, state_fault).await
    }
    async fn renew(&self, shard_id: &str, owner: &str, counter: u64, expires_at_ms: u64) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.renew(shard_id, owner, counter, expires_at_ms), state_fault, state_fault).await
    }
    async fn checkpoint(&self, shard_id: &str, owner: &str, counter: u64, progress: &Progress) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.checkpoint(shard_id, owner, counter, progress), state_fault, state_fault).await
    }
    async fn release(&self, shard_id: &str, owner: &str, counter: u64) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.release(shard_id, owner, counter), state_fault, state_fault).await
    }
    async fn delete(&self, lease: &Lease) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.delete(lease), state_fault, state_fault).await
    }
    async fn request_reconcile(&self, at_ms: u64) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.request_reconcile(at_ms), state_fault, state_fault).await
    }
    async fn reconcile_request(&self) -> Result<Option<u64>, StateError> {
        call(&self.fate, &self.faults, self.inner.reconcile_request(), state_fault, state_fault).await
    }
    async fn clear_reconcile_request(&self, started_ms: u64) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.clear_reconcile_request(started_ms), state_fault, state_fault).await
    }
    async fn hold_named(&self, name: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.hold_named(name, owner, until_ms, now_ms), state_fault, state_fault).await
    }
    async fn release_named(&self, name: &str, owner: &str) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.release_named(name, owner), state_fault, state_fault).await
    }
    async fn rule_fingerprints(&self) -> Result<Option<std::collections::BTreeMap<String, String>>, StateError> {
        call(&self.fate, &self.faults, self.inner.rule_fingerprints(), state_fault, state_fault).await
    }
    async fn record_fingerprints(&self, fingerprints: &std::collections::BTreeMap<String, String>) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.record_fingerprints(fingerprints), state_fault, state_fault).await
    }
    async fn definitions(&self) -> Result<Option<(Committed, u64)>, StateError> {
        call(&self.fate, &self.faults, self.inner.definitions(), state_fault, state_fault).await
    }
    async fn store_definitions(&self, c: &Committed, revision: Option<u64>) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.store_definitions(c, revision), state_fault, state_fault).await
    }
    async fn publish_beat(&self, beat: &Beat) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.publish_beat(beat), state_fault, state_fault).await
    }
    async fn beats(&self) -> Result<Vec<Beat>, StateError> {
        call(&self.fate, &self.faults, self.inner.beats(), state_fault, state_fault).await
    }
    async fn drop_beat(&self, owner: &str) -> Result<(), StateError> {
        call(&self.fate, &self.faults, self.inner.drop_beat(owner), state_fault, state_fault).await
    }
    async fn record_copy_job(&self, job: &CopyJob) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.record_copy_job(job), state_fault, state_fault).await
    }
    async fn copy_jobs(&self) -> Result<Vec<StoredJob>, StateError> {
        call(&self.fate, &self.faults, self.inner.copy_jobs(), state_fault, state_fault).await
    }
    async fn claim_copy_job(&self, id: &str, version: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.claim_copy_job(id, version, owner, until_ms, now_ms), state_fault, state_fault).await
    }
    async fn advance_copy_job(&self, id: &str, version: &str, owner: &str, step: &JobStep) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.advance_copy_job(id, version, owner, step), state_fault, state_fault).await
    }
    async fn end_copy_job(&self, id: &str, version: &str, next: Option<&CopyJob>) -> Result<bool, StateError> {
        call(&self.fate, &self.faults, self.inner.end_copy_job(id, version, next), state_fault, state_fault).await
    }
}

/// The source table as copy rules write it, under the replica's fate and drawn faults.
pub struct Copies<C> {
    pub inner: Arc<C>,
    pub fate: Arc<Fate>,
    pub faults: Arc<Faults>,
}

impl<C: CopyStore> CopyStore for Copies<C> {
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version: &'a str,
        project: &'a [String],
        start: Option<&'a ItemKey>,
        limit: usize,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        let t = || SinkError::Transient("simulated".into());
        Box::pin(call(&self.fate, &self.faults, self.inner.find(q, version, project, start, limit), t, t))
    }

    fn correct<'a>(
        &'a self,
        key: &'a ItemKey,
        fix: &'a CopyFix,
        version: &'a str,
        read: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Corrected, SinkError>> {
        let t = || SinkError::Transient("simulated".into());
        Box::pin(call(&self.fate, &self.faults, self.inner.correct(key, fix, version, read), t, t))
    }

    fn source<'a>(
        &'a self,
        key: &'a ItemKey,
        attributes: &'a [String],
    ) -> BoxFuture<'a, Result<Option<serde_json::Map<String, serde_json::Value>>, SinkError>> {
        let t = || SinkError::Transient("simulated".into());
        Box::pin(call(&self.fate, &self.faults, self.inner.source(key, attributes), t, t))
    }

    fn write<'a>(&'a self, key: &'a ItemKey, change: &'a CopyChange, version: &'a str) -> BoxFuture<'a, Result<CopyOutcome, SinkError>> {
        let t = || SinkError::Transient("simulated".into());
        Box::pin(call(&self.fate, &self.faults, self.inner.write(key, change, version), t, t))
    }
}

pub struct Sink<A> {
    pub inner: Arc<A>,
    pub fate: Arc<Fate>,
    pub faults: Arc<Faults>,
    /// Who writes each partition key in each second, printed when the store throttles one
    /// (`SIM_TRACE_THROTTLES=1`; None: not traced).
    pub trace: Option<WriteTrace>,
}

/// One replica's view of the shared [`TraceLog`].
#[derive(Debug, Clone)]
pub struct WriteTrace {
    pub who: Arc<str>,
    pub log: Arc<Mutex<TraceLog>>,
}

/// The ledger writes applied to each partition key in its current second (replica, sort key,
/// WCU), and how many throttles were printed.
#[derive(Debug, Default)]
pub struct TraceLog {
    keys: std::collections::HashMap<String, Second>,
    printed: u64,
}

/// A partition key's current second and the writes applied to it in that second (replica,
/// sort key, WCU).
type Second = (u64, Vec<(Arc<str>, String, f64)>);

/// Throttles printed at most, so that a run with many stays readable.
const TRACE_PRINTS: u64 = 200;

impl WriteTrace {
    /// Notes an applied write to `key`; prints who wrote the key this second when it was throttled.
    fn note(&self, key: &[(String, String)], out: &Result<WriteOutcome, SinkError>) {
        let pk = key.first().map_or("", |(_, v)| v.as_str());
        let sk = key.get(1).map_or("", |(_, v)| v.as_str());
        let now = now_ms();
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let entry = log.keys.entry(pk.to_string()).or_insert((now / 1000, Vec::new()));
        if entry.0 != now / 1000 {
            *entry = (now / 1000, Vec::new());
        }
        match out {
            Ok(WriteOutcome::Applied { capacity, .. }) => entry.1.push((self.who.clone(), sk.to_string(), *capacity)),
            Err(SinkError::Throttled(_)) => {
                let mut by_who: std::collections::BTreeMap<&str, (u64, f64)> = Default::default();
                for (who, _, wcu) in &entry.1 {
                    let e = by_who.entry(&**who).or_default();
                    (e.0, e.1) = (e.0 + 1, e.1 + wcu);
                }
                let line = format!("throttled {pk} {sk} by {} at {} ms into the second; this second: {by_who:?}", self.who, now % 1000);
                if log.printed < TRACE_PRINTS {
                    log.printed += 1;
                    eprintln!("{line}");
                }
            }
            _ => {}
        }
    }
}

impl<A: AggregateStore> AggregateStore for Sink<A> {
    async fn apply(&self, write: &LedgerWrite) -> Result<WriteOutcome, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        let traced = async {
            let out = self.inner.apply(write).await;
            if let Some(trace) = &self.trace {
                trace.note(&write.key, &out);
            }
            out
        };
        call(&self.fate, &self.faults, traced, t, t).await
    }

    async fn live_helpers(&self, q: &HelperQuery<'_>) -> Result<LiveHelpers, SinkError> {
        self.inner.live_helpers(q).await
    }

    async fn derivation_counters(&self, key: &[(String, String)], names: &DerivationNames) -> Result<Counters, SinkError> {
        self.inner.derivation_counters(key, names).await
    }

    async fn lower_cursor(&self, key: &[(String, String)], attribute: &str, to: Option<&str>, scan: HelperScan) -> Result<(), SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.lower_cursor(key, attribute, to, scan), t, t).await
    }

    async fn set_derived(&self, w: &DerivedWrite<'_>) -> Result<Option<f64>, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.set_derived(w), t, t).await
    }

    async fn expire_helper(
        &self,
        key: &[(String, String)],
        attribute: &str,
        at: u64,
        version: (&str, Option<&str>),
    ) -> Result<bool, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.expire_helper(key, attribute, at, version), t, t).await
    }

    async fn helper_state(&self, key: &[(String, String)]) -> Result<(Option<HelperState>, f64), SinkError> {
        self.inner.helper_state(key).await
    }

    async fn helper_states(&self, q: &HelperQuery<'_>) -> Result<HelperStates, SinkError> {
        self.inner.helper_states(q).await
    }

    async fn count_transitions(&self, w: &TransitionWrite<'_>) -> Result<Option<f64>, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.count_transitions(w), t, t).await
    }

    async fn settle_count(&self, w: &SettleWrite<'_>) -> Result<Option<f64>, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.settle_count(w), t, t).await
    }

    async fn register_expiry(&self, p: &Pending) -> Result<f64, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.register_expiry(p), t, t).await
    }

    async fn due_expiries(&self, q: &DueQuery<'_>) -> Result<Vec<Pending>, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.due_expiries(q), t, t).await
    }

    async fn remove_expired(&self, p: &Pending) -> Result<bool, SinkError> {
        let t = || SinkError::Transient("simulated".into());
        call(&self.fate, &self.faults, self.inner.remove_expired(p), t, t).await
    }
}
