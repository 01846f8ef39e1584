//! Every metric name, in one place (Prometheus text, prefix `ddb_aggregator_`, base units).
//! Label values are small fixed sets: rule names from the config, reason codes, outcomes,
//! shard ids of the shards this replica currently reads.

pub const ITERATOR_AGE_SECONDS: &str = "ddb_aggregator_iterator_age_seconds";
pub const ITERATOR_AGE_MAX_SECONDS: &str = "ddb_aggregator_iterator_age_max_seconds";
pub const RECORDS_READ: &str = "ddb_aggregator_records_read_total";
pub const RECORDS_FILTERED: &str = "ddb_aggregator_records_filtered_total";
pub const LEASES_TAKEN: &str = "ddb_aggregator_leases_taken_total";
pub const LEASES_LOST: &str = "ddb_aggregator_leases_lost_total";
pub const RECORDS_MATCHED: &str = "ddb_aggregator_records_matched_total";
pub const RECORDS_SKIPPED: &str = "ddb_aggregator_records_skipped_total";
pub const AGGREGATE_WRITES: &str = "ddb_aggregator_aggregate_writes_total";
pub const DERIVATIONS: &str = "ddb_aggregator_derivations_total";
/// Helper queries of derivations, and the helper items they read (live or not): their ratio
/// is what one derivation reads.
pub const DERIVATION_QUERIES: &str = "ddb_aggregator_derivation_queries_total";
pub const DERIVATION_ITEMS_READ: &str = "ddb_aggregator_derivation_items_read_total";
pub const HELPER_EXPIRIES: &str = "ddb_aggregator_helper_expiries_total";
/// Helper items the service's own sweep deleted, or kept (written since), by `outcome`.
pub const HELPER_DELETES: &str = "ddb_aggregator_helper_deletes_total";
/// How far behind the sweep of expired helpers is: now less the oldest expiry it found due.
pub const HELPER_SWEEP_LAG: &str = "ddb_aggregator_helper_sweep_lag_seconds";
/// Helper items by rule and state (live, zero), as the last scheduled reconcile of everything read them.
pub const HELPER_ITEMS: &str = "ddb_aggregator_helper_items";
pub const HELPER_WRITES_TOO_OLD: &str = "ddb_aggregator_helper_writes_too_old_total";
/// Sharded totals folded from their sub-items, by rule and `outcome` (written, superseded, failed).
pub const FOLDS: &str = "ddb_aggregator_folds_total";
/// How far a rule's folded totals lag behind their sub-items: the age of the oldest write not
/// folded yet, as of the last fold round (0: none).
pub const FOLD_LAG: &str = "ddb_aggregator_fold_lag_seconds";
/// Copy items written by copy rules, by rule and `outcome`: written, older (the item held this
/// change's copies or a newer one's), gone (deleted after the query found it), rejected (the
/// table refused it: dead-lettered), error (the batch is retried); and fan-outs `superseded`
/// (the source changed again: the newer change writes the copies).
pub const COPY_WRITES: &str = "ddb_aggregator_copy_writes_total";
/// Items one source change's fan-out found, by rule.
pub const COPY_FANOUT_ITEMS: &str = "ddb_aggregator_copy_fanout_items";
/// Copy fan-out jobs pending in the state table, as the last maintenance round listed them.
pub const COPY_JOBS_PENDING: &str = "ddb_aggregator_copy_jobs_pending";
/// Age of the oldest pending copy fan-out job, in seconds (0: none).
pub const COPY_JOB_AGE: &str = "ddb_aggregator_copy_job_oldest_seconds";
pub const RULE_REBUILD_PENDING: &str = "ddb_aggregator_rule_rebuild_pending";
/// 1 for the reason a replica holds no lease while its rule definitions differ from the
/// committed ones (`reason`: committed_replicas_live, leases_held, conflicting_definitions,
/// newer_protocol), else 0.
pub const DEFINITIONS_WAITING: &str = "ddb_aggregator_definitions_waiting";
/// The generation of the committed rule definitions this replica last read.
pub const DEFINITIONS_GENERATION: &str = "ddb_aggregator_definitions_generation";
/// Old definitions whose leftovers (targets, attributes, helper items) are still to be zeroed.
pub const DEFINITIONS_RETIRE_PENDING: &str = "ddb_aggregator_definitions_retire_pending";
/// Old definitions whose zeroed leftovers wait for `reconcile.remove_leftovers_after` to be removed.
pub const DEFINITIONS_REMOVAL_PENDING: &str = "ddb_aggregator_definitions_removal_pending";
/// Items deleted and attributes removed after a rule change (`kind`: item, attribute).
pub const DEFINITIONS_REMOVED: &str = "ddb_aggregator_definitions_leftovers_removed_total";
pub const RULE_REBUILD_SKIPPED: &str = "ddb_aggregator_rule_rebuild_skipped_targets_total";
pub const COALESCED_UPDATES: &str = "ddb_aggregator_coalesced_record_updates_total";
pub const WRITE_CAPACITY_UNITS: &str = "ddb_aggregator_write_capacity_units_total";
pub const BATCH_DURATION_SECONDS: &str = "ddb_aggregator_batch_duration_seconds";
pub const END_TO_END_LAG_SECONDS: &str = "ddb_aggregator_end_to_end_lag_seconds";
/// One applied batch's time by phase (`phase`: poll_wait, get_records, evaluate, dead_letters,
/// writes, checkpoint).
pub const BATCH_PHASE_SECONDS: &str = "ddb_aggregator_batch_phase_seconds";
/// Target writes a batch kept in flight at once (its write window, [`crate::worker::window`]).
pub const BATCH_WRITES_IN_FLIGHT: &str = "ddb_aggregator_batch_writes_in_flight";
/// How long a write waited for its partition key's budget (`aggregates.partition_write_rate`).
pub const PARTITION_PACING_SECONDS: &str = "ddb_aggregator_partition_pacing_seconds";
pub const SHARDS: &str = "ddb_aggregator_shards";
pub const LEASES_HELD: &str = "ddb_aggregator_leases_held";
pub const GET_RECORDS: &str = "ddb_aggregator_get_records_total";
pub const TRIMMED_DATA: &str = "ddb_aggregator_trimmed_data_total";
pub const DEAD_LETTERS: &str = "ddb_aggregator_dead_letters_total";
pub const DEAD_LETTER_FAILURES: &str = "ddb_aggregator_dead_letter_send_failures_total";
/// Dead letters by the form they reached the queue in (`form`: full, images_cut, keys_only,
/// dropped, disabled); `dropped` means SQS refused every form and the record is only in the log.
pub const DEAD_LETTER_DELIVERIES: &str = "ddb_aggregator_dead_letter_deliveries_total";
pub const RECONCILE_RUNS: &str = "ddb_aggregator_reconcile_runs_total";
pub const RECONCILE_DRIFT: &str = "ddb_aggregator_reconcile_drift_total";
pub const RECONCILE_CORRECTIONS: &str = "ddb_aggregator_reconcile_corrections_total";
pub const RECONCILE_FAILED_TARGETS: &str = "ddb_aggregator_reconcile_failed_targets_total";
pub const RECONCILE_TIP_BY_EMPTY_PAGES: &str = "ddb_aggregator_reconcile_tip_by_empty_pages_total";
pub const RECONCILE_LAST_SUCCESS: &str = "ddb_aggregator_reconcile_last_success_timestamp_seconds";
pub const BUILD_INFO: &str = "ddb_aggregator_build_info";
pub const SHARDS_LOST: &str = "ddb_aggregator_shards_lost_total";
pub const LEDGER_FENCE_VIOLATIONS: &str = "ddb_aggregator_ledger_fence_violations_total";
pub const LEASES_DELETED: &str = "ddb_aggregator_leases_deleted_total";
pub const RECONCILE_REQUESTED: &str = "ddb_aggregator_reconcile_requested";

