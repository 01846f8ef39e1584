//! The aggregate table in DynamoDB: the ledger-guarded write as one UpdateItem.

use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;

use super::{AggregateStore, LedgerWrite, SinkError, WriteOutcome};
use crate::aws::{classify, FailureKind};
use crate::sink::ledger::FLOOR_ATTRIBUTE;

pub struct DynamoDbAggregates {
    client: Client,
    table: String,
}

impl DynamoDbAggregates {
    pub fn new(client: Client, table: String) -> DynamoDbAggregates {
        DynamoDbAggregates { client, table }
    }
}

impl AggregateStore for DynamoDbAggregates {
    async fn apply(&self, w: &LedgerWrite) -> Result<WriteOutcome, SinkError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .expression_attribute_names("#l", &w.entry_name)
            .expression_attribute_values(":l", AttributeValue::S(w.entry_value.clone()))
            .expression_attribute_values(":first", AttributeValue::S(w.first.clone()));
        for (name, value) in &w.key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        let mut adds = Vec::with_capacity(w.adds.len());
        for (i, (name, v)) in w.adds.iter().enumerate() {
            adds.push(format!("#m{i} :m{i}"));
            req = req
                .expression_attribute_names(format!("#m{i}"), name)
                .expression_attribute_values(format!(":m{i}"), AttributeValue::N(v.to_string()));
        }
        // The ledger condition: this shard's entry is absent or below the first record of
        // the write, and the item's floor (if any) does not exclude this shard.
        let mut condition = "(attribute_not_exists(#l) OR #l < :first)".to_string();
        // With pruning the item's floor must not exceed the new floor (which is at most this
        // shard's own); otherwise it must not exceed this shard's.
        if let Some(floor) = w.new_floor.as_ref().or(w.shard_floor.as_ref()) {
            condition.push_str(" AND (attribute_not_exists(#f) OR #f <= :floor)");
            req = req
                .expression_attribute_names("#f", FLOOR_ATTRIBUTE)
                .expression_attribute_values(":floor", AttributeValue::S(floor.clone()));
        }
        let mut update = if adds.is_empty() { String::new() } else { format!("ADD {} ", adds.join(", ")) };
        update.push_str(if w.new_floor.is_some() { "SET #l = :l, #f = :floor" } else { "SET #l = :l" });
        if !w.prune.is_empty() {
            let names: Vec<String> = (0..w.prune.len()).map(|i| format!("#p{i}")).collect();
            for (name, p) in names.iter().zip(&w.prune) {
                req = req.expression_attribute_names(name, p);
            }
            update.push_str(&format!(" REMOVE {}", names.join(", ")));
        }
        let resp = req
            .update_expression(update)
            .condition_expression(condition)
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await;
        match resp {
            Ok(out) => Ok(WriteOutcome::Applied {
                capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0),
                entries: out
                    .attributes()
                    .map(|a| a.keys().filter(|k| k.starts_with(crate::sink::ledger::ENTRY_PREFIX)).cloned().collect())
                    .unwrap_or_default(),
            }),
            Err(e) => {
                if let Some(UpdateItemError::ConditionalCheckFailedException(c)) = e.as_service_error() {
                    let text = |k: &str| c.item().and_then(|i| i.get(k)).and_then(|v| v.as_s().ok()).cloned();
                    return Ok(WriteOutcome::Stale { entry: text(&w.entry_name), floor: text(FLOOR_ATTRIBUTE) });
                }
                let f = classify(&e);
                Err(match f.kind {
                    FailureKind::Throttled | FailureKind::Transient => SinkError::Transient(f.to_string()),
                    FailureKind::Invalid => SinkError::Invalid(f.to_string()),
                    _ => SinkError::Fatal(format!("{} (table {})", f, self.table)),
                })
            }
        }
    }
}
