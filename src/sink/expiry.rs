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
//!   condition). So a helper with a live reference is never deleted.
//! - `distinct`'s transition ([`super::distinct`]) sets the expiry as it clears the helper's
//!   flag, on condition of the flag and a zero count, not of the write counter: the helper may
//!   have been raised and lowered again since the derivation read it. So each transaction takes
//!   `t_e` from its own time, just before it is recorded and sent: a record applied before that
//!   was created before `t_e`. One applied while this process is paused between the two was
//!   created at most that pause after `t_e`: the 4 hours of margin cover that pause and P
//!   together. (Conditioning on the write counter would close it; helpers written by two
//!   deployments carry one counter each, so the flag and count stand in for it.) The attribute is
//!   configured (`aggregates.helper_expiry_attribute`), so every process that writes helpers
//!   (the service, reconcile and its own consumer) removes it on every helper write, whether
//!   or not it may set expiries (only while DescribeTimeToLive says TTL is enabled on it).
//!
//! Where the table's TTL is not on that attribute, the service deletes expired helpers itself
//! ([`Expiry::own`]), and the argument above holds as it stands, since its delete is narrower
//! than TTL's:
//! - Before an expiry `at` is set, a pending item ([`pending_key`]) naming the helper and `at`
//!   is put in the aggregates table, under a reserved partition key. Put first: a crash
//!   between the two leaves a pending item whose helper has no such expiry, which the sweep
//!   drops; never an expiry nobody will act on.
//! - The sweep ([`sweep`]) reads the pending items whose `at` lies an hour ([`SWEEP_GRACE_S`])
//!   behind its clock and deletes each helper only if it still carries that same `at`, its
//!   count is zero and no `distinct` target counts it. Every helper write removes the expiry,
//!   so a helper written since is kept. TTL deletes on the expiry alone; this delete also
//!   checks the count, and the hour covers a sweeping host's clock running ahead of the one
//!   that set `at`.
//! - Pending items are items of the table, so they outlive a restart, and the next sweep
//!   (whichever replica holds its lease) finds them.

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

/// How often the service sweeps the helpers it deletes itself ([`sweep`]).
pub const SWEEP_MS: u64 = 10 * 60_000;
/// The named lease in the state table of the replica that sweeps.
pub const SWEEP_LEASE: &str = "helper-expiry-sweep";
/// A helper is deleted this long after its expiry at the earliest, so a sweeping host whose
/// clock runs ahead of the one that set the expiry (by up to this) deletes no earlier than
/// the argument above allows.
pub const SWEEP_GRACE_S: u64 = 3_600;
/// Deletes a sweep keeps in flight per partition.
pub const SWEEP_CONCURRENCY: usize = 8;
/// Pending items a sweep reads at most, per partition of them and round.
pub const SWEEP_PAGE: usize = 100;
/// The pending items' partitions: a helper's is fixed by its key ([`pending_key`]). Writes of
/// many expiries at once spread over them; a sweep reads each. Changing it strands the
/// pending items of the partitions dropped.
pub const PENDING_PARTITIONS: u8 = 16;
/// The pending items' partition keys begin with this: a helper's marker, so no template
/// produces it ([`crate::rules::helper::MARK`]) and the loop check covers it.
pub const PENDING_PREFIX: &str = "#_agg#expiring#";
/// A pending item's attribute holding the helper's key values, partition key first.
pub const PENDING_HELPER: &str = "helper_key";

/// The aggregates table's TTL attribute (`aggregates.helper_expiry_attribute`), where helper
/// expiries go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    pub attribute: String,
    /// How long after its count reached zero a helper expires: [`EXPIRE_AFTER_MS`] (a test
    /// shortens it to show that expiring too early double-counts).
    pub after_ms: u64,
    /// Whether this process sets expiries; every process removes them.
    pub set: bool,
    /// Whether the service deletes expired helpers itself (the table's TTL is not on the
    /// attribute): each expiry it sets is first recorded as pending ([`pending_key`]).
    pub own: bool,
}

