//! Running copy fan-out jobs ([`crate::rules::copy::job`]) beside the shard readers: each
//! maintenance round lists the pending jobs, claims a few, and runs each in a task of its own,
//! page after page within its rule's capacity budget, so a large fan-out never holds a shard.
//!
//! Crash points: before a page (the claim lapses and a runner resumes from the cursor), after a
//! page's writes but before the cursor moves (the page is written again: every copy is at the
//! change's version, skipped), after the last page but before the job ends (the last page
//! again). A runner whose job was replaced by a newer change's, or claimed by another after its
//! claim lapsed, stops at its next step; writes it had in flight carry an older or the same
//! version, which the copies' conditions refuse or make no difference.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
// tokio's clock: the system's in the service, the simulated one in a simulation.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::Shared;
use crate::reconcile::budget;
use crate::rules::copy::job::{CopyJob, StoredJob};
use crate::rules::copy::CopyRule;
use crate::sink::copy::{fan_out_page, CopyStore, FanOut, JOB_PAGE_ITEMS};
use crate::sink::dead_letter::{DeadLetter, Reason};
use crate::sink::AggregateStore;
use crate::state::{now_ms, JobStep, LeaseStore, StateError};
use crate::stream::StreamSource;
use crate::telemetry::names;

/// Jobs one replica runs at once.
pub const JOBS_AT_ONCE: usize = 4;

/// How a job's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobExit {
    /// Every page written, the job ended (or replaced by its follow-up).
    Done,
    /// Another runner holds it, or a newer change replaced it.
    NotOurs,
    /// The source changed since (its newer change fans out itself): the job ended.
    Superseded,
    /// Stopped (shutdown): the claim lapses, another runner resumes.
    Stopped,
    /// A call failed: the next round retries from the cursor.
    Failed,
}

/// Runs one claimed job to its end, or until `stop`.
pub async fn run<S, L, A>(shared: Arc<Shared<S, L, A>>, stored: StoredJob, stop: CancellationToken) -> JobExit
where
    S: StreamSource,
    L: LeaseStore,
    A: AggregateStore,
{
    let job = stored.job;
    let (Some(store), Some(rule)) = (shared.copies.clone(), shared.engine.copies.iter().find(|r| *r.name == *job.rule)) else {
        return JobExit::NotOurs;
    };
    let runner = Runner { shared: &shared, store: store.as_ref(), rule, id: job.id(), version: job.version(), job: &job };
    let exit = runner.run(&stop).await;
    info!(job = %runner.id, rule = %rule.name, exit = ?exit, "copy job stopped");
    exit
}

struct Runner<'a, S, L, A> {
    shared: &'a Shared<S, L, A>,
    store: &'a dyn CopyStore,
    rule: &'a CopyRule,
    job: &'a CopyJob,
    id: String,
    version: String,
}

