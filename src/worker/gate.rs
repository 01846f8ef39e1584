//! The definitions gate of a maintenance round ([`crate::state::definitions`]): publish this
//! replica's heartbeat, read what is committed, and say whether it may hold leases now,
//! committing its own definitions when the protocol allows.

use std::collections::BTreeMap;

use tracing::{info, warn};

use crate::rules::Rule;
use crate::state::definitions::{self, Beat, Gate, Running, Seen, WaitReason};
use crate::state::{Lease, LeaseStore, StateError};
use crate::telemetry::names;

/// Heartbeats expired this long ago are removed by a waiting replica (they block nothing).
const FORGET_BEATS_AFTER_MS: u64 = 60 * 60 * 1000;

/// A drain mark lives this many lease durations: the committer's next round (a third of one)
/// checks again and commits well within it; a committer that died meanwhile holds the others
/// back no longer than this.
const DRAIN_ROUNDS: u64 = 2;

pub struct DefinitionsGate {
    running: Running,
    /// False for a command-line consumer: it applies records only under the committed
    /// definitions and never commits its own (but the first, when nothing is recorded).
    commits: bool,
    /// The committed definitions are marked draining by another replica: take no new lease.
    held_back: bool,
    /// Why this replica holds no lease, while it does not.
    waiting: Option<WaitReason>,
    generation: Option<u64>,
}

/// Shard leases held, unexpired and unfinished, by others than `owner`.
pub fn live_leases(leases: &BTreeMap<String, Lease>, owner: &str, now_ms: u64) -> usize {
    leases.values().filter(|l| !l.finished() && !l.available(now_ms) && l.owner.as_deref() != Some(owner)).count()
}

impl DefinitionsGate {
    pub fn new(rules: &[Rule]) -> DefinitionsGate {
        DefinitionsGate {
            running: Running::new(rules.iter().map(|r| (r.name.to_string(), r.definition.to_string()))),
            commits: true,
            held_back: false,
            waiting: None,
            generation: None,
        }
    }

    /// With the config's helper expiry attribute: a replica whose attribute differs from the
    /// committed one waits like one whose rules differ.
    pub fn with_expiry(mut self, expiry: Option<String>) -> Self {
        self.running = self.running.with_expiry(expiry);
        self
    }

    /// With the config's copy rules: a replica whose copy rules differ from the committed ones
    /// waits like one whose rules differ.
    pub fn with_copies(mut self, copies: Option<String>) -> Self {
        self.running = self.running.with_copies(copies);
        self
    }

    /// A gate that never commits (a command-line consumer's).
    pub fn never_committing(mut self) -> Self {
        self.commits = false;
        self
    }

    /// Whether this round's replica may take new leases (it runs the committed definitions
    /// and no other replica marked them draining).
    pub fn takes_leases(&self) -> bool {
        self.waiting.is_none() && !self.held_back
    }

    /// Read after taking leases, before starting their readers: true when this replica still
    /// runs the committed definitions and no other marked them draining. Otherwise the leases
    /// just taken are given back unused: a committer's last check may have missed them.
    pub async fn still_current<L: LeaseStore>(&self, store: &L, owner: &str, now_ms: u64) -> Result<bool, StateError> {
        let committed = store.definitions().await?;
        Ok(committed.is_some_and(|(c, _)| self.running.runs(&c) && !c.drained_by_other(owner, now_ms)))
    }

    /// Why this replica holds no lease now, if it does not.
    pub fn waiting(&self) -> Option<WaitReason> {
        self.waiting
    }

