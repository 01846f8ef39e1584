//! Reconcile on the local emulators: drift found and fixed exactly by `reconcile --customer`,
//! `--all` and the schedule; `--dry-run` writes nothing; no false corrections while writers
//! race it; the backfill of a table that already has data; `dlq replay`.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::{AttributeValue, PutRequest, WriteRequest};
use common::*;
use serde_json::Value;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn reconcile(config: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"))
        .arg("reconcile")
        .arg("--config")
        .arg(config)
        .args(args)
        .envs(aws_env())
        .output()
        .expect("run reconcile")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The summary line of `--output json`.
fn summary(o: &Output) -> Value {
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or("{}");
    serde_json::from_str::<Value>(last).unwrap_or(Value::Null)["summary"].clone()
}

async fn set_number(c: &aws_sdk_dynamodb::Client, table: &str, pk: &str, sk: &str, attr: &str, value: &str) {
    c.update_item()
        .table_name(table)
        .key("PK", AttributeValue::S(pk.into()))
        .key("SK", AttributeValue::S(sk.into()))
        .update_expression("SET #a = :v")
        .expression_attribute_names("#a", attr)
        .expression_attribute_values(":v", AttributeValue::N(value.into()))
        .send()
        .await
        .unwrap();
}

fn n(item: &std::collections::HashMap<String, AttributeValue>, attr: &str) -> String {
    item.get(attr).and_then(|v| v.as_n().ok()).cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn customer_all_dry_run_and_schedule_fix_drift_exactly() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("recon");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let svc = Service::start(&config, dir.path(), "svc", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    workload(&c, &table, 600, 20, 4, 11).await;
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    let truth_c3 = get(&c, &table, "CUST#c3", "PROFILE").await;

    // Drift: two attributes of c3, one of a daily total.
    set_number(&c, &table, "CUST#c3", "PROFILE", "revenue", "999999").await;
    set_number(&c, &table, "CUST#c3", "PROFILE", "orderCount", "1").await;
    let sales = aggregates(&scan(&c, &table).await).into_keys().find(|k| k.0.starts_with("SALES#") && k.2 == "orders").unwrap();
    set_number(&c, &table, &sales.0, "TOTAL", "orders", "12345").await;

    // --dry-run reports, exits 1, writes nothing.
    let o = reconcile(&config, &["--customer", "c3", "--dry-run", "--output", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(summary(&o)["drifts"], 2, "{}", text(&o));
    assert_eq!(summary(&o)["corrected"], 0);
    assert_eq!(n(&get(&c, &table, "CUST#c3", "PROFILE").await, "revenue"), "999999", "dry run wrote nothing");

    // --customer fixes exactly the customer's targets.
    let o = reconcile(&config, &["--customer", "c3"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("2 drift(s), 2 corrected"), "{}", text(&o));
    let fixed = get(&c, &table, "CUST#c3", "PROFILE").await;
    assert_eq!(n(&fixed, "revenue"), n(&truth_c3, "revenue"));
    assert_eq!(n(&fixed, "orderCount"), n(&truth_c3, "orderCount"));
    assert_eq!(n(&get(&c, &table, &sales.0, "TOTAL").await, "orders"), "12345", "not determined by --customer");

    // --all finds the rest.
    let o = reconcile(&config, &["--all", "--output", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(summary(&o)["corrected"], 1, "{}", text(&o));
    wait_exact(&c, &table, Duration::from_secs(5)).await;

    // A customer whose last order is deleted: its counters go to zero (and stay exact).
    let orders: Vec<_> = scan(&c, &table)
        .await
        .into_iter()
        .filter(|i| i["PK"].as_s().is_ok_and(|p| p == "CUST#c5") && i["SK"].as_s().is_ok_and(|s| s.starts_with("ORDER#")))
        .collect();
    assert!(!orders.is_empty());
    for o in &orders {
        c.delete_item().table_name(&table).key("PK", o["PK"].clone()).key("SK", o["SK"].clone()).send().await.unwrap();
    }
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    set_number(&c, &table, "CUST#c5", "PROFILE", "orderCount", "3").await;
    let o = reconcile(&config, &["--customer", "c5"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(n(&get(&c, &table, "CUST#c5", "PROFILE").await, "orderCount"), "0", "no order left: zero");
    drop(svc);

    // The schedule inside `run` finds drift in targets touched since its last run.
    let svc = Service::start(&config, dir.path(), "scheduled", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "3s")]);
    let pk = "CUST#c7";
    c.put_item()
        .table_name(&table)
        .item("PK", AttributeValue::S(pk.into()))
        .item("SK", AttributeValue::S("ORDER#2026-11-03#sched".into()))
        .item("status", AttributeValue::S("PAID".into()))
        .item("total", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap();
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    set_number(&c, &table, pk, "PROFILE", "revenue", "-5").await;
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
    let m = svc.metrics();
    assert!(metric(&m, "ddb_aggregator_reconcile_corrections_total") >= 1.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_racing_writers_never_corrects_a_right_value() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("race");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let _svc = Service::start(&config, dir.path(), "svc", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    workload(&c, &table, 200, 10, 2, 21).await;
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    // A writer keeps changing orders of the same 20 customers (about 10 writes/s) for the
    // whole run; it stops by itself after 90 s at most.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, table, stop) = (c.clone(), table.clone(), stop.clone());
        tokio::spawn(async move {
            let mut writes = 0;
            for round in 0..90u64 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                writes += workload(&c, &table, 10, 20, 1, 100 + round).await;
                tokio::time::sleep(Duration::from_millis(800)).await;
            }
            writes
        })
    };
    let started = Instant::now();
    let (mut injected, mut corrected, mut runs) = (0u64, 0u64, 0u64);
    let attrs = ["revenue", "orderCount", "openOrders"];
    while started.elapsed() < Duration::from_secs(30) {
        // Now and then, one drift on a (customer, attribute) not drifted before.
        {
            let k = injected as usize;
            set_number(&c, &table, &format!("CUST#c{}", k % 20), "PROFILE", attrs[(k / 20) % 3], "-77777").await;
            injected += 1;
        }
        let o = reconcile(&config, &["--all", "--rounds", "2", "--output", "json"]);
        runs += 1;
        let s = summary(&o);
        assert!(s.is_object(), "{}", text(&o));
        corrected += s["corrected"].as_u64().unwrap_or(0);
        // Drift on a target that keeps changing is reported, not forced: corrected later.
        let not_quiet = s["not_quiet"].as_array().map_or(0, Vec::len);
        assert!(o.status.code() == Some(0) || not_quiet > 0, "{}", text(&o));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.await.unwrap();
    // Settle: the stream applied, then reconcile until nothing is left.
    wait_for_stream(&c, &table).await;
    for _ in 0..3 {
        let o = reconcile(&config, &["--all", "--output", "json"]);
        corrected += summary(&o)["corrected"].as_u64().unwrap_or(0);
        if o.status.code() == Some(0) {
            break;
        }
    }
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    println!(
        "{runs} reconcile runs over {:.0}s while {writes} writes raced them: {injected} drifts injected, {corrected} corrected",
        started.elapsed().as_secs_f64()
    );
    assert!(injected >= 3);
    assert_eq!(corrected, injected, "reconcile corrected exactly the injected drifts, never a right value");
}

/// Waits until the aggregates equal the truth apart from injected drift: used after the
/// writers stop, before the last reconcile (bounded).
async fn wait_for_stream(c: &aws_sdk_dynamodb::Client, table: &str) {
    let started = Instant::now();
    let mut last = None;
    loop {
        let now = aggregates(&scan(c, table).await);
        if last.as_ref() == Some(&now) || started.elapsed() > Duration::from_secs(30) {
            return;
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_of_20000_existing_orders() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("backfill");
    create_source_table(&c, &table).await;
    // 20,000 orders before any consumer exists.
    let mut batches = Vec::new();
    for chunk in 0..800u32 {
        let reqs: Vec<WriteRequest> = (0..25u32)
            .map(|i| {
                let n = chunk * 25 + i;
                let put = PutRequest::builder()
                    .item("PK", AttributeValue::S(format!("CUST#c{}", n % 300)))
                    .item("SK", AttributeValue::S(format!("ORDER#2026-10-{:02}#o{n}", 1 + n % 28)))
                    .item("status", AttributeValue::S(["PENDING", "PAID", "SHIPPED"][(n % 3) as usize].into()))
                    .item("total", AttributeValue::N(format!("{}.{:02}", n % 500, n % 100)))
                    .build()
                    .unwrap();
                WriteRequest::builder().put_request(put).build()
            })
            .collect();
        batches.push(reqs);
    }
    let mut handles = Vec::new();
    for part in batches.chunks(100) {
        let c = c.clone();
        let table = table.clone();
        let part = part.to_vec();
        handles.push(tokio::spawn(async move {
            for reqs in part {
                let mut pending = Some(reqs);
                for _ in 0..20 {
                    let Some(r) = pending.take() else { break };
                    let out = c.batch_write_item().request_items(&table, r).send().await.unwrap();
                    pending = out.unprocessed_items().and_then(|u| u.get(&table)).filter(|v| !v.is_empty()).cloned();
                }
                assert!(pending.is_none(), "unprocessed items left");
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    // The service starts at the stream's tip (start_position: latest), then reconcile --all
    // builds every aggregate from the items.
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let _svc = Service::start(
        &config,
        dir.path(),
        "svc",
        &[("DDB_AGGREGATOR__SOURCE__START_POSITION", "latest"), ("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")],
    );
    let o = reconcile(&config, &["--all", "--segments", "4", "--output", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = summary(&o);
    let items = s["items_read"].as_f64().unwrap();
    let secs = s["seconds"].as_f64().unwrap();
    println!("backfill: {items} items read in {secs:.1}s ({:.0} items/s), {} attributes written", items / secs, s["corrected"]);
    assert!(items >= 20_000.0);
    wait_exact(&c, &table, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_after_fixing_a_poison_item() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("replay");
    create_source_table(&c, &table).await;
    let sqs = sqs_client_at(&sqs_endpoint());
    let queue = create_queue(&sqs, &format!("{table}-dlq")).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let text_config = std::fs::read_to_string(&config).unwrap().replace(&format!("{}/000000000000/{table}-dlq", sqs_endpoint()), &queue);
    std::fs::write(&config, text_config).unwrap();
    let svc = Service::start(&config, dir.path(), "svc", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    let put = |sk: &str, total: AttributeValue| {
        c.put_item()
            .table_name(&table)
            .item("PK", AttributeValue::S("CUST#c1".into()))
            .item("SK", AttributeValue::S(sk.into()))
            .item("status", AttributeValue::S("PAID".into()))
            .item("total", total)
            .send()
    };
    put("ORDER#2026-11-30#o1", AttributeValue::N("10".into())).await.unwrap();
    put("ORDER#2026-11-30#bad", AttributeValue::S("12 EUR".into())).await.unwrap();
    let started = Instant::now();
    while metric(&svc.metrics(), "ddb_aggregator_dead_letters_total") < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Fix the item: the fix is itself poison (its old image is), so it is queued too.
    put("ORDER#2026-11-30#bad", AttributeValue::N("12".into())).await.unwrap();
    while metric(&svc.metrics(), "ddb_aggregator_dead_letters_total") < 2.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let profile = get(&c, &table, "CUST#c1", "PROFILE").await;
    assert_eq!(n(&profile, "revenue"), "10", "the poison order is not in the aggregates yet");
    let o = Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"))
        .args(["dlq", "replay", "--config"])
        .arg(&config)
        .envs(aws_env())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("2 letter(s) replayed and deleted"), "{}", text(&o));
    wait_exact(&c, &table, Duration::from_secs(10)).await;
    assert_eq!(n(&get(&c, &table, "CUST#c1", "PROFILE").await, "revenue"), "22");
    assert!(drain_queue(&sqs, &queue).await.is_empty(), "replayed letters are deleted");
}
