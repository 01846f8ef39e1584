//! `run`: wires the real AWS clients, the metrics endpoint and signal handling around the
//! worker. One cancellation root; SIGTERM/SIGINT start a bounded drain.

use std::sync::Arc;

use aws_sdk_dynamodb::types::StreamViewType;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use tracing::{error, info, warn};

use crate::aws::{classify, FailureKind};
use crate::config::Config;
use crate::registry::dynamodb::{Registered, Registry, RegistryError};
use crate::registry::Starting;
use crate::sink::dead_letter::{DeadLetters, SqsDeadLetters};
use crate::sink::dynamodb::DynamoDbAggregates;
use crate::sink::expiry::Described;
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
        // Disabled with a stream still readable (24 hours): read what is left of it; the
        // watcher follows a new one when the stream is enabled again.
        _ if spec.is_none_or(|s| !s.stream_enabled()) && t.latest_stream_arn().is_some() => {
            warn!(table, "the source table's stream is disabled: reading what is left of it");
        }
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

/// What the source table's stream is now, compared with the one being read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamChange {
    Same,
    /// The stream was disabled: its shards stay readable for 24 h, so keep reading them.
    Disabled,
    /// Disabled and enabled again (or replaced): a new stream with a new ARN to follow.
    New(String),
}

/// Decides whether to follow a new stream (pure).
pub fn stream_change(current: &str, enabled: bool, latest: Option<&str>) -> StreamChange {
    match latest {
        Some(l) if enabled && l != current => StreamChange::New(l.to_string()),
        _ if !enabled => StreamChange::Disabled,
        _ => StreamChange::Same,
    }
}

/// The table's stream as DescribeTable reports it: (enabled, latest ARN).
async fn describe_stream(client: &aws_sdk_dynamodb::Client, table: &str) -> Option<(bool, Option<String>)> {
    let desc = client.describe_table().table_name(table).send().await.ok()?;
    let t = desc.table()?;
    let enabled = t.stream_specification().is_some_and(|s| s.stream_enabled());
    Some((enabled, t.latest_stream_arn().map(str::to_string)))
}

/// Watches the source table's stream; on a new one, requests a reconcile of everything (in the
/// state table, before anything else, so a crash cannot lose the gap), cancels `follow` and
/// says which stream to follow.
async fn watch_stream(
    client: aws_sdk_dynamodb::Client,
    config: Config,
    current: String,
    every: Duration,
    follow: CancellationToken,
) -> Option<String> {
    let table = &config.source.table;
    loop {
        tokio::select! {
            biased;
            _ = follow.cancelled() => return None,
            _ = tokio::time::sleep(every) => {}
        }
        let Some((enabled, latest)) = describe_stream(&client, table).await else { continue };
        match stream_change(&current, enabled, latest.as_deref()) {
            StreamChange::New(arn) => {
                warn!(old = %current, new = %arn, "the source table has a new stream (disabled and enabled again): following it; records written in between were never streamed, so a reconcile of everything is requested");
                let leases = DynamoDbLeases::new(client.clone(), config.state.table.clone(), arn.clone());
                if let Err(e) = leases.request_reconcile(crate::state::now_ms()).await {
                    warn!(error = %e, "cannot record the reconcile request for the stream gap yet; trying again");
                    continue;
                }
                follow.cancel();
                return Some(arn);
            }
            StreamChange::Disabled => warn!(stream = %current, "the source table's stream is disabled: reading what is left of it"),
            StreamChange::Same => {}
        }
    }
}

