//! Dead letters: a poison record goes to SQS as one JSON message with the full record, the
//! rule(s) it poisoned, the variables, the reason and the attempts (DESIGN.md section 2), with
//! message attributes `rule` and `reason`.
//!
//! A letter must never hold its shard for ever, so it is sent down a ladder of forms
//! ([`Delivery`]): the full record (characters SQS refuses written as JSON escapes, which
//! decode to the same record), then without its images, then its keys only. Only when SQS
//! refuses even that is the letter dropped (the caller logs the record in full). A queue that
//! is unavailable is different: that is an error, and the shard waits.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;

use aws_sdk_sqs::types::MessageAttributeValue;
use serde::Serialize;
use serde_json::{Map, Value};
use tracing::warn;

use super::SinkError;
use crate::aws::{classify, Failure, FailureKind};

/// SQS's largest message: 256 KiB, body and attributes together.
pub const MAX_MESSAGE_BYTES: usize = 262_144;
/// Room kept for message attributes.
const ATTRIBUTE_ROOM: usize = 2_048;
/// Longest attribute value sent: two of them, with their names and types, fit [`ATTRIBUTE_ROOM`].
const MAX_ATTRIBUTE_BYTES: usize = 512;
/// In the keys-only form, bounds on the free text that could otherwise keep it too large.
const KEYS_ONLY_MESSAGE_BYTES: usize = 4_096;
const KEYS_ONLY_VARIABLE_BYTES: usize = 1_024;

/// The stream record fields a keys-only letter keeps: enough to find the item and the record.
const KEYS_ONLY_TOP: [&str; 2] = ["eventID", "eventName"];
const KEYS_ONLY_DYNAMODB: [&str; 3] = ["Keys", "SequenceNumber", "ApproximateCreationDateTime"];

/// Error codes with which SQS refuses one message for what it holds; any other refusal may be
/// the queue's or the credentials' and is waited out. `InvalidParameterValue` is how SQS says
/// a message is too long.
const MESSAGE_REFUSALS: [&str; 5] =
    ["InvalidMessageContents", "InvalidParameterValue", "MessageTooLong", "InvalidAttributeValue", "InvalidAttributeName"];

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

/// The form in which a dead letter reached the queue (or did not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The whole record.
    Full,
    /// Without NewImage/OldImage: too large, refused, or `include_images: false`.
    ImagesCut,
    /// The record's identity only (event id and name, keys, sequence number, creation time),
    /// marked `"record_cut": "keys_only"`.
    KeysOnly,
    /// SQS refused every form: the letter is not in the queue.
    Dropped,
    /// No queue configured.
    Disabled,
}

impl Delivery {
    pub const ALL: [Delivery; 5] = [Delivery::Full, Delivery::ImagesCut, Delivery::KeysOnly, Delivery::Dropped, Delivery::Disabled];

    /// The `form` label of `ddb_aggregator_dead_letter_deliveries_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::Full => "full",
            Delivery::ImagesCut => "images_cut",
            Delivery::KeysOnly => "keys_only",
            Delivery::Dropped => "dropped",
            Delivery::Disabled => "disabled",
        }
    }
}

/// The forms tried, in order.
const LADDER: [Delivery; 3] = [Delivery::Full, Delivery::ImagesCut, Delivery::KeysOnly];

/// Whether SQS accepts `c` in a message body or a string attribute (the XML 1.0 character set;
/// a `char` is never a surrogate).
pub fn sqs_allowed(c: char) -> bool {
    matches!(c, '\u{9}' | '\u{A}' | '\u{D}' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

/// `json` (serialized JSON) with every character SQS refuses written as a `\uXXXX` escape.
/// Outside strings valid JSON holds only ASCII structure and whitespace SQS allows, so every
/// such character is inside a string, where the escape decodes to the very same character:
/// the JSON value is unchanged. (serde_json already escapes U+0000..U+001F; U+FFFE and U+FFFF
/// it writes raw.)
pub fn sqs_safe_json(json: &str) -> Cow<'_, str> {
    let Some(first) = json.find(|c: char| !sqs_allowed(c)) else { return Cow::Borrowed(json) };
    let mut out = String::with_capacity(json.len() + 16);
    out.push_str(&json[..first]);
    for c in json[first..].chars() {
        if sqs_allowed(c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{u:04x}");
            }
        }
    }
    Cow::Owned(out)
}

