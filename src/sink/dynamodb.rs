//! The aggregate table in DynamoDB: the ledger-guarded write as one UpdateItem.

use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeValue, ReturnConsumedCapacity, ReturnValuesOnConditionCheckFailure, TimeToLiveStatus, TransactWriteItem, Update,
};
use aws_sdk_dynamodb::Client;
use std::collections::HashMap;
use tracing::{info, warn};

use super::distinct::COUNTED;
use super::expiry::{due_before, pending_at, pending_key, pending_partition, Described, DueQuery, Pending, PENDING_HELPER};
use super::{
    AggregateStore, Counters, DerivationNames, DerivedWrite, HelperQuery, HelperSeen, HelperState, HelperStates, LedgerWrite, LiveHelpers,
    Settle, SettleWrite, SinkError, TransitionWrite, WriteOutcome,
};
use crate::aws::classify;
use crate::decimal::Decimal;
use crate::rules::helper::{HelperScan, Scalar, REFS};
use crate::sink::derive::derived_expressions;
use crate::sink::hold::HoldSeen;
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
                    helper: helper_seen(w, item),
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
                    let hold_attribute = w.ledger.hold_attribute();
                    if get(&hold_attribute).is_some_and(|v| v.as_s().is_err()) {
                        return Err(SinkError::Fatal(format!(
                            "{hold_attribute} on this item is not a string: only ddb-aggregator may write it; remove it"
                        )));
                    }
                    let log_prefix = w.ledger.log_prefix();
                    let hold = text(&hold_attribute).map(|value| HoldSeen {
                        value,
                        logs: c.item().map(|i| i.keys().filter(|k| k.starts_with(&log_prefix)).cloned().collect()).unwrap_or_default(),
                    });
                    let helper = helper_seen(w, c.item());
                    return Ok(WriteOutcome::Stale { entry, floor: text(floor_attr), open: text(open_attr), hold, helper });
                }
                Err(self.error(classify(&e)))
            }
        }
    }

    async fn live_helpers(&self, q: &HelperQuery<'_>) -> Result<LiveHelpers, SinkError> {
        let [pk_name, sk_name, ..] = q.key_names else {
            return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
        };
        let mut out = LiveHelpers::default();
        let mut start = None;
        // Each page reads up to 1 MB; the bound only stops a table that never ends.
        for _ in 0..100_000 {
            let req = self.partition_query(pk_name, sk_name, q.pk).set_exclusive_start_key(start.take());
            // From the cursor the first live helper is usually among the first few read.
            let limit = if out.read == 0 { 5 } else { 50 };
            let page = match q.scan {
                HelperScan::Count => count_query(req, q).send().await,
                HelperScan::First | HelperScan::Last => scan_query(req, q).limit(limit).send().await,
            }
            .map_err(|e| self.error(classify(&e)))?;
            out.capacity += page.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0);
            out.read += u64::try_from(page.scanned_count()).unwrap_or(0);
            if q.scan == HelperScan::Count {
                out.count += u64::try_from(page.count()).unwrap_or(0);
            } else if first_live(page.items(), sk_name, q.prefix, &mut out) {
                return Ok(out);
            }
            match page.last_evaluated_key().filter(|k| !k.is_empty()) {
                Some(k) => start = Some(k.clone()),
                None => return Ok(out),
            }
        }
        Err(SinkError::Fatal(format!("querying helper items under {} did not end", q.prefix)))
    }

    async fn derivation_counters(&self, key: &[(String, String)], names: &DerivationNames) -> Result<Counters, SinkError> {
        // The whole item: a projection would cost the same read capacity, and its expression
        // would have to hold every counter's name.
        let mut req =
            self.client.get_item().table_name(&self.table).consistent_read(true).return_consumed_capacity(ReturnConsumedCapacity::Total);
        for (name, value) in key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        let out = req.send().await.map_err(|e| self.error(classify(&e)))?;
        let mut counters =
            Counters { capacity: out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0), ..Counters::default() };
        for (name, value) in out.item().into_iter().flatten() {
            if let Some(measure) = name.strip_prefix(&names.counters) {
                // A counter that is not a number (written by someone else) comes back as text
                // that is not one either: the write conditioned on it is refused (a
                // ValidationException), not lost to a race round after round.
                let value = value.as_n().cloned().unwrap_or_else(|_| format!("not a number: {value:?}"));
                counters.values.insert(measure.to_string(), value);
            } else if let (Some(measure), Ok(tail)) = (name.strip_prefix(&names.cursors), value.as_s()) {
                counters.cursors.insert(measure.to_string(), tail.clone());
            } else if let Some(measure) = name.strip_prefix(&names.counts) {
                let value = value.as_n().cloned().unwrap_or_else(|_| format!("not a number: {value:?}"));
                counters.counts.insert(measure.to_string(), value);
            } else if let Some(measure) = name.strip_prefix(&names.walked) {
                counters.walked.insert(measure.to_string());
            } else if let Ok(n) = value.as_n() {
                counters.numbers.insert(name.clone(), n.clone());
            }
        }
        Ok(counters)
    }

    async fn helper_state(&self, key: &[(String, String)]) -> Result<(Option<HelperState>, f64), SinkError> {
        let mut req = self
            .client
            .get_item()
            .table_name(&self.table)
            .consistent_read(true)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .projection_expression("#refs, #c")
            .expression_attribute_names("#refs", REFS)
            .expression_attribute_names("#c", COUNTED);
        for (name, value) in key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        let out = req.send().await.map_err(|e| self.error(classify(&e)))?;
        let capacity = out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0);
        // An item with neither (a value that came and went in one batch) is neither live nor counted.
        Ok((out.item().map(helper_state), capacity))
    }

    async fn helper_states(&self, q: &HelperQuery<'_>) -> Result<HelperStates, SinkError> {
        let [pk_name, sk_name, ..] = q.key_names else {
            return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
        };
        let mut out = HelperStates::default();
        let mut start = None;
        for _ in 0..100_000 {
            let page = self
                .partition_query(pk_name, sk_name, q.pk)
                .key_condition_expression("#pk = :pk AND begins_with(#sk, :prefix)")
                .projection_expression("#sk, #refs, #c")
                .expression_attribute_names("#refs", REFS)
                .expression_attribute_names("#c", COUNTED)
                .expression_attribute_values(":prefix", AttributeValue::S(q.prefix.to_string()))
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.error(classify(&e)))?;
            out.capacity += page.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0);
            for item in page.items() {
                if let Some(tail) = item.get(sk_name).and_then(|v| v.as_s().ok()).and_then(|sk| sk.strip_prefix(q.prefix)) {
                    out.helpers.insert(tail.to_string(), helper_state(item));
                }
            }
            match page.last_evaluated_key().filter(|k| !k.is_empty()) {
                Some(k) => start = Some(k.clone()),
                None => return Ok(out),
            }
        }
        Err(SinkError::Fatal(format!("querying helper items under {} did not end", q.prefix)))
    }

    async fn count_transitions(&self, w: &TransitionWrite<'_>) -> Result<Option<f64>, SinkError> {
        let items = transition_items(&self.table, w).map_err(|e| SinkError::Invalid(e.to_string()))?;
        let out = self
            .client
            .transact_write_items()
            .set_transact_items(Some(items))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await;
        match out {
            Ok(out) => Ok(Some(out.consumed_capacity().iter().filter_map(|c| c.capacity_units()).sum())),
            Err(e) => {
                if let Some(TransactWriteItemsError::TransactionCanceledException(c)) = e.as_service_error() {
                    let codes: Vec<&str> = c.cancellation_reasons().iter().filter_map(|r| r.code()).collect();
                    if codes.contains(&"ConditionalCheckFailed") {
                        return Ok(None);
                    }
                    let message = format!("transaction cancelled: {}", codes.join(", "));
                    return Err(if codes.iter().any(|c| c.contains("Validation") || c.contains("ItemCollectionSizeLimit")) {
                        SinkError::Invalid(message)
                    } else if codes.iter().any(|c| c.contains("Throttl") || c.contains("Capacity")) {
                        SinkError::Throttled(message)
                    } else {
                        SinkError::Transient(message)
                    });
                }
                Err(self.error(classify(&e)))
            }
        }
    }

    async fn settle_count(&self, w: &SettleWrite<'_>) -> Result<Option<f64>, SinkError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .expression_attribute_names("#w", w.walked)
            .expression_attribute_names("#g", w.counter)
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .expression_attribute_values(":zero", AttributeValue::N("0".into()));
        req = match w.kind {
            Settle::Count { value, mark } => {
                let walked = if mark { ", #w = :one" } else { "" };
                let update = match value {
                    0 => format!("SET #n = :v{walked}, #g = if_not_exists(#g, :zero) + :one REMOVE #d"),
                    _ => format!("SET #n = :v, #d = :v{walked}, #g = if_not_exists(#g, :zero) + :one"),
                };
                let req = req
                    .update_expression(update)
                    .expression_attribute_names("#n", w.count)
                    .expression_attribute_names("#d", w.attribute)
                    .expression_attribute_values(":v", AttributeValue::N(value.to_string()));
                match w.seen {
                    Some(seen) => {
                        req.condition_expression("#g = :seen").expression_attribute_values(":seen", AttributeValue::N(seen.to_string()))
                    }
                    None => req.condition_expression("attribute_not_exists(#g)"),
                }
            }
            Settle::Unwalk => req
                .update_expression("SET #g = if_not_exists(#g, :zero) + :one REMOVE #w")
                .condition_expression("attribute_exists(#pk)")
                .expression_attribute_names("#pk", w.key.first().map_or("", |(name, _)| name.as_str())),
        };
        for (name, value) in w.key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        match req.send().await {
            Ok(out) => Ok(Some(out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0))),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(None),
            Err(e) => Err(self.error(classify(&e))),
        }
    }

    async fn lower_cursor(&self, key: &[(String, String)], attribute: &str, to: Option<&str>, scan: HelperScan) -> Result<(), SinkError> {
        let mut req = self.client.update_item().table_name(&self.table).expression_attribute_names("#k", attribute);
        req = match (to, scan) {
            (Some(to), HelperScan::First | HelperScan::Last) => {
                let beyond = if scan == HelperScan::First { "#k > :to" } else { "#k < :to" };
                req.update_expression("SET #k = :to")
                    .condition_expression(beyond)
                    .expression_attribute_values(":to", AttributeValue::S(to.to_string()))
            }
            (None, _) => req.update_expression("REMOVE #k").condition_expression("attribute_exists(#k)"),
            // distinct keeps no cursor.
            (Some(_), HelperScan::Count) => return Ok(()),
        };
        for (name, value) in key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        match req.send().await {
            Ok(_) => Ok(()),
            // Already at or before `to`, or absent: it covers the helper as it is.
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(()),
            Err(e) => Err(self.error(classify(&e))),
        }
    }

    async fn set_derived(&self, w: &DerivedWrite<'_>) -> Result<Option<f64>, SinkError> {
        let e = derived_expressions(w.values);
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .update_expression(e.update)
            .condition_expression(e.condition)
            .expression_attribute_values(":one", AttributeValue::N("1".into()));
        for (i, d) in w.values.iter().enumerate() {
            req = req.expression_attribute_names(format!("#d{i}"), &d.name).expression_attribute_names(format!("#g{i}"), &d.counter);
            if let Some(seen) = &d.seen {
                req = req.expression_attribute_values(format!(":s{i}"), AttributeValue::N(seen.clone()));
            }
            if let Some(c) = &d.cursor {
                req = req.expression_attribute_names(format!("#k{i}"), &c.attribute);
                if let Some(seen) = &c.seen {
                    req = req.expression_attribute_values(format!(":ks{i}"), AttributeValue::S(seen.clone()));
                }
                if let Some(to) = &c.to {
                    req = req.expression_attribute_values(format!(":kt{i}"), AttributeValue::S(to.clone()));
                }
            }
            if let Some(v) = &d.value {
                let v = match v {
                    Scalar::N(n) => AttributeValue::N(n.to_string()),
                    Scalar::S(s) => AttributeValue::S(s.clone()),
                };
                req = req.expression_attribute_values(format!(":d{i}"), v);
            }
        }
        if e.uses_string {
            req = req.expression_attribute_values(":string", AttributeValue::S("S".into()));
        }
        if e.uses_zero {
            req = req.expression_attribute_values(":zero", AttributeValue::N("0".into()));
        }
        for (name, value) in w.key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        match req.send().await {
            Ok(out) => Ok(Some(out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0))),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(None),
            Err(e) => Err(self.error(classify(&e))),
        }
    }

    async fn expire_helper(
        &self,
        key: &[(String, String)],
        attribute: &str,
        at: u64,
        version: (&str, Option<&str>),
    ) -> Result<bool, SinkError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .update_expression("SET #x = :at")
            .expression_attribute_names("#pk", key.first().map_or("", |(name, _)| name.as_str()))
            .expression_attribute_names("#x", attribute)
            .expression_attribute_names("#refs", REFS)
            .expression_attribute_names("#c", COUNTED)
            .expression_attribute_names("#v", version.0)
            .expression_attribute_values(":at", AttributeValue::N(at.to_string()))
            .expression_attribute_values(":zero", AttributeValue::N("0".into()));
        // No write since the helper was seen at zero: every record it counted was created
        // before `at` was computed.
        let unchanged = match version.1 {
            Some(v) => {
                req = req.expression_attribute_values(":v", AttributeValue::N(v.to_string()));
                "#v = :v"
            }
            None => "attribute_not_exists(#v)",
        };
        req = req.condition_expression(format!(
            "attribute_exists(#pk) AND (attribute_not_exists(#refs) OR #refs = :zero) AND attribute_not_exists(#x) AND attribute_not_exists(#c) AND {unchanged}"
        ));
        for (name, value) in key {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.as_service_error(), Some(UpdateItemError::ConditionalCheckFailedException(_))) => Ok(false),
            Err(e) => Err(self.error(classify(&e))),
        }
    }

    async fn register_expiry(&self, p: &Pending) -> Result<f64, SinkError> {
        self.put_pending(p).await
    }

    async fn due_expiries(&self, q: &DueQuery<'_>) -> Result<Vec<Pending>, SinkError> {
        self.due_pending(q).await
    }

    async fn remove_expired(&self, p: &Pending) -> Result<bool, SinkError> {
        let deleted = self.delete_expired_helper(p).await?;
        self.delete_pending(p).await?;
        Ok(deleted)
    }
}

