//! The simulation's world: the source table (items), its stream (partitions that roll over,
//! split and are trimmed), the replicas and their fates, the schedule of faults, and the
//! oracle.

mod faults;
pub mod rebuild;
mod reconcile;
pub mod tip;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ddb_aggregator::config::Config;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::reconcile::memory::MemorySources;
use ddb_aggregator::reconcile::ReconcileError;
use ddb_aggregator::rules::helper::{MARK, REFS};
use ddb_aggregator::sink::dead_letter::{DeadLetters, Delivery, MemoryDeadLetters};
use ddb_aggregator::sink::expiry::Expiry;
use ddb_aggregator::sink::memory::{MemValue, MemoryAggregates};
use ddb_aggregator::state::memory::MemoryLeases;
use ddb_aggregator::state::{now_ms, simulate_clock, Checkpoint, LeaseStore};
use ddb_aggregator::stream::sim::SimStream;
use ddb_aggregator::telemetry::Health;
use ddb_aggregator::worker::{Polling, Shared, Worker};
use faults::{Copies, Fate, Faults, Leases, Sink, Source};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const HOUR: u64 = 3_600_000;
const DAY: u64 = 24 * HOUR;
/// 2027-01-01T00:00:00Z: the simulated epoch.
const EPOCH_MS: u64 = 1_798_761_600_000;
/// Customers per partition: enough that every partition sees traffic.
const CUSTOMERS_PER_PARTITION: u32 = 8;
/// A partition takes about 3,000 RCU/s of strongly consistent reads for its 1,000 WCU/s.
const READS_PER_WRITE_LIMIT: f64 = 3.0;
/// The lease duration of the simulated deployments (maintenance every third of it): 10
/// minutes (the most the config allows), so months of stream life cost minutes of CPU (each maintenance round lists the
/// whole lease table and each renewal is a call); still short against a shard's 4 hours.
const LEASE: &str = "600s";
/// The simulated aggregates table's TTL attribute.
pub const TTL_ATTRIBUTE: &str = "expiresAt";
/// Every customer whose number is this modulo 8 has a string in `orders_HELD` on its item
/// (the application wrote it), so the table refuses the write of a record that moves one of
/// its orders to HELD (scenario c): that record goes to the dead letters, and every other
/// contribution of the batch, of both rules on the item, still lands.
const REFUSING: u32 = 3;
/// Orders older than this are deleted from the source table (their REMOVE records stream like
/// any other): a year's reconciles and checks then read a table of bounded size. The default
/// of [`Params::order_lifetime_days`].
pub const ORDER_LIFETIME_DAYS: u64 = 30;
/// Orders placed in the peak-load phase (hundreds of thousands at 200 partitions) are deleted
/// after a day, like a flash sale's carts: otherwise a month of reconciles and checks reads
/// them all, and the peak's orders cost more real time than the rest of the year.
const PEAK_ORDER_LIFETIME_MS: u64 = DAY;
/// A pause lasts this long at least: longer than the lease, so it moves while the replica sleeps.
const PAUSE_MIN_MS: u64 = 700_000;

#[derive(Debug, Clone)]
pub struct Params {
    pub seed: u64,
    pub partitions: usize,
    pub days: u64,
    pub replicas: usize,
    /// Item changes per simulated hour, over the whole table.
    pub writes_per_hour: f64,
    /// Chance of a fault per call.
    pub fault_rate: f64,
    /// The longest wait between polls of an idle shard (simulated seconds).
    pub idle_poll_secs: u64,
    /// Stop the run (drain, last check) once this much real time has passed.
    pub wall_budget: Option<std::time::Duration>,
    /// Simulated hours between deployment A's scheduled reconciles of everything.
    pub reconcile_every_hours: u64,
    /// Print a line per simulated day (real time so far, lease table, source items).
    pub progress: bool,
    /// Runs of empty pages mid-shard (AWS: "it might take multiple calls" to reach records)
    /// injected per partition and simulated hour, and their length in pages (inclusive).
    /// The default, 1 to 2 pages, is shorter than the default `reconcile.tip_evidence` rule
    /// (3 pages over 2s), so reconcile must never judge a shard caught up too early.
    pub empty_runs_per_partition_hour: f64,
    pub empty_run_pages: (u32, u32),
    /// How long after reaching zero a helper item expires (the table's TTL deletes it at the
    /// next retention pass). Shorter than the service's own is a seeded bug.
    pub helper_expiry_ms: u64,
    /// The table has no TTL: the service records each expiry and its sweep deletes the
    /// helpers (every 10 simulated minutes), in place of the simulated TTL.
    pub own_expiry: bool,
    /// WCU a partition key takes per simulated second before the aggregates table throttles
    /// a ledger write (DynamoDB: about 1,000); None: no limit.
    pub partition_limit_wcu: Option<f64>,
    /// A peak-load phase: every partition written this fast for a while, so every shard runs
    /// batches back to back, as in production.
    pub peak: Option<Peak>,
    /// `write_shards` of the daily totals (`SALES#<day>` / `TOTAL`, written from every shard).
    pub daily_shards: Option<u16>,
    /// Orders are deleted this many days after they were placed (those of the peak-load
    /// phase after [`PEAK_ORDER_LIFETIME_MS`]): the source table, and with it the time a
    /// reconcile or a check takes, is about this many days of orders.
    pub order_lifetime_days: u64,
    /// Simulated milliseconds every call of the replicas (stream, leases, aggregates) takes
    /// to answer; 0: calls answer at once.
    pub call_latency_ms: u64,
    /// The replicas' `aggregates.partition_write_rate` (None: the service's default; 0: no
    /// pacing).
    pub partition_write_rate: Option<u32>,
}

/// A peak-load phase: `per_partition_per_s` records a second per partition for `minutes`,
/// from the start of simulated hour `hour`.
#[derive(Debug, Clone, Copy)]
pub struct Peak {
    pub hour: u64,
    pub minutes: u64,
    pub per_partition_per_s: f64,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            seed: 1,
            partitions: 8,
            days: 14,
            replicas: 3,
            writes_per_hour: 400.0,
            fault_rate: 0.01,
            idle_poll_secs: 900,
            wall_budget: None,
            reconcile_every_hours: 24,
            progress: false,
            empty_runs_per_partition_hour: 1.0,
            empty_run_pages: (1, 2),
            helper_expiry_ms: ddb_aggregator::sink::expiry::EXPIRE_AFTER_MS,
            own_expiry: false,
            partition_limit_wcu: Some(1000.0),
            peak: None,
            daily_shards: None,
            order_lifetime_days: ORDER_LIFETIME_DAYS,
            call_latency_ms: 0,
            partition_write_rate: None,
        }
    }
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub partitions: usize,
    /// [`Params::order_lifetime_days`].
    pub order_days: u64,
    /// [`Params::call_latency_ms`].
    pub call_latency_ms: u64,
    pub days: u64,
    pub partition_limit: Option<f64>,
    pub shards: u64,
    pub splits: u64,
    pub records: u64,
    /// Runs of empty pages injected mid-shard, and their pages.
    pub empty_runs: u64,
    pub empty_run_pages: u64,
    pub poison: u64,
    pub faults: u64,
    pub calls: u64,
    pub crashes: u64,
    pub pauses: u64,
    pub restarts: u64,
    pub outages: u64,
    pub checks: u64,
    pub values_compared: u64,
    pub values_wrong: u64,
    /// Profile changes (the copy rule's sources), and the orders' copies compared at the
    /// checks: wrong, and not judged (the profile's last change in a loss window).
    pub profile_changes: u64,
    pub copies_compared: u64,
    /// Copy fan-out jobs recorded (changes with more copies than the batch writes).
    pub copy_jobs: u64,
    pub copies_wrong: u64,
    pub copies_unjudged: u64,
    /// Sharded runs: the folded daily totals compared at the quiescent checks, and those that
    /// differed from the truth.
    pub totals_compared: u64,
    pub totals_stale: u64,
    pub daily_shards: Option<u16>,
    pub largest_item: usize,
    pub largest_item_entries: usize,
    /// Simulated hours since the start when the largest item was written.
    pub largest_item_hour: u64,
    /// The largest item in the first 8 simulated hours: the stream's first shards share one
    /// creation time, so the floor cannot pass them until the last of them is done, and their
    /// entries stay until then (the rest of the run is measured apart).
    pub largest_item_first_hours: usize,
    pub most_entries: usize,
    /// Hourly largest items after the first 8 hours, outside the outage and the 24 hours
    /// after it: the largest, how many hours, and how many of them over 8 KB.
    pub largest_item_steady: usize,
    pub steady_hours: u64,
    pub steady_hours_over_8k: u64,
    /// The largest item during the outage's catch-up (the 24 hours after it).
    pub largest_item_catch_up: usize,
    /// Why the largest item's entries were there when it was largest.
    pub largest_item_why: String,
    pub largest_item_first_why: String,
    pub hottest_writes: u64,
    pub hottest_wcu: f64,
    /// The most WCU of ledger writes one partition key took in one simulated second, by phase
    /// (the first 8 hours, steady state, the outage's catch-up), with the key; and the hours
    /// in which some partition went over DynamoDB's 1,000 WCU/s (the fakes do not throttle).
    pub partition_peak_first_hours: (f64, String),
    pub partition_peak_steady: (f64, String),
    pub partition_peak_catch_up: (f64, String),
    pub hours_over_partition_limit: u64,
    /// Ledger writes the partition limit throttled (each retried), by phase as above, and in
    /// the hour of the peak-load phase.
    pub throttled_first_hours: u64,
    pub throttled_steady: u64,
    pub throttled_catch_up: u64,
    pub throttled_peak: u64,
    /// Strongly consistent reads of one item (folds of sharded totals, reconcile's reads of
    /// one target) throttled over a partition's read limit, and the most RCU one partition
    /// key took in one second, with the key.
    pub reads_throttled: u64,
    pub read_peak: (f64, String),
    /// The daily totals' partitions (`SALES#...`, written from every shard): their most WCU in
    /// one second, by phase (first 8 hours, steady, the peak-load hour, the outage's catch-up).
    pub daily_total_peak: [f64; 4],
    /// The hour of the peak-load phase: its records, its hottest partition in one second and
    /// its largest item; how long after the phase ended every shard had applied its records.
    pub peak_records: u64,
    pub partition_peak_peak: (f64, String),
    pub largest_item_peak: usize,
    pub peak_drained_s: Option<u64>,
    /// How long after the outage's end (every replica back) every shard had caught up.
    pub outage_caught_up_s: Option<u64>,
    pub lease_table_max: usize,
    pub leases_deleted: u64,
    pub longest_unowned_s: u64,
    pub children_started: u64,
    pub shards_lost: u64,
    pub reconcile_requests: u64,
    pub repairs: u64,
    /// Start-ups in which a reader started at LATEST may have skipped records, flagged by a
    /// reconcile request ([`World::start_up`]).
    pub start_up_skips_flagged: u64,
    /// Reconcile rounds run among the faults, and what they corrected.
    pub reconcile_rounds: u64,
    pub reconcile_corrected: u64,
    pub reconcile_failed: u64,
    /// Why rounds gave up: the first reason of each kind (its text before any shard id), with
    /// the day and how many rounds gave up for it.
    pub reconcile_failures: Vec<(String, u64)>,
    pub deployment_b_values: u64,
    pub letters: u64,
    /// Letters the queue refused whole and took in a cut form (scenario g).
    pub letters_cut: u64,
    /// Orders deleted for their age.
    pub archived: u64,
    /// Streams followed after the table's stream was disabled and enabled again (scenario i),
    /// and the changes made while it was off (never streamed).
    pub streams_followed: u64,
    pub unstreamed: u64,
    /// Shards of the old stream whose checkpoint moved after the new stream appeared: a
    /// paused replica read them late (the fence keeps that from counting twice).
    pub old_stream_read_late: u64,
    /// Helper items the simulated TTL deleted, and those left at the end: live (a count
    /// above zero) and at zero (expiring), with the most on one target.
    pub helpers_expired: u64,
    pub helpers_live: u64,
    pub helpers_zero: u64,
    pub helpers_most_on_a_target: u64,
    /// With the service's own delete: helpers kept by the sweep (written since their expiry
    /// was recorded), and expiries still pending at the end.
    pub expiries_kept: u64,
    pub expiries_pending: u64,
    /// Records the table refused (scenario c), and their dead letters.
    pub refused: u64,
    pub refused_letters: u64,
    pub wall_s: f64,
    pub problems: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation seed {}: {} partitions, {} simulated days in {:.1} s", self.seed, self.partitions, self.days, self.wall_s)?;
        if self.call_latency_ms > 0 {
            writeln!(f, "  every replica call answers {} simulated ms after it took effect", self.call_latency_ms)?;
        }
        writeln!(
            f,
            "  shards {} (splits {}), records {} ({} poison, {} orders archived: at {} days, the peak's at 1), dead letters {}",
            self.shards, self.splits, self.records, self.poison, self.archived, self.order_days, self.letters
        )?;
        writeln!(f, "  runs of empty pages mid-shard {} ({} pages)", self.empty_runs, self.empty_run_pages)?;
        if self.start_up_skips_flagged > 0 {
            writeln!(f, "  a reconcile was requested during the start-up (a reader started at LATEST may have skipped records): letters of records before it not required")?;
        }
        writeln!(
            f,
            "  faults {} of {} calls, crashes {}, pauses {}, rolling restarts {}, outages {}",
            self.faults, self.calls, self.crashes, self.pauses, self.restarts, self.outages
        )?;
        writeln!(f, "  quiescent checks {}: {} values compared, {} wrong", self.checks, self.values_compared, self.values_wrong)?;
        writeln!(
            f,
            "  copies: {} profile changes, {} fan-out jobs; {} order copies compared at the checks, {} wrong ({} not judged: the profile's last change was in a loss window)",
            self.profile_changes, self.copy_jobs, self.copies_compared, self.copies_wrong, self.copies_unjudged
        )?;
        if let Some(n) = self.daily_shards {
            writeln!(f, "  daily totals over {n} sub-items: {} folded totals compared, {} stale", self.totals_compared, self.totals_stale)?;
        }
        writeln!(
            f,
            "  helper items: {} expired and deleted; at the end {} live, {} at zero (expiring), at most {} on one target",
            self.helpers_expired, self.helpers_live, self.helpers_zero, self.helpers_most_on_a_target
        )?;
        if self.expiries_kept + self.expiries_pending > 0 {
            writeln!(
                f,
                "  deleted by the service's own sweep (no TTL): {} kept as written since, {} expiries pending at the end",
                self.expiries_kept, self.expiries_pending
            )?;
        }
        writeln!(
            f,
            "  largest target item {} bytes ({} ledger entries, hour {}), most ledger entries on one item at the end {}",
            self.largest_item, self.largest_item_entries, self.largest_item_hour, self.most_entries
        )?;
        writeln!(
            f,
            "  (largest item in the first 8 hours, the stream's first shards all created at once: {} bytes)",
            self.largest_item_first_hours
        )?;
        writeln!(
            f,
            "  (largest item after the first 8 hours outside the outage's catch-up: {} bytes, over 8 KB in {} of {} hours; in the catch-up: {} bytes)",
            self.largest_item_steady, self.steady_hours_over_8k, self.steady_hours, self.largest_item_catch_up
        )?;
        writeln!(f, "  hottest target: {} writes at {:.2} WCU per write", self.hottest_writes, self.hottest_wcu)?;
        let peak = |p: &(f64, String)| format!("{:.0} WCU/s ({})", p.0, p.1);
        writeln!(
            f,
            "  hottest partition in one second: first 8 hours {}, steady {}, catch-up {}; hours over 1,000 WCU/s: {}",
            peak(&self.partition_peak_first_hours),
            peak(&self.partition_peak_steady),
            peak(&self.partition_peak_catch_up),
            self.hours_over_partition_limit
        )?;
        writeln!(
            f,
            "  ledger writes throttled over a partition's limit ({}): first 8 hours {}, steady {}, catch-up {}, peak-load hour {}",
            self.partition_limit.map_or("no limit".to_string(), |l| format!("{l:.0} WCU/s")),
            self.throttled_first_hours,
            self.throttled_steady,
            self.throttled_catch_up,
            self.throttled_peak
        )?;
        writeln!(
            f,
            "  strongly consistent reads of one item (folds, reconcile) ({}): {} throttled; the hottest partition {:.0} RCU/s ({})",
            self.partition_limit.map_or("no limit".to_string(), |l| format!("{:.0} RCU/s", l * READS_PER_WRITE_LIMIT)),
            self.reads_throttled,
            self.read_peak.0,
            self.read_peak.1
        )?;
        writeln!(
            f,
            "  the daily totals' partition in one second: first 8 hours {:.0} WCU/s, steady {:.0}, peak-load hour {:.0}, catch-up {:.0}",
            self.daily_total_peak[0], self.daily_total_peak[1], self.daily_total_peak[2], self.daily_total_peak[3]
        )?;
        if self.peak_records > 0 {
            writeln!(
                f,
                "  peak-load phase: {} records; its hour's hottest partition {}, largest item {} bytes; every shard caught up {} after it ended",
                self.peak_records,
                peak(&self.partition_peak_peak),
                self.largest_item_peak,
                self.peak_drained_s.map_or("never (before the end)".to_string(), |s| format!("{s} s"))
            )?;
        }
        if self.outages > 0 {
            let caught_up = self.outage_caught_up_s.map_or("never (before the end)".to_string(), |s| format!("{s} s"));
            writeln!(f, "  the outage's catch-up: every shard caught up {caught_up} after every replica was back")?;
        }
        writeln!(
            f,
            "  lease table at most {} leases, {} finished leases deleted; longest unowned shard {} s",
            self.lease_table_max, self.leases_deleted, self.longest_unowned_s
        )?;
        writeln!(
            f,
            "  scenarios: a children started {}, b shards lost {}, j reconcile requests {} (repaired {}), d second deployment values {}, e/f most entries {}, g letters refused and sent cut {}, h leases deleted {}, c records the table refused {} (dead-lettered {}), i streams followed {} ({} changes never streamed, {} old-stream shards read after the switch)",
            self.children_started,
            self.shards_lost,
            self.reconcile_requests,
            self.repairs,
            self.deployment_b_values,
            self.most_entries,
            self.letters_cut,
            self.leases_deleted,
            self.refused,
            self.refused_letters,
            self.streams_followed,
            self.unstreamed,
            self.old_stream_read_late
        )?;
        writeln!(
            f,
            "  reconcile: {} rounds among the faults ({} attributes corrected, {} rounds gave up)",
            self.reconcile_rounds, self.reconcile_corrected, self.reconcile_failed
        )?;
        if !self.largest_item_why.is_empty() {
            writeln!(f, "  the largest item's entries: {}", self.largest_item_why)?;
        }
        if !self.largest_item_first_why.is_empty() {
            writeln!(f, "  in the first 8 hours: {}", self.largest_item_first_why)?;
        }
        for (why, n) in &self.reconcile_failures {
            writeln!(f, "    {n} gave up, the first: {}", why.chars().take(300).collect::<String>())?;
        }
        if self.problems.is_empty() {
            write!(f, "  sound: every aggregate exact at every quiescent point")
        } else {
            write!(f, "  PROBLEMS ({}):\n    {}", self.problems.len(), self.problems.join("\n    "))
        }
    }
}

