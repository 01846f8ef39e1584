//! The YAML file as written: serde structs that reject unknown keys. Nothing here is checked
//! beyond types; `validate` turns this into a [`super::Config`] that cannot be invalid.

use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer};

use super::schema;

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

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
/// The config file of ddb-aggregator (`ddb-aggregator validate --config FILE` checks one).
#[schemars(rename = "Config", title = "ddb-aggregator config")]
pub struct RawConfig {
    /// The table whose stream is read.
    pub source: RawSource,
    /// Where leases, checkpoints and the committed rule definitions are kept.
    pub state: RawState,
    /// Defaults to the source table.
    #[serde(default)]
    pub aggregates: Option<RawAggregates>,
    /// The SQS queue that poison records go to, with their full payload.
    #[serde(default)]
    pub dead_letter: Option<RawDeadLetter>,
    /// The scheduled reconcile that repairs drift, and how any reconcile decides a shard is read.
    #[serde(default)]
    pub reconcile: Option<RawReconcile>,
    /// The Prometheus endpoint (/metrics, /healthz, /readyz).
    #[serde(default)]
    pub metrics: Option<RawMetrics>,
    /// The AWS SDK's timeouts and retries (every client: DynamoDB, Streams, SQS).
    #[serde(default)]
    pub aws: Option<RawAws>,
    /// What to aggregate: each rule filters records, keys them to a target item, and keeps
    /// measures on it.
    pub rules: Vec<RawRule>,
}

/// The AWS SDK's timeouts and retries (every client: DynamoDB, Streams, SQS).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Aws")]
pub struct RawAws {
    /// Default 3s.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub connect_timeout: Option<String>,
    /// Default 20s: one HTTP response.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub read_timeout: Option<String>,
    /// Default 60s: one call with its retries.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub operation_timeout: Option<String>,
    /// Default 3 (the first attempt included).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Whole>")]
    pub max_attempts: Option<String>,
    /// `standard` (default) or `adaptive` (client-side rate limiting on throttling).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::RetryMode>")]
    pub retry_mode: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Source")]
pub struct RawSource {
    /// Source table name; its stream ARN is resolved with DescribeTable.
    pub table: String,
    /// For shards without a checkpoint: `trim_horizon` (default) or `latest`.
    #[serde(default)]
    #[schemars(with = "Option<schema::StartPosition>")]
    pub start_position: Option<String>,
    /// Most records per batch, 1 to 10,000 (default 1000), as Lambda; above 1000 a batch
    /// gathers several GetRecords pages.
    #[serde(default)]
    #[schemars(range(min = 1, max = 10000))]
    pub batch_size: Option<u32>,
    /// Wait up to this for more records before writing (default 0s).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub batching_window: Option<String>,
    /// Records older than this (by ApproximateCreationDateTime) are dead-lettered with reason
    /// `too_old` instead of applied, like Lambda's MaximumRecordAgeInSeconds. Default: none.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub max_record_age: Option<String>,
    /// Behind the tip, read and evaluate a shard's next batch while a full one writes (default
    /// false: one batch at a time). Faster catch-up where calls wait on the network, for the
    /// memory of a second batch.
    #[serde(default)]
    pub read_ahead: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "State")]