impl DynamoDbAggregates {
    async fn put_pending(&self, p: &Pending) -> Result<f64, SinkError> {
        let [(pk_name, _), (sk_name, _), ..] = p.helper.as_slice() else {
            return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
        };
        let (pk, sk) = pending_key(p);
        let helper = p.helper.iter().map(|(_, v)| AttributeValue::S(v.clone())).collect();
        let out = self
            .client
            .put_item()
            .table_name(&self.table)
            .item(pk_name, AttributeValue::S(pk))
            .item(sk_name, AttributeValue::S(sk))
            .item(PENDING_HELPER, AttributeValue::L(helper))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await
            .map_err(|e| self.error(classify(&e)))?;
        Ok(out.consumed_capacity().and_then(|c| c.capacity_units()).unwrap_or(0.0))
    }

    async fn due_pending(&self, q: &DueQuery<'_>) -> Result<Vec<Pending>, SinkError> {
        let [pk_name, sk_name, ..] = q.key_names else {
            return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
        };
        let page = self
            .partition_query(pk_name, sk_name, &pending_partition(q.attribute, q.partition))
            .key_condition_expression("#pk = :pk AND #sk < :due")
            .expression_attribute_values(":due", AttributeValue::S(due_before(q.due_s)))
            .limit(i32::try_from(q.limit).unwrap_or(i32::MAX))
            .send()
            .await
            .map_err(|e| self.error(classify(&e)))?;
        let mut out = Vec::new();
        for item in page.items() {
            // A malformed one (written by hand) is skipped, never deleted blindly.
            let at = item.get(sk_name).and_then(|v| v.as_s().ok()).and_then(|sk| pending_at(sk));
            let values = item.get(PENDING_HELPER).and_then(|v| v.as_l().ok());
            let values: Option<Vec<String>> = values.map(|l| l.iter().filter_map(|v| v.as_s().ok().cloned()).collect());
            match (at, values) {
                (Some(at), Some(values)) if values.len() == q.key_names.len() => {
                    out.push(Pending { helper: q.key_names.iter().cloned().zip(values).collect(), attribute: q.attribute.to_string(), at });
                }
                _ => warn!(table = %self.table, item = ?item, "a pending helper expiry item is malformed: skipped (delete it by hand)"),
            }
        }
        Ok(out)
    }