impl Report {
    pub fn assert_sound(&self) {
        assert!(self.problems.is_empty(), "seed {} replays this run: SIM_SEED={}\n{self}", self.seed, self.seed);
        assert!(self.checks > 0 && self.values_compared > 0, "the oracle compared nothing:\n{self}");
        assert_eq!(self.copies_wrong, 0, "{self}");
        assert!(self.profile_changes == 0 || self.copies_compared > 0, "the copy oracle compared nothing:\n{self}");
        assert!(self.profile_changes < 100 || self.copy_jobs > 0, "no fan-out ran as a job:\n{self}");
    }
}

/// Runs one seeded simulation to its end.
pub fn run(p: &Params) -> Report {
    // SIM_LOG=<filter> prints the replicas' log lines (e.g. `ddb_aggregator::worker::jobs=info`);
    // SIM_TRACE_THROTTLES=1 prints who wrote a partition key in the second one of its writes was
    // throttled (World.trace).
    if let Ok(filter) = std::env::var("SIM_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(filter)).with_test_writer().try_init();
    }
    let started = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
    fastrand::seed(p.seed);
    let mut report = rt.block_on(async {
        simulate_clock(Some(EPOCH_MS));
        let mut world = World::new(p.clone());
        world.run().await;
        simulate_clock(None);
        world.report
    });
    report.wall_s = started.elapsed().as_secs_f64();
    report
}

fn config(state: &str, rules: &str) -> Config {
    let text = format!(
        r#"
source: {{ table: sim-source, start_position: latest, batch_size: 200, read_ahead: true }}
state: {{ table: {state}, lease_duration: {LEASE} }}
aggregates: {{ table: sim-aggregates }}
dead_letter: {{ queue_url: "http://127.0.0.1:1/sim-dlq", max_attempts: 1 }}
reconcile: {{ interval: 0s, wait: 30m }}
rules:
{rules}"#
    );
    Config::from_yaml(&text, Vec::<(String, String)>::new()).expect("simulation config")
}

const ORDERS: &str = r#"{ dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }"#;

fn config_a(daily_shards: Option<u16>) -> Config {
    let shards = daily_shards.map_or(String::new(), |n| format!(", write_shards: {n}"));
    config(
        "sim-state-a",
        &format!(
            r#"  - name: customer-orders
    filter: {ORDERS}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PROFILE" }}
    measures:
      orderCount: count
      revenue: {{ sum: total }}
      "orders_{{status}}": count
      largestOrder: {{ max: total }}
      activeDays: {{ distinct: "{{date|day}}" }}
      oldestPending: {{ min: createdAt, where: {{ status: {{ S: [PENDING] }} }} }}
      lastTotal: {{ latest: total, by: updatedAt }}
    reconcile: {{ scan: true }}
  - name: customer-spend
    filter: {ORDERS}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PROFILE" }}
    measures: {{ spend: {{ sum: total }} }}
    reconcile: {{ scan: true }}
  - name: daily-sales
    filter: {ORDERS}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "SALES#{{date|day}}", SK: "TOTAL"{shards} }}
    measures: {{ orders: count, revenue: {{ sum: total }} }}
    reconcile: {{ scan: true }}
  - name: {COPY_RULE}
    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [PROFILE] }} }} }} }}
    source_key: {{ PK: "CUST#{{customer}}", SK: PROFILE }}
    copy:
      attributes: {{ customerName: name }}
      to: {{ PK: "CUST#{{customer}}", SK_begins_with: "ORDER#" }}
      inline_items: {COPY_INLINE}
"#
        ),
    )
}

/// Deployment A's copy rule: each customer's name on their orders.
const COPY_RULE: &str = "customer-name-on-orders";
/// Copies a change writes in its batch: a customer's orders of the last days pass it often, so
/// the rest of their fan-out runs as a job (through crashes, pauses and faults).
const COPY_INLINE: usize = 3;

/// The share of item changes that change a customer's profile (its name, or a delete).
const PROFILE_SHARE: f64 = 0.03;

/// A customer's profile as the application last wrote it: its name (None: deleted), and when.
#[derive(Debug, Clone)]
struct Profile {
    name: Option<String>,
    changed_at: u64,
}

/// A second deployment (its own state table, so its own ledger namespace) that writes the same
/// customer items as the first. (Not the daily totals: the largest item, a daily total written
/// from every shard, then shows one deployment's ledger, which is what the 8 KB aim is about;
/// two deployments on one global total hold twice the entries.)
fn config_b() -> Config {
    config(
        "sim-state-b",
        &format!(
            r#"  - name: customer-orders-b
    filter: {ORDERS}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PROFILE" }}
    measures: {{ ordersB: count }}
    reconcile: {{ scan: true }}
"#
        ),
    )
}

/// An order in the source table.
#[derive(Debug, Clone)]
struct Order {
    status: &'static str,
    /// Cents; None: a poison order (its total is a string).
    cents: Option<i64>,
    /// Simulated epoch ms of the last change the application made (`updatedAt`).
    updated: u64,
}

/// A shard that takes new records for a range of the key space.
#[derive(Debug, Clone)]
struct Leaf {
    lo: u32,
    hi: u32,
    shard: String,
    rollover_at: u64,
}

struct Replica {
    fate: Arc<Fate>,
    cancel: CancellationToken,
    /// Stops the fold loop (on a crash as on a stop).
    folds: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

/// Scheduled events of the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Restart(usize),
    /// The replica's stream watcher sees the new stream: it stops and starts again on it.
    Switch(usize),
}

/// A backlog being timed: from `since`, until deployment A's checkpoints passed the last
/// sequence number each open shard had then (a shard's end passes every one).
struct Backlog {
    since: u64,
    /// Taken at `since`; a shard leaves once passed (seen every step, so before its finished
    /// lease can be deleted).
    marks: Option<BTreeMap<String, u64>>,
}

impl Backlog {
    fn from(since: u64) -> Backlog {
        Backlog { since, marks: None }
    }

    /// How long since `since` if every mark is now passed.
    fn applied(&mut self, now: u64, lasts: &BTreeMap<String, u64>, checkpoints: &BTreeMap<String, Option<Checkpoint>>) -> Option<u64> {
        if now < self.since {
            return None;
        }
        let marks = self.marks.get_or_insert_with(|| lasts.clone());
        marks.retain(|shard, last| match checkpoints.get(shard) {
            Some(Some(Checkpoint::ShardEnd)) => false,
            Some(Some(Checkpoint::Sequence(s))) => s.parse::<u64>().map_or(true, |s| s < *last),
            _ => true,
        });
        marks.is_empty().then(|| now - self.since)
    }
}

