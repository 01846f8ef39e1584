//! The idempotency ledger kept on every target item (pure).
//!
//! For each stream shard that has written to an item, the item holds one attribute
//! `_agg:<shard>` = `<highest applied sequence number, 40 digits>@<newest record time>`. A write
//! adds the coalesced deltas and advances the entry in one conditional UpdateItem, on condition
//! that the entry is absent or below the write's first sequence number; so a replayed record
//! is never applied twice, whichever replica replays it. Sequence numbers increase within a
//! shard and are at most 40 digits, so zero-padding makes string order numeric order.
//!
//! The item can also carry `_aggfloor`, the creation time (epoch ms, 20 digits) below which
//! shards are finished and their entries pruned: a write from a shard created before the floor
//! is refused, so a stalled former owner cannot re-apply records whose entry was pruned.

use crate::decimal::{Decimal, DecimalError};
use crate::rules::Contribution;

/// Prefix of ledger entry attributes (inside the reserved `_agg` namespace).
pub const ENTRY_PREFIX: &str = "_agg:";
pub const FLOOR_ATTRIBUTE: &str = "_aggfloor";
/// DynamoDB Streams sequence numbers are 21 to 40 digits.
pub const SEQUENCE_WIDTH: usize = 40;

/// `_agg:<shard id without the shardId- prefix>`.
pub fn entry_name(shard_id: &str) -> String {
    format!("{ENTRY_PREFIX}{}", shard_id.strip_prefix("shardId-").unwrap_or(shard_id))
}

/// A sequence number zero-padded to 40 digits; None if it is not 1 to 40 digits.
pub fn pad_sequence(seq: &str) -> Option<String> {
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = seq.trim_start_matches('0');
    (trimmed.len() <= SEQUENCE_WIDTH).then(|| format!("{trimmed:0>SEQUENCE_WIDTH$}"))
}

/// The creation time (epoch ms) of the shard an entry belongs to, from its name.
pub fn entry_created_ms(name: &str) -> Option<u64> {
    let id = name.strip_prefix(ENTRY_PREFIX)?;
    crate::stream::shard_created_ms(&format!("shardId-{id}"))
}

/// The stored entry: padded last sequence number, then `@` and the newest record time.
pub fn entry_value(last_padded: &str, newest_created: Option<Decimal>) -> String {
    match newest_created.and_then(Decimal::trunc_i64) {
        Some(t) => format!("{last_padded}@{t}"),
        None => last_padded.to_string(),
    }
}

/// The padded sequence number of a stored entry.
pub fn entry_sequence(value: &str) -> &str {
    value.split('@').next().unwrap_or(value)
}

/// The record time of a stored entry (epoch seconds).
pub fn entry_time(value: &str) -> Option<i64> {
    value.split_once('@').and_then(|(_, t)| t.parse().ok())
}

/// The floor attribute's value for a shard creation time.
pub fn floor_value(created_ms: u64) -> String {
    format!("{created_ms:020}")
}

/// What one conditional write carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// Non-zero summed deltas, by attribute.
    pub adds: Vec<(String, Decimal)>,
    pub first: String,
    pub last: String,
    pub newest_created: Option<Decimal>,
    pub records: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("record without a usable sequence number")]
    NoSequence,
    #[error(transparent)]
    Number(#[from] DecimalError),
}