    /// Deletes the helper of `p` if it still carries the expiry `p.at`, at zero, uncounted.
    async fn delete_expired_helper(&self, p: &Pending) -> Result<bool, SinkError> {
        let mut req = self
            .client
            .delete_item()
            .table_name(&self.table)
            .condition_expression("#x = :at AND (attribute_not_exists(#refs) OR #refs = :zero) AND attribute_not_exists(#c)")
            .expression_attribute_names("#x", &p.attribute)
            .expression_attribute_names("#refs", REFS)
            .expression_attribute_names("#c", COUNTED)
            .expression_attribute_values(":at", AttributeValue::N(p.at.to_string()))
            .expression_attribute_values(":zero", AttributeValue::N("0".into()));
        for (name, value) in &p.helper {
            req = req.key(name, AttributeValue::S(value.clone()));
        }
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.as_service_error(), Some(DeleteItemError::ConditionalCheckFailedException(_))) => Ok(false),
            Err(e) => Err(self.error(classify(&e))),
        }
    }

    async fn delete_pending(&self, p: &Pending) -> Result<(), SinkError> {
        let (pk, sk) = pending_key(p);
        let mut req = self.client.delete_item().table_name(&self.table);
        for ((name, _), value) in p.helper.iter().zip([pk, sk]) {
            req = req.key(name, AttributeValue::S(value));
        }
        req.send().await.map(|_| ()).map_err(|e| self.error(classify(&e)))
    }
}