impl Expiry {
    /// Sets and removes expiries in `attribute`, and leaves the deletes to the table's TTL.
    pub fn new(attribute: &str) -> Expiry {
        Expiry { attribute: attribute.to_string(), after_ms: EXPIRE_AFTER_MS, set: true, own: false }
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

/// How the service expires helpers, from what DescribeTimeToLive said: `Some(own)` (expiries
/// are set; `own`: the service deletes them itself), or None when the call failed (keep what
/// was decided before; at start, set none).
pub fn setting(described: &Described, configured: &str) -> Option<bool> {
    match described {
        Described::On { attribute, enabled: true } if attribute == configured => Some(false),
        // Being turned on, on another attribute, or off: TTL will not delete them (yet).
        Described::On { .. } | Described::Off => Some(true),
        Described::Failed => None,
    }
}

/// A helper whose expiry the service is to delete itself: its key (names and values,
/// partition key first) and the expiry it was given (epoch seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub helper: Vec<(String, String)>,
    /// The attribute holding the expiry ([`Expiry::attribute`]).
    pub attribute: String,
    pub at: u64,
}

/// Which pending expiries a sweep reads: those of `attribute` in one partition, due at
/// `due_s` (their expiry at or before it), oldest first, at most `limit`.
#[derive(Debug, Clone)]
pub struct DueQuery<'a> {
    /// The table's key attributes.
    pub key_names: &'a [String],
    pub attribute: &'a str,
    pub partition: u8,
    pub due_s: u64,
    pub limit: usize,
}

/// The partition key of the pending items of `attribute` in `partition`: another expiry
/// attribute (another deployment on the table, or a changed key) has partitions of its own.
pub fn pending_partition(attribute: &str, partition: u8) -> String {
    format!("{PENDING_PREFIX}{attribute}#{partition}")
}

/// The key values of the pending item of `p`: the partition
/// `#_agg#expiring#<attribute>#<n>` ([`pending_partition`]), `n` from a hash of the helper's
/// key, and the sort key `<at, 12 digits>#<hash>`, so a partition reads in order of expiry and
/// a helper expiring twice at once has one item.
pub fn pending_key(p: &Pending) -> (String, String) {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (_, v) in &p.helper {
        h.update(v.as_bytes());
        h.update([0u8]);
    }
    let digest = h.finalize();
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let partition = digest.first().map_or(0, |b| b % PENDING_PARTITIONS);
    (pending_partition(&p.attribute, partition), format!("{:012}#{hex}", p.at))
}

/// The sort-key bound of pending items due at `due_s` (expiry at or before it): those whose
/// key sorts below it.
pub fn due_before(due_s: u64) -> String {
    format!("{:012}", due_s.saturating_add(1))
}

/// The expiry in a pending item's sort key.
pub fn pending_at(sort_key: &str) -> Option<u64> {
    sort_key.split_once('#').and_then(|(at, _)| at.parse().ok())
}

/// Records `p` before its expiry is set: the write capacity it consumed, or None when the
/// table refused it for good (say the role lacks `dynamodb:PutItem` on the aggregates table
/// after an upgrade): then no expiry is set and the helper stays, as without TTL before, and
/// the first refusal is logged. Transient errors are retried, then returned.
pub async fn record<S: crate::sink::AggregateStore>(store: &S, p: &Pending) -> Result<Option<f64>, crate::sink::SinkError> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match crate::sink::retrying(|| store.register_expiry(p)).await {
        Ok(capacity) => Ok(Some(capacity)),
        Err(e) if e.is_retriable() => Err(e),
        Err(e) => {
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(error = %e, "recording a helper item's expiry failed (it needs dynamodb:PutItem and dynamodb:DeleteItem on the aggregates table): helpers at zero are left without an expiry");
            }
            Ok(None)
        }
    }
}

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Helpers deleted.
    pub deleted: u64,
    /// Pending items whose helper was written since, or is gone: dropped, the helper kept.
    pub kept: u64,
    /// Whether a partition had more due than one round reads.
    pub more: bool,
    /// The oldest expiry found due (epoch seconds): how far the sweep is behind.
    pub oldest_due: Option<u64>,
    /// Deletes that failed after their retries (tried again next sweep), and partitions of
    /// pending items that could not be read; the first error.
    pub failed: u64,
    pub unread: u64,
    pub error: Option<String>,
}

/// Deletes the helpers of `attribute` whose recorded expiry lies [`SWEEP_GRACE_S`] before
/// `now_s`, each only if it still carries that expiry at zero
/// ([`crate::sink::AggregateStore::remove_expired`]). Reads at most [`SWEEP_PAGE`] pending
/// items per partition, the partitions side by side and [`SWEEP_CONCURRENCY`] deletes at once
/// in each. Each call is retried ([`crate::sink::retrying`]); one that still fails is counted
/// and the others go on. An error only when no partition could be read.
pub async fn sweep<S: crate::sink::AggregateStore>(
    store: &S,
    key_names: &[String],
    attribute: &str,
    now_s: u64,
) -> Result<Swept, crate::sink::SinkError> {
    let due_s = now_s.saturating_sub(SWEEP_GRACE_S);
    let rounds = (0..PENDING_PARTITIONS).map(|partition| {
        let q = DueQuery { key_names, attribute, partition, due_s, limit: SWEEP_PAGE };
        async move { sweep_partition(store, &q).await }
    });
    let mut swept = Swept::default();
    let mut unread = None;
    for one in futures::future::join_all(rounds).await {
        match one {
            Ok(one) => swept.add(one),
            Err(e) => {
                swept.unread += 1;
                unread.get_or_insert(e);
            }
        }
    }
    match unread {
        Some(e) if swept.unread >= u64::from(PENDING_PARTITIONS) => Err(e),
        e => {
            swept.error = swept.error.take().or(e.map(|e| e.to_string()));
            Ok(swept)
        }
    }
}

