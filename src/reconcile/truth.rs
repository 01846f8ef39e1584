//! The truth, computed from the source items themselves (pure): what every target's measure
//! attributes should hold given the items as they are now.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use crate::decimal::Decimal;
use crate::rules::helper::{self, Derive};
use crate::rules::item::item_id;
use crate::rules::record::StreamRecord;
use crate::rules::template::VarValue;
use crate::rules::{MeasureKind, Poison, Rule, TargetKey};

/// Attribute values per target.
pub type Values = BTreeMap<TargetKey, BTreeMap<String, Decimal>>;

/// What a rule's measures sum to over a set of items.
#[derive(Debug, Default)]
pub struct Truth {
    pub values: Values,
    pub items: u64,
    /// Items the rule cannot evaluate (they are in the dead-letter queue or will be).
    pub poisons: Vec<Poison>,
    /// Held targets ([`super::hold`]): each source item's contribution to them is kept in
    /// [`Truth::by_item`].
    pub held: BTreeSet<TargetKey>,
    /// Per held target, each source item's contribution, by its id ([`item_id`]).
    pub by_item: BTreeMap<TargetKey, super::hold::ByItem>,
}

impl Truth {
    /// Adds one source item (typed DynamoDB JSON). The item counts as a stream INSERT of
    /// itself, so the rule's filter, source key and `where` decide exactly as for the stream;
    /// `key_names` are the source table's key attributes (for `dynamodb.Keys`).
    pub fn add_item(&mut self, rule: &Rule, key_names: &[String], item: &Map<String, Value>) {
        if let Some(record) = insert_record(key_names, item.clone()) {
            self.add_record(rule, &record);
        }
    }

    /// Adds one source item as [`insert_record`] made it (so an item read once is not copied
    /// again for every rule).
    pub fn add_record(&mut self, rule: &Rule, record: &Value) {
        self.items += 1;
        if !rule.filter_matches(record) {
            return;
        }
        let Ok(decoded) = StreamRecord::decode(record) else { return };
        match rule.deltas(&decoded) {
            Ok(deltas) => {
                let held = deltas.iter().filter(|(t, _)| self.held.contains(t));
                for (target, values) in held {
                    let id = item_id(&rule.name, decoded.keys);
                    self.by_item.entry(target.clone()).or_default().insert(id, values.clone());
                }
                for (target, values) in deltas {
                    let entry = self.values.entry(target).or_default();
                    for (name, v) in values {
                        let sum = entry.entry(name).or_insert(Decimal::ZERO);
                        match sum.checked_add(v) {
                            Ok(s) => *sum = s,
                            Err(e) => self.poisons.push(Poison {
                                code: crate::rules::PoisonCode::OutOfRange,
                                rule: Some(rule.name.clone()),
                                message: format!("the true sum leaves DynamoDB's number range: {e}"),
                                variables: BTreeMap::new(),
                            }),
                        }
                    }
                }
            }
            Err(p) => self.poisons.push(p),
        }
    }
}

/// A source item as the stream record of its own INSERT (what [`Truth::add_record`] takes);
/// None for the ledger registry's item, when the aggregates live in the source table.
pub fn insert_record(key_names: &[String], item: Map<String, Value>) -> Option<Value> {
    if crate::registry::is_reserved_key(key_names.iter().filter_map(|k| item.get(k)?.get("S")?.as_str())) {
        return None;
    }
    let keys: Map<String, Value> = key_names.iter().filter_map(|k| item.get(k).map(|v| (k.clone(), v.clone()))).collect();
    // Built by moving the item in, not with `json!` (which serialises the image value by value).
    let mut ddb = Map::new();
    ddb.insert("Keys".into(), Value::Object(keys));
    ddb.insert("NewImage".into(), Value::Object(item));
    ddb.insert("StreamViewType".into(), Value::String("NEW_AND_OLD_IMAGES".into()));
    let mut record = Map::new();
    record.insert("eventName".into(), Value::String("INSERT".into()));
    record.insert("eventSource".into(), Value::String("aws:dynamodb".into()));
    record.insert("dynamodb".into(), Value::Object(ddb));
    Some(Value::Object(record))
}

