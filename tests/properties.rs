//! Property tests of the pure core: exact deltas for any history and interleaving, and no
//! panic on any input to the pattern compiler, the record decoder or the engine.

use std::collections::BTreeMap;

use ddb_aggregator::config::Config;
use ddb_aggregator::decimal::Decimal;
use ddb_aggregator::pattern::{Pattern, PatternOptions, PatternSet};
use ddb_aggregator::rules::template::{Template, VarValue};
use ddb_aggregator::rules::{Coalescer, Engine};
use ddb_aggregator::sink::expiry::Expiry;
use ddb_aggregator::sink::memory::{MemValue, MemoryAggregates};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Cases per no-panic property: 2,000 in the test suite; `scripts/fuzz` raises it with
/// FUZZ_CASES and runs the properties again and again with fresh seeds for a set time.
fn cases(default: u32) -> u32 {
    std::env::var("FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const COMMERCE: &str = include_str!("../config/commerce.yaml");
const HELPER_MARK: &str = ddb_aggregator::rules::helper::MARK;

fn engine() -> Engine {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce.yaml")).unwrap();
    Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine
}

#[derive(Debug, Clone, PartialEq)]
struct Order {
    status: Option<&'static str>,
    total: Option<String>,
    /// `updatedAt`: the op that last wrote the item (latest's `by`).
    updated: usize,
}

const STATUSES: [&str; 4] = ["PENDING", "PAID", "SHIPPED", "CANCELLED"];

fn status() -> impl Strategy<Value = Option<&'static str>> {
    prop_oneof![4 => (0..STATUSES.len()).prop_map(|i| Some(STATUSES[i])), 1 => Just(None)]
}

fn total() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        6 => (0u64..100_000, 0u32..3).prop_map(|(n, scale)| Some(format!("{}", Decimal::parse(&format!("{n}E-{scale}")).unwrap()))),
        1 => (1u64..1_000_000_000, 0u32..10).prop_map(|(n, scale)| Some(format!("{n}.{}E+{scale}", n % 97))),
        1 => Just(None),
    ]
}

/// One operation on item `item` (index into a small key space).
#[derive(Debug, Clone)]
enum Op {
    Put {
        item: usize,
        status: Option<&'static str>,
        total: Option<String>,
    },
    SetStatus {
        item: usize,
        status: Option<&'static str>,
    },
    SetTotal {
        item: usize,
        total: Option<String>,
    },
    Delete {
        item: usize,
    },
    /// A delete by DynamoDB's TTL service.
    Expire {
        item: usize,
    },
}

const CUSTOMERS: [&str; 4] = ["c0", "c1", "zoë", "ACME-Corp"];
const DATES: [&str; 3] = ["2026-11-29", "2026-11-30T23:30:00Z", "2026-12-01T01:00:00+02:00"];
const ITEMS: usize = 12;

fn key(item: usize) -> (String, String) {
    (format!("CUST#{}", CUSTOMERS[item % CUSTOMERS.len()]), format!("ORDER#{}#o{item}", DATES[item % DATES.len()]))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..ITEMS, status(), total()).prop_map(|(item, status, total)| Op::Put { item, status, total }),
        2 => (0..ITEMS, status()).prop_map(|(item, status)| Op::SetStatus { item, status }),
        2 => (0..ITEMS, total()).prop_map(|(item, total)| Op::SetTotal { item, total }),
        1 => (0..ITEMS).prop_map(|item| Op::Delete { item }),
        1 => (0..ITEMS).prop_map(|item| Op::Expire { item }),
    ]
}

fn image(item: usize, o: &Order) -> Value {
    let (pk, sk) = key(item);
    let mut m = Map::new();
    m.insert("PK".into(), json!({"S": pk}));
    m.insert("SK".into(), json!({"S": sk}));
    if let Some(s) = o.status {
        m.insert("status".into(), json!({"S": s}));
    }
    if let Some(t) = &o.total {
        m.insert("total".into(), json!({"N": t}));
    }
    m.insert("updatedAt".into(), json!({"N": o.updated.to_string()}));
    Value::Object(m)
}

/// A table's history: per-item record lists in stream order, the final items, and the items
/// the TTL service deleted (as they were then).
struct History {
    records: Vec<Vec<Value>>,
    table: BTreeMap<usize, Order>,
    expired: Vec<(usize, Order)>,
}

