//! The reconcile schedule inside `run`: every `reconcile.interval`, one replica at a time (a
//! named lease in the state table, through the worker's lease store, renewed while it runs)
//! reconciles the targets it wrote since its last run, or
//! everything when so configured or when data was lost (trimmed stream data).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Options, Reconciler};
use crate::state::now_ms;
use crate::worker::Shared;

/// The state-table item that serialises scheduled runs across replicas (it has no
/// `stream_arn`, so it is never taken for a shard lease).
pub const SCHEDULE_LEASE: &str = "reconcile-schedule";

pub async fn run_schedule<S, L: crate::state::LeaseStore, A>(
    shared: Arc<Shared<S, L, A>>,
    reconciler: Reconciler,
    interval: Option<Duration>,
    cancel: CancellationToken,
) {
    let check = interval.map_or(Duration::from_secs(5), |i| Duration::from_secs(5).min(i));
    let mut since = Duration::ZERO;
    // Runs that failed or left a requested repair unfinished, in a row: the next waits longer.
    let mut failures: u32 = 0;
    let mut not_before = tokio::time::Instant::now();
    // When the full run of a requested repair started that left targets not quiet (written
    // all through it): only those are retried, as targets, until every one was compared.
    let mut partial: Option<Partial> = None;
    // Rules added or changed and old definitions retired: first, with the schedule on or off.
    let mut rebuilds = Rebuilds::default();
    rebuilds.step(&shared, &reconciler).await;
    loop {
        tokio::select! {
            biased; // deterministic: a simulation's seed replays exactly
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(check) => {}
        }
        rebuilds.step(&shared, &reconciler).await;
        since += check;
        // A persisted request (data was lost) runs a full reconcile even with the schedule
        // off (interval 0s), and after restarts.
        let requested = shared.leases.reconcile_request().await.ok().flatten();
        metrics::gauge!(crate::telemetry::names::RECONCILE_REQUESTED).set(if requested.is_some() { 1.0 } else { 0.0 });
        if requested.is_none() && interval.is_none_or(|i| since < i) {
            continue;
        }
        if tokio::time::Instant::now() < not_before {
            continue;
        }
        since = Duration::ZERO;
        if !hold(&*shared, HOLD).await {
            continue;
        }
        let started_ms = now_ms();
        let all = covers_all(shared.config.reconcile_all, requested.is_some(), partial.as_ref());
        // A replica whose watcher has not seen a new stream yet reads the old one: a repair
        // from its view waits for the wrong shards, so it leaves the request to the others.
        if requested.is_some() && !reconciler.reads_the_current_stream().await {
            let _ = shared.leases.release_named(SCHEDULE_LEASE, &shared.owner).await;
            continue;
        }
        let touched = std::mem::take(&mut *shared.touched.lock().unwrap_or_else(|e| e.into_inner()));
        // A requested repair also fences the targets it finds right: the request may come
        // from a stream change, with a reader of the old stream still writing.
        // Holds only while this replica runs the committed definitions and protocol (3 or
        // later): then every replica that writes honours them.
        let holds = shared.definitions_current.load(std::sync::atomic::Ordering::Acquire);
        let opts = Options { wait: shared.config.reconcile_wait, fence_all: requested.is_some(), holds, ..Options::default() };
        let mut retry: Vec<(String, crate::rules::TargetKey)> = Vec::new();
        let (mut drifts, mut corrected, mut checked) = (0, 0, 0);
        let mut by_empty_pages = std::collections::BTreeSet::new();
        let run_started = std::time::Instant::now();
        let run = async {
            if all {
                let r = reconciler.run(&Options { all: true, ..opts.clone() }).await?;
                crate::telemetry::helper_items(r.helpers.iter().map(|(rule, c)| (rule.as_str(), c.live, c.zero)));
                checked += r.targets_checked;
                by_empty_pages.extend(r.by_empty_pages);
                drifts += r.drifts.len();
                corrected += r.drifts.iter().filter(|d| d.corrected).count();
                retry.extend(r.not_quiet);
                retry.extend(r.failed.into_iter().map(|(rule, key, _)| (rule, key)));
            } else {
                for (rule, targets) in touched.iter() {
                    let r = reconciler.run_targets(rule, targets.clone(), &opts).await?;
                    checked += r.targets_checked;
                    by_empty_pages.extend(r.by_empty_pages);
                    drifts += r.drifts.len();
                    corrected += r.drifts.iter().filter(|d| d.corrected).count();
                    retry.extend(r.not_quiet);
                    retry.extend(r.failed.into_iter().map(|(rule, key, _)| (rule, key)));
                }
            }
            Ok::<(), super::ReconcileError>(())
        };
        let result = renewing(&*shared, run).await;
        let unfinished = result.is_err() || (requested.is_some() && !retry.is_empty());
        failures = if unfinished { failures.saturating_add(1) } else { 0 };
        not_before = tokio::time::Instant::now() + retry_after(failures);
        match result {
            Ok(()) => {
                // One success per round, over every rule, and a round with nothing to check
                // is one too (a quiet table is not a failing reconcile).
                if retry.is_empty() && corrected == drifts {
                    crate::telemetry::reconcile_succeeded(now_ms());
                }
                let seconds = run_started.elapsed().as_secs_f64();
                let by_empty_pages = by_empty_pages.len();
                info!(
                    all,
                    targets = checked,
                    seconds,
                    drifts,
                    corrected,
                    not_quiet = retry.len(),
                    by_empty_pages,
                    "scheduled reconcile done"
                );
                // Targets not quiet were not repaired: the request stays (a restart runs it
                // whole again), and the next runs retry only them.
                if requested.is_some() && retry.is_empty() {
                    if let Err(e) = shared.leases.clear_reconcile_request(partial.map_or(started_ms, |p| p.started_ms)).await {
                        warn!(error = %e, "cannot clear the reconcile request; the next round runs it again");
                    }
                    partial = None;
                } else if requested.is_some() {
                    partial = next_partial(partial, all, started_ms);
                }
            }
            Err(e) => {
                metrics::counter!(crate::telemetry::names::RECONCILE_RUNS, "outcome" => crate::telemetry::names::RunOutcome::Error.as_str())
                    .increment(1);
                warn!(error = %e, "scheduled reconcile failed; its targets are kept for the next run");
                let mut t = shared.touched.lock().unwrap_or_else(|e| e.into_inner());
                for (rule, targets) in touched {
                    t.entry(rule).or_default().extend(targets);
                }
            }
        }
        {
            let mut t = shared.touched.lock().unwrap_or_else(|e| e.into_inner());
            for (rule, key) in retry {
                t.entry(rule).or_default().insert(key);
            }
        }
        let _ = shared.leases.release_named(SCHEDULE_LEASE, &shared.owner).await;
    }
}

