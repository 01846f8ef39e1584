//! Reconcile on DynamoDB: the target and source tables, the state table's evidence and, on the
//! command line, a consumer of its own for shards nobody owns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity};
use aws_sdk_dynamodb::Client;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::budget::{self, ReadBudget};
use super::caught_up;
use super::protocol::{self, Applied, Consumer, Correction, Placement, Removal, SourceItems, TargetItem, TargetStore};
use super::report::{Report, Stored};
use super::truth::{insert_record, is_target, target_for, Truth};
use super::{check, refusal, Options, ReconcileError};
use crate::aws::classify;
use crate::config::Config;
use crate::decimal::Decimal;
use crate::rules::{Rule, TargetKey};
use crate::sink::dead_letter::{DeadLetters, SqsDeadLetters};
use crate::sink::derive::DeriveTarget;
use crate::sink::dynamodb::DynamoDbAggregates;
use crate::sink::expiry::ExpiryChange;
use crate::sink::ledger::Ledger;
use crate::state::dynamodb::DynamoDbLeases;
use crate::state::Lease;
use crate::state::LeaseStore;
use crate::stream::dynamodb::DynamoDbStream;
use crate::telemetry::names;
use crate::worker::{Shared, Worker};

type Item = HashMap<String, AttributeValue>;

/// Items per scan page.
const SCAN_PAGE: i32 = 500;

/// Reconcile's own consumer: its stop, its task, and what it shares with its readers.
type OwnConsumer = (CancellationToken, tokio::task::JoinHandle<()>, Arc<Shared<DynamoDbStream, DynamoDbLeases, DynamoDbAggregates>>);

pub struct Reconciler {
    ddb: Client,
    config: Config,
    /// The source table's key attributes (partition key first).
    source_keys: Vec<String>,
    leases: DynamoDbLeases,
    ledger: Ledger,
    stream: DynamoDbStream,
    stream_arn: String,
    sdk: aws_config::SdkConfig,
    /// Reads shards nobody owns itself (the command line); false inside `run`, whose own
    /// worker is the consumer.
    own_consumer: bool,
    /// Consumed read capacity per second over both tables.
    budget: Arc<ReadBudget>,
    /// Where its own consumer writes the copy rules' copies (None: no copy rules).
    copies: Option<Arc<dyn crate::sink::copy::CopyStore>>,
    pub items_read: Arc<AtomicU64>,
    /// The aggregates table's TTL attribute: a corrected helper item's expiry follows its
    /// count ([`crate::sink::expiry`]).
    expiry: Option<crate::sink::expiry::Expiry>,
}

fn to_json(item: &Item) -> Result<Map<String, Value>, ReconcileError> {
    let mut m = Map::new();
    for (k, v) in item {
        let value = crate::aws::attribute_to_json(v).map_err(|e| ReconcileError::Data(format!("attribute {k}: {e}")))?;
        m.insert(k.clone(), value);
    }
    Ok(m)
}

fn aws(doing: String) -> impl FnOnce(crate::aws::Failure) -> ReconcileError {
    move |f| ReconcileError::Aws(format!("{doing}: {f}"))
}

