use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::*;
use crate::reconcile::memory::MemorySources;
use crate::reconcile::protocol::Applied;
use crate::reconcile::Report;
use crate::rules::copy::{CopyChange, SortValue, Version};

fn rule() -> CopyRule {
    crate::rules::copy::example("names", &[("customerName", "name"), ("customerTier", "tier")])
}

fn key(pk: &str, sk: &str) -> ItemKey {
    [("PK".to_string(), json!({"S": pk})), ("SK".to_string(), json!({"S": sk}))].into_iter().collect()
}

fn item(pk: &str, sk: &str, extra: Value) -> Map<String, Value> {
    let mut m: Map<String, Value> = key(pk, sk).into_iter().collect();
    m.extend(extra.as_object().cloned().unwrap_or_default());
    m
}

fn name_of(s: &MemorySources, sk: &str) -> (Option<Value>, Option<Value>) {
    let i = s.get(&["CUST#c1".to_string(), sk.to_string()]).unwrap();
    (i.get("customerName").cloned(), i.get("customerTier").cloned())
}

/// A consumer that has applied everything, and first runs `meanwhile` (a stream write that
/// lands between reconcile's reads and its corrections).
struct Caught {
    meanwhile: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    asked: Mutex<Vec<u64>>,
}

impl Consumer for Caught {
    async fn applied_before(&self, after_ms: u64, _wait: Duration) -> Result<Applied, ReconcileError> {
        self.asked.lock().unwrap().push(after_ms);
        if let Some(f) = self.meanwhile.lock().unwrap().take() {
            f();
        }
        Ok(Applied::default())
    }
}

fn caught() -> Caught {
    Caught { meanwhile: Mutex::new(None), asked: Mutex::new(Vec::new()) }
}

/// Customer c1 (Ann, gold) with four orders: right, wrong name, no copies, a stale tier.
fn store() -> Arc<MemorySources> {
    let mut s = MemorySources::new(vec!["PK".into(), "SK".into()]);
    s.page_size = 2;
    s.put(item("CUST#c1", "PROFILE", json!({"name": {"S": "Ann"}, "tier": {"S": "gold"}})));
    s.put(item("CUST#c1", "ORDER#1", json!({"customerName": {"S": "Ann"}, "customerTier": {"S": "gold"}})));
    let v1 = Version::new(1, "100").unwrap().text();
    s.put(item("CUST#c1", "ORDER#2", json!({"customerName": {"S": "Al"}, "customerTier": {"S": "gold"}, "_aggc:names": {"S": v1}})));
    s.put(item("CUST#c1", "ORDER#3", json!({"total": {"N": "3"}})));
    s.put(item("CUST#c1", "ORDER#4", json!({"customerName": {"S": "Ann"}, "customerTier": {"S": "blue"}})));
    Arc::new(s)
}

fn options(dry_run: bool) -> Options {
    Options { dry_run, ..Options::default() }
}

#[test]
fn a_fix_sets_what_differs_and_removes_what_the_source_lacks() {
    let r = rule();
    let want = [Some(json!({"S": "Ann"})), None];
    let held = |v: Value| v.as_object().unwrap().clone().into_iter().collect::<BTreeMap<String, Value>>();
    assert_eq!(fix_for(&r, &want, &held(json!({"customerName": {"S": "Ann"}}))), None);
    assert_eq!(
        fix_for(&r, &want, &held(json!({"customerName": {"S": "Al"}, "customerTier": {"S": "gold"}}))),
        Some(CopyFix { set: vec![("customerName".into(), json!({"S": "Ann"}))], remove: vec!["customerTier".into()] })
    );
    // A number copied as a string is not the same value.
    let want = [Some(json!({"N": "1"})), None];
    assert!(fix_for(&r, &want, &held(json!({"customerName": {"S": "1"}}))).is_some());
}

#[test]
fn sources_are_named_by_the_variables_and_found_by_their_keys() {
    let r = rule();
    let vars: BTreeMap<String, String> = [("customer".to_string(), "c1".to_string())].into();
    assert_eq!(source_for(&r, &vars), Some(key("CUST#c1", "PROFILE")));
    assert_eq!(source_for(&r, &BTreeMap::new()), None);
    assert!(is_source(&r, &key("CUST#c1", "PROFILE")));
    assert!(!is_source(&r, &key("CUST#c1", "ORDER#1")));
    assert!(!is_source(&r, &key("SALES#x", "PROFILE")));
}

#[tokio::test]
async fn copies_that_differ_from_their_source_are_set_to_it_after_the_evidence() {
    let s = store();
    let consumer = caught();
    let mut report = Report::default();
    let before = crate::state::now_ms();
    reconcile_copies(s.as_ref(), &consumer, &rule(), &[key("CUST#c1", "PROFILE")], &BTreeSet::new(), &options(false), &mut report)
        .await
        .unwrap();
    let (ann, gold) = (Some(json!({"S": "Ann"})), Some(json!({"S": "gold"})));
    for sk in ["ORDER#1", "ORDER#2", "ORDER#3", "ORDER#4"] {
        assert_eq!(name_of(&s, sk), (ann.clone(), gold.clone()), "{sk}");
    }
    assert_eq!(report.copies_checked, 4, "the source itself is not a copy");
    let fixed: Vec<String> = report.copy_drifts.iter().filter(|d| d.corrected).map(CopyDrift::item_text).collect();
    assert_eq!(fixed, ["CUST#c1 / ORDER#2", "CUST#c1 / ORDER#3", "CUST#c1 / ORDER#4"]);
    // The evidence asked for covers the source read.
    assert!(consumer.asked.lock().unwrap().iter().all(|t| *t >= before));
    // The correction leaves the recorded version as it was: the stream's next change wins.
    let o2 = s.get(&["CUST#c1".to_string(), "ORDER#2".to_string()]).unwrap();
    assert_eq!(o2.get("_aggc:names"), Some(&json!({"S": Version::new(1, "100").unwrap().text()})));
    assert_eq!(report.uncorrected(), 0);
}

