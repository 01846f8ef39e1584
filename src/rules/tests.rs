//! The delta rules of DESIGN.md section 2, one example each.

use serde_json::{json, Value};

use super::*;
use crate::config::Config;

fn engine(extra_rules: &str) -> Engine {
    let text = format!(
        "source: {{ table: commerce-main }}\nstate: {{ table: state-table }}\naggregates: {{ table: aggs-table }}\nrules:\n{}{extra_rules}",
        r#"  - name: customer-orders
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures:
      orderCount: count
      revenue: { sum: total }
      "orders_{status}": count
      openRevenue: { sum: total, where: { status: { S: [PENDING, PAID] } } }
"#
    );
    Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine
}

fn order(status: &str, total: Value) -> Value {
    json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}, "status": {"S": status}, "total": total})
}

fn record(event: &str, old: Option<Value>, new: Option<Value>) -> Value {
    let mut ddb = json!({"Keys": {"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}}, "SequenceNumber": "100"});
    if let Some(o) = old {
        ddb["OldImage"] = o;
    }
    if let Some(n) = new {
        ddb["NewImage"] = n;
    }
    json!({"eventName": event, "dynamodb": ddb})
}

/// Runs one record; returns "attribute=delta" strings of the single target, sorted.
fn deltas_of(engine: &Engine, rec: &Value) -> Result<Vec<String>, Vec<Poison>> {
    let mut batch = Coalescer::new();
    let report = engine.apply(rec, &mut batch);
    if !report.poisons.is_empty() {
        return Err(report.poisons);
    }
    Ok(batch
        .into_targets()
        .into_iter()
        .flat_map(|(t, d)| d.attributes.into_iter().map(move |(a, v)| format!("{}/{}:{a}={v}", t.0[0], t.0[1])))
        .collect())
}

#[test]
fn status_change_moves_one_count() {
    let e = engine("");
    let rec = record("MODIFY", Some(order("PENDING", json!({"N": "10"}))), Some(order("PAID", json!({"N": "10"}))));
    assert_eq!(deltas_of(&e, &rec).unwrap(), vec!["CUST#c1/PROFILE:orders_PAID=1", "CUST#c1/PROFILE:orders_PENDING=-1"]);
}

#[test]
fn total_change_gives_the_difference() {
    let e = engine("");
    let rec = record("MODIFY", Some(order("PAID", json!({"N": "10"}))), Some(order("PAID", json!({"N": "15"}))));
    assert_eq!(deltas_of(&e, &rec).unwrap(), vec!["CUST#c1/PROFILE:openRevenue=5", "CUST#c1/PROFILE:revenue=5"]);
}

#[test]
fn insert_and_remove_are_opposites() {
    let e = engine("");
    let ins = deltas_of(&e, &record("INSERT", None, Some(order("PENDING", json!({"N": "0.1"}))))).unwrap();
    assert_eq!(
        ins,
        vec![
            "CUST#c1/PROFILE:openRevenue=0.1",
            "CUST#c1/PROFILE:orderCount=1",
            "CUST#c1/PROFILE:orders_PENDING=1",
            "CUST#c1/PROFILE:revenue=0.1"
        ]
    );
    let rem = deltas_of(&e, &record("REMOVE", Some(order("PENDING", json!({"N": "0.1"}))), None)).unwrap();
    assert_eq!(
        rem,
        vec![
            "CUST#c1/PROFILE:openRevenue=-0.1",
            "CUST#c1/PROFILE:orderCount=-1",
            "CUST#c1/PROFILE:orders_PENDING=-1",
            "CUST#c1/PROFILE:revenue=-0.1"
        ]
    );
}

#[test]
fn unchanged_modify_changes_nothing() {
    let e = engine("");
    let img = order("PAID", json!({"N": "10.50"}));
    let spelled = order("PAID", json!({"N": "10.5"}));
    assert_eq!(deltas_of(&e, &record("MODIFY", Some(img), Some(spelled))).unwrap(), Vec::<String>::new());
}

#[test]
fn items_the_source_key_does_not_match_are_ignored() {
    let e = engine("");
    for (pk, sk) in [("CUST#c1#x", "ORDER#d#o"), ("CUST#c1", "ORDER#d"), ("CUST#", "ORDER#d#o"), ("CUST#c1", "ORDER#d#o#extra")] {
        let img = json!({"PK": {"S": pk}, "SK": {"S": sk}, "total": {"N": "1"}});
        let rec = json!({"eventName": "INSERT", "dynamodb": {"Keys": {"PK": {"S": pk}, "SK": {"S": sk}}, "NewImage": img}});
        assert_eq!(deltas_of(&e, &rec).unwrap(), Vec::<String>::new(), "{pk} {sk}");
    }
}

#[test]
fn poison_names_rule_measure_and_attribute() {
    let e = engine("");
    let p = deltas_of(&e, &record("INSERT", None, Some(order("PAID", json!({"S": "10"}))))).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::NonNumericSum);
    assert_eq!(p[0].rule.as_deref(), Some("customer-orders"));
    assert_eq!(p[0].message, "measures.revenue: attribute total is of type S, a sum needs N");
    assert_eq!(p[0].variables.get("customer").map(String::as_str), Some("c1"));
    let p = deltas_of(&e, &record("INSERT", None, Some(order("PAID", json!({"N": "1E+126"}))))).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::OutOfRange);
    let p = deltas_of(&e, &record("INSERT", None, Some(order("PAID", json!({"N": "12abc"}))))).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::NonNumericSum);
    assert!(p[0].message.contains("N value is not a number") && !p[0].message.contains("12abc"), "{}", p[0].message);
}

