//! Zero-count helper items leave the table through its TTL attribute.
//!
//! A helper ([`crate::rules::helper`]) whose count reaches zero gets an expiry `EXPIRE_AFTER`
//! ahead, set by a write conditioned on the count still being zero; a write that raises the
//! count removes the expiry in the same UpdateItem. DynamoDB deletes an item at some time after
//! its expiry (typically within two days), honours an update that removes the expiry before
//! that, and never deletes an item whose expiry lies ahead.
//!
//! Why no record is counted twice although the deleted helper took its ledger with it:
//! - Every record R whose delta a helper holds was created before the helper last reached zero,
//!   so before the expiry was set at `t_e`: the helper is deleted at or after `t_e + EXPIRE_AFTER`.
//! - A helper write is sent only while the oldest record of its batch is younger than
//!   `WRITE_AGE_LIMIT` ([`may_write_helpers`], checked before each helper write). The stream
//!   keeps records for 24 hours, so only a batch stuck for hours is older: its helper writes
//!   are left out and a reconcile of everything is requested. Any write of R therefore reaches
//!   DynamoDB before `R.created + WRITE_AGE_LIMIT + P`, where P, the time from that check to
//!   the request's arrival (a process paused in between), is assumed below
//!   `EXPIRE_AFTER - WRITE_AGE_LIMIT` (4 hours), and the local clock within minutes of AWS's.
//! - So a replay of R reaches the helper before `t_e + EXPIRE_AFTER`: the helper, and the ledger
//!   entry that refuses the replay, are still there. A helper written after its deletion is new:
//!   it counts only records it never held.
//! - A write that raises the count removes the expiry; an expiry is set only while the count is
//!   zero and no write has touched the helper since it was seen at zero (the write's
//!   condition). So a helper with a live reference is never deleted. The attribute is
//!   configured (`aggregates.helper_expiry_attribute`), so every process that writes helpers
//!   (the service, reconcile and its own consumer) removes it on every helper write, whether
//!   or not it may set expiries (only while DescribeTimeToLive says TTL is enabled on it).

use crate::decimal::Decimal;
use crate::rules::helper::REFS;
use crate::rules::TargetKey;

const HOUR_MS: u64 = 3_600_000;
/// How long after its count reached zero a helper item expires.
pub const EXPIRE_AFTER_MS: u64 = 40 * HOUR_MS;
/// Records older than this are not written to helper items ([`may_write_helpers`]).
pub const WRITE_AGE_LIMIT_MS: u64 = 36 * HOUR_MS;

/// How often a running service reads the table's TTL settings again.
pub const REFRESH_MS: u64 = 60_000;

/// The aggregates table's TTL attribute (`aggregates.helper_expiry_attribute`), where helper
/// expiries go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    pub attribute: String,
    /// How long after its count reached zero a helper expires: [`EXPIRE_AFTER_MS`] (a test
    /// shortens it to show that expiring too early double-counts).
    pub after_ms: u64,
    /// Whether this process sets expiries (TTL is enabled on the attribute); every process
    /// removes them.
    pub set: bool,
}

impl Expiry {
    /// Sets and removes expiries in `attribute`.
    pub fn new(attribute: &str) -> Expiry {
        Expiry { attribute: attribute.to_string(), after_ms: EXPIRE_AFTER_MS, set: true }
    }

    /// The expiry, in epoch seconds (the TTL attribute's unit), of a helper found at zero at `now_ms`.
    pub fn at(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.after_ms) / 1000
    }
}

/// What DescribeTimeToLive said of the aggregates table: expiries are set only while TTL is
/// enabled on the configured attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Described {
    /// TTL on (`enabled`) or being turned on, on this attribute.
    On { attribute: String, enabled: bool },
    /// TTL off, or being turned off.
    Off,
    /// The call failed.
    Failed,
}

/// A helper write's part in expiry: the TTL attribute, which the write removes. Every write
/// removes it, whatever it adds: one that leaves the count at zero has it set again after
/// ([`due`]), so a live helper never keeps one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiryWrite {
    pub attribute: String,
}

/// What a write saw of a helper item: its count, whether it carries an expiry, and its write
/// counter (the expiry is set only if no write came since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelperSeen {
    pub refs: Decimal,
    pub expiring: bool,
    pub version: Option<String>,
}

/// Whether a helper seen as `seen` after a write (or a refused replay) is to get its expiry
/// now: its count is zero and it has none.
pub fn due(seen: Option<&HelperSeen>) -> bool {
    seen.is_some_and(|s| s.refs.is_zero() && !s.expiring)
}

