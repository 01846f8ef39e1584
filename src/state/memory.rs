//! An in-memory state table with the same conditional semantics, for unit tests.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{JobStep, Lease, LeaseStore, LeaseView, Progress, StateError, ViewMark};
use crate::rules::copy::job::{CopyJob, StoredJob};

#[derive(Debug, Default)]
pub struct MemoryLeases {
    id: StoreId,
    leases: Mutex<Table>,
    /// (oldest, latest) pending request.
    reconcile_request: Mutex<Option<(u64, u64)>>,
    unowned: Mutex<Unowned>,
    /// Named leases: name -> (owner, until).
    named: Mutex<BTreeMap<String, (String, u64)>>,
    /// Rule fingerprints recorded; None: never any.
    fingerprints: Mutex<Option<BTreeMap<String, String>>>,
    /// Committed definitions and their revision.
    definitions: Mutex<Option<(super::definitions::Committed, u64)>>,
    beats: Mutex<BTreeMap<String, super::definitions::Beat>>,
    /// Copy fan-out jobs by id.
    jobs: Mutex<BTreeMap<String, StoredJob>>,
    /// Copy fan-out jobs recorded so far (follow-ups included).
    jobs_recorded: std::sync::atomic::AtomicU64,
}

/// Tells stores apart, so a view is only ever brought up to date from its own store's log.
#[derive(Debug)]
struct StoreId(u64);

impl Default for StoreId {
    fn default() -> StoreId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        StoreId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// Deleted leases the change log remembers before it forgets them and starts a new epoch
/// (every view then reads the whole table once).
const FORGET_DELETED_AFTER: usize = 4096;

/// The leases, and a log of which changed when ([`LeaseStore::refresh`]).
#[derive(Debug, Default)]
struct Table {
    leases: BTreeMap<String, Lease>,
    /// Bumped at every change of a lease.
    version: u64,
    /// Bumped when the log forgets deleted leases.
    epoch: u64,
    /// Version -> the lease changed then (each lease at its latest change only).
    log: BTreeMap<u64, String>,
    latest: std::collections::HashMap<String, u64>,
    /// Deleted leases still in the log.
    deleted: usize,
}

impl Table {
    /// Records that `shard`'s lease changed (or was created or deleted).
    fn touch(&mut self, shard: &str) {
        self.version += 1;
        if let Some(before) = self.latest.insert(shard.to_string(), self.version) {
            self.log.remove(&before);
        }
        self.log.insert(self.version, shard.to_string());
    }

    fn remove(&mut self, shard: &str) {
        self.leases.remove(shard);
        self.touch(shard);
        self.deleted += 1;
        if self.deleted > FORGET_DELETED_AFTER {
            let leases = &self.leases;
            self.log.retain(|_, s| leases.contains_key(s));
            self.latest.retain(|s, _| leases.contains_key(s));
            self.deleted = 0;
            self.epoch += 1;
        }
    }

    /// Brings `view` up to date: the leases changed since its mark, or all of them.
    fn refresh(&self, store: u64, view: &mut LeaseView) {
        match view.mark {
            Some(m) if m.store == store && m.epoch == self.epoch && m.version <= self.version => {
                for (_, shard) in self.log.range(m.version + 1..) {
                    match self.leases.get(shard) {
                        Some(l) => view.leases.insert(shard.clone(), l.clone()),
                        None => view.leases.remove(shard),
                    };
                }
            }
            _ => view.leases = self.leases.clone(),
        }
        view.mark = Some(ViewMark { store, epoch: self.epoch, version: self.version });
    }
}

/// When each lease became free to take, to measure how long shards went unowned.
#[derive(Debug, Default)]
struct Unowned {
    /// Shard -> when it was created, released, or read to its end.
    since: BTreeMap<String, u64>,
    longest_ms: u64,
    largest_table: usize,
    /// Waits before this time are not measured.
    from_ms: u64,
}

impl MemoryLeases {
    pub fn new() -> MemoryLeases {
        MemoryLeases::default()
    }

