//! The offline commands as a user meets them: the real binary, files, stdout, stderr, exit codes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ddb_aggregator::decimal::Decimal;
use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run ddb-aggregator")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

const DEMO: &str = "config/commerce.yaml";

fn demo() -> String {
    root().join(DEMO).to_string_lossy().into_owned()
}

/// Target attribute -> value, from simulate's (or the oracle's) JSON lines.
fn deltas(text: &str) -> BTreeMap<(String, String, String), Decimal> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        if v.get("value").is_some() || v.get("target").is_none() {
            continue; // a max, min, latest or distinct (see values()), or a copy rule's line
        }
        let key = (
            v["target"]["PK"].as_str().unwrap().to_string(),
            v["target"]["SK"].as_str().unwrap().to_string(),
            v["attribute"].as_str().unwrap().to_string(),
        );
        let value = Decimal::parse(v["delta"].as_str().unwrap()).unwrap();
        assert!(!value.is_zero(), "zero sums are left out: {line}");
        assert!(out.insert(key, value).is_none(), "duplicate line {line}");
    }
    out
}

/// simulate over 10,000 generated records equals the totals that an independent Python
/// program computed from the final state of the table (tests/tools/gen_records.py).
#[test]
fn simulate_equals_the_independent_truth() {
    let dir = tempfile::tempdir().unwrap();
    for (seed, lambda_event) in [(7, false), (2026, true)] {
        let records = dir.path().join(format!("records-{seed}.json"));
        let expect = dir.path().join(format!("expect-{seed}.jsonl"));
        let mut gen = Command::new("python3");
        gen.arg(root().join("tests/tools/gen_records.py"))
            .args(["--seed", &seed.to_string(), "--records", "10000", "--out"])
            .arg(&records)
            .arg("--expect")
            .arg(&expect);
        if lambda_event {
            gen.arg("--lambda-event");
        }
        let g = gen.output().expect("python3 is needed for this test");
        assert!(g.status.success(), "generator failed: {}", String::from_utf8_lossy(&g.stderr));
        let out = run(&["simulate", "--config", &demo(), "--records", records.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let got = deltas(&stdout(&out));
        let want = deltas(&std::fs::read_to_string(&expect).unwrap());
        assert!(want.len() > 400, "the oracle produced a real workload ({} values)", want.len());
        for (k, v) in &want {
            assert_eq!(got.get(k), Some(v), "seed {seed}: {k:?}");
        }
        assert_eq!(got.len(), want.len(), "seed {seed}: no extra target attributes");
        // Output order: target (PK, then SK), then attribute; byte order.
        let keys: Vec<_> = stdout(&out)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v.get("target").is_some())
            .map(|v| {
                (
                    v["target"]["PK"].as_str().unwrap().to_string(),
                    v["target"]["SK"].as_str().unwrap().to_string(),
                    v["attribute"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert!(stderr(&out).contains("10000 records"), "{}", stderr(&out));
    }
}

#[test]
fn simulate_prints_the_documented_format_and_reports_poison() {
    let dir = tempfile::tempdir().unwrap();
    let rec = |seq: u32, event: &str, total: &str, status: &str, pk: &str| {
        format!(
            r#"{{"eventID":"e{seq}","eventName":"{event}","dynamodb":{{"Keys":{{"PK":{{"S":"{pk}"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}}}},"NewImage":{{"PK":{{"S":"{pk}"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}},"status":{{"S":"{status}"}},"total":{total}}},"SequenceNumber":"{seq}"}}}}"#
        )
    };
    let lines = [
        rec(1, "INSERT", r#"{"N":"10.2"}"#, "PAID", "CUST#c1"),
        rec(2, "INSERT", r#"{"N":"5.3"}"#, "PENDING", "CUST#c1"),
        rec(3, "INSERT", r#"{"S":"ten"}"#, "PAID", "CUST#c1"),
        String::new(),
        rec(4, "INSERT", r#"{"N":"1"}"#, "PAID", "CUST#c2"),
        r#"{"eventName":"INSERT"}"#.to_string(),
    ];
    let path = write(dir.path(), "records.jsonl", &lines.join("\n"));
    let out = run(&["simulate", "--config", &demo(), "--records", &path]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let first = text.lines().next().unwrap();
    assert_eq!(first, r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"openOrders","delta":"2"}"#);
    assert!(text.contains(r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"revenue","delta":"15.5"}"#), "{text}");
    assert!(text.contains(r#"{"target":{"PK":"SALES#2026-11-30","SK":"TOTAL"},"attribute":"revenue","delta":"16.5"}"#), "{text}");
    let err = stderr(&out);
    // Record 3's sum is poison for both rules; line 6 is not a stream record.
    assert!(
        err.contains(":3: poison record: non_numeric_sum (rule customer-orders): measures.revenue: attribute total is of type S"),
        "{err}"
    );
    assert!(err.contains(":3: poison record: non_numeric_sum (rule daily-sales)"), "{err}");
    assert!(err.contains(":6: poison record: malformed_record: dynamodb is missing"), "{err}");
    assert!(!err.contains("ten"), "item values stay out of messages: {err}");
    assert!(err.contains("5 records, 4 matched a rule, 3 poison"), "blank lines are skipped: {err}");
    // A poison record adds nothing to the rule it poisoned: not even its count.
    assert!(text.contains(r#""PK":"CUST#c1","SK":"PROFILE"},"attribute":"orderCount","delta":"2"}"#), "{text}");
}

#[test]
fn simulate_rejects_broken_input_with_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.jsonl", "{\"eventName\":\"INSERT\",\"dynamodb\":{}}\n{not json\n");
    let out = run(&["simulate", "--config", &demo(), "--records", &bad]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("bad.jsonl:2: not valid JSON"), "{}", stderr(&out));
    let broken_doc = write(dir.path(), "event.json", "{\n  \"Records\": [\n    {\"eventName\": \n");
    let out = run(&["simulate", "--config", &demo(), "--records", &broken_doc]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("event.json: not valid JSON") && stderr(&out).contains("line 4"), "{}", stderr(&out));
    let not_records = write(dir.path(), "n.json", "{\"Records\": 5}");
    let out = run(&["simulate", "--config", &demo(), "--records", &not_records]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("Records must be an array"), "{}", stderr(&out));
    let out = run(&["simulate", "--config", &demo(), "--records", "/nonexistent/records.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/records.jsonl: cannot read"), "{}", stderr(&out));
}

#[test]
fn simulate_reads_standard_input() {
    use std::io::Write;
    let mut child = bin()
        .args(["simulate", "--config", &demo(), "--records", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(br#"{"eventName":"REMOVE","dynamodb":{"Keys":{"PK":{"S":"CUST#c9"},"SK":{"S":"ORDER#2026-01-02T03:04:05Z#x"}},"OldImage":{"PK":{"S":"CUST#c9"},"SK":{"S":"ORDER#2026-01-02T03:04:05Z#x"},"total":{"N":"0.1"}}}}"#).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(
        stdout(&out).contains(r#"{"target":{"PK":"SALES#2026-01-02","SK":"TOTAL"},"attribute":"revenue","delta":"-0.1"}"#),
        "{}",
        stdout(&out)
    );
}

#[test]
fn validate_reports_paths_and_exit_codes() {
    let out = run(&["validate", "--config", &demo()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("valid")
            && stdout(&out).contains("rule customer-orders")
            && stdout(&out).contains("reconcile flags: --customer --date"),
        "{}",
        stdout(&out)
    );
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join(DEMO))
        .unwrap()
        .replace("revenue: { sum: total }", "revenue: { sum: total, where: { status: { S: [{ wildcard: \"a**\" }] } } }");
    let bad = write(dir.path(), "bad.yaml", &text);
    let out = run(&["validate", "--config", &bad]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("bad.yaml: rules[0].measures.revenue.where.status.S[0].wildcard: consecutive wildcard characters"), "{err}");
    let out = bin().args(["validate", "--config", &demo()]).env("DDB_AGGREGATOR__SOURCE__BATCH_SIZE", "0").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("source.batch_size: 0"), "{}", stderr(&out));
    let out = run(&["validate"]);
    assert_eq!(out.status.code(), Some(2), "missing flag is a usage error");
    assert!(stderr(&out).contains("--config"));
}

#[test]
fn every_shipped_config_validates() {
    let mut n = 0;
    for entry in std::fs::read_dir(root().join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let out = run(&["validate", "--config", path.to_str().unwrap()]);
            assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
            n += 1;
        }
    }
    assert!(n >= 3, "commerce, saas and ledger examples ship ({n} found)");
}

#[test]
fn test_pattern_like_the_aws_cli() {
    let dir = tempfile::tempdir().unwrap();
    let record = write(
        dir.path(),
        "event.json",
        r#"{"eventName":"INSERT","dynamodb":{"Keys":{"SK":{"S":"ORDER#1"}},"NewImage":{"total":{"N":"150"}}}}"#,
    );
    let yes = write(dir.path(), "yes.json", r#"{"dynamodb":{"Keys":{"SK":{"S":[{"prefix":"ORDER#"}]}}}}"#);
    let no = write(dir.path(), "no.json", r#"{"eventName":["REMOVE"]}"#);
    let numeric = write(dir.path(), "numeric.json", r#"{"dynamodb":{"NewImage":{"total":{"N":[{"numeric":[">",100]}]}}}}"#);
    let dup = write(dir.path(), "dup.json", r#"{"eventName":["REMOVE"],"eventName":["INSERT"]}"#);
    for (pattern, extra, expected) in [
        (&yes, None, "true"),
        (&no, None, "false"),
        (&numeric, None, "false"),
        (&numeric, Some("--numeric-strings"), "true"),
        (&dup, None, "true"),
    ] {
        let mut args = vec!["test-pattern", "--pattern", pattern, "--event", &record];
        args.extend(extra);
        let out = run(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out), format!("{expected}\n"), "{pattern}");
    }
    // The event is matched from its text: a key given twice counts once, the last, as in a
    // parsed event; escapes and dotted keys mean what they do there.
    let twice =
        write(dir.path(), "twice.json", r#"{"eventName":"REMOVE","dynamodb.Keys":{"SK":{"S":"ORDER\u00231"}},"eventName":"INSERT"}"#);
    for (pattern, expected) in [(&no, "false"), (&yes, "true")] {
        let out = run(&["test-pattern", "--pattern", pattern, "--event", &twice]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out), format!("{expected}\n"), "{pattern}");
    }
    let invalid = write(dir.path(), "invalid.json", r#"{"dynamodb":{"Keys":{"SK":{"S":[{"prefix":["ORDER#"]}]}}}}"#);
    let out = run(&["test-pattern", "--pattern", &invalid, "--event", &record]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stdout(&out).is_empty());
    assert!(
        stderr(&out).contains("invalid pattern: dynamodb.Keys.SK.S[0].prefix: prefix match pattern must be a string"),
        "{}",
        stderr(&out)
    );
    let bad_event = write(dir.path(), "bad.json", "{\"a\": ");
    let out = run(&["test-pattern", "--pattern", &yes, "--event", &bad_event]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("event is not valid JSON"), "{}", stderr(&out));
    let out = run(&["test-pattern", "--pattern", "/nope.json", "--event", &record]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn help_explains_the_commands() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    for cmd in ["validate", "test-pattern", "simulate"] {
        assert!(stdout(&out).contains(cmd), "{}", stdout(&out));
    }
    let out = run(&["simulate", "--help"]);
    assert!(stdout(&out).contains("JSON lines") && stdout(&out).contains("Records"), "{}", stdout(&out));
}

/// A rule whose filter reads what only stream records hold (here `eventName: [INSERT]`: items
/// ever inserted, deletes not subtracted) cannot be recomputed from the items: `validate` warns,
/// and `reconcile --rule` refuses it before any request.
#[test]
fn a_rule_reconcile_cannot_recompute_is_flagged_and_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(demo()).unwrap().replacen(
        "    filter:\n      dynamodb:",
        "    filter:\n      eventName: [INSERT]\n      dynamodb:",
        1,
    );
    assert!(text.contains("eventName: [INSERT]"), "the example's first filter changed shape");
    let config = write(dir.path(), "inserts.yaml", &text);
    let o = run(&["validate", "--config", &config]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("warning: rule customer-orders cannot be reconciled: its filter reads eventName"), "{}", stdout(&o));
    let o = run(&["reconcile", "--config", &config, "--rule", "customer-orders", "--customer", "c1"]);
    assert_eq!(o.status.code(), Some(2), "{}{}", stdout(&o), stderr(&o));
    assert!(stderr(&o).contains("which the source items do not hold"), "{}", stderr(&o));
}

/// A `numeric` operator on an N value never matches without `numeric_strings: true` (as in
/// Lambda): `validate` says where and what to set, and still exits 0.
#[test]
fn validate_warns_about_a_numeric_match_on_n_values_that_can_never_match() {
    let dir = tempfile::tempdir().unwrap();
    let open = "      openOrders: { count: true, where: { status: { S: [PENDING, PAID] } } }";
    let text = std::fs::read_to_string(demo()).unwrap();
    assert!(text.contains(open), "the example's measures changed shape");
    let text = text.replacen(
        open,
        &format!("{open}\n      bigOrders: {{ count: true, where: {{ total: {{ N: [{{ numeric: [\">\", 500] }}] }} }} }}"),
        1,
    );
    let config = write(dir.path(), "big.yaml", &text);
    let o = run(&["validate", "--config", &config]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("warning: rules[0].measures.bigOrders.where.total.N[0].numeric never matches"), "{out}");
    assert!(out.contains("set numeric_strings: true"), "{out}");
}

/// `healthcheck` for images without curl: 0 on a 2xx answer, 1 when the service answers
/// otherwise or not at all, 2 for an address it cannot use.
#[test]
fn healthcheck_asks_healthz() {
    use std::io::{Read, Write};
    let serve = |status: &'static str| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let handle = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap();
            let request = String::from_utf8_lossy(&buf[..n]).into_owned();
            let body = "x\n";
            let _ =
                s.write_all(format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).as_bytes());
            request
        });
        (port, handle)
    };
    let (port, seen) = serve("200 OK");
    let o = run(&["healthcheck", "--url", &format!("http://127.0.0.1:{port}/healthz")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(seen.join().unwrap().starts_with("GET /healthz HTTP/1.1\r\n"));
    let (port, seen) = serve("503 Service Unavailable");
    let o = run(&["healthcheck", "--url", &format!("http://127.0.0.1:{port}/healthz")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("503 Service Unavailable"), "{}", stderr(&o));
    seen.join().unwrap();
    // Nobody listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let o = run(&["healthcheck", "--url", &format!("http://127.0.0.1:{closed}/healthz")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot reach 127.0.0.1:"), "{}", stderr(&o));
    let o = run(&["healthcheck", "--url", "localhost:9464"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--url"), "{}", stderr(&o));
}

/// `--config env:NAME` reads the YAML from an environment variable (an ECS secret).
#[test]
fn a_config_can_come_from_an_environment_variable() {
    let text = std::fs::read_to_string(demo()).unwrap();
    let o =
        bin().args(["validate", "--config", "env:DDB_AGGREGATOR_CONFIG_YAML"]).env("DDB_AGGREGATOR_CONFIG_YAML", &text).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("rule customer-orders"), "{}", stdout(&o));
    let o =
        bin().args(["validate", "--config", "env:DDB_AGGREGATOR_CONFIG_YAML"]).env_remove("DDB_AGGREGATOR_CONFIG_YAML").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o)
            .contains("environment variable DDB_AGGREGATOR_CONFIG_YAML (named by --config env:DDB_AGGREGATOR_CONFIG_YAML) is not set"),
        "{}",
        stderr(&o)
    );
    let o = bin().args(["validate", "--config", "env:BROKEN"]).env("BROKEN", "rules: [").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not valid YAML"), "{}", stderr(&o));
}

/// The config's SDK timeouts bound every call: DynamoDB that accepts the connection and never
/// answers ends `reconcile` with an error (exit 1) instead of a hang.
#[test]
fn a_call_that_never_answers_times_out() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    // Accept (bounded) and hold the connections open without a byte in answer.
    let holder = std::thread::spawn(move || {
        let _ = silent.set_nonblocking(true);
        let mut held = Vec::new();
        for _ in 0..300 {
            if let Ok((s, _)) = silent.accept() {
                held.push(s);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(demo()).unwrap() + "aws: { read_timeout: 1s, operation_timeout: 3s, max_attempts: 1 }\n";
    let config = write(dir.path(), "c.yaml", &text);
    let mut child = bin()
        .args(["reconcile", "--config", &config, "--customer", "c1"])
        .env("AWS_ENDPOINT_URL_DYNAMODB", format!("http://127.0.0.1:{port}"))
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A bound, not a speed check: without timeouts the process would never exit.
    let mut status = None;
    for _ in 0..600 {
        if let Some(s) = child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let Some(status) = status else {
        let _ = child.kill();
        panic!("reconcile still waiting on a silent endpoint after 60 s");
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.to_lowercase().contains("timeout") || err.to_lowercase().contains("timed out"), "{err}");
    drop(holder);
}

/// `ttl_deletes: ignore` as a user meets it (config/commerce-measures.yaml): `simulate` shows a
/// delete by DynamoDB's TTL service changing only the rule that counts it, a user's delete
/// changing both, `validate` warns that reconcile cannot recompute the rule, and
/// `reconcile --rule` refuses it before any request. (DynamoDB Local does not emulate TTL, so
/// no emulator can produce the TTL service's record.)
#[test]
fn a_ttl_delete_under_ignore_changes_nothing_and_reconcile_refuses_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let config = root().join("config/commerce-measures.yaml").to_string_lossy().into_owned();
    let remove = |seq: u32, identity: &str| {
        format!(
            r#"{{"eventName":"REMOVE",{identity}"dynamodb":{{"Keys":{{"PK":{{"S":"CUST#c1"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}}}},"OldImage":{{"PK":{{"S":"CUST#c1"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}},"status":{{"S":"PAID"}},"total":{{"N":"7.25"}}}},"SequenceNumber":"{seq}"}}}}"#
        )
    };
    let ttl = r#""userIdentity":{"type":"Service","principalId":"dynamodb.amazonaws.com"},"#;
    let attrs = |path: &str| {
        let out = run(&["simulate", "--config", &config, "--records", path]);
        assert!(out.status.success(), "{}", stderr(&out));
        deltas(&stdout(&out)).into_iter().map(|((_, sk, a), v)| (format!("{sk}.{a}"), v.to_string())).collect::<BTreeMap<_, _>>()
    };
    let by_ttl = attrs(&write(dir.path(), "ttl.jsonl", &remove(1, ttl)));
    let want: BTreeMap<String, String> = [
        ("PROFILE.avgOrder_count", "-1"),
        ("PROFILE.avgOrder_sum", "-7.25"),
        ("PROFILE.avgPaidOrder_count", "-1"),
        ("PROFILE.avgPaidOrder_sum", "-7.25"),
        ("PROFILE.orderCount", "-1"),
        ("PROFILE.revenue", "-7.25"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(by_ttl, want, "the TTL delete leaves PLACED alone");
    let by_user = attrs(&write(dir.path(), "user.jsonl", &remove(2, "")));
    assert_eq!(by_user.get("PLACED.ordersPlaced").map(String::as_str), Some("-1"), "{by_user:?}");
    assert_eq!(by_user.get("PLACED.revenuePlaced").map(String::as_str), Some("-7.25"));
    let o = run(&["validate", "--config", &config]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("warning: rule orders-placed cannot be reconciled: it has ttl_deletes: ignore"), "{}", stdout(&o));
    assert!(stdout(&o).contains("avgOrder_sum, avgOrder_count"), "validate lists what avg writes: {}", stdout(&o));
    let o = run(&["reconcile", "--config", &config, "--rule", "orders-placed", "--customer", "c1"]);
    assert_eq!(o.status.code(), Some(2), "{}{}", stdout(&o), stderr(&o));
    assert!(stderr(&o).contains("the items that remain cannot recompute it"), "{}", stderr(&o));
}

/// max, min, latest and distinct print their final `"value"` (null: nothing contributes)
/// instead of a `"delta"`, sorted with the counters; helper items are not shown.
#[test]
fn simulate_prints_the_value_of_max_min_latest_and_distinct() {
    let dir = tempfile::tempdir().unwrap();
    let config = root().join("config/commerce-measures.yaml").to_string_lossy().into_owned();
    let rec = |seq: u32, event: &str, c: &str, day: &str, total: &str, status: &str| {
        let image = format!(
            r#"{{"PK":{{"S":"CUST#{c}"}},"SK":{{"S":"ORDER#{day}#o{seq}"}},"status":{{"S":"{status}"}},"total":{{"N":"{total}"}},"updatedAt":{{"N":"{seq}"}}}}"#
        );
        let which = if event == "REMOVE" { "OldImage" } else { "NewImage" };
        format!(
            r#"{{"eventName":"{event}","dynamodb":{{"Keys":{{"PK":{{"S":"CUST#{c}"}},"SK":{{"S":"ORDER#{day}#o{seq}"}}}},"{which}":{image},"SequenceNumber":"{}"}}}}"#,
            seq + if event == "REMOVE" { 100 } else { 0 }
        )
    };
    let lines = [
        rec(1, "INSERT", "c1", "2026-11-29", "10", "PAID"),
        rec(2, "INSERT", "c1", "2026-11-30", "25", "PENDING"),
        rec(2, "REMOVE", "c1", "2026-11-30", "25", "PENDING"),
        rec(3, "INSERT", "c2", "2026-11-30", "4", "PAID"),
        rec(3, "REMOVE", "c2", "2026-11-30", "4", "PAID"),
    ];
    let out = run(&["simulate", "--config", &config, "--records", &write(dir.path(), "r.jsonl", &lines.join("\n"))]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let profile = |c: &str, a: &str, v: &str| format!(r#"{{"target":{{"PK":"CUST#{c}","SK":"PROFILE"}},"attribute":"{a}","value":{v}}}"#);
    let c1: Vec<&str> = text.lines().filter(|l| l.contains("CUST#c1") && l.contains("PROFILE")).collect();
    assert_eq!(
        c1,
        [
            profile("c1", "activeDays", r#""1""#).as_str(),
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"avgOrder_count","delta":"1"}"#,
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"avgOrder_sum","delta":"10"}"#,
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"avgPaidOrder_count","delta":"1"}"#,
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"avgPaidOrder_sum","delta":"10"}"#,
            profile("c1", "firstOrderDay", r#""2026-11-29""#).as_str(),
            profile("c1", "largestOrder", r#""10""#).as_str(),
            profile("c1", "lastStatus", r#""PAID""#).as_str(),
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"orderCount","delta":"1"}"#,
            r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"revenue","delta":"10"}"#,
        ],
        "the deleted order of 25 gives the largest back to 10: {text}"
    );
    assert!(text.contains(&profile("c2", "largestOrder", "null")), "c2's only order was deleted: {text}");
    assert!(!text.contains("_agg"), "helper items are the service's own: {text}");
}

/// A sharded target: `simulate` prints the total's delta and names the sub-items it is spread
/// over; `validate` refuses a helper measure on it, and a `write_shards` out of range, with the
/// path and exit 2.
#[test]
fn simulate_and_validate_understand_sharded_targets() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(demo()).unwrap();
    let plain = r#"target: { PK: "SALES#{date|day}", SK: "TOTAL" }"#;
    let sharded = text.replace(plain, r#"target: { PK: "SALES#{date|day}", SK: "TOTAL", write_shards: 16 }"#);
    let config = write(dir.path(), "sharded.yaml", &sharded);
    let rec = |seq: u32, total: &str| {
        format!(
            r#"{{"eventName":"INSERT","dynamodb":{{"Keys":{{"PK":{{"S":"CUST#c{seq}"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}}}},"NewImage":{{"PK":{{"S":"CUST#c{seq}"}},"SK":{{"S":"ORDER#2026-11-30#o{seq}"}},"status":{{"S":"PAID"}},"total":{{"N":"{total}"}}}},"SequenceNumber":"{seq}"}}}}"#
        )
    };
    let records = write(dir.path(), "records.jsonl", &[rec(1, "10.25"), rec(2, "4")].join("\n"));
    let out = run(&["simulate", "--config", &config, "--records", &records]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(r#"{"target":{"PK":"SALES#2026-11-30","SK":"TOTAL"},"attribute":"revenue","delta":"14.25","sub_items":{"write_shards":16,"first":"SALES#2026-11-30#_agg#w0","last":"SALES#2026-11-30#_agg#w15"}}"#),
        "{text}"
    );
    assert!(
        text.contains(r#"{"target":{"PK":"CUST#c1","SK":"PROFILE"},"attribute":"revenue","delta":"10.25"}"#),
        "unsharded lines unchanged: {text}"
    );
    let out = run(&["validate", "--config", &config]);
    assert!(out.status.success(), "{}", stderr(&out));
    for (bad, says) in [
        ("write_shards: 16 }", "rules[1].target.write_shards: 1000: give a whole number from 2 to 100"),
        ("measures: { orders: count, revenue: { sum: total } }", "rules[1].target.write_shards: biggest is a max"),
    ] {
        let broken = match says.contains("1000") {
            true => sharded.replace(bad, "write_shards: 1000 }"),
            false => sharded.replace(bad, "measures: { orders: count, biggest: { max: total } }"),
        };
        let out = run(&["validate", "--config", &write(dir.path(), "bad.yaml", &broken)]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    }
}

/// A copy rule as a user meets it offline (the demo config's): `simulate` prints, per source, the copies its last
/// change sets and removes and where they are found; a change of other attributes prints
/// nothing; `validate` refuses a `to` that would find the source itself, with the path and
/// exit 2.
#[test]
fn simulate_and_validate_understand_copy_rules() {
    let dir = tempfile::tempdir().unwrap();
    // config/commerce.yaml's customer-name-on-orders.
    let text = std::fs::read_to_string(demo()).unwrap();
    let config = demo();
    let profile = |c: &str, fields: &str| format!(r#"{{"PK":{{"S":"CUST#{c}"}},"SK":{{"S":"PROFILE"}}{fields}}}"#);
    let rec = |event: &str, c: &str, seq: u32, old: Option<&str>, new: Option<&str>| {
        let keys = format!(r#"{{"PK":{{"S":"CUST#{c}"}},"SK":{{"S":"PROFILE"}}}}"#);
        let old = old.map(|o| format!(r#","OldImage":{}"#, profile(c, o))).unwrap_or_default();
        let new = new.map(|n| format!(r#","NewImage":{}"#, profile(c, n))).unwrap_or_default();
        format!(r#"{{"eventName":"{event}","dynamodb":{{"Keys":{keys}{old}{new},"SequenceNumber":"{seq}"}}}}"#)
    };
    let ann = r#","name":{"S":"Ann"},"tier":{"S":"gold"}"#;
    let bea = r#","name":{"S":"Bea"},"tier":{"S":"gold"}"#;
    let records = [
        rec("INSERT", "c1", 1, None, Some(ann)),
        rec("MODIFY", "c1", 2, Some(ann), Some(bea)),
        rec("MODIFY", "c2", 3, Some(r#","name":{"S":"Cy"},"visits":{"N":"1"}"#), Some(r#","name":{"S":"Cy"},"visits":{"N":"2"}"#)),
        rec("REMOVE", "c3", 4, Some(ann), None),
    ];
    let out = run(&["simulate", "--config", &config, "--records", &write(dir.path(), "r.jsonl", &records.join("\n"))]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    assert_eq!(
        lines,
        vec![
            r#"{"rule":"customer-name-on-orders","source":{"PK":{"S":"CUST#c1"},"SK":{"S":"PROFILE"}},"to":{"PK":"CUST#c1","SK_begins_with":"ORDER#"},"set":{"customerName":{"S":"Bea"},"customerTier":{"S":"gold"}},"remove":[]}"#,
            r#"{"rule":"customer-name-on-orders","source":{"PK":{"S":"CUST#c3"},"SK":{"S":"PROFILE"}},"to":{"PK":"CUST#c3","SK_begins_with":"ORDER#"},"set":{},"remove":["customerName","customerTier"],"deleted":true}"#,
        ],
        "c1's last change, c2's none (only visits changed), c3's delete"
    );
    assert!(
        stderr(&out).contains("4 records, 4 matched a rule, 0 poison, 0 target attributes changed, 2 sources' copies changed"),
        "{}",
        stderr(&out)
    );
    let looping = text.replace(r#"SK_begins_with: "ORDER#" }"#, r#"SK_begins_with: "P" }"#);
    let out = run(&["validate", "--config", &write(dir.path(), "loop.yaml", &looping)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("rules[2].copy.to: could find the source item itself"), "{}", stderr(&out));
}