/// Registers help texts and units.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        ITERATOR_AGE_SECONDS,
        Unit::Seconds,
        "Age of the newest record read from each shard this replica reads (0 at the tip)."
    );
    describe_gauge!(ITERATOR_AGE_MAX_SECONDS, Unit::Seconds, "Largest iterator age over the shards this replica reads.");
    describe_counter!(RECORDS_READ, "Stream records read (a batch read again after a failure counts again, as Lambda's PolledEventCount).");
    describe_counter!(RECORDS_FILTERED, "Records no rule's filter matched (Lambda's FilteredOutEventCount).");
    describe_counter!(LEASES_TAKEN, "Shard leases this replica took (KCL's TakenLeases).");
    describe_counter!(LEASES_LOST, "Shard leases this replica lost to another before it was done (KCL's LostLeases).");
    describe_counter!(RECORDS_MATCHED, "Records whose filter matched, per rule.");
    describe_counter!(RECORDS_SKIPPED, "Records not applied, by reason (poison, trimmed, too_old).");
    describe_counter!(AGGREGATE_WRITES, "Aggregate UpdateItem calls, by outcome (applied, stale, error).");
    describe_gauge!(
        RULE_REBUILD_PENDING,
        "1 while a rule added or changed since its fingerprint was recorded is being rebuilt from the items (reconcile of the rule over the whole table), then 0."
    );
    describe_gauge!(
        DEFINITIONS_WAITING,
        "1 while this replica holds no lease because its rule definitions differ from the committed ones, by reason (committed_replicas_live, leases_held, conflicting_definitions, newer_protocol)."
    );
    describe_gauge!(DEFINITIONS_GENERATION, "Generation of the committed rule definitions, as this replica last read it.");
    describe_gauge!(
        DEFINITIONS_RETIRE_PENDING,
        "Old rule definitions whose leftovers (targets, attributes and helper items the current rules do not write) are still to be zeroed."
    );
    describe_gauge!(
        DEFINITIONS_REMOVAL_PENDING,
        "Old rule definitions whose zeroed leftovers are removed once reconcile.remove_leftovers_after has passed."
    );
    describe_counter!(DEFINITIONS_REMOVED, "Leftovers of old rule definitions removed after the replay window, by kind (item, attribute).");
    describe_counter!(
        RULE_REBUILD_SKIPPED,
        "Targets a rule's rebuild could not correct in its passes (written all through them, or refused): reported in the log and left to the scheduled reconcile."
    );
    describe_counter!(
        DERIVATIONS,
        "Derivations of max, min, latest and distinct attributes from their helper items, by outcome (written; lost_race: another derivation of the target landed first, retried; error)."
    );
    describe_gauge!(
        HELPER_ITEMS,
        "Helper items of max, min, latest and distinct by rule and state (live: a count above zero; zero: expiring or kept), as the last scheduled reconcile of everything read them."
    );
    describe_counter!(DERIVATION_QUERIES, "Helper queries of derivations (one per attribute derived), by measure kind.");
    describe_counter!(
        DERIVATION_ITEMS_READ,
        "Helper items the derivations' queries read, live or not, by measure kind (divide by derivation_queries_total for the items one derivation reads)."
    );
    describe_counter!(COALESCED_UPDATES, "Record-to-target updates folded into aggregate writes (compare with aggregate_writes_total).");
    describe_counter!(WRITE_CAPACITY_UNITS, "Write capacity units consumed by aggregate writes.");
    describe_histogram!(BATCH_DURATION_SECONDS, Unit::Seconds, "Time to evaluate and write one batch.");
    describe_histogram!(END_TO_END_LAG_SECONDS, Unit::Seconds, "From a record's creation to its aggregate write.");
    describe_histogram!(
        BATCH_PHASE_SECONDS,
        Unit::Seconds,
        "One applied batch's time by phase: poll_wait (before the GetRecords call that returned its first record), get_records, evaluate, dead_letters, writes, checkpoint."
    );
    describe_histogram!(
        BATCH_WRITES_IN_FLIGHT,
        "Target writes a batch kept in flight at once: its targets, up to a window that grows while batches need more and halves on throttling (aggregates.write_concurrency caps it)."
    );
    describe_histogram!(
        PARTITION_PACING_SECONDS,
        Unit::Seconds,
        "Writes that waited for their partition key's budget (aggregates.partition_write_rate), by how long; writes that did not wait are not recorded."
    );
    describe_gauge!(SHARDS, "Shards of the stream by state (reading, waiting, finished).");
    describe_gauge!(LEASES_HELD, "Shard leases this replica holds.");
    describe_counter!(GET_RECORDS, "GetRecords calls by outcome (ok, empty, expired, throttled, trimmed, error).");
    describe_counter!(TRIMMED_DATA, "Times a shard position was older than the stream's retention: data was lost and needs a reconcile.");
    describe_counter!(
        SHARDS_LOST,
        "Leased shards that left the stream before they were read to their end: data was lost and a reconcile of everything was requested."
    );
    describe_counter!(
        HELPER_EXPIRIES,
        "Helper items of max, min, latest and distinct given an expiry in the table's TTL attribute (their count reached zero), per rule."
    );
    describe_counter!(
        HELPER_DELETES,
        "Expired helper items the service deleted itself (the table's TTL is not on aggregates.helper_expiry_attribute): outcome deleted, kept (written since its expiry was set, or already gone), or failed (a delete, or a partition of pending items read, that failed after its retries; tried again within a minute)."
    );
    describe_gauge!(
        HELPER_SWEEP_LAG,
        "On the replica that sweeps expired helper items: seconds between now and the oldest recorded expiry its last sweep found due (0: none). Growing: deletes fall behind the expiries."
    );
    describe_counter!(
        FOLDS,
        "Sharded totals (write_shards) folded from their sub-items, per rule: outcome written, superseded (a fold that read newer sub-items landed first) or failed (folded again next round)."
    );
    describe_gauge!(
        FOLD_LAG,
        "Per rule with write_shards, on each replica: seconds from the oldest sub-item write not yet folded into its total to the last fold round (0: all folded). Growing: folds fail or fall behind."
    );
    describe_counter!(
        COPY_WRITES,
        "Copy items written by copy rules, per rule: outcome written, older (the item held this change's copies or a newer one's), gone (deleted after the query found it), rejected (the table refused it: dead-lettered) or error (the batch is retried); and fan-outs superseded (the source changed again before they were done: the newer change writes the copies)."
    );
    describe_histogram!(COPY_FANOUT_ITEMS, "Items one source change's fan-out found, per copy rule.");
    describe_gauge!(
        COPY_JOBS_PENDING,
        "Copy fan-out jobs pending in the state table (fan-outs larger than copy.inline_items, and the follow-ups of fan-outs through an index), as this replica last listed them."
    );
    describe_gauge!(
        COPY_JOB_AGE,
        "Seconds since the oldest pending copy fan-out job was recorded (0: none). Growing: jobs fail or fall behind."
    );
    describe_counter!(HELPER_WRITES_TOO_OLD, "Helper writes left out because their batch held a record older than 36 hours (a helper that expired meanwhile would count it again); a reconcile of everything is requested.");
    describe_counter!(LEDGER_FENCE_VIOLATIONS, "Writes refused by a target item's ledger floor while this replica held a valid lease on the unfinished shard: an invariant violation (a reset state table, or a bug); a reconcile of everything is requested. Alert on it.");
    describe_counter!(LEASES_DELETED, "Finished leases deleted once their shard left the stream and its children held checkpoints.");
    describe_gauge!(RECONCILE_REQUESTED, "1 while a persisted request to reconcile everything (after lost or trimmed data) is pending.");
    describe_counter!(
        DEAD_LETTER_DELIVERIES,
        "Dead letters by the form SQS took (full, images_cut, keys_only) or dropped when it refused every form (alert on dropped)."
    );
    describe_counter!(DEAD_LETTERS, "Records sent to the dead-letter queue, by reason.");
    describe_counter!(DEAD_LETTER_FAILURES, "Failed attempts to send a dead letter (the shard waits and retries; alert on it).");
    describe_counter!(RECONCILE_RUNS, "Reconcile runs by outcome (ok, drift_remaining, error).");
    describe_counter!(RECONCILE_DRIFT, "Drifted target attributes found by reconcile, per rule.");
    describe_counter!(RECONCILE_CORRECTIONS, "Drifted target attributes corrected by reconcile, per rule.");
    describe_counter!(RECONCILE_FAILED_TARGETS, "Targets reconcile could not read or correct (the others went on), per rule.");
    describe_counter!(
        RECONCILE_TIP_BY_EMPTY_PAGES,
        "Shards reconcile judged caught up by the empty-page rule alone (reconcile.tip_evidence: an idle open shard, neither ended nor with a record from after the truth read applied), once per wait for evidence. The rule is an assumption AWS does not promise (RELIABILITY.md)."
    );
    describe_gauge!(RECONCILE_LAST_SUCCESS, Unit::Seconds, "When a reconcile last finished with no drift left (epoch seconds).");
    describe_gauge!(BUILD_INFO, "Build information; the value is always 1.");
}

