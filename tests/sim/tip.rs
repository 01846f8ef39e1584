//! Reconcile's tip evidence under runs of empty GetRecords pages mid-shard (issue 26): the real
//! worker and the real reconcile protocol on a simulated clock, busy shards and idle ones, and
//! runs of empty pages injected on busy shards before their next record, which every iterator
//! chain reaching it answers (AWS: "it might take multiple calls" to pass a stretch without
//! records, with no bound). Reconciles are requested all along;
//! an oracle that knows when every record was appended names each judgement that came before
//! its shard applied what the truth read saw (premature), by the evidence that made it.
//!
//! Deterministic like the main simulation: one thread, paused time, every choice from the seed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddb_aggregator::config::Config;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::reconcile::caught_up;
use ddb_aggregator::reconcile::memory::MemorySources;
use ddb_aggregator::reconcile::protocol::{self, Applied, Consumer};
use ddb_aggregator::reconcile::{Options, ReconcileError, Report};
use ddb_aggregator::sink::memory::MemoryAggregates;
use ddb_aggregator::state::memory::MemoryLeases;
use ddb_aggregator::state::{now_ms, simulate_clock, Checkpoint, Lease};
use ddb_aggregator::stream::sim::SimStream;
use ddb_aggregator::telemetry::Health;
use ddb_aggregator::worker::{Shared, Worker};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::faults::{Fate, Faults, Leases, Sink, Source};
use super::reconcile::SimTargets;

const EPOCH_MS: u64 = 1_798_761_600_000;
const CUSTOMERS_PER_SHARD: u32 = 6;
/// A customer's orders stay below this (older ones are deleted): every reconcile scans the
/// table, whose size is then bounded however long the run.
const ORDERS_PER_CUSTOMER: usize = 20;

#[derive(Debug, Clone)]
pub struct TipParams {
    pub seed: u64,
    /// Open shards; the first `busy` take records all the time, the others now and then.
    pub shards: usize,
    pub busy: usize,
    pub minutes: u64,
    /// Records per second on a busy shard, and an idle shard's mean gap between records (s).
    pub busy_rate: f64,
    pub idle_gap_s: f64,
    /// Runs of empty pages injected per simulated minute (on random busy shards), and their
    /// length in pages (inclusive).
    pub runs_per_minute: f64,
    pub run_pages: (u32, u32),
    /// The rule: `reconcile.tip_evidence`.
    pub empty_pages: u32,
    pub over: &'static str,
    /// A reconcile of every target is requested this often (simulated seconds).
    pub reconcile_every_s: u64,
}

impl Default for TipParams {
    fn default() -> TipParams {
        TipParams {
            seed: 1,
            shards: 6,
            busy: 3,
            minutes: 10,
            busy_rate: 4.0,
            idle_gap_s: 240.0,
            runs_per_minute: 30.0,
            run_pages: (1, 8),
            empty_pages: 3,
            over: "2s",
            reconcile_every_s: 15,
        }
    }
}

#[derive(Debug, Default)]
pub struct TipReport {
    pub params: String,
    pub records: u64,
    pub runs: u64,
    pub run_pages: u64,
    pub reconciles: u64,
    pub reconciles_gave_up: u64,
    /// Judgements (a shard caught up, once per wait for evidence), by evidence.
    pub judged: BTreeMap<&'static str, u64>,
    /// Judgements made before the shard applied a record the truth read saw, by evidence.
    pub premature: BTreeMap<&'static str, u64>,
    /// Distinct shards the reconcile reports named as judged by empty pages, and the
    /// judgements they counted.
    pub reported_shards: usize,
    pub reported_judgements: u64,
    /// Attributes reconcile corrected: in this world without faults every one is a right
    /// value overwritten after a premature judgement.
    pub corrected: u64,
    pub values_compared: u64,
    pub values_wrong: u64,
    pub wall_s: f64,
    pub problems: Vec<String>,
}

impl std::fmt::Display for TipReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "tip evidence simulation: {} ({:.1} s)", self.params, self.wall_s)?;
        writeln!(f, "  records {}, empty-page runs injected {} ({} pages)", self.records, self.runs, self.run_pages)?;
        writeln!(f, "  reconciles {} ({} gave up), corrections {}", self.reconciles, self.reconciles_gave_up, self.corrected)?;
        writeln!(f, "  judgements by evidence {:?}, premature {:?}", self.judged, self.premature)?;
        writeln!(
            f,
            "  reported by reconcile as judged by empty pages: {} judgements, {} distinct shards",
            self.reported_judgements, self.reported_shards
        )?;
        write!(f, "  after the drain: {} values compared, {} wrong", self.values_compared, self.values_wrong)?;
        for p in &self.problems {
            write!(f, "\n  PROBLEM: {p}")?;
        }
        Ok(())
    }
}

