//! A source item's identity for one rule, the same from a stream record's `Keys` and from an
//! item reconcile reads: the hold's log names items by it (see [`crate::sink::hold`]).

use std::sync::Arc;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Hex digits of an item id: 128 bits of SHA-256, so two items of one rule never share one by
/// chance, whatever their keys.
pub const ITEM_ID_LEN: usize = 32;

/// The id of the item with these key attributes (typed DynamoDB JSON, as in `dynamodb.Keys`)
/// for `rule`: a hash of the rule's name and the attributes' names, types and values, in name
/// order. The rule is part of it because each rule's contribution is logged on its own.
pub fn item_id(rule: &str, keys: &Map<String, Value>) -> Arc<str> {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    };
    field(rule.as_bytes());
    let mut names: Vec<&String> = keys.keys().collect();
    names.sort_unstable();
    for name in names {
        field(name.as_bytes());
        // One type and its value: {"S": "..."}, {"N": "..."} or {"B": "<base64>"}.
        match keys.get(name).and_then(Value::as_object).and_then(|m| m.iter().next()) {
            Some((ty, Value::String(v))) => {
                field(ty.as_bytes());
                field(v.as_bytes());
            }
            other => field(other.map(|(t, v)| format!("{t}{v}")).unwrap_or_default().as_bytes()),
        }
    }
    let digest = h.finalize();
    let hex: String = digest.iter().take(ITEM_ID_LEN / 2).map(|b| format!("{b:02x}")).collect();
    Arc::from(hex)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn ids_depend_on_rule_and_every_key_attribute_and_not_on_order() {
        let a = item_id("orders", &keys(json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#1"}})));
        assert_eq!(a.len(), ITEM_ID_LEN);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, item_id("orders", &keys(json!({"SK": {"S": "ORDER#1"}, "PK": {"S": "CUST#c1"}}))));
        assert_ne!(a, item_id("revenue", &keys(json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#1"}}))));
        assert_ne!(a, item_id("orders", &keys(json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2"}}))));
        assert_ne!(a, item_id("orders", &keys(json!({"PK": {"S": "CUST#c1"}, "SK": {"N": "1"}}))));
        // Lengths are hashed too: moving a character from one value to the next is another item.
        assert_ne!(
            item_id("r", &keys(json!({"PK": {"S": "ab"}, "SK": {"S": "c"}}))),
            item_id("r", &keys(json!({"PK": {"S": "a"}, "SK": {"S": "bc"}})))
        );
    }
}