    /// One round: true when this replica runs the committed definitions (after committing its
    /// own, if that was due) and may hold leases.
    pub async fn round<L: LeaseStore>(
        &mut self,
        store: &L,
        owner: &str,
        leases: &BTreeMap<String, Lease>,
        (now_ms, read_at): (u64, std::time::Instant),
        lease_ms: u64,
    ) -> Result<bool, StateError> {
        // `now_ms` as of now: the round may run long after it was read (retries, a pause).
        let fresh_ms = || now_ms.saturating_add(u64::try_from(read_at.elapsed().as_millis()).unwrap_or(u64::MAX / 2));
        let beat =
            Beat { owner: owner.to_string(), digest: self.running.digest(), protocol: self.running.protocol, until_ms: now_ms + lease_ms };
        store.publish_beat(&beat).await?;
        let committed = store.definitions().await?;
        if let Some((c, _)) = &committed {
            self.show_pending(c);
        }
        let current = committed.as_ref().is_some_and(|(c, _)| self.running.runs(c));
        self.held_back = committed.as_ref().is_some_and(|(c, _)| c.drained_by_other(owner, now_ms));
        let gate = if current {
            Gate::Run
        } else {
            let legacy = if committed.is_none() { store.rule_fingerprints().await? } else { None };
            let beats = store.beats().await?;
            self.forget_old_beats(store, &beats, now_ms).await;
            let seen = Seen {
                committed: committed.as_ref().map(|(c, _)| c),
                legacy: legacy.as_ref(),
                beats: &beats,
                live_leases: live_leases(leases, owner, now_ms),
                now_ms,
            };
            match definitions::decide(owner, &self.running, seen) {
                Gate::Commit(_) | Gate::Drain if !self.commits && (committed.is_some() || legacy.is_some()) => {
                    Gate::Wait(WaitReason::NotCommitted)
                }
                other => other,
            }
        };
        let open = match gate {
            Gate::Run => {
                self.note_generation(committed.as_ref().map(|(c, _)| c.generation));
                true
            }
            Gate::Wait(why) => {
                self.note_generation(committed.as_ref().map(|(c, _)| c.generation));
                self.wait(why);
                if let Some((c, revision)) = committed.filter(|(c, _)| c.drained_by(owner, now_ms)) {
                    // Blocked after marking: give the mark up so the others take leases again.
                    let _ = store.store_definitions(&definitions::Committed { draining: None, ..c }, Some(revision)).await;
                }
                false
            }
            Gate::Drain => {
                if let Some((c, revision)) = committed {
                    self.mark_draining(store, c, revision, owner, now_ms, lease_ms).await?;
                }
                self.wait(WaitReason::Draining);
                false
            }
            // The mark must outlive the commit by a lease duration on a fresh clock: a round
            // slow to get here (retries, a paused process) marks again instead.
            Gate::Commit(_) if committed.as_ref().is_some_and(|(c, _)| !c.drained_by(owner, fresh_ms().saturating_add(lease_ms))) => {
                if let Some((c, revision)) = committed {
                    self.mark_draining(store, c, revision, owner, fresh_ms(), lease_ms).await?;
                }
                self.wait(WaitReason::Draining);
                false
            }
            Gate::Commit(next) => self.commit(store, next, committed.map(|(_, r)| r)).await?,
        };
        if open {
            self.waiting = None;
        }
        for reason in WaitReason::ALL {
            metrics::gauge!(names::DEFINITIONS_WAITING, "reason" => reason.as_str()).set(if self.waiting == Some(reason) {
                1.0
            } else {
                0.0
            });
        }
        Ok(open)
    }

