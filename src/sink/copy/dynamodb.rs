//! Copies in DynamoDB: the fan-out's Query and its conditional UpdateItem.

use std::collections::HashMap;
use std::sync::Arc;

use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;
use futures::future::BoxFuture;

use super::{CopyFix, CopyOutcome, CopyStore, Corrected, Found, FoundPage, ItemKey};
use crate::aws::{attribute_to_json, classify, json_to_attribute};
use crate::config::Config;
use crate::rules::copy::{check_table, CopyChange, FindQuery, SortValue, TableKeys};
use crate::sink::SinkError;

/// Why the copy rules cannot write their copies.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The table is not as the rules need (a `to` on keys it does not have).
    #[error("{0}")]
    Refused(String),
    #[error("describing source table {table}: {why}")]
    Describe { table: String, why: String },
}

/// The store that writes `config`'s copies in the source table, with every copy rule's `to`
/// checked against the table's keys and indexes (DescribeTable); None without copy rules.
pub async fn for_config(ddb: &Client, config: &Config) -> Result<Option<Arc<dyn CopyStore>>, SetupError> {
    use aws_sdk_dynamodb::types::{KeySchemaElement, KeyType, ScalarAttributeType};
    if config.engine.copies.is_empty() {
        return Ok(None);
    }
    let table = &config.source.table;
    let describe = |why: String| SetupError::Describe { table: table.clone(), why };
    let desc = ddb.describe_table().table_name(table).send().await.map_err(|e| describe(classify(&e).to_string()))?;
    let t = desc.table().ok_or_else(|| describe("no table in the answer".into()))?;
    let keys_of = |schema: &[KeySchemaElement]| -> Vec<String> {
        let mut keys: Vec<&KeySchemaElement> = schema.iter().collect();
        keys.sort_by_key(|k| *k.key_type() != KeyType::Hash);
        keys.iter().map(|k| k.attribute_name().to_string()).collect()
    };
    let keys = TableKeys {
        table: keys_of(t.key_schema()),
        indexes: t.global_secondary_indexes().iter().filter_map(|i| Some((i.index_name()?.to_string(), keys_of(i.key_schema())))).collect(),
        not_text: t
            .attribute_definitions()
            .iter()
            .filter(|d| *d.attribute_type() != ScalarAttributeType::S)
            .map(|d| d.attribute_name().to_string())
            .collect(),
        partial: t
            .global_secondary_indexes()
            .iter()
            .filter_map(|i| {
                let p = i.projection()?;
                let all = p.projection_type() == Some(&aws_sdk_dynamodb::types::ProjectionType::All);
                let name = i.index_name()?.to_string();
                (!all).then(|| (name, p.non_key_attributes().to_vec()))
            })
            .collect(),
    };
    for rule in &config.engine.copies {
        check_table(rule, &keys, table).map_err(SetupError::Refused)?;
    }
    Ok(Some(Arc::new(DynamoDbCopies::new(ddb.clone(), table.clone(), keys.table))))
}

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
        SinkError::from_failure(f, &self.table)
    }

    async fn query(
        &self,
        q: &FindQuery,
        version_attribute: &str,
        project: &[String],
        start: Option<&ItemKey>,
        limit: usize,
    ) -> Result<FoundPage, SinkError> {
        let mut condition = "#p = :p".to_string();
        let mut req = self
            .client
            .query()
            .table_name(&self.table)
            .set_index_name(q.index.clone())
            // An index is read eventually consistent: DynamoDB offers nothing else there.
            .consistent_read(q.index.is_none())
            .limit(i32::try_from(limit.max(1)).unwrap_or(i32::MAX))
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
        for (i, a) in project.iter().enumerate() {
            projection.push(format!("#a{i}"));
            req = req.expression_attribute_names(format!("#a{i}"), a);
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
            let values = project.iter().filter_map(|a| Some((a.clone(), attribute_to_json(item.get(a)?).ok()?))).collect();
            page.items.push(Found { key, version, values });
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

impl DynamoDbCopies {
    /// Reconcile's correction: conditioned on the item existing with its version as read.
    async fn fix(&self, key: &ItemKey, fix: &CopyFix, version_attribute: &str, read: Option<&str>) -> Result<Corrected, SinkError> {
        let Some(partition) = self.key_names.first() else { return Err(SinkError::Fatal(format!("table {}: no key schema", self.table))) };
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .expression_attribute_names("#k", partition)
            .expression_attribute_names("#v", version_attribute);
        for (k, v) in key {
            req = req.key(k, json_to_attribute(v).map_err(SinkError::Fatal)?);
        }
        req = match read {
            Some(v) => req
                .condition_expression("attribute_exists(#k) AND #v = :read")
                .expression_attribute_values(":read", AttributeValue::S(v.to_string())),
            None => req.condition_expression("attribute_exists(#k) AND attribute_not_exists(#v)"),
        };
        let mut parts = Vec::new();
        let sets: Vec<String> = (0..fix.set.len()).map(|i| format!("#c{i} = :c{i}")).collect();
        for (i, (name, value)) in fix.set.iter().enumerate() {
            let value = match json_to_attribute(value) {
                Ok(v) => v,
                Err(why) => return Ok(Corrected::Rejected(format!("{name}: {why}"))),
            };
            req = req.expression_attribute_names(format!("#c{i}"), name).expression_attribute_values(format!(":c{i}"), value);
        }
        if !sets.is_empty() {
            parts.push(format!("SET {}", sets.join(", ")));
        }
        let removes: Vec<String> = (0..fix.remove.len()).map(|i| format!("#r{i}")).collect();
        for (i, name) in fix.remove.iter().enumerate() {
            req = req.expression_attribute_names(format!("#r{i}"), name);
        }
        if !removes.is_empty() {
            parts.push(format!("REMOVE {}", removes.join(", ")));
        }
        match req.update_expression(parts.join(" ")).send().await {
            Ok(out) => Ok(Corrected::Done { capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0) }),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(Corrected::Changed),
            Err(e) => match self.error(classify(&e)) {
                SinkError::Invalid(why) => Ok(Corrected::Rejected(why)),
                other => Err(other),
            },
        }
    }

    async fn get(&self, key: &ItemKey, attributes: &[String]) -> Result<Option<serde_json::Map<String, serde_json::Value>>, SinkError> {
        let mut req = self.client.get_item().table_name(&self.table).consistent_read(true);
        for (k, v) in key {
            req = req.key(k, json_to_attribute(v).map_err(SinkError::Fatal)?);
        }
        if !attributes.is_empty() {
            let names: Vec<String> = (0..attributes.len()).map(|i| format!("#a{i}")).collect();
            for (i, a) in attributes.iter().enumerate() {
                req = req.expression_attribute_names(format!("#a{i}"), a);
            }
            // The key too, so that an item without the attributes still reads as existing.
            req = req.expression_attribute_names("#k", self.key_names.first().map_or("", String::as_str));
            req = req.projection_expression(format!("#k, {}", names.join(", ")));
        }
        let out = req.send().await.map_err(|e| self.error(classify(&e)))?;
        let Some(item) = out.item() else { return Ok(None) };
        let mut map = serde_json::Map::new();
        for (k, v) in item {
            map.insert(k.clone(), attribute_to_json(v).map_err(SinkError::Fatal)?);
        }
        Ok(Some(map))
    }
}

impl CopyStore for DynamoDbCopies {
    fn source<'a>(
        &'a self,
        key: &'a ItemKey,
        attributes: &'a [String],
    ) -> BoxFuture<'a, Result<Option<serde_json::Map<String, serde_json::Value>>, SinkError>> {
        Box::pin(self.get(key, attributes))
    }

    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version_attribute: &'a str,
        project: &'a [String],
        start: Option<&'a ItemKey>,
        limit: usize,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        Box::pin(self.query(q, version_attribute, project, start, limit))
    }

    fn correct<'a>(
        &'a self,
        key: &'a ItemKey,
        fix: &'a CopyFix,
        version_attribute: &'a str,
        read: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Corrected, SinkError>> {
        Box::pin(self.fix(key, fix, version_attribute, read))
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
