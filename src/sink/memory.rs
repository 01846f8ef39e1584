//! An in-memory aggregate table with the same conditional ledger semantics, for unit tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::distinct::COUNTED;
use super::expiry::{due_before, pending_at, pending_key, pending_partition, DueQuery, Pending};
use super::hold::{HoldSeen, HoldWrite};
use super::{
    AggregateStore, Counters, DerivationNames, Derived, DerivedWrite, HelperQuery, HelperSeen, HelperState, HelperStates, LedgerWrite,
    LiveHelpers, Settle, SettleWrite, SinkError, TransitionWrite, WriteOutcome,
};
use crate::decimal::Decimal;
use crate::rules::helper::{self, HelperScan, Scalar, REFS};
use crate::sink::ledger::{admits, applied_of, expressions, is_any_entry, Seen, MAX_EXPRESSION_BYTES};

/// One item's attributes.
type Item = BTreeMap<String, MemValue>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemValue {
    Num(Decimal),
    Str(String),
    Set(std::collections::BTreeSet<String>),
    Bin(Vec<u8>),
}

#[derive(Debug, Default)]
struct State {
    /// By key, in key order: a partition's helper items are a range (as a Query reads them).
    items: BTreeMap<Vec<String>, BTreeMap<String, MemValue>>,
    /// Pending helper expiries ([`super::expiry::pending_key`]): their key, and the helper's
    /// key values.
    pending: BTreeMap<(String, String), Vec<String>>,
    /// Pending expiries are refused for good (a role without dynamodb:PutItem).
    refuse_pending: bool,
    /// The sweep's faults: deletes of these helpers, and reads of these partitions of pending
    /// items, are refused for good.
    refuse_deletes: std::collections::BTreeSet<Vec<String>>,
    refuse_pending_reads: std::collections::BTreeSet<u8>,
    /// Every expiry set, by (expiry, key), so that [`MemoryAggregates::delete_expired`] reads
    /// only those due (an entry whose item has another expiry since, or none, is stale).
    expiring: std::collections::BTreeSet<(u64, Vec<String>)>,
    fail_next: u32,
    /// Writes that fail with an error no retry helps (the batch fails at once).
    fatal_next: u32,
    calls: u64,
    /// Largest item size written, bytes, and the ledger entries (of any namespace) it held.
    largest_item: usize,
    largest_item_entries: usize,
    /// When (epoch ms, the service's clock) the largest item was written.
    largest_item_at: u64,
    /// The largest item as that write left it (a simulation explains its entries).
    largest_item_copy: BTreeMap<String, MemValue>,
    /// Largest item size written since a simulation last asked (its hourly figure).
    largest_since_asked: usize,
    /// Per partition key: the second (of the service's clock) its writes last fell in, and the
    /// WCU of its ledger writes in that second.
    partition_second: std::collections::HashMap<String, (u64, f64)>,
    /// The most WCU one partition key took in one second since last asked, and the key; and
    /// the same per partition key.
    peak_partition_since_asked: (f64, String),
    peaks_since_asked: HashMap<String, f64>,
    /// WCU a partition key takes per second before ledger writes are throttled (None: no
    /// limit), and the writes throttled since last asked.
    partition_limit: Option<f64>,
    throttled_since_asked: u64,
    /// The same for strongly consistent reads of one item ([`MemoryAggregates::read_item`]):
    /// RCU per partition key in the current second, the limit (DynamoDB's is about 3,000
    /// RCU/s), the reads throttled and the most RCU one key took in a second since last asked.
    read_second: std::collections::HashMap<String, (u64, f64)>,
    read_limit: Option<f64>,
    reads_throttled_since_asked: u64,
    peak_read_since_asked: (f64, String),
    /// Per item: writes applied and the capacity they consumed (an item deleted leaves it:
    /// [`State::forget_usage`]).
    usage: HashMap<Vec<String>, (u64, f64)>,
    /// The most written of the items deleted since, with its usage.
    hottest_gone: Option<(Vec<String>, (u64, f64))>,
}

#[derive(Debug, Default)]
pub struct MemoryAggregates {
    state: Mutex<State>,
    gate: WriteGate,
}

/// Holds ledger writes back, for tests of what happens while a batch is writing.
#[derive(Debug, Default)]
struct WriteGate {
    /// None: open; Some(n): n more writes pass, then writes wait.
    closing: Mutex<Option<u64>>,
    opened: tokio::sync::Notify,
    waiting: std::sync::atomic::AtomicUsize,
}

