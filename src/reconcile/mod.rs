//! Reconcile: recompute the truth from the source items and repair drift, without ever
//! introducing drift while the stream keeps writing.
//!
//! Per rule: (1) snapshot the target items, ledger included; (2) read the truth (strongly
//! consistent Query, or a parallel Scan); (3) wait until the stream consumer has applied
//! everything created before the truth was read (state table: each shard at its tip, or past
//! that time); (4) read each target again: if its ledger changed since the snapshot, a record
//! was applied meanwhile and the comparison would be unsound, so retry later; otherwise the
//! stored values reflect exactly the records created before the truth read, and any
//! difference is real drift, corrected with a write conditioned on the ledger being unchanged.
//! (This orders the snapshot before the truth read instead of comparing record timestamps,
//! which DynamoDB Local rounds to the minute.)

pub mod schedule;
pub mod truth;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use serde_json::{Map, Value};
use tracing::info;

use crate::aws::classify;
use crate::config::Config;
use crate::decimal::Decimal;
use crate::rules::{ReconcileSource, Rule, TargetKey};
use crate::sink::ledger::ENTRY_PREFIX;
use crate::state::dynamodb::DynamoDbLeases;
use crate::state::{now_ms, LeaseStore};
use crate::telemetry::names;
use truth::{is_target, owns_attribute, target_for, Truth};

/// What to reconcile and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// Variable values (`--customer c1`): reconcile the targets they determine.
    pub vars: BTreeMap<String, String>,
    /// Every target, from a full scan (also the initial backfill).
    pub all: bool,
    pub rule: Option<String>,
    pub dry_run: bool,
    pub segments: u32,
    /// Items per second across all scan segments; None: unlimited.
    pub read_rate: Option<u32>,
    /// Longest wait for the consumer to catch up.
    pub wait: Duration,
    /// Skip the wait (no consumer will ever read this stream).
    pub no_wait: bool,
    /// Rounds for a target whose ledger keeps changing.
    pub attempts: u32,
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            vars: BTreeMap::new(),
            all: false,
            rule: None,
            dry_run: false,
            segments: 4,
            read_rate: None,
            wait: Duration::from_secs(60),
            no_wait: false,
            attempts: 5,
            progress: false,
        }
    }
}

/// A stored attribute: its number, or the text of a value that is not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    Missing,
    Number(Decimal),
    Other(String),
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stored::Missing => f.write_str("-"),
            Stored::Number(n) => write!(f, "{n}"),
            Stored::Other(s) => write!(f, "{s:?}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Drift {
    pub rule: String,
    pub target: TargetKey,
    pub attribute: String,
    pub stored: Stored,
    pub truth: Decimal,
    pub corrected: bool,
}

impl Drift {
    pub fn difference(&self) -> Option<Decimal> {
        match &self.stored {
            Stored::Missing => Some(self.truth),
            Stored::Number(n) => self.truth.checked_sub(*n).ok(),
            Stored::Other(_) => None,
        }
    }
}

#[derive(Debug, Default)]
pub struct Report {
    pub drifts: Vec<Drift>,
    /// Targets whose ledger kept changing: reported, not forced.
    pub not_quiet: Vec<(String, TargetKey)>,
    pub items_read: u64,
    pub targets_checked: u64,
    pub poisons: u64,
    pub elapsed: Duration,
}

impl Report {
    pub fn uncorrected(&self) -> usize {
        self.drifts.iter().filter(|d| !d.corrected).count() + self.not_quiet.len()
    }
}

/// A target item as read: its owned numeric attributes and its ledger.
#[derive(Debug, Clone, Default, PartialEq)]
struct Snapshot {
    exists: bool,
    values: BTreeMap<String, Stored>,
    ledger: BTreeMap<String, String>,
}

pub struct Reconciler {
    ddb: Client,
    config: Config,
    /// The source table's key attributes (partition key first).
    source_keys: Vec<String>,
    leases: DynamoDbLeases,
    pub items_read: Arc<AtomicU64>,
}

