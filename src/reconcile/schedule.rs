//! The reconcile schedule inside `run`: every `reconcile.interval`, one replica at a time (a
//! lease item in the state table) reconciles the targets it wrote since its last run, or
//! everything when so configured or when data was lost (trimmed stream data).

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Options, Reconciler};
use crate::state::now_ms;
use crate::worker::Shared;

/// The state-table item that serialises scheduled runs across replicas (it has no
/// `stream_arn`, so it is never taken for a shard lease).
pub const SCHEDULE_LEASE: &str = "reconcile-schedule";

async fn acquire(ddb: &Client, table: &str, owner: &str, hold: Duration) -> bool {
    let now = now_ms();
    let until = now + u64::try_from(hold.as_millis()).unwrap_or(u64::MAX / 2);
    ddb.update_item()
        .table_name(table)
        .key("shard_id", AttributeValue::S(SCHEDULE_LEASE.into()))
        .update_expression("SET #o = :me, #e = :until")
        .condition_expression("attribute_not_exists(#o) OR #o = :me OR #e < :now")
        .expression_attribute_names("#o", "owner")
        .expression_attribute_names("#e", "expires_at")
        .expression_attribute_values(":me", AttributeValue::S(owner.into()))
        .expression_attribute_values(":until", AttributeValue::N(until.to_string()))
        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
        .send()
        .await
        .is_ok()
}

async fn release(ddb: &Client, table: &str, owner: &str) {
    let _ = ddb
        .update_item()
        .table_name(table)
        .key("shard_id", AttributeValue::S(SCHEDULE_LEASE.into()))
        .update_expression("REMOVE #o")
        .condition_expression("#o = :me")
        .expression_attribute_names("#o", "owner")
        .expression_attribute_values(":me", AttributeValue::S(owner.into()))
        .send()
        .await;
}

pub async fn run_schedule<S, L: crate::state::LeaseStore, A>(
    shared: Arc<Shared<S, L, A>>,
    reconciler: Reconciler,
    ddb: Client,
    interval: Option<Duration>,
    cancel: CancellationToken,
) {
    let table = shared.config.state.table.clone();
    let check = interval.map_or(Duration::from_secs(5), |i| Duration::from_secs(5).min(i));
    let mut since = Duration::ZERO;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(check) => {}
        }
        since += check;
        // A persisted request (data was lost) runs a full reconcile even with the schedule
        // off (interval 0s), and after restarts.
        let requested = shared.leases.reconcile_request().await.ok().flatten();
        metrics::gauge!(crate::telemetry::names::RECONCILE_REQUESTED).set(if requested.is_some() { 1.0 } else { 0.0 });
        if requested.is_none() && interval.is_none_or(|i| since < i) {
            continue;
        }
        since = Duration::ZERO;
        let hold = interval.unwrap_or(Duration::ZERO).max(Duration::from_secs(60)) * 2;
        if !acquire(&ddb, &table, &shared.owner, hold).await {
            continue;
        }
        let started_ms = now_ms();
        let all = shared.config.reconcile_all || requested.is_some();
        let touched = std::mem::take(&mut *shared.touched.lock().unwrap_or_else(|e| e.into_inner()));
        let opts = Options { wait: Duration::from_secs(120), ..Options::default() };
        let mut retry: Vec<(String, crate::rules::TargetKey)> = Vec::new();
        let (mut drifts, mut corrected) = (0, 0);
        let result: Result<(), String> = async {
            if all {
                let r = reconciler.run(&Options { all: true, ..opts.clone() }).await?;
                drifts += r.drifts.len();
                corrected += r.drifts.iter().filter(|d| d.corrected).count();
                retry.extend(r.not_quiet);
            } else {
                for (rule, targets) in touched.iter() {
                    let r = reconciler.run_targets(rule, targets.clone(), &opts).await?;
                    drifts += r.drifts.len();
                    corrected += r.drifts.iter().filter(|d| d.corrected).count();
                    retry.extend(r.not_quiet);
                }
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                info!(all, drifts, corrected, not_quiet = retry.len(), "scheduled reconcile done");
                // Targets not quiet were not repaired: the request stays for the next run.
                if requested.is_some() && retry.is_empty() {
                    if let Err(e) = shared.leases.clear_reconcile_request(started_ms).await {
                        warn!(error = %e, "cannot clear the reconcile request; the next round runs it again");
                    }
                }
            }
            Err(e) => {
                metrics::counter!(crate::telemetry::names::RECONCILE_RUNS, "outcome" => "error").increment(1);
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
        release(&ddb, &table, &shared.owner).await;
    }
}
