//! Dead letters: a poison record goes to SQS as one JSON message with the full record, the
//! rule(s) it poisoned, the variables, the reason and the attempts (DESIGN.md section 2), with
//! message attributes `rule` and `reason`. A record too large for one message keeps its keys
//! and metadata and says its images were cut.

use std::collections::BTreeMap;
use std::sync::Mutex;

use aws_sdk_sqs::types::MessageAttributeValue;
use serde::Serialize;
use serde_json::Value;

use super::SinkError;
use crate::aws::{classify, FailureKind};

/// SQS's largest message: 256 KiB, body and attributes together.
pub const MAX_MESSAGE_BYTES: usize = 262_144;
/// Room kept for message attributes.
const ATTRIBUTE_ROOM: usize = 2_048;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Reason {
    pub code: String,
    pub message: String,
}

/// The message body. `rule` is the first rule the record poisoned; `rules` lists all of them.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DeadLetter {
    pub version: u32,
    pub reason: Reason,
    pub rule: String,
    pub rules: Vec<String>,
    pub attempts: u32,
    pub first_failed_at: String,
    pub stream_arn: String,
    pub shard_id: String,
    pub sequence_number: String,
    pub variables: BTreeMap<String, String>,
    pub record: Value,
    /// True when NewImage/OldImage were removed to fit the message (or by configuration).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub images_cut: bool,
}

impl DeadLetter {
    /// The JSON body, cutting the images if it would not fit one SQS message (or when
    /// `include_images` is off).
    pub fn body(&self, include_images: bool) -> (String, bool) {
        let full = serde_json::to_string(self).unwrap_or_default();
        if include_images && full.len() + ATTRIBUTE_ROOM <= MAX_MESSAGE_BYTES {
            return (full, false);
        }
        let mut cut = self.clone();
        cut.images_cut = true;
        if let Some(ddb) = cut.record.get_mut("dynamodb").and_then(Value::as_object_mut) {
            ddb.remove("NewImage");
            ddb.remove("OldImage");
        }
        (serde_json::to_string(&cut).unwrap_or_default(), true)
    }
}

/// Where dead letters go.
pub enum DeadLetters {
    Sqs(SqsDeadLetters),
    Memory(std::sync::Arc<MemoryDeadLetters>),
    /// No queue configured: poison records are logged and counted only.
    Disabled,
}

impl DeadLetters {
    pub async fn send(&self, letter: &DeadLetter) -> Result<(), SinkError> {
        match self {
            DeadLetters::Sqs(q) => q.send(letter).await,
            DeadLetters::Memory(m) => m.send(letter).await,
            DeadLetters::Disabled => Ok(()),
        }
    }

    pub fn enabled(&self) -> bool {
        !matches!(self, DeadLetters::Disabled)
    }
}

pub struct SqsDeadLetters {
    client: aws_sdk_sqs::Client,
    queue_url: String,
    include_images: bool,
}

impl SqsDeadLetters {
    pub fn new(client: aws_sdk_sqs::Client, queue_url: String, include_images: bool) -> SqsDeadLetters {
        SqsDeadLetters { client, queue_url, include_images }
    }
}

fn attribute(v: &str) -> Result<MessageAttributeValue, SinkError> {
    MessageAttributeValue::builder().data_type("String").string_value(v).build().map_err(|e| SinkError::Fatal(e.to_string()))
}

impl SqsDeadLetters {
    pub async fn send(&self, letter: &DeadLetter) -> Result<(), SinkError> {
        let (body, _) = letter.body(self.include_images);
        let resp = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(body)
            .message_attributes("rule", attribute(&letter.rule)?)
            .message_attributes("reason", attribute(&letter.reason.code)?)
            .send()
            .await;
        match resp {
            Ok(_) => Ok(()),
            Err(e) => {
                let f = classify(&e);
                // Every failure to hand a dead letter over is retried: the shard waits (its
                // checkpoint stays) rather than lose the record.
                Err(match f.kind {
                    FailureKind::Invalid => SinkError::Invalid(format!("SQS refused the dead letter: {f}")),
                    _ => SinkError::Transient(format!("SQS {}: {f}", self.queue_url)),
                })
            }
        }
    }
}

/// Keeps dead letters in memory (tests, and `simulate`-like tooling).
#[derive(Debug, Default)]
pub struct MemoryDeadLetters {
    letters: Mutex<Vec<DeadLetter>>,
    fail_next: Mutex<u32>,
}

impl MemoryDeadLetters {
    pub fn letters(&self) -> Vec<DeadLetter> {
        self.letters.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn fail_next(&self, n: u32) {
        *self.fail_next.lock().unwrap_or_else(|e| e.into_inner()) = n;
    }
}

impl MemoryDeadLetters {
    pub async fn send(&self, letter: &DeadLetter) -> Result<(), SinkError> {
        {
            let mut f = self.fail_next.lock().unwrap_or_else(|e| e.into_inner());
            if *f > 0 {
                *f -= 1;
                return Err(SinkError::Transient("queue unavailable (simulated)".into()));
            }
        }
        self.letters.lock().unwrap_or_else(|e| e.into_inner()).push(letter.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn letter(image_bytes: usize) -> DeadLetter {
        DeadLetter {
            version: 1,
            reason: Reason { code: "non_numeric_sum".into(), message: "measures.revenue: attribute total is of type S".into() },
            rule: "customer-orders".into(),
            rules: vec!["customer-orders".into()],
            attempts: 1,
            first_failed_at: "2026-11-30T00:00:00Z".into(),
            stream_arn: "arn".into(),
            shard_id: "shardId-1".into(),
            sequence_number: "42".into(),
            variables: [("customer".to_string(), "c1".to_string())].into(),
            record: json!({"eventName": "INSERT", "dynamodb": {"Keys": {"PK": {"S": "CUST#c1"}}, "NewImage": {"blob": {"S": "x".repeat(image_bytes)}}, "SequenceNumber": "42"}}),
            images_cut: false,
        }
    }

    #[test]
    fn body_has_the_documented_shape() {
        let (body, cut) = letter(10).body(true);
        assert!(!cut);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["reason"]["code"], "non_numeric_sum");
        assert_eq!(v["rule"], "customer-orders");
        assert_eq!(v["variables"]["customer"], "c1");
        assert_eq!(v["record"]["dynamodb"]["NewImage"]["blob"]["S"], "xxxxxxxxxx");
        assert!(v.get("images_cut").is_none());
    }

    #[test]
    fn oversized_records_keep_keys_and_say_images_were_cut() {
        let (body, cut) = letter(300_000).body(true);
        assert!(cut);
        assert!(body.len() < MAX_MESSAGE_BYTES);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["images_cut"], true);
        assert_eq!(v["record"]["dynamodb"]["Keys"]["PK"]["S"], "CUST#c1");
        assert!(v["record"]["dynamodb"].get("NewImage").is_none());
        let (_, cut) = letter(10).body(false);
        assert!(cut, "include_images: false leaves item data out");
    }
}