    async fn mark_draining<L: LeaseStore>(
        &self,
        store: &L,
        c: definitions::Committed,
        revision: u64,
        owner: &str,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<(), StateError> {
        let mark = definitions::Drain { owner: owner.to_string(), until_ms: now_ms.saturating_add(DRAIN_ROUNDS * lease_ms) };
        if store.store_definitions(&definitions::Committed { draining: Some(mark), ..c }, Some(revision)).await? {
            info!("committed rule definitions marked draining; committing this replica's own after one more check");
        }
        Ok(())
    }

    async fn commit<L: LeaseStore>(&mut self, store: &L, next: definitions::Committed, revision: Option<u64>) -> Result<bool, StateError> {
        if !store.store_definitions(&next, revision).await? {
            info!("another replica stored rule definitions meanwhile; reading them next round");
            return Ok(false);
        }
        if next.generation == 1 && next.settled() {
            info!(rules = next.rules.len(), "rule definitions committed (generation 1); a rule added or changed later is rebuilt");
        } else {
            warn!(
                generation = next.generation,
                rebuild = ?next.rebuild,
                retire = next.retire.len(),
                "new rule definitions committed: their rules are rebuilt from the items, and what the old definitions wrote is zeroed"
            );
        }
        self.note_generation(Some(next.generation));
        Ok(true)
    }

    /// Every replica shows the committed work (the schedule's holder does it as well).
    fn show_pending(&self, c: &definitions::Committed) {
        for name in self.running.rules.keys() {
            let pending = c.rebuild.contains(name) && self.running.runs(c);
            metrics::gauge!(names::RULE_REBUILD_PENDING, "rule" => name.clone()).set(if pending { 1.0 } else { 0.0 });
        }
        metrics::gauge!(names::DEFINITIONS_RETIRE_PENDING).set(c.to_zero() as f64);
        metrics::gauge!(names::DEFINITIONS_REMOVAL_PENDING).set(c.to_remove() as f64);
    }

    fn wait(&mut self, why: WaitReason) {
        if self.waiting != Some(why) {
            warn!(reason = why.as_str(), "holding no lease: {}", why.explain());
        }
        self.waiting = Some(why);
    }

    fn note_generation(&mut self, generation: Option<u64>) {
        if let Some(g) = generation {
            if self.generation != Some(g) {
                info!(generation = g, "committed rule definitions read");
            }
            metrics::gauge!(names::DEFINITIONS_GENERATION).set(g as f64);
        }
        self.generation = generation;
    }

    async fn forget_old_beats<L: LeaseStore>(&self, store: &L, beats: &[Beat], now_ms: u64) {
        for b in beats.iter().filter(|b| b.until_ms.saturating_add(FORGET_BEATS_AFTER_MS) < now_ms) {
            let _ = store.drop_beat(&b.owner).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::memory::MemoryLeases;

    fn rules(yaml_change: impl Fn(String) -> String) -> Vec<Rule> {
        let text = yaml_change(include_str!("../../config/commerce.yaml").to_string());
        crate::config::Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap().engine.rules
    }

    fn lease(shard: &str, owner: &str, until: u64) -> (String, Lease) {
        let mut l = Lease::new(shard, None);
        l.owner = Some(owner.into());
        l.expires_at_ms = until;
        (shard.to_string(), l)
    }

    #[tokio::test]
    async fn a_new_config_waits_without_leases_until_the_old_replicas_are_gone() {
        let store = MemoryLeases::new();
        let old = rules(|t| t);
        let new = rules(|t| t.replace("SALES#{date|day}", "MONTHLY#{date|month}"));
        let (mut a, mut b) = (DefinitionsGate::new(&old), DefinitionsGate::new(&new));
        let none = BTreeMap::new();
        assert!(a.round(&store, "a", &none, (1_000, std::time::Instant::now()), 10_000).await.unwrap(), "first start commits");
        let held: BTreeMap<String, Lease> = [lease("s1", "a", 11_000)].into();
        assert!(!b.round(&store, "b", &held, (2_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert_eq!(b.waiting(), Some(WaitReason::CommittedLive));
        assert!(a.round(&store, "a", &held, (3_000, std::time::Instant::now()), 10_000).await.unwrap(), "the old replica works on");
        // a stops (SIGTERM: beat dropped, leases released): b marks the definitions draining
        // and commits only after one more check.
        store.drop_beat("a").await.unwrap();
        assert!(!b.round(&store, "b", &none, (4_000, std::time::Instant::now()), 10_000).await.unwrap(), "marked, not committed yet");
        assert_eq!(b.waiting(), Some(WaitReason::Draining));
        // A replica of the old definitions that read the item before the mark and took a
        // lease after it finds the mark when it reads again, and gives the lease back.
        assert!(!a.still_current(&store, "a", 4_100).await.unwrap());
        let mut a3 = DefinitionsGate::new(&old);
        assert!(
            a3.round(&store, "a3", &none, (4_200, std::time::Instant::now()), 10_000).await.unwrap(),
            "still the committed definitions"
        );
        assert!(!a3.takes_leases(), "but marked draining: no new lease");
        store.drop_beat("a3").await.unwrap();
        assert!(b.round(&store, "b", &none, (5_000, std::time::Instant::now()), 10_000).await.unwrap(), "b commits and runs");
        let (c, _) = store.definitions().await.unwrap().unwrap();
        assert_eq!(c.draining, None);
        assert_eq!((c.generation, c.rebuild.iter().cloned().collect::<Vec<_>>()), (2, vec!["daily-sales".to_string()]));
        // An old replica restarted now holds nothing.
        let mut a2 = DefinitionsGate::new(&old);
        assert!(!a2.round(&store, "a2", &none, (6_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert_eq!(a2.waiting(), Some(WaitReason::CommittedLive));
        // A command-line consumer with another config never commits it.
        store.drop_beat("b").await.unwrap();
        let mut cli = DefinitionsGate::new(&old).never_committing();
        assert!(!cli.round(&store, "cli", &none, (7_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert_eq!(cli.waiting(), Some(WaitReason::NotCommitted));
        assert_eq!(store.definitions().await.unwrap().unwrap().0.generation, 2);
    }

    #[tokio::test]
    async fn a_committer_blocked_after_marking_gives_the_mark_up() {
        let store = MemoryLeases::new();
        let (old, new) = (rules(|t| t), rules(|t| t.replace("SALES#{date|day}", "MONTHLY#{date|month}")));
        let (mut a, mut b) = (DefinitionsGate::new(&old), DefinitionsGate::new(&new));
        let none = BTreeMap::new();
        assert!(a.round(&store, "a", &none, (1_000, std::time::Instant::now()), 10_000).await.unwrap());
        store.drop_beat("a").await.unwrap();
        assert!(!b.round(&store, "b", &none, (2_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert!(store.definitions().await.unwrap().unwrap().0.draining.is_some());
        // a was only paused: its lease, taken before b's last check, blocks the commit.
        let held: BTreeMap<String, Lease> = [lease("s1", "a", 12_000)].into();
        assert!(!b.round(&store, "b", &held, (3_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert_eq!(b.waiting(), Some(WaitReason::LeasesHeld));
        let (c, _) = store.definitions().await.unwrap().unwrap();
        assert_eq!((c.generation, c.draining), (1, None), "nothing committed, the mark given up");
        assert!(a.round(&store, "a", &held, (3_500, std::time::Instant::now()), 10_000).await.unwrap() && a.takes_leases());
        // A committer whose mark would expire within a lease duration of its commit (a slow
        // round) marks again instead of committing.
        store.drop_beat("a").await.unwrap();
        assert!(!b.round(&store, "b", &none, (4_000, std::time::Instant::now()), 10_000).await.unwrap());
        assert!(!b.round(&store, "b", &none, (15_000, std::time::Instant::now()), 10_000).await.unwrap(), "mark until 24,000: too close");
        // Marked again from a fresh clock: 15,000 plus the round's own time (a few ms, or more
        // on a loaded machine), plus two lease durations.
        let (c, _) = store.definitions().await.unwrap().unwrap();
        let until = c.draining.map(|d| d.until_ms);
        assert!(c.generation == 1 && until.is_some_and(|u| (35_000..36_000).contains(&u)), "marked again: {until:?}");
        assert!(b.round(&store, "b", &none, (16_000, std::time::Instant::now()), 10_000).await.unwrap(), "then commits");
    }
}
