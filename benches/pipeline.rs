//! Throughput of the pure pipeline, per core: `cargo bench --bench pipeline`.
//!
//! Realistic stream records of about 500 bytes (orders of the commerce model plus other entity types)
//! against 5 rules. Each stage runs several times; the median is printed with its ratio to
//! parse-only, the practical ceiling for a pipeline that starts from raw JSON. Then the
//! pattern matcher side by side with the `quamina` crate (a Rust port of the Go library that
//! implements the same pattern language) on the same 5 patterns and the same records, the
//! runs of the two alternating.
//! The output is markdown; scripts/bench copies it into BENCHMARKS.md.

use std::hint::black_box;
use std::time::Instant;

use std::collections::HashMap;

use aws_sdk_dynamodbstreams::primitives::DateTime;
use aws_sdk_dynamodbstreams::types::{AttributeValue, Identity, OperationType, Record, StreamRecord, StreamViewType};
use ddb_aggregator::config::Config;
use ddb_aggregator::pattern::{Pattern, PatternOptions, PatternSet, RawMatcher};
use ddb_aggregator::rules::Coalescer;
use ddb_aggregator::stream::dynamodb::record_to_json;
use serde_json::Value;

/// The allocator the service binary uses (src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RECORDS: usize = 50_000;
const RUNS: usize = 7;