#[tokio::test]
async fn a_dry_run_reports_and_writes_nothing() {
    let s = store();
    let mut report = Report::default();
    reconcile_copies(s.as_ref(), &caught(), &rule(), &[key("CUST#c1", "PROFILE")], &BTreeSet::new(), &options(true), &mut report)
        .await
        .unwrap();
    assert_eq!(report.copy_drifts.len(), 3);
    assert!(report.copy_drifts.iter().all(|d| !d.corrected));
    assert_eq!(name_of(&s, "ORDER#2").0, Some(json!({"S": "Al"})));
    let lines = report.copy_drifts[0].lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("customerName") && lines[0].contains("\"Al\"") && lines[0].contains("\"Ann\""), "{lines:?}");
}

#[tokio::test]
async fn a_deleted_source_takes_its_copies_off() {
    let s = store();
    s.delete(&["CUST#c1".to_string(), "PROFILE".to_string()]);
    let mut report = Report::default();
    reconcile_copies(s.as_ref(), &caught(), &rule(), &[key("CUST#c1", "PROFILE")], &BTreeSet::new(), &options(false), &mut report)
        .await
        .unwrap();
    for sk in ["ORDER#1", "ORDER#2", "ORDER#3", "ORDER#4"] {
        assert_eq!(name_of(&s, sk), (None, None), "{sk}");
    }
}

/// The stream renames the customer after reconcile read the source: its fan-out writes a copy
/// before the correction. The correction's condition (the version read before the source)
/// fails there, so the rename stays; on a copy the fan-out has not reached yet, the correction
/// lands first and the fan-out's newer version wins after it.
#[tokio::test]
async fn a_change_written_after_the_source_read_is_never_undone() {
    let s = store();
    let writer = s.clone();
    let rename = CopyChange {
        source: key("CUST#c1", "PROFILE"),
        find: FindQuery {
            index: None,
            partition: ("PK".into(), "CUST#c1".into()),
            sort: Some(("SK".into(), SortValue::BeginsWith("ORDER#".into()))),
        },
        set: vec![("customerName".into(), json!({"S": "Bea"})), ("customerTier".into(), json!({"S": "gold"}))],
        remove: vec![],
        version: Version::new(5, "900").unwrap(),
        deleted: false,
        snapshot: vec![Some(json!({"S": "Bea"})), Some(json!({"S": "gold"}))],
    };
    let late = rename.clone();
    let consumer = Caught {
        meanwhile: Mutex::new(Some(Box::new(move || {
            writer.put(item("CUST#c1", "PROFILE", json!({"name": {"S": "Bea"}, "tier": {"S": "gold"}})));
            let w = writer.clone();
            let change = rename.clone();
            // The fan-out reaches ORDER#2 only, before the corrections.
            futures::executor::block_on(async move {
                w.write(&key("CUST#c1", "ORDER#2"), &change, "_aggc:names").await.unwrap();
            });
        }))),
        asked: Mutex::new(Vec::new()),
    };
    let mut report = Report::default();
    reconcile_copies(s.as_ref(), &consumer, &rule(), &[key("CUST#c1", "PROFILE")], &BTreeSet::new(), &options(false), &mut report)
        .await
        .unwrap();
    assert_eq!(name_of(&s, "ORDER#2").0, Some(json!({"S": "Bea"})), "the correction undid the rename");
    let left: Vec<String> = report.copy_drifts.iter().filter(|d| d.left.is_some()).map(CopyDrift::item_text).collect();
    assert_eq!(left, ["CUST#c1 / ORDER#2"]);
    // The rest of the fan-out comes after the corrections and wins by its version.
    for sk in ["ORDER#1", "ORDER#3", "ORDER#4"] {
        s.write(&key("CUST#c1", sk), &late, "_aggc:names").await.unwrap();
        assert_eq!(name_of(&s, sk).0, Some(json!({"S": "Bea"})), "{sk}");
    }
}

#[tokio::test]
async fn a_source_whose_fan_out_job_is_pending_is_left_to_the_job() {
    let s = store();
    let source = key("CUST#c1", "PROFILE");
    let pending: BTreeSet<String> = [crate::rules::copy::job::job_id("names", &source)].into();
    let mut report = Report::default();
    reconcile_copies(s.as_ref(), &caught(), &rule(), &[source], &pending, &options(false), &mut report).await.unwrap();
    assert_eq!((report.copy_sources_pending, report.copies_checked, report.copy_drifts.len()), (1, 0, 0));
    assert_eq!(name_of(&s, "ORDER#2").0, Some(json!({"S": "Al"})), "the job writes it");
}
