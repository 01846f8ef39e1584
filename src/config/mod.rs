//! Configuration: YAML text (plus `DDB_AGGREGATOR__A__B=value` environment overrides) ->
//! raw serde structs -> a validated [`Config`] whose rules are compiled and checked.
//!
//! Every error names the path of the offending setting: `rules[1].measures.revenue.sum: ...`.

mod copy;
mod doc;
mod loops;
pub mod raw;
pub mod schema;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use indexmap::IndexMap;
use serde_json::Value;

use crate::pattern::{Pattern, PatternError, PatternOptions, PatternSet};
use crate::rules::helper::Derive;
use crate::rules::template::Template;
use crate::rules::{Engine, HelperMeasure, Measure, MeasureKind, ReconcileSource, Rule, TtlDeletes, ValueOf, RESERVED_ATTRIBUTE_PREFIX};
use doc::Doc;
use raw::{RawConfig, RawRule};

/// Prefix of environment variables that override settings; `__` separates path segments.
pub const ENV_PREFIX: &str = "DDB_AGGREGATOR__";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    TrimHorizon,
    Latest,
}

#[derive(Debug, Clone)]
pub struct SourceConfig {
    pub table: String,
    pub start_position: StartPosition,
    pub batch_size: u32,
    pub batching_window: Duration,
    pub max_record_age: Option<Duration>,
    /// Read and evaluate the next batch of a shard while one writes ([`crate::worker::shard`]).
    pub read_ahead: bool,
}

#[derive(Debug, Clone)]
pub struct StateConfig {
    pub table: String,
    pub create_table: bool,
    pub lease_duration: Duration,
}

#[derive(Debug, Clone)]
pub struct DeadLetterConfig {
    pub queue_url: String,
    pub max_attempts: u32,
    pub include_images: bool,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub source: SourceConfig,
    pub state: StateConfig,
    pub aggregates_table: String,
    /// Namespace of this deployment's ledger entries, floor and straggler set on target items.
    pub ledger_namespace: String,
    /// `aggregates.ledger_namespace` was set (in the file or the environment), not derived
    /// from the state table's name.
    pub ledger_namespace_explicit: bool,
    /// Most target writes a shard keeps in flight (`aggregates.write_concurrency`).
    pub write_concurrency: usize,
    /// Most WCU per second to one partition key from this replica, 0: unpaced
    /// (`aggregates.partition_write_rate`, [`crate::sink::pace`]).
    pub partition_write_rate: u32,
    /// How often each replica folds the sharded totals it wrote (`aggregates.fold_interval`).
    pub fold_interval: Duration,
    /// The aggregates table's TTL attribute for helper items (`aggregates.helper_expiry_attribute`,
    /// [`crate::sink::expiry`]).
    pub helper_expiry_attribute: Option<String>,
    pub dead_letter: Option<DeadLetterConfig>,
    /// None: no scheduled reconcile.
    pub reconcile_interval: Option<Duration>,
    /// The schedule reconciles every target (true) or the touched ones.
    pub reconcile_all: bool,
    /// Longest wait for a live replica that is behind (`reconcile.wait`).
    pub reconcile_wait: Duration,
    /// Evidence must be this much later than the truth read (`reconcile.margin`).
    pub reconcile_margin: Duration,
    /// How long after an old definition's leftovers were zeroed they are removed
    /// (`reconcile.remove_leftovers_after`).
    pub remove_leftovers_after: Duration,
    /// Where `reconcile` pushes its results (`reconcile.pushgateway`).
    pub reconcile_pushgateway: Option<String>,
    /// When an idle open shard counts as read to its tip (`reconcile.tip_evidence`).
    pub tip_evidence: TipEvidence,
    pub metrics_listen: SocketAddr,
    pub aws: AwsSettings,
    pub engine: Engine,
    /// Patterns that can never match, with their path and the fix (`validate` and `run` warn).
    pub pattern_warnings: Vec<String>,
}

/// The empty-page rule, reconcile's evidence for an idle open shard (one that ended, or
/// applied a record created after the truth read, needs no rule): `empty_pages` empty
/// GetRecords pages in a row on one iterator chain, the last called at least `over` after the
/// first, show the chain was at the shard's tip when the first was called. AWS bounds no run of
/// empty pages mid-shard ("it might take multiple calls"), so this is an assumption; reconcile
/// counts the shards it judges by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TipEvidence {
    pub empty_pages: u32,
    pub over: Duration,
}

impl Default for TipEvidence {
    /// 3 pages over 2s: a reader polls an idle shard 4 to 10 times a second, so 2s is about 8
    /// to 20 calls, against 2 in a row before; and an idle shard's evidence comes 2s later,
    /// little against `reconcile.margin` and `reconcile.wait`.
    fn default() -> TipEvidence {
        TipEvidence { empty_pages: 3, over: Duration::from_secs(2) }
    }
}

/// Most pages the empty-page rule may ask for, and the longest span: a reconcile waits about
/// that long for an idle shard's evidence.
pub const TIP_EMPTY_PAGES_MAX: u32 = 100;
pub const TIP_OVER_MAX: Duration = Duration::from_secs(60);

fn tip_evidence(raw: Option<&raw::RawTipEvidence>, wait: Duration) -> Result<TipEvidence, ConfigError> {
    let d = TipEvidence::default();
    let Some(raw) = raw else { return Ok(d) };
    let path = "reconcile.tip_evidence.empty_pages";
    let empty_pages = match raw.empty_pages.as_deref() {
        None => d.empty_pages,
        Some(t) => t.parse::<u32>().ok().filter(|n| (2..=TIP_EMPTY_PAGES_MAX).contains(n)).ok_or_else(|| {
            err(path, format!("{t:?}: use 2 to {TIP_EMPTY_PAGES_MAX} (one empty page may be a stretch of the shard without records)"))
        })?,
    };
    let path = "reconcile.tip_evidence.over";
    let over = match raw.over.as_deref() {
        None => d.over,
        Some(t) => parse_duration(t).map_err(|m| err(path, m))?,
    };
    if over > TIP_OVER_MAX {
        return Err(err(path, format!("at most {}s (a reconcile waits about this long for an idle shard)", TIP_OVER_MAX.as_secs())));
    }
    if over >= wait {
        return Err(err(path, "must be shorter than reconcile.wait (a reconcile would give up on every idle shard)"));
    }
    Ok(TipEvidence { empty_pages, over })
}