/// The rebuilds of rules added or changed and the retirement of old definitions, as the
/// schedule carries them out ([`super::rebuild`]).
#[derive(Default)]
struct Rebuilds {
    failures: u32,
    not_before: Option<tokio::time::Instant>,
    progress: super::rebuild::Progress,
}

impl Rebuilds {
    /// While this replica runs the committed definitions, and holding the schedule's lease,
    /// does what is left of their rebuilds and retirements (another replica may have done
    /// it). An unfinished step waits as long as a failed reconcile.
    async fn step<S, L: crate::state::LeaseStore, A>(&mut self, shared: &Shared<S, L, A>, reconciler: &Reconciler) {
        let current = shared.definitions_current.load(std::sync::atomic::Ordering::Acquire);
        if !current || self.not_before.is_some_and(|t| tokio::time::Instant::now() < t) {
            return;
        }
        // One read every few seconds: a new generation (this replica gone and back, a
        // rollback) brings new work at any time.
        let remove_after_ms = u64::try_from(shared.config.remove_leftovers_after.as_millis()).unwrap_or(u64::MAX);
        match shared.leases.definitions().await {
            // Zeroed leftovers wait for their removal to be due.
            Ok(Some((c, _))) if c.settled() && c.removal_due_ms(remove_after_ms).is_none_or(|due| crate::state::now_ms() < due) => return,
            Ok(None) => return,
            Ok(Some(_)) => {}
            Err(e) => {
                warn!(error = %e, "cannot read the committed rule definitions; trying again");
                return self.failed();
            }
        }
        if !hold(shared, HOLD).await {
            return; // another replica rebuilds
        }
        let wait = shared.config.reconcile_wait;
        let stepped = renewing(shared, super::rebuild::step(reconciler, &shared.leases, &mut self.progress, wait)).await;
        // Targets left to retry alone are this replica's progress (kept in memory): it keeps
        // the lease (for at most its hold) so the next step is its own, not another replica's
        // full pass from the start.
        if !stepped.as_ref().is_ok_and(|s| s.retrying) {
            let _ = shared.leases.release_named(SCHEDULE_LEASE, &shared.owner).await;
        }
        match stepped {
            Ok(s) => {
                let mut t = shared.touched.lock().unwrap_or_else(|e| e.into_inner());
                for (rule, key) in s.skipped {
                    t.entry(rule).or_default().insert(key);
                }
                if s.settled && !s.removal_left {
                    self.failures = 0;
                } else if s.retrying {
                    // Progress: targets left by a pass are retried alone, soon.
                    self.not_before = Some(tokio::time::Instant::now() + Duration::from_secs(5));
                } else {
                    self.failed();
                }
            }
            Err(e) => {
                warn!(error = %e, "cannot read or store the committed rule definitions; trying again");
                self.failed();
            }
        }
    }

    fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
        self.not_before = Some(tokio::time::Instant::now() + retry_after(self.failures));
    }
}

/// Whether a scheduled run reconciles everything (pure): when so configured, or for a pending
/// request to repair everything, unless that request's full run is done (`partial`: when it
/// started) and left only targets that were written all through it, which the next runs
/// retry alone. A hot target (today's global total) is never quiet while writes flow, and a
/// full scan every few minutes until it cools down repaired nothing more.
pub fn covers_all(reconcile_all: bool, requested: bool, partial: Option<&Partial>) -> bool {
    reconcile_all || (requested && partial.is_none())
}

/// A requested repair whose full run left targets not quiet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partial {
    /// When its full run started (the request is cleared as of then).
    pub started_ms: u64,
    /// Targeted retries since.
    pub retries: u32,
}

/// Targeted retries of one requested repair before the next full run: a request made after
/// the full run started (more data lost) needs a full run of its own, and a target that never
/// quiets down (or cannot be written) must not hold it back for ever.
pub const MAX_TARGETED_RETRIES: u32 = 5;

/// The repair's state after an unfinished run (pure): a full run starts the retries; each
/// targeted one counts, and past [`MAX_TARGETED_RETRIES`] the next run is full again.
pub fn next_partial(partial: Option<Partial>, was_full: bool, started_ms: u64) -> Option<Partial> {
    match partial {
        _ if was_full => Some(Partial { started_ms, retries: 0 }),
        Some(p) if p.retries + 1 < MAX_TARGETED_RETRIES => Some(Partial { retries: p.retries + 1, ..p }),
        _ => None,
    }
}

/// How long the schedule waits after `failures` unfinished runs in a row before the next: 0
/// after a good run, then 5 s doubling up to 15 minutes, so a target that cannot be corrected
/// (or a table that refuses every read) does not rerun a full reconcile every few seconds.
pub fn retry_after(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let cap = Duration::from_secs(15 * 60);
    Duration::from_secs(5).checked_mul(1u32.checked_shl(failures - 1).unwrap_or(u32::MAX)).map_or(cap, |d| d.min(cap))
}

/// How long the schedule lease is held between renewals.
const HOLD: Duration = Duration::from_secs(120);

async fn hold<S, L: crate::state::LeaseStore, A>(shared: &Shared<S, L, A>, d: Duration) -> bool {
    let now = now_ms();
    let until = now + u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 2);
    shared.leases.hold_named(SCHEDULE_LEASE, &shared.owner, until, now).await.unwrap_or(false)
}

/// Runs `work` while renewing the schedule lease every third of its hold, so a run longer than
/// the hold is not taken over by another replica midway. (Losing it is no danger to the data:
/// corrections are conditional; the lease only spares duplicate work.)
async fn renewing<S, L: crate::state::LeaseStore, A, T>(shared: &Shared<S, L, A>, work: impl std::future::Future<Output = T>) -> T {
    tokio::pin!(work);
    let mut tick = tokio::time::interval(HOLD / 3);
    tick.tick().await;
    loop {
        tokio::select! {
            biased;
            out = &mut work => return out,
            _ = tick.tick() => {
                if !hold(shared, HOLD).await {
                    warn!("the reconcile schedule's lease was taken over; finishing this run");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_repair_scans_once_then_retries_only_what_was_not_quiet() {
        assert!(!covers_all(false, false, None), "touched targets only");
        assert!(covers_all(false, true, None), "a request: everything");
        let p = Partial { started_ms: 5, retries: 0 };
        assert!(!covers_all(false, true, Some(&p)), "its full run is done: only the targets not quiet then");
        assert!(covers_all(true, false, Some(&p)), "configured to reconcile everything");
        let mut state = next_partial(None, true, 5);
        assert_eq!(state, Some(p), "a full run starts the retries");
        let mut retries = 0;
        while state.is_some() {
            state = next_partial(state, false, 99);
            retries += 1;
        }
        assert_eq!(retries, MAX_TARGETED_RETRIES, "then a full run again: a later request is not held back for ever");
    }

    #[test]
    fn unfinished_runs_back_off_to_fifteen_minutes() {
        let secs: Vec<u64> = [0, 1, 2, 3, 8, 9, 10, 31, 32, 33, u32::MAX].iter().map(|&f| retry_after(f).as_secs()).collect();
        assert_eq!(secs, [0, 5, 10, 20, 640, 900, 900, 900, 900, 900, 900]);
    }
}
