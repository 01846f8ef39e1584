//! The aggregate table in DynamoDB: the ledger-guarded write as one UpdateItem.

use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure};
use aws_sdk_dynamodb::Client;

use super::{AggregateStore, LedgerWrite, SinkError, WriteOutcome};
use crate::aws::{classify, FailureKind};
use crate::sink::ledger::{applied_of, expressions, ExprValue, Seen};

pub struct DynamoDbAggregates {
    client: Client,
    table: String,
}

impl DynamoDbAggregates {
    pub fn new(client: Client, table: String) -> DynamoDbAggregates {
        DynamoDbAggregates { client, table }
    }
}

fn attribute(v: &ExprValue) -> AttributeValue {
    match v {
        ExprValue::S(s) => AttributeValue::S(s.clone()),
        ExprValue::N(n) => AttributeValue::N(n.clone()),
        ExprValue::Ss(v) => AttributeValue::Ss(v.clone()),
        ExprValue::B(b) => AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(b.clone())),
    }
}

impl AggregateStore for DynamoDbAggregates {
    async fn apply(&self, w: &LedgerWrite) -> Result<WriteOutcome, SinkError> {
        let e = expressions(w);
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .update_expression(e.update)
            .condition_expression(e.condition);
        for (name, value) in &w.key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        for (k, v) in e.names {
            req = req.expression_attribute_names(k, v);
        }
        for (k, v) in &e.values {
            req = req.expression_attribute_values(k, attribute(v));
        }
        let (floor_attr, open_attr) = w.fence.as_ref().map(|f| (f.floor_attribute.as_str(), f.open_attribute.as_str())).unwrap_or(("", ""));
        match req.send().await {
            Ok(out) => {
                let item = out.attributes();
                let text = |k: &str| item.and_then(|i| i.get(k)).and_then(|v| v.as_s().ok()).cloned();
                let mut entries: Vec<String> =
                    item.map(|a| a.keys().filter(|k| w.ledger.is_entry(k)).cloned().collect()).unwrap_or_default();
                // In name order, as the memory store gives them (the SDK's map has none).
                entries.sort_unstable();
                Ok(WriteOutcome::Applied {
                    capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0),
                    seen: Seen { entries, floor: text(floor_attr), open: text(open_attr) },
                })
            }
            Err(e) => {
                if let Some(UpdateItemError::ConditionalCheckFailedException(c)) = e.as_service_error() {
                    let get = |k: &str| c.item().and_then(|i| i.get(k));
                    let text = |k: &str| get(k).and_then(|v| v.as_s().ok()).cloned();
                    let compact = get(&w.entry_name).and_then(|v| v.as_b().ok()).map(|b| b.as_ref());
                    let entry = applied_of(
                        compact,
                        [get(&w.named_entry), get(&w.legacy_entry)].map(|v| v.and_then(|v| v.as_s().ok()).map(String::as_str)),
                    );
                    return Ok(WriteOutcome::Stale { entry, floor: text(floor_attr), open: text(open_attr) });
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
