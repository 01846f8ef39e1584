//! The writers' side of a reconcile hold (pure), as checked in `model/src/hold.rs`.
//!
//! The counter protocol corrects a target only when no write lands between reconcile's truth
//! read and its correction, which a target written every second never allows. Reconcile can
//! instead put a hold on the item (`_agghold:<namespace>` = `<hold id>:<expiry, epoch ms>`).
//! Every ledger write is conditioned on there being no hold. A write refused by one is redone:
//! - under a live hold, conditioned on that very hold, also setting one log attribute per
//!   source item the write applies: what the item contributes to the target after its last
//!   record in the write ([`crate::rules::Contribution::after`]);
//! - over an expired hold (its owner crashed or was too slow), or one that would need more
//!   log attributes than [`MAX_LOGS`], removing the hold and every log attribute, so that the
//!   owner's correction, conditioned on its hold, fails and is tried again later.
//!
//! Reconcile then sets the target to the sum of the logged contributions plus the truth of
//! the items not logged: an item that was not logged had no record applied since the hold.

use std::sync::Arc;

use crate::decimal::Decimal;
use crate::sink::ledger::Ledger;

/// Log attributes an item holds at most: more would cost a large item on every write of a
/// busy target, so a write that would go past it ends the hold instead.
pub const MAX_LOGS: usize = 100;

/// One source item's contribution to a target after a write: (item id, attribute -> value).
pub type Logged = (Arc<str>, Vec<(String, Decimal)>);

/// A hold found on an item by a refused write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldSeen {
    /// The hold attribute's value, as stored.
    pub value: String,
    /// The item's log attributes of this namespace (of any hold).
    pub logs: Vec<String>,
}

/// What a ledger write does about holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum HoldWrite {
    /// Conditioned on there being no hold.
    #[default]
    Absent,
    /// Conditioned on the hold `seen`; sets each (log attribute, contribution).
    Log { seen: String, logs: Vec<(String, String)> },
    /// Conditioned on the hold `seen`; removes it and the log attributes `remove`.
    Clear { seen: String, remove: Vec<String> },
}

impl HoldWrite {
    /// The hold this write is conditioned on (None: on there being none).
    pub fn seen(&self) -> Option<&str> {
        match self {
            HoldWrite::Absent => None,
            HoldWrite::Log { seen, .. } | HoldWrite::Clear { seen, .. } => Some(seen),
        }
    }
}

/// A hold's value: its id and when it expires.
pub fn hold_value(id: &str, expires_ms: u64) -> String {
    format!("{id}:{expires_ms}")
}

/// (id, expiry) of a hold's value; None for a value this release did not write.
pub fn parse(value: &str) -> Option<(&str, u64)> {
    let (id, expires) = value.rsplit_once(':')?;
    let ok = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    Some((id, expires.parse().ok()?)).filter(|_| ok)
}

/// The log attribute of `item` under the hold `id`.
pub fn log_name(ledger: &Ledger, id: &str, item: &str) -> String {
    format!("{}{id}:{item}", ledger.log_prefix())
}

/// A contribution as a log attribute's value: `[["orderCount","1"],["revenue","12.5"]]`.
pub fn encode(values: &[(String, Decimal)]) -> String {
    let pairs: Vec<(&str, String)> = values.iter().map(|(n, v)| (n.as_str(), v.to_string())).collect();
    serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".into())
}

/// A log attribute's value back as a contribution; None if it is not one.
pub fn decode(text: &str) -> Option<Vec<(String, Decimal)>> {
    let pairs: Vec<(String, String)> = serde_json::from_str(text).ok()?;
    pairs.into_iter().map(|(n, v)| Some((n, Decimal::parse(&v).ok()?))).collect()
}