/// A helper item's count and `distinct` flag.
fn helper_state(item: &HashMap<String, AttributeValue>) -> HelperState {
    let refs = item.get(REFS).and_then(|v| v.as_n().ok()).and_then(|n| n.parse::<Decimal>().ok());
    HelperState {
        live: refs.is_some_and(|n| n > Decimal::ZERO),
        counted: item.contains_key(COUNTED),
        below_zero: refs.is_some_and(|n| n < Decimal::ZERO),
    }
}

/// A `distinct` transition's items: the target's count (and attribute, once walked) moved,
/// each helper's flag inverted on condition that its flag and the sign of its count are as read.
fn transition_items(table: &str, w: &TransitionWrite<'_>) -> Result<Vec<TransactWriteItem>, aws_sdk_dynamodb::error::BuildError> {
    let delta = super::distinct::delta(&w.helpers.iter().map(|(k, s)| (k.clone(), *s)).collect::<Vec<_>>());
    let key = |sk: Option<&str>| -> HashMap<String, AttributeValue> {
        let last = w.key.len().saturating_sub(1);
        w.key
            .iter()
            .enumerate()
            .map(|(i, (n, v))| (n.clone(), AttributeValue::S(sk.filter(|_| i == last).unwrap_or(v).to_string())))
            .collect()
    };
    let update = match w.attribute {
        Some(_) => {
            "SET #n = if_not_exists(#n, :zero) + :delta, #d = if_not_exists(#n, :zero) + :delta, #g = if_not_exists(#g, :zero) + :one"
        }
        None => "SET #n = if_not_exists(#n, :zero) + :delta, #g = if_not_exists(#g, :zero) + :one",
    };
    let mut target = Update::builder()
        .table_name(table)
        .set_key(Some(key(None)))
        .update_expression(update)
        .expression_attribute_names("#n", w.count)
        .expression_attribute_names("#g", w.counter)
        .expression_attribute_values(":delta", AttributeValue::N(delta.to_string()))
        .expression_attribute_values(":zero", AttributeValue::N("0".into()))
        .expression_attribute_values(":one", AttributeValue::N("1".into()));
    if let Some(a) = w.attribute {
        target = target.expression_attribute_names("#d", a);
    }
    let mut items = vec![TransactWriteItem::builder().update(target.build()?).build()];
    let pk = w.key_names.first().map_or("", String::as_str);
    for (sk, seen) in w.helpers {
        let mut u = Update::builder()
            .table_name(table)
            .set_key(Some(key(Some(sk))))
            .expression_attribute_names("#pk", pk)
            .expression_attribute_names("#refs", REFS)
            .expression_attribute_names("#c", COUNTED)
            .expression_attribute_values(":zero", AttributeValue::N("0".into()));
        u = if seen.counted {
            // At zero it expires as any helper at zero does ([`super::expiry`]); below zero
            // (a drift for reconcile) it gets no expiry.
            let (clear, refs) = match (w.expiry, seen.below_zero) {
                (_, true) => ("REMOVE #c", "#refs < :zero"),
                (Some((attribute, at)), false) => {
                    u = u.expression_attribute_names("#x", attribute).expression_attribute_values(":at", AttributeValue::N(at.to_string()));
                    ("REMOVE #c SET #x = :at", "(attribute_not_exists(#refs) OR #refs = :zero)")
                }
                (None, false) => ("REMOVE #c", "(attribute_not_exists(#refs) OR #refs = :zero)"),
            };
            u.update_expression(clear).condition_expression(format!("attribute_exists(#pk) AND attribute_exists(#c) AND {refs}"))
        } else {
            u.update_expression("SET #c = :one")
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .condition_expression("attribute_exists(#pk) AND attribute_not_exists(#c) AND #refs > :zero")
        };
        items.push(TransactWriteItem::builder().update(u.build()?).build());
    }
    Ok(items)
}