struct World {
    p: Params,
    rng: fastrand::Rng,
    stream: Arc<SimStream>,
    aggregates: Arc<MemoryAggregates>,
    leases_a: Arc<MemoryLeases>,
    leases_b: Arc<MemoryLeases>,
    dlq: Arc<MemoryDeadLetters>,
    faults: Arc<Faults>,
    /// Slot i: replica i of deployment A; the last slot: deployment B's one replica.
    replicas: Vec<Option<Replica>>,
    generation: u64,
    items: BTreeMap<(u32, String, u64), Order>,
    next_order: u64,
    /// Orders in the order they were placed, with the time: the oldest are archived (deleted
    /// from the source table, as a retention job or a TTL would), so the table stays the size
    /// of [`Params::order_lifetime_days`] of orders however long the run.
    placed: std::collections::VecDeque<(u64, (u32, String, u64))>,
    /// Orders placed in the peak-load phase, archived after [`PEAK_ORDER_LIFETIME_MS`].
    placed_in_peak: std::collections::VecDeque<(u64, (u32, String, u64))>,
    /// The peak-load phase is writing.
    peaking: bool,
    /// Customers' profiles, as the application last wrote them (the copy rule's sources).
    profiles: BTreeMap<u32, Profile>,
    next_name: u64,
    leaves: Vec<Leaf>,
    events: Vec<(u64, Event)>,
    /// Poison records' sequence numbers, with their append time.
    poison: Vec<(u64, u64)>,
    /// Records the table refuses (an order moved to HELD), with their append time.
    refused: Vec<(u64, u64)>,
    /// Orders moved to HELD: they never change again (each change would be refused too).
    held: std::collections::BTreeSet<(u32, String, u64)>,
    /// Per status count of a refusing customer: how many refused (or never streamed) moves to
    /// HELD away from that status reconcile may not have corrected yet. The stored count is
    /// then above the truth by at most this; once it equals the truth, reconcile has.
    held_from: BTreeMap<(Vec<String>, String), u64>,
    /// Every status count a HELD move ever left from: reconcile's corrections of these are
    /// repairs.
    held_ever: std::collections::BTreeSet<(Vec<String>, String)>,
    /// Records appended within these windows may be lost (an outage, a stream switch, a
    /// start-up that flagged a skip): their letters are not required.
    loss_windows: Vec<(u64, u64)>,
    /// A reconcile was requested during the start-up ([`World::start_up`]).
    start_up_flagged: bool,
    /// The source table's stream is disabled (scenario i): changes are not streamed.
    disabled: bool,
    disabled_at: u64,
    /// The stream's ARN (a new one each time it is enabled again).
    stream_arn: String,
    /// Lease tables of streams no longer followed (their figures still count).
    retired_leases: Vec<Arc<MemoryLeases>>,
    /// The largest item size explained so far.
    explained: usize,
    /// The source table as reconcile reads it (the same items as `items`).
    sources: Arc<MemorySources>,
    /// Each deployment's reconcile round running among the replicas (A's scheduled or
    /// requested, B's requested), with whether data loss was flagged (a reconcile request in
    /// the state table) before or after it: its corrections are repairs then. When A's next
    /// scheduled round starts.
    rounds: [Option<tokio::task::JoinHandle<(bool, RoundResult)>>; 2],
    /// Per deployment, a requested repair whose full run left targets not quiet: when it
    /// started, and those targets (retried alone, as the service's schedule does).
    partial: [Option<(ddb_aggregator::reconcile::schedule::Partial, reconcile::Retry)>; 2],
    next_round: u64,
    /// When each deployment may run a requested repair again (after one that gave up).
    requested_not_before: [u64; 2],
    /// When each deployment's running round started.
    round_started: [u64; 2],
    /// Whether each deployment's running round covers everything.
    round_full: [bool; 2],
    /// The old stream's checkpoints when the new stream appeared (scenario i).
    old_stream_at_switch: BTreeMap<(usize, String), Option<ddb_aggregator::state::Checkpoint>>,
    /// Backlogs being timed (the outage's, from its end; the peak-load phase's, from its end)
    /// until deployment A applied every record appended before.
    outage_back: Option<Backlog>,
    peak_ended: Option<Backlog>,
    /// Who wrote each partition key in each second, printed at each throttle
    /// (`SIM_TRACE_THROTTLES=1`).
    trace: Option<Arc<std::sync::Mutex<faults::TraceLog>>>,
    report: Report,
}

impl World {
    fn new(p: Params) -> World {
        let partitions = p.partitions;
        let partition_limit = p.partition_limit_wcu;
        let first_round = p.reconcile_every_hours * HOUR;
        let stream = Arc::new(SimStream::new());
        stream.quiet();
        // 20-digit sequence numbers (the most a u64 holds; AWS's are 21 to 28), so the
        // ledger's entries are about the size they are in production.
        stream.start_sequences_at(10_000_000_000_000_000_000);
        let now = now_ms();
        let span = u32::MAX / p.partitions as u32;
        let mut rng = fastrand::Rng::with_seed(p.seed);
        let leaves = (0..p.partitions)
            .map(|i| {
                let lo = span * i as u32;
                let hi = if i + 1 == p.partitions { u32::MAX } else { lo + span };
                Leaf { lo, hi, shard: stream.add_shard_at(None, now), rollover_at: now + rng.u64(HOUR..4 * HOUR) }
            })
            .collect();
        let report = Report {
            seed: p.seed,
            partitions: p.partitions,
            order_days: p.order_lifetime_days,
            call_latency_ms: p.call_latency_ms,
            days: p.days,
            partition_limit: p.partition_limit_wcu,
            daily_shards: p.daily_shards,
            shards: p.partitions as u64,
            ..Report::default()
        };
        World {
            faults: {
                let faults = Faults::new(p.seed ^ 0x5eed, p.fault_rate);
                faults.set_latency_ms(p.call_latency_ms);
                Arc::new(faults)
            },
            replicas: (0..=p.replicas).map(|_| None).collect(),
            p,
            rng,
            stream,
            aggregates: {
                let aggregates = MemoryAggregates::new();
                for c in (0..CUSTOMERS_PER_PARTITION * partitions as u32).filter(|c| c % 8 == REFUSING) {
                    aggregates.put(&[&format!("CUST#c{c}"), "PROFILE"], "orders_HELD", MemValue::Str("held: see the order's notes".into()));
                }
                aggregates.set_partition_limit(partition_limit);
                aggregates.set_read_limit(partition_limit.map(|l| l * READS_PER_WRITE_LIMIT));
                Arc::new(aggregates)
            },
            leases_a: Arc::new(MemoryLeases::new()),
            leases_b: Arc::new(MemoryLeases::new()),
            dlq: {
                let dlq = MemoryDeadLetters::default();
                dlq.refuse_containing(SQS_REFUSES);
                // The checks read each letter's sequence number and form, not its payload.
                dlq.keep_lean();
                Arc::new(dlq)
            },
            generation: 0,
            items: BTreeMap::new(),
            next_order: 0,
            placed: std::collections::VecDeque::new(),
            placed_in_peak: std::collections::VecDeque::new(),
            peaking: false,
            profiles: BTreeMap::new(),
            next_name: 0,
            leaves,
            events: Vec::new(),
            poison: Vec::new(),
            refused: Vec::new(),
            held: std::collections::BTreeSet::new(),
            held_from: BTreeMap::new(),
            held_ever: std::collections::BTreeSet::new(),
            loss_windows: Vec::new(),
            start_up_flagged: false,
            disabled: false,
            disabled_at: 0,
            stream_arn: "arn:sim:stream/1".into(),
            retired_leases: Vec::new(),
            explained: 0,
            sources: Arc::new(MemorySources::new(vec!["PK".into(), "SK".into()])),
            rounds: [None, None],
            partial: [None, None],
            next_round: now + first_round,
            requested_not_before: [0, 0],
            round_started: [0, 0],
            round_full: [false, false],
            old_stream_at_switch: Default::default(),
            outage_back: None,
            peak_ended: None,
            trace: std::env::var_os("SIM_TRACE_THROTTLES").map(|_| Default::default()),
            report,
        }
    }

    fn start(&mut self, slot: usize) {
        self.generation += 1;
        let b = slot == self.p.replicas;
        let fate = Arc::new(Fate::default());
        let mut config = if b { config_b() } else { config_a(self.p.daily_shards) };
        if let Some(rate) = self.p.partition_write_rate {
            config.partition_write_rate = rate;
        }
        let fold_interval = config.fold_interval;
        let namespace = config.ledger_namespace.clone();
        // What `run_stream` does on a stream that follows another (service.rs).
        let follows = self.report.streams_followed > 0;
        config.source.start_position = ddb_aggregator::service::start_of(config.source.start_position, follows);
        let leases = if b { self.leases_b.clone() } else { self.leases_a.clone() };
        let shared = Shared::new(
            config,
            Source { inner: self.stream.clone(), fate: fate.clone(), faults: self.faults.clone() },
            Leases { inner: leases, fate: fate.clone(), faults: self.faults.clone() },
            Arc::new(Sink {
                inner: self.aggregates.clone(),
                fate: fate.clone(),
                faults: self.faults.clone(),
                trace: self.trace.as_ref().map(|log| faults::WriteTrace {
                    who: format!("{}replica-{slot}-{}", if b { "B " } else { "" }, self.generation).into(),
                    log: log.clone(),
                }),
            }),
            format!("replica-{slot}-{}", self.generation),
            Arc::new(Health::default()),
        )
        .with_dead_letters(DeadLetters::Memory(self.dlq.clone()), self.stream_arn.clone())
        .with_expiry(Some(Expiry { after_ms: self.p.helper_expiry_ms, own: self.p.own_expiry, ..Expiry::new(TTL_ATTRIBUTE) }));
        // The copy rule writes the source table, under the replica's fate like its other calls.
        let shared = if b {
            shared
        } else {
            shared.with_copies(Arc::new(Copies { inner: self.sources.clone(), fate: fate.clone(), faults: self.faults.clone() }))
        };
        let mut shared = shared;
        // Idle shards are polled every few minutes: months of stream life in minutes of CPU.
        shared.polling = Polling { idle_min: Duration::from_secs(60), idle_max: Duration::from_secs(self.p.idle_poll_secs) };
        let worker = Worker::new(shared);
        let cancel = CancellationToken::new();
        // The fold loop of a sharded rule's totals: it ends with the process (a crash too).
        let folds = CancellationToken::new();
        if !b && self.p.daily_shards.is_some() {
            let targets = Arc::new(reconcile::SimTargets::new(self.aggregates.clone(), &namespace));
            tokio::spawn(ddb_aggregator::worker::fold::run_folds(worker.shared().clone(), targets, fold_interval, folds.clone()));
        }
        let c = cancel.clone();
        let handle = tokio::spawn(async move {
            let _ = worker.run(c).await;
        });
        self.replicas[slot] = Some(Replica { fate, cancel, folds, handle });
    }

