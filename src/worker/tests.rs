//! The whole consumer on in-memory fakes: the simulated stream (splits, rollovers, expired
//! iterators, trimming), the memory lease table and the memory aggregate table.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::decimal::Decimal;
use crate::rules::Coalescer;
use crate::sink::dead_letter::MemoryDeadLetters;
use crate::sink::memory::{MemValue, MemoryAggregates};
use crate::state::memory::MemoryLeases;
use crate::stream::sim::SimStream;

fn config() -> Config {
    config_with(&[("SOURCE__BATCH_SIZE", "7")])
}

/// The demo config with a 600 ms lease and `DDB_AGGREGATOR__<name>` overrides.
fn config_with(overrides: &[(&str, &str)]) -> Config {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
    // Tip evidence after two empty pages, however quick (the rule before it was configurable):
    // these tests wait for it in real time. The rule itself is tested in `super::tip`.
    let mut env = vec![
        ("DDB_AGGREGATOR__STATE__LEASE_DURATION".to_string(), "600ms".to_string()),
        ("DDB_AGGREGATOR__RECONCILE__TIP_EVIDENCE__EMPTY_PAGES".to_string(), "2".to_string()),
        ("DDB_AGGREGATOR__RECONCILE__TIP_EVIDENCE__OVER".to_string(), "0s".to_string()),
    ];
    env.extend(overrides.iter().map(|(k, v)| (format!("DDB_AGGREGATOR__{k}"), v.to_string())));
    Config::from_yaml(&text, env).unwrap()
}

fn order(customer: &str, n: u32, event: &str, total: &str, status: &str) -> Value {
    let img = json!({"PK": {"S": format!("CUST#{customer}")}, "SK": {"S": format!("ORDER#2026-11-30#o{n}")}, "total": {"N": total}, "status": {"S": status}});
    let mut ddb = json!({"Keys": {"PK": img["PK"], "SK": img["SK"]}, "ApproximateCreationDateTime": 1_764_460_800});
    match event {
        "INSERT" => ddb["NewImage"] = img,
        "REMOVE" => ddb["OldImage"] = img,
        _ => {
            ddb["NewImage"] = img.clone();
            ddb["OldImage"] = img;
        }
    }
    json!({"eventName": event, "dynamodb": ddb})
}

/// The expected aggregates: every record in one batch through the engine.
fn expected(records: &[Value]) -> BTreeMap<(Vec<String>, String), Decimal> {
    let engine = config().engine;
    let mut batch = Coalescer::new();
    for r in records {
        assert!(engine.apply(r, &mut batch).poisons.is_empty());
    }
    let mut out = BTreeMap::new();
    for (k, d) in batch.into_targets() {
        for (a, v) in d.attributes {
            out.insert((k.0.iter().map(|s| s.to_string()).collect(), a), v);
        }
    }
    out
}

type Fakes = (Arc<SimStream>, Arc<MemoryLeases>, Arc<MemoryAggregates>);

struct Replica {
    cancel: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), WorkerError>>,
    shared: Arc<Shared<ArcSource, ArcLeases, MemoryAggregates>>,
}

/// Starts a replica over shared fakes (the fakes are shared through Arc wrappers).
fn start(fakes: &Fakes, name: &str) -> Replica {
    start_with(fakes, name, None)
}

fn start_with(fakes: &Fakes, name: &str, dlq: Option<Arc<MemoryDeadLetters>>) -> Replica {
    start_config(fakes, name, dlq, config())
}

fn start_config(fakes: &Fakes, name: &str, dlq: Option<Arc<MemoryDeadLetters>>, config: Config) -> Replica {
    let mut shared = Shared::new(
        config,
        ArcSource(fakes.0.clone()),
        ArcLeases(fakes.1.clone()),
        fakes.2.clone(),
        name.to_string(),
        Arc::new(Health::default()),
    );
    if let Some(d) = dlq {
        shared = shared.with_dead_letters(DeadLetters::Memory(d), "arn:sim".into());
    }
    let worker = Worker::new(shared);
    let shared = worker.shared().clone();
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    Replica { cancel, handle: tokio::spawn(worker.run(c)), shared }
}

struct ArcSource(Arc<SimStream>);
impl StreamSource for ArcSource {
    async fn shards(&self) -> Result<Vec<ShardInfo>, crate::stream::StreamError> {
        self.0.shards().await
    }
    async fn iterator(&self, shard_id: &str, position: &crate::stream::Position) -> Result<String, crate::stream::StreamError> {
        self.0.iterator(shard_id, position).await
    }
    async fn records(&self, iterator: &str, limit: u32) -> Result<crate::stream::Page, crate::stream::StreamError> {
        self.0.records(iterator, limit).await
    }
}

