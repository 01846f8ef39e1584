//! Telemetry: metric names ([`names`]), the Prometheus exporter with health endpoints, and
//! logging.

pub mod held;
pub mod names;
pub mod probe;
pub mod process;
pub mod push;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What `/readyz` reports: the config is loaded, AWS answered, and leases are being renewed.
#[derive(Debug, Default)]
pub struct Health {
    pub aws_reachable: AtomicBool,
    /// Epoch ms of the last completed lease-maintenance round.
    pub last_maintenance_ms: AtomicU64,
    /// Maintenance rounds older than this make the replica unready.
    pub maintenance_deadline_ms: AtomicU64,
    /// Epoch ms when the worker loop last started a maintenance round (successful or not:
    /// AWS being slow or down is no reason to restart the process).
    pub last_tick_ms: AtomicU64,
}

/// How long the worker loop may go without a maintenance round before `/healthz` fails and
/// the orchestrator restarts the process: ten lease durations, at least two minutes.
pub fn live_deadline_ms(lease_ms: u64) -> u64 {
    lease_ms.saturating_mul(10).max(120_000)
}

impl Health {
    /// The worker loop made a step (a maintenance round began, or one of its calls returned,
    /// successful or not).
    pub fn beat(&self) {
        self.last_tick_ms.store(crate::state::now_ms(), Ordering::Relaxed);
    }

    /// `/healthz`: the worker loop is turning (before its first round, during start-up, yes).
    pub fn alive(&self, now_ms: u64, deadline_ms: u64) -> bool {
        let last = self.last_tick_ms.load(Ordering::Relaxed);
        last == 0 || now_ms.saturating_sub(last) <= deadline_ms
    }

    pub fn ready(&self, now_ms: u64) -> bool {
        let last = self.last_maintenance_ms.load(Ordering::Relaxed);
        self.aws_reachable.load(Ordering::Relaxed)
            && last > 0
            && now_ms.saturating_sub(last) <= self.maintenance_deadline_ms.load(Ordering::Relaxed)
    }
}

/// A batch phase is milliseconds at the tip: finer buckets below 100 ms.
const PHASE_BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.175, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Writes in flight: powers of two up to `aggregates.write_concurrency`'s most.
const IN_FLIGHT_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Installs the global recorder. Histograms get buckets; gauges that stop being updated
/// (shards this replica no longer reads) disappear after `gauge_idle`.
pub fn install_metrics(gauge_idle: Duration) -> Result<PrometheusHandle, String> {
    let buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(names::BATCH_DURATION_SECONDS.into()), &buckets)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(names::END_TO_END_LAG_SECONDS.into()), &buckets))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(names::BATCH_PHASE_SECONDS.into()), &PHASE_BUCKETS))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(names::BATCH_WRITES_IN_FLIGHT.into()), &IN_FLIGHT_BUCKETS))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(names::PARTITION_PACING_SECONDS.into()), &PHASE_BUCKETS))
        .map_err(|e| e.to_string())?
        .idle_timeout(metrics_util::MetricKindMask::GAUGE, Some(gauge_idle))
        .install_recorder()
        .map_err(|e| e.to_string())?;
    names::describe();
    process::describe();
    metrics::gauge!(names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    Ok(handle)
}

