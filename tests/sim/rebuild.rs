//! A rule change rebuilt beside a busy target and a user's string (issue 26): the real workers
//! (old and new definitions side by side, then the old one stopped), the real definitions
//! protocol on the simulated lease table, and the real rebuild ([`rebuild::step`]) over the
//! reconcile protocol, on a simulated clock. One customer gets an order every simulated second
//! from before the change until after the rebuild; another customer's profile holds a user's
//! string where the renamed measure goes. The rebuild must finish (the committed definitions
//! settle) without starting over; every other target must be exact when it does; what it
//! skipped is retried alone once the busy customer is quiet (as the service's schedule does),
//! and then everything but the user's string is exact and the string is untouched.
//!
//! Deterministic like the main simulation: one thread, paused time, every choice from the seed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ddb_aggregator::config::Config;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::reconcile::memory::MemorySources;
use ddb_aggregator::reconcile::protocol::{self, Removed, Retirement};
use ddb_aggregator::reconcile::rebuild::{self, Passes};
use ddb_aggregator::reconcile::{Options, ReconcileError, Report};
use ddb_aggregator::rules::{Rule, TargetKey};
use ddb_aggregator::sink::memory::{MemValue, MemoryAggregates};
use ddb_aggregator::state::memory::MemoryLeases;
use ddb_aggregator::state::{now_ms, simulate_clock, LeaseStore};
use ddb_aggregator::stream::sim::SimStream;
use ddb_aggregator::telemetry::Health;
use ddb_aggregator::worker::{Shared, Worker};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::faults::{Fate, Faults, Leases, Sink, Source};
use super::reconcile::{SimConsumer, SimTargets};
use super::tip::{cents_text, item};

const EPOCH_MS: u64 = 1_798_761_600_000;
/// A customer's orders stay below this (older ones are deleted).
const ORDERS_PER_CUSTOMER: usize = 20;
/// The customer written every second (on shard 0) and the one whose profile holds a string.
const HOT: u32 = 0;
const USERS: u32 = 5;
const USER_TEXT: &str = "set by a user";
/// `reconcile.remove_leftovers_after`, short here: zeroed leftovers (the renamed measure's old
/// attribute) are removed this long after the rebuild zeroed them.
const REMOVE_AFTER_S: u64 = 600;

#[derive(Debug, Clone)]
pub struct RebuildParams {
    pub seed: u64,
    pub shards: usize,
    pub customers_per_shard: u32,
    /// Order writes per simulated second over the whole table (besides the hot customer's).
    pub writes_per_s: f64,
    /// Simulated seconds of the old definitions alone, then of old and new side by side.
    pub before_s: u64,
    pub overlap_s: u64,
    /// The longest the rebuild may take after the old replica stops (simulated seconds).
    pub limit_s: u64,
}

impl Default for RebuildParams {
    fn default() -> RebuildParams {
        RebuildParams { seed: 1, shards: 20, customers_per_shard: 6, writes_per_s: 4.0, before_s: 180, overlap_s: 60, limit_s: 3600 }
    }
}

#[derive(Debug, Default)]
pub struct RebuildReport {
    pub params: String,
    pub records: u64,
    pub records_of_hot: u64,
    /// The hot customer's orders while the rebuild ran (from the old replica's stop to settled).
    pub hot_writes_during: u64,
    /// Simulated seconds from the old replica's stop until the new definitions were committed,
    /// and until nothing was left to rebuild or retire.
    pub committed_after_s: Option<f64>,
    pub settled_after_s: Option<f64>,
    /// Rebuild steps run, full passes among them (1: the rebuild never started over), and
    /// targets skipped (reported, handed to the schedule).
    pub steps: u64,
    pub full_passes: u64,
    pub skipped: Vec<TargetKey>,
    /// Values wrong just after the rebuild (writes stopped, drained), and after the skipped
    /// targets were reconciled alone.
    pub wrong_after_rebuild: Vec<String>,
    pub values_compared: u64,
    pub wrong_after_reconcile: Vec<String>,
    pub user_string_kept: bool,
    /// Items still holding the renamed measure's old attribute once its removal was due, and
    /// whether the committed definitions still list the old definition then.
    pub old_attribute_left: Vec<String>,
    pub retire_left: bool,
    pub wall_s: f64,
    pub problems: Vec<String>,
}

