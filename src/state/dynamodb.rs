//! The state table in DynamoDB: hash key `shard_id`, one item per shard of one stream.

use std::collections::{BTreeMap, HashMap};

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
};
use aws_sdk_dynamodb::Client;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;

use super::definitions::{Beat, Committed};
use super::{Checkpoint, JobStep, Lease, LeaseStore, Progress, StateError};
use crate::rules::copy::job::{CopyJob, StoredJob};

mod jobs;
use crate::aws::{classify, FailureKind};

pub struct DynamoDbLeases {
    client: Client,
    table: String,
    /// Leases are per stream: a recreated table has a new stream and new shards.
    stream_arn: String,
}

impl DynamoDbLeases {
    pub fn new(client: Client, table: String, stream_arn: String) -> DynamoDbLeases {
        DynamoDbLeases { client, table, stream_arn }
    }

    /// Whether this deployment read another of the table's streams before: the stream it reads
    /// now follows that one (it was disabled and enabled again, and every record of the new
    /// one comes after the gap), so it is read from its trim horizon whatever `start_position`
    /// says. Known from the stream last read, kept in the state table ([`Self::note_stream`]),
    /// or, for a state table written before that was kept, from a lease of another stream.
    pub async fn follows_another_stream(&self) -> Result<bool, StateError> {
        let noted = self.last_stream().await?;
        if follows_from(noted.as_ref(), &self.stream_arn, false) {
            return Ok(true);
        }
        self.holds_another_streams_lease().await
    }

    /// The stream this deployment last started reading, and whether that one followed another
    /// (None: never, or before it was kept).
    async fn last_stream(&self) -> Result<Option<(String, bool)>, StateError> {
        let resp = self.client.get_item().table_name(&self.table).key("shard_id", s(STREAM_READ)).consistent_read(true).send().await;
        match resp {
            Ok(r) => Ok(r.item().and_then(|i| {
                let arn = i.get("followed_arn")?.as_s().ok()?.clone();
                Some((arn, i.get("follows_another").and_then(|v| v.as_bool().ok()).copied().unwrap_or(false)))
            })),
            Err(e) => map_err(e, &self.table).map(|_| None),
        }
    }

    /// Keeps this stream as the one this deployment reads, so a replica started after the old
    /// stream's leases are gone (deleted a day after its shards left the listing) still knows
    /// the stream it finds is a new one.
    /// `follows`: this stream follows another, so a replica that starts after this note but
    /// before any lease of it exists still reads it from the horizon.
    pub async fn note_stream(&self, follows: bool) -> Result<(), StateError> {
        let resp = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("shard_id", s(STREAM_READ))
            .item("followed_arn", s(&self.stream_arn))
            .item("follows_another", AttributeValue::Bool(follows))
            .item("noted_at", n(super::now_ms()))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }

    /// Whether a deployment has read a stream with this state table: it noted the stream it
    /// reads, or holds a lease (of any stream). A new state table has neither, nor does one
    /// that does not exist yet.
    pub async fn has_read_a_stream(&self) -> Result<bool, StateError> {
        match self.last_stream().await {
            Ok(Some(_)) => return Ok(true),
            Ok(None) => {}
            Err(StateError::TableMissing(_)) => return Ok(false),
            Err(e) => return Err(e),
        }
        let mut found = false;
        self.scan_pages("attribute_exists(stream_arn)", Some("shard_id"), |items| {
            found = !items.is_empty();
            Ok(found)
        })
        .await?;
        Ok(found)
    }

    /// Whether the state table holds a lease of another stream. Stops at the first one.
    async fn holds_another_streams_lease(&self) -> Result<bool, StateError> {
        let mut found = false;
        self.scan_pages("attribute_exists(stream_arn) AND stream_arn <> :arn", Some("shard_id"), |items| {
            found = !items.is_empty();
            Ok(found)
        })
        .await?;
        Ok(found)
    }

