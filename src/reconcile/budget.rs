//! The read budget of a reconcile: consumed read capacity per second, shared by every read on
//! both tables (source scans and queries, target reads and scans), so a nightly `--all` does
//! not starve the service or the application of capacity.

use std::sync::Mutex;
use std::time::Duration;

// tokio's clock: the system's in the service, the simulated one in a simulation.
use tokio::time::Instant;

/// Read capacity units per second across every read of one reconcile; None: unlimited.
#[derive(Debug)]
pub struct ReadBudget {
    per_second: Option<f64>,
    started: Instant,
    used: Mutex<f64>,
}

impl ReadBudget {
    pub fn new(per_second: Option<f64>) -> ReadBudget {
        ReadBudget { per_second: per_second.filter(|r| *r > 0.0), started: Instant::now(), used: Mutex::new(0.0) }
    }

    /// Records `units` consumed, then waits until the budget allows the next read.
    pub async fn spend(&self, units: f64) {
        let used = {
            let mut u = self.used.lock().unwrap_or_else(|e| e.into_inner());
            *u += units.max(0.0);
            *u
        };
        if let Some(d) = self.per_second.and_then(|r| delay(used, r, self.started.elapsed())) {
            tokio::time::sleep(d).await;
        }
    }

    /// Units consumed so far.
    pub fn used(&self) -> f64 {
        *self.used.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How long to wait so that `used` units over the run stay within `per_second` (pure).
pub fn delay(used: f64, per_second: f64, elapsed: Duration) -> Option<Duration> {
    if per_second <= 0.0 || !used.is_finite() {
        return None;
    }
    let due = Duration::try_from_secs_f64(used / per_second).ok()?;
    due.checked_sub(elapsed).filter(|d| !d.is_zero())
}

/// What a read consumed: DynamoDB's figure, or one unit per item (a strongly consistent read
/// of an item up to 4 KB) when the answer has none.
pub fn units(consumed: Option<f64>, items: usize) -> f64 {
    consumed.unwrap_or(items.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wait_for_their_budget() {
        let s = Duration::from_secs;
        assert_eq!(delay(100.0, 50.0, s(1)), Some(s(1)), "100 units at 50/s take 2 s");
        assert_eq!(delay(100.0, 50.0, s(3)), None, "behind the budget: no wait");
        assert_eq!(delay(100.0, 0.0, s(0)), None);
        assert_eq!(delay(f64::INFINITY, 1.0, s(0)), None);
        assert_eq!(units(Some(2.5), 10), 2.5);
        assert_eq!(units(None, 10), 10.0);
        assert_eq!(units(None, 0), 1.0, "an empty page still costs a read");
    }
}
