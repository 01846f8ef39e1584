//! Keeps one replica's writes to one partition key under a rate (`aggregates.partition_write_rate`).
//!
//! A DynamoDB partition takes about 1,000 WCU/s. A target and its helper items (max, min,
//! latest, distinct) share a partition key, and a reader catching up writes a batch's worth of
//! them at once: a busy customer's helpers alone can pass the limit, and the table throttles.
//! Pacing spreads them out instead, as a token bucket per partition key:
//!
//! - a key holds up to `burst` WCU of credit and earns `rate` WCU per second;
//! - a write reserves its expected cost before it is sent (the last cost seen on the key for its
//!   [`Kind`] of write, 1 WCU at first) and waits until the key's credit is back to zero if that
//!   took it below;
//! - once the write is done its real cost settles the difference.
//!
//! So in any second a key takes at most `burst + rate` WCU from this replica, plus what writes
//! cost beyond their estimate. A batch sends its writes to a key together, their estimates made
//! before any of them is settled: estimated per kind, a batch's many small helper writes are not
//! charged at its target's cost, nor its target or derivation at a helper's. Pacing only delays
//! writes: which records are applied, and how, does not depend on it. A target written from many
//! shards (a global total) is the business of `write_shards`, not of this per-replica budget.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The longest one write waits for its key, whatever the key owes.
const MAX_WAIT: Duration = Duration::from_secs(60);

/// Keys held before idle ones (credit full again) are dropped; after a sweep, the next one
/// waits until the keys left have doubled, so sweeps cost O(1) a write however many keys are busy.
const KEYS_BEFORE_SWEEP: usize = 4096;

/// The buckets of the keys seen lately, and the count at which idle ones are dropped next.
#[derive(Debug)]
struct Keys {
    buckets: HashMap<String, Bucket>,
    sweep_at: usize,
}

impl Default for Keys {
    fn default() -> Keys {
        Keys { buckets: HashMap::new(), sweep_at: KEYS_BEFORE_SWEEP }
    }
}

/// One partition key's credit.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bucket {
    /// WCU of credit at `at_ms` (below zero: owed by writes already sent).
    credit: f64,
    at_ms: u64,
    /// What the last write of each [`Kind`] to the key cost (the next one's estimate).
    last_cost: [f64; 3],
}

/// The kind of a paced write: writes of one kind to a key cost about the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A batch's write to a target item (its counters and its ledger).
    Target = 0,
    /// A batch's write to a helper item of a max, min, latest or distinct measure (small).
    Helper = 1,
    /// A derivation of a target's max, min, latest or distinct from its helpers (a
    /// transaction over several items for `distinct`).
    Derivation = 2,
}

impl Kind {
    /// The kind's estimate in [`Bucket::last_cost`].
    fn index(self) -> usize {
        self as usize
    }
}

/// A token bucket's rate and size, in WCU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Credit earned per second.
    pub rate: f64,
    /// Most credit a key holds.
    pub burst: f64,
}

impl Budget {
    /// A budget of `rate` WCU/s whose burst is an eighth of it, so that a key takes at most
    /// `1.125 x rate` in any second: 900 at the default 800, which leaves room for writes that
    /// cost more than their estimate under DynamoDB's 1,000.
    pub fn of_rate(rate: u32) -> Budget {
        let rate = f64::from(rate.max(1));
        Budget { rate, burst: (rate / 8.0).max(1.0) }
    }

    /// The bucket as of `now_ms`: credit earned since, up to the burst.
    fn refill(&self, b: Bucket, now_ms: u64) -> Bucket {
        let earned = now_ms.saturating_sub(b.at_ms) as f64 * self.rate / 1000.0;
        Bucket { credit: (b.credit + earned).min(self.burst), at_ms: now_ms.max(b.at_ms), ..b }
    }