impl Reconciler {
    pub async fn new(sdk: &aws_config::SdkConfig, config: Config) -> Result<Reconciler, ReconcileError> {
        let ddb = Client::new(sdk);
        let desc = ddb
            .describe_table()
            .table_name(&config.source.table)
            .send()
            .await
            .map_err(|e| classify(&e))
            .map_err(aws(format!("describing source table {}", config.source.table)))?;
        let table = desc.table().ok_or_else(|| ReconcileError::Aws("DescribeTable returned no table".into()))?;
        let mut source_keys: Vec<(bool, String)> =
            table.key_schema().iter().map(|k| (k.key_type().as_str() != "HASH", k.attribute_name().to_string())).collect();
        source_keys.sort();
        let source_keys = source_keys.into_iter().map(|(_, n)| n).collect();
        let stream_arn = table.latest_stream_arn().unwrap_or_default().to_string();
        let leases = DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), stream_arn.clone());
        let ledger = Ledger::new(&config.ledger_namespace);
        let stream = DynamoDbStream::new(aws_sdk_dynamodbstreams::Client::new(sdk), stream_arn.clone());
        // A helper it raises loses its expiry; it sets none (the service does).
        let expiry = config
            .helper_expiry_attribute
            .as_deref()
            .map(|a| crate::sink::expiry::Expiry { set: false, ..crate::sink::expiry::Expiry::new(a) });
        // Its own consumer applies the copy rules too: skipping them would move checkpoints
        // past their changes.
        let copies = crate::sink::copy::dynamodb::for_config(&ddb, &config).await.map_err(|e| match e {
            crate::sink::copy::dynamodb::SetupError::Refused(m) => ReconcileError::BadInput(m),
            e => ReconcileError::Aws(e.to_string()),
        })?;
        Ok(Reconciler {
            copies,
            expiry,
            ddb,
            config,
            source_keys,
            leases,
            ledger,
            stream,
            stream_arn,
            sdk: sdk.clone(),
            own_consumer: false,
            budget: Arc::new(ReadBudget::new(None)),
            items_read: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Shards nobody owns are read by this reconciler itself (with the same leases, ledger and
    /// checkpoints as `run`), so reconcile works with the service stopped.
    pub fn with_own_consumer(mut self) -> Self {
        self.own_consumer = true;
        self
    }

    /// Limits every read of both tables to `units` of consumed read capacity per second.
    pub fn with_read_capacity(mut self, units: Option<f64>) -> Self {
        self.budget = Arc::new(ReadBudget::new(units));
        self
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// With its own consumer, reconcile needs the state table before it reads anything (a
    /// backfill before the first `run` may create it): a missing one is found before an
    /// hours-long scan, not after.
    async fn prepare_state(&self) -> Result<(), ReconcileError> {
        if !self.own_consumer {
            return Ok(());
        }
        self.leases.prepare(self.config.state.create_table).await.map_err(|e| match e {
            crate::state::StateError::TableMissing(_) => ReconcileError::BadInput(e.to_string()),
            e => ReconcileError::Aws(format!("preparing the state table: {e}")),
        })
    }

    pub async fn run(&self, opts: &Options) -> Result<Report, ReconcileError> {
        let started = Instant::now();
        let rules = check(&self.config, opts)?;
        if !opts.dry_run {
            self.prepare_state().await?;
        }
        let refused = self.config.engine.rules.iter().filter(|_| opts.rule.is_none()).filter_map(refusal).collect();
        let mut report = Report { refused, ..Report::default() };
        for rule in &rules {
            let requested: Option<BTreeSet<TargetKey>> = if opts.all { None } else { target_for(rule, &opts.vars).map(|t| [t].into()) };
            protocol::reconcile_rule(self, self, self, rule, requested, opts, &mut report).await?;
        }
        for rule in super::copy_rules(&self.config, opts) {
            let Some(store) = self.copies.as_deref() else { break };
            let sources = match opts.all {
                true => self.copy_sources(rule, opts).await?,
                false => super::copies::source_for(rule, &opts.vars).into_iter().collect(),
            };
            let pending = self.pending_copy_jobs().await?;
            super::copies::reconcile_copies(store, self, rule, &sources, &pending, opts, &mut report).await?;
        }
        Ok(self.finish(report, started))
    }

    /// Reconciles the copies of the named sources of copy rule `rule_name` (`dlq replay`).
    pub async fn run_copies(
        &self,
        rule_name: &str,
        sources: &[crate::sink::copy::ItemKey],
        opts: &Options,
    ) -> Result<Report, ReconcileError> {
        let started = Instant::now();
        let rule = self
            .config
            .engine
            .copies
            .iter()
            .find(|r| *r.name == *rule_name)
            .ok_or_else(|| ReconcileError::BadInput(format!("no copy rule {rule_name}")))?;
        let store = self.copies.as_deref().ok_or_else(|| ReconcileError::BadInput("no copy rules in this config".into()))?;
        if !opts.dry_run {
            self.prepare_state().await?;
        }
        let mut report = Report::default();
        let pending = self.pending_copy_jobs().await?;
        super::copies::reconcile_copies(store, self, rule, sources, &pending, opts, &mut report).await?;
        Ok(self.finish(report, started))
    }

    /// The ids of the copy fan-out jobs pending in the state table.
    async fn pending_copy_jobs(&self) -> Result<BTreeSet<String>, ReconcileError> {
        use crate::state::LeaseStore;
        match self.leases.copy_jobs().await {
            Ok(jobs) => Ok(jobs.iter().map(|j| j.job.id()).collect()),
            // No state table yet (a backfill before the first run): no job either.
            Err(crate::state::StateError::TableMissing(_)) => Ok(BTreeSet::new()),
            Err(e) => Err(ReconcileError::Aws(format!("listing the copy jobs: {e}"))),
        }
    }

    /// The keys of every source item of a copy rule, from a scan of the source table.
    async fn copy_sources(
        &self,
        rule: &crate::rules::copy::CopyRule,
        opts: &Options,
    ) -> Result<Vec<crate::sink::copy::ItemKey>, ReconcileError> {
        let mut out = Vec::new();
        let table = self.config.source.table.clone();
        self.scan_each(&table, opts.segments.max(1), opts.read_rate, opts.progress, |item| {
            let keys: Option<crate::sink::copy::ItemKey> =
                self.source_keys.iter().map(|k| Some((k.clone(), crate::aws::attribute_to_json(item.get(k)?).ok()?))).collect();
            if let Some(keys) = keys.filter(|k| super::copies::is_source(rule, k)) {
                out.push(keys);
            }
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Reconciles explicit targets of one rule (the schedule's "touched since the last run"),
    /// concurrently.
    pub async fn run_targets(&self, rule_name: &str, targets: BTreeSet<TargetKey>, opts: &Options) -> Result<Report, ReconcileError> {
        let started = Instant::now();
        let rule = self
            .config
            .engine
            .rules
            .iter()
            .find(|r| *r.name == *rule_name)
            .ok_or_else(|| ReconcileError::BadInput(format!("no rule {rule_name}")))?
            .clone();
        if let Some(why) = refusal(&rule) {
            return Ok(self.finish(Report { refused: vec![why], ..Report::default() }, started));
        }
        let mut report = Report::default();
        if !targets.is_empty() {
            if !opts.dry_run {
                self.prepare_state().await?;
            }
            protocol::reconcile_rule(self, self, self, &rule, Some(targets), opts, &mut report).await?;
        }
        Ok(self.finish(report, started))
    }

    fn finish(&self, mut report: Report, started: Instant) -> Report {
        report.items_read = self.items_read.load(Ordering::Relaxed);
        report.read_units = self.budget.used();
        report.elapsed = started.elapsed();
        let outcome = if report.uncorrected() == 0 { names::RunOutcome::Ok } else { names::RunOutcome::DriftRemaining };
        metrics::counter!(names::RECONCILE_RUNS, "outcome" => outcome.as_str()).increment(1);
        report
    }

    fn key_of(&self, target: &TargetKey) -> Vec<(String, AttributeValue)> {
        self.config.engine.key_names.iter().cloned().zip(target.0.iter().map(|v| AttributeValue::S(v.to_string()))).collect()
    }

    fn target_item(&self, item: Option<&Item>) -> TargetItem {
        let Some(item) = item else { return TargetItem::default() };
        let mut t = TargetItem { exists: true, ..Default::default() };
        t.version = item.get(&self.ledger.version_attribute()).and_then(|v| v.as_n().ok()).cloned();
        if let Some(AttributeValue::Ss(names)) = item.get(&self.ledger.measures_attribute()) {
            t.written = names.iter().cloned().collect();
        }
        t.floor = item.get(&self.ledger.floor_attribute()).and_then(|v| v.as_s().ok()).cloned();
        t.shared = item.keys().any(|k| k.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) && !self.ledger.is_own(k));
        t.hold = item.get(&self.ledger.hold_attribute()).and_then(|v| v.as_s().ok()).cloned();
        let log_prefix = self.ledger.log_prefix();
        t.logs = item
            .iter()
            .filter(|(k, _)| k.starts_with(&log_prefix))
            .filter_map(|(k, v)| Some((k.clone(), v.as_s().ok()?.clone())))
            .collect();
        let keys = &self.config.engine.key_names;
        for (k, v) in item.iter().filter(|(k, _)| !k.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) && !keys.contains(k)) {
            let stored = match v {
                AttributeValue::N(n) => Decimal::parse(n).map(Stored::Number).unwrap_or_else(|_| Stored::Other(n.clone())),
                AttributeValue::S(s) => Stored::Other(s.clone()),
                other => Stored::Other(format!("{other:?}")),
            };
            t.values.insert(k.clone(), stored);
        }
        t
    }

    /// A strongly consistent parallel scan, streamed page by page into `each` (memory holds a
    /// few pages, not the table), rate-limited, with progress and an ETA on stderr.
    async fn scan_each(
        &self,
        table: &str,
        segments: u32,
        rate: Option<u32>,
        progress: bool,
        mut each: impl FnMut(&Item) -> Result<(), ReconcileError> + Send,
    ) -> Result<(), ReconcileError> {
        let started = Instant::now();
        let expected = if progress { self.item_count(table).await } else { None };
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<Item>>(segments as usize * 2);
        let mut tasks = Vec::new();
        for segment in 0..segments {
            let (ddb, table, tx, budget) = (self.ddb.clone(), table.to_string(), tx.clone(), self.budget.clone());
            let per_segment = rate.map(|r| (f64::from(r) / f64::from(segments)).max(1.0));
            tasks.push(tokio::spawn(async move {
                let mut start: Option<Item> = None;
                let mut read = 0usize;
                let seg_started = Instant::now();
                for _ in 0..10_000_000 {
                    let page = ddb
                        .scan()
                        .table_name(&table)
                        .consistent_read(true)
                        .segment(i32::try_from(segment).unwrap_or(0))
                        .total_segments(i32::try_from(segments).unwrap_or(1))
                        .limit(SCAN_PAGE)
                        .set_exclusive_start_key(start.take())
                        .return_consumed_capacity(ReturnConsumedCapacity::Total)
                        .send()
                        .await
                        .map_err(|e| classify(&e))
                        .map_err(aws(format!("scanning {table}")))?;
                    read += page.items().len();
                    budget.spend(budget::units(page.consumed_capacity().and_then(|c| c.capacity_units()), page.items().len())).await;
                    let next = page.last_evaluated_key().filter(|k| !k.is_empty()).cloned();
                    if tx.send(page.items().to_vec()).await.is_err() {
                        return Ok(());
                    }
                    if let Some(r) = per_segment {
                        // Stay at or below the read rate: sleep until this segment's budget allows.
                        let due = Duration::from_secs_f64(read as f64 / r);
                        if let Some(wait) = due.checked_sub(seg_started.elapsed()) {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    match next {
                        Some(k) => start = Some(k),
                        None => return Ok::<_, ReconcileError>(()),
                    }
                }
                Err(ReconcileError::Aws(format!("scanning {table} did not finish")))
            }));
        }
        drop(tx);
        let mut shown = Progress::new(started, expected, progress);
        let mut failed = None;
        while let Some(page) = rx.recv().await {
            self.items_read.fetch_add(page.len() as u64, Ordering::Relaxed);
            shown.add(page.len() as u64);
            for item in &page {
                if let Err(e) = each(item) {
                    failed.get_or_insert(e);
                }
            }
        }
        shown.done();
        for t in tasks {
            match t.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(ReconcileError::Aws(e.to_string()));
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// DescribeTable's item count (updated about every 6 hours on AWS): the progress bar's
    /// estimate.
    async fn item_count(&self, table: &str) -> Option<u64> {
        let out = self.ddb.describe_table().table_name(table).send().await.ok()?;
        out.table()?.item_count().and_then(|n| u64::try_from(n).ok()).filter(|n| *n > 0)
    }

    /// Waits until every shard has applied the records created before `after_ms` plus the
    /// margin ([`super::caught_up`]). Shards nobody owns are read by a consumer of our own, when
    /// allowed; a live owner is waited for up to `max` without progress.
    /// Whether the stream this reconciler waits on is the source table's stream now (a
    /// DescribeTable; true when it cannot tell, as the watcher keeps its stream then).
    pub async fn reads_the_current_stream(&self) -> bool {
        let desc = self.ddb.describe_table().table_name(&self.config.source.table).send().await;
        let latest = desc.ok().and_then(|d| d.table().and_then(|t| t.latest_stream_arn().map(str::to_string)));
        latest.is_none_or(|l| l == self.stream_arn)
    }

    async fn wait_for_consumer(&self, after_ms: u64, max: Duration) -> Result<Applied, ReconcileError> {
        let target = after_ms + u64::try_from(self.config.reconcile_margin.as_millis()).unwrap_or(u64::MAX / 4);
        let mut consumer: Option<OwnConsumer> = None;
        let result = self.wait_for_evidence(target, max, &mut consumer).await;
        if let Some((stop, task, folds)) = consumer {
            // It finishes its batch, checkpoints and releases its leases for `run`, and the
            // sharded totals it wrote are folded (`run` may not be running).
            stop.cancel();
            let _ = task.await;
            crate::worker::fold::fold_round(self, &folds.folds, crate::state::now_ms()).await;
        }
        result
    }

    async fn wait_for_evidence(&self, target: u64, max: Duration, consumer: &mut Option<OwnConsumer>) -> Result<Applied, ReconcileError> {
        let started = Instant::now();
        let mut last_progress = started;
        let mut last_seen: Option<Vec<Lease>> = None;
        loop {
            let caught_up::Standing { behind, leases, fence_ms, by_empty_pages } =
                caught_up::standing(&self.stream, &self.leases, target).await?;
            if behind.is_empty() {
                return Ok(Applied { fence_ms, by_empty_pages });
            }
            if consumer.is_none() && self.own_consumer && caught_up::needs_a_consumer(&behind) {
                info!(shards = behind.iter().filter(|b| b.owner.is_none()).count(), "no live owner for some shards; reading them");
                *consumer = Some(self.start_consumer());
            }
            // Any checkpoint moving counts as progress: the wait is for a consumer that stalled.
            let seen: Vec<Lease> = behind.iter().filter_map(|b| leases.get(&b.shard_id).cloned()).collect();
            if last_seen.as_ref() != Some(&seen) {
                last_seen = Some(seen);
                last_progress = Instant::now();
            }
            // A consumer that progresses is waited for, up to ten times `max` in all.
            if last_progress.elapsed() > max || started.elapsed() > max * 10 {
                let names: Vec<String> = behind
                    .iter()
                    .map(|b| match &b.owner {
                        Some(o) => format!("{} (owner {o})", b.shard_id),
                        None => format!("{} (no owner)", b.shard_id),
                    })
                    .collect();
                return Err(ReconcileError::NotCaughtUp(format!(
                    "the stream consumer has not applied every record written before this reconcile: no progress for {}s, or {}s in all (shards behind: {})",
                    max.as_secs(),
                    max.as_secs() * 10,
                    names.join(", ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A worker over the same state table that takes only leases nobody holds.
    fn start_consumer(&self) -> OwnConsumer {
        let ddb = self.ddb.clone();
        let leases = DynamoDbLeases::new(ddb.clone(), self.config.state.table.clone(), self.stream_arn.clone());
        let sink = Arc::new(DynamoDbAggregates::new(ddb, self.config.aggregates_table.clone()));
        let dead_letters = match &self.config.dead_letter {
            Some(d) => DeadLetters::Sqs(SqsDeadLetters::new(aws_sdk_sqs::Client::new(&self.sdk), d.queue_url.clone(), d.include_images)),
            None => DeadLetters::Disabled,
        };
        let owner = format!("reconcile-{}", crate::worker::replica_id());
        let shared =
            Shared::new(self.config.clone(), self.stream.clone(), leases, sink, owner, Arc::new(crate::telemetry::Health::default()))
                .with_dead_letters(dead_letters, self.stream_arn.clone())
                .without_balancing()
                .reading_from_the_horizon();
        let shared = match &self.copies {
            Some(store) => shared.with_copies(store.clone()),
            None => shared,
        };
        let stop = CancellationToken::new();
        let worker = Worker::new(shared);
        let shared = worker.shared().clone();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = worker.run(token).await {
                tracing::warn!(error = %e, "reconcile's own consumer stopped");
            }
        });
        (stop, task, shared)
    }
}

/// Scan progress on stderr: a bar with an ETA on a terminal, a line every 10 s otherwise.
struct Progress {
    started: Instant,
    expected: Option<u64>,
    enabled: bool,
    tty: bool,
    seen: u64,
    last: Instant,
}

impl Progress {
    fn new(started: Instant, expected: Option<u64>, enabled: bool) -> Progress {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        Progress { started, expected, enabled, tty, seen: 0, last: started }
    }

    fn add(&mut self, n: u64) {
        self.seen += n;
        let every = if self.tty { Duration::from_millis(200) } else { Duration::from_secs(10) };
        if self.enabled && self.last.elapsed() >= every {
            self.last = Instant::now();
            self.show(false);
        }
    }

    fn done(&mut self) {
        if self.enabled {
            self.show(true);
        }
    }

    fn show(&self, done: bool) {
        let line = progress_line(self.seen, self.expected, self.started.elapsed(), done);
        if self.tty {
            eprint!("\r{line}   ");
            if done {
                eprintln!();
            }
        } else {
            eprintln!("reconcile: {line}");
        }
    }
}

/// One progress line (pure): items, rate, and with an expected total, a bar and an ETA.
pub fn progress_line(seen: u64, expected: Option<u64>, elapsed: Duration, done: bool) -> String {
    let secs = elapsed.as_secs_f64().max(0.001);
    let rate = seen as f64 / secs;
    if done {
        return format!("scanned {seen} items in {secs:.1}s ({rate:.0}/s)");
    }
    match expected {
        Some(total) if total > 0 => {
            let part = (seen as f64 / total as f64).min(1.0);
            let filled = (part * 20.0).round() as usize;
            let eta = if rate > 0.0 { (total.saturating_sub(seen)) as f64 / rate } else { 0.0 };
            format!(
                "[{}{}] {seen}/~{total} items ({:.0}%), {rate:.0}/s, ETA {}:{:02}",
                "#".repeat(filled),
                ".".repeat(20 - filled),
                part * 100.0,
                (eta as u64) / 60,
                (eta as u64) % 60
            )
        }
        _ => format!("scanned {seen} items ({rate:.0}/s)"),
    }
}

impl TargetStore for Reconciler {
    async fn read(&self, key: &TargetKey) -> Result<TargetItem, ReconcileError> {
        let mut req = self
            .ddb
            .get_item()
            .table_name(&self.config.aggregates_table)
            .consistent_read(true)
            .return_consumed_capacity(ReturnConsumedCapacity::Total);
        for (k, v) in self.key_of(key) {
            req = req.key(k, v);
        }
        let out = req.send().await.map_err(|e| classify(&e)).map_err(aws(format!("reading target {:?}", key.0)))?;
        self.budget.spend(budget::units(out.consumed_capacity().and_then(|c| c.capacity_units()), 1)).await;
        Ok(self.target_item(out.item()))
    }

    async fn scan(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let key_names = self.config.engine.key_names.clone();
        let mut out = BTreeMap::new();
        self.scan_each(&self.config.aggregates_table, 1, None, false, |item| {
            let key: Option<Vec<&str>> = key_names.iter().map(|k| item.get(k).and_then(|v| v.as_s().ok()).map(String::as_str)).collect();
            if let Some(key) = key.filter(|k| is_target(rule, k)) {
                out.insert(TargetKey(key.iter().map(|s| Box::from(*s)).collect()), self.target_item(Some(item)));
            }
            Ok(())
        })
        .await?;
        Ok(out)
    }

    async fn correct(&self, key: &TargetKey, c: &Correction) -> Result<bool, ReconcileError> {
        let mut req = self.ddb.update_item().table_name(&self.config.aggregates_table);
        for (k, v) in self.key_of(key) {
            req = req.key(k, v);
        }
        let mut sets = Vec::new();
        for (i, (name, value)) in c.set.iter().enumerate() {
            sets.push(format!("#a{i} = :a{i}"));
            req = req
                .expression_attribute_names(format!("#a{i}"), name)
                .expression_attribute_values(format!(":a{i}"), AttributeValue::N(value.to_string()));
        }
        if let Some(fence) = &c.fence {
            // The straggler set empties: every straggler was created before the old floor.
            sets.push("#f = :f, #o = :o".to_string());
            req = req
                .expression_attribute_names("#f", self.ledger.floor_attribute())
                .expression_attribute_names("#o", self.ledger.open_attribute())
                .expression_attribute_values(":f", AttributeValue::S(fence.clone()))
                .expression_attribute_values(":o", AttributeValue::S(",".into()));
        }
        let mut adds = vec!["#v :one"];
        req = req
            .expression_attribute_names("#v", self.ledger.version_attribute())
            .expression_attribute_values(":one", AttributeValue::N("1".into()));
        if !c.set.is_empty() {
            // A string set cannot be empty: a fence alone adds no measure names.
            adds.push("#w :w");
            req = req
                .expression_attribute_names("#w", self.ledger.measures_attribute())
                .expression_attribute_values(":w", AttributeValue::Ss(c.set.iter().map(|(n, _)| n.clone()).collect()));
        }
        req = if !c.expect.is_empty() {
            let mut conds = vec!["attribute_exists(#v)".to_string()];
            for (i, (name, value)) in c.expect.iter().enumerate() {
                conds.push(format!("#e{i} = :e{i}"));
                req = req
                    .expression_attribute_names(format!("#e{i}"), name)
                    .expression_attribute_values(format!(":e{i}"), AttributeValue::N(value.to_string()));
            }
            req.condition_expression(conds.join(" AND "))
        } else {
            match &c.seen_version {
                Some(v) => req.condition_expression("#v = :seen").expression_attribute_values(":seen", AttributeValue::N(v.clone())),
                None => req.condition_expression("attribute_not_exists(#v)"),
            }
        };
        let mut removes = Vec::new();
        if let Some(r) = &c.release {
            // A held target's correction: only while its hold stands, which it ends.
            removes.push("#h".to_string());
            req = req
                .expression_attribute_names("#h", self.ledger.hold_attribute())
                .expression_attribute_values(":h", AttributeValue::S(r.hold.clone()));
            for (i, name) in r.logs.iter().enumerate() {
                removes.push(format!("#z{i}"));
                req = req.expression_attribute_names(format!("#z{i}"), name);
            }
            let condition = req.get_condition_expression().clone().unwrap_or_default();
            req = req.condition_expression(format!("({condition}) AND #h = :h"));
        }
        match crate::sink::expiry::after_correction(self.expiry.as_ref(), key, &c.set, crate::state::now_ms()) {
            Some(ExpiryChange::Set { attribute, at }) => {
                sets.push("#x = :x".to_string());
                req = req.expression_attribute_names("#x", attribute).expression_attribute_values(":x", AttributeValue::N(at.to_string()));
            }
            Some(ExpiryChange::Remove { attribute }) => {
                removes.push("#x".to_string());
                req = req.expression_attribute_names("#x", attribute);
            }
            None => {}
        }
        let set = if sets.is_empty() { String::new() } else { format!("SET {} ", sets.join(", ")) };
        let remove = if removes.is_empty() { String::new() } else { format!(" REMOVE {}", removes.join(", ")) };
        match req.update_expression(format!("{set}ADD {}{remove}", adds.join(", "))).send().await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(false),
            Err(e) => Err(ReconcileError::Aws(format!("correcting {:?}: {}", key.0, classify(&e)))),
        }
    }

    async fn helpers(&self, rule: &Rule, owner: &TargetKey) -> Result<BTreeMap<TargetKey, TargetItem>, ReconcileError> {
        let key_names = &self.config.engine.key_names;
        let ([pk_name, sk_name], [pk, sk]) = (key_names.as_slice(), &*owner.0) else { return Ok(BTreeMap::new()) };
        let prefix = format!("{sk}{}", crate::rules::helper::MARK);
        let mut out = BTreeMap::new();
        let mut start = None;
        for _ in 0..1_000_000 {
            let page = self
                .ddb
                .query()
                .table_name(&self.config.aggregates_table)
                .consistent_read(true)
                .key_condition_expression("#pk = :pk AND begins_with(#sk, :prefix)")
                .expression_attribute_names("#pk", pk_name)
                .expression_attribute_names("#sk", sk_name)
                .expression_attribute_values(":pk", AttributeValue::S(pk.to_string()))
                .expression_attribute_values(":prefix", AttributeValue::S(prefix.clone()))
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| classify(&e))
                .map_err(aws(format!("querying the helper items of {:?}", owner.0)))?;
            self.budget.spend(budget::units(page.consumed_capacity().and_then(|c| c.capacity_units()), page.items().len())).await;
            for item in page.items() {
                let Some(helper_sk) = item.get(sk_name).and_then(|v| v.as_s().ok()) else { continue };
                if is_target(rule, &[&**pk, helper_sk.as_str()]) {
                    out.insert(TargetKey([pk.clone(), Box::from(helper_sk.as_str())].into()), self.target_item(Some(item)));
                }
            }
            match page.last_evaluated_key().filter(|k| !k.is_empty()) {
                Some(k) => start = Some(k.clone()),
                None => return Ok(out),
            }
        }
        Err(ReconcileError::Aws(format!("querying the helper items of {:?} did not end", owner.0)))
    }

    async fn derive(&self, key_names: &[String], target: &DeriveTarget) -> Result<(), ReconcileError> {
        let store = DynamoDbAggregates::new(self.ddb.clone(), self.config.aggregates_table.clone());
        let stats = crate::sink::derive::derive_target(&store, key_names, &self.ledger, target, self.expiry.as_ref()).await;
        if let Ok(s) = &stats {
            // Its counter reads and helper queries come out of the same read budget.
            self.budget.spend(s.read_capacity).await;
        }
        stats
            .and_then(crate::sink::derive::DeriveStats::refused_as_error)
            .map_err(|e| ReconcileError::Aws(format!("deriving {:?}: {e}", target.key.0)))
    }

    async fn remove(&self, key: &TargetKey, r: &Removal) -> Result<bool, ReconcileError> {
        let version = self.ledger.version_attribute();
        let sent = match r {
            Removal::Item { seen_version } => {
                let mut req = self
                    .ddb
                    .delete_item()
                    .table_name(&self.config.aggregates_table)
                    .condition_expression("#v = :seen")
                    .expression_attribute_names("#v", version)
                    .expression_attribute_values(":seen", AttributeValue::N(seen_version.clone()));
                for (k, v) in self.key_of(key) {
                    req = req.key(k, v);
                }
                req.send().await.map(|_| ()).map_err(|e| {
                    let refused = matches!(e.as_service_error(), Some(DeleteItemError::ConditionalCheckFailedException(_)));
                    (refused, classify(&e))
                })
            }
            Removal::Attributes(names) => {
                let mut req = self.ddb.update_item().table_name(&self.config.aggregates_table);
                for (k, v) in self.key_of(key) {
                    req = req.key(k, v);
                }
                let mut conds = vec!["attribute_exists(#v)".to_string()];
                let mut removes = Vec::new();
                for (i, name) in names.iter().enumerate() {
                    conds.push(format!("#r{i} = :zero"));
                    removes.push(format!("#r{i}"));
                    req = req.expression_attribute_names(format!("#r{i}"), name);
                }
                req = req
                    .expression_attribute_names("#v", version)
                    .expression_attribute_names("#w", self.ledger.measures_attribute())
                    .expression_attribute_values(":zero", AttributeValue::N("0".into()))
                    .expression_attribute_values(":one", AttributeValue::N("1".into()))
                    .expression_attribute_values(":w", AttributeValue::Ss(names.clone()))
                    .condition_expression(conds.join(" AND "))
                    .update_expression(format!("REMOVE {} ADD #v :one DELETE #w :w", removes.join(", ")));
                req.send().await.map(|_| ()).map_err(|e| {
                    let refused = matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_)));
                    (refused, classify(&e))
                })
            }
        };
        match sent {
            Ok(()) => Ok(true),
            Err((true, _)) => Ok(false),
            Err((false, e)) => Err(ReconcileError::Aws(format!("removing leftovers of {:?}: {e}", key.0))),
        }
    }

    async fn fold(&self, key: &TargetKey, values: &[(String, Decimal)], seq: Decimal) -> Result<bool, ReconcileError> {
        // At most 100 attributes a write (an expression stays far below 4 KB): the first write
        // takes the sequence, the others land only while it is still this fold's.
        let chunks: Vec<&[(String, Decimal)]> =
            if values.is_empty() { vec![values] } else { values.chunks(protocol::MAX_SET_PER_CORRECTION).collect() };
        for (n, chunk) in chunks.into_iter().enumerate() {
            let mut req = self.ddb.update_item().table_name(&self.config.aggregates_table);
            for (k, v) in self.key_of(key) {
                req = req.key(k, v);
            }
            let mut sets = vec!["#s = :s".to_string()];
            req = req
                .expression_attribute_names("#s", self.ledger.fold_attribute())
                .expression_attribute_values(":s", AttributeValue::N(seq.to_string()));
            for (i, (name, value)) in chunk.iter().enumerate() {
                sets.push(format!("#a{i} = :a{i}"));
                req = req
                    .expression_attribute_names(format!("#a{i}"), name)
                    .expression_attribute_values(format!(":a{i}"), AttributeValue::N(value.to_string()));
            }
            let condition = if n == 0 { "attribute_not_exists(#s) OR #s < :s" } else { "#s = :s" };
            match req.update_expression(format!("SET {}", sets.join(", "))).condition_expression(condition).send().await {
                Ok(_) => {}
                Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => return Ok(false),
                Err(e) => return Err(ReconcileError::Aws(format!("folding {:?}: {}", key.0, classify(&e)))),
            }
        }
        Ok(true)
    }

    async fn reset_fold(&self, key: &TargetKey, zero: &[String]) -> Result<bool, ReconcileError> {
        let mut req = self.ddb.update_item().table_name(&self.config.aggregates_table);
        for (k, v) in self.key_of(key) {
            req = req.key(k, v);
        }
        req = req.expression_attribute_names("#s", self.ledger.fold_attribute());
        let mut sets = Vec::new();
        for (i, name) in zero.iter().take(protocol::MAX_SET_PER_CORRECTION).enumerate() {
            sets.push(format!("#a{i} = :zero"));
            req = req.expression_attribute_names(format!("#a{i}"), name);
        }
        if !sets.is_empty() {
            req = req.expression_attribute_values(":zero", AttributeValue::N("0".into()));
        }
        let set = if sets.is_empty() { String::new() } else { format!("SET {} ", sets.join(", ")) };
        match req.update_expression(format!("{set}REMOVE #s")).condition_expression("attribute_exists(#s)").send().await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(false),
            Err(e) => Err(ReconcileError::Aws(format!("resetting the total {:?}: {}", key.0, classify(&e)))),
        }
    }

    async fn hold(&self, key: &TargetKey, p: &Placement) -> Result<bool, ReconcileError> {
        let mut req = self
            .ddb
            .update_item()
            .table_name(&self.config.aggregates_table)
            .expression_attribute_names("#v", self.ledger.version_attribute())
            .expression_attribute_names("#h", self.ledger.hold_attribute())
            .expression_attribute_values(":h", AttributeValue::S(p.value.clone()));
        for (k, v) in self.key_of(key) {
            req = req.key(k, v);
        }
        req = match &p.seen {
            Some(seen) => req
                .condition_expression("attribute_exists(#v) AND #h = :seen")
                .expression_attribute_values(":seen", AttributeValue::S(seen.clone())),
            None => req.condition_expression("attribute_exists(#v) AND attribute_not_exists(#h)"),
        };
        let mut removes = Vec::new();
        for (i, name) in p.stale.iter().enumerate() {
            removes.push(format!("#z{i}"));
            req = req.expression_attribute_names(format!("#z{i}"), name);
        }
        let remove = if removes.is_empty() { String::new() } else { format!(" REMOVE {}", removes.join(", ")) };
        match req.update_expression(format!("SET #h = :h{remove}")).send().await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(false),
            Err(e) => Err(ReconcileError::Aws(format!("placing a hold on {:?}: {}", key.0, classify(&e)))),
        }
    }
}

impl SourceItems for Reconciler {
    async fn query(&self, rule: &Rule, pk: &str, sk_prefix: Option<&str>, truth: &mut Truth) -> Result<(), ReconcileError> {
        let pk_name = &self.source_keys[0];
        let table = &self.config.source.table;
        let mut start: Option<Item> = None;
        for _ in 0..1_000_000 {
            let mut req = self
                .ddb
                .query()
                .table_name(table)
                .consistent_read(true)
                .return_consumed_capacity(ReturnConsumedCapacity::Total)
                .expression_attribute_names("#pk", pk_name)
                .expression_attribute_values(":pk", AttributeValue::S(pk.to_string()))
                .set_exclusive_start_key(start.take());
            req = match (sk_prefix, self.source_keys.get(1)) {
                (Some(prefix), Some(sk_name)) => req
                    .key_condition_expression("#pk = :pk AND begins_with(#sk, :sk)")
                    .expression_attribute_names("#sk", sk_name)
                    .expression_attribute_values(":sk", AttributeValue::S(prefix.to_string())),
                _ => req.key_condition_expression("#pk = :pk"),
            };
            let page = req.send().await.map_err(|e| classify(&e)).map_err(aws(format!("querying {table}")))?;
            self.items_read.fetch_add(page.items().len() as u64, Ordering::Relaxed);
            self.budget.spend(budget::units(page.consumed_capacity().and_then(|c| c.capacity_units()), page.items().len())).await;
            for item in page.items() {
                if let Some(record) = insert_record(&self.source_keys, to_json(item)?) {
                    truth.add_record(rule, &record);
                }
            }
            match page.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => return Ok(()),
            }
        }
        Err(ReconcileError::Aws(format!("querying {table} did not finish")))
    }

    async fn scan(&self, rule: &Rule, opts: &Options, truth: &mut Truth) -> Result<(), ReconcileError> {
        let keys = self.source_keys.clone();
        self.scan_each(&self.config.source.table, opts.segments.max(1), opts.read_rate, opts.progress && opts.all, |item| {
            if let Some(record) = insert_record(&keys, to_json(item)?) {
                truth.add_record(rule, &record);
            }
            Ok(())
        })
        .await
    }
}

impl Consumer for Reconciler {
    async fn applied_before(&self, after_ms: u64, wait: Duration) -> Result<Applied, ReconcileError> {
        self.wait_for_consumer(after_ms, wait).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines() {
        let s = Duration::from_secs(10);
        assert_eq!(progress_line(500, Some(2000), s, false), "[#####...............] 500/~2000 items (25%), 50/s, ETA 0:30");
        assert_eq!(progress_line(500, None, s, false), "scanned 500 items (50/s)");
        assert_eq!(progress_line(2500, Some(2000), s, false), "[####################] 2500/~2000 items (100%), 250/s, ETA 0:00");
        assert_eq!(progress_line(500, Some(2000), s, true), "scanned 500 items in 10.0s (50/s)");
    }
}
