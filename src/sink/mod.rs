//! Writing aggregates: one conditional UpdateItem per target item and batch, guarded by the
//! idempotency ledger ([`ledger`]), behind a narrow [`AggregateStore`] trait.

pub mod copy;
pub mod dead_letter;
pub mod derive;
pub mod distinct;
pub mod dynamodb;
pub mod expiry;
pub mod hold;
pub mod ledger;
pub mod memory;
pub mod pace;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use crate::decimal::Decimal;
use crate::rules::helper::{HelperScan, Scalar};
use crate::rules::{TargetDelta, TargetKey};
use expiry::{Expiry, ExpiryWrite, HelperSeen, Pending};
use hold::{HoldSeen, HoldWrite};
use ledger::{admits, plan, FloorPlan, Ledger, Prune, Seen, WritePlan};

/// How a write proves the item still admits its shard (see [`ledger`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub floor_attribute: String,
    pub open_attribute: String,
    /// This shard's creation time as a floor value.
    pub mine: String,
    /// `,<shard>,`: this shard in a straggler set (packed, and as older sets hold it).
    pub tokens: [String; 2],
}

/// One ledger-guarded write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerWrite {
    /// (attribute, value) of the target's key, partition key first.
    pub key: Vec<(String, String)>,
    pub adds: Vec<(String, Decimal)>,
    /// The deployment's ledger: which attributes of the item are its entries.
    pub ledger: Ledger,
    /// This shard's compact entry, and its new value (the write's last sequence number).
    pub entry_name: String,
    pub entry_value: Vec<u8>,
    /// Padded first sequence number of the write: the entries must be below it.
    pub first: String,
    /// The entries this shard had before compact entries (`_agg:<namespace>:<shard>`) and
    /// before namespaces (`_agg:<shard>`): a write must also be past them, so a batch applied
    /// by an earlier version and replayed after the upgrade is not applied twice.
    pub named_entry: String,
    pub legacy_entry: String,
    /// The item's write counter, advanced by every write (reconcile's O(1) condition).
    pub version_attribute: String,
    /// The set of measure attributes this deployment wrote on the item.
    pub measures_attribute: String,
    /// None for shard ids without a creation time (no floor, no pruning).
    pub fence: Option<Fence>,
    /// Entries of finished shards to remove, with the floor and straggler set to set.
    pub prune: Option<Prune>,
    /// No hold, or the reconcile hold the write logs under or ends ([`hold`]).
    pub hold: HoldWrite,
    /// A helper item's expiry attribute ([`expiry`]): every helper write removes it, and the
    /// outcome says what the write saw of the helper. None: not a helper, or no attribute.
    pub expiry: Option<ExpiryWrite>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WriteOutcome {
    /// `seen`: the item's ledger after the write; `helper`: its count and expiry after the
    /// write, when the write carried an [`ExpiryWrite`].
    Applied { capacity: f64, seen: Seen, helper: Option<HelperSeen> },
    /// The condition failed: the item's current entry, floor, straggler set and hold (and
    /// its count and expiry, as for `Applied`).
    Stale { entry: Option<String>, floor: Option<String>, open: Option<String>, hold: Option<HoldSeen>, helper: Option<HelperSeen> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Timeouts, 5xx: retry.
    #[error("transient write error: {0}")]
    Transient(String),
    /// The table's partition or capacity throttled the write: retry, and send less at once.
    #[error("write throttled: {0}")]
    Throttled(String),
    /// The write can never succeed as it is (a measure attribute holding a string, ...).
    #[error("write refused: {0}")]
    Invalid(String),
    #[error("write error: {0}")]
    Fatal(String),
}

impl SinkError {
    /// A failed DynamoDB call on `table` as the writers see it: throttled, transient, refused
    /// as invalid, or fatal (naming the table).
    pub fn from_failure(f: crate::aws::Failure, table: &str) -> SinkError {
        use crate::aws::FailureKind;
        match f.kind {
            FailureKind::Throttled => SinkError::Throttled(f.to_string()),
            FailureKind::Transient => SinkError::Transient(f.to_string()),
            FailureKind::Invalid => SinkError::Invalid(f.to_string()),
            _ => SinkError::Fatal(format!("{f} (table {table})")),
        }
    }

    pub fn is_retriable(&self) -> bool {
        matches!(self, SinkError::Transient(_) | SinkError::Throttled(_))
    }
}

pub trait AggregateStore: Send + Sync + 'static {
    fn apply(&self, write: &LedgerWrite) -> impl Future<Output = Result<WriteOutcome, SinkError>> + Send;

    /// The helper items (`refs` above zero) of partition `pk` whose sort key begins with
    /// `prefix`, strongly consistent: the sort-key tail (after `prefix`) of the least
    /// (`First`) or greatest (`Last`), or how many there are (`Count`). `First` and `Last`
    /// start at the tail `from` (inclusive; None: the end of the range) and stop at the first
    /// live helper.
    fn live_helpers(&self, key: &HelperQuery<'_>) -> impl Future<Output = Result<LiveHelpers, SinkError>> + Send;

    /// The item's derivation counters (attributes starting with `names.counters`, numbers
    /// as stored) and cursors (starting with `names.cursors`, strings), strongly consistent,
    /// by the name after the prefix; absent ones are missing.
    fn derivation_counters(
        &self,
        key: &[(String, String)],
        names: &DerivationNames,
    ) -> impl Future<Output = Result<Counters, SinkError>> + Send;

    /// Moves a derivation cursor back to `to` if it lies beyond it in `scan` order (`First`:
    /// above it; `Last`: below it), or removes it (`to` None: the whole range) if present.
    /// Never creates the item; an absent cursor already covers the whole range.
    fn lower_cursor(
        &self,
        key: &[(String, String)],
        attribute: &str,
        to: Option<&str>,
        scan: HelperScan,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Sets (Some) or removes (None) the derived attributes and advances each one's counter,
    /// if every counter is still as `seen` (None: absent): the write capacity it consumed.
    /// None when another derivation moved one of them first.
    fn set_derived(&self, write: &DerivedWrite<'_>) -> impl Future<Output = Result<Option<f64>, SinkError>> + Send;

    /// Sets a helper item's expiry (`attribute`, epoch seconds `at`) if its count is still
    /// zero ([`expiry`]): whether it did (false: the count moved, or the item is gone).
    /// `version`: the item's write counter (attribute, value seen; None: absent), which must
    /// be unchanged.
    fn expire_helper(
        &self,
        key: &[(String, String)],
        attribute: &str,
        at: u64,
        version: (&str, Option<&str>),
    ) -> impl Future<Output = Result<bool, SinkError>> + Send;

    /// One helper item's count and `distinct` flag, strongly consistent (None: no such item),
    /// and the read capacity it consumed.
    fn helper_state(&self, key: &[(String, String)]) -> impl Future<Output = Result<(Option<HelperState>, f64), SinkError>> + Send;

    /// Every helper item of partition `pk` whose sort key begins with `prefix`, strongly
    /// consistent, by tail.
    fn helper_states(&self, q: &HelperQuery<'_>) -> impl Future<Output = Result<HelperStates, SinkError>> + Send;

    /// A `distinct` transition, all or nothing ([`distinct`]): each helper's flag set as
    /// asked if its flag and count are still as read, and the target's count moved by how
    /// many flags were set less how many were cleared. The write capacity it consumed; None
    /// when a helper changed first.
    fn count_transitions(&self, w: &TransitionWrite<'_>) -> impl Future<Output = Result<Option<f64>, SinkError>> + Send;

    /// Sets a `distinct` attribute's count (and the attribute: removed at zero) and marks it
    /// walked, or removes the mark ([`Settle`]), advancing its derivation counter: the write
    /// capacity it consumed; None when the counter moved first (`Count`) or the item is gone
    /// (`Unwalk`).
    fn settle_count(&self, w: &SettleWrite<'_>) -> impl Future<Output = Result<Option<f64>, SinkError>> + Send;

    /// Records that the service is to delete the helper `p.helper` once `p.at` has passed: a
    /// pending item ([`expiry::pending_key`]), put before the expiry is set. The write capacity
    /// it consumed.
    fn register_expiry(&self, p: &expiry::Pending) -> impl Future<Output = Result<f64, SinkError>> + Send;

    /// The pending expiries `q` asks for ([`expiry::DueQuery`]), oldest first.
    fn due_expiries(&self, q: &expiry::DueQuery<'_>) -> impl Future<Output = Result<Vec<expiry::Pending>, SinkError>> + Send;

    /// Deletes the helper of `p` if it still carries the expiry `p.at` in `p.attribute`, at a
    /// count of zero and counted by no `distinct` target, then the pending item: whether the
    /// helper was deleted.
    fn remove_expired(&self, p: &expiry::Pending) -> impl Future<Output = Result<bool, SinkError>> + Send;
}

/// What a `distinct` derivation reads of one helper item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelperState {
    /// Its count is above zero.
    pub live: bool,
    /// It is counted in its target's `distinct` count ([`distinct::COUNTED`]).
    pub counted: bool,
    /// Its count is below zero (a drift for reconcile): no expiry is set on it.
    pub below_zero: bool,
}

/// A measure's helper items, by tail, and what reading them cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HelperStates {
    pub helpers: BTreeMap<String, HelperState>,
    pub capacity: f64,
}

/// One all-or-nothing `distinct` transition on a target and some of its helpers.
#[derive(Debug, Clone)]
pub struct TransitionWrite<'a> {
    pub key_names: &'a [String],
    /// The target's key values, partition key first.
    pub key: &'a [(String, String)],
    /// The attribute's count (`_aggn:<namespace>:<name>`) and derivation counter.
    pub count: &'a str,
    pub counter: &'a str,
    /// The derived attribute, set to the new count (removed at zero) once the count is
    /// walked; None while it is not.
    pub attribute: Option<&'a str>,
    /// The helpers' sort keys, each with its state as read: its flag is inverted.
    pub helpers: &'a [(String, HelperState)],
    /// The TTL attribute and expiry to set on a helper whose flag is cleared.
    pub expiry: Option<(&'a str, u64)>,
}

/// The count of a `distinct` attribute, set after a walk of every helper.
#[derive(Debug, Clone)]
pub struct SettleWrite<'a> {
    pub key: &'a [(String, String)],
    pub attribute: &'a str,
    pub count: &'a str,
    pub walked: &'a str,
    pub counter: &'a str,
    /// The derivation counter as read (None: absent): `Count` is conditioned on it.
    pub seen: Option<&'a str>,
    pub kind: Settle,
}

/// What a [`SettleWrite`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Sets the count and the attribute (removed at zero), and the walked mark if `mark` (a
    /// walk whose flags all agreed; not for a count that was not a number, set before flags
    /// are flipped).
    Count { value: u64, mark: bool },
    /// Removes the walked mark of an existing item, whatever its counter (before reconcile
    /// corrects a helper): every derivation walks again until one settles.
    Unwalk,
}

/// One Query for a target measure's helpers.
#[derive(Debug, Clone, Copy)]
pub struct HelperQuery<'a> {
    /// The table's key attribute names, partition key first (helpers need a sort key).
    pub key_names: &'a [String],
    pub pk: &'a str,
    pub prefix: &'a str,
    pub scan: HelperScan,
    /// `First` and `Last`: the tail to start at, inclusive (None: the end of the range the
    /// scan starts from).
    pub from: Option<&'a str>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LiveHelpers {
    /// The sort-key tail of the first live helper in the scan's order (none for `Count`).
    pub first: Option<String>,
    pub count: u64,
    /// Read capacity the query consumed.
    pub capacity: f64,
    /// Helper items the query read, live or not.
    pub read: u64,
    /// `First` and `Last`: the tail of the last item read (the first live one, when found).
    pub last_read: Option<String>,
}

/// The attribute prefixes of a target's derivation counters and cursors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivationNames {
    pub counters: String,
    pub cursors: String,
    /// `distinct`: its count of helpers flagged counted, and whether a walk of every helper
    /// has set their flags ([`distinct`]).
    pub counts: String,
    pub walked: String,
}

/// A target's derivation counters and cursors, by the name after their prefix, and the read
/// capacity reading them consumed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    pub values: BTreeMap<String, String>,
    pub cursors: BTreeMap<String, String>,
    /// `distinct`: the counts (numbers as stored), the walked marks, and every other number
    /// on the item by name (the derived attributes among them).
    pub counts: BTreeMap<String, String>,
    pub walked: std::collections::BTreeSet<String>,
    pub numbers: BTreeMap<String, String>,
    pub capacity: f64,
}

