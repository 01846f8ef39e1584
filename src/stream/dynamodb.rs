//! DynamoDB Streams through aws-sdk-dynamodbstreams. SDK errors become [`StreamError`] here,
//! and SDK records become the JSON shape GetRecords and Lambda use, through a total function
//! (an attribute type the SDK does not know is an error, never a panic).

use std::collections::HashMap;

use aws_sdk_dynamodbstreams::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodbstreams::primitives::Blob;
use aws_sdk_dynamodbstreams::types::{AttributeValue, Record, ShardIteratorType};
use aws_sdk_dynamodbstreams::Client;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use base64::Engine as _;
use serde_json::{Map, Value};

use super::{Page, Position, Records, ShardInfo, StreamError, StreamSource};
use crate::aws::{classify, FailureKind};

#[derive(Clone)]
pub struct DynamoDbStream {
    client: Client,
    stream_arn: String,
}

impl DynamoDbStream {
    pub fn new(client: Client, stream_arn: String) -> DynamoDbStream {
        DynamoDbStream { client, stream_arn }
    }

    pub fn stream_arn(&self) -> &str {
        &self.stream_arn
    }
}

fn map_err<E>(e: SdkError<E, HttpResponse>) -> StreamError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let f = classify(&e);
    match (f.code.as_str(), f.kind) {
        ("ExpiredIteratorException", _) => StreamError::ExpiredIterator,
        ("TrimmedDataAccessException", _) => StreamError::TrimmedData(f.to_string()),
        (_, FailureKind::Throttled) => StreamError::Throttled(f.to_string()),
        (_, FailureKind::Transient) => StreamError::Transient(f.to_string()),
        (_, FailureKind::NotFound) => StreamError::NotFound(f.to_string()),
        _ => StreamError::Fatal(f.to_string()),
    }
}

impl StreamSource for DynamoDbStream {
    async fn shards(&self) -> Result<Vec<ShardInfo>, StreamError> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        // Bounded: a stream has at most a few thousand shards in 24 h; 10,000 pages is a bug.
        for _ in 0..10_000 {
            let resp = self
                .client
                .describe_stream()
                .stream_arn(&self.stream_arn)
                .set_exclusive_start_shard_id(start.clone())
                .send()
                .await
                .map_err(map_err)?;
            let Some(desc) = resp.stream_description() else { break };
            for s in desc.shards() {
                let Some(id) = s.shard_id() else { continue };
                let closed = s.sequence_number_range().and_then(|r| r.ending_sequence_number()).is_some();
                out.push(ShardInfo { shard_id: id.to_string(), parent: s.parent_shard_id().map(str::to_string), closed });
            }
            match desc.last_evaluated_shard_id() {
                Some(last) => start = Some(last.to_string()),
                None => return Ok(out),
            }
        }
        Err(StreamError::Fatal("DescribeStream did not finish paging".into()))
    }

    async fn iterator(&self, shard_id: &str, position: &Position) -> Result<String, StreamError> {
        let req = self.client.get_shard_iterator().stream_arn(&self.stream_arn).shard_id(shard_id);
        let req = match position {
            Position::TrimHorizon => req.shard_iterator_type(ShardIteratorType::TrimHorizon),
            Position::Latest => req.shard_iterator_type(ShardIteratorType::Latest),
            Position::After(seq) => req.shard_iterator_type(ShardIteratorType::AfterSequenceNumber).sequence_number(seq),
            Position::At(seq) => req.shard_iterator_type(ShardIteratorType::AtSequenceNumber).sequence_number(seq),
        };
        let resp = req.send().await.map_err(map_err)?;
        resp.shard_iterator().map(str::to_string).ok_or_else(|| StreamError::NoIterator(shard_id.to_string()))
    }

    async fn records(&self, iterator: &str, limit: u32) -> Result<Page, StreamError> {
        let limit = i32::try_from(limit.clamp(1, 1000)).unwrap_or(1000);
        let resp = self.client.get_records().shard_iterator(iterator).limit(limit).send().await.map_err(map_err)?;
        let sdk = resp.records.unwrap_or_default();
        // A record this version cannot represent fails the page, before any is taken.
        for r in &sdk {
            convertible(r).map_err(StreamError::Fatal)?;
        }
        let first = sdk.iter().find_map(|r| r.dynamodb.as_ref()?.approximate_creation_date_time.and_then(|t| epoch_ms(&t)));
        // Each record is converted as it is taken, and its SDK form is freed then: the page is
        // never held as JSON trees all at once.
        let records = Records::lazy(sdk.len(), first, sdk.into_iter().map(|r| record_to_json(r).unwrap_or_else(unconvertible)));
        Ok(Page { records, next_iterator: resp.next_shard_iterator })
    }
}

