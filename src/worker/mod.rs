//! The service loop of one replica: discover shards, keep leases (renew, take, balance), run
//! one reader per leased shard, and drain on shutdown. One `select!` loop; every reader is a
//! task under the replica's cancellation token.

pub mod shard;

use std::collections::{BTreeMap, HashMap};
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
use crate::state::{now_ms, Lease, LeaseStore};
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
    /// Iterator age per shard this replica reads, seconds.
    pub ages: std::sync::Mutex<HashMap<String, f64>>,
    pub dead_letters: DeadLetters,
    pub stream_arn: String,
    /// Creation time (epoch ms) of the oldest shard not yet finished; 0 when unknown. Ledger
    /// entries of shards created before it can be pruned.
    pub open_floor_ms: AtomicU64,
    /// Targets written since the last scheduled reconcile, per rule (bounded).
    pub touched: std::sync::Mutex<BTreeMap<String, std::collections::BTreeSet<crate::rules::TargetKey>>>,
    /// Set when data was lost (trimmed): the next scheduled reconcile covers every target.
    pub reconcile_everything: std::sync::atomic::AtomicBool,
    /// Ledger entries to remove on the next write to each target (bounded).
    pub pending_prunes: std::sync::Mutex<HashMap<crate::rules::TargetKey, Vec<String>>>,
}

impl<S, L, A> Shared<S, L, A> {
    pub fn new(config: Config, source: S, leases: L, sink: Arc<A>, owner: String, health: Arc<Health>) -> Shared<S, L, A> {
        let engine = config.engine.clone();
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
            open_floor_ms: AtomicU64::new(0),
            touched: Default::default(),
            reconcile_everything: Default::default(),
            pending_prunes: Default::default(),
        }
    }

    pub fn with_dead_letters(mut self, dead_letters: DeadLetters, stream_arn: String) -> Self {
        self.dead_letters = dead_letters;
        self.stream_arn = stream_arn;
        self
    }

    /// Remembers a written target for the schedule (bounded: past 100,000 targets the next
    /// run covers everything instead).
    pub fn touch(&self, rule: &str, key: &crate::rules::TargetKey) {
        let mut t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = t.values().map(|s| s.len()).sum();
        if total >= 100_000 {
            self.reconcile_everything.store(true, Ordering::Relaxed);
            return;
        }
        t.entry(rule.to_string()).or_default().insert(key.clone());
    }

    /// Ledger entries seen on `key` that may now be removed.
    pub fn take_prunes(&self, key: &crate::rules::TargetKey) -> Vec<String> {
        self.pending_prunes.lock().unwrap_or_else(|e| e.into_inner()).remove(key).unwrap_or_default()
    }

    pub fn add_prunes(&self, key: &crate::rules::TargetKey, entries: Vec<String>) {
        if entries.is_empty() {
            return;
        }
        let mut p = self.pending_prunes.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded memory: forgetting only delays pruning until the item's next write.
        if p.len() >= 100_000 {
            p.clear();
        }
        p.insert(key.clone(), entries);
    }

    pub fn set_age(&self, shard: &str, seconds: f64) {
        metrics::gauge!(names::ITERATOR_AGE_SECONDS, "shard" => shard.to_string()).set(seconds);
        self.ages.lock().unwrap_or_else(|e| e.into_inner()).insert(shard.to_string(), seconds);
    }
}

struct Running {
    counter: u64,
    valid_until_ms: Arc<AtomicU64>,
    stop: CancellationToken,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{0}")]
    Fatal(String),
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
    running: HashMap<String, Running>,
    tasks: FuturesUnordered<JoinHandle<(String, ShardExit)>>,
    shards: Vec<ShardInfo>,
    last_discovery_ms: u64,
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> Worker<S, L, A> {
    pub fn new(shared: Shared<S, L, A>) -> Worker<S, L, A> {
        Worker {
            shared: Arc::new(shared),
            running: HashMap::new(),
            tasks: FuturesUnordered::new(),
            shards: Vec::new(),
            last_discovery_ms: 0,
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
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tick.tick() => {
                    if let Err(e) = self.maintain().await {
                        warn!(error = %e, "lease maintenance failed; retrying next round");
                    }
                }
                Some(done) = self.tasks.next(), if !self.tasks.is_empty() => self.reap(done),
            }
        }
        self.drain().await;
        Ok(())
    }