impl TipReport {
    pub fn premature(&self) -> u64 {
        self.premature.values().sum()
    }
}

/// When each record of each shard was appended: (sequence number, epoch ms).
type Appended = Arc<Mutex<BTreeMap<String, Vec<(u64, u64)>>>>;

/// The judgements of every wait for evidence, as the oracle sees them.
#[derive(Debug, Default)]
struct Judgements {
    judged: BTreeMap<&'static str, u64>,
    premature: BTreeMap<&'static str, u64>,
}

/// The evidence rule of `SimConsumer` (tests/sim/reconcile.rs), polled every 250 ms as
/// DynamoDB's reconciler does, with the oracle's look at each judgement.
struct Watched {
    stream: Arc<SimStream>,
    leases: Arc<MemoryLeases>,
    margin_ms: u64,
    appended: Appended,
    judgements: Arc<Mutex<Judgements>>,
}

impl Watched {
    /// Whether `lease`'s shard still holds a record appended before `before_ms` that its
    /// checkpoint does not cover.
    fn unapplied(&self, lease: &Lease, before_ms: u64) -> bool {
        let covered = match &lease.checkpoint {
            Some(Checkpoint::ShardEnd) => return false,
            Some(Checkpoint::Sequence(s)) => s.parse::<u64>().unwrap_or(0),
            _ => 0,
        };
        let appended = self.appended.lock().unwrap_or_else(|e| e.into_inner());
        appended.get(&lease.shard_id).is_some_and(|records| records.iter().any(|(seq, at)| *at < before_ms && *seq > covered))
    }
}

