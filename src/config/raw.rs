//! The YAML file as written: serde structs that reject unknown keys. Nothing here is checked
//! beyond types; `validate` turns this into a [`super::Config`] that cannot be invalid.

use indexmap::IndexMap;
use serde::{Deserialize, Deserializer};

/// Durations and other text settings written as a bare number (`10`) arrive as numbers;
/// take them as text so validation can say what is missing (a unit).
fn text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        S(String),
        U(u64),
        I(i64),
        F(f64),
    }
    Ok(Option::<Text>::deserialize(d)?.map(|t| match t {
        Text::S(s) => s,
        Text::U(n) => n.to_string(),
        Text::I(n) => n.to_string(),
        Text::F(n) => n.to_string(),
    }))
}

/// A ledger namespace: text only. YAML reads some (`123456`, `-12345`) as numbers, whose text
/// is not the namespace any more, so those must be quoted.
fn namespace<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        S(String),
        Other(serde::de::IgnoredAny),
    }
    match Option::<Text>::deserialize(d)? {
        None => Ok(None),
        Some(Text::S(s)) => Ok(Some(s)),
        Some(Text::Other(_)) => {
            Err(serde::de::Error::custom("YAML reads this namespace as a number: write it in quotes (\"123456\", also in the environment)"))
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub source: RawSource,
    pub state: RawState,
    /// Defaults to the source table.
    #[serde(default)]
    pub aggregates: Option<RawAggregates>,
    #[serde(default)]
    pub dead_letter: Option<RawDeadLetter>,
    #[serde(default)]
    pub reconcile: Option<RawReconcile>,
    #[serde(default)]
    pub metrics: Option<RawMetrics>,
    #[serde(default)]
    pub aws: Option<RawAws>,
    pub rules: Vec<RawRule>,
}

/// The AWS SDK's timeouts and retries (every client: DynamoDB, Streams, SQS).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAws {
    /// Default 3s.
    #[serde(default, deserialize_with = "text")]
    pub connect_timeout: Option<String>,
    /// Default 20s: one HTTP response.
    #[serde(default, deserialize_with = "text")]
    pub read_timeout: Option<String>,
    /// Default 60s: one call with its retries.
    #[serde(default, deserialize_with = "text")]
    pub operation_timeout: Option<String>,
    /// Default 3 (the first attempt included).
    #[serde(default, deserialize_with = "text")]
    pub max_attempts: Option<String>,
    /// `standard` (default) or `adaptive` (client-side rate limiting on throttling).
    #[serde(default, deserialize_with = "text")]
    pub retry_mode: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSource {
    /// Source table name; its stream ARN is resolved with DescribeTable.
    pub table: String,
    /// For shards without a checkpoint: `trim_horizon` (default) or `latest`.
    #[serde(default)]
    pub start_position: Option<String>,
    /// GetRecords Limit, 1..=1000 (default 1000).
    #[serde(default)]
    pub batch_size: Option<u32>,
    /// Wait up to this for more records before writing (default 0s).
    #[serde(default, deserialize_with = "text")]
    pub batching_window: Option<String>,
    /// Records older than this (by ApproximateCreationDateTime) are dead-lettered with reason
    /// `too_old` instead of applied, like Lambda's MaximumRecordAgeInSeconds. Default: none.
    #[serde(default, deserialize_with = "text")]
    pub max_record_age: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawState {
    /// Lease and checkpoint table.
    pub table: String,
    /// Create the state table when missing (default false).
    #[serde(default)]
    pub create_table: Option<bool>,
    /// Default 10s.
    #[serde(default, deserialize_with = "text")]
    pub lease_duration: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAggregates {
    pub table: String,
    /// Names this deployment's ledger entries on target items (default: derived from the
    /// state table), so two deployments writing one item never refuse or prune each other.
    #[serde(default, deserialize_with = "namespace")]
    pub ledger_namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDeadLetter {
    pub queue_url: String,
    /// Attempts before a poison record goes to the queue (default 5).
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Put NewImage/OldImage in dead letters (default true); false for tables with personal
    /// data keeps only keys and metadata.
    #[serde(default)]
    pub include_images: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReconcile {
    /// `0s` disables the schedule (default 1h).
    #[serde(default, deserialize_with = "text")]
    pub interval: Option<String>,
    /// What the schedule reconciles: `touched` (targets this replica wrote since its last
    /// run, default) or `all` (a full scan every interval).
    #[serde(default)]
    pub scope: Option<String>,
    /// Longest wait for a live replica that is behind (default 2m).
    #[serde(default, deserialize_with = "text")]
    pub wait: Option<String>,
    /// How long after the truth read the consumer's evidence must be (stream propagation and
    /// clock skew; default 2s).
    #[serde(default, deserialize_with = "text")]
    pub margin: Option<String>,
    /// How long after a rule change's leftovers are zeroed they are removed (default 25h: past
    /// the stream's 24 h retention, so no replay can reach them).
    #[serde(default, deserialize_with = "text")]
    pub remove_leftovers_after: Option<String>,
    /// A Pushgateway (http://host:port) the `reconcile` command pushes its results to.
    #[serde(default, deserialize_with = "text")]
    pub pushgateway: Option<String>,
    /// When an idle open shard counts as read to its tip (default `{empty_pages: 3, over: 2s}`).
    #[serde(default)]
    pub tip_evidence: Option<RawTipEvidence>,
}

/// The empty-page rule: this many empty GetRecords pages in a row on one iterator chain,
/// spanning at least `over`, are taken as the shard's tip.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTipEvidence {
    /// Default 3.
    #[serde(default, deserialize_with = "text")]
    pub empty_pages: Option<String>,
    /// From the first page's call to the last one's (default 2s).
    #[serde(default, deserialize_with = "text")]
    pub over: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// Default 0.0.0.0:9464.
    #[serde(default, deserialize_with = "text")]
    pub listen: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub name: String,
    /// A filter pattern or a list of them (any matches); absent: every record.
    #[serde(default)]
    pub filter: Option<serde_json::Value>,
    /// Compare N values numerically in this rule's patterns (Lambda cannot).
    #[serde(default)]
    pub numeric_strings: bool,
    pub source_key: IndexMap<String, String>,
    pub target: IndexMap<String, String>,
    /// Attribute name (template) -> `count` or `{count: true | sum: ATTR | avg: ATTR, where: PATTERN}`.
    pub measures: IndexMap<String, serde_json::Value>,
    #[serde(default)]
    pub reconcile: Option<RawRuleReconcile>,
    /// `count` (default: a TTL delete is a delete) or `ignore`.
    #[serde(default)]
    pub ttl_deletes: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRuleReconcile {
    /// `{PK: "CUST#{customer}", SK_begins_with: "ORDER#"}`
    #[serde(default)]
    pub query: Option<IndexMap<String, String>>,
    #[serde(default)]
    pub scan: Option<bool>,
}
