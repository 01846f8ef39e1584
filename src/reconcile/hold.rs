//! Correcting targets that are written all the time: reconcile's side of the hold protocol
//! checked in `model/src/hold.rs` (the writers' side: [`crate::sink::hold`]).
//!
//! The counter protocol ([`super::protocol`]) corrects a target only when its write counter
//! stays still from before the truth read until the correction. For targets still changing
//! after every round, a hold round:
//! 1. places a hold on each (its id and expiry), replacing only an expired one;
//! 2. reads the truth, keeping each source item's contribution to the held targets;
//! 3. waits until every record created before the truth read is applied;
//! 4. reads each target with its logs (what writers logged under the hold: per source item,
//!    its contribution after their write);
//! 5. corrects it to the logged contributions plus the truth of the items not logged,
//!    conditioned on the counter as read and on its own hold, removing hold and logs.
//!    A moved counter: read again (a few times). Hold gone: give up, reported as not quiet.
//!
//! An item not logged had no record applied since the hold: everything of it created before
//! the truth read was applied by step 3, and nothing after (that would have been logged).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;

use super::protocol::{corrections, drifts, fence_for, Consumer, Correction, Placement, Release, SourceItems, TargetItem, TargetStore};
use super::report::Report;
use super::{Options, ReconcileError};
use crate::decimal::{Decimal, DecimalError};
use crate::rules::{Rule, TargetKey};
use crate::sink::hold::{self as writers, decode, hold_value, parse};
use crate::state::now_ms;
use crate::telemetry::names;

/// Reads and corrections of one held target before it is given up (each a few milliseconds
/// apart, against writes a second or more apart).
pub const ATTEMPTS: usize = 10;
/// How long a hold outlives the wait for the readers: the truth read, the reads and
/// corrections after it. A hold that expires first is ended by the next write, and its target
/// is reported as not quiet. A round that gives up marks its holds expired at once.
pub const SLACK_MS: u64 = 60_000;
/// Log attributes a correction removes at most (writers keep an item at [`writers::MAX_LOGS`],
/// concurrent ones may pass it a little): with more, the target is given up.
pub const MAX_RELEASED_LOGS: usize = 2 * writers::MAX_LOGS;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    #[error("log attribute {0} does not hold a contribution")]
    BadLog(String),
    #[error("held value out of range: {0}")]
    Number(#[from] DecimalError),
}

/// Contributions of source items, by item id.
pub type ByItem = BTreeMap<Arc<str>, Vec<(String, Decimal)>>;

/// The items logged under the hold `id` among `logs` (attribute -> value): item id -> its
/// contribution. Logs of other holds are not this hold's.
pub fn own_logs(id: &str, logs: &BTreeMap<String, String>) -> Result<ByItem, HoldError> {
    let mut out = ByItem::new();
    for (name, value) in logs {
        let Some((head, item)) = name.rsplit_once(':') else { continue };
        if head.rsplit_once(':').is_none_or(|(_, h)| h != id) {
            continue;
        }
        let contribution = decode(value).ok_or_else(|| HoldError::BadLog(name.clone()))?;
        out.insert(Arc::from(item), contribution);
    }
    Ok(out)
}

/// What a held target should hold: each logged item's logged contribution, plus the truth of
/// every item that was not logged.
pub fn held_values(logged: &ByItem, truth: &ByItem) -> Result<BTreeMap<String, Decimal>, HoldError> {
    let mut want: BTreeMap<String, Decimal> = BTreeMap::new();
    let unlogged = truth.iter().filter(|(item, _)| !logged.contains_key(*item));
    for (_, values) in logged.iter().chain(unlogged) {
        for (name, v) in values {
            let sum = want.entry(name.clone()).or_insert(Decimal::ZERO);
            *sum = sum.checked_add(*v)?;
        }
    }
    Ok(want)
}

/// The correction writes of a held target read as `item`: those of the counter protocol for
/// `want`, the last one also conditioned on the hold and ending it (a write of its own when
/// nothing drifted).
pub fn held_corrections(
    rule: &Rule,
    key: &TargetKey,
    want: &BTreeMap<String, Decimal>,
    item: &TargetItem,
    hold: &str,
    fence: Option<&str>,
) -> (Vec<super::report::Drift>, Vec<Correction>) {
    let found = drifts(rule, key, want, item);
    let mut writes = corrections(&found, item, fence);
    let release = Release { hold: hold.to_string(), logs: item.logs.keys().cloned().collect() };
    match writes.last_mut() {
        Some(last) => last.release = Some(release),
        // Nothing drifted: the write that ends the hold also fences (a requested repair fences
        // every target it compares, and this one costs no extra write).
        None => writes.push(Correction {
            seen_version: item.version.clone(),
            set: Vec::new(),
            fence: fence.map(str::to_string),
            expect: Vec::new(),
            release: Some(release),
        }),
    }
    // The writes before the last need only the counter: a writer that logs or ends the hold
    // moves it too.
    (found, writes)
}