/// The AWS SDK's timeouts and retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsSettings {
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub operation_timeout: Duration,
    pub max_attempts: u32,
    pub adaptive_retries: bool,
}

impl Default for AwsSettings {
    fn default() -> AwsSettings {
        AwsSettings {
            connect_timeout: Duration::from_secs(3),
            read_timeout: Duration::from_secs(20),
            operation_timeout: Duration::from_secs(60),
            max_attempts: 3,
            adaptive_retries: false,
        }
    }
}

fn aws_settings(raw: Option<&raw::RawAws>) -> Result<AwsSettings, ConfigError> {
    let d = AwsSettings::default();
    let Some(raw) = raw else { return Ok(d) };
    let positive = |path: &str, v: Option<&str>, default: Duration| -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(t) => match parse_duration(t).map_err(|m| err(path, m))? {
                z if z.is_zero() => Err(err(path, "must be more than 0")),
                ok => Ok(ok),
            },
        }
    };
    let max_attempts = match raw.max_attempts.as_deref() {
        None => d.max_attempts,
        Some(t) => {
            t.parse::<u32>().ok().filter(|n| (1..=20).contains(n)).ok_or_else(|| err("aws.max_attempts", format!("{t:?}: use 1 to 20")))?
        }
    };
    let adaptive_retries = match raw.retry_mode.as_deref().unwrap_or("standard") {
        "standard" => false,
        "adaptive" => true,
        other => return Err(err("aws.retry_mode", format!("{other:?}: use standard or adaptive"))),
    };
    Ok(AwsSettings {
        connect_timeout: positive("aws.connect_timeout", raw.connect_timeout.as_deref(), d.connect_timeout)?,
        read_timeout: positive("aws.read_timeout", raw.read_timeout.as_deref(), d.read_timeout)?,
        operation_timeout: positive("aws.operation_timeout", raw.operation_timeout.as_deref(), d.operation_timeout)?,
        max_attempts,
        adaptive_retries,
    })
}

/// `aggregates.write_concurrency` when not set.
/// 16: on one 2-core machine with DynamoDB Local a wider window was slower (x0.88 at 64, both
/// batch sizes, CPU-bound); against DynamoDB's network latency a wider one can pay, so it is a
/// setting.
pub const DEFAULT_WRITE_CONCURRENCY: usize = 16;

/// `aggregates.partition_write_rate` when not set: 800 WCU/s and a burst of 100 keep one key
/// at or under 900 WCU in any second, under a DynamoDB partition's 1,000.
pub const DEFAULT_PARTITION_WRITE_RATE: u32 = 800;

/// A configuration error: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

/// Two rules that may write one attribute of one item: the stored value would be their sum,
/// while reconcile recomputes each rule alone and would set it to each rule's truth in turn
/// (and one rule's corrections could zero the other's counters). Refused with the pair named.
fn shared_attribute(rules: &[Rule]) -> Option<String> {
    for (i, a) in rules.iter().enumerate() {
        for b in &rules[i + 1..] {
            let same_item = a.target.iter().zip(&b.target).all(|((_, x), (_, y))| x.may_overlap(y));
            if !same_item {
                continue;
            }
            for ma in &a.measures {
                if let Some(mb) = b.measures.iter().find(|mb| ma.name.may_overlap(&mb.name)) {
                    return Some(format!(
                        "rules {:?} and {:?} may both write {:?} / {:?} on the same target item ({}); reconcile recomputes each rule alone, so give the measures (or the targets) names that cannot coincide",
                        a.name,
                        b.name,
                        ma.name.text(),
                        mb.name.text(),
                        a.target.iter().map(|(k, t)| format!("{k}: {}", t.text())).collect::<Vec<_>>().join(", ")
                    ));
                }
            }
        }
    }
    None
}