    pub fn snapshot(&self) -> Vec<Lease> {
        self.lock().leases.values().cloned().collect()
    }

    /// The longest time a ready lease waited to be taken (ms): from its creation, release,
    /// expiry or its parent's end, whichever came last, to the take.
    pub fn longest_unowned_ms(&self) -> u64 {
        self.unowned.lock().unwrap_or_else(|e| e.into_inner()).longest_ms
    }

    /// Measures waits only from `ms` on (the simulation's outages are not the protocol's).
    pub fn measure_unowned_from(&self, ms: u64) {
        self.unowned.lock().unwrap_or_else(|e| e.into_inner()).from_ms = ms;
    }

    /// Copy fan-out jobs pending.
    pub fn copy_jobs_pending(&self) -> usize {
        self.jobs().len()
    }

    /// The pending copy fan-out jobs as stored (a simulation explains what waits).
    pub fn copy_jobs_snapshot(&self) -> Vec<crate::rules::copy::job::StoredJob> {
        self.jobs().values().cloned().collect()
    }

    /// Copy fan-out jobs recorded so far.
    pub fn copy_jobs_recorded(&self) -> u64 {
        self.jobs_recorded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most leases the table held at once.
    pub fn largest_table(&self) -> usize {
        self.unowned.lock().unwrap_or_else(|e| e.into_inner()).largest_table
    }

    fn mark_free(&self, shard: &str, at: u64) {
        self.unowned.lock().unwrap_or_else(|e| e.into_inner()).since.insert(shard.to_string(), at);
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, StoredJob>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, shard_id: &str, owner: &str, counter: u64, f: impl FnOnce(&mut Lease)) -> bool {
        let mut m = self.lock();
        match m.leases.get_mut(shard_id) {
            Some(l) if l.owner.as_deref() == Some(owner) && l.counter == counter => {
                f(l);
                m.touch(shard_id);
                true
            }
            _ => false,
        }
    }
}

impl LeaseStore for MemoryLeases {
    async fn prepare(&self, _create: bool) -> Result<(), StateError> {
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Lease>, StateError> {
        Ok(self.snapshot())
    }

    async fn refresh(&self, view: &mut LeaseView) -> Result<(), StateError> {
        self.lock().refresh(self.id.0, view);
        Ok(())
    }

    async fn create(&self, lease: &Lease) -> Result<bool, StateError> {
        let mut m = self.lock();
        if m.leases.contains_key(&lease.shard_id) {
            return Ok(false);
        }
        m.leases.insert(lease.shard_id.clone(), lease.clone());
        m.touch(&lease.shard_id);
        let size = m.leases.len();
        drop(m);
        let mut u = self.unowned.lock().unwrap_or_else(|e| e.into_inner());
        u.since.insert(lease.shard_id.clone(), super::now_ms());
        u.largest_table = u.largest_table.max(size);
        Ok(true)
    }

    async fn take(&self, lease: &Lease, owner: &str, expires_at_ms: u64) -> Result<Option<Lease>, StateError> {
        let mut m = self.lock();
        let taken = match m.leases.get_mut(&lease.shard_id) {
            Some(l) if l.counter == lease.counter => {
                let now = super::now_ms();
                let parent_end = l
                    .parent
                    .as_ref()
                    .and_then(|p| self.unowned.lock().unwrap_or_else(|e| e.into_inner()).since.get(&format!("end:{p}")).copied());
                let mut u = self.unowned.lock().unwrap_or_else(|e| e.into_inner());
                let free = u.since.get(&l.shard_id).copied().unwrap_or(now);
                let expired = if l.owner.is_some() { l.expires_at_ms } else { 0 };
                let from = free.max(expired).max(parent_end.unwrap_or(0)).max(u.from_ms);
                u.longest_ms = u.longest_ms.max(now.saturating_sub(from));
                drop(u);
                l.owner = Some(owner.to_string());
                l.counter += 1;
                l.expires_at_ms = expires_at_ms;
                l.clone()
            }
            _ => return Ok(None),
        };
        m.touch(&lease.shard_id);
        Ok(Some(taken))
    }

    async fn renew(&self, shard_id: &str, owner: &str, counter: u64, expires_at_ms: u64) -> Result<bool, StateError> {
        Ok(self.update(shard_id, owner, counter, |l| l.expires_at_ms = expires_at_ms))
    }

    async fn checkpoint(&self, shard_id: &str, owner: &str, counter: u64, progress: &Progress) -> Result<bool, StateError> {
        if progress.checkpoint == Some(super::Checkpoint::ShardEnd) {
            self.mark_free(&format!("end:{shard_id}"), super::now_ms());
        }
        Ok(self.update(shard_id, owner, counter, |l| {
            match (&progress.checkpoint, &l.checkpoint) {
                // As the DynamoDB store: the horizon mark never replaces a real checkpoint.
                (Some(super::Checkpoint::TrimHorizon), Some(c)) if *c != super::Checkpoint::TrimHorizon => {}
                (Some(c), _) => l.checkpoint = Some(c.clone()),
                (None, _) => {}
            }
            if progress.last_record_ms.is_some() {
                l.last_record_ms = progress.last_record_ms;
            }
            if progress.at_tip_ms.is_some() {
                l.at_tip_ms = progress.at_tip_ms;
            }
            if let Some(due) = &progress.fold_due {
                l.fold_due = due.clone();
            }
        }))
    }

    async fn release(&self, shard_id: &str, owner: &str, counter: u64) -> Result<bool, StateError> {
        self.mark_free(shard_id, super::now_ms());
        Ok(self.update(shard_id, owner, counter, |l| {
            l.owner = None;
            l.expires_at_ms = 0;
        }))
    }

    async fn delete(&self, lease: &Lease) -> Result<bool, StateError> {
        let mut m = self.lock();
        match m.leases.get(&lease.shard_id) {
            Some(l) if l.counter == lease.counter && l.finished() => {
                m.remove(&lease.shard_id);
                let mut u = self.unowned.lock().unwrap_or_else(|e| e.into_inner());
                u.since.remove(&lease.shard_id);
                u.since.remove(&format!("end:{}", lease.shard_id));
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn request_reconcile(&self, at_ms: u64) -> Result<(), StateError> {
        let mut r = self.reconcile_request.lock().unwrap_or_else(|e| e.into_inner());
        *r = Some(r.map_or((at_ms, at_ms), |(first, last)| (first.min(at_ms), last.max(at_ms))));
        Ok(())
    }

    async fn reconcile_request(&self) -> Result<Option<u64>, StateError> {
        Ok(self.reconcile_request.lock().unwrap_or_else(|e| e.into_inner()).map(|(first, _)| first))
    }

    async fn clear_reconcile_request(&self, started_ms: u64) -> Result<bool, StateError> {
        let mut r = self.reconcile_request.lock().unwrap_or_else(|e| e.into_inner());
        match *r {
            Some((_, last)) if last <= started_ms => {
                *r = None;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn hold_named(&self, name: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        match named.get(name) {
            Some((o, until)) if o != owner && *until >= now_ms => Ok(false),
            _ => {
                named.insert(name.to_string(), (owner.to_string(), until_ms));
                Ok(true)
            }
        }
    }

    async fn release_named(&self, name: &str, owner: &str) -> Result<(), StateError> {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        if named.get(name).is_some_and(|(o, _)| o == owner) {
            named.remove(name);
        }
        Ok(())
    }

    async fn rule_fingerprints(&self) -> Result<Option<BTreeMap<String, String>>, StateError> {
        Ok(self.fingerprints.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    async fn record_fingerprints(&self, fingerprints: &BTreeMap<String, String>) -> Result<(), StateError> {
        let mut f = self.fingerprints.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(BTreeMap::new).extend(fingerprints.iter().map(|(k, v)| (k.clone(), v.clone())));
        Ok(())
    }

    async fn definitions(&self) -> Result<Option<(super::definitions::Committed, u64)>, StateError> {
        Ok(self.definitions.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    async fn store_definitions(&self, committed: &super::definitions::Committed, revision: Option<u64>) -> Result<bool, StateError> {
        let mut d = self.definitions.lock().unwrap_or_else(|e| e.into_inner());
        if d.as_ref().map(|(_, r)| *r) != revision {
            return Ok(false);
        }
        *d = Some((committed.clone(), revision.map_or(1, |r| r + 1)));
        Ok(true)
    }

    async fn publish_beat(&self, beat: &super::definitions::Beat) -> Result<(), StateError> {
        self.beats.lock().unwrap_or_else(|e| e.into_inner()).insert(beat.owner.clone(), beat.clone());
        Ok(())
    }

    async fn beats(&self) -> Result<Vec<super::definitions::Beat>, StateError> {
        Ok(self.beats.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect())
    }

    async fn drop_beat(&self, owner: &str) -> Result<(), StateError> {
        self.beats.lock().unwrap_or_else(|e| e.into_inner()).remove(owner);
        Ok(())
    }

    async fn record_copy_job(&self, job: &CopyJob) -> Result<bool, StateError> {
        let mut jobs = self.jobs();
        let id = job.id();
        if jobs.get(&id).is_some_and(|j| j.job.version() >= job.version()) {
            return Ok(false);
        }
        let mut job = job.clone();
        job.created_ms = jobs.get(&id).map_or(job.created_ms, |older| older.job.created_ms);
        jobs.insert(id, StoredJob { job, owner: None, expires_at_ms: 0 });
        self.jobs_recorded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(true)
    }

    async fn copy_jobs(&self) -> Result<Vec<StoredJob>, StateError> {
        Ok(self.jobs().values().cloned().collect())
    }

    async fn claim_copy_job(&self, id: &str, version: &str, owner: &str, until_ms: u64, now_ms: u64) -> Result<bool, StateError> {
        let mut jobs = self.jobs();
        match jobs.get_mut(id) {
            Some(j) if j.job.version() == version && j.job.due_ms <= now_ms && j.free_for(owner, now_ms) => {
                j.owner = Some(owner.to_string());
                j.expires_at_ms = until_ms;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn advance_copy_job(&self, id: &str, version: &str, owner: &str, step: &JobStep) -> Result<bool, StateError> {
        let mut jobs = self.jobs();
        match jobs.get_mut(id) {
            Some(j) if j.job.version() == version && j.owner.as_deref() == Some(owner) => {
                j.job.cursor = Some(step.cursor.clone());
                j.job.found = step.found;
                j.expires_at_ms = step.until_ms;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn end_copy_job(&self, id: &str, version: &str, next: Option<&CopyJob>) -> Result<bool, StateError> {
        let mut jobs = self.jobs();
        if jobs.get(id).is_none_or(|j| j.job.version() != version) {
            return Ok(false);
        }
        match next {
            Some(n) => jobs.insert(id.to_string(), StoredJob { job: n.clone(), owner: None, expires_at_ms: 0 }),
            None => jobs.remove(id),
        };
        Ok(true)
    }
}

#[cfg(test)]
mod named_tests {
    use super::*;

    #[tokio::test]
    async fn a_named_lease_is_held_by_one_owner_until_it_expires_or_is_released() {
        let l = MemoryLeases::new();
        assert!(l.hold_named("s", "a", 100, 0).await.unwrap());
        assert!(!l.hold_named("s", "b", 200, 50).await.unwrap(), "held by a");
        assert!(l.hold_named("s", "a", 300, 90).await.unwrap(), "a renews");
        assert!(l.hold_named("s", "b", 500, 301).await.unwrap(), "expired: b takes it");
        l.release_named("s", "a").await.unwrap();
        assert!(!l.hold_named("s", "a", 600, 400).await.unwrap(), "a cannot release b's");
        l.release_named("s", "b").await.unwrap();
        assert!(l.hold_named("s", "a", 700, 400).await.unwrap(), "released: free");
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;
    use crate::state::Checkpoint;

    fn table(l: &MemoryLeases) -> BTreeMap<String, Lease> {
        l.snapshot().into_iter().map(|x| (x.shard_id.clone(), x)).collect()
    }

    /// One random operation on the table, as replicas make them (most fail their condition).
    async fn random_op(l: &MemoryLeases, rng: &mut fastrand::Rng, shards: u32, step: u32) {
        let shard = format!("s{}", rng.u32(..shards));
        let current = l.lock().leases.get(&shard).cloned();
        let owner = ["a", "b", "c"][rng.usize(..3)];
        let counter = current.as_ref().map_or(0, |c| c.counter) + u64::from(rng.u8(..4) == 0);
        match (rng.u8(..7), current) {
            (0, _) => drop(l.create(&Lease::new(&shard, None)).await),
            (1, Some(c)) => drop(l.take(&c, owner, rng.u64(..1000)).await),
            (2, _) => drop(l.renew(&shard, owner, counter, rng.u64(..1000)).await),
            (3, _) => {
                let checkpoint = Some(if rng.bool() { Checkpoint::ShardEnd } else { Checkpoint::Sequence(rng.u32(..).to_string()) });
                drop(l.checkpoint(&shard, owner, counter, &Progress { checkpoint, ..Progress::default() }).await)
            }
            (4, _) => drop(l.release(&shard, owner, counter).await),
            (5, Some(c)) => drop(l.delete(&c).await),
            // A shard's whole life, so that many are deleted.
            (6, _) => {
                let short = Lease::new(&format!("t{step}"), None);
                l.create(&short).await.unwrap();
                let taken = l.take(&short, owner, 1).await.unwrap().unwrap();
                let end = Progress { checkpoint: Some(Checkpoint::ShardEnd), ..Progress::default() };
                assert!(l.checkpoint(&taken.shard_id, owner, taken.counter, &end).await.unwrap());
                let finished = l.lock().leases[&taken.shard_id].clone();
                assert!(l.delete(&finished).await.unwrap());
            }
            _ => {}
        }
    }

    /// Views refreshed at random points, some rarely, across the log's epochs: each equals
    /// the whole table after its refresh, whatever changed and was deleted in between.
    #[tokio::test]
    async fn a_refreshed_view_equals_the_table() {
        let l = MemoryLeases::new();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut views = [LeaseView::default(), LeaseView::default(), LeaseView::default()];
        for step in 0..70_000u32 {
            random_op(&l, &mut rng, 50, step).await;
            let v = rng.usize(..views.len());
            // View 0 every few steps, view 2 rarely (often a whole epoch behind).
            if rng.u32(..[4, 40, 4000][v]) == 0 {
                l.refresh(&mut views[v]).await.unwrap();
                assert_eq!(views[v].leases, table(&l), "view {v} after step {step}");
            }
        }
        let epochs = l.lock().epoch;
        assert!(epochs >= 2, "the log forgot deleted leases {epochs} times; the test needs it to");
    }

    /// A view from another store, or a full list, is read again in full.
    #[tokio::test]
    async fn a_view_of_another_store_is_read_in_full() {
        let (a, b) = (MemoryLeases::new(), MemoryLeases::new());
        a.create(&Lease::new("x", None)).await.unwrap();
        b.create(&Lease::new("y", None)).await.unwrap();
        let mut view = LeaseView::default();
        a.refresh(&mut view).await.unwrap();
        b.refresh(&mut view).await.unwrap();
        assert_eq!(view.leases.keys().collect::<Vec<_>>(), ["y"]);
        view.replace(a.list().await.unwrap());
        b.refresh(&mut view).await.unwrap();
        assert_eq!(view.leases.keys().collect::<Vec<_>>(), ["y"]);
    }
}
