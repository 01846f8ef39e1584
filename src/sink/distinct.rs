//! `distinct` as a count of 0↔1 transitions: what a derivation reads is the helpers its batch
//! touched, not every helper of the target.
//!
//! Each helper item carries a flag, [`COUNTED`], and the target a count per attribute
//! (`_aggn:<namespace>:<attribute>`). A flag changes only together with the count, in one
//! transaction ([`AggregateStore::count_transitions`]) conditioned on the helper's flag and the
//! sign of its count being as read. So, whatever crashes, retries and replicas do:
//! - **(I) the count equals the number of flagged helpers.** It holds at the start (no flag,
//!   no count), every transaction keeps it, and the only other write of the count
//!   ([`AggregateStore::settle_count`]) sets it to a number of flags read after the derivation
//!   counter, conditioned on that counter, which every transaction advances.
//! - **(II) once walked, a helper is flagged exactly when it is live, but for helpers a batch
//!   wrote whose derivation has not finished.** A walk (`_aggw:<namespace>:<attribute>`, set by
//!   the settle) reads every helper and flips every flag that disagrees. After it, a helper's
//!   liveness changes only through a helper write, and the batch that wrote it derives, before
//!   its checkpoint moves, from the flags of every helper it touched, flipping those that
//!   disagree. A crash in between replays the batch, which touches the same helpers again (the
//!   ledger refuses the writes, not the derivation).
//! - **The attribute is the count**, set by each transaction once walked, and by the settle
//!   (removed at zero). A derivation whose transactions lowered the count reads again and
//!   settles it if it reads zero, so a count that fell to zero never stays as `0`.
//!
//! The first derivation of an attribute that was never walked (an upgrade from protocol 5, where
//! the attribute was a count of live helpers) walks every helper once, and so does reconcile (a
//! correction may raise or zero any helper). Its transactions leave the attribute as it was; the
//! settle sets it. A flagged helper gets no expiry ([`AggregateStore::expire_helper`]): the
//! transaction that clears its flag sets it, so a helper the count still holds is never deleted.

use std::collections::BTreeSet;

use super::expiry::{Expiry, Pending};
use super::{
    AggregateStore, Counters, DerivationNames, HelperQuery, HelperScan, HelperState, Settle, SettleWrite, SinkError, TransitionWrite,
};
use crate::rules::helper;

/// The helper item's flag: it is counted in its target's `distinct` count (a number, 1; absent:
/// not counted).
pub const COUNTED: &str = "counted";
/// Helpers in one transaction, besides the target (DynamoDB takes 100 items).
pub const HELPERS_PER_TRANSACTION: usize = 24;
/// Rounds before the derivation gives up (the batch is retried from its checkpoint).
const ROUNDS: u32 = 8;

/// Which helpers a `distinct` derivation reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touched {
    /// The tails of the helpers a batch wrote (any record of it, whatever the net).
    Helpers(BTreeSet<String>),
    /// Every helper (reconcile: a correction may change any of them).
    Everything,
    /// None: the walked mark is removed, before reconcile corrects a helper. A correction
    /// changes a helper's count without its flag; until a walk flips it, every derivation
    /// walks, whether or not reconcile gets to derive.
    Unwalk,
}

/// The helpers whose flag disagrees with their count, each with its state as read.
pub fn mismatched<'a>(states: impl IntoIterator<Item = (&'a String, &'a HelperState)>) -> Vec<(String, HelperState)> {
    states.into_iter().filter(|(_, s)| s.live != s.counted).map(|(t, s)| (t.clone(), *s)).collect()
}

/// How a transaction flipping these helpers' flags moves the count.
pub fn delta(flips: &[(String, HelperState)]) -> i64 {
    flips.iter().map(|(_, s)| if s.counted { -1 } else { 1 }).sum()
}

/// The attribute as the count says it should read (None: removed, at zero).
pub fn expected(count: u64) -> Option<String> {
    (count > 0).then(|| count.to_string())
}