/// One hold round over `keys` of `rule`: the targets it could not correct. A target that
/// cannot be read or written is reported in `report.failed`; the others go on.
pub async fn hold_round<T: TargetStore, S: SourceItems, C: Consumer>(
    targets: &T,
    sources: &S,
    consumer: &C,
    rule: &Rule,
    keys: BTreeSet<TargetKey>,
    opts: &Options,
    report: &mut Report,
) -> Result<BTreeSet<TargetKey>, ReconcileError> {
    let id: String = std::iter::repeat_with(fastrand::alphanumeric).take(16).collect();
    let wait_ms = u64::try_from(opts.wait.as_millis()).unwrap_or(u64::MAX);
    let hold = hold_value(&id, now_ms().saturating_add(wait_ms).saturating_add(SLACK_MS));
    let placed: Vec<(TargetKey, Result<bool, ReconcileError>)> = futures::stream::iter(keys)
        .map(|key| {
            let hold = hold.clone();
            async move {
                let placed = place(targets, &key, hold).await;
                (key, placed)
            }
        })
        .buffer_unordered(super::protocol::CONCURRENCY)
        .collect()
        .await;
    let mut left = BTreeSet::new();
    let mut held = BTreeSet::new();
    for (key, placed) in placed {
        match placed {
            Ok(true) => {
                held.insert(key);
            }
            Ok(false) => {
                left.insert(key);
            }
            Err(e) => failed(rule, key, &e, report),
        }
    }
    if held.is_empty() {
        return Ok(left);
    }
    tracing::info!(rule = %rule.name, targets = held.len(), "correcting targets that keep changing under a hold");
    let (truth, applied) = match read_and_wait(sources, consumer, rule, &held, opts).await {
        Ok(read) => read,
        Err(e) => {
            for key in &held {
                release(targets, key, &id, &hold).await;
            }
            return Err(e);
        }
    };
    report.judged_by_empty_pages(&applied.by_empty_pages);
    let empty = ByItem::new();
    for key in held {
        let by_item = truth.by_item.get(&key).unwrap_or(&empty);
        match correct_held(targets, rule, &key, &id, &hold, by_item, applied.fence_ms).await {
            Ok(Some(found)) => report.drifts.extend(found),
            Ok(None) => {
                release(targets, &key, &id, &hold).await;
                left.insert(key);
            }
            Err(e) => {
                release(targets, &key, &id, &hold).await;
                failed(rule, key, &e, report);
            }
        }
    }
    Ok(left)
}

/// Steps 2 and 3: the truth of the held targets, by item, once the readers applied everything
/// created before it was read.
async fn read_and_wait<S: SourceItems, C: Consumer>(
    sources: &S,
    consumer: &C,
    rule: &Rule,
    held: &BTreeSet<TargetKey>,
    opts: &Options,
) -> Result<(super::truth::Truth, super::protocol::Applied), ReconcileError> {
    let truth = super::protocol::read_truth(sources, rule, Some(held), held, opts).await?;
    let applied = if opts.no_wait { Default::default() } else { consumer.applied_before(now_ms(), opts.wait).await? };
    Ok((truth, applied))
}

fn failed(rule: &Rule, key: TargetKey, e: &ReconcileError, report: &mut Report) {
    tracing::warn!(rule = %rule.name, target = ?key.0, error = %e, "cannot correct this target under a hold; the others go on");
    metrics::counter!(names::RECONCILE_FAILED_TARGETS, "rule" => rule.name.to_string()).increment(1);
    report.failed.push((rule.name.to_string(), key, e.to_string()));
}

/// A round that gives a target up marks its hold expired (when it still stands), so writers
/// stop logging and the next round may hold the target again. Best effort: a hold left
/// standing expires by itself.
async fn release<T: TargetStore>(targets: &T, key: &TargetKey, id: &str, hold: &str) {
    let expired = Placement { value: hold_value(id, 0), seen: Some(hold.to_string()), stale: Vec::new() };
    if let Err(e) = targets.hold(key, &expired).await {
        tracing::debug!(target = ?key.0, error = %e, "could not mark a hold expired; it expires by itself");
    }
}