pub async fn run(config: Config) -> Result<(), ServiceError> {
    let cancel = CancellationToken::new();
    let health = Arc::new(Health::default());
    let lease_ms = u64::try_from(config.state.lease_duration.as_millis()).unwrap_or(u64::MAX);
    let handle = telemetry::install_metrics(std::time::Duration::from_millis(lease_ms.saturating_mul(3).max(30_000)))
        .map_err(ServiceError::Runtime)?;
    let names = |rules: &mut dyn Iterator<Item = &str>| rules.map(str::to_string).collect::<Vec<_>>();
    telemetry::names::init_series(
        &names(&mut config.engine.rules.iter().map(|r| &*r.name)),
        &names(&mut config.engine.copies.iter().map(|r| &*r.name)),
    );
    let listener = telemetry::bind(config.metrics_listen).await.map_err(ServiceError::Setup)?;
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tokio::spawn(telemetry::serve(listener, handle, health.clone(), cancel.clone()));

    let sdk = crate::aws::sdk_config(&config.aws).await;
    let ddb = aws_sdk_dynamodb::Client::new(&sdk);
    let mut stream_arn = resolve_stream(&ddb, &config.source.table).await?;
    if config.aggregates_table != config.source.table {
        ddb.describe_table().table_name(&config.aggregates_table).send().await.map_err(|e| {
            let f = classify(&e);
            match f.kind {
                FailureKind::NotFound => ServiceError::Setup(format!("aggregates table {} does not exist", config.aggregates_table)),
                _ => ServiceError::Runtime(format!("describing aggregates table {}: {f}", config.aggregates_table)),
            }
        })?;
    }
    register(&ddb, &config, &stream_arn).await?;
    let signals = cancel.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        info!("stop requested; finishing in-flight batches");
        signals.cancel();
    });
    info!(metrics = %local, rules = config.engine.rules.len(), ledger_namespace = %config.ledger_namespace, "starting");
    if let Some(why) = config.short_removal_window() {
        warn!("{why}");
    }
    for why in &config.pattern_warnings {
        warn!("{why}");
    }
    let every = (config.state.lease_duration * 3).clamp(Duration::from_secs(10), Duration::from_secs(60));
    let mut followed = false;
    loop {
        let follow = cancel.child_token();
        let watcher = tokio::spawn(watch_stream(ddb.clone(), config.clone(), stream_arn.clone(), every, follow.clone()));
        let result = run_stream(&config, &sdk, &ddb, &stream_arn, followed, health.clone(), follow.clone()).await;
        follow.cancel();
        let next = watcher.await.ok().flatten();
        match next {
            Some(arn) if !cancel.is_cancelled() && result.is_ok() => {
                stream_arn = arn;
                followed = true;
            }
            _ => {
                cancel.cancel();
                return result;
            }
        }
    }
}

/// Refuses a start that would count the stream's records again (a deployment moved to a new
/// state table with the default ledger namespace), or registers this deployment in the ledger
/// registry of the aggregates table ([`crate::registry`]).
async fn register(ddb: &aws_sdk_dynamodb::Client, config: &Config, stream_arn: &str) -> Result<(), ServiceError> {
    if config.engine.rules.is_empty() {
        return Ok(()); // copy rules only: no ledger on any item
    }
    let leases = DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), stream_arn.to_string());
    let state_is_new =
        !leases.has_read_a_stream().await.map_err(|e| ServiceError::Runtime(format!("reading state table {}: {e}", config.state.table)))?;
    let this = Starting {
        aggregates_table: &config.aggregates_table,
        source_table: &config.source.table,
        state_table: &config.state.table,
        stream_arn,
        namespace: &config.ledger_namespace,
        explicit: config.ledger_namespace_explicit,
        state_is_new,
    };
    let registry = Registry::new(ddb.clone(), &config.aggregates_table, &config.engine.key_names);
    match registry.check_and_register(&this).await {
        Ok(Registered::Written(e)) => {
            info!(ledger_namespace = %e.namespace, source = %e.source_table, state = %e.state_table, "registered this deployment in the aggregates table's ledger registry");
            Ok(())
        }
        Ok(Registered::Unchanged) => Ok(()),
        Ok(Registered::NotWritten(failure)) => {
            warn!(error = %failure, table = %config.aggregates_table, "cannot register this deployment in the aggregates table's ledger registry; starting anyway, the next start tries again");
            Ok(())
        }
        Err(e @ (RegistryError::Refused(_) | RegistryError::Malformed { .. })) => Err(ServiceError::Setup(e.to_string())),
        Err(e) => Err(ServiceError::Runtime(e.to_string())),
    }
}