impl std::fmt::Display for RebuildReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |x: Option<f64>| x.map_or("never".to_string(), |x| format!("{x:.0} s"));
        writeln!(f, "rebuild simulation: {} ({:.1} s)", self.params, self.wall_s)?;
        writeln!(f, "  records {}; the hot customer's orders during the rebuild {}", self.records, self.hot_writes_during)?;
        writeln!(
            f,
            "  after the old replica's stop: committed {}, settled {} ({} rebuild steps, {} full passes); skipped {:?}",
            s(self.committed_after_s),
            s(self.settled_after_s),
            self.steps,
            self.full_passes,
            self.skipped.iter().map(|k| k.0.join("/")).collect::<Vec<_>>()
        )?;
        writeln!(f, "  wrong just after the rebuild: {} {:?}", self.wrong_after_rebuild.len(), self.wrong_after_rebuild)?;
        write!(
            f,
            "  after the skipped targets were reconciled alone: {} values compared, {} wrong {:?}; the user's string kept: {}",
            self.values_compared,
            self.wrong_after_reconcile.len(),
            self.wrong_after_reconcile,
            self.user_string_kept
        )?;
        write!(
            f,
            "\n  after the removal was due: {} items with the old attribute {:?}; the old definition still listed: {}",
            self.old_attribute_left.len(),
            self.old_attribute_left.iter().take(5).collect::<Vec<_>>(),
            self.retire_left
        )?;
        for p in &self.problems {
            write!(f, "\n  PROBLEM: {p}")?;
        }
        Ok(())
    }
}

/// The rebuild's passes over the simulated tables: the reconcile protocol, as the service's
/// reconciler runs it.
struct SimPasses {
    config: Config,
    targets: SimTargets,
    sources: Arc<MemorySources>,
    consumer: SimConsumer,
    /// Full passes (every target of a rule) run.
    full: Arc<std::sync::atomic::AtomicU64>,
}

impl Passes for SimPasses {
    fn config(&self) -> &Config {
        &self.config
    }

    async fn pass(&self, rule: &Rule, targets: Option<BTreeSet<TargetKey>>, opts: &Options) -> Result<Report, ReconcileError> {
        if targets.is_none() {
            self.full.fetch_add(1, Ordering::Relaxed);
        }
        let mut report = Report::default();
        protocol::reconcile_rule(&self.targets, &*self.sources, &self.consumer, rule, targets, opts, &mut report).await?;
        Ok(report)
    }

    async fn retire(&self, old: &Rule, current: &[Rule]) -> Result<Retirement, ReconcileError> {
        protocol::retire_rule(&self.targets, old, current).await
    }

    async fn remove(&self, old: &Rule, current: &[Rule]) -> Result<Removed, ReconcileError> {
        protocol::remove_leftovers(&self.targets, old, current).await
    }
}

fn config(measures: &str) -> Config {
    let text = format!(
        r#"
source: {{ table: sim-source, start_position: trim_horizon, batch_size: 100, read_ahead: true }}
state: {{ table: sim-rebuild-state, lease_duration: 10s }}
aggregates: {{ table: sim-aggregates }}
reconcile: {{ interval: 0s, wait: 2m, remove_leftovers_after: {REMOVE_AFTER_S}s }}
rules:
  - name: orders
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PROFILE" }}
    measures: {{ {measures} }}
    reconcile: {{ query: {{ PK: "CUST#{{customer}}", SK_begins_with: "ORDER#" }} }}
"#
    );
    Config::from_yaml(&text, Vec::<(String, String)>::new()).expect("rebuild simulation config")
}

/// Runs one seeded rebuild simulation.
pub fn rebuild_run(p: &RebuildParams) -> RebuildReport {
    let started = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
    let mut report = rt.block_on(async {
        simulate_clock(Some(EPOCH_MS));
        let report = World::new(p.clone()).run().await;
        simulate_clock(None);
        report
    });
    report.wall_s = started.elapsed().as_secs_f64();
    report
}

struct World {
    p: RebuildParams,
    old: Config,
    new: Config,
    rng: fastrand::Rng,
    stream: Arc<SimStream>,
    shards: Vec<String>,
    leases: Arc<MemoryLeases>,
    aggregates: Arc<MemoryAggregates>,
    sources: Arc<MemorySources>,
    /// (customer, order) -> cents.
    items: BTreeMap<(u32, u64), i64>,
    next_order: u64,
    /// Full passes the rebuild ran (the harness's last, targeted pass is not one).
    full_passes: Arc<std::sync::atomic::AtomicU64>,
    report: RebuildReport,
}

