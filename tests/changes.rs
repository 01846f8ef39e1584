//! Changes to a running deployment, end to end on DynamoDB Local: a re-keyed rollup rebuilt, a
//! rolling deploy of a rule change (old and new replicas side by side), a rebuild beside a
//! busy target and a user's string, and the source's stream disabled and enabled again (with
//! the service running, and while it is down). Every test compares the aggregate items with
//! the truth computed from a scan of the source table, to the last digit. (Apart from
//! tests/service.rs so that scripts/test runs them beside each other, on emulators of
//! their own.)

mod common;

use std::time::{Duration, Instant};

use common::*;

/// The tests share two CPU cores and one emulator: run them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LEASE: &str = "2s";

fn stream_spec(on: bool) -> aws_sdk_dynamodb::types::StreamSpecification {
    use aws_sdk_dynamodb::types::{StreamSpecification, StreamViewType};
    let b = StreamSpecification::builder().stream_enabled(on);
    (if on { b.stream_view_type(StreamViewType::NewAndOldImages) } else { b }).build().unwrap()
}

/// Scenario i of issue 11: a stream that is disabled and enabled again gets a new ARN. The
/// service follows it, and the changes made while no stream was on (never streamed) are
/// repaired by the reconcile of everything it requests, with the schedule off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_disabled_and_enabled_again_is_followed_and_its_gap_reconciled() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = test_dir();
    let table = unique("restream");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), LEASE);
    let svc = Service::start(&config, dir.path(), "svc", &[("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s")]);
    workload(&c, &table, 300, 20, 4, 11).await;
    // A customer the rest of the test never touches: nothing but the repair writes its item
    // after the switch.
    c.put_item()
        .table_name(&table)
        .item("PK", AttributeValue::S("CUST#quiet".into()))
        .item("SK", AttributeValue::S("ORDER#2026-11-02#q1".into()))
        .item("status", AttributeValue::S("PAID".into()))
        .item("total", AttributeValue::N("7".into()))
        .send()
        .await
        .unwrap();
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
    let arn = |c: aws_sdk_dynamodb::Client, t: String| async move {
        c.describe_table().table_name(t).send().await.unwrap().table().and_then(|t| t.latest_stream_arn().map(str::to_string))
    };
    let old = arn(c.clone(), table.clone()).await;
    c.update_table().table_name(&table).stream_specification(stream_spec(false)).send().await.unwrap();
    workload(&c, &table, 100, 20, 2, 12).await; // never streamed
    c.update_table().table_name(&table).stream_specification(stream_spec(true)).send().await.unwrap();
    let new = arn(c.clone(), table.clone()).await;
    assert_ne!(old, new, "re-enabling gives a new stream ARN");
    workload(&c, &table, 200, 20, 4, 13).await;
    wait_exact_or(&c, &table, Duration::from_secs(150), || svc.log_tail()).await;
    // The values are exact once the aggregates are corrected; the run ends after the copies.
    let started = std::time::Instant::now();
    while metric(&svc.metrics(), "ddb_aggregator_reconcile_runs_total") < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the gap was reconciled\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The repair fenced every target against the old stream's shards, the quiet customer's
    // too (it had no drift): a paused reader of the old stream that wakes now is refused.
    let old_shards: Vec<String> = scan(&c, &format!("{table}-state"))
        .await
        .iter()
        .filter(|l| l.get("stream_arn").and_then(|a| a.as_s().ok()) == old.as_ref())
        .filter_map(|l| l.get("shard_id").and_then(|a| a.as_s().ok()).cloned())
        .collect();
    assert!(!old_shards.is_empty(), "the old stream's leases are in the state table");
    let newest_old = old_shards.iter().filter_map(|id| ddb_aggregator::shard_id::created_ms(id)).max().expect("shard ids carry times");
    for item in scan(&c, &table).await.iter().filter(|i| i.keys().any(|a| a.starts_with("_aggv"))) {
        let floor = item.iter().find(|(a, _)| a.starts_with("_aggfloor:")).and_then(|(_, v)| v.as_s().ok());
        assert!(
            floor.is_some_and(|f| *f > ddb_aggregator::sink::ledger::floor_value(newest_old)),
            "{:?} {:?}: floor {floor:?} still admits the old stream's shards (newest created {newest_old})",
            item.get("PK"),
            item.get("SK")
        );
    }
}