/// What a helper write saw of the item's count and expiry (None: the write carries no expiry).
fn helper_seen(w: &LedgerWrite, item: Option<&std::collections::HashMap<String, AttributeValue>>) -> Option<HelperSeen> {
    let (e, item) = (w.expiry.as_ref()?, item?);
    // No count: the item's writes added nothing to it (a value that came and went in one batch).
    let refs = match item.get(REFS) {
        None => Decimal::ZERO,
        Some(v) => Decimal::parse(v.as_n().ok()?).ok()?,
    };
    let version = item.get(&w.version_attribute).and_then(|v| v.as_n().ok()).cloned();
    Some(HelperSeen { refs, expiring: item.contains_key(&e.attribute), version })
}

/// Whether any rule keeps helper items (max, min, latest, distinct): only then does the
/// table's TTL matter.
pub fn keeps_helpers(config: &crate::config::Config) -> bool {
    config.engine.rules.iter().any(|r| r.measures.iter().any(|m| matches!(m.kind, crate::rules::MeasureKind::Helper(_))))
}

/// What DescribeTimeToLive says of `table`, and the failure when it failed.
pub async fn describe_ttl(ddb: &Client, table: &str) -> (Described, Option<crate::aws::Failure>) {
    let out = match ddb.describe_time_to_live().table_name(table).send().await {
        Ok(out) => out,
        Err(e) => return (Described::Failed, Some(classify(&e))),
    };
    let d = out.time_to_live_description();
    let status = d.and_then(|d| d.time_to_live_status());
    let described = match (status, d.and_then(|d| d.attribute_name())) {
        (Some(TimeToLiveStatus::Enabled), Some(a)) => Described::On { attribute: a.to_string(), enabled: true },
        (Some(TimeToLiveStatus::Enabling), Some(a)) => Described::On { attribute: a.to_string(), enabled: false },
        _ => Described::Off,
    };
    (described, None)
}

