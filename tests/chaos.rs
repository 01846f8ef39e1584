//! Chaos: the default workload runs for a set time against three replicas while every AWS
//! call they make (DynamoDB, its stream, SQS) goes through proxies that inject faults at 5%
//! (5xx, throttling, expired iterators, connections dropped before and after the call took
//! effect, delays); replicas are killed with SIGKILL and restarted, others stopped with
//! SIGTERM and replaced (a rolling deploy). Afterwards every aggregate must equal the truth
//! and the dead-letter queue must hold every poison record written.
//!
//! `CHAOS_SECONDS` (default 40) sets the length and `CHAOS_FAULT_RATE` (default 0.05) the
//! fault rate; `scripts/chaos` runs the long form and prints the same figures.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use common::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Writes orders at `rate` per second until `stop`: inserts, status and total changes,
/// deletes, and every 97th write a poison order of one of three kinds. Returns
/// (writes, poison order keys with their expected reason).
async fn writer(
    c: aws_sdk_dynamodb::Client,
    table: String,
    rate: u64,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> (u64, BTreeMap<String, String>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut orders: Vec<(String, String)> = Vec::new();
    let mut poison = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    let statuses = ["PENDING", "PAID", "SHIPPED", "CANCELLED"];
    let mut n = 0u64;
    // Bounded by the stop flag, and in any case by two hours of writes.
    while !stop.load(Ordering::Relaxed) && n < rate * 7200 {
        tick.tick().await;
        n += 1;
        let pk = format!("CUST#c{}", rng.u32(0..60));
        let total = AttributeValue::N(format!("{}.{:02}", rng.u32(0..500), rng.u32(0..100)));
        let put = |sk: String, status: &str, total: AttributeValue| {
            c.put_item()
                .table_name(&table)
                .item("PK", AttributeValue::S(pk.clone()))
                .item("SK", AttributeValue::S(sk))
                .item("status", AttributeValue::S(status.into()))
                .item("total", total)
                .send()
        };
        let roll = rng.u32(0..100);
        let result = if n.is_multiple_of(97) {
            let (sk, status, total, reason) = match (n / 97) % 3 {
                0 => (format!("ORDER#2026-11-30#p{n}"), "PAID", AttributeValue::S("12 EUR".into()), "non_numeric_sum"),
                1 => (format!("ORDER#2026-11-30#p{n}"), "ON#HOLD", AttributeValue::N("3".into()), "key_delimiter"),
                _ => (format!("ORDER#someday#p{n}"), "PAID", AttributeValue::N("4".into()), "bad_timestamp"),
            };
            poison.insert(format!("{pk}|{sk}"), reason.to_string());
            put(sk, status, total).await.map(|_| ()).map_err(|e| format!("{e:?}"))
        } else if roll < 40 || orders.is_empty() {
            let sk = format!("ORDER#2026-11-{:02}#o{n}", rng.u32(1..29));
            orders.push((pk.clone(), sk.clone()));
            put(sk, statuses[rng.usize(0..2)], total).await.map(|_| ()).map_err(|e| format!("{e:?}"))
        } else {
            let change = match roll {
                ..70 => Change::Status,
                70..90 => Change::Total,
                _ => Change::Delete,
            };
            change_order(&c, &table, &mut orders, &mut rng, change).await
        };
        result.expect("workload write (straight to DynamoDB Local, no faults)");
    }
    (n, poison)
}

/// The replica's process id in a lease owner (`<host>-<pid>-<random>`).
fn owner_pid(owner: &str) -> Option<u32> {
    owner.rsplit('-').nth(1)?.parse().ok()
}

/// Watches the lease table: the longest time an open shard had no live owner (no owner, an
/// expired lease, or an owner that was killed).
async fn watch_ownership(
    c: aws_sdk_dynamodb::Client,
    state: String,
    alive: Arc<Mutex<HashSet<u32>>>,
    stop: Arc<AtomicBool>,
    longest_ms: Arc<AtomicU64>,
) {
    let mut since: BTreeMap<String, Instant> = BTreeMap::new();
    let mut seen_owned = false;
    for _ in 0..200_000 {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let alive_now = alive.lock().unwrap().clone();
        // The replicas create the state table; until then there is nothing to watch.
        let items = if c.describe_table().table_name(&state).send().await.is_ok() { scan(&c, &state).await } else { Vec::new() };
        for item in items {
            let Some(shard) = item.get("shard_id").and_then(|v| v.as_s().ok()) else { continue };
            if !item.contains_key("stream_arn") || item.get("checkpoint").and_then(|v| v.as_s().ok()).is_some_and(|c| c == "SHARD_END") {
                since.remove(shard);
                continue;
            }
            let owner = item.get("owner").and_then(|v| v.as_s().ok());
            let expires = item.get("expires_at").and_then(|v| v.as_n().ok()).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            let owned = owner.and_then(|o| owner_pid(o)).is_some_and(|pid| alive_now.contains(&pid)) && expires > now_ms;
            seen_owned |= owned;
            if owned {
                if let Some(t) = since.remove(shard) {
                    longest_ms.fetch_max(t.elapsed().as_millis() as u64, Ordering::Relaxed);
                }
            } else if seen_owned {
                since.entry(shard.to_string()).or_insert_with(Instant::now);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_loses_nothing_and_doubles_nothing() {
    let seconds: u64 = env_or("CHAOS_SECONDS", 40u64).clamp(10, 7200);
    let rate: f64 = env_or("CHAOS_FAULT_RATE", 0.05f64).clamp(0.0, 0.5);
    let writes_per_second: u64 = env_or("CHAOS_WRITES_PER_SECOND", 40u64).clamp(1, 500);
    let seed: u64 = env_or("CHAOS_SEED", 11u64);
    let c = client().await;
    let dir = test_dir();
    let table = unique("chaos");
    let state = format!("{table}-state");
    create_source_table(&c, &table).await;
    let sqs = sqs_client_at(&sqs_endpoint());
    let queue = create_queue(&sqs, &format!("{table}-dlq")).await;
    let config = write_config(dir.path(), &table, &state, "2s");
    // Every AWS call of the replicas goes through a proxy; the test's own calls do not.
    let ddb_proxy = common::proxy::start_chaos(ddb_port(), rate, u64::MAX).await;
    let sqs_proxy = common::proxy::start_chaos(sqs_port(), rate, u64::MAX).await;
    let (ddb_url, sqs_url) = (ddb_proxy.endpoint(), sqs_proxy.endpoint());
    let env: Vec<(&str, &str)> = vec![
        ("AWS_ENDPOINT_URL_DYNAMODB", &ddb_url),
        ("AWS_ENDPOINT_URL_DYNAMODB_STREAMS", &ddb_url),
        ("AWS_ENDPOINT_URL_SQS", &sqs_url),
        ("DDB_AGGREGATOR__DEAD_LETTER__QUEUE_URL", &queue),
        ("DDB_AGGREGATOR__DEAD_LETTER__MAX_ATTEMPTS", "3"),
    ];
    let alive: Arc<Mutex<HashSet<u32>>> = Arc::default();
    let mut started = 0usize;
    // A rolling upgrade (scripts/upgrade-test): every other replica started is another
    // release's binary, so both run side by side through the kills and restarts.
    let other = std::env::var("CHAOS_OTHER_BINARY").ok().filter(|b| !b.is_empty());
    let mut launch = |alive: &Arc<Mutex<HashSet<u32>>>| {
        started += 1;
        let name = format!("replica{started}");
        let s = match other.as_deref().filter(|_| started % 2 == 1) {
            Some(binary) => Service::start_binary(std::path::Path::new(binary), &config, dir.path(), &format!("{name}-other"), &env),
            None => Service::start(&config, dir.path(), &name, &env),
        };
        alive.lock().unwrap().insert(s.pid());
        s
    };
    let mut replicas: Vec<Service> = (0..3).map(|_| launch(&alive)).collect();

    let stop_writes = Arc::new(AtomicBool::new(false));
    let writes = tokio::spawn(writer(c.clone(), table.clone(), writes_per_second, stop_writes.clone(), seed));
    let stop_watch = Arc::new(AtomicBool::new(false));
    let longest_unowned = Arc::new(AtomicU64::new(0));
    let watcher = tokio::spawn(watch_ownership(c.clone(), state.clone(), alive.clone(), stop_watch.clone(), longest_unowned.clone()));

    // Kills and rolling restarts at random moments until the time is up; the first two
    // actions are one of each, so even the short form has both.
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut kills, mut rolling, mut unexpected_exits) = (0u32, 0u32, 0u32);
    let mut sigterm_codes: Vec<Option<i32>> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut action = 0u32;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.u64(1500..5000))).await;
        // A replica that exited by itself (it should not) is counted and replaced.
        for r in replicas.iter_mut() {
            if let Ok(Some(_)) = r.child.try_wait() {
                unexpected_exits += 1;
                alive.lock().unwrap().remove(&r.pid());
                *r = launch(&alive);
            }
        }
        let i = rng.usize(0..replicas.len());
        if action == 0 || (action > 1 && rng.u8(0..10) < 6) {
            alive.lock().unwrap().remove(&replicas[i].pid());
            replicas[i].kill();
            kills += 1;
            tokio::time::sleep(Duration::from_millis(rng.u64(200..3000))).await;
        } else {
            let (code, _) = replicas[i].terminate();
            alive.lock().unwrap().remove(&replicas[i].pid());
            sigterm_codes.push(code);
            rolling += 1;
        }
        replicas[i] = launch(&alive);
        action += 1;
    }
    stop_writes.store(true, Ordering::Relaxed);
    let (written, poison) = writes.await.unwrap();
    let last_write = Instant::now();

    // Everything applied, nothing twice: aggregates against the truth over the good records.
    let (mut got, mut want) = (Values::new(), Values::new());
    for _ in 0..360 {
        let items = scan(&c, &table).await;
        let orders: Vec<_> = items.iter().filter(|i| i["SK"].as_s().is_ok_and(|s| s.starts_with("ORDER#"))).cloned().collect();
        (got, want) = (aggregates(&items), truth_without_poison(&orders));
        if got == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settle = last_write.elapsed();
    stop_watch.store(true, Ordering::Relaxed);
    watcher.await.unwrap();
    let keys: BTreeSet<_> = want.keys().chain(got.keys()).cloned().collect();
    let differing: Vec<_> = keys.iter().filter(|k| want.get(*k) != got.get(*k)).collect();
    // Count attributes tell lost from doubled records.
    let (mut lost, mut doubled) = (0i64, 0i64);
    for k in keys.iter().filter(|k| k.2 == "orderCount" || k.2 == "orders") {
        let diff = got.get(k).and_then(|v| v.trunc_i64()).unwrap_or(0) - want.get(k).and_then(|v| v.trunc_i64()).unwrap_or(0);
        if diff < 0 {
            lost -= diff;
        } else {
            doubled += diff;
        }
    }
    // Every poison record in the queue, with its reason; duplicates (a letter sent again by a
    // replica killed before its checkpoint) are counted, not hidden.
    let mut letters: BTreeMap<String, (String, u32)> = BTreeMap::new();
    for _ in 0..60 {
        for (body, _) in drain_queue(&sqs, &queue).await {
            let keys = &body["record"]["dynamodb"]["Keys"];
            let key = format!("{}|{}", keys["PK"]["S"].as_str().unwrap_or(""), keys["SK"]["S"].as_str().unwrap_or(""));
            let reason = body["reason"]["code"].as_str().unwrap_or("").to_string();
            letters.entry(key).or_insert((reason, 0)).1 += 1;
        }
        if letters.len() >= poison.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let duplicates: u32 = letters.values().map(|(_, n)| n - 1).sum();
    let wrong_reason: Vec<_> = letters.iter().filter(|(k, (r, _))| poison.get(*k) != Some(r)).collect();

    let kinds =
        |p: &common::proxy::FaultProxy| p.by_kind.lock().unwrap().iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ");
    let calls = |p: &common::proxy::FaultProxy| p.injected.load(Ordering::SeqCst) + p.forwarded.load(Ordering::SeqCst);
    let injected = ddb_proxy.injected.load(Ordering::SeqCst) + sqs_proxy.injected.load(Ordering::SeqCst);
    let all_calls = calls(&ddb_proxy) + calls(&sqs_proxy);
    println!("chaos: {seconds} s, 3 replicas, lease 2 s, fault rate {:.1}% on every AWS call", rate * 100.0);
    println!("  writes: {written} ({writes_per_second}/s), of which poison: {}", poison.len());
    println!(
        "  AWS calls through the proxies: {all_calls}; faults injected: {injected} ({:.2}%)",
        injected as f64 * 100.0 / all_calls.max(1) as f64
    );
    println!("    DynamoDB + streams ({} calls): {}", calls(&ddb_proxy), kinds(&ddb_proxy));
    println!("    SQS ({} calls): {}", calls(&sqs_proxy), kinds(&sqs_proxy));
    println!(
        "  SIGKILLs: {kills} (each restarted); rolling restarts (SIGTERM + replacement): {rolling}; exit codes on SIGTERM: {:?}; unexpected exits: {unexpected_exits}",
        sigterm_codes.iter().collect::<BTreeSet<_>>()
    );
    println!("  longest time a shard had no live owner: {:.1} s", longest_unowned.load(Ordering::Relaxed) as f64 / 1000.0);
    println!(
        "  aggregate values compared: {}; differing: {} (records lost {lost}, doubled {doubled}); settled {:.1} s after the last write",
        keys.len(),
        differing.len(),
        settle.as_secs_f64()
    );
    println!(
        "  dead letters: {} distinct poison records of {} written; duplicate deliveries {duplicates}; wrong reason {}",
        letters.len(),
        poison.len(),
        wrong_reason.len()
    );
    let tails = || replicas.iter().map(|r| r.log_tail()).collect::<Vec<_>>().join("\n---\n");
    assert!(
        differing.is_empty(),
        "drift: {:?}\n{}",
        differing.iter().take(10).map(|k| (k, got.get(*k).map(|d| d.to_string()), want.get(*k).map(|d| d.to_string()))).collect::<Vec<_>>(),
        tails()
    );
    assert_eq!(letters.keys().collect::<Vec<_>>(), poison.keys().collect::<Vec<_>>(), "every poison record dead-lettered, nothing else");
    assert!(wrong_reason.is_empty(), "{wrong_reason:?}");
    assert!(sigterm_codes.iter().all(|c| *c == Some(0)), "SIGTERM exits 0: {sigterm_codes:?}");
    assert!(kills >= 1 && rolling >= 1, "kills {kills}, rolling {rolling}");
    assert!(rate == 0.0 || ddb_proxy.injected.load(Ordering::SeqCst) > 0, "faults were injected");
    drop(replicas);
}
