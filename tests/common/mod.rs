//! Shared helpers of the integration tests: the local emulators (started once per test
//! binary through scripts/local-aws, on ports of their own), clients, tables, the service
//! process, and the truth computed independently from a scan of the source table.
#![allow(dead_code)]

pub mod proxy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, StreamSpecification, StreamViewType,
};
use aws_sdk_dynamodb::Client;
use ddb_aggregator::decimal::Decimal;

/// Each test binary gets emulators of its own (the heavy binaries would slow the
/// timing-sensitive ones):
/// DynamoDB Local on 8100 + k, moto on 9424 + k (k < 9). scripts/test stops them all. DDB_LOCAL_PORT
/// and SQS_LOCAL_PORT move the bases (two checkouts testing on one machine).
pub const EMULATOR_SLOTS: &[&str] =
    &["", "dead_letters", "ledger_dynamodb", "reconcile", "service", "startup", "chaos", "changes", "copies"];

fn slot() -> u16 {
    let exe = std::env::current_exe().ok();
    let name = exe.as_ref().and_then(|p| p.file_name()).and_then(|n| n.to_str()).unwrap_or("");
    let base = name.rsplit_once('-').map_or(name, |(b, _)| b);
    EMULATOR_SLOTS.iter().position(|s| *s == base).map_or(0, |i| i as u16)
}

fn base(var: &str, default: u16) -> u16 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn ddb_port() -> u16 {
    base("DDB_LOCAL_PORT", 8100) + slot()
}

pub fn sqs_port() -> u16 {
    base("SQS_LOCAL_PORT", 9424) + slot()
}

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where DynamoDB Local keeps its database (scripts/local-aws's DDB_LOCAL_DB_DIR), unless the
/// environment says: in a file with its stream records indexed, where each write otherwise costs
/// more the more streams the emulator has seen (tests/service.rs alone: 310 s instead of 611);
/// in memory for tests/copies.rs, whose 20,000-order fan-out reads more than it writes (146 s in
/// memory, 189 s in a file).
fn db_dir() -> String {
    std::env::var("DDB_LOCAL_DB_DIR").unwrap_or_else(|_| if EMULATOR_SLOTS[slot() as usize] == "copies" { "memory" } else { "shm" }.into())
}

/// Starts (or finds running) DynamoDB Local and moto on the test ports.
pub fn emulators() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let out = Command::new(root().join("scripts/local-aws"))
            .arg("start")
            .env("DDB_LOCAL_DB_DIR", db_dir())
            .env("DDB_LOCAL_PORT", ddb_port().to_string())
            .env("SQS_LOCAL_PORT", sqs_port().to_string())
            .stdout(Stdio::null())
            .output()
            .expect("scripts/local-aws runs");
        assert!(out.status.success(), "local emulators did not start:\n{}", String::from_utf8_lossy(&out.stderr));
    });
}

pub fn endpoint() -> String {
    format!("http://127.0.0.1:{}", ddb_port())
}

pub fn sqs_endpoint() -> String {
    format!("http://127.0.0.1:{}", sqs_port())
}

/// Environment for the service process and the SDK clients.
pub fn aws_env() -> Vec<(String, String)> {
    vec![
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID".into(), "local".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "local".into()),
        ("AWS_ENDPOINT_URL_DYNAMODB".into(), endpoint()),
        ("AWS_ENDPOINT_URL_DYNAMODB_STREAMS".into(), endpoint()),
        ("AWS_ENDPOINT_URL_SQS".into(), sqs_endpoint()),
    ]
}

/// Runs a `ddb-aggregator` command against the test emulators (blocking).
pub fn run_cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ddb-aggregator")).args(args).envs(aws_env()).output().expect("run ddb-aggregator")
}

pub async fn client() -> Client {
    emulators();
    let creds = aws_sdk_dynamodb::config::Credentials::new("local", "local", None, None, "tests");
    let conf = aws_sdk_dynamodb::Config::builder()
        .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
        .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
        .endpoint_url(endpoint())
        .credentials_provider(creds)
        .build();
    Client::from_conf(conf)
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{:06x}", std::process::id(), fastrand::u32(..0xff_ffff))
}

