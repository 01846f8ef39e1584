//! The ledger's conditional UpdateItem against DynamoDB Local itself: replays refused, the
//! remainder applied, finished shards' entries pruned with the floor, stale shards fenced.

mod common;

use aws_sdk_dynamodb::types::AttributeValue;
use common::*;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::rules::{Contribution, TargetDelta, TargetKey};
use ddb_aggregator::sink::dynamodb::DynamoDbAggregates;
use std::sync::Arc;

use ddb_aggregator::sink::ledger::{decode_sequence, floor_value, open_value, pad_sequence, FloorPlan, Ledger};
use ddb_aggregator::sink::{hold, write_target, write_target_pruning, ShardContext, SinkError};
use ddb_aggregator::state::now_ms;

fn delta(seqs: &[u64], amount: &str) -> TargetDelta {
    TargetDelta {
        contributions: seqs
            .iter()
            .map(|s| Contribution {
                sequence: Some(format!("{s:021}").into()),
                rule: None,
                created: Some(Decimal::from_i64(1_764_460_800)),
                values: vec![("revenue".into(), Decimal::parse(amount).unwrap())],
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_condition_on_dynamodb_local() {
    let c = client().await;
    let table = unique("ledger");
    create_source_table(&c, &table).await;
    let store = DynamoDbAggregates::new(c.clone(), table.clone());
    let names = vec!["PK".to_string(), "SK".to_string()];
    let key = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into_boxed_slice());
    let a = "shardId-00000001700000000001-aaaaaaaa";
    let b = "shardId-00000001700000000002-bbbbbbbb";
    let ledger = Ledger::new("dep1");
    let ctx_a = ShardContext::new(&ledger, a);
    let read = || get(&c, &table, "CUST#c1", "PROFILE");
    // Records 1..3 of shard A.
    let s = write_target(&store, &names, &key, &delta(&[1, 2, 3], "1.5"), &ctx_a).await.unwrap();
    assert_eq!((s.calls, s.applied_records), (1, 3));
    // A replay of 1..5: 1..3 are refused by the ledger, 4..5 applied.
    let s = write_target(&store, &names, &key, &delta(&[1, 2, 3, 4, 5], "1.5"), &ctx_a).await.unwrap();
    assert_eq!((s.calls, s.applied_records, s.skipped_records), (2, 2, 3));
    let item = read().await;
    assert_eq!(item["revenue"].as_n().unwrap(), "7.5");
    // The entry is binary (a length byte and the number's bytes): DynamoDB compares it byte by
    // byte, which is what refused 1..3 above.
    assert_eq!(decode_sequence(item[&ledger.entry_name(a)].as_b().unwrap().as_ref()), Some(format!("{:040}", 5)));
    // Another deployment (its own namespace) writes the same item from a shard of the same
    // id: its entry is its own, so neither refuses the other.
    let other = ShardContext::new(&Ledger::new("dep2"), a);
    let s = write_target(&store, &names, &key, &delta(&[1], "100"), &other).await.unwrap();
    assert_eq!(s.applied_records, 1, "a second deployment is not refused by the first one's entry");
    // Shard B (created later) writes; A is finished, so its entry is prunable. Shard S (older
    // than the floor, still open) stays admitted as a straggler.
    let straggler = "shardId-00000001699999999999-cccccccc";
    let plan = FloorPlan::new(floor_value(1_700_000_000_002), vec!["00000001699999999999-cccccccc".into()]);
    let ctx_b = ShardContext { plan: Some(Arc::new(plan)), ..ShardContext::new(&ledger, b) };
    let s = write_target(&store, &names, &key, &delta(&[10], "1"), &ctx_b).await.unwrap();
    let seen = s.seen.unwrap();
    assert_eq!(seen.entries, vec![ledger.entry_name(a), ledger.entry_name(b)]);
    let s = write_target_pruning(&store, &names, &key, &delta(&[11], "1"), &ctx_b, Some(&seen)).await.unwrap();
    assert_eq!(s.pruned, 1);
    let item = read().await;
    assert!(!item.contains_key(&ledger.entry_name(a)), "A's entry was pruned");
    assert_eq!(item[&ledger.floor_attribute()].as_s().unwrap(), &floor_value(1_700_000_000_002));
    assert_eq!(item[&ledger.open_attribute()].as_s().unwrap(), &open_value(&["00000001699999999999-cccccccc".to_string()]));
    assert!(item.contains_key(&Ledger::new("dep2").entry_name(a)), "the other deployment's entry is untouched");
    assert_eq!(item["revenue"].as_n().unwrap(), "109.5");
    // A stale pruning write (it saw the item before the floor moved): its compare-and-set
    // fails on DynamoDB itself, it re-plans from the floor the item holds now, and applies its
    // record once (removing an entry already gone is a no-op).
    let s = write_target_pruning(&store, &names, &key, &delta(&[12], "1"), &ctx_b, Some(&seen)).await.unwrap();
    assert_eq!(s.applied_records, 1);
    assert!(s.stale >= 1, "the first attempt's compare-and-set failed: {s:?}");
    assert_eq!(read().await[&ledger.floor_attribute()].as_s().unwrap(), &floor_value(1_700_000_000_002));
    // The straggler, created before the floor, is admitted by name.
    let ctx_s = ShardContext::new(&ledger, straggler);
    let s = write_target(&store, &names, &key, &delta(&[1], "1"), &ctx_s).await.unwrap();
    assert!(!s.fenced && s.applied_records == 1, "{s:?}");
    assert_eq!(read().await["revenue"].as_n().unwrap(), "111.5");
    // A stalled former owner of A wakes up: fenced, nothing applied twice.
    let stale = write_target(&store, &names, &key, &delta(&[4, 5, 6], "1.5"), &ctx_a).await.unwrap();
    assert!(stale.fenced && stale.applied_records == 0, "{stale:?}");
    assert_eq!(read().await["revenue"].as_n().unwrap(), "111.5");
    // A measure attribute holding a string: a permanent error, not a retry loop.
    c.update_item()
        .table_name(&table)
        .key("PK", AttributeValue::S("CUST#c1".into()))
        .key("SK", AttributeValue::S("PROFILE".into()))
        .update_expression("SET revenue = :s")
        .expression_attribute_values(":s", AttributeValue::S("n/a".into()))
        .send()
        .await
        .unwrap();
    assert!(matches!(write_target(&store, &names, &key, &delta(&[13], "1"), &ctx_b).await, Err(SinkError::Invalid(_))));
}

/// An item written by a version before compact entries holds `_agg:<namespace>:<shard>` as a
/// padded string: DynamoDB itself refuses what it covers, and applies the rest under the
/// compact entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_of_the_previous_format_still_refuses_replays_on_dynamodb_local() {
    let c = client().await;
    let table = unique("ledger-upgrade");
    create_source_table(&c, &table).await;
    let store = DynamoDbAggregates::new(c.clone(), table.clone());
    let names = vec!["PK".to_string(), "SK".to_string()];
    let key = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into_boxed_slice());
    let shard = "shardId-00000001700000000001-aaaaaaaa";
    let ledger = Ledger::new("dep1");
    // The previous version applied records 1..4 (revenue 4 x 2.5) and kept its string entry.
    c.update_item()
        .table_name(&table)
        .key("PK", AttributeValue::S("CUST#c1".into()))
        .key("SK", AttributeValue::S("PROFILE".into()))
        .update_expression("SET revenue = :r, #e = :e")
        .expression_attribute_names("#e", ledger.named_entry(shard))
        .expression_attribute_values(":r", AttributeValue::N("10".into()))
        .expression_attribute_values(":e", AttributeValue::S(format!("{}@1764460800", pad_sequence("4").unwrap())))
        .send()
        .await
        .unwrap();
    let ctx = ShardContext::new(&ledger, shard);
    let s = write_target(&store, &names, &key, &delta(&[1, 2, 3, 4, 5, 6], "2.5"), &ctx).await.unwrap();
    assert_eq!((s.applied_records, s.skipped_records), (2, 4), "{s:?}");
    let item = get(&c, &table, "CUST#c1", "PROFILE").await;
    assert_eq!(item["revenue"].as_n().unwrap(), "15");
    assert_eq!(decode_sequence(item[&ledger.entry_name(shard)].as_b().unwrap().as_ref()), pad_sequence("6"));
    // A replay of everything changes nothing.
    let again = write_target(&store, &names, &key, &delta(&[1, 2, 3, 4, 5, 6], "2.5"), &ctx).await.unwrap();
    assert_eq!(again.applied_records, 0, "{again:?}");
    assert_eq!(get(&c, &table, "CUST#c1", "PROFILE").await["revenue"].as_n().unwrap(), "15");
}

/// A reconcile hold on DynamoDB Local itself: a write refused by a live hold is redone under
/// it, logging each source item's contribution after the write; a write over an expired hold
/// removes hold and log in the same UpdateItem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_log_under_a_live_hold_and_end_an_expired_one_on_dynamodb_local() {
    let c = client().await;
    let table = unique("ledger-hold");
    create_source_table(&c, &table).await;
    let store = DynamoDbAggregates::new(c.clone(), table.clone());
    let names = vec!["PK".to_string(), "SK".to_string()];
    let key = TargetKey(vec![Box::from("SALES#2026-12-04"), Box::from("TOTAL")].into_boxed_slice());
    let ledger = Ledger::new("dep1");
    let ctx = ShardContext::new(&ledger, "shardId-00000001700000000001-aaaaaaaa");
    let set_hold = |value: String| {
        c.update_item()
            .table_name(&table)
            .key("PK", AttributeValue::S("SALES#2026-12-04".into()))
            .key("SK", AttributeValue::S("TOTAL".into()))
            .update_expression("SET #h = :h")
            .expression_attribute_names("#h", ledger.hold_attribute())
            .expression_attribute_values(":h", AttributeValue::S(value))
            .send()
    };
    let order = |seq: u64, item: &str, amount: i64, after: Option<i64>| Contribution {
        sequence: Some(format!("{seq:021}").into()),
        values: vec![("revenue".into(), Decimal::from_i64(amount))],
        item: Some(Arc::from(item)),
        after: Some(after.map(|a| vec![("revenue".into(), Decimal::from_i64(a))]).unwrap_or_default()),
        ..Default::default()
    };
    let batch = |cs: Vec<Contribution>| TargetDelta { contributions: cs, ..Default::default() };
    set_hold(hold::hold_value("h1", now_ms() + 600_000)).await.unwrap();
    // o1 placed at 30 then cancelled, o2 placed at 20.
    let s = write_target(
        &store,
        &names,
        &key,
        &batch(vec![order(1, "o1", 30, Some(30)), order(2, "o2", 20, Some(20)), order(3, "o1", -30, None)]),
        &ctx,
    )
    .await
    .unwrap();
    assert_eq!((s.applied_records, s.held), (3, 1), "{s:?}");
    let item = get(&c, &table, "SALES#2026-12-04", "TOTAL").await;
    assert_eq!(item["revenue"].as_n().unwrap(), "20");
    assert_eq!(item[&hold::log_name(&ledger, "h1", "o1")].as_s().unwrap(), "[]");
    assert_eq!(item[&hold::log_name(&ledger, "h1", "o2")].as_s().unwrap(), r#"[["revenue","20"]]"#);
    assert!(item.contains_key(&ledger.hold_attribute()), "the hold stays for its owner");
    // The hold expires: the next write ends it, logs and all.
    set_hold(hold::hold_value("h1", 1)).await.unwrap();
    let s = write_target(&store, &names, &key, &batch(vec![order(4, "o3", 5, Some(5))]), &ctx).await.unwrap();
    assert_eq!((s.applied_records, s.holds_ended), (1, 1), "{s:?}");
    let item = get(&c, &table, "SALES#2026-12-04", "TOTAL").await;
    assert_eq!(item["revenue"].as_n().unwrap(), "25");
    assert!(item.keys().all(|k| !k.starts_with("_agghold") && !k.starts_with("_agglog")), "{:?}", item.keys().collect::<Vec<_>>());
}

/// Reconcile's side of a hold on DynamoDB Local: placed once (a second placement is refused
/// while it stands), read back with what a write logged under it, and ended by the correction
/// conditioned on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_places_reads_and_ends_a_hold_on_dynamodb_local() {
    use ddb_aggregator::reconcile::protocol::{Correction, Placement, Release, TargetStore};
    let c = client().await;
    let (source, aggregates) = (unique("hold-src"), unique("hold-aggs"));
    create_source_table(&c, &source).await;
    create_source_table(&c, &aggregates).await;
    let yaml = format!(
        "source: {{ table: {source} }}\nstate: {{ table: unused-state }}\naggregates: {{ table: {aggregates}, ledger_namespace: dep1 }}\nrules:\n  - name: daily\n    source_key: {{ PK: \"CUST#{{customer}}\", SK: \"ORDER#{{date}}#{{order}}\" }}\n    target: {{ PK: \"SALES#{{date}}\", SK: TOTAL }}\n    measures:\n      revenue: {{ sum: total }}\n"
    );
    let config = ddb_aggregator::config::Config::from_yaml(&yaml, Vec::<(String, String)>::new()).unwrap();
    let creds = aws_sdk_dynamodb::config::Credentials::new("local", "local", None, None, "tests");
    let sdk = aws_config::SdkConfig::builder()
        .behavior_version(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint())
        .credentials_provider(aws_sdk_dynamodb::config::SharedCredentialsProvider::new(creds))
        .build();
    let reconciler = ddb_aggregator::reconcile::Reconciler::new(&sdk, config).await.unwrap();
    let store = DynamoDbAggregates::new(c.clone(), aggregates.clone());
    let names = vec!["PK".to_string(), "SK".to_string()];
    let key = TargetKey(vec![Box::from("SALES#2026-12-04"), Box::from("TOTAL")].into_boxed_slice());
    let ctx = ShardContext::new(&Ledger::new("dep1"), "shardId-00000001700000000001-aaaaaaaa");
    let order = |seq: u64, item: &str, amount: i64| Contribution {
        sequence: Some(format!("{seq:021}").into()),
        values: vec![("revenue".into(), Decimal::from_i64(amount))],
        item: Some(Arc::from(item)),
        after: Some(vec![("revenue".into(), Decimal::from_i64(amount))]),
        ..Default::default()
    };
    let write = |cs: Vec<Contribution>| TargetDelta { contributions: cs, ..Default::default() };
    write_target(&store, &names, &key, &write(vec![order(1, "o1", 10)]), &ctx).await.unwrap();
    let value = hold::hold_value("r1", now_ms() + 600_000);
    let place = |seen: Option<String>| Placement { value: value.clone(), seen, stale: vec![] };
    assert!(reconciler.hold(&key, &place(None)).await.unwrap());
    assert!(!reconciler.hold(&key, &place(None)).await.unwrap(), "a standing hold is not replaced");
    let absent = TargetKey(vec![Box::from("SALES#1999-01-01"), Box::from("TOTAL")].into_boxed_slice());
    assert!(!reconciler.hold(&absent, &place(None)).await.unwrap(), "no hold on an item this deployment never wrote");
    write_target(&store, &names, &key, &write(vec![order(2, "o2", 7)]), &ctx).await.unwrap();
    let item = reconciler.read(&key).await.unwrap();
    assert_eq!(item.hold.as_deref(), Some(value.as_str()));
    let logs: Vec<(&String, &String)> = item.logs.iter().collect();
    assert_eq!(logs, [(&"_agglog:dep1:r1:o2".to_string(), &r#"[["revenue","7"]]"#.to_string())]);
    // The correction ends the hold with its logs; conditioned on it, a second one is refused.
    let release = Release { hold: value.clone(), logs: item.logs.keys().cloned().collect() };
    let fix = Correction {
        seen_version: item.version.clone(),
        set: vec![("revenue".into(), Decimal::from_i64(17))],
        fence: None,
        expect: vec![],
        release: Some(release),
    };
    assert!(reconciler.correct(&key, &fix).await.unwrap());
    let after = reconciler.read(&key).await.unwrap();
    assert!(after.hold.is_none() && after.logs.is_empty(), "{after:?}");
    let again = Correction { seen_version: after.version.clone(), ..fix };
    assert!(!reconciler.correct(&key, &again).await.unwrap(), "the hold is gone");
    // An expired hold and a stale log of it: replaced, the log removed in the same write.
    let (old, stale) = (hold::hold_value("r0", 1), "_agglog:dep1:r0:x".to_string());
    c.update_item()
        .table_name(&aggregates)
        .key("PK", AttributeValue::S("SALES#2026-12-04".into()))
        .key("SK", AttributeValue::S("TOTAL".into()))
        .update_expression("SET #h = :h, #l = :l")
        .expression_attribute_names("#h", "_agghold:dep1")
        .expression_attribute_names("#l", &stale)
        .expression_attribute_values(":h", AttributeValue::S(old.clone()))
        .expression_attribute_values(":l", AttributeValue::S("[]".into()))
        .send()
        .await
        .unwrap();
    let newer = hold::hold_value("r2", now_ms() + 600_000);
    let replace = Placement { value: newer.clone(), seen: Some(old), stale: vec![stale] };
    assert!(reconciler.hold(&key, &replace).await.unwrap());
    let item = reconciler.read(&key).await.unwrap();
    assert!(item.hold.as_deref() == Some(newer.as_str()) && item.logs.is_empty(), "{item:?}");
    // Nothing drifted: the write that ends the hold raises the floor too.
    let end = Correction {
        seen_version: item.version.clone(),
        set: vec![],
        fence: Some(floor_value(1_700_000_000_000)),
        expect: vec![],
        release: Some(Release { hold: newer, logs: vec![] }),
    };
    assert!(reconciler.correct(&key, &end).await.unwrap());
    let item = get(&c, &aggregates, "SALES#2026-12-04", "TOTAL").await;
    assert!(!item.contains_key("_agghold:dep1"));
    assert_eq!(item["_aggfloor:dep1"].as_s().unwrap(), &floor_value(1_700_000_000_000));
}

/// Without TTL on the table the service deletes expired helpers itself, on DynamoDB Local:
/// each expiry is recorded as a pending item first; the sweep deletes a helper that still
/// carries its expiry at zero and keeps one written since or never given it, and leaves no
/// pending item behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_deletes_expired_helpers_itself_on_dynamodb_local() {
    use ddb_aggregator::rules::helper::REFS;
    use ddb_aggregator::sink::expiry::{self, Expiry};
    let c = client().await;
    let table = unique("own-expiry");
    create_source_table(&c, &table).await;
    let store = DynamoDbAggregates::new(c.clone(), table.clone());
    let names = vec!["PK".to_string(), "SK".to_string()];
    let sk = |v: &str| format!("PROFILE#_agg#largest#N{v}");
    let helper = |v: &str| TargetKey(vec![Box::from("CUST#c1"), Box::from(sk(v))].into_boxed_slice());
    let refs = |seq: u64, d: i64| TargetDelta {
        contributions: vec![Contribution {
            sequence: Some(format!("{seq:021}").into()),
            values: vec![(REFS.into(), Decimal::from_i64(d))],
            ..Default::default()
        }],
        ..Default::default()
    };
    // Expiring at once, so that the sweep below finds them due.
    let ctx = ShardContext {
        expiry: Some(Expiry { after_ms: 0, own: true, ..Expiry::new(EXPIRES_AT) }),
        ..ShardContext::new(&Ledger::new("dep1"), "shardId-00000001700000000001-aaaaaaaa")
    };
    for (v, seq) in [("5", 1), ("6", 3), ("7", 5)] {
        write_target(&store, &names, &helper(v), &refs(seq, 1), &ctx).await.unwrap();
        let s = write_target(&store, &names, &helper(v), &refs(seq + 1, -1), &ctx).await.unwrap();
        assert_eq!(s.expiries_set, 1, "{v}");
    }
    let pending = || async {
        scan(&c, &table).await.into_iter().filter(|i| i["PK"].as_s().unwrap().starts_with(expiry::PENDING_PREFIX)).collect::<Vec<_>>()
    };
    let recorded = pending().await;
    assert_eq!(recorded.len(), 3, "{recorded:?}");
    assert!(recorded.iter().all(|i| i["PK"].as_s().unwrap().starts_with(&format!("{}{EXPIRES_AT}#", expiry::PENDING_PREFIX))));
    for item in &recorded {
        let key = item[expiry::PENDING_HELPER].as_l().unwrap();
        let helper = get(&c, &table, key[0].as_s().unwrap(), key[1].as_s().unwrap()).await;
        let at = expiry::pending_at(item["SK"].as_s().unwrap()).unwrap();
        assert_eq!(helper[EXPIRES_AT].as_n().unwrap(), &at.to_string(), "the pending item names the helper's expiry");
    }
    // N6 is written again (its expiry removed); N7 loses its expiry as if the process died
    // between recording and setting it.
    write_target(&store, &names, &helper("6"), &refs(7, 1), &ctx).await.unwrap();
    c.update_item()
        .table_name(&table)
        .key("PK", AttributeValue::S("CUST#c1".into()))
        .key("SK", AttributeValue::S(sk("7")))
        .update_expression("REMOVE #x")
        .expression_attribute_names("#x", EXPIRES_AT)
        .send()
        .await
        .unwrap();
    let before = expiry::sweep(&store, &names, EXPIRES_AT, 1_700_000_000).await.unwrap();
    assert_eq!(before, expiry::Swept::default(), "nothing is due before its expiry");
    // N8 is at zero with its expiry, but a `distinct` target still counts it (its flag).
    write_target(&store, &names, &helper("8"), &refs(11, 1), &ctx).await.unwrap();
    write_target(&store, &names, &helper("8"), &refs(12, -1), &ctx).await.unwrap();
    c.update_item()
        .table_name(&table)
        .key("PK", AttributeValue::S("CUST#c1".into()))
        .key("SK", AttributeValue::S(sk("8")))
        .update_expression("SET #c = :one")
        .expression_attribute_names("#c", ddb_aggregator::sink::distinct::COUNTED)
        .expression_attribute_values(":one", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap();
    let swept = expiry::sweep(&store, &names, EXPIRES_AT, now_ms() / 1000 + expiry::SWEEP_GRACE_S + 1).await.unwrap();
    assert_eq!((swept.deleted, swept.kept), (1, 3), "{swept:?}");
    assert!(get(&c, &table, "CUST#c1", &sk("5")).await.is_empty(), "N5 expired at zero and is deleted");
    assert_eq!(get(&c, &table, "CUST#c1", &sk("6")).await[REFS].as_n().unwrap(), "1", "N6 is live again");
    assert_eq!(get(&c, &table, "CUST#c1", &sk("7")).await[REFS].as_n().unwrap(), "0", "N7 never got its expiry");
    assert_eq!(get(&c, &table, "CUST#c1", &sk("8")).await[REFS].as_n().unwrap(), "0", "N8 is still counted");
    assert!(pending().await.is_empty(), "every pending item is gone");
    // A record of N5 after its deletion starts a new helper.
    write_target(&store, &names, &helper("5"), &refs(9, 1), &ctx).await.unwrap();
    assert_eq!(get(&c, &table, "CUST#c1", &sk("5")).await[REFS].as_n().unwrap(), "1");
}