/// Two rules that may write one target item with different `write_shards`: the one's deltas
/// would go to sub-items and the other's to the item itself, which the fold overwrites.
fn mixed_sharding(rules: &[Rule]) -> Option<String> {
    for (i, a) in rules.iter().enumerate() {
        for b in &rules[i + 1..] {
            let same_item = a.target.iter().zip(&b.target).all(|((_, x), (_, y))| x.may_overlap(y));
            if same_item && a.write_shards != b.write_shards {
                let n = |r: &Rule| r.write_shards.map_or("none".to_string(), |n| n.to_string());
                return Some(format!(
                    "rules {:?} (write_shards {}) and {:?} (write_shards {}) may write the same target item ({}); give them the same write_shards, or targets that cannot coincide",
                    a.name,
                    n(a),
                    b.name,
                    n(b),
                    a.target.iter().map(|(k, t)| format!("{k}: {}", t.text())).collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    None
}

/// The key attributes a rule's `target` names (every entry but `write_shards`).
pub fn target_key_names(r: &RawRule) -> impl Iterator<Item = &String> {
    r.target.keys().filter(|k| k.as_str() != WRITE_SHARDS)
}

/// The `target` entry that spreads a target over sub-items.
pub const WRITE_SHARDS: &str = "write_shards";

/// `target.write_shards`: a whole number from 2 to 100, if given.
fn write_shards(path: &str, r: &RawRule) -> Result<Option<u16>, ConfigError> {
    use crate::rules::shards::{MAX_SHARDS, MIN_SHARDS};
    let Some(v) = r.target.get(WRITE_SHARDS) else { return Ok(None) };
    let at = format!("{path}.target.{WRITE_SHARDS}");
    let n = v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok()));
    match n.and_then(|n| u16::try_from(n).ok()).filter(|n| (MIN_SHARDS..=MAX_SHARDS).contains(n)) {
        Some(n) => Ok(Some(n)),
        None => Err(err(
            at,
            format!("{v}: give a whole number from {MIN_SHARDS} to {MAX_SHARDS} (the sub-items a target is spread over; about the stream's shard count / 200 * 8 KB of ledger, see docs/configuration.md)"),
        )),
    }
}

/// `--config env:NAME`: the config's YAML text is in environment variable NAME.
pub const ENV_CONFIG_PREFIX: &str = "env:";

fn err(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { path: path.into(), message: message.into() }
}

impl Config {
    /// Why `reconcile.remove_leftovers_after` is unsafe, when it is shorter than the stream's
    /// retention: a replay of a record that a removed item's ledger held would count it again.
    pub fn short_removal_window(&self) -> Option<String> {
        let retention = Duration::from_millis(crate::worker::plan::RETENTION_MS);
        (self.remove_leftovers_after < retention).then(|| {
            format!(
                "reconcile.remove_leftovers_after is {:?}, shorter than the stream's 24 h retention: a record replayed after an item's removal counts again on it",
                self.remove_leftovers_after
            )
        })
    }

    /// Reads, overrides from the process environment, and validates.
    /// Reads the file at `path`, or with `env:NAME` the YAML text held by environment variable
    /// NAME (an ECS task's `secrets` from SSM Parameter Store, so rules change without a new
    /// image).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = match path.to_str().and_then(|p| p.strip_prefix(ENV_CONFIG_PREFIX)) {
            Some(name) => std::env::var(name).map_err(|e| match e {
                std::env::VarError::NotPresent => err("", format!("environment variable {name} (named by --config env:{name}) is not set")),
                std::env::VarError::NotUnicode(_) => err("", format!("environment variable {name} is not valid UTF-8")),
            })?,
            None => std::fs::read_to_string(path).map_err(|e| err("", format!("cannot read {}: {e}", path.display())))?,
        };
        Config::from_yaml(&text, std::env::vars())
    }

    /// Parses YAML text; `env` supplies overrides (pass `std::env::vars()`).
    pub fn from_yaml(text: &str, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, ConfigError> {
        let mut doc = Doc::parse(text).map_err(|e| err("", format!("not valid YAML: {e}")))?;
        if doc.is_null() {
            return Err(err("", "the file is empty"));
        }
        let mut overridden = Vec::new();
        for (key, value) in env {
            if let Some(rest) = key.strip_prefix(ENV_PREFIX) {
                apply_override(&mut doc, rest, &value).map_err(|m| err(key.clone(), m))?;
                overridden.push(key);
            }
        }
        let raw: RawConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
            let path = e.path().to_string();
            let mut m = e.inner().to_string();
            let path = if path == "." { String::new() } else { path };
            if !overridden.is_empty() {
                m.push_str(&format!(" (after environment overrides {})", overridden.join(", ")));
            }
            err(path, m)
        })?;
        validate(raw)
    }

    /// Variable names the rules' targets and the copy rules' sources use: the flags of `reconcile`.
    pub fn target_variables(&self) -> BTreeSet<String> {
        let targets = self.engine.rules.iter().flat_map(|r| r.target.iter().flat_map(|(_, t)| t.variables()));
        // A copy rule's copies are reconciled by their source: its key's variables.
        let sources = self.engine.copies.iter().flat_map(|r| r.source_key.iter().flat_map(|(_, t)| t.variables()));
        targets.chain(sources).map(str::to_string).collect()
    }
}

/// YAML text as the config reads it, as JSON (the form filters and measures take): for tests
/// that hold the parser to the values it must read.
pub fn yaml_value(text: &str) -> Result<Value, String> {
    let doc = Doc::parse(text).map_err(|e| e.to_string())?;
    serde::Deserialize::deserialize(doc).map_err(|e: serde::de::value::Error| e.to_string())
}

/// What an environment override's text sets, as JSON.
pub fn override_value(text: &str) -> Value {
    serde::Deserialize::deserialize(Doc::scalar(text)).unwrap_or(Value::Null)
}

/// Sets `path` (segments separated by `__`, matched to existing keys case-insensitively,
/// numbers index lists) to `value` parsed as a YAML scalar.
fn apply_override(doc: &mut Doc, path: &str, value: &str) -> Result<(), String> {
    let segments: Vec<&str> = path.split("__").collect();
    if segments.iter().any(|s| s.is_empty()) {
        return Err("empty path segment in environment override".into());
    }
    let mut node = doc;
    for (i, seg) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        node = match node {
            Doc::Seq(items) => {
                let idx: usize = seg.parse().map_err(|_| format!("{seg:?} must be a list index here"))?;
                let len = items.len();
                items.get_mut(idx).ok_or_else(|| format!("index {idx} is past the end of a list of {len}"))?
            }
            Doc::Map(map) => {
                let key = map.keys().find(|k| k.eq_ignore_ascii_case(seg)).cloned().unwrap_or_else(|| seg.to_ascii_lowercase());
                map.entry(key).or_insert_with(|| if last { Doc::Null } else { Doc::Map(Default::default()) })
            }
            _ => return Err(format!("cannot descend into {seg:?}: the value above it is not a mapping")),
        };
    }
    *node = Doc::scalar(value);
    Ok(())
}

/// `250ms`, `10s`, `5m`, `1h`, `1d`, `0s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(|| format!("duration {s:?} needs a unit (ms, s, m, h, d)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(format!("duration {s:?}: unknown unit {unit:?} (use ms, s, m, h, d)")),
    };
    ms.map(Duration::from_millis).ok_or_else(|| format!("duration {s:?} is too large"))
}

fn duration(path: &str, value: Option<&str>, default: &str) -> Result<Duration, ConfigError> {
    parse_duration(value.unwrap_or(default)).map_err(|m| err(path, m))
}

fn table_name(path: &str, name: &str) -> Result<String, ConfigError> {
    let ok = (3..=255).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !ok {
        return Err(err(path, format!("{name:?} is not a DynamoDB table name (3-255 characters: letters, digits, _ - .)")));
    }
    Ok(name.to_string())
}

fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    let source_table = table_name("source.table", &raw.source.table)?;
    let start_position = match raw.source.start_position.as_deref().unwrap_or("trim_horizon") {
        "trim_horizon" => StartPosition::TrimHorizon,
        "latest" => StartPosition::Latest,
        other => return Err(err("source.start_position", format!("{other:?}: use trim_horizon or latest"))),
    };
    let batch_size = raw.source.batch_size.unwrap_or(1000);
    if !(1..=10_000).contains(&batch_size) {
        return Err(err(
            "source.batch_size",
            format!("{batch_size}: 1 to 10000 records (as Lambda; above 1000 a batch gathers several GetRecords pages)"),
        ));
    }
    let batching_window = duration("source.batching_window", raw.source.batching_window.as_deref(), "0s")?;
    if batching_window > Duration::from_secs(300) {
        return Err(err("source.batching_window", "at most 300s (as Lambda)"));
    }
    let max_record_age = match raw.source.max_record_age.as_deref() {
        None => None,
        Some(text) => {
            let d = duration("source.max_record_age", Some(text), "0s")?;
            if d < Duration::from_secs(1) {
                return Err(err("source.max_record_age", "at least 1s (leave it out to apply records of any age)"));
            }
            Some(d)
        }
    };
    let lease_duration = duration("state.lease_duration", raw.state.lease_duration.as_deref(), "10s")?;
    if lease_duration < Duration::from_millis(300) || lease_duration > Duration::from_secs(600) {
        return Err(err("state.lease_duration", "between 300ms and 600s (leases are renewed every third of it)"));
    }
    let state = StateConfig {
        table: table_name("state.table", &raw.state.table)?,
        create_table: raw.state.create_table.unwrap_or(false),
        lease_duration,
    };
    let aggregates_table = match raw.aggregates.as_ref().and_then(|a| a.table.as_deref()) {
        Some(t) => table_name("aggregates.table", t)?,
        None => source_table.clone(),
    };
    let write_concurrency = match raw.aggregates.as_ref().and_then(|a| a.write_concurrency) {
        None => DEFAULT_WRITE_CONCURRENCY,
        Some(n @ 1..=256) => n as usize,
        Some(n) => return Err(err("aggregates.write_concurrency", format!("{n}: use 1 to 256"))),
    };
    let partition_write_rate = match raw.aggregates.as_ref().and_then(|a| a.partition_write_rate) {
        None => DEFAULT_PARTITION_WRITE_RATE,
        Some(n @ 0..=100_000) => n,
        Some(n) => return Err(err("aggregates.partition_write_rate", format!("{n}: use 0 (no pacing) to 100000 WCU per second"))),
    };
    let fold_interval = duration("aggregates.fold_interval", raw.aggregates.as_ref().and_then(|a| a.fold_interval.as_deref()), "1s")?;
    if fold_interval < Duration::from_millis(100) || fold_interval > Duration::from_secs(3600) {
        return Err(err("aggregates.fold_interval", format!("{fold_interval:?}: use 100ms to 1h (default 1s)")));
    }
    if state.table == source_table || state.table == aggregates_table {
        return Err(err("state.table", "must be a table of its own, not the source or aggregates table"));
    }
    let ledger_namespace = match raw.aggregates.as_ref().and_then(|a| a.ledger_namespace.as_deref()) {
        None => crate::sink::ledger::default_namespace(&state.table),
        Some(ns) => crate::sink::ledger::check_namespace(ns).map_err(|m| err("aggregates.ledger_namespace", m))?.to_string(),
    };
    let ledger_namespace_explicit = raw.aggregates.as_ref().is_some_and(|a| a.ledger_namespace.is_some());
    let helper_expiry_attribute = match raw.aggregates.as_ref().and_then(|a| a.helper_expiry_attribute.as_deref()) {
        None => None,
        Some(a)
            if a.is_empty() || a.len() > 255 || a.contains(['.', '[', '#']) || a.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) =>
        {
            return Err(err(
                "aggregates.helper_expiry_attribute",
                format!(
                    "{a:?}: a top-level attribute name of 1 to 255 bytes, without . [ or #, not starting with {}",
                    crate::rules::RESERVED_ATTRIBUTE_PREFIX
                ),
            ))
        }
        Some(a) => Some(a.to_string()),
    };
    let dead_letter = match raw.dead_letter {
        Some(d) => {
            if !(d.queue_url.starts_with("https://") || d.queue_url.starts_with("http://")) {
                return Err(err("dead_letter.queue_url", format!("{:?} is not a queue URL (http:// or https://)", d.queue_url)));
            }
            let max_attempts = d.max_attempts.unwrap_or(5);
            if !(1..=100).contains(&max_attempts) {
                return Err(err("dead_letter.max_attempts", format!("{max_attempts}: use 1 to 100")));
            }
            Some(DeadLetterConfig { queue_url: d.queue_url, max_attempts, include_images: d.include_images.unwrap_or(true) })
        }
        None => None,
    };
    let interval = duration("reconcile.interval", raw.reconcile.as_ref().and_then(|r| r.interval.as_deref()), "1h")?;
    let reconcile_interval = (!interval.is_zero()).then_some(interval);
    let reconcile_wait = duration("reconcile.wait", raw.reconcile.as_ref().and_then(|r| r.wait.as_deref()), "2m")?;
    let reconcile_pushgateway = raw.reconcile.as_ref().and_then(|r| r.pushgateway.clone()).filter(|u| !u.is_empty());
    if let Some(u) = &reconcile_pushgateway {
        crate::telemetry::push::parse_url(u).map_err(|e| err("reconcile.pushgateway", e.to_string()))?;
    }
    let reconcile_margin = duration("reconcile.margin", raw.reconcile.as_ref().and_then(|r| r.margin.as_deref()), "2s")?;
    let path = "reconcile.remove_leftovers_after";
    let remove_leftovers_after = duration(path, raw.reconcile.as_ref().and_then(|r| r.remove_leftovers_after.as_deref()), "25h")?;
    if remove_leftovers_after.is_zero() {
        return Err(err(path, "0s: use a duration past the stream's 24 h retention (default 25h)"));
    }
    let tip_evidence = tip_evidence(raw.reconcile.as_ref().and_then(|r| r.tip_evidence.as_ref()), reconcile_wait)?;
    let reconcile_all = match raw.reconcile.as_ref().and_then(|r| r.scope.as_deref()).unwrap_or("touched") {
        "touched" => false,
        "all" => true,
        other => return Err(err("reconcile.scope", format!("{other:?}: use touched or all"))),
    };
    let aws = aws_settings(raw.aws.as_ref())?;
    let listen = raw.metrics.as_ref().and_then(|m| m.listen.as_deref()).unwrap_or("0.0.0.0:9464");
    let metrics_listen: SocketAddr =
        listen.parse().map_err(|_| err("metrics.listen", format!("{listen:?} is not an address like 0.0.0.0:9464")))?;

    if raw.rules.is_empty() {
        return Err(err("rules", "at least one rule is needed"));
    }
    // The aggregates table's key attributes, as the first rule with a target names them.
    let key_names: Vec<String> =
        raw.rules.iter().find(|r| r.copy.is_none()).map(|r| target_key_names(r).cloned().collect()).unwrap_or_default();
    let mut rules = Vec::with_capacity(raw.rules.len());
    let mut copies = Vec::new();
    for (i, r) in raw.rules.iter().enumerate() {
        let path = format!("rules[{i}]");
        rule_name(&path, &r.name)?;
        if raw.rules[..i].iter().any(|x| x.name == r.name) {
            return Err(err(format!("{path}.name"), format!("{:?} is used by an earlier rule", r.name)));
        }
        match &r.copy {
            Some(c) => copies.push(copy::validate(&path, r, c)?),
            None => rules.push(validate_rule(&path, r, &key_names)?),
        }
    }
    if let Some(message) = shared_attribute(&rules) {
        return Err(err("rules", message));
    }
    if let Some(message) = mixed_sharding(&rules) {
        return Err(err("rules", message));
    }
    // Rules with the same filter (and options) share one evaluation per record.
    let aggregating: Vec<&RawRule> = raw.rules.iter().filter(|r| r.copy.is_none()).collect();
    let filter_of = aggregating
        .iter()
        .enumerate()
        .map(|(i, r)| {
            aggregating[..i]
                .iter()
                .position(|e| r.filter.is_some() && e.filter == r.filter && e.numeric_strings == r.numeric_strings)
                .unwrap_or(i)
        })
        .collect();
    let pattern_warnings = raw.rules.iter().enumerate().flat_map(|(i, r)| numeric_on_numbers(&format!("rules[{i}]"), r)).collect();
    let engine = Engine { rules, copies, key_names, filter_of };
    if aggregates_table == source_table {
        loops::check(&engine)?;
    }
    loops::check_copies(&raw.rules, &engine, aggregates_table == source_table)?;
    Ok(Config {
        source: SourceConfig {
            table: source_table,
            start_position,
            batch_size,
            batching_window,
            max_record_age,
            read_ahead: raw.source.read_ahead.unwrap_or(false),
        },
        state,
        aggregates_table,
        ledger_namespace,
        ledger_namespace_explicit,
        helper_expiry_attribute,
        write_concurrency,
        partition_write_rate,
        fold_interval,
        dead_letter,
        reconcile_interval,
        reconcile_all,
        reconcile_wait,
        reconcile_margin,
        remove_leftovers_after,
        reconcile_pushgateway,
        tip_evidence,
        metrics_listen,
        aws,
        engine,
        pattern_warnings,
    })
}