/// Whether a settle must write: the attribute is not walked, or the count or the attribute
/// differ from `count`. The count and the attribute are compared as numbers.
pub fn needs_settle(counters: &Counters, name: &str, count: u64) -> bool {
    let number = |v: Option<&String>| v.map(|v| v.parse::<crate::decimal::Decimal>().ok());
    let stored = number(counters.counts.get(name)).unwrap_or(Some(crate::decimal::Decimal::ZERO));
    let want = crate::decimal::Decimal::from_i64(i64::try_from(count).unwrap_or(i64::MAX));
    let shown = number(counters.numbers.get(name));
    !counters.walked.contains(name) || stored != Some(want) || shown != expected(count).map(|_| Some(want))
}

/// One attribute's derivation, and where it reads.
pub struct DistinctTarget<'a> {
    pub key_names: &'a [String],
    pub key: &'a [(String, String)],
    pub pk: &'a str,
    pub owner_sk: &'a str,
    pub names: &'a DerivationNames,
    pub name: &'a str,
    pub touched: &'a Touched,
    pub expiry: Option<&'a Expiry>,
}

/// What one `distinct` derivation did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DistinctStats {
    /// Helper items read.
    pub read: u64,
    pub read_capacity: f64,
    pub write_capacity: f64,
    /// Transactions and settles that landed, and those refused because something changed first.
    pub landed: u64,
    pub lost: u64,
}

/// Derives one `distinct` attribute: flips the flags of the touched helpers (every helper,
/// until the attribute is walked) that disagree with their counts, then settles the attribute
/// where it must.
pub async fn derive_distinct<S: AggregateStore>(store: &S, t: &DistinctTarget<'_>, stats: &mut DistinctStats) -> Result<(), SinkError> {
    if *t.touched == Touched::Unwalk {
        let counters = store.derivation_counters(t.key, t.names).await?;
        stats.read_capacity += counters.capacity;
        settle(store, t, &counters, Settle::Unwalk, stats).await?;
        return Ok(());
    }
    // Every helper, whatever was touched: a count that is not a whole number (someone else
    // wrote it) is set from the flags.
    let mut everything = false;
    // The transactions landed and lowered the count: only the count is read again.
    let mut lowered = false;
    for _ in 0..ROUNDS {
        let counters = store.derivation_counters(t.key, t.names).await?;
        stats.read_capacity += counters.capacity;
        let walked = counters.walked.contains(t.name);
        let stored = match counters.counts.get(t.name).map(|c| c.parse::<u64>()) {
            None => Some(0),
            Some(Ok(c)) => Some(c),
            Some(Err(_)) => None,
        };
        let fast = match t.touched {
            Touched::Helpers(tails) if walked && !everything => Some(tails),
            _ => None,
        };
        if let (Some(_), Some(count), true) = (fast, stored, lowered) {
            match settle_if_needed(store, t, &counters, count, stats).await? {
                true => return Ok(()),
                false => continue,
            }
        }
        if fast.is_some() && stored.is_none() {
            everything = true;
            continue;
        }
        let states = match fast {
            Some(tails) => touched_states(store, t, tails, stats).await?,
            None => every_state(store, t, stats).await?,
        };
        let flips = mismatched(&states);
        let flagged = states.values().filter(|s| s.counted).count() as u64;
        if stored.is_none() {
            // A count that is not a whole number (someone else wrote it) takes no transaction:
            // it is set to the flags read, and the walk flips them in the next round.
            settle(store, t, &counters, Settle::Count { value: flagged, mark: flips.is_empty() }, stats).await?;
            continue;
        }
        if !flips.is_empty() {
            match flip(store, t, walked, &flips, stats).await? {
                Flipped::Landed { lowered: false } if fast.is_some() => return Ok(()),
                // A count that went down may have reached zero: read it again.
                Flipped::Landed { lowered: true } if fast.is_some() => lowered = true,
                Flipped::Landed { .. } | Flipped::Lost => {}
            }
            continue;
        }
        // The flags agree with the counts it read: settle where the count or the attribute
        // disagree. Walked: the count is the number of flags (I), and only the attribute may
        // be off. Not walked: the number of flags it read, after reading the counter.
        let count = match (fast, stored) {
            (Some(_), Some(c)) => c,
            _ => flagged,
        };
        if settle_if_needed(store, t, &counters, count, stats).await? {
            return Ok(());
        }
    }
    Err(SinkError::Transient(format!("deriving {} on {:?}: its helpers kept changing", t.name, t.key)))
}