struct ArcLeases(Arc<MemoryLeases>);
impl LeaseStore for ArcLeases {
    async fn prepare(&self, create: bool) -> Result<(), crate::state::StateError> {
        self.0.prepare(create).await
    }
    async fn list(&self) -> Result<Vec<Lease>, crate::state::StateError> {
        self.0.list().await
    }
    async fn refresh(&self, view: &mut crate::state::LeaseView) -> Result<(), crate::state::StateError> {
        self.0.refresh(view).await
    }
    async fn create(&self, lease: &Lease) -> Result<bool, crate::state::StateError> {
        self.0.create(lease).await
    }
    async fn take(&self, lease: &Lease, owner: &str, expires_at_ms: u64) -> Result<Option<Lease>, crate::state::StateError> {
        self.0.take(lease, owner, expires_at_ms).await
    }
    async fn renew(&self, shard_id: &str, owner: &str, counter: u64, expires_at_ms: u64) -> Result<bool, crate::state::StateError> {
        self.0.renew(shard_id, owner, counter, expires_at_ms).await
    }
    async fn checkpoint(
        &self,
        shard_id: &str,
        owner: &str,
        counter: u64,
        progress: &crate::state::Progress,
    ) -> Result<bool, crate::state::StateError> {
        self.0.checkpoint(shard_id, owner, counter, progress).await
    }
    async fn release(&self, shard_id: &str, owner: &str, counter: u64) -> Result<bool, crate::state::StateError> {
        self.0.release(shard_id, owner, counter).await
    }
    async fn delete(&self, lease: &Lease) -> Result<bool, crate::state::StateError> {
        self.0.delete(lease).await
    }
    async fn request_reconcile(&self, at_ms: u64) -> Result<(), crate::state::StateError> {
        self.0.request_reconcile(at_ms).await
    }
    async fn reconcile_request(&self) -> Result<Option<u64>, crate::state::StateError> {
        self.0.reconcile_request().await
    }
    async fn clear_reconcile_request(&self, started_ms: u64) -> Result<bool, crate::state::StateError> {
        self.0.clear_reconcile_request(started_ms).await
    }
    async fn hold_named(&self, name: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, crate::state::StateError> {
        self.0.hold_named(name, owner, until_ms, now_ms).await
    }
    async fn release_named(&self, name: &str, owner: &str) -> Result<(), crate::state::StateError> {
        self.0.release_named(name, owner).await
    }
    async fn rule_fingerprints(&self) -> Result<Option<BTreeMap<String, String>>, crate::state::StateError> {
        self.0.rule_fingerprints().await
    }
    async fn record_fingerprints(&self, fingerprints: &BTreeMap<String, String>) -> Result<(), crate::state::StateError> {
        self.0.record_fingerprints(fingerprints).await
    }
    async fn definitions(&self) -> Result<Option<(crate::state::definitions::Committed, u64)>, crate::state::StateError> {
        self.0.definitions().await
    }
    async fn store_definitions(
        &self,
        c: &crate::state::definitions::Committed,
        revision: Option<u64>,
    ) -> Result<bool, crate::state::StateError> {
        self.0.store_definitions(c, revision).await
    }
    async fn publish_beat(&self, beat: &crate::state::definitions::Beat) -> Result<(), crate::state::StateError> {
        self.0.publish_beat(beat).await
    }
    async fn beats(&self) -> Result<Vec<crate::state::definitions::Beat>, crate::state::StateError> {
        self.0.beats().await
    }
    async fn drop_beat(&self, owner: &str) -> Result<(), crate::state::StateError> {
        self.0.drop_beat(owner).await
    }
    async fn record_copy_job(&self, job: &crate::rules::copy::job::CopyJob) -> Result<bool, crate::state::StateError> {
        self.0.record_copy_job(job).await
    }
    async fn copy_jobs(&self) -> Result<Vec<crate::rules::copy::job::StoredJob>, crate::state::StateError> {
        self.0.copy_jobs().await
    }
    async fn claim_copy_job(
        &self,
        id: &str,
        version: &str,
        owner: &str,
        until_ms: u64,
        now_ms: u64,
    ) -> Result<bool, crate::state::StateError> {
        self.0.claim_copy_job(id, version, owner, until_ms, now_ms).await
    }
    async fn advance_copy_job(
        &self,
        id: &str,
        version: &str,
        owner: &str,
        step: &crate::state::JobStep,
    ) -> Result<bool, crate::state::StateError> {
        self.0.advance_copy_job(id, version, owner, step).await
    }
    async fn end_copy_job(
        &self,
        id: &str,
        version: &str,
        next: Option<&crate::rules::copy::job::CopyJob>,
    ) -> Result<bool, crate::state::StateError> {
        self.0.end_copy_job(id, version, next).await
    }
}

/// Waits (bounded) until the aggregates equal `want` and every closed shard is finished.
async fn settle(fakes: &Fakes, want: &BTreeMap<(Vec<String>, String), Decimal>, closed: usize) {
    for _ in 0..400 {
        let finished = fakes.1.snapshot().iter().filter(|l| l.finished()).count();
        if fakes.2.numbers() == *want && finished >= closed {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fakes.2.numbers(), *want, "aggregates did not settle in 20 s");
    panic!("closed shards not finished: {:?}", fakes.1.snapshot());
}

/// A lineage: root -> rollover -> split into two, records in each generation.
fn workload(sim: &SimStream) -> (Vec<Value>, Vec<(String, Option<String>)>) {
    let mut all = Vec::new();
    let mut lineage = Vec::new();
    let root = sim.add_shard(None);
    lineage.push((root.clone(), None));
    let mut n = 0;
    let mut put = |shard: &str, all: &mut Vec<Value>, k: u32| {
        for i in 0..k {
            n += 1;
            let r =
                order(&format!("c{}", n % 5), n, "INSERT", &format!("{}.{:02}", i, n % 100), if n % 2 == 0 { "PAID" } else { "PENDING" });
            sim.append(shard, r.clone());
            all.push(r);
        }
    };
    put(&root, &mut all, 20);
    let next = sim.rollover(&root);
    lineage.push((next.clone(), Some(root.clone())));
    put(&next, &mut all, 15);
    let (a, b) = sim.split(&next);
    lineage.push((a.clone(), Some(next.clone())));
    lineage.push((b.clone(), Some(next.clone())));
    put(&a, &mut all, 12);
    put(&b, &mut all, 9);
    // Changes to existing orders land in the child shards too.
    for (shard, i) in [(&a, 3u32), (&b, 4)] {
        let r = order(&format!("c{}", i % 5), i, "MODIFY", "99.99", "SHIPPED");
        sim.append(shard, r.clone());
        all.push(r);
    }
    (all, lineage)
}

#[tokio::test]
async fn reads_lineage_parent_first_and_applies_exactly_once() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let (records, lineage) = workload(&fakes.0);
    let replica = start(&fakes, "r1");
    settle(&fakes, &expected(&records), 2).await;
    replica.cancel.cancel();
    replica.handle.await.unwrap().unwrap();
    // Parent-first: every record of a parent was read before any record of its child.
    let reads = fakes.0.reads();
    for (child, parent) in &lineage {
        if let Some(parent) = parent {
            let last_parent = reads.iter().rposition(|(s, _)| s == parent).unwrap();
            let first_child = reads.iter().position(|(s, _)| s == child).unwrap();
            assert!(last_parent < first_child, "{child} read before its parent {parent} was done");
        }
    }
    // Released on shutdown.
    assert!(fakes.1.snapshot().iter().all(|l| l.owner.is_none()), "{:?}", fakes.1.snapshot());
}

#[tokio::test]
async fn replay_from_trim_horizon_changes_nothing() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let (records, _) = workload(&fakes.0);
    let want = expected(&records);
    let r = start(&fakes, "r1");
    settle(&fakes, &want, 2).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    // Forget every checkpoint: a new lease table replays the whole stream.
    let replay: Fakes = (fakes.0.clone(), Arc::new(MemoryLeases::new()), fakes.2.clone());
    let calls_before = fakes.2.calls();
    let r = start(&replay, "r2");
    settle(&replay, &want, 2).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(fakes.2.numbers(), want, "replay changed nothing");
    assert!(fakes.2.calls() > calls_before, "the replay did write (and was refused by the ledger)");
}

#[tokio::test]
async fn expired_iterators_throttling_and_failed_writes_lose_nothing() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let mut records = Vec::new();
    let r = start(&fakes, "r1");
    for round in 0..6u32 {
        for i in 0..10u32 {
            let rec = order("c1", round * 10 + i, "INSERT", "1.1", "PAID");
            fakes.0.append(&shard, rec.clone());
            records.push(rec);
        }
        match round {
            1 => fakes.0.expire_iterators(),
            2 => fakes.0.throttle_next(3),
            3 => fakes.2.fail_next(4),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(fakes.2.numbers()[&(vec!["CUST#c1".to_string(), "PROFILE".to_string()], "revenue".to_string())].to_string(), "66");
}

#[tokio::test]
async fn trimmed_data_is_counted_not_skipped_silently() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    for i in 0..10 {
        fakes.0.append(&shard, order("c1", i, "INSERT", "1", "PAID"));
    }
    // A checkpoint at record 3 whose successors were trimmed before we resumed.
    let mut lease = Lease::new(&shard, None);
    lease.checkpoint = Some(crate::state::Checkpoint::Sequence(format!("{:021}", 3)));
    fakes.1.create(&lease).await.unwrap();
    fakes.0.trim(&shard, 6);
    let r = start(&fakes, "r1");
    // Records 7..10 survive the trim and are applied; 4..6 are lost and reported.
    let want = expected(&(7..=10).map(|i| order("c1", i - 1, "INSERT", "1", "PAID")).collect::<Vec<_>>());
    settle(&fakes, &want, 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert!(r.shared.trimmed_events.load(Ordering::Relaxed) >= 1);
}

/// DynamoDB Local answers TrimmedDataAccess to GetRecords on an empty shard read from
/// TRIM_HORIZON. With no checkpoint nothing can have been lost: the reader polls again,
/// schedules no reconcile, and applies the records once they come.
#[tokio::test]
async fn trimmed_answers_before_any_checkpoint_are_not_a_loss() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    fakes.0.trimmed_when_empty();
    let r = start(&fakes, "r1");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let records: Vec<Value> = (1..=5).map(|i| order("c1", i, "INSERT", "2.5", "PAID")).collect();
    for r in &records {
        fakes.0.append(&shard, r.clone());
    }
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(r.shared.trimmed_events.load(Ordering::Relaxed), 0, "no loss reported");
    assert!(!r.shared.reconcile_everything.load(Ordering::Relaxed), "no reconcile scheduled");
}