impl WriteGate {
    /// Whether this write passes now (and counts it against the writes still let through).
    fn pass(&self) -> bool {
        let mut closing = self.closing.lock().unwrap_or_else(|e| e.into_inner());
        match closing.as_mut() {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }

    async fn wait(&self) {
        use std::sync::atomic::Ordering;
        loop {
            let opened = self.opened.notified();
            tokio::pin!(opened);
            opened.as_mut().enable();
            if self.pass() {
                return;
            }
            self.waiting.fetch_add(1, Ordering::SeqCst);
            opened.await;
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl MemoryAggregates {
    pub fn new() -> MemoryAggregates {
        MemoryAggregates::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numeric measure attributes of every item (not the ledger's own): (key values, attribute) -> value.
    pub fn numbers(&self) -> BTreeMap<(Vec<String>, String), Decimal> {
        let s = self.lock();
        let mut out = BTreeMap::new();
        for (k, item) in &s.items {
            for (a, v) in item {
                if let MemValue::Num(n) = v {
                    if !n.is_zero() && !a.starts_with(crate::rules::RESERVED_ATTRIBUTE_PREFIX) {
                        out.insert((k.clone(), a.clone()), *n);
                    }
                }
            }
        }
        out
    }

    pub fn item(&self, key: &[&str]) -> Option<BTreeMap<String, MemValue>> {
        self.with_item(&key.iter().map(|s| s.to_string()).collect::<Vec<_>>(), |item| item.cloned())
    }

    /// `f` of the item with these key values (None: absent), read in place: nothing cloned.
    pub fn with_item<R>(&self, key: &[String], f: impl FnOnce(Option<&BTreeMap<String, MemValue>>) -> R) -> R {
        f(self.lock().items.get(key))
    }

    /// [`MemoryAggregates::with_item`] as a strongly consistent GetItem: 1 RCU per started
    /// 4 KB (1 for an item that is not there) on the item's partition key, refused with
    /// [`SinkError::Throttled`] if it would take that key over the read limit in this second
    /// ([`MemoryAggregates::set_read_limit`]).
    pub fn read_item<R>(&self, key: &[String], f: impl FnOnce(Option<&BTreeMap<String, MemValue>>) -> R) -> Result<R, SinkError> {
        let mut s = self.lock();
        let size = s.items.get(key).map_or(0, |item| item_size(&[], item));
        let rcu = size.div_ceil(4096).max(1) as f64;
        let partition = key.first().map_or("", String::as_str);
        let second = crate::state::now_ms() / 1000;
        if s.read_limit.is_some_and(|limit| used_in(&s.read_second, partition, second) + rcu > limit) {
            s.reads_throttled_since_asked += 1;
            return Err(SinkError::Throttled(format!(
                "ProvisionedThroughputExceededException: partition {partition:?} over its read limit"
            )));
        }
        let used = charge_in(&mut s.read_second, partition, second, rcu);
        if used > s.peak_read_since_asked.0 {
            s.peak_read_since_asked = (used, partition.to_string());
        }
        Ok(f(s.items.get(key)))
    }

    /// Throttles a strongly consistent read ([`MemoryAggregates::read_item`]) that would take
    /// its partition key over `rcu` within one second, as DynamoDB does above about 3,000
    /// RCU/s per partition (None: no limit, the default).
    pub fn set_read_limit(&self, rcu: Option<f64>) {
        self.lock().read_limit = rcu;
    }

    /// Reads throttled by the read limit since last asked, and the most RCU one partition key
    /// took in one second, with the key.
    pub fn take_read_figures(&self) -> (u64, (f64, String)) {
        let mut s = self.lock();
        (std::mem::take(&mut s.reads_throttled_since_asked), std::mem::take(&mut s.peak_read_since_asked))
    }

    /// `f` of every item whose key values `wanted` accepts, in key order, read in place.
    pub fn each_item(&self, mut wanted: impl FnMut(&[String]) -> bool, mut f: impl FnMut(&[String], &BTreeMap<String, MemValue>)) {
        for (k, item) in self.lock().items.iter().filter(|(k, _)| wanted(k)) {
            f(k, item);
        }
    }

    /// What DynamoDB's TTL does, at once: deletes the items whose `attribute` (epoch seconds)
    /// is at or before `now_s`. How many it deleted.
    pub fn delete_expired(&self, attribute: &str, now_s: u64) -> usize {
        let mut s = self.lock();
        let mut deleted = 0;
        while let Some((at, key)) = s.expiring.first().cloned().filter(|(at, _)| *at <= now_s) {
            s.expiring.remove(&(at, key.clone()));
            let still = Decimal::from_i64(i64::try_from(at).unwrap_or(i64::MAX));
            if s.items.get(&key).is_some_and(|item| matches!(item.get(attribute), Some(MemValue::Num(x)) if *x == still)) {
                s.items.remove(&key);
                s.forget_usage(&key);
                deleted += 1;
            }
        }
        deleted
    }

    /// How many pending helper expiries are recorded ([`AggregateStore::register_expiry`]).
    pub fn pending_expiries(&self) -> usize {
        self.lock().pending.len()
    }

    /// Refuses every pending expiry from now on, as a table refuses a role without the right.
    pub fn refuse_pending_expiries(&self) {
        self.lock().refuse_pending = true;
    }

    /// Refuses for good the sweep's deletes of these helpers (key values) and its reads of
    /// these partitions of pending items (a fault the sweep must survive).
    pub fn refuse_sweep(&self, helpers: &[Vec<String>], partitions: &[u8]) {
        let mut s = self.lock();
        s.refuse_deletes.extend(helpers.iter().cloned());
        s.refuse_pending_reads.extend(partitions.iter().copied());
    }

    /// Removes an attribute directly (a write that never landed).
    pub fn remove_attribute(&self, key: &[&str], attr: &str) {
        if let Some(item) = self.lock().items.get_mut(&key.iter().map(|s| s.to_string()).collect::<Vec<_>>()) {
            item.remove(attr);
        }
    }

    /// Sets an attribute directly (e.g. a string where a counter should be).
    pub fn put(&self, key: &[&str], attr: &str, value: MemValue) {
        let mut s = self.lock();
        let key: Vec<String> = key.iter().map(|s| s.to_string()).collect();
        // Any number may be an expiry (reconcile's corrections set theirs here).
        if let MemValue::Num(n) = &value {
            if let Ok(at) = n.to_string().parse::<u64>() {
                s.expiring.insert((at, key.clone()));
            }
        }
        s.items.entry(key).or_default().insert(attr.to_string(), value);
    }

    /// The next `n` writes fail with a transient error.
    pub fn fail_next(&self, n: u32) {
        self.lock().fail_next = n;
    }

    /// The next `n` ledger writes fail with an error the write does not retry.
    pub fn fail_next_for_good(&self, n: u32) {
        self.lock().fatal_next = n;
    }

    pub fn calls(&self) -> u64 {
        self.lock().calls
    }

    /// Ledger writes wait after `n` more have passed, until [`MemoryAggregates::open_writes`].
    pub fn close_writes_after(&self, n: u64) {
        *self.gate.closing.lock().unwrap_or_else(|e| e.into_inner()) = Some(n);
    }

    pub fn open_writes(&self) {
        *self.gate.closing.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.gate.opened.notify_waiters();
    }

    /// Ledger writes waiting at the closed gate.
    pub fn writes_waiting(&self) -> usize {
        self.gate.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The most written item: its key, writes and mean WCU per write.
    pub fn hottest(&self) -> Option<(Vec<String>, u64, f64)> {
        let s = self.lock();
        let gone = s.hottest_gone.as_ref().map(|(k, u)| (k, u));
        s.usage.iter().chain(gone).max_by(|a, b| hotter(*a, *b)).map(|(k, (n, c))| (k.clone(), *n, c / *n as f64))
    }

    /// The keys of the items whose key is `rest` followed by a last part that begins with
    /// `prefix` (a partition's helper items), in key order: a range, not a pass over the table.
    pub fn keys_with_prefix(&self, rest: &[String], prefix: &str) -> Vec<Vec<String>> {
        let mut start = rest.to_vec();
        start.push(prefix.to_string());
        self.lock()
            .items
            .range(start..)
            .map(|(k, _)| k)
            .take_while(|k| k.len() == rest.len() + 1 && k[..rest.len()] == *rest && k[rest.len()].starts_with(prefix))
            .cloned()
            .collect()
    }

    /// Every item's key values.
    pub fn keys(&self) -> Vec<Vec<String>> {
        self.lock().items.keys().cloned().collect()
    }

    /// Reconcile's correction: sets `set` and advances the counter `version_attribute`, if
    /// `guard` holds; adds the names to `measures_attribute`; sets the string attributes
    /// `texts` (a fence: the ledger's floor and straggler set).
    /// A fold of a sharded target's total: sets `values` and `fold_attribute` to `seq` if the
    /// stored sequence is absent or lower (as DynamoDB's
    /// `attribute_not_exists(#s) OR #s < :s`).
    pub fn fold_if(&self, key: &[String], fold_attribute: &str, seq: Decimal, values: &[(String, Decimal)]) -> bool {
        let mut s = self.lock();
        if matches!(s.items.get(key).and_then(|i| i.get(fold_attribute)), Some(MemValue::Num(n)) if *n >= seq) {
            return false;
        }
        let item = s.items.entry(key.to_vec()).or_default();
        for (name, v) in values {
            item.insert(name.clone(), MemValue::Num(*v));
        }
        item.insert(fold_attribute.to_string(), MemValue::Num(seq));
        true
    }

    /// A retired sharded total: `zero` set to 0 and the fold sequence removed, if it has one
    /// (as DynamoDB's `attribute_exists(#s)`).
    pub fn reset_fold_if(&self, key: &[String], fold_attribute: &str, zero: &[String]) -> bool {
        let mut s = self.lock();
        let Some(item) = s.items.get_mut(key).filter(|i| i.contains_key(fold_attribute)) else { return false };
        for name in zero {
            item.insert(name.clone(), MemValue::Num(Decimal::ZERO));
        }
        item.remove(fold_attribute);
        true
    }

    pub fn correct_if(
        &self,
        key: &[String],
        (version_attribute, measures_attribute): (&str, &str),
        guard: Guard<'_>,
        set: &[(String, Decimal)],
        texts: &[(String, String)],
        remove: &[String],
    ) -> bool {
        let Guard { seen, expect, hold } = guard;
        let mut s = self.lock();
        if let Some((attribute, value)) = hold {
            let held = matches!(s.items.get(key).and_then(|i| i.get(attribute)), Some(MemValue::Str(h)) if h == value);
            if !held {
                return false;
            }
        }
        let version = match s.items.get(key).and_then(|i| i.get(version_attribute)) {
            Some(MemValue::Num(n)) => Some(*n),
            _ => None,
        };
        if expect.is_empty() {
            if version.map(|v| v.to_string()).as_deref() != seen {
                return false;
            }
        } else {
            // As DynamoDB's `attribute_exists(#v) AND #e0 = :e0 ...`.
            let holds = |(name, want): &(String, Decimal)| matches!(s.items.get(key).and_then(|i| i.get(name)), Some(MemValue::Num(n)) if n == want);
            if version.is_none() || !expect.iter().all(holds) {
                return false;
            }
        }
        let item = s.items.entry(key.to_vec()).or_default();
        for (name, v) in set {
            item.insert(name.clone(), MemValue::Num(*v));
        }
        if let Some((attribute, _)) = hold {
            item.remove(attribute);
        }
        for name in remove {
            item.remove(name);
        }
        for (name, v) in texts {
            item.insert(name.clone(), MemValue::Str(v.clone()));
        }
        let next = version.unwrap_or(Decimal::ZERO).checked_add(Decimal::from_i64(1)).unwrap_or(Decimal::ZERO);
        item.insert(version_attribute.to_string(), MemValue::Num(next));
        let mut written = match item.remove(measures_attribute) {
            Some(MemValue::Set(v)) => v,
            _ => Default::default(),
        };
        written.extend(set.iter().map(|(n, _)| n.clone()));
        item.insert(measures_attribute.to_string(), MemValue::Set(written));
        true
    }

    /// Places a reconcile hold: sets `hold_attribute` to `value` and removes `stale`, if the
    /// item carries the counter `version_attribute` and holds no hold or still `seen`.
    pub fn hold_if(
        &self,
        key: &[String],
        (version_attribute, hold_attribute): (&str, &str),
        seen: Option<&str>,
        value: &str,
        stale: &[String],
    ) -> bool {
        let mut s = self.lock();
        let Some(item) = s.items.get_mut(key) else { return false };
        let current = match item.get(hold_attribute) {
            Some(MemValue::Str(h)) => Some(h.as_str()),
            Some(_) => return false,
            None => None,
        };
        if !item.contains_key(version_attribute) || current != seen {
            return false;
        }
        item.insert(hold_attribute.to_string(), MemValue::Str(value.to_string()));
        for name in stale {
            item.remove(name);
        }
        true
    }

    /// Deletes the item if its counter `version_attribute` is still `seen` (as DynamoDB's
    /// `#v = :seen`).
    pub fn delete_if(&self, key: &[String], version_attribute: &str, seen: &str) -> bool {
        let mut s = self.lock();
        let holds = matches!(s.items.get(key).and_then(|i| i.get(version_attribute)), Some(MemValue::Num(n)) if n.to_string() == seen);
        if holds {
            s.items.remove(key);
            s.forget_usage(key);
        }
        holds
    }

    /// Removes `names` if each still holds zero and the item carries the counter
    /// `version_attribute`, which it advances, and drops them from `measures_attribute`.
    pub fn remove_zeros_if(&self, key: &[String], (version_attribute, measures_attribute): (&str, &str), names: &[String]) -> bool {
        let mut s = self.lock();
        let Some(item) = s.items.get_mut(key) else { return false };
        let zero = |a: &String| matches!(item.get(a), Some(MemValue::Num(n)) if n.is_zero());
        let Some(MemValue::Num(version)) = item.get(version_attribute).cloned() else { return false };
        if !names.iter().all(zero) {
            return false;
        }
        for a in names {
            item.remove(a);
        }
        let next = version.checked_add(Decimal::from_i64(1)).unwrap_or(Decimal::ZERO);
        item.insert(version_attribute.to_string(), MemValue::Num(next));
        if let Some(MemValue::Set(written)) = item.get_mut(measures_attribute) {
            written.retain(|w| !names.contains(w));
            if written.is_empty() {
                item.remove(measures_attribute);
            }
        }
        true
    }

    /// Ledger entries (of any namespace) of the item holding the most.
    pub fn most_entries(&self) -> usize {
        let s = self.lock();
        s.items.values().map(|i| i.keys().filter(|k| is_any_entry(k)).count()).max().unwrap_or(0)
    }

    /// The largest item size any write produced, in bytes.
    pub fn largest_item(&self) -> usize {
        self.lock().largest_item
    }

    /// Forgets the largest item so far (a simulation measures a phase of its own).
    pub fn reset_largest(&self) {
        let mut s = self.lock();
        (s.largest_item, s.largest_item_entries, s.largest_item_at) = (0, 0, 0);
    }

    /// The largest item size written since the last call (a simulation's hourly figure).
    pub fn take_largest_since(&self) -> usize {
        std::mem::take(&mut self.lock().largest_since_asked)
    }

    /// The most WCU of ledger writes one partition key took within one second (of the
    /// service's clock) since last asked, and that key. DynamoDB serves about 1,000 WCU/s per
    /// partition; this store throttles only with [`MemoryAggregates::set_partition_limit`].
    pub fn take_peak_partition_wcu(&self) -> (f64, String) {
        std::mem::take(&mut self.lock().peak_partition_since_asked)
    }

    /// The most WCU of ledger writes in one second since last asked, per partition key
    /// written (a simulation's figure for one kind of target).
    pub fn take_partition_peaks(&self) -> HashMap<String, f64> {
        std::mem::take(&mut self.lock().peaks_since_asked)
    }

    /// Throttles a ledger write that would take its partition key over `wcu` within one
    /// second of the service's clock, as DynamoDB does above about 1,000 WCU/s per partition
    /// (None: no limit, the default).
    pub fn set_partition_limit(&self, wcu: Option<f64>) {
        self.lock().partition_limit = wcu;
    }

    /// Ledger writes throttled by the partition limit since last asked.
    pub fn take_throttled(&self) -> u64 {
        std::mem::take(&mut self.lock().throttled_since_asked)
    }

    /// The largest item as its largest write left it.
    pub fn largest_item_copy(&self) -> BTreeMap<String, MemValue> {
        self.lock().largest_item_copy.clone()
    }

    /// The ledger entries the largest item held when it was that large, and when that was.
    pub fn largest_item_entries(&self) -> (usize, u64) {
        let s = self.lock();
        (s.largest_item_entries, s.largest_item_at)
    }
}

/// DynamoDB's item size: attribute names and values in bytes (numbers about their digits).
pub fn item_size(key: &[(String, String)], item: &BTreeMap<String, MemValue>) -> usize {
    let keys: usize = key.iter().map(|(n, v)| n.len() + v.len()).sum();
    keys + item.iter().map(|(n, v)| attribute_size(n, v)).sum::<usize>()
}

/// One attribute's share of the item size: its name and value in bytes.
fn attribute_size(name: &str, value: &MemValue) -> usize {
    name.len()
        + match value {
            MemValue::Num(d) => d.to_string().len() / 2 + 2,
            MemValue::Str(s) => s.len(),
            MemValue::Set(v) => v.iter().map(String::len).sum(),
            MemValue::Bin(b) => b.len(),
        }
}

/// What a helper write saw of the item's count and expiry (None: the write carries no expiry,
/// or the item has no count).
fn helper_seen(w: &LedgerWrite, item: &BTreeMap<String, MemValue>) -> Option<HelperSeen> {
    let e = w.expiry.as_ref().filter(|_| !item.is_empty())?;
    // No count: the item's writes added nothing to it (a value that came and went in one batch).
    let refs = match item.get(REFS) {
        None => Decimal::ZERO,
        Some(MemValue::Num(refs)) => *refs,
        Some(_) => return None,
    };
    let version = match item.get(&w.version_attribute) {
        Some(MemValue::Num(n)) => Some(n.to_string()),
        _ => None,
    };
    Some(HelperSeen { refs, expiring: item.contains_key(&e.attribute), version })
}

/// A helper item's count and `distinct` flag, as [`AggregateStore::helper_state`] reads them.
fn helper_state(item: &BTreeMap<String, MemValue>) -> HelperState {
    let refs = match item.get(REFS) {
        Some(MemValue::Num(n)) => Some(*n),
        _ => None,
    };
    HelperState {
        live: refs.is_some_and(|n| n > Decimal::ZERO),
        counted: item.contains_key(COUNTED),
        below_zero: refs.is_some_and(|n| n < Decimal::ZERO),
    }
}

/// Capacity `partition` took in `second` so far, by a per-partition (second, capacity) map.
fn used_in(per_second: &HashMap<String, (u64, f64)>, partition: &str, second: u64) -> f64 {
    per_second.get(partition).filter(|b| b.0 == second).map_or(0.0, |b| b.1)
}

/// Adds `capacity` to `partition`'s in `second` (a new second starts at zero); the total.
fn charge_in(per_second: &mut HashMap<String, (u64, f64)>, partition: &str, second: u64, capacity: f64) -> f64 {
    match per_second.get_mut(partition) {
        Some(b) if b.0 == second => {
            b.1 += capacity;
            b.1
        }
        _ => {
            per_second.insert(partition.to_string(), (second, capacity));
            capacity
        }
    }
}

/// Which of two items' usage is the greater: more writes, then the smaller key.
fn hotter(a: (&Vec<String>, &(u64, f64)), b: (&Vec<String>, &(u64, f64))) -> std::cmp::Ordering {
    a.1 .0.cmp(&b.1 .0).then_with(|| b.0.cmp(a.0))
}

impl State {
    /// An item was deleted: its usage leaves the map (helpers keyed by value or version come
    /// and go by the million over a simulated year), kept only if it is the most written yet.
    fn forget_usage(&mut self, key: &[String]) {
        let Some(gone) = self.usage.remove_entry(key) else { return };
        let beats = self.hottest_gone.as_ref().is_none_or(|(k, u)| hotter((&gone.0, &gone.1), (k, u)).is_gt());
        if beats {
            self.hottest_gone = Some(gone);
        }
    }

    /// Whether `capacity` more would take `partition` over the limit in the current second.
    fn over_partition_limit(&self, partition: &str, capacity: f64) -> bool {
        self.partition_limit.is_some_and(|limit| self.used_this_second(partition, crate::state::now_ms() / 1000) + capacity > limit)
    }

    /// WCU `partition` took in `second` so far.
    fn used_this_second(&self, partition: &str, second: u64) -> f64 {
        used_in(&self.partition_second, partition, second)
    }

    /// Adds `capacity` to `partition`'s WCU in the current second.
    fn charge_partition(&mut self, partition: &str, capacity: f64) {
        let used = charge_in(&mut self.partition_second, partition, crate::state::now_ms() / 1000, capacity);
        if used > self.peak_partition_since_asked.0 {
            self.peak_partition_since_asked = (used, partition.to_string());
        }
        // No key allocated per write once the partition is known this hour.
        match self.peaks_since_asked.get_mut(partition) {
            Some(peak) => *peak = peak.max(used),
            None => {
                self.peaks_since_asked.insert(partition.to_string(), used);
            }
        }
    }
}

/// DynamoDB's largest item.
pub const MAX_ITEM_BYTES: usize = 400 * 1024;

impl AggregateStore for MemoryAggregates {
    async fn apply(&self, w: &LedgerWrite) -> Result<WriteOutcome, SinkError> {
        self.gate.wait().await;
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        if s.fatal_next > 0 {
            s.fatal_next -= 1;
            return Err(SinkError::Fatal("simulated failure".into()));
        }
        let longest = expressions(w).longest();
        if longest > MAX_EXPRESSION_BYTES {
            return Err(SinkError::Invalid(format!(
                "ValidationException: Invalid UpdateExpression: Expression size has exceeded the maximum allowed size ({longest} bytes)"
            )));
        }
        let key: Vec<String> = w.key.iter().map(|(_, v)| v.clone()).collect();
        let largest = s.largest_item;
        let item = s.items.entry(key.clone()).or_default();
        let text = |v: Option<&MemValue>| match v {
            Some(MemValue::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let (floor_attr, open_attr) = w.fence.as_ref().map(|f| (f.floor_attribute.as_str(), f.open_attribute.as_str())).unwrap_or(("", ""));
        let compact = match item.get(&w.entry_name) {
            Some(MemValue::Bin(b)) => Some(b.as_slice()),
            _ => None,
        };
        let older = [&w.named_entry, &w.legacy_entry].map(|n| match item.get(n) {
            Some(MemValue::Str(s)) => Some(s.as_str()),
            _ => None,
        });
        let entry = applied_of(compact, older);
        let floor = text(item.get(floor_attr));
        let open = text(item.get(open_attr));
        let entry_ok = entry.as_ref().is_none_or(|e| *e < w.first);
        let fence_ok = w.fence.as_ref().is_none_or(|f| admits(floor.as_deref(), open.as_deref(), &f.mine, &f.tokens));
        let cas_ok = w.prune.as_ref().is_none_or(|p| p.seen_floor == floor && p.seen_open == open);
        let hold_attr = w.ledger.hold_attribute();
        if item.get(&hold_attr).is_some_and(|v| !matches!(v, MemValue::Str(_))) {
            return Err(SinkError::Fatal(format!("{hold_attr} on this item is not a string: only ddb-aggregator may write it; remove it")));
        }
        let hold = text(item.get(&hold_attr));
        let hold_ok = hold.as_deref() == w.hold.seen();
        if !(entry_ok && fence_ok && cas_ok && hold_ok) {
            let log_prefix = w.ledger.log_prefix();
            let hold = hold.map(|value| HoldSeen { value, logs: item.keys().filter(|k| k.starts_with(&log_prefix)).cloned().collect() });
            return Ok(WriteOutcome::Stale { entry, floor, open, hold, helper: helper_seen(w, item) });
        }
        // The changed attributes first (None: removed), so a refused write leaves the item as
        // it was and the item is not copied (hot items hold hundreds of entries).
        let mut changes: BTreeMap<String, Option<MemValue>> = BTreeMap::new();
        for (name, v) in &w.adds {
            let current = match item.get(name) {
                None => Decimal::ZERO,
                Some(MemValue::Num(n)) => *n,
                Some(MemValue::Str(_) | MemValue::Set(_) | MemValue::Bin(_)) => {
                    return Err(SinkError::Invalid(format!("An operand in the update expression has an incorrect data type ({name})")))
                }
            };
            let sum = current.checked_add(*v).map_err(|e| SinkError::Invalid(e.to_string()))?;
            changes.insert(name.clone(), Some(MemValue::Num(sum)));
        }
        let version = match item.get(&w.version_attribute) {
            Some(MemValue::Num(n)) => *n,
            _ => Decimal::ZERO,
        };
        changes.insert(w.version_attribute.clone(), Some(MemValue::Num(version.checked_add(Decimal::from_i64(1)).unwrap_or(version))));
        if !w.adds.is_empty() {
            let mut written = match item.get(&w.measures_attribute) {
                Some(MemValue::Set(v)) => v.clone(),
                _ => Default::default(),
            };
            written.extend(w.adds.iter().map(|(n, _)| n.clone()));
            changes.insert(w.measures_attribute.clone(), Some(MemValue::Set(written)));
        }
        changes.insert(w.entry_name.clone(), Some(MemValue::Bin(w.entry_value.clone())));
        if let (Some(p), Some(_)) = (&w.prune, &w.fence) {
            for e in &p.entries {
                changes.entry(e.clone()).or_insert(None);
            }
            changes.insert(floor_attr.to_string(), Some(MemValue::Str(p.floor.clone())));
            changes.insert(open_attr.to_string(), Some(MemValue::Str(p.open.clone())));
        }
        match &w.hold {
            HoldWrite::Absent => {}
            HoldWrite::Log { logs, .. } => {
                for (name, value) in logs {
                    changes.insert(name.clone(), Some(MemValue::Str(value.clone())));
                }
            }
            HoldWrite::Clear { remove, .. } => {
                for name in remove.iter().chain([&hold_attr]) {
                    changes.entry(name.clone()).or_insert(None);
                }
            }
        }
        if let Some(e) = &w.expiry {
            changes.entry(e.attribute.clone()).or_insert(None);
        }
        let before = item_size(&w.key, item);
        let removed: usize = changes.keys().filter_map(|n| item.get_key_value(n)).map(|(n, v)| attribute_size(n, v)).sum();
        let added: usize = changes.iter().filter_map(|(n, v)| v.as_ref().map(|v| attribute_size(n, v))).sum();
        let after = before.saturating_sub(removed) + added;
        if after > MAX_ITEM_BYTES {
            return Err(SinkError::Invalid("ValidationException: Item size has exceeded the maximum allowed size".into()));
        }
        // 1 WCU per started KB of the larger of the item before and after.
        let capacity = before.max(after).div_ceil(1024).max(1) as f64;
        let partition = w.key.first().map_or("", |(_, v)| v.as_str());
        if s.over_partition_limit(partition, capacity) {
            s.throttled_since_asked += 1;
            if s.items.get(&key).is_some_and(BTreeMap::is_empty) {
                s.items.remove(&key);
            }
            return Err(SinkError::Throttled(format!("ProvisionedThroughputExceededException: partition {partition:?} over its limit")));
        }
        let item = s.items.get_mut(&key).ok_or_else(|| SinkError::Fatal("the item went away".into()))?;
        for (name, v) in changes {
            match v {
                Some(v) => item.insert(name, v),
                None => item.remove(&name),
            };
        }
        let updated = &*item;
        let helper = helper_seen(w, updated);
        let seen = Seen {
            entries: updated.keys().filter(|k| w.ledger.is_entry(k)).cloned().collect(),
            floor: text(updated.get(floor_attr)),
            open: text(updated.get(open_attr)),
        };
        // Counted only for a new largest item (the simulation's report), not on every write.
        let grew = (after > largest).then(|| (updated.keys().filter(|k| is_any_entry(k)).count(), updated.clone()));
        s.largest_since_asked = s.largest_since_asked.max(after);
        if let Some((entries, copy)) = grew {
            s.largest_item = after;
            s.largest_item_entries = entries;
            s.largest_item_at = crate::state::now_ms();
            s.largest_item_copy = copy;
        }
        let u = s.usage.entry(w.key.iter().map(|(_, v)| v.clone()).collect()).or_default();
        u.0 += 1;
        u.1 += capacity;
        s.charge_partition(partition, capacity);
        Ok(WriteOutcome::Applied { capacity, seen, helper })
    }

    async fn expire_helper(
        &self,
        key: &[(String, String)],
        attribute: &str,
        at: u64,
        version: (&str, Option<&str>),
    ) -> Result<bool, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        let key: Vec<String> = key.iter().map(|(_, v)| v.clone()).collect();
        let unchanged = |item: &BTreeMap<String, MemValue>| match item.get(version.0) {
            Some(MemValue::Num(n)) => version.1 == Some(n.to_string().as_str()),
            _ => version.1.is_none(),
        };
        match s.items.get_mut(&key) {
            Some(item)
                if !item.is_empty()
                    && item.get(REFS).is_none_or(|v| matches!(v, MemValue::Num(n) if n.is_zero()))
                    && !item.contains_key(attribute)
                    && !item.contains_key(COUNTED)
                    && unchanged(item) =>
            {
                item.insert(attribute.to_string(), MemValue::Num(Decimal::from_i64(i64::try_from(at).unwrap_or(i64::MAX))));
                s.expiring.insert((at, key));
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn register_expiry(&self, p: &Pending) -> Result<f64, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.refuse_pending {
            return Err(SinkError::Fatal("simulated AccessDeniedException".into()));
        }
        s.pending.insert(pending_key(p), p.helper.iter().map(|(_, v)| v.clone()).collect());
        Ok(1.0)
    }

    async fn due_expiries(&self, q: &DueQuery<'_>) -> Result<Vec<Pending>, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.refuse_pending_reads.contains(&q.partition) {
            return Err(SinkError::Fatal("AccessDeniedException: simulated refusal of a pending partition's read".into()));
        }
        let pk = pending_partition(q.attribute, q.partition);
        let due = due_before(q.due_s);
        let from = (pk.clone(), String::new());
        Ok(s.pending
            .range(from..)
            .take_while(|((p, sk), _)| *p == pk && *sk < due)
            .take(q.limit)
            .filter_map(|((_, sk), values)| {
                let helper = q.key_names.iter().cloned().zip(values.iter().cloned()).collect();
                Some(Pending { helper, attribute: q.attribute.to_string(), at: pending_at(sk)? })
            })
            .collect())
    }

    async fn remove_expired(&self, p: &Pending) -> Result<bool, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        let key: Vec<String> = p.helper.iter().map(|(_, v)| v.clone()).collect();
        if s.refuse_deletes.contains(&key) {
            return Err(SinkError::Fatal("AccessDeniedException: simulated refusal of a helper's delete".into()));
        }
        let at = Decimal::from_i64(i64::try_from(p.at).unwrap_or(i64::MAX));
        let expired = s.items.get(&key).is_some_and(|item| {
            matches!(item.get(&p.attribute), Some(MemValue::Num(n)) if *n == at)
                && item.get(REFS).is_none_or(|v| matches!(v, MemValue::Num(n) if n.is_zero()))
                && !item.contains_key(COUNTED)
        });
        if expired {
            s.items.remove(&key);
            s.forget_usage(&key);
        }
        s.pending.remove(&pending_key(p));
        Ok(expired)
    }

    async fn live_helpers(&self, q: &HelperQuery<'_>) -> Result<LiveHelpers, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        // The helpers under [pk, prefix..], in key order as a Query reads them; First and Last
        // start at `from` and stop at the first live helper, as the Query does.
        let key = |tail: &str| vec![q.pk.to_string(), format!("{}{tail}", q.prefix)];
        let all = key("")..vec![q.pk.to_string(), helper::successor(q.prefix)];
        let live = |item: &BTreeMap<String, MemValue>| matches!(item.get(REFS), Some(MemValue::Num(n)) if *n > Decimal::ZERO);
        let mine = |k: &Vec<String>| k.len() == 2 && k[1].starts_with(q.prefix);
        let tail = |k: &Vec<String>| k[1][q.prefix.len()..].to_string();
        let mut out = LiveHelpers { capacity: 0.5, ..LiveHelpers::default() };
        let range: Box<dyn Iterator<Item = (&Vec<String>, &Item)>> = match (q.scan, q.from) {
            (HelperScan::Count, _) => {
                let items: Vec<_> = s.items.range(all).filter(|(k, _)| mine(k)).collect();
                out.read = items.len() as u64;
                out.count = items.iter().filter(|(_, i)| live(i)).count() as u64;
                return Ok(out);
            }
            (HelperScan::First, None) => Box::new(s.items.range(all)),
            (HelperScan::First, Some(from)) => Box::new(s.items.range(key(from)..all.end)),
            (HelperScan::Last, None) => Box::new(s.items.range(all).rev()),
            (HelperScan::Last, Some(from)) => Box::new(s.items.range(all.start..=key(from)).rev()),
        };
        for (k, item) in range.filter(|(k, _)| mine(k)) {
            out.read += 1;
            out.last_read = Some(tail(k));
            if live(item) {
                out.first = Some(tail(k));
                break;
            }
        }
        Ok(out)
    }

    async fn derivation_counters(&self, key: &[(String, String)], names: &DerivationNames) -> Result<Counters, SinkError> {
        let s = self.lock();
        let key: Vec<String> = key.iter().map(|(_, v)| v.clone()).collect();
        let mut out = Counters { capacity: 0.5, ..Counters::default() };
        for (name, value) in s.items.get(&key).into_iter().flatten() {
            if let Some(measure) = name.strip_prefix(&names.counters) {
                let value = match value {
                    MemValue::Num(n) => n.to_string(),
                    other => format!("not a number: {other:?}"),
                };
                out.values.insert(measure.to_string(), value);
            } else if let (Some(measure), MemValue::Str(tail)) = (name.strip_prefix(&names.cursors), value) {
                out.cursors.insert(measure.to_string(), tail.clone());
            } else if let Some(measure) = name.strip_prefix(&names.counts) {
                let value = match value {
                    MemValue::Num(n) => n.to_string(),
                    other => format!("not a number: {other:?}"),
                };
                out.counts.insert(measure.to_string(), value);
            } else if let Some(measure) = name.strip_prefix(&names.walked) {
                out.walked.insert(measure.to_string());
            } else if let MemValue::Num(n) = value {
                out.numbers.insert(name.clone(), n.to_string());
            }
        }
        Ok(out)
    }

    async fn helper_state(&self, key: &[(String, String)]) -> Result<(Option<HelperState>, f64), SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        let key: Vec<String> = key.iter().map(|(_, v)| v.clone()).collect();
        Ok((s.items.get(&key).filter(|i| !i.is_empty()).map(helper_state), 0.5))
    }

    async fn helper_states(&self, q: &HelperQuery<'_>) -> Result<HelperStates, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        let all = vec![q.pk.to_string(), q.prefix.to_string()]..vec![q.pk.to_string(), helper::successor(q.prefix)];
        let helpers = s
            .items
            .range(all)
            .filter(|(k, i)| k.len() == 2 && k[1].starts_with(q.prefix) && !i.is_empty())
            .map(|(k, i)| (k[1][q.prefix.len()..].to_string(), helper_state(i)))
            .collect();
        Ok(HelperStates { helpers, capacity: 0.5 })
    }

    async fn count_transitions(&self, w: &TransitionWrite<'_>) -> Result<Option<f64>, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        let key = |sk: Option<&str>| -> Vec<String> {
            let mut k: Vec<String> = w.key.iter().map(|(_, v)| v.clone()).collect();
            if let (Some(last), Some(sk)) = (k.last_mut(), sk) {
                *last = sk.to_string();
            }
            k
        };
        let unchanged =
            w.helpers.iter().all(|(sk, seen)| s.items.get(&key(Some(sk))).is_some_and(|i| !i.is_empty() && helper_state(i) == *seen));
        if !unchanged {
            return Ok(None);
        }
        let target = s.items.entry(key(None)).or_default();
        let count = match target.get(w.count) {
            None => Decimal::ZERO,
            Some(MemValue::Num(n)) => *n,
            Some(_) => return Err(SinkError::Invalid(format!("ValidationException: {} is not a number", w.count))),
        };
        let delta = Decimal::from_i64(super::distinct::delta(&w.helpers.iter().map(|(k, s)| (k.clone(), *s)).collect::<Vec<_>>()));
        let next = count.checked_add(delta).map_err(|e| SinkError::Invalid(e.to_string()))?;
        target.insert(w.count.to_string(), MemValue::Num(next));
        if let Some(a) = w.attribute {
            target.insert(a.to_string(), MemValue::Num(next));
        }
        let version = match target.get(w.counter) {
            Some(MemValue::Num(n)) => *n,
            _ => Decimal::ZERO,
        };
        target.insert(w.counter.to_string(), MemValue::Num(version.checked_add(Decimal::ONE).unwrap_or(version)));
        let mut expiring = Vec::new();
        for (sk, seen) in w.helpers {
            let Some(item) = s.items.get_mut(&key(Some(sk))) else { continue };
            if seen.counted {
                item.remove(COUNTED);
                if let Some((attribute, at)) = w.expiry.filter(|_| !seen.below_zero) {
                    item.insert(attribute.to_string(), MemValue::Num(Decimal::from_i64(i64::try_from(at).unwrap_or(i64::MAX))));
                    expiring.push((at, key(Some(sk))));
                }
            } else {
                item.insert(COUNTED.to_string(), MemValue::Num(Decimal::ONE));
            }
        }
        s.expiring.extend(expiring);
        Ok(Some(2.0 * (w.helpers.len() + 1) as f64))
    }

    async fn settle_count(&self, w: &SettleWrite<'_>) -> Result<Option<f64>, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        let key: Vec<String> = w.key.iter().map(|(_, v)| v.clone()).collect();
        if w.kind == Settle::Unwalk && s.items.get(&key).is_none_or(|i| i.is_empty()) {
            return Ok(None);
        }
        let item = s.items.entry(key).or_default();
        let counter = match item.get(w.counter) {
            Some(MemValue::Num(n)) => Some(*n),
            Some(other) => return Err(SinkError::Invalid(format!("ValidationException: {} is not a number: {other:?}", w.counter))),
            _ => None,
        };
        match w.kind {
            Settle::Unwalk => {
                item.remove(w.walked);
            }
            Settle::Count { .. } if counter.map(|n| n.to_string()).as_deref() != w.seen => return Ok(None),
            Settle::Count { value, mark } => {
                let value = Decimal::from_i64(i64::try_from(value).unwrap_or(i64::MAX));
                item.insert(w.count.to_string(), MemValue::Num(value));
                if mark {
                    item.insert(w.walked.to_string(), MemValue::Num(Decimal::ONE));
                }
                match value.is_zero() {
                    true => item.remove(w.attribute),
                    false => item.insert(w.attribute.to_string(), MemValue::Num(value)),
                };
            }
        }
        item.insert(
            w.counter.to_string(),
            MemValue::Num(counter.unwrap_or(Decimal::ZERO).checked_add(Decimal::ONE).unwrap_or(Decimal::ZERO)),
        );
        Ok(Some(1.0))
    }

    async fn lower_cursor(&self, key: &[(String, String)], attribute: &str, to: Option<&str>, scan: HelperScan) -> Result<(), SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        let key: Vec<String> = key.iter().map(|(_, v)| v.clone()).collect();
        let Some(item) = s.items.get_mut(&key) else { return Ok(()) };
        let Some(MemValue::Str(at)) = item.get(attribute) else { return Ok(()) };
        match to {
            Some(to) if helper::before(scan, to, at) => {
                item.insert(attribute.to_string(), MemValue::Str(to.to_string()));
            }
            Some(_) => {}
            None => {
                item.remove(attribute);
            }
        }
        Ok(())
    }

    async fn set_derived(&self, w: &DerivedWrite<'_>) -> Result<Option<f64>, SinkError> {
        let mut s = self.lock();
        s.calls += 1;
        if s.fail_next > 0 {
            s.fail_next -= 1;
            return Err(SinkError::Throttled("simulated throttling".into()));
        }
        if let Some(bad) = w.values.iter().filter_map(|d| d.seen.as_deref()).find(|n| n.parse::<Decimal>().is_err()) {
            // As DynamoDB answers a number literal that is not one.
            return Err(SinkError::Invalid(format!("ValidationException: {bad:?} is not a number")));
        }
        let key: Vec<String> = w.key.iter().map(|(_, v)| v.clone()).collect();
        let item = s.items.entry(key).or_default();
        let counter = |item: &BTreeMap<String, MemValue>, name: &str| match item.get(name) {
            Some(MemValue::Num(n)) => Some(*n),
            _ => None,
        };
        let cursor = |item: &BTreeMap<String, MemValue>, name: &str| match item.get(name) {
            Some(MemValue::Str(t)) => Some(t.clone()),
            _ => None,
        };
        let moved = |d: &Derived| d.cursor.as_ref().is_some_and(|c| cursor(item, &c.attribute) != c.seen);
        if w.values.iter().any(|d| counter(item, &d.counter).map(|n| n.to_string()) != d.seen || moved(d)) {
            return Ok(None);
        }
        for d in w.values {
            let next = counter(item, &d.counter).unwrap_or(Decimal::ZERO).checked_add(Decimal::ONE).unwrap_or(Decimal::ZERO);
            item.insert(d.counter.clone(), MemValue::Num(next));
            match &d.value {
                Some(Scalar::N(n)) => item.insert(d.name.clone(), MemValue::Num(*n)),
                Some(Scalar::S(v)) => item.insert(d.name.clone(), MemValue::Str(v.clone())),
                None => item.remove(&d.name),
            };
            if let Some(c) = &d.cursor {
                match &c.to {
                    Some(to) => item.insert(c.attribute.clone(), MemValue::Str(to.clone())),
                    None => item.remove(&c.attribute),
                };
            }
        }
        Ok(Some(1.0))
    }
}

/// What [`MemoryAggregates::correct_if`] requires of the item: its counter still `seen` (None:
/// absent) or, when `expect` is not empty, the counter present and these attributes holding
/// these values.
#[derive(Clone, Copy, Debug)]
pub struct Guard<'a> {
    pub seen: Option<&'a str>,
    pub expect: &'a [(String, Decimal)],
    /// (hold attribute, value): the item must still hold this hold, which the write removes.
    pub hold: Option<(&'a str, &'a str)>,
}