/// Applies the ops to a table and returns (per-item record lists in order, final table).
fn history(ops: &[Op]) -> (Vec<Vec<Value>>, BTreeMap<usize, Order>) {
    let h = full_history(ops);
    (h.records, h.table)
}

fn full_history(ops: &[Op]) -> History {
    let mut expired = Vec::new();
    let mut table: BTreeMap<usize, Order> = BTreeMap::new();
    let mut records: Vec<Vec<Value>> = vec![Vec::new(); ITEMS];
    for (at, op) in ops.iter().enumerate() {
        let item = match op {
            Op::Put { item, .. } | Op::SetStatus { item, .. } | Op::SetTotal { item, .. } | Op::Delete { item } | Op::Expire { item } => {
                *item
            }
        };
        let old = table.get(&item).cloned();
        let new = match (op, &old) {
            (Op::Put { status, total, .. }, _) => Some(Order { status: *status, total: total.clone(), updated: at }),
            (Op::SetStatus { status, .. }, Some(o)) => Some(Order { status: *status, updated: at, ..o.clone() }),
            (Op::SetTotal { total, .. }, Some(o)) => Some(Order { total: total.clone(), updated: at, ..o.clone() }),
            (Op::Delete { .. } | Op::Expire { .. }, _) => None,
            (_, None) => continue, // updating a missing item writes nothing here
        };
        let (pk, sk) = key(item);
        let mut ddb = json!({"Keys": {"PK": {"S": pk}, "SK": {"S": sk}}});
        let event = match (&old, &new) {
            (None, None) => continue,
            (None, Some(_)) => "INSERT",
            (Some(_), Some(_)) => "MODIFY",
            (Some(_), None) => "REMOVE",
        };
        if let Some(o) = &old {
            ddb["OldImage"] = image(item, o);
        }
        if let Some(n) = &new {
            ddb["NewImage"] = image(item, n);
        }
        let mut record = json!({"eventName": event, "dynamodb": ddb});
        if let (Op::Expire { .. }, Some(o)) = (op, &old) {
            record["userIdentity"] = json!({"type": "Service", "principalId": "dynamodb.amazonaws.com"});
            expired.push((item, o.clone()));
        }
        records[item].push(record);
        match new {
            Some(n) => table.insert(item, n),
            None => table.remove(&item),
        };
    }
    History { records, table, expired }
}

fn utc_day(date: &str) -> &'static str {
    // The three dates above, by hand: the offset one is the previous UTC day.
    match date {
        "2026-11-29" => "2026-11-29",
        "2026-11-30T23:30:00Z" => "2026-11-30",
        "2026-12-01T01:00:00+02:00" => "2026-11-30",
        _ => unreachable!(),
    }
}

