//! Copies in DynamoDB: the fan-out's Query and its conditional UpdateItem.

use std::collections::HashMap;

use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;
use futures::future::BoxFuture;

use super::{CopyOutcome, CopyStore, Found, FoundPage, ItemKey};
use crate::aws::{attribute_to_json, classify, json_to_attribute, FailureKind};
use crate::rules::copy::{CopyChange, FindQuery, SortValue};
use crate::sink::SinkError;

pub struct DynamoDbCopies {
    client: Client,
    table: String,
    /// The table's key attributes, partition key first (DescribeTable).
    key_names: Vec<String>,
}

impl DynamoDbCopies {
    pub fn new(client: Client, table: String, key_names: Vec<String>) -> DynamoDbCopies {
        DynamoDbCopies { client, table, key_names }
    }

    fn error(&self, f: crate::aws::Failure) -> SinkError {
        match f.kind {
            FailureKind::Throttled => SinkError::Throttled(f.to_string()),
            FailureKind::Transient => SinkError::Transient(f.to_string()),
            FailureKind::Invalid => SinkError::Invalid(f.to_string()),
            _ => SinkError::Fatal(format!("{} (table {})", f, self.table)),
        }
    }

    async fn query(&self, q: &FindQuery, version_attribute: &str, start: Option<&ItemKey>) -> Result<FoundPage, SinkError> {
        let mut condition = "#p = :p".to_string();
        let mut req = self
            .client
            .query()
            .table_name(&self.table)
            .set_index_name(q.index.clone())
            // An index is read eventually consistent: DynamoDB offers nothing else there.
            .consistent_read(q.index.is_none())
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .expression_attribute_names("#p", &q.partition.0)
            .expression_attribute_values(":p", AttributeValue::S(q.partition.1.clone()));
        if let Some((name, value)) = &q.sort {
            let (text, expr) = match value {
                SortValue::Equals(v) => (v, " AND #s = :s"),
                SortValue::BeginsWith(v) => (v, " AND begins_with(#s, :s)"),
            };
            condition.push_str(expr);
            req = req.expression_attribute_names("#s", name).expression_attribute_values(":s", AttributeValue::S(text.clone()));
        }
        let mut projection = vec!["#v".to_string()];
        for (i, k) in self.key_names.iter().enumerate() {
            projection.push(format!("#k{i}"));
            req = req.expression_attribute_names(format!("#k{i}"), k);
        }
        req = req
            .key_condition_expression(condition)
            .projection_expression(projection.join(", "))
            .expression_attribute_names("#v", version_attribute);
        if let Some(start) = start {
            let start: HashMap<String, AttributeValue> = start
                .iter()
                .map(|(k, v)| json_to_attribute(v).map(|a| (k.clone(), a)))
                .collect::<Result<_, _>>()
                .map_err(SinkError::Fatal)?;
            req = req.set_exclusive_start_key(Some(start));
        }
        let out = req.send().await.map_err(|e| self.error(classify(&e)))?;
        let typed = |m: &HashMap<String, AttributeValue>| -> Result<ItemKey, SinkError> {
            m.iter().map(|(k, v)| attribute_to_json(v).map(|j| (k.clone(), j))).collect::<Result<_, _>>().map_err(SinkError::Fatal)
        };
        let mut page =
            FoundPage { read_capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0), ..FoundPage::default() };
        for item in out.items() {
            let key: ItemKey = self.key_names.iter().filter_map(|k| Some((k.clone(), attribute_to_json(item.get(k)?).ok()?))).collect();
            let version = item.get(version_attribute).and_then(|v| v.as_s().ok()).cloned();
            page.items.push(Found { key, version });
        }
        page.next = out.last_evaluated_key().map(typed).transpose()?;
        Ok(page)
    }

    async fn update(&self, key: &ItemKey, change: &CopyChange, version_attribute: &str) -> Result<CopyOutcome, SinkError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .expression_attribute_names("#v", version_attribute)
            .expression_attribute_values(":v", AttributeValue::S(change.version.text()));
        for (k, v) in key {
            req = req.key(k, json_to_attribute(v).map_err(SinkError::Fatal)?);
        }
        let mut sets = Vec::with_capacity(change.set.len() + 1);
        for (i, (name, value)) in change.set.iter().enumerate() {
            sets.push(format!("#c{i} = :c{i}"));
            let value = match json_to_attribute(value) {
                Ok(v) => v,
                Err(why) => return Ok(CopyOutcome::Rejected(format!("{name}: {why}"))),
            };
            req = req.expression_attribute_names(format!("#c{i}"), name).expression_attribute_values(format!(":c{i}"), value);
        }
        sets.push("#v = :v".to_string());
        let mut update = format!("SET {}", sets.join(", "));
        if !change.remove.is_empty() {
            let removes: Vec<String> = (0..change.remove.len()).map(|i| format!("#r{i}")).collect();
            for (i, name) in change.remove.iter().enumerate() {
                req = req.expression_attribute_names(format!("#r{i}"), name);
            }
            update.push_str(&format!(" REMOVE {}", removes.join(", ")));
        }
        let Some(partition) = self.key_names.first() else { return Err(SinkError::Fatal(format!("table {}: no key schema", self.table))) };
        req = req
            .update_expression(update)
            .condition_expression("attribute_exists(#k) AND (attribute_not_exists(#v) OR #v < :v)")
            .expression_attribute_names("#k", partition);
        match req.send().await {
            Ok(out) => Ok(CopyOutcome::Written { capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0) }),
            Err(e) => {
                if let Some(UpdateItemError::ConditionalCheckFailedException(c)) = e.as_service_error() {
                    return Ok(if c.item().is_some_and(|i| !i.is_empty()) { CopyOutcome::Older } else { CopyOutcome::Gone });
                }
                match self.error(classify(&e)) {
                    SinkError::Invalid(why) => Ok(CopyOutcome::Rejected(why)),
                    other => Err(other),
                }
            }
        }
    }
}

impl CopyStore for DynamoDbCopies {
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        start: Option<&'a ItemKey>,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        Box::pin(self.query(q, version_attribute, start))
    }

    fn write<'a>(
        &'a self,
        key: &'a ItemKey,
        change: &'a CopyChange,
        version_attribute: &'a str,
    ) -> BoxFuture<'a, Result<CopyOutcome, SinkError>> {
        Box::pin(self.update(key, change, version_attribute))
    }
}
