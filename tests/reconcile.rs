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
    set_value(c, table, pk, sk, attr, AttributeValue::N(value.into())).await;
}

async fn set_text(c: &aws_sdk_dynamodb::Client, table: &str, pk: &str, sk: &str, attr: &str, value: &str) {
    set_value(c, table, pk, sk, attr, AttributeValue::S(value.into())).await;
}

async fn set_value(c: &aws_sdk_dynamodb::Client, table: &str, pk: &str, sk: &str, attr: &str, value: AttributeValue) {
    c.update_item()
        .table_name(table)
        .key("PK", AttributeValue::S(pk.into()))
        .key("SK", AttributeValue::S(sk.into()))
        .update_expression("SET #a = :v")
        .expression_attribute_names("#a", attr)
        .expression_attribute_values(":v", value)
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

/// A Pushgateway stand-in on loopback: takes one request (bounded: 120 s), answers 200, and
/// returns what it received.
fn capture_one_push() -> (u16, std::thread::JoinHandle<String>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let handle = std::thread::spawn(move || {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            let Ok((mut conn, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            };
            conn.set_nonblocking(false).unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let text = String::from_utf8_lossy(&got).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("Content-Length: "))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if body.len() >= len {
                        break;
                    }
                }
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
            return String::from_utf8_lossy(&got).to_string();
        }
        String::new()
    });
    (port, handle)
}