/// What a write refused by the hold `seen` does next, at `now_ms`: log `logs` (per source
/// item, its contribution after the write) under a live hold, or end the hold. `unidentified`:
/// the write applies a record whose source item has no id, which cannot be logged.
pub fn decide(seen: &HoldSeen, now_ms: u64, ledger: &Ledger, logs: &[Logged], unidentified: bool) -> HoldWrite {
    let clear = || HoldWrite::Clear { seen: seen.value.clone(), remove: seen.logs.iter().take(MAX_LOGS).cloned().collect() };
    let Some((id, expires_ms)) = parse(&seen.value) else { return clear() };
    if expires_ms <= now_ms || unidentified {
        return clear();
    }
    let logs: Vec<(String, String)> = logs.iter().map(|(item, after)| (log_name(ledger, id, item), encode(after))).collect();
    let added = logs.iter().filter(|(n, _)| !seen.logs.contains(n)).count();
    if seen.logs.len() + added > MAX_LOGS {
        return clear();
    }
    HoldWrite::Log { seen: seen.value.clone(), logs }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap()
    }

    fn logs(items: &[(&str, &[(&str, &str)])]) -> Vec<Logged> {
        items.iter().map(|(i, vs)| (Arc::from(*i), vs.iter().map(|(n, v)| (n.to_string(), d(v))).collect())).collect()
    }

    #[test]
    fn a_live_hold_is_logged_per_item_under_its_id() {
        let ledger = Ledger::new("ns");
        let seen = HoldSeen { value: hold_value("h1", 2_000), logs: vec![] };
        let w = decide(&seen, 1_999, &ledger, &logs(&[("aa", &[("orderCount", "1"), ("revenue", "12.50")]), ("bb", &[])]), false);
        assert_eq!(
            w,
            HoldWrite::Log {
                seen: "h1:2000".into(),
                logs: vec![
                    ("_agglog:ns:h1:aa".into(), r#"[["orderCount","1"],["revenue","12.5"]]"#.into()),
                    ("_agglog:ns:h1:bb".into(), "[]".into()),
                ]
            }
        );
        assert!(ledger.is_own("_agglog:ns:h1:aa") && ledger.is_own("_agghold:ns") && !ledger.is_own("_agghold:other"));
    }

    #[test]
    fn an_expired_unreadable_or_full_hold_is_ended_with_its_logs() {
        let ledger = Ledger::new("ns");
        let old = vec!["_agglog:ns:h0:aa".to_string()];
        let seen = HoldSeen { value: hold_value("h1", 2_000), logs: old.clone() };
        let one = logs(&[("aa", &[("n", "1")])]);
        let clear = HoldWrite::Clear { seen: "h1:2000".into(), remove: old.clone() };
        assert_eq!(decide(&seen, 2_000, &ledger, &one, false), clear, "expired at its expiry");
        assert_eq!(decide(&seen, 1_000, &ledger, &one, true), clear, "a record without an item id cannot be logged");
        let odd = HoldSeen { value: "not a hold".into(), logs: old.clone() };
        assert_eq!(decide(&odd, 1_000, &ledger, &one, false), HoldWrite::Clear { seen: "not a hold".into(), remove: old });
        // 99 logged items: one more fits, two do not.
        let full = HoldSeen { value: hold_value("h1", 2_000), logs: (0..99).map(|i| log_name(&ledger, "h1", &format!("i{i}"))).collect() };
        assert!(matches!(decide(&full, 1_000, &ledger, &logs(&[("i0", &[]), ("new", &[])]), false), HoldWrite::Log { .. }));
        assert!(matches!(decide(&full, 1_000, &ledger, &logs(&[("new1", &[]), ("new2", &[])]), false), HoldWrite::Clear { .. }));
    }

    #[test]
    fn values_parse_back() {
        assert_eq!(parse("h-1:123"), Some(("h-1", 123)));
        assert_eq!(parse(":123"), None);
        assert_eq!(parse("h1:soon"), None);
        assert_eq!(parse("a:b:1"), None, "ids are letters, digits and '-'");
        let v = vec![("orders_{x}".to_string(), d("-0.001")), ("n".to_string(), d("1"))];
        assert_eq!(decode(&encode(&v)), Some(v));
        assert_eq!(decode("[]"), Some(vec![]));
        assert_eq!(decode(r#"[["n","x"]]"#), None);
    }
}