pub async fn create_source_table(c: &Client, name: &str) {
    create_table(c, name, true).await;
}

/// An aggregates table of its own (no stream), as DESIGN recommends: on DynamoDB Local a write
/// to a stream-enabled table is about 20 times slower (25 against 500 UpdateItems/s here), and
/// helper items (max, min, latest, distinct) write once per value. Its TTL attribute is
/// [`EXPIRES_AT`], as docs/semantics.md asks (helpers expire 40 hours after reaching zero, long
/// after any test ends, although DynamoDB Local does delete expired items).
pub async fn create_aggregates_table(c: &Client, name: &str) {
    create_table(c, name, false).await;
    let spec = aws_sdk_dynamodb::types::TimeToLiveSpecification::builder().enabled(true).attribute_name(EXPIRES_AT).build().unwrap();
    c.update_time_to_live()
        .table_name(name)
        .time_to_live_specification(spec)
        .send()
        .await
        .unwrap_or_else(|e| panic!("TTL on {name}: {e:?}"));
}

/// An aggregates table without TTL: the service deletes zero-count helpers itself, recording
/// each expiry as a pending item first ([`ddb_aggregator::sink::expiry`]).
pub async fn create_aggregates_table_without_ttl(c: &Client, name: &str) {
    create_table(c, name, false).await;
}

/// The TTL attribute of the aggregates tables tests create.
pub const EXPIRES_AT: &str = "expiresAt";

/// A PK/SK table, with a NEW_AND_OLD_IMAGES stream or without one.
async fn create_table(c: &Client, name: &str, stream: bool) {
    let req = c
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(AttributeDefinition::builder().attribute_name("PK").attribute_type(ScalarAttributeType::S).build().unwrap())
        .attribute_definitions(AttributeDefinition::builder().attribute_name("SK").attribute_type(ScalarAttributeType::S).build().unwrap())
        .key_schema(KeySchemaElement::builder().attribute_name("PK").key_type(KeyType::Hash).build().unwrap())
        .key_schema(KeySchemaElement::builder().attribute_name("SK").key_type(KeyType::Range).build().unwrap());
    let req = if stream {
        req.stream_specification(
            StreamSpecification::builder().stream_enabled(true).stream_view_type(StreamViewType::NewAndOldImages).build().unwrap(),
        )
    } else {
        req
    };
    req.send().await.unwrap_or_else(|e| panic!("create table {name}: {e:?}"));
}

/// `config` (from [`write_example_config`]) with its aggregates in `aggregates` instead.
pub fn use_aggregates_table(config: &Path, table: &str, aggregates: &str) {
    let text = std::fs::read_to_string(config).unwrap();
    let from = format!("aggregates:\n  table: {table}\n");
    assert!(text.contains(&from), "{text}");
    std::fs::write(config, text.replace(&from, &format!("aggregates:\n  table: {aggregates}\n"))).unwrap();
}

/// A config file for the commerce rules on `table`, with `state` as the state table.
pub fn write_config(dir: &Path, table: &str, state: &str, lease: &str) -> PathBuf {
    write_example_config(dir, "config/commerce.yaml", table, state, lease)
}

