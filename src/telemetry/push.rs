//! Pushing a batch job's results to a Prometheus Pushgateway (the nightly `reconcile --all`
//! CronJob lives shorter than a scrape interval). Plain `http://` only, as Pushgateways run
//! inside the cluster; POST, so a failed run keeps the last success time pushed before.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Pushgateway job the results are grouped under.
pub const JOB: &str = "ddb-aggregator-reconcile";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("{0:?} is not a Pushgateway address like http://pushgateway:9091")]
    BadUrl(String),
    #[error("cannot reach the Pushgateway at {0}: {1}")]
    Io(String, String),
    #[error("the Pushgateway answered {0}")]
    Refused(String),
}

/// What one run did, as pushed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobResult {
    pub succeeded: bool,
    pub finished_s: f64,
    pub seconds: f64,
    pub targets_checked: u64,
    pub items_read: u64,
    pub drifts: u64,
    pub corrected: u64,
    pub uncorrected: u64,
    /// Shards judged caught up by the empty-page rule alone.
    pub shards_by_empty_pages: u64,
    /// Per rule: helper items live and at zero.
    pub helpers: Vec<(String, u64, u64)>,
}

/// The Prometheus text of a run (pure). The last-success gauge only when it succeeded, so the
/// `ReconcileNotSucceeding` alert keeps seeing the last good run after a failed one.
pub fn body(r: &JobResult) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n"));
    };
    if r.succeeded {
        gauge("ddb_aggregator_reconcile_last_success_timestamp_seconds", "When a reconcile last left no drift.", r.finished_s);
    }
    gauge("ddb_aggregator_reconcile_job_last_run_timestamp_seconds", "When the reconcile job last finished.", r.finished_s);
    gauge("ddb_aggregator_reconcile_job_succeeded", "1 when the last run left no drift, else 0.", if r.succeeded { 1.0 } else { 0.0 });
    gauge("ddb_aggregator_reconcile_job_duration_seconds", "How long the last run took.", r.seconds);
    gauge("ddb_aggregator_reconcile_job_targets_checked", "Targets the last run compared.", r.targets_checked as f64);
    gauge("ddb_aggregator_reconcile_job_items_read", "Source and target items the last run read.", r.items_read as f64);
    gauge("ddb_aggregator_reconcile_job_drifts", "Drifted attributes the last run found.", r.drifts as f64);
    gauge("ddb_aggregator_reconcile_job_corrections", "Drifted attributes the last run corrected.", r.corrected as f64);
    gauge("ddb_aggregator_reconcile_job_uncorrected", "Drift the last run left (not quiet, not a number).", r.uncorrected as f64);
    gauge(
        "ddb_aggregator_reconcile_job_shards_by_empty_pages",
        "Idle shards the last run judged caught up by the empty-page rule alone (reconcile.tip_evidence, an assumption).",
        r.shards_by_empty_pages as f64,
    );
    if !r.helpers.is_empty() {
        let name = "ddb_aggregator_reconcile_job_helper_items";
        out.push_str(&format!("# HELP {name} Helper items of max, min, latest and distinct the last run read, by rule and state (live, zero).\n# TYPE {name} gauge\n"));
        for (rule, live, zero) in &r.helpers {
            let rule = rule.replace('\\', "\\\\").replace('"', "\\\"");
            out.push_str(&format!("{name}{{rule=\"{rule}\",state=\"live\"}} {live}\n{name}{{rule=\"{rule}\",state=\"zero\"}} {zero}\n"));
        }
    }
    out
}

/// (host:port, path prefix) of an `http://` Pushgateway address.
pub fn parse_url(url: &str) -> Result<(String, String), PushError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| PushError::BadUrl(url.to_string()))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(PushError::BadUrl(url.to_string()));
    }
    let authority = if authority.contains(':') { authority.to_string() } else { format!("{authority}:80") };
    Ok((authority, path.to_string()))
}

/// POSTs `body` to `{url}/metrics/job/{JOB}`; bounded by 10 s.
pub async fn push(url: &str, body: &str) -> Result<(), PushError> {
    let (authority, prefix) = parse_url(url)?;
    let io = |e: std::io::Error| PushError::Io(authority.clone(), e.to_string());
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(&authority).await.map_err(io)?;
        let request = format!(
            "POST {prefix}/metrics/job/{JOB} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(request.as_bytes()).await.map_err(io)?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).await.map_err(io)?;
        let text = String::from_utf8_lossy(&answer);
        let status = text.lines().next().unwrap_or("").to_string();
        match status.split(' ').nth(1) {
            Some(code) if code.starts_with('2') => Ok(()),
            _ => Err(PushError::Refused(status)),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| PushError::Io(authority.clone(), "timed out after 10 s".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_url("http://pushgateway:9091").unwrap(), ("pushgateway:9091".into(), "".into()));
        assert_eq!(parse_url("http://pg/prefix/").unwrap(), ("pg:80".into(), "/prefix".into()));
        assert!(matches!(parse_url("https://pg:9091"), Err(PushError::BadUrl(_))));
        assert!(matches!(parse_url("http://"), Err(PushError::BadUrl(_))));
    }

    #[test]
    fn a_failed_run_leaves_the_last_success_alone() {
        let ok = body(&JobResult { succeeded: true, finished_s: 1700.0, corrected: 3, ..JobResult::default() });
        assert!(ok.contains("\nddb_aggregator_reconcile_last_success_timestamp_seconds 1700\n"), "{ok}");
        assert!(ok.contains("\nddb_aggregator_reconcile_job_corrections 3\n"));
        let judged = body(&JobResult { shards_by_empty_pages: 2, ..JobResult::default() });
        assert!(judged.contains("\nddb_aggregator_reconcile_job_shards_by_empty_pages 2\n"), "{judged}");
        let failed = body(&JobResult { succeeded: false, finished_s: 1800.0, ..JobResult::default() });
        assert!(!failed.contains("last_success"), "{failed}");
        assert!(failed.contains("\nddb_aggregator_reconcile_job_succeeded 0\n"));
    }

    #[test]
    fn helper_items_are_pushed_per_rule_and_state() {
        let b = body(&JobResult { helpers: vec![("customer-orders".into(), 12, 30), ("a\"b".into(), 0, 1)], ..JobResult::default() });
        assert!(b.contains("\nddb_aggregator_reconcile_job_helper_items{rule=\"customer-orders\",state=\"live\"} 12\n"), "{b}");
        assert!(b.contains("\nddb_aggregator_reconcile_job_helper_items{rule=\"customer-orders\",state=\"zero\"} 30\n"), "{b}");
        assert!(b.contains("{rule=\"a\\\"b\",state=\"zero\"} 1\n"), "a quote in a rule name is escaped: {b}");
        assert!(!body(&JobResult::default()).contains("helper_items"), "no helper measures, no series");
    }
}