    async fn run(&mut self) {
        for slot in 0..=self.p.replicas {
            self.start(slot);
        }
        // Every root shard read by both deployments before the first write (`latest` starts
        // there, at the tip), bounded.
        let roots: Vec<String> = self.leaves.iter().map(|l| l.shard.clone()).collect();
        for _ in 0..120 {
            if self.roots_owned(&roots) {
                break;
            }
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        let start = now_ms();
        let end = start + self.p.days * DAY;
        let mut roots_done = false;
        let mut started_up = false;
        let step = Duration::from_secs(60);
        let mut next_check = start + DAY;
        let mut draining_since: Option<u64> = None;
        let mut next_retention = start;
        let mut next_hour = start + HOUR;
        // One outage longer than the retention, a third of the way in (by day 4 at the latest,
        // so a run cut short by its time budget still has one).
        let outage_at = (self.p.days >= 4).then(|| start + (self.p.days * DAY / 3).min(4 * DAY) + self.rng.u64(0..HOUR * 6));
        // The table's stream disabled and enabled again, two thirds of the way in (by day 8
        // at the latest), off for 1 to 3 minutes (scenario i): the old stream still holds
        // records nobody read when the new one appears.
        let disable_at = (self.p.days >= 6).then(|| start + (self.p.days * DAY * 2 / 3).min(8 * DAY) + self.rng.u64(0..HOUR * 6));
        let mut enable_at: Option<u64> = None;
        // The peak-load phase: from hour 30, or half way through a shorter run, at the first
        // step not draining for a check (it defers the next check until it is over).
        let peak_at = self.p.peak.map(|p| (start + p.hour.min(self.p.days * 24 / 2).max(1) * HOUR, p.minutes * 60_000));
        let mut peak_started: Option<u64> = None;
        let long_peak = peak_at.map_or(0, |p| p.1);
        let mut filed = start;
        let wall = std::time::Instant::now();
        let mut next_progress = start + DAY;
        while now_ms() < end && self.p.wall_budget.is_none_or(|b| wall.elapsed() < b) {
            let now = now_ms();
            if self.p.progress && now >= next_progress {
                next_progress += DAY;
                // With the figures so far, so a long run that is stopped still says how it went.
                eprintln!(
                    "  day {}: {:.0} s, {} leases, {} tasks, {} source items; {} checks, {} values compared, {} wrong, {} problems; largest item since hour 8 {} B",
                    (now - start) / DAY,
                    wall.elapsed().as_secs_f64(),
                    self.leases_a.snapshot().len(),
                    // A crashed replica's tasks end at their next call: this stays bounded.
                    tokio::runtime::Handle::current().metrics().num_alive_tasks(),
                    self.items.len(),
                    self.report.checks,
                    self.report.values_compared,
                    self.report.values_wrong,
                    self.report.problems.len(),
                    self.aggregates.largest_item()
                );
            }
            self.due_events(now);
            // `latest` starts a root shard at its tip: a replica that dies before its first
            // checkpoint there skips what came in between (as Lambda and the KCL do). The
            // disturbances start once every root shard is read to its end (children always
            // start at TRIM_HORIZON).
            roots_done = roots_done || self.roots_finished(&roots);
            if now >= start + 8 * HOUR && self.report.largest_item_first_hours == 0 {
                self.report.largest_item_first_hours = self.aggregates.largest_item().max(1);
                self.aggregates.reset_largest();
                self.report.largest_item_first_why = std::mem::take(&mut self.report.largest_item_why);
                self.explained = 0;
            }
            if roots_done {
                self.maybe_disturb(now);
            }
            if outage_at.is_some_and(|t| now >= t && self.report.outages == 0) {
                self.outage(now);
                draining_since = None;
                next_check = now + 28 * HOUR;
            }
            if disable_at.is_some_and(|t| now >= t) && !self.disabled && self.report.streams_followed == 0 {
                self.disable_stream(now);
                enable_at = Some(now + self.rng.u64(60_000..3 * 60_000));
            }
            if enable_at.is_some_and(|t| now >= t) {
                enable_at = None;
                self.enable_stream(now).await;
                // A check soon after (before the next scheduled reconcile could hide a record
                // counted twice by a reader left on the old stream).
                next_check = next_check.min(now + 2 * HOUR);
            }
            if !started_up {
                started_up = self.start_up(start, now, &roots).await;
            }
            self.rollovers(now);
            self.time_backlogs(now);
            self.empty_runs(step);
            self.reconcile_rounds(now);
            self.explain_largest(now);
            if now >= next_hour {
                next_hour = now + HOUR;
                let catching_up = outage_at.is_some_and(|t| (t..t + 50 * HOUR).contains(&now));
                // Since the last filing (an hour, or longer after a check that took a while),
                // some of the peak-load phase: from its start until every shard applied it.
                let peak =
                    peak_started.is_some_and(|t| now > t && self.report.peak_drained_s.is_none_or(|d| filed < t + long_peak + d * 1000));
                filed = now;
                self.hourly_figures(now >= start + 8 * HOUR, catching_up, peak);
            }
            if now >= next_retention {
                self.retention(now);
                self.expire_helpers(now).await;
                next_retention = now + 10 * 60_000;
            }
            let peaking = match (self.p.peak, peak_at, peak_started) {
                (Some(_), Some((at, _)), None) => draining_since.is_none() && now >= at,
                (Some(_), Some((_, long)), Some(t)) => now < t + long,
                _ => false,
            };
            match draining_since {
                None if peaking => {
                    let t = *peak_started.get_or_insert(now);
                    let step_ms = step.as_millis() as u64;
                    if now + step_ms >= t + long_peak {
                        self.peak_ended = Some(Backlog::from(now + step_ms));
                    }
                    // The step's records a second at a time, as they would come (the step's
                    // wait is these seconds).
                    self.peak_step(step, self.p.peak.map_or(0.0, |p| p.per_partition_per_s)).await;
                    continue;
                }
                None if now >= next_check => draining_since = Some(now),
                None => self.writes(step),
                Some(since) => {
                    if self.caught_up() {
                        self.check().await;
                        draining_since = None;
                        next_check = now + DAY;
                    } else if now - since > 12 * HOUR {
                        let why = self.not_caught_up();
                        self.report.problems.push(format!("day {}: not caught up 12 h after writes stopped ({why})", (now - start) / DAY));
                        draining_since = None;
                        next_check = now + DAY;
                    }
                }
            }
            tokio::time::sleep(step).await;
        }
        // The end: no more faults, every replica alive, drain, and the last check.
        self.report.days = (now_ms() - start) / DAY;
        self.faults_off();
        for (slot, r) in self.replicas.iter().enumerate() {
            if r.as_ref().is_none_or(|r| r.fate.dead.load(Ordering::Relaxed)) {
                self.events.push((0, Event::Restart(slot)));
            }
        }
        self.due_events(now_ms());
        for _ in 0..(12 * 60) {
            if self.caught_up() {
                break;
            }
            self.rollovers(now_ms());
            tokio::time::sleep(step).await;
        }
        if self.caught_up() {
            self.check().await;
        } else {
            let why = self.not_caught_up();
            self.report.problems.push(format!("not caught up 12 h after the end ({why})"));
        }
        self.finish().await;
    }

    /// The end of the run: no more faults or pauses, so the last drain is bounded.
    fn faults_off(&self) {
        self.faults.set_rate(0.0);
        for r in self.replicas.iter().flatten() {
            r.fate.paused_until.store(0, Ordering::Relaxed);
        }
    }

    fn due_events(&mut self, now: u64) {
        let (due, later): (Vec<_>, Vec<_>) = self.events.drain(..).partition(|(t, _)| *t <= now);
        self.events = later;
        for (_, event) in due {
            match event {
                Event::Restart(slot) => self.start(slot),
                Event::Switch(slot) => {
                    if let Some(r) = self.replicas[slot].take() {
                        r.cancel.cancel();
                        r.folds.cancel();
                        self.start(slot);
                    }
                }
            }
        }
    }

    /// The start-up: until every root shard has a checkpoint in both deployments, a reader that
    /// started at LATEST and lost its iterator (an expired one, a trimmed-data answer) gets a
    /// new LATEST one and skips what arrived in between, as Lambda and the KCL do; the service
    /// then requests a reconcile of everything, so it is never silent. A skipped poison record
    /// has no dead letter then (reconcile repairs the values, not the letters): from the start
    /// to the step that first sees the request is a loss window for letters (a record appended
    /// after the request comes after the new iterator). True once every root is checkpointed
    /// (or after 2 hours, bounded).
    async fn start_up(&mut self, start: u64, now: u64, roots: &[String]) -> bool {
        if !self.start_up_flagged {
            for leases in [&self.leases_a, &self.leases_b] {
                self.start_up_flagged |= leases.reconcile_request().await.ok().flatten().is_some();
            }
            if self.start_up_flagged {
                self.report.start_up_skips_flagged += 1;
                self.loss_windows.push((start, now));
            }
        }
        let checkpointed = [&self.leases_a, &self.leases_b].iter().all(|leases| {
            let with: std::collections::BTreeSet<String> =
                leases.snapshot().into_iter().filter(|l| l.checkpoint.is_some()).map(|l| l.shard_id).collect();
            roots.iter().all(|r| with.contains(r))
        });
        checkpointed || now >= start + 2 * HOUR
    }

    /// Runs of empty pages on random open shards, each before the shard's next record: every
    /// reader that reaches that record (both deployments, a stale or a new owner) answers
    /// that many empty pages first.
    fn empty_runs(&mut self, step: Duration) {
        let per_step = self.p.empty_runs_per_partition_hour * self.leaves.len() as f64 * step.as_secs_f64() / 3600.0;
        let (lo, hi) = self.p.empty_run_pages;
        // At most a few runs a step, each drawn apart: a bounded loop.
        if per_step <= 0.0 {
            return; // no draw either: a seed replays a run made without runs
        }
        let mut runs = per_step.floor() as u64 + u64::from(self.rng.f64() < per_step.fract());
        while runs > 0 && hi > 0 {
            runs -= 1;
            let shard = self.leaves[self.rng.usize(..self.leaves.len())].shard.clone();
            if self.stream.empty_run_unpassed(&shard) {
                continue; // two runs back to back would be one longer run
            }
            let pages = self.rng.u32(lo.max(1)..=hi.max(lo.max(1)));
            self.stream.empty_pages_on(&shard, pages);
            self.report.empty_runs += 1;
            self.report.empty_run_pages += u64::from(pages);
        }
    }

    /// Crashes, pauses and rolling restarts, at random.
    fn maybe_disturb(&mut self, now: u64) {
        let slots = self.p.replicas + 1;
        // A crash about every 8 simulated hours; the process comes back within 20 minutes.
        if self.rng.f64() < 1.0 / (8.0 * 60.0) {
            let slot = self.rng.usize(..slots);
            if let Some(r) = self.replicas[slot].take() {
                r.fate.dead.store(true, Ordering::Relaxed);
                r.folds.cancel();
                self.report.crashes += 1;
                self.events.push((now + self.rng.u64(0..20 * 60_000), Event::Restart(slot)));
            }
        }
        // A pause (GC, SIGSTOP) about every 12 hours, long enough for the lease to move.
        if self.rng.f64() < 1.0 / (12.0 * 60.0) {
            if let Some(r) = self.replicas[self.rng.usize(..slots)].as_ref() {
                r.fate.paused_until.store(now + self.rng.u64(PAUSE_MIN_MS..5 * PAUSE_MIN_MS), Ordering::Relaxed);
                self.report.pauses += 1;
            }
        }
        // A rolling restart about every 3 days: each replica drains and comes back.
        if self.rng.f64() < 1.0 / (3.0 * 24.0 * 60.0) {
            self.report.restarts += 1;
            for slot in 0..slots {
                if let Some(r) = self.replicas[slot].take() {
                    r.cancel.cancel();
                    r.folds.cancel();
                    self.events.push((now + 60_000 * (slot as u64 + 1), Event::Restart(slot)));
                }
            }
        }
    }

    /// The source table's stream disabled: every shard closes (no children), and changes are
    /// no longer streamed; the replicas read what is left.
    fn disable_stream(&mut self, now: u64) {
        self.disabled = true;
        self.disabled_at = now;
        for leaf in &self.leaves {
            self.stream.reshard_at(&leaf.shard, 0, now);
        }
        // A replica of A paused from now until after the new stream appears (GC, SIGSTOP),
        // longer than its lease: it wakes on the old stream, often after the requested
        // repair, and while its watcher cannot see the new stream (below) it takes the old
        // stream's expired leases again and applies what they still hold.
        if let Some(r) = self.replicas[0].as_ref() {
            let until = now + self.rng.u64(PAUSE_MIN_MS..2 * PAUSE_MIN_MS);
            r.fate.paused_until.fetch_max(until, Ordering::Relaxed);
            self.report.pauses += 1;
        }
    }

    /// Enabled again: a new stream with a new ARN and new shards. What each deployment's
    /// stream watcher does (service.rs): the real decision sees a new stream; a reconcile of
    /// everything is requested in the state table (before anything else); the worker stops and
    /// starts again on the new stream, whose lease set starts empty.
    async fn enable_stream(&mut self, now: u64) {
        let stream = Arc::new(SimStream::new());
        stream.quiet();
        // Letters are matched by sequence number: the new stream's continue past the old one's.
        stream.start_sequences_at(self.stream.next_sequence());
        for leaf in &mut self.leaves {
            leaf.shard = stream.add_shard_at(None, now);
            leaf.rollover_at = now + self.rng.u64(HOUR..4 * HOUR);
        }
        self.report.shards += self.leaves.len() as u64;
        let old_arn = std::mem::replace(&mut self.stream_arn, format!("arn:sim:stream/{}", self.report.streams_followed + 2));
        match ddb_aggregator::service::stream_change(&old_arn, true, Some(&self.stream_arn)) {
            ddb_aggregator::service::StreamChange::New(_) => {}
            other => self.report.problems.push(format!("a re-enabled stream was not seen as new: {other:?}")),
        }
        let (a, b) = (Arc::new(MemoryLeases::new()), Arc::new(MemoryLeases::new()));
        for leases in [&a, &b] {
            if leases.request_reconcile(now).await.is_err() {
                self.report.problems.push("cannot request the reconcile of a stream's gap".into());
            }
        }
        self.retired_leases.push(std::mem::replace(&mut self.leases_a, a));
        self.retired_leases.push(std::mem::replace(&mut self.leases_b, b));
        self.stream = stream;
        self.disabled = false;
        self.report.streams_followed += 1;
        // Changes made while the stream was off, and those the old stream held that nobody
        // read before the replicas moved on, reach the aggregates only through reconcile.
        self.loss_windows.push((self.disabled_at.saturating_sub(2 * HOUR), now + 2 * HOUR));
        // Each replica's watcher ticks on its own (every 10 to 60 s); a paused one only once
        // it wakes, and until then it reads the old stream. Replica 0's DescribeTable calls
        // fail for 5 to 15 minutes after it wakes.
        for slot in 0..=self.p.replicas {
            if let Some(r) = self.replicas[slot].as_ref() {
                let awake = r.fate.paused_until.load(Ordering::Relaxed).max(now);
                let blind = if slot == 0 { self.rng.u64(5 * 60_000..15 * 60_000) } else { 0 };
                self.events.push((awake + blind + self.rng.u64(10_000..60_000), Event::Switch(slot)));
            }
        }
        self.old_stream_at_switch = self.old_checkpoints();
    }

    /// Checkpoints of the streams no longer followed, by (lease table, shard).
    fn old_checkpoints(&self) -> BTreeMap<(usize, String), Option<ddb_aggregator::state::Checkpoint>> {
        let leases = self.retired_leases.iter().enumerate().flat_map(|(i, l)| l.snapshot().into_iter().map(move |l| (i, l)));
        leases.map(|(i, l)| ((i, l.shard_id), l.checkpoint)).collect()
    }

    /// When the largest item grew: what its ledger entries (deployment A's) were, by the lease
    /// table of the moment (within a simulated minute of the write).
    fn explain_largest(&mut self, now: u64) {
        use ddb_aggregator::sink::ledger::{entry_created_ms, entry_shard, is_any_entry, open_tokens, Ledger};
        let size = self.aggregates.largest_item();
        if size <= self.explained {
            return;
        }
        self.explained = size;
        let item = self.aggregates.largest_item_copy();
        let ledger = Ledger::new(&config_a(None).ledger_namespace);
        let text = |a: &str| match item.get(a) {
            Some(MemValue::Str(t)) => Some(t.clone()),
            _ => None,
        };
        let floor = text(&ledger.floor_attribute()).and_then(|f| f.parse::<u64>().ok());
        let open = text(&ledger.open_attribute()).unwrap_or_default();
        let snapshot = self.leases_a.snapshot();
        let leases: std::collections::HashMap<String, bool> = snapshot.iter().map(|l| (l.shard_id.clone(), l.finished())).collect();
        // Ages (minutes) of the unfinished shards, oldest first; and how many never started.
        let mut ages: Vec<u64> = snapshot
            .iter()
            .filter(|l| !l.finished())
            .filter_map(|l| ddb_aggregator::shard_id::created_ms(&l.shard_id))
            .map(|c| now.saturating_sub(c) / 60_000)
            .collect();
        ages.sort_unstable_by(|a, b| b.cmp(a));
        let unstarted = snapshot.iter().filter(|l| !l.finished() && l.checkpoint.is_none()).count();
        let (mut unfinished, mut after_floor, mut by_time, mut prunable, mut others) = (0, 0, 0, 0, 0);
        for name in item.keys() {
            if !ledger.is_entry(name) {
                others += usize::from(is_any_entry(name));
                continue;
            }
            let shard = entry_shard(name).map(|s| format!("shardId-{s}")).unwrap_or_default();
            let created = entry_created_ms(name).unwrap_or(0);
            if !leases.get(&shard).copied().unwrap_or(true) {
                unfinished += 1;
            } else if floor.is_none_or(|f| created >= f) {
                after_floor += 1;
            } else if open_tokens(&shard).iter().any(|t| open.contains(t.as_str())) {
                by_time += 1;
            } else {
                prunable += 1;
            }
        }
        let open_leases = leases.values().filter(|f| !**f).count();
        self.report.largest_item_why = format!(
            "{unfinished} of unfinished shards, {after_floor} of finished shards created after its floor (a creation time {} min before), {by_time} finished but admitted by a straggler's creation time, {prunable} prunable not pruned yet, {others} of deployment B; {} stragglers in its set; {open_leases} unfinished leases then ({unstarted} without a checkpoint; ages in minutes: oldest {:?}, 101st oldest {:?})",
            floor.map_or(0, |f| now.saturating_sub(f) / 60_000),
            open.matches(',').count().saturating_sub(1),
            ages.first(),
            ages.get(100),
        );
    }

    /// Files the largest item and the hottest partition of the hour under start-up, the
    /// outage's catch-up or the rest.
    fn hourly_figures(&mut self, after_start_up: bool, catching_up: bool, peak: bool) {
        let size = self.aggregates.take_largest_since();
        let hot = self.aggregates.take_peak_partition_wcu();
        let throttled = self.aggregates.take_throttled();
        let (reads_throttled, read_peak) = self.aggregates.take_read_figures();
        self.report.reads_throttled += reads_throttled;
        if read_peak.0 > self.report.read_peak.0 {
            self.report.read_peak = read_peak;
        }
        let totals =
            self.aggregates.take_partition_peaks().into_iter().filter(|(k, _)| k.starts_with("SALES#")).fold(0.0, |m, (_, w)| w.max(m));
        let r = &mut self.report;
        r.hours_over_partition_limit += u64::from(hot.0 > 1000.0);
        let (phase, throttles, total) = match (peak, catching_up, after_start_up) {
            (true, _, _) => (&mut r.partition_peak_peak, &mut r.throttled_peak, &mut r.daily_total_peak[2]),
            (_, true, _) => (&mut r.partition_peak_catch_up, &mut r.throttled_catch_up, &mut r.daily_total_peak[3]),
            (_, _, true) => (&mut r.partition_peak_steady, &mut r.throttled_steady, &mut r.daily_total_peak[1]),
            _ => (&mut r.partition_peak_first_hours, &mut r.throttled_first_hours, &mut r.daily_total_peak[0]),
        };
        *throttles += throttled;
        *total = total.max(totals);
        if hot.0 > phase.0 {
            *phase = hot;
        }
        if peak {
            r.largest_item_peak = r.largest_item_peak.max(size);
        } else if catching_up {
            r.largest_item_catch_up = r.largest_item_catch_up.max(size);
        } else if after_start_up {
            r.largest_item_steady = r.largest_item_steady.max(size);
            r.steady_hours += 1;
            r.steady_hours_over_8k += u64::from(size > 8192);
        }
    }

    /// Every replica of both deployments down for 26 hours: records are trimmed and closed
    /// shards leave the listing before anyone reads them.
    fn outage(&mut self, now: u64) {
        self.report.outages += 1;
        let back = now + 26 * HOUR;
        for slot in 0..=self.p.replicas {
            if let Some(r) = self.replicas[slot].take() {
                r.fate.dead.store(true, Ordering::Relaxed);
                r.folds.cancel();
            }
        }
        self.events.retain(|(_, e)| !matches!(e, Event::Restart(_) | Event::Switch(_)));
        for slot in 0..=self.p.replicas {
            self.events.push((back + slot as u64 * 60_000, Event::Restart(slot)));
        }
        self.outage_back = Some(Backlog::from(back + self.p.replicas as u64 * 60_000));
        self.loss_windows.push((now.saturating_sub(25 * HOUR), back + HOUR));
        // Shards unowned during the outage are the outage, not the lease protocol.
        self.leases_a.measure_unowned_from(back);
        self.leases_b.measure_unowned_from(back);
    }

    /// What the service's reconcile schedule does, running among the replicas, their faults
    /// and the writes: A's reconcile of everything every `reconcile_every_hours`, and for each
    /// deployment a requested repair within a minute of the request (it fences every target
    /// it compares, and clears the request when every target was quiet). A repair that gave
    /// up runs again 30 minutes later.
    fn reconcile_rounds(&mut self, now: u64) {
        for d in 0..2 {
            if let Some(done) = self.rounds[d].take_if(|r| r.is_finished()) {
                let (flagged, done) = split_round(futures::FutureExt::now_or_never(done));
                if !matches!(done, Some(Ok(Ok(_)))) {
                    self.requested_not_before[d] = now + 30 * 60_000;
                }
                if let Some(Ok(Ok(r))) = &done {
                    let mut left = reconcile::Retry::new();
                    let unrepaired = r.not_quiet.iter().map(|(rule, k)| (rule, k)).chain(r.failed.iter().map(|(rule, k, _)| (rule, k)));
                    for (rule, k) in unrepaired {
                        left.entry(rule.clone()).or_default().insert(k.clone());
                    }
                    self.update_partial(d, flagged, self.round_full[d], left);
                }
                self.count_round(done, flagged);
            }
            let leases = if d == 0 { self.leases_a.clone() } else { self.leases_b.clone() };
            let requested = futures::FutureExt::now_or_never(leases.reconcile_request()).and_then(|r| r.ok().flatten()).is_some();
            let scheduled = d == 0 && now >= self.next_round;
            if self.rounds[d].is_some() || !(scheduled || (requested && now >= self.requested_not_before[d])) {
                continue;
            }
            if scheduled {
                self.next_round = now + self.p.reconcile_every_hours * HOUR;
            }
            let (aggregates, sources, stream) = (self.aggregates.clone(), self.sources.clone(), self.stream.clone());
            let config = if d == 0 { config_a(self.p.daily_shards) } else { config_b() };
            // What the service's schedule does (`schedule::covers_all`).
            let all = ddb_aggregator::reconcile::schedule::covers_all(scheduled, requested, self.partial[d].as_ref().map(|p| &p.0));
            let partial = if all { None } else { self.partial[d].clone() };
            self.rounds[d] = Some(tokio::spawn(async move {
                let started = now_ms();
                let requested = leases.reconcile_request().await.ok().flatten().is_some();
                let only = partial.as_ref().map(|p| &p.1);
                let r = reconcile::reconcile_all(&config, &aggregates, &sources, &stream, &leases, requested, only).await;
                if requested && r.as_ref().is_ok_and(|r| r.not_quiet.is_empty() && r.failed.is_empty()) {
                    let _ = leases.clear_reconcile_request(partial.map_or(started, |p| p.0.started_ms)).await;
                }
                let flagged_after = leases.reconcile_request().await.ok().flatten().is_some();
                (requested || flagged_after, r)
            }));
            self.round_started[d] = now;
            self.round_full[d] = all;
        }
    }

    /// After a round with a request pending: nothing left, the repair is done; targets left
    /// after a full run, only those are retried next; after a retry, what is still left.
    fn update_partial(&mut self, d: usize, requested: bool, was_full: bool, left: reconcile::Retry) {
        if !requested || left.is_empty() {
            self.partial[d] = None;
            return;
        }
        let state = self.partial[d].as_ref().map(|p| p.0);
        let next = ddb_aggregator::reconcile::schedule::next_partial(state, was_full, self.round_started[d]);
        self.partial[d] = next.map(|p| (p, left));
    }

    /// `loss_flagged`: the service had asked for a reconcile of everything (an iterator lost
    /// before a first checkpoint at LATEST, trimmed data), so corrections may be repairs.
    fn count_round(
        &mut self,
        done: Option<Result<Result<ddb_aggregator::reconcile::Report, ReconcileError>, tokio::task::JoinError>>,
        loss_flagged: bool,
    ) {
        match done {
            Some(Ok(Ok(r))) => {
                self.report.reconcile_rounds += 1;
                let corrected = r.drifts.iter().filter(|d| d.corrected).count() as u64;
                self.report.reconcile_corrected += corrected;
                // A record the table refused leaves its status counts behind: reconcile's
                // correction of those is a repair.
                let key = |d: &ddb_aggregator::reconcile::report::Drift| d.target.0.iter().map(|p| p.to_string()).collect::<Vec<_>>();
                let corrected =
                    r.drifts.iter().filter(|d| d.corrected && !self.held_ever.contains(&(key(d), d.attribute.clone()))).count() as u64;
                // Before the outage, and with no loss flagged by the service, nothing drifts: a
                // correction then is reconcile changing a right value.
                if corrected > 0 && self.report.outages == 0 && !loss_flagged {
                    let d: Vec<String> =
                        r.drifts.iter().take(3).map(|d| format!("{:?}.{} {} -> {}", d.target.0, d.attribute, d.stored, d.truth)).collect();
                    self.report.problems.push(format!("reconcile corrected {corrected} right values before any loss: {}", d.join("; ")));
                }
            }
            other => {
                self.report.reconcile_failed += 1;
                let why = match other {
                    Some(Ok(Err(e))) => e.to_string(),
                    Some(Err(e)) => format!("the round's task: {e}"),
                    _ => "unfinished".to_string(),
                };
                let kind = |w: &str| {
                    w.split("shardId-").next().unwrap_or_default().chars().filter(|c| !c.is_ascii_digit()).take(60).collect::<String>()
                };
                let day = now_ms().saturating_sub(EPOCH_MS) / DAY;
                let failures = &mut self.report.reconcile_failures;
                match failures.iter_mut().find(|(w, _)| kind(w.split_once(": ").map_or("", |x| x.1)) == kind(&why)) {
                    Some((_, n)) => *n += 1,
                    None => failures.push((format!("day {day}: {why}"), 1)),
                }
            }
        }
    }

    fn rollovers(&mut self, now: u64) {
        if self.disabled {
            return;
        }
        let max_leaves = self.p.partitions + self.p.partitions / 2 + 1;
        let mut i = 0;
        while i < self.leaves.len() {
            if self.leaves[i].rollover_at > now {
                i += 1;
                continue;
            }
            let leaf = self.leaves[i].clone();
            let split = self.leaves.len() < max_leaves && leaf.hi - leaf.lo > 2 && self.rng.f64() < 0.05;
            // Within the minute step, at a millisecond of its own (a split's two children share
            // one, as they do in DynamoDB): shards rolled over in one step do not share a
            // creation time, which the ledger's straggler set admits shards by.
            let at = now.saturating_sub(self.rng.u64(0..60_000)).max(created(&leaf.shard) + 1);
            let children = self.stream.reshard_at(&leaf.shard, if split { 2 } else { 1 }, at);
            self.report.shards += children.len() as u64;
            let next = |rng: &mut fastrand::Rng| now + rng.u64(7 * HOUR / 2..9 * HOUR / 2);
            if split {
                self.report.splits += 1;
                let mid = leaf.lo + (leaf.hi - leaf.lo) / 2;
                self.leaves[i] = Leaf { lo: leaf.lo, hi: mid, shard: children[0].clone(), rollover_at: next(&mut self.rng) };
                self.leaves.insert(i + 1, Leaf { lo: mid, hi: leaf.hi, shard: children[1].clone(), rollover_at: next(&mut self.rng) });
                i += 2;
            } else {
                self.leaves[i] = Leaf { shard: children[0].clone(), rollover_at: next(&mut self.rng), ..leaf };
                i += 1;
            }
        }
    }

    /// 24-hour retention: trimmed records, and closed shards gone from the listing. A gone
    /// shard whose lease had not reached its end is data lost (outages only).
    fn retention(&mut self, now: u64) {
        let leases: BTreeMap<String, Option<Checkpoint>> =
            self.leases_a.snapshot().into_iter().map(|l| (l.shard_id, l.checkpoint)).collect();
        let last: BTreeMap<String, Option<u64>> = leases.keys().map(|id| (id.clone(), self.stream.last_sequence(id))).collect();
        for gone in self.stream.retain_after(now.saturating_sub(DAY)) {
            let read = match leases.get(&gone) {
                Some(Some(Checkpoint::ShardEnd)) => true,
                Some(Some(Checkpoint::Sequence(s))) => {
                    last.get(&gone).copied().flatten().is_none_or(|l| s.parse::<u64>().is_ok_and(|s| s >= l))
                }
                _ => last.get(&gone).copied().flatten().is_none(),
            };
            if !read {
                self.report.shards_lost += 1;
            }
        }
    }

    fn customers(&self) -> u32 {
        CUSTOMERS_PER_PARTITION * self.p.partitions as u32
    }

    fn leaf_for(&self, customer: u32) -> &str {
        let h = customer.wrapping_mul(2_654_435_761);
        let leaf = self.leaves.iter().find(|l| l.lo <= h && h < l.hi).unwrap_or(&self.leaves[self.leaves.len() - 1]);
        &leaf.shard
    }

    /// Times the backlogs: the first step at which every shard has caught up after the
    /// outage's end or the peak-load phase's.
    fn time_backlogs(&mut self, now: u64) {
        if self.outage_back.is_none() && self.peak_ended.is_none() {
            return;
        }
        let checkpoints: BTreeMap<String, Option<Checkpoint>> =
            self.leases_a.snapshot().into_iter().map(|l| (l.shard_id, l.checkpoint)).collect();
        let lasts: BTreeMap<String, u64> =
            self.leaves.iter().filter_map(|l| Some((l.shard.clone(), self.stream.last_sequence(&l.shard)?))).collect();
        if let Some(took) = self.outage_back.as_mut().and_then(|b| b.applied(now, &lasts, &checkpoints)) {
            self.report.outage_caught_up_s = Some(took / 1000);
            self.outage_back = None;
        }
        if let Some(took) = self.peak_ended.as_mut().and_then(|b| b.applied(now, &lasts, &checkpoints)) {
            self.report.peak_drained_s = Some(took / 1000);
            self.peak_ended = None;
        }
    }

    /// A step of the peak-load phase: `per_s` records a second for every partition, written
    /// a second at a time over the step.
    async fn peak_step(&mut self, step: Duration, per_s: f64) {
        let n = (per_s * self.p.partitions as f64).round() as u64;
        self.peaking = true;
        for _ in 0..step.as_secs() {
            for _ in 0..n {
                self.write_one();
            }
            self.report.peak_records += n;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.peaking = false;
        self.archive();
    }

    fn writes(&mut self, step: Duration) {
        let expected = self.p.writes_per_hour * step.as_secs_f64() / 3600.0;
        let mut n = expected.floor() as u64;
        if self.rng.f64() < expected.fract() {
            n += 1;
        }
        for _ in 0..n {
            self.write_one();
        }
        self.archive();
    }

    /// Deletes orders placed more than [`Params::order_lifetime_days`] ago, a hundred a step,
    /// and those of the peak-load phase after [`PEAK_ORDER_LIFETIME_MS`], a thousand a step.
    /// Poison orders go too (their removal is poison as well), or the one customer that holds
    /// them would grow for ever, and with it every check and reconcile.
    fn archive(&mut self) {
        let now = now_ms();
        self.archive_from(false, now.saturating_sub(self.p.order_lifetime_days.saturating_mul(DAY)), 100);
        self.archive_from(true, now.saturating_sub(PEAK_ORDER_LIFETIME_MS), 1_000);
    }

    /// The orders placed in the peak-load phase (`peak`), or the others, oldest first.
    fn placed(&mut self, peak: bool) -> &mut std::collections::VecDeque<(u64, (u32, String, u64))> {
        if peak {
            &mut self.placed_in_peak
        } else {
            &mut self.placed
        }
    }

    fn archive_from(&mut self, peak: bool, cutoff: u64, most: usize) {
        for _ in 0..most {
            if self.placed(peak).front().is_none_or(|(at, _)| *at >= cutoff) {
                break;
            }
            let Some((_, key)) = self.placed(peak).pop_front() else { break };
            if self.held.contains(&key) {
                continue;
            }
            let Some(old) = self.items.get(&key).cloned() else { continue };
            let seq = self.emit("REMOVE", &key, Some(&old), None);
            if old.cents.is_none() {
                self.poison.push((seq, now_ms()));
                self.report.poison += 1;
            }
            self.sources.delete(&[format!("CUST#c{}", key.0), format!("ORDER#{}#o{}", key.1, key.2)]);
            self.items.remove(&key);
            self.report.archived += 1;
        }
    }

    /// An order changed by the application with an UpdateItem: its copies stay as they are.
    fn update_order(&self, key: &(u32, String, u64), order: &Order) {
        let mut item = source_item(key, order);
        let stored = self.sources.get(&[format!("CUST#c{}", key.0), format!("ORDER#{}#o{}", key.1, key.2)]);
        for (name, value) in stored.into_iter().flatten() {
            if name == COPY_ATTRIBUTE || name.starts_with(ddb_aggregator::rules::copy::VERSION_PREFIX) {
                item.insert(name, value);
            }
        }
        self.sources.put(item);
    }

    /// A customer's profile created, renamed or deleted, as the source table would stream it.
    fn profile_change(&mut self) {
        let customer = self.rng.u32(..self.customers());
        let old = self.profiles.get(&customer).and_then(|p| p.name.clone());
        let new = match old {
            Some(_) if self.rng.f64() < 0.1 => None,
            _ => {
                self.next_name += 1;
                Some(format!("name-{}", self.next_name))
            }
        };
        let event = match (&old, &new) {
            (None, _) => "INSERT",
            (Some(_), Some(_)) => "MODIFY",
            (Some(_), None) => "REMOVE",
        };
        let image = |name: &Option<String>| {
            name.as_ref().map(|n| json!({"PK": {"S": format!("CUST#c{customer}")}, "SK": {"S": "PROFILE"}, "name": {"S": n}}))
        };
        let keys = json!({"PK": {"S": format!("CUST#c{customer}")}, "SK": {"S": "PROFILE"}});
        self.append(event, keys, image(&old), image(&new), customer);
        match image(&new).and_then(|i| i.as_object().cloned()) {
            Some(item) => drop(self.sources.put(item)),
            None => drop(self.sources.delete(&[format!("CUST#c{customer}"), "PROFILE".into()])),
        }
        self.profiles.insert(customer, Profile { name: new, changed_at: now_ms() });
        self.report.profile_changes += 1;
    }

    /// One item change, as the source table would stream it.
    fn write_one(&mut self) {
        if self.rng.f64() < PROFILE_SHARE {
            self.profile_change();
            return;
        }
        let now = now_ms();
        let day = chrono_day(now);
        let roll = self.rng.f64();
        if roll < 0.01 {
            let customer = self.customers(); // a customer of its own: its orders only leave (`archive`)
            self.next_order += 1;
            let order = Order { status: "PENDING", cents: None, updated: now };
            let key = (customer, day, self.next_order);
            let seq = self.emit("INSERT", &key, None, Some(&order));
            self.poison.push((seq, now));
            self.sources.put(source_item(&key, &order));
            let peak = self.peaking;
            self.placed(peak).push_back((now, key.clone()));
            self.items.insert(key, order);
            self.report.poison += 1;
            return;
        }
        let existing: Vec<(u32, String, u64)> = if roll < 0.5 || self.items.is_empty() {
            Vec::new()
        } else {
            // An order of a random customer (poison orders, of customer `customers()`, only leave).
            let customer = self.rng.u32(..self.customers());
            let orders: Vec<&(u32, String, u64)> = self
                .items
                .range((customer, String::new(), 0)..(customer + 1, String::new(), 0))
                .map(|(k, _)| k)
                .filter(|k| !self.held.contains(*k))
                .take(64)
                .collect();
            let pick = self.rng.usize(..orders.len().max(1));
            orders.get(pick).map(|k| (*k).clone()).into_iter().collect()
        };
        if existing.first().is_some_and(|k| self.held.contains(k)) {
            return; // a held order never changes
        }
        match existing.into_iter().next() {
            None => {
                let customer = self.rng.u32(..self.customers());
                self.next_order += 1;
                let order = Order { status: "PENDING", cents: Some(self.rng.i64(1..100_000)), updated: now };
                let key = (customer, day, self.next_order);
                self.emit("INSERT", &key, None, Some(&order));
                // The application copies the customer's name onto the order it places.
                let mut item = source_item(&key, &order);
                if let Some(name) = self.profiles.get(&customer).and_then(|p| p.name.clone()) {
                    item.insert(COPY_ATTRIBUTE.into(), json!({ "S": name }));
                }
                self.sources.put(item);
                let peak = self.peaking;
                self.placed(peak).push_back((now, key.clone()));
                self.items.insert(key, order);
            }
            Some(key) => {
                let old = self.items[&key].clone();
                if self.rng.f64() < 0.3 {
                    self.emit("REMOVE", &key, Some(&old), None);
                    self.sources.delete(&[format!("CUST#c{}", key.0), format!("ORDER#{}#o{}", key.1, key.2)]);
                    self.items.remove(&key);
                } else if key.0 % 8 == REFUSING && old.cents.is_some() && self.rng.f64() < 0.1 {
                    // The table refuses this record's write (`orders_HELD` holds a string). Its
                    // `updatedAt` stays: lastTotal's helpers do not change.
                    let new = Order { status: "HELD", ..old.clone() };
                    let seq = self.emit("MODIFY", &key, Some(&old), Some(&new));
                    self.refused.push((seq, now_ms()));
                    self.report.refused += 1;
                    self.update_order(&key, &new);
                    self.held.insert(key.clone());
                    let count = (vec![format!("CUST#c{}", key.0), "PROFILE".into()], format!("orders_{}", old.status));
                    *self.held_from.entry(count.clone()).or_default() += 1;
                    self.held_ever.insert(count);
                    self.items.insert(key, new);
                } else {
                    let new = if self.rng.bool() {
                        Order { status: if old.status == "PENDING" { "PAID" } else { "SHIPPED" }, updated: now, ..old.clone() }
                    } else {
                        Order { cents: Some(self.rng.i64(1..100_000)), updated: now, ..old.clone() }
                    };
                    self.emit("MODIFY", &key, Some(&old), Some(&new));
                    self.update_order(&key, &new);
                    self.items.insert(key, new);
                }
            }
        }
    }

    fn emit(&mut self, event: &str, key: &(u32, String, u64), old: Option<&Order>, new: Option<&Order>) -> u64 {
        let keys = json!({"PK": {"S": format!("CUST#c{}", key.0)}, "SK": {"S": format!("ORDER#{}#o{}", key.1, key.2)}});
        let image = |o: &Order| Value::Object(source_item(key, o));
        self.append(event, keys, old.map(image), new.map(image), key.0)
    }

    /// Appends a record of one of `customer`'s items to the shard its partition key maps to.
    fn append(&mut self, event: &str, keys: Value, old: Option<Value>, new: Option<Value>, customer: u32) -> u64 {
        let mut ddb = json!({"Keys": keys, "ApproximateCreationDateTime": now_ms() / 1000});
        if let Some(o) = old {
            ddb["OldImage"] = o;
        }
        if let Some(n) = new {
            ddb["NewImage"] = n;
        }
        let record: Value = json!({"eventName": event, "dynamodb": ddb});
        if self.disabled {
            self.report.unstreamed += 1;
            return 0; // never streamed: only a reconcile brings it in
        }
        self.report.records += 1;
        let shard = self.leaf_for(customer).to_string();
        self.stream.append_at(&shard, record, now_ms())
    }

    /// Every root shard held by a reader of both deployments.
    fn roots_owned(&self, roots: &[String]) -> bool {
        [&self.leases_a, &self.leases_b].iter().all(|leases| {
            let owned: std::collections::BTreeSet<String> =
                leases.snapshot().into_iter().filter(|l| l.owner.is_some()).map(|l| l.shard_id).collect();
            roots.iter().all(|r| owned.contains(r))
        })
    }

    /// Every root shard finished by both deployments.
    fn roots_finished(&self, roots: &[String]) -> bool {
        [&self.leases_a, &self.leases_b].iter().all(|leases| {
            let finished: std::collections::BTreeSet<String> =
                leases.snapshot().into_iter().filter(|l| l.finished()).map(|l| l.shard_id).collect();
            roots.iter().all(|r| finished.contains(r))
        })
    }

    /// Every listed shard read to its last record, and every copy fan-out job done, by both
    /// deployments.
    fn caught_up(&self) -> bool {
        // After a stream switch, not before every replica follows the new stream.
        let switching = self.events.iter().any(|(_, e)| matches!(e, Event::Switch(_)));
        !switching && [&self.leases_a, &self.leases_b].iter().all(|leases| leases.copy_jobs_pending() == 0) && self.shards_read()
    }

    /// What [`World::caught_up`] waits for, in words.
    fn not_caught_up(&self) -> String {
        let jobs: Vec<usize> = [&self.leases_a, &self.leases_b].iter().map(|l| l.copy_jobs_pending()).collect();
        let now = now_ms();
        let stored = self.leases_a.copy_jobs_snapshot();
        let mut owners: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for j in &stored {
            let o = owners.entry(j.owner.clone().unwrap_or_else(|| "-".into())).or_default();
            if j.expires_at_ms > now {
                o.0 += 1;
            } else {
                o.1 += 1;
            }
        }
        let claimed: Vec<String> = stored
            .iter()
            .filter(|j| j.owner.is_some() && j.expires_at_ms > now)
            .take(4)
            .map(|j| {
                format!(
                    "{} found {} cursor {:?} age {} s",
                    j.job.id(),
                    j.job.found,
                    j.job.cursor,
                    now.saturating_sub(j.job.created_ms) / 1000
                )
            })
            .collect();
        let not_due = stored.iter().filter(|j| j.job.due_ms > now).count();
        let oldest = stored.iter().map(|j| now.saturating_sub(j.job.created_ms) / 1000).max().unwrap_or(0);
        let live: Vec<String> = self.replicas.iter().flatten().map(|r| format!("{}", r.fate.dead.load(Ordering::Relaxed))).collect();
        format!(
            "copy jobs pending {jobs:?} (by owner: claimed, lapsed {owners:?}; not due {not_due}; oldest {oldest} s; replicas dead {live:?}; claimed: {claimed:?}), every shard read {}, closed shards done {}",
            self.shards_read(),
            self.closed_shards_done()
        )
    }

    /// Every listed shard read to its last record, by both deployments.
    fn shards_read(&self) -> bool {
        [&self.leases_a, &self.leases_b].iter().all(|leases| {
            let by_id: BTreeMap<String, Option<Checkpoint>> = leases.snapshot().into_iter().map(|l| (l.shard_id, l.checkpoint)).collect();
            self.leaves.iter().all(|leaf| match self.stream.last_sequence(&leaf.shard) {
                // No records yet: read once a replica of this deployment has its lease.
                None => by_id.contains_key(&leaf.shard),
                Some(last) => match by_id.get(&leaf.shard) {
                    Some(Some(Checkpoint::ShardEnd)) => true,
                    Some(Some(Checkpoint::Sequence(s))) => s.parse::<u64>().is_ok_and(|s| s >= last),
                    _ => false,
                },
            })
        }) && self.closed_shards_done()
    }

    /// Closed shards still listed are finished (their records applied) by both deployments.
    fn closed_shards_done(&self) -> bool {
        let open: std::collections::BTreeSet<&str> = self.leaves.iter().map(|l| l.shard.as_str()).collect();
        [&self.leases_a, &self.leases_b].iter().all(|leases| {
            leases.snapshot().iter().filter(|l| !open.contains(l.shard_id.as_str())).all(|l| {
                l.finished()
                    || self.stream.last_sequence(&l.shard_id).is_none_or(
                        |last| matches!(&l.checkpoint, Some(Checkpoint::Sequence(s)) if s.parse::<u64>().is_ok_and(|s| s >= last)),
                    )
            })
        })
    }

    /// The folded daily totals against the truth: every fold that was due has run by a
    /// quiescent check (a second after the last write), so a stale total is a lost fold.
    fn check_folds(&mut self, truth: &BTreeMap<(Vec<String>, String), Decimal>, folded: &BTreeMap<(Vec<String>, String), Decimal>) {
        let totals = |m: &BTreeMap<(Vec<String>, String), Decimal>| -> BTreeMap<(Vec<String>, String), Decimal> {
            m.iter().filter(|((k, _), v)| k[0].starts_with("SALES#") && !v.is_zero()).map(|(k, v)| (k.clone(), *v)).collect()
        };
        let (want, got) = (totals(truth), totals(folded));
        let keys: std::collections::BTreeSet<&(Vec<String>, String)> = want.keys().chain(got.keys()).collect();
        self.report.totals_compared += keys.len() as u64;
        let stale: Vec<String> = keys
            .into_iter()
            .filter(|k| want.get(*k) != got.get(*k))
            .map(|k| format!("{:?}.{}: folded {:?}, truth {:?}", k.0, k.1, got.get(k), want.get(k)))
            .collect();
        if !stale.is_empty() {
            self.report.totals_stale += stale.len() as u64;
            let day = (now_ms() - EPOCH_MS) / DAY;
            self.report.problems.push(format!(
                "day {day}: {} folded totals stale: {}",
                stale.len(),
                stale.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
    }

    /// The oracle: every aggregate from the source items, compared with the table. After an
    /// outage lost data, a reconcile must have been requested; the simulation then stands in for
    /// it (the real reconcile needs DynamoDB) and sets the truth.
    async fn check(&mut self) {
        self.check_values().await;
        self.check_copies();
        if self.p.daily_shards.is_some() {
            // The fold rounds due (a second after a write) run first; a repair folded what it read.
            tokio::time::sleep(Duration::from_secs(5)).await;
            let folded = numbers(&self.aggregates, true).1;
            self.check_folds(&self.truth(), &folded);
        }
    }

    /// The copy oracle: every order's copy of its customer's name equals the profile as the
    /// application last wrote it (none once deleted). A customer whose last profile change falls
    /// in a window where records may be lost (an outage past the retention, a disabled stream,
    /// a start-up skip) cannot be judged: copies are not reconciled, so a lost change stays
    /// until the next one (docs/limits.md).
    fn check_copies(&mut self) {
        let mut wrong = Vec::new();
        for item in self.sources.items() {
            let (Some(pk), Some(sk)) = (text_of(&item, "PK"), text_of(&item, "SK")) else { continue };
            let Some(customer) = sk.starts_with("ORDER#").then(|| pk.trim_start_matches("CUST#c").parse::<u32>().ok()).flatten() else {
                continue;
            };
            let profile = self.profiles.get(&customer);
            if profile.is_some_and(|p| self.loss_windows.iter().any(|&(from, to)| (from..to).contains(&p.changed_at))) {
                self.report.copies_unjudged += 1;
                continue;
            }
            self.report.copies_compared += 1;
            let expected = profile.and_then(|p| p.name.clone());
            let held = text_of(&item, COPY_ATTRIBUTE).map(str::to_string);
            if held != expected {
                wrong.push(format!("{pk} {sk}: holds {held:?}, profile {expected:?}"));
            }
        }
        if !wrong.is_empty() {
            self.report.copies_wrong += wrong.len() as u64;
            let day = (now_ms() - EPOCH_MS) / DAY;
            self.report.problems.push(format!(
                "day {day}: {} copies wrong: {}",
                wrong.len(),
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
    }

    async fn check_values(&mut self) {
        self.report.checks += 1;
        let late = self.old_checkpoints().into_iter().filter(|(k, c)| self.old_stream_at_switch.get(k) != Some(c)).count();
        self.report.old_stream_read_late = self.report.old_stream_read_late.max(late as u64);
        let truth = self.truth();
        let stored = numbers(&self.aggregates, self.p.daily_shards.is_some()).0;
        let requested = self.leases_a.reconcile_request().await.ok().flatten().is_some();
        let requested_b = self.leases_b.reconcile_request().await.ok().flatten().is_some();
        if requested || requested_b {
            self.report.reconcile_requests += u64::from(requested) + u64::from(requested_b);
        }
        let keys: std::collections::BTreeSet<&(Vec<String>, String)> = truth.keys().chain(stored.keys()).collect();
        let mut wrong = Vec::new();
        for k in keys {
            self.report.values_compared += 1;
            if k.1 == "ordersB" {
                self.report.deployment_b_values += 1;
            }
            if !agrees(&mut self.held_from, k, &truth, &stored) {
                wrong.push(format!("{:?}.{}: stored {:?}, truth {:?}", k.0, k.1, stored.get(k), truth.get(k)));
            }
        }
        if !wrong.is_empty() && (requested || requested_b) {
            // The service flagged possible loss (trimmed or lost shards, an iterator lost
            // before a first checkpoint) and asked for a reconcile: the real one repairs it.
            for (wanted, config, leases) in
                [(requested, config_a(self.p.daily_shards), self.leases_a.clone()), (requested_b, config_b(), self.leases_b.clone())]
            {
                if !wanted {
                    continue;
                }
                let r = reconcile::reconcile_all(&config, &self.aggregates, &self.sources, &self.stream, &leases, true, None).await;
                if r.as_ref().is_ok_and(|r| r.not_quiet.is_empty()) {
                    let _ = leases.clear_reconcile_request(u64::MAX).await;
                }
                self.count_round(Some(Ok(r)), true);
            }
            let after = numbers(&self.aggregates, self.p.daily_shards.is_some()).0;
            let keys: std::collections::BTreeSet<&(Vec<String>, String)> = truth.keys().chain(after.keys()).collect();
            let held_from = &mut self.held_from;
            let still: Vec<String> = keys
                .into_iter()
                .filter(|k| !agrees(held_from, k, &truth, &after))
                .take(5)
                .map(|k| format!("{:?}.{}: stored {:?}, truth {:?}", k.0, k.1, after.get(k), truth.get(k)))
                .collect();
            if still.is_empty() {
                self.report.repairs += 1;
                return;
            }
            self.report.values_wrong += still.len() as u64;
            self.report
                .problems
                .push(format!("reconcile did not repair (requested by A/B: {requested}/{requested_b}): {}", still.join("; ")));
            return;
        }
        if requested || requested_b {
            let _ = self.leases_a.clear_reconcile_request(u64::MAX).await;
            let _ = self.leases_b.clear_reconcile_request(u64::MAX).await;
        }
        if !wrong.is_empty() {
            self.report.values_wrong += wrong.len() as u64;
            let day = (now_ms() - EPOCH_MS) / DAY;
            self.report.problems.push(format!(
                "day {day}: {} values wrong (reconcile requested: {requested}/{requested_b}): {}",
                wrong.len(),
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
    }

    /// The helper items left: live and at zero, and the most on one target.
    /// Deletes expired helpers: what the table's TTL does (here at once, the worst case), or
    /// the service's own sweep ([`Params::own_expiry`]) until nothing due is left.
    async fn expire_helpers(&mut self, now: u64) {
        if !self.p.own_expiry {
            self.report.helpers_expired += self.aggregates.delete_expired(TTL_ATTRIBUTE, now / 1000) as u64;
            return;
        }
        let names = ["PK".to_string(), "SK".to_string()];
        for _ in 0..10_000 {
            match ddb_aggregator::sink::expiry::sweep(&*self.aggregates, &names, TTL_ATTRIBUTE, now / 1000).await {
                Ok(swept) => {
                    self.report.helpers_expired += swept.deleted;
                    self.report.expiries_kept += swept.kept;
                    if !swept.more {
                        return;
                    }
                }
                Err(e) => {
                    self.report.problems.push(format!("the sweep of expired helpers failed: {e}"));
                    return;
                }
            }
        }
    }

    fn count_helpers(&mut self) {
        let mut per_target: BTreeMap<(String, String), u64> = BTreeMap::new();
        for key in self.aggregates.keys() {
            let Some(h) = key.last().and_then(|sk| ddb_aggregator::rules::helper::parse(sk)) else { continue };
            let parts: Vec<&str> = key.iter().map(String::as_str).collect();
            let Some(item) = self.aggregates.item(&parts) else { continue };
            *per_target.entry((key[0].clone(), h.owner_sk.to_string())).or_default() += 1;
            // No count: the item's writes added nothing to it (a value that came and went in one batch).
            if item.get(REFS).is_none_or(|v| matches!(v, MemValue::Num(n) if n.is_zero())) {
                self.report.helpers_zero += 1;
            } else {
                self.report.helpers_live += 1;
            }
        }
        self.report.helpers_most_on_a_target = per_target.values().copied().max().unwrap_or(0);
        self.report.expiries_pending = self.aggregates.pending_expiries() as u64;
    }

    /// The aggregates as the rules define them, computed from the items alone.
    fn truth(&self) -> BTreeMap<(Vec<String>, String), Decimal> {
        let mut t: BTreeMap<(Vec<String>, String), Decimal> = BTreeMap::new();
        let mut add = |pk: String, sk: &str, attr: String, v: Decimal| {
            let e = t.entry((vec![pk, sk.to_string()], attr)).or_insert(Decimal::ZERO);
            *e = e.checked_add(v).expect("in range");
        };
        let one = Decimal::from_i64(1);
        let mut largest: BTreeMap<String, Decimal> = BTreeMap::new();
        let mut days: BTreeMap<String, std::collections::BTreeSet<&str>> = BTreeMap::new();
        let mut oldest_pending: BTreeMap<String, u64> = BTreeMap::new();
        let mut last: BTreeMap<String, (u64, Decimal)> = BTreeMap::new();
        for ((customer, day, id), o) in &self.items {
            let pk = format!("CUST#c{customer}");
            add(pk.clone(), "PROFILE", "ordersB".into(), one);
            let Some(cents) = o.cents else { continue };
            let total = Decimal::parse(&cents_text(cents)).expect("a decimal");
            add(pk.clone(), "PROFILE", "orderCount".into(), one);
            add(pk.clone(), "PROFILE", "revenue".into(), total);
            add(pk.clone(), "PROFILE", "spend".into(), total);
            add(pk.clone(), "PROFILE", format!("orders_{}", o.status), one);
            let max = largest.entry(pk.clone()).or_insert(total);
            *max = (*max).max(total);
            for measure in ["largestOrder", "activeDays", "lastTotal"] {
                add(pk.clone(), &format!("PROFILE{MARK}{measure}"), REFS.into(), one);
            }
            if o.status == "PENDING" {
                add(pk.clone(), &format!("PROFILE{MARK}oldestPending"), REFS.into(), one);
                let e = oldest_pending.entry(pk.clone()).or_insert(*id);
                *e = (*e).min(*id);
            }
            // latest: the greatest updatedAt, ties to the greater value.
            let l = last.entry(pk.clone()).or_insert((o.updated, total));
            *l = (*l).max((o.updated, total));
            days.entry(pk).or_default().insert(day);
            add(format!("SALES#{day}"), "TOTAL", "orders".into(), one);
            add(format!("SALES#{day}"), "TOTAL", "revenue".into(), total);
        }
        // max and distinct, as values (their helper items are not compared: `numbers`).
        for (pk, v) in largest {
            t.insert((vec![pk, "PROFILE".to_string()], "largestOrder".into()), v);
        }
        for (pk, d) in days {
            t.insert((vec![pk, "PROFILE".to_string()], "activeDays".into()), Decimal::from_i64(d.len() as i64));
        }
        for (pk, id) in oldest_pending {
            t.insert((vec![pk, "PROFILE".to_string()], "oldestPending".into()), Decimal::from_i64(i64::try_from(id).expect("an id")));
        }
        for (pk, (_, total)) in last {
            t.insert((vec![pk, "PROFILE".to_string()], "lastTotal".into()), total);
        }
        t.retain(|_, v| !v.is_zero());
        t
    }

    async fn finish(&mut self) {
        self.report.copy_jobs = self.leases_a.copy_jobs_recorded();
        for round in self.rounds.iter_mut().filter_map(Option::take).collect::<Vec<_>>() {
            let (flagged, done) = split_round(tokio::time::timeout(Duration::from_secs(12 * 3600), round).await.ok());
            self.count_round(done, flagged);
        }
        for r in self.replicas.iter().flatten() {
            r.cancel.cancel();
            r.folds.cancel();
        }
        for r in self.replicas.iter_mut().filter_map(Option::take) {
            if !r.fate.dead.load(Ordering::Relaxed) {
                let _ = tokio::time::timeout(Duration::from_secs(60), r.handle).await;
            }
        }
        let letters: std::collections::BTreeSet<String> = self.dlq.letters().into_iter().map(|l| l.sequence_number).collect();
        self.report.letters = letters.len() as u64;
        self.report.letters_cut = self.dlq.sent().iter().filter(|s| s.form != Delivery::Full).count() as u64;
        for (seq, at) in &self.poison {
            let lossy = self.loss_windows.iter().any(|&(from, to)| (from..to).contains(at));
            if !lossy && !letters.contains(&format!("{seq:021}")) {
                self.report.problems.push(format!("poison record {seq} has no dead letter"));
            }
        }
        for (seq, at) in &self.refused {
            let lossy = self.loss_windows.iter().any(|&(from, to)| (from..to).contains(at));
            if letters.contains(&format!("{seq:021}")) {
                self.report.refused_letters += 1;
            } else if !lossy {
                self.report.problems.push(format!("refused record {seq} has no dead letter"));
            }
        }
        // Only poison and refused records are dead-lettered: every other contribution landed.
        let expected: std::collections::BTreeSet<String> =
            self.poison.iter().chain(&self.refused).map(|(seq, _)| format!("{seq:021}")).collect();
        let stray: Vec<&String> = letters.iter().filter(|l| !expected.contains(*l)).take(3).collect();
        if !stray.is_empty() {
            self.report.problems.push(format!("records dead-lettered that neither were poison nor refused: {stray:?}"));
        }
        self.report.faults = self.faults.injected.load(Ordering::Relaxed);
        self.report.calls = self.faults.calls.load(Ordering::Relaxed);
        self.count_helpers();
        self.report.largest_item = self.aggregates.largest_item();
        let (entries, at) = self.aggregates.largest_item_entries();
        self.report.largest_item_entries = entries;
        self.report.largest_item_hour = at.saturating_sub(EPOCH_MS) / HOUR;
        self.report.most_entries = self.aggregates.most_entries();
        if let Some((_, writes, wcu)) = self.aggregates.hottest() {
            self.report.hottest_writes = writes;
            self.report.hottest_wcu = wcu;
        }
        let a_tables: Vec<&Arc<MemoryLeases>> = std::iter::once(&self.leases_a).chain(self.retired_leases.iter().step_by(2)).collect();
        let all_tables = std::iter::once(&self.leases_a).chain(std::iter::once(&self.leases_b)).chain(&self.retired_leases);
        self.report.lease_table_max = a_tables.iter().map(|l| l.largest_table()).max().unwrap_or(0);
        let left: usize = a_tables.iter().map(|l| l.snapshot().len()).sum();
        self.report.leases_deleted = self.report.shards.saturating_sub(left as u64);
        self.report.longest_unowned_s = all_tables.map(|l| l.longest_unowned_ms()).max().unwrap_or(0) / 1000;
        self.report.children_started = self.report.shards - self.p.partitions as u64;
    }
}

/// An order as the source table holds it (typed DynamoDB JSON).
type RoundResult = Result<ddb_aggregator::reconcile::Report, ReconcileError>;

/// A finished round's (loss flagged, result), as `count_round` takes them.
/// Whether a stored value agrees with the truth. A refusing customer's `orders_HELD` holds the
/// application's string (not compared); a status count HELD moves left from may stand above
/// the truth by the moves reconcile has not corrected yet (`held_from`), and is exact once
/// reconcile has (then the allowance ends).
/// Values by (key, attribute).
type Numbers = BTreeMap<(Vec<String>, String), Decimal>;

/// The table's numbers as the oracle compares them: every aggregate, derived ones included.
/// The helper items of max and distinct are summed per target and measure
/// (`<target SK>#_agg#<measure>`, `refs`): every order counts once in each, so a record
/// counted twice (say after its helper expired too early) shows there even where the derived
/// value hides it. Their expiries are not compared.
///
/// With the daily totals sharded, their sub-items are added up into the totals' keys (the
/// scatter-gather read), and the totals as folded are the second map.
fn numbers(aggregates: &MemoryAggregates, sharded: bool) -> (Numbers, Numbers) {
    let (mut out, mut folded) = (BTreeMap::new(), BTreeMap::new());
    for ((key, attr), v) in aggregates.numbers() {
        let k = ddb_aggregator::rules::TargetKey(key.iter().map(|p| Box::from(p.as_str())).collect());
        if let Some((total, _)) = ddb_aggregator::rules::shards::parse(&k) {
            let e = out.entry((total.0.iter().map(|p| p.to_string()).collect(), attr)).or_insert(Decimal::ZERO);
            *e = e.checked_add(v).expect("in range");
            continue;
        }
        if sharded && key[0].starts_with("SALES#") {
            folded.insert((key, attr), v);
            continue;
        }
        let helper =
            key.last().and_then(|sk| ddb_aggregator::rules::helper::parse(sk)).map(|h| format!("{}{}{}", h.owner_sk, MARK, h.measure));
        match helper {
            None => {
                out.insert((key, attr), v);
            }
            Some(_) if attr != REFS => {}
            Some(sum) => {
                let e = out.entry((vec![key[0].clone(), sum], attr)).or_insert(Decimal::ZERO);
                *e = e.checked_add(v).expect("in range");
            }
        }
    }
    out.retain(|_, v| !v.is_zero());
    (out, folded)
}

fn agrees(
    held_from: &mut BTreeMap<(Vec<String>, String), u64>,
    k: &(Vec<String>, String),
    truth: &BTreeMap<(Vec<String>, String), Decimal>,
    stored: &BTreeMap<(Vec<String>, String), Decimal>,
) -> bool {
    let refusing =
        k.0.first().and_then(|pk| pk.strip_prefix("CUST#c")).and_then(|n| n.parse::<u32>().ok()).is_some_and(|c| c % 8 == REFUSING);
    if refusing && k.1 == "orders_HELD" {
        return true;
    }
    let (t, s) = (truth.get(k).copied().unwrap_or(Decimal::ZERO), stored.get(k).copied().unwrap_or(Decimal::ZERO));
    if t == s {
        held_from.remove(k);
        return true;
    }
    let allowance = held_from.get(k).map_or(Decimal::ZERO, |n| Decimal::from_i64(i64::try_from(*n).unwrap_or(i64::MAX)));
    s.checked_sub(t).is_ok_and(|above| above > Decimal::ZERO && above <= allowance)
}

/// A shard's creation time (epoch ms), from its id.
fn created(shard: &str) -> u64 {
    ddb_aggregator::shard_id::created_ms(shard).unwrap_or(0)
}

fn split_round(
    done: Option<Result<(bool, RoundResult), tokio::task::JoinError>>,
) -> (bool, Option<Result<RoundResult, tokio::task::JoinError>>) {
    match done {
        Some(Ok((flagged, r))) => (flagged, Some(Ok(r))),
        Some(Err(e)) => (false, Some(Err(e))),
        None => (false, None),
    }
}

/// The copy rule's attribute on orders.
const COPY_ATTRIBUTE: &str = "customerName";

/// An S attribute's text.
fn text_of<'a>(item: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a str> {
    item.get(name).and_then(|v| v.get("S")).and_then(Value::as_str)
}

fn source_item(key: &(u32, String, u64), o: &Order) -> serde_json::Map<String, Value> {
    let total = match o.cents {
        Some(c) => json!({"N": cents_text(c)}),
        None => json!({"S": "n/a"}),
    };
    let mut item = json!({"PK": {"S": format!("CUST#c{}", key.0)}, "SK": {"S": format!("ORDER#{}#o{}", key.1, key.2)},
                      "status": {"S": o.status}, "total": total, "createdAt": {"N": key.2.to_string()},
                      "updatedAt": {"N": o.updated.to_string()}});
    // Every fourth poison order holds what the simulated SQS refuses (scenario g): a U+FFFF,
    // which the letter escapes, and a text the queue refuses for good, so the letter goes
    // out with its images cut.
    if o.cents.is_none() && key.2.is_multiple_of(4) {
        item["note"] = json!({"S": format!("{SQS_REFUSES} \u{FFFF}")});
    }
    item.as_object().cloned().unwrap_or_default()
}

/// A text the simulated queue refuses in any letter body.
const SQS_REFUSES: &str = "sqs-refuses-this";

/// Cents as a decimal text (`12345` -> `123.45`).
fn cents_text(c: i64) -> String {
    format!("{}.{:02}", c / 100, c % 100)
}

/// `YYYY-MM-DD` of an epoch ms.
fn chrono_day(ms: u64) -> String {
    let days = ms / DAY;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[test]
fn civil_dates() {
    assert_eq!(chrono_day(EPOCH_MS), "2027-01-01");
    assert_eq!(chrono_day(EPOCH_MS + 59 * DAY), "2027-03-01");
    assert_eq!(chrono_day(0), "1970-01-01");
}