#[tokio::test]
async fn two_replicas_share_shards_and_stay_exact() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shards: Vec<String> = (0..4).map(|_| fakes.0.add_shard(None)).collect();
    let mut records = Vec::new();
    for (i, s) in shards.iter().enumerate() {
        for j in 0..25u32 {
            let n = i as u32 * 100 + j;
            let rec = order(&format!("c{}", n % 3), n, "INSERT", "2.5", "PAID");
            fakes.0.append(s, rec.clone());
            records.push(rec);
        }
    }
    let a = start(&fakes, "a");
    let b = start(&fakes, "b");
    settle(&fakes, &expected(&records), 0).await;
    // Give balancing a few rounds, then each holds two.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let owners: Vec<Option<String>> = fakes.1.snapshot().into_iter().map(|l| l.owner).collect();
    let count = |o: &str| owners.iter().filter(|x| x.as_deref() == Some(o)).count();
    assert_eq!((count("a"), count("b")), (2, 2), "{owners:?}");
    // One replica goes away without releasing (a crash): the other takes everything over.
    a.handle.abort();
    let more = order("c9", 999, "INSERT", "1", "PAID");
    fakes.0.append(&shards[0], more.clone());
    records.push(more);
    settle(&fakes, &expected(&records), 0).await;
    b.cancel.cancel();
    b.handle.await.unwrap().unwrap();
}

#[tokio::test]
async fn poison_records_go_to_the_dead_letter_queue_and_the_shard_moves_on() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let dlq = Arc::new(MemoryDeadLetters::default());
    let shard = fakes.0.add_shard(None);
    let mut good = Vec::new();
    let mut poison_seqs = Vec::new();
    for i in 0..30u32 {
        let rec = match i {
            5 => order("c1", i, "INSERT", "1", "PA#ID"), // key delimiter in orders_{status}
            11 => {
                let mut r = order("c2", i, "INSERT", "1", "PAID");
                r["dynamodb"]["NewImage"]["total"] = json!({"S": "12 EUR"}); // non-numeric sum
                r
            }
            17 => order("cbad", i, "INSERT", "1", "PAID"), // its PROFILE's orderCount is a string
            _ => order(&format!("c{}", i % 3), i, "INSERT", "2.5", "PENDING"),
        };
        let seq = fakes.0.append(&shard, rec.clone());
        if matches!(i, 5 | 11 | 17) {
            poison_seqs.push(format!("{seq:021}"));
        } else {
            good.push(rec);
        }
    }
    fakes.2.put(&["CUST#cbad", "PROFILE"], "orderCount", MemValue::Str("n/a".into()));
    dlq.fail_next(2); // the queue is down at first: the shard waits, nothing is lost
    let r = start_with(&fakes, "r1", Some(dlq.clone()));
    // The good records of all rules, plus the rules the poison records did not poison.
    let mut want = expected(&good);
    for rec in [order("c1", 5, "INSERT", "1", "PA#ID"), order("cbad", 17, "INSERT", "1", "PAID")] {
        let mut day = rec.clone();
        day["dynamodb"]["NewImage"]["status"] = json!({"S": "PAID"});
        for ((k, a), v) in expected(&[day]) {
            if k[0].starts_with("SALES#") {
                let e = want.entry((k, a)).or_insert(Decimal::ZERO);
                *e = e.checked_add(v).unwrap();
            }
        }
    }
    settle(&fakes, &want, 0).await;
    for _ in 0..100 {
        if dlq.letters().len() >= 3 && fakes.1.snapshot()[0].checkpoint == Some(crate::state::Checkpoint::Sequence(format!("{:021}", 30))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    let letters = dlq.letters();
    let got: Vec<(String, String, String)> =
        letters.iter().map(|l| (l.sequence_number.clone(), l.reason.code.clone(), l.rule.clone())).collect();
    assert_eq!(
        got,
        vec![
            (poison_seqs[0].clone(), "key_delimiter".into(), "customer-orders".into()),
            (poison_seqs[1].clone(), "non_numeric_sum".into(), "customer-orders".into()),
            (poison_seqs[2].clone(), "write_rejected".into(), "customer-orders".into()),
        ],
        "each poison record exactly once, with its reason"
    );
    assert_eq!(letters[1].rules, vec!["customer-orders", "daily-sales"], "a record that poisons two rules is one message naming both");
    assert_eq!(letters[1].record["dynamodb"]["NewImage"]["total"]["S"], "12 EUR", "the full record travels with the letter");
    assert_eq!(letters[2].attempts, 5, "permanent write errors are retried max_attempts times");
    assert_eq!(letters[0].variables.get("customer").map(String::as_str), Some("c1"));
    assert_eq!(
        fakes.1.snapshot()[0].checkpoint,
        Some(crate::state::Checkpoint::Sequence(format!("{:021}", 30))),
        "the checkpoint passed them"
    );
}

#[tokio::test]
async fn records_older_than_max_record_age_are_dead_lettered() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let dlq = Arc::new(MemoryDeadLetters::default());
    let shard = fakes.0.add_shard(None);
    let old = order("c1", 1, "INSERT", "1", "PAID"); // ApproximateCreationDateTime is in 2025
    let mut fresh = order("c1", 2, "INSERT", "2", "PAID");
    fresh["dynamodb"]["ApproximateCreationDateTime"] = json!(crate::state::now_ms() / 1000);
    fakes.0.append(&shard, old);
    fakes.0.append(&shard, fresh.clone());
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
    let env = vec![
        ("DDB_AGGREGATOR__STATE__LEASE_DURATION".to_string(), "600ms".to_string()),
        ("DDB_AGGREGATOR__SOURCE__MAX_RECORD_AGE".to_string(), "1h".to_string()),
    ];
    let cfg = Config::from_yaml(&text, env).unwrap();
    let shared =
        Shared::new(cfg, ArcSource(fakes.0.clone()), ArcLeases(fakes.1.clone()), fakes.2.clone(), "r1".into(), Arc::new(Health::default()))
            .with_dead_letters(DeadLetters::Memory(dlq.clone()), "arn".into());
    let cancel = CancellationToken::new();
    let h = tokio::spawn(Worker::new(shared).run(cancel.clone()));
    settle(&fakes, &expected(&[fresh]), 0).await;
    for _ in 0..100 {
        if !dlq.letters().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    h.await.unwrap().unwrap();
    let letters = dlq.letters();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].reason.code, "too_old");
    assert_eq!(letters[0].rules, vec!["customer-orders", "daily-sales"]);
}