type Item = HashMap<String, AttributeValue>;

fn to_json(item: &Item) -> Result<Map<String, Value>, String> {
    let mut m = Map::new();
    for (k, v) in item {
        m.insert(k.clone(), crate::aws::attribute_to_json(v).map_err(|e| format!("attribute {k}: {e}"))?);
    }
    Ok(m)
}

impl Reconciler {
    pub async fn new(ddb: Client, config: Config) -> Result<Reconciler, String> {
        let desc = ddb
            .describe_table()
            .table_name(&config.source.table)
            .send()
            .await
            .map_err(|e| format!("describing source table {}: {}", config.source.table, classify(&e)))?;
        let table = desc.table().ok_or("DescribeTable returned no table")?;
        let mut source_keys: Vec<(bool, String)> =
            table.key_schema().iter().map(|k| (k.key_type().as_str() != "HASH", k.attribute_name().to_string())).collect();
        source_keys.sort();
        let source_keys = source_keys.into_iter().map(|(_, n)| n).collect();
        let stream_arn = table.latest_stream_arn().unwrap_or_default().to_string();
        let leases = DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), stream_arn);
        Ok(Reconciler { ddb, config, source_keys, leases, items_read: Arc::new(AtomicU64::new(0)) })
    }

    /// Checks options against the config before any request: known rule, variables that
    /// form keys (no `#`, not empty), and at least one target determined.
    pub fn check(config: &Config, opts: &Options) -> Result<Vec<Rule>, String> {
        let known: BTreeSet<String> = config.target_variables();
        for (k, v) in &opts.vars {
            if !known.contains(k) {
                return Err(format!(
                    "--{k}: no rule's target uses {{{k}}} (variables: {})",
                    known.iter().map(|v| format!("--{v}")).collect::<Vec<_>>().join(" ")
                ));
            }
            if v.is_empty() || v.contains(crate::rules::template::DELIMITER) {
                return Err(format!("--{k} {v:?}: a key part may not be empty or contain '#'"));
            }
        }
        let mut rules: Vec<Rule> = config.engine.rules.clone();
        if let Some(name) = &opts.rule {
            rules.retain(|r| *r.name == **name);
            if rules.is_empty() {
                return Err(format!(
                    "--rule {name}: no such rule (rules: {})",
                    config.engine.rules.iter().map(|r| r.name.to_string()).collect::<Vec<_>>().join(", ")
                ));
            }
        }
        if opts.all {
            if !opts.vars.is_empty() {
                return Err("--all reconciles every target; leave out the variable flags".into());
            }
            return Ok(rules);
        }
        if opts.vars.is_empty() {
            return Err("say what to reconcile: variable flags (e.g. --customer c1) or --all".into());
        }
        rules.retain(|r| target_for(r, &opts.vars).is_some());
        if rules.is_empty() {
            return Err(format!(
                "no rule's target is determined by {}",
                opts.vars.keys().map(|k| format!("--{k}")).collect::<Vec<_>>().join(" ")
            ));
        }
        Ok(rules)
    }

    pub async fn run(&self, opts: &Options) -> Result<Report, String> {
        let started = Instant::now();
        let rules = Reconciler::check(&self.config, opts)?;
        let mut report = Report::default();
        for rule in &rules {
            let requested: Option<BTreeSet<TargetKey>> = if opts.all { None } else { target_for(rule, &opts.vars).map(|t| [t].into()) };
            self.reconcile_rule(rule, requested, opts, &mut report).await?;
        }
        self.finish(report, started)
    }

    /// Reconciles explicit targets of one rule (the schedule's "touched since the last run").
    pub async fn run_targets(&self, rule_name: &str, targets: BTreeSet<TargetKey>, opts: &Options) -> Result<Report, String> {
        let started = Instant::now();
        let rule = self.config.engine.rules.iter().find(|r| *r.name == *rule_name).ok_or_else(|| format!("no rule {rule_name}"))?.clone();
        let mut report = Report::default();
        // Query rules read each target's own partition; scan rules share one scan.
        if matches!(rule.reconcile, ReconcileSource::Query { .. }) {
            for t in targets {
                self.reconcile_rule(&rule, Some([t].into()), opts, &mut report).await?;
            }
        } else if !targets.is_empty() {
            self.reconcile_rule(&rule, Some(targets), opts, &mut report).await?;
        }
        self.finish(report, started)
    }

    fn finish(&self, mut report: Report, started: Instant) -> Result<Report, String> {
        report.items_read = self.items_read.load(Ordering::Relaxed);
        report.elapsed = started.elapsed();
        let outcome = if report.uncorrected() == 0 { "ok" } else { "drift_remaining" };
        metrics::counter!(names::RECONCILE_RUNS, "outcome" => outcome).increment(1);
        if outcome == "ok" {
            metrics::gauge!(names::RECONCILE_LAST_SUCCESS).set(now_ms() as f64 / 1000.0);
        }
        Ok(report)
    }

    async fn reconcile_rule(
        &self,
        rule: &Rule,
        requested: Option<BTreeSet<TargetKey>>,
        opts: &Options,
        report: &mut Report,
    ) -> Result<(), String> {
        let mut pending = requested;
        for round in 0..opts.attempts.max(1) {
            // (1) Snapshot the targets, before the truth is read.
            let snapshots: BTreeMap<TargetKey, Snapshot> = match &pending {
                Some(targets) => {
                    let mut m = BTreeMap::new();
                    for t in targets {
                        m.insert(t.clone(), self.read_target(rule, t).await?);
                    }
                    m
                }
                None => self.scan_targets(rule).await?,
            };
            // (2) The truth.
            let truth_read_at = now_ms();
            let truth = self.truth(rule, &pending, opts).await?;
            let truth_done_at = now_ms();
            report.poisons += truth.poisons.len() as u64;
            // (3) Wait for the consumer to apply everything created before the truth read.
            if !opts.dry_run && !opts.no_wait {
                self.wait_for_consumer(truth_done_at.max(truth_read_at), opts.wait).await?;
            }
            // (4) Compare and correct, target by target.
            let mut keys: BTreeSet<TargetKey> = snapshots.keys().cloned().collect();
            keys.extend(truth.values.keys().cloned());
            if let Some(p) = &pending {
                keys.retain(|k| p.contains(k));
            }
            let mut hot = BTreeSet::new();
            let known_entries = self.known_entries().await;
            for key in keys {
                report.targets_checked += 1;
                let before = snapshots.get(&key).cloned().unwrap_or_default();
                let now = self.read_target(rule, &key).await?;
                if !opts.dry_run && now.ledger != before.ledger {
                    hot.insert(key);
                    continue;
                }
                let empty = BTreeMap::new();
                let want = truth.values.get(&key).unwrap_or(&empty);
                let mut drifts = Vec::new();
                let attrs: BTreeSet<&String> = want.keys().chain(now.values.keys()).collect();
                for attr in attrs {
                    let t = want.get(attr).copied().unwrap_or(Decimal::ZERO);
                    let stored = now.values.get(attr).cloned().unwrap_or(Stored::Missing);
                    let same = match &stored {
                        Stored::Number(n) => *n == t,
                        Stored::Missing => t.is_zero(),
                        Stored::Other(_) => false,
                    };
                    if !same {
                        drifts.push(Drift {
                            rule: rule.name.to_string(),
                            target: key.clone(),
                            attribute: attr.clone(),
                            stored,
                            truth: t,
                            corrected: false,
                        });
                    }
                }
                if drifts.is_empty() {
                    continue;
                }
                metrics::counter!(names::RECONCILE_DRIFT, "rule" => rule.name.to_string()).increment(drifts.len() as u64);
                if !opts.dry_run {
                    if self.correct(&key, &drifts, &now, &known_entries).await? {
                        metrics::counter!(names::RECONCILE_CORRECTIONS, "rule" => rule.name.to_string()).increment(drifts.len() as u64);
                        for d in &mut drifts {
                            d.corrected = true;
                        }
                        info!(rule = %rule.name, target = ?key.0, attributes = drifts.len(), "drift corrected");
                    } else {
                        hot.insert(key);
                        continue;
                    }
                }
                report.drifts.extend(drifts);
            }
            if hot.is_empty() {
                return Ok(());
            }
            info!(rule = %rule.name, targets = hot.len(), round, "targets changed while reconciling; trying them again");
            pending = Some(hot);
        }
        for key in pending.into_iter().flatten() {
            report.not_quiet.push((rule.name.to_string(), key));
        }
        Ok(())
    }

    fn key_of(&self, target: &TargetKey) -> Vec<(String, AttributeValue)> {
        self.config.engine.key_names.iter().cloned().zip(target.0.iter().map(|v| AttributeValue::S(v.to_string()))).collect()
    }

    fn snapshot_of(rule: &Rule, item: Option<&Item>) -> Snapshot {
        let Some(item) = item else { return Snapshot::default() };
        let mut s = Snapshot { exists: true, ..Default::default() };
        for (k, v) in item {
            if k.starts_with(ENTRY_PREFIX) {
                if let Ok(text) = v.as_s() {
                    s.ledger.insert(k.clone(), text.clone());
                }
            } else if owns_attribute(rule, k) {
                let stored = match v {
                    AttributeValue::N(n) => Decimal::parse(n).map(Stored::Number).unwrap_or_else(|_| Stored::Other(n.clone())),
                    AttributeValue::S(t) => Stored::Other(t.clone()),
                    other => Stored::Other(format!("{other:?}")),
                };
                s.values.insert(k.clone(), stored);
            }
        }
        s
    }

    async fn read_target(&self, rule: &Rule, target: &TargetKey) -> Result<Snapshot, String> {
        let mut req = self.ddb.get_item().table_name(&self.config.aggregates_table).consistent_read(true);
        for (k, v) in self.key_of(target) {
            req = req.key(k, v);
        }
        let out = req.send().await.map_err(|e| format!("reading target {:?}: {}", target.0, classify(&e)))?;
        Ok(Reconciler::snapshot_of(rule, out.item()))
    }

    /// Every existing target item of the rule (a scan of the aggregates table).
    async fn scan_targets(&self, rule: &Rule) -> Result<BTreeMap<TargetKey, Snapshot>, String> {
        let key_names = self.config.engine.key_names.clone();
        let items = self.scan(&self.config.aggregates_table, 1, None, false).await?;
        let mut out = BTreeMap::new();
        for item in &items {
            let key: Option<Vec<&str>> = key_names.iter().map(|k| item.get(k).and_then(|v| v.as_s().ok()).map(String::as_str)).collect();
            let Some(key) = key else { continue };
            if is_target(rule, &key) {
                let target = TargetKey(key.iter().map(|s| Box::from(*s)).collect());
                out.insert(target, Reconciler::snapshot_of(rule, Some(item)));
            }
        }
        Ok(out)
    }

    async fn truth(&self, rule: &Rule, targets: &Option<BTreeSet<TargetKey>>, opts: &Options) -> Result<Truth, String> {
        let mut truth = Truth::default();
        let query = match (&rule.reconcile, targets) {
            (ReconcileSource::Query { pk, sk_begins_with }, Some(targets)) if targets.len() == 1 => {
                let vars = targets.iter().next().map(|t| truth::variables_of(rule, t)).unwrap_or_default();
                let lookup = |name: &str| vars.get(name).map(|v| crate::rules::template::VarValue::Str(v.as_str()));
                let pk_value = pk.expand(lookup).ok();
                let sk_value = match sk_begins_with {
                    Some(t) => t.expand(lookup).ok().map(Some),
                    None => Some(None),
                };
                pk_value.zip(sk_value)
            }
            _ => None,
        };
        let items = match query {
            Some((pk, sk)) => self.query(&pk, sk.as_deref()).await?,
            None => self.scan(&self.config.source.table, opts.segments.max(1), opts.read_rate, opts.progress && opts.all).await?,
        };
        for item in &items {
            truth.add_item(rule, &self.source_keys, &to_json(item)?);
        }
        if let Some(targets) = targets {
            truth.values.retain(|k, _| targets.contains(k));
        }
        Ok(truth)
    }

    async fn query(&self, pk: &str, sk_prefix: Option<&str>) -> Result<Vec<Item>, String> {
        let pk_name = &self.source_keys[0];
        let mut out = Vec::new();
        let mut start: Option<Item> = None;
        for _ in 0..1_000_000 {
            let mut req = self
                .ddb
                .query()
                .table_name(&self.config.source.table)
                .consistent_read(true)
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
            let page = req.send().await.map_err(|e| format!("querying {}: {}", self.config.source.table, classify(&e)))?;
            self.items_read.fetch_add(page.items().len() as u64, Ordering::Relaxed);
            out.extend(page.items().iter().cloned());
            match page.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => return Ok(out),
            }
        }
        Err("query did not finish".into())
    }

    /// A strongly consistent parallel scan, rate-limited, with progress on stderr.
    async fn scan(&self, table: &str, segments: u32, rate: Option<u32>, progress: bool) -> Result<Vec<Item>, String> {
        let started = Instant::now();
        let counter = self.items_read.clone();
        let base = counter.load(Ordering::Relaxed);
        let mut tasks = Vec::new();
        for segment in 0..segments {
            let ddb = self.ddb.clone();
            let table = table.to_string();
            let counter = counter.clone();
            let per_segment = rate.map(|r| (f64::from(r) / f64::from(segments)).max(1.0));
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                let mut start: Option<Item> = None;
                let seg_started = Instant::now();
                for _ in 0..10_000_000 {
                    let page = ddb
                        .scan()
                        .table_name(&table)
                        .consistent_read(true)
                        .segment(i32::try_from(segment).unwrap_or(0))
                        .total_segments(i32::try_from(segments).unwrap_or(1))
                        .limit(500)
                        .set_exclusive_start_key(start.take())
                        .send()
                        .await
                        .map_err(|e| format!("scanning {table}: {}", classify(&e)))?;
                    counter.fetch_add(page.items().len() as u64, Ordering::Relaxed);
                    out.extend(page.items().iter().cloned());
                    if let Some(r) = per_segment {
                        // Stay at or below the read rate: sleep until this segment's budget allows.
                        let due = Duration::from_secs_f64(out.len() as f64 / r);
                        if let Some(wait) = due.checked_sub(seg_started.elapsed()) {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    match page.last_evaluated_key() {
                        Some(k) if !k.is_empty() => start = Some(k.clone()),
                        _ => return Ok::<_, String>(out),
                    }
                }
                Err("scan did not finish".to_string())
            }));
        }
        let ticker = progress.then(|| {
            let counter = counter.clone();
            tokio::spawn(async move {
                use std::io::{IsTerminal, Write};
                let tty = std::io::stderr().is_terminal();
                let every = if tty { Duration::from_millis(200) } else { Duration::from_secs(10) };
                loop {
                    tokio::time::sleep(every).await;
                    let n = counter.load(Ordering::Relaxed) - base;
                    let rate = n as f64 / started.elapsed().as_secs_f64().max(0.001);
                    if tty {
                        eprint!("\rscanned {n} items ({rate:.0}/s)   ");
                        let _ = std::io::stderr().flush();
                    } else {
                        eprintln!("reconcile: scanned {n} items ({rate:.0}/s)");
                    }
                }
            })
        });
        let mut items = Vec::new();
        let mut error = None;
        for t in tasks {
            match t.await {
                Ok(Ok(mut part)) => items.append(&mut part),
                Ok(Err(e)) => error = Some(e),
                Err(e) => error = Some(e.to_string()),
            }
        }
        if let Some(t) = ticker {
            t.abort();
            let n = counter.load(Ordering::Relaxed) - base;
            eprintln!(
                "{}scanned {n} items in {:.1}s ({:.0}/s)",
                if std::io::IsTerminal::is_terminal(&std::io::stderr()) { "\r" } else { "reconcile: " },
                started.elapsed().as_secs_f64(),
                n as f64 / started.elapsed().as_secs_f64().max(0.001)
            );
        }
        match error {
            Some(e) => Err(e),
            None => Ok(items),
        }
    }

    /// Ledger entry names (this deployment's namespace) of every shard that can still write
    /// (for "no new entry" conditions): finished shards cannot.
    async fn known_entries(&self) -> Vec<String> {
        let ledger = crate::sink::ledger::Ledger::new(&self.config.ledger_namespace);
        self.leases
            .list()
            .await
            .map(|l| l.iter().filter(|l| !l.finished()).map(|l| ledger.entry_name(&l.shard_id)).collect())
            .unwrap_or_default()
    }

    /// Waits until every unfinished shard was at its tip, or applied a record created, after
    /// `after_ms` plus a margin for stream propagation and clock skew.
    async fn wait_for_consumer(&self, after_ms: u64, max: Duration) -> Result<(), String> {
        const MARGIN_MS: u64 = 2_000;
        let target = after_ms + MARGIN_MS;
        let started = Instant::now();
        loop {
            let leases = self.leases.list().await.map_err(|e| format!("reading the state table: {e}"))?;
            if leases.is_empty() {
                return Err(format!(
                    "no consumer has read this table's stream (state table {} has no leases): start `ddb-aggregator run` first (start_position: latest for a table that already has data), or pass --no-wait if no consumer will ever run",
                    self.config.state.table
                ));
            }
            let behind: Vec<&str> = leases
                .iter()
                .filter(|l| !l.finished())
                .filter(|l| !(l.at_tip_ms.is_some_and(|t| t >= target) || l.last_record_ms.is_some_and(|t| t >= target)))
                .map(|l| l.shard_id.as_str())
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if started.elapsed() > max {
                return Err(format!(
                    "the stream consumer has not caught up within {}s (shards behind: {}); is `ddb-aggregator run` running?",
                    max.as_secs(),
                    behind.join(", ")
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Sets the drifted attributes to the truth, on condition that the ledger is exactly as
    /// read (no record applied since). False when the condition failed.
    async fn correct(&self, target: &TargetKey, drifts: &[Drift], seen: &Snapshot, known_entries: &[String]) -> Result<bool, String> {
        let mut req = self.ddb.update_item().table_name(&self.config.aggregates_table);
        for (k, v) in self.key_of(target) {
            req = req.key(k, v);
        }
        let mut sets = Vec::new();
        for (i, d) in drifts.iter().enumerate() {
            sets.push(format!("#a{i} = :a{i}"));
            req = req
                .expression_attribute_names(format!("#a{i}"), &d.attribute)
                .expression_attribute_values(format!(":a{i}"), AttributeValue::N(d.truth.to_string()));
        }
        let mut conditions = Vec::new();
        let mut n = 0;
        for (name, value) in &seen.ledger {
            conditions.push(format!("#l{n} = :l{n}"));
            req = req
                .expression_attribute_names(format!("#l{n}"), name)
                .expression_attribute_values(format!(":l{n}"), AttributeValue::S(value.clone()));
            n += 1;
        }
        for name in known_entries.iter().filter(|e| !seen.ledger.contains_key(*e)) {
            conditions.push(format!("attribute_not_exists(#l{n})"));
            req = req.expression_attribute_names(format!("#l{n}"), name);
            n += 1;
        }
        if !conditions.is_empty() {
            req = req.condition_expression(conditions.join(" AND "));
        }
        match req.update_expression(format!("SET {}", sets.join(", "))).send().await {
            Ok(_) => Ok(true),
            Err(e) => {
                if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) {
                    return Ok(false);
                }
                Err(format!("correcting {:?}: {}", target.0, classify(&e)))
            }
        }
    }
}

/// Outcome of `dlq replay`.
#[derive(Debug, Default)]
pub struct ReplaySummary {
    pub replayed: u64,
    pub kept: Vec<String>,
    pub corrected: u64,
}

/// For each dead letter: reconcile the targets its record touched (for every rule it
/// poisoned), then delete it. Letters whose targets cannot be determined, or still drift, stay.
pub async fn replay_dead_letters(
    reconciler: &Reconciler,
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    max: u64,
    opts: &Options,
) -> Result<ReplaySummary, String> {
    let mut summary = ReplaySummary::default();
    let mut seen = 0u64;
    while seen < max {
        let resp = sqs
            .receive_message()
            .queue_url(queue_url)
            .max_number_of_messages(10)
            .visibility_timeout(300)
            .wait_time_seconds(1)
            .send()
            .await
            .map_err(|e| format!("receiving from {queue_url}: {}", crate::aws::classify_any(&e)))?;
        let messages = resp.messages();
        if messages.is_empty() {
            break;
        }
        for m in messages {
            seen += 1;
            let body: Value = serde_json::from_str(m.body().unwrap_or("")).unwrap_or(Value::Null);
            let id = m.message_id().unwrap_or("?").to_string();
            match replay_one(reconciler, &body, opts).await {
                Ok(corrected) => {
                    summary.corrected += corrected;
                    if let Some(handle) = m.receipt_handle() {
                        sqs.delete_message()
                            .queue_url(queue_url)
                            .receipt_handle(handle)
                            .send()
                            .await
                            .map_err(|e| format!("deleting {id}: {}", crate::aws::classify_any(&e)))?;
                    }
                    summary.replayed += 1;
                }
                Err(why) => summary.kept.push(format!("{id}: {why}")),
            }
        }
    }
    Ok(summary)
}

async fn replay_one(reconciler: &Reconciler, body: &Value, opts: &Options) -> Result<u64, String> {
    if body.get("version").and_then(Value::as_u64) != Some(1) {
        return Err("not a ddb-aggregator dead letter (version 1)".into());
    }
    let mut rules: Vec<String> = body
        .get("rules")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|r| r.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    if rules.is_empty() {
        rules.extend(body.get("rule").and_then(Value::as_str).map(str::to_string));
    }
    let letter_vars: BTreeMap<String, String> = body
        .get("variables")
        .and_then(Value::as_object)
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default();
    let mut corrected = 0;
    for name in &rules {
        let rule = reconciler
            .config
            .engine
            .rules
            .iter()
            .find(|r| *r.name == **name)
            .ok_or_else(|| format!("rule {name} is not in this config"))?;
        // The variables from the letter, or captured again from the record's keys.
        let mut vars = letter_vars.clone();
        if let Some(keys) = body.pointer("/record/dynamodb/Keys").and_then(Value::as_object) {
            let mut caps = Vec::new();
            for (attr, t) in &rule.source_key {
                if let Some(v) = keys.get(attr).and_then(|v| v.get("S")).and_then(Value::as_str) {
                    caps.clear();
                    if t.capture(v, &mut caps) {
                        for (n, c) in &caps {
                            vars.entry(n.to_string()).or_insert_with(|| c.to_string());
                        }
                    }
                }
            }
        }
        let target_vars: BTreeSet<&str> = rule.target.iter().flat_map(|(_, t)| t.variables()).collect();
        vars.retain(|k, _| target_vars.contains(k.as_str()));
        if target_for(rule, &vars).is_none() {
            return Err(format!("the letter does not determine rule {name}'s target"));
        }
        let report = reconciler.run(&Options { vars, rule: Some(name.clone()), all: false, ..opts.clone() }).await?;
        if report.uncorrected() > 0 {
            return Err(format!("rule {name}: drift remains ({} not corrected)", report.uncorrected()));
        }
        corrected += report.drifts.len() as u64;
    }
    Ok(corrected)
}