/// The dead-letter reason of a source record some of whose copies the table refused.
pub const COPY_REJECTED: &str = "copy_rejected";

/// The `outcome` values of [`COPY_WRITES`].
pub const COPY_OUTCOMES: [&str; 6] = ["written", "older", "gone", "rejected", "error", "superseded"];

/// Creates every counter series with its fixed label values at zero, so dashboards and alerts
/// (`increase()`, `rate()`) see the series before the first event.
pub fn init_series(rules: &[String], copy_rules: &[String]) {
    use metrics::counter;
    for name in [
        RECORDS_READ,
        RECORDS_FILTERED,
        LEASES_TAKEN,
        LEASES_LOST,
        COALESCED_UPDATES,
        WRITE_CAPACITY_UNITS,
        TRIMMED_DATA,
        DEAD_LETTER_FAILURES,
        SHARDS_LOST,
        LEDGER_FENCE_VIOLATIONS,
        LEASES_DELETED,
        RECONCILE_TIP_BY_EMPTY_PAGES,
    ] {
        counter!(name).increment(0);
    }
    for outcome in WriteOutcome::ALL {
        counter!(AGGREGATE_WRITES, "outcome" => outcome.as_str()).increment(0);
    }
    for kind in ["max", "min", "latest", "distinct"] {
        counter!(DERIVATION_QUERIES, "kind" => kind).increment(0);
        counter!(DERIVATION_ITEMS_READ, "kind" => kind).increment(0);
    }
    for outcome in ["written", "lost_race", "covered", "refused", "error"] {
        counter!(DERIVATIONS, "outcome" => outcome).increment(0);
    }
    for kind in ["item", "attribute"] {
        counter!(DEFINITIONS_REMOVED, "kind" => kind).increment(0);
    }
    for outcome in ["deleted", "kept", "failed"] {
        counter!(HELPER_DELETES, "outcome" => outcome).increment(0);
    }
    metrics::gauge!(DEFINITIONS_REMOVAL_PENDING).set(0.0);
    for outcome in ReadOutcome::ALL {
        counter!(GET_RECORDS, "outcome" => outcome.as_str()).increment(0);
    }
    for outcome in RunOutcome::ALL {
        counter!(RECONCILE_RUNS, "outcome" => outcome.as_str()).increment(0);
    }
    for reason in crate::state::definitions::WaitReason::ALL {
        metrics::gauge!(DEFINITIONS_WAITING, "reason" => reason.as_str()).set(0.0);
    }
    for state in ShardState::ALL {
        metrics::gauge!(SHARDS, "state" => state.as_str()).set(0.0);
    }
    for form in crate::sink::dead_letter::Delivery::ALL {
        counter!(DEAD_LETTER_DELIVERIES, "form" => form.as_str()).increment(0);
    }
    let reasons = crate::rules::PoisonCode::ALL.iter().map(|c| c.as_str()).chain(["too_old", "write_rejected", COPY_REJECTED]);
    for reason in reasons {
        counter!(DEAD_LETTERS, "reason" => reason).increment(0);
        counter!(RECORDS_SKIPPED, "reason" => reason).increment(0);
    }
    for rule in rules {
        counter!(RECORDS_MATCHED, "rule" => rule.clone()).increment(0);
        counter!(RECONCILE_DRIFT, "rule" => rule.clone()).increment(0);
        counter!(RECONCILE_CORRECTIONS, "rule" => rule.clone()).increment(0);
        counter!(RECONCILE_FAILED_TARGETS, "rule" => rule.clone()).increment(0);
    }
    if !copy_rules.is_empty() {
        metrics::gauge!(COPY_JOBS_PENDING).set(0.0);
        metrics::gauge!(COPY_JOB_AGE).set(0.0);
    }
    for rule in copy_rules {
        counter!(RECORDS_MATCHED, "rule" => rule.clone()).increment(0);
        for outcome in COPY_OUTCOMES {
            counter!(COPY_WRITES, "rule" => rule.clone(), "outcome" => outcome).increment(0);
        }
    }
}

