//! Bad and hostile input, as a user meets it: every case gets a one-line message that says
//! where the problem is, and exit code 2 (never a panic or a stack trace). RELIABILITY.md
//! lists these cases.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"))
}

fn demo() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/commerce.yaml")).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and checks: exit 2, the message, and no panic text.
fn expect_bad(o: Output, message: &str, case: &str) {
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{case}: exit code; stderr: {err}");
    assert!(err.contains(message), "{case}: expected {message:?} in: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{case}: panic: {err}");
}

/// Config cases: (what, replace this, with this, expected message).
const CONFIG_CASES: &[(&str, &str, &str, &str)] = &[
    ("unknown top-level key", "rules:", "rulez: []\nrules:", "unknown field `rulez`"),
    ("unknown nested key", "  batch_size: 1000", "  batch_size: 1000\n  batchsize: 5", "source.batchsize: unknown field `batchsize`"),
    ("batch size out of range", "  batch_size: 1000", "  batch_size: 0", "source.batch_size: 0: 1 to 10000 records"),
    ("duration without unit", "  lease_duration: 10s", "  lease_duration: 10", "state.lease_duration: duration \"10\" needs a unit"),
    ("lease too short", "  lease_duration: 10s", "  lease_duration: 100ms", "state.lease_duration: between 300ms and 600s"),
    (
        "unknown start position",
        "  start_position: trim_horizon",
        "  start_position: oldest",
        "source.start_position: \"oldest\": use trim_horizon or latest",
    ),
    (
        "bad table name",
        "  table: commerce-main\n  start_position",
        "  table: \"orders table\"\n  start_position",
        "source.table: \"orders table\" is not a DynamoDB table name",
    ),
    ("state table is the source", "  table: ddb-aggregator-state", "  table: commerce-main", "state.table: must be a table of its own"),
    (
        "queue URL not a URL",
        "  queue_url: http://localhost:9324/000000000000/ddb-aggregator-dlq",
        "  queue_url: my-queue",
        "dead_letter.queue_url: \"my-queue\" is not a queue URL",
    ),
    ("max attempts zero", "  max_attempts: 5", "  max_attempts: 0", "dead_letter.max_attempts: 0: use 1 to 100"),
    ("metrics address", "  listen: 0.0.0.0:9464", "  listen: localhost", "metrics.listen: \"localhost\" is not an address"),
    ("no rules", "rules:", "rules: []\nx_rules:", "unknown field `x_rules`"),
    (
        "duplicate rule name",
        "  - name: daily-sales",
        "  - name: customer-orders",
        "rules[1].name: \"customer-orders\" is used by an earlier rule",
    ),
    ("rule name with spaces", "  - name: daily-sales", "  - name: daily sales", "rules[1].name: \"daily sales\": 1-64 letters"),
    (
        "pattern leaf not an array",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { S: \"ORDER#\" }",
        "rules[0].filter.dynamodb.Keys.SK.S: \"S\" must be an object or an array",
    ),
    (
        "pattern unknown operator",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { S: [{ begins: \"ORDER#\" }] }",
        "rules[0].filter.dynamodb.Keys.SK.S[0].begins: unrecognized match type",
    ),
    (
        "pattern bad numeric range",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { N: [{ numeric: [\">\", 5, \"<\", 1] }] }",
        "rules[0].filter.dynamodb.Keys.SK.N[0].numeric: bottom of a numeric range must be less than its top",
    ),
    (
        "pattern wildcard **",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { S: [{ wildcard: \"ORDER**\" }] }",
        "rules[0].filter.dynamodb.Keys.SK.S[0].wildcard: consecutive wildcard characters",
    ),
    (
        "pattern empty array",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { S: [] }",
        "rules[0].filter.dynamodb.Keys.SK.S: empty arrays are not allowed",
    ),
    (
        "pattern bad cidr",
        "          SK: { S: [{ prefix: \"ORDER#\" }] }",
        "          SK: { S: [{ cidr: \"10.0.0.0/99\" }] }",
        "rules[0].filter.dynamodb.Keys.SK.S[0].cidr: malformed CIDR",
    ),
    (
        "template unclosed brace",
        "      PK: \"CUST#{customer}\"\n      SK",
        "      PK: \"CUST#{customer\"\n      SK",
        "rules[0].source_key.PK: unclosed '{'",
    ),
    (
        "template adjacent captures",
        "      SK: \"ORDER#{date}#{order_id}\"",
        "      SK: \"ORDER#{date}{order_id}\"",
        "rules[0].source_key.SK: capture {date} must be followed by '#'",
    ),
    (
        "template unknown function",
        "    target: { PK: \"SALES#{date|day}\", SK: \"TOTAL\" }",
        "    target: { PK: \"SALES#{date|week}\", SK: \"TOTAL\" }",
        "rules[1].target.PK: unknown template function \"week\"",
    ),
    (
        "template function in a capture",
        "      SK: \"ORDER#{date}#{order_id}\"",
        "      SK: \"ORDER#{date|day}#{order_id}\"",
        "rules[0].source_key.SK: {date|day}: functions apply to target templates",
    ),
    (
        "measure with two kinds",
        "      revenue: { sum: total }",
        "      revenue: { sum: total, count: true }",
        "rules[0].measures.revenue: exactly one of count or sum",
    ),
    (
        "measure nested path",
        "      orderCount: count",
        "      \"stats.orders\": count",
        "rules[0].measures.stats.orders: measures are top-level attributes",
    ),
    (
        "measure reserved name",
        "      orderCount: count",
        "      _agg_count: count",
        "rules[0].measures._agg_count: attribute name may not be empty, a key attribute, or start with \"_agg\"",
    ),
    (
        "measure bad product",
        "      revenue: { sum: total }",
        "      revenue: { sum: \"qty * price * 2\" }",
        "rules[0].measures.revenue.sum: \"qty * price * 2\": give an attribute name or \"ATTR * ATTR\"",
    ),
    (
        "target with other key attributes",
        "    target: { PK: \"SALES#{date|day}\", SK: \"TOTAL\" }",
        "    target: { pk: \"SALES#{date|day}\", sk: \"TOTAL\" }",
        "rules[1].target: every rule writes to the same table",
    ),
    (
        "feedback loop",
        "    target: { PK: \"CUST#{customer}\", SK: \"PROFILE\" }",
        "    target: { PK: \"CUST#{customer}\", SK: \"ORDER#{date}#total\" }",
        "rules[0].target: items written by rule \"customer-orders\" could match",
    ),
    (
        "reconcile query variable not in target",
        "      query: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }",
        "      query: { PK: \"CUST#{order_id}\" }",
        "rules[0].reconcile.query: {order_id} must be captured by source_key and used in target",
    ),
    (
        "reconcile query and scan",
        "      query: { PK: \"CUST#{customer}\", SK_begins_with: \"ORDER#\" }",
        "      query: { PK: \"CUST#{customer}\" }\n      scan: true",
        "rules[0].reconcile: give either query or scan: true, not both",
    ),
    (
        "max_record_age too small",
        "  batching_window: 0s",
        "  batching_window: 0s\n  max_record_age: 10ms",
        "source.max_record_age: at least 1s",
    ),
    ("reconcile scope", "  interval: 1h", "  interval: 1h\n  scope: some", "reconcile.scope: \"some\": use touched or all"),
];

#[test]
fn config_errors_name_the_setting_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let base = demo();
    assert!(CONFIG_CASES.len() >= 30);
    for (i, (case, from, to, message)) in CONFIG_CASES.iter().enumerate() {
        assert!(base.contains(from), "{case}: the demo config has no {from:?}");
        let path = write(dir.path(), &format!("c{i}.yaml"), &base.replacen(from, to, 1));
        let o = bin().args(["validate", "--config"]).arg(&path).output().unwrap();
        expect_bad(o, message, case);
    }
}

#[test]
fn files_and_environment() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| bin().args(args).envs(env.iter().copied()).output().unwrap();
    let cfg = write(dir.path(), "ok.yaml", &demo());
    let cfg = cfg.to_str().unwrap();
    expect_bad(run(&["validate", "--config", "/nonexistent.yaml"], &[]), "cannot read /nonexistent.yaml", "missing config file");
    let empty = write(dir.path(), "empty.yaml", "");
    expect_bad(run(&["validate", "--config", empty.to_str().unwrap()], &[]), "the file is empty", "empty config");
    let broken = write(dir.path(), "broken.yaml", "source: [unclosed");
    expect_bad(run(&["validate", "--config", broken.to_str().unwrap()], &[]), "not valid YAML", "broken YAML");
    let binary = write(dir.path(), "binary.yaml", "\u{0}\u{1}\u{2}");
    let o = run(&["validate", "--config", binary.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2), "binary config: {}", stderr(&o));
    expect_bad(
        run(&["validate", "--config", cfg], &[("DDB_AGGREGATOR__SOURCE__BATCH_SIZE", "lots")]),
        "source.batch_size",
        "env override of the wrong type",
    );
    expect_bad(
        run(&["validate", "--config", cfg], &[("DDB_AGGREGATOR__NOPE", "1")]),
        "unknown field `nope`",
        "env override of an unknown setting",
    );
    expect_bad(
        run(&["validate", "--config", cfg], &[("DDB_AGGREGATOR__RULES__7__NAME", "x")]),
        "index 7 is past the end",
        "env override past the rule list",
    );
    expect_bad(
        run(&["validate", "--config", cfg], &[("DDB_AGGREGATOR__SOURCE____TABLE", "x")]),
        "empty path segment",
        "env override with an empty segment",
    );
}

#[test]
fn patterns_events_and_records() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "ok.yaml", &demo());
    let event = write(dir.path(), "event.json", r#"{"eventName": "INSERT"}"#);
    let tp = |pattern: &str, event: &Path| {
        let p = write(dir.path(), "p.json", pattern);
        bin().args(["test-pattern", "--pattern"]).arg(p).arg("--event").arg(event).output().unwrap()
    };
    expect_bad(tp("{\"eventName\": [", &event), "invalid pattern: not valid JSON", "pattern not JSON");
    expect_bad(tp("[\"INSERT\"]", &event), "a pattern must be a JSON object", "pattern not an object");
    expect_bad(tp(r#"{"eventName": [{"anything-but": null}]}"#, &event), "eventName[0].anything-but", "anything-but null");
    expect_bad(
        tp(r#"{"a": [{"exists": "yes"}]}"#, &event),
        "a[0].exists: exists match pattern must be either true or false",
        "exists not a boolean",
    );
    expect_bad(
        tp(r#"{"a": [{"numeric": [">", "5"]}]}"#, &event),
        "a[0].numeric[1]: value of > must be numeric",
        "numeric value as a string",
    );
    let bad_event = write(dir.path(), "bad.json", "{]");
    expect_bad(tp(r#"{"a": ["x"]}"#, &bad_event), "event is not valid JSON", "event not JSON");
    let sim = |records: &str| {
        let r = write(dir.path(), "r.jsonl", records);
        bin().args(["simulate", "--config"]).arg(&cfg).arg("--records").arg(r).output().unwrap()
    };
    expect_bad(sim("{\"eventName\":\"INSERT\"}\nnot json\n"), "r.jsonl:2: not valid JSON", "records file line not JSON");
    expect_bad(sim("{\"Records\": {}}"), "Records must be an array", "Lambda event without an array");
    expect_bad(sim("42"), "expected stream records", "records file of a number");
}

#[test]
fn command_line_values() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "ok.yaml", &demo());
    let cfg = cfg.to_str().unwrap();
    let rec = |args: &[&str]| bin().args(["reconcile", "--config", cfg]).args(args).output().unwrap();
    expect_bad(
        rec(&["--customer", "c1#CUST#victim"]),
        "--customer \"c1#CUST#victim\": a key part may not be empty or contain '#'",
        "delimiter injection",
    );
    expect_bad(rec(&["--customer", ""]), "a key part may not be empty", "empty key part");
    expect_bad(rec(&["--shop", "s1"]), "unexpected argument '--shop'", "unknown variable");
    expect_bad(rec(&["--shop", "s1"]), "are: --customer --date", "unknown variable: the flags there are");
    expect_bad(rec(&["--custmer", "c1"]), "a similar argument exists: '--customer'", "a typo");
    expect_bad(rec(&["--customer"]), "a value is required for '--customer <VALUE>'", "variable without a value");
    expect_bad(rec(&[]), "say what to reconcile", "nothing to reconcile");
    expect_bad(rec(&["--all", "--customer", "c1"]), "--all reconciles every target", "--all with variables");
    expect_bad(rec(&["--customer", "c1", "--rule", "nope"]), "--rule nope: no such rule", "unknown rule");
    expect_bad(rec(&["--customer", "c1", "--wait", "soon"]), "--wait: duration \"soon\"", "bad duration flag");
    expect_bad(
        rec(&["--customer", "c1", "--customer", "c2"]),
        "'--customer <VALUE>' cannot be used multiple times",
        "variable given twice",
    );
    let o = rec(&["--all", "--segments", "0"]);
    assert_eq!(o.status.code(), Some(2), "segments 0: {}", stderr(&o));
    let o = bin().args(["simulate", "--config", cfg]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "missing --records: {}", stderr(&o));
    let o = bin().args(["frobnicate"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "unknown command: {}", stderr(&o));
}