/// A config file from one of the commerce examples: source and aggregates in `table`, `state`
/// as the state table with `lease` as its lease duration, the dead-letter queue on the test SQS.
pub fn write_example_config(dir: &Path, example: &str, table: &str, state: &str, lease: &str) -> PathBuf {
    let text = std::fs::read_to_string(root().join(example)).unwrap();
    let text = text
        .replace("  lease_duration: 10s\n", "")
        .replace("table: commerce-main", &format!("table: {table}"))
        .replace("table: commerce-aggregates", &format!("table: {table}"))
        .replace("table: ddb-aggregator-state", &format!("table: {state}\n  lease_duration: {lease}"))
        .replace(
            "queue_url: http://localhost:9324/000000000000/ddb-aggregator-dlq",
            &format!("queue_url: {}/000000000000/{table}-dlq", sqs_endpoint()),
        );
    let path = dir.join(format!("{table}.yaml"));
    std::fs::write(&path, text).unwrap();
    path
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running `ddb-aggregator run` process.
pub struct Service {
    pub child: Child,
    pub metrics_port: u16,
    pub log: PathBuf,
}

impl Service {
    pub fn start(config: &Path, log_dir: &Path, name: &str, extra_env: &[(&str, &str)]) -> Service {
        Service::start_binary(Path::new(env!("CARGO_BIN_EXE_ddb-aggregator")), config, log_dir, name, extra_env)
    }

    /// [`Service::start`] with another build of the service (an earlier release's).
    pub fn start_binary(binary: &Path, config: &Path, log_dir: &Path, name: &str, extra_env: &[(&str, &str)]) -> Service {
        let metrics_port = free_port();
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new(binary);
        cmd.args(["run", "--config", config.to_str().unwrap(), "--log-format", "text"])
            .envs(aws_env())
            .env("DDB_AGGREGATOR__METRICS__LISTEN", format!("127.0.0.1:{metrics_port}"))
            .env("RUST_LOG", "info")
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start ddb-aggregator");
        Service { child, metrics_port, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; returns the exit code and how long the process took to exit (bounded 15 s).
    pub fn terminate(&mut self) -> (Option<i32>, Duration) {
        let started = Instant::now();
        let _ = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status();
        for _ in 0..300 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status.code(), started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
        (None, started.elapsed())
    }

    /// The Prometheus text of /metrics (empty if unreachable).
    pub fn metrics(&self) -> String {
        self.get("/metrics").1
    }

    /// GET `path` on the metrics port: (status line, body); empty if unreachable.
    pub fn get(&self, path: &str) -> (String, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)) else { return Default::default() };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes());
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or_default();
        (head.lines().next().unwrap_or("").to_string(), body.to_string())
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sum of a metric's samples (all label sets).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub type Values = BTreeMap<(String, String, String), Decimal>;

pub async fn scan(c: &Client, table: &str) -> Vec<std::collections::HashMap<String, AttributeValue>> {
    let mut out = Vec::new();
    let mut start = None;
    loop {
        let page = c.scan().table_name(table).consistent_read(true).set_exclusive_start_key(start).send().await.expect("scan");
        out.extend(page.items().iter().cloned());
        match page.last_evaluated_key() {
            Some(k) if !k.is_empty() => start = Some(k.clone()),
            _ => return out,
        }
    }
}

fn s<'a>(item: &'a std::collections::HashMap<String, AttributeValue>, k: &str) -> Option<&'a str> {
    item.get(k).and_then(|v| v.as_s().ok()).map(String::as_str)
}