/// The states of every helper of the attribute (a walk).
async fn every_state<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    stats: &mut DistinctStats,
) -> Result<std::collections::BTreeMap<String, HelperState>, SinkError> {
    let prefix = helper::prefix(t.owner_sk, t.name);
    let q = HelperQuery { key_names: t.key_names, pk: t.pk, prefix: &prefix, scan: HelperScan::Count, from: None };
    let all = store.helper_states(&q).await?;
    stats.read += all.helpers.len() as u64;
    stats.read_capacity += all.capacity;
    Ok(all.helpers)
}

/// The states of the touched helpers (one that is gone is neither live nor counted).
async fn touched_states<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    tails: &BTreeSet<String>,
    stats: &mut DistinctStats,
) -> Result<std::collections::BTreeMap<String, HelperState>, SinkError> {
    let prefix = helper::prefix(t.owner_sk, t.name);
    let mut out = std::collections::BTreeMap::new();
    for tail in tails {
        let key = with_sort_key(t.key, &format!("{prefix}{tail}"));
        let (state, capacity) = store.helper_state(&key).await?;
        stats.read += 1;
        stats.read_capacity += capacity;
        if let Some(s) = state {
            out.insert(tail.clone(), s);
        }
    }
    Ok(out)
}

enum Flipped {
    /// `lowered`: a transaction moved the count down (with several, the count may have
    /// reached zero in any of them).
    Landed {
        lowered: bool,
    },
    Lost,
}

/// Flips the flags, a transaction per [`HELPERS_PER_TRANSACTION`]; any that loses ends it.
async fn flip<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    walked: bool,
    flips: &[(String, HelperState)],
    stats: &mut DistinctStats,
) -> Result<Flipped, SinkError> {
    let prefix = helper::prefix(t.owner_sk, t.name);
    let expiring = t.expiry.filter(|e| e.set);
    let count = format!("{}{}", t.names.counts, t.name);
    let counter = format!("{}{}", t.names.counters, t.name);
    let mut lowered = false;
    for chunk in flips.chunks(HELPERS_PER_TRANSACTION) {
        let helpers: Vec<(String, HelperState)> = chunk.iter().map(|(tail, s)| (format!("{prefix}{tail}"), *s)).collect();
        // The expiry from the time of this chunk's transaction, not of the read: a helper may
        // hold records applied since (raised and lowered again while this derivation waited).
        let expiry = expiring.map(|e| (e.attribute.as_str(), e.at(crate::state::now_ms())));
        // Where the service deletes helpers itself, no expiry without its record.
        let recorded = match expiry.filter(|_| expiring.is_some_and(|e| e.own)) {
            Some(e) => record_expiries(store, t, &helpers, e, stats).await?,
            None => true,
        };
        let w = TransitionWrite {
            key_names: t.key_names,
            key: t.key,
            count: &count,
            counter: &counter,
            attribute: walked.then_some(t.name),
            helpers: &helpers,
            expiry: expiry.filter(|_| recorded),
        };
        match store.count_transitions(&w).await? {
            Some(capacity) => {
                stats.landed += 1;
                stats.write_capacity += capacity;
                lowered |= delta(chunk) < 0;
            }
            None => {
                stats.lost += 1;
                return Ok(Flipped::Lost);
            }
        }
    }
    Ok(Flipped::Landed { lowered })
}

/// The key of the item beside `key` with sort key `sk`: a helper of that target.
fn with_sort_key(key: &[(String, String)], sk: &str) -> Vec<(String, String)> {
    let mut out = key.to_vec();
    if let Some(last) = out.last_mut() {
        last.1 = sk.to_string();
    }
    out
}

