//! The state table's items as typed records (serde_dynamo). A malformed item is an error that
//! names the item and the attribute, never a silent default: a lease read as counter 0 or
//! expiry 0 would be taken by every replica at once.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use serde::Deserialize;

use super::{Checkpoint, Lease, StateError};

/// A shard's lease, as `create`, `take`, `renew` and `checkpoint` write it.
#[derive(Debug, Deserialize)]
struct LeaseItem {
    shard_id: String,
    parent: Option<String>,
    owner: Option<String>,
    counter: u64,
    /// Absent on finished leases written by other tools: free (never a wrong type).
    #[serde(default)]
    expires_at: u64,
    checkpoint: Option<String>,
    /// `TRIM_HORIZON` when a reader started there and applied nothing yet.
    horizon: Option<String>,
    last_record_ms: Option<u64>,
    at_tip_ms: Option<u64>,
    #[serde(default)]
    fold_due: Vec<String>,
}

/// The pending "reconcile everything" request.
#[derive(Debug, Deserialize)]
struct RequestItem {
    requested_at: u64,
}

/// Reads `item` as a `T`; an error names the item (its `shard_id`) and the attribute.
fn typed<T: serde::de::DeserializeOwned>(item: &HashMap<String, AttributeValue>) -> Result<T, StateError> {
    let fields: serde_dynamo::Item = item.clone().into();
    let de = serde_dynamo::Deserializer::from_attribute_value(serde_dynamo::AttributeValue::M(fields.into()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = item.get("shard_id").and_then(|v| v.as_s().ok()).map_or("(no shard_id)", String::as_str);
        let at = e.path().to_string();
        let why = if at == "." { e.inner().to_string() } else { format!("attribute {at}: {}", e.inner()) };
        StateError::Malformed(key.to_string(), why)
    })
}

/// A lease item.
pub fn lease(item: &HashMap<String, AttributeValue>) -> Result<Lease, StateError> {
    let l: LeaseItem = typed(item)?;
    Ok(Lease {
        shard_id: l.shard_id,
        parent: l.parent,
        owner: l.owner,
        counter: l.counter,
        expires_at_ms: l.expires_at,
        checkpoint: l
            .checkpoint
            .map(|c| Checkpoint::parse(&c))
            .or(l.horizon.filter(|h| h == Checkpoint::TRIM_HORIZON).map(|_| Checkpoint::TrimHorizon)),
        last_record_ms: l.last_record_ms,
        at_tip_ms: l.at_tip_ms,
        fold_due: l.fold_due,
    })
}

/// The time of a reconcile request item.
pub fn requested_at(item: &HashMap<String, AttributeValue>) -> Result<u64, StateError> {
    let r: RequestItem = typed(item)?;
    Ok(r.requested_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> AttributeValue {
        AttributeValue::S(v.into())
    }

    fn n(v: &str) -> AttributeValue {
        AttributeValue::N(v.into())
    }

    fn good() -> HashMap<String, AttributeValue> {
        [
            ("shard_id", s("shardId-00000001764460800000-0000abcd")),
            ("stream_arn", s("arn:aws:dynamodb:us-east-1:1:table/t/stream/x")),
            ("counter", n("7")),
            ("expires_at", n("1764460810000")),
            ("owner", s("r1")),
            ("checkpoint", s("000000000000000000042")),
            ("at_tip_ms", n("1764460805000")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    #[test]
    fn a_lease_item_reads_into_a_lease() {
        let l = lease(&good()).unwrap();
        assert_eq!((l.counter, l.expires_at_ms, l.owner.as_deref()), (7, 1_764_460_810_000, Some("r1")));
        assert_eq!(l.checkpoint, Some(Checkpoint::Sequence("000000000000000000042".into())));
        assert_eq!((l.parent, l.last_record_ms, l.at_tip_ms), (None, None, Some(1_764_460_805_000)));
    }

    #[test]
    fn the_horizon_mark_is_a_checkpoint_only_without_a_real_one() {
        let mut item = good();
        item.insert("horizon".into(), s("TRIM_HORIZON"));
        assert_eq!(lease(&item).unwrap().checkpoint, Some(Checkpoint::Sequence("000000000000000000042".into())));
        item.remove("checkpoint");
        assert_eq!(lease(&item).unwrap().checkpoint, Some(Checkpoint::TrimHorizon));
    }

    #[test]
    fn a_malformed_item_is_an_error_naming_it_never_a_default() {
        let cases: [(&str, Option<AttributeValue>, &str); 5] = [
            ("counter", Some(s("7")), "counter"),
            ("counter", None, "counter"),
            ("expires_at", Some(n("-5")), "expires_at"),
            ("checkpoint", Some(n("42")), "checkpoint"),
            ("shard_id", None, "shard_id"),
        ];
        for (attr, value, named) in cases {
            let mut item = good();
            match value {
                Some(v) => item.insert(attr.to_string(), v),
                None => item.remove(attr),
            };
            let e = lease(&item).unwrap_err().to_string();
            assert!(e.contains(named), "{attr}: {e}");
            assert!(e.contains("malformed"), "{attr}: {e}");
        }
        let mut item = good();
        item.insert("counter".into(), s("7"));
        assert!(lease(&item).unwrap_err().to_string().contains("shardId-00000001764460800000-0000abcd"), "the item is named");
        let request: HashMap<String, AttributeValue> = [("requested_at".to_string(), s("yesterday"))].into();
        assert!(requested_at(&request).is_err());
    }
}

/// A copy fan-out job ([`crate::rules::copy::job`]), as `record_copy_job` writes it.
#[derive(Debug, Deserialize)]
struct JobItem {
    rule: String,
    /// The change, as JSON.
    change: String,
    /// The key the next page starts after, as JSON.
    cursor: Option<String>,
    #[serde(default)]
    found: u64,
    created_at: u64,
    due_at: u64,
    #[serde(default)]
    follow_up: bool,
    owner: Option<String>,
    #[serde(default)]
    expires_at: u64,
}

/// A copy job item.
pub fn copy_job(item: &HashMap<String, AttributeValue>) -> Result<crate::rules::copy::job::StoredJob, StateError> {
    use crate::rules::copy::job::{CopyJob, StoredJob};
    let j: JobItem = typed(item)?;
    let key = || item.get("shard_id").and_then(|v| v.as_s().ok()).cloned().unwrap_or_default();
    let change = serde_json::from_str(&j.change).map_err(|e| StateError::Malformed(key(), format!("attribute change: {e}")))?;
    let cursor = match &j.cursor {
        None => None,
        Some(c) => Some(serde_json::from_str(c).map_err(|e| StateError::Malformed(key(), format!("attribute cursor: {e}")))?),
    };
    Ok(StoredJob {
        job: CopyJob { rule: j.rule, change, cursor, found: j.found, created_ms: j.created_at, due_ms: j.due_at, follow_up: j.follow_up },
        owner: j.owner,
        expires_at_ms: j.expires_at,
    })
}
