//! A batch's copies ([`crate::sink::copy`]): fanned out after its target writes and before its
//! checkpoint, so a crash anywhere replays them (the copies' versions skip what was written).
//! A change writes its first `copy.inline_items` copies here; the rest of its fan-out, and the
//! follow-up of a fan-out through an index, is recorded as a job ([`crate::rules::copy::job`])
//! before the checkpoint moves, and runs beside the readers ([`crate::worker::jobs`]).

use serde_json::Value;

use super::{Applier, BatchOutcome, Letter};
use crate::rules::copy::job::CopyJob;
use crate::rules::copy::{CopyChange, CopyRule};
use crate::sink::copy::{fan_out_page, FanOut};
use crate::sink::{AggregateStore, SinkError};
use crate::state::{now_ms, LeaseStore};
use crate::stream::StreamSource;
use crate::telemetry::names;

/// Refused copy items named in one letter.
const REJECTED_NAMED: usize = 10;

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> Applier<S, L, A> {
    /// Fans out each change of the batch, one source after the other. A copy item the table
    /// refuses is dead-lettered with the source record and the item's key; the others go on.
    pub(super) async fn copy(&mut self, copies: &[(usize, CopyChange, Value)]) -> Result<(), BatchOutcome> {
        if copies.is_empty() {
            return Ok(());
        }
        let shared = self.shared.clone();
        let Some(store) = shared.copies.as_deref() else {
            return Err(BatchOutcome::Failed(SinkError::Fatal("copy rules, but no table to write their copies to".into())));
        };
        for (i, change, record) in copies {
            let Some(rule) = shared.engine.copies.get(*i) else { continue };
            // A replica that lost its lease writes no more: the new owner replays the batch.
            if !self.lease.valid() {
                return Err(BatchOutcome::LeaseLost);
            }
            let out = match fan_out_page(store, rule, change, shared.config.write_concurrency, None, rule.inline_items).await {
                Ok(out) => out,
                Err(e) => {
                    metrics::counter!(names::COPY_WRITES, "rule" => rule.name.to_string(), "outcome" => "error").increment(1);
                    return Err(BatchOutcome::Failed(e));
                }
            };
            let ends = out.next.is_none().then_some(out.found);
            copied(&self.shared.capacity_milli, rule, &out, ends);
            let mut unrecorded = None;
            if let Some(job) = job_for(rule, change, &out, now_ms()) {
                match self.shared.leases.record_copy_job(&job).await {
                    Ok(_) => {}
                    Err(e) if e.is_retriable() => return Err(BatchOutcome::Failed(SinkError::Transient(e.to_string()))),
                    // Refused for good (an item over 400 KB: copied values that large): the rest
                    // of the fan-out is dead-lettered, never a batch retried forever.
                    Err(e) => {
                        unrecorded =
                            Some(format!("the rest of the fan-out (after {} copies) could not be recorded as a job: {e}", out.found))
                    }
                }
            }
            for (key, why) in &out.rejected {
                tracing::error!(shard = %self.shard(), rule = %rule.name, item = %serde_json::to_string(key).unwrap_or_default(), error = %why, "the table refused a copy; its source record is dead-lettered");
            }
            let refused = match (&out.query_refused, out.rejected.is_empty()) {
                (Some(why), _) => Some(format!("the table refused the query that finds the copies: {why}")),
                (None, false) => Some(rejected_message(&out)),
                (None, true) => unrecorded,
            };
            if let Some(message) = refused {
                let letter = Letter::new(record.clone(), names::COPY_REJECTED, message, vec![rule.name.to_string()], 1);
                self.send_letters(&[letter]).await.map_err(BatchOutcome::Failed)?;
            }
        }
        Ok(())
    }
}

/// The metrics of one page or more of a fan-out, and its capacity in `capacity_milli`;
/// `ends`: the fan-out ended here, having found that many copies in all.
pub(crate) fn copied(capacity_milli: &std::sync::atomic::AtomicU64, rule: &CopyRule, out: &FanOut, ends: Option<u64>) {
    let name = rule.name.to_string();
    let outcomes = [
        ("written", out.written),
        ("older", out.older),
        ("gone", out.gone),
        ("rejected", out.rejected.len() as u64),
        ("superseded", u64::from(out.superseded)),
    ];
    for (outcome, n) in outcomes {
        metrics::counter!(names::COPY_WRITES, "rule" => name.clone(), "outcome" => outcome).increment(n);
    }
    if let Some(found) = ends {
        metrics::histogram!(names::COPY_FANOUT_ITEMS, "rule" => name).record(found as f64);
    }
    metrics::counter!(names::WRITE_CAPACITY_UNITS).increment(out.write_capacity.round() as u64);
    capacity_milli.fetch_add((out.write_capacity * 1000.0).round() as u64, std::sync::atomic::Ordering::Relaxed);
}

/// The job a change's fan-out leaves, after the batch wrote its first page (pure): the rest of
/// its pages, or the re-run of a fan-out through an index; none when the source changed since
/// (the newer change fans out itself) or the query was refused.
pub fn job_for(rule: &CopyRule, change: &CopyChange, out: &FanOut, now_ms: u64) -> Option<CopyJob> {
    if out.superseded || out.query_refused.is_some() {
        return None;
    }
    match &out.next {
        Some(next) => Some(CopyJob::rest(&rule.name, change.clone(), next.clone(), out.found, now_ms)),
        None if rule.to.index.is_some() => Some(CopyJob::follow_up(&rule.name, change.clone(), now_ms)),
        None => None,
    }
}

/// The letter's message: how many copies were refused, and the first few items with why.
pub(crate) fn rejected_message(out: &FanOut) -> String {
    let named: Vec<String> = out
        .rejected
        .iter()
        .take(REJECTED_NAMED)
        .map(|(key, why)| format!("{}: {why}", serde_json::to_string(key).unwrap_or_default()))
        .collect();
    let more = out.rejected.len().saturating_sub(REJECTED_NAMED);
    let tail = if more > 0 { format!("; and {more} more") } else { String::new() };
    format!("the table refused {} of the {} copies this change sets: {}{tail}", out.rejected.len(), out.found, named.join("; "))
}
