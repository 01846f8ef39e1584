//! The service loop of one replica: discover shards, keep leases (renew, take, balance), run
//! one reader per leased shard, and drain on shutdown. One `select!` loop; every reader is a
//! task under the replica's cancellation token.

pub mod age;
pub mod apply;
pub mod batch;
pub mod fold;
pub mod gate;
pub mod jobs;
pub mod phases;
pub mod plan;
pub mod shard;
pub mod tip;
pub mod window;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::rules::Engine;
use crate::sink::dead_letter::DeadLetters;
use crate::sink::AggregateStore;
use crate::state::{now_ms, Checkpoint, Lease, LeaseStore, LeaseView, Progress};
use crate::stream::{lineage, ShardInfo, StreamSource};
use crate::telemetry::{names, Health};
use shard::{read_shard, ShardExit, ShardLease};

/// What the replica's tasks share.
pub struct Shared<S, L, A> {
    pub config: Config,
    pub engine: Engine,
    pub source: S,
    pub leases: L,
    pub sink: Arc<A>,
    /// This replica's id in lease items.
    pub owner: String,
    pub health: Arc<Health>,
    /// Write capacity consumed, in thousandths of a unit.
    pub capacity_milli: AtomicU64,
    /// Times a checkpoint or iterator pointed at trimmed data (records lost).
    pub trimmed_events: AtomicU64,
    /// What each reader of this replica saw of its shard (iterator age, [`age`]).
    pub ages: std::sync::Mutex<HashMap<String, age::ShardAge>>,
    pub dead_letters: DeadLetters,
    pub stream_arn: String,
    /// This deployment's ledger names on target items.
    pub ledger: crate::sink::ledger::Ledger,
    /// Which shards target items may still take writes from (from the lease table); None:
    /// unknown, prune nothing.
    pub floor_plan: std::sync::Mutex<Option<Arc<crate::sink::ledger::FloorPlan>>>,
    /// Sharded totals written since their last fold ([`fold`]).
    pub folds: fold::Folds,
    /// Targets written since the last scheduled reconcile, per rule (bounded).
    pub touched: std::sync::Mutex<BTreeMap<String, BTreeSet<crate::rules::TargetKey>>>,
    /// Set when data was lost (trimmed, a shard gone): a reconcile of everything is to be
    /// requested in the state table (where it survives restarts); cleared once persisted.
    pub reconcile_everything: std::sync::atomic::AtomicBool,
    /// How often idle shards are polled.
    pub polling: Polling,
    /// What the last write saw of each target's ledger, for pruning on the next (bounded).
    pub seen: std::sync::Mutex<HashMap<crate::rules::TargetKey, crate::sink::ledger::Seen>>,
    /// Takes leases from live replicas to balance (false: reconcile's own consumer, which
    /// only takes leases nobody holds).
    pub balance: bool,
    /// Starts a shard without a checkpoint at its trim horizon whatever `start_position`
    /// says (reconcile's own consumer: see [`Shared::reading_from_the_horizon`]).
    pub from_horizon: bool,
    /// This replica runs the committed rule definitions ([`gate`]): only then does it hold
    /// leases, reconcile on schedule or rebuild.
    pub definitions_current: std::sync::atomic::AtomicBool,
    /// The helper items' expiry attribute (`aggregates.helper_expiry_attribute`): every helper
    /// write removes it ([`crate::sink::expiry`]).
    pub expiry_attribute: Option<String>,
    /// Whether expiries are set: DescribeTimeToLive answered (the service reads it every
    /// minute; reconcile's own consumer never sets).
    pub expiry_on: std::sync::atomic::AtomicBool,
    /// Whether the service deletes expired helpers itself (the table's TTL is not on that
    /// attribute): each expiry is recorded as pending first ([`crate::sink::expiry`]).
    pub expiry_own: std::sync::atomic::AtomicBool,
    /// How long after reaching zero a helper expires (a test shortens it).
    pub expiry_after_ms: u64,
    /// The table the copy rules write ([`crate::sink::copy`]); None: no copy rules.
    pub copies: Option<Arc<dyn crate::sink::copy::CopyStore>>,
    /// This replica's budget per partition key (`aggregates.partition_write_rate`); None: unpaced.
    pub pacer: Option<crate::sink::pace::Pacer>,
}