impl Consumer for Watched {
    async fn applied_before(&self, after_ms: u64, wait: Duration) -> Result<Applied, ReconcileError> {
        let target = after_ms + self.margin_ms;
        let started = now_ms();
        loop {
            let standing = caught_up::standing(&*self.stream, &*self.leases, target).await?;
            if standing.behind.is_empty() {
                let mut j = self.judgements.lock().unwrap_or_else(|e| e.into_inner());
                for lease in standing.leases.values() {
                    let Some(evidence) = caught_up::evidence(lease, target) else { continue };
                    *j.judged.entry(evidence.as_str()).or_default() += 1;
                    if self.unapplied(lease, after_ms) {
                        *j.premature.entry(evidence.as_str()).or_default() += 1;
                    }
                }
                return Ok(Applied { fence_ms: standing.fence_ms, by_empty_pages: standing.by_empty_pages });
            }
            if now_ms().saturating_sub(started) > u64::try_from(wait.as_millis()).unwrap_or(u64::MAX) {
                return Err(ReconcileError::NotCaughtUp(format!("{} shards behind", standing.behind.len())));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

fn config(p: &TipParams) -> Config {
    let text = format!(
        r#"
source: {{ table: sim-source, start_position: trim_horizon, batch_size: 100 }}
state: {{ table: sim-tip-state, lease_duration: 10s }}
aggregates: {{ table: sim-aggregates }}
reconcile: {{ interval: 0s, wait: 2m, tip_evidence: {{ empty_pages: {}, over: {} }} }}
rules:
  - name: orders
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PROFILE" }}
    measures: {{ orderCount: count, revenue: {{ sum: total }} }}
    reconcile: {{ scan: true }}
"#,
        p.empty_pages, p.over
    );
    Config::from_yaml(&text, Vec::<(String, String)>::new()).expect("tip simulation config")
}

/// Runs one seeded tip-evidence simulation.
pub fn tip_run(p: &TipParams) -> TipReport {
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
    p: TipParams,
    config: Config,
    rng: fastrand::Rng,
    stream: Arc<SimStream>,
    shards: Vec<String>,
    leases: Arc<MemoryLeases>,
    aggregates: Arc<MemoryAggregates>,
    sources: Arc<MemorySources>,
    appended: Appended,
    /// (customer, order) -> cents.
    items: BTreeMap<(u32, u64), i64>,
    next_order: u64,
    report: TipReport,
}

impl World {
    fn new(p: TipParams) -> World {
        let stream = Arc::new(SimStream::new());
        stream.quiet();
        let now = now_ms();
        let shards = (0..p.shards).map(|_| stream.add_shard_at(None, now - 60_000)).collect();
        World {
            config: config(&p),
            rng: fastrand::Rng::with_seed(p.seed),
            report: TipReport { params: format!("{p:?}"), ..TipReport::default() },
            p,
            stream,
            shards,
            leases: Arc::new(MemoryLeases::new()),
            aggregates: Arc::new(MemoryAggregates::new()),
            sources: Arc::new(MemorySources::new(vec!["PK".into(), "SK".into()])),
            appended: Arc::default(),
            items: BTreeMap::new(),
            next_order: 0,
        }
    }

    async fn run(mut self) -> TipReport {
        let (stop_worker, stop_rounds) = (CancellationToken::new(), CancellationToken::new());
        let worker = self.worker(&stop_worker);
        let judgements = Arc::new(Mutex::new(Judgements::default()));
        let rounds = self.reconciles(&stop_rounds, judgements.clone());
        let step = Duration::from_millis(100);
        let end = now_ms() + self.p.minutes * 60_000;
        while now_ms() < end {
            self.writes(step);
            self.empty_runs(step);
            tokio::time::sleep(step).await;
        }
        // No more writes or runs; the reconcile under way finishes and no other starts, so none
        // repairs what an earlier one did wrong. Then the drain: every record applied, and the
        // oracle compares.
        stop_rounds.cancel();
        let reports = rounds.await.unwrap_or_default();
        for _ in 0..600 {
            if self.drained() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if !self.drained() {
            self.report.problems.push("not drained 10 minutes after the last write".into());
        }
        stop_worker.cancel();
        let _ = worker.await;
        for r in &reports {
            match r {
                Ok(r) => {
                    self.report.reconciles += 1;
                    self.report.corrected += r.drifts.iter().filter(|d| d.corrected).count() as u64;
                    self.report.reported_judgements += r.empty_page_judgements;
                }
                Err(_) => self.report.reconciles_gave_up += 1,
            }
        }
        self.report.reported_shards =
            reports.iter().flatten().flat_map(|r| r.by_empty_pages.iter()).collect::<std::collections::BTreeSet<_>>().len();
        let j = std::mem::take(&mut *judgements.lock().unwrap_or_else(|e| e.into_inner()));
        self.report.judged = j.judged;
        self.report.premature = j.premature;
        self.check();
        self.report
    }

    fn worker(&self, stop: &CancellationToken) -> tokio::task::JoinHandle<()> {
        let fate = Arc::new(Fate::default());
        let faults = Arc::new(Faults::new(self.p.seed, 0.0));
        let shared = Shared::new(
            self.config.clone(),
            Source { inner: self.stream.clone(), fate: fate.clone(), faults: faults.clone() },
            Leases { inner: self.leases.clone(), fate: fate.clone(), faults: faults.clone() },
            Arc::new(Sink { inner: self.aggregates.clone(), fate, faults, trace: None }),
            "replica-1".into(),
            Arc::new(Health::default()),
        );
        let worker = Worker::new(shared);
        let stop = stop.clone();
        tokio::spawn(async move {
            let _ = worker.run(stop).await;
        })
    }

    /// A reconcile of every target every `reconcile_every_s`, among the writes, until `stop`.
    fn reconciles(
        &self,
        stop: &CancellationToken,
        judgements: Arc<Mutex<Judgements>>,
    ) -> tokio::task::JoinHandle<Vec<Result<Report, ReconcileError>>> {
        let targets = SimTargets::new(self.aggregates.clone(), &self.config.ledger_namespace);
        let consumer = Watched {
            stream: self.stream.clone(),
            leases: self.leases.clone(),
            margin_ms: u64::try_from(self.config.reconcile_margin.as_millis()).unwrap_or(2_000),
            appended: self.appended.clone(),
            judgements,
        };
        let sources = self.sources.clone();
        let rule = self.config.engine.rules[0].clone();
        let every = Duration::from_secs(self.p.reconcile_every_s);
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut out = Vec::new();
            let opts = Options { all: true, wait: Duration::from_secs(120), attempts: 3, ..Options::default() };
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return out,
                    _ = tokio::time::sleep(every) => {}
                }
                let mut report = Report::default();
                let r = protocol::reconcile_rule(&targets, &*sources, &consumer, &rule, None, &opts, &mut report).await;
                out.push(r.map(|()| report));
            }
        })
    }

    fn writes(&mut self, step: Duration) {
        let secs = step.as_secs_f64();
        for i in 0..self.shards.len() {
            let chance = if i < self.p.busy { self.p.busy_rate * secs } else { secs / self.p.idle_gap_s };
            if self.rng.f64() < chance {
                self.write_one(i);
            }
        }
    }

    /// A new order of a customer of shard `i`, or now and then one deleted.
    fn write_one(&mut self, i: usize) {
        let customer = i as u32 + self.shards.len() as u32 * self.rng.u32(..CUSTOMERS_PER_SHARD);
        let orders = self.items.range((customer, 0)..(customer + 1, 0)).take(ORDERS_PER_CUSTOMER).count();
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
        let seq = self.stream.append_at(&self.shards[i], json!({"eventName": event, "dynamodb": ddb}), now_ms());
        self.appended.lock().unwrap_or_else(|e| e.into_inner()).entry(self.shards[i].clone()).or_default().push((seq, now_ms()));
        self.report.records += 1;
    }

    fn empty_runs(&mut self, step: Duration) {
        if self.p.busy == 0 || self.rng.f64() >= self.p.runs_per_minute * step.as_secs_f64() / 60.0 {
            return;
        }
        let shard = &self.shards[self.rng.usize(..self.p.busy)];
        let pages = self.rng.u32(self.p.run_pages.0..=self.p.run_pages.1);
        if self.stream.empty_run_unpassed(shard) {
            return; // two runs back to back would be one longer run
        }
        self.stream.empty_pages_on(shard, pages);
        self.report.runs += 1;
        self.report.run_pages += u64::from(pages);
    }

    /// Every shard's checkpoint covers its last record.
    fn drained(&self) -> bool {
        drained(&self.stream, &self.leases, &self.shards)
    }

    /// The oracle: every aggregate from the items, against the table.
    fn check(&mut self) {
        let mut truth: BTreeMap<(Vec<String>, String), Decimal> = BTreeMap::new();
        for ((customer, _), cents) in &self.items {
            let key = vec![format!("CUST#c{customer}"), "PROFILE".to_string()];
            for (attr, v) in [("orderCount", Decimal::from_i64(1)), ("revenue", Decimal::parse(&cents_text(*cents)).expect("cents"))] {
                let e = truth.entry((key.clone(), attr.to_string())).or_insert(Decimal::ZERO);
                *e = e.checked_add(v).expect("in range");
            }
        }
        truth.retain(|_, v| !v.is_zero());
        let mut stored = self.aggregates.numbers();
        stored.retain(|_, v| !v.is_zero());
        let keys: std::collections::BTreeSet<&(Vec<String>, String)> = truth.keys().chain(stored.keys()).collect();
        let mut wrong = Vec::new();
        for k in keys {
            self.report.values_compared += 1;
            if truth.get(k) != stored.get(k) {
                wrong.push(format!("{:?}.{}: stored {:?}, truth {:?}", k.0, k.1, stored.get(k), truth.get(k)));
            }
        }
        self.report.values_wrong = wrong.len() as u64;
        if !wrong.is_empty() {
            self.report.problems.push(format!(
                "{} values wrong, e.g. {}",
                wrong.len(),
                wrong.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
    }
}

/// Every one of `shards` has a checkpoint covering its last record.
pub(super) fn drained(stream: &SimStream, leases: &MemoryLeases, shards: &[String]) -> bool {
    let leases: BTreeMap<String, Lease> = leases.snapshot().into_iter().map(|l| (l.shard_id.clone(), l)).collect();
    shards.iter().all(|s| match stream.last_sequence(s) {
        None => true,
        Some(last) => leases
            .get(s)
            .is_some_and(|l| matches!(&l.checkpoint, Some(Checkpoint::Sequence(c)) if c.parse::<u64>().is_ok_and(|c| c >= last))),
    })
}

pub(super) fn item(key: (u32, u64), cents: i64) -> serde_json::Map<String, Value> {
    let v = json!({"PK": {"S": format!("CUST#c{}", key.0)}, "SK": {"S": format!("ORDER#o{}", key.1)}, "total": {"N": cents_text(cents)}});
    v.as_object().cloned().unwrap_or_default()
}

pub(super) fn cents_text(c: i64) -> String {
    format!("{}.{:02}", c / 100, c % 100)
}