    /// A consistent scan of the state table with `filter` (`:arn`, where it is used, is this
    /// stream's ARN), page by page into `page`, until it returns true (stop) or the table ends.
    async fn scan_pages(
        &self,
        filter: &str,
        projection: Option<&str>,
        page: impl FnMut(&[HashMap<String, AttributeValue>]) -> Result<bool, StateError>,
    ) -> Result<(), StateError> {
        let values = filter.contains(":arn").then(|| HashMap::from([(":arn".to_string(), s(&self.stream_arn))]));
        self.scan_with(filter, values, projection, page).await
    }

    /// A consistent scan of the items whose key starts with `prefix` (heartbeats, copy jobs),
    /// page by page into `page`.
    async fn scan_prefix(
        &self,
        prefix: &str,
        page: impl FnMut(&[HashMap<String, AttributeValue>]) -> Result<bool, StateError>,
    ) -> Result<(), StateError> {
        let values = Some(HashMap::from([(":p".to_string(), s(prefix))]));
        self.scan_with("begins_with(shard_id, :p)", values, None, page).await
    }

    async fn scan_with(
        &self,
        filter: &str,
        values: Option<HashMap<String, AttributeValue>>,
        projection: Option<&str>,
        mut page: impl FnMut(&[HashMap<String, AttributeValue>]) -> Result<bool, StateError>,
    ) -> Result<(), StateError> {
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        for _ in 0..100_000 {
            let resp = self
                .client
                .scan()
                .table_name(&self.table)
                .consistent_read(true)
                .filter_expression(filter)
                .set_expression_attribute_values(values.clone())
                .set_projection_expression(projection.map(str::to_string))
                .set_exclusive_start_key(start.take())
                .send()
                .await;
            let resp = match resp {
                Ok(r) => r,
                Err(e) => {
                    map_err(e, &self.table)?;
                    return Err(StateError::Transient("scan condition failed".into()));
                }
            };
            if page(resp.items())? {
                return Ok(());
            }
            match resp.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => return Ok(()),
            }
        }
        Err(StateError::Fatal("state table scan did not finish".into()))
    }

    /// The state-table item of the pending "reconcile everything" request. It has no
    /// `stream_arn`, so it is never listed as a lease; it outlives the stream (a re-enabled
    /// stream's gap is covered by the same request).
    fn request_key(&self) -> String {
        RECONCILE_REQUEST.to_string()
    }
}

/// Key of the state-table item holding the rule fingerprints (no `stream_arn`: never a lease),
/// one attribute `rule:<name>` per rule.
pub const RULE_FINGERPRINTS: &str = "rule-fingerprints";
const FINGERPRINT_PREFIX: &str = "rule:";

/// Key of the state-table item holding the committed rule definitions (JSON in `definitions`,
/// `generation`, and `revision`, which every store advances and conditions on).
pub const DEFINITIONS: &str = "definitions";
/// Prefix of the state-table items holding replicas' heartbeats (`replica#<owner>`).
pub const BEAT_PREFIX: &str = "replica#";

/// Key of the state-table item holding a pending request to reconcile everything.
pub const RECONCILE_REQUEST: &str = "reconcile-request";
/// Key of the state-table item naming the stream this deployment reads (`followed_arn`; no
/// `stream_arn`, so it is never listed as a lease).
pub const STREAM_READ: &str = "stream-read";

/// Whether the stream read now follows another, from the stream noted last (its ARN, and
/// whether it followed one) and whether the state table holds another stream's lease (pure).
pub fn follows_from(noted: Option<&(String, bool)>, current: &str, holds_other_lease: bool) -> bool {
    match noted {
        Some((arn, followed)) if arn == current => *followed || holds_other_lease,
        Some(_) => true,
        None => holds_other_lease,
    }
}