/// The target a rule writes for the given variables, if they determine it.
pub fn target_for(rule: &Rule, vars: &BTreeMap<String, String>) -> Option<TargetKey> {
    let mut parts = Vec::with_capacity(rule.target.len());
    for (_, t) in &rule.target {
        let v = t.expand(|name| vars.get(name).map(|s| VarValue::Str(s.as_str()))).ok()?;
        parts.push(v.into_boxed_str());
    }
    Some(TargetKey(parts.into_boxed_slice()))
}

/// Whether an item key (values in the table's key order) could be one of the rule's targets,
/// or one of their helper items (of a `max`, `min`, `latest` or `distinct` of the rule); never
/// the ledger registry item.
pub fn is_target<S: AsRef<str>>(rule: &Rule, key: &[S]) -> bool {
    if crate::registry::is_reserved_key(key.iter().map(AsRef::as_ref)) {
        return false;
    }
    let owner = |key: &[&str]| rule.target.len() == key.len() && rule.target.iter().zip(key).all(|((_, t), v)| t.matches_expansion(v));
    // A sharded rule's sub-items, as well as the totals they fold into; never another rule's
    // (no template expands to a key holding the mark). Only a partition key holding the mark
    // is parsed (a reconcile asks of every item of the table).
    let marked = key.first().is_some_and(|pk| pk.as_ref().contains(crate::rules::shards::MARK));
    if let Some((o, i)) =
        marked.then(|| crate::rules::shards::parse(&TargetKey(key.iter().map(|p| Box::from(p.as_ref())).collect()))).flatten()
    {
        let parts: Vec<&str> = o.0.iter().map(|p| &**p).collect();
        return rule.write_shards.is_some_and(|n| i < n) && owner(&parts);
    }
    let (sk, rest) = match key.split_last() {
        Some(split) => split,
        None => return rule.target.is_empty(),
    };
    match helper::parse(sk.as_ref()) {
        Some(h) => {
            let mut o: Vec<&str> = rest.iter().map(AsRef::as_ref).collect();
            o.push(h.owner_sk);
            owner(&o) && helper_measure(rule, h.measure).is_some()
        }
        None => rule.target.len() == key.len() && rule.target.iter().zip(key).all(|((_, t), v)| t.matches_expansion(v.as_ref())),
    }
}

/// The rule's helper measure an expanded name belongs to.
pub fn helper_measure(rule: &Rule, name: &str) -> Option<Derive> {
    rule.measures.iter().find_map(|m| match &m.kind {
        MeasureKind::Helper(h) if m.name.matches_expansion(name) => Some(h.derive),
        _ => None,
    })
}

/// The target a key belongs to: a helper item's target, or the key itself.
pub fn owner_of(key: &TargetKey) -> TargetKey {
    match key.0.split_last().and_then(|(sk, rest)| helper::parse(sk).map(|h| (h, rest))) {
        Some((h, rest)) => {
            let mut o = rest.to_vec();
            o.push(Box::from(h.owner_sk));
            TargetKey(o.into_boxed_slice())
        }
        None => key.clone(),
    }
}

/// Whether an attribute could be written by one of the rule's counting measures (the derived
/// attributes of helper measures are derived again, not compared as counters).
pub fn owns_attribute(rule: &Rule, attribute: &str) -> bool {
    !attribute.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX)
        && !rule.target.iter().any(|(k, _)| k == attribute)
        && rule.measures.iter().any(|m| !matches!(m.kind, MeasureKind::Helper(_)) && m.name.matches_expansion(attribute))
}

/// Whether reconcile may compare and correct `attribute` on one of the rule's targets: a
/// measure name without variables (only the rule writes it), or a name a template forms that
/// this deployment wrote on the item (`written`, the item's measure set) or that the truth
/// names. A user's `orders_note` next to `orders_{status}` counters is none of these.
pub fn manages(rule: &Rule, attribute: &str, written: &std::collections::BTreeSet<String>, truth_names: bool) -> bool {
    if !owns_attribute(rule, attribute) {
        return false;
    }
    truth_names || written.contains(attribute) || rule.measures.iter().any(|m| m.name.is_literal() && m.name.matches_expansion(attribute))
}