fn epoch_ms(t: &aws_sdk_dynamodbstreams::primitives::DateTime) -> Option<u64> {
    u64::try_from(t.to_millis().ok()?).ok()
}

/// Whether [`record_to_json`] can convert `r`: every attribute of a type this version knows.
fn convertible(r: &Record) -> Result<(), String> {
    fn attribute(v: &AttributeValue) -> Result<(), String> {
        match v {
            AttributeValue::L(items) => items.iter().try_for_each(attribute),
            AttributeValue::M(m) => item(m),
            AttributeValue::S(_)
            | AttributeValue::N(_)
            | AttributeValue::B(_)
            | AttributeValue::Bool(_)
            | AttributeValue::Null(_)
            | AttributeValue::Ss(_)
            | AttributeValue::Ns(_)
            | AttributeValue::Bs(_) => Ok(()),
            _ => Err("an attribute type this version does not know".to_string()),
        }
    }
    fn item(m: &HashMap<String, AttributeValue>) -> Result<(), String> {
        m.iter().try_for_each(|(k, v)| attribute(v).map_err(|e| format!("attribute {k}: {e}")))
    }
    let Some(d) = &r.dynamodb else { return Ok(()) };
    [&d.keys, &d.new_image, &d.old_image].into_iter().flatten().try_for_each(item)
}

/// What a record that [`convertible`] accepted and [`record_to_json`] still refused becomes:
/// not a stream record, so the rules make it a poison letter carrying the reason.
fn unconvertible(reason: String) -> Value {
    let mut m = Map::new();
    m.insert("conversionError".into(), Value::String(reason));
    Value::Object(m)
}