/// The same switch while no replica runs: the first replica to start on the new stream finds
/// in the state table that it read another stream, so it reads the new one from TRIM_HORIZON
/// and requests the repair of the gap itself (no watcher saw the switch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_switched_while_the_service_was_down_is_repaired_when_it_starts() {
    switched_while_down(false).await;
}

/// As above, with the old stream's leases gone from the state table, as they are a day after
/// its shards left the listing (a stream disabled for longer than that): the stream read last
/// is kept apart from the leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_switched_after_its_old_leases_were_deleted_is_still_repaired() {
    switched_while_down(true).await;
}

/// Deletes every lease item (the ones with a `stream_arn`) of a state table.
async fn delete_leases(c: &aws_sdk_dynamodb::Client, state: &str) {
    let items = scan(c, state).await;
    let leases: Vec<_> = items.iter().filter(|i| i.contains_key("stream_arn")).collect();
    assert!(!leases.is_empty(), "the first run left leases");
    for item in leases {
        let key = item["shard_id"].clone();
        c.delete_item().table_name(state).key("shard_id", key).send().await.unwrap();
    }
}

async fn switched_while_down(forget_old_leases: bool) {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let dir = test_dir();
    let table = unique("downswitch");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), LEASE);
    let off = ("DDB_AGGREGATOR__RECONCILE__INTERVAL", "0s");
    let mut svc = Service::start(&config, dir.path(), "before", &[off]);
    workload(&c, &table, 200, 10, 4, 21).await;
    wait_exact_or(&c, &table, Duration::from_secs(60), || svc.log_tail()).await;
    svc.kill();
    if forget_old_leases {
        delete_leases(&c, &format!("{table}-state")).await;
    }
    c.update_table().table_name(&table).stream_specification(stream_spec(false)).send().await.unwrap();
    workload(&c, &table, 60, 10, 2, 22).await; // never streamed
    c.update_table().table_name(&table).stream_specification(stream_spec(true)).send().await.unwrap();
    workload(&c, &table, 60, 10, 2, 23).await; // on the new stream before anyone reads it
                                               // `latest` would skip what the new stream holds: a followed stream starts at its horizon.
    let svc = Service::start(&config, dir.path(), "after", &[off, ("DDB_AGGREGATOR__SOURCE__START_POSITION", "latest")]);
    wait_exact_or(&c, &table, Duration::from_secs(150), || svc.log_tail()).await;
    // The repair's corrections land before its run is counted: wait (bounded) for the count.
    let started = Instant::now();
    while metric(&svc.metrics(), "ddb_aggregator_reconcile_runs_total") < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the gap was reconciled\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `{date|day}` changed to `{date|month}` in a running deployment: the service sees the rule's
