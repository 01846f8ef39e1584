//! Where one batch's time goes, phase by phase: the wait before the GetRecords call that
//! returned its first record, the GetRecords calls, evaluation, dead letters, the target
//! writes and the checkpoint. Each phase is a histogram (`batch_phase_seconds{phase}`), and
//! every batch is one debug line (target `ddb_aggregator::phases`) so a lag run can say where
//! its slowest batches spent their time.

use std::time::Duration;

use crate::telemetry::names::{self, Phase};

/// The phases of one applied batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchPhases {
    /// From the end of the previous GetRecords call on the shard to the start of the one that
    /// returned the batch's first record (the idle poll interval, at the tip).
    pub poll_wait: Duration,
    /// GetRecords calls that returned the batch's records.
    pub get_records: Duration,
    pub evaluate: Duration,
    pub dead_letters: Duration,
    pub writes: Duration,
    pub checkpoint: Duration,
}

impl BatchPhases {
    /// Every phase with its label, in pipeline order.
    pub fn each(&self) -> [(Phase, Duration); 6] {
        [
            (Phase::PollWait, self.poll_wait),
            (Phase::GetRecords, self.get_records),
            (Phase::Evaluate, self.evaluate),
            (Phase::DeadLetters, self.dead_letters),
            (Phase::Writes, self.writes),
            (Phase::Checkpoint, self.checkpoint),
        ]
    }

    /// From the first GetRecords call to the checkpoint (the poll wait not included).
    pub fn busy(&self) -> Duration {
        self.each().iter().filter(|(p, _)| *p != Phase::PollWait).map(|(_, d)| *d).sum()
    }

    pub fn record(&self, shard: &str, records: usize, targets: usize) {
        for (phase, d) in self.each() {
            metrics::histogram!(names::BATCH_PHASE_SECONDS, "phase" => phase.as_str()).record(d.as_secs_f64());
        }
        tracing::debug!(
            target: "ddb_aggregator::phases",
            shard,
            records,
            targets,
            poll_wait_ms = ms(self.poll_wait),
            get_records_ms = ms(self.get_records),
            evaluate_ms = ms(self.evaluate),
            dead_letters_ms = ms(self.dead_letters),
            writes_ms = ms(self.writes),
            checkpoint_ms = ms(self.checkpoint),
            "batch phases"
        );
    }
}

/// Milliseconds with microsecond resolution, for a log field.
fn ms(d: Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}

/// The read side of the batch being gathered: the poll wait before its first page and the
/// GetRecords time of its pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gathering {
    pub poll_wait: Duration,
    pub get_records: Duration,
}

impl Gathering {
    /// A GetRecords call that took `took` after a gap of `gap` since the previous call ended
    /// returned `records`, while `pending` records were already gathered.
    pub fn page(&mut self, pending: usize, records: usize, gap: Duration, took: Duration) {
        if records == 0 {
            return;
        }
        if pending == 0 {
            *self = Gathering { poll_wait: gap, get_records: Duration::ZERO };
        }
        self.get_records += took;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_wait_is_the_gap_before_the_batch_first_page_and_reads_add_up() {
        let mut g = Gathering::default();
        g.page(0, 0, 250 * MS, 4 * MS); // an empty poll: nothing gathered
        assert_eq!(g, Gathering::default());
        g.page(0, 10, 180 * MS, 6 * MS);
        g.page(10, 1000, Duration::ZERO, 30 * MS);
        assert_eq!(g, Gathering { poll_wait: 180 * MS, get_records: 36 * MS });
        // The next batch starts afresh.
        g.page(0, 3, 100 * MS, 5 * MS);
        assert_eq!(g, Gathering { poll_wait: 100 * MS, get_records: 5 * MS });
    }

    #[test]
    fn busy_time_leaves_the_poll_wait_out() {
        let p = BatchPhases {
            poll_wait: 200 * MS,
            get_records: 5 * MS,
            evaluate: MS,
            dead_letters: Duration::ZERO,
            writes: 40 * MS,
            checkpoint: 9 * MS,
        };
        assert_eq!(p.busy(), 55 * MS);
        let labels: Vec<&str> = p.each().iter().map(|(ph, _)| ph.as_str()).collect();
        assert_eq!(labels, ["poll_wait", "get_records", "evaluate", "dead_letters", "writes", "checkpoint"]);
    }
}