/// Where the shards of a stream without known ancestry start (pure): `start_position`, except
/// on a stream that follows one this deployment read before (the table's stream was disabled
/// and enabled again): every record of it comes after the gap the requested reconcile
/// repairs, so `latest` would skip what was written before each replica's first read.
pub fn start_of(configured: crate::config::StartPosition, follows_another: bool) -> crate::config::StartPosition {
    if follows_another {
        crate::config::StartPosition::TrimHorizon
    } else {
        configured
    }
}

/// Reads one stream until `stop`: the worker and the reconcile schedule. `followed`: the
/// watcher moved to this stream from another.
async fn run_stream(
    config: &Config,
    sdk: &aws_config::SdkConfig,
    ddb: &aws_sdk_dynamodb::Client,
    stream_arn: &str,
    followed: bool,
    health: Arc<Health>,
    stop: CancellationToken,
) -> Result<(), ServiceError> {
    let copies = crate::sink::copy::dynamodb::for_config(ddb, config).await.map_err(|e| match e {
        crate::sink::copy::dynamodb::SetupError::Refused(m) => ServiceError::Setup(m),
        e @ crate::sink::copy::dynamodb::SetupError::Describe { .. } => ServiceError::Runtime(e.to_string()),
    })?;
    let leases = DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), stream_arn.to_string());
    leases.prepare(config.state.create_table).await.map_err(|e| match e {
        crate::state::StateError::TableMissing(_) => ServiceError::Setup(e.to_string()),
        e => ServiceError::Runtime(e.to_string()),
    })?;
    // A replica started after the switch learns it from the state table. If the switch came
    // while no replica ran, nobody requested the repair of the gap yet: the first to read
    // the new stream (no lease of it exists) does, before it reads anything, and only then
    // notes the new stream as the one read (a crash in between requests it again).
    let runtime = |e: crate::state::StateError| ServiceError::Runtime(e.to_string());
    let follows = followed || leases.follows_another_stream().await.map_err(runtime)?;
    if follows && !followed && leases.list().await.map_err(runtime)?.is_empty() {
        warn!(stream = %stream_arn, "this stream follows one read before and nobody has read it yet: records written in between were never streamed, so a reconcile of everything is requested");
        leases.request_reconcile(crate::state::now_ms()).await.map_err(runtime)?;
    }
    leases.note_stream(follows).await.map_err(runtime)?;
    let mut config = config.clone();
    if follows && config.source.start_position != crate::config::StartPosition::TrimHorizon {
        info!(stream = %stream_arn, "this stream follows one read before (disabled and enabled again): its shards start at TRIM_HORIZON, not LATEST");
    }
    config.source.start_position = start_of(config.source.start_position, follows);
    let sink = Arc::new(DynamoDbAggregates::new(ddb.clone(), config.aggregates_table.clone()));
    let owner = replica_id();
    info!(owner = %owner, stream = %stream_arn, "reading stream");
    let dead_letters = match &config.dead_letter {
        Some(d) => DeadLetters::Sqs(SqsDeadLetters::new(aws_sdk_sqs::Client::new(sdk), d.queue_url.clone(), d.include_images)),
        None => {
            tracing::warn!("no dead_letter queue configured: poison records are logged and counted, not queued");
            DeadLetters::Disabled
        }
    };
    let streams = aws_sdk_dynamodbstreams::Client::new(sdk);
    let shared = Shared::new(config.clone(), DynamoDbStream::new(streams, stream_arn.to_string()), leases, sink, owner, health)
        .with_dead_letters(dead_letters, stream_arn.to_string());
    let shared = match copies {
        Some(store) => shared.with_copies(store),
        None => shared,
    };
    let worker = Worker::new(shared);
    if let Some(attribute) = config.helper_expiry_attribute.clone().filter(|_| crate::sink::dynamodb::keeps_helpers(&config)) {
        tokio::spawn(watch_ttl(worker.shared().clone(), ddb.clone(), (config.aggregates_table.clone(), attribute.clone()), stop.clone()));
        tokio::spawn(sweep_expired_helpers(worker.shared().clone(), attribute, stop.clone()));
    }
    // Also with the schedule off: a persisted request to reconcile everything (data lost)
    // is still carried out.
    let folder = match config.engine.rules.iter().any(|r| r.write_shards.is_some()) {
        true => {
            Some(Arc::new(crate::reconcile::Reconciler::new(sdk, config.clone()).await.map_err(|e| ServiceError::Runtime(e.to_string()))?))
        }
        false => None,
    };
    if let Some(folder) = &folder {
        tokio::spawn(crate::worker::fold::run_folds(worker.shared().clone(), folder.clone(), config.fold_interval, stop.clone()));
    }
    let shared = worker.shared().clone();
    let reconciler = crate::reconcile::Reconciler::new(sdk, config.clone()).await.map_err(|e| ServiceError::Runtime(e.to_string()))?;
    tokio::spawn(crate::reconcile::schedule::run_schedule(worker.shared().clone(), reconciler, config.reconcile_interval, stop.clone()));
    let ran = worker.run(stop).await.map_err(|e| {
        error!(error = %e, "worker failed");
        ServiceError::Runtime(e.to_string())
    });
    if let Some(folder) = folder {
        // The last batches landed after the fold task's last round: their totals are folded
        // before the process ends.
        crate::worker::fold::fold_round(&*folder, &shared.folds, crate::state::now_ms()).await;
    }
    ran
}