/// Matches on DynamoDB numbers (an `N` or `NS` leaf) that never match in a rule without
/// `numeric_strings: true`: a stream record holds numbers as text, so (as in Lambda) a
/// `numeric` operator sees no number, and a number literal (`N: [500]`, `anything-but: [0]`)
/// equals no value. One warning per match, with its path and the fix.
fn numeric_on_numbers(path: &str, r: &RawRule) -> Vec<String> {
    /// The elements of an `N`/`NS` leaf's list that compare numbers, with why.
    fn leaf(list: &Value, at: &str, out: &mut Vec<(String, &'static str)>) {
        let Value::Array(items) = list else { return };
        for (i, item) in items.iter().enumerate() {
            let at = format!("{at}[{i}]");
            match item {
                Value::Number(_) => out.push((at, "a number never equals an N value")),
                Value::Object(o) if o.contains_key("numeric") => out.push((format!("{at}.numeric"), "a numeric operator sees no number")),
                Value::Object(o) => {
                    let numbers = match o.get("anything-but") {
                        Some(Value::Number(_)) => true,
                        Some(Value::Array(a)) => a.iter().any(Value::is_number),
                        _ => false,
                    };
                    if numbers {
                        out.push((format!("{at}.anything-but"), "a number excludes no N value"));
                    }
                }
                _ => {}
            }
        }
    }
    fn walk(v: &Value, at: &str, out: &mut Vec<(String, &'static str)>) {
        match v {
            Value::Object(fields) => {
                for (k, v) in fields {
                    let here = format!("{at}.{k}");
                    // The pattern compiler splits `a.b.N` keys on the dots: the leaf is the last.
                    if matches!(k.rsplit('.').next(), Some("N" | "NS")) && v.is_array() {
                        leaf(v, &here, out);
                    } else {
                        walk(v, &here, out);
                    }
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &format!("{at}[{i}]"), out);
                }
            }
            _ => {}
        }
    }
    if r.numeric_strings {
        return Vec::new();
    }
    let mut found = Vec::new();
    if let Some(f) = &r.filter {
        walk(f, &format!("{path}.filter"), &mut found);
    }
    for (name, spec) in &r.measures {
        if let Some(w) = spec.as_object().and_then(|o| o.get("where")) {
            walk(w, &format!("{path}.measures.{name}.where"), &mut found);
        }
    }
    found
        .into_iter()
        .map(|(at, why)| {
            format!(
                "{at} never matches: DynamoDB numbers are text in a stream record, so without numeric_strings: true on rule {} {why} (as in Lambda); set numeric_strings: true",
                r.name
            )
        })
        .collect()
}

fn template(path: &str, text: &str) -> Result<Template, ConfigError> {
    Template::parse(text).map_err(|m| err(path, m))
}

/// The fields a filter (one pattern or a list) reads that a source item alone cannot supply:
/// anything but `dynamodb.Keys` and `dynamodb.NewImage`, except `eventSource` (always
/// `aws:dynamodb`) and an `eventName` list naming INSERT, MODIFY and REMOVE (every record).
pub fn stream_only_fields(filter: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    fn every_event(v: &Value) -> bool {
        let names: Vec<&str> = v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        ["INSERT", "MODIFY", "REMOVE"].iter().all(|n| names.contains(n))
    }
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Array(patterns) => patterns.iter().for_each(|p| walk(p, out)),
            Value::Object(fields) => {
                for (k, v) in fields {
                    match k.as_str() {
                        "$or" => walk(v, out),
                        "eventSource" => {}
                        "eventName" if every_event(v) => {}
                        "dynamodb" => {
                            let inner: Vec<Value> = match v {
                                Value::Object(_) => vec![v.clone()],
                                Value::Array(a) => a.clone(),
                                _ => vec![],
                            };
                            for o in inner.iter().filter_map(Value::as_object) {
                                for (k2, v2) in o {
                                    match k2.as_str() {
                                        "Keys" | "NewImage" => {}
                                        "$or" => walk(&serde_json::json!({ "dynamodb": v2 }), out),
                                        other => out.push(format!("dynamodb.{other}")),
                                    }
                                }
                            }
                        }
                        other => out.push(other.to_string()),
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(filter, &mut out);
    out.sort();
    out.dedup();
    out
}

/// A rule's name: it is a metric label.
fn rule_name(path: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) {
        return Err(err(format!("{path}.name"), format!("{name:?}: 1-64 letters, digits, _ - . (it is a metric label)")));
    }
    Ok(())
}

/// A rule's `source_key`: capturing templates, partition key first.
fn source_key(path: &str, r: &RawRule) -> Result<Vec<(String, Template)>, ConfigError> {
    if r.source_key.is_empty() {
        return Err(err(format!("{path}.source_key"), "name at least the partition key, e.g. PK: \"CUST#{customer}\""));
    }
    let mut source_key = Vec::new();
    for (attr, text) in &r.source_key {
        let at = format!("{path}.source_key.{attr}");
        let t = template(&at, text)?;
        t.check_capturing().map_err(|m| err(&at, m))?;
        source_key.push((attr.clone(), t));
    }
    Ok(source_key)
}

fn validate_rule(path: &str, r: &RawRule, key_names: &[String]) -> Result<Rule, ConfigError> {
    let options = PatternOptions { numeric_strings: r.numeric_strings };
    let filter = match &r.filter {
        None => None,
        Some(v) => Some(PatternSet::compile(v, options).map_err(|e| pattern_err(&format!("{path}.filter"), e))?),
    };
    if r.target.is_empty() {
        return Err(err(
            format!("{path}.target"),
            "is missing: give the target item's key as templates (e.g. PK: \"CUST#{customer}\", SK: PROFILE), or copy: for a copy rule",
        ));
    }
    let source_key = source_key(path, r)?;
    let captures: BTreeSet<&str> = source_key.iter().flat_map(|(_, t)| t.variables()).collect();
    // Targets: the same key attributes as every other rule, put in the table's key order.
    let mut names: Vec<&String> = target_key_names(r).collect();
    names.sort();
    let mut expected: Vec<&String> = key_names.iter().collect();
    expected.sort();
    if names != expected {
        return Err(err(
            format!("{path}.target"),
            format!(
                "every rule writes to the same table, so targets need the same key attributes: expected {key_names:?}, found {:?}",
                target_key_names(r).collect::<Vec<_>>()
            ),
        ));
    }
    let write_shards = write_shards(path, r)?;
    let mut target = Vec::new();
    for name in key_names {
        let at = format!("{path}.target.{name}");
        let Some(text) = r.target[name.as_str()].as_str() else {
            return Err(err(&at, "a key value is a template (text), such as \"SALES#{date|day}\""));
        };
        let t = template(&at, text)?;
        if t.text().is_empty() {
            return Err(err(&at, "a key value may not be empty"));
        }
        target.push((name.clone(), t));
    }
    if r.measures.is_empty() {
        return Err(err(format!("{path}.measures"), "at least one measure is needed, e.g. orderCount: count"));
    }
    let mut measures = Vec::new();
    for (name, spec) in &r.measures {
        let at = format!("{path}.measures.{name}");
        let name_t = template(&at, name)?;
        if name.is_empty() || name.starts_with(RESERVED_ATTRIBUTE_PREFIX) || key_names.iter().any(|k| k == name) {
            return Err(err(&at, format!("attribute name may not be empty, a key attribute, or start with {RESERVED_ATTRIBUTE_PREFIX:?}")));
        }
        if name.contains('.') || name.contains('[') {
            return Err(err(&at, "measures are top-level attributes: DynamoDB's ADD cannot create nested paths, so no '.' or '['"));
        }
        if let Some(avg) = spec.as_object().and_then(|o| o.get("avg")) {
            measures.extend(validate_avg(&at, name, spec, avg, options)?);
            continue;
        }
        if let Some((derive, value)) = helper_kind(spec) {
            measures.push(validate_helper(&at, name_t, spec, derive, value, key_names, options)?);
            continue;
        }
        measures.push(validate_measure(&at, name_t, spec, options)?);
    }
    // Names as written, after avg's expansion: `avg_{status}` meets `avg_PAID_sum`, and an
    // avg may not expand onto a key attribute.
    if let Some(m) = measures.iter().find(|m| key_names.iter().any(|k| k == m.name.text())) {
        return Err(err(format!("{path}.measures"), format!("{} is a key attribute of the aggregates table", m.name)));
    }
    for (i, a) in measures.iter().enumerate() {
        if let Some(b) = measures[..i].iter().find(|b| b.name.may_overlap(&a.name)) {
            let what = if a.name.text() == b.name.text() {
                format!("{} is written twice", a.name)
            } else {
                format!("{} and {} can name the same attribute", b.name, a.name)
            };
            return Err(err(format!("{path}.measures"), format!("{what} by this rule (avg: NAME writes NAME_sum and NAME_count)")));
        }
    }
    let ttl_deletes = match r.ttl_deletes.as_deref() {
        None | Some("count") => TtlDeletes::Count,
        Some("ignore") => TtlDeletes::Ignore,
        Some(other) => {
            return Err(err(
                format!("{path}.ttl_deletes"),
                format!("{other:?}: give count (a TTL delete is a delete, the default) or ignore (a TTL delete changes nothing)"),
            ))
        }
    };
    let reconcile = match &r.reconcile {
        None => ReconcileSource::Scan,
        Some(rec) => match (&rec.query, rec.scan) {
            (Some(_), Some(true)) => return Err(err(format!("{path}.reconcile"), "give either query or scan: true, not both")),
            (None, Some(true)) => ReconcileSource::Scan,
            (None, _) => return Err(err(format!("{path}.reconcile"), "give query: {PK: ..., SK_begins_with: ...} or scan: true")),
            (Some(q), _) => validate_query(&format!("{path}.reconcile.query"), q, &source_key, &target, &captures)?,
        },
    };
    if let (Some(_), Some(m)) = (write_shards, measures.iter().find(|m| matches!(m.kind, MeasureKind::Helper(_)))) {
        return Err(err(
            format!("{path}.target.{WRITE_SHARDS}"),
            format!("{} is a max, min, latest or distinct measure: its value cannot be summed from sub-items, so a sharded target takes count, sum and avg only (put it in a rule of its own)", m.name),
        ));
    }
    let stream_only = r.filter.as_ref().map(stream_only_fields).unwrap_or_default();
    let definition = crate::rules::fingerprint::canonical(r);
    let fingerprint = crate::rules::fingerprint::of_definition(&definition);
    Ok(Rule {
        name: r.name.as_str().into(),
        filter,
        source_key,
        target,
        write_shards,
        measures,
        reconcile,
        stream_only,
        ttl_deletes,
        fingerprint,
        definition: definition.into(),
    })
}

/// A rule read back from its canonical definition (kept in the state table by an earlier
/// generation): what its targets hold, with no reconcile query (a full scan finds its items).
pub fn rule_from_definition(name: &str, definition: &str, key_names: &[String]) -> Result<Rule, ConfigError> {
    let at = format!("definition of rule {name}");
    let v: serde_json::Value = serde_json::from_str(definition).map_err(|e| err(&at, format!("not JSON: {e}")))?;
    let pairs = |field: &str| -> Result<IndexMap<String, String>, ConfigError> {
        let list = v.get(field).and_then(|x| x.as_array()).ok_or_else(|| err(&at, format!("{field} is missing")))?;
        list.iter()
            .map(|p| match p.as_array().map(Vec::as_slice) {
                Some([serde_json::Value::String(k), serde_json::Value::String(t)]) => Ok((k.clone(), t.clone())),
                _ => Err(err(&at, format!("{field} holds something other than [key, template] pairs"))),
            })
            .collect()
    };
    let measures = v.get("measures").and_then(|m| m.as_object()).ok_or_else(|| err(&at, "measures is missing"))?;
    let raw = RawRule {
        name: name.to_string(),
        filter: v.get("filter").filter(|f| !f.is_null()).cloned(),
        numeric_strings: v.get("numeric_strings").and_then(|b| b.as_bool()).unwrap_or(false),
        source_key: pairs("source_key")?,
        target: pairs("target")?
            .into_iter()
            .map(|(k, t)| (k, serde_json::Value::String(t)))
            .chain(v.get(WRITE_SHARDS).map(|n| (WRITE_SHARDS.to_string(), n.clone())))
            .collect(),
        measures: measures.iter().map(|(k, m)| (k.clone(), m.clone())).collect(),
        reconcile: None,
        copy: None,
        ttl_deletes: v.get("ttl_deletes").and_then(|t| t.as_str()).map(str::to_string),
    };
    validate_rule(&at, &raw, key_names)
}

fn pattern_err(outer: &str, e: PatternError) -> ConfigError {
    let e = e.within(outer);
    ConfigError { path: e.path, message: e.message }
}

/// `avg: ATTR`: kept as its sum and its count, `<name>_sum` and `<name>_count` (both exact
/// and invertible, so updates and deletes keep the average right; readers divide).
fn validate_avg(at: &str, name: &str, spec: &Value, avg: &Value, options: PatternOptions) -> Result<[Measure; 2], ConfigError> {
    let attr = match avg {
        Value::String(a) if !a.is_empty() && !a.contains(char::is_whitespace) && !a.contains('*') => a.clone(),
        _ => return Err(err(format!("{at}.avg"), "must be an attribute name (the average of a product is not supported)")),
    };
    let mut sum = spec.clone();
    if let Some(o) = sum.as_object_mut() {
        if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "avg" | "where")) {
            return Err(err(format!("{at}.{k}"), "unknown key; avg takes an attribute name and an optional where"));
        }
        o.remove("avg");
        o.insert("sum".into(), Value::String(attr.clone()));
    }
    let sum_name = template(at, &format!("{name}_sum"))?;
    let count_name = template(at, &format!("{name}_count"))?;
    let sum = validate_measure(at, sum_name, &sum, options)?;
    let count = Measure { name: count_name, kind: MeasureKind::CountOf(attr), filter: sum.filter.clone() };
    Ok([sum, count])
}

/// Which helper measure a spec names (`max`, `min`, `latest`, `distinct`), with its value.
fn helper_kind(spec: &Value) -> Option<(Derive, &Value)> {
    let o = spec.as_object()?;
    [("max", Derive::Max), ("min", Derive::Min), ("latest", Derive::Latest), ("distinct", Derive::Distinct)]
        .into_iter()
        .find_map(|(k, d)| o.get(k).map(|v| (d, v)))
}

/// `max`, `min`, `latest` (with `by`) and `distinct`: kept in helper items next to the target
/// (same partition key, a sort key derived from the target's), so the table needs a sort key.
fn validate_helper(
    at: &str,
    name: Template,
    spec: &Value,
    derive: Derive,
    value: &Value,
    key_names: &[String],
    options: PatternOptions,
) -> Result<Measure, ConfigError> {
    let kind = derive.as_str();
    if key_names.len() < 2 {
        return Err(err(
            at,
            format!("{kind} keeps helper items next to its target (same partition key, a sort key derived from the target's): the aggregates table needs a sort key"),
        ));
    }
    if name.text().contains(crate::rules::template::DELIMITER) {
        return Err(err(at, format!("{kind}: the name becomes part of the helper items' sort keys, so it may not hold '#'")));
    }
    let obj = spec.as_object().ok_or_else(|| err(at, "expected a mapping"))?;
    let allowed: &[&str] = if derive == Derive::Latest { &["latest", "by", "where"] } else { &[kind, "where"] };
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        let also = if derive == Derive::Latest { "latest: ATTR, by: ATTR" } else { "an attribute or a template" };
        return Err(err(format!("{at}.{k}"), format!("unknown key; {kind} takes {also} and an optional where")));
    }
    let value = match value {
        Value::String(t) if t.contains('{') => ValueOf::Template(template(&format!("{at}.{kind}"), t)?),
        Value::String(a) if !a.is_empty() && !a.contains(char::is_whitespace) && !a.contains('*') => ValueOf::Attribute(a.clone()),
        _ => return Err(err(format!("{at}.{kind}"), "give an attribute name (N or S) or a template such as \"{date|day}\"")),
    };
    let by = match (derive, obj.get("by")) {
        (Derive::Latest, Some(Value::String(b))) if !b.is_empty() && !b.contains(char::is_whitespace) => Some(b.clone()),
        (Derive::Latest, Some(_)) => {
            return Err(err(format!("{at}.by"), "must be an attribute name (N or S): the item with its highest value wins"))
        }
        (Derive::Latest, None) => return Err(err(at, "latest needs by: the attribute that orders the items (e.g. updatedAt)")),
        _ => None,
    };
    let filter = match obj.get("where") {
        None => None,
        Some(w) => Some(Pattern::compile(w, options).map_err(|e| pattern_err(&format!("{at}.where"), e))?),
    };
    Ok(Measure { name, kind: MeasureKind::Helper(HelperMeasure { derive, value, by }), filter })
}

