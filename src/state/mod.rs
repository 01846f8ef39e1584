//! Leases and checkpoints: one item per shard in the state table.
//!
//! A lease names its owner and a fencing counter that changes whenever ownership changes.
//! Renewals, checkpoints and releases are conditional on (owner, counter), so a replica that
//! lost a lease can no longer move its checkpoint. Exactly-once does not rest on leases (the
//! ledger on each target item does); leases keep readers to one per shard and say where to
//! resume.

pub mod definitions;
pub mod dynamodb;
mod items;
pub mod memory;

use std::collections::BTreeMap;
use std::future::Future;

use crate::rules::copy::job::{CopyJob, StoredJob};

/// Where a shard has been read to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkpoint {
    /// Every record up to and including this sequence number is applied.
    Sequence(String),
    /// The shard is closed and every record is applied.
    ShardEnd,
    /// Nothing applied yet, and reading started at the shard's trim horizon: the next owner
    /// starts there too, not at `start_position: latest` (which would skip what arrived since).
    TrimHorizon,
}

impl Checkpoint {
    pub const SHARD_END: &'static str = "SHARD_END";
    pub const TRIM_HORIZON: &'static str = "TRIM_HORIZON";

    pub fn parse(s: &str) -> Checkpoint {
        match s {
            Self::SHARD_END => Checkpoint::ShardEnd,
            Self::TRIM_HORIZON => Checkpoint::TrimHorizon,
            _ => Checkpoint::Sequence(s.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Checkpoint::Sequence(s) => s,
            Checkpoint::ShardEnd => Self::SHARD_END,
            Checkpoint::TrimHorizon => Self::TRIM_HORIZON,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub shard_id: String,
    pub parent: Option<String>,
    pub owner: Option<String>,
    /// Fencing token: incremented on every change of owner.
    pub counter: u64,
    /// Wall-clock expiry (epoch ms); 0 when released.
    pub expires_at_ms: u64,
    pub checkpoint: Option<Checkpoint>,
    /// ApproximateCreationDateTime (epoch ms) of the newest record applied.
    pub last_record_ms: Option<u64>,
    /// When the reader last found the shard with nothing more to read (epoch ms).
    pub at_tip_ms: Option<u64>,
    /// Sharded totals this shard's writes left unfolded as of its last checkpoint (each key as
    /// a JSON array of its values): the next owner folds them ([`crate::worker::fold`]).
    pub fold_due: Vec<String>,
}

impl Lease {
    pub fn new(shard_id: &str, parent: Option<&str>) -> Lease {
        Lease {
            shard_id: shard_id.to_string(),
            parent: parent.map(str::to_string),
            owner: None,
            counter: 0,
            expires_at_ms: 0,
            checkpoint: None,
            last_record_ms: None,
            at_tip_ms: None,
            fold_due: Vec::new(),
        }
    }

    pub fn finished(&self) -> bool {
        self.checkpoint == Some(Checkpoint::ShardEnd)
    }

    /// Nobody holds it (never taken, released, or expired).
    pub fn available(&self, now_ms: u64) -> bool {
        self.owner.is_none() || self.expires_at_ms <= now_ms
    }
}

/// The lease table as a replica last read it, kept from one maintenance round to the next
/// ([`LeaseStore::refresh`]). A store that keeps a log of its changes brings it up to date by
/// copying only the leases changed since; the default reads every lease again. A caller may
/// change `leases` only as a write to the store just did (that write is then in the store's log
/// after the mark, and the next refresh replaces the caller's copy): any other change would
/// stay in the view until that lease next changes in the store.
#[derive(Debug, Default, Clone)]
pub struct LeaseView {
    pub leases: BTreeMap<String, Lease>,
    /// Whose changes `leases` holds, and up to which one (None: the next refresh reads all).
    pub mark: Option<ViewMark>,
}

/// A store's change log position: which store, which generation of its log (a log that
/// forgets deleted leases starts a new one), and the last change a view holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewMark {
    pub store: u64,
    pub epoch: u64,
    pub version: u64,
}

impl LeaseView {
    /// Every lease as just read: the whole view replaced.
    pub fn replace(&mut self, leases: Vec<Lease>) {
        self.leases = leases.into_iter().map(|l| (l.shard_id.clone(), l)).collect();
        self.mark = None;
    }
}

/// A checkpoint update from the shard reader.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    pub checkpoint: Option<Checkpoint>,
    pub last_record_ms: Option<u64>,
    pub at_tip_ms: Option<u64>,
    /// Replaces the lease's unfolded sharded totals ([`Lease::fold_due`]); None: unchanged.
    pub fold_due: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("state table {0} does not exist (set state.create_table: true to create it)")]
    TableMissing(String),
    #[error("transient state table error: {0}")]
    Transient(String),
    #[error("state table error: {0}")]
    Fatal(String),
    /// An item that does not have the shape this version writes (hand-edited, or written by
    /// something else): never read with defaults.
    #[error("state table item {0} is malformed ({1}): fix or delete it")]
    Malformed(String, String),
}