/// `text` made fit for a string message attribute: characters SQS refuses become U+FFFD and it
/// is cut to [`MAX_ATTRIBUTE_BYTES`]. Attributes only route and filter; the body keeps the
/// exact values.
pub fn sqs_safe_attribute(text: &str) -> Cow<'_, str> {
    if text.len() <= MAX_ATTRIBUTE_BYTES && text.chars().all(sqs_allowed) {
        return Cow::Borrowed(text);
    }
    let mut out: String = text.chars().map(|c| if sqs_allowed(c) { c } else { char::REPLACEMENT_CHARACTER }).collect();
    truncate(&mut out, MAX_ATTRIBUTE_BYTES);
    Cow::Owned(out)
}

/// Cuts `s` to at most `max` bytes on a character boundary, ending it with an ellipsis when cut.
fn truncate(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push('…');
}

/// What goes on the wire: the letter, and the keys-only marker (kept out of [`DeadLetter`] so
/// the struct the worker builds stays as it is).
#[derive(Serialize)]
struct Wire<'a> {
    #[serde(flatten)]
    letter: &'a DeadLetter,
    #[serde(skip_serializing_if = "Option::is_none")]
    record_cut: Option<&'static str>,
}

/// One form of a letter, ready to send.
#[derive(Debug, Clone)]
pub struct Encoded<'a> {
    pub form: Delivery,
    pub letter: Cow<'a, DeadLetter>,
    /// The JSON body, safe for SQS.
    pub body: String,
}

fn has_images(record: &Value) -> bool {
    record.get("dynamodb").is_some_and(|d| d.get("NewImage").is_some() || d.get("OldImage").is_some())
}

fn without_images(letter: &DeadLetter) -> DeadLetter {
    let mut cut = letter.clone();
    cut.images_cut = true;
    if let Some(ddb) = cut.record.get_mut("dynamodb").and_then(Value::as_object_mut) {
        ddb.remove("NewImage");
        ddb.remove("OldImage");
    }
    cut
}

fn keys_only(letter: &DeadLetter) -> DeadLetter {
    let mut record = Map::new();
    for k in KEYS_ONLY_TOP {
        if let Some(v) = letter.record.get(k) {
            record.insert(k.to_string(), v.clone());
        }
    }
    let mut ddb = Map::new();
    for k in KEYS_ONLY_DYNAMODB {
        if let Some(v) = letter.record.get("dynamodb").and_then(|d| d.get(k)) {
            ddb.insert(k.to_string(), v.clone());
        }
    }
    record.insert("dynamodb".to_string(), Value::Object(ddb));
    DeadLetter { record: Value::Object(record), images_cut: true, ..letter.clone() }
}

fn fits(body: &str) -> bool {
    body.len() + ATTRIBUTE_ROOM <= MAX_MESSAGE_BYTES
}

impl DeadLetter {
    fn wire(&self, record_cut: Option<&'static str>) -> Option<String> {
        // Serializing a struct of strings and JSON values cannot fail; if it ever did, the form
        // is skipped rather than sent empty.
        let json = serde_json::to_string(&Wire { letter: self, record_cut }).ok()?;
        Some(sqs_safe_json(&json).into_owned())
    }

    /// The letter in `form`, or None when that form does not apply: the full record when it is
    /// too large or images are off, the images-cut one when there were no images to cut.
    pub fn encode(&self, form: Delivery, include_images: bool) -> Option<Encoded<'_>> {
        let (letter, body) = match form {
            Delivery::Full => {
                if !include_images {
                    return None;
                }
                let body = self.wire(None)?;
                if !fits(&body) {
                    return None;
                }
                (Cow::Borrowed(self), body)
            }
            Delivery::ImagesCut => {
                if include_images && !has_images(&self.record) && self.encode(Delivery::Full, true).is_some() {
                    return None;
                }
                let cut = without_images(self);
                let body = cut.wire(None)?;
                (Cow::Owned(cut), body)
            }
            Delivery::KeysOnly => {
                let mut cut = keys_only(self);
                let mut body = cut.wire(Some("keys_only"))?;
                // Keys are small (2 KB + 1 KB at most); the free text is what can still be large.
                if !fits(&body) {
                    truncate(&mut cut.reason.message, KEYS_ONLY_MESSAGE_BYTES);
                    for v in cut.variables.values_mut() {
                        truncate(v, KEYS_ONLY_VARIABLE_BYTES);
                    }
                    body = cut.wire(Some("keys_only"))?;
                }
                (Cow::Owned(cut), body)
            }
            Delivery::Dropped | Delivery::Disabled => return None,
        };
        Some(Encoded { form, letter, body })
    }

    /// The JSON body of the first form that applies, and whether its images were cut.
    pub fn body(&self, include_images: bool) -> (String, bool) {
        match LADDER.iter().find_map(|f| self.encode(*f, include_images)) {
            Some(e) => (e.body, e.form != Delivery::Full),
            None => (String::new(), true),
        }
    }
}