fn validate_measure(at: &str, name: Template, spec: &Value, options: PatternOptions) -> Result<Measure, ConfigError> {
    let usage = "use count, {count: true}, {sum: ATTR}, {sum: \"ATTR * ATTR\"}, {avg: ATTR}, {max: ATTR}, {min: ATTR}, {latest: ATTR, by: ATTR} or {distinct: ATTR}, with an optional where";
    let obj = match spec {
        Value::String(s) if s == "count" => return Ok(Measure { name, kind: MeasureKind::Count, filter: None }),
        Value::Object(o) => o,
        _ => return Err(err(at, usage)),
    };
    for key in obj.keys() {
        if !matches!(key.as_str(), "count" | "sum" | "where") {
            return Err(err(format!("{at}.{key}"), format!("unknown key; {usage}")));
        }
    }
    let kind = match (obj.get("count"), obj.get("sum")) {
        (Some(Value::Bool(true)), None) => MeasureKind::Count,
        (Some(_), None) => return Err(err(format!("{at}.count"), "must be true")),
        (None, Some(Value::String(s))) => {
            let parts: Vec<&str> = s.split('*').map(str::trim).collect();
            let valid = |a: &str| !a.is_empty() && !a.contains(char::is_whitespace);
            match parts.as_slice() {
                [a] if valid(a) => MeasureKind::Sum(a.to_string()),
                [a, b] if valid(a) && valid(b) => MeasureKind::Product(a.to_string(), b.to_string()),
                _ => return Err(err(format!("{at}.sum"), format!("{s:?}: give an attribute name or \"ATTR * ATTR\""))),
            }
        }
        (None, Some(_)) => return Err(err(format!("{at}.sum"), "must be an attribute name")),
        (None, None) | (Some(_), Some(_)) => return Err(err(at, format!("exactly one of count or sum; {usage}"))),
    };
    let filter = match obj.get("where") {
        None => None,
        Some(w) => Some(Pattern::compile(w, options).map_err(|e| pattern_err(&format!("{at}.where"), e))?),
    };
    Ok(Measure { name, kind, filter })
}

