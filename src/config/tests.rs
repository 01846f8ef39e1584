use super::*;
use crate::rules::helper::Derive;
use crate::rules::ValueOf;

const DEMO: &str = include_str!("../../config/commerce.yaml");

fn load(text: &str) -> Result<Config, ConfigError> {
    Config::from_yaml(text, Vec::<(String, String)>::new())
}

fn load_err(text: &str) -> String {
    load(text).unwrap_err().to_string()
}

/// The demo config with one line replaced.
fn demo_with(from: &str, to: &str) -> String {
    assert!(DEMO.contains(from), "{from}");
    DEMO.replacen(from, to, 1)
}

#[test]
fn demo_config_is_valid() {
    let c = load(DEMO).unwrap();
    assert_eq!(c.source.table, "commerce-main");
    assert_eq!(c.source.batch_size, 1000);
    assert_eq!(c.state.lease_duration, Duration::from_secs(10));
    assert_eq!(c.reconcile_interval, Some(Duration::from_secs(3600)));
    assert_eq!(c.engine.rules.len(), 2);
    assert_eq!(c.engine.key_names, vec!["PK", "SK"]);
    assert_eq!(c.target_variables().into_iter().collect::<Vec<_>>(), vec!["customer", "date"]);
    assert_eq!(c.dead_letter.as_ref().unwrap().max_attempts, 5);
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
    assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
    assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
    for bad in ["10", "s", "1.5s", "-1s", "10 sec", "", "99999999999999999999d"] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
}

#[test]
fn environment_overrides() {
    let env = vec![
        ("DDB_AGGREGATOR__SOURCE__TABLE".to_string(), "other-table".to_string()),
        ("DDB_AGGREGATOR__SOURCE__BATCH_SIZE".to_string(), "50".to_string()),
        ("DDB_AGGREGATOR__RULES__1__NAME".to_string(), "daily".to_string()),
        ("DDB_AGGREGATOR__AGGREGATES__TABLE".to_string(), "aggs".to_string()),
        ("UNRELATED".to_string(), "x".to_string()),
    ];
    let c = Config::from_yaml(DEMO, env).unwrap();
    assert_eq!(c.source.table, "other-table");
    assert_eq!(c.source.batch_size, 50);
    assert_eq!(&*c.engine.rules[1].name, "daily");
    assert_eq!(c.aggregates_table, "aggs");
    let bad = Config::from_yaml(DEMO, vec![("DDB_AGGREGATOR__SOURCE__TABEL".to_string(), "x".to_string())]).unwrap_err().to_string();
    assert!(bad.contains("unknown field `tabel`") && bad.contains("DDB_AGGREGATOR__SOURCE__TABEL"), "{bad}");
    let bad = Config::from_yaml(DEMO, vec![("DDB_AGGREGATOR__RULES__9__NAME".to_string(), "x".to_string())]).unwrap_err().to_string();
    assert!(bad.contains("past the end"), "{bad}");
}

#[test]
fn errors_name_the_path() {
    let cases: &[(&str, &str, &str)] = &[
        ("  batch_size: 1000", "  batch_size: 10001", "source.batch_size: 10001"),
        ("  batch_size: 1000", "  batch_size: 100\n  bogus: 1", "unknown field `bogus`"),
        ("  lease_duration: 10s", "  lease_duration: 10", "state.lease_duration: duration \"10\" needs a unit"),
        ("  interval: 1h", "  interval: 1 hour", "reconcile.interval"),
        ("  listen: 0.0.0.0:9464", "  listen: nowhere", "metrics.listen"),
        (
            "  table: commerce-main\ndead_letter",
            "  table: commerce-main\n  ledger_namespace: \"a:b\"\ndead_letter",
            "aggregates.ledger_namespace: \"a:b\": use 1 to 16",
        ),
        ("  start_position: trim_horizon", "  start_position: earliest", "source.start_position"),
        ("      revenue: { sum: total }", "      revenue: { sum: \"\" }", "rules[0].measures.revenue.sum"),
        ("      revenue: { sum: total }", "      revenue: { summ: total }", "rules[0].measures.revenue.summ: unknown key"),
        (
            "      revenue: { sum: total }",
            "      revenue: { sum: total, count: true }",
            "rules[0].measures.revenue: exactly one of count or sum",
        ),
        ("      revenue: { sum: total }", "      revenue: sum", "rules[0].measures.revenue: use count"),
        ("      orderCount: count", "      \"PK\": count", "rules[0].measures.PK: attribute name may not be"),
        ("      orderCount: count", "      \"a.b\": count", "rules[0].measures.a.b: measures are top-level"),
        ("      orderCount: count", "      \"_agg_x\": count", "or start with \"_agg\""),
        (
            "          SK: { S: [{ prefix: \"ORDER#\" }] }",
            "          SK: { S: [{ prefix: 5 }] }",
            "rules[0].filter.dynamodb.Keys.SK.S[0].prefix: prefix match pattern must be a string",
        ),
        (
            "where: { status: { S: [PENDING, PAID] } } }\n      openOrders",
            "where: { status: { S: [] } } }\n      openOrders",
            "rules[0].measures.openRevenue.where.status.S: empty arrays",
        ),
        (
            "      PK: \"CUST#{customer}\"\n      SK: \"ORDER#{date}#{order_id}\"",
            "      PK: \"CUST#{customer\"\n      SK: \"ORDER#{date}#{order_id}\"",
            "rules[0].source_key.PK: unclosed",
        ),
        (
            "      SK: \"ORDER#{date}#{order_id}\"",
            "      SK: \"ORDER#{date}{order_id}\"",
            "rules[0].source_key.SK: capture {date} must be followed by '#'",
        ),
        (
            "    target: { PK: \"SALES#{date|day}\", SK: \"TOTAL\" }",
            "    target: { PK: \"SALES#{date|week}\", SK: \"TOTAL\" }",
            "rules[1].target.PK: unknown template function",
        ),
        (
            "    target: { PK: \"SALES#{date|day}\", SK: \"TOTAL\" }",
            "    target: { PK: \"SALES#{date|day}\" }",
            "rules[1].target: every rule writes to the same table",
        ),
        ("  - name: daily-sales", "  - name: customer-orders", "rules[1].name: \"customer-orders\" is used by an earlier rule"),
        ("  - name: daily-sales", "  - name: daily sales", "rules[1].name"),
        ("  table: ddb-aggregator-state", "  table: commerce-main", "state.table: must be a table of its own"),
        ("  table: ddb-aggregator-state", "  table: x", "state.table: \"x\" is not a DynamoDB table name"),
        ("  queue_url: http://localhost:9324/000000000000/ddb-aggregator-dlq", "  queue_url: ddb-aggregator-dlq", "dead_letter.queue_url"),
        (
            "      query: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }",
            "      query: { PK: \"CUST#{order_id}\" }",
            "rules[0].reconcile.query: {order_id} must be captured by source_key and used in target",
        ),
        (
            "      query: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }",
            "      query: { GSI1PK: \"x\" }",
            "rules[0].reconcile.query.GSI1PK: unknown key",
        ),
        (
            "    target: { PK: \"CUST#{customer}\", SK: \"PROFILE\" }",
            "    target: { PK: \"CUST#{customer}\", SK: \"ORDER#{date}#total\" }",
            "rules[0].target: items written by rule \"customer-orders\" could match rule \"customer-orders\"",
        ),
    ];
    for (from, to, expected) in cases {
        let e = load_err(&demo_with(from, to));
        assert!(e.contains(expected), "{to:?}\n  expected: {expected}\n  got: {e}");
    }
    assert!(load_err("").contains("empty"));
    assert!(load_err("source: [").contains("not valid YAML"), "{}", load_err("source: ["));
    assert!(load_err(&DEMO.replace("rules:", "rules: []\nx:")).contains("unknown field `x`"));
}