impl<S, L, A> Shared<S, L, A> {
    pub fn new(config: Config, source: S, leases: L, sink: Arc<A>, owner: String, health: Arc<Health>) -> Shared<S, L, A> {
        let expiry_attribute = config.helper_expiry_attribute.clone();
        let engine = config.engine.clone();
        let ledger = crate::sink::ledger::Ledger::new(&config.ledger_namespace);
        let pacer = crate::sink::pace::Pacer::new(config.partition_write_rate);
        Shared {
            config,
            engine,
            source,
            leases,
            sink,
            owner,
            health,
            capacity_milli: AtomicU64::new(0),
            trimmed_events: AtomicU64::new(0),
            ages: Default::default(),
            dead_letters: DeadLetters::Disabled,
            stream_arn: String::new(),
            ledger,
            floor_plan: Default::default(),
            folds: Default::default(),
            touched: Default::default(),
            reconcile_everything: Default::default(),
            seen: Default::default(),
            polling: Polling::default(),
            balance: true,
            from_horizon: false,
            definitions_current: Default::default(),
            expiry_attribute,
            expiry_on: Default::default(),
            expiry_own: Default::default(),
            expiry_after_ms: crate::sink::expiry::EXPIRE_AFTER_MS,
            copies: None,
            pacer,
        }
    }

    /// Where the copy rules' copies are written.
    pub fn with_copies(mut self, store: Arc<dyn crate::sink::copy::CopyStore>) -> Shared<S, L, A> {
        self.copies = Some(store);
        self
    }

    /// Starts a shard nobody ever read at its trim horizon. Reconcile's own consumer: the
    /// checkpoints it leaves are where `run` goes on, and one read from LATEST that saw no
    /// record leaves none, so `run` would start at LATEST again and skip what was written in
    /// between. From the horizon every record is applied (the ledger drops repeats) before
    /// reconcile compares the truth, and a shard that had none keeps a TRIM_HORIZON
    /// checkpoint for `run`.
    pub fn reading_from_the_horizon(mut self) -> Self {
        self.from_horizon = true;
        self
    }

    /// Where `lease` (as listed, before this replica took it) starts when it has neither a
    /// checkpoint nor a known parent: `start_position`, except a never-taken lease (counter 0)
    /// for reconcile's own consumer. A lease some reader took before without leaving a
    /// checkpoint was read from LATEST: the records before that start were skipped on purpose
    /// (a backfill counted them), so reading it from the horizon would count them twice.
    pub fn start_position(&self, lease: &Lease) -> crate::config::StartPosition {
        if self.from_horizon && lease.counter == 0 {
            crate::config::StartPosition::TrimHorizon
        } else {
            self.config.source.start_position
        }
    }

    /// A consumer that only takes leases nobody holds (reconcile catching up shards whose
    /// owner is gone), never one a live replica renews.
    /// It also never commits rule definitions ([`gate`]): it applies records only under the
    /// committed ones.
    pub fn without_balancing(mut self) -> Self {
        self.balance = false;
        self
    }

    /// Helper items at zero expire through this attribute, whatever the config says (tests,
    /// the simulation). None: no expiry.
    pub fn with_expiry(mut self, expiry: Option<crate::sink::expiry::Expiry>) -> Self {
        self.expiry_attribute = expiry.as_ref().map(|e| e.attribute.clone());
        self.expiry_on = std::sync::atomic::AtomicBool::new(expiry.as_ref().is_some_and(|e| e.set));
        self.expiry_own = std::sync::atomic::AtomicBool::new(expiry.as_ref().is_some_and(|e| e.own));
        self.expiry_after_ms = expiry.map_or(crate::sink::expiry::EXPIRE_AFTER_MS, |e| e.after_ms);
        self
    }

    /// The expiry part of this replica's helper writes now: None without an expiry attribute.
    pub fn expiry(&self) -> Option<crate::sink::expiry::Expiry> {
        let attribute = self.expiry_attribute.clone()?;
        Some(crate::sink::expiry::Expiry {
            attribute,
            after_ms: self.expiry_after_ms,
            set: self.expiry_on.load(Ordering::Relaxed),
            own: self.expiry_own.load(Ordering::Relaxed),
        })
    }