    /// Reserves a write's expected cost on a key (None: not seen yet, full credit): the key's
    /// bucket after it, and how long the write waits (until the credit is back to zero).
    fn reserve(&self, b: Option<Bucket>, now_ms: u64, kind: Kind) -> (Bucket, Duration) {
        let b = self.refill(b.unwrap_or(Bucket { credit: self.burst, at_ms: now_ms, last_cost: [1.0; 3] }), now_ms);
        let credit = b.credit - b.last_cost[kind.index()];
        // Never NaN or negative (costs are finite and at least 0); capped all the same.
        let wait =
            if credit >= 0.0 { Duration::ZERO } else { Duration::try_from_secs_f64(-credit / self.rate).unwrap_or(MAX_WAIT).min(MAX_WAIT) };
        (Bucket { credit, ..b }, wait)
    }

    /// A write that reserved `reserved` and cost `cost` settles the difference; its cost is the
    /// key's next estimate for its kind.
    fn settle(&self, b: Bucket, reserved: Reserved, cost: f64, now_ms: u64) -> Bucket {
        let b = self.refill(b, now_ms);
        let cost = if cost.is_finite() { cost.max(0.0) } else { reserved.cost };
        let mut last_cost = b.last_cost;
        last_cost[reserved.kind.index()] = cost.max(1.0);
        Bucket { credit: (b.credit + reserved.cost - cost).min(self.burst), last_cost, ..b }
    }

    /// The table throttled a write to the key anyway (another writer shares it, or writes cost
    /// more than estimated): the key's next write waits at least a burst's worth of time.
    fn throttled(&self, b: Bucket, now_ms: u64) -> Bucket {
        let b = self.refill(b, now_ms);
        Bucket { credit: b.credit.min(-self.burst), ..b }
    }

    /// Whether a key's bucket is full again by `now_ms` (dropping it changes nothing).
    fn idle(&self, b: Bucket, now_ms: u64) -> bool {
        self.refill(b, now_ms).credit >= self.burst
    }
}

/// What a paced write cost, as far as it is known.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spent {
    /// WCU consumed (None: the write failed, and its estimate stays charged).
    pub cost: Option<f64>,
    /// The table throttled one of its calls.
    pub throttled: bool,
}

/// A reservation to settle once the write is done ([`Pacer::settle`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use]
pub struct Reserved {
    cost: f64,
    kind: Kind,
}

/// The partition keys this replica writes, each with its own bucket.
#[derive(Debug)]
pub struct Pacer {
    budget: Budget,
    /// The pacer's clock starts at its first use (tokio's clock: paused and advanced in
    /// simulations, so read inside the runtime).
    started: std::sync::OnceLock<tokio::time::Instant>,
    keys: Mutex<Keys>,
    waited_ms: AtomicU64,
    waits: AtomicU64,
}