/// Maps an SDK error; a failed condition is `Ok(false)` for the caller.
fn map_err<E>(e: SdkError<E, HttpResponse>, table: &str) -> Result<bool, StateError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let f = classify(&e);
    match f.kind {
        FailureKind::ConditionFailed => Ok(false),
        FailureKind::Throttled | FailureKind::Transient => Err(StateError::Transient(f.to_string())),
        FailureKind::NotFound => Err(StateError::TableMissing(table.to_string())),
        _ => Err(StateError::Fatal(f.to_string())),
    }
}

/// A heartbeat item; one of another shape is skipped (it is not a lease either).
fn beat_of(item: &HashMap<String, AttributeValue>) -> Option<Beat> {
    let num = |k: &str| item.get(k).and_then(|v| v.as_n().ok()).and_then(|v| v.parse::<u64>().ok());
    Some(Beat {
        owner: item.get("owner")?.as_s().ok()?.clone(),
        digest: item.get("digest")?.as_s().ok()?.clone(),
        protocol: num("protocol")?,
        until_ms: num("expires_at")?,
    })
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

/// The lease attribute that marks a reader started at the trim horizon that applied nothing
/// yet ([`Checkpoint::TrimHorizon`]); `checkpoint`, once set, takes precedence.
pub const HORIZON: &str = "horizon";

const OWNED: &str = "#o = :owner AND #c = :counter";

impl DynamoDbLeases {
    /// An UpdateItem on a lease, conditioned on `owner` still holding it with `counter`.
    fn owned(
        &self,
        shard_id: &str,
        owner: &str,
        counter: u64,
    ) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(shard_id))
            .condition_expression(OWNED)
            .expression_attribute_names("#o", "owner")
            .expression_attribute_names("#c", "counter")
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":counter", n(counter))
    }

    /// Sends a conditional update (a lease's, a copy job's): false when its condition failed.
    async fn send_owned(
        &self,
        req: aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder,
    ) -> Result<bool, StateError> {
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }
}

impl LeaseStore for DynamoDbLeases {
    async fn prepare(&self, create: bool) -> Result<(), StateError> {
        match self.client.describe_table().table_name(&self.table).send().await {
            Ok(_) => return Ok(()),
            Err(e) => {
                let f = classify(&e);
                if f.kind != FailureKind::NotFound {
                    return Err(StateError::Fatal(format!("describing state table {}: {f}", self.table)));
                }
            }
        }
        if !create {
            return Err(StateError::TableMissing(self.table.clone()));
        }
        let created = self
            .client
            .create_table()
            .table_name(&self.table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name("shard_id")
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(|e| StateError::Fatal(e.to_string()))?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name("shard_id")
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(|e| StateError::Fatal(e.to_string()))?,
            )
            .send()
            .await;
        if let Err(e) = created {
            let f = classify(&e);
            // Another replica created it at the same moment.
            if f.code != "ResourceInUseException" {
                return Err(StateError::Fatal(format!("creating state table {}: {f}", self.table)));
            }
        }
        // Wait (bounded) until the table is ACTIVE.
        for _ in 0..120 {
            let d = self.client.describe_table().table_name(&self.table).send().await;
            if let Ok(d) = d {
                if d.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                    return Ok(());
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        Err(StateError::Fatal(format!("state table {} did not become ACTIVE in 60 s", self.table)))
    }

    async fn list(&self) -> Result<Vec<Lease>, StateError> {
        let mut out = Vec::new();
        self.scan_pages("stream_arn = :arn", None, |items| {
            for item in items {
                out.push(super::items::lease(item)?);
            }
            Ok(false)
        })
        .await?;
        Ok(out)
    }

    async fn create(&self, lease: &Lease) -> Result<bool, StateError> {
        let mut req = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("shard_id", s(&lease.shard_id))
            .item("stream_arn", s(&self.stream_arn))
            .item("counter", n(0))
            .item("expires_at", n(0))
            .condition_expression("attribute_not_exists(shard_id)");
        if let Some(p) = &lease.parent {
            req = req.item("parent", s(p));
        }
        // A re-listed shard whose child holds a checkpoint is created finished (plan::new_lease).
        if let Some(cp) = &lease.checkpoint {
            req = req.item("checkpoint", s(cp.as_str()));
        }
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    async fn take(&self, lease: &Lease, owner: &str, expires_at_ms: u64) -> Result<Option<Lease>, StateError> {
        let resp = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(&lease.shard_id))
            .update_expression("SET #o = :owner, #c = :next, #e = :exp")
            .condition_expression("#c = :counter")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_names("#c", "counter")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":next", n(lease.counter + 1))
            .expression_attribute_values(":counter", n(lease.counter))
            .expression_attribute_values(":exp", n(expires_at_ms))
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await;
        match resp {
            Ok(r) => r.attributes().map(super::items::lease).transpose(),
            Err(e) => map_err(e, &self.table).map(|_| None),
        }
    }

    async fn renew(&self, shard_id: &str, owner: &str, counter: u64, expires_at_ms: u64) -> Result<bool, StateError> {
        let req = self
            .owned(shard_id, owner, counter)
            .update_expression("SET #e = :exp")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":exp", n(expires_at_ms));
        self.send_owned(req).await
    }