    fn reap(&mut self, done: Result<(String, ShardExit), tokio::task::JoinError>) {
        match done {
            Ok((shard, exit)) => {
                info!(shard = %shard, exit = ?exit, "shard reader stopped");
                self.running.remove(&shard);
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
        metrics::gauge!(names::LEASES_HELD).set(0.0);
        info!("stopped; leases released");
    }

    /// One round: renew, discover, take and balance, report.
    async fn maintain(&mut self) -> Result<(), String> {
        let shared = self.shared.clone();
        let lease_ms = self.lease_ms();
        let now = now_ms();
        // Renew what we hold; a lost lease stops its reader.
        for (shard, r) in &self.running {
            match shared.leases.renew(shard, &shared.owner, r.counter, now + lease_ms).await {
                Ok(true) => r.valid_until_ms.store(now + lease_ms, Ordering::Relaxed),
                Ok(false) => {
                    warn!(shard = %shard, "lease taken by another replica");
                    r.valid_until_ms.store(0, Ordering::Relaxed);
                    r.stop.cancel();
                }
                Err(e) => warn!(shard = %shard, error = %e, "lease renewal failed"),
            }
        }
        if now.saturating_sub(self.last_discovery_ms) >= lease_ms.max(1000) || self.shards.is_empty() {
            self.shards = shared.source.shards().await.map_err(|e| format!("DescribeStream: {e}"))?;
            self.last_discovery_ms = now;
        }
        let mut leases: BTreeMap<String, Lease> =
            shared.leases.list().await.map_err(|e| e.to_string())?.into_iter().map(|l| (l.shard_id.clone(), l)).collect();
        for s in &self.shards {
            if !leases.contains_key(&s.shard_id) {
                let lease = Lease::new(&s.shard_id, s.parent.as_deref());
                shared.leases.create(&lease).await.map_err(|e| e.to_string())?;
                leases.insert(s.shard_id.clone(), lease);
            }
        }
        shared.health.aws_reachable.store(true, Ordering::Relaxed);
        let finished = |id: &str| leases.get(id).is_some_and(Lease::finished);
        let ready: Vec<String> = lineage::ready(&self.shards, &finished).into_iter().map(|s| s.shard_id.clone()).collect();
        // Balance: about ready / replicas each, replicas being the live owners plus us.
        let mut owners: BTreeMap<&str, usize> = BTreeMap::new();
        owners.insert(shared.owner.as_str(), 0);
        for id in &ready {
            if let Some(l) = leases.get(id) {
                if let (Some(o), false) = (&l.owner, l.available(now)) {
                    *owners.entry(o.as_str()).or_default() += 1;
                }
            }
        }
        let target = ready.len().div_ceil(owners.len().max(1));
        let mut mine = self.running.len();
        let mut taken = Vec::new();
        for id in &ready {
            if mine >= target {
                break;
            }
            let Some(l) = leases.get(id) else { continue };
            if self.running.contains_key(id) || !l.available(now) {
                continue;
            }
            if let Some(got) = shared.leases.take(l, &shared.owner, now + lease_ms).await.map_err(|e| e.to_string())? {
                taken.push(got);
                mine += 1;
            }
        }
        if mine < target && taken.is_empty() {
            // Nothing free: take one lease from the busiest replica above its share.
            let busiest = owners.iter().filter(|(o, _)| **o != shared.owner).max_by_key(|(_, n)| **n).map(|(o, n)| (o.to_string(), *n));
            if let Some((victim, n)) = busiest {
                if n > target {
                    if let Some(l) = ready
                        .iter()
                        .filter_map(|id| leases.get(id))
                        .find(|l| l.owner.as_deref() == Some(victim.as_str()) && !l.available(now))
                    {
                        if let Some(got) = shared.leases.take(l, &shared.owner, now + lease_ms).await.map_err(|e| e.to_string())? {
                            info!(shard = %got.shard_id, from = %victim, "took a lease to balance replicas");
                            taken.push(got);
                        }
                    }
                }
            }
        }
        for lease in taken {
            self.start_reader(lease, now + lease_ms);
        }
        let max_age = {
            let mut ages = shared.ages.lock().unwrap_or_else(|e| e.into_inner());
            ages.retain(|shard, _| self.running.contains_key(shard));
            ages.values().copied().fold(0.0, f64::max)
        };
        metrics::gauge!(names::ITERATOR_AGE_MAX_SECONDS).set(max_age);
        let finished_count = leases.values().filter(|l| l.finished()).count();
        // The ledger floor: every shard created before the oldest unfinished one is finished.
        let unfinished: Vec<Option<u64>> =
            leases.values().filter(|l| !l.finished()).map(|l| crate::stream::shard_created_ms(&l.shard_id)).collect();
        let floor = if unfinished.iter().any(Option::is_none) { 0 } else { unfinished.iter().flatten().copied().min().unwrap_or(0) };
        shared.open_floor_ms.store(floor, Ordering::Relaxed);
        metrics::gauge!(names::LEASES_HELD).set(self.running.len() as f64);
        metrics::gauge!(names::SHARDS, "state" => "reading").set(ready.len() as f64);
        metrics::gauge!(names::SHARDS, "state" => "waiting")
            .set(self.shards.len().saturating_sub(ready.len()).saturating_sub(finished_count) as f64);
        metrics::gauge!(names::SHARDS, "state" => "finished").set(finished_count as f64);
        metrics::gauge!(names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        shared.health.last_maintenance_ms.store(now_ms(), Ordering::Relaxed);
        Ok(())
    }

    fn start_reader(&mut self, lease: Lease, valid_until: u64) {
        let shard = lease.shard_id.clone();
        info!(shard = %shard, counter = lease.counter, "lease taken");
        let valid_until_ms = Arc::new(AtomicU64::new(valid_until));
        let stop = CancellationToken::new();
        let handle = ShardLease {
            shard_id: shard.clone(),
            counter: lease.counter,
            valid_until_ms: valid_until_ms.clone(),
            checkpoint: lease.checkpoint.clone(),
        };
        let shared = self.shared.clone();
        let task_stop = stop.clone();
        let name = shard.clone();
        self.tasks.push(tokio::spawn(async move { (name, read_shard(shared, handle, task_stop).await) }));
        self.running.insert(shard, Running { counter: lease.counter, valid_until_ms, stop });
    }
}

#[cfg(test)]
mod tests;
