//! The attributes of `max`, `min`, `latest` and `distinct`, derived from their helper items
//! ([`crate::rules::helper`]) after a batch's writes.
//!
//! A derivation reads the target's counter (`_aggd:<namespace>`), queries each measure's live
//! helpers, and writes the values on condition that the counter is unchanged, advancing it. Why
//! this is exact with many shards, replicas and crashes:
//! - every helper write is followed, before its batch's checkpoint moves, by a derivation of
//!   its target that succeeds; a crash in between replays the batch, which derives again (its
//!   helper writes are refused by the ledger, the derivation is not);
//! - a derivation lands only if no other landed since it read the counter, and it queried the
//!   helpers after that read. So the last one to land queried after every earlier one landed,
//!   hence after every helper write whose derivation landed before it: it saw them all. A view
//!   older than another derivation's can never overwrite it.

use std::collections::BTreeMap;

use super::{AggregateStore, DerivedWrite, HelperQuery, SinkError};
use crate::rules::helper::{self, Derive, Scalar};
use crate::rules::{Engine, MeasureKind, TargetDelta, TargetKey};
use crate::sink::ledger::Ledger;

/// Rounds lost to other derivations of the same target before the batch gives up (and is
/// retried from its checkpoint).
const ROUNDS: u32 = 32;
/// Transient failures retried within one derivation.
const TRANSIENT_RETRIES: u32 = 8;

/// A target whose derived attributes a batch changed, with the measures to derive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeriveTarget {
    pub key: TargetKey,
    /// Expanded measure name -> how it is derived.
    pub measures: BTreeMap<String, Derive>,
}

/// The targets whose helpers are among `targets` (a batch's writes), each with the measures
/// those helpers belong to. Helpers are found by their sort key; the measure's kind by the
/// rules that wrote them.
pub fn targets_to_derive(engine: &Engine, targets: &[(TargetKey, TargetDelta)]) -> Vec<DeriveTarget> {
    let mut out: BTreeMap<TargetKey, BTreeMap<String, Derive>> = BTreeMap::new();
    for (key, delta) in targets {
        let Some(h) = key.0.last().filter(|_| key.0.len() > 1).and_then(|sk| helper::parse(sk)) else { continue };
        let derive = delta.contributions.iter().filter_map(|c| c.rule.as_deref()).find_map(|rule| {
            let rule = engine.rules.iter().find(|r| *r.name == *rule)?;
            rule.measures.iter().find_map(|m| match &m.kind {
                MeasureKind::Helper(hm) if m.name.matches_expansion(h.measure) => Some(hm.derive),
                _ => None,
            })
        });
        let Some(derive) = derive else { continue };
        let mut owner = key.0.to_vec();
        if let Some(last) = owner.last_mut() {
            *last = Box::from(h.owner_sk);
        }
        out.entry(TargetKey(owner.into_boxed_slice())).or_default().insert(h.measure.to_string(), derive);
    }
    out.into_iter().map(|(key, measures)| DeriveTarget { key, measures }).collect()
}

/// The derived values one batch gives on its own, from an empty table (each helper's count is
/// the batch's delta): `simulate`'s `"value"` lines. None: nothing contributes.
pub fn values_of_batch(engine: &Engine, targets: &[(TargetKey, TargetDelta)]) -> Vec<(TargetKey, String, Option<Scalar>)> {
    let mut out = Vec::new();
    for t in targets_to_derive(engine, targets) {
        let Some((owner_sk, partition)) = t.key.0.split_last() else { continue };
        for (name, how) in &t.measures {
            let prefix = helper::prefix(owner_sk, name);
            let helpers = targets.iter().filter_map(|(k, d)| {
                let (sk, p) = k.0.split_last()?;
                let tail = sk.strip_prefix(prefix.as_str()).filter(|_| p == partition)?;
                Some((tail, d.attributes.get(helper::REFS).copied().unwrap_or(crate::decimal::Decimal::ZERO)))
            });
            out.push((t.key.clone(), name.clone(), helper::derive(*how, helpers)));
        }
    }
    out
}