pub struct RawState {
    /// Lease and checkpoint table.
    pub table: String,
    /// Create the state table when missing (default false).
    #[serde(default)]
    pub create_table: Option<bool>,
    /// Default 10s.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub lease_duration: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Aggregates")]
pub struct RawAggregates {
    /// The table the target items are written to (default: the source table).
    #[serde(default)]
    pub table: Option<String>,
    /// Names this deployment's ledger entries on target items (default: derived from the
    /// state table), so two deployments writing one item never refuse or prune each other.
    #[serde(default, deserialize_with = "namespace")]
    #[schemars(with = "Option<String>")]
    pub ledger_namespace: Option<String>,
    /// Most target writes a shard keeps in flight at once, 1 to 256 (default 16). A batch
    /// sends as many as it has targets, up to a window that starts at 16 (or this, if lower),
    /// grows while batches need more and halves when the table throttles.
    #[serde(default)]
    #[schemars(range(min = 1, max = 256))]
    pub write_concurrency: Option<u32>,
    /// Most WCU per second this replica writes to one partition key, 0 to 100,000 (default
    /// 800; 0: no pacing). A target and its helper items share a partition key, and a
    /// partition takes about 1,000 WCU/s: writes beyond the budget wait instead of being
    /// throttled.
    #[serde(default)]
    #[schemars(range(min = 0, max = 100000))]
    pub partition_write_rate: Option<u32>,
    /// The table's TTL attribute, for the helper items of max, min, latest and distinct: one at
    /// zero gets an expiry there (once TTL is enabled on it), and every helper write removes
    /// it (default: none, helpers at zero stay).
    #[serde(default)]
    pub helper_expiry_attribute: Option<String>,
    /// How often each replica folds the sub-items of `write_shards` targets it wrote into their
    /// totals, 100ms to 1h (default 1s).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub fold_interval: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "DeadLetter")]
pub struct RawDeadLetter {
    /// The queue's URL (https://sqs.<region>.amazonaws.com/<account>/<name>).
    pub queue_url: String,
    /// Attempts before a poison record goes to the queue (default 5).
    #[serde(default)]
    #[schemars(range(min = 1, max = 100))]
    pub max_attempts: Option<u32>,
    /// Put NewImage/OldImage in dead letters (default true); false for tables with personal
    /// data keeps only keys and metadata.
    #[serde(default)]
    pub include_images: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Reconcile")]
pub struct RawReconcile {
    /// `0s` disables the schedule (default 1h).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub interval: Option<String>,
    /// What the schedule reconciles: `touched` (targets this replica wrote since its last
    /// run, default) or `all` (a full scan every interval).
    #[serde(default)]
    #[schemars(with = "Option<schema::Scope>")]
    pub scope: Option<String>,
    /// Longest wait for a live replica that is behind (default 2m).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub wait: Option<String>,
    /// How long after the truth read the consumer's evidence must be (stream propagation and
    /// clock skew; default 2s).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub margin: Option<String>,
    /// How long after a rule change's leftovers are zeroed they are removed (default 25h: past
    /// the stream's 24 h retention, so no replay can reach them).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub remove_leftovers_after: Option<String>,
    /// A Pushgateway (http://host:port) the `reconcile` command pushes its results to.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<String>")]
    pub pushgateway: Option<String>,
    /// When an idle open shard counts as read to its tip (default `{empty_pages: 3, over: 2s}`).
    #[serde(default)]
    pub tip_evidence: Option<RawTipEvidence>,
}

/// The empty-page rule: this many empty GetRecords pages in a row on one iterator chain,
/// spanning at least `over`, are taken as the shard's tip.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "TipEvidence")]
pub struct RawTipEvidence {
    /// Default 3.
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Whole>")]
    pub empty_pages: Option<String>,
    /// From the first page's call to the last one's (default 2s).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<schema::Duration>")]
    pub over: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Metrics")]
pub struct RawMetrics {
    /// The address to serve on (default 0.0.0.0:9464).
    #[serde(default, deserialize_with = "text")]
    #[schemars(with = "Option<String>")]
    pub listen: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Rule")]
pub struct RawRule {
    /// Unique among the rules; names the rule in metrics, logs and the state table.
    pub name: String,
    /// A filter pattern or a list of them (any matches); absent: every record.
    #[serde(default)]
    #[schemars(with = "Option<schema::Filter>")]
    pub filter: Option<serde_json::Value>,
    /// Compare N values numerically in this rule's patterns (Lambda cannot).
    #[serde(default)]
    pub numeric_strings: bool,
    /// The source item's key attributes as templates that capture variables
    /// (`PK: "CUST#{customer}"`), partition key first.
    pub source_key: IndexMap<String, String>,
    /// The target item's key attributes as templates of those variables
    /// (`PK: "SALES#{date|day}"`), and optionally `write_shards: N` (2 to 100) to spread a hot
    /// target over N sub-items. Every rule but a `copy` rule has one.
    #[serde(default)]
    #[schemars(with = "schema::Target")]
    pub target: IndexMap<String, serde_json::Value>,
    /// Attribute name (template) -> `count` or `{count: true | sum: ATTR | avg: ATTR, where: PATTERN}`.
    /// Every rule but a `copy` rule has at least one.
    #[serde(default)]
    #[schemars(with = "IndexMap<String, schema::Measure>")]
    pub measures: IndexMap<String, serde_json::Value>,
    /// Keep copies of the source item's attributes on the items that display them (the
    /// customer's name on each order), in place of `target` and `measures`.
    #[serde(default)]
    pub copy: Option<RawCopy>,
    /// How reconcile finds this rule's source items: a query or a scan.
    #[serde(default)]
    pub reconcile: Option<RawRuleReconcile>,
    /// `count` (default: a TTL delete is a delete) or `ignore`.
    #[serde(default)]
    #[schemars(with = "Option<schema::TtlDeletes>")]
    pub ttl_deletes: Option<String>,
}

/// A `copy` rule's copies: which source attributes, and the items that hold them.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Copy")]
pub struct RawCopy {
    /// Copy attribute (on the items `to` finds) -> the source attribute it copies:
    /// `{customerName: name}`.
    pub attributes: IndexMap<String, String>,
    /// The items that hold the copies, as a query of templates of `source_key`'s variables:
    /// `{PK: "CUST#{customer}", SK_begins_with: "ORDER#"}` on the table, or
    /// `{index: GSI1, GSI1PK: "CUST#{customer}"}` on a global secondary index (with its
    /// partition key, and optionally its sort key or `<sort key>_begins_with`).
    pub to: IndexMap<String, String>,
    /// Copies one change writes in the batch that read it (1 to 1,000; default 100). A larger
    /// fan-out goes on as a job in the state table, so the shard's other rules do not wait.
    #[serde(default)]
    #[schemars(range(min = 1, max = 1000))]
    pub inline_items: Option<u64>,
    /// Write capacity units per second one fan-out job spends (default 500: half of what one
    /// partition key takes, for copies in the source's item collection).
    #[serde(default)]
    #[schemars(range(min = 1, max = 40000))]
    pub job_capacity_per_second: Option<f64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "RuleReconcile")]
pub struct RawRuleReconcile {
    /// The source items of one target, as a query: `{PK: "CUST#{customer}", SK_begins_with: "ORDER#"}`.
    #[serde(default)]
    pub query: Option<IndexMap<String, String>>,
    /// Find them with a parallel scan instead.
    #[serde(default)]
    pub scan: Option<bool>,
}