/// An SDK record in the JSON shape of GetRecords and Lambda events. Takes the record: its
/// strings move into the JSON tree, none is copied.
pub fn record_to_json(r: Record) -> Result<Value, String> {
    let mut obj = Map::new();
    let put = |m: &mut Map<String, Value>, k: &str, v: Option<String>| {
        if let Some(v) = v {
            m.insert(k.into(), Value::String(v));
        }
    };
    put(&mut obj, "eventID", r.event_id);
    put(&mut obj, "eventName", r.event_name.map(|v| v.as_str().to_string()));
    put(&mut obj, "eventVersion", r.event_version);
    put(&mut obj, "eventSource", r.event_source);
    put(&mut obj, "awsRegion", r.aws_region);
    if let Some(d) = r.dynamodb {
        let mut ddb = Map::new();
        if let Some(t) = d.approximate_creation_date_time {
            // Epoch seconds, as a JSON number (fractions kept exactly).
            let secs = t.secs();
            let nanos = t.subsec_nanos();
            let text = if nanos == 0 { secs.to_string() } else { format!("{secs}.{nanos:09}").trim_end_matches('0').to_string() };
            let n: serde_json::Number = serde_json::from_str(&text).map_err(|e| format!("ApproximateCreationDateTime: {e}"))?;
            ddb.insert("ApproximateCreationDateTime".into(), Value::Number(n));
        }
        for (name, item) in [("Keys", d.keys), ("NewImage", d.new_image), ("OldImage", d.old_image)] {
            if let Some(item) = item {
                ddb.insert(name.into(), item_to_json(item)?);
            }
        }
        put(&mut ddb, "SequenceNumber", d.sequence_number);
        if let Some(s) = d.size_bytes {
            ddb.insert("SizeBytes".into(), Value::Number(s.into()));
        }
        put(&mut ddb, "StreamViewType", d.stream_view_type.map(|v| v.as_str().to_string()));
        obj.insert("dynamodb".into(), Value::Object(ddb));
    }
    if let Some(u) = r.user_identity {
        let mut id = Map::new();
        put(&mut id, "type", u.r#type);
        put(&mut id, "principalId", u.principal_id);
        obj.insert("userIdentity".into(), Value::Object(id));
    }
    Ok(Value::Object(obj))
}

fn item_to_json(item: HashMap<String, AttributeValue>) -> Result<Value, String> {
    let mut m = Map::new();
    for (k, v) in item {
        match attribute_to_json(v) {
            Ok(v) => m.insert(k, v),
            Err(e) => return Err(format!("attribute {k}: {e}")),
        };
    }
    Ok(Value::Object(m))
}

/// Typed DynamoDB JSON (`{"S": "x"}`, `{"N": "1"}`, ...) from a stream attribute value, taken
/// by value. Total: a variant the SDK adds later is an error, never a panic.
pub fn attribute_to_json(v: AttributeValue) -> Result<Value, String> {
    let b64 = |b: Blob| Value::String(base64::engine::general_purpose::STANDARD.encode(b.into_inner()));
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let (ty, inner) = match v {
        AttributeValue::S(s) => ("S", Value::String(s)),
        AttributeValue::N(n) => ("N", Value::String(n)),
        AttributeValue::B(b) => ("B", b64(b)),
        AttributeValue::Bool(b) => ("BOOL", Value::Bool(b)),
        AttributeValue::Null(b) => ("NULL", Value::Bool(b)),
        AttributeValue::Ss(v) => ("SS", strings(v)),
        AttributeValue::Ns(v) => ("NS", strings(v)),
        AttributeValue::Bs(v) => ("BS", Value::Array(v.into_iter().map(b64).collect())),
        AttributeValue::L(items) => ("L", Value::Array(items.into_iter().map(attribute_to_json).collect::<Result<_, _>>()?)),
        AttributeValue::M(m) => ("M", item_to_json(m)?),
        _ => return Err("an attribute type this version does not know".to_string()),
    };
    let mut typed = Map::new();
    typed.insert(ty.into(), inner);
    Ok(Value::Object(typed))
}

#[cfg(test)]
mod tests {
    use aws_sdk_dynamodbstreams::primitives::DateTime;
    use aws_sdk_dynamodbstreams::types::{Identity, OperationType, StreamRecord};
    use serde_json::json;

    use super::*;

    #[test]
    fn converts_every_attribute_type() {
        let mut m = HashMap::new();
        m.insert("x".to_string(), AttributeValue::N("1".into()));
        let cases = [
            (AttributeValue::S("a".into()), json!({"S": "a"})),
            (AttributeValue::N("1.50".into()), json!({"N": "1.50"})),
            (AttributeValue::B(Blob::new(vec![1, 2, 3])), json!({"B": "AQID"})),
            (AttributeValue::Bool(true), json!({"BOOL": true})),
            (AttributeValue::Null(true), json!({"NULL": true})),
            (AttributeValue::Ss(vec!["a".into()]), json!({"SS": ["a"]})),
            (AttributeValue::Ns(vec!["1".into()]), json!({"NS": ["1"]})),
            (AttributeValue::Bs(vec![Blob::new(vec![0])]), json!({"BS": ["AA=="]})),
            (AttributeValue::L(vec![AttributeValue::S("a".into())]), json!({"L": [{"S": "a"}]})),
            (AttributeValue::M(m), json!({"M": {"x": {"N": "1"}}})),
        ];
        for (v, want) in cases {
            assert_eq!(attribute_to_json(v).unwrap(), want);
        }
    }

    #[test]
    fn every_known_attribute_type_is_convertible_and_a_refusal_becomes_a_poison_record() {
        // The SDK's Unknown variant cannot be built outside it: the refusal itself is the
        // `_` arm of `convertible` and of `attribute_to_json`, which agree.
        let mut inner = HashMap::new();
        inner.insert("x".to_string(), AttributeValue::Bs(vec![Blob::new(vec![0])]));
        let mut image = HashMap::new();
        image.insert("PK".to_string(), AttributeValue::S("CUST#c1".into()));
        image.insert("doc".to_string(), AttributeValue::L(vec![AttributeValue::M(inner), AttributeValue::Null(true)]));
        let rec = Record::builder().dynamodb(StreamRecord::builder().set_new_image(Some(image)).build()).build();
        assert_eq!(convertible(&rec), Ok(()));
        assert!(record_to_json(rec).is_ok());
        assert!(crate::rules::record::StreamRecord::decode(&unconvertible("x".into())).is_err());
    }

    #[test]
    fn converts_a_record_to_the_lambda_shape() {
        let mut keys = HashMap::new();
        keys.insert("PK".to_string(), AttributeValue::S("CUST#c1".into()));
        let rec = Record::builder()
            .event_id("e1")
            .event_name(OperationType::Remove)
            .dynamodb(
                StreamRecord::builder()
                    .approximate_creation_date_time(DateTime::from_secs_and_nanos(1_764_460_800, 500_000_000))
                    .set_keys(Some(keys.clone()))
                    .set_old_image(Some(keys))
                    .sequence_number("000000000000000000042")
                    .build(),
            )
            .user_identity(Identity::builder().r#type("Service").principal_id("dynamodb.amazonaws.com").build())
            .build();
        let v = record_to_json(rec).unwrap();
        assert_eq!(v["eventName"], "REMOVE");
        assert_eq!(v["dynamodb"]["ApproximateCreationDateTime"].to_string(), "1764460800.5");
        assert_eq!(v["dynamodb"]["OldImage"]["PK"]["S"], "CUST#c1");
        assert_eq!(v["userIdentity"]["principalId"], "dynamodb.amazonaws.com");
        let decoded = crate::rules::record::StreamRecord::decode(&v).unwrap();
        assert_eq!(decoded.sequence_number, Some("000000000000000000042"));
    }
}