/// Sends `letter` down the ladder through `put`. `put` answers `Err(SinkError::Invalid)` when
/// the queue refuses that message for good; any other error stops the ladder and is returned,
/// so the shard waits and the letter is retried (nothing lost).
async fn deliver<'a, F, Fut>(letter: &'a DeadLetter, include_images: bool, mut put: F) -> Result<Delivery, SinkError>
where
    F: FnMut(Encoded<'a>) -> Fut,
    Fut: std::future::Future<Output = Result<(), SinkError>>,
{
    for form in LADDER {
        let Some(encoded) = letter.encode(form, include_images) else { continue };
        match put(encoded).await {
            Ok(()) => return Ok(form),
            Err(SinkError::Invalid(why)) => warn!(
                shard = %letter.shard_id,
                sequence_number = %letter.sequence_number,
                form = form.as_str(),
                error = %why,
                "the dead-letter queue refused this form of the letter; trying the next"
            ),
            Err(e) => return Err(e),
        }
    }
    Ok(Delivery::Dropped)
}

/// Where dead letters go.
pub enum DeadLetters {
    Sqs(SqsDeadLetters),
    Memory(std::sync::Arc<MemoryDeadLetters>),
    /// No queue configured: poison records are logged and counted only.
    Disabled,
}

impl DeadLetters {
    /// The form the letter reached the queue in, or `Dropped` when the queue refused every
    /// form. An error only when the queue could not be reached or answered with a fault that
    /// may pass (unavailable, throttled, 5xx, credentials): retry later.
    pub async fn send(&self, letter: &DeadLetter) -> Result<Delivery, SinkError> {
        match self {
            DeadLetters::Sqs(q) => q.send(letter).await,
            DeadLetters::Memory(m) => m.send(letter).await,
            DeadLetters::Disabled => Ok(Delivery::Disabled),
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

/// A string attribute, or None when there is nothing to send (SQS refuses empty values).
fn attribute(v: &str) -> Result<Option<MessageAttributeValue>, SinkError> {
    let v = sqs_safe_attribute(v);
    if v.is_empty() {
        return Ok(None);
    }
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(v.into_owned())
        .build()
        .map(Some)
        .map_err(|e| SinkError::Fatal(e.to_string()))
}

/// Whether SQS refused this message for what it holds, so that another form may pass.
fn refuses_message(f: &Failure) -> bool {
    let code = f.code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(&f.code);
    f.kind == FailureKind::Invalid || MESSAGE_REFUSALS.contains(&code)
}

impl SqsDeadLetters {
    pub async fn send(&self, letter: &DeadLetter) -> Result<Delivery, SinkError> {
        let mut attributes = HashMap::new();
        for (name, value) in [("rule", &letter.rule), ("reason", &letter.reason.code)] {
            if let Some(v) = attribute(value)? {
                attributes.insert(name.to_string(), v);
            }
        }
        let attributes = Some(attributes).filter(|a| !a.is_empty());
        deliver(letter, self.include_images, |e| {
            let req = self.client.send_message().queue_url(&self.queue_url).message_body(e.body).set_message_attributes(attributes.clone());
            async move {
                req.send().await.map(|_| ()).map_err(|e| {
                    let f = classify(&e);
                    if refuses_message(&f) {
                        SinkError::Invalid(format!("SQS refused the dead letter: {f}"))
                    } else {
                        // The queue, not this message: the shard waits (its checkpoint stays)
                        // rather than lose the record.
                        SinkError::Transient(format!("SQS {}: {f}", self.queue_url))
                    }
                })
            }
        })
        .await
    }
}

/// One letter as the memory queue took it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub form: Delivery,
    pub letter: DeadLetter,
    pub body: String,
}

/// Keeps dead letters in memory (tests, and `simulate`-like tooling). Like SQS it refuses, for
/// good, bodies with characters outside SQS's set or over its size, and any body holding a
/// string given to [`MemoryDeadLetters::refuse_containing`].
#[derive(Debug, Default)]
pub struct MemoryDeadLetters {
    sent: Mutex<Vec<Sent>>,
    fail_next: Mutex<u32>,
    refused: Mutex<Vec<String>>,
    /// Letters are kept without their record and body ([`MemoryDeadLetters::keep_lean`]).
    lean: std::sync::atomic::AtomicBool,
}

impl MemoryDeadLetters {
    pub fn letters(&self) -> Vec<DeadLetter> {
        self.sent().into_iter().map(|s| s.letter).collect()
    }

    pub fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// From now on each letter is kept without its record (`Value::Null`) and with an empty
    /// body: a simulated year sends hundreds of thousands, at about 12 KB each in full.
    pub fn keep_lean(&self) {
        self.lean.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The next `n` sends fail as if the queue were unavailable.
    pub fn fail_next(&self, n: u32) {
        *self.fail_next.lock().unwrap_or_else(|e| e.into_inner()) = n;
    }

    /// From now on, every body containing `needle` is refused for good, as SQS refuses a
    /// message for what it holds.
    pub fn refuse_containing(&self, needle: impl Into<String>) {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).push(needle.into());
    }

    pub async fn send(&self, letter: &DeadLetter) -> Result<Delivery, SinkError> {
        deliver(letter, true, |e| std::future::ready(self.put(e))).await
    }

    fn put(&self, e: Encoded<'_>) -> Result<(), SinkError> {
        {
            let mut f = self.fail_next.lock().unwrap_or_else(|e| e.into_inner());
            if *f > 0 {
                *f -= 1;
                return Err(SinkError::Transient("queue unavailable (simulated)".into()));
            }
        }
        if let Some(c) = e.body.chars().find(|c| !sqs_allowed(*c)) {
            return Err(SinkError::Invalid(format!("InvalidMessageContents: character U+{:04X} (simulated)", u32::from(c))));
        }
        if e.body.len() > MAX_MESSAGE_BYTES {
            return Err(SinkError::Invalid(format!("InvalidParameterValue: {} bytes (simulated)", e.body.len())));
        }
        if let Some(n) = self.refused.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|n| e.body.contains(n.as_str())) {
            return Err(SinkError::Invalid(format!("InvalidMessageContents: holds {n:?} (simulated)")));
        }
        let mut sent = Sent { form: e.form, letter: e.letter.into_owned(), body: e.body };
        if self.lean.load(std::sync::atomic::Ordering::Relaxed) {
            sent.letter.record = serde_json::Value::Null;
            sent.body = String::new();
        }
        self.sent.lock().unwrap_or_else(|e| e.into_inner()).push(sent);
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
            record: json!({"eventID": "e1", "eventName": "INSERT", "eventSource": "aws:dynamodb",
                "dynamodb": {"Keys": {"PK": {"S": "CUST#c1"}}, "NewImage": {"blob": {"S": "x".repeat(image_bytes)}},
                "SequenceNumber": "42", "ApproximateCreationDateTime": 1_764_460_800, "StreamViewType": "NEW_AND_OLD_IMAGES"}}),
            images_cut: false,
        }
    }

    fn with_image_text(text: &str) -> DeadLetter {
        let mut l = letter(0);
        l.record["dynamodb"]["NewImage"]["total"] = json!({ "S": text });
        l
    }

    fn decode(body: &str) -> Value {
        serde_json::from_str(body).expect("the body is JSON")
    }

    fn refused_chars(s: &str) -> Vec<char> {
        s.chars().filter(|c| !sqs_allowed(*c)).collect()
    }

    #[test]
    fn sqs_character_set_boundaries() {
        for c in ['\t', '\n', '\r', ' ', '\u{D7FF}', '\u{E000}', '\u{FFFD}', '\u{10000}', '\u{1F600}', '\u{10FFFF}'] {
            assert!(sqs_allowed(c), "{c:?}");
        }
        for c in ['\0', '\u{8}', '\u{B}', '\u{C}', '\u{E}', '\u{1F}', '\u{FFFE}', '\u{FFFF}'] {
            assert!(!sqs_allowed(c), "{c:?}");
        }
    }

    #[test]
    fn noncharacters_are_escaped_and_decode_to_the_same_string() {
        let v = json!({"s": "12\u{FFFF}", "t": "\u{FFFE}x\u{FFFF}", "\u{FFFF}key": 1});
        let raw = serde_json::to_string(&v).unwrap();
        assert!(raw.contains('\u{FFFF}'), "serde_json writes U+FFFF raw (what this guards against)");
        let safe = sqs_safe_json(&raw);
        assert_eq!(safe, r#"{"s":"12\uffff","t":"\ufffex\uffff","\uffffkey":1}"#);
        assert_eq!(decode(&safe), v);
    }

    #[test]
    fn control_characters_are_escaped_whether_serde_did_it_or_not() {
        let all: String = (0u8..0x20).map(char::from).collect();
        let v = json!({ "c": all });
        let safe = sqs_safe_json(&serde_json::to_string(&v).unwrap()).into_owned();
        assert!(refused_chars(&safe).is_empty());
        assert_eq!(decode(&safe), v);
        // Raw inside a string (not serde's output): escaped all the same, and then valid JSON.
        let safe = sqs_safe_json("[\"a\u{1}b\u{1F}\"]");
        assert_eq!(safe, r#"["a\u0001b\u001f"]"#);
        assert_eq!(decode(&safe), json!(["a\u{1}b\u{1F}"]));
    }

    #[test]
    fn text_sqs_accepts_is_left_alone() {
        for s in ["plain", "", "{\"emoji\":\"😀 \u{10FFFF} \u{E000}\"}", "tab\tnewline\ncr\r"] {
            assert!(matches!(sqs_safe_json(s), Cow::Borrowed(b) if b == s), "{s:?}");
        }
        // Astral characters are allowed: kept raw, not turned into surrogate escapes.
        assert_eq!(sqs_safe_json("\"😀\u{FFFF}\""), "\"😀\\uffff\"");
    }

    #[test]
    fn every_character_round_trips_and_none_refused_remains() {
        let all: String = (0u32..=0x10FFFF).filter_map(char::from_u32).collect();
        let v = json!({ "all": all });
        let safe = sqs_safe_json(&serde_json::to_string(&v).unwrap()).into_owned();
        assert!(refused_chars(&safe).is_empty());
        assert_eq!(decode(&safe), v);
    }

    #[test]
    fn attributes_are_made_safe_and_bounded() {
        assert_eq!(sqs_safe_attribute("customer-orders"), "customer-orders");
        assert_eq!(sqs_safe_attribute("a\u{FFFF}b\u{0}"), "a\u{FFFD}b\u{FFFD}");
        let long = sqs_safe_attribute(&"é".repeat(1_000)).into_owned();
        assert!(long.len() <= MAX_ATTRIBUTE_BYTES && long.ends_with('…'));
        assert!(attribute("").unwrap().is_none(), "SQS refuses an empty attribute value: none is sent");
        assert_eq!(attribute("r\u{FFFE}").unwrap().unwrap().string_value(), Some("r\u{FFFD}"));
    }

    #[test]
    fn truncation_keeps_whole_characters() {
        let mut s = "aé😀".repeat(10);
        truncate(&mut s, 9);
        assert!(s.len() <= 9 && s.ends_with('…'), "{s}");
        let mut short = "abc".to_string();
        truncate(&mut short, 3);
        assert_eq!(short, "abc");
    }

    #[test]
    fn refusals_of_the_message_differ_from_refusals_of_the_queue() {
        let f = |kind, code: &str| Failure { kind, code: code.into(), message: String::new() };
        assert!(refuses_message(&f(FailureKind::Other, "InvalidMessageContents")));
        assert!(refuses_message(&f(FailureKind::Other, "InvalidParameterValue")));
        assert!(refuses_message(&f(FailureKind::Invalid, "ValidationException")));
        assert!(!refuses_message(&f(FailureKind::NotFound, "AWS.SimpleQueueService.NonExistentQueue")));
        assert!(!refuses_message(&f(FailureKind::Throttled, "RequestThrottled")));
        assert!(!refuses_message(&f(FailureKind::Transient, "")));
        assert!(!refuses_message(&f(FailureKind::Other, "AccessDenied")));
        assert!(!refuses_message(&f(FailureKind::Other, "KmsDisabled")));
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
        assert!(v.get("record_cut").is_none());
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

    #[test]
    fn escaping_counts_toward_the_size_limit() {
        // 100,000 U+FFFF are 300,000 bytes raw and 600,000 escaped: too large either way.
        let l = with_image_text(&"\u{FFFF}".repeat(100_000));
        assert!(l.encode(Delivery::Full, true).is_none());
        let e = l.encode(Delivery::ImagesCut, true).unwrap();
        assert!(fits(&e.body));
    }

    #[tokio::test]
    async fn a_body_with_noncharacters_is_delivered_whole() {
        let q = MemoryDeadLetters::default();
        let l = with_image_text("12\u{FFFF}");
        assert_eq!(q.send(&l).await.unwrap(), Delivery::Full);
        let sent = q.sent();
        assert!(refused_chars(&sent[0].body).is_empty());
        assert_eq!(decode(&sent[0].body)["record"], l.record, "the record decodes to the original, U+FFFF and all");
        assert_eq!(sent[0].letter, l);
    }

    #[tokio::test]
    async fn refused_images_are_cut() {
        let q = MemoryDeadLetters::default();
        q.refuse_containing("poison-in-the-image");
        let l = with_image_text("poison-in-the-image");
        assert_eq!(q.send(&l).await.unwrap(), Delivery::ImagesCut);
        let v = decode(&q.sent()[0].body);
        assert_eq!(v["images_cut"], true);
        assert!(v.get("record_cut").is_none());
        assert!(v["record"]["dynamodb"].get("NewImage").is_none());
        assert_eq!(v["record"]["eventSource"], "aws:dynamodb", "everything but the images stays");
        assert_eq!(v["record"]["dynamodb"]["Keys"]["PK"]["S"], "CUST#c1");
    }

    #[tokio::test]
    async fn refused_metadata_leaves_the_keys_only() {
        let q = MemoryDeadLetters::default();
        q.refuse_containing("aws:dynamodb");
        let l = letter(10);
        assert_eq!(q.send(&l).await.unwrap(), Delivery::KeysOnly);
        let v = decode(&q.sent()[0].body);
        assert_eq!(v["record_cut"], "keys_only");
        assert_eq!(v["images_cut"], true);
        assert_eq!(
            v["record"],
            json!({"eventID": "e1", "eventName": "INSERT", "dynamodb": {"Keys": {"PK": {"S": "CUST#c1"}},
                "SequenceNumber": "42", "ApproximateCreationDateTime": 1_764_460_800}})
        );
        assert_eq!(v["reason"]["code"], "non_numeric_sum");
        assert_eq!(v["sequence_number"], "42");
    }

    #[tokio::test]
    async fn a_letter_refused_in_every_form_is_dropped_not_an_error() {
        let q = MemoryDeadLetters::default();
        q.refuse_containing("CUST#c1");
        assert_eq!(q.send(&letter(10)).await.unwrap(), Delivery::Dropped);
        assert!(q.sent().is_empty());
    }

    #[tokio::test]
    async fn a_record_without_images_goes_from_full_to_keys_only() {
        let q = MemoryDeadLetters::default();
        q.refuse_containing("aws:dynamodb");
        let mut l = letter(0);
        l.record["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        assert!(l.encode(Delivery::ImagesCut, true).is_none(), "nothing to cut: the same body again would be refused again");
        assert!(l.encode(Delivery::ImagesCut, false).is_some(), "with images off it is the first form");
        assert_eq!(q.send(&l).await.unwrap(), Delivery::KeysOnly);
    }

    #[test]
    fn keys_only_bounds_the_free_text() {
        let mut l = letter(300_000);
        l.reason.message = "m".repeat(300_000);
        l.variables.insert("big".into(), "v".repeat(300_000));
        let e = l.encode(Delivery::KeysOnly, true).unwrap();
        assert!(fits(&e.body), "{} bytes", e.body.len());
        assert_eq!(decode(&e.body)["variables"]["customer"], "c1");
    }

    #[tokio::test]
    async fn an_unavailable_queue_is_an_error_to_retry_and_loses_nothing() {
        let q = MemoryDeadLetters::default();
        q.fail_next(1);
        let err = q.send(&letter(10)).await.unwrap_err();
        assert!(err.is_retriable(), "{err}");
        assert!(q.sent().is_empty());
        assert_eq!(q.send(&letter(10)).await.unwrap(), Delivery::Full);
        assert_eq!(q.letters(), vec![letter(10)]);
    }

    #[tokio::test]
    async fn no_queue_is_a_delivery_of_its_own() {
        assert_eq!(DeadLetters::Disabled.send(&letter(1)).await.unwrap(), Delivery::Disabled);
        let labels: std::collections::BTreeSet<_> = Delivery::ALL.iter().map(|d| d.as_str()).collect();
        assert_eq!(labels.len(), Delivery::ALL.len());
    }
}