/// Logs what the table's TTL means for helper items (at start, and when it changes).
pub fn log_ttl(table: &str, configured: &str, described: &Described, failure: Option<&crate::aws::Failure>) {
    match (described, failure) {
        (Described::On { attribute, enabled: true }, _) if attribute == configured => {
            info!(table = %table, attribute = %attribute, "zero-count helper items expire through the table's TTL attribute");
        }
        (Described::On { attribute, enabled: false }, _) if attribute == configured => {
            info!(table = %table, attribute = %attribute, "TTL is being turned on: the service deletes expired helper items itself until it is enabled");
        }
        (Described::On { attribute, .. }, _) => info!(
            table = %table, attribute = %attribute, configured = %configured,
            "the table's TTL is on another attribute than aggregates.helper_expiry_attribute: the service deletes expired helper items itself"
        ),
        (Described::Off, _) => info!(
            table = %table, configured = %configured,
            "the aggregates table has no TTL: the service deletes expired helper items itself (TTL on aggregates.helper_expiry_attribute would do it for free: docs/semantics.md#helper-items-expire)"
        ),
        (Described::Failed, f) => warn!(
            table = %table,
            error = %f.map(ToString::to_string).unwrap_or_default(),
            "DescribeTimeToLive failed (it needs dynamodb:DescribeTimeToLive): zero-count helper items get no expiry until it succeeds"
        ),
    }
}

