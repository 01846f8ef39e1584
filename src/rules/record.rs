//! A borrowed view of one stream record in the JSON shape GetRecords and Lambda use.
//!
//! Records stay `serde_json::Value`s so patterns can match the whole record; this view checks
//! the parts the rules rely on once, with an error instead of a panic for any odd shape.

use serde_json::{Map, Value};

use crate::decimal::Decimal;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventName {
    Insert,
    Modify,
    Remove,
}

impl EventName {
    pub fn as_str(self) -> &'static str {
        match self {
            EventName::Insert => "INSERT",
            EventName::Modify => "MODIFY",
            EventName::Remove => "REMOVE",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct StreamRecord<'a> {
    /// The whole record, for filter patterns.
    pub raw: &'a Value,
    pub event_name: EventName,
    pub keys: &'a Map<String, Value>,
    /// Images as JSON objects (so `where` patterns can match them directly).
    pub new_image: Option<&'a Value>,
    pub old_image: Option<&'a Value>,
    pub sequence_number: Option<&'a str>,
    /// Epoch seconds.
    pub approximate_creation: Option<Decimal>,
    /// A REMOVE by DynamoDB's TTL service (`userIdentity` type Service, principal
    /// dynamodb.amazonaws.com), not by a user.
    pub ttl_delete: bool,
}

/// The principal DynamoDB's TTL service deletes items as.
pub const TTL_PRINCIPAL: &str = "dynamodb.amazonaws.com";

impl<'a> StreamRecord<'a> {
    /// Checks the record's shape. The message says what is wrong, never what the item holds.
    pub fn decode(raw: &'a Value) -> Result<StreamRecord<'a>, String> {
        let obj = raw.as_object().ok_or("a stream record must be a JSON object")?;
        let event_name = match obj.get("eventName").and_then(Value::as_str) {
            Some("INSERT") => EventName::Insert,
            Some("MODIFY") => EventName::Modify,
            Some("REMOVE") => EventName::Remove,
            Some(_) => return Err("eventName must be INSERT, MODIFY or REMOVE".into()),
            None => return Err("eventName is missing".into()),
        };
        let ddb = obj.get("dynamodb").and_then(Value::as_object).ok_or("dynamodb is missing or not an object")?;
        let keys = ddb.get("Keys").and_then(Value::as_object).ok_or("dynamodb.Keys is missing or not an object")?;
        let image = |name: &str| -> Result<Option<&'a Value>, String> {
            match ddb.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v @ Value::Object(_)) => Ok(Some(v)),
                Some(_) => Err(format!("dynamodb.{name} must be an object")),
            }
        };
        let new_image = image("NewImage")?;
        let old_image = image("OldImage")?;
        match (event_name, new_image.is_some(), old_image.is_some()) {
            (EventName::Insert, false, _) => return Err("an INSERT record has no NewImage (the stream must be NEW_AND_OLD_IMAGES)".into()),
            (EventName::Remove, _, false) => return Err("a REMOVE record has no OldImage (the stream must be NEW_AND_OLD_IMAGES)".into()),
            (EventName::Modify, n, o) if !(n && o) => {
                return Err("a MODIFY record needs NewImage and OldImage (the stream must be NEW_AND_OLD_IMAGES)".into())
            }
            _ => {}
        }
        // Only the image that the event name implies counts: an INSERT's OldImage would be
        // a contradiction, so it is ignored rather than trusted.
        let (new_image, old_image) = match event_name {
            EventName::Insert => (new_image, None),
            EventName::Remove => (None, old_image),
            EventName::Modify => (new_image, old_image),
        };
        let sequence_number = match ddb.get("SequenceNumber") {
            None => None,
            Some(Value::String(s)) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => Some(s.as_str()),
            Some(_) => return Err("dynamodb.SequenceNumber must be a string of digits".into()),
        };
        let approximate_creation = match ddb.get("ApproximateCreationDateTime") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => {
                Some(Decimal::parse(n.as_str()).map_err(|_| "dynamodb.ApproximateCreationDateTime is not a usable number")?)
            }
            Some(_) => return Err("dynamodb.ApproximateCreationDateTime must be a number (epoch seconds)".into()),
        };
        let identity = obj.get("userIdentity");
        let ttl_delete = event_name == EventName::Remove
            && identity.and_then(|i| i.get("type")).and_then(Value::as_str) == Some("Service")
            && identity.and_then(|i| i.get("principalId")).and_then(Value::as_str) == Some(TTL_PRINCIPAL);
        Ok(StreamRecord { raw, event_name, keys, new_image, old_image, sequence_number, approximate_creation, ttl_delete })
    }
}