/// The commerce aggregates computed from the order items themselves (not from the stream).
pub fn truth(items: &[std::collections::HashMap<String, AttributeValue>]) -> Values {
    let mut t: Values = BTreeMap::new();
    let mut add = |pk: &str, sk: &str, a: &str, v: Decimal| {
        let e = t.entry((pk.to_string(), sk.to_string(), a.to_string())).or_insert(Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    };
    for item in items {
        let (Some(pk), Some(sk)) = (s(item, "PK"), s(item, "SK")) else { continue };
        let p: Vec<&str> = pk.split('#').collect();
        let k: Vec<&str> = sk.split('#').collect();
        if p.len() != 2 || p[0] != "CUST" || p[1].is_empty() || k.len() != 3 || k[0] != "ORDER" || k[1].is_empty() || k[2].is_empty() {
            continue;
        }
        let total = item.get("total").and_then(|v| v.as_n().ok()).map(|n| Decimal::parse(n).unwrap());
        let status = s(item, "status");
        add(pk, "PROFILE", "orderCount", Decimal::ONE);
        if let Some(t) = total {
            add(pk, "PROFILE", "revenue", t);
        }
        if let Some(st) = status {
            add(pk, "PROFILE", &format!("orders_{st}"), Decimal::ONE);
            if st == "PENDING" || st == "PAID" {
                add(pk, "PROFILE", "openOrders", Decimal::ONE);
                if let Some(t) = total {
                    add(pk, "PROFILE", "openRevenue", t);
                }
            }
        }
        // Dates in this workload are plain days.
        let day = format!("SALES#{}", k[1]);
        add(&day, "TOTAL", "orders", Decimal::ONE);
        if let Some(t) = total {
            add(&day, "TOTAL", "revenue", t);
        }
    }
    t.retain(|_, v| !v.is_zero());
    t
}

/// The numeric attributes of the aggregate items (PROFILE and TOTAL), ledger excluded.
pub fn aggregates(items: &[std::collections::HashMap<String, AttributeValue>]) -> Values {
    let mut out = BTreeMap::new();
    for item in items {
        let (Some(pk), Some(sk)) = (s(item, "PK"), s(item, "SK")) else { continue };
        if sk != "PROFILE" && sk != "TOTAL" {
            continue;
        }
        for (a, v) in item.iter().filter(|(a, _)| !a.starts_with("_agg")) {
            if let Ok(n) = v.as_n() {
                let d = Decimal::parse(n).unwrap();
                if !d.is_zero() {
                    out.insert((pk.to_string(), sk.to_string(), a.clone()), d);
                }
            }
        }
    }
    out
}

/// Waits (bounded) until the aggregates equal the truth; returns the time it took.
pub async fn wait_exact(c: &Client, table: &str, timeout: Duration) -> Duration {
    wait_exact_or(c, table, timeout, String::new).await
}

/// Like [`wait_exact`]; `context` adds to the failure message (a service log, say).
pub async fn wait_exact_or(c: &Client, table: &str, timeout: Duration, context: impl Fn() -> String) -> Duration {
    let started = Instant::now();
    loop {
        let items = scan(c, table).await;
        let (want, got) = (truth(&items), aggregates(&items));
        if want == got {
            return started.elapsed();
        }
        if started.elapsed() > timeout {
            let diffs: Vec<String> = want
                .keys()
                .chain(got.keys())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .filter(|k| want.get(*k) != got.get(*k))
                .take(10)
                .map(|k| format!("{k:?}: stored {:?}, truth {:?}", got.get(k).map(|d| d.to_string()), want.get(k).map(|d| d.to_string())))
                .collect();
            panic!("aggregates differ from the truth after {timeout:?} ({} values):\n{}\n{}", want.len(), diffs.join("\n"), context());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A random workload over `customers` customers: inserts, status and total changes, other
/// attribute changes, deletes. `workers` tasks write concurrently, each on its own customers.
pub async fn workload(c: &Client, table: &str, writes: usize, customers: usize, workers: usize, seed: u64) -> usize {
    let mut handles = Vec::new();
    for w in 0..workers {
        let c = c.clone();
        let table = table.to_string();
        let share = writes / workers + usize::from(w < writes % workers);
        handles.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed * 1000 + w as u64);
            let mine: Vec<usize> = (0..customers).filter(|i| i % workers == w).collect();
            let mut orders: Vec<(String, String)> = Vec::new();
            let mut n = 0usize;
            let statuses = ["PENDING", "PAID", "SHIPPED", "CANCELLED"];
            let mut done = 0;
            while done < share {
                let roll = rng.u32(0..100);
                let total = format!("{}.{:02}", rng.u32(0..500), rng.u32(0..100));
                let r = if roll < 40 || orders.is_empty() {
                    n += 1;
                    let pk = format!("CUST#c{}", mine[rng.usize(0..mine.len())]);
                    let sk = format!("ORDER#2026-11-{:02}#w{w}o{n}", rng.u32(1..29));
                    orders.push((pk.clone(), sk.clone()));
                    c.put_item()
                        .table_name(&table)
                        .item("PK", AttributeValue::S(pk))
                        .item("SK", AttributeValue::S(sk))
                        .item("status", AttributeValue::S(statuses[rng.usize(0..2)].into()))
                        .item("total", AttributeValue::N(total))
                        .item("updatedAt", updated_at())
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| format!("{e:?}"))
                } else {
                    let change = match roll {
                        ..65 => Change::Status,
                        65..85 => Change::Total,
                        85..90 => Change::Note,
                        _ => Change::Delete,
                    };
                    change_order(&c, &table, &mut orders, &mut rng, change).await
                };
                r.expect("workload write");
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    total
}

/// `updatedAt` of an order write: increasing across every writer of the process (latest's
/// `by` in config/commerce-measures.yaml).
fn updated_at() -> AttributeValue {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    AttributeValue::N(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_string())
}

/// A change to an existing order.
#[derive(Clone, Copy, Debug)]
pub enum Change {
    /// A random status (one of the four).
    Status,
    /// A random total.
    Total,
    /// An attribute no rule counts.
    Note,
    Delete,
}

/// Applies `change` to a random order of `orders` (deleted orders leave the list).
pub async fn change_order(
    c: &Client,
    table: &str,
    orders: &mut Vec<(String, String)>,
    rng: &mut fastrand::Rng,
    change: Change,
) -> Result<(), String> {
    let i = rng.usize(0..orders.len());
    let (pk, sk) = orders[i].clone();
    let upd = c.update_item().table_name(table).key("PK", AttributeValue::S(pk.clone())).key("SK", AttributeValue::S(sk.clone()));
    let sent = match change {
        Change::Status => {
            let status = ["PENDING", "PAID", "SHIPPED", "CANCELLED"][rng.usize(0..4)];
            upd.update_expression("SET #s = :s, updatedAt = :u")
                .expression_attribute_names("#s", "status")
                .expression_attribute_values(":s", AttributeValue::S(status.into()))
                .expression_attribute_values(":u", updated_at())
                .send()
                .await
                .map(|_| ())
        }
        Change::Total => {
            let total = format!("{}.{:02}", rng.u32(0..500), rng.u32(0..100));
            upd.update_expression("SET #t = :t, updatedAt = :u")
                .expression_attribute_names("#t", "total")
                .expression_attribute_values(":t", AttributeValue::N(total))
                .expression_attribute_values(":u", updated_at())
                .send()
                .await
                .map(|_| ())
        }
        Change::Note => upd
            .update_expression("SET note = :n")
            .expression_attribute_values(":n", AttributeValue::S(format!("note {}", rng.u32(..))))
            .send()
            .await
            .map(|_| ()),
        Change::Delete => {
            orders.swap_remove(i);
            return c
                .delete_item()
                .table_name(table)
                .key("PK", AttributeValue::S(pk))
                .key("SK", AttributeValue::S(sk))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| format!("{e:?}"));
        }
    };
    sent.map_err(|e| format!("{e:?}"))
}

/// The helper items of max, min, latest and distinct in `table` (not the registry item).
pub async fn helper_items(c: &Client, table: &str) -> Vec<std::collections::HashMap<String, AttributeValue>> {
    let mut items = scan(c, table).await;
    items.retain(|i| i["SK"].as_s().is_ok_and(|sk| sk.contains("#_agg#")) && !i["PK"].as_s().is_ok_and(|pk| pk.starts_with("#_agg#")));
    items
}

/// One item by key, read strongly consistently (empty when absent).
pub async fn get(c: &Client, table: &str, pk: &str, sk: &str) -> std::collections::HashMap<String, AttributeValue> {
    c.get_item()
        .table_name(table)
        .key("PK", AttributeValue::S(pk.into()))
        .key("SK", AttributeValue::S(sk.into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item()
        .cloned()
        .unwrap_or_default()
}

/// The lease items of a state table (the ones with a `stream_arn`; the reconcile request and
/// the stream last read are not leases): shard, owner, checkpoint.
pub async fn leases(c: &Client, state: &str) -> Vec<(String, Option<String>, Option<String>)> {
    let Ok(_) = c.describe_table().table_name(state).send().await else { return Vec::new() };
    scan(c, state)
        .await
        .iter()
        .filter(|i| i.contains_key("stream_arn"))
        .map(|i| (s(i, "shard_id").unwrap_or("").to_string(), s(i, "owner").map(str::to_string), s(i, "checkpoint").map(str::to_string)))
        .collect()
}

/// The checkpoints of a state table once they have held still for three seconds (a batch moves
/// its checkpoint just after its writes, so aggregates can be exact a moment before it moves).
pub async fn settled_checkpoints(c: &Client, state: &str) -> Vec<String> {
    let read = || async { leases(c, state).await.into_iter().filter_map(|(_, _, cp)| cp).collect::<Vec<String>>() };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = read().await;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = read().await;
        if now == last && !now.is_empty() {
            return now;
        }
        assert!(Instant::now() < deadline, "the checkpoints of {state} kept moving: {now:?}");
        last = now;
    }
}

pub fn sqs_client_at(endpoint: &str) -> aws_sdk_sqs::Client {
    let creds = aws_sdk_sqs::config::Credentials::new("local", "local", None, None, "tests");
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(creds)
        .build();
    aws_sdk_sqs::Client::from_conf(conf)
}

/// Creates a queue; returns its URL as the server spells it.
pub async fn create_queue(sqs: &aws_sdk_sqs::Client, name: &str) -> String {
    sqs.create_queue().queue_name(name).send().await.expect("create queue").queue_url().unwrap().to_string()
}

/// Every message in the queue (received, not deleted: visibility timeout 300 s keeps them
/// from being counted twice); bounded.
pub async fn drain_queue(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<(serde_json::Value, std::collections::HashMap<String, String>)> {
    let mut out = Vec::new();
    for _ in 0..200 {
        let resp = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(300)
            .message_attribute_names("All")
            .wait_time_seconds(0)
            .send()
            .await
            .expect("receive");
        let msgs = resp.messages();
        if msgs.is_empty() {
            break;
        }
        for m in msgs {
            let body: serde_json::Value = serde_json::from_str(m.body().unwrap_or("null")).expect("dead letter is JSON");
            let attrs = m
                .message_attributes()
                .map(|a| a.iter().filter_map(|(k, v)| Some((k.clone(), v.string_value()?.to_string()))).collect())
                .unwrap_or_default();
            out.push((body, attrs));
        }
    }
    out
}

/// A directory for a test's configs and service logs. With `KEEP_TEST_LOGS=1` it is kept
/// (its path is printed) so the logs of a failed run can be read.
pub fn test_dir() -> tempfile::TempDir {
    let mut dir = tempfile::tempdir().unwrap();
    if std::env::var_os("KEEP_TEST_LOGS").is_some() {
        println!("test logs kept in {}", dir.path().display());
        dir.disable_cleanup(true);
    }
    dir
}

/// The truth over the good records: the commerce rules, with each poison record left out of
/// the rules it poisons.
pub fn truth_without_poison(items: &[std::collections::HashMap<String, AttributeValue>]) -> Values {
    let mut out = Values::new();
    let mut add = |k: (String, String, String), v: Decimal| {
        let e = out.entry(k).or_insert(Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    };
    for item in items {
        let sk = item["SK"].as_s().unwrap();
        let pk = item["PK"].as_s().unwrap();
        let non_numeric = item.get("total").is_some_and(|t| t.as_s().is_ok());
        let bad_status = item.get("status").and_then(|s| s.as_s().ok()).is_some_and(|s| s.contains('#'));
        let bad_date = sk.contains("#someday#");
        let rejected_customer = pk == "CUST#cbad";
        // Rule customer-orders: poisoned by a string total, a '#' in status, cbad's profile.
        let mut one = vec![item.clone()];
        let orders_ok = !(non_numeric || bad_status || rejected_customer);
        let sales_ok = !(non_numeric || bad_date);
        if orders_ok || sales_ok {
            if bad_date {
                // Let truth() parse the item; its SALES part is dropped below.
                one[0].insert("SK".into(), AttributeValue::S(sk.replace("#someday#", "#1999-01-01#")));
            }
            for (k, v) in truth(&one) {
                let is_sales = k.0.starts_with("SALES#");
                if (is_sales && sales_ok) || (!is_sales && orders_ok) {
                    add(k, v);
                }
            }
        }
    }
    out.retain(|_, v| !v.is_zero());
    out
}

/// A deployment of `example` (a file under config/) for a test: a source table and an
/// aggregates table of its own (no stream, as DESIGN recommends), with the config pointing at
/// them, leases of 2 s. (directory, source table, aggregates table, config)
pub async fn deployment(
    c: &aws_sdk_dynamodb::Client,
    prefix: &str,
    example: &str,
) -> (tempfile::TempDir, String, String, std::path::PathBuf) {
    let dir = test_dir();
    let table = unique(prefix);
    let aggregates = format!("{table}-agg");
    create_source_table(c, &table).await;
    create_aggregates_table(c, &aggregates).await;
    let config = write_example_config(dir.path(), example, &table, &format!("{table}-state"), "2s");
    use_aggregates_table(&config, &table, &aggregates);
    (dir, table, aggregates, config)
}