/// Records the expiries a transition of `helpers` sets (on each it stops counting, at zero),
/// where the service deletes expired helpers itself ([`super::expiry`]): before the transition,
/// side by side. False when the table refused one for good: the transition then sets no expiry.
async fn record_expiries<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    helpers: &[(String, HelperState)],
    (attribute, at): (&str, u64),
    stats: &mut DistinctStats,
) -> Result<bool, SinkError> {
    let mut pending = Vec::new();
    for (sk, _) in helpers.iter().filter(|(_, s)| s.counted && !s.below_zero) {
        pending.push(Pending { helper: with_sort_key(t.key, sk), attribute: attribute.to_string(), at });
    }
    let records = futures::future::join_all(pending.iter().map(|p| super::expiry::record(store, p))).await;
    let mut all = true;
    for r in records {
        match r? {
            Some(capacity) => stats.write_capacity += capacity,
            None => all = false,
        }
    }
    Ok(all)
}

/// Settles the count at `count` and marks it walked where [`needs_settle`]: whether it is
/// settled (false: the derivation counter moved first).
async fn settle_if_needed<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    counters: &Counters,
    count: u64,
    stats: &mut DistinctStats,
) -> Result<bool, SinkError> {
    if !needs_settle(counters, t.name, count) {
        return Ok(true);
    }
    settle(store, t, counters, Settle::Count { value: count, mark: true }, stats).await
}