#[tokio::test]
async fn ledger_entries_of_finished_shards_are_pruned_and_stale_writers_fenced() {
    use crate::sink::ledger::{floor_value, Ledger};
    use crate::sink::{write_target, ShardContext};
    let ledger = Ledger::new(&config().ledger_namespace);
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let a = fakes.0.add_shard(None);
    let mut records = Vec::new();
    for i in 0..5 {
        let r = order("c1", i, "INSERT", "1", "PAID");
        fakes.0.append(&a, r.clone());
        records.push(r);
    }
    let b = fakes.0.rollover(&a);
    let r = order("c1", 10, "INSERT", "1", "PAID");
    fakes.0.append(&b, r.clone());
    records.push(r);
    let replica = start(&fakes, "r1");
    settle(&fakes, &expected(&records), 1).await;
    // The first write from B saw A's entry; the next write to the item removes it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = order("c1", 11, "INSERT", "1", "PAID");
    fakes.0.append(&b, r.clone());
    records.push(r);
    settle(&fakes, &expected(&records), 1).await;
    let item = fakes.2.item(&["CUST#c1", "PROFILE"]).unwrap();
    let entries: Vec<&String> = item.keys().filter(|k| ledger.is_entry(k)).collect();
    assert_eq!(entries, vec![&ledger.entry_name(&b)], "only the open shard's entry is left");
    let b_created = crate::shard_id::created_ms(&b).unwrap();
    assert_eq!(item.get(&ledger.floor_attribute()), Some(&MemValue::Str(floor_value(b_created))));
    replica.cancel.cancel();
    replica.handle.await.unwrap().unwrap();
    // A former owner of A that wakes up late cannot re-apply A's records: it is fenced.
    let engine = config().engine;
    let mut batch = Coalescer::new();
    engine.apply(
        &{
            let mut r = order("c1", 3, "INSERT", "1", "PAID");
            r["dynamodb"]["SequenceNumber"] = json!(format!("{:021}", 4));
            r
        },
        &mut batch,
    );
    let (key, delta) = batch.into_targets().into_iter().find(|(k, _)| &*k.0[0] == "CUST#c1").unwrap();
    let stale = write_target(fakes.2.as_ref(), &engine.key_names, &key, &delta, &ShardContext::new(&ledger, &a)).await.unwrap();
    assert!(stale.fenced && stale.applied_records == 0, "{stale:?}");
    assert_eq!(fakes.2.numbers(), expected(&records), "nothing was applied twice");
}

/// Random lineage graphs (splits and rollovers at random points, records everywhere) are read
/// parent-first and applied exactly once, with two replicas sharing the work.
#[tokio::test]
async fn random_lineages_are_read_parent_first() {
    for seed in 0..6u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
        let mut open: Vec<String> = (0..rng.usize(1..3)).map(|_| fakes.0.add_shard(None)).collect();
        let mut parents: Vec<(String, String)> = Vec::new();
        let mut records = Vec::new();
        let mut closed = 0;
        let mut n = 0u32;
        for _ in 0..rng.usize(3..8) {
            // Records on every open shard, then one shard splits or rolls over.
            for s in &open {
                for _ in 0..rng.u32(0..6) {
                    n += 1;
                    let r = order(&format!("c{}", rng.u32(0..4)), n, "INSERT", &format!("{}.{}", rng.u32(0..50), rng.u32(0..10)), "PAID");
                    fakes.0.append(s, r.clone());
                    records.push(r);
                }
            }
            let i = rng.usize(0..open.len());
            let s = open.remove(i);
            closed += 1;
            if rng.bool() {
                let (a, b) = fakes.0.split(&s);
                parents.push((a.clone(), s.clone()));
                parents.push((b.clone(), s.clone()));
                open.extend([a, b]);
            } else {
                let c = fakes.0.rollover(&s);
                parents.push((c.clone(), s.clone()));
                open.push(c);
            }
        }
        let a = start(&fakes, "a");
        let b = start(&fakes, "b");
        settle(&fakes, &expected(&records), closed).await;
        a.cancel.cancel();
        b.cancel.cancel();
        a.handle.await.unwrap().unwrap();
        b.handle.await.unwrap().unwrap();
        let reads = fakes.0.reads();
        for (child, parent) in &parents {
            let (Some(last_parent), Some(first_child)) =
                (reads.iter().rposition(|(s, _)| s == parent), reads.iter().position(|(s, _)| s == child))
            else {
                continue;
            };
            assert!(last_parent < first_child, "seed {seed}: {child} read before its parent {parent} was done");
        }
    }
}

/// A random order history for a few customers, with sequence numbers: inserts, status and
/// total changes (some that change nothing the rules count), deletes.
fn random_history(rng: &mut fastrand::Rng, len: usize) -> Vec<Value> {
    let statuses = ["PENDING", "PAID", "SHIPPED"];
    let mut live: Vec<Value> = Vec::new();
    let mut out = Vec::new();
    for n in 0..len {
        let (event, old, new) = if live.is_empty() || rng.u8(0..10) < 4 {
            let img = json!({"PK": {"S": format!("CUST#c{}", rng.u8(0..3))}, "SK": {"S": format!("ORDER#2026-11-30#o{n}")},
                             "total": {"N": format!("{}.{:02}", rng.u32(0..500), rng.u32(0..100))}, "status": {"S": statuses[rng.usize(0..2)]}});
            live.push(img.clone());
            ("INSERT", None, Some(img))
        } else {
            let i = rng.usize(0..live.len());
            match rng.u8(0..10) {
                0..=2 => ("REMOVE", Some(live.swap_remove(i)), None),
                r => {
                    let old = live[i].clone();
                    match r {
                        3..=5 => live[i]["status"] = json!({"S": statuses[rng.usize(0..3)]}),
                        6..=8 => live[i]["total"] = json!({"N": format!("{}.{:02}", rng.u32(0..500), rng.u32(0..100))}),
                        _ => live[i]["note"] = json!({"S": "nothing counted changes"}),
                    }
                    ("MODIFY", Some(old), Some(live[i].clone()))
                }
            }
        };
        let img = old.as_ref().or(new.as_ref()).unwrap();
        let mut ddb = json!({"Keys": {"PK": img["PK"], "SK": img["SK"]}, "SequenceNumber": format!("{:021}", 100 + n),
                             "ApproximateCreationDateTime": 1_764_460_800});
        if let Some(o) = old {
            ddb["OldImage"] = o;
        }
        if let Some(n) = new {
            ddb["NewImage"] = n;
        }
        out.push(json!({"eventName": event, "dynamodb": ddb}));
    }
    out
}