    pub fn with_dead_letters(mut self, dead_letters: DeadLetters, stream_arn: String) -> Self {
        self.dead_letters = dead_letters;
        self.stream_arn = stream_arn;
        self
    }

    /// Remembers a written target for the schedule (bounded: past 100,000 targets the next
    /// run covers everything instead). Nothing when no scheduled run would read it (schedule
    /// off, or scope `all`): the bound would otherwise ask for a full reconcile of a deployment
    /// that never reconciles on its own.
    pub fn touch(&self, rule: &str, key: &crate::rules::TargetKey) {
        if self.config.reconcile_interval.is_none() || self.config.reconcile_all {
            return;
        }
        let mut t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = t.values().map(|s| s.len()).sum();
        if total >= 100_000 {
            self.request_reconcile_everything();
            return;
        }
        t.entry(rule.to_string()).or_default().insert(key.clone());
    }

    /// Marks the totals a shard's lease records as unfolded (a previous owner's writes, before
    /// the checkpoint this reader starts from), under the rule whose sub-items they have.
    pub fn resume_folds(&self, shard: &str, due: &[String]) {
        let now = now_ms();
        for total in fold::parse_due(due) {
            let parts: Vec<&str> = total.0.iter().map(|p| &**p).collect();
            let rule = self.engine.rules.iter().find(|r| r.write_shards.is_some() && crate::reconcile::truth::is_target(r, &parts));
            if let Some((rule, n)) = rule.and_then(|r| Some((r, r.write_shards?))) {
                self.folds.mark(total, &rule.name, n, shard, now);
            }
        }
    }

    /// What the last write saw of `key`'s ledger.
    pub fn take_seen(&self, key: &crate::rules::TargetKey) -> Option<crate::sink::ledger::Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).remove(key)
    }

    pub fn put_seen(&self, key: &crate::rules::TargetKey, seen: crate::sink::ledger::Seen) {
        let mut p = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded memory: forgetting only delays pruning until the item's next write.
        if p.len() >= 100_000 {
            p.clear();
        }
        p.insert(key.clone(), seen);
    }

    /// Runs a write of `kind` to `key`'s item within its partition key's budget ([`crate::sink::pace`]):
    /// waits for it first, then settles what the write `spent` (a failed write keeps its
    /// estimate charged; a throttled one slows the key's next writes).
    pub async fn paced<T, E>(
        &self,
        key: &crate::rules::TargetKey,
        kind: crate::sink::pace::Kind,
        write: impl std::future::Future<Output = Result<T, E>>,
        spent: impl FnOnce(&Result<T, E>) -> crate::sink::pace::Spent,
    ) -> Result<T, E> {
        let (Some(pacer), Some(pk)) = (&self.pacer, key.0.first()) else { return write.await };
        let reserved = pacer.reserve(pk, kind).await;
        let out = write.await;
        pacer.settle(pk, reserved, spent(&out));
        out
    }

    pub fn floor_plan(&self) -> Option<Arc<crate::sink::ledger::FloorPlan>> {
        self.floor_plan.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Data was lost: ask for a reconcile of everything (persisted by the next maintenance
    /// round, so it survives restarts).
    pub fn request_reconcile_everything(&self) {
        self.reconcile_everything.store(true, Ordering::Relaxed);
    }

    /// Updates what the reader of `shard` saw (the maintenance tick turns it into gauges).
    pub fn note_age(&self, shard: &str, f: impl FnOnce(&mut age::ShardAge)) {
        f(self.ages.lock().unwrap_or_else(|e| e.into_inner()).entry(shard.to_string()).or_default());
    }
}

/// Poll intervals of an idle shard: from `idle_min`, doubling up to `idle_max`. The
/// simulation lengthens them to cover months of stream life in minutes.
#[derive(Debug, Clone, Copy)]
pub struct Polling {
    pub idle_min: Duration,
    pub idle_max: Duration,
}

impl Default for Polling {
    fn default() -> Polling {
        Polling { idle_min: shard::IDLE_MIN, idle_max: shard::IDLE_MAX }
    }
}

/// How much older than this replica's last DescribeStream a shard must be to count as known:
/// DescribeStream is eventually consistent, and shard ids carry the server's clock.
const LISTING_MARGIN_MS: u64 = 5 * 60 * 1000;

struct Running {
    counter: u64,
    valid_until_ms: Arc<AtomicU64>,
    stop: CancellationToken,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A maintenance round could not read or write what it needs; retried next round.
    #[error("{0}")]
    Aws(String),
    #[error("state table: {0}")]
    State(#[from] crate::state::StateError),
}

fn state_error(e: crate::state::StateError) -> WorkerError {
    WorkerError::State(e)
}

/// A replica id: host, process and a random suffix (two processes on one host differ).
pub fn replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_string()))
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}-{:04x}", std::process::id(), fastrand::u16(..))
}