impl Swept {
    /// Adds one partition's sweep.
    fn add(&mut self, one: Swept) {
        self.deleted += one.deleted;
        self.kept += one.kept;
        self.failed += one.failed;
        self.more |= one.more;
        self.oldest_due = match (self.oldest_due, one.oldest_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.error = self.error.take().or(one.error);
    }
}

async fn sweep_partition<S: crate::sink::AggregateStore>(store: &S, q: &DueQuery<'_>) -> Result<Swept, crate::sink::SinkError> {
    use futures::StreamExt;
    let due = crate::sink::retrying(|| store.due_expiries(q)).await?;
    let mut swept = Swept { more: due.len() >= q.limit, oldest_due: due.iter().map(|p| p.at).min(), ..Swept::default() };
    let deletes: Vec<_> = due.iter().map(|p| crate::sink::retrying(move || store.remove_expired(p))).collect();
    let mut deletes = futures::stream::iter(deletes).buffer_unordered(SWEEP_CONCURRENCY);
    while let Some(deleted) = deletes.next().await {
        match deleted {
            Ok(true) => swept.deleted += 1,
            Ok(false) => swept.kept += 1,
            // Its pending item stays: the next sweep tries it again.
            Err(e) => {
                swept.failed += 1;
                swept.error.get_or_insert(e.to_string());
            }
        }
    }
    Ok(swept)
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
    fn the_service_deletes_itself_unless_ttl_is_enabled_on_the_attribute() {
        let on = |a: &str, enabled| Described::On { attribute: a.into(), enabled };
        assert_eq!(setting(&on("ttl", true), "ttl"), Some(false), "TTL deletes");
        assert_eq!(setting(&on("ttl", false), "ttl"), Some(true), "being turned on: not deleting yet");
        assert_eq!(setting(&on("expiresAt", true), "ttl"), Some(true), "TTL on another attribute");
        assert_eq!(setting(&Described::Off, "ttl"), Some(true));
        assert_eq!(setting(&Described::Failed, "ttl"), None, "unknown: keep what was decided");
    }

    #[test]
    fn a_pending_item_sorts_by_expiry_in_a_partition_fixed_by_the_helper() {
        let helper = |sk: &str| vec![("PK".to_string(), "CUST#c1".to_string()), ("SK".to_string(), sk.to_string())];
        let p = Pending { helper: helper("PROFILE#_agg#largest#N5"), attribute: "ttl".into(), at: 1_764_691_200 };
        let (pk, sk) = pending_key(&p);
        assert!(pk.starts_with("#_agg#expiring#ttl#") && pk.contains(crate::rules::helper::MARK), "{pk}");
        assert!(crate::registry::is_reserved_key([pk.as_str()]), "never a target's key");
        let n: u8 = pk["#_agg#expiring#ttl#".len()..].parse().unwrap();
        assert!(n < PENDING_PARTITIONS);
        assert!(sk.starts_with("001764691200#") && sk.len() == 13 + 32, "{sk}");
        assert_eq!(pending_at(&sk), Some(p.at));
        assert_eq!(pending_key(&Pending { at: p.at + 1, ..p.clone() }).0, pk, "the partition depends on the helper only");
        assert_ne!(pending_key(&Pending { attribute: "expiresAt".into(), ..p.clone() }).0, pk, "another attribute's own partitions");
        assert_ne!(pending_key(&Pending { helper: helper("PROFILE#_agg#largest#N6"), ..p.clone() }).1, sk);
        // Due: expiry at or before now, and nothing later.
        assert!(sk < due_before(p.at) && sk < due_before(p.at + 5));
        assert!(sk > due_before(p.at - 1));
        let spread: std::collections::BTreeSet<String> = (0..200)
            .map(|i| pending_key(&Pending { helper: helper(&format!("P#_agg#m#N{i}")), attribute: "ttl".into(), at: 1 }).0)
            .collect();
        assert_eq!(spread.len(), usize::from(PENDING_PARTITIONS), "200 helpers use every partition");
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