impl DynamoDbAggregates {
    /// A strongly consistent Query of partition `pk` (`#pk = :pk`, `#sk` named), with its
    /// consumed capacity: the base of every helper query.
    fn partition_query(&self, pk_name: &str, sk_name: &str, pk: &str) -> QueryFluentBuilder {
        self.client
            .query()
            .table_name(&self.table)
            .consistent_read(true)
            .expression_attribute_names("#pk", pk_name)
            .expression_attribute_names("#sk", sk_name)
            .expression_attribute_values(":pk", AttributeValue::S(pk.to_string()))
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
    }

    fn error(&self, f: crate::aws::Failure) -> SinkError {
        SinkError::from_failure(f, &self.table)
    }
}

/// Distinct's query: how many helpers are live (the filter drops the others after reading).
fn count_query(req: QueryFluentBuilder, q: &HelperQuery<'_>) -> QueryFluentBuilder {
    req.key_condition_expression("#pk = :pk AND begins_with(#sk, :prefix)")
        .filter_expression("#refs > :zero")
        .expression_attribute_names("#refs", REFS)
        .expression_attribute_values(":prefix", AttributeValue::S(q.prefix.to_string()))
        .expression_attribute_values(":zero", AttributeValue::N("0".into()))
        .select(aws_sdk_dynamodb::types::Select::Count)
}

/// Max, min and latest's query: from the cursor (or the end of the range) in scan order, a
/// page of keys and counts at a time (the caller sets its Limit); the first live one ends it
/// ([`first_live`]).
fn scan_query(req: QueryFluentBuilder, q: &HelperQuery<'_>) -> QueryFluentBuilder {
    let forward = q.scan == HelperScan::First;
    let req = req.scan_index_forward(forward).limit(25).projection_expression("#sk, #refs").expression_attribute_names("#refs", REFS);
    let from = q.from.map(|f| format!("{}{f}", q.prefix));
    match (from, forward) {
        (None, _) => req
            .key_condition_expression("#pk = :pk AND begins_with(#sk, :prefix)")
            .expression_attribute_values(":prefix", AttributeValue::S(q.prefix.to_string())),
        // Every key in [prefix, prefix + from] begins with the prefix.
        (Some(from), false) => req
            .key_condition_expression("#pk = :pk AND #sk BETWEEN :lo AND :hi")
            .expression_attribute_values(":lo", AttributeValue::S(q.prefix.to_string()))
            .expression_attribute_values(":hi", AttributeValue::S(from)),
        // [prefix + from, the prefix's successor]: the bound itself is not a helper of it.
        (Some(from), true) => req
            .key_condition_expression("#pk = :pk AND #sk BETWEEN :lo AND :hi")
            .expression_attribute_values(":lo", AttributeValue::S(from))
            .expression_attribute_values(":hi", AttributeValue::S(crate::rules::helper::successor(q.prefix))),
    }
}

/// Notes a page's items in `out` (the last one read) up to the first live one, the helper
/// the derivation needs: whether it was found.
fn first_live(items: &[HashMap<String, AttributeValue>], sk_name: &str, prefix: &str, out: &mut LiveHelpers) -> bool {
    for item in items {
        let Some(tail) = item.get(sk_name).and_then(|v| v.as_s().ok()).and_then(|sk| sk.strip_prefix(prefix)) else { continue };
        out.last_read = Some(tail.to_string());
        let live = item.get(REFS).and_then(|v| v.as_n().ok()).and_then(|n| n.parse::<Decimal>().ok()).is_some_and(|n| n > Decimal::ZERO);
        if live {
            out.first = Some(tail.to_string());
            return true;
        }
    }
    false
}