/// `n` finished leases of long-gone shards for the table's stream, as a stream's history
/// leaves them.
async fn finished_leases(c: &aws_sdk_dynamodb::Client, table: &str, state: &str, n: u32) {
    let arn = c.describe_table().table_name(table).send().await.unwrap().table().unwrap().latest_stream_arn().unwrap().to_string();
    let created = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64) - 3 * 86_400_000;
    for chunk in (0..n).collect::<Vec<_>>().chunks(25) {
        let reqs: Vec<WriteRequest> = chunk
            .iter()
            .map(|i| {
                let put = PutRequest::builder()
                    .item("shard_id", AttributeValue::S(format!("shardId-{created:020}-{i:08x}")))
                    .item("stream_arn", AttributeValue::S(arn.clone()))
                    .item("checkpoint", AttributeValue::S("SHARD_END".into()))
                    .item("counter", AttributeValue::N("1".into()))
                    .build()
                    .unwrap();
                WriteRequest::builder().put_request(put).build()
            })
            .collect();
        c.batch_write_item().request_items(state, reqs).send().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_service_stopped_reconcile_catches_up_and_touches_no_user_attribute() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("stopped");
    let state = format!("{table}-state");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &state, "2s");
    let mut svc = Service::start(&config, dir.path(), "svc", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    workload(&c, &table, 400, 20, 4, 31).await;
    wait_exact(&c, &table, Duration::from_secs(60)).await;
    // The service dies holding its leases; writes go on with nobody reading them.
    svc.kill();
    workload(&c, &table, 200, 20, 4, 32).await;
    // Drift on c3, next to 300 ledger entries of another deployment (a condition with one
    // term per entry would pass DynamoDB's 4 KB expression limit); user attributes on c1
    // whose names `orders_{status}` could form; 1,000 finished leases in the state table.
    set_number(&c, &table, "CUST#c3", "PROFILE", "revenue", "999999").await;
    let mut entries =
        c.update_item().table_name(&table).key("PK", AttributeValue::S("CUST#c3".into())).key("SK", AttributeValue::S("PROFILE".into()));
    let mut sets = Vec::new();
    for i in 0..300 {
        sets.push(format!("#e{i} = :e"));
        entries = entries.expression_attribute_names(format!("#e{i}"), format!("_agg:other:00000001700000000000-{i:08x}"));
    }
    entries
        .update_expression(format!("SET {}", sets.join(", ")))
        .expression_attribute_values(":e", AttributeValue::S("x".repeat(30)))
        .send()
        .await
        .unwrap();
    set_text(&c, &table, "CUST#c1", "PROFILE", "orders_note", "vip").await;
    set_number(&c, &table, "CUST#c1", "PROFILE", "orders_cap", "10").await;
    finished_leases(&c, &table, &state, 1000).await;

    let o = reconcile(&config, &["--customer", "c3", "--output", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let items = scan(&c, &table).await;
    let (truth, stored) = (truth(&items), aggregates(&items));
    let c3 = |v: &Values| v.iter().filter(|(k, _)| k.0 == "CUST#c3").map(|(k, v)| (k.2.clone(), *v)).collect::<Vec<_>>();
    assert_eq!(c3(&stored), c3(&truth), "c3 is exact, the 200 writes nobody read included");
    // Reconcile read the shards itself: every other target caught up through the ledger.
    let wrong: Vec<_> = truth.iter().filter(|(k, v)| k.0 != "CUST#c1" && stored.get(*k) != Some(*v)).collect();
    assert!(wrong.is_empty(), "{wrong:?}");

    // Drift on a daily total, for --all (no variable determines it).
    let sales = truth.keys().find(|k| k.0.starts_with("SALES#") && k.2 == "orders").unwrap().clone();
    set_number(&c, &table, &sales.0, "TOTAL", "orders", "12345").await;
    let (port, pushed) = capture_one_push();
    let gateway = format!("http://127.0.0.1:{port}");
    for args in [&["--customer", "c1"][..], &["--all", "--read-capacity", "5000", "--pushgateway", &gateway][..]] {
        let o = reconcile(&config, args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", text(&o));
        let c1 = get(&c, &table, "CUST#c1", "PROFILE").await;
        assert_eq!(c1.get("orders_note").and_then(|v| v.as_s().ok()).map(String::as_str), Some("vip"), "{args:?}");
        assert_eq!(n(&c1, "orders_cap"), "10", "{args:?}: a user's number is not reconcile's");
    }
    let items = scan(&c, &table).await;
    assert_eq!(aggregates(&items).get(&sales), common::truth(&items).get(&sales), "--all fixed the daily total");
    // The --all run pushed its results, as the nightly CronJob does.
    let pushed = pushed.join().unwrap();
    assert!(pushed.contains("\nddb_aggregator_reconcile_job_corrections 1\n"), "{pushed}");
    assert!(pushed.starts_with("POST /metrics/job/ddb-aggregator-reconcile HTTP/1.1"), "{pushed}");
    assert!(pushed.contains("\nddb_aggregator_reconcile_job_succeeded 1\n"), "{pushed}");
    assert!(pushed.contains("\nddb_aggregator_reconcile_last_success_timestamp_seconds "), "{pushed}");
    // Its leases are released with checkpoints, for `run` to go on from.
    let held: Vec<_> = leases(&c, &state).await.into_iter().filter(|l| l.2.as_deref().is_some_and(|c| c != "SHARD_END")).collect();
    assert!(!held.is_empty() && held.iter().all(|l| l.1.is_none()), "{held:?}");
    c.update_item()
        .table_name(&table)
        .key("PK", AttributeValue::S("CUST#c1".into()))
        .key("SK", AttributeValue::S("PROFILE".into()))
        .update_expression("REMOVE orders_note, orders_cap")
        .send()
        .await
        .unwrap();
    // `run` again, more writes: nothing reconcile applied is applied twice.
    let svc = Service::start(&config, dir.path(), "again", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    workload(&c, &table, 100, 20, 2, 33).await;
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
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
    // At least 30 s and at least 3 runs (a loaded machine makes each run slower), at most 20.
    while (started.elapsed() < Duration::from_secs(30) || injected < 3) && runs < 20 {
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
    // The replay works with the service stopped, and leaves nothing for it to apply twice.
    drop(svc);
    put("ORDER#2026-11-30#o2", AttributeValue::N("5".into())).await.unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"))
        .args(["dlq", "replay", "--config"])
        .arg(&config)
        .envs(aws_env())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("2 letter(s) replayed and deleted"), "{}", text(&o));
    wait_exact(&c, &table, Duration::from_secs(10)).await;
    assert_eq!(n(&get(&c, &table, "CUST#c1", "PROFILE").await, "revenue"), "27");
    assert!(drain_queue(&sqs, &queue).await.is_empty(), "replayed letters are deleted");
    let svc = Service::start(&config, dir.path(), "again", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    put("ORDER#2026-11-30#o3", AttributeValue::N("1".into())).await.unwrap();
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
    assert_eq!(n(&get(&c, &table, "CUST#c1", "PROFILE").await, "revenue"), "28", "nothing applied twice");
}

/// A first-ever `reconcile --all` (the backfill) on a deployment that starts at `latest` reads
/// the shards itself; the checkpoints it leaves must let `run` go on without a gap: orders
/// written between the backfill and the first `run` are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_before_the_first_run_leaves_no_gap() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();
    let table = unique("gap");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let text_config = std::fs::read_to_string(&config).unwrap().replace("start_position: trim_horizon", "start_position: latest");
    std::fs::write(&config, text_config).unwrap();
    workload(&c, &table, 300, 20, 4, 41).await;
    let o = reconcile(&config, &["--all", "--output", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let items = scan(&c, &table).await;
    assert_eq!(aggregates(&items), common::truth(&items), "the backfill is exact");
    // Nobody reads the stream now; then the service starts for the first time.
    workload(&c, &table, 150, 20, 4, 42).await;
    let svc = Service::start(&config, dir.path(), "first", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
}
