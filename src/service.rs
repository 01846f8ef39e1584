//! `run`: wires the real AWS clients, the metrics endpoint and signal handling around the
//! worker. One cancellation root; SIGTERM/SIGINT start a bounded drain.

use std::sync::Arc;

use aws_sdk_dynamodb::types::StreamViewType;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::aws::{classify, FailureKind};
use crate::config::Config;
use crate::sink::dead_letter::{DeadLetters, SqsDeadLetters};
use crate::sink::dynamodb::DynamoDbAggregates;
use crate::state::dynamodb::DynamoDbLeases;
use crate::state::LeaseStore;
use crate::stream::dynamodb::DynamoDbStream;
use crate::telemetry::{self, Health};
use crate::worker::{replica_id, Shared, Worker};

/// Why the service could not start or stopped: the exit code says which.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The configuration or the AWS resources it names are wrong: exit 2.
    #[error("{0}")]
    Setup(String),
    /// A failure while running: exit 1.
    #[error("{0}")]
    Runtime(String),
}

/// Finds the source table's stream and checks it carries both images.
pub async fn resolve_stream(client: &aws_sdk_dynamodb::Client, table: &str) -> Result<String, ServiceError> {
    let desc = client.describe_table().table_name(table).send().await.map_err(|e| {
        let f = classify(&e);
        match f.kind {
            FailureKind::NotFound => ServiceError::Setup(format!("source table {table} does not exist")),
            _ => ServiceError::Runtime(format!("describing source table {table}: {f}")),
        }
    })?;
    let t = desc.table().ok_or_else(|| ServiceError::Runtime(format!("DescribeTable {table} returned no table")))?;
    let spec = t.stream_specification();
    match spec {
        Some(s) if s.stream_enabled() => match s.stream_view_type() {
            Some(StreamViewType::NewAndOldImages) => {}
            other => {
                return Err(ServiceError::Setup(format!(
                    "source table {table} has a {} stream; deltas need NEW_AND_OLD_IMAGES (update the table's StreamSpecification)",
                    other.map(|v| v.as_str()).unwrap_or("unknown")
                )))
            }
        },
        _ => {
            return Err(ServiceError::Setup(format!(
                "source table {table} has no stream; enable one with StreamViewType NEW_AND_OLD_IMAGES"
            )))
        }
    }
    t.latest_stream_arn().map(str::to_string).ok_or_else(|| ServiceError::Setup(format!("source table {table} reports no stream ARN")))
}

pub async fn run(config: Config) -> Result<(), ServiceError> {
    let cancel = CancellationToken::new();
    let health = Arc::new(Health::default());
    let lease_ms = u64::try_from(config.state.lease_duration.as_millis()).unwrap_or(u64::MAX);
    let handle = telemetry::install_metrics(std::time::Duration::from_millis(lease_ms.saturating_mul(3).max(30_000)))
        .map_err(ServiceError::Runtime)?;
    telemetry::names::init_series(&config.engine.rules.iter().map(|r| r.name.to_string()).collect::<Vec<_>>());
    let listener = telemetry::bind(config.metrics_listen).await.map_err(ServiceError::Setup)?;
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tokio::spawn(telemetry::serve(listener, handle, health.clone(), cancel.clone()));

    let sdk = crate::aws::sdk_config().await;
    let ddb = aws_sdk_dynamodb::Client::new(&sdk);
    let streams = aws_sdk_dynamodbstreams::Client::new(&sdk);
    let stream_arn = resolve_stream(&ddb, &config.source.table).await?;
    if config.aggregates_table != config.source.table {
        ddb.describe_table().table_name(&config.aggregates_table).send().await.map_err(|e| {
            let f = classify(&e);
            match f.kind {
                FailureKind::NotFound => ServiceError::Setup(format!("aggregates table {} does not exist", config.aggregates_table)),
                _ => ServiceError::Runtime(format!("describing aggregates table {}: {f}", config.aggregates_table)),
            }
        })?;
    }
    let leases = DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), stream_arn.clone());
    leases.prepare(config.state.create_table).await.map_err(|e| match e {
        crate::state::StateError::TableMissing(_) => ServiceError::Setup(e.to_string()),
        e => ServiceError::Runtime(e.to_string()),
    })?;
    let sink = Arc::new(DynamoDbAggregates::new(ddb.clone(), config.aggregates_table.clone()));
    let owner = replica_id();
    info!(owner = %owner, stream = %stream_arn, metrics = %local, rules = config.engine.rules.len(), "starting");
    let dead_letters = match &config.dead_letter {
        Some(d) => DeadLetters::Sqs(SqsDeadLetters::new(aws_sdk_sqs::Client::new(&sdk), d.queue_url.clone(), d.include_images)),
        None => {
            tracing::warn!("no dead_letter queue configured: poison records are logged and counted, not queued");
            DeadLetters::Disabled
        }
    };
    let shared = Shared::new(config, DynamoDbStream::new(streams, stream_arn.clone()), leases, sink, owner, health)
        .with_dead_letters(dead_letters, stream_arn);
    let reconcile_interval = shared.config.reconcile_interval;
    let schedule_config = shared.config.clone();
    let worker = Worker::new(shared);
    // Also with the schedule off: a persisted request to reconcile everything (data lost)
    // is still carried out.
    let reconciler = crate::reconcile::Reconciler::new(ddb.clone(), schedule_config).await.map_err(ServiceError::Runtime)?;
    tokio::spawn(crate::reconcile::schedule::run_schedule(
        worker.shared().clone(),
        reconciler,
        ddb.clone(),
        reconcile_interval,
        cancel.clone(),
    ));

    let signals = cancel.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        info!("stop requested; finishing in-flight batches");
        signals.cancel();
    });
    let result = worker.run(cancel.clone()).await;
    cancel.cancel();
    result.map_err(|e| {
        error!(error = %e, "worker failed");
        ServiceError::Runtime(e.to_string())
    })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