/// Readers of one shard that overlap in every way the lease protocol allows: a reader starts
/// at a checkpoint its predecessor wrote, cuts batches differently, and the predecessor's
/// writes after that checkpoint land late, partly, or not at all, interleaved with the new
/// reader's. Whatever the cuts, every record is applied exactly once: in particular records
/// that cancel out within one reader's batch while a predecessor applied only some of them.
#[tokio::test]
async fn overlapping_readers_with_any_batch_cuts_apply_every_record_once() {
    use crate::rules::{TargetDelta, TargetKey};
    use crate::sink::{write_target, ShardContext};
    let engine = config().engine;
    let ctx = ShardContext::new(&crate::sink::ledger::Ledger::new("t"), "shardId-00000001796001337266-8e340a17");
    // One reader's batches over records[from..to]: each batch's target writes.
    let batches = |rng: &mut fastrand::Rng, records: &[Value], from: usize, to: usize| -> Vec<(usize, Vec<(TargetKey, TargetDelta)>)> {
        let mut out = Vec::new();
        let mut at = from;
        while at < to {
            let end = (at + rng.usize(1..8)).min(to);
            let mut batch = Coalescer::new();
            for r in &records[at..end] {
                assert!(engine.apply(r, &mut batch).poisons.is_empty());
            }
            out.push((end, batch.into_targets()));
            at = end;
        }
        out
    };
    for case in 0..400u64 {
        let mut rng = fastrand::Rng::with_seed(case);
        let len = rng.usize(5..40);
        let records = random_history(&mut rng, len);
        let store = MemoryAggregates::new();
        let mut checkpoint = 0;
        // Per dead reader, its batches after its last checkpoint, in order: all writes of one
        // batch land before any of the next (a batch starts when the one before is written).
        let mut zombies: Vec<std::collections::VecDeque<Vec<(TargetKey, TargetDelta)>>> = Vec::new();
        let readers = rng.usize(1..5);
        for r in 0..readers {
            let last = r + 1 == readers;
            let to = if last { records.len() } else { rng.usize(checkpoint..=records.len()) };
            let mine = batches(&mut rng, &records, checkpoint, to);
            // This reader checkpoints after `done` batches, then dies with the rest in flight.
            let done = if last { mine.len() } else { rng.usize(0..=mine.len()) };
            let mut tail = std::collections::VecDeque::new();
            for (i, (end, writes)) in mine.into_iter().enumerate() {
                if i < done {
                    for (key, delta) in &writes {
                        // A dead reader's writes land at random moments.
                        if let Some(z) = (!zombies.is_empty() && rng.bool()).then(|| rng.usize(0..zombies.len())) {
                            if let Some(front) = zombies[z].front_mut() {
                                let (k, d) = front.swap_remove(rng.usize(0..front.len()));
                                write_target(&store, &engine.key_names, &k, &d, &ctx).await.unwrap();
                                if front.is_empty() {
                                    zombies[z].pop_front();
                                }
                            }
                        }
                        write_target(&store, &engine.key_names, key, delta, &ctx).await.unwrap();
                    }
                    checkpoint = end;
                } else {
                    // Not checkpointed: written whole, or partly when the reader died in it.
                    let whole = rng.bool();
                    let landing: Vec<_> = writes.into_iter().filter(|_| whole || rng.bool()).collect();
                    if !landing.is_empty() {
                        tail.push_back(landing);
                    }
                    if !whole {
                        break;
                    }
                }
            }
            zombies.push(tail);
        }
        for z in zombies {
            for batch in z {
                for (k, d) in batch {
                    write_target(&store, &engine.key_names, &k, &d, &ctx).await.unwrap();
                }
            }
        }
        assert_eq!(store.numbers(), expected(&records), "case {case}: {} records", records.len());
    }
}

/// A batch larger than one GetRecords page gathers full pages without waiting, so each target
/// is written once for all of them; batch_size cuts batches; at the tip the window waits.
#[tokio::test]
async fn batches_gather_pages_up_to_batch_size() {
    for (size, window, writes) in [("2500", "60s", 2), ("2500", "0s", 2), ("1000", "0s", 6)] {
        let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
        let shard = fakes.0.add_shard(None);
        // 2,500 orders of one customer on one day: two targets (CUST#c1, SALES#2026-11-30).
        let records: Vec<Value> = (1..=2500).map(|n| order("c1", n, "INSERT", "1.25", "PAID")).collect();
        for r in &records {
            fakes.0.append(&shard, r.clone());
        }
        // A 5 s lease: a debug build on a loaded machine can take longer than 600 ms over a
        // batch of 2,500, and a lease that lapses under every attempt never commits one.
        let config = config_with(&[("SOURCE__BATCH_SIZE", size), ("SOURCE__BATCHING_WINDOW", window), ("STATE__LEASE_DURATION", "5s")]);
        let r = start_config(&fakes, "r1", None, config);
        settle(&fakes, &expected(&records), 0).await;
        r.cancel.cancel();
        r.handle.await.unwrap().unwrap();
        // Pages of 1,000, 1,000 and 500: one batch of 2,500, or three of up to 1,000. Applied
        // writes, not calls: on a loaded machine the lease can still lapse, and the batch read
        // again is refused by the ledger (stale calls, nothing applied).
        let applied = fakes.2.hottest().map(|(_, n, _)| 2 * n);
        assert_eq!(applied, Some(writes), "batch_size {size}, window {window}: {} calls", fakes.2.calls());
        assert_eq!(
            fakes.2.numbers().get(&(vec!["CUST#c1".to_string(), "PROFILE".to_string()], "revenue".to_string())),
            Some(&Decimal::parse("3125").unwrap())
        );
    }
}

/// Two rules that feed one target item.
fn two_rule_config() -> Config {
    let text = r#"
source: { table: src-table, start_position: trim_horizon, batch_size: 100 }
state: { table: state-table, lease_duration: 600ms }
aggregates: { table: agg-table }
dead_letter: { queue_url: "http://127.0.0.1:1/q", max_attempts: 1 }
rules:
  - name: counts
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures: { orderCount: count }
    reconcile: { scan: true }
  - name: by-status
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures: { "orders_{status}": count }
    reconcile: { scan: true }
"#;
    Config::from_yaml(text, Vec::<(String, String)>::new()).unwrap()
}

/// Scenario c: after a refused write, isolation is per record. A record refused for one rule's
/// attribute is refused whole and dead-lettered; the other records land with both rules'
/// contributions (per-contribution isolation dropped the second rule's part of each record).
#[tokio::test]
async fn a_refused_attribute_isolates_whole_records_and_hides_no_other_rule() {
    let (letter, numbers) = refused_letter_after(|_, _| {}).await;
    let key = |a: &str| (vec!["CUST#c1".to_string(), "PROFILE".to_string()], a.to_string());
    let want: BTreeMap<_, _> = [
        (key("orderCount"), Decimal::from_i64(3)),
        (key("orders_PAID"), Decimal::from_i64(2)),
        (key("orders_PENDING"), Decimal::from_i64(1)),
    ]
    .into();
    assert_eq!(numbers, want);
    assert_eq!(letter.rules, vec!["counts", "by-status"], "the letter names every rule of the refused record");
    assert_eq!(letter.record["dynamodb"]["NewImage"]["status"]["S"], "BAD", "the refused record, read again from the stream");
    assert!(!letter.images_cut);
}