    async fn checkpoint(&self, shard_id: &str, owner: &str, counter: u64, progress: &Progress) -> Result<bool, StateError> {
        let mut sets = Vec::new();
        let mut req = self.owned(shard_id, owner, counter);
        match &progress.checkpoint {
            // Its own attribute: it never overwrites a sequence checkpoint, and a version that
            // does not know it reads no checkpoint (and starts as it always did) instead of
            // asking for an iterator after sequence number "TRIM_HORIZON".
            Some(Checkpoint::TrimHorizon) => {
                sets.push("#hz = :hz");
                req = req.expression_attribute_names("#hz", HORIZON).expression_attribute_values(":hz", s(Checkpoint::TRIM_HORIZON));
            }
            Some(cp) => {
                sets.push("#cp = :cp");
                req = req.expression_attribute_names("#cp", "checkpoint").expression_attribute_values(":cp", s(cp.as_str()));
            }
            None => {}
        }
        if let Some(t) = progress.last_record_ms {
            sets.push("#lr = :lr");
            req = req.expression_attribute_names("#lr", "last_record_ms").expression_attribute_values(":lr", n(t));
        }
        if let Some(t) = progress.at_tip_ms {
            sets.push("#tip = :tip");
            req = req.expression_attribute_names("#tip", "at_tip_ms").expression_attribute_values(":tip", n(t));
        }
        let mut remove = "";
        match progress.fold_due.as_deref() {
            None => {}
            // A string set cannot be empty.
            Some([]) => remove = " REMOVE #fd",
            Some(due) => {
                sets.push("#fd = :fd");
                req = req.expression_attribute_values(":fd", AttributeValue::Ss(due.to_vec()));
            }
        }
        if progress.fold_due.is_some() {
            req = req.expression_attribute_names("#fd", "fold_due");
        }
        if sets.is_empty() && remove.is_empty() {
            return Ok(true);
        }
        let set = if sets.is_empty() { String::new() } else { format!("SET {}", sets.join(", ")) };
        self.send_owned(req.update_expression(format!("{set}{remove}"))).await
    }

    async fn delete(&self, lease: &Lease) -> Result<bool, StateError> {
        let resp = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key("shard_id", s(&lease.shard_id))
            .condition_expression("#c = :counter AND #cp = :end")
            .expression_attribute_names("#c", "counter")
            .expression_attribute_names("#cp", "checkpoint")
            .expression_attribute_values(":counter", n(lease.counter))
            .expression_attribute_values(":end", s(Checkpoint::SHARD_END))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    async fn request_reconcile(&self, at_ms: u64) -> Result<(), StateError> {
        // The oldest request says since when; the latest decides which run may clear it.
        let resp = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(&self.request_key()))
            .update_expression("SET #r = if_not_exists(#r, :at), #l = :at")
            .expression_attribute_names("#r", "requested_at")
            .expression_attribute_names("#l", "latest_request_at")
            .expression_attribute_values(":at", n(at_ms))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }

    async fn reconcile_request(&self) -> Result<Option<u64>, StateError> {
        let resp =
            self.client.get_item().table_name(&self.table).key("shard_id", s(&self.request_key())).consistent_read(true).send().await;
        match resp {
            Ok(r) => r.item().map(super::items::requested_at).transpose(),
            Err(e) => map_err(e, &self.table).map(|_| None),
        }
    }

    async fn clear_reconcile_request(&self, started_ms: u64) -> Result<bool, StateError> {
        let resp = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key("shard_id", s(&self.request_key()))
            .condition_expression("#l <= :started")
            .expression_attribute_names("#l", "latest_request_at")
            .expression_attribute_values(":started", n(started_ms))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    async fn release(&self, shard_id: &str, owner: &str, counter: u64) -> Result<bool, StateError> {
        let req = self
            .owned(shard_id, owner, counter)
            .update_expression("REMOVE #o SET #e = :zero")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":zero", n(0));
        self.send_owned(req).await
    }

    async fn hold_named(&self, name: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        // No `stream_arn`: never listed as a shard's lease.
        let resp = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(name))
            .update_expression("SET #o = :me, #e = :until")
            .condition_expression("attribute_not_exists(#o) OR #o = :me OR #e < :now")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":me", s(owner))
            .expression_attribute_values(":until", n(until_ms))
            .expression_attribute_values(":now", n(now_ms))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    async fn rule_fingerprints(&self) -> Result<Option<BTreeMap<String, String>>, StateError> {
        let resp = self.client.get_item().table_name(&self.table).key("shard_id", s(RULE_FINGERPRINTS)).consistent_read(true).send().await;
        match resp {
            Ok(r) => Ok(r.item().map(|item| {
                item.iter().filter_map(|(k, v)| Some((k.strip_prefix(FINGERPRINT_PREFIX)?.to_string(), v.as_s().ok()?.clone()))).collect()
            })),
            Err(e) => map_err(e, &self.table).map(|_| None),
        }
    }

    async fn record_fingerprints(&self, fingerprints: &BTreeMap<String, String>) -> Result<(), StateError> {
        // One attribute per rule: replicas recording different rules do not overwrite each other.
        let mut req = self.client.update_item().table_name(&self.table).key("shard_id", s(RULE_FINGERPRINTS));
        let mut sets = vec!["#at = :at".to_string()];
        req = req.expression_attribute_names("#at", "recorded_at").expression_attribute_values(":at", n(crate::state::now_ms()));
        for (i, (rule, fp)) in fingerprints.iter().enumerate() {
            sets.push(format!("#r{i} = :r{i}"));
            req = req
                .expression_attribute_names(format!("#r{i}"), format!("{FINGERPRINT_PREFIX}{rule}"))
                .expression_attribute_values(format!(":r{i}"), s(fp));
        }
        match req.update_expression(format!("SET {}", sets.join(", "))).send().await {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }

    async fn definitions(&self) -> Result<Option<(Committed, u64)>, StateError> {
        let resp = self.client.get_item().table_name(&self.table).key("shard_id", s(DEFINITIONS)).consistent_read(true).send().await;
        let item = match resp {
            Ok(r) => r.item().cloned(),
            Err(e) => return map_err(e, &self.table).map(|_| None),
        };
        let Some(item) = item else { return Ok(None) };
        let malformed = |why: String| StateError::Malformed(DEFINITIONS.into(), why);
        let text = item.get("definitions").and_then(|v| v.as_s().ok()).ok_or_else(|| malformed("no definitions string".into()))?;
        let committed: Committed = serde_json::from_str(text).map_err(|e| malformed(format!("definitions: {e}")))?;
        let revision = item
            .get("revision")
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| malformed("no revision number".into()))?;
        Ok(Some((committed, revision)))
    }

    async fn store_definitions(&self, committed: &Committed, revision: Option<u64>) -> Result<bool, StateError> {
        let text = serde_json::to_string(committed).map_err(|e| StateError::Fatal(format!("encoding the definitions: {e}")))?;
        let req = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("shard_id", s(DEFINITIONS))
            .item("definitions", s(&text))
            .item("generation", n(committed.generation))
            .item("protocol", n(committed.protocol))
            .item("revision", n(revision.map_or(1, |r| r.saturating_add(1))))
            .item("stored_at", n(super::now_ms()))
            .expression_attribute_names("#r", "revision");
        let req = match revision {
            Some(r) => req.condition_expression("#r = :r").expression_attribute_values(":r", n(r)),
            None => req.condition_expression("attribute_not_exists(#r)"),
        };
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    async fn publish_beat(&self, beat: &Beat) -> Result<(), StateError> {
        let resp = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("shard_id", s(&format!("{BEAT_PREFIX}{}", beat.owner)))
            .item("owner", s(&beat.owner))
            .item("digest", s(&beat.digest))
            .item("protocol", n(beat.protocol))
            .item("expires_at", n(beat.until_ms))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }

    async fn beats(&self) -> Result<Vec<Beat>, StateError> {
        let mut out = Vec::new();
        self.scan_prefix(BEAT_PREFIX, |items| {
            out.extend(items.iter().filter_map(beat_of));
            Ok(false)
        })
        .await?;
        Ok(out)
    }

    async fn drop_beat(&self, owner: &str) -> Result<(), StateError> {
        let resp = self.client.delete_item().table_name(&self.table).key("shard_id", s(&format!("{BEAT_PREFIX}{owner}"))).send().await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }

    async fn record_copy_job(&self, job: &CopyJob) -> Result<bool, StateError> {
        self.put_job(job).await
    }

    async fn copy_jobs(&self) -> Result<Vec<StoredJob>, StateError> {
        self.list_jobs().await
    }

    async fn claim_copy_job(&self, id: &str, version: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        self.claim_job(id, version, owner, until_ms, now_ms).await
    }

    async fn advance_copy_job(&self, id: &str, version: &str, owner: &str, step: &JobStep) -> Result<bool, StateError> {
        self.advance_job(id, version, owner, step).await
    }

    async fn end_copy_job(&self, id: &str, version: &str, next: Option<&CopyJob>) -> Result<bool, StateError> {
        self.end_job(id, version, next).await
    }

    async fn release_named(&self, name: &str, owner: &str) -> Result<(), StateError> {
        let resp = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(name))
            .update_expression("REMOVE #o")
            .condition_expression("#o = :me")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_values(":me", s(owner))
            .send()
            .await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => map_err(e, &self.table).map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::follows_from;

    #[test]
    fn a_stream_follows_another_by_the_note_or_by_an_old_lease() {
        let noted = |arn: &str, followed: bool| Some((arn.to_string(), followed));
        // Another stream noted: this one follows it, leases or not (they go a day later).
        assert!(follows_from(noted("old", false).as_ref(), "new", false));
        // This stream noted by a replica that found it followed another: a replica starting
        // before any lease of it exists still reads it from the horizon.
        assert!(follows_from(noted("new", true).as_ref(), "new", false));
        // Noted as a fresh start, or nothing noted: only another stream's lease says so.
        assert!(!follows_from(noted("new", false).as_ref(), "new", false));
        assert!(follows_from(noted("new", false).as_ref(), "new", true));
        assert!(!follows_from(None, "new", false));
        assert!(follows_from(None, "new", true));
    }
}