/// fingerprint changed and rebuilds it while orders keep coming, ending with every old daily
/// target at zero, every monthly target exact and ddb_aggregator_rule_rebuild_pending back at 0;
/// `validate --against-state` tells beforehand what the deploy rebuilds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_bucket_is_rebuilt_and_the_old_daily_targets_end_at_zero() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let (dir, table, aggregates, config) = deployment(&c, "rebuild", "config/commerce.yaml").await;
    let mut svc = Service::start(&config, dir.path(), "svc", &[]);
    assert!(workload(&c, &table, 600, 10, 2, 23).await >= 600);
    let started = Instant::now();
    while aggregates_of(&c, &aggregates).await != truth(&scan(&c, &table).await) {
        assert!(started.elapsed() < Duration::from_secs(60), "daily targets never caught up\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let days = aggregates_of(&c, &aggregates)
        .await
        .keys()
        .filter(|(pk, _, _)| pk.starts_with("SALES#"))
        .map(|(pk, _, _)| pk.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    assert!(days > 20, "the workload spreads over the month's days: {days}");
    let state = |out: &std::process::Output| String::from_utf8_lossy(&out.stdout).into_owned();
    let check = run_cli(&["validate", "--config", config.to_str().unwrap(), "--against-state"]);
    assert!(state(&check).contains("rule daily-sales: unchanged"), "{}", state(&check));
    svc.terminate();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("SALES#{date|day}", "SALES#{date|month}")).unwrap();
    let check = run_cli(&["validate", "--config", config.to_str().unwrap(), "--against-state"]);
    assert!(state(&check).contains("rule daily-sales: would be rebuilt: changed"), "{}", state(&check));
    assert!(state(&check).contains("rule customer-orders: unchanged"), "{}", state(&check));
    let svc = Service::start(&config, dir.path(), "svc2", &[]);
    // Orders keep coming while the rebuild runs.
    assert!(workload(&c, &table, 200, 10, 2, 29).await >= 200);
    let started = Instant::now();
    loop {
        let pending = metric(&svc.metrics(), "ddb_aggregator_rule_rebuild_pending{rule=\"daily-sales\"}");
        let exact = aggregates_of(&c, &aggregates).await == monthly(truth(&scan(&c, &table).await));
        if exact && pending == 0.0 && svc.log_tail().contains("rule rebuilt") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "no rebuild (pending {pending}, exact {exact})\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The daily items are still there, at zero; the monthly ones hold everything.
    let items = scan(&c, &aggregates).await;
    let daily: Vec<_> = items.iter().filter(|i| i["PK"].as_s().is_ok_and(|p| p.len() == "SALES#2026-11-01".len())).collect();
    assert_eq!(daily.len(), days, "every old daily target was kept and zeroed");
    assert!(daily.iter().all(|i| i["orders"].as_n().is_ok_and(|n| n == "0")), "zeroed");
    let log = std::fs::read_to_string(&svc.log).unwrap_or_default();
    let rebuilt = log.lines().find(|l| l.contains("rule rebuilt")).unwrap_or_default();
    println!("rebuild: {rebuilt}");
    let check = run_cli(&["validate", "--config", config.to_str().unwrap(), "--against-state"]);
    assert!(state(&check).contains("rule daily-sales: unchanged"), "recorded: {}", state(&check));
}

/// The commerce truth with daily-sales bucketed by month (`SALES#2026-11`).
fn monthly(truth: Values) -> Values {
    let mut out: Values = Default::default();
    for ((pk, sk, a), v) in truth {
        let pk = match pk.strip_prefix("SALES#") {
            Some(day) => format!("SALES#{}", &day[..7]),
            None => pk,
        };
        let e = out.entry((pk, sk, a)).or_insert(ddb_aggregator::decimal::Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    }
    out
}

/// The aggregates of `table` (PROFILE and TOTAL items), as [`aggregates`] reads them.
async fn aggregates_of(c: &aws_sdk_dynamodb::Client, table: &str) -> Values {
    aggregates(&scan(c, table).await)
}

/// The commerce truth under `config/commerce.yaml` changed as [`rolling_change`] changes it:
/// `revenue` of the customer profile renamed `spend`, daily sales re-keyed to `MONTHLY#<month>`.
fn renamed_and_monthly(truth: Values) -> Values {
    let mut out: Values = Default::default();
    for ((pk, sk, a), v) in truth {
        let pk = match pk.strip_prefix("SALES#") {
            Some(day) => format!("MONTHLY#{}", &day[..7]),
            None => pk,
        };
        let a = if sk == "PROFILE" && a == "revenue" { "spend".to_string() } else { a };
        let e = out.entry((pk, sk, a)).or_insert(ddb_aggregator::decimal::Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    }
    out
}

/// `reconcile.remove_leftovers_after` of the new replica in [`rolling_change`]: short, so the
/// test sees the zeroed leftovers removed.
const REMOVE_AFTER: &str = "20s";

/// Orders keep arriving for `for_how_long` (bounded: at most 150 chunks of 20 writes).
async fn orders_for(c: &aws_sdk_dynamodb::Client, table: &str, for_how_long: Duration, seed: u64) -> usize {
    let started = Instant::now();
    let mut written = 0;
    for chunk in 0..150 {
        if started.elapsed() >= for_how_long {
            break;
        }
        written += workload(c, table, 20, 10, 2, seed * 100 + chunk).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    written
}

/// A rolling deploy of a rule change, as a Deployment's RollingUpdate runs it: replica A holds
/// the stream with the old config, B starts beside it with the new one (a daily rollup re-keyed
/// to a monthly one under a new prefix, a measure renamed) and both run for a minute while
/// orders arrive; then A gets SIGTERM. With nothing run by hand, every new target ends exact,
/// every old target and the old attribute at 0, and nothing is left to rebuild or retire.
/// `restart_a`: A is killed and started again (old config) in the middle of the overlap.
async fn rolling_change(prefix: &str, restart_a: bool) {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let (dir, table, aggregates, config) = deployment(&c, prefix, "config/commerce.yaml").await;
    let text = std::fs::read_to_string(&config).unwrap();
    let changed = text
        .replace("SALES#{date|day}", "MONTHLY#{date|month}")
        .replace("      revenue: { sum: total }\n", "      spend: { sum: total }\n");
    assert!(changed.contains("spend: { sum: total }") && changed.contains("MONTHLY#"), "the change applies to the example");
    let new_config = dir.path().join("new.yaml");
    std::fs::write(&new_config, changed).unwrap();
    let mut a = Service::start(&config, dir.path(), "a", &[]);
    assert!(workload(&c, &table, 300, 10, 2, 41).await >= 300);
    let started = Instant::now();
    while aggregates_of(&c, &aggregates).await != truth(&scan(&c, &table).await) {
        assert!(started.elapsed() < Duration::from_secs(60), "A never caught up\n{}", a.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let check = run_cli(&["validate", "--config", new_config.to_str().unwrap(), "--against-state"]);
    let plan = String::from_utf8_lossy(&check.stdout).into_owned();
    for line in [
        "rule daily-sales: would be rebuilt: changed",
        "rule customer-orders: would be rebuilt: changed",
        "old definition of rule daily-sales would be retired",
    ] {
        assert!(plan.contains(line), "{line}\n{plan}");
    }
    let b = Service::start(&new_config, dir.path(), "b", &[("DDB_AGGREGATOR__RECONCILE__REMOVE_LEFTOVERS_AFTER", REMOVE_AFTER)]);
    let overlap = Instant::now();
    let mut written = orders_for(&c, &table, Duration::from_secs(if restart_a { 25 } else { 50 }), 1).await;
    if restart_a {
        a.kill();
        a = Service::start(&config, dir.path(), "a2", &[]);
        written += orders_for(&c, &table, Duration::from_secs(25), 2).await;
    }
    let waiting = metric(&b.metrics(), "ddb_aggregator_definitions_waiting{reason=\"committed_replicas_live\"}");
    let (ready, _) = b.get("/readyz");
    println!(
        "overlap: {written} order writes in {:.0} s; B waiting for live replicas of the old definitions: {waiting}",
        overlap.elapsed().as_secs_f64()
    );
    if !restart_a {
        assert_eq!(waiting, 1.0, "B holds no lease while A runs the committed definitions\n{}", b.log_tail());
    }
    assert!(ready.contains("200"), "B is ready while it waits (a RollingUpdate goes on): {ready}\n{}", b.log_tail());
    let (code, took) = a.terminate();
    assert_eq!(code, Some(0), "A drains and exits 0 ({took:?})\n{}", a.log_tail());
    let switched = Instant::now();
    written += orders_for(&c, &table, Duration::from_secs(10), 3).await;
    loop {
        let m = b.metrics();
        let pending: f64 = ["daily-sales", "customer-orders"]
            .iter()
            .map(|r| metric(&m, &format!("ddb_aggregator_rule_rebuild_pending{{rule=\"{r}\"}}")))
            .sum();
        let retire = metric(&m, "ddb_aggregator_definitions_retire_pending");
        let want = renamed_and_monthly(truth(&scan(&c, &table).await));
        let have = aggregates_of(&c, &aggregates).await;
        if have == want && pending == 0.0 && retire == 0.0 {
            break;
        }
        let wrong: Vec<_> = want.iter().filter(|(k, v)| have.get(*k) != Some(*v)).take(3).collect();
        let extra: Vec<_> = have.iter().filter(|(k, _)| !want.contains_key(*k)).take(3).collect();
        assert!(
            switched.elapsed() < Duration::from_secs(180),
            "pending {pending}, retire {retire}, wrong {wrong:?}, left behind {extra:?}\n{}",
            b.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settled = switched.elapsed();
    let items = scan(&c, &aggregates).await;
    let old_daily = items.iter().filter(|i| i["PK"].as_s().is_ok_and(|p| p.starts_with("SALES#"))).count();
    let monthly = items.iter().filter(|i| i["PK"].as_s().is_ok_and(|p| p.starts_with("MONTHLY#"))).count();
    assert!(old_daily > 20 && monthly >= 1, "old daily targets {old_daily}, monthly {monthly}");
    println!(
        "rolling change: {written} order writes during and after the overlap; {old_daily} old daily targets at 0, {monthly} monthly exact; settled {:.1} s after A's SIGTERM",
        settled.as_secs_f64()
    );
    // Once `reconcile.remove_leftovers_after` has passed: the old daily targets and the old
    // attribute are gone, the users' profiles stay, and the aggregates are still exact.
    loop {
        let items = scan(&c, &aggregates).await;
        let old_daily = items.iter().filter(|i| i["PK"].as_s().is_ok_and(|p| p.starts_with("SALES#"))).count();
        let revenue = items.iter().filter(|i| i["SK"].as_s().is_ok_and(|s| s == "PROFILE") && i.contains_key("revenue")).count();
        let removal = metric(&b.metrics(), "ddb_aggregator_definitions_removal_pending");
        if old_daily == 0 && revenue == 0 && removal == 0.0 {
            break;
        }
        assert!(
            switched.elapsed() < settled + Duration::from_secs(120),
            "left after the removal was due: {old_daily} old daily targets, {revenue} profiles with revenue, removal pending {removal}\n{}",
            b.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let removed = metric(&b.metrics(), "ddb_aggregator_definitions_leftovers_removed_total{kind=\"item\"}");
    assert!(removed >= old_daily as f64, "{removed} items removed, {old_daily} old daily targets");
    assert_eq!(aggregates_of(&c, &aggregates).await, renamed_and_monthly(truth(&scan(&c, &table).await)), "exact after the removal");
    println!("rolling change: leftovers removed {:.1} s after A's SIGTERM ({removed} items)", switched.elapsed().as_secs_f64());
    let check = run_cli(&["validate", "--config", new_config.to_str().unwrap(), "--against-state"]);
    let plan = String::from_utf8_lossy(&check.stdout).into_owned();
    assert!(plan.contains("rule daily-sales: unchanged") && !plan.contains("would be retired"), "{plan}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_rule_change_ends_exact_with_nothing_left_behind() {
    rolling_change("rolling", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_rule_change_with_the_old_replica_restarted_midway_ends_exact() {
    rolling_change("rolling-restart", true).await;
}

/// Orders for one customer every second until `stop` (bounded: 600 orders): a target written
/// all through a rebuild (its counter never stays still for a whole pass).
async fn hot_orders(c: aws_sdk_dynamodb::Client, table: String, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> usize {
    use aws_sdk_dynamodb::types::AttributeValue;
    let mut n = 0;
    while n < 600 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        n += 1;
        c.put_item()
            .table_name(&table)
            .item("PK", AttributeValue::S("CUST#c0".into()))
            .item("SK", AttributeValue::S(format!("ORDER#2026-11-15#hot{n}")))
            .item("status", AttributeValue::S("PAID".into()))
            .item("total", AttributeValue::N(format!("{n}.25")))
            .send()
            .await
            .expect("hot order");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    n
}

/// A measure added while one customer gets an order every second and another customer's
/// profile holds a user's string where the new measure goes: the rebuild skips the string at
/// once, corrects the busy target (under a hold when its counter never stays still), and
/// finishes (`ddb_aggregator_rule_rebuild_pending` 0) without starting over. The user's string
/// stays, and everything ends exact with no command run by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_finishes_beside_a_busy_target_and_a_users_string() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let (dir, table, aggregates, config) = deployment(&c, "busy", "config/commerce.yaml").await;
    let mut svc = Service::start(&config, dir.path(), "svc", &[]);
    assert!(workload(&c, &table, 300, 10, 2, 47).await >= 300);
    let started = Instant::now();
    while aggregates_of(&c, &aggregates).await != truth(&scan(&c, &table).await) {
        assert!(started.elapsed() < Duration::from_secs(60), "never caught up\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    svc.terminate();
    let user_text = AttributeValue::S("set by a user".into());
    let profile = |pk: &str| {
        c.update_item().table_name(&aggregates).key("PK", AttributeValue::S(pk.into())).key("SK", AttributeValue::S("PROFILE".into()))
    };
    profile("CUST#c3").update_expression("SET spend = :s").expression_attribute_values(":s", user_text.clone()).send().await.unwrap();
    let text = std::fs::read_to_string(&config).unwrap();
    let changed = text.replace("      revenue: { sum: total }\n", "      revenue: { sum: total }\n      spend: { sum: total }\n");
    assert!(changed.contains("spend: { sum: total }"));
    std::fs::write(&config, changed).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hot = tokio::spawn(hot_orders(c.clone(), table.clone(), stop.clone()));
    let svc = Service::start(&config, dir.path(), "svc2", &[]);
    let rebuilding = Instant::now();
    loop {
        let m = svc.metrics();
        let pending = metric(&m, "ddb_aggregator_rule_rebuild_pending{rule=\"customer-orders\"}");
        if pending == 0.0 && svc.log_tail().contains("rule rebuilt") {
            break;
        }
        assert!(rebuilding.elapsed() < Duration::from_secs(300), "the rebuild never finished (pending {pending})\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = rebuilding.elapsed();
    let skipped = metric(&svc.metrics(), "ddb_aggregator_rule_rebuild_skipped_targets_total{rule=\"customer-orders\"}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let hot_orders = hot.await.unwrap();
    let log = std::fs::read_to_string(&svc.log).unwrap_or_default();
    let reported = log.matches("target could not be corrected by the rebuild").count();
    assert_eq!(reported as f64, skipped, "each skipped target is reported");
    println!("busy rebuild: finished in {:.1} s beside {hot_orders} hot orders, {skipped} target(s) skipped", took.as_secs_f64());
    let held = log.matches("drift corrected under a hold").count();
    println!("busy rebuild: {held} target(s) corrected under a hold");
    assert_eq!(skipped, 1.0, "only the user's string is skipped: the busy target is corrected\n{}", svc.log_tail());
    // Once the writes stop and the service has applied them, every target is exact: the
    // rebuild corrected the busy one. The string stays.
    let settled = Instant::now();
    loop {
        let mut want = truth(&scan(&c, &table).await);
        let spend: Vec<_> = want
            .iter()
            .filter(|((_, sk, a), _)| sk == "PROFILE" && a == "revenue")
            .map(|((pk, sk, _), v)| ((pk.clone(), sk.clone(), "spend".to_string()), *v))
            .collect();
        want.extend(spend);
        want.remove(&("CUST#c3".to_string(), "PROFILE".to_string(), "spend".to_string()));
        let have = aggregates_of(&c, &aggregates).await;
        if have == want {
            break;
        }
        let wrong: Vec<_> = want.iter().filter(|(k, v)| have.get(*k) != Some(*v)).take(3).collect();
        assert!(settled.elapsed() < Duration::from_secs(30), "wrong {wrong:?}\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("busy rebuild: every target exact {:.1} s after the writes stopped", settled.elapsed().as_secs_f64());
    assert_eq!(get(&c, &aggregates, "CUST#c3", "PROFILE").await.get("spend"), Some(&user_text), "the user's string is never overwritten");
}

/// Helper items of `aggregates`: (live without an expiry, live with one, at zero without one,
/// at zero with one).
async fn helper_expiries(c: &aws_sdk_dynamodb::Client, aggregates: &str) -> [usize; 4] {
    let mut out = [0; 4];
    for item in helper_items(c, aggregates).await {
        let live = item.get("refs").is_some_and(|v| v.as_n().unwrap().parse::<i64>().unwrap() > 0);
        out[usize::from(!live) * 2 + usize::from(item.contains_key(EXPIRES_AT))] += 1;
    }
    out
}

/// Adding `aggregates.helper_expiry_attribute` in a rolling deploy while TTL is already on:
/// the replica that names it holds no lease while one that does not (and so would not remove
/// expiries) runs, then commits it and expires helpers at zero; no live helper ever carries
/// an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_the_helper_expiry_attribute_waits_for_the_replicas_without_it() {
    let _serial = SERIAL.lock().await;
    let c = client().await;
    let (dir, table, aggregates, new_config) = deployment(&c, "expiry", "config/commerce-measures.yaml").await;
    let text = std::fs::read_to_string(&new_config).unwrap();
    let line = format!("  helper_expiry_attribute: {EXPIRES_AT}\n");
    assert!(text.contains(&line), "the example names the attribute");
    let old_config = dir.path().join("old.yaml");
    std::fs::write(&old_config, text.replace(&line, "")).unwrap();
    let mut a = Service::start(&old_config, dir.path(), "a", &[]);
    assert!(workload(&c, &table, 300, 10, 2, 43).await >= 300);
    let b = Service::start(&new_config, dir.path(), "b", &[]);
    orders_for(&c, &table, Duration::from_secs(20), 4).await;
    let waiting = metric(&b.metrics(), "ddb_aggregator_definitions_waiting{reason=\"committed_replicas_live\"}");
    assert_eq!(waiting, 1.0, "B holds no lease while A runs without the attribute\n{}", b.log_tail());
    let [_, live_expiring, zero, zero_expiring] = helper_expiries(&c, &aggregates).await;
    assert_eq!((live_expiring, zero_expiring), (0, 0), "A sets no expiry, B writes nothing");
    assert!(zero > 0, "helpers at zero wait for B");
    let (code, _) = a.terminate();
    assert_eq!(code, Some(0), "{}", a.log_tail());
    let switched = Instant::now();
    loop {
        orders_for(&c, &table, Duration::from_secs(3), 5).await;
        let [live, live_expiring, _, zero_expiring] = helper_expiries(&c, &aggregates).await;
        assert_eq!(live_expiring, 0, "a live helper never expires");
        let generation = metric(&b.metrics(), "ddb_aggregator_definitions_generation");
        if zero_expiring > 0 && generation == 2.0 {
            println!("expiry attribute committed as generation 2; {zero_expiring} helpers at zero expiring, {live} live");
            break;
        }
        assert!(switched.elapsed() < Duration::from_secs(90), "generation {generation}, {zero_expiring} expiring\n{}", b.log_tail());
    }
    drop(b);
}