pub struct Worker<S, L, A> {
    shared: Arc<Shared<S, L, A>>,
    running: BTreeMap<String, Running>,
    tasks: FuturesUnordered<JoinHandle<(String, ShardExit)>>,
    /// The last listing (shared with each round's borrows), and its newest shard's creation.
    shards: Arc<Vec<ShardInfo>>,
    newest_listed_ms: u64,
    last_discovery_ms: u64,
    /// When each leased shard was first seen missing from DescribeStream.
    missing_since: BTreeMap<String, u64>,
    /// The lease table as the last round read it (and wrote it since), brought up to date at
    /// the start of each round.
    lease_view: LeaseView,
    gate: gate::DefinitionsGate,
    /// Leases whose readers were stopped because the definitions gate closed: released once
    /// the reader finished its batch (shard -> fencing counter).
    to_release: BTreeMap<String, u64>,
    /// When the definitions gate last opened (None: closed since, or never opened).
    gate_open_at: Option<u64>,
    /// When this maintenance round read its clock.
    round_started: std::time::Instant,
    /// Copy fan-out jobs running here ([`jobs`]), by id, and their tasks.
    jobs: BTreeMap<String, CancellationToken>,
    job_tasks: FuturesUnordered<JoinHandle<(String, jobs::JobExit)>>,
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> Worker<S, L, A> {
    pub fn new(shared: Shared<S, L, A>) -> Worker<S, L, A> {
        let gate = gate::DefinitionsGate::new(&shared.engine.rules)
            .with_expiry(shared.expiry_attribute.clone())
            .with_copies(crate::rules::copy::definitions(&shared.engine.copies));
        let gate = if shared.balance { gate } else { gate.never_committing() };
        Worker {
            gate,
            to_release: BTreeMap::new(),
            gate_open_at: None,
            round_started: std::time::Instant::now(),
            shared: Arc::new(shared),
            running: BTreeMap::new(),
            tasks: FuturesUnordered::new(),
            shards: Arc::new(Vec::new()),
            newest_listed_ms: 0,
            last_discovery_ms: 0,
            missing_since: BTreeMap::new(),
            lease_view: LeaseView::default(),
            jobs: BTreeMap::new(),
            job_tasks: FuturesUnordered::new(),
        }
    }

    pub fn shared(&self) -> &Arc<Shared<S, L, A>> {
        &self.shared
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.shared.config.state.lease_duration.as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs until `cancel`; then stops every reader after its in-flight batch, and releases
    /// the leases so other replicas take over at once.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), WorkerError> {
        let period = self.shared.config.state.lease_duration / 3;
        self.shared.health.maintenance_deadline_ms.store(self.lease_ms(), Ordering::Relaxed);
        let mut tick = tokio::time::interval(period.max(Duration::from_millis(100)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            // Biased (in this order), not random: a stop first, a finished reader before the
            // round that may give its shard's children out, and the same order on every run,
            // so a simulation's seed replays exactly.
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                Some(done) = self.tasks.next(), if !self.tasks.is_empty() => self.reap(done),
                Some(done) = self.job_tasks.next(), if !self.job_tasks.is_empty() => {
                    if let Ok((id, _)) = done {
                        self.jobs.remove(&id);
                    }
                }
                _ = tick.tick() => {
                    self.shared.health.beat();
                    if let Err(e) = self.maintain().await {
                        warn!(error = %e, "lease maintenance failed; retrying next round");
                    }
                }
            }
        }
        self.drain().await;
        Ok(())
    }

    fn reap(&mut self, done: Result<(String, ShardExit), tokio::task::JoinError>) {
        match done {
            Ok((shard, exit)) => {
                info!(shard = %shard, exit = ?exit, "shard reader stopped");
                if exit == ShardExit::LeaseLost {
                    metrics::counter!(names::LEASES_LOST).increment(1);
                }
                if let Some(r) = self.running.remove(&shard) {
                    if self.gate.waiting().is_some() && exit != ShardExit::LeaseLost {
                        self.to_release.insert(shard.clone(), r.counter);
                    }
                }
                if exit == ShardExit::Finished {
                    // Children may be ready now: discover again at the next round.
                    self.last_discovery_ms = 0;
                }
            }
            Err(e) => warn!(error = %e, "shard reader task failed"),
        }
    }

    /// Stops readers (each finishes its batch and checkpoints) and releases leases; bounded.
    async fn drain(&mut self) {
        for r in self.running.values() {
            r.stop.cancel();
        }
        // A job stops before its next page and gives its claim up: another replica resumes it.
        for stop in self.jobs.values() {
            stop.cancel();
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
        while !self.tasks.is_empty() {
            match tokio::time::timeout_at(deadline, self.tasks.next()).await {
                Ok(Some(done)) => {
                    if let Ok((shard, exit)) = &done {
                        if *exit != ShardExit::LeaseLost {
                            if let Some(r) = self.running.get(shard) {
                                let _ = self.shared.leases.release(shard, &self.shared.owner, r.counter).await;
                            }
                        }
                    }
                    self.reap(done);
                }
                Ok(None) => break,
                Err(_) => {
                    warn!(readers = self.tasks.len(), "readers did not stop in time");
                    break;
                }
            }
        }
        while let Ok(Some(_)) = tokio::time::timeout_at(deadline, self.job_tasks.next()).await {}
        metrics::gauge!(names::LEASES_HELD).set(0.0);
        // A reconcile request a reader could not write yet (its retry is the next round's,
        // which never comes): written now, or it would be lost with this process.
        self.persist_reconcile_request().await;
        let _ = self.shared.leases.drop_beat(&self.shared.owner).await;
        info!("stopped; leases released");
    }

    /// One round: renew, discover, keep the lease table tidy, take and balance, report.
    async fn maintain(&mut self) -> Result<(), WorkerError> {
        let now = now_ms();
        self.round_started = std::time::Instant::now();
        // A replica whose gate closed, or has not opened within a lease duration (its rounds
        // fail), renews nothing: another may commit once its leases lapse, and its readers stop
        // at their deadline. One failed round renews as usual.
        if self.gate_open_at.is_some_and(|t| now.saturating_sub(t) < self.lease_ms()) {
            self.renew(now).await;
        }
        // First, so a failing listing below cannot hold a request back.
        self.persist_reconcile_request().await;
        if now.saturating_sub(self.last_discovery_ms) >= self.lease_ms().max(1000) || self.shards.is_empty() {
            match self.shared.source.shards().await {
                Ok(shards) => {
                    self.newest_listed_ms = shards.iter().filter_map(|s| crate::shard_id::created_ms(&s.shard_id)).max().unwrap_or(0);
                    self.shards = Arc::new(shards);
                    self.last_discovery_ms = now;
                }
                // The shards listed last time: a throttled listing must not stop this round's
                // definitions gate, on which renewals depend.
                Err(e) if !self.shards.is_empty() => warn!(error = %e, "DescribeStream failed; using the shards listed before"),
                Err(e) => return Err(WorkerError::Aws(format!("DescribeStream: {e}"))),
            }
        }
        // Taken out for the round; an error leaves it out, so the next round reads all again.
        let mut view = std::mem::take(&mut self.lease_view);
        self.shared.leases.refresh(&mut view).await.map_err(state_error)?;
        let round = self.lease_round(&mut view.leases, now).await;
        self.lease_view = view;
        round
    }

    /// The rest of a round, on the lease table as just read: create the leases of new shards,
    /// keep the table tidy, take and balance, report. The changes this round makes to the
    /// table are made to `leases` too when they succeed; the next refresh brings in the rest.
    async fn lease_round(&mut self, leases: &mut BTreeMap<String, Lease>, now: u64) -> Result<(), WorkerError> {
        let shards = self.shards.clone();
        let listed: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        // One failed call costs one lease a round, not the round: with hundreds of shards a
        // round must not depend on every call succeeding.
        for s in shards.iter() {
            if !leases.contains_key(&s.shard_id) {
                let lease = plan::new_lease(s, leases);
                let created = self.shared.leases.create(&lease).await;
                self.shared.health.beat();
                match created {
                    Ok(_) => {
                        leases.insert(s.shard_id.clone(), lease);
                    }
                    Err(e) => warn!(shard = %s.shard_id, error = %e, "cannot create the lease; next round"),
                }
            }
        }
        self.shared.health.aws_reachable.store(true, Ordering::Relaxed);
        if !self.definitions_gate(leases, now).await? {
            self.report(&[], leases);
            return Ok(());
        }
        self.finish_lost(&listed, leases, now).await;
        self.delete_finished(&listed, leases).await;
        let finished = |id: &str| leases.get(id).is_some_and(Lease::finished);
        let ready: Vec<String> = lineage::ready(&shards, &finished).into_iter().map(|s| s.shard_id.clone()).collect();
        let running: BTreeSet<String> = self.running.keys().cloned().collect();
        let want: Vec<Lease> = plan::leases_to_take(&ready, leases, &self.shared.owner, &running, now)
            .into_iter()
            .filter(|l| self.shared.balance || l.available(now))
            .filter(|_| self.gate.takes_leases())
            .cloned()
            .collect();
        let lease_ms = self.lease_ms();
        let mut taken_now = Vec::new();
        for l in want {
            let taken = self.shared.leases.take(&l, &self.shared.owner, now + lease_ms).await;
            self.shared.health.beat();
            let got = match taken {
                Ok(got) => got,
                Err(e) => {
                    warn!(shard = %l.shard_id, error = %e, "cannot take the lease; next round");
                    continue;
                }
            };
            if let Some(got) = got {
                metrics::counter!(names::LEASES_TAKEN).increment(1);
                if let Some(o) = l.owner.as_deref().filter(|o| *o != self.shared.owner && !l.available(now)) {
                    info!(shard = %got.shard_id, from = %o, "took a lease to balance replicas");
                }
                let start = plan::initial_position(
                    got.checkpoint.as_ref(),
                    plan::parent_known(&got, leases, &listed),
                    self.shared.start_position(&l),
                );
                // A finished parent's unfolded totals: its owner may have died after its end.
                if let Some(parent) = got.parent.as_ref().and_then(|p| leases.get(p)).filter(|p| p.finished()) {
                    self.shared.resume_folds(&got.shard_id, &parent.fold_due);
                }
                taken_now.push((got, start));
            }
        }
        self.start_if_still_current(taken_now, now + lease_ms).await;
        self.start_jobs().await;
        self.report(&ready, leases);
        Ok(())
    }

    /// Starts the copy fan-out jobs due (this replica runs the committed definitions).
    async fn start_jobs(&mut self) {
        if self.shared.copies.is_none() || !self.gate.takes_leases() {
            return;
        }
        let running = self.jobs.keys().cloned().collect();
        let due = match jobs::due(&self.shared, &running).await {
            Ok(due) => due,
            Err(e) => {
                warn!(error = %e, "cannot list the copy jobs; next round");
                return;
            }
        };
        for job in due {
            let id = job.job.id();
            let stop = CancellationToken::new();
            let (shared, task_stop, name) = (self.shared.clone(), stop.clone(), id.clone());
            self.job_tasks.push(tokio::spawn(async move {
                // A panic ends the job's run, not the replica's record of it.
                let run = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(jobs::run(shared, job, task_stop)));
                (name, run.await.unwrap_or(jobs::JobExit::Failed))
            }));
            self.jobs.insert(id, stop);
        }
    }

    /// Starts the readers of the leases just taken if the committed definitions are still
    /// this replica's and not marked draining; gives the leases back unused otherwise.
    async fn start_if_still_current(&mut self, taken: Vec<(Lease, Option<crate::stream::Position>)>, until: u64) {
        if taken.is_empty() {
            return;
        }
        let shared = self.shared.clone();
        match self.gate.still_current(&shared.leases, &shared.owner, now_ms()).await {
            Ok(true) => {
                for (got, start) in taken {
                    self.start_reader(got, start, until);
                }
            }
            current => {
                if let Err(e) = current {
                    warn!(error = %e, "cannot read the committed rule definitions after taking leases; giving them back");
                } else {
                    info!(
                        leases = taken.len(),
                        "the committed rule definitions changed or were marked draining meanwhile; leases given back unused"
                    );
                }
                for (got, _) in taken {
                    let _ = shared.leases.release(&got.shard_id, &shared.owner, got.counter).await;
                }
            }
        }
    }

    /// The definitions gate ([`gate`]): false while this replica's rule definitions are not
    /// the committed ones. Then it holds no lease: its readers stop after their batch and
    /// their leases are released, so the replicas of the committed definitions, or those
    /// waiting to commit theirs, know it applies nothing. Readiness does not depend on it.
    async fn definitions_gate(&mut self, leases: &BTreeMap<String, Lease>, now: u64) -> Result<bool, WorkerError> {
        let round = self.gate.round(&self.shared.leases, &self.shared.owner, leases, (now, self.round_started), self.lease_ms()).await;
        let open = round.as_ref().is_ok_and(|open| *open);
        self.shared.definitions_current.store(open, Ordering::Release);
        match round {
            Ok(true) => self.gate_open_at = Some(now),
            Ok(false) => self.gate_open_at = None,
            Err(_) => {}
        }
        round.map_err(state_error)?;
        if open {
            return Ok(true);
        }
        for r in self.running.values() {
            r.stop.cancel();
        }
        for (shard, counter) in std::mem::take(&mut self.to_release) {
            let _ = self.shared.leases.release(&shard, &self.shared.owner, counter).await;
        }
        Ok(false)
    }

    /// Renews what this replica holds; a lost lease stops its reader.
    async fn renew(&self, now: u64) {
        let shared = &self.shared;
        let until = now + self.lease_ms();
        for (shard, r) in &self.running {
            let renewed = shared.leases.renew(shard, &shared.owner, r.counter, until).await;
            shared.health.beat();
            match renewed {
                Ok(true) => r.valid_until_ms.store(until, Ordering::Relaxed),
                Ok(false) => {
                    warn!(shard = %shard, "lease taken by another replica");
                    r.valid_until_ms.store(0, Ordering::Relaxed);
                    r.stop.cancel();
                }
                Err(e) => warn!(shard = %shard, error = %e, "lease renewal failed"),
            }
        }
    }

    /// Unfinished leases whose shard left the stream: the loss is counted, a reconcile of
    /// everything requested, and the lease finished, so it blocks neither its children, nor
    /// ledger pruning, nor reconcile. A lease a live replica holds is left to its reader
    /// (which meets the same loss when it next asks for an iterator).
    async fn finish_lost(&mut self, listed: &BTreeSet<&str>, leases: &mut BTreeMap<String, Lease>, now: u64) {
        self.missing_since.retain(|id, _| leases.contains_key(id) && !listed.contains(id.as_str()));
        for l in leases.values().filter(|l| !l.finished() && !listed.contains(l.shard_id.as_str())) {
            if !self.missing_since.contains_key(&l.shard_id) {
                self.missing_since.insert(l.shard_id.clone(), now);
            }
        }
        let lost: Vec<Lease> = plan::lost_leases(listed, leases, &self.missing_since, now)
            .into_iter()
            .filter(|l| l.available(now) && !self.running.contains_key(&l.shard_id))
            .cloned()
            .collect();
        let shared = &self.shared;
        for l in lost {
            let Ok(Some(got)) = shared.leases.take(&l, &shared.owner, now + self.lease_ms()).await else { continue };
            shard::shard_lost(shared, &got.shard_id, "DescribeStream no longer lists it").await;
            let progress = Progress { checkpoint: Some(Checkpoint::ShardEnd), last_record_ms: None, at_tip_ms: None, fold_due: None };
            if let Ok(true) = shared.leases.checkpoint(&got.shard_id, &shared.owner, got.counter, &progress).await {
                if let Some(x) = leases.get_mut(&got.shard_id) {
                    x.checkpoint = Some(Checkpoint::ShardEnd);
                }
            }
            let _ = shared.leases.release(&got.shard_id, &shared.owner, got.counter).await;
        }
    }

    /// Deletes finished leases that the listing forgot and whose children hold checkpoints.
    async fn delete_finished(&self, listed: &BTreeSet<&str>, leases: &BTreeMap<String, Lease>) {
        for l in plan::deletable_leases(listed, leases) {
            if let Ok(true) = self.shared.leases.delete(l).await {
                metrics::counter!(names::LEASES_DELETED).increment(1);
            }
        }
    }

    /// Writes a pending "reconcile everything" request (a fence violation, or a write that
    /// failed earlier) to the state table.
    async fn persist_reconcile_request(&self) {
        shard::persist_request(&self.shared).await;
    }

    /// Gauges, and the floor plan target writes prune by.
    fn report(&self, ready: &[String], leases: &BTreeMap<String, Lease>) {
        let shared = &self.shared;
        // Every held shard's age on every tick, so the series of a shard whose batches keep
        // failing stays exported and rising; a shard no longer held stops being refreshed and
        // its series goes after the exporter's idle timeout.
        let max_age = {
            let mut ages = shared.ages.lock().unwrap_or_else(|e| e.into_inner());
            ages.retain(|shard, _| self.running.contains_key(shard));
            let now = now_ms();
            let mut max = 0.0f64;
            for (shard, a) in ages.iter() {
                let seconds = a.seconds(now);
                metrics::gauge!(names::ITERATOR_AGE_SECONDS, "shard" => shard.clone()).set(seconds);
                max = max.max(seconds);
            }
            max
        };
        metrics::gauge!(names::ITERATOR_AGE_MAX_SECONDS).set(max_age);
        let finished_count = leases.values().filter(|l| l.finished()).count();
        // Every shard this replica has not seen is newer than its last listing: by the local
        // clock less a margin, and by the server's clock, the newest listed shard's creation.
        let known_until = self.last_discovery_ms.saturating_sub(LISTING_MARGIN_MS).min(self.newest_listed_ms);
        let plan = crate::sink::ledger::floor_plan(plan::unfinished(leases, &self.shards), known_until);
        *shared.floor_plan.lock().unwrap_or_else(|e| e.into_inner()) = plan.map(Arc::new);
        metrics::gauge!(names::LEASES_HELD).set(self.running.len() as f64);
        metrics::gauge!(names::SHARDS, "state" => names::ShardState::Reading.as_str()).set(ready.len() as f64);
        metrics::gauge!(names::SHARDS, "state" => names::ShardState::Waiting.as_str())
            .set(self.shards.len().saturating_sub(ready.len()).saturating_sub(finished_count) as f64);
        metrics::gauge!(names::SHARDS, "state" => names::ShardState::Finished.as_str()).set(finished_count as f64);
        metrics::gauge!(names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        shared.health.last_maintenance_ms.store(now_ms(), Ordering::Relaxed);
    }

    fn start_reader(&mut self, lease: Lease, start: Option<crate::stream::Position>, valid_until: u64) {
        let shard = lease.shard_id.clone();
        info!(shard = %shard, counter = lease.counter, "lease taken");
        self.shared.resume_folds(&shard, &lease.fold_due);
        let valid_until_ms = Arc::new(AtomicU64::new(valid_until));
        let stop = CancellationToken::new();
        let handle = ShardLease { shard_id: shard.clone(), counter: lease.counter, valid_until_ms: valid_until_ms.clone(), start };
        let shared = self.shared.clone();
        let task_stop = stop.clone();
        let name = shard.clone();
        self.tasks.push(tokio::spawn(async move { (name, read_shard(shared, handle, task_stop).await) }));
        self.running.insert(shard, Running { counter: lease.counter, valid_until_ms, stop });
    }
}

#[cfg(test)]
mod tests;