/// The aggregates computed straight from the final items, written without the engine.
fn truth(table: &BTreeMap<usize, Order>) -> BTreeMap<(String, String, String), Decimal> {
    let mut out: BTreeMap<(String, String, String), Decimal> = BTreeMap::new();
    let mut add = |pk: String, sk: &str, attr: String, v: Decimal| {
        let e = out.entry((pk, sk.to_string(), attr)).or_insert(Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    };
    for (item, o) in table {
        let (pk, _) = key(*item);
        let total = o.total.as_deref().map(|t| Decimal::parse(t).unwrap());
        add(pk.clone(), "PROFILE", "orderCount".into(), Decimal::ONE);
        if let Some(t) = total {
            add(pk.clone(), "PROFILE", "revenue".into(), t);
        }
        if let Some(s) = o.status {
            add(pk.clone(), "PROFILE", format!("orders_{s}"), Decimal::ONE);
            if s == "PENDING" || s == "PAID" {
                add(pk.clone(), "PROFILE", "openOrders".into(), Decimal::ONE);
                if let Some(t) = total {
                    add(pk.clone(), "PROFILE", "openRevenue".into(), t);
                }
            }
        }
        let day = format!("SALES#{}", utc_day(DATES[item % DATES.len()]));
        add(day.clone(), "TOTAL", "orders".into(), Decimal::ONE);
        if let Some(t) = total {
            add(day, "TOTAL", "revenue".into(), t);
        }
    }
    out.retain(|_, v| !v.is_zero());
    out
}

/// The measures of config/commerce-measures.yaml from the final items (and, for the rule that
/// ignores TTL deletes, the items the TTL service deleted), written without the engine.
fn measures_truth(h: &History) -> BTreeMap<(String, String, String), Decimal> {
    let mut out: BTreeMap<(String, String, String), Decimal> = BTreeMap::new();
    let mut add = |pk: &str, sk: &str, attr: &str, v: Decimal| {
        let e = out.entry((pk.to_string(), sk.to_string(), attr.to_string())).or_insert(Decimal::ZERO);
        *e = e.checked_add(v).unwrap();
    };
    let placed = h.table.iter().map(|(i, o)| (*i, o)).chain(h.expired.iter().map(|(i, o)| (*i, o)));
    for (item, o) in placed {
        let (pk, _) = key(item);
        add(&pk, "PLACED", "ordersPlaced", Decimal::ONE);
        if let Some(t) = o.total.as_deref() {
            add(&pk, "PLACED", "revenuePlaced", Decimal::parse(t).unwrap());
        }
    }
    for (item, o) in &h.table {
        let (pk, _) = key(*item);
        add(&pk, "PROFILE", "orderCount", Decimal::ONE);
        let Some(t) = o.total.as_deref().map(|t| Decimal::parse(t).unwrap()) else { continue };
        add(&pk, "PROFILE", "revenue", t);
        add(&pk, "PROFILE", "avgOrder_sum", t);
        add(&pk, "PROFILE", "avgOrder_count", Decimal::ONE);
        if matches!(o.status, Some("PAID" | "SHIPPED")) {
            add(&pk, "PROFILE", "avgPaidOrder_sum", t);
            add(&pk, "PROFILE", "avgPaidOrder_count", Decimal::ONE);
        }
    }
    out.retain(|_, v| !v.is_zero());
    out
}

/// Interleaves per-item record lists (each item's order kept, as a stream guarantees).
fn interleave(per_item: Vec<Vec<Value>>, picks: Vec<u16>) -> Vec<Value> {
    let mut queues: Vec<std::collections::VecDeque<Value>> = per_item.into_iter().map(Into::into).collect();
    let mut records = Vec::new();
    let mut pick = picks.into_iter();
    while queues.iter().any(|q| !q.is_empty()) {
        let live: Vec<usize> = (0..queues.len()).filter(|i| !queues[*i].is_empty()).collect();
        let i = live[pick.next().map(usize::from).unwrap_or(0) % live.len()];
        records.extend(queues[i].pop_front());
    }
    records
}

fn run_batches(engine: &Engine, records: &[Value], cuts: &[usize]) -> BTreeMap<(String, String, String), Decimal> {
    let mut out: BTreeMap<(String, String, String), Decimal> = BTreeMap::new();
    let mut start = 0;
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (records.len() + 1)).collect();
    bounds.push(records.len());
    bounds.sort();
    for end in bounds {
        let mut batch = Coalescer::new();
        for r in &records[start..end] {
            let report = engine.apply(r, &mut batch);
            assert!(report.poisons.is_empty(), "{:?}", report.poisons);
        }
        for (target, delta) in batch.into_targets() {
            for (attr, v) in delta.attributes {
                let e = out.entry((target.0[0].to_string(), target.0[1].to_string(), attr)).or_insert(Decimal::ZERO);
                *e = e.checked_add(v).unwrap();
            }
        }
        start = end;
    }
    out.retain(|_, v| !v.is_zero());
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The coalesced deltas of all records equal the aggregates of the final items, whatever
    /// the interleaving of different items' records and however they are cut into batches.
    #[test]
    fn deltas_equal_aggregates_of_final_items(ops in prop::collection::vec(op(), 1..120), picks in prop::collection::vec(any::<u16>(), 0..400), cuts in prop::collection::vec(any::<usize>(), 0..6)) {
        let engine = engine();
        let (per_item, table) = history(&ops);
        let records = interleave(per_item, picks);
        prop_assert_eq!(run_batches(&engine, &records, &cuts), truth(&table));
    }

    /// The same for averages and a rule that ignores TTL deletes: the averages' sums and counts
    /// follow the final items, and "orders placed" keeps the orders the TTL service deleted.
    #[test]
    fn averages_and_ttl_ignoring_counts_equal_the_truth(ops in prop::collection::vec(op(), 1..120), picks in prop::collection::vec(any::<u16>(), 0..400), cuts in prop::collection::vec(any::<usize>(), 0..6)) {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        let engine = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine;
        let h = full_history(&ops);
        let want = measures_truth(&h);
        let records = interleave(h.records, picks);
        let mut got = run_batches(&engine, &records, &cuts);
        got.retain(|(_, sk, _), _| !sk.contains(HELPER_MARK));
        prop_assert_eq!(got, want);
    }

    #[test]
    fn decimal_text_round_trips_and_sums_are_exact(a in -1_000_000_000_000i64..1_000_000_000_000, b in -1_000_000_000_000i64..1_000_000_000_000, sa in 0u32..20, sb in 0u32..20) {
        let x = Decimal::parse(&format!("{a}E-{sa}")).unwrap();
        let y = Decimal::parse(&format!("{b}E-{sb}")).unwrap();
        prop_assert_eq!(Decimal::parse(&x.to_string()).unwrap(), x);
        let s = x.checked_add(y).unwrap();
        prop_assert_eq!(s.checked_sub(y).unwrap(), x);
        prop_assert_eq!(x.checked_add(y).unwrap(), y.checked_add(x).unwrap());
        // Against i128 arithmetic at a common scale.
        let scale = sa.max(sb);
        let ai = i128::from(a) * 10i128.pow(scale - sa);
        let bi = i128::from(b) * 10i128.pow(scale - sb);
        prop_assert_eq!(s, Decimal::parse(&format!("{}E-{scale}", ai + bi)).unwrap());
        prop_assert_eq!(x.cmp(&y), ai.cmp(&bi));
    }
}

