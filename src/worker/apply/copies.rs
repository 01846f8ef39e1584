//! A batch's copies ([`crate::sink::copy`]): fanned out after its target writes and before its
//! checkpoint, so a crash anywhere replays them (the copies' versions skip what was written).

use serde_json::Value;

use super::{Applier, BatchOutcome, Letter};
use crate::rules::copy::{CopyChange, CopyRule};
use crate::sink::copy::{fan_out, FanOut};
use crate::sink::{AggregateStore, SinkError};
use crate::state::LeaseStore;
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
            let out = match fan_out(store, rule, change, shared.config.write_concurrency).await {
                Ok(out) => out,
                Err(e) => {
                    metrics::counter!(names::COPY_WRITES, "rule" => rule.name.to_string(), "outcome" => "error").increment(1);
                    return Err(BatchOutcome::Failed(e));
                }
            };
            self.copied(rule, &out);
            for (key, why) in &out.rejected {
                tracing::error!(shard = %self.shard(), rule = %rule.name, item = %serde_json::to_string(key).unwrap_or_default(), error = %why, "the table refused a copy; its source record is dead-lettered");
            }
            let refused = match (&out.query_refused, out.rejected.is_empty()) {
                (Some(why), _) => Some(format!("the table refused the query that finds the copies: {why}")),
                (None, false) => Some(rejected_message(&out)),
                (None, true) => None,
            };
            if let Some(message) = refused {
                let letter = Letter::new(record.clone(), names::COPY_REJECTED, message, vec![rule.name.to_string()], 1);
                self.send_letters(&[letter]).await.map_err(BatchOutcome::Failed)?;
            }
        }
        Ok(())
    }

    /// The metrics of one fan-out.
    fn copied(&self, rule: &CopyRule, out: &FanOut) {
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
        metrics::histogram!(names::COPY_FANOUT_ITEMS, "rule" => name).record(out.found as f64);
        metrics::counter!(names::WRITE_CAPACITY_UNITS).increment(out.write_capacity.round() as u64);
        self.shared.capacity_milli.fetch_add((out.write_capacity * 1000.0).round() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The letter's message: how many copies were refused, and the first few items with why.
fn rejected_message(out: &FanOut) -> String {
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