/// A derivation's write on a target item.
#[derive(Debug, Clone, Copy)]
pub struct DerivedWrite<'a> {
    pub key: &'a [(String, String)],
    pub values: &'a [Derived],
}

/// One derived attribute in a [`DerivedWrite`].
#[derive(Debug, Clone, PartialEq)]
pub struct Derived {
    pub name: String,
    /// Its derivation counter's attribute, and the value read before the helpers were
    /// queried (None: absent).
    pub counter: String,
    pub seen: Option<String>,
    /// None: nothing contributes, the attribute is removed.
    pub value: Option<Scalar>,
    /// `max`, `min` and `latest`: the cursor the helpers were queried from, as read, and
    /// where the next derivation starts (None: absent, the whole range). The write is also
    /// conditioned on the cursor being as read.
    pub cursor: Option<CursorWrite>,
}

/// A derivation cursor (`_aggk:<namespace>:<attribute>`): the tail of a helper such that no
/// live helper lies before it in the measure's scan order ([`derive`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorWrite {
    pub attribute: String,
    pub seen: Option<String>,
    pub to: Option<String>,
}

/// What writing one target cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WriteStats {
    pub calls: u64,
    pub capacity: f64,
    /// Records whose effect was already in the item (replays).
    pub skipped_records: u64,
    pub applied_records: u64,
    /// What the item's ledger looked like after the write, for pruning on the next one.
    pub seen: Option<Seen>,
    /// Entries removed by this write.
    pub pruned: usize,
    /// The item no longer admits this shard (floor passed it): the write was refused.
    pub fenced: bool,
    /// Calls whose ledger condition failed (records already applied).
    pub stale: u64,
    /// Calls the table throttled (retried).
    pub throttled: u64,
    /// Calls refused because a reconcile hold was placed, moved or removed (redone for it).
    pub held: u64,
    /// Writes that ended an expired or full hold.
    pub holds_ended: u64,
    /// Helper items given an expiry (their count reached zero).
    pub expiries_set: u64,
}