/// What the new replica's rebuild loop saw.
#[derive(Debug, Default)]
struct Seen {
    committed_at: Option<u64>,
    settled_at: Option<u64>,
    steps: u64,
    skipped: Vec<TargetKey>,
}

impl World {
    fn new(p: RebuildParams) -> World {
        let stream = Arc::new(SimStream::new());
        stream.quiet();
        let now = now_ms();
        let shards = (0..p.shards).map(|_| stream.add_shard_at(None, now - 60_000)).collect();
        World {
            old: config("orderCount: count, revenue: { sum: total }"),
            new: config("orderCount: count, spend: { sum: total }"),
            rng: fastrand::Rng::with_seed(p.seed),
            report: RebuildReport { params: format!("{p:?}"), ..RebuildReport::default() },
            p,
            stream,
            shards,
            leases: Arc::new(MemoryLeases::new()),
            aggregates: Arc::new(MemoryAggregates::new()),
            sources: Arc::new(MemorySources::new(vec!["PK".into(), "SK".into()])),
            items: BTreeMap::new(),
            next_order: 0,
            full_passes: Arc::default(),
        }
    }

    async fn run(mut self) -> RebuildReport {
        let step = Duration::from_millis(100);
        let stop_a = CancellationToken::new();
        let a = self.worker(self.old.clone(), "replica-a", &stop_a);
        self.write_for(Duration::from_secs(self.p.before_s), step).await;
        self.aggregates.put(&[&format!("CUST#c{USERS}"), "PROFILE"], "spend", MemValue::Str(USER_TEXT.into()));
        let stop_b = CancellationToken::new();
        let b = self.worker(self.new.clone(), "replica-b", &stop_b);
        let (stop_loop, seen) = (CancellationToken::new(), Arc::new(std::sync::Mutex::new(Seen::default())));
        let rebuilds = self.rebuild_loop(&b.1, &stop_loop, seen.clone());
        self.write_for(Duration::from_secs(self.p.overlap_s), step).await;
        stop_a.cancel();
        let _ = a.0.await;
        let stopped = now_ms();
        let hot_before = self.hot_orders();
        let deadline = stopped + self.p.limit_s * 1000;
        while now_ms() < deadline && lock(&seen).settled_at.is_none() {
            self.write_for(Duration::from_secs(1), step).await;
        }
        self.report.hot_writes_during = self.hot_orders() - hot_before;
        // A minute more of writes after the rebuild, then quiet.
        self.write_for(Duration::from_secs(60), step).await;
        {
            let s = lock(&seen);
            let since = |t: Option<u64>| t.map(|t| t.saturating_sub(stopped) as f64 / 1000.0);
            self.report.committed_after_s = since(s.committed_at);
            self.report.settled_after_s = since(s.settled_at);
            self.report.steps = s.steps;
            self.report.full_passes = self.full_passes.load(Ordering::Relaxed);
            self.report.skipped = s.skipped.clone();
        }
        if self.report.settled_after_s.is_none() {
            self.report.problems.push(format!("the rebuild did not finish within {} s of the old replica's stop", self.p.limit_s));
        }
        self.drain().await;
        self.report.wrong_after_rebuild = self.check().1;
        // The schedule's retry of what the rebuild skipped, now that the busy customer is quiet.
        let passes = self.passes();
        let opts = Options { wait: Duration::from_secs(120), attempts: 3, ..Options::default() };
        let skipped: BTreeSet<TargetKey> = self.report.skipped.iter().cloned().collect();
        if let Err(e) = passes.pass(&self.new.engine.rules[0], Some(skipped), &opts).await {
            self.report.problems.push(format!("reconciling the skipped targets failed: {e}"));
        }
        let (compared, wrong) = self.check();
        self.report.values_compared = compared;
        self.report.wrong_after_reconcile = wrong;
        self.report.user_string_kept = self
            .aggregates
            .item(&[&format!("CUST#c{USERS}"), "PROFILE"])
            .is_some_and(|i| matches!(i.get("spend"), Some(MemValue::Str(s)) if s == USER_TEXT));
        // Quiet past the removal window: the rebuild loop removes the zeroed old attribute.
        tokio::time::sleep(Duration::from_secs(REMOVE_AFTER_S + 60)).await;
        self.report.old_attribute_left = self
            .aggregates
            .keys()
            .into_iter()
            .filter(|k| self.aggregates.item(&k.iter().map(String::as_str).collect::<Vec<_>>()).is_some_and(|i| i.contains_key("revenue")))
            .map(|k| k.join("/"))
            .collect();
        self.report.retire_left = self.leases.definitions().await.ok().flatten().is_none_or(|(c, _)| !c.retire.is_empty());
        stop_loop.cancel();
        let _ = rebuilds.await;
        stop_b.cancel();
        let _ = b.0.await;
        self.report
    }