impl StateError {
    pub fn is_retriable(&self) -> bool {
        matches!(self, StateError::Transient(_))
    }
}

/// The state table. Conditional operations return `Ok(false)` when the condition failed
/// (somebody else owns the lease now).
pub trait LeaseStore: Send + Sync + 'static {
    /// Checks the table exists, creating it when `create` is set.
    fn prepare(&self, create: bool) -> impl Future<Output = Result<(), StateError>> + Send;
    fn list(&self) -> impl Future<Output = Result<Vec<Lease>, StateError>> + Send;
    /// Brings `view` up to date: afterwards it holds exactly the leases [`LeaseStore::list`]
    /// would return. By default every lease is read again.
    fn refresh(&self, view: &mut LeaseView) -> impl Future<Output = Result<(), StateError>> + Send {
        async move {
            let leases = self.list().await?;
            view.replace(leases);
            Ok(())
        }
    }
    /// Creates the lease if it does not exist yet.
    fn create(&self, lease: &Lease) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Takes `lease` (as last read) for `owner`: succeeds only if its counter is unchanged.
    fn take(&self, lease: &Lease, owner: &str, expires_at_ms: u64) -> impl Future<Output = Result<Option<Lease>, StateError>> + Send;
    fn renew(&self, shard_id: &str, owner: &str, counter: u64, expires_at_ms: u64)
        -> impl Future<Output = Result<bool, StateError>> + Send;
    fn checkpoint(
        &self,
        shard_id: &str,
        owner: &str,
        counter: u64,
        progress: &Progress,
    ) -> impl Future<Output = Result<bool, StateError>> + Send;
    fn release(&self, shard_id: &str, owner: &str, counter: u64) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Deletes a finished lease, if it is still as read (counter unchanged).
    fn delete(&self, lease: &Lease) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Records a request to reconcile everything (data was lost), kept until a full
    /// reconcile that started after it clears it.
    fn request_reconcile(&self, at_ms: u64) -> impl Future<Output = Result<(), StateError>> + Send;
    /// When the oldest pending request to reconcile everything was made, if one is pending.
    fn reconcile_request(&self) -> impl Future<Output = Result<Option<u64>, StateError>> + Send;
    /// Clears the request if every request was made at or before `started_ms` (a full
    /// reconcile that started then covered them); a request made during the run stays.
    fn clear_reconcile_request(&self, started_ms: u64) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Takes or renews a named lease that is no shard's (the reconcile schedule's): true when
    /// `owner` holds it until `until_ms` (it was free, expired at `now_ms`, or already its own).
    fn hold_named(&self, name: &str, owner: &str, until_ms: u64, now_ms: u64) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Gives a named lease up, if `owner` holds it.
    fn release_named(&self, name: &str, owner: &str) -> impl Future<Output = Result<(), StateError>> + Send;
    /// The rule fingerprints recorded (rule name -> fingerprint); None: never any (a
    /// deployment's first start).
    fn rule_fingerprints(&self) -> impl Future<Output = Result<Option<BTreeMap<String, String>>, StateError>> + Send;
    /// Records fingerprints (others already recorded stay).
    fn record_fingerprints(&self, fingerprints: &BTreeMap<String, String>) -> impl Future<Output = Result<(), StateError>> + Send;
    /// The committed rule definitions and the item's revision (every store advances it);
    /// None: nothing committed yet.
    fn definitions(&self) -> impl Future<Output = Result<Option<(definitions::Committed, u64)>, StateError>> + Send;
    /// Stores `committed` if the item's revision is still `revision` (None: no item yet);
    /// false when somebody stored another meanwhile.
    fn store_definitions(
        &self,
        committed: &definitions::Committed,
        revision: Option<u64>,
    ) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Publishes (or refreshes) a replica's heartbeat.
    fn publish_beat(&self, beat: &definitions::Beat) -> impl Future<Output = Result<(), StateError>> + Send;
    /// Every heartbeat in the table, expired ones included.
    fn beats(&self) -> impl Future<Output = Result<Vec<definitions::Beat>, StateError>> + Send;
    /// Removes a replica's heartbeat (at shutdown, or an expired one).
    fn drop_beat(&self, owner: &str) -> impl Future<Output = Result<(), StateError>> + Send;
    /// Records a copy fan-out job ([`crate::rules::copy::job`]) unless the table holds one
    /// for the same or a newer change of its source (false then): an older one is replaced.
    fn record_copy_job(&self, job: &CopyJob) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Every pending copy job.
    fn copy_jobs(&self) -> impl Future<Output = Result<Vec<StoredJob>, StateError>> + Send;
    /// Claims job `id` for `owner` until `until_ms`, if it still is `version`'s and nobody
    /// else holds it at `now_ms`.
    fn claim_copy_job(
        &self,
        id: &str,
        version: &str,
        owner: &str,
        until_ms: u64,
        now_ms: u64,
    ) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Moves job `id`'s cursor to `cursor`, with `found` copies so far, and renews the
    /// claim until `until_ms`: only if it still is `version`'s and `owner`'s.
    fn advance_copy_job(
        &self,
        id: &str,
        version: &str,
        owner: &str,
        step: &JobStep,
    ) -> impl Future<Output = Result<bool, StateError>> + Send;
    /// Ends job `id` if it still is `version`'s: deleted, or replaced by `next` (a follow-up).
    fn end_copy_job(&self, id: &str, version: &str, next: Option<&CopyJob>) -> impl Future<Output = Result<bool, StateError>> + Send;
}

/// One step of a copy job: where it goes on, and how long its runner holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStep {
    pub cursor: crate::rules::copy::job::Key,
    pub found: u64,
    pub until_ms: u64,
}

thread_local! {
    /// A simulated clock for this thread: (epoch ms at `start`, `start`). Only the
    /// deterministic simulation sets it, on a current-thread runtime with paused tokio time,
    /// so its epoch time moves with tokio's virtual clock.
    static SIMULATED: std::cell::Cell<Option<(u64, tokio::time::Instant)>> = const { std::cell::Cell::new(None) };
}

/// Makes [`now_ms`] on this thread follow tokio's (paused) clock from `epoch_ms` on; None
/// returns to the system clock.
pub fn simulate_clock(epoch_ms: Option<u64>) {
    SIMULATED.with(|c| c.set(epoch_ms.map(|e| (e, tokio::time::Instant::now()))));
}

/// Epoch milliseconds now.
pub fn now_ms() -> u64 {
    if let Some((epoch, start)) = SIMULATED.with(std::cell::Cell::get) {
        return epoch.saturating_add(u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX));
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