/// Places `hold` on `key`, replacing an expired (or unreadable) hold, never a live one.
async fn place<T: TargetStore>(targets: &T, key: &TargetKey, hold: String) -> Result<bool, ReconcileError> {
    let item = targets.read(key).await?;
    let live = item.hold.as_deref().and_then(parse).is_some_and(|(_, expires)| expires > now_ms());
    if live || !item.exists {
        return Ok(false);
    }
    let stale = item.logs.keys().take(writers::MAX_LOGS).cloned().collect();
    targets.hold(key, &Placement { value: hold, seen: item.hold, stale }).await
}

/// Steps 4 and 5 for one held target: its drifts (corrected), or None when the hold is gone
/// or the target moved at every attempt.
async fn correct_held<T: TargetStore>(
    targets: &T,
    rule: &Rule,
    key: &TargetKey,
    id: &str,
    hold: &str,
    truth: &ByItem,
    fence_ms: Option<u64>,
) -> Result<Option<Vec<super::report::Drift>>, ReconcileError> {
    'attempt: for _ in 0..ATTEMPTS {
        let item = targets.read(key).await?;
        if item.hold.as_deref() != Some(hold) || item.logs.len() > MAX_RELEASED_LOGS {
            return Ok(None);
        }
        let logged = own_logs(id, &item.logs).map_err(|e| ReconcileError::Data(format!("held target {:?}: {e}", key.0)))?;
        let want = held_values(&logged, truth).map_err(|e| ReconcileError::Data(format!("held target {:?}: {e}", key.0)))?;
        let fence = fence_for(&item, fence_ms);
        let (mut found, writes) = held_corrections(rule, key, &want, &item, hold, fence.as_deref());
        if !writes.is_empty() {
            super::protocol::unwalk_owner(targets, rule, key).await?;
        }
        for w in &writes {
            if !targets.correct(key, w).await? {
                continue 'attempt;
            }
            metrics::counter!(names::RECONCILE_CORRECTIONS, "rule" => rule.name.to_string()).increment(w.set.len() as u64);
        }
        for d in found.iter_mut().filter(|d| !matches!(d.stored, super::report::Stored::Other(_))) {
            d.corrected = true;
        }
        if !found.is_empty() {
            metrics::counter!(names::RECONCILE_DRIFT, "rule" => rule.name.to_string()).increment(found.len() as u64);
            tracing::info!(rule = %rule.name, target = ?key.0, attributes = found.len(), "drift corrected under a hold");
        }
        return Ok(Some(found));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap()
    }

    fn by_item(items: &[(&str, &[(&str, &str)])]) -> ByItem {
        items.iter().map(|(i, vs)| (Arc::from(*i), vs.iter().map(|(n, v)| (n.to_string(), d(v))).collect())).collect()
    }

    #[test]
    fn a_held_target_is_what_was_logged_plus_the_truth_of_the_rest() {
        let logs: BTreeMap<String, String> = [
            ("_agglog:ns:h1:a".to_string(), r#"[["revenue","5"],["orders","1"]]"#.to_string()),
            ("_agglog:ns:h1:c".to_string(), "[]".to_string()),
            // A stray log of an older hold is not this hold's.
            ("_agglog:ns:h0:b".to_string(), r#"[["revenue","1000"]]"#.to_string()),
        ]
        .into();
        let logged = own_logs("h1", &logs).unwrap();
        assert_eq!(logged, by_item(&[("a", &[("revenue", "5"), ("orders", "1")]), ("c", &[])]));
        // The truth read saw a at 3 (updated to 5 since), b at 2, c at 4 (deleted since); d was
        // created after the truth read and logged.
        let truth = by_item(&[
            ("a", &[("revenue", "3"), ("orders", "1")]),
            ("b", &[("revenue", "2"), ("orders", "1")]),
            ("c", &[("revenue", "4"), ("orders", "1")]),
        ]);
        let want = held_values(&logged, &truth).unwrap();
        assert_eq!(want, [("orders".to_string(), d("2")), ("revenue".to_string(), d("7"))].into());
        let mut with_d = logged.clone();
        with_d.insert(Arc::from("d"), vec![("revenue".to_string(), d("0.5")), ("orders".to_string(), d("1"))]);
        assert_eq!(held_values(&with_d, &truth).unwrap()["revenue"], d("7.5"));
        let bad: BTreeMap<String, String> = [("_agglog:ns:h1:a".to_string(), "five".to_string())].into();
        assert_eq!(own_logs("h1", &bad), Err(HoldError::BadLog("_agglog:ns:h1:a".into())));
    }
}
