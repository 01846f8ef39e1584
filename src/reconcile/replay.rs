//! `dlq replay`: for each dead letter, reconcile the targets its record touched, then delete it.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::dynamodb::Reconciler;
use super::truth::target_for;
use super::{Options, ReconcileError};

/// Outcome of `dlq replay`.
#[derive(Debug, Default)]
pub struct ReplaySummary {
    pub replayed: u64,
    pub kept: Vec<String>,
    pub corrected: u64,
}

/// For each dead letter: reconcile the targets its record touched (for every rule it
/// poisoned), then delete it. Letters whose targets cannot be determined, or still drift, stay.
pub async fn replay_dead_letters(
    reconciler: &Reconciler,
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    max: u64,
    opts: &Options,
) -> Result<ReplaySummary, ReconcileError> {
    let mut summary = ReplaySummary::default();
    let mut seen = 0u64;
    while seen < max {
        let resp = sqs
            .receive_message()
            .queue_url(queue_url)
            .max_number_of_messages(10)
            .visibility_timeout(300)
            .wait_time_seconds(1)
            .send()
            .await
            .map_err(|e| ReconcileError::Queue(format!("receiving from {queue_url}: {}", crate::aws::classify_any(&e))))?;
        let messages = resp.messages();
        if messages.is_empty() {
            break;
        }
        for m in messages {
            seen += 1;
            let body: Value = serde_json::from_str(m.body().unwrap_or("")).unwrap_or(Value::Null);
            let id = m.message_id().unwrap_or("?").to_string();
            match replay_one(reconciler, &body, opts).await {
                Ok(corrected) => {
                    summary.corrected += corrected;
                    if let Some(handle) = m.receipt_handle() {
                        sqs.delete_message()
                            .queue_url(queue_url)
                            .receipt_handle(handle)
                            .send()
                            .await
                            .map_err(|e| ReconcileError::Queue(format!("deleting {id}: {}", crate::aws::classify_any(&e))))?;
                    }
                    summary.replayed += 1;
                }
                Err(why) => summary.kept.push(format!("{id}: {why}")),
            }
        }
    }
    Ok(summary)
}

/// Replays one letter; Err: why it stays in the queue.
async fn replay_one(reconciler: &Reconciler, body: &Value, opts: &Options) -> Result<u64, String> {
    if body.get("version").and_then(Value::as_u64) != Some(1) {
        return Err("not a ddb-aggregator dead letter (version 1)".into());
    }
    let mut rules: Vec<String> = body
        .get("rules")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|r| r.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    if rules.is_empty() {
        rules.extend(body.get("rule").and_then(Value::as_str).map(str::to_string));
    }
    let letter_vars: BTreeMap<String, String> = body
        .get("variables")
        .and_then(Value::as_object)
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default();
    let mut corrected = 0;
    for name in &rules {
        // A copy rule's part of a letter: the copies of the source the record is about.
        if let Some(rule) = reconciler.config().engine.copies.iter().find(|r| *r.name == **name) {
            corrected += replay_copies(reconciler, rule, body, opts).await?;
            continue;
        }
        let rule = reconciler
            .config()
            .engine
            .rules
            .iter()
            .find(|r| *r.name == **name)
            .ok_or_else(|| format!("rule {name} is not in this config"))?;
        // The variables from the letter, or captured again from the record's keys.
        let mut vars = letter_vars.clone();
        if let Some(keys) = body.pointer("/record/dynamodb/Keys").and_then(Value::as_object) {
            let mut caps = Vec::new();
            for (attr, t) in &rule.source_key {
                if let Some(v) = keys.get(attr).and_then(|v| v.get("S")).and_then(Value::as_str) {
                    caps.clear();
                    if t.capture(v, &mut caps) {
                        for (n, c) in &caps {
                            vars.entry(n.to_string()).or_insert_with(|| c.to_string());
                        }
                    }
                }
            }
        }
        let target_vars: BTreeSet<&str> = rule.target.iter().flat_map(|(_, t)| t.variables()).collect();
        vars.retain(|k, _| target_vars.contains(k.as_str()));
        if target_for(rule, &vars).is_none() {
            return Err(format!("the letter does not determine rule {name}'s target"));
        }
        let report =
            reconciler.run(&Options { vars, rule: Some(name.clone()), all: false, ..opts.clone() }).await.map_err(|e| e.to_string())?;
        if report.uncorrected() > 0 {
            return Err(format!("rule {name}: drift remains ({} not corrected)", report.uncorrected()));
        }
        corrected += report.drifts.len() as u64;
    }
    Ok(corrected)
}

/// Reconciles the copies of the source a letter's record is about; Err: why it stays.
async fn replay_copies(reconciler: &Reconciler, rule: &crate::rules::copy::CopyRule, body: &Value, opts: &Options) -> Result<u64, String> {
    let name = &rule.name;
    let keys: crate::sink::copy::ItemKey = body
        .pointer("/record/dynamodb/Keys")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .ok_or_else(|| format!("the letter's record has no dynamodb.Keys to find copy rule {name}'s source"))?;
    if !super::copies::is_source(rule, &keys) {
        return Err(format!("the letter's record is not a source of copy rule {name}"));
    }
    let report = reconciler.run_copies(name, &[keys], opts).await.map_err(|e| e.to_string())?;
    let left: Vec<String> = report.copy_drifts.iter().filter(|d| !d.corrected).map(|d| d.item_text()).collect();
    if !left.is_empty() {
        return Err(format!("copy rule {name}: {} copy item(s) still differ from the source ({})", left.len(), left.join(", ")));
    }
    Ok(report.copy_drifts.len() as u64)
}