/// Serves `/metrics`, `/healthz` and `/readyz` until cancelled. Minimal HTTP/1.1: one request
/// per connection, bounded request size and time.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle, health: Arc<Health>, cancel: CancellationToken) {
    let upkeep = handle.clone();
    let upkeep_cancel = cancel.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = upkeep_cancel.cancelled() => return,
                _ = tick.tick() => {
                    held::refresh();
                    process::export(&process::read());
                    upkeep.run_upkeep();
                }
            }
        }
    });
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((mut socket, _)) = accepted else { continue };
        let handle = handle.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let read = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buf)).await;
            let Ok(Ok(n)) = read else { return };
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let (status, content_type, body) = match path {
                "/metrics" => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", handle.render()),
                "/healthz"
                    if health.alive(crate::state::now_ms(), live_deadline_ms(health.maintenance_deadline_ms.load(Ordering::Relaxed))) =>
                {
                    ("200 OK", "text/plain", "ok\n".to_string())
                }
                "/healthz" => ("503 Service Unavailable", "text/plain", "the worker loop has stopped turning\n".to_string()),
                "/readyz" if health.ready(crate::state::now_ms()) => ("200 OK", "text/plain", "ready\n".to_string()),
                "/readyz" => ("503 Service Unavailable", "text/plain", "not ready\n".to_string()),
                _ => ("404 Not Found", "text/plain", "not found: try /metrics, /healthz, /readyz\n".to_string()),
            };
            let head =
                format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
            let _ = socket.shutdown().await;
        });
    }
}

/// Records a successful reconcile. The gauge is held ([`held`]), so the idle timeout that
/// drops gauges of shards no longer read never drops it, and `ReconcileNotSucceeding` sees its
/// value age.
pub fn reconcile_succeeded(now_ms: u64) {
    held::set(names::RECONCILE_LAST_SUCCESS, Vec::new(), now_ms as f64 / 1000.0);
}

/// Counts what a sweep of expired helper items did at `now_s`, and how far behind it is.
pub fn helper_deletes(swept: &crate::sink::expiry::Swept, now_s: u64) {
    metrics::counter!(names::HELPER_DELETES, "outcome" => "deleted").increment(swept.deleted);
    metrics::counter!(names::HELPER_DELETES, "outcome" => "kept").increment(swept.kept);
    metrics::counter!(names::HELPER_DELETES, "outcome" => "failed").increment(swept.failed + swept.unread);
    let lag = swept.oldest_due.map_or(0, |at| now_s.saturating_sub(at));
    held::set(names::HELPER_SWEEP_LAG, Vec::new(), lag as f64);
}

/// This replica's round read no pending item (another holds the sweep's lease, the lease or
/// every partition could not be read, or it does not run the committed definitions): its lag
/// gauge goes after the idle timeout, so a stale value never stands for a sweep that is not
/// running here.
pub fn helper_sweep_not_here() {
    held::release(names::HELPER_SWEEP_LAG);
}

/// Helper items per rule (`rule`, live, zero) as a reconcile of everything read them, held
/// until the next replaces them all (a rule gone from the config goes with it).
pub fn helper_items<'a>(rules: impl IntoIterator<Item = (&'a str, u64, u64)>) {
    held::release(names::HELPER_ITEMS);
    for (rule, live, zero) in rules {
        for (state, n) in [("live", live), ("zero", zero)] {
            held::set(names::HELPER_ITEMS, vec![("rule", rule.to_string()), ("state", state.to_string())], n as f64);
        }
    }
}

/// A sweep that could read no pending item at all.
pub fn helper_sweep_failed() {
    metrics::counter!(names::HELPER_DELETES, "outcome" => "failed").increment(u64::from(crate::sink::expiry::PENDING_PARTITIONS));
}

/// Binds the metrics address (an error names it, e.g. when the port is taken).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))
}

/// JSON or text logs on stderr, levels from RUST_LOG (default info).
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,aws_config=warn,aws_smithy_runtime=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    if json {
        let _ = builder.json().flatten_event(true).with_current_span(false).try_init();
    } else {
        let _ = builder.try_init();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_fails_only_when_the_loop_stops_turning() {
        let h = Health::default();
        let deadline = live_deadline_ms(10_000);
        assert_eq!(deadline, 120_000);
        assert_eq!(live_deadline_ms(60_000), 600_000);
        assert!(h.alive(1_000_000, deadline), "before the first round (start-up)");
        h.last_tick_ms.store(1_000_000, Ordering::Relaxed);
        assert!(h.alive(1_000_000 + deadline, deadline));
        assert!(!h.alive(1_000_001 + deadline, deadline), "wedged");
    }
}