const CONFIG: &str = r#"
source: { table: commerce-main }
state: { table: ddb-aggregator-state }
rules:
  - name: customer-orders
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures:
      orderCount: count
      revenue: { sum: total }
      "orders_{status}": count
      openRevenue: { sum: total, where: { status: { S: [PENDING, PAID] } } }
      openOrders: { count: true, where: { status: { S: [PENDING, PAID] } } }
  - name: daily-sales
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "SALES#{date|day}", SK: "TOTAL" }
    measures: { orders: count, revenue: { sum: total } }
  - name: big-orders
    numeric_strings: true
    filter:
      eventName: [INSERT, MODIFY]
      dynamodb: { NewImage: { total: { N: [{ numeric: [">=", 500] }] } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "BIG#{date|month}", SK: "TOTAL" }
    measures: { bigOrders: count }
  - name: org-projects
    filter:
      dynamodb: { Keys: { SK: { S: [{ prefix: "PROJECT#" }] } } }
    source_key: { PK: "ORG#{org}", SK: "PROJECT#{createdAt}#{project}" }
    target: { PK: "ORG#{org}", SK: "PROFILE" }
    measures: { projectCount: count }
  - name: ttl-expired
    filter:
      userIdentity: { principalId: ["dynamodb.amazonaws.com"] }
      dynamodb: { OldImage: { status: { S: [{ anything-but: [PAID, SHIPPED] }] } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures: { expiredOrders: count }
"#;

/// Five patterns in the subset both matchers implement (quamina compares numbers only with
/// JSON numbers, so the N-string comparison of `big-orders` is replaced by a status test).
const SHARED_PATTERNS: [&str; 5] = [
    r#"{"dynamodb": {"Keys": {"SK": {"S": [{"prefix": "ORDER#"}]}}}}"#,
    r#"{"eventName": ["INSERT", "MODIFY"], "dynamodb": {"NewImage": {"status": {"S": ["PAID", "SHIPPED"]}}}}"#,
    r#"{"dynamodb": {"Keys": {"SK": {"S": [{"prefix": "PROJECT#"}]}}}}"#,
    r#"{"userIdentity": {"principalId": ["dynamodb.amazonaws.com"]}, "dynamodb": {"OldImage": {"status": {"S": [{"anything-but": ["PAID", "SHIPPED"]}]}}}}"#,
    r#"{"eventName": ["REMOVE"], "dynamodb": {"Keys": {"PK": {"S": [{"suffix": "7"}]}}}}"#,
];

/// Deterministic pseudo-random numbers (no dependency, same records every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn records() -> Vec<String> {
    let mut rng = Lcg(42);
    let statuses = ["PENDING", "PAID", "SHIPPED", "CANCELLED"];
    (0..RECORDS)
        .map(|i| {
            let kind = rng.next(10);
            let cust = rng.next(500);
            let (pk, sk) = if kind < 8 {
                (format!("CUST#c{cust}"), format!("ORDER#2026-11-{:02}T{:02}:15:00Z#o{i}", 1 + rng.next(28), rng.next(24)))
            } else if kind == 8 {
                (format!("ORG#org{cust}"), format!("PROJECT#2026-10-{:02}#p{i}", 1 + rng.next(28)))
            } else {
                (format!("CUST#c{cust}"), "PROFILE".to_string())
            };
            let image = |status: &str, total: u64| {
                format!(
                    r#"{{"PK":{{"S":"{pk}"}},"SK":{{"S":"{sk}"}},"status":{{"S":"{status}"}},"total":{{"N":"{}.{:02}"}},"sku":{{"S":"SKU-{}"}}}}"#,
                    total / 100,
                    total % 100,
                    total % 977
                )
            };
            let event = rng.next(10);
            let old = image(statuses[rng.next(4) as usize], rng.next(100_000));
            let new = image(statuses[rng.next(4) as usize], rng.next(100_000));
            let (name, images, identity) = match event {
                0..=4 => ("INSERT", format!(r#""NewImage":{new}"#), ""),
                5..=8 => ("MODIFY", format!(r#""NewImage":{new},"OldImage":{old}"#), ""),
                _ => ("REMOVE", format!(r#""OldImage":{old}"#), r#","userIdentity":{"type":"Service","principalId":"dynamodb.amazonaws.com"}"#),
            };
            format!(
                r#"{{"eventID":"{i:032x}","eventName":"{name}","eventVersion":"1.1","eventSource":"aws:dynamodb","awsRegion":"us-east-1","dynamodb":{{"ApproximateCreationDateTime":1764496800,"Keys":{{"PK":{{"S":"{pk}"}},"SK":{{"S":"{sk}"}}}},{images},"SequenceNumber":"{:021}","SizeBytes":480,"StreamViewType":"NEW_AND_OLD_IMAGES"}}{identity}}}"#,
                i + 1
            )
        })
        .collect()
}

/// A record as the SDK's GetRecords gives it (the service's input), from its JSON form. The
/// bench's records hold S and N attributes only.
fn sdk_record(v: &Value) -> Record {
    let item = |m: &Value| -> HashMap<String, AttributeValue> {
        m.as_object()
            .unwrap()
            .iter()
            .map(|(k, t)| {
                let (ty, x) = t.as_object().unwrap().iter().next().unwrap();
                let x = x.as_str().unwrap().to_string();
                (k.clone(), if ty == "N" { AttributeValue::N(x) } else { AttributeValue::S(x) })
            })
            .collect()
    };
    let d = &v["dynamodb"];
    let mut sr = StreamRecord::builder()
        .approximate_creation_date_time(DateTime::from_secs(d["ApproximateCreationDateTime"].as_i64().unwrap()))
        .set_keys(Some(item(&d["Keys"])))
        .sequence_number(d["SequenceNumber"].as_str().unwrap())
        .size_bytes(d["SizeBytes"].as_i64().unwrap())
        .stream_view_type(StreamViewType::NewAndOldImages);
    if !d["NewImage"].is_null() {
        sr = sr.set_new_image(Some(item(&d["NewImage"])));
    }
    if !d["OldImage"].is_null() {
        sr = sr.set_old_image(Some(item(&d["OldImage"])));
    }
    let mut r = Record::builder()
        .event_id(v["eventID"].as_str().unwrap())
        .event_name(OperationType::from(v["eventName"].as_str().unwrap()))
        .event_version(v["eventVersion"].as_str().unwrap())
        .event_source(v["eventSource"].as_str().unwrap())
        .aws_region(v["awsRegion"].as_str().unwrap())
        .dynamodb(sr.build());
    if let Some(u) = v.get("userIdentity") {
        r = r.user_identity(
            Identity::builder().r#type(u["type"].as_str().unwrap()).principal_id(u["principalId"].as_str().unwrap()).build(),
        );
    }
    r.build()
}

/// Records per second (median of RUNS) of `f` over a fresh copy of `records` each run, the
/// copy made outside the timing: the service owns each page it converts.
fn measure_owned(records: &[Record], mut f: impl FnMut(Vec<Record>) -> usize) -> f64 {
    median(
        (0..RUNS)
            .map(|_| {
                let copy = records.to_vec();
                let start = Instant::now();
                let n = f(copy);
                n as f64 / start.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Records per second of one run of `f`.
fn rate(f: &mut impl FnMut() -> usize) -> f64 {
    let start = Instant::now();
    let n = f();
    n as f64 / start.elapsed().as_secs_f64()
}

/// Runs `f` RUNS times; records per second (median).
fn measure(mut f: impl FnMut() -> usize) -> f64 {
    median((0..RUNS).map(|_| rate(&mut f)).collect())
}

/// Runs `f` and `g` RUNS times each, alternating (ABBA), so that a shared machine's slow
/// moments fall on both; the two medians.
fn measure_side_by_side(mut f: impl FnMut() -> usize, mut g: impl FnMut() -> usize) -> (f64, f64) {
    let (mut a, mut b) = (Vec::with_capacity(RUNS), Vec::with_capacity(RUNS));
    for i in 0..RUNS {
        if i % 2 == 0 {
            a.push(rate(&mut f));
            b.push(rate(&mut g));
        } else {
            b.push(rate(&mut g));
            a.push(rate(&mut f));
        }
    }
    (median(a), median(b))
}

fn main() {
    let config = Config::from_yaml(CONFIG, Vec::<(String, String)>::new()).expect("bench config");
    let engine = config.engine;
    let raw = records();
    let bytes: usize = raw.iter().map(String::len).sum();
    let parsed: Vec<Value> = raw.iter().map(|r| serde_json::from_str(r).unwrap()).collect();

    let parse = measure(|| {
        for r in &raw {
            black_box(serde_json::from_str::<Value>(r).unwrap());
        }
        raw.len()
    });
    let filter_only = measure(|| {
        black_box(parsed.iter().map(|r| engine.rules.iter().filter(|rule| rule.filter_matches(black_box(r))).count()).sum::<usize>());
        parsed.len()
    });
    let pipeline_parsed = measure(|| {
        let mut batch = Coalescer::new();
        for r in &parsed {
            black_box(engine.apply(r, &mut batch));
        }
        black_box(batch.into_targets());
        parsed.len()
    });
    let parse_filter = measure(|| {
        let matched: usize = raw
            .iter()
            .map(|r| {
                let v: Value = serde_json::from_str(r).unwrap();
                engine.rules.iter().filter(|rule| rule.filter_matches(&v)).count()
            })
            .sum();
        black_box(matched);
        raw.len()
    });
    let full = measure(|| {
        let mut batch = Coalescer::new();
        for r in &raw {
            let v: Value = serde_json::from_str(r).unwrap();
            black_box(engine.apply(&v, &mut batch));
        }
        black_box(batch.into_targets());
        raw.len()
    });
    // The service's evaluate phase: SDK records converted, then evaluated.
    let sdk: Vec<Record> = parsed.iter().map(sdk_record).collect();
    assert_eq!(record_to_json(sdk[0].clone()).unwrap(), parsed[0], "the SDK form converts back to the same record");
    let convert = measure_owned(&sdk, |records| {
        let n = records.len();
        for r in records {
            black_box(record_to_json(r).unwrap());
        }
        n
    });
    let from_sdk = measure_owned(&sdk, |records| {
        let n = records.len();
        let mut batch = Coalescer::new();
        for r in records {
            let v = record_to_json(r).unwrap();
            black_box(engine.apply(&v, &mut batch));
        }
        black_box(batch.into_targets());
        n
    });
    let matched = parsed.iter().filter(|r| engine.rules.iter().any(|rule| rule.filter_matches(r))).count();
    let mut batch = Coalescer::new();
    for r in &parsed {
        engine.apply(r, &mut batch);
    }
    let writes = batch.into_targets().len();

    // The matchers side by side: both start from the raw bytes of each record.
    let ours: Vec<Pattern> = SHARED_PATTERNS.iter().map(|p| Pattern::parse(p, PatternOptions::default()).expect("pattern")).collect();
    let mut q = quamina::Quamina::<usize>::new();
    for (i, p) in SHARED_PATTERNS.iter().enumerate() {
        q.add_pattern(i, p).expect("quamina pattern");
    }
    let ours_matches: usize = parsed.iter().map(|r| ours.iter().filter(|p| p.matches(r)).count()).sum();
    let quamina_matches: usize = raw.iter().map(|r| q.matches_for_event(r.as_bytes()).map_or(0, |m| m.len())).sum();
    let sets: Vec<PatternSet> = ours.iter().map(|p| PatternSet::new(vec![p.clone()])).collect();
    let text_matcher = RawMatcher::new(&sets);
    let text_count = |r: &String| text_matcher.matching(r).expect("record JSON").count();
    let text_matches: usize = raw.iter().map(text_count).sum();
    let ours_raw = measure(|| {
        let n: usize = raw
            .iter()
            .map(|r| {
                let v: Value = serde_json::from_str(r).unwrap();
                ours.iter().filter(|p| p.matches(&v)).count()
            })
            .sum();
        black_box(n);
        raw.len()
    });
    let ours_parsed = measure(|| {
        black_box(parsed.iter().map(|r| ours.iter().filter(|p| p.matches(black_box(r))).count()).sum::<usize>());
        parsed.len()
    });
    let (ours_text, quamina_raw) = measure_side_by_side(
        || {
            black_box(raw.iter().map(|r| text_count(black_box(r))).sum::<usize>());
            raw.len()
        },
        || {
            black_box(raw.iter().map(|r| q.matches_for_event(black_box(r.as_bytes())).map_or(0, |m| m.len())).sum::<usize>());
            raw.len()
        },
    );

    println!(
        "Pipeline: {RECORDS} records, {} bytes on average, {} rules; {matched} records match a rule; {writes} coalesced target writes.",
        bytes / RECORDS,
        engine.rules.len()
    );
    println!("One core, median of {RUNS} runs.");
    println!();
    println!("| stage | records/s | vs parse only |");
    println!("|---|---:|---:|");
    for (name, rate) in [
        ("parse only (raw JSON to serde_json::Value)", parse),
        ("pattern matching only (5 filters, parsed records)", filter_only),
        ("filter + deltas + coalesce (parsed records)", pipeline_parsed),
        ("parse + filter", parse_filter),
        ("parse + filter + deltas + coalesce", full),
    ] {
        println!("| {name} | {rate:.0} | {:.0}% |", 100.0 * rate / parse);
    }
    println!();
    println!("ratio full/parse: {:.1}%", 100.0 * full / parse);
    println!();
    println!("The service's evaluate phase, from the SDK's GetRecords records (one core, median of {RUNS} runs):");
    println!();
    println!("| stage | records/s | µs per record |");
    println!("|---|---:|---:|");
    for (name, rate) in
        [("SDK record to the JSON shape only", convert), ("SDK record to the JSON shape + filter + deltas + coalesce", from_sdk)]
    {
        println!("| {name} | {rate:.0} | {:.2} |", 1e6 / rate);
    }
    println!();
    println!("evaluate per record: {:.2} µs (from SDK records)", 1e6 / from_sdk);
    println!();
    println!(
        "Pattern matching side by side, same 5 patterns, same {RECORDS} records (matches: ours {ours_matches}, from text {text_matches}, quamina {quamina_matches}):"
    );
    println!();
    println!("| matcher | records/s |");
    println!("|---|---:|");
    println!("| ddb-aggregator, from raw JSON (one pass over the text, named fields only: `RawMatcher`) | {ours_text:.0} |");
    println!("| ddb-aggregator, from raw JSON (serde_json parse into a tree + match) | {ours_raw:.0} |");
    println!("| ddb-aggregator, records already parsed (the service's case) | {ours_parsed:.0} |");
    println!("| quamina 0.6.0, from raw JSON (its own flattener) | {quamina_raw:.0} |");
    println!();
    println!("ratio match/quamina: {:.2}x (both from raw JSON)", ours_text / quamina_raw);
    println!("ratio tree/quamina: {:.2}x (parse into a tree, then match)", ours_raw / quamina_raw);
    assert_eq!(ours_matches, quamina_matches, "the two matchers disagree on these patterns");
    assert_eq!(text_matches, ours_matches, "matching from text disagrees with matching the tree");
}