/// The typed value of an attribute in an image: `{"S": "x"}` -> ("S", "x").
pub fn attribute<'a>(image: &'a Value, name: &str) -> Option<(&'a str, &'a Value)> {
    let typed = image.get(name)?.as_object()?;
    if typed.len() != 1 {
        return None;
    }
    typed.iter().next().map(|(t, v)| (t.as_str(), v))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn decodes_and_rejects() {
        let ok = json!({"eventName": "MODIFY", "dynamodb": {"Keys": {}, "NewImage": {}, "OldImage": {}, "SequenceNumber": "0012", "ApproximateCreationDateTime": 1.5e9}});
        let r = StreamRecord::decode(&ok).unwrap();
        assert_eq!(r.sequence_number, Some("0012"));
        assert_eq!(r.approximate_creation.unwrap().to_string(), "1500000000");
        for (bad, why) in [
            (json!([]), "JSON object"),
            (json!({"dynamodb": {}}), "eventName is missing"),
            (json!({"eventName": "PUT", "dynamodb": {}}), "INSERT, MODIFY or REMOVE"),
            (json!({"eventName": "INSERT"}), "dynamodb is missing"),
            (json!({"eventName": "INSERT", "dynamodb": {"NewImage": {}}}), "Keys"),
            (json!({"eventName": "INSERT", "dynamodb": {"Keys": {}}}), "NEW_AND_OLD_IMAGES"),
            (json!({"eventName": "MODIFY", "dynamodb": {"Keys": {}, "NewImage": {}}}), "NEW_AND_OLD_IMAGES"),
            (json!({"eventName": "INSERT", "dynamodb": {"Keys": {}, "NewImage": 5}}), "must be an object"),
            (json!({"eventName": "INSERT", "dynamodb": {"Keys": {}, "NewImage": {}, "SequenceNumber": 12}}), "SequenceNumber"),
            (
                json!({"eventName": "INSERT", "dynamodb": {"Keys": {}, "NewImage": {}, "ApproximateCreationDateTime": "x"}}),
                "ApproximateCreationDateTime",
            ),
        ] {
            let err = StreamRecord::decode(&bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn only_a_remove_by_the_ttl_service_is_a_ttl_delete() {
        let rec = |event: &str, identity: Value| {
            let mut r = json!({"eventName": event, "dynamodb": {"Keys": {}, "NewImage": {}, "OldImage": {}}});
            if !identity.is_null() {
                r["userIdentity"] = identity;
            }
            r
        };
        let ttl = json!({"type": "Service", "principalId": "dynamodb.amazonaws.com"});
        let is_ttl = |r: &Value| StreamRecord::decode(r).unwrap().ttl_delete;
        assert!(is_ttl(&rec("REMOVE", ttl.clone())));
        assert!(!is_ttl(&rec("REMOVE", Value::Null)), "a user's delete");
        assert!(!is_ttl(&rec("MODIFY", ttl)), "TTL only deletes");
        assert!(!is_ttl(&rec("REMOVE", json!({"type": "Service", "principalId": "other.amazonaws.com"}))));
        assert!(!is_ttl(&rec("REMOVE", json!({"type": "User", "principalId": "dynamodb.amazonaws.com"}))));
        assert!(!is_ttl(&rec("REMOVE", json!("Service"))), "an odd shape is not TTL");
    }

    #[test]
    fn typed_attributes() {
        let img = json!({"a": {"S": "x"}, "b": {"N": "5"}, "c": {}, "d": "raw"});
        assert_eq!(attribute(&img, "a").map(|(t, _)| t), Some("S"));
        assert_eq!(attribute(&img, "b").and_then(|(_, v)| v.as_str()), Some("5"));
        assert!(attribute(&img, "c").is_none());
        assert!(attribute(&img, "d").is_none());
        assert!(attribute(&img, "z").is_none());
    }
}
