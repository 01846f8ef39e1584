//! Copy rules end to end on DynamoDB Local: the real binary keeps the customer's name and tier
//! on every order (config/commerce.yaml's customer-name-on-orders) while profiles are renamed,
//! re-tiered and deleted, orders come and go, and the service is killed with SIGKILL.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use common::*;

const LEASE: &str = "2s";

/// The writer's view of one customer's profile: (name, tier), or None once deleted.
type Profiles = BTreeMap<usize, Option<(String, Option<String>)>>;

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

async fn put_profile(c: &Client, table: &str, customer: usize, name: &str, tier: Option<&str>) {
    let mut req = c.put_item().table_name(table).item("PK", s(&format!("CUST#c{customer}"))).item("SK", s("PROFILE")).item("name", s(name));
    if let Some(t) = tier {
        req = req.item("tier", s(t));
    }
    req.send().await.unwrap_or_else(|e| panic!("profile c{customer}: {e:?}"));
}

/// An order, written as the application writes it: with a snapshot of its customer's profile.
async fn put_order(c: &Client, table: &str, customer: usize, n: usize, profile: Option<&(String, Option<String>)>) {
    let mut req = c
        .put_item()
        .table_name(table)
        .item("PK", s(&format!("CUST#c{customer}")))
        .item("SK", s(&format!("ORDER#2026-12-06#o{n}")))
        .item("status", s("PAID"))
        .item("total", AttributeValue::N(format!("{}.25", n % 90)));
    if let Some((name, tier)) = profile {
        req = req.item("customerName", s(name));
        if let Some(t) = tier {
            req = req.item("customerTier", s(t));
        }
    }
    req.send().await.unwrap_or_else(|e| panic!("order {n}: {e:?}"));
}

/// Renames, re-tiers, drops and deletes profiles in bursts while orders are placed (with the
/// profile as the writer knows it) and deleted: returns the final profiles.
async fn churn(c: Client, table: String, customers: usize, steps: usize, seed: u64) -> Profiles {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut profiles: Profiles = BTreeMap::new();
    let mut orders: Vec<(usize, usize)> = Vec::new();
    let mut n = 0;
    for k in 0..customers {
        let p = (format!("Customer {k}"), Some("blue".to_string()));
        put_profile(&c, &table, k, &p.0, p.1.as_deref()).await;
        profiles.insert(k, Some(p));
        for _ in 0..6 {
            n += 1;
            put_order(&c, &table, k, n, profiles[&k].as_ref()).await;
            orders.push((k, n));
        }
    }
    // The last customer's profile is deleted half way.
    let doomed = customers - 1;
    for step in 0..steps {
        // Spread over a few seconds, so that the SIGKILLs land in the middle of it.
        tokio::time::sleep(Duration::from_millis(15)).await;
        let k = rng.usize(..customers);
        if step == steps / 2 {
            c.delete_item().table_name(&table).key("PK", s(&format!("CUST#c{doomed}"))).key("SK", s("PROFILE")).send().await.unwrap();
            profiles.insert(doomed, None);
            continue;
        }
        match rng.u32(..10) {
            // A burst of renames of one customer.
            0..=2 if profiles[&k].is_some() => {
                for b in 0..rng.usize(1..4) {
                    let tier = if rng.bool() { Some(["gold", "blue", "green"][rng.usize(..3)].to_string()) } else { None };
                    let p = (format!("Customer {k} v{step}.{b}"), tier);
                    put_profile(&c, &table, k, &p.0, p.1.as_deref()).await;
                    profiles.insert(k, Some(p));
                }
            }
            3..=6 => {
                n += 1;
                put_order(&c, &table, k, n, profiles[&k].as_ref()).await;
                orders.push((k, n));
            }
            // Deletes leave the doomed customer's orders, whose copies its delete removes.
            _ if orders.iter().any(|(k, _)| *k != doomed) => {
                let mut pick = rng.usize(..orders.len());
                while orders[pick].0 == doomed {
                    pick = (pick + 1) % orders.len();
                }
                let (k, o) = orders.swap_remove(pick);
                let sk = format!("ORDER#2026-12-06#o{o}");
                c.delete_item().table_name(&table).key("PK", s(&format!("CUST#c{k}"))).key("SK", s(&sk)).send().await.unwrap();
            }
            _ => {}
        }
    }
    profiles
}