fn validate_query(
    at: &str,
    q: &indexmap::IndexMap<String, String>,
    source_key: &[(String, Template)],
    target: &[(String, Template)],
    captures: &BTreeSet<&str>,
) -> Result<ReconcileSource, ConfigError> {
    let partition = &source_key[0].0;
    let mut pk = None;
    let mut sk = None;
    for (k, v) in q {
        let t = template(&format!("{at}.{k}"), v)?;
        if k == partition {
            pk = Some(t);
        } else if let Some(attr) = k.strip_suffix("_begins_with") {
            if source_key.get(1).is_none_or(|(s, _)| s != attr) {
                return Err(err(format!("{at}.{k}"), format!("{attr} is not the sort key named in source_key")));
            }
            sk = Some(t);
        } else {
            return Err(err(format!("{at}.{k}"), format!("unknown key: use {partition} and optionally <sort key>_begins_with")));
        }
    }
    let pk = pk.ok_or_else(|| err(at, format!("the partition key {partition} is required")))?;
    let target_vars: BTreeSet<&str> = target.iter().flat_map(|(_, t)| t.variables()).collect();
    for t in pk.variables().chain(sk.iter().flat_map(|t| t.variables())) {
        if !captures.contains(t) || !target_vars.contains(t) {
            return Err(err(at, format!("{{{t}}} must be captured by source_key and used in target, so a target determines its query")));
        }
    }
    Ok(ReconcileSource::Query { pk, sk_begins_with: sk })
}

#[cfg(test)]
mod tests;