#[test]
fn attribute_variables_in_keys_cannot_redirect_writes() {
    let e = engine(
        r#"  - name: by-region
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "REGION#{region}", SK: "TOTAL" }
    measures: { orders: count }
"#,
    );
    let with_region = |r: &str| {
        let mut img = order("PAID", json!({"N": "1"}));
        img["region"] = json!({"S": r});
        record("INSERT", None, Some(img))
    };
    let p = deltas_of(&e, &with_region("eu#CUST#victim")).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::KeyDelimiter);
    let p = deltas_of(&e, &with_region("")).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::EmptyKeyPart);
    let p = deltas_of(&e, &record("INSERT", None, Some(order("PAID", json!({"N": "1"}))))).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::MissingVariable, "a target key that cannot be formed is poison");
    let long = "x".repeat(3000);
    let p = deltas_of(&e, &with_region(&long)).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::KeyTooLong);
    // Other rules still apply to a record that poisons one rule.
    let mut batch = Coalescer::new();
    let report = e.apply(&with_region("a#b"), &mut batch);
    assert_eq!(report.poisons.len(), 1);
    assert_eq!(batch.into_targets().len(), 1, "customer-orders applied");
}

#[test]
fn products_and_where_filters() {
    let e = engine(
        r#"  - name: lines
    numeric_strings: true
    source_key: { PK: "INV#{invoice}", SK: "ITEM#{line}" }
    target: { PK: "INV#{invoice}", SK: "HEADER" }
    measures:
      total: { sum: "qty * unitPrice" }
      big: { count: true, where: { unitPrice: { N: [{ numeric: [">", 1000] }] } } }
"#,
    );
    let line = |qty: &str, price: &str| json!({"PK": {"S": "INV#i1"}, "SK": {"S": "ITEM#1"}, "qty": {"N": qty}, "unitPrice": {"N": price}});
    let rec = json!({"eventName": "MODIFY", "dynamodb": {"Keys": {}, "OldImage": line("2", "0.10"), "NewImage": line("3", "1000.01")}});
    assert_eq!(deltas_of(&e, &rec).unwrap(), vec!["INV#i1/HEADER:big=1", "INV#i1/HEADER:total=2999.83"]);
    let huge = json!({"eventName": "INSERT", "dynamodb": {"Keys": {}, "NewImage": line("1E+100", "1E+100")}});
    assert_eq!(deltas_of(&e, &huge).unwrap_err()[0].code, PoisonCode::OutOfRange);
}

#[test]
fn malformed_records_are_poison_without_a_rule() {
    let e = engine("");
    let p = deltas_of(&e, &json!({"eventName": "INSERT", "dynamodb": {"Keys": {}}})).unwrap_err();
    assert_eq!(p[0].code, PoisonCode::MalformedRecord);
    assert_eq!(p[0].rule, None);
    assert_eq!(p[0].to_string(), "malformed_record: an INSERT record has no NewImage (the stream must be NEW_AND_OLD_IMAGES)");
}

/// `avg` keeps its sum and the count of images holding the attribute: an update moves both,
/// a total removed from an order leaves its count, a delete takes both away.
#[test]
fn avg_moves_its_sum_and_count_through_updates_and_deletes() {
    let e = engine(
        r#"  - name: averages
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "AVG#{customer}", SK: "PROFILE" }
    measures:
      avgOrder: { avg: total }
      avgPaid: { avg: total, where: { status: { S: [PAID] } } }
"#,
    );
    let avg = |rec: &Value| -> Vec<String> { deltas_of(&e, rec).unwrap().into_iter().filter(|d| d.starts_with("AVG#")).collect() };
    let insert = record("INSERT", None, Some(order("PAID", json!({"N": "10.5"}))));
    assert_eq!(
        avg(&insert),
        [
            "AVG#c1/PROFILE:avgOrder_count=1",
            "AVG#c1/PROFILE:avgOrder_sum=10.5",
            "AVG#c1/PROFILE:avgPaid_count=1",
            "AVG#c1/PROFILE:avgPaid_sum=10.5"
        ]
    );
    let change = record("MODIFY", Some(order("PAID", json!({"N": "10.5"}))), Some(order("PENDING", json!({"N": "12"}))));
    assert_eq!(
        avg(&change),
        ["AVG#c1/PROFILE:avgOrder_sum=1.5", "AVG#c1/PROFILE:avgPaid_count=-1", "AVG#c1/PROFILE:avgPaid_sum=-10.5"],
        "the count of all orders stays, the paid one leaves"
    );
    let mut no_total = order("PENDING", json!(null));
    no_total.as_object_mut().unwrap().remove("total");
    let dropped = record("MODIFY", Some(order("PENDING", json!({"N": "12"}))), Some(no_total.clone()));
    assert_eq!(
        avg(&dropped),
        ["AVG#c1/PROFILE:avgOrder_count=-1", "AVG#c1/PROFILE:avgOrder_sum=-12"],
        "an order without a total leaves the average"
    );
    assert!(avg(&record("INSERT", None, Some(no_total))).is_empty());
    let bad = record("INSERT", None, Some(order("PAID", json!({"S": "ten"}))));
    assert_eq!(deltas_of(&e, &bad).unwrap_err()[0].code, PoisonCode::NonNumericSum, "a total that is not a number is poison, as for sum");
}