/// Every measure kept in helper items, on the commerce model: per customer, and per status
/// (orders move between statuses), and per day on a second rule.
const HELPER_RULES: &str = r#"
source: { table: commerce-main }
state: { table: ddb-aggregator-state }
aggregates: { table: commerce-aggregates }
rules:
  - name: customer-orders
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures:
      largestOrder: { max: total }
      smallestOrder: { min: total }
      firstOrderDay: { min: "{date|day}" }
      lastStatus: { latest: status, by: updatedAt }
      activeDays: { distinct: "{date|day}" }
      statuses: { distinct: status }
      largest_{status}: { max: total }
      largestPaid: { max: total, where: { status: { S: [PAID] } } }
  - name: daily-sales
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "SALES#{date|day}", SK: "TOTAL" }
    measures:
      biggestSale: { max: total }
      lastBuyer: { latest: "{customer}", by: updatedAt }
"#;

/// A derived attribute's value: a number or a string.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Derived {
    N(Decimal),
    S(String),
}

/// The helper measures of [`HELPER_RULES`] from the final items, without the engine.
fn helper_truth(table: &BTreeMap<usize, Order>) -> BTreeMap<(String, String, String), Derived> {
    let mut max: BTreeMap<(String, String, String), Derived> = BTreeMap::new();
    let mut min: BTreeMap<(String, String, String), Derived> = BTreeMap::new();
    let mut latest: BTreeMap<(String, String, String), (usize, Derived)> = BTreeMap::new();
    let mut distinct: BTreeMap<(String, String, String), std::collections::BTreeSet<String>> = BTreeMap::new();
    let k = |pk: &str, sk: &str, a: &str| (pk.to_string(), sk.to_string(), a.to_string());
    for (item, o) in table {
        let (pk, _) = key(*item);
        let day = utc_day(DATES[item % DATES.len()]);
        let sales = format!("SALES#{day}");
        let total = o.total.as_deref().map(|t| Derived::N(Decimal::parse(t).unwrap()));
        let keep = |map: &mut BTreeMap<_, Derived>, key, v: Derived, greater: bool| {
            let e = map.entry(key).or_insert_with(|| v.clone());
            if (v > *e) == greater && v != *e {
                *e = v;
            }
        };
        if let Some(t) = &total {
            keep(&mut max, k(&pk, "PROFILE", "largestOrder"), t.clone(), true);
            keep(&mut min, k(&pk, "PROFILE", "smallestOrder"), t.clone(), false);
            keep(&mut max, k(&sales, "TOTAL", "biggestSale"), t.clone(), true);
            if let Some(s) = o.status {
                keep(&mut max, k(&pk, "PROFILE", &format!("largest_{s}")), t.clone(), true);
            }
            if o.status == Some("PAID") {
                keep(&mut max, k(&pk, "PROFILE", "largestPaid"), t.clone(), true);
            }
        }
        keep(&mut min, k(&pk, "PROFILE", "firstOrderDay"), Derived::S(day.to_string()), false);
        distinct.entry(k(&pk, "PROFILE", "activeDays")).or_default().insert(day.to_string());
        if let Some(s) = o.status {
            distinct.entry(k(&pk, "PROFILE", "statuses")).or_default().insert(s.to_string());
            let e = latest.entry(k(&pk, "PROFILE", "lastStatus")).or_insert((o.updated, Derived::S(s.to_string())));
            if o.updated > e.0 {
                *e = (o.updated, Derived::S(s.to_string()));
            }
        }
        let customer = pk.trim_start_matches("CUST#").to_string();
        let e = latest.entry(k(&sales, "TOTAL", "lastBuyer")).or_insert((o.updated, Derived::S(customer.clone())));
        if o.updated > e.0 {
            *e = (o.updated, Derived::S(customer));
        }
    }
    let mut out = max;
    out.extend(min);
    out.extend(latest.into_iter().map(|(k, (_, v))| (k, v)));
    out.extend(distinct.into_iter().map(|(k, set)| (k, Derived::N(Decimal::from_i64(set.len() as i64)))));
    out
}