/// What one derivation cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeriveStats {
    pub queries: u64,
    pub writes: u64,
    pub read_capacity: f64,
    /// Of the write that landed.
    pub write_capacity: f64,
    /// Rounds another derivation of the same target won.
    pub lost: u32,
}

/// Derives `target`'s attributes from its live helpers until a write lands.
pub async fn derive_target<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    ledger: &Ledger,
    target: &DeriveTarget,
) -> Result<DeriveStats, SinkError> {
    let mut stats = DeriveStats::default();
    let mut transient = 0;
    for _ in 0..ROUNDS + TRANSIENT_RETRIES {
        match derive_once(store, key_names, ledger, target, &mut stats).await {
            Ok(Some(capacity)) => {
                stats.write_capacity += capacity;
                return Ok(stats);
            }
            Ok(None) => {
                stats.lost += 1;
                if stats.lost >= ROUNDS {
                    break;
                }
            }
            Err(e) if e.is_retriable() && transient < TRANSIENT_RETRIES => {
                transient += 1;
                tokio::time::sleep(super::backoff(transient)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(SinkError::Transient(format!("deriving {:?}: other derivations kept landing first", target.key.0)))
}

/// One round: read the counter, query the helpers, write on condition. None: lost the race.
async fn derive_once<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    ledger: &Ledger,
    target: &DeriveTarget,
    stats: &mut DeriveStats,
) -> Result<Option<f64>, SinkError> {
    let (Some(pk), Some(owner_sk)) = (target.key.0.first(), target.key.0.last().filter(|_| target.key.0.len() > 1)) else {
        return Err(SinkError::Invalid("helper items need a table with a sort key".into()));
    };
    let key: Vec<(String, String)> = key_names.iter().cloned().zip(target.key.0.iter().map(|v| v.to_string())).collect();
    let generation = ledger.derived_attribute();
    let seen = store.generation(&key, &generation).await?;
    let mut values: Vec<(String, Option<Scalar>)> = Vec::with_capacity(target.measures.len());
    for (name, derive) in &target.measures {
        let prefix = helper::prefix(owner_sk, name);
        let live = store.live_helpers(&HelperQuery { key_names, pk, prefix: &prefix, scan: derive.scan() }).await?;
        stats.queries += 1;
        stats.read_capacity += live.capacity;
        values.push((name.clone(), derive.value(live.first.as_deref(), live.count)));
    }
    stats.writes += 1;
    store.set_derived(&DerivedWrite { key: &key, generation: &generation, seen: seen.as_deref(), values: &values }).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::decimal::Decimal;
    use crate::rules::{Coalescer, TargetDelta};
    use crate::sink::memory::{MemValue, MemoryAggregates};

    fn engine() -> Engine {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/commerce-measures.yaml")).unwrap();
        Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine
    }

    fn order(customer: &str, id: u32, total: &str, status: &str) -> serde_json::Value {
        let image = serde_json::json!({
            "PK": {"S": format!("CUST#{customer}")}, "SK": {"S": format!("ORDER#2026-11-{:02}#o{id}", 1 + id % 28)},
            "total": {"N": total}, "status": {"S": status}, "updatedAt": {"N": id.to_string()},
        });
        serde_json::json!({"eventName": "INSERT", "dynamodb": {
            "Keys": {"PK": image["PK"], "SK": image["SK"]}, "NewImage": image,
            "SequenceNumber": format!("{id:021}"), "StreamViewType": "NEW_AND_OLD_IMAGES"}})
    }

    fn batch(engine: &Engine, records: &[serde_json::Value]) -> Vec<(TargetKey, TargetDelta)> {
        let mut c = Coalescer::new();
        for r in records {
            assert!(engine.apply(r, &mut c).poisons.is_empty());
        }
        c.into_targets()
    }

    #[test]
    fn a_batch_derives_each_target_once_with_every_measure_its_helpers_touched() {
        let e = engine();
        let targets = batch(&e, &[order("c1", 1, "5", "PAID"), order("c1", 2, "9", "PENDING"), order("c2", 3, "1", "PAID")]);
        let derive = targets_to_derive(&e, &targets);
        let keys: Vec<Vec<&str>> = derive.iter().map(|d| d.key.0.iter().map(|s| &**s).collect()).collect();
        assert_eq!(keys, [vec!["CUST#c1", "PROFILE"], vec!["CUST#c2", "PROFILE"]]);
        let measures: Vec<(&str, Derive)> = derive[0].measures.iter().map(|(n, d)| (n.as_str(), *d)).collect();
        assert_eq!(
            measures,
            [
                ("activeDays", Derive::Distinct),
                ("firstOrderDay", Derive::Min),
                ("largestOrder", Derive::Max),
                ("lastStatus", Derive::Latest)
            ]
        );
    }

    async fn write(store: &MemoryAggregates, e: &Engine, targets: &[(TargetKey, TargetDelta)]) {
        let ctx = crate::sink::ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000000-00000001");
        for (k, d) in targets {
            crate::sink::write_target(store, &e.key_names, k, d, &ctx).await.unwrap();
        }
        for t in targets_to_derive(e, targets) {
            derive_target(store, &e.key_names, &Ledger::new("t"), &t).await.unwrap();
        }
    }

    #[tokio::test]
    async fn deleting_the_largest_order_brings_back_the_next_and_the_last_one_removes_it() {
        let e = engine();
        let store = MemoryAggregates::new();
        write(&store, &e, &batch(&e, &[order("c1", 1, "5", "PAID"), order("c1", 2, "9", "PENDING")])).await;
        let profile = || store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(9))));
        assert_eq!(profile().get("lastStatus"), Some(&MemValue::Str("PENDING".into())));
        assert_eq!(profile().get("activeDays"), Some(&MemValue::Num(Decimal::from_i64(2))));
        let mut delete = order("c1", 2, "9", "PENDING");
        delete["eventName"] = "REMOVE".into();
        delete["dynamodb"]["OldImage"] = delete["dynamodb"]["NewImage"].take();
        delete["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        delete["dynamodb"]["SequenceNumber"] = format!("{:021}", 10).into();
        write(&store, &e, &batch(&e, &[delete.clone()])).await;
        assert_eq!(profile().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(5))), "the next largest");
        assert_eq!(profile().get("lastStatus"), Some(&MemValue::Str("PAID".into())));
        assert_eq!(profile().get("activeDays"), Some(&MemValue::Num(Decimal::ONE)));
        let mut last = order("c1", 1, "5", "PAID");
        last["eventName"] = "REMOVE".into();
        last["dynamodb"]["OldImage"] = last["dynamodb"]["NewImage"].take();
        last["dynamodb"].as_object_mut().unwrap().remove("NewImage");
        last["dynamodb"]["SequenceNumber"] = format!("{:021}", 11).into();
        write(&store, &e, &batch(&e, &[last])).await;
        for gone in ["largestOrder", "firstOrderDay", "lastStatus", "activeDays"] {
            assert_eq!(profile().get(gone), None, "{gone}: nothing contributes");
        }
        // A replay of the delete: its helper writes are refused, the derivation changes nothing.
        write(&store, &e, &batch(&e, &[delete])).await;
        assert_eq!(profile().get("largestOrder"), None);
    }

    #[tokio::test]
    async fn a_derivation_from_an_older_view_never_lands_after_a_newer_one() {
        let store = MemoryAggregates::new();
        let key = vec![("PK".to_string(), "CUST#c1".to_string()), ("SK".to_string(), "PROFILE".to_string())];
        let g = "_aggd:t";
        let value = |v: i64| vec![("largestOrder".to_string(), Some(Scalar::N(Decimal::from_i64(v))))];
        let old = store.generation(&key, g).await.unwrap();
        let newer = store.generation(&key, g).await.unwrap();
        assert!(store
            .set_derived(&DerivedWrite { key: &key, generation: g, seen: newer.as_deref(), values: &value(9) })
            .await
            .unwrap()
            .is_some());
        assert!(
            store.set_derived(&DerivedWrite { key: &key, generation: g, seen: old.as_deref(), values: &value(5) }).await.unwrap().is_none(),
            "read before the newer one landed: refused"
        );
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap().get("largestOrder"), Some(&MemValue::Num(Decimal::from_i64(9))));
    }
}