/// `ttl_deletes: ignore`: a REMOVE by DynamoDB's TTL service changes nothing for that rule (the
/// other rules subtract it); a user's delete still subtracts.
#[test]
fn a_ttl_delete_changes_nothing_under_ignore() {
    let e = engine(
        r#"  - name: orders-ever
    ttl_deletes: ignore
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "EVER#{customer}", SK: "PROFILE" }
    measures: { ordersEver: count }
"#,
    );
    let mut ttl = record("REMOVE", Some(order("PAID", json!({"N": "10"}))), None);
    ttl["userIdentity"] = json!({"type": "Service", "principalId": "dynamodb.amazonaws.com"});
    let got = deltas_of(&e, &ttl).unwrap();
    assert!(!got.iter().any(|d| d.starts_with("EVER#")), "{got:?}");
    assert!(got.contains(&"CUST#c1/PROFILE:orderCount=-1".to_string()), "the default rule counts the TTL delete: {got:?}");
    let user = record("REMOVE", Some(order("PAID", json!({"N": "10"}))), None);
    assert!(deltas_of(&e, &user).unwrap().contains(&"EVER#c1/PROFILE:ordersEver=-1".to_string()));
}

#[test]
fn the_ledger_registry_item_is_never_a_source_nor_a_target() {
    // A rule whose source key and target the registry's key could both be.
    let e = engine(
        r##"  - name: anything
    source_key: { PK: "#{a}#{b}", SK: "{c}#{d}#{f}" }
    target: { PK: "#{c}#{d}", SK: "T" }
    measures: { n: count }
"##,
    );
    let key = json!({"PK": {"S": crate::registry::KEY}, "SK": {"S": crate::registry::KEY}});
    let rec = json!({"eventName": "INSERT", "dynamodb": {"Keys": key.clone(), "NewImage": key, "SequenceNumber": "1"}});
    let mut batch = Coalescer::new();
    let report = e.apply(&rec, &mut batch);
    assert!(report.matched.is_empty() && report.poisons.is_empty(), "{report:?}");
    assert!(batch.into_targets().is_empty(), "its stream records are not evaluated");
    let item = json!({"PK": {"S": "#x#y"}, "SK": {"S": "_agg#registry#z"}});
    let rec = json!({"eventName": "INSERT", "dynamodb": {"Keys": item.clone(), "NewImage": item, "SequenceNumber": "2"}});
    let poisons = deltas_of(&e, &rec).expect_err("a target expanding to the registry's key");
    assert_eq!(poisons[0].code, PoisonCode::ReservedAttribute, "{poisons:?}");
}

#[test]
fn each_contribution_names_its_item_and_what_the_item_contributes_after_the_record() {
    let e = engine("");
    // PENDING 10 -> PAID 12: the item contributes its new image, whichever attributes moved.
    let rec = record("MODIFY", Some(order("PENDING", json!({"N": "10"}))), Some(order("PAID", json!({"N": "12"}))));
    let mut batch = Coalescer::new();
    assert!(engine_apply_ok(&e, &rec, &mut batch));
    let targets = batch.into_targets();
    let c = &targets[0].1.contributions[0];
    let keys = json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}});
    assert_eq!(c.item, Some(item::item_id("customer-orders", keys.as_object().unwrap())));
    let after: Vec<String> = c.after_values().iter().map(|(n, v)| format!("{n}={v}")).collect();
    assert_eq!(after, ["orderCount=1", "revenue=12", "orders_PAID=1", "openRevenue=12"]);
    // A delete: the item contributes nothing after it.
    let mut batch = Coalescer::new();
    assert!(engine_apply_ok(&e, &record("REMOVE", Some(order("PAID", json!({"N": "12"}))), None), &mut batch));
    let targets = batch.into_targets();
    assert!(targets[0].1.contributions[0].after_values().is_empty());
    assert_eq!(targets[0].1.attributes["revenue"].to_string(), "-12");
}

fn engine_apply_ok(e: &Engine, rec: &Value, batch: &mut Coalescer) -> bool {
    e.apply(rec, batch).poisons.is_empty()
}