/// The shard a batch comes from, and what the ledger may prune.
#[derive(Debug, Clone)]
pub struct ShardContext {
    pub ledger: Ledger,
    pub entry_name: String,
    pub named_entry: String,
    pub legacy_entry: String,
    pub version_attribute: String,
    pub measures_attribute: String,
    pub fence: Option<Fence>,
    /// The current floor plan (from the lease table); None: prune nothing.
    pub plan: Option<std::sync::Arc<FloorPlan>>,
    /// The aggregates table's TTL attribute: helper items at zero expire ([`expiry`]).
    pub expiry: Option<Expiry>,
    /// The creation time of the batch's oldest record: helper writes are sent only while it is
    /// younger than [`expiry::WRITE_AGE_LIMIT_MS`].
    pub oldest_ms: Option<u64>,
}

impl ShardContext {
    pub fn new(ledger: &Ledger, shard_id: &str) -> ShardContext {
        ShardContext {
            ledger: ledger.clone(),
            entry_name: ledger.entry_name(shard_id),
            named_entry: ledger.named_entry(shard_id),
            legacy_entry: ledger::entry_name(shard_id),
            version_attribute: ledger.version_attribute(),
            measures_attribute: ledger.measures_attribute(),
            fence: crate::shard_id::created_ms(shard_id).map(|c| Fence {
                floor_attribute: ledger.floor_attribute(),
                open_attribute: ledger.open_attribute(),
                mine: ledger::floor_value(c),
                tokens: ledger::open_tokens(shard_id),
            }),
            plan: None,
            expiry: None,
            oldest_ms: None,
        }
    }

    /// What a write to an item last seen as `seen` may prune now.
    pub fn prune(&self, seen: Option<&Seen>) -> Option<Prune> {
        self.fence.as_ref()?;
        ledger::prune_for(self.plan.as_deref()?, seen?, &self.entry_name)
    }

    fn admitted(&self, floor: Option<&str>, open: Option<&str>) -> bool {
        self.fence.as_ref().is_none_or(|f| admits(floor, open, &f.mine, &f.tokens))
    }
}

/// Most transient failures retried for one write before the batch gives up (and is retried
/// from its checkpoint).
const MAX_TRANSIENT_RETRIES: u32 = 8;

/// Writes one target's coalesced deltas exactly once: on a stale ledger, drops the records
/// the item already has and retries with the rest.
pub async fn write_target<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    key: &TargetKey,
    delta: &TargetDelta,
    shard: &ShardContext,
) -> Result<WriteStats, SinkError> {
    write_target_pruning(store, key_names, key, delta, shard, None).await
}