/// One batch as the worker applies it: coalesced, written through the ledger, then derived.
/// `crash_after`: only that many target writes land and nothing is derived (a replica that
/// died mid-batch). With `expiry`, helpers at zero are given an expiry in [`EXPIRES_AT`].
async fn apply_batch_expiring(
    engine: &Engine,
    store: &MemoryAggregates,
    records: &[Value],
    crash_after: Option<usize>,
    expiry: Option<&Expiry>,
) {
    use ddb_aggregator::sink::{derive, ledger::Ledger, write_target, ShardContext};
    let mut batch = Coalescer::new();
    for r in records {
        let report = engine.apply(r, &mut batch);
        assert!(report.poisons.is_empty(), "{:?}", report.poisons);
    }
    let targets = batch.into_targets();
    let ledger = Ledger::new("p");
    let mut ctx = ShardContext::new(&ledger, "shardId-00000001700000000000-00000001");
    if let Some(e) = expiry {
        ctx.expiry = Some(e.clone());
        ctx.oldest_ms = Some(ddb_aggregator::state::now_ms());
    }
    for (n, (key, delta)) in targets.iter().enumerate() {
        if crash_after == Some(n) {
            return;
        }
        write_target(store, &engine.key_names, key, delta, &ctx).await.unwrap();
    }
    if crash_after.is_some() {
        return;
    }
    for t in derive::targets_to_derive(engine, &targets) {
        derive::derive_target(store, &engine.key_names, &ledger, &t, ctx.expiry.as_ref()).await.unwrap();
    }
}