/// Reads the aggregates table's TTL settings at start and every minute after, until `stop`:
/// expiries are set once it answered, left to TTL where it is enabled on the configured
/// attribute and recorded for the service's own delete otherwise ([`crate::sink::expiry`]).
/// Every helper write removes the attribute whatever this finds.
async fn watch_ttl<S, L, A>(
    shared: Arc<Shared<S, L, A>>,
    ddb: aws_sdk_dynamodb::Client,
    (table, attribute): (String, String),
    stop: CancellationToken,
) {
    let mut last: Option<Described> = None;
    loop {
        let (described, failure) = crate::sink::dynamodb::describe_ttl(&ddb, &table).await;
        if last.as_ref() != Some(&described) {
            crate::sink::dynamodb::log_ttl(&table, &attribute, &described, failure.as_ref());
        }
        if let Some(own) = crate::sink::expiry::setting(&described, &attribute) {
            shared.expiry_own.store(own, std::sync::atomic::Ordering::Relaxed);
            shared.expiry_on.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        last = Some(described);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(crate::sink::expiry::REFRESH_MS)) => {}
        }
    }
}

/// What one round of the helper sweep came to: how soon the next runs ([`next_sweep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SweepRound {
    /// The replica does not run the committed definitions yet (it commits them some seconds
    /// after start).
    NotCommitted,
    /// Another replica holds the sweep's lease.
    HeldElsewhere,
    /// The lease could not be read, or the sweep read no partition, or a part of it failed.
    Failed,
    /// Swept; `more`: a partition had more due than one round reads.
    Swept { more: bool },
}

/// How long after `round` the next sweep runs: soon while the definitions are not committed,
/// a minute after a failure (not at once, even with more due: a delete refused for good would
/// fail again), a second while more are due, else [`crate::sink::expiry::SWEEP_MS`].
fn next_sweep(round: SweepRound) -> Duration {
    match round {
        SweepRound::NotCommitted => Duration::from_secs(5),
        SweepRound::Failed => Duration::from_secs(60),
        SweepRound::Swept { more: true } => Duration::from_secs(1),
        SweepRound::HeldElsewhere | SweepRound::Swept { more: false } => Duration::from_millis(crate::sink::expiry::SWEEP_MS),
    }
}

/// Deletes the helpers whose expiry the service recorded as its own to delete, on the replica
/// that runs the committed definitions and holds the sweep's lease, until `stop`; the rounds
/// are spaced by [`next_sweep`]. Also while TTL is on: expiries recorded before it was turned
/// on are still swept.
async fn sweep_expired_helpers<S, L: LeaseStore, A: crate::sink::AggregateStore>(
    shared: Arc<Shared<S, L, A>>,
    attribute: String,
    stop: CancellationToken,
) {
    let Some(key_names) = shared.engine.rules.first().map(|r| r.target.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()) else {
        return;
    };
    let mut wait = next_sweep(SweepRound::NotCommitted);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = next_sweep(sweep_round(&shared, &key_names, &attribute).await);
    }
}

