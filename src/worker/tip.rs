//! A reader's evidence that it reached its shard's tip (pure): the empty-page rule of
//! `reconcile.tip_evidence`.
//!
//! Reconcile prefers evidence that needs no rule (the shard ended, or a record created after
//! its truth read was applied: `reconcile::caught_up`); for an idle open shard there is only
//! this. AWS documents that GetRecords may answer empty pages for a stretch of a shard without
//! records and need "multiple calls" to pass it, with no bound, so a run of empty pages is
//! taken as the tip only when it is both long (`empty_pages`) and slow (`over`).

use std::collections::VecDeque;

use crate::config::TipEvidence;

/// The current run of empty pages on one iterator chain.
#[derive(Debug, Default, Clone)]
pub struct EmptyRun {
    /// Call times (epoch ms) of the run's pages, oldest first, from the latest that may date
    /// evidence on (older ones can never date evidence again and are dropped).
    calls: VecDeque<u64>,
}

impl EmptyRun {
    /// A new iterator chain: what the old one answered says nothing about it.
    pub fn reset(&mut self) {
        self.calls.clear();
    }

    /// Takes one page of `records` from a call made at `called_at` (epoch ms). Returns the
    /// evidence it gives, if any: under the rule everything created before that time was
    /// read. The date is the latest call that starts `rule.empty_pages` pages in a row (up to
    /// and including this one), this one called at least `rule.over` after it.
    pub fn page(&mut self, rule: &TipEvidence, records: usize, called_at: u64) -> Option<u64> {
        if records > 0 {
            self.calls.clear();
            return None;
        }
        self.calls.push_back(called_at);
        let over = u64::try_from(rule.over.as_millis()).unwrap_or(u64::MAX);
        let pages = rule.empty_pages.max(1) as usize;
        // Page i starts a qualifying run when at least `pages` pages follow from it (itself
        // included) and they span `over`; both only get easier as the run grows.
        let qualifies = |calls: &VecDeque<u64>, i: usize| calls.len() - i >= pages && called_at.saturating_sub(calls[i]) >= over;
        while self.calls.len() >= 2 && qualifies(&self.calls, 1) {
            self.calls.pop_front();
        }
        qualifies(&self.calls, 0).then(|| self.calls[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rule(empty_pages: u32, over_ms: u64) -> TipEvidence {
        TipEvidence { empty_pages, over: Duration::from_millis(over_ms) }
    }

    /// The evidence after each page of (records, call time).
    fn run(rule: &TipEvidence, pages: &[(usize, u64)]) -> Vec<Option<u64>> {
        let mut r = EmptyRun::default();
        pages.iter().map(|(n, at)| r.page(rule, *n, *at)).collect()
    }

    #[test]
    fn a_run_must_be_long_and_slow() {
        let r = rule(3, 2_000);
        // Three empty pages within a second: not yet. The run goes on until its first page is
        // 2s behind, and the date moves up with the latest page 2s behind.
        let pages = [(0, 0), (0, 500), (0, 1_000), (0, 1_999), (0, 2_000), (0, 2_250), (0, 2_500)];
        assert_eq!(run(&r, &pages), [None, None, None, None, Some(0), Some(0), Some(500)]);
        // Two pages 5s apart are slow enough but too few; the third makes a run, dated by its
        // first page (5_000 starts only two).
        let slow = [(0, 0), (0, 5_000), (0, 10_000)];
        assert_eq!(run(&r, &slow), [None, None, Some(0)]);
    }

    #[test]
    fn records_or_a_new_chain_start_the_run_again() {
        let r = rule(2, 0);
        assert_eq!(run(&r, &[(0, 10), (5, 20), (0, 30), (0, 40)]), [None, None, None, Some(30)], "a page with records ends a run");
        assert_eq!(run(&r, &[(0, 10), (1000, 20), (0, 30)]), [None, None, None], "a full page too");
        let mut e = EmptyRun::default();
        assert_eq!(e.page(&r, 0, 10), None);
        e.reset();
        assert_eq!(e.page(&r, 0, 20), None, "a new iterator chain starts from nothing");
        assert_eq!(e.page(&r, 0, 30), Some(20));
    }

    #[test]
    fn the_old_rule_is_two_pages_over_nothing() {
        // `empty_pages: 2, over: 0s` is the rule before `reconcile.tip_evidence`: two empty
        // pages in a row, dated by the first of the last two.
        let r = rule(2, 0);
        assert_eq!(run(&r, &[(0, 100), (0, 200), (0, 300)]), [None, Some(100), Some(200)]);
    }

    #[test]
    fn a_clock_that_steps_back_is_measured_from_after_the_step() {
        let r = rule(2, 1_000);
        assert_eq!(run(&r, &[(0, 5_000), (0, 3_000), (0, 4_500)]), [None, None, Some(3_000)]);
    }

    #[test]
    fn a_long_idle_run_keeps_only_what_may_still_date_evidence() {
        let r = rule(3, 2_000);
        let mut e = EmptyRun::default();
        let mut last = None;
        for i in 0..10_000u64 {
            last = e.page(&r, 0, i * 250);
        }
        assert_eq!(last, Some(9_999 * 250 - 2_000), "the newest call 2s back");
        assert_eq!(e.calls.len(), 9, "8 pages within 2s at 250 ms, and the one 2s back");
    }
}