/// The derived attributes in the store: every attribute of a target item that no counter
/// writes, by (PK, SK, attribute).
fn derived_in(store: &MemoryAggregates) -> BTreeMap<(String, String, String), Derived> {
    let mut out = BTreeMap::new();
    for key in store.keys() {
        if key[1].contains(HELPER_MARK) {
            continue;
        }
        let parts: Vec<&str> = key.iter().map(String::as_str).collect();
        for (attr, v) in store.item(&parts).unwrap_or_default() {
            let value = match v {
                MemValue::Num(n) => Derived::N(n),
                MemValue::Str(s) => Derived::S(s),
                _ => continue,
            };
            if !attr.starts_with('_') {
                out.insert((key[0].clone(), key[1].clone(), attr), value);
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// max, min, latest and distinct equal the values of the final items for any history
    /// (deletes of the extreme included, orders moving between statuses), any interleaving,
    /// any cut into batches, with batches replayed and replicas dying mid-batch.
    #[test]
    fn helper_measures_equal_the_values_of_the_final_items(
        ops in prop::collection::vec(op(), 1..100),
        picks in prop::collection::vec(any::<u16>(), 0..300),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
        faults in prop::collection::vec((0u8..5, any::<usize>()), 0..8),
    ) {
        let (store, table) = run_with_faults(&ops, picks, &cuts, &faults, Expiring::Never);
        prop_assert_eq!(derived_in(&store), helper_truth(&table));
    }

    /// The same with helpers that expire: after each batch a TTL sweep deletes every helper
    /// that carried the same expiry since 4 batches before (replays reach 3 batches back, as
    /// the stream's 24 hours lie within the 40 hours of an expiry). Values that come back
    /// after their helper was deleted start a new one; nothing is counted twice.
    #[test]
    fn helper_measures_stay_exact_when_helpers_at_zero_expire(
        ops in prop::collection::vec(op(), 1..100),
        picks in prop::collection::vec(any::<u16>(), 0..300),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        faults in prop::collection::vec((0u8..5, any::<usize>()), 0..12),
    ) {
        let (store, table) = run_with_faults(&ops, picks, &cuts, &faults, Expiring::Ttl(4));
        prop_assert_eq!(derived_in(&store), helper_truth(&table));
    }

    /// The same where the table has no TTL and the service deletes expired helpers itself:
    /// each batch takes an hour, a helper expires 2.5 hours after it reached zero and the
    /// sweep, after each batch, deletes it an hour after that (replays reach 3 batches back,
    /// as above).
    #[test]
    fn helper_measures_stay_exact_when_the_service_deletes_expired_helpers(
        ops in prop::collection::vec(op(), 1..100),
        picks in prop::collection::vec(any::<u16>(), 0..300),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        faults in prop::collection::vec((0u8..5, any::<usize>()), 0..12),
    ) {
        let (store, table) = run_with_faults(&ops, picks, &cuts, &faults, Expiring::Own);
        prop_assert_eq!(derived_in(&store), helper_truth(&table));
        // Every expiry set was recorded: a sweep long after deletes every helper carrying
        // one, and leaves no pending item behind.
        let names = ["PK".to_string(), "SK".to_string()];
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let later = u64::MAX / 2000;
        while rt.block_on(ddb_aggregator::sink::expiry::sweep(&store, &names, EXPIRES_AT, later)).unwrap().more {}
        let expiring = store.keys().into_iter().filter(|k| {
            let parts: Vec<&str> = k.iter().map(String::as_str).collect();
            store.item(&parts).is_some_and(|i| i.contains_key(EXPIRES_AT))
        });
        prop_assert_eq!((expiring.count(), store.pending_expiries()), (0, 0));
    }
}

/// How helpers at zero leave the store in [`run_with_faults`].
#[derive(Clone, Copy)]
enum Expiring {
    Never,
    /// The table's TTL: a helper whose expiry stood unchanged for that many batches.
    Ttl(usize),
    /// The service's own sweep, on a clock that moves an hour a batch.
    Own,
}

/// A batch's length on the clock of [`Expiring::Own`], and how long after zero a helper
/// expires: with the sweep's hour of grace, deleted by the sweep 4 batches later, as
/// [`Expiring::Ttl`]`(4)`.
const BATCH_MS: u64 = 3_600_000;
const OWN_EXPIRE_AFTER_MS: u64 = 2 * BATCH_MS + BATCH_MS / 2;

/// The TTL attribute of [`helper_measures_stay_exact_when_helpers_at_zero_expire`].
const EXPIRES_AT: &str = "expiresAt";

/// Runs `ops` interleaved by `picks`, cut into batches at `cuts`, with `faults` per batch
/// (1: a replica dies mid-batch; 2: a stalled replica replays up to 3 batches back; 3: the
/// batch is applied twice; 4: a shorter batch is applied and derived, and the batch is then
/// read again from the same checkpoint with more records). `expiring`: helpers expire, and a sweep after each batch
/// deletes those whose expiry stood unchanged for that many batches.
fn run_with_faults(
    ops: &[Op],
    picks: Vec<u16>,
    cuts: &[usize],
    faults: &[(u8, usize)],
    expiring: Expiring,
) -> (MemoryAggregates, BTreeMap<usize, Order>) {
    let engine = Config::from_yaml(HELPER_RULES, Vec::<(String, String)>::new()).unwrap().engine;
    let (per_item, table) = history(ops);
    let mut records = interleave(per_item, picks);
    for (i, r) in records.iter_mut().enumerate() {
        r["dynamodb"]["SequenceNumber"] = json!(format!("{:021}", i + 1));
    }
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (records.len() + 1)).collect();
    bounds.push(records.len());
    bounds.sort();
    bounds.dedup();
    let batches: Vec<(usize, usize)> = bounds
        .iter()
        .scan(0, |start, end| {
            let b = (*start, *end);
            *start = *end;
            Some(b)
        })
        .collect();
    let store = MemoryAggregates::new();
    let expiry = match expiring {
        Expiring::Never => None,
        Expiring::Ttl(_) => Some(Expiry::new(EXPIRES_AT)),
        Expiring::Own => Some(Expiry { own: true, after_ms: OWN_EXPIRE_AFTER_MS, ..Expiry::new(EXPIRES_AT) }),
    };
    let expiry = expiry.as_ref();
    let mut seen_expiring = BTreeMap::new();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    rt.block_on(async {
        ddb_aggregator::state::simulate_clock(Some(1_764_547_200_000));
        for (i, (start, end)) in batches.iter().enumerate() {
            let (fault, arg) = faults.get(i).copied().unwrap_or((0, 0));
            match fault {
                // A replica dies mid-batch; the next owner reads the batch again.
                1 => apply_batch_expiring(&engine, &store, &records[*start..*end], Some(arg % 4), expiry).await,
                // A stalled replica replays batches already applied (up to 3 back).
                2 => {
                    let from = batches[i.saturating_sub(arg % 4)].0;
                    apply_batch_expiring(&engine, &store, &records[from..*start], None, expiry).await;
                }
                // The first part was applied and derived, then the batch failed before its
                // checkpoint, and the next read returned more records.
                4 => {
                    let part = *start + (end - start) * (arg % 4) / 4;
                    apply_batch_expiring(&engine, &store, &records[*start..part], None, expiry).await;
                }
                _ => {}
            }
            apply_batch_expiring(&engine, &store, &records[*start..*end], None, expiry).await;
            if fault == 3 {
                apply_batch_expiring(&engine, &store, &records[*start..*end], None, expiry).await;
            }
            match expiring {
                Expiring::Never => {}
                Expiring::Ttl(after) => ttl_sweep(&store, &mut seen_expiring, i, after),
                Expiring::Own => {
                    tokio::time::advance(std::time::Duration::from_millis(BATCH_MS)).await;
                    let names = ["PK".to_string(), "SK".to_string()];
                    let now_s = ddb_aggregator::state::now_ms() / 1000;
                    ddb_aggregator::sink::expiry::sweep(&store, &names, EXPIRES_AT, now_s).await.unwrap();
                }
            }
        }
    });
    (store, table)
}

/// DynamoDB's TTL, counted in batches: deletes each helper whose expiry has stood, with no
/// write in between (same write counter), since `after` batches before `batch`.
fn ttl_sweep(store: &MemoryAggregates, expiring: &mut BTreeMap<Vec<String>, (Option<MemValue>, usize)>, batch: usize, after: usize) {
    let version = "_aggv:p";
    for key in store.keys().into_iter().filter(|k| k[1].contains(HELPER_MARK)) {
        let parts: Vec<&str> = key.iter().map(String::as_str).collect();
        let item = store.item(&parts).unwrap_or_default();
        if !item.contains_key(EXPIRES_AT) {
            expiring.remove(&key);
            continue;
        }
        let seen = item.get(version).cloned();
        let since = match expiring.get(&key) {
            Some((v, since)) if *v == seen => *since,
            _ => batch,
        };
        expiring.insert(key.clone(), (seen.clone(), since));
        if batch >= since + after {
            let Some(MemValue::Num(v)) = seen else { continue };
            assert!(store.delete_if(&key, version, &v.to_string()), "nothing wrote {key:?} since its expiry");
            expiring.remove(&key);
        }
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-zA-Z0-9.*#$ -]{0,8}".prop_map(Value::String),
        prop::sample::select(vec![
            "prefix",
            "suffix",
            "anything-but",
            "numeric",
            "exists",
            "cidr",
            "wildcard",
            "equals-ignore-case",
            "$or",
            ">",
            "<=",
            "=",
            "10.0.0.0/8",
            "*a*",
            "**",
            "N",
            "S"
        ])
        .prop_map(|s| Value::String(s.to_string())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "prefix",
                        "suffix",
                        "anything-but",
                        "numeric",
                        "exists",
                        "cidr",
                        "wildcard",
                        "equals-ignore-case",
                        "$or",
                        "dynamodb",
                        "Keys",
                        "SK",
                        "S",
                        "N",
                        "a.b",
                        "eventName",
                        "NewImage",
                        "OldImage",
                        ""
                    ]),
                    inner
                ),
                0..5
            )
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(2000), ..ProptestConfig::default() })]

    /// Any JSON is either a pattern or an error, and any event can be matched: no panic.
    #[test]
    fn patterns_never_panic(pattern in json_value(), event in json_value(), numeric in any::<bool>()) {
        let options = PatternOptions { numeric_strings: numeric };
        if let Ok(p) = PatternSet::compile(&pattern, options) {
            let _ = p.matches(&event);
        }
        if let Ok(p) = Pattern::compile(&pattern, options) {
            let _ = p.matches(&event);
        }
    }

    /// Any text as a pattern: parse errors, never panics.
    #[test]
    fn pattern_text_never_panics(text in "\\PC{0,64}") {
        let _ = Pattern::parse(&text, PatternOptions::default());
    }

    /// The engine takes any JSON as a record: a report (maybe poison), never a panic.
    #[test]
    fn engine_never_panics_on_records(body in json_value(), event in prop::sample::select(vec!["INSERT", "MODIFY", "REMOVE", "X"]), keys in json_value(), img in json_value()) {
        let engine = engine();
        let mut batch = Coalescer::new();
        let _ = engine.apply(&body, &mut batch);
        let rec = json!({"eventName": event, "dynamodb": {"Keys": keys, "NewImage": img, "OldImage": img, "SequenceNumber": "1"}});
        let _ = engine.apply(&rec, &mut batch);
        let shaped = json!({"eventName": event, "dynamodb": {"Keys": {"SK": {"S": "ORDER#x#y"}}, "NewImage": {"PK": {"S": "CUST#a"}, "SK": {"S": "ORDER#2026-11-30#y"}, "total": body, "status": img}, "OldImage": {"PK": {"S": "CUST#a"}, "SK": {"S": "ORDER#2026-11-30#y"}, "total": keys}}});
        let _ = engine.apply(&shaped, &mut batch);
        let _ = batch.into_targets();
    }

    #[test]
    fn templates_never_panic(template in "\\PC{0,24}", value in "\\PC{0,24}") {
        if let Ok(t) = Template::parse(&template) {
            let mut caps = Vec::new();
            let _ = t.capture(&value, &mut caps);
            let _ = t.expand(|_| Some(VarValue::Str(&value)));
        }
    }

    #[test]
    fn config_loader_never_panics_on_edited_configs(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..12)) {
        // The demo config with random bytes deleted, inserted or replaced.
        let mut text = COMMERCE.as_bytes().to_vec();
        for (at, byte, kind) in edits {
            let i = at.index(text.len() + 1);
            match kind {
                0 if i < text.len() => { text.remove(i); }
                1 => text.insert(i, byte),
                _ if i < text.len() => text[i] = byte,
                _ => {}
            }
        }
        let _ = Config::from_yaml(&String::from_utf8_lossy(&text), Vec::<(String, String)>::new());
    }

    #[test]
    fn config_loader_never_panics_on_random_documents_and_overrides(doc in json_value(), name in "[A-Z_0-9]{0,30}", value in "\\PC{0,20}") {
        let _ = Config::from_yaml(&doc.to_string(), Vec::<(String, String)>::new());
        let _ = Config::from_yaml(COMMERCE, vec![(format!("DDB_AGGREGATOR__{name}"), value)]);
    }

    #[test]
    fn decimal_parse_never_panics(text in "[-+0-9.eE]{0,60}") {
        let _ = Decimal::parse(&text);
    }
}