    fn worker(&self, config: Config, owner: &str, stop: &CancellationToken) -> (tokio::task::JoinHandle<()>, Arc<AtomicCurrent>) {
        let fate = Arc::new(Fate::default());
        let faults = Arc::new(Faults::new(self.p.seed, 0.0));
        let shared = Shared::new(
            config,
            Source { inner: self.stream.clone(), fate: fate.clone(), faults: faults.clone() },
            Leases { inner: self.leases.clone(), fate: fate.clone(), faults: faults.clone() },
            Arc::new(Sink { inner: self.aggregates.clone(), fate, faults, trace: None }),
            owner.into(),
            Arc::new(Health::default()),
        );
        let worker = Worker::new(shared);
        let current = Arc::new(AtomicCurrent(worker.shared().clone()));
        let stop = stop.clone();
        (
            tokio::spawn(async move {
                let _ = worker.run(stop).await;
            }),
            current,
        )
    }

    fn passes(&self) -> SimPasses {
        SimPasses {
            config: self.new.clone(),
            targets: SimTargets::new(self.aggregates.clone(), &self.new.ledger_namespace),
            sources: self.sources.clone(),
            consumer: SimConsumer {
                stream: self.stream.clone(),
                leases: self.leases.clone(),
                margin_ms: u64::try_from(self.new.reconcile_margin.as_millis()).unwrap_or(2_000),
                poll: Duration::from_millis(250),
            },
            full: self.full_passes.clone(),
        }
    }