/// A source table, an aggregates table of its own (a deleted profile would take aggregates in
/// the source table with it), and the commerce config on them, with `{table}-state` as the
/// state table.
struct Deployment {
    dir: tempfile::TempDir,
    table: String,
    aggregates: String,
    state: String,
    config: std::path::PathBuf,
}

async fn deployment(c: &Client, prefix: &str) -> Deployment {
    let dir = test_dir();
    let table = unique(prefix);
    let (aggregates, state) = (format!("{table}-aggregates"), format!("{table}-state"));
    create_source_table(c, &table).await;
    create_aggregates_table(c, &aggregates).await;
    let config = write_config(dir.path(), &table, &state, LEASE);
    use_aggregates_table(&config, &table, &aggregates);
    Deployment { dir, table, aggregates, state, config }
}

/// Orders whose copies differ from their customer's final profile: (order, what it holds).
async fn wrong_copies(c: &Client, table: &str, profiles: &Profiles) -> Vec<String> {
    let mut wrong = Vec::new();
    for item in scan(c, table).await {
        let pk = item["PK"].as_s().unwrap();
        let sk = item["SK"].as_s().unwrap();
        if !sk.starts_with("ORDER#") {
            continue;
        }
        let k: usize = pk.trim_start_matches("CUST#c").parse().unwrap();
        let held =
            (item.get("customerName").and_then(|v| v.as_s().ok()).cloned(), item.get("customerTier").and_then(|v| v.as_s().ok()).cloned());
        let expected = match &profiles[&k] {
            Some((name, tier)) => (Some(name.clone()), tier.clone()),
            None => (None, None),
        };
        if held != expected {
            wrong.push(format!("{pk} {sk}: holds {held:?}, expected {expected:?}"));
        }
    }
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renames_reach_every_order_through_sigkills_and_a_deleted_profile_takes_its_copies() {
    let c = client().await;
    let Deployment { dir, table, aggregates, config, .. } = deployment(&c, "copies").await;
    let writer = tokio::spawn(churn(c.clone(), table.clone(), 6, 400, 11));
    let mut svc = Service::start(&config, dir.path(), "svc", &[]);
    let mut rng = fastrand::Rng::with_seed(5);
    let mut kills = 0;
    while !writer.is_finished() || kills < 3 {
        tokio::time::sleep(Duration::from_millis(rng.u64(500..2500))).await;
        svc.kill();
        kills += 1;
        svc = Service::start(&config, dir.path(), "svc", &[]);
    }
    let profiles = writer.await.unwrap();
    let started = Instant::now();
    let mut wrong = wrong_copies(&c, &table, &profiles).await;
    while !wrong.is_empty() && started.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        wrong = wrong_copies(&c, &table, &profiles).await;
    }
    assert!(wrong.is_empty(), "{} orders with wrong copies after {kills} SIGKILLs:\n{}\n{}", wrong.len(), wrong.join("\n"), svc.log_tail());
    // The service wrote them: the orders carry the version of the change their copies came from.
    let versioned = scan(&c, &table).await.iter().filter(|i| i.contains_key("_aggc:customer-name-on-orders")).count();
    assert!(versioned > 20, "{versioned} orders carry a copy version");
    // The copy writes are order MODIFYs that change nothing the counters read.
    let started = Instant::now();
    loop {
        let (want, got) = (truth(&scan(&c, &table).await), common::aggregates(&scan(&c, &aggregates).await));
        if want == got {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "aggregates differ from the truth: {want:?}\n{got:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let m = svc.metrics();
    let last_run: Vec<&str> = m.lines().filter(|l| l.starts_with("ddb_aggregator_copy_writes_total{")).collect();
    println!("{kills} SIGKILLs: every order's copies equal its profile; {versioned} orders written by the service; the last run's copy writes: {last_run:?}");
    assert!(kills >= 3);
}

/// Copies per second on DynamoDB Local: one customer with COPIES_ORDERS orders (default 2,000),
/// renamed once; the time from the rename until every order holds the new name. Run by hand:
///   COPIES_ORDERS=2000 cargo test --release --test copies fan_out_rate -- --ignored --nocapture
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn fan_out_rate() {
    let n: usize = std::env::var("COPIES_ORDERS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let c = client().await;
    let Deployment { dir, table, state, config, .. } = deployment(&c, "fanout").await;
    put_profile(&c, &table, 1, "Ann", Some("gold")).await;
    for chunk in (0..n).collect::<Vec<_>>().chunks(25) {
        let mut writes = Vec::new();
        for i in chunk {
            let item = [
                ("PK", s("CUST#c1")),
                ("SK", s(&format!("ORDER#2026-12-06#o{i:06}"))),
                ("status", s("PAID")),
                ("total", AttributeValue::N("1".into())),
                ("customerName", s("Ann")),
                ("customerTier", s("gold")),
            ];
            let put = aws_sdk_dynamodb::types::PutRequest::builder()
                .set_item(Some(item.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
                .build()
                .unwrap();
            writes.push(aws_sdk_dynamodb::types::WriteRequest::builder().put_request(put).build());
        }
        c.batch_write_item().request_items(&table, writes).send().await.unwrap();
    }
    let svc = Service::start(&config, dir.path(), "svc", &[]);
    // Every order counted: the service has read the backlog.
    let started = Instant::now();
    loop {
        let m = svc.metrics();
        if metric(&m, "ddb_aggregator_records_read_total") >= (n + 1) as f64 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "backlog not read");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before = svc.metrics();
    // The profile's INSERT, read after the orders, fans out too (the orders carry no version
    // yet): done before the rename, whose writes are counted from here.
    while pending_jobs(&c, &state).await > 0 {
        assert!(started.elapsed() < Duration::from_secs(900), "the profile's first fan-out did not end\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    put_profile(&c, &table, 1, "Bea", Some("gold")).await;
    let renamed = Instant::now();
    let done = loop {
        let m = svc.metrics();
        let written = m
            .lines()
            .find(|l| l.starts_with("ddb_aggregator_copy_writes_total") && l.contains("\"written\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        let was = before
            .lines()
            .find(|l| l.starts_with("ddb_aggregator_copy_writes_total") && l.contains("\"written\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if written - was >= n as f64 {
            break renamed.elapsed();
        }
        assert!(renamed.elapsed() < Duration::from_secs(900), "fan-out not done: {written}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let wrong = wrong_copies(&c, &table, &[(1, Some(("Bea".to_string(), Some("gold".to_string()))))].into_iter().collect()).await;
    assert!(wrong.is_empty(), "{}", wrong.len());
    let wcu =
        metric(&svc.metrics(), "ddb_aggregator_write_capacity_units_total") - metric(&before, "ddb_aggregator_write_capacity_units_total");
    println!(
        "fan-out of {n} copies: {:.1} s, {:.0} copies/s, {wcu} WCU ({:.2} per copy)",
        done.as_secs_f64(),
        n as f64 / done.as_secs_f64(),
        wcu / n as f64
    );
}

/// A table with a global secondary index GSI1 (GSI1PK, GSI1SK), all attributes projected.
async fn create_table_with_index(c: &Client, name: &str) {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection, ProjectionType, ScalarAttributeType,
        StreamSpecification, StreamViewType,
    };
    let attr = |n: &str| AttributeDefinition::builder().attribute_name(n).attribute_type(ScalarAttributeType::S).build().unwrap();
    let key = |n: &str, t: KeyType| KeySchemaElement::builder().attribute_name(n).key_type(t).build().unwrap();
    let gsi = GlobalSecondaryIndex::builder()
        .index_name("GSI1")
        .key_schema(key("GSI1PK", KeyType::Hash))
        .key_schema(key("GSI1SK", KeyType::Range))
        .projection(Projection::builder().projection_type(ProjectionType::All).build())
        .build()
        .unwrap();
    c.create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attr("PK"))
        .attribute_definitions(attr("SK"))
        .attribute_definitions(attr("GSI1PK"))
        .attribute_definitions(attr("GSI1SK"))
        .key_schema(key("PK", KeyType::Hash))
        .key_schema(key("SK", KeyType::Range))
        .global_secondary_indexes(gsi)
        .stream_specification(
            StreamSpecification::builder().stream_enabled(true).stream_view_type(StreamViewType::NewAndOldImages).build().unwrap(),
        )
        .send()
        .await
        .unwrap_or_else(|e| panic!("create table {name}: {e:?}"));
}

/// A copy rule whose `to` is a global secondary index: a product's title on every order line
/// that sells it (lines live under their orders, and GSI1 groups them by product). Renames
/// reach every line, a deleted product takes its title off them, and a `to` naming an index
/// the table does not have stops `run` with exit 2 and the index's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_rule_finds_its_copies_through_a_global_secondary_index() {
    let c = client().await;
    let dir = test_dir();
    let table = unique("gsi");
    create_table_with_index(&c, &table).await;
    let rule = format!(
        r#"source: {{ table: {table} }}
state: {{ table: {table}-state, create_table: true, lease_duration: {LEASE} }}
rules:
  - name: title-on-lines
    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [META] }} }} }} }}
    source_key: {{ PK: "PRODUCT#{{sku}}", SK: META }}
    copy:
      attributes: {{ productTitle: title }}
      to: {{ index: GSI1, GSI1PK: "PRODUCT#{{sku}}", GSI1SK_begins_with: "LINE#" }}
"#
    );
    let config = dir.path().join("gsi.yaml");
    std::fs::write(&config, &rule).unwrap();
    let product = |sku: &str, title: Option<&str>| {
        let c = c.clone();
        let (table, sku, title) = (table.clone(), sku.to_string(), title.map(str::to_string));
        async move {
            let key = [("PK".to_string(), s(&format!("PRODUCT#{sku}"))), ("SK".to_string(), s("META"))];
            match title {
                Some(t) => drop(
                    c.put_item()
                        .table_name(&table)
                        .set_item(Some(key.into_iter().chain([("title".to_string(), s(&t))]).collect()))
                        .send()
                        .await
                        .unwrap(),
                ),
                None => drop(c.delete_item().table_name(&table).set_key(Some(key.into_iter().collect())).send().await.unwrap()),
            }
        }
    };
    product("p1", Some("Mug")).await;
    product("p2", Some("Pen")).await;
    // 60 order lines, each of one product, written with its title.
    for n in 0..60 {
        let sku = if n % 3 == 0 { "p2" } else { "p1" };
        let title = if sku == "p1" { "Mug" } else { "Pen" };
        c.put_item()
            .table_name(&table)
            .item("PK", s(&format!("ORDER#o{}", n / 4)))
            .item("SK", s(&format!("LINE#{n:03}")))
            .item("GSI1PK", s(&format!("PRODUCT#{sku}")))
            .item("GSI1SK", s(&format!("LINE#o{}#{n:03}", n / 4)))
            .item("productTitle", s(title))
            .send()
            .await
            .unwrap();
    }
    let svc = Service::start(&config, dir.path(), "svc", &[]);
    product("p1", Some("Big mug")).await;
    product("p2", None).await;
    let titles = |items: &[std::collections::HashMap<String, AttributeValue>]| -> BTreeMap<String, Option<String>> {
        items
            .iter()
            .filter(|i| i["SK"].as_s().is_ok_and(|s| s.starts_with("LINE#")))
            .map(|i| (i["GSI1PK"].as_s().unwrap().clone(), i.get("productTitle").and_then(|v| v.as_s().ok()).cloned()))
            .fold(BTreeMap::new(), |mut m, (p, t)| {
                m.entry(format!("{p} {t:?}")).or_insert(None);
                m
            })
    };
    let want: BTreeMap<String, Option<String>> =
        [("PRODUCT#p1 Some(\"Big mug\")".to_string(), None), ("PRODUCT#p2 None".to_string(), None)].into_iter().collect();
    let started = Instant::now();
    loop {
        let got = titles(&scan(&c, &table).await);
        if got == want {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "lines hold {got:?}\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Each fan-out through the index runs again 5 s after it ended: the follow-ups find the 60
    // lines at their change's version already, and end.
    let older = |m: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("ddb_aggregator_copy_writes_total{") && l.contains("outcome=\"older\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let started = Instant::now();
    while pending_jobs(&c, &format!("{table}-state")).await > 0 || older(&svc.metrics()) < 60.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "follow-ups pending; {} older\n{}", older(&svc.metrics()), svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(titles(&scan(&c, &table).await), want);
    drop(svc);
    // An index the table does not have: `run` stops at once, naming it.
    std::fs::write(&config, rule.replace("index: GSI1", "index: GSI9")).unwrap();
    let out = run_cli(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("copy.to names index GSI9, which table") && err.contains("[\"GSI1\"]"), "{err}");
}

/// Puts `n` orders of customer `customer` holding `name` (25 to a call, 4 calls at once).
async fn put_orders(c: &Client, table: &str, customer: usize, n: usize, name: &str) {
    use futures::stream::{self, StreamExt};
    let calls: Vec<Vec<usize>> = (0..n).collect::<Vec<_>>().chunks(25).map(<[usize]>::to_vec).collect();
    stream::iter(calls)
        .for_each_concurrent(4, |chunk| async move {
            let mut writes = Vec::new();
            for i in chunk {
                let item = [
                    ("PK", s(&format!("CUST#c{customer}"))),
                    ("SK", s(&format!("ORDER#2026-12-06#o{i:06}"))),
                    ("status", s("PAID")),
                    ("total", AttributeValue::N("1".into())),
                    ("customerName", s(name)),
                    ("customerTier", s("gold")),
                ];
                let put = aws_sdk_dynamodb::types::PutRequest::builder()
                    .set_item(Some(item.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
                    .build()
                    .unwrap();
                writes.push(aws_sdk_dynamodb::types::WriteRequest::builder().put_request(put).build());
            }
            let mut left = Some(std::collections::HashMap::from([(table.to_string(), writes)]));
            for _ in 0..50 {
                let Some(items) = left.take().filter(|m| m.values().any(|w| !w.is_empty())) else { break };
                let out = c.batch_write_item().set_request_items(Some(items)).send().await.unwrap();
                left = out.unprocessed_items().cloned();
            }
        })
        .await;
}

/// The copy jobs pending in the state table.
async fn pending_jobs(c: &Client, state: &str) -> usize {
    scan(c, state).await.iter().filter(|i| i["shard_id"].as_s().is_ok_and(|s| s.starts_with("copy-job#"))).count()
}

/// A customer's `orderCount` as the service wrote it.
async fn order_count(c: &Client, aggregates: &str, customer: usize) -> Option<String> {
    let item = c
        .get_item()
        .table_name(aggregates)
        .key("PK", s(&format!("CUST#c{customer}")))
        .key("SK", s("PROFILE"))
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    item.item().and_then(|i| i.get("orderCount")).and_then(|v| v.as_n().ok()).cloned()
}

/// The written copies the service reports.
fn copies_written(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("ddb_aggregator_copy_writes_total{") && l.contains("outcome=\"written\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A rename of a customer with FAN_OUT_ORDERS orders (default 20,000): the batch writes the
/// first 100 copies and records the rest as a job in the state table; the service is killed
/// with SIGKILL in the middle of the job, and the next one resumes it from its cursor. Another
/// customer on the same shard places orders meanwhile: its counters are current while the
/// job is still pending. In the end every order holds the new name, and the copy writes are
/// the minimum (one per order) plus at most the pages a kill interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_of_twenty_thousand_orders_survives_a_sigkill_and_the_counters_do_not_wait() {
    let n: usize = std::env::var("FAN_OUT_ORDERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let c = client().await;
    let Deployment { dir, table, aggregates, state, config } = deployment(&c, "bigfan").await;
    put_profile(&c, &table, 1, "Ann", Some("gold")).await;
    put_profile(&c, &table, 2, "Cy", Some("blue")).await;
    put_orders(&c, &table, 1, n, "Ann").await;
    let mut svc = Service::start(&config, dir.path(), "svc", &[]);
    let started = Instant::now();
    while order_count(&c, &aggregates, 1).await.as_deref() != Some(&n.to_string()) {
        assert!(started.elapsed() < Duration::from_secs(600), "the backlog was not counted\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The profile's INSERT, read after the orders, fans out too (the orders carry no version
    // yet): done before the rename, whose writes are counted from here.
    while pending_jobs(&c, &state).await > 0 {
        assert!(started.elapsed() < Duration::from_secs(900), "the profile's first fan-out did not end\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let baseline = copies_written(&svc.metrics());
    put_profile(&c, &table, 1, "Bea", Some("gold")).await;
    let renamed = Instant::now();
    // Customer 2's orders, one at a time, while the job runs: each is counted at once.
    let mut placed = 0;
    let mut counted_while_pending = 0;
    let mut written_before_kill = 0.0;
    let mut killed = false;
    loop {
        let jobs = pending_jobs(&c, &state).await;
        let written = copies_written(&svc.metrics());
        if jobs == 0 && renamed.elapsed() > Duration::from_secs(2) {
            break;
        }
        assert!(renamed.elapsed() < Duration::from_secs(900), "the fan-out did not end: {written} written\n{}", svc.log_tail());
        if !killed && written - baseline >= n as f64 * 0.3 {
            written_before_kill = copies_written(&svc.metrics()) - baseline;
            svc.kill();
            killed = true;
            svc = Service::start(&config, dir.path(), "svc", &[]);
            continue;
        }
        if placed < 10 && jobs > 0 {
            placed += 1;
            put_order(&c, &table, 2, 100_000 + placed, Some(&("Cy".to_string(), Some("blue".to_string())))).await;
            let asked = Instant::now();
            while order_count(&c, &aggregates, 2).await.as_deref() != Some(&placed.to_string()) {
                assert!(asked.elapsed() < Duration::from_secs(60), "customer 2's counters wait\n{}", svc.log_tail());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if pending_jobs(&c, &state).await > 0 {
                counted_while_pending += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = renamed.elapsed();
    assert!(killed, "the fan-out ended before the kill");
    assert!(
        counted_while_pending >= 3,
        "only {counted_while_pending} of {placed} orders of customer 2 were counted while the job was pending"
    );
    let profiles: Profiles =
        [(1, Some(("Bea".to_string(), Some("gold".to_string())))), (2, Some(("Cy".to_string(), Some("blue".to_string()))))]
            .into_iter()
            .collect();
    let wrong = wrong_copies(&c, &table, &profiles).await;
    assert!(wrong.is_empty(), "{} of {n} orders hold the wrong copies: {:?}", wrong.len(), &wrong[..wrong.len().min(5)]);
    let m = svc.metrics();
    let written = written_before_kill + copies_written(&m);
    let wcu = metric(&m, "ddb_aggregator_write_capacity_units_total");
    // The second run wrote what the first had not (its counter starts at 0): the rest, give or
    // take the page in flight at the kill (100 copies) and the writes between scrape and kill.
    let lines: Vec<&str> = m.lines().filter(|l| l.starts_with("ddb_aggregator_copy_")).collect();
    assert!(
        (written - n as f64).abs() <= 200.0,
        "{written} copies written for {n} orders ({written_before_kill} before the kill); after: {lines:#?}"
    );
    println!(
        "fan-out of {n} copies through a SIGKILL: {:.1} s, {written} copies written (minimum {n}; about {written_before_kill} before the kill, as last scraped), {wcu} WCU in the second run; customer 2: {counted_while_pending} of {placed} orders counted while the job was pending",
        took.as_secs_f64()
    );
}

/// Sets an order's copied name by hand (drift: the application wrote it, or a change was lost).
async fn tamper(c: &Client, table: &str, customer: usize, n: usize, name: &str) {
    c.update_item()
        .table_name(table)
        .key("PK", s(&format!("CUST#c{customer}")))
        .key("SK", s(&format!("ORDER#2026-12-06#o{n}")))
        .update_expression("SET customerName = :n")
        .expression_attribute_values(":n", s(name))
        .send()
        .await
        .unwrap();
}

/// `reconcile --customer` and `--all` find the orders whose copies differ from their customer's
/// profile and set them, with the service stopped (reconcile reads the stream itself first);
/// `--dry-run` reports them and writes nothing; a deleted profile's copies are removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_sets_copies_that_differ_from_their_source() {
    let c = client().await;
    let Deployment { dir: _dir, table, config, .. } = deployment(&c, "copyrec").await;
    let mut profiles: Profiles = BTreeMap::new();
    for k in 1..=3 {
        let p = (format!("Customer {k}"), Some("gold".to_string()));
        put_profile(&c, &table, k, &p.0, p.1.as_deref()).await;
        for n in 0..5 {
            put_order(&c, &table, k, k * 100 + n, Some(&p)).await;
        }
        profiles.insert(k, Some(p));
    }
    c.delete_item().table_name(&table).key("PK", s("CUST#c3")).key("SK", s("PROFILE")).send().await.unwrap();
    profiles.insert(3, None);
    let cfg = config.to_str().unwrap();
    // A first reconcile applies the stream (the profiles' fan-outs, the delete's among them).
    let out = run_cli(&["reconcile", "--config", cfg, "--all"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(wrong_copies(&c, &table, &profiles).await.is_empty());
    // Drift on two orders of c1 and one of c2.
    tamper(&c, &table, 1, 101, "Mallory").await;
    tamper(&c, &table, 1, 103, "Mallory").await;
    tamper(&c, &table, 2, 202, "Eve").await;
    let wrong = |w: Vec<String>| w.into_iter().map(|l| l.split(':').next().unwrap_or("").to_string()).collect::<Vec<_>>();
    let dry = run_cli(&["reconcile", "--config", cfg, "--customer", "c1", "--dry-run", "--output", "json"]);
    let text = String::from_utf8_lossy(&dry.stdout);
    assert_eq!(dry.status.code(), Some(1), "drift left by a dry run\n{text}\n{}", String::from_utf8_lossy(&dry.stderr));
    let drifts: Vec<serde_json::Value> =
        text.lines().filter_map(|l| serde_json::from_str(l).ok()).filter(|v: &serde_json::Value| v.get("copy_item").is_some()).collect();
    assert_eq!(drifts.len(), 2, "{text}");
    assert!(
        drifts.iter().all(|d| d["attributes"][0]["stored"] == serde_json::json!({"S": "Mallory"})
            && d["attributes"][0]["true"] == serde_json::json!({"S": "Customer 1"})),
        "{text}"
    );
    assert_eq!(wrong(wrong_copies(&c, &table, &profiles).await).len(), 3, "a dry run wrote");
    let out = run_cli(&["reconcile", "--config", cfg, "--customer", "c1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("copies: 5 copy item(s) checked, 2 differed from their source, 2 corrected"), "{text}");
    assert_eq!(wrong(wrong_copies(&c, &table, &profiles).await), ["CUST#c2 ORDER#2026-12-06#o202"]);
    let out = run_cli(&["reconcile", "--config", cfg, "--all"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("1 differed from their source, 1 corrected"), "{text}");
    assert!(wrong_copies(&c, &table, &profiles).await.is_empty());
    // A copy rule named with a variable that does not name its source.
    let out = run_cli(&["reconcile", "--config", cfg, "--rule", "customer-name-on-orders", "--date", "2026-12-06"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("copy rule customer-name-on-orders's source is not determined by --date"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An order at the 400 KB limit refuses its copy of a long new name: the profile's record is
/// dead-lettered (`copy_rejected`) and the customer's other orders get the name. `dlq replay`
/// keeps the letter while the order is still too large, and once it is made smaller (as the
/// runbook says), sets its copies and deletes the letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_sets_the_copies_a_dead_letter_names_once_the_item_fits() {
    let c = client().await;
    let Deployment { dir, table, config, .. } = deployment(&c, "copydlq").await;
    let sqs = sqs_client_at(&sqs_endpoint());
    let queue = create_queue(&sqs, &format!("{table}-dlq")).await;
    let ann = ("Ann".to_string(), Some("gold".to_string()));
    put_profile(&c, &table, 1, "Ann", Some("gold")).await;
    put_order(&c, &table, 1, 1, Some(&ann)).await;
    put_order(&c, &table, 1, 2, Some(&ann)).await;
    // Order 2 pads itself to 1 KB under the limit.
    let pad = "x".repeat(400 * 1024 - 1024);
    c.update_item()
        .table_name(&table)
        .key("PK", s("CUST#c1"))
        .key("SK", s("ORDER#2026-12-06#o2"))
        .update_expression("SET padding = :p")
        .expression_attribute_values(":p", s(&pad))
        .send()
        .await
        .unwrap();
    let svc = Service::start(&config, dir.path(), "svc", &[]);
    let long = format!("Ann {}", "y".repeat(4000));
    put_profile(&c, &table, 1, &long, Some("gold")).await;
    let started = Instant::now();
    let letters = loop {
        let letters = drain_queue(&sqs, &queue).await;
        if !letters.is_empty() {
            break letters;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no dead letter\n{}", svc.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    drop(svc);
    let (letter, _) = &letters[0];
    assert_eq!(letter["reason"]["code"], "copy_rejected", "{letter}");
    assert_eq!(letter["rules"], serde_json::json!(["customer-name-on-orders"]), "{letter}");
    let held = |profiles: Profiles| {
        let c = c.clone();
        let table = table.clone();
        async move { wrong_copies(&c, &table, &profiles).await }
    };
    let renamed: Profiles = [(1, Some((long.clone(), Some("gold".to_string()))))].into_iter().collect();
    assert_eq!(held(renamed.clone()).await.len(), 1, "order 1 takes the name, order 2 cannot");
    // Reading the queue above hid the letter for 300 s (its visibility timeout): each replay
    // below gets a copy of it, sent again as it was.
    sqs.send_message().queue_url(&queue).message_body(letter.to_string()).send().await.unwrap();
    let replay = || run_cli(&["dlq", "replay", "--config", config.to_str().unwrap()]);
    let out = replay();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "the item is still too large: the letter stays\n{text}");
    assert!(text.contains("still differ from the source"), "{text}");
    c.update_item()
        .table_name(&table)
        .key("PK", s("CUST#c1"))
        .key("SK", s("ORDER#2026-12-06#o2"))
        .update_expression("REMOVE padding")
        .send()
        .await
        .unwrap();
    sqs.send_message().queue_url(&queue).message_body(letter.to_string()).send().await.unwrap();
    let out = replay();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(held(renamed).await.is_empty(), "{text}");
}

/// Adding a copy rule in a rolling deploy: the replica with it holds no lease while one
/// without it runs (which checkpoints past a rename without copying it), then commits it as
/// the next generation; `reconcile --all` then sets the copies the old replica left, and the
/// next rename is copied by the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_a_copy_rule_waits_for_the_replicas_without_it() {
    let c = client().await;
    let Deployment { dir, table, aggregates, config: new_config, .. } = deployment(&c, "copyadd").await;
    let text = std::fs::read_to_string(&new_config).unwrap();
    let cut = text.find("  - name: customer-name-on-orders").expect("the example has the copy rule");
    let old_config = dir.path().join("old.yaml");
    std::fs::write(&old_config, &text[..cut]).unwrap();
    let ann = ("Ann".to_string(), Some("gold".to_string()));
    put_profile(&c, &table, 1, "Ann", Some("gold")).await;
    for n in 0..5 {
        put_order(&c, &table, 1, n, Some(&ann)).await;
    }
    let mut a = Service::start(&old_config, dir.path(), "a", &[]);
    let started = Instant::now();
    while order_count(&c, &aggregates, 1).await.as_deref() != Some("5") {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", a.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let b = Service::start(&new_config, dir.path(), "b", &[]);
    let waiting = || metric(&b.metrics(), "ddb_aggregator_definitions_waiting{reason=\"committed_replicas_live\"}");
    let started = Instant::now();
    while waiting() != 1.0 {
        assert!(started.elapsed() < Duration::from_secs(30), "B does not wait\n{}", b.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A rename while only A applies: counted nowhere, copied by nobody.
    put_profile(&c, &table, 1, "Bea", Some("gold")).await;
    put_order(&c, &table, 1, 5, Some(&("Bea".to_string(), Some("gold".to_string())))).await;
    let started = Instant::now();
    while order_count(&c, &aggregates, 1).await.as_deref() != Some("6") {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", a.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(waiting(), 1.0, "B still waits while A runs\n{}", b.log_tail());
    let bea: Profiles = [(1, Some(("Bea".to_string(), Some("gold".to_string()))))].into_iter().collect();
    assert_eq!(wrong_copies(&c, &table, &bea).await.len(), 5, "A copies nothing");
    let (code, _) = a.terminate();
    assert_eq!(code, Some(0), "{}", a.log_tail());
    let started = Instant::now();
    while metric(&b.metrics(), "ddb_aggregator_definitions_generation") != 2.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "B did not commit\n{}", b.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let out = run_cli(&["reconcile", "--config", new_config.to_str().unwrap(), "--all"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("5 differed from their source, 5 corrected"), "{said}");
    assert!(wrong_copies(&c, &table, &bea).await.is_empty());
    put_profile(&c, &table, 1, "Cy", Some("blue")).await;
    let cy: Profiles = [(1, Some(("Cy".to_string(), Some("blue".to_string()))))].into_iter().collect();
    let started = Instant::now();
    while !wrong_copies(&c, &table, &cy).await.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(60), "the rename after the commit is not copied\n{}", b.log_tail());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
