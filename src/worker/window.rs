//! How many of a batch's target writes a shard keeps in flight at once: as many as the batch
//! has targets, up to a window that grows while batches need more and halves on throttling,
//! never above `aggregates.write_concurrency`. A tip batch with ten targets sends ten; a
//! catch-up batch with hundreds uses the window, and a partition that throttles makes it
//! back off (the writes themselves retry with backoff; the window keeps the next batches
//! from hitting it as hard).

/// The window a reader starts with.
pub const START: usize = 16;
/// The smallest window throttling can bring it to.
pub const FLOOR: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteWindow {
    limit: usize,
    cap: usize,
}

impl WriteWindow {
    /// A window starting at [`START`] (or the cap, if lower). `cap` is at least 1.
    pub fn new(cap: usize) -> WriteWindow {
        let cap = cap.max(1);
        WriteWindow { limit: START.min(cap), cap }
    }

    /// Writes in flight for a batch of `writes` (at least 1).
    pub fn in_flight(&self, writes: usize) -> usize {
        self.limit.min(writes).max(1)
    }

    /// The window after a batch of `writes`: halved (not below [`FLOOR`]) if any write was
    /// throttled; grown by half (up to the cap) if the batch had more writes than the window;
    /// else as it was.
    #[must_use]
    pub fn after(self, writes: usize, throttled: bool) -> WriteWindow {
        let limit = if throttled {
            (self.limit / 2).max(FLOOR.min(self.cap))
        } else if writes > self.limit {
            self.limit.saturating_add((self.limit / 2).max(1)).min(self.cap)
        } else {
            self.limit
        };
        WriteWindow { limit, ..self }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_batch_sends_what_it_has_and_a_large_one_the_window() {
        let w = WriteWindow::new(64);
        assert_eq!(w.in_flight(10), 10);
        assert_eq!(w.in_flight(500), START);
        assert_eq!(w.in_flight(0), 1);
    }

    #[test]
    fn catch_up_grows_the_window_to_the_cap_and_tip_batches_leave_it() {
        let mut w = WriteWindow::new(64);
        let mut seen = vec![w.limit()];
        for _ in 0..10 {
            w = w.after(500, false);
            seen.push(w.limit());
        }
        assert_eq!(seen[..6], [16, 24, 36, 54, 64, 64]);
        assert_eq!(w.after(10, false), w, "a batch the window covers changes nothing");
    }

    #[test]
    fn throttling_halves_it_down_to_the_floor_and_it_grows_again() {
        let mut w = WriteWindow::new(64);
        for _ in 0..5 {
            w = w.after(500, false);
        }
        assert_eq!(w.limit(), 64);
        w = w.after(500, true);
        assert_eq!(w.limit(), 32);
        for _ in 0..10 {
            w = w.after(500, true);
        }
        assert_eq!(w.limit(), FLOOR);
        w = w.after(500, false);
        assert_eq!(w.limit(), 3);
    }

    #[test]
    fn the_cap_bounds_everything_even_below_the_start_and_floor() {
        assert_eq!(WriteWindow::new(4).in_flight(100), 4);
        assert_eq!(WriteWindow::new(4).after(100, false).limit(), 4);
        let one = WriteWindow::new(1);
        assert_eq!(one.after(100, true).limit(), 1);
        assert_eq!(one.after(100, false).limit(), 1);
        assert_eq!(WriteWindow::new(0).in_flight(5), 1, "a cap of 0 is taken as 1");
    }
}
