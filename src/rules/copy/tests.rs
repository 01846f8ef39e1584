use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

fn t(s: &str) -> Template {
    Template::parse(s).unwrap()
}

/// The example of DESIGN.md: a customer's name and tier on each of their orders.
fn rule() -> CopyRule {
    crate::rules::copy::example("customer-name-on-orders", &[("customerName", "name"), ("customerTier", "tier")])
}

fn record(event: &str, seq: &str, old: Option<Value>, new: Option<Value>) -> Value {
    let mut ddb = json!({"Keys": {"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}}, "SequenceNumber": seq});
    if let Some(o) = old {
        ddb["OldImage"] = o;
    }
    if let Some(n) = new {
        ddb["NewImage"] = n;
    }
    json!({"eventName": event, "dynamodb": ddb})
}

fn profile(name: Option<&str>, tier: Option<&str>, visits: u32) -> Value {
    let mut image = json!({"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}, "visits": {"N": visits.to_string()}});
    if let Some(n) = name {
        image["name"] = json!({"S": n});
    }
    if let Some(t) = tier {
        image["tier"] = json!({"S": t});
    }
    image
}

fn change_of(raw: &Value, created: u64) -> Option<CopyChange> {
    rule().change(&StreamRecord::decode(raw).unwrap(), Some(created)).unwrap()
}

#[test]
fn a_rename_sets_every_copy_attribute_and_finds_the_orders() {
    let raw = record("MODIFY", "300", Some(profile(Some("Ann"), Some("gold"), 1)), Some(profile(Some("Bea"), Some("gold"), 1)));
    let c = change_of(&raw, 1_796_001_337_266).unwrap();
    assert_eq!(c.set, vec![("customerName".into(), json!({"S": "Bea"})), ("customerTier".into(), json!({"S": "gold"}))]);
    assert!(c.remove.is_empty() && !c.deleted);
    assert_eq!(
        c.find,
        FindQuery {
            index: None,
            partition: ("PK".into(), "CUST#c1".into()),
            sort: Some(("SK".into(), SortValue::BeginsWith("ORDER#".into())))
        }
    );
    assert_eq!(c.version.text(), format!("00000001796001337266.{}300", "0".repeat(37)));
    assert_eq!(c.source["PK"], json!({"S": "CUST#c1"}));
}

#[test]
fn other_changes_write_nothing_and_deletes_always_do() {
    let quiet = record("MODIFY", "1", Some(profile(Some("Ann"), None, 1)), Some(profile(Some("Ann"), None, 2)));
    assert_eq!(change_of(&quiet, 0), None, "only visits changed");
    let removed_tier = record("MODIFY", "2", Some(profile(Some("Ann"), Some("gold"), 1)), Some(profile(Some("Ann"), None, 1)));
    let c = change_of(&removed_tier, 0).unwrap();
    assert_eq!(c.remove, vec!["customerTier".to_string()]);
    let bare = record("INSERT", "3", None, Some(profile(None, None, 0)));
    assert_eq!(change_of(&bare, 0), None, "a new source without copied attributes has none to set");
    let insert = record("INSERT", "3", None, Some(profile(None, Some("gold"), 0)));
    let c = change_of(&insert, 0).unwrap();
    assert_eq!((c.set.len(), c.remove.len(), c.deleted), (1, 1, false), "a recreated source wins over its tombstone");
    let delete = record("REMOVE", "4", Some(profile(Some("Ann"), Some("gold"), 1)), None);
    let c = change_of(&delete, 0).unwrap();
    assert_eq!((c.set.len(), c.remove.len(), c.deleted), (0, 2, true));
}

#[test]
fn items_the_source_key_does_not_capture_are_not_sources() {
    let mut raw = record("INSERT", "1", None, Some(profile(Some("Ann"), None, 0)));
    raw["dynamodb"]["Keys"]["SK"] = json!({"S": "ORDER#1"});
    assert_eq!(change_of(&raw, 0), None);
}

#[test]
fn a_record_without_a_usable_sequence_number_is_poison() {
    let mut raw = record("INSERT", "1", None, Some(profile(Some("Ann"), None, 0)));
    raw["dynamodb"].as_object_mut().unwrap().remove("SequenceNumber");
    let p = rule().change(&StreamRecord::decode(&raw).unwrap(), Some(0)).unwrap_err();
    assert_eq!(p.code, PoisonCode::MalformedRecord);
    assert!(p.message.contains("SequenceNumber"), "{p}");
    assert_eq!(p.variables["customer"], "c1");
}

#[test]
fn versions_order_by_shard_creation_then_sequence_number_as_numbers() {
    let v = |ms, s: &str| Version::new(ms, s).unwrap();
    // A longer sequence number is larger even where its text sorts first.
    assert!(v(1, "9") < v(1, "10"));
    assert!(v(1, "9").text() < v(1, "10").text());
    // A child shard's records follow its parent's, whatever their sequence numbers.
    assert!(v(1, "99999999999999999999999") < v(2, "1"));
    assert!(v(1, "99999999999999999999999").text() < v(2, "1").text());
    assert_eq!(v(5, "00042"), v(5, "42"));
    let max = "9".repeat(SEQUENCE_DIGITS);
    assert_eq!(Version::parse(&v(u64::MAX, &max).text()), Some(v(u64::MAX, &max)));
    assert_eq!(Version::new(0, &"1".repeat(41)), Err(VersionError::TooLong(41)));
    assert_eq!(Version::new(0, "12a"), Err(VersionError::NotDigits));
    assert_eq!(Version::new(0, ""), Err(VersionError::Missing));
    assert_eq!(Version::parse("1.2"), None);
}

#[test]
fn a_batch_keeps_the_newest_change_per_source() {
    let a = change_of(&record("MODIFY", "5", Some(profile(Some("A"), None, 0)), Some(profile(Some("B"), None, 0))), 1).unwrap();
    let b = change_of(&record("MODIFY", "7", Some(profile(Some("B"), None, 0)), Some(profile(Some("C"), None, 0))), 1).unwrap();
    let mut batch = CopyBatch::default();
    batch.add(0, b.clone(), &json!("b"));
    batch.add(0, a, &json!("a"));
    let out: Vec<_> = batch.into_changes().collect();
    assert_eq!(out, vec![(0, b, json!("b"))]);
}

/// One change of the profile in a generated history.
#[derive(Debug, Clone)]
enum Op {
    Name(Option<&'static str>),
    Tier(Option<&'static str>),
    Visit,
    Delete,
    /// The stream's shard rolls over: later records are in a child shard, whose sequence
    /// numbers start anywhere.
    Split(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        prop::option::of(prop::sample::select(vec!["Ann", "Bea", "Cy"])).prop_map(Op::Name),
        prop::option::of(prop::sample::select(vec!["gold", "blue"])).prop_map(Op::Tier),
        Just(Op::Visit),
        Just(Op::Delete),
        // Sequence numbers just below a power of ten, so that a shard's numbers gain a digit.
        (1u32..25, 0u64..30).prop_map(|(k, d)| Op::Split(10u64.pow(k % 19 + 1).saturating_sub(d).max(1))),
    ]
}

/// The records of a history, each with the creation time of its shard.
fn history(ops: &[Op]) -> (Vec<(Value, u64)>, Option<Value>) {
    let (mut created, mut seq) = (1_700_000_000_000u64, 90u64);
    let mut item: Option<Value> = None;
    let mut out = Vec::new();
    for op in ops {
        if let Op::Split(start) = op {
            created += 1 + start % 5;
            seq = *start;
            continue;
        }
        seq += 1;
        let mut next = item.clone().unwrap_or_else(|| profile(None, None, 0));
        match op {
            Op::Name(n) | Op::Tier(n) => {
                let attr = if matches!(op, Op::Name(_)) { "name" } else { "tier" };
                match n {
                    Some(v) => next[attr] = json!({"S": v}),
                    None => drop(next.as_object_mut().and_then(|o| o.remove(attr))),
                }
            }
            Op::Visit => next["visits"] = json!({"N": seq.to_string()}),
            Op::Delete | Op::Split(_) => {}
        }
        let raw = match (op, &item) {
            (Op::Delete, None) => continue,
            (Op::Delete, Some(old)) => record("REMOVE", &seq.to_string(), Some(old.clone()), None),
            (_, None) => record("INSERT", &seq.to_string(), None, Some(next.clone())),
            (_, Some(old)) => record("MODIFY", &seq.to_string(), Some(old.clone()), Some(next.clone())),
        };
        item = if matches!(op, Op::Delete) { None } else { Some(next) };
        out.push((raw, created));
    }
    (out, item)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any cut of the history into batches, any replays from an earlier point (a crash before
    /// the checkpoint, a lost lease), and any order in which the resulting writes land on a
    /// copy item (a slow writer's write arriving late) leave the copy equal to the final
    /// source: its copied attributes, or none once it was deleted.
    #[test]
    fn any_cut_replay_and_write_order_leaves_the_copies_of_the_final_source(
        ops in prop::collection::vec(op(), 1..40),
        cuts in prop::collection::vec((0usize..40, 1usize..8), 1..12),
        order in prop::collection::vec(any::<prop::sample::Index>(), 0..64),
    ) {
        let (records, last) = history(&ops);
        prop_assume!(!records.is_empty());
        let n = records.len();
        // Deliveries: each starts at or before the furthest point reached (a replay), and the
        // last one runs to the end, so every record is delivered at least once.
        let mut deliveries = Vec::new();
        let mut reached: usize = 0;
        for (back, len) in &cuts {
            let start = reached.saturating_sub(*back);
            let end = (start + len).min(n);
            deliveries.push(start..end);
            reached = reached.max(end);
        }
        deliveries.push(reached.saturating_sub(cuts[0].0)..n);
        let mut writes = Vec::new();
        for range in deliveries {
            let mut batch = CopyBatch::default();
            for (raw, created) in &records[range] {
                if let Some(c) = rule().change(&StreamRecord::decode(raw).unwrap(), Some(*created)).unwrap() {
                    batch.add(0, c, raw);
                }
            }
            writes.extend(batch.into_changes().map(|(_, c, _)| c));
        }
        // The writes land in a shuffled order.
        for (i, pick) in order.iter().enumerate() {
            let n = writes.len();
            if n > 1 {
                writes.swap(i % n, pick.index(n));
            }
        }
        let mut copy = CopyState::default();
        for w in &writes {
            copy.apply(w);
        }
        let mut expected = BTreeMap::new();
        for (copy_name, source) in [("customerName", "name"), ("customerTier", "tier")] {
            if let Some(v) = last.as_ref().and_then(|item| item.get(source)) {
                expected.insert(copy_name.to_string(), v.clone());
            }
        }
        prop_assert_eq!(&copy.values, &expected, "ops {:?}", ops);
    }
}

#[test]
fn to_must_name_the_keys_of_the_table_or_of_an_existing_index() {
    let keys = TableKeys {
        table: vec!["PK".into(), "SK".into()],
        indexes: vec![("GSI1".into(), vec!["GSI1PK".into(), "GSI1SK".into()])],
        not_text: vec!["GSI1SK".into()],
        partial: vec![("GSI2".into(), vec!["customerName".into(), "customerTier".into()])],
    };
    assert_eq!(check_table(&rule(), &keys, "t"), Ok(()));
    let mut wrong = rule();
    wrong.to.partition.0 = "pk".into();
    let e = check_table(&wrong, &keys, "t").unwrap_err();
    assert!(e.contains("are not those of table t: its keys are [\"PK\", \"SK\"]"), "{e}");
    let mut on_index = rule();
    on_index.to.index = Some("GSI2".into());
    let e = check_table(&on_index, &keys, "t").unwrap_err();
    assert!(e.contains("names index GSI2, which table t does not have (its global secondary indexes: [\"GSI1\"])"), "{e}");
    on_index.to.index = Some("GSI1".into());
    on_index.to.partition.0 = "GSI1PK".into();
    on_index.to.sort = Some(("GSI1SK".into(), SortCondition::BeginsWith(t("ORDER#"))));
    let e = check_table(&on_index, &keys, "t").unwrap_err();
    assert!(e.contains("key attribute GSI1SK is not of type S in index GSI1 of table t"), "{e}");
    on_index.to.sort = None;
    assert_eq!(check_table(&on_index, &keys, "t"), Ok(()));
    // An index that projects the copies but not their version.
    let keys = TableKeys { indexes: vec![("GSI2".into(), vec!["GSI1PK".into()])], ..keys };
    on_index.to.index = Some("GSI2".into());
    let e = check_table(&on_index, &keys, "t").unwrap_err();
    assert!(e.contains("index GSI2 of table t does not project [\"_aggc:customer-name-on-orders\"]"), "{e}");
}

#[test]
fn a_record_from_a_shard_without_a_creation_time_is_poison() {
    let raw = record("MODIFY", "3", Some(profile(Some("Ann"), None, 0)), Some(profile(Some("Bea"), None, 0)));
    let p = rule().change(&StreamRecord::decode(&raw).unwrap(), None).unwrap_err();
    assert_eq!(p.code, PoisonCode::MalformedRecord);
    assert!(p.message.contains("creation time"), "{p}");
}

#[test]
fn a_fan_out_goes_on_only_while_the_source_holds_what_it_copies() {
    let raw = record("MODIFY", "3", Some(profile(Some("Ann"), None, 0)), Some(profile(Some("Bea"), None, 0)));
    let c = change_of(&raw, 1).unwrap();
    let item = |v: Value| v.as_object().cloned().unwrap();
    assert!(c.still_current(&rule().current(Some(&item(profile(Some("Bea"), None, 7))))), "other attributes do not matter");
    assert!(!c.still_current(&rule().current(Some(&item(profile(Some("Cy"), None, 0))))));
    assert!(!c.still_current(&rule().current(None)));
    let delete = change_of(&record("REMOVE", "4", Some(profile(Some("Bea"), None, 0)), None), 1).unwrap();
    assert!(delete.still_current(&rule().current(None)));
    assert!(delete.still_current(&rule().current(Some(&item(profile(None, None, 0))))), "recreated without copied attributes");
    assert!(!delete.still_current(&rule().current(Some(&item(profile(Some("Dee"), None, 0))))));
}

/// What one step of the interleaving does besides the next source change.
#[derive(Debug, Clone)]
enum Beat {
    /// The consumer applies this many more records (a batch), coalesced, each change fanned out
    /// to the items that exist now.
    Apply(usize),
    /// The application places an order holding the source's current copied values, no version.
    Place,
    /// A writer that lost its lease queries the items of one change it applied (now), and
    /// writes them later.
    Pause(prop::sample::Index),
    /// A paused writer wakes: it reads the source, and writes its items if the source still
    /// holds what its change copies.
    Wake(prop::sample::Index),
}

fn beat() -> impl Strategy<Value = Beat> {
    prop_oneof![
        (1usize..6).prop_map(Beat::Apply),
        Just(Beat::Place),
        any::<prop::sample::Index>().prop_map(Beat::Pause),
        any::<prop::sample::Index>().prop_map(Beat::Wake),
    ]
}

/// The copy attributes an item holds when the application creates it from this source.
fn placed(current: &[Option<Value>]) -> CopyState {
    let names = ["customerName", "customerTier"];
    CopyState { values: names.iter().zip(current).filter_map(|(n, v)| Some((n.to_string(), v.clone()?))).collect(), version: None }
}

/// A fan-out as `sink::copy::fan_out` runs it, over the items `found` (queried earlier by a
/// paused writer): the source is read first, and the items are written only if it still holds
/// what the change copies.
fn fan_out_model(change: &CopyChange, source_now: &[Option<Value>], found: &[usize], items: &mut [CopyState]) {
    if !change.still_current(source_now) {
        return;
    }
    for &i in found {
        items[i].apply(change);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Orders placed at any moment with the source's values of that moment, a consumer that
    /// lags, and writers that lose their lease between their query and their writes: once
    /// every record is applied and every paused writer has woken, each order holds the final
    /// source's values.
    #[test]
    fn orders_placed_at_any_moment_end_with_the_final_source_despite_late_writers(
        ops in prop::collection::vec(op(), 1..30),
        beats in prop::collection::vec(prop::collection::vec(beat(), 0..4), 30),
    ) {
        let (records, last) = history(&ops);
        prop_assume!(!records.is_empty());
        let rule = rule();
        let source_at = |applied_to: usize| -> Vec<Option<Value>> {
            // The source item after the first `applied_to` records.
            let image = records[..applied_to].last().and_then(|(raw, _)| {
                let r = StreamRecord::decode(raw).ok()?;
                r.new_image.and_then(|i| i.as_object().cloned())
            });
            rule.current(image.as_ref())
        };
        let mut items: Vec<CopyState> = Vec::new();
        let mut consumer = 0usize;
        let mut applied: Vec<CopyChange> = Vec::new();
        let mut paused: Vec<(CopyChange, Vec<usize>)> = Vec::new();
        for (t, step_beats) in beats.iter().enumerate().take(records.len()) {
            let written = t + 1; // records 0..=t are in the table
            for b in step_beats {
                match b {
                    Beat::Apply(n) => {
                        let end = (consumer + n).min(written);
                        let mut batch = CopyBatch::default();
                        for (raw, created) in &records[consumer..end] {
                            if let Some(c) = rule.change(&StreamRecord::decode(raw).unwrap(), Some(*created)).unwrap() {
                                batch.add(0, c, raw);
                            }
                        }
                        for (_, c, _) in batch.into_changes() {
                            let all: Vec<usize> = (0..items.len()).collect();
                            fan_out_model(&c, &source_at(written), &all, &mut items);
                            applied.push(c);
                        }
                        consumer = end;
                    }
                    Beat::Place => items.push(placed(&source_at(written))),
                    Beat::Pause(i) if !applied.is_empty() => {
                        paused.push((applied[i.index(applied.len())].clone(), (0..items.len()).collect()));
                    }
                    Beat::Wake(i) if !paused.is_empty() => {
                        let (c, found) = paused.swap_remove(i.index(paused.len()));
                        fan_out_model(&c, &source_at(written), &found, &mut items);
                    }
                    _ => {}
                }
            }
        }
        // The rest: the consumer applies everything, then the paused writers wake.
        let n = records.len();
        let mut batch = CopyBatch::default();
        for (raw, created) in &records[consumer..] {
            if let Some(c) = rule.change(&StreamRecord::decode(raw).unwrap(), Some(*created)).unwrap() {
                batch.add(0, c, raw);
            }
        }
        for (_, c, _) in batch.into_changes() {
            let all: Vec<usize> = (0..items.len()).collect();
            fan_out_model(&c, &source_at(n), &all, &mut items);
        }
        for (c, found) in paused {
            fan_out_model(&c, &source_at(n), &found, &mut items);
        }
        let expected = placed(&rule.current(last.as_ref().and_then(|i| i.as_object())));
        for (i, item) in items.iter().enumerate() {
            prop_assert_eq!(&item.values, &expected.values, "order {} of {}; ops {:?}", i, items.len(), ops);
        }
    }
}