impl Pacer {
    /// None for a rate of 0 (no pacing).
    pub fn new(rate: u32) -> Option<Pacer> {
        (rate > 0).then(|| Pacer {
            budget: Budget::of_rate(rate),
            started: std::sync::OnceLock::new(),
            keys: Mutex::default(),
            waited_ms: AtomicU64::new(0),
            waits: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        let started = self.started.get_or_init(tokio::time::Instant::now);
        u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until a write of `kind` to `partition_key` fits the budget; settle it when done.
    pub async fn reserve(&self, partition_key: &str, kind: Kind) -> Reserved {
        let now = self.now_ms();
        let (reserved, wait) = {
            let mut keys = self.keys();
            if keys.buckets.len() >= keys.sweep_at && !keys.buckets.contains_key(partition_key) {
                keys.buckets.retain(|_, b| !self.budget.idle(*b, now));
                keys.sweep_at = (2 * keys.buckets.len()).max(KEYS_BEFORE_SWEEP);
            }
            // The key is allocated once, when it is new, not on every write.
            let (b, wait) = self.budget.reserve(keys.buckets.get(partition_key).copied(), now, kind);
            match keys.buckets.get_mut(partition_key) {
                Some(old) => *old = b,
                None => drop(keys.buckets.insert(partition_key.to_string(), b)),
            }
            (Reserved { cost: b.last_cost[kind.index()], kind }, wait)
        };
        if !wait.is_zero() {
            self.waits.fetch_add(1, Ordering::Relaxed);
            self.waited_ms.fetch_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
            metrics::histogram!(crate::telemetry::names::PARTITION_PACING_SECONDS).record(wait.as_secs_f64());
            tokio::time::sleep(wait).await;
        }
        reserved
    }

    /// Settles a reservation with what the write cost (None: unknown, the estimate stays
    /// charged), and whether the table throttled it.
    pub fn settle(&self, partition_key: &str, reserved: Reserved, spent: Spent) {
        let now = self.now_ms();
        let mut keys = self.keys();
        if let Some(b) = keys.buckets.get_mut(partition_key) {
            if let Some(cost) = spent.cost {
                *b = self.budget.settle(*b, reserved, cost, now);
            }
            if spent.throttled {
                *b = self.budget.throttled(*b, now);
            }
        }
    }

    /// Writes that waited, and for how long in all (ms), since the pacer started.
    pub fn waited(&self) -> (u64, u64) {
        (self.waits.load(Ordering::Relaxed), self.waited_ms.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `writes` writes of `cost` WCU each as fast as the budget lets them, one after the
    /// other, from `start_ms`; the most WCU sent in any calendar second.
    fn peak_per_second(budget: &Budget, writes: usize, cost: f64, start_ms: u64) -> f64 {
        let mut bucket = None;
        let mut now = start_ms;
        let mut per_second: HashMap<u64, f64> = HashMap::new();
        for _ in 0..writes {
            let (b, wait) = budget.reserve(bucket, now, Kind::Target);
            now += u64::try_from(wait.as_millis()).unwrap() + u64::from(wait.subsec_nanos() % 1_000_000 > 0);
            *per_second.entry(now / 1000).or_default() += cost;
            bucket = Some(budget.settle(b, Reserved { cost: b.last_cost[0], kind: Kind::Target }, cost, now));
        }
        per_second.into_values().fold(0.0, f64::max)
    }

    #[test]
    fn a_key_takes_at_most_its_rate_and_burst_in_any_second() {
        let budget = Budget::of_rate(800);
        assert_eq!(budget.burst, 100.0);
        for start in [0, 1, 500, 999] {
            let peak = peak_per_second(&budget, 5_000, 1.0, start);
            assert!((800.0..=900.0).contains(&peak), "start {start}: {peak} WCU in one second");
        }
        // Writes of 3 WCU: the estimate learns the cost after the first.
        let peak = peak_per_second(&budget, 2_000, 3.0, 0);
        assert!(peak <= 903.0, "{peak} WCU in one second at 3 WCU a write");
    }

    #[test]
    fn the_burst_goes_at_once_and_the_rest_waits_its_turn() {
        let budget = Budget::of_rate(800);
        let mut b = None;
        let mut waits = Vec::new();
        for _ in 0..103 {
            let (next, wait) = budget.reserve(b, 10_000, Kind::Helper);
            b = Some(next);
            waits.push(wait);
        }
        assert!(waits[..100].iter().all(Duration::is_zero), "the burst of 100 goes at once");
        // The 101st is 1 WCU in debt: 1/800 s; the 103rd 3/800 s.
        assert_eq!(waits[100], Duration::from_secs_f64(1.0 / 800.0));
        assert_eq!(waits[102], Duration::from_secs_f64(3.0 / 800.0));
    }

    #[test]
    fn each_kind_of_write_is_charged_its_own_last_cost() {
        let budget = Budget::of_rate(800);
        let (b, _) = budget.reserve(None, 0, Kind::Target);
        let b = budget.settle(b, Reserved { cost: 1.0, kind: Kind::Target }, 40.0, 0);
        let (b, _) = budget.reserve(Some(b), 0, Kind::Helper);
        let b = budget.settle(b, Reserved { cost: 1.0, kind: Kind::Helper }, 1.0, 0);
        let (b, _) = budget.reserve(Some(b), 0, Kind::Derivation);
        let b = budget.settle(b, Reserved { cost: 1.0, kind: Kind::Derivation }, 6.0, 0);
        assert_eq!(b.last_cost, [40.0, 1.0, 6.0]);
        for (kind, cost) in [(Kind::Target, 40.0), (Kind::Helper, 1.0), (Kind::Derivation, 6.0)] {
            let (after, _) = budget.reserve(Some(b), 0, kind);
            assert_eq!(b.credit - after.credit, cost, "{kind:?} is charged its own last cost");
        }
    }

    #[test]
    fn credit_comes_back_with_time_up_to_the_burst() {
        let budget = Budget::of_rate(800);
        let (b, _) = budget.reserve(None, 0, Kind::Target);
        let spent = Bucket { credit: -100.0, ..b };
        assert_eq!(budget.refill(spent, 125).credit, 0.0, "100 WCU owed, earned back in 125 ms");
        assert_eq!(budget.refill(spent, 60_000).credit, 100.0, "never above the burst");
        assert!(budget.idle(spent, 60_000) && !budget.idle(spent, 200));
        // A clock that goes back earns nothing and loses nothing.
        assert_eq!(budget.refill(Bucket { at_ms: 1_000, ..spent }, 900).credit, -100.0);
    }

    #[test]
    fn settling_charges_what_the_write_cost_and_refunds_one_never_sent() {
        let budget = Budget::of_rate(800);
        let (b, _) = budget.reserve(None, 0, Kind::Target);
        assert_eq!(b.credit, 99.0);
        let target = |cost| Reserved { cost, kind: Kind::Target };
        let dearer = budget.settle(b, target(1.0), 4.0, 0);
        assert_eq!((dearer.credit, dearer.last_cost), (96.0, [4.0, 1.0, 1.0]), "3 WCU more than reserved; the target's next estimate is 4");
        let unsent = budget.settle(dearer, target(4.0), 0.0, 0);
        assert_eq!((unsent.credit, unsent.last_cost), (100.0, [1.0; 3]), "refunded, and the estimate never below 1 WCU");
        // A cost that is not a number keeps the reservation charged; no wait overflows.
        for odd in [f64::NAN, f64::INFINITY, -5.0] {
            let b = budget.settle(b, target(1.0), odd, 0);
            assert!(b.credit.is_finite() && b.credit <= 100.0, "{odd}: {b:?}");
        }
        let deep = Bucket { credit: -1e300, ..b };
        assert_eq!(budget.reserve(Some(deep), 0, Kind::Target).1, MAX_WAIT);
    }

    /// Batches of writes to one key, each sent together as a batch sends them: its target's write
    /// of `target_wcu` and `helpers` helper writes of 1 WCU, `window` in flight, each taking
    /// `latency_ms`, then the target's derivation of `target_wcu`. A first batch teaches the
    /// estimates and the bucket fills again; the most WCU sent in any calendar second of the
    /// three batches after it (paused clock).
    async fn batches_peak(window: usize, latency_ms: u64, target_wcu: f64, helpers: usize) -> f64 {
        use futures::StreamExt;
        let pacer = Pacer::new(800).unwrap();
        let start = tokio::time::Instant::now();
        let sent = Mutex::new(HashMap::<u64, f64>::new());
        let write = |kind: Kind, cost: f64| {
            let (pacer, sent) = (&pacer, &sent);
            async move {
                let r = pacer.reserve("CUST#c1", kind).await;
                let at = u64::try_from(start.elapsed().as_millis()).unwrap();
                *sent.lock().unwrap().entry(at / 1000).or_default() += cost;
                tokio::time::sleep(Duration::from_millis(latency_ms)).await;
                pacer.settle("CUST#c1", r, Spent { cost: Some(cost), throttled: false });
            }
        };
        for batch in 0..4 {
            let kinds = std::iter::once((Kind::Target, target_wcu)).chain(std::iter::repeat_n((Kind::Helper, 1.0), helpers));
            futures::stream::iter(kinds.map(|(kind, cost)| write(kind, cost))).buffer_unordered(window).collect::<Vec<()>>().await;
            write(Kind::Derivation, target_wcu).await;
            if batch == 0 {
                tokio::time::sleep(Duration::from_secs(2)).await;
                sent.lock().unwrap().clear();
            }
        }
        sent.into_inner().unwrap().into_values().fold(0.0, f64::max)
    }

    /// A batch reserves all its writes to a key before any is settled: with one estimate per
    /// key, its target was charged at the cost of the helper written before it (over the
    /// budget by the difference) and its helpers at the target's cost (slow).
    #[tokio::test(start_paused = true)]
    async fn a_batchs_writes_to_one_key_take_at_most_rate_and_burst_in_any_second() {
        let mut over = Vec::new();
        for window in [1, 16, 256, 2_000] {
            for latency in [0, 3, 40] {
                for target_wcu in [1.0, 5.0, 40.0] {
                    let peak = batches_peak(window, latency, target_wcu, 1_500).await;
                    if peak > 900.0 {
                        over.push(format!("window {window}, latency {latency} ms, target {target_wcu} WCU: {peak} WCU in one second"));
                    }
                }
            }
        }
        assert!(over.is_empty(), "{over:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_keys_are_dropped_and_busy_ones_kept() {
        let pacer = Pacer::new(800).unwrap();
        let spent = Spent { cost: Some(1.0), throttled: false };
        // The customers and the total make KEYS_BEFORE_SWEEP keys: the next new key sweeps.
        for i in 0..KEYS_BEFORE_SWEEP - 1 {
            let r = pacer.reserve(&format!("CUST#c{i}"), Kind::Helper).await;
            pacer.settle(&format!("CUST#c{i}"), r, spent);
        }
        // A busy key: a write of 1,000 WCU leaves it in debt for more than a second.
        let r = pacer.reserve("SALES#d", Kind::Target).await;
        pacer.settle("SALES#d", r, Spent { cost: Some(1000.0), throttled: false });
        tokio::time::advance(Duration::from_millis(10)).await;
        let _ = pacer.reserve("CUST#new", Kind::Target).await;
        {
            let keys = pacer.keys();
            assert_eq!(keys.buckets.len(), 2, "the idle customers went, the busy total and the new key stay");
            assert!(keys.buckets.contains_key("SALES#d"));
            assert_eq!(keys.sweep_at, KEYS_BEFORE_SWEEP, "the next sweep at the floor");
        }
        // When a sweep finds every key busy, the next waits until they have doubled.
        for i in 0..KEYS_BEFORE_SWEEP {
            let _ = pacer.reserve(&format!("CUST#d{i}"), Kind::Helper).await;
        }
        assert_eq!(pacer.keys().sweep_at, 2 * KEYS_BEFORE_SWEEP, "no sweep per new key while all are busy");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pacer_delays_writes_past_the_burst_and_counts_the_waits() {
        let pacer = Pacer::new(400).unwrap();
        let started = tokio::time::Instant::now();
        for _ in 0..200 {
            let r = pacer.reserve("CUST#c1", Kind::Target).await;
            pacer.settle("CUST#c1", r, Spent { cost: Some(1.0), throttled: false });
        }
        // 50 go at once, the other 150 at 400 a second.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(374) && took <= Duration::from_millis(385), "{took:?}");
        let other = tokio::time::Instant::now();
        let r = pacer.reserve("CUST#c2", Kind::Target).await;
        pacer.settle("CUST#c2", r, Spent { cost: Some(1.0), throttled: true });
        assert_eq!(other.elapsed(), Duration::ZERO, "another key has its own budget");
        let after_throttle = tokio::time::Instant::now();
        let _ = pacer.reserve("CUST#c2", Kind::Target).await;
        // A throttled key's next write waits for a burst and its own cost: 51/400 s.
        let waited = after_throttle.elapsed();
        assert!(waited >= Duration::from_millis(127) && waited <= Duration::from_millis(129), "{waited:?}");
        assert_eq!(pacer.waited().0, 151);
        assert!(Pacer::new(0).is_none(), "0: no pacing");
    }
}