/// Whether a batch whose oldest record was created at `oldest_ms` may write helper items at
/// `now_ms`. Records without a creation time (none come from DynamoDB Streams) do not hold
/// a batch back.
pub fn may_write_helpers(oldest_ms: Option<u64>, now_ms: u64) -> bool {
    oldest_ms.is_none_or(|o| now_ms.saturating_sub(o) <= WRITE_AGE_LIMIT_MS)
}

/// What a reconcile correction does to a helper item's expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpiryChange<'a> {
    Set { attribute: &'a str, at: u64 },
    Remove { attribute: &'a str },
}

/// The expiry part of a correction that sets `set` on the item `key` at `now_ms`: a helper
/// set to zero expires (if this process sets expiries), one set above zero loses any expiry.
/// None: not a helper, no TTL, or the correction leaves the count alone.
pub fn after_correction<'a>(
    expiry: Option<&'a Expiry>,
    key: &TargetKey,
    set: &[(String, Decimal)],
    now_ms: u64,
) -> Option<ExpiryChange<'a>> {
    let e = expiry.filter(|_| super::is_helper(key))?;
    let attribute = e.attribute.as_str();
    let (_, refs) = set.iter().find(|(name, _)| name == REFS)?;
    match refs.is_zero() {
        true if e.set => Some(ExpiryChange::Set { attribute, at: e.at(now_ms) }),
        true => None,
        false => Some(ExpiryChange::Remove { attribute }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(refs: i64, expiring: bool) -> Option<HelperSeen> {
        Some(HelperSeen { refs: Decimal::from_i64(refs), expiring, version: Some("3".into()) })
    }

    #[test]
    fn only_a_helper_at_zero_without_an_expiry_gets_one() {
        assert!(due(seen(0, false).as_ref()));
        assert!(!due(seen(0, true).as_ref()), "already expiring");
        assert!(!due(seen(1, false).as_ref()), "still referenced");
        assert!(!due(seen(-1, false).as_ref()), "below zero is a drift for reconcile, not an expiry");
        assert!(!due(None), "not a helper, or a store without TTL");
    }

    #[test]
    fn expiry_is_within_two_days_and_past_the_write_age_limit() {
        let now = 1_764_547_200_000;
        let at = Expiry::new("ttl").at(now);
        assert_eq!(at, (now + 40 * HOUR_MS) / 1000);
        assert!(at * 1000 <= now + 48 * HOUR_MS);
        const { assert!(EXPIRE_AFTER_MS - WRITE_AGE_LIMIT_MS >= 4 * HOUR_MS, "the margin for a paused writer") };
        const { assert!(WRITE_AGE_LIMIT_MS > 24 * HOUR_MS, "a record the stream still holds is always written") };
    }

    #[test]
    fn a_correction_expires_a_helper_it_zeroes_and_keeps_one_it_raises() {
        let e = Expiry::new("ttl");
        let helper = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE#_agg#largest#N5")].into());
        let target = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into());
        let refs = |n: i64| vec![(REFS.to_string(), Decimal::from_i64(n))];
        let now = 1_764_547_200_000;
        assert_eq!(after_correction(Some(&e), &helper, &refs(0), now), Some(ExpiryChange::Set { attribute: "ttl", at: e.at(now) }));
        assert_eq!(after_correction(Some(&e), &helper, &refs(2), now), Some(ExpiryChange::Remove { attribute: "ttl" }));
        assert_eq!(after_correction(None, &helper, &refs(0), now), None, "no TTL");
        let removing = Expiry { set: false, ..e.clone() };
        assert_eq!(after_correction(Some(&removing), &helper, &refs(0), now), None, "this process sets none");
        assert_eq!(after_correction(Some(&removing), &helper, &refs(1), now), Some(ExpiryChange::Remove { attribute: "ttl" }));
        assert_eq!(after_correction(Some(&e), &target, &refs(0), now), None, "not a helper");
        assert_eq!(after_correction(Some(&e), &helper, &[("other".into(), Decimal::ZERO)], now), None, "count untouched");
    }

    #[test]
    fn old_batches_write_no_helpers() {
        let now = 10 * WRITE_AGE_LIMIT_MS;
        assert!(may_write_helpers(Some(now - 24 * HOUR_MS), now));
        assert!(may_write_helpers(Some(now - WRITE_AGE_LIMIT_MS), now));
        assert!(!may_write_helpers(Some(now - WRITE_AGE_LIMIT_MS - 1), now));
        assert!(may_write_helpers(Some(now + 5_000), now), "a clock behind the stream's");
        assert!(may_write_helpers(None, now));
    }
}
