//! Iterator age per shard, as Lambda's IteratorAge and KCL's MillisBehindLatest mean it: how far
//! behind the stream this replica's reading of the shard is. Kept from what the reader saw and
//! computed on every maintenance tick (pure), so a shard whose batches keep failing shows an age
//! that goes on rising instead of a frozen value or a series that disappears.

/// What a reader has seen of its shard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardAge {
    /// Creation time (epoch ms) of the oldest record read and not yet applied.
    pub oldest_unapplied_ms: Option<u64>,
    /// Creation time of the newest record applied.
    pub newest_applied_ms: Option<u64>,
    /// The last read found nothing more, with nothing waiting to be applied.
    pub at_tip: bool,
    /// When reading started failing (GetRecords or GetShardIterator errors in a row).
    pub failing_since_ms: Option<u64>,
}

impl ShardAge {
    /// Records were read (the first of them created at `first_ms`).
    pub fn read(&mut self, first_ms: Option<u64>) {
        if self.oldest_unapplied_ms.is_none() {
            self.oldest_unapplied_ms = first_ms;
        }
        self.at_tip = false;
        self.failing_since_ms = None;
    }

    /// A GetRecords or GetShardIterator call failed at `now_ms`.
    pub fn failed(&mut self, now_ms: u64) {
        self.failing_since_ms.get_or_insert(now_ms);
    }

    /// Everything read so far is applied; the newest record was created at `newest_ms`.
    pub fn applied(&mut self, newest_ms: Option<u64>) {
        self.oldest_unapplied_ms = None;
        if newest_ms.is_some() {
            self.newest_applied_ms = newest_ms;
        }
    }

    /// An empty page with nothing pending.
    pub fn tip(&mut self) {
        self.at_tip = self.oldest_unapplied_ms.is_none();
        self.failing_since_ms = None;
    }

    /// Seconds behind at `now_ms`: from the oldest record waiting to be applied; at the tip, 0,
    /// or the time since reading started failing there; else from the newest record applied
    /// (a reader that cannot read falls behind by the time since) or from the first failure;
    /// 0 before anything was read.
    pub fn seconds(&self, now_ms: u64) -> f64 {
        let since = |t: u64| now_ms.saturating_sub(t) as f64 / 1000.0;
        match (self.oldest_unapplied_ms, self.at_tip) {
            (Some(t), _) => since(t),
            (None, true) => self.failing_since_ms.map_or(0.0, since),
            (None, false) => self.newest_applied_ms.or(self.failing_since_ms).map_or(0.0, since),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stuck_batch_ages_from_its_oldest_record() {
        let mut a = ShardAge::default();
        assert_eq!(a.seconds(50_000), 0.0, "nothing read yet");
        a.read(Some(10_000));
        a.read(Some(20_000));
        assert_eq!(a.seconds(70_000), 60.0, "the oldest unapplied record counts");
        a.tip();
        assert_eq!(a.seconds(130_000), 120.0, "an empty page does not hide records still waiting");
        a.applied(Some(20_000));
        assert_eq!(a.seconds(130_000), 110.0, "applied, not at the tip: since the newest applied");
        a.tip();
        assert_eq!(a.seconds(500_000), 0.0, "at the tip");
        a.read(Some(400_000));
        assert_eq!(a.seconds(500_000), 100.0);
        a.applied(None);
        assert_eq!(a.seconds(500_000), 480.0, "a batch without creation times keeps the last known");
    }

    #[test]
    fn a_reader_that_cannot_read_falls_behind() {
        let mut a = ShardAge::default();
        a.failed(10_000);
        a.failed(20_000);
        assert_eq!(a.seconds(70_000), 60.0, "never read anything: from the first failure");
        a.tip();
        assert_eq!(a.seconds(70_000), 0.0);
        a.read(Some(60_000));
        a.applied(Some(60_000));
        a.tip();
        a.failed(3_600_000);
        assert_eq!(a.seconds(3_605_000), 5.0, "an idle shard throttled once: since the failure, not the last record");
        assert_eq!(a.seconds(3_900_000), 300.0, "and failing on: the age goes on rising");
    }
}