/// Label values: one definition per event, so a dashboard or alert never matches a spelling
/// that one module types differently.
macro_rules! label_values {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }
    };
}

label_values! {
    /// `aggregate_writes_total{outcome}`.
    WriteOutcome {
        /// Written.
        Applied => "applied",
        /// Already applied (a replayed batch): nothing changed.
        Stale => "stale",
        /// Refused by the floor: the shard's entries may be pruned.
        Fenced => "fenced",
        /// Refused because reconcile placed, replaced or removed a hold on the target: redone
        /// for the hold (logging under it, or ending an expired one).
        Held => "held",
        /// Refused for good (a ValidationException): the records are dead-lettered.
        Rejected => "rejected",
        /// Failed and retried.
        Error => "error",
    }
}

label_values! {
    /// `get_records_total{outcome}`.
    ReadOutcome {
        Ok => "ok",
        Empty => "empty",
        Expired => "expired",
        Throttled => "throttled",
        Trimmed => "trimmed",
        Error => "error",
    }
}

label_values! {
    /// `batch_phase_seconds{phase}`.
    Phase {
        PollWait => "poll_wait",
        GetRecords => "get_records",
        Evaluate => "evaluate",
        DeadLetters => "dead_letters",
        Writes => "writes",
        Checkpoint => "checkpoint",
    }
}

label_values! {
    /// `reconcile_runs_total{outcome}`.
    RunOutcome {
        Ok => "ok",
        DriftRemaining => "drift_remaining",
        Error => "error",
    }
}

label_values! {
    /// `shards{state}`.
    ShardState {
        Reading => "reading",
        Waiting => "waiting",
        Finished => "finished",
    }
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn label_values_are_distinct_snake_case() {
        let all: Vec<&str> = WriteOutcome::ALL
            .iter()
            .map(|v| v.as_str())
            .chain(ReadOutcome::ALL.iter().map(|v| v.as_str()))
            .chain(RunOutcome::ALL.iter().map(|v| v.as_str()))
            .chain(ShardState::ALL.iter().map(|v| v.as_str()))
            .chain(Phase::ALL.iter().map(|v| v.as_str()))
            .collect();
        assert!(all.iter().all(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')), "{all:?}");
        assert_eq!(WriteOutcome::ALL.len(), 6);
        assert_eq!(ReadOutcome::ALL.len(), 6);
    }
}
