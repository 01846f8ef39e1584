use serde_json::{json, Map, Value};

use std::sync::Arc;

use super::*;
use crate::reconcile::memory::MemorySources;
use crate::rules::copy::{SortValue, Version};

fn rule() -> CopyRule {
    crate::rules::copy::example("names", &[("customerName", "name")])
}

fn key(pk: &str, sk: &str) -> ItemKey {
    [("PK".to_string(), json!({"S": pk})), ("SK".to_string(), json!({"S": sk}))].into_iter().collect()
}

fn item(pk: &str, sk: &str, extra: Value) -> Map<String, Value> {
    let mut m: Map<String, Value> = key(pk, sk).into_iter().collect();
    m.extend(extra.as_object().cloned().unwrap_or_default());
    m
}

fn change(seq: &str, name: Option<&str>, sort: Option<SortValue>) -> CopyChange {
    CopyChange {
        source: key("CUST#c1", "PROFILE"),
        find: FindQuery { index: None, partition: ("PK".into(), "CUST#c1".into()), sort: sort.map(|s| ("SK".to_string(), s)) },
        set: name.map(|n| vec![("customerName".to_string(), json!({"S": n}))]).unwrap_or_default(),
        remove: if name.is_none() { vec!["customerName".to_string()] } else { vec![] },
        version: Version::new(1_700_000_000_000, seq).unwrap(),
        deleted: name.is_none(),
        snapshot: vec![name.map(|n| json!({"S": n}))],
    }
}

/// The application changes the profile (the source): its name, or a delete.
fn profile(s: &MemorySources, name: Option<&str>) {
    match name {
        Some(n) => drop(s.put(item("CUST#c1", "PROFILE", json!({"name": {"S": n}})))),
        None => drop(s.delete(&["CUST#c1".to_string(), "PROFILE".to_string()])),
    }
}

/// A customer with a profile, `n` orders and an order of another customer.
fn store(n: usize) -> Arc<MemorySources> {
    let mut s = MemorySources::new(vec!["PK".into(), "SK".into()]);
    s.page_size = 3;
    s.put(item("CUST#c1", "PROFILE", json!({"name": {"S": "Ann"}})));
    for i in 0..n {
        s.put(item("CUST#c1", &format!("ORDER#{i:03}"), json!({"total": {"N": "1"}, "customerName": {"S": "Ann"}})));
    }
    s.put(item("CUST#c2", "ORDER#000", json!({"customerName": {"S": "Cy"}})));
    Arc::new(s)
}

fn get(s: &MemorySources, pk: &str, sk: &str) -> Option<Map<String, Value>> {
    s.get(&[pk.to_string(), sk.to_string()])
}

fn name_on(s: &MemorySources, pk: &str, sk: &str) -> Option<Value> {
    get(s, pk, sk).and_then(|i| i.get("customerName").cloned())
}

#[tokio::test]
async fn a_rename_reaches_every_order_over_pages_and_a_replay_writes_nothing() {
    let s = store(10);
    profile(&s, Some("Bea"));
    let c = change("5", Some("Bea"), Some(SortValue::BeginsWith("ORDER#".into())));
    let out = fan_out(s.as_ref(), &rule(), &c, 4).await.unwrap();
    assert_eq!((out.found, out.written, out.older, out.gone), (10, 10, 0, 0));
    assert_eq!(out.write_capacity, 10.0);
    for i in 0..10 {
        assert_eq!(name_on(&s, "CUST#c1", &format!("ORDER#{i:03}")), Some(json!({"S": "Bea"})));
    }
    assert_eq!(name_on(&s, "CUST#c1", "PROFILE"), None, "the source holds name, not the copy");
    assert_eq!(name_on(&s, "CUST#c2", "ORDER#000"), Some(json!({"S": "Cy"})), "another customer's order");
    let again = fan_out(s.as_ref(), &rule(), &c, 4).await.unwrap();
    assert_eq!((again.found, again.written, again.older), (10, 0, 10), "skipped by the version read with the items");
    // An older change arriving late changes nothing, also on an order placed since (it holds
    // the name the application copied, and no version): the source has moved on.
    s.put(item("CUST#c1", "ORDER#new", json!({"customerName": {"S": "Bea"}})));
    let late = fan_out(s.as_ref(), &rule(), &change("4", Some("Zed"), Some(SortValue::BeginsWith("ORDER#".into()))), 4).await.unwrap();
    assert_eq!((late.written, late.superseded), (0, true));
    assert_eq!(name_on(&s, "CUST#c1", "ORDER#007"), Some(json!({"S": "Bea"})));
    assert_eq!(name_on(&s, "CUST#c1", "ORDER#new"), Some(json!({"S": "Bea"})));
}

/// What the source check guards against: without it, a late writer's older change lands on
/// an item that carries no version yet.
#[tokio::test]
async fn without_the_source_check_a_late_write_would_land_on_an_item_without_a_version() {
    let s = store(0);
    profile(&s, Some("Bea"));
    s.put(item("CUST#c1", "ORDER#new", json!({"customerName": {"S": "Bea"}})));
    let late = change("4", Some("Zed"), None);
    assert_eq!(s.write(&key("CUST#c1", "ORDER#new"), &late, "_aggc:names").await.unwrap(), CopyOutcome::Written { capacity: 1.0 });
    assert_eq!(name_on(&s, "CUST#c1", "ORDER#new"), Some(json!({"S": "Zed"})), "the version condition alone lets it in");
}