    /// The new replica's rebuilds, as the service's schedule runs them on the replica holding
    /// its lease (here the only one, with no backoff after a failed step): while its
    /// definitions are the committed ones, a step every 5 s, until `stop`.
    fn rebuild_loop(
        &self,
        current: &Arc<AtomicCurrent>,
        stop: &CancellationToken,
        seen: Arc<std::sync::Mutex<Seen>>,
    ) -> tokio::task::JoinHandle<()> {
        let (passes, leases, current, stop) = (self.passes(), self.leases.clone(), current.clone(), stop.clone());
        let wait = self.new.reconcile_wait;
        let remove_after_ms = REMOVE_AFTER_S * 1000;
        tokio::spawn(async move {
            let mut progress = rebuild::Progress::default();
            let mut generation = None;
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
                if !current.get() {
                    continue;
                }
                let Ok(Some((c, _))) = leases.definitions().await else { continue };
                let first = *generation.get_or_insert(c.generation);
                if c.generation != first {
                    continue; // only the generation B committed is watched
                }
                if lock(&seen).committed_at.is_none() {
                    lock(&seen).committed_at = Some(now_ms());
                }
                if c.settled() {
                    {
                        let mut s = lock(&seen);
                        s.settled_at = s.settled_at.or(Some(now_ms()));
                    }
                    if c.removal_due_ms(remove_after_ms).is_none_or(|due| now_ms() < due) {
                        continue;
                    }
                }
                lock(&seen).steps += 1;
                if let Ok(stepped) = rebuild::step(&passes, &*leases, &mut progress, wait).await {
                    let mut s = lock(&seen);
                    s.skipped.extend(stepped.skipped.into_iter().map(|(_, k)| k));
                    if stepped.settled {
                        s.settled_at = s.settled_at.or(Some(now_ms()));
                    }
                }
            }
        })
    }

    async fn write_for(&mut self, how_long: Duration, step: Duration) {
        let end = now_ms() + u64::try_from(how_long.as_millis()).unwrap_or(0);
        let mut next_hot = now_ms();
        while now_ms() < end {
            if now_ms() >= next_hot {
                self.write_one(HOT, 0);
                next_hot += 1000;
            }
            for _ in 0..16 {
                if self.rng.f64() >= self.p.writes_per_s * step.as_secs_f64() / 16.0 {
                    continue;
                }
                let shard = self.rng.usize(..self.shards.len());
                let customer = shard as u32 + self.shards.len() as u32 * self.rng.u32(..self.p.customers_per_shard);
                if customer != HOT {
                    self.write_one(customer, shard);
                }
            }
            tokio::time::sleep(step).await;
        }
    }

    fn hot_orders(&self) -> u64 {
        self.report.records_of_hot
    }

    /// A new order of `customer` (on `shard`), or its oldest deleted now and then.
    fn write_one(&mut self, customer: u32, shard: usize) {
        let orders = self.items.range((customer, 0)..(customer + 1, 0)).count();
        let oldest = self.items.range((customer, 0)..(customer + 1, 0)).next().map(|(k, c)| (*k, *c));
        let delete = orders >= ORDERS_PER_CUSTOMER || self.rng.f64() < 0.3;
        let (event, key, cents) = match oldest {
            Some((key, cents)) if delete => {
                self.items.remove(&key);
                self.sources.delete(&[format!("CUST#c{}", key.0), format!("ORDER#o{}", key.1)]);
                ("REMOVE", key, cents)
            }
            _ => {
                self.next_order += 1;
                let key = (customer, self.next_order);
                let cents = self.rng.i64(1..100_000);
                self.items.insert(key, cents);
                self.sources.put(item(key, cents));
                ("INSERT", key, cents)
            }
        };
        let image = Value::Object(item(key, cents));
        let mut ddb = json!({"Keys": {"PK": image["PK"], "SK": image["SK"]}, "ApproximateCreationDateTime": now_ms() / 1000});
        ddb[if event == "INSERT" { "NewImage" } else { "OldImage" }] = image;
        self.stream.append_at(&self.shards[shard], json!({"eventName": event, "dynamodb": ddb}), now_ms());
        self.report.records += 1;
        if customer == HOT {
            self.report.records_of_hot += 1;
        }
    }

    /// Every record applied (bounded: 10 simulated minutes).
    async fn drain(&mut self) {
        for _ in 0..600 {
            if self.drained() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.report.problems.push("not drained 10 minutes after the last write".into());
    }

    fn drained(&self) -> bool {
        super::tip::drained(&self.stream, &self.leases, &self.shards)
    }

    /// The oracle: the new definitions' values from the items against the table (every
    /// number; `revenue`, the old name, must be 0 or gone; the user's string is not a number
    /// and its customer's `spend` is left out). Returns (values compared, the wrong ones).
    fn check(&self) -> (u64, Vec<String>) {
        let mut truth: BTreeMap<(Vec<String>, String), Decimal> = BTreeMap::new();
        for ((customer, _), cents) in &self.items {
            let key = vec![format!("CUST#c{customer}"), "PROFILE".to_string()];
            for (attr, v) in [("orderCount", Decimal::from_i64(1)), ("spend", Decimal::parse(&cents_text(*cents)).expect("cents"))] {
                if *customer == USERS && attr == "spend" {
                    continue;
                }
                let e = truth.entry((key.clone(), attr.to_string())).or_insert(Decimal::ZERO);
                *e = e.checked_add(v).expect("in range");
            }
        }
        truth.retain(|_, v| !v.is_zero());
        let stored = self.aggregates.numbers();
        let keys: BTreeSet<&(Vec<String>, String)> = truth.keys().chain(stored.keys()).collect();
        let mut wrong = Vec::new();
        for k in &keys {
            if truth.get(*k) != stored.get(*k) {
                wrong.push(format!("{}.{}: stored {:?}, truth {:?}", k.0.join("/"), k.1, stored.get(*k), truth.get(*k)));
            }
        }
        (keys.len() as u64, wrong)
    }
}

/// Whether a worker runs the committed definitions (its definitions gate is open).
struct AtomicCurrent(Arc<Shared<Source<SimStream>, Leases<MemoryLeases>, Sink<MemoryAggregates>>>);

impl AtomicCurrent {
    fn get(&self) -> bool {
        self.0.definitions_current.load(Ordering::Acquire)
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