/// A replica with `start_position: latest`, once it holds a lease and reads at the tip.
async fn start_at_latest(fakes: &Fakes) -> Replica {
    let r = start_config(fakes, "r1", None, config_with(&[("SOURCE__START_POSITION", "latest")]));
    for _ in 0..100 {
        if fakes.1.snapshot().iter().any(|l| l.owner.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    r
}

/// Scenario a: under `start_position: latest`, a child of a known shard is read from its
/// start: a rollover never skips the child's first records.
#[tokio::test]
async fn latest_never_skips_the_first_records_of_a_rollover() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let root = fakes.0.add_shard(None);
    fakes.0.append(&root, order("c1", 1, "INSERT", "100", "PAID")); // before the start: skipped by `latest`
    let r = start_at_latest(&fakes).await;
    let mut records = vec![order("c1", 2, "INSERT", "1", "PAID")];
    fakes.0.append(&root, records[0].clone());
    let child = fakes.0.rollover(&root);
    for n in 3..8 {
        let rec = order("c1", n, "INSERT", "1", "PAID");
        fakes.0.append(&child, rec.clone());
        records.push(rec);
    }
    settle(&fakes, &expected(&records), 1).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// Scenario b: a leased shard that left DescribeStream before it was read to its end is lost
/// data: counted, its lease finished (so it pins neither the ledger floor nor reconcile), and a
/// reconcile of everything requested in the state table (where it survives restarts).
#[tokio::test(start_paused = true)]
async fn a_shard_gone_before_its_end_is_counted_finished_and_reconciled() {
    // Virtual time: a shard counts as lost only after it was missing for minutes.
    crate::state::simulate_clock(Some(crate::state::now_ms()));
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let old = fakes.0.add_shard(None);
    let young = fakes.0.add_shard(None);
    let r = start(&fakes, "r1");
    settle(&fakes, &BTreeMap::new(), 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    r.cancel.cancel(); // released, unfinished
    r.handle.await.unwrap().unwrap();
    fakes.0.append(&old, order("c1", 1, "INSERT", "5", "PAID")); // never read
    fakes.0.forget(&old);
    let rec = order("c2", 2, "INSERT", "1", "PAID");
    fakes.0.append(&young, rec.clone());
    let r = start(&fakes, "r2");
    settle(&fakes, &expected(std::slice::from_ref(&rec)), 0).await;
    tokio::time::sleep(Duration::from_secs(11 * 60)).await;
    settle(&fakes, &expected(&[rec]), 0).await;
    // Finished, and then deleted (unlisted, no children): either way it blocks nothing.
    let lease = fakes.1.snapshot().into_iter().find(|l| l.shard_id == old);
    assert!(lease.as_ref().is_none_or(|l| l.finished()), "{lease:?}");
    for _ in 0..50 {
        if fakes.1.reconcile_request().await.unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(fakes.1.reconcile_request().await.unwrap().is_some(), "a reconcile of everything is requested");
    let plan = r.shared.floor_plan().unwrap();
    assert_eq!(
        plan.floor,
        crate::sink::ledger::floor_value(crate::shard_id::created_ms(&young).unwrap()),
        "the lost shard no longer pins the floor"
    );
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// Scenario h: finished leases are deleted once DescribeStream forgets the shard and its
/// children hold checkpoints, so the lease scan does not grow with the stream's age.
#[tokio::test]
async fn finished_leases_are_deleted_once_the_stream_forgets_them() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let (records, lineage) = workload(&fakes.0);
    let r = start(&fakes, "r1");
    settle(&fakes, &expected(&records), 2).await;
    let (root, _) = &lineage[0];
    let (second, _) = &lineage[1];
    fakes.0.forget(root);
    fakes.0.forget(second);
    for _ in 0..100 {
        if fakes.1.snapshot().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left: Vec<String> = fakes.1.snapshot().into_iter().map(|l| l.shard_id).collect();
    assert_eq!(left, vec![lineage[2].0.clone(), lineage[3].0.clone()], "only the open children's leases are left");
    assert_eq!(fakes.1.reconcile_request().await.unwrap(), None, "deleting finished leases is no loss");
    // Records keep flowing, exactly once.
    let more = order("c1", 77, "INSERT", "3", "PAID");
    fakes.0.append(&lineage[2].0, more.clone());
    let mut all = records.clone();
    all.push(more);
    settle(&fakes, &expected(&all), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

#[test]
fn batches_are_due_when_full_at_the_end_or_at_the_tip_after_the_window() {
    use super::shard::batch_due;
    // (pending, batch_size, shard_end, at_tip, window_passed) -> due
    let cases = [
        ((0, 100, true, true, true), false),     // nothing gathered: nothing to apply
        ((100, 100, false, false, false), true), // full
        ((150, 100, false, false, false), true),
        ((5, 100, true, false, false), true),  // the shard's end: apply what is left
        ((5, 100, false, true, true), true),   // the tip, window passed
        ((5, 100, false, true, false), false), // the tip, still within the window: wait
        ((5, 100, false, false, true), false), // a full page: keep gathering without waiting
    ];
    for ((pending, size, end, tip, passed), due) in cases {
        assert_eq!(batch_due(pending, size, end, tip, passed), due, "{pending} {size} {end} {tip} {passed}");
    }
}

/// A reader started at LATEST has no checkpoint until its first batch: throttling before then
/// must not make it ask for LATEST again (the simulation found records skipped that way). It
/// retries the iterator it has.
#[tokio::test]
async fn a_throttled_reader_at_latest_keeps_its_place() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let r = start_at_latest(&fakes).await;
    fakes.0.throttle_next(3);
    let records: Vec<Value> = (1..=3).map(|n| order("c1", n, "INSERT", "2", "PAID")).collect();
    for rec in &records {
        fakes.0.append(&shard, rec.clone());
    }
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// A first batch at LATEST whose writes fail is read again from its first page once the
/// table takes writes, not from a new LATEST iterator that would skip it.
#[tokio::test]
async fn a_failed_first_batch_at_latest_is_read_again_not_skipped() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let r = start_at_latest(&fakes).await;
    fakes.2.fail_next_for_good(3);
    let records: Vec<Value> = (1..=3).map(|n| order("c1", n, "INSERT", "2", "PAID")).collect();
    for rec in &records {
        fakes.0.append(&shard, rec.clone());
    }
    settle(&fakes, &expected(&records), 0).await;
    assert_eq!(fakes.1.reconcile_request().await.unwrap(), None, "nothing was skipped");
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// Waits (at most 2 s) for a reconcile request in the state table.
async fn await_request(fakes: &Fakes) {
    for _ in 0..100 {
        if fakes.1.reconcile_request().await.unwrap().is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A shard read from LATEST that changes hands before its first checkpoint (its reader stopped,
/// crashed or lost the lease before any record came) is read from LATEST again: what arrived
/// between the two starts is skipped. Not silent: the second reader requests a reconcile of
/// everything (the simulation found deployment B's counts below the truth without one).
#[tokio::test]
async fn a_latest_shard_taken_again_before_its_first_checkpoint_requests_a_reconcile() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let first = start_at_latest(&fakes).await;
    first.cancel.cancel();
    first.handle.await.unwrap().unwrap();
    assert_eq!(fakes.1.reconcile_request().await.unwrap(), None, "one reader of a LATEST start loses nothing");
    // Written while nobody reads: the next LATEST start is after it.
    fakes.0.append(&shard, order("c1", 1, "INSERT", "2", "PAID"));
    let second = start_at_latest(&fakes).await;
    await_request(&fakes).await;
    assert!(fakes.1.reconcile_request().await.unwrap().is_some(), "the second reader of the LATEST start asks for a reconcile");
    second.cancel.cancel();
    second.handle.await.unwrap().unwrap();
}

/// DynamoDB Local answers TrimmedDataAccess to the iterator of an empty shard read from LATEST
/// once records arrive; a new LATEST iterator then skips them (the reconcile benchmark found
/// 63 of 2,000 orders skipped so). Not silent: a reconcile of everything is requested and
/// persisted at once, and what arrives after the new iterator is applied.
#[tokio::test]
async fn a_trimmed_answer_at_latest_requests_a_reconcile() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    fakes.0.trimmed_when_empty();
    let r = start_at_latest(&fakes).await;
    await_request(&fakes).await;
    assert!(fakes.1.reconcile_request().await.unwrap().is_some(), "the request is in the state table");
    // The stretch a new LATEST iterator skips, then what comes after it.
    fakes.0.append(&shard, order("c1", 1, "INSERT", "2", "PAID"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later: Vec<Value> = (2..=3).map(|n| order("c1", n, "INSERT", "2", "PAID")).collect();
    for rec in &later {
        fakes.0.append(&shard, rec.clone());
    }
    settle(&fakes, &expected(&later), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(r.shared.trimmed_events.load(Ordering::Relaxed), 0, "not counted as trimmed data");
}

/// A reconcile request still only in memory when the replica is told to stop (its write
/// failed and the retry is the next round's, which never comes) is written by the drain, not
/// lost with the process.
#[tokio::test]
async fn a_pending_reconcile_request_is_written_when_the_replica_stops() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    fakes.0.add_shard(None);
    let r = start(&fakes, "r1");
    settle(&fakes, &BTreeMap::new(), 0).await;
    assert_eq!(fakes.1.reconcile_request().await.unwrap(), None, "nothing requested yet");
    r.shared.request_reconcile_everything();
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert!(fakes.1.reconcile_request().await.unwrap().is_some(), "the drain wrote the pending request");
}

/// AWS: GetRecords may answer an empty list for a stretch of the shard without records, and
/// take more calls to reach the records after it. Such a page is not the tip: a lease never
/// shows tip evidence while records before it wait unapplied (reconcile would compare too soon).
#[tokio::test]
async fn an_empty_page_mid_shard_is_not_taken_for_the_tip() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let records: Vec<Value> = (1..=5).map(|n| order("c1", n, "INSERT", "2", "PAID")).collect();
    for rec in &records {
        fakes.0.append(&shard, rec.clone());
    }
    fakes.0.empty_pages_next(1);
    let r = start(&fakes, "a");
    let mut evidence_seen = false;
    for _ in 0..400 {
        let lease = fakes.1.snapshot().into_iter().find(|l| l.shard_id == shard);
        if let Some(l) = lease.filter(|l| l.at_tip_ms.is_some()) {
            assert!(l.checkpoint.is_some(), "tip evidence before any record was applied: {l:?}");
            evidence_seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(evidence_seen, "the reader reaches the real tip and says so");
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// Reconcile's own consumer as a replica that only takes free leases and reads a never-taken
/// shard from its horizon.
fn start_own_consumer(fakes: &Fakes, config: Config) -> (CancellationToken, tokio::task::JoinHandle<Result<(), WorkerError>>) {
    let shared = Shared::new(
        config,
        ArcSource(fakes.0.clone()),
        ArcLeases(fakes.1.clone()),
        fakes.2.clone(),
        "reconcile-x".to_string(),
        Arc::new(Health::default()),
    )
    .without_balancing()
    .reading_from_the_horizon();
    let cancel = CancellationToken::new();
    (cancel.clone(), tokio::spawn(Worker::new(shared).run(cancel)))
}

/// A shard `run` read from LATEST and left without a checkpoint (no record came) is not read
/// from the horizon by reconcile's own consumer: the records before `run`'s start were skipped
/// on purpose (a backfill counted them), and applying them now would count them twice.
#[tokio::test]
async fn reconciles_consumer_does_not_replay_what_latest_skipped() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    fakes.0.append(&shard, order("c3", 1, "INSERT", "5", "PAID"));
    let run = start_at_latest(&fakes).await;
    run.cancel.cancel();
    run.handle.await.unwrap().unwrap();
    let lease = fakes.1.snapshot().into_iter().find(|l| l.shard_id == shard).unwrap();
    assert_eq!((lease.checkpoint.clone(), lease.counter > 0), (None, true), "{lease:?}");
    let (cancel, own) = start_own_consumer(&fakes, config_with(&[("SOURCE__START_POSITION", "latest")]));
    for _ in 0..200 {
        if fakes.1.snapshot().iter().any(|l| l.owner.as_deref() == Some("reconcile-x")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let later = vec![order("c4", 2, "INSERT", "7", "PAID")];
    fakes.0.append(&shard, later[0].clone());
    settle(&fakes, &expected(&later), 0).await;
    cancel.cancel();
    own.await.unwrap().unwrap();
    assert_eq!(fakes.2.numbers(), expected(&later), "the record before run's start stays uncounted");
}

/// Reconcile's own consumer on a deployment at `start_position: latest` that never ran: it
/// reads from the horizon, and a shard that had no record keeps a TRIM_HORIZON checkpoint, so
/// the first `run` counts what arrives between the two instead of starting at LATEST.
#[tokio::test]
async fn a_reader_from_the_horizon_leaves_run_no_gap_at_latest() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shard = fakes.0.add_shard(None);
    let latest = config_with(&[("SOURCE__START_POSITION", "latest")]);
    let (cancel, own) = start_own_consumer(&fakes, latest.clone());
    for _ in 0..400 {
        if fakes.1.snapshot().iter().any(|l| l.at_tip_ms.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cancel.cancel();
    own.await.unwrap().unwrap();
    let lease = fakes.1.snapshot().into_iter().find(|l| l.shard_id == shard).unwrap();
    assert_eq!(lease.checkpoint, Some(crate::state::Checkpoint::TrimHorizon), "{lease:?}");
    // Written while nobody reads the stream; then `run` starts for the first time.
    let between: Vec<Value> = (1..=4).map(|n| order("c2", n, "INSERT", "3", "PAID")).collect();
    for rec in &between {
        fakes.0.append(&shard, rec.clone());
    }
    let r = start_config(&fakes, "run", None, latest);
    settle(&fakes, &expected(&between), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

/// Targets are remembered for the schedule only when a scheduled run will read them; with the
/// schedule off, 100,000 written targets ask for no reconcile of everything.
#[test]
fn written_targets_are_kept_only_for_a_schedule_that_reads_them() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let shared = |config: Config| {
        Shared::new(
            config,
            ArcSource(fakes.0.clone()),
            ArcLeases(fakes.1.clone()),
            fakes.2.clone(),
            "r".into(),
            Arc::new(Health::default()),
        )
    };
    let key = |i: u32| crate::rules::TargetKey(vec![Box::from(format!("CUST#c{i}").as_str()), Box::from("PROFILE")].into_boxed_slice());
    for (interval, scope, kept) in [("0s", "touched", false), ("1h", "all", false), ("1h", "touched", true)] {
        let s = shared(config_with(&[("RECONCILE__INTERVAL", interval), ("RECONCILE__SCOPE", scope)]));
        for i in 0..100_001 {
            s.touch("customer-orders", &key(i));
        }
        let held: usize = s.touched.lock().unwrap().values().map(|t| t.len()).sum();
        assert_eq!(held > 0, kept, "{interval} {scope}: {held} kept");
        assert_eq!(
            s.reconcile_everything.load(Ordering::Relaxed),
            kept,
            "{interval} {scope}: the bound asks for everything only with a schedule"
        );
    }
}
#[test]
fn an_empty_poll_soon_after_records_waits_the_minimum_and_an_idle_shard_backs_off() {
    use super::shard::{next_idle, ACTIVE_FOR};
    use super::Polling;
    let p = Polling { idle_min: Duration::from_millis(100), idle_max: Duration::from_millis(250) };
    let ms = Duration::from_millis;
    // Records 300 ms ago: the minimum, however far the backoff had gone.
    assert_eq!(next_idle(ms(250), &p, Some(ms(300))), ms(100));
    // Records longer ago than ACTIVE_FOR, or never: doubling, capped.
    assert_eq!(next_idle(ms(100), &p, Some(ACTIVE_FOR)), ms(200));
    assert_eq!(next_idle(ms(200), &p, None), ms(250));
    assert_eq!(next_idle(ms(250), &p, None), ms(250));
}

/// Four records on one target, the second refused by a user's attribute of the wrong type;
/// `fault` strikes once the first write is refused, while the record is isolated. Returns the
/// one letter (a `write_rejected` of the second record) and the numbers that landed.
/// The letter re-reads its record from the stream (a batch keeps none): throttling is retried
/// and the letter still carries the full record; a record trimmed meanwhile travels as its
/// sequence number alone, marked cut, the reason saying why. Either way the other records land
/// and the shard moves on.
async fn refused_letter_after(
    fault: impl FnOnce(&SimStream, &str),
) -> (crate::sink::dead_letter::DeadLetter, BTreeMap<(Vec<String>, String), Decimal>) {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let dlq = Arc::new(MemoryDeadLetters::default());
    fakes.2.put(&["CUST#c1", "PROFILE"], "orders_BAD", MemValue::Str("not a number".into()));
    let shard = fakes.0.add_shard(None);
    for (n, status) in [(1, "PAID"), (2, "BAD"), (3, "PAID"), (4, "PENDING")] {
        fakes.0.append(&shard, order("c1", n, "INSERT", "1", status));
    }
    let mut config = two_rule_config();
    // Isolation retries the refused record (backing off) before the letter: the fault's window.
    if let Some(d) = config.dead_letter.as_mut() {
        d.max_attempts = 4;
    }
    let r = start_config(&fakes, "r1", Some(dlq.clone()), config);
    for _ in 0..200 {
        if fakes.2.calls() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fault(&fakes.0, &shard);
    for _ in 0..200 {
        if dlq.letters().len() == 1 && fakes.2.numbers().len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    let key = |a: &str| (vec!["CUST#c1".to_string(), "PROFILE".to_string()], a.to_string());
    assert_eq!(fakes.2.numbers().get(&key("orderCount")), Some(&Decimal::from_i64(3)), "the other records landed");
    let letters = dlq.letters();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((letters[0].reason.code.as_str(), letters[0].sequence_number.as_str()), ("write_rejected", "000000000000000000002"));
    (letters[0].clone(), fakes.2.numbers())
}

#[tokio::test]
async fn a_refused_record_is_read_again_through_throttling() {
    let (letter, _) = refused_letter_after(|s, _| s.throttle_next(3)).await;
    assert_eq!(letter.record["dynamodb"]["NewImage"]["status"]["S"], "BAD", "{letter:?}");
    assert!(!letter.images_cut);
}

#[tokio::test]
async fn a_refused_record_trimmed_meanwhile_is_lettered_by_its_sequence_number() {
    let (letter, _) = refused_letter_after(|s, shard| s.trim(shard, 4)).await;
    assert!(letter.images_cut, "{letter:?}");
    assert_eq!(letter.record, json!({"dynamodb": {"SequenceNumber": "000000000000000000002"}}));
    assert!(letter.reason.message.contains("could not be read again from the stream"), "{}", letter.reason.message);
}

#[tokio::test]
async fn a_refused_record_the_stream_answers_only_empty_pages_for_is_lettered_cut_not_retried_for_ever() {
    // 3 empty pages per re-read, REREAD_ATTEMPTS + 1 re-reads: more than the stream ever gives.
    let (letter, _) = refused_letter_after(|s, _| s.empty_pages_next(1_000)).await;
    assert!(letter.images_cut, "{letter:?}");
    assert!(letter.reason.message.contains("only empty pages at it, 6 times"), "{}", letter.reason.message);
}

/// A batch holding a record older than the helper write limit writes its counts and sums but
/// none of its helper items (one that expired meanwhile would count the record again), and
/// asks for a reconcile of everything; a batch of young records writes them.
#[tokio::test]
async fn records_too_old_for_helper_items_leave_them_to_reconcile() {
    for too_old in [true, false] {
        let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
        let shard = fakes.0.add_shard(None);
        let now_s = crate::state::now_ms() / 1000;
        let mut old = order("c1", 1, "INSERT", "5", "PAID");
        old["dynamodb"]["ApproximateCreationDateTime"] = json!(if too_old { now_s - 37 * 3600 } else { now_s - 23 * 3600 });
        let mut fresh = order("c1", 2, "INSERT", "7", "PAID");
        fresh["dynamodb"]["ApproximateCreationDateTime"] = json!(now_s);
        fakes.0.append(&shard, old);
        fakes.0.append(&shard, fresh);
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let cfg = Config::from_yaml(&text, vec![("DDB_AGGREGATOR__STATE__LEASE_DURATION".to_string(), "600ms".to_string())]).unwrap();
        // The example config names `expiresAt` as the helpers' expiry attribute: the limit holds.
        assert!(cfg.helper_expiry_attribute.is_some());
        let Replica { cancel, handle: h, shared } = start_config(&fakes, "r1", None, cfg);
        let count = || fakes.2.numbers().get(&(vec!["CUST#c1".to_string(), "PROFILE".to_string()], "orderCount".to_string())).copied();
        let checkpointed = || fakes.1.snapshot().iter().any(|l| l.checkpoint == Some(Checkpoint::Sequence(format!("{:021}", 2))));
        for _ in 0..200 {
            if count() == Some(Decimal::from_i64(2)) && checkpointed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
        h.await.unwrap().unwrap();
        assert_eq!(count(), Some(Decimal::from_i64(2)), "counts are written either way (too old: {too_old})");
        assert!(checkpointed(), "the shard goes on (too old: {too_old})");
        let helpers = fakes.2.keys().iter().filter(|k| k.len() == 2 && k[1].contains(crate::rules::helper::MARK)).count();
        // Persisted in the state table, or still to be.
        let requested = shared.reconcile_everything.load(Ordering::Relaxed) || fakes.1.reconcile_request().await.unwrap().is_some();
        if too_old {
            assert_eq!((helpers, requested), (0, true), "helpers left to reconcile");
        } else {
            assert!(helpers > 0 && !requested, "{helpers} helpers, reconcile requested {requested}");
        }
    }
}

mod pipeline;

/// A shard read to its end leaves its unfolded sharded totals in its finished lease, and the
/// owner of a child shard folds them (the parent's owner may have died before its fold round,
/// and nobody reads the parent again). No fold loop runs here, so nothing is folded meanwhile.
#[tokio::test]
async fn a_childs_owner_takes_over_the_finished_parents_unfolded_totals() {
    let fakes: Fakes = (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()));
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
    let text = text.replace(r#"SK: "TOTAL" }"#, r#"SK: "TOTAL", write_shards: 4 }"#);
    let env = vec![("DDB_AGGREGATOR__STATE__LEASE_DURATION".to_string(), "600ms".to_string())];
    let config = Config::from_yaml(&text, env).unwrap();
    let parent = fakes.0.add_shard(None);
    fakes.0.append(&parent, order("c1", 1, "INSERT", "5", "PAID"));
    let child = fakes.0.rollover(&parent);
    let r = start_config(&fakes, "r1", None, config);
    let total = r#"["SALES#2026-11-30","TOTAL"]"#.to_string();
    let mut seen = (Vec::new(), Vec::new());
    for _ in 0..200 {
        let parent_due = fakes.1.snapshot().into_iter().find(|l| l.shard_id == parent && l.finished()).map(|l| l.fold_due);
        seen = (parent_due.unwrap_or_default(), r.shared.folds.due_for(&child));
        if seen.0.contains(&total) && seen.1.contains(&total) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen.0.contains(&total), "the finished parent's lease records the unfolded total: {seen:?}");
    assert!(seen.1.contains(&total), "the child's reader took it over: {seen:?}");
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}