#[tokio::test]
async fn a_delete_removes_the_copies_and_its_version_stays_as_a_tombstone() {
    let s = store(3);
    profile(&s, None);
    fan_out(s.as_ref(), &rule(), &change("9", None, Some(SortValue::BeginsWith("ORDER#".into()))), 2).await.unwrap();
    let order = get(&s, "CUST#c1", "ORDER#001").unwrap();
    assert!(!order.contains_key("customerName"));
    assert_eq!(order["_aggc:names"], json!({"S": Version::new(1_700_000_000_000, "9").unwrap().text()}));
    let late = fan_out(s.as_ref(), &rule(), &change("8", Some("Ann"), Some(SortValue::BeginsWith("ORDER#".into()))), 2).await.unwrap();
    assert_eq!(late.written, 0, "a late older record does not bring the copies back");
    // Even when the source holds its values again (recreated): the tombstone refuses it.
    profile(&s, Some("Ann"));
    let late = fan_out(s.as_ref(), &rule(), &change("8", Some("Ann"), Some(SortValue::BeginsWith("ORDER#".into()))), 2).await.unwrap();
    assert_eq!((late.written, late.older), (0, 3));
}

#[tokio::test]
async fn the_source_itself_is_never_written_and_a_refused_item_does_not_stop_the_others() {
    let mut small = MemorySources::new(vec!["PK".into(), "SK".into()]);
    (small.page_size, small.max_item_bytes) = (2, 500);
    for item in store(3).items() {
        small.put(item);
    }
    small.put(item("CUST#c1", "ORDER#big", json!({"blob": {"S": "x".repeat(600)}})));
    profile(&small, Some("Bea"));
    // A whole-partition query finds the profile too.
    let out = fan_out(&small, &rule(), &change("5", Some("Bea"), None), 2).await.unwrap();
    assert_eq!(out.found, 4, "three orders and the big one; the profile is the source");
    assert_eq!(out.written, 3);
    assert_eq!(out.rejected.len(), 1);
    assert_eq!(out.rejected[0].0, key("CUST#c1", "ORDER#big"));
    assert!(out.rejected[0].1.contains("maximum allowed size"), "{:?}", out.rejected);
    assert_eq!(name_on(&small, "CUST#c1", "PROFILE"), None);
}

#[tokio::test]
async fn a_write_to_an_item_deleted_after_the_query_does_not_create_it() {
    let s = store(1);
    let gone = key("CUST#c1", "ORDER#000");
    s.delete(&["CUST#c1".to_string(), "ORDER#000".to_string()]);
    let c = change("5", Some("Bea"), None);
    assert_eq!(s.write(&gone, &c, "_aggc:names").await.unwrap(), CopyOutcome::Gone);
    assert!(get(&s, "CUST#c1", "ORDER#000").is_none());
}

/// A store whose copy writes fail with a transient error every other call, after taking
/// effect half of those times (as a timeout can).
struct Flaky {
    inner: Arc<MemorySources>,
    calls: std::sync::atomic::AtomicU64,
}

impl CopyStore for Flaky {
    fn find<'a>(
        &'a self,
        q: &'a FindQuery,
        version: &'a str,
        project: &'a [String],
        start: Option<&'a ItemKey>,
        limit: usize,
    ) -> BoxFuture<'a, Result<FoundPage, SinkError>> {
        self.inner.find(q, version, project, start, limit)
    }

    fn correct<'a>(
        &'a self,
        key: &'a ItemKey,
        fix: &'a CopyFix,
        version: &'a str,
        read: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Corrected, SinkError>> {
        self.inner.correct(key, fix, version, read)
    }

    fn source<'a>(&'a self, key: &'a ItemKey, attributes: &'a [String]) -> BoxFuture<'a, Result<Option<Map<String, Value>>, SinkError>> {
        self.inner.source(key, attributes)
    }

    fn write<'a>(&'a self, key: &'a ItemKey, change: &'a CopyChange, version: &'a str) -> BoxFuture<'a, Result<CopyOutcome, SinkError>> {
        Box::pin(async move {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match n % 4 {
                1 => Err(SinkError::Transient("timed out before it was sent".into())),
                3 => {
                    self.inner.write(key, change, version).await?;
                    Err(SinkError::Transient("timed out after it took effect".into()))
                }
                _ => self.inner.write(key, change, version).await,
            }
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_page_retries_a_copy_write_that_failed_for_a_moment_instead_of_failing() {
    let s = store(10);
    profile(&s, Some("Bea"));
    let flaky = Flaky { inner: s.clone(), calls: Default::default() };
    let c = change("5", Some("Bea"), Some(SortValue::BeginsWith("ORDER#".into())));
    let (mut cursor, mut found, mut written, mut older) = (None, 0, 0, 0);
    for _ in 0..10 {
        // Pages of 3 (the store's page size): none fails.
        let out = fan_out_page(&flaky, &rule(), &c, 1, cursor.as_ref(), 100).await.unwrap();
        (found, written, older) = (found + out.found, written + out.written, older + out.older);
        cursor = out.next;
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!((found, cursor), (10, None));
    // Every order holds the name; a write that took effect before its error is found older
    // when retried.
    assert_eq!(written + older, 10, "{written} written, {older} older");
    assert!(older > 0, "a retried write that had taken effect is found older");
    for i in 0..10 {
        assert_eq!(name_on(&s, "CUST#c1", &format!("ORDER#{i:03}")), Some(json!({"S": "Bea"})));
    }
}