impl<S: StreamSource, L: LeaseStore, A: AggregateStore> Runner<'_, S, L, A> {
    fn lease_ms(&self) -> u64 {
        u64::try_from(self.shared.config.state.lease_duration.as_millis()).unwrap_or(u64::MAX)
    }

    async fn run(&self, stop: &CancellationToken) -> JobExit {
        let leases = &self.shared.leases;
        let owner = &self.shared.owner;
        let now = now_ms();
        match leases.claim_copy_job(&self.id, &self.version, owner, now + self.lease_ms(), now).await {
            Ok(true) => {}
            Ok(false) => return JobExit::NotOurs,
            Err(e) => return self.failed("claiming", &e),
        }
        let started = Instant::now();
        let (mut cursor, mut found, mut spent) = (self.job.cursor.clone(), self.job.found, 0.0);
        loop {
            if stop.is_cancelled() {
                return self.stop(cursor, found).await;
            }
            let in_flight = self.shared.config.write_concurrency;
            let out = match fan_out_page(self.store, self.rule, &self.job.change, in_flight, cursor.as_ref(), JOB_PAGE_ITEMS).await {
                Ok(out) => out,
                Err(e) => {
                    metrics::counter!(names::COPY_WRITES, "rule" => self.rule.name.to_string(), "outcome" => "error").increment(1);
                    warn!(job = %self.id, rule = %self.rule.name, error = %e, "copy job page failed; retried from its cursor");
                    return JobExit::Failed;
                }
            };
            found += out.found;
            let ends = out.next.is_none() || out.superseded || out.query_refused.is_some();
            super::apply::copies::copied(&self.shared.capacity_milli, self.rule, &out, ends.then_some(found));
            self.dead_letter(&out).await;
            spent += out.write_capacity;
            let Some(next) = out.next.clone().filter(|_| !ends) else { return self.end(&out).await };
            let step = JobStep { cursor: next.clone(), found, until_ms: now_ms() + self.lease_ms() };
            match leases.advance_copy_job(&self.id, &self.version, owner, &step).await {
                Ok(true) => cursor = Some(next),
                Ok(false) => return JobExit::NotOurs,
                Err(e) => return self.failed("moving the cursor of", &e),
            }
            if let Some(wait) = budget::delay(spent, self.rule.job_capacity_per_second, started.elapsed()) {
                // Within the claim: a longer wait is taken after the next page's renewal.
                let wait = wait.min(Duration::from_millis(self.lease_ms() / 2));
                tokio::select! {
                    _ = stop.cancelled() => return self.stop(cursor, found).await,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }

    /// Gives the claim up at a stop (shutdown), so another replica resumes at once.
    async fn stop(&self, cursor: Option<crate::rules::copy::job::Key>, found: u64) -> JobExit {
        if let Some(cursor) = cursor {
            let step = JobStep { cursor, found, until_ms: 0 };
            let _ = self.shared.leases.advance_copy_job(&self.id, &self.version, &self.shared.owner, &step).await;
        }
        JobExit::Stopped
    }

    /// Ends the job after its last page: removed, or replaced by its follow-up.
    async fn end(&self, out: &FanOut) -> JobExit {
        let follow_up = (self.rule.to.index.is_some() && !self.job.follow_up && !out.superseded && out.query_refused.is_none())
            .then(|| CopyJob::follow_up(&self.job.rule, self.job.change.clone(), now_ms()));
        match self.shared.leases.end_copy_job(&self.id, &self.version, follow_up.as_ref()).await {
            Ok(_) if out.superseded => JobExit::Superseded,
            Ok(_) => JobExit::Done,
            Err(e) => self.failed("ending", &e),
        }
    }

    fn failed(&self, doing: &str, e: &StateError) -> JobExit {
        warn!(job = %self.id, error = %e, "{doing} a copy job failed; the next round retries");
        JobExit::Failed
    }

    /// Copies the table refused, or a query it refused: dead-lettered with the source's keys
    /// and the change's sequence number (the job does not keep the record's images).
    async fn dead_letter(&self, out: &FanOut) {
        let message = match (&out.query_refused, out.rejected.is_empty()) {
            (Some(why), _) => format!("the table refused the query that finds the copies: {why}"),
            (None, false) => super::apply::copies::rejected_message(out),
            (None, true) => return,
        };
        let change = &self.job.change;
        error!(job = %self.id, rule = %self.rule.name, "copy job: {message}; its change is dead-lettered");
        let record = json!({
            "eventName": if change.deleted { "REMOVE" } else { "MODIFY" },
            "dynamodb": { "Keys": change.source, "SequenceNumber": change.version.sequence_number() },
        });
        let letter = DeadLetter {
            version: 1,
            reason: Reason { code: names::COPY_REJECTED.to_string(), message },
            rule: self.rule.name.to_string(),
            rules: vec![self.rule.name.to_string()],
            attempts: 1,
            first_failed_at: chrono::DateTime::<chrono::Utc>::from_timestamp_millis(i64::try_from(now_ms()).unwrap_or(0))
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                .unwrap_or_default(),
            stream_arn: self.shared.stream_arn.clone(),
            shard_id: String::new(),
            sequence_number: change.version.sequence_number().to_string(),
            variables: Default::default(),
            record,
            images_cut: true,
        };
        metrics::counter!(names::DEAD_LETTERS, "reason" => names::COPY_REJECTED).increment(1);
        if let Err(e) = self.shared.dead_letters.send(&letter).await {
            error!(job = %self.id, error = %e, "the copy job's dead letter could not be sent");
        }
    }
}

/// Jobs of this replica's copy rules in the state table: the pending-jobs gauges set, and the
/// ones to start now (claimed by the task that runs them).
pub async fn due<S, L, A>(shared: &Shared<S, L, A>, running: &std::collections::BTreeSet<String>) -> Result<Vec<StoredJob>, StateError>
where
    L: LeaseStore,
{
    let jobs = shared.leases.copy_jobs().await?;
    let now = now_ms();
    let (pending, oldest_ms) = crate::rules::copy::job::pending(&jobs, now);
    metrics::gauge!(names::COPY_JOBS_PENDING).set(pending as f64);
    metrics::gauge!(names::COPY_JOB_AGE).set(oldest_ms as f64 / 1000.0);
    let rules = shared.engine.copies.iter().map(|r| &*r.name).collect();
    let room = JOBS_AT_ONCE.saturating_sub(running.len());
    Ok(crate::rules::copy::job::to_start(&jobs, &shared.owner, running, &rules, room, now).into_iter().cloned().collect())
}