#[test]
fn a_separate_aggregates_table_cannot_loop() {
    let looping = demo_with(
        "    target: { PK: \"CUST#{customer}\", SK: \"PROFILE\" }",
        "    target: { PK: \"CUST#{customer}\", SK: \"ORDER#{date}#total\" }",
    );
    assert!(load(&looping).is_err());
    let separate = looping.replacen("aggregates:\n  table: commerce-main", "aggregates:\n  table: commerce-aggregates", 1);
    assert!(load(&separate).is_ok());
}

#[test]
fn loop_check_asks_the_filter() {
    // The target could match the source key, but the filter only accepts INSERTs of items
    // with a `kind` attribute that aggregate items never have.
    let text = demo_with(
        "    target: { PK: \"CUST#{customer}\", SK: \"PROFILE\" }",
        "    target: { PK: \"CUST#{customer}\", SK: \"ORDER#{date}#total\" }",
    )
    .replacen(
        "    filter:\n      dynamodb:\n        Keys:\n          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "    filter:\n      dynamodb:\n        NewImage:\n          kind: { S: [order] }",
        1,
    )
    .replacen(
        "filter: { dynamodb: { Keys: { SK: { S: [{ prefix: \"ORDER#\" }] } } } }",
        "filter: { dynamodb: { NewImage: { kind: { S: [order] } } } }",
        1,
    );
    // Without the copy rule, whose `to` (SK_begins_with: ORDER#) would find these targets.
    let text = &text[..text.find("  - name: customer-name-on-orders").unwrap()];
    load(text).unwrap();
}

#[test]
fn shipped_example_configs_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 1);
}

#[test]
fn filters_on_stream_only_fields_are_found() {
    use serde_json::json;
    let f = |v| super::stream_only_fields(&v);
    assert!(f(json!({"dynamodb": {"Keys": {"SK": {"S": [{"prefix": "ORDER#"}]}}, "NewImage": {"status": {"S": ["PAID"]}}}})).is_empty());
    assert!(f(json!({"eventName": ["INSERT", "MODIFY", "REMOVE"], "eventSource": ["aws:dynamodb"]})).is_empty(), "every record");
    assert_eq!(f(json!({"eventName": ["INSERT"]})), ["eventName"]);
    assert_eq!(f(json!({"userIdentity": {"type": ["Service"]}})), ["userIdentity"]);
    assert_eq!(f(json!({"dynamodb": {"OldImage": {"status": {"S": ["PAID"]}}}})), ["dynamodb.OldImage"]);
    assert_eq!(f(json!({"$or": [{"eventName": ["REMOVE"]}, {"dynamodb": {"Keys": {}}}]})), ["eventName"]);
    assert_eq!(f(json!({"dynamodb": {"$or": [{"Keys": {}}, {"OldImage": {}}]}})), ["dynamodb.OldImage"]);
    assert_eq!(
        f(json!([{"dynamodb": {"Keys": {}}}, {"eventName": ["MODIFY"], "dynamodb": {"SizeBytes": [{"numeric": [">", 5]}]}}])),
        ["dynamodb.SizeBytes", "eventName"]
    );
}

