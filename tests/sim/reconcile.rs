//! Reconcile in the simulation: the real protocol over the simulated tables, the lease table
//! and the stream listing, with the same evidence rule as on DynamoDB.

use ddb_aggregator::sink::expiry::Expiry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ddb_aggregator::config::Config;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::reconcile::caught_up;
use ddb_aggregator::reconcile::memory::{MemorySources, MemoryTargets};
use ddb_aggregator::reconcile::protocol::{self, Applied, Consumer, Correction, Placement, Removal, TargetItem, TargetStore};
use ddb_aggregator::reconcile::{Options, ReconcileError, Report};
use ddb_aggregator::rules::{Rule, TargetKey};
use ddb_aggregator::sink::derive::DeriveTarget;
use ddb_aggregator::sink::ledger::Ledger;
use ddb_aggregator::sink::memory::MemoryAggregates;
use ddb_aggregator::state::memory::MemoryLeases;
use ddb_aggregator::state::now_ms;
use ddb_aggregator::stream::sim::SimStream;

/// One deployment's view of the aggregates table (its ledger namespace).
pub struct SimTargets {
    store: Arc<MemoryAggregates>,
    ledger: Ledger,
}

impl SimTargets {
    pub fn new(store: Arc<MemoryAggregates>, namespace: &str) -> SimTargets {
        SimTargets { store, ledger: Ledger::new(namespace) }
    }

    fn view(&self) -> MemoryTargets<'_> {
        MemoryTargets {
            store: &self.store,
            ledger: self.ledger.clone(),
            expiry: Some(Expiry { set: false, ..Expiry::new(super::TTL_ATTRIBUTE) }),
        }
    }
}

impl TargetStore for SimTargets {
    async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
        self.view().read(key).await
    }

    async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        self.view().scan(rule).await
    }

    async fn correct(&self, key: &TargetKey, c: &Correction) -> Result<bool, ReconcileError> {
        self.view().correct(key, c).await
    }

    async fn helpers(&self, rule: &Rule, owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        self.view().helpers(rule, owner).await
    }

    async fn derive(&self, key_names: &[String], target: &DeriveTarget) -> Result<(), ReconcileError> {
        self.view().derive(key_names, target).await
    }

    async fn remove(&self, key: &TargetKey, r: &Removal) -> Result<bool, ReconcileError> {
        self.view().remove(key, r).await
    }

    async fn hold(&self, key: &TargetKey, p: &Placement) -> Result<bool, ReconcileError> {
        self.view().hold(key, p).await
    }

    async fn fold(&self, key: &TargetKey, values: &[(String, Decimal)], seq: Decimal) -> Result<bool, ReconcileError> {
        self.view().fold(key, values, seq).await
    }

    async fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> Result<bool, ReconcileError> {
        self.view().reset_fold(key, zero).await
    }
}

/// The evidence from one deployment's lease table and the stream's listing; waits in
/// simulated time while the replicas (or nobody) catch up.
pub struct SimConsumer {
    pub stream: Arc<SimStream>,
    pub leases: Arc<MemoryLeases>,
    pub margin_ms: u64,
    /// How often it looks while shards are behind.
    pub poll: Duration,
}

impl Consumer for SimConsumer {
    async fn applied_before(&self, after_ms: u64, wait: Duration) -> Result<Applied, ReconcileError> {
        let target = after_ms + self.margin_ms;
        let started = now_ms();
        loop {
            let caught_up::Standing { behind, fence_ms, by_empty_pages, .. } =
                caught_up::standing(&*self.stream, &*self.leases, target).await?;
            if behind.is_empty() {
                return Ok(Applied { fence_ms, by_empty_pages });
            }
            if now_ms().saturating_sub(started) > u64::try_from(wait.as_millis()).unwrap_or(u64::MAX) {
                return Err(ReconcileError::NotCaughtUp(format!("{} shards behind, e.g. {:?}", behind.len(), behind.first())));
            }
            tokio::time::sleep(self.poll).await;
        }
    }
}

/// The targets a requested repair's full run found not quiet, by rule: the schedule retries
/// only those next (`schedule::covers_all`).
pub type Retry = BTreeMap<String, std::collections::BTreeSet<TargetKey>>;

/// Reconciles every target of every rule of `config` once (the schedule's `--all`), or only
/// the targets of `only`; `fence_all`: a requested repair, which fences every target it
/// compares.
pub async fn reconcile_all(
    config: &Config,
    aggregates: &Arc<MemoryAggregates>,
    sources: &MemorySources,
    stream: &Arc<SimStream>,
    leases: &Arc<MemoryLeases>,
    fence_all: bool,
    only: Option<&Retry>,
) -> Result<Report, ReconcileError> {
    let targets = SimTargets::new(aggregates.clone(), &config.ledger_namespace);
    let consumer = SimConsumer {
        stream: stream.clone(),
        leases: leases.clone(),
        margin_ms: u64::try_from(config.reconcile_margin.as_millis()).unwrap_or(2_000),
        // Every 2 minutes: each look lists the stream and the lease table (thousands of
        // shards at 200 partitions), and idle shards are polled every 15 minutes anyway.
        poll: Duration::from_secs(120),
    };
    // Simulated time: a long wait costs nothing, and a stalled consumer is found by the oracle.
    let opts = Options { wait: Duration::from_secs(6 * 3600), attempts: 3, fence_all, ..Options::default() };
    let mut report = Report::default();
    for rule in &config.engine.rules {
        let keys = match only {
            None => None,
            Some(only) => match only.get(rule.name.as_ref()) {
                Some(keys) => Some(keys.clone()),
                None => continue,
            },
        };
        protocol::reconcile_rule(&targets, sources, &consumer, rule, keys, &opts, &mut report).await?;
    }
    Ok(report)
}