/// [`write_target`], also pruning entries of finished shards seen on the item before
/// (`seen`), in the same UpdateItem.
pub async fn write_target_pruning<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    key: &TargetKey,
    delta: &TargetDelta,
    shard: &ShardContext,
    seen: Option<&Seen>,
) -> Result<WriteStats, SinkError> {
    let mut stats = WriteStats::default();
    let mut seen = seen.cloned();
    let mut prune = shard.prune(seen.as_ref());
    // Rounds in which another write moved the floor first (a hot item written from every shard).
    let mut raced = 0;
    let mut applied: Option<String> = None;
    // The reconcile hold the item was last seen holding ([`hold`]).
    let mut held: Option<HoldSeen> = None;
    // A logging write was refused as invalid: the next one ends the hold.
    let mut end_hold = false;
    let mut transient = 0;
    let total_records = delta.contributions.len() as u64;
    // What the last write saw of the helper's count and expiry (helper items only).
    let mut helper: Option<HelperSeen> = None;
    let expiry = shard.expiry.as_ref().filter(|_| is_helper(key));
    // Each stale round raises `applied` strictly or drops the pruning, so this ends; the
    // bound is a safety net.
    for _ in 0..64 {
        let Some(p): Option<WritePlan> = plan(&delta.contributions, applied.as_deref()).map_err(|e| SinkError::Fatal(e.to_string()))?
        else {
            stats.skipped_records = total_records - stats.applied_records;
            expire_if_due(store, key_names, key, (expiry, &shard.version_attribute), helper.take(), &mut stats).await?;
            return Ok(stats);
        };
        let hold = match &held {
            None => HoldWrite::Absent,
            Some(h) if end_hold => {
                HoldWrite::Clear { seen: h.value.clone(), remove: h.logs.iter().take(hold::MAX_LOGS).cloned().collect() }
            }
            Some(h) => hold::decide(h, crate::state::now_ms(), &shard.ledger, &p.logs, p.unidentified),
        };
        let write = LedgerWrite {
            key: key_names.iter().cloned().zip(key.0.iter().map(|v| v.to_string())).collect(),
            adds: p.adds.clone(),
            ledger: shard.ledger.clone(),
            entry_name: shard.entry_name.clone(),
            named_entry: shard.named_entry.clone(),
            legacy_entry: shard.legacy_entry.clone(),
            version_attribute: shard.version_attribute.clone(),
            measures_attribute: shard.measures_attribute.clone(),
            entry_value: ledger::encode_sequence(&p.last)
                .ok_or_else(|| SinkError::Fatal(format!("sequence number {} not encodable", p.last)))?,
            first: p.first.clone(),
            fence: shard.fence.clone(),
            prune: prune.clone(),
            hold,
            expiry: expiry.map(|e| ExpiryWrite { attribute: e.attribute.clone() }),
        };
        let longest = ledger::expressions(&write).longest();
        if longest > ledger::MAX_EXPRESSION_BYTES {
            // Too many attributes for one UpdateItem (templates like `orders_{status}` can form
            // any number): prune another time, then write the records in two runs, each a
            // valid ledger write of its own (records in sequence order).
            if prune.take().is_some() {
                continue;
            }
            if let Some((low, high)) = split_records(&delta.contributions, applied.as_deref()) {
                let mut split = Box::pin(write_target_pruning(store, key_names, key, &low, shard, None)).await?;
                let rest = Box::pin(write_target_pruning(store, key_names, key, &high, shard, None)).await?;
                split.add(&rest);
                split.throttled += stats.throttled;
                split.held += stats.held;
                split.stale += stats.stale;
                split.calls += stats.calls;
                split.skipped_records = total_records.saturating_sub(split.applied_records);
                return Ok(split);
            }
            // One record alone is too large: our own limit, a bug to surface, never a reason to
            // dead-letter records.
            return Err(SinkError::Fatal(format!("ledger write expression of {longest} bytes exceeds DynamoDB's 4 KB")));
        }
        if expiry.is_some() && !expiry::may_write_helpers(shard.oldest_ms, crate::state::now_ms()) {
            // Checked again before each helper write: the batch may have aged while it wrote.
            return Err(SinkError::Transient("the batch's oldest record is too old to write helper items".into()));
        }
        stats.calls += 1;
        match store.apply(&write).await {
            Ok(WriteOutcome::Applied { capacity, seen, helper }) => {
                stats.capacity += capacity;
                stats.applied_records = p.records as u64;
                stats.skipped_records = total_records - stats.applied_records;
                stats.pruned = write.prune.as_ref().map_or(0, |p| p.entries.len());
                stats.holds_ended += u64::from(matches!(write.hold, HoldWrite::Clear { .. }));
                stats.seen = Some(seen);
                expire_if_due(store, key_names, key, (expiry, &shard.version_attribute), helper, &mut stats).await?;
                return Ok(stats);
            }
            Ok(WriteOutcome::Stale { entry, floor, open, hold, helper: now }) => {
                stats.stale += 1;
                helper = now;
                if !shard.admitted(floor.as_deref(), open.as_deref()) {
                    // The item's floor passed this shard: someone saw it finished (every
                    // record applied and checkpointed) and pruned its entry, so this write is
                    // a replay. Refuse it; nothing is applied twice.
                    stats.fenced = true;
                    stats.skipped_records = total_records - stats.applied_records;
                    return Ok(stats);
                }
                if hold.as_ref().map(|h| h.value.as_str()) != write.hold.seen() {
                    // A reconcile hold was placed, replaced or removed since the item was last
                    // seen: redo the write for the hold it holds now (logging under it, or
                    // ending it). A held item is not pruned: its writes stay small.
                    stats.held += 1;
                    if hold.is_some() {
                        prune = None;
                    }
                    held = hold;
                    continue;
                }
                if prune.as_ref().is_some_and(|p| p.seen_floor != floor || p.seen_open != open) {
                    // Another write moved the floor since we saw the item: prune again from
                    // what the item holds now (its admitted set only shrank), a few times.
                    raced += 1;
                    prune = match seen.as_mut().filter(|_| raced <= 3) {
                        Some(s) => {
                            s.floor = floor;
                            s.open = open;
                            shard.prune(Some(s))
                        }
                        None => None,
                    };
                    continue;
                }
                match entry {
                    Some(e) if applied.as_deref().is_none_or(|a| e.as_str() > a) => applied = Some(e),
                    // The condition failed but the entry does not explain it: a concurrent
                    // change; read again by retrying.
                    _ => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
            Err(e) if e.is_retriable() && transient < MAX_TRANSIENT_RETRIES => {
                transient += 1;
                stats.throttled += u64::from(matches!(e, SinkError::Throttled(_)));
                tokio::time::sleep(backoff(transient)).await;
            }
            Err(SinkError::Invalid(_)) if matches!(write.hold, HoldWrite::Log { .. }) => {
                // The logs made the write invalid (the item would pass 400 KB): end the hold
                // instead of refusing the records.
                end_hold = true;
            }
            Err(e) => return Err(e),
        }
    }
    Err(SinkError::Fatal("ledger write did not settle after 64 rounds".into()))
}

/// Whether a target key is a helper item's (its sort key holds [`helper::MARK`]).
pub fn is_helper(key: &TargetKey) -> bool {
    key.0.len() > 1 && key.0.last().is_some_and(|sk| crate::rules::helper::parse(sk).is_some())
}

/// Gives a helper found at zero without an expiry its expiry ([`expiry`]). Also after a
/// refused replay: a crash between the write that reached zero and this one leaves the expiry
/// to the batch's replay.
async fn expire_if_due<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    key: &TargetKey,
    (expiry, version_attribute): (Option<&Expiry>, &str),
    seen: Option<HelperSeen>,
    stats: &mut WriteStats,
) -> Result<(), SinkError> {
    let (Some(e), Some(seen)) = (expiry.filter(|e| e.set && expiry::due(seen.as_ref())), seen) else { return Ok(()) };
    let item_key: Vec<(String, String)> = key_names.iter().cloned().zip(key.0.iter().map(|v| v.to_string())).collect();
    let at = e.at(crate::state::now_ms());
    if e.own {
        match expiry::record(store, &Pending { helper: item_key.clone(), attribute: e.attribute.clone(), at }).await? {
            Some(capacity) => stats.capacity += capacity,
            None => return Ok(()),
        }
    }
    let set = retrying(|| store.expire_helper(&item_key, &e.attribute, at, (version_attribute, seen.version.as_deref()))).await?;
    stats.expiries_set += u64::from(set);
    Ok(())
}

/// Runs `call` until it succeeds, retrying transient errors with backoff up to
/// [`MAX_TRANSIENT_RETRIES`] times.
pub(crate) async fn retrying<T, F: std::future::Future<Output = Result<T, SinkError>>>(
    mut call: impl FnMut() -> F,
) -> Result<T, SinkError> {
    let mut transient = 0;
    loop {
        match call().await {
            Err(err) if err.is_retriable() && transient < MAX_TRANSIENT_RETRIES => {
                transient += 1;
                tokio::time::sleep(backoff(transient)).await;
            }
            done => return done,
        }
    }
}

impl WriteStats {
    /// Adds a later write's figures (the later one's view of the item wins).
    fn add(&mut self, later: &WriteStats) {
        self.calls += later.calls;
        self.capacity += later.capacity;
        self.applied_records += later.applied_records;
        self.pruned += later.pruned;
        self.fenced |= later.fenced;
        self.stale += later.stale;
        self.throttled += later.throttled;
        self.held += later.held;
        self.holds_ended += later.holds_ended;
        self.expiries_set += later.expiries_set;
        if later.seen.is_some() {
            self.seen = later.seen.clone();
        }
    }
}

/// The not yet applied records (after `applied`) in two halves at a record boundary, lower
/// sequence numbers first; None for fewer than two records.
fn split_records(contributions: &[crate::rules::Contribution], applied: Option<&str>) -> Option<(TargetDelta, TargetDelta)> {
    let mut rest: Vec<&crate::rules::Contribution> = contributions
        .iter()
        .filter(|c| c.sequence.as_deref().and_then(ledger::pad_sequence).is_some_and(|s| applied.is_none_or(|a| s.as_str() > a)))
        .collect();
    rest.sort_by_key(|c| c.sequence.as_deref().and_then(ledger::pad_sequence));
    let mut seqs: Vec<Option<&str>> = rest.iter().map(|c| c.sequence.as_deref()).collect();
    seqs.dedup();
    let middle = *seqs.get(seqs.len() / 2).filter(|_| seqs.len() >= 2)?;
    let at = rest.iter().position(|c| c.sequence.as_deref() == middle)?;
    let delta =
        |cs: &[&crate::rules::Contribution]| TargetDelta { contributions: cs.iter().map(|c| (*c).clone()).collect(), ..Default::default() };
    Some((delta(&rest[..at]), delta(&rest[at..])))
}

/// Exponential backoff with full jitter: 50 ms doubling, capped at 5 s.
pub fn backoff(attempt: u32) -> Duration {
    let cap = 50u64.saturating_mul(1u64 << attempt.min(7)).min(5_000);
    Duration::from_millis(fastrand::u64(cap / 2..=cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::Contribution;
    use crate::sink::memory::{MemValue, MemoryAggregates};

    fn contribution(seq: u64, attr: &str) -> Contribution {
        Contribution {
            sequence: Some(format!("{seq:021}").into()),
            rule: None,
            created: None,
            values: crate::rules::values_of([(attr, Decimal::from_i64(1))]),
            ..Default::default()
        }
    }

    fn key() -> TargetKey {
        TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE")].into_boxed_slice())
    }

    #[tokio::test]
    async fn a_batch_too_large_for_one_expression_is_written_in_runs_of_records() {
        // 400 records, each forming its own attribute name (`orders_{status}` with 400 statuses).
        let store = MemoryAggregates::new();
        let delta = TargetDelta {
            contributions: (1..=400).map(|i| contribution(i, &format!("orders_status{i:03}"))).collect(),
            ..Default::default()
        };
        let ctx = ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa");
        let names = vec!["PK".to_string(), "SK".to_string()];
        let stats = write_target(&store, &names, &key(), &delta, &ctx).await.unwrap();
        assert_eq!(stats.applied_records, 400);
        assert!(stats.calls >= 2, "{stats:?}");
        assert_eq!(store.numbers().len(), 400, "every record applied once");
        // A replay changes nothing.
        let again = write_target(&store, &names, &key(), &delta, &ctx).await.unwrap();
        assert_eq!(again.applied_records, 0);
        assert_eq!(store.numbers().values().map(|v| v.to_string()).collect::<std::collections::BTreeSet<_>>(), ["1".to_string()].into());
    }

    /// The memory store's per-partition WCU in one second (the simulation's hottest partition):
    /// writes of one partition key within a second add up, other keys and the next second
    /// start afresh, and asking resets the peak.
    #[tokio::test(start_paused = true)]
    async fn the_memory_store_measures_each_partitions_wcu_per_second() {
        crate::state::simulate_clock(Some(1_764_460_800_000));
        let store = MemoryAggregates::new();
        let names = vec!["PK".to_string(), "SK".to_string()];
        let write = |pk: &'static str, sk: &'static str, seq: u64| {
            let (store, names) = (&store, &names);
            async move {
                let key = TargetKey(vec![Box::from(pk), Box::from(sk)].into_boxed_slice());
                let delta = TargetDelta { contributions: vec![contribution(seq, "orders")], ..Default::default() };
                let ctx = ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa");
                write_target(store, names, &key, &delta, &ctx).await.unwrap();
            }
        };
        for (i, sk) in ["A", "B", "C"].into_iter().enumerate() {
            write("SALES#2026-11-30", sk, i as u64 + 1).await;
        }
        write("CUST#c1", "PROFILE", 1).await;
        assert_eq!(store.take_peak_partition_wcu(), (3.0, "SALES#2026-11-30".to_string()), "three small items, one partition key");
        let peaks = store.take_partition_peaks();
        assert_eq!((peaks.len(), peaks["SALES#2026-11-30"], peaks["CUST#c1"]), (2, 3.0, 1.0), "per partition key: {peaks:?}");
        assert_eq!(store.take_peak_partition_wcu(), (0.0, String::new()), "asked again: nothing since");
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        write("SALES#2026-11-30", "A", 10).await;
        write("CUST#c1", "PROFILE", 2).await;
        write("CUST#c1", "PROFILE", 3).await;
        assert_eq!(store.take_peak_partition_wcu(), (2.0, "CUST#c1".to_string()), "the next second starts at zero");
        crate::state::simulate_clock(None);
    }

    /// The memory store forgets a deleted item's write count (a long simulation deletes
    /// millions of helpers) but still reports the most written item, deleted or not.
    #[tokio::test]
    async fn the_memory_store_reports_the_hottest_item_after_it_is_deleted() {
        let store = MemoryAggregates::new();
        let ledger = Ledger::new("t");
        let ctx = ShardContext::new(&ledger, "shardId-00000001700000000001-aaaaaaaa");
        async fn write(store: &MemoryAggregates, ctx: &ShardContext, sk: &str, seq: u64) {
            let key = TargetKey(vec![Box::from("CUST#c1"), Box::from(sk)].into_boxed_slice());
            let delta = TargetDelta { contributions: vec![contribution(seq, "orders")], ..Default::default() };
            write_target(store, &["PK".to_string(), "SK".to_string()], &key, &delta, ctx).await.unwrap();
        }
        for seq in 1..=3 {
            write(&store, &ctx, "A", seq).await;
        }
        for seq in 4..=5 {
            write(&store, &ctx, "B", seq).await;
        }
        let hottest = |store: &MemoryAggregates| store.hottest().map(|(k, n, _)| (k.join("/"), n));
        assert_eq!(hottest(&store), Some(("CUST#c1/A".into(), 3)));
        let key_a = vec!["CUST#c1".to_string(), "A".to_string()];
        let version = match store.item(&["CUST#c1", "A"]).and_then(|i| i.get(&ledger.version_attribute()).cloned()) {
            Some(MemValue::Num(v)) => v.to_string(),
            other => panic!("A has a version: {other:?}"),
        };
        assert!(store.delete_if(&key_a, &ledger.version_attribute(), &version));
        assert_eq!(hottest(&store), Some(("CUST#c1/A".into(), 3)), "deleted, still the most written");
        for seq in 6..=7 {
            write(&store, &ctx, "B", seq).await;
        }
        assert_eq!(hottest(&store), Some(("CUST#c1/B".into(), 4)), "overtaken by a live item");
    }

    /// With a partition limit the memory store throttles a write that would take its
    /// partition key over it within one second, as DynamoDB does; the writer retries until
    /// the next second, where the write lands once, and another partition key is not held
    /// back.
    #[tokio::test(start_paused = true)]
    async fn the_memory_store_throttles_a_partition_over_its_limit() {
        crate::state::simulate_clock(Some(1_764_460_800_000));
        let store = MemoryAggregates::new();
        store.set_partition_limit(Some(3.0));
        let names = vec!["PK".to_string(), "SK".to_string()];
        let started = tokio::time::Instant::now();
        let mut stats = Vec::new();
        for (i, (pk, sk)) in
            [("SALES#d", "A"), ("SALES#d", "B"), ("SALES#d", "C"), ("CUST#c1", "P"), ("SALES#d", "D")].into_iter().enumerate()
        {
            let key = TargetKey(vec![Box::from(pk), Box::from(sk)].into_boxed_slice());
            let delta = TargetDelta { contributions: vec![contribution(i as u64 + 1, "orders")], ..Default::default() };
            let ctx = ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa");
            stats.push((write_target(&store, &names, &key, &delta, &ctx).await.unwrap(), started.elapsed()));
        }
        let throttled: Vec<u64> = stats.iter().map(|(s, _)| s.throttled).collect();
        assert!(
            throttled[..4].iter().all(|t| *t == 0) && throttled[4] > 0,
            "only the fourth write on SALES#d within the second: {throttled:?}"
        );
        assert_eq!(store.take_throttled(), throttled[4], "every refusal counted");
        let second = std::time::Duration::from_secs(1);
        assert!(stats[3].1 < second && stats[4].1 >= second, "retried until the next second: {stats:?}");
        let counts: Vec<_> = ["A", "B", "C", "D"].iter().map(|sk| store.item(&["SALES#d", sk]).map(|i| i.get("orders").cloned())).collect();
        assert!(counts.iter().all(|c| c.as_ref().is_some_and(|n| n.is_some())), "each applied once: {counts:?}");
        crate::state::simulate_clock(None);
    }

    /// With a read limit the memory store throttles a strongly consistent read that would take
    /// its partition key over it within one second: 1 RCU per started 4 KB, another key not
    /// held back, the next second starting at zero.
    #[tokio::test(start_paused = true)]
    async fn the_memory_store_throttles_reads_of_a_partition_over_its_limit() {
        crate::state::simulate_clock(Some(1_764_460_800_000));
        let store = MemoryAggregates::new();
        store.put(&["SALES#d", "TOTAL"], "note", MemValue::Str("x".repeat(5000)));
        store.put(&["SALES#d", "OTHER"], "orders", MemValue::Num(Decimal::from_i64(1)));
        store.set_read_limit(Some(4.0));
        let key = |pk: &str, sk: &str| vec![pk.to_string(), sk.to_string()];
        let size = |k: &[String]| store.read_item(k, |i| i.map_or(0, BTreeMap::len));
        assert_eq!(size(&key("SALES#d", "TOTAL")).unwrap(), 1, "2 RCU: 5,000 bytes");
        assert_eq!(size(&key("SALES#d", "OTHER")).unwrap(), 1, "1 RCU");
        assert_eq!(size(&key("SALES#d", "NONE")).unwrap(), 0, "1 RCU for an item that is not there");
        assert!(matches!(size(&key("SALES#d", "TOTAL")), Err(SinkError::Throttled(_))), "5 RCU in the second");
        assert_eq!(size(&key("CUST#c1", "PROFILE")).unwrap(), 0, "another partition key");
        assert_eq!(store.take_read_figures(), (1, (4.0, "SALES#d".to_string())));
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert_eq!(size(&key("SALES#d", "TOTAL")).unwrap(), 1, "the next second starts at zero");
        store.set_read_limit(None);
        for _ in 0..10 {
            assert!(size(&key("SALES#d", "TOTAL")).is_ok(), "no limit, no throttling");
        }
        crate::state::simulate_clock(None);
    }

    #[tokio::test]
    async fn a_helper_at_zero_expires_and_a_raised_one_does_not() {
        use crate::rules::helper::REFS;
        let store = MemoryAggregates::new();
        let names = vec!["PK".to_string(), "SK".to_string()];
        let helper = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE#_agg#largest#N5")].into_boxed_slice());
        let with_ttl = ShardContext {
            expiry: Some(Expiry::new("expiresAt")),
            ..ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa")
        };
        let refs = |seq: u64, d: i64| TargetDelta {
            contributions: vec![Contribution {
                values: crate::rules::values_of([(REFS, Decimal::from_i64(d))]),
                ..contribution(seq, REFS)
            }],
            ..Default::default()
        };
        let state = || {
            let item = store.item(&["CUST#c1", "PROFILE#_agg#largest#N5"]);
            let num = |a: &str| match item.as_ref().and_then(|i| i.get(a)) {
                Some(MemValue::Num(n)) => Some(n.to_string()),
                _ => None,
            };
            (num(REFS), num("expiresAt"))
        };
        let write = |d: TargetDelta, ctx: ShardContext| {
            let (store, names, helper) = (&store, &names, &helper);
            async move { write_target(store, names, helper, &d, &ctx).await.unwrap() }
        };
        let s = write(refs(1, 1), with_ttl.clone()).await;
        assert_eq!((state(), s.expiries_set), ((Some("1".into()), None), 0));
        let before = crate::state::now_ms();
        let s = write(refs(2, -1), with_ttl.clone()).await;
        let (count, at) = state();
        let at: u64 = at.expect("an expiry at zero").parse().unwrap();
        assert_eq!((count.as_deref(), s.expiries_set), (Some("0"), 1));
        assert!(at >= Expiry::new("expiresAt").at(before) && at * 1000 <= crate::state::now_ms() + 48 * 3_600_000, "{at}");
        // A replay changes nothing and sets nothing again.
        assert_eq!(write(refs(2, -1), with_ttl.clone()).await.expiries_set, 0);
        // Raised again: the same write removes the expiry.
        write(refs(3, 1), with_ttl.clone()).await;
        assert_eq!(state(), (Some("1".into()), None));
        // The process dies between the write that reaches zero and the expiry: its replay sets it.
        let without = ShardContext { expiry: None, ..with_ttl.clone() };
        write(refs(4, -1), without).await;
        assert_eq!(state(), (Some("0".into()), None));
        let replay = write(refs(4, -1), with_ttl.clone()).await;
        assert_eq!((replay.applied_records, replay.expiries_set), (0, 1));
        assert!(state().1.is_some());
        // TTL deletes it; a later record makes a new helper, which does not expire.
        assert_eq!(store.delete_expired("expiresAt", u64::MAX / 2), 1);
        write(refs(5, 1), with_ttl.clone()).await;
        assert_eq!(state(), (Some("1".into()), None));
        // Items that are not helpers never get an expiry.
        let zero = TargetDelta {
            contributions: vec![Contribution { values: crate::rules::values_of([("n", Decimal::ZERO)]), ..contribution(6, "n") }],
            ..Default::default()
        };
        assert_eq!(write_target(&store, &names, &key(), &zero, &with_ttl).await.unwrap().expiries_set, 0);
        assert!(store.item(&["CUST#c1", "PROFILE"]).is_none_or(|i| !i.contains_key("expiresAt")));
    }

    /// The argument of [`expiry`] at one helper, with its seeded bug: a batch replayed after its
    /// helper expired at once counts its record again (the count goes below zero); with the
    /// service's expiry the helper, and the ledger entry that refuses the replay, are still there.
    #[tokio::test]
    async fn a_replay_after_an_early_expiry_counts_twice_and_after_the_real_one_does_not() {
        use crate::rules::helper::REFS;
        for (after_ms, want) in [(0, Some("-1")), (expiry::EXPIRE_AFTER_MS, Some("0"))] {
            let store = MemoryAggregates::new();
            let names = vec!["PK".to_string(), "SK".to_string()];
            let helper = TargetKey(vec![Box::from("CUST#c1"), Box::from("PROFILE#_agg#largest#N5")].into_boxed_slice());
            let ctx = ShardContext {
                expiry: Some(Expiry { after_ms, ..Expiry::new("expiresAt") }),
                ..ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa")
            };
            let refs = |seq: u64, d: i64| TargetDelta {
                contributions: vec![Contribution {
                    values: crate::rules::values_of([(REFS, Decimal::from_i64(d))]),
                    ..contribution(seq, REFS)
                }],
                ..Default::default()
            };
            write_target(&store, &names, &helper, &refs(1, 1), &ctx).await.unwrap();
            write_target(&store, &names, &helper, &refs(2, -1), &ctx).await.unwrap();
            // The table's TTL runs now; then the batch of record 2 is replayed (its checkpoint
            // never moved).
            store.delete_expired("expiresAt", crate::state::now_ms() / 1000);
            write_target(&store, &names, &helper, &refs(2, -1), &ctx).await.unwrap();
            let count = match store.item(&["CUST#c1", "PROFILE#_agg#largest#N5"]).and_then(|i| i.get(REFS).cloned()) {
                Some(MemValue::Num(n)) => Some(n.to_string()),
                _ => None,
            };
            assert_eq!(count.as_deref(), want, "expiring {after_ms} ms after zero");
        }
    }

    /// Without TTL on the attribute the service deletes a helper at zero itself once its
    /// recorded expiry has passed, and keeps one written since; the same seeded bug (an
    /// expiry at once) counts a replay twice.
    #[tokio::test]
    async fn without_ttl_the_sweep_deletes_a_helper_still_at_its_expiry_and_keeps_one_written_since() {
        use crate::rules::helper::REFS;
        let names = vec!["PK".to_string(), "SK".to_string()];
        let helper = |v: &str| TargetKey(vec![Box::from("CUST#c1"), Box::from(format!("PROFILE#_agg#largest#N{v}"))].into_boxed_slice());
        let refs = |seq: u64, d: i64| TargetDelta {
            contributions: vec![Contribution {
                values: crate::rules::values_of([(REFS, Decimal::from_i64(d))]),
                ..contribution(seq, REFS)
            }],
            ..Default::default()
        };
        let own = |after_ms| ShardContext {
            expiry: Some(Expiry { after_ms, own: true, ..Expiry::new("expiresAt") }),
            ..ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa")
        };
        let count = |store: &MemoryAggregates, v: &str| match store.item(&["CUST#c1", &format!("PROFILE#_agg#largest#N{v}")]) {
            None => None,
            Some(i) => match i.get(REFS) {
                Some(MemValue::Num(n)) => Some(n.to_string()),
                _ => Some("none".into()),
            },
        };
        let store = MemoryAggregates::new();
        let ctx = own(expiry::EXPIRE_AFTER_MS);
        for (v, seq) in [("5", 1), ("6", 3), ("7", 5)] {
            write_target(&store, &names, &helper(v), &refs(seq, 1), &ctx).await.unwrap();
            let s = write_target(&store, &names, &helper(v), &refs(seq + 1, -1), &ctx).await.unwrap();
            assert_eq!(s.expiries_set, 1);
        }
        assert_eq!(store.pending_expiries(), 3, "each expiry recorded");
        // N6 is raised again (its expiry removed); N7's expiry is gone as if the process died
        // between recording and setting it.
        write_target(&store, &names, &helper("6"), &refs(7, 1), &ctx).await.unwrap();
        store.remove_attribute(&["CUST#c1", "PROFILE#_agg#largest#N7"], "expiresAt");
        let now_s = crate::state::now_ms() / 1000;
        let early = expiry::sweep(&store, &names, "expiresAt", now_s).await.unwrap();
        assert_eq!((early, store.pending_expiries()), (expiry::Swept::default(), 3), "nothing is due yet");
        let later = now_s + expiry::EXPIRE_AFTER_MS / 1000 + expiry::SWEEP_GRACE_S + 60;
        let within_grace = expiry::sweep(&store, &names, "expiresAt", later - expiry::SWEEP_GRACE_S - 60).await.unwrap();
        assert_eq!(within_grace.deleted + within_grace.kept, 0, "due only an hour after the expiry");
        let swept = expiry::sweep(&store, &names, "expiresAt", later).await.unwrap();
        assert_eq!((swept.deleted, swept.kept, store.pending_expiries()), (1, 2, 0));
        assert_eq!((count(&store, "5"), count(&store, "6"), count(&store, "7")), (None, Some("1".into()), Some("0".into())));
        // A table that refuses the records (a role without dynamodb:PutItem): no expiry is
        // set, and the batch goes on.
        store.refuse_pending_expiries();
        write_target(&store, &names, &helper("8"), &refs(8, 1), &ctx).await.unwrap();
        let s = write_target(&store, &names, &helper("8"), &refs(9, -1), &ctx).await.unwrap();
        assert_eq!(s.expiries_set, 0);
        assert!(store.item(&["CUST#c1", "PROFILE#_agg#largest#N8"]).is_some_and(|i| !i.contains_key("expiresAt")));
        // The seeded bug: expiring at once lets the sweep delete the helper and its ledger,
        // and the replay of record 2 counts again.
        let store = MemoryAggregates::new();
        let early = own(0);
        write_target(&store, &names, &helper("5"), &refs(1, 1), &early).await.unwrap();
        write_target(&store, &names, &helper("5"), &refs(2, -1), &early).await.unwrap();
        let swept = expiry::sweep(&store, &names, "expiresAt", crate::state::now_ms() / 1000 + expiry::SWEEP_GRACE_S).await.unwrap();
        assert_eq!(swept.deleted, 1);
        write_target(&store, &names, &helper("5"), &refs(2, -1), &early).await.unwrap();
        assert_eq!(count(&store, "5").as_deref(), Some("-1"), "the replay counted twice");
    }

    /// A sweep goes on past a delete the table refuses and a partition of pending items it
    /// cannot read: it deletes the rest, counts both, and keeps their pending items for the
    /// next sweep. Only when no partition can be read is the sweep an error.
    #[tokio::test]
    async fn a_sweep_goes_on_past_a_refused_delete_and_an_unreadable_partition() {
        use crate::rules::helper::REFS;
        let names = vec!["PK".to_string(), "SK".to_string()];
        let sk = |v: u32| format!("PROFILE#_agg#largest#N{v}");
        let refs = |seq: u64, d: i64| TargetDelta {
            contributions: vec![Contribution {
                values: crate::rules::values_of([(REFS, Decimal::from_i64(d))]),
                ..contribution(seq, REFS)
            }],
            ..Default::default()
        };
        let ctx = ShardContext {
            expiry: Some(Expiry { own: true, ..Expiry::new("expiresAt") }),
            ..ShardContext::new(&Ledger::new("t"), "shardId-00000001700000000001-aaaaaaaa")
        };
        let partition_of = |v: u32| {
            let p = expiry::Pending {
                helper: vec![("PK".into(), "CUST#c1".into()), ("SK".into(), sk(v))],
                attribute: "expiresAt".into(),
                at: 0,
            };
            expiry::pending_key(&p).0.rsplit('#').next().and_then(|n| n.parse::<u8>().ok()).unwrap()
        };
        // Three helpers whose pending items lie in three partitions.
        let mut values: Vec<u32> = Vec::new();
        for v in 1..100 {
            if values.len() < 3 && !values.iter().any(|w| partition_of(*w) == partition_of(v)) {
                values.push(v);
            }
        }
        let store = MemoryAggregates::new();
        for (i, v) in values.iter().enumerate() {
            let key = TargetKey(vec![Box::from("CUST#c1"), Box::from(sk(*v))].into_boxed_slice());
            write_target(&store, &names, &key, &refs(2 * i as u64 + 1, 1), &ctx).await.unwrap();
            write_target(&store, &names, &key, &refs(2 * i as u64 + 2, -1), &ctx).await.unwrap();
        }
        let [deleted, refused, unread] = [values[0], values[1], values[2]];
        store.refuse_sweep(&[vec!["CUST#c1".into(), sk(refused)]], &[partition_of(unread)]);
        let later = crate::state::now_ms() / 1000 + expiry::EXPIRE_AFTER_MS / 1000 + expiry::SWEEP_GRACE_S + 60;
        let swept = expiry::sweep(&store, &names, "expiresAt", later).await.unwrap();
        assert_eq!((swept.deleted, swept.kept, swept.failed, swept.unread), (1, 0, 1, 1), "{swept:?}");
        assert!(swept.error.as_deref().is_some_and(|e| e.contains("AccessDenied")), "{swept:?}");
        assert_eq!(store.pending_expiries(), 2, "the refused and the unread are tried again next sweep");
        assert!(store.item(&["CUST#c1", &sk(deleted)]).is_none(), "the other helper was deleted");
        store.refuse_sweep(&[], &(0..expiry::PENDING_PARTITIONS).collect::<Vec<_>>());
        assert!(expiry::sweep(&store, &names, "expiresAt", later).await.is_err(), "no partition could be read");
    }

    /// Record `seq` of source item `item`, changing `n` by `delta`; the item contributes
    /// `after` to `n` after it (None: nothing, it was deleted).
    fn of_item(seq: u64, item: &str, delta: i64, after: Option<i64>) -> Contribution {
        Contribution {
            item: Some(std::sync::Arc::from(item)),
            after: Some(crate::rules::values_of(after.map(|a| ("n", Decimal::from_i64(a))))),
            values: crate::rules::values_of([("n", Decimal::from_i64(delta))]),
            ..contribution(seq, "n")
        }
    }

    fn text(store: &MemoryAggregates, attr: &str) -> Option<String> {
        match store.item(&["CUST#c1", "PROFILE"])?.get(attr)? {
            MemValue::Str(s) => Some(s.clone()),
            other => panic!("{attr}: {other:?}"),
        }
    }

    #[tokio::test]
    async fn under_a_live_hold_a_write_logs_each_items_contribution_after_its_last_record() {
        let store = MemoryAggregates::new();
        let ledger = Ledger::new("t");
        let ctx = ShardContext::new(&ledger, "shardId-00000001700000000001-aaaaaaaa");
        let names = vec!["PK".to_string(), "SK".to_string()];
        let hold = hold::hold_value("h1", crate::state::now_ms() + 600_000);
        store.put(&["CUST#c1", "PROFILE"], &ledger.hold_attribute(), MemValue::Str(hold.clone()));
        // a is inserted (1), b inserted (1), a deleted (0); then a replay and a later record of b.
        let batch = TargetDelta {
            contributions: vec![of_item(1, "a", 1, Some(1)), of_item(2, "b", 1, Some(1)), of_item(3, "a", -1, None)],
            ..Default::default()
        };
        let s = write_target(&store, &names, &key(), &batch, &ctx).await.unwrap();
        assert_eq!((s.applied_records, s.held, s.holds_ended), (3, 1, 0), "{s:?}");
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap()["n"], MemValue::Num(Decimal::from_i64(1)));
        assert_eq!(text(&store, &ledger.hold_attribute()), Some(hold.clone()), "the hold stays for its owner");
        assert_eq!(text(&store, &hold::log_name(&ledger, "h1", "a")).as_deref(), Some("[]"), "a's last record deleted it");
        assert_eq!(text(&store, &hold::log_name(&ledger, "h1", "b")).as_deref(), Some(r#"[["n","1"]]"#));
        // Records 2..4: 2 and 3 are applied already, so only 4 (b's update to 5) is logged.
        let more = TargetDelta {
            contributions: vec![of_item(2, "b", 1, Some(1)), of_item(3, "a", -1, None), of_item(4, "b", 4, Some(5))],
            ..Default::default()
        };
        let s = write_target(&store, &names, &key(), &more, &ctx).await.unwrap();
        assert_eq!((s.applied_records, s.skipped_records), (1, 2), "{s:?}");
        assert_eq!(text(&store, &hold::log_name(&ledger, "h1", "b")).as_deref(), Some(r#"[["n","5"]]"#));
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap()["n"], MemValue::Num(Decimal::from_i64(5)));
        // A record without an item id cannot be logged: the write ends the hold instead.
        let unknown = TargetDelta { contributions: vec![contribution(5, "n")], ..Default::default() };
        let s = write_target(&store, &names, &key(), &unknown, &ctx).await.unwrap();
        assert_eq!((s.applied_records, s.holds_ended), (1, 1), "{s:?}");
        let item = store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert!(item.keys().all(|k| !k.starts_with("_agghold") && !k.starts_with("_agglog")), "{item:?}");
        assert_eq!(item["n"], MemValue::Num(Decimal::from_i64(6)));
    }

    #[tokio::test]
    async fn a_write_over_an_expired_hold_removes_it_and_its_log() {
        let store = MemoryAggregates::new();
        let ledger = Ledger::new("t");
        let ctx = ShardContext::new(&ledger, "shardId-00000001700000000001-aaaaaaaa");
        store.put(&["CUST#c1", "PROFILE"], &ledger.hold_attribute(), MemValue::Str(hold::hold_value("h1", 1)));
        store.put(&["CUST#c1", "PROFILE"], &hold::log_name(&ledger, "h1", "z"), MemValue::Str("[]".into()));
        let batch = TargetDelta { contributions: vec![of_item(1, "a", 1, Some(1))], ..Default::default() };
        let s = write_target(&store, &["PK".to_string(), "SK".to_string()], &key(), &batch, &ctx).await.unwrap();
        assert_eq!((s.applied_records, s.held, s.holds_ended), (1, 1, 1), "{s:?}");
        let item = store.item(&["CUST#c1", "PROFILE"]).unwrap();
        assert!(item.keys().all(|k| !k.starts_with("_agghold") && !k.starts_with("_agglog")), "{item:?}");
        // The largest logging write fits one expression.
        let seen = hold::HoldSeen { value: hold::hold_value("h1", u64::MAX), logs: vec![] };
        let logs: Vec<_> =
            (0..hold::MAX_LOGS).map(|i| (std::sync::Arc::from(format!("{i:032x}")), vec![("n".to_string(), Decimal::ONE)])).collect();
        let w = LedgerWrite {
            key: vec![("PK".into(), "CUST#c1".into()), ("SK".into(), "PROFILE".into())],
            adds: (0..20).map(|i| (format!("m{i}"), Decimal::ONE)).collect(),
            ledger: ledger.clone(),
            entry_name: ctx.entry_name.clone(),
            named_entry: ctx.named_entry.clone(),
            legacy_entry: ctx.legacy_entry.clone(),
            version_attribute: ctx.version_attribute.clone(),
            measures_attribute: ctx.measures_attribute.clone(),
            entry_value: ledger::encode_sequence("1").unwrap(),
            first: ledger::pad_sequence("1").unwrap(),
            fence: ctx.fence.clone(),
            prune: None,
            hold: hold::decide(&seen, 0, &ledger, &logs, false),
            expiry: None,
        };
        assert!(matches!(w.hold, HoldWrite::Log { .. }));
        assert!(ledger::expressions(&w).longest() <= ledger::MAX_EXPRESSION_BYTES, "{}", ledger::expressions(&w).longest());
    }

    #[tokio::test]
    async fn an_entry_written_before_namespaces_still_refuses_replays() {
        let store = MemoryAggregates::new();
        let shard = "shardId-00000001700000000001-aaaaaaaa";
        // The previous version applied records 1..5 and kept `_agg:<shard>`.
        store.put(&["CUST#c1", "PROFILE"], "n", MemValue::Num(Decimal::from_i64(5)));
        store.put(&["CUST#c1", "PROFILE"], &ledger::entry_name(shard), MemValue::Str(ledger::pad_sequence("5").unwrap()));
        let delta = TargetDelta { contributions: (1..=7).map(|i| contribution(i, "n")).collect(), ..Default::default() };
        let ctx = ShardContext::new(&Ledger::new("t"), shard);
        let stats = write_target(&store, &["PK".to_string(), "SK".to_string()], &key(), &delta, &ctx).await.unwrap();
        assert_eq!((stats.applied_records, stats.skipped_records), (2, 5));
        assert_eq!(store.item(&["CUST#c1", "PROFILE"]).unwrap()["n"], MemValue::Num(Decimal::from_i64(7)));
    }
}