/// Sets the count and the attribute, on condition that the derivation counter is as read, or
/// removes the walked mark ([`Settle`]): whether it landed.
async fn settle<S: AggregateStore>(
    store: &S,
    t: &DistinctTarget<'_>,
    counters: &Counters,
    kind: Settle,
    stats: &mut DistinctStats,
) -> Result<bool, SinkError> {
    let (count_attr, walked, counter) =
        (format!("{}{}", t.names.counts, t.name), format!("{}{}", t.names.walked, t.name), format!("{}{}", t.names.counters, t.name));
    let w = SettleWrite {
        key: t.key,
        attribute: t.name,
        count: &count_attr,
        walked: &walked,
        counter: &counter,
        seen: counters.values.get(t.name).map(String::as_str),
        kind,
    };
    match store.settle_count(&w).await? {
        Some(capacity) => {
            stats.landed += 1;
            stats.write_capacity += capacity;
            Ok(true)
        }
        None => {
            stats.lost += 1;
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decimal::Decimal;
    use crate::sink::ledger::Ledger;
    use crate::sink::memory::{MemValue, MemoryAggregates};

    const DAYS: &str = "activeDays";

    fn day(d: u32) -> String {
        helper::Derive::Distinct.tail(&helper::Scalar::S(format!("2026-11-{d:02}")), None)
    }

    fn set_refs(store: &MemoryAggregates, d: u32, refs: i64) {
        let sk = format!("{}{}", helper::prefix("PROFILE", DAYS), day(d));
        store.put(&["CUST#c1", &sk], helper::REFS, MemValue::Num(Decimal::from_i64(refs)));
    }

    /// Derives the days after a batch that touched `touched` (None: reconcile, every helper).
    async fn derive(store: &MemoryAggregates, touched: Option<&[u32]>) -> DistinctStats {
        let touched = match touched {
            Some(days) => Touched::Helpers(days.iter().map(|d| day(*d)).collect()),
            None => Touched::Everything,
        };
        derive_as(store, touched).await
    }

    async fn derive_as(store: &MemoryAggregates, touched: Touched) -> DistinctStats {
        let names = Ledger::new("t").derivation_names();
        let key = [("PK".to_string(), "CUST#c1".to_string()), ("SK".to_string(), "PROFILE".to_string())];
        let key_names = ["PK".to_string(), "SK".to_string()];
        let t = DistinctTarget {
            key_names: &key_names,
            key: &key,
            pk: "CUST#c1",
            owner_sk: "PROFILE",
            names: &names,
            name: DAYS,
            touched: &touched,
            expiry: None,
        };
        let mut stats = DistinctStats::default();
        derive_distinct(store, &t, &mut stats).await.unwrap();
        stats
    }

    fn shown(store: &MemoryAggregates) -> Option<MemValue> {
        store.item(&["CUST#c1", "PROFILE"]).and_then(|i| i.get(DAYS).cloned())
    }

    fn n(v: i64) -> Option<MemValue> {
        Some(MemValue::Num(Decimal::from_i64(v)))
    }

    /// A target derived by protocol 5 (the days counted by a query, no flags): its first
    /// derivation walks every helper once, and from then on each reads the helpers it touched.
    #[tokio::test]
    async fn a_count_from_protocol_five_is_walked_once_then_moves_by_transitions() {
        let store = MemoryAggregates::new();
        for (d, refs) in [(1, 2), (2, 1), (3, 1), (4, 0)] {
            set_refs(&store, d, refs);
        }
        store.put(&["CUST#c1", "PROFILE"], DAYS, MemValue::Num(Decimal::from_i64(3)));
        store.put(&["CUST#c1", "PROFILE"], "_aggd:t:activeDays", MemValue::Num(Decimal::from_i64(7)));
        set_refs(&store, 5, 1);
        let walk = derive(&store, Some(&[5])).await;
        assert_eq!(walk.read, 10, "every helper, twice: once to flip the flags, once to settle");
        assert_eq!(shown(&store), n(4));
        let profile = store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert_eq!(profile.get("_aggn:t:activeDays"), n(4).as_ref());
        assert!(profile.contains_key("_aggw:t:activeDays"));
        // Walked: a batch that closes day 1 reads day 1 only.
        set_refs(&store, 1, 0);
        let one = derive(&store, Some(&[1])).await;
        assert_eq!((one.read, one.landed), (1, 1), "one helper read, one transaction");
        assert_eq!(shown(&store), n(3));
        // A batch that leaves day 2 live (its count moved, not its liveness) writes nothing.
        set_refs(&store, 2, 5);
        let none = derive(&store, Some(&[2])).await;
        assert_eq!((none.read, none.landed, none.lost), (1, 0, 0));
        for d in [2, 3, 5] {
            set_refs(&store, d, 0);
        }
        derive(&store, Some(&[2, 3, 5])).await;
        assert_eq!(shown(&store), None, "no day left: the attribute is removed, not 0");
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap().get("_aggn:t:activeDays"), n(0).as_ref());
    }

    /// A derivation that crashed after its helper writes: the next batch's derivation reads
    /// only its own helpers, and the replay of the crashed batch flips the one it left.
    #[tokio::test]
    async fn a_replayed_batch_flips_the_flags_its_crashed_derivation_left() {
        let store = MemoryAggregates::new();
        set_refs(&store, 1, 1);
        derive(&store, Some(&[1])).await;
        set_refs(&store, 2, 1);
        // Crash: day 2 is live, not counted. Another batch raises day 3.
        set_refs(&store, 3, 1);
        derive(&store, Some(&[3])).await;
        assert_eq!(shown(&store), n(2), "day 2 waits for its batch");
        derive(&store, Some(&[2])).await;
        assert_eq!(shown(&store), n(3));
        // Reconcile's walk finds nothing to change.
        let walk = derive(&store, None).await;
        assert_eq!((walk.read, walk.landed), (3, 0));
    }

    /// Reconcile removes the walked mark before it corrects a helper's count (which leaves
    /// the flag): if it stops before it derives, the next batch's derivation walks and flips it.
    #[tokio::test]
    async fn a_helper_reconcile_corrected_is_flipped_by_the_next_walk() {
        let store = MemoryAggregates::new();
        set_refs(&store, 1, 1);
        derive(&store, Some(&[1])).await;
        derive_as(&store, Touched::Unwalk).await;
        set_refs(&store, 1, 0);
        set_refs(&store, 2, 1);
        let next = derive(&store, Some(&[2])).await;
        assert_eq!(next.read, 4, "every helper, twice");
        assert_eq!(shown(&store), n(1), "day 2 only");
        let profile = store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert!(profile.contains_key("_aggw:t:activeDays"), "walked again");
        assert_eq!(derive(&store, Some(&[2])).await.read, 1, "and read as before");
        // No item, nothing to mark: the unwalk creates none.
        let empty = MemoryAggregates::new();
        derive_as(&empty, Touched::Unwalk).await;
        assert_eq!(empty.item(&["CUST#c1", "PROFILE"]), None);
    }

    /// Someone overwrote the count or the attribute: reconcile's walk sets both from the flags.
    #[tokio::test]
    async fn reconcile_sets_an_overwritten_count_and_attribute_from_the_flags() {
        let store = MemoryAggregates::new();
        for d in 1..=3 {
            set_refs(&store, d, 1);
        }
        derive(&store, Some(&[1, 2, 3])).await;
        store.put(&["CUST#c1", "PROFILE"], "_aggn:t:activeDays", MemValue::Str("x".into()));
        store.put(&["CUST#c1", "PROFILE"], DAYS, MemValue::Num(Decimal::from_i64(9)));
        derive(&store, None).await;
        assert_eq!(shown(&store), n(3));
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap().get("_aggn:t:activeDays"), n(3).as_ref());
        // A batch's derivation that reads a count that is not a number walks too.
        store.put(&["CUST#c1", "PROFILE"], "_aggn:t:activeDays", MemValue::Str("x".into()));
        set_refs(&store, 4, 1);
        derive(&store, Some(&[4])).await;
        assert_eq!(shown(&store), n(4));
    }

    fn s(live: bool, counted: bool) -> HelperState {
        HelperState { live, counted, below_zero: false }
    }

    #[test]
    fn flags_that_disagree_with_counts_are_flipped_and_move_the_count() {
        let states: std::collections::BTreeMap<String, HelperState> = [
            ("a".to_string(), s(true, true)),
            ("b".to_string(), s(true, false)),
            ("c".to_string(), s(false, true)),
            ("d".to_string(), s(false, false)),
            ("e".to_string(), s(true, false)),
        ]
        .into();
        let flips = mismatched(&states);
        assert_eq!(flips.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(), ["b", "c", "e"]);
        assert_eq!(delta(&flips), 1, "two raised, one cleared");
        assert_eq!(delta(&[]), 0);
    }

    fn counters(count: Option<&str>, walked: bool, shown: Option<&str>) -> Counters {
        let mut c = Counters::default();
        if let Some(n) = count {
            c.counts.insert("days".into(), n.into());
        }
        if walked {
            c.walked.insert("days".into());
        }
        if let Some(v) = shown {
            c.numbers.insert("days".into(), v.into());
        }
        c
    }

    #[test]
    fn a_settle_writes_only_where_the_walk_mark_the_count_or_the_attribute_is_off() {
        assert!(!needs_settle(&counters(Some("3"), true, Some("3")), "days", 3));
        assert!(!needs_settle(&counters(Some("3.0"), true, Some("3.00")), "days", 3), "compared as numbers");
        assert!(!needs_settle(&counters(Some("0"), true, None), "days", 0), "zero: the attribute is removed");
        assert!(!needs_settle(&counters(None, true, None), "days", 0), "an absent count is zero");
        assert!(needs_settle(&counters(Some("0"), true, Some("0")), "days", 0), "a count that fell to zero shows no 0");
        assert!(needs_settle(&counters(Some("3"), false, Some("3")), "days", 3), "never walked");
        assert!(needs_settle(&counters(Some("2"), true, Some("3")), "days", 3));
        assert!(needs_settle(&counters(Some("3"), true, Some("2")), "days", 3), "the attribute drifted");
        assert!(needs_settle(&counters(Some("3"), true, None), "days", 3));
        assert!(needs_settle(&counters(Some("x"), true, Some("3")), "days", 3), "a count that is not a number");
    }
}