/// The variables a target key was expanded from (captures of the target templates).
pub fn variables_of(rule: &Rule, key: &TargetKey) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for ((_, t), v) in rule.target.iter().zip(key.0.iter()) {
        let mut caps = Vec::new();
        if t.capture(v, &mut caps) {
            for (n, c) in caps {
                out.insert(n.to_string(), c.to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::Config;

    fn rules() -> Vec<Rule> {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn item(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn truth_from_items() {
        let rules = rules();
        let keys = vec!["PK".to_string(), "SK".to_string()];
        let mut t = Truth::default();
        for i in [
            json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": "PAID"}, "total": {"N": "10.5"}}),
            json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o2"}, "status": {"S": "SHIPPED"}, "total": {"N": "5"}}),
            json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}, "orderCount": {"N": "7"}}),
            json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o3"}, "status": {"S": "PAID"}, "total": {"S": "x"}}),
        ] {
            t.add_item(&rules[0], &keys, &item(i));
        }
        let registry = json!({"PK": {"S": crate::registry::KEY}, "SK": {"S": crate::registry::KEY}});
        t.add_item(&rules[0], &keys, &item(registry));
        assert_eq!(t.items, 4, "the ledger registry item is no source item");
        assert_eq!(t.poisons.len(), 1);
        let c1 = &t.values[&target_for(&rules[0], &[("customer".to_string(), "c1".to_string())].into()).unwrap()];
        let shown: Vec<String> = c1.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(shown, ["openOrders=1", "openRevenue=10.5", "orderCount=2", "orders_PAID=1", "orders_SHIPPED=1", "revenue=15.5"]);
    }

    /// A helper item's sort key holds `#_agg#<measure>#`: for a measure starting with `w` that
    /// contains a sub-item's mark (`#_agg#w`), but only a partition key marks a sub-item.
    #[test]
    fn a_helper_of_a_measure_starting_with_w_is_its_rules_target() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let text = text.replace("largestOrder: { max: total }", "weightiest: { max: total }");
        let rules = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules;
        let sk = format!("{}N1", crate::rules::helper::prefix("PROFILE", "weightiest"));
        assert!(sk.contains(crate::rules::shards::MARK), "{sk}");
        assert!(is_target(&rules[0], &["CUST#c1", sk.as_str()]));
        assert!(is_target(&rules[0], &[String::from("CUST#c1"), sk.clone()]), "owned parts too");
        assert!(!is_target(&rules[0], &["CUST#c1", &sk.replace("weightiest", "heaviest")]), "no such measure");
        assert!(!is_target(&rules[0], &["CUST#c1#_agg#w1", "PROFILE"]), "a sub-item of an unsharded rule");
    }

    #[test]
    fn targets_and_attributes() {
        let rules = rules();
        assert!(is_target(&rules[0], &["CUST#c1", "PROFILE"]));
        assert!(!is_target(&rules[0], &["CUST#c1", "ORDER#x#y"]));
        assert!(is_target(&rules[1], &["SALES#2026-11-30", "TOTAL"]));
        assert!(!is_target(&rules[0], &[crate::registry::KEY, crate::registry::KEY]), "the ledger registry item");
        assert!(owns_attribute(&rules[0], "orders_PAID"));
        assert!(!owns_attribute(&rules[0], "name"));
        assert!(!owns_attribute(&rules[0], "_agg:0001"));
        // A user's attribute that `orders_{status}` could form is not reconcile's, unless the
        // service wrote it or the truth names it; `orderCount` always is.
        let written: std::collections::BTreeSet<String> = ["orders_PAID".to_string()].into();
        assert!(!manages(&rules[0], "orders_note", &written, false));
        assert!(manages(&rules[0], "orders_note", &written, true));
        assert!(manages(&rules[0], "orders_PAID", &written, false));
        assert!(manages(&rules[0], "orderCount", &Default::default(), false));
        assert!(!manages(&rules[0], "name", &written, true));
        let key = target_for(&rules[0], &[("customer".to_string(), "c9".to_string())].into()).unwrap();
        assert_eq!(variables_of(&rules[0], &key).get("customer").map(String::as_str), Some("c9"));
        assert!(target_for(&rules[1], &[("customer".to_string(), "c9".to_string())].into()).is_none(), "daily-sales needs {{date}}");
    }
}
