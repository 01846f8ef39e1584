//! Writing aggregates: one conditional UpdateItem per target item and batch, guarded by the
//! idempotency ledger ([`ledger`]), behind a narrow [`AggregateStore`] trait.

pub mod dead_letter;
pub mod dynamodb;
pub mod ledger;
pub mod memory;

use std::future::Future;
use std::time::Duration;

use crate::decimal::Decimal;
use crate::rules::{TargetDelta, TargetKey};
use ledger::{entry_sequence, entry_value, plan, WritePlan};

/// One ledger-guarded write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerWrite {
    /// (attribute, value) of the target's key, partition key first.
    pub key: Vec<(String, String)>,
    pub adds: Vec<(String, Decimal)>,
    pub entry_name: String,
    pub entry_value: String,
    /// Padded first sequence number of the write: the entry must be below it.
    pub first: String,
    /// This shard's creation time as a floor value; None for shard ids without one.
    pub shard_floor: Option<String>,
    /// Ledger entries of finished shards to remove, with the floor to set (at most this
    /// shard's own floor). The write then requires the item's floor to be at most the new one.
    pub prune: Vec<String>,
    pub new_floor: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WriteOutcome {
    /// `entries`: the ledger entry names the item holds after the write.
    Applied { capacity: f64, entries: Vec<String> },
    /// The condition failed: the item's current entry and floor.
    Stale { entry: Option<String>, floor: Option<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Throttling, timeouts, 5xx: retry.
    #[error("transient write error: {0}")]
    Transient(String),
    /// The write can never succeed as it is (a measure attribute holding a string, ...).
    #[error("write refused: {0}")]
    Invalid(String),
    #[error("write error: {0}")]
    Fatal(String),
}

impl SinkError {
    pub fn is_retriable(&self) -> bool {
        matches!(self, SinkError::Transient(_))
    }
}

pub trait AggregateStore: Send + Sync + 'static {
    fn apply(&self, write: &LedgerWrite) -> impl Future<Output = Result<WriteOutcome, SinkError>> + Send;
}

/// What writing one target cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WriteStats {
    pub calls: u64,
    pub capacity: f64,
    /// Records whose effect was already in the item (replays).
    pub skipped_records: u64,
    pub applied_records: u64,
    /// Ledger entries the item still holds that belong to finished shards (to prune on the
    /// next write to it).
    pub prunable: Vec<String>,
    /// Entries removed by this write.
    pub pruned: usize,
    /// The item's ledger floor is above this shard: the write was a replay and was refused.
    pub fenced: bool,
    /// Calls whose ledger condition failed (records already applied).
    pub stale: u64,
}

/// The shard a batch comes from, and what the ledger may prune.
#[derive(Debug, Clone)]
pub struct ShardContext {
    pub entry_name: String,
    pub floor: Option<String>,
    /// Creation time (floor format) of the oldest shard still open: every shard created before
    /// it is finished, so its entries can go. None: unknown, prune nothing.
    pub open_floor: Option<String>,
}

impl ShardContext {
    pub fn new(shard_id: &str) -> ShardContext {
        ShardContext {
            entry_name: ledger::entry_name(shard_id),
            floor: crate::stream::shard_created_ms(shard_id).map(ledger::floor_value),
            open_floor: None,
        }
    }

    /// The floor a pruning write sets: the open floor, never above this (open) shard's own.
    fn prune_floor(&self) -> Option<&String> {
        Some(self.open_floor.as_ref()?.min(self.floor.as_ref()?))
    }

    /// Entries (by name) that belong to shards created before the prune floor.
    fn prunable(&self, entries: &[String]) -> Vec<String> {
        let Some(limit) = self.prune_floor() else { return Vec::new() };
        entries
            .iter()
            .filter(|e| **e != self.entry_name)
            .filter(|e| ledger::entry_created_ms(e).map(ledger::floor_value).is_some_and(|c| c < *limit))
            .cloned()
            .collect()
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
    write_target_pruning(store, key_names, key, delta, shard, Vec::new()).await
}

/// [`write_target`], also removing `prune` (entries of finished shards seen on this item
/// before) and raising the item's floor, in the same UpdateItem.
pub async fn write_target_pruning<S: AggregateStore>(
    store: &S,
    key_names: &[String],
    key: &TargetKey,
    delta: &TargetDelta,
    shard: &ShardContext,
    mut prune: Vec<String>,
) -> Result<WriteStats, SinkError> {
    let mut stats = WriteStats::default();
    let mut applied: Option<String> = None;
    let mut transient = 0;
    let total_records = delta.contributions.len() as u64;
    // Each stale round raises `applied` strictly, so this ends; the bound is a safety net.
    for _ in 0..64 {
        let Some(p): Option<WritePlan> = plan(&delta.contributions, applied.as_deref()).map_err(|e| SinkError::Fatal(e.to_string()))?
        else {
            stats.skipped_records = total_records - stats.applied_records;
            return Ok(stats);
        };
        let write = LedgerWrite {
            key: key_names.iter().cloned().zip(key.0.iter().map(|v| v.to_string())).collect(),
            adds: p.adds.clone(),
            entry_name: shard.entry_name.clone(),
            entry_value: entry_value(&p.last, p.newest_created),
            first: p.first.clone(),
            shard_floor: shard.floor.clone(),
            new_floor: if prune.is_empty() { None } else { shard.prune_floor().cloned() },
            prune: prune.clone(),
        };
        stats.calls += 1;
        match store.apply(&write).await {
            Ok(WriteOutcome::Applied { capacity, entries }) => {
                stats.capacity += capacity;
                stats.applied_records = p.records as u64;
                stats.skipped_records = total_records - stats.applied_records;
                stats.pruned = write.prune.len();
                stats.prunable = shard.prunable(&entries);
                return Ok(stats);
            }
            Ok(WriteOutcome::Stale { entry, floor }) => {
                stats.stale += 1;
                if let (Some(item_floor), Some(mine)) = (&floor, &shard.floor) {
                    if item_floor > mine {
                        // The item's floor passed this shard: the shard was finished (every
                        // record applied and checkpointed) when its entry was pruned, so this
                        // write is a replay. Refuse it; nothing is applied twice.
                        stats.fenced = true;
                        stats.skipped_records = total_records - stats.applied_records;
                        return Ok(stats);
                    }
                }
                if let (Some(item_floor), Some(new_floor)) = (&floor, &write.new_floor) {
                    if item_floor > new_floor {
                        // Another replica already raised the floor further: skip our pruning.
                        prune.clear();
                        continue;
                    }
                }
                match entry {
                    Some(e) if applied.as_deref().is_none_or(|a| entry_sequence(&e) > a) => applied = Some(entry_sequence(&e).to_string()),
                    // The condition failed but the entry does not explain it: a concurrent
                    // change; read again by retrying.
                    _ => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
            Err(e) if e.is_retriable() && transient < MAX_TRANSIENT_RETRIES => {
                transient += 1;
                tokio::time::sleep(backoff(transient)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(SinkError::Fatal("ledger write did not settle after 64 rounds".into()))
}

/// Exponential backoff with full jitter: 50 ms doubling, capped at 5 s.
pub fn backoff(attempt: u32) -> Duration {
    let cap = 50u64.saturating_mul(1u64 << attempt.min(7)).min(5_000);
    Duration::from_millis(fastrand::u64(cap / 2..=cap))
}