/// Two rules that may add to one attribute of one item are refused: reconcile recomputes each
/// rule alone and would set the attribute to each rule's truth in turn.
#[test]
fn two_rules_cannot_write_one_attribute_of_one_item() {
    let second = |target: &str, measures: &str| {
        format!(
            "{DEMO}  - name: returns\n    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [{{ prefix: \"RETURN#\" }}] }} }} }} }}\n    source_key: {{ PK: \"CUST#{{customer}}\", SK: \"RETURN#{{date}}#{{order_id}}\" }}\n    target: {target}\n    measures: {measures}\n    reconcile: {{ scan: true }}\n"
        )
    };
    let same = r#"{ PK: "CUST#{customer}", SK: "PROFILE" }"#;
    for (target, measures, refused) in [
        (same, "{ orderCount: count }", true),
        (same, r#"{ "orders_{kind}": count }"#, true),
        (same, "{ orders_total: count }", true),
        (same, r#"{ "returns_{kind}": count, returnCount: count }"#, false),
        (r#"{ PK: "CUST#{customer}", SK: "RETURNS" }"#, "{ orderCount: count }", false),
        (r#"{ PK: "RET#{customer}", SK: "PROFILE" }"#, "{ orderCount: count }", false),
        (r#"{ PK: "SALES#{date|month}", SK: "TOTAL" }"#, "{ orders: count, revenue: { sum: total } }", false),
        (r#"{ PK: "SALES#{date|day}", SK: "TOTAL" }"#, "{ orders: count }", true),
    ] {
        let text = second(target, measures);
        match load(&text) {
            Err(e) if refused => assert!(e.to_string().contains("and \"returns\" may both write"), "{e}"),
            Err(e) => panic!("{target} {measures}: {e}"),
            Ok(_) => assert!(!refused, "{target} {measures} was accepted"),
        }
    }
}

#[test]
fn aws_timeouts_and_retries() {
    assert_eq!(load(DEMO).unwrap().aws, super::AwsSettings::default());
    let with = |section: &str| format!("{DEMO}aws: {section}\n");
    let c =
        load(&with("{ connect_timeout: 1s, read_timeout: 5s, operation_timeout: 30s, max_attempts: 5, retry_mode: adaptive }")).unwrap();
    assert_eq!(
        c.aws,
        super::AwsSettings {
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(30),
            max_attempts: 5,
            adaptive_retries: true,
        }
    );
    for (section, path) in [
        ("{ read_timeout: 0s }", "aws.read_timeout"),
        ("{ connect_timeout: soon }", "aws.connect_timeout"),
        ("{ max_attempts: 0 }", "aws.max_attempts"),
        ("{ max_attempts: 21 }", "aws.max_attempts"),
        ("{ retry_mode: fast }", "aws.retry_mode"),
        ("{ timeout: 1s }", "unknown field `timeout`"),
    ] {
        let e = load_err(&with(section));
        assert!(e.contains(path), "{section}: {e}");
    }
}

/// `avg: ATTR` is kept as `<name>_sum` and `<name>_count`, both under the measure's `where`;
/// the count counts images that hold the attribute.
#[test]
fn avg_is_a_sum_and_a_count_of_the_attribute() {
    let text = demo_with(
        "      orderCount: count\n",
        "      orderCount: count\n      avgOrder: { avg: total, where: { status: { S: [PAID] } } }\n",
    );
    let c = load(&text).unwrap();
    let m: Vec<(String, &MeasureKind, bool)> =
        c.engine.rules[0].measures.iter().map(|m| (m.name.to_string(), &m.kind, m.filter.is_some())).collect();
    assert!(m.contains(&("avgOrder_sum".into(), &MeasureKind::Sum("total".into()), true)), "{m:?}");
    assert!(m.contains(&("avgOrder_count".into(), &MeasureKind::CountOf("total".into()), true)), "{m:?}");
    assert!(!m.iter().any(|(n, _, _)| n == "avgOrder"), "no attribute of the bare name");
    for (spec, why) in [
        ("{ avg: \"qty * price\" }", "measures.avgOrder.avg: must be an attribute name"),
        ("{ avg: 5 }", "measures.avgOrder.avg: must be an attribute name"),
        ("{ avg: total, sum: total }", "measures.avgOrder.sum: unknown key"),
    ] {
        let e = load_err(&demo_with("      orderCount: count\n", &format!("      orderCount: count\n      avgOrder: {spec}\n")));
        assert!(e.contains(why), "{spec}: {e}");
    }
    let clash =
        demo_with("      orderCount: count\n", "      orderCount: count\n      avgOrder: { avg: total }\n      avgOrder_sum: count\n");
    assert!(load_err(&clash).contains("avgOrder_sum"), "a measure may not repeat a half of an avg");
    let templated =
        demo_with("      orderCount: count\n", "      orderCount: count\n      avg_{status}: { avg: total }\n      avg_PAID_sum: count\n");
    assert!(load_err(&templated).contains("can name the same attribute"), "avg_{{status}}_sum can be avg_PAID_sum");
    let key = demo_with("      orderCount: count\n", "      orderCount: count\n      X: { avg: total }\n");
    let key = key.replace("\", SK: \"PROFILE\"", "\", X_sum: \"PROFILE\"").replace("\", SK: \"TOTAL\"", "\", X_sum: \"TOTAL\"");
    assert!(load_err(&key).contains("X_sum is a key attribute"), "{}", load_err(&key));
}

#[test]
fn ttl_deletes_count_by_default_and_can_be_ignored() {
    let c = load(DEMO).unwrap();
    assert!(c.engine.rules.iter().all(|r| r.ttl_deletes == TtlDeletes::Count));
    let at = "    reconcile:\n      query: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n";
    let ignore = demo_with(at, &format!("{at}    ttl_deletes: ignore\n"));
    assert_eq!(load(&ignore).unwrap().engine.rules[0].ttl_deletes, TtlDeletes::Ignore);
    let e = load_err(&demo_with(at, &format!("{at}    ttl_deletes: skip\n")));
    assert!(e.starts_with("rules[0].ttl_deletes: \"skip\": give count"), "{e}");
}

/// max, min, latest (with by) and distinct: what each takes, and a table with a sort key.
#[test]
fn helper_measures_take_an_attribute_or_a_template_and_need_a_sort_key() {
    let with = |spec: &str| demo_with("      orderCount: count\n", &format!("      orderCount: count\n      m: {spec}\n"));
    let c = load(&with("{ latest: status, by: updatedAt, where: { status: { S: [PAID] } } }")).unwrap();
    let m = c.engine.rules[0].measures.iter().find(|m| m.name.text() == "m").unwrap();
    assert!(
        matches!(&m.kind, MeasureKind::Helper(h) if h.derive == Derive::Latest && h.by.as_deref() == Some("updatedAt") && h.value == ValueOf::Attribute("status".into()))
    );
    assert!(m.filter.is_some());
    let c = load(&with("{ distinct: \"{date|day}\" }")).unwrap();
    let m = c.engine.rules[0].measures.iter().find(|m| m.name.text() == "m").unwrap();
    assert!(matches!(&m.kind, MeasureKind::Helper(h) if h.derive == Derive::Distinct && matches!(h.value, ValueOf::Template(_))));
    for (spec, why) in [
        ("{ latest: status }", "measures.m: latest needs by"),
        ("{ latest: status, by: 5 }", "measures.m.by: must be an attribute name"),
        ("{ max: total, by: updatedAt }", "measures.m.by: unknown key; max takes an attribute or a template"),
        ("{ max: \"a b\" }", "measures.m.max: give an attribute name"),
        ("{ min: [total] }", "measures.m.min: give an attribute name"),
    ] {
        let e = load_err(&with(spec));
        assert!(e.contains(why), "{spec}: {e}");
    }
    let hash = demo_with("      orderCount: count\n", "      orderCount: count\n      \"m#x\": { max: total }\n");
    assert!(load_err(&hash).contains("may not hold '#'"), "{}", load_err(&hash));
    let no_sort_key = r#"
source: { table: orders }
state: { table: state }
aggregates: { table: aggregates }
rules:
  - name: r
    source_key: { PK: "CUST#{customer}" }
    target: { PK: "CUST#{customer}" }
    measures: { largest: { max: total } }
"#;
    let e = load_err(no_sort_key);
    assert!(e.contains("rules[0].measures.largest: max keeps helper items") && e.contains("needs a sort key"), "{e}");
}

#[test]
fn a_namespace_set_in_the_file_or_the_environment_is_explicit() {
    let c = Config::from_yaml(DEMO, Vec::new()).unwrap();
    assert!(!c.ledger_namespace_explicit, "derived from the state table");
    let env = |v: &str| vec![("DDB_AGGREGATOR__AGGREGATES__LEDGER_NAMESPACE".to_string(), v.to_string())];
    let c = Config::from_yaml(DEMO, env("blue")).unwrap();
    assert_eq!((c.ledger_namespace.as_str(), c.ledger_namespace_explicit), ("blue", true));
    let c = Config::from_yaml(DEMO, env("\"123456\"")).unwrap();
    assert_eq!(c.ledger_namespace, "123456", "quoted: the text as written");
    for number in ["123456", "-12345"] {
        let bad = Config::from_yaml(DEMO, env(number)).unwrap_err().to_string();
        assert!(bad.contains("aggregates.ledger_namespace") && bad.contains("write it in quotes"), "{bad}");
    }
}

#[test]
fn the_empty_page_rule_is_explicit_and_checked() {
    assert_eq!(load(DEMO).unwrap().tip_evidence, TipEvidence { empty_pages: 3, over: Duration::from_secs(2) });
    let with = |rule: &str| demo_with("  interval: 1h\n", &format!("  interval: 1h\n  tip_evidence: {rule}\n"));
    assert_eq!(
        load(&with("{ empty_pages: 5, over: 10s }")).unwrap().tip_evidence,
        TipEvidence { empty_pages: 5, over: Duration::from_secs(10) }
    );
    assert_eq!(
        load(&with("{ over: 500ms }")).unwrap().tip_evidence,
        TipEvidence { empty_pages: 3, over: Duration::from_millis(500) },
        "a field left out keeps its default"
    );
    let env = vec![("DDB_AGGREGATOR__RECONCILE__TIP_EVIDENCE__EMPTY_PAGES".to_string(), "4".to_string())];
    assert_eq!(Config::from_yaml(DEMO, env).unwrap().tip_evidence.empty_pages, 4, "the environment sets it too");
    for (rule, path, why) in [
        ("{ empty_pages: 1 }", "reconcile.tip_evidence.empty_pages: \"1\": use 2 to 100", "one page is no run"),
        ("{ empty_pages: 0 }", "reconcile.tip_evidence.empty_pages: \"0\"", "none"),
        ("{ empty_pages: 101 }", "reconcile.tip_evidence.empty_pages: \"101\"", "too many"),
        ("{ empty_pages: three }", "reconcile.tip_evidence.empty_pages: \"three\"", "not a number"),
        ("{ empty_pages: -3 }", "reconcile.tip_evidence.empty_pages: \"-3\"", "negative"),
        ("{ over: 2 }", "reconcile.tip_evidence.over: duration \"2\" needs a unit", "no unit"),
        ("{ over: 61s }", "reconcile.tip_evidence.over: at most 60s", "too long"),
        ("{ pages: 3 }", "unknown field `pages`", "a misspelt field"),
    ] {
        let e = load_err(&with(rule));
        assert!(e.contains(path), "{why}: {rule}: {e}");
    }
    let short_wait = demo_with("  interval: 1h\n", "  interval: 1h\n  wait: 5s\n  tip_evidence: { over: 5s }\n");
    assert!(
        load_err(&short_wait).contains("reconcile.tip_evidence.over: must be shorter than reconcile.wait"),
        "{}",
        load_err(&short_wait)
    );
}

#[test]
fn leftovers_of_a_rule_change_are_removed_after_the_replay_window_unless_told_otherwise() {
    assert_eq!(load(DEMO).unwrap().remove_leftovers_after, Duration::from_secs(25 * 3600), "past the stream's 24 h retention");
    let with = |v: &str| demo_with("  interval: 1h\n", &format!("  interval: 1h\n  remove_leftovers_after: {v}\n"));
    assert_eq!(load(&with("48h")).unwrap().remove_leftovers_after, Duration::from_secs(48 * 3600));
    let env = vec![("DDB_AGGREGATOR__RECONCILE__REMOVE_LEFTOVERS_AFTER".to_string(), "30s".to_string())];
    assert_eq!(Config::from_yaml(DEMO, env).unwrap().remove_leftovers_after, Duration::from_secs(30), "the environment sets it too");
    for (v, want) in [
        ("0s", "reconcile.remove_leftovers_after: 0s: use a duration past the stream's 24 h retention"),
        ("25", "reconcile.remove_leftovers_after: duration \"25\" needs a unit"),
        ("soon", "reconcile.remove_leftovers_after"),
    ] {
        let e = load_err(&with(v));
        assert!(e.contains(want), "{v}: {e}");
    }
}

#[test]
fn helper_items_are_loop_checked_like_targets() {
    // Aggregates in the source table, and a second rule whose source_key has the shape of the
    // first rule's helper items (`PROFILE#_agg#largestOrder#<value>`), not of its targets.
    let text = include_str!("../../config/commerce-measures.yaml").replace("aggregates:\n  table: commerce-aggregates\n", "aggregates:\n");
    let events = "  - name: events\n    source_key: { PK: \"CUST#{customer}\", SK: \"{kind}#{a}#{b}#{c}\" }\n    target: { PK: \"EVENTS#{kind}\", SK: \"TOTAL\" }\n    measures: { events: count }\n    reconcile: { scan: true }\n";
    let looping = format!("{text}{events}");
    let e = load_err(&looping);
    assert!(
        e.contains("helper items (of max, min, latest, distinct) written by rule \"customer-orders\" could match rule \"events\""),
        "{e}"
    );
    let filtered = looping
        .replace("  - name: events\n", "  - name: events\n    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: \"EVENT#\" }] } } } }\n");
    load(&filtered).unwrap_or_else(|e| panic!("a filter that helper keys fail keeps it apart: {e}"));
}

#[test]
fn a_numeric_operator_on_n_without_numeric_strings_is_warned_with_its_path() {
    let big = "      openOrders: { count: true, where: { status: { S: [PENDING, PAID] } } }";
    let text =
        demo_with(big, &format!("{big}\n      bigOrders: {{ count: true, where: {{ total: {{ N: [{{ numeric: [\">\", 500] }}] }} }} }}"));
    let c = load(&text).unwrap();
    assert_eq!(c.pattern_warnings.len(), 1, "{:?}", c.pattern_warnings);
    let w = &c.pattern_warnings[0];
    assert!(w.starts_with("rules[0].measures.bigOrders.where.total.N[0].numeric never matches"), "{w}");
    assert!(w.contains("a numeric operator sees no number"), "{w}");
    assert!(w.contains("set numeric_strings: true"), "{w}");
    assert!(load(DEMO).unwrap().pattern_warnings.is_empty());
    // With numeric_strings the operator compares N values numerically: nothing to warn about.
    let fixed = text.replacen("  - name: customer-orders\n", "  - name: customer-orders\n    numeric_strings: true\n", 1);
    assert!(fixed.contains("numeric_strings: true"));
    assert!(load(&fixed).unwrap().pattern_warnings.is_empty());
    // In a filter, and on a NS leaf, likewise; on an S leaf or a plain number it is not about N.
    let filter = demo_with("SK: { S: [{ prefix: \"ORDER#\" }] }", "SK: { S: [{ prefix: \"ORDER#\" }] }\n        NewImage: { qty: { NS: [{ numeric: [\">\", 1] }] }, n: { S: [{ numeric: [\">\", 1] }] } }");
    let warnings = load(&filter).unwrap().pattern_warnings;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with("rules[0].filter.dynamodb.NewImage.qty.NS[0].numeric never matches"), "{}", warnings[0]);
    // A dotted key, a number literal and anything-but numbers under N: each never matches.
    let forms = demo_with(
        "SK: { S: [{ prefix: \"ORDER#\" }] }",
        "SK: { S: [{ prefix: \"ORDER#\" }] }\n        \"NewImage.total.N\": [{ numeric: [\">\", 0] }]\n        NewImage: { qty: { N: [500, \"7\", { anything-but: [0] }] } }",
    );
    let warnings = load(&forms).unwrap().pattern_warnings;
    let paths: Vec<&str> = warnings.iter().map(|w| w.split(' ').next().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "rules[0].filter.dynamodb.NewImage.qty.N[0]",
            "rules[0].filter.dynamodb.NewImage.qty.N[2].anything-but",
            "rules[0].filter.dynamodb.NewImage.total.N[0].numeric"
        ],
        "{warnings:?}"
    );
    assert!(warnings[0].contains("a number never equals an N value"), "{}", warnings[0]);
}

#[test]
fn write_concurrency_defaults_takes_1_to_256_and_needs_no_aggregates_table() {
    assert_eq!(load(DEMO).unwrap().write_concurrency, DEFAULT_WRITE_CONCURRENCY);
    let only_cap = demo_with("aggregates:\n  table: commerce-main\n", "aggregates:\n  write_concurrency: 8\n");
    let c = load(&only_cap).unwrap();
    assert_eq!((c.write_concurrency, c.aggregates_table.as_str()), (8, "commerce-main"), "the aggregates table defaults to the source");
    let env = vec![("DDB_AGGREGATOR__AGGREGATES__WRITE_CONCURRENCY".to_string(), "256".to_string())];
    assert_eq!(Config::from_yaml(DEMO, env).unwrap().write_concurrency, 256);
    for bad in ["0", "257"] {
        let text = demo_with(
            "aggregates:\n  table: commerce-main\n",
            &format!("aggregates:\n  table: commerce-main\n  write_concurrency: {bad}\n"),
        );
        assert_eq!(load_err(&text), format!("aggregates.write_concurrency: {bad}: use 1 to 256"));
    }
}

#[test]
fn partition_write_rate_defaults_to_800_and_takes_0_to_100000() {
    assert_eq!(load(DEMO).unwrap().partition_write_rate, 800);
    let set = |v: &str| {
        demo_with("aggregates:\n  table: commerce-main\n", &format!("aggregates:\n  table: commerce-main\n  partition_write_rate: {v}\n"))
    };
    assert_eq!(load(&set("0")).unwrap().partition_write_rate, 0, "0 turns pacing off");
    assert_eq!(load(&set("100000")).unwrap().partition_write_rate, 100_000);
    assert_eq!(load_err(&set("100001")), "aggregates.partition_write_rate: 100001: use 0 (no pacing) to 100000 WCU per second");
    assert!(load_err(&set("-1")).contains("aggregates.partition_write_rate"), "a negative rate names its key");
    let env = vec![("DDB_AGGREGATOR__AGGREGATES__PARTITION_WRITE_RATE".to_string(), "2400".to_string())];
    assert_eq!(Config::from_yaml(DEMO, env).unwrap().partition_write_rate, 2400);
}

const DAILY_TARGET: &str = r#"target: { PK: "SALES#{date|day}", SK: "TOTAL" }"#;

fn sharded(n: &str) -> String {
    demo_with(DAILY_TARGET, &format!(r#"target: {{ PK: "SALES#{{date|day}}", SK: "TOTAL", write_shards: {n} }}"#))
}

#[test]
fn write_shards_takes_2_to_100_and_is_part_of_the_definition() {
    let c = load(&sharded("16")).unwrap();
    let daily = &c.engine.rules[1];
    assert_eq!(daily.write_shards, Some(16));
    assert_eq!(c.engine.key_names, vec!["PK", "SK"], "write_shards is not a key attribute");
    assert_eq!(c.engine.rules[0].write_shards, None);
    let plain = load(DEMO).unwrap();
    assert_eq!(c.engine.rules[0].fingerprint, plain.engine.rules[0].fingerprint, "other rules keep their fingerprints");
    assert_ne!(daily.fingerprint, plain.engine.rules[1].fingerprint, "a change of write_shards is a change of the rule");
    assert!(
        daily.definition.contains(r#""write_shards":16"#) && daily.definition.contains(crate::rules::shards::MAPPING),
        "{}",
        daily.definition
    );
    let back = rule_from_definition("daily-sales", &daily.definition, &c.engine.key_names).unwrap();
    assert_eq!((back.write_shards, back.fingerprint.as_str()), (Some(16), daily.fingerprint.as_str()));
    // From the environment, as text.
    let env = vec![("DDB_AGGREGATOR__RULES__1__TARGET__WRITE_SHARDS".to_string(), "8".to_string())];
    assert_eq!(Config::from_yaml(&sharded("16"), env).unwrap().engine.rules[1].write_shards, Some(8));
    for bad in ["1", "101", "0", "-3", "2.5", "\"many\"", "true"] {
        let e = load_err(&sharded(bad));
        assert!(e.starts_with("rules[1].target.write_shards: ") && e.contains("2 to 100"), "{bad}: {e}");
    }
    let e = load_err(&demo_with(DAILY_TARGET, r#"target: { PK: "SALES#{date|day}", SK: 7 }"#));
    assert!(e.starts_with("rules[1].target.SK: ") && e.contains("template"), "{e}");
}

#[test]
fn a_sharded_target_takes_count_sum_and_avg_only_and_no_rule_with_other_sharding() {
    let helper = sharded("4").replacen(
        "measures: { orders: count, revenue: { sum: total } }",
        "measures: { orders: count, biggest: { max: total } }",
        1,
    );
    let e = load_err(&helper);
    assert!(e.starts_with("rules[1].target.write_shards: biggest is a max") && e.contains("count, sum and avg"), "{e}");
    let avg = sharded("4").replacen("revenue: { sum: total } }", "basket: { avg: total } }", 1);
    assert!(load(&avg).is_ok());
    // A second rule on the daily totals with another write_shards.
    let second = format!(
        "{}\n  - name: daily-items\n    source_key: {{ PK: \"CUST#{{customer}}\", SK: \"ORDER#{{date}}#{{order_id}}\" }}\n    target: {{ PK: \"SALES#{{date|day}}\", SK: \"TOTAL\" }}\n    measures: {{ items: {{ sum: qty }} }}\n",
        sharded("4").trim_end()
    );
    let e = load_err(&second);
    assert!(e.starts_with("rules: ") && e.contains("write_shards 4") && e.contains("write_shards none"), "{e}");
    assert!(load(&second.replacen("SK: \"TOTAL\" }\n    measures: { items", "SK: \"TOTAL\", write_shards: 4 }\n    measures: { items", 1))
        .is_ok());
}

#[test]
fn sub_items_are_loop_checked_like_targets() {
    // Aggregates in the source table, and a rule reading every `SALES#` item: the daily totals'
    // sub-items (`SALES#<day>#_agg#w<i>`) would be counted as its records.
    let text = format!(
        "{}\n  - name: everything\n    source_key: {{ PK: \"SALES#{{day}}#{{a}}#{{b}}\", SK: \"TOTAL\" }}\n    target: {{ PK: \"ALL\", SK: \"X\" }}\n    measures: {{ n: count }}\n",
        sharded("4").trim_end()
    );
    let e = load_err(&text);
    assert!(e.contains("loop") || e.contains("feedback"), "{e}");
    assert!(load(&text.replacen("write_shards: 4 ", "", 1)).is_ok(), "unsharded, nothing writes such keys");
}

/// The demo config with its copy rule replaced (`copy` holds the `copy:` block, indented).
fn demo_with_copy(extra: &str, copy: &str) -> String {
    let aggregating = &DEMO[..DEMO.find("  - name: customer-name-on-orders").unwrap()];
    format!(
        "{aggregating}  - name: customer-name-on-orders\n    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [PROFILE] }} }} }} }}\n    source_key: {{ PK: \"CUST#{{customer}}\", SK: PROFILE }}\n{extra}    copy:\n{copy}"
    )
}

const COPY: &str =
    "      attributes: { customerName: name, customerTier: tier }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n";

#[test]
fn copy_rules_are_validated_apart_from_the_aggregating_rules() {
    let c = load(&demo_with_copy("", COPY)).unwrap();
    assert_eq!(c.engine.rules.len(), 2, "copy rules are not aggregating rules");
    assert_eq!(c.engine.copies.len(), 1);
    let rule = &c.engine.copies[0];
    assert_eq!((rule.inline_items, rule.job_capacity_per_second), (100, 500.0), "the defaults");
    let paced = load(&demo_with_copy("", &format!("{COPY}      inline_items: 20\n      job_capacity_per_second: 250\n"))).unwrap();
    assert_eq!((paced.engine.copies[0].inline_items, paced.engine.copies[0].job_capacity_per_second), (20, 250.0));
    let pairs: Vec<(&str, &str)> = rule.attributes.iter().map(|a| (a.copy.as_str(), a.source.as_str())).collect();
    assert_eq!(pairs, vec![("customerName", "name"), ("customerTier", "tier")]);
    assert_eq!(rule.to.partition.0, "PK");
    assert!(matches!(&rule.to.sort, Some((sk, crate::rules::copy::SortCondition::BeginsWith(t))) if sk == "SK" && t.text() == "ORDER#"));
    // The filter-sharing table covers the aggregating rules only.
    assert_eq!(c.engine.filter_of.len(), 2);
    let on_index = demo_with_copy(
        "",
        "      attributes: { title: name }\n      to: { index: GSI1, GSI1PK: \"CUST#{customer}\", GSI1SK_begins_with: LINE }\n",
    );
    let c = load(&on_index).unwrap();
    let to = &c.engine.copies[0].to;
    assert_eq!((to.index.as_deref(), to.partition.0.as_str()), (Some("GSI1"), "GSI1PK"));
    assert!(matches!(&to.sort, Some((sk, _)) if sk == "GSI1SK"));
}

#[test]
fn copy_rule_errors_name_the_path_and_the_fix() {
    let cases: &[(&str, &str, &str)] = &[
        ("    target: { PK: X, SK: Y }\n", COPY, "rules[2].target: a copy rule writes the items its copy.to finds"),
        ("    measures: { n: count }\n", COPY, "rules[2].measures: a copy rule keeps copies, not measures"),
        ("    ttl_deletes: ignore\n", COPY, "rules[2].ttl_deletes"),
        (
            "",
            "      attributes: {}\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.attributes: name at least one",
        ),
        (
            "",
            "      attributes: { _aggx: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.attributes._aggx",
        ),
        (
            "",
            "      attributes: { SK: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.attributes.SK: a copy is a top-level attribute",
        ),
        (
            "",
            "      attributes: { \"a.b\": name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.attributes.a.b",
        ),
        (
            "",
            "      attributes: { n: \"x.y\" }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.attributes.n: \"x.y\"",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.to: the table's partition key PK is required",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", GSI1SK: x }\n",
            "rules[2].copy.to.GSI1SK: unknown key: on the table, give PK and optionally SK or SK_begins_with",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{region}\", SK_begins_with: \"ORDER#\" }\n",
            "rules[2].copy.to: {region} is not captured by source_key",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\" }\n",
            "rules[2].copy.to: could find the source item itself",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK: PROFILE }\n",
            "rules[2].copy.to: could find the source item itself",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: PRO }\n",
            "rules[2].copy.to: could find the source item itself",
        ),
        ("", "      attributes: { n: name }\n      to: { index: G, GSI1PK: x }\n", "rules[2].copy.to.index: \"G\" is not an index name"),
        (
            "",
            "      attributes: { n: name }\n      to: { index: GSI1, GSI1SK_begins_with: x }\n",
            "rules[2].copy.to: index GSI1's partition key is required",
        ),
        ("", "      attributes: { n: name }\n      to: { index: GSI1, GSI1PK: x, GSI1SK: y, Z: z }\n", "rules[2].copy.to.Z: unknown key"),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n      fan_out: 3\n",
            "unknown field `fan_out`",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n      inline_items: 0\n",
            "rules[2].copy.inline_items: 0 is out of range: a batch writes 1 to 1000 copies of a change, and a job the rest",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n      inline_items: 5000\n",
            "rules[2].copy.inline_items: 5000 is out of range",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n      job_capacity_per_second: 0.5\n",
            "rules[2].copy.job_capacity_per_second: 0.5 is out of range: give 1 to 40000 write capacity units per second",
        ),
        (
            "",
            "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }\n      job_capacity_per_second: .nan\n",
            "non-finite float `.nan` rejected",
        ),
    ];
    for (extra, copy, expected) in cases {
        let text = demo_with_copy(extra, copy);
        let e = load_err(&text);
        assert!(e.contains(expected), "{extra}{copy}\n  expected: {expected}\n  got: {e}");
    }
    // A filter that would skip some changes of a source (its delete has no NewImage).
    let copy_filter =
        "    filter: { dynamodb: { Keys: { SK: { S: [PROFILE] } } } }\n    source_key: { PK: \"CUST#{customer}\", SK: PROFILE }\n    copy:";
    for (filter, field) in
        [("{ dynamodb: { NewImage: { tier: { S: [gold] } } } }", "dynamodb.NewImage"), ("[{ eventName: [MODIFY] }]", "eventName")]
    {
        let text =
            demo_with_copy("", COPY).replace(copy_filter, &copy_filter.replace("{ dynamodb: { Keys: { SK: { S: [PROFILE] } } } }", filter));
        let e = load_err(&text);
        assert!(
            e.contains(&format!("rules[2].filter: a copy rule's filter may test dynamodb.Keys and eventSource only, not {field}")),
            "{e}"
        );
    }
    // Two profiles of a customer would share one set of copies.
    let text = demo_with_copy("", COPY).replace("SK: PROFILE }\n    copy:", "SK: \"PROFILE#{p}\" }\n    copy:");
    let e = load_err(&text);
    assert!(e.contains("rules[2].copy.to: does not use {p}, which source_key captures"), "{e}");
    let many: String = (0..101).map(|i| format!("a{i}: s{i}, ")).collect();
    let e = load_err(&demo_with_copy(
        "",
        &format!("      attributes: {{ {many} }}\n      to: {{ PK: \"CUST#{{customer}}\", SK_begins_with: \"ORDER#\" }}\n"),
    ));
    assert!(e.contains("rules[2].copy.attributes: 101 attributes: at most 100"), "{e}");
    // A rule with neither a target nor copy says what it misses.
    let e = load_err(&demo_with("    target: { PK: \"SALES#{date|day}\", SK: \"TOTAL\" }\n", ""));
    assert!(e.contains("rules[1].target: is missing") && e.contains("copy:"), "{e}");
}

#[test]
fn copies_are_never_written_onto_aggregates_or_kept_by_two_rules() {
    // Aggregates live in the source table: a `to` that could find the PROFILE item (which
    // holds customer-orders' measures) is refused.
    let e = load_err(&demo_with_copy("", "      attributes: { n: name }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: P }\n"));
    assert!(e.contains("copy.to: could find the source item itself"), "{e}");
    let sales = "  - name: sales-note\n    source_key: { PK: \"CUST#{customer}\", SK: NOTE }\n    copy:\n      attributes: { note: text }\n      to: { PK: \"SALES#{customer}\", SK_begins_with: TOT }\n";
    let e = load_err(&format!("{DEMO}{sales}"));
    assert!(e.contains("rules[3].copy.to: could find the target items of rule \"daily-sales\""), "{e}");
    // In a table of their own, the aggregates are out of reach.
    let apart = format!("{DEMO}{sales}").replacen("aggregates:\n  table: commerce-main", "aggregates:\n  table: commerce-aggregates", 1);
    assert_eq!(load(&apart).unwrap().engine.copies.len(), 2);
    let twice = format!("{}{}", demo_with_copy("", COPY), "  - name: tier-again\n    source_key: { PK: \"CUST#{customer}\", SK: PROFILE }\n    copy:\n      attributes: { customerTier: level }\n      to: { PK: \"CUST#{customer}\", SK_begins_with: \"LINE#\" }\n");
    let e = load_err(&twice);
    assert!(e.contains("rules[3].copy.attributes.customerTier: rule \"customer-name-on-orders\" keeps customerTier too"), "{e}");
}
