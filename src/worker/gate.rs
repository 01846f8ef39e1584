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

pub struct DefinitionsGate {
    running: Running,
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
            waiting: None,
            generation: None,
        }
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
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<bool, StateError> {
        let beat =
            Beat { owner: owner.to_string(), digest: self.running.digest(), protocol: self.running.protocol, until_ms: now_ms + lease_ms };
        store.publish_beat(&beat).await?;
        let committed = store.definitions().await?;
        let current = committed.as_ref().is_some_and(|(c, _)| self.running.runs(c));
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
            definitions::decide(owner, &self.running, seen)
        };
        let open = match gate {
            Gate::Run => {
                self.note_generation(committed.as_ref().map(|(c, _)| c.generation));
                true
            }
            Gate::Wait(why) => {
                self.note_generation(committed.as_ref().map(|(c, _)| c.generation));
                self.wait(why);
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
        assert!(a.round(&store, "a", &none, 1_000, 10_000).await.unwrap(), "first start commits");
        let held: BTreeMap<String, Lease> = [lease("s1", "a", 11_000)].into();
        assert!(!b.round(&store, "b", &held, 2_000, 10_000).await.unwrap());
        assert_eq!(b.waiting(), Some(WaitReason::CommittedLive));
        assert!(a.round(&store, "a", &held, 3_000, 10_000).await.unwrap(), "the old replica works on");
        // a stops (SIGTERM: beat dropped, leases released).
        store.drop_beat("a").await.unwrap();
        assert!(b.round(&store, "b", &none, 4_000, 10_000).await.unwrap(), "b commits and runs");
        let (c, _) = store.definitions().await.unwrap().unwrap();
        assert_eq!((c.generation, c.rebuild.iter().cloned().collect::<Vec<_>>()), (2, vec!["daily-sales".to_string()]));
        // An old replica restarted now holds nothing.
        let mut a2 = DefinitionsGate::new(&old);
        assert!(!a2.round(&store, "a2", &none, 5_000, 10_000).await.unwrap());
        assert_eq!(a2.waiting(), Some(WaitReason::CommittedLive));
    }
}