/// Sums the contributions after `applied` (a padded sequence number, or None for all).
/// None when every contribution is applied already. Records that cancel out still give a
/// plan (with no adds): its write advances the ledger, so a replica that applied only some
/// of them cannot leave their sum half applied.
pub fn plan(contributions: &[Contribution], applied: Option<&str>) -> Result<Option<WritePlan>, PlanError> {
    let mut adds: Vec<(String, Decimal)> = Vec::new();
    let (mut first, mut last): (Option<String>, Option<String>) = (None, None);
    let mut newest: Option<Decimal> = None;
    let mut records = 0;
    for c in contributions {
        let seq = c.sequence.as_deref().and_then(pad_sequence).ok_or(PlanError::NoSequence)?;
        if applied.is_some_and(|a| seq.as_str() <= a) {
            continue;
        }
        records += 1;
        for (name, v) in &c.values {
            match adds.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => *sum = sum.checked_add(*v)?,
                None => adds.push((name.clone(), *v)),
            }
        }
        if first.as_ref().is_none_or(|f| seq < *f) {
            first = Some(seq.clone());
        }
        if last.as_ref().is_none_or(|l| seq > *l) {
            last = Some(seq);
        }
        if let Some(t) = c.created {
            if newest.is_none_or(|n| t > n) {
                newest = Some(t);
            }
        }
    }
    adds.retain(|(_, v)| !v.is_zero());
    adds.sort_by(|a, b| a.0.cmp(&b.0));
    match (first, last) {
        (Some(first), Some(last)) => Ok(Some(WritePlan { adds, first, last, newest_created: newest, records })),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(seq: &str, values: &[(&str, &str)]) -> Contribution {
        Contribution {
            sequence: Some(seq.into()),
            rule: None,
            created: Some(Decimal::from_i64(1_764_460_800)),
            values: values.iter().map(|(n, v)| (n.to_string(), Decimal::parse(v).unwrap())).collect(),
        }
    }

    #[test]
    fn padding_orders_like_numbers() {
        let a = pad_sequence("9").unwrap();
        let b = pad_sequence("000000000000000000010").unwrap();
        assert_eq!(a.len(), 40);
        assert!(a < b);
        assert_eq!(pad_sequence(&"1".repeat(40)).unwrap(), "1".repeat(40));
        assert_eq!(pad_sequence(&"1".repeat(41)), None);
        assert_eq!(pad_sequence("12a"), None);
        assert_eq!(pad_sequence(""), None);
    }

    #[test]
    fn plans_skip_applied_records() {
        let cs = [c("10", &[("n", "1"), ("rev", "2.5")]), c("11", &[("n", "1")]), c("12", &[("rev", "-2.5")])];
        let all = plan(&cs, None).unwrap().unwrap();
        assert_eq!(all.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=2"]);
        assert_eq!(all.first, pad_sequence("10").unwrap());
        assert_eq!(all.last, pad_sequence("12").unwrap());
        assert_eq!(all.records, 3);
        let rest = plan(&cs, Some(&pad_sequence("10").unwrap())).unwrap().unwrap();
        assert_eq!(rest.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=1", "rev=-2.5"]);
        assert_eq!(rest.first, pad_sequence("11").unwrap());
        assert_eq!(plan(&cs, Some(&pad_sequence("12").unwrap())).unwrap(), None);
        let v = entry_value(&all.last, all.newest_created);
        assert_eq!(entry_sequence(&v), all.last);
        assert_eq!(entry_time(&v), Some(1_764_460_800));
        assert_eq!(entry_name("shardId-00000001796001337266-8e340a17"), "_agg:00000001796001337266-8e340a17");
    }

    #[test]
    fn records_that_cancel_out_still_advance_the_ledger() {
        // An order inserted, re-priced and deleted: the sums are zero, but a replica may have
        // applied the insert alone; the write must still go out to find that out.
        let cs = [c("10", &[("n", "1"), ("rev", "448.3")]), c("11", &[("rev", "-194.86")]), c("12", &[("n", "-1"), ("rev", "-253.44")])];
        let p = plan(&cs, None).unwrap().unwrap();
        assert!(p.adds.is_empty());
        assert_eq!((p.first, p.last, p.records), (pad_sequence("10").unwrap(), pad_sequence("12").unwrap(), 3));
        let rest = plan(&cs, Some(&pad_sequence("10").unwrap())).unwrap().unwrap();
        assert_eq!(rest.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=-1", "rev=-448.3"]);
    }
}