/// One round of the helper sweep, its outcome logged and counted.
async fn sweep_round<S, L: LeaseStore, A: crate::sink::AggregateStore>(
    shared: &Shared<S, L, A>,
    key_names: &[String],
    attribute: &str,
) -> SweepRound {
    // Only under the committed definitions: the expiry attribute is one of them.
    if !shared.definitions_current.load(std::sync::atomic::Ordering::Relaxed) {
        telemetry::helper_sweep_not_here();
        return SweepRound::NotCommitted;
    }
    let now = crate::state::now_ms();
    let hold = now.saturating_add(crate::sink::expiry::SWEEP_MS);
    match shared.leases.hold_named(crate::sink::expiry::SWEEP_LEASE, &shared.owner, hold, now).await {
        Ok(true) => {}
        Ok(false) => {
            telemetry::helper_sweep_not_here();
            return SweepRound::HeldElsewhere;
        }
        Err(e) => {
            telemetry::helper_sweep_not_here();
            warn!(error = %e, "cannot take the helper sweep's lease: tried again in a minute");
            return SweepRound::Failed;
        }
    }
    match crate::sink::expiry::sweep(shared.sink.as_ref(), key_names, attribute, now / 1000).await {
        Ok(swept) => {
            telemetry::helper_deletes(&swept, now / 1000);
            if swept.deleted + swept.kept > 0 {
                info!(deleted = swept.deleted, kept = swept.kept, "swept expired helper items");
            }
            match &swept.error {
                Some(e) => {
                    warn!(failed = swept.failed, partitions_unread = swept.unread, error = %e, "some expired helper items could not be deleted: tried again in a minute");
                    SweepRound::Failed
                }
                None => SweepRound::Swept { more: swept.more },
            }
        }
        Err(e) => {
            telemetry::helper_sweep_failed();
            telemetry::helper_sweep_not_here();
            warn!(error = %e, "sweeping expired helper items failed: tried again in a minute");
            SweepRound::Failed
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helper_sweep_runs_again_soon_only_when_it_must() {
        let period = Duration::from_millis(crate::sink::expiry::SWEEP_MS);
        assert_eq!(next_sweep(SweepRound::NotCommitted), Duration::from_secs(5), "definitions are committed seconds after start");
        assert_eq!(next_sweep(SweepRound::Swept { more: true }), Duration::from_secs(1), "a backlog goes on at once");
        assert_eq!(next_sweep(SweepRound::Failed), Duration::from_secs(60), "a failure: not 10 minutes, not every second");
        assert_eq!(next_sweep(SweepRound::HeldElsewhere), period);
        assert_eq!(next_sweep(SweepRound::Swept { more: false }), period);
    }

    #[test]
    fn a_followed_stream_starts_at_its_horizon() {
        use crate::config::StartPosition::{Latest, TrimHorizon};
        assert_eq!(start_of(Latest, false), Latest, "the first stream: as configured");
        assert_eq!(start_of(Latest, true), TrimHorizon, "after the gap: every record of the new stream counts");
        assert_eq!(start_of(TrimHorizon, true), TrimHorizon);
    }

    #[test]
    fn a_new_stream_is_followed_a_disabled_one_read_to_its_end() {
        assert_eq!(stream_change("arn:1", true, Some("arn:1")), StreamChange::Same);
        assert_eq!(stream_change("arn:1", true, Some("arn:2")), StreamChange::New("arn:2".into()));
        assert_eq!(stream_change("arn:1", false, Some("arn:1")), StreamChange::Disabled);
        assert_eq!(stream_change("arn:1", false, None), StreamChange::Disabled);
        assert_eq!(stream_change("arn:1", true, None), StreamChange::Same, "no ARN reported: keep what we read");
    }
}
