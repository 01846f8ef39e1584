//! Copy fan-out jobs in the state table ([`crate::rules::copy::job`]): one item per (rule,
//! source item), keyed `copy-job#<rule>#<digest>`, never listed as a lease (no `stream_arn`).

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::{map_err, n, s, DynamoDbLeases};
use crate::rules::copy::job::{CopyJob, StoredJob, JOB_PREFIX};
use crate::state::{JobStep, StateError};

/// Every step of a job is conditioned on the job still being this change's.
const SAME_CHANGE: &str = "#v = :v";

fn json<T: serde::Serialize>(value: &T) -> Result<AttributeValue, StateError> {
    serde_json::to_string(value).map(AttributeValue::S).map_err(|e| StateError::Fatal(format!("encoding a copy job: {e}")))
}

/// The item `record_copy_job` and `end_copy_job` put.
fn job_item(job: &CopyJob) -> Result<HashMap<String, AttributeValue>, StateError> {
    let mut item = HashMap::from([
        ("shard_id".to_string(), s(&job.id())),
        ("rule".to_string(), s(&job.rule)),
        ("version".to_string(), s(&job.version())),
        ("change".to_string(), json(&job.change)?),
        ("found".to_string(), n(job.found)),
        ("created_at".to_string(), n(job.created_ms)),
        ("due_at".to_string(), n(job.due_ms)),
        ("follow_up".to_string(), AttributeValue::Bool(job.follow_up)),
    ]);
    if let Some(c) = &job.cursor {
        item.insert("cursor".to_string(), json(c)?);
    }
    Ok(item)
}

impl DynamoDbLeases {
    /// Records `job` over an older change's: unclaimed, from its own cursor, keeping the
    /// older one's creation time (the copies have been pending since then).
    pub(super) async fn put_job(&self, job: &CopyJob) -> Result<bool, StateError> {
        let mut sets = vec!["#rule = :rule", "#v = :v", "#change = :change", "#found = :found", "#due = :due", "#fu = :fu"];
        sets.push("#created = if_not_exists(#created, :created)");
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(&job.id()))
            .condition_expression("attribute_not_exists(#v) OR #v < :v")
            .expression_attribute_names("#rule", "rule")
            .expression_attribute_names("#v", "version")
            .expression_attribute_names("#change", "change")
            .expression_attribute_names("#found", "found")
            .expression_attribute_names("#due", "due_at")
            .expression_attribute_names("#fu", "follow_up")
            .expression_attribute_names("#created", "created_at")
            .expression_attribute_names("#cur", "cursor")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":rule", s(&job.rule))
            .expression_attribute_values(":v", s(&job.version()))
            .expression_attribute_values(":change", json(&job.change)?)
            .expression_attribute_values(":found", n(job.found))
            .expression_attribute_values(":due", n(job.due_ms))
            .expression_attribute_values(":fu", AttributeValue::Bool(job.follow_up))
            .expression_attribute_values(":created", n(job.created_ms));
        let remove = match &job.cursor {
            Some(c) => {
                sets.push("#cur = :cur");
                req = req.expression_attribute_values(":cur", json(c)?);
                "REMOVE #o, #e"
            }
            None => "REMOVE #o, #e, #cur",
        };
        let resp = req.update_expression(format!("SET {} {remove}", sets.join(", "))).send().await;
        match resp {
            Ok(_) => Ok(true),
            Err(e) => map_err(e, &self.table),
        }
    }

    pub(super) async fn list_jobs(&self) -> Result<Vec<StoredJob>, StateError> {
        let mut out = Vec::new();
        self.scan_prefix(JOB_PREFIX, |items| {
            // An item this release cannot read (hand-edited, or a newer release's) is left to
            // the replicas that can: it must not stop the other jobs.
            for item in items {
                match crate::state::items::copy_job(item) {
                    Ok(job) => out.push(job),
                    Err(e) => tracing::warn!(error = %e, "a copy job item this release cannot read is left alone"),
                }
            }
            Ok(false)
        })
        .await?;
        Ok(out)
    }

    pub(super) async fn claim_job(&self, id: &str, version: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        let req = self
            .claimed_update(id, version, owner)
            .update_expression("SET #o = :me, #e = :until")
            .condition_expression(format!("{SAME_CHANGE} AND #due <= :now AND (attribute_not_exists(#o) OR #o = :me OR #e <= :now)"))
            .expression_attribute_names("#due", "due_at")
            .expression_attribute_values(":until", n(until_ms))
            .expression_attribute_values(":now", n(now_ms));
        self.send_owned(req).await
    }

    pub(super) async fn advance_job(&self, id: &str, version: &str, owner: &str, step: &JobStep) -> Result<bool, StateError> {
        let req = self
            .claimed_update(id, version, owner)
            .update_expression("SET #cur = :cur, #w = :w, #e = :until")
            .condition_expression(format!("{SAME_CHANGE} AND #o = :me"))
            .expression_attribute_names("#cur", "cursor")
            .expression_attribute_names("#w", "found")
            .expression_attribute_values(":cur", json(&step.cursor)?)
            .expression_attribute_values(":w", n(step.found))
            .expression_attribute_values(":until", n(step.until_ms));
        self.send_owned(req).await
    }

    /// An UpdateItem of job `id` with the names and values its conditions share: `#v`/`:v`
    /// (the change's version), `#o`/`:me` (the runner), `#e` (the claim's expiry).
    fn claimed_update(
        &self,
        id: &str,
        version: &str,
        owner: &str,
    ) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("shard_id", s(id))
            .expression_attribute_names("#v", "version")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_names("#e", "expires_at")
            .expression_attribute_values(":v", s(version))
            .expression_attribute_values(":me", s(owner))
    }

    pub(super) async fn end_job(&self, id: &str, version: &str, next: Option<&CopyJob>) -> Result<bool, StateError> {
        let resp = match next {
            Some(job) => self
                .client
                .put_item()
                .table_name(&self.table)
                .set_item(Some(job_item(job)?))
                .condition_expression(SAME_CHANGE)
                .expression_attribute_names("#v", "version")
                .expression_attribute_values(":v", s(version))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| map_err(e, &self.table)),
            None => self
                .client
                .delete_item()
                .table_name(&self.table)
                .key("shard_id", s(id))
                .condition_expression(SAME_CHANGE)
                .expression_attribute_names("#v", "version")
                .expression_attribute_values(":v", s(version))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| map_err(e, &self.table)),
        };
        match resp {
            Ok(()) => Ok(true),
            Err(r) => r,
        }
    }
}
