//! Rule definitions committed by generation (DESIGN.md, "Changing a running deployment").
//!
//! The state table keeps the rule definitions the deployment applies (the definitions
//! themselves, not only fingerprints) under a monotonic generation, and every live replica
//! publishes a heartbeat ([`Beat`]) naming the definitions and protocol it runs. A replica whose
//! definitions differ from the committed ones holds no lease, so it applies no record, until
//! no live replica runs the committed ones and no shard lease is held; then it commits its own
//! (generation + 1) and the deployment rebuilds. So:
//! - no record is applied under two definitions: the old ones stop before the new ones start
//!   (checkpoints are per shard, so "not applying a rule" can only mean "holding no lease");
//! - the rebuild's truth covers everything the old definition wrote, and the committed item
//!   says what that was ([`Committed::retire`]), so its leftovers are zeroed;
//! - an old replica restarted mid-rollout still runs the committed definitions and works until
//!   it is replaced; a rollback is a change like any other;
//! - two different new definitions at once commit nothing, and say so.
//!
//! Everything here is pure: [`decide`] turns what a maintenance round read into a [`Gate`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::rules::fingerprint;

/// The storage formats this release writes (ledger entries, counters, helper keys, state
/// items). 1: releases before definitions were kept (no heartbeat, no committed item). 2:
/// definitions committed by generation. 3: every ledger write honours a reconcile hold
/// ([`crate::sink::hold`]), so a hold may be placed only once 3 is committed. 4: a write that
/// raises a helper item's count removes its expiry ([`crate::sink::expiry`]), so expiries are
/// written only where no replica of 3 or older writes. 5: derivations of `max`, `min` and
/// `latest` read from a cursor that the writers of their helpers move back
/// ([`crate::sink::derive`]), which a replica of 4 would not. 6: `distinct` is a count of
/// helpers flagged counted, moved with the flags ([`crate::sink::distinct`]); a replica of 5
/// would set it to the live helpers it counts and leave the flags behind. A replica never runs once a newer
/// protocol is committed, and a newer one commits its own only when no replica of the
/// committed one holds a lease.
pub const PROTOCOL: u64 = 6;

/// One committed rule: its canonical definition and the generation since which it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleDef {
    pub definition: String,
    pub since: u64,
}

/// An old definition whose leftovers (targets, attributes, helper items the current rules
/// do not write) are still to be zeroed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retired {
    pub name: String,
    pub definition: String,
    /// When its leftovers were zeroed (epoch ms): they are removed once
    /// `reconcile.remove_leftovers_after` has passed since. None: still to be zeroed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zeroed_ms: Option<u64>,
}

impl Retired {
    pub fn new(name: &str, definition: &str) -> Retired {
        Retired { name: name.to_string(), definition: definition.to_string(), zeroed_ms: None }
    }

    /// Whether `other` is the same old definition (whatever its progress).
    pub fn same(&self, other: &Retired) -> bool {
        self.name == other.name && self.definition == other.definition
    }
}

/// What the state table holds as committed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    pub generation: u64,
    pub protocol: u64,
    pub rules: BTreeMap<String, RuleDef>,
    /// Rules whose targets are still to be rebuilt for their current definition.
    #[serde(default)]
    pub rebuild: BTreeSet<String>,
    /// Old definitions still to be cleaned up after.
    #[serde(default)]
    pub retire: Vec<Retired>,
    /// A replica about to commit other definitions: until it expires, the replicas of these
    /// take no new lease (see [`Drain`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining: Option<Drain>,
    /// `aggregates.helper_expiry_attribute` of these definitions: every writer of helper
    /// items must remove it ([`crate::sink::expiry`]), so replicas that differ in it never
    /// write at once. Absent: none (and the digest is what releases before it computed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry: Option<String>,
    /// The copy rules of these definitions ([`crate::rules::copy::definitions`]): a replica
    /// without a copy rule would move its checkpoints past the changes that rule copies, so
    /// replicas that differ in them never run at once. Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copies: Option<String>,
}

/// The mark a committer stores before it checks a last time and commits. Without it, a
/// replica of the committed definitions whose heartbeat and leases lapsed (a long pause) could
/// read the committed item, the committer check and commit, and the paused one then take a
/// lease and apply the old definitions after the commit. With it, a taker reads the committed
/// item again after taking leases and gives them back unused if it is marked or moved on,
/// while the committer's last check sees any lease taken before that read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    pub owner: String,
    pub until_ms: u64,
}

impl Committed {
    /// The digest replicas publish: definitions and protocol together.
    pub fn digest(&self) -> String {
        digest(
            self.rules.iter().map(|(n, r)| (n.as_str(), r.definition.as_str())),
            self.protocol,
            self.expiry.as_deref(),
            self.copies.as_deref(),
        )
    }

    /// Whether a live drain mark of another replica than `me` is on it: no new lease.
    pub fn drained_by_other(&self, me: &str, now_ms: u64) -> bool {
        self.draining.as_ref().is_some_and(|d| d.owner != me && d.until_ms > now_ms)
    }

    /// Whether `me` marked it, and the mark is live: its last check passed a round ago.
    pub fn drained_by(&self, me: &str, now_ms: u64) -> bool {
        self.draining.as_ref().is_some_and(|d| d.owner == me && d.until_ms > now_ms)
    }

    /// Whether the rebuild of this generation is done and every old definition's leftovers are
    /// zeroed (their removal may still be due: [`Committed::removal_due_ms`]).
    pub fn settled(&self) -> bool {
        self.rebuild.is_empty() && self.retire.iter().all(|r| r.zeroed_ms.is_some())
    }

    /// Old definitions whose leftovers are still to be zeroed.
    pub fn to_zero(&self) -> usize {
        self.retire.iter().filter(|r| r.zeroed_ms.is_none()).count()
    }

    /// Old definitions whose zeroed leftovers are still to be removed.
    pub fn to_remove(&self) -> usize {
        self.retire.iter().filter(|r| r.zeroed_ms.is_some()).count()
    }

    /// When the first zeroed leftovers are due for removal, `after_ms` after they were zeroed.
    pub fn removal_due_ms(&self, after_ms: u64) -> Option<u64> {
        self.retire.iter().filter_map(|r| r.zeroed_ms).min().map(|z| z.saturating_add(after_ms))
    }
}

/// The definitions a replica runs: rule name -> canonical definition, and its protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub rules: BTreeMap<String, String>,
    pub protocol: u64,
    /// The helper expiry attribute ([`Committed::expiry`]).
    pub expiry: Option<String>,
    /// The copy rules ([`Committed::copies`]).
    pub copies: Option<String>,
}

impl Running {
    pub fn new(rules: impl IntoIterator<Item = (String, String)>) -> Running {
        Running { rules: rules.into_iter().collect(), protocol: PROTOCOL, expiry: None, copies: None }
    }

    /// With the config's copy rules ([`crate::rules::copy::definitions`]).
    pub fn with_copies(self, copies: Option<String>) -> Running {
        Running { copies, ..self }
    }

    /// With the config's `aggregates.helper_expiry_attribute`.
    pub fn with_expiry(self, expiry: Option<String>) -> Running {
        Running { expiry, ..self }
    }

    pub fn digest(&self) -> String {
        digest(self.rules.iter().map(|(n, d)| (n.as_str(), d.as_str())), self.protocol, self.expiry.as_deref(), self.copies.as_deref())
    }

    /// Whether these are the committed definitions (and protocol, expiry attribute and copy
    /// rules).
    pub fn runs(&self, c: &Committed) -> bool {
        self.protocol == c.protocol
            && self.expiry == c.expiry
            && self.copies == c.copies
            && self.rules.len() == c.rules.len()
            && self.rules.iter().all(|(n, d)| c.rules.get(n).is_some_and(|r| r.definition == *d))
    }
}

/// A digest of a definition set: `p<protocol>:` and FNV-1a over the names and definitions
/// (and the expiry attribute and the copy rules, when there are).
fn digest<'a>(rules: impl Iterator<Item = (&'a str, &'a str)>, protocol: u64, expiry: Option<&str>, copies: Option<&str>) -> String {
    let mut text = String::new();
    for (n, d) in rules {
        text.push_str(n);
        text.push('\u{0}');
        text.push_str(d);
        text.push('\u{0}');
    }
    if let Some(attribute) = expiry {
        text.push_str("\u{0}helper_expiry_attribute\u{0}");
        text.push_str(attribute);
    }
    if let Some(copies) = copies {
        text.push_str("\u{0}copy_rules\u{0}");
        text.push_str(copies);
    }
    format!("p{protocol}:{:016x}", fingerprint::fnv1a(text.as_bytes()))
}

/// A replica's heartbeat in the state table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Beat {
    pub owner: String,
    pub digest: String,
    pub protocol: u64,
    /// Epoch ms until which the replica counts as live.
    pub until_ms: u64,
}

/// Why a replica holds no lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitReason {
    /// A live replica still runs the committed definitions.
    CommittedLive,
    /// A shard lease is still held (by a replica of the committed definitions, or one of an
    /// older release that publishes no heartbeat).
    LeasesHeld,
    /// Live replicas run two or more different new definitions: none is committed.
    Conflicting,
    /// The committed protocol is newer than this release's: a rollback past a format change
    /// needs the newer release.
    NewerProtocol,
    /// Another replica marked the committed definitions draining and is about to commit
    /// (or this one did, and checks once more).
    Draining,
    /// A command-line consumer's config differs from the committed definitions: it never
    /// commits, so it applies nothing.
    NotCommitted,
    /// The config changes a live rule's `write_shards` (or gives a committed rule's target to
    /// a rule with another `write_shards`): not supported yet, so it is never committed.
    ShardingChanged,
}

impl WaitReason {
    pub const ALL: [WaitReason; 7] = [
        WaitReason::CommittedLive,
        WaitReason::LeasesHeld,
        WaitReason::Conflicting,
        WaitReason::NewerProtocol,
        WaitReason::Draining,
        WaitReason::NotCommitted,
        WaitReason::ShardingChanged,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WaitReason::CommittedLive => "committed_replicas_live",
            WaitReason::LeasesHeld => "leases_held",
            WaitReason::Conflicting => "conflicting_definitions",
            WaitReason::NewerProtocol => "newer_protocol",
            WaitReason::Draining => "draining",
            WaitReason::NotCommitted => "not_committed",
            WaitReason::ShardingChanged => "sharding_changed",
        }
    }

    pub fn explain(self) -> &'static str {
        match self {
            WaitReason::CommittedLive => {
                "a live replica still runs the committed rule definitions; this one takes leases once they are gone"
            }
            WaitReason::LeasesHeld => {
                "shard leases are still held under the committed rule definitions; this one takes leases once they are released or expired"
            }
            WaitReason::Conflicting => {
                "live replicas run different new rule definitions: nothing is committed until they agree (deploy one config)"
            }
            WaitReason::NewerProtocol => "the state table records a newer storage protocol than this release writes: run the newer release",
            WaitReason::Draining => "the committed rule definitions are marked draining: a replica commits its own once a last check passes",
            WaitReason::NotCommitted => {
                "this config's rule definitions are not the committed ones, and a command-line consumer never commits: use the config the service runs"
            }
            WaitReason::ShardingChanged => {
                "this config changes the write_shards of a live target, which is not supported yet: deploy the committed write_shards again, or put the sharded rule on a target with another key (docs/configuration.md, write_shards)"
            }
        }
    }
}

/// What a replica does this round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    /// Its definitions are the committed ones: take leases, read, rebuild what is due.
    Run,
    /// Hold no lease, and say why.
    Wait(WaitReason),
    /// Commit these (conditional on the committed item being as read), then run.
    Commit(Committed),
    /// Nothing blocks a commit: mark the committed item draining ([`Drain`]) and check again
    /// next round, holding no lease.
    Drain,
}

/// What a round read from the state table.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub committed: Option<&'a Committed>,
    /// Fingerprints an older release recorded (`rule-fingerprints`), when nothing is committed.
    pub legacy: Option<&'a BTreeMap<String, String>>,
    pub beats: &'a [Beat],
    /// Shard leases held, unexpired, by anyone.
    pub live_leases: usize,
    pub now_ms: u64,
}

/// The pure decision of one round for the replica `me` running `mine`.
pub fn decide(me: &str, mine: &Running, seen: Seen<'_>) -> Gate {
    let Some(c) = seen.committed else { return first_commit(mine, seen) };
    if c.protocol > mine.protocol {
        return Gate::Wait(WaitReason::NewerProtocol);
    }
    if mine.runs(c) {
        return Gate::Run;
    }
    if sharding_changed(c, mine) {
        return Gate::Wait(WaitReason::ShardingChanged);
    }
    match blocker(me, mine, &c.digest(), seen) {
        Some(why) => Gate::Wait(why),
        None if c.drained_by(me, seen.now_ms) => Gate::Commit(next(c, mine)),
        None if c.drained_by_other(me, seen.now_ms) => Gate::Wait(WaitReason::Draining),
        None => Gate::Drain,
    }
}

/// Nothing committed yet: a deployment's first start (nothing to rebuild), or the first start
/// of this release over fingerprints an older release recorded. The older replicas ignore
/// reconcile holds (protocol 3), so even with the same fingerprints this waits until they hold
/// no lease; different fingerprints: their definitions are unknown, so nothing can be
/// retired, and what differs is rebuilt.
fn first_commit(mine: &Running, seen: Seen<'_>) -> Gate {
    let rules = mine.rules.iter().map(|(n, d)| (n.clone(), RuleDef { definition: d.clone(), since: 1 })).collect();
    let mut first = Committed {
        generation: 1,
        protocol: mine.protocol,
        rules,
        expiry: mine.expiry.clone(),
        copies: mine.copies.clone(),
        ..Committed::default()
    };
    let Some(legacy) = seen.legacy else { return Gate::Commit(first) };
    let changed: BTreeSet<String> =
        mine.rules.iter().filter(|(n, d)| legacy.get(*n) != Some(&fingerprint::of_definition(d))).map(|(n, _)| n.clone()).collect();
    if seen.live_leases > 0 {
        return Gate::Wait(WaitReason::LeasesHeld);
    }
    first.rebuild = changed;
    Gate::Commit(first)
}

/// Whether `mine` would move a committed target between sharded and unsharded forms, or to
/// another number of sub-items: a rule of the same name, or one whose target templates may
/// form the same keys, whose `write_shards` differs from a committed or retiring definition's.
/// The rebuild cannot do that yet: the old form's sub-items (or item) would keep counts that
/// the new form's reconcile does not see, and the old folds' sequence would refuse the new.
pub fn sharding_changed(c: &Committed, mine: &Running) -> bool {
    use crate::rules::template::Template;
    type Shape = (Vec<(String, Template)>, Option<u64>);
    let shape = |definition: &str| -> Option<Shape> {
        let v: serde_json::Value = serde_json::from_str(definition).ok()?;
        let target = v.get("target")?.as_array()?.iter().map(|pair| {
            let [k, t] = pair.as_array()?.as_slice() else { return None };
            Some((k.as_str()?.to_string(), Template::parse(t.as_str()?).ok()?))
        });
        Some((target.collect::<Option<Vec<_>>>()?, v.get(crate::config::WRITE_SHARDS).and_then(serde_json::Value::as_u64)))
    };
    let same_items = |a: &[(String, Template)], b: &[(String, Template)]| {
        a.len() == b.len() && a.iter().zip(b).all(|((ka, ta), (kb, tb))| ka == kb && ta.may_overlap(tb))
    };
    let old = c.rules.iter().map(|(n, r)| (n.as_str(), r.definition.as_str()));
    let old = old.chain(c.retire.iter().map(|r| (r.name.as_str(), r.definition.as_str())));
    let old: Vec<(&str, Shape)> = old.filter_map(|(n, d)| Some((n, shape(d)?))).collect();
    mine.rules
        .iter()
        .filter_map(|(n, d)| Some((n, shape(d)?)))
        .any(|(name, (target, shards))| old.iter().any(|(o, (t, s))| (*o == name.as_str() || same_items(t, &target)) && *s != shards))
}

/// What keeps `mine` from being committed now, if anything.
fn blocker(me: &str, mine: &Running, committed: &str, seen: Seen<'_>) -> Option<WaitReason> {
    let live = || seen.beats.iter().filter(|b| b.owner != me && b.until_ms > seen.now_ms);
    if live().any(|b| b.digest == committed) {
        return Some(WaitReason::CommittedLive);
    }
    if seen.live_leases > 0 {
        return Some(WaitReason::LeasesHeld);
    }
    let ours = mine.digest();
    if live().any(|b| b.digest != ours) {
        return Some(WaitReason::Conflicting);
    }
    None
}

/// The generation after `c` that runs `mine`: rules whose definition changed or that are new
/// are rebuilt (as are those whose rebuild was still due), and old definitions that are no
/// longer current are cleaned up after (with those still pending).
pub fn next(c: &Committed, mine: &Running) -> Committed {
    let generation = c.generation.saturating_add(1);
    let mut rules = BTreeMap::new();
    let mut rebuild = BTreeSet::new();
    for (name, def) in &mine.rules {
        match c.rules.get(name).filter(|r| r.definition == *def) {
            Some(same) => {
                rules.insert(name.clone(), same.clone());
                if c.rebuild.contains(name) {
                    rebuild.insert(name.clone());
                }
            }
            None => {
                rules.insert(name.clone(), RuleDef { definition: def.clone(), since: generation });
                rebuild.insert(name.clone());
            }
        }
    }
    // Carried entries are zeroed again under the new rules, and their removal waits a whole
    // window from then: what the new generation stops writing (a rule removed now that wrote
    // the same attributes) had its ledger written until now.
    let mut retire: Vec<Retired> = c.retire.iter().map(|r| Retired::new(&r.name, &r.definition)).collect();
    for (name, old) in &c.rules {
        if mine.rules.get(name) != Some(&old.definition) {
            retire.push(Retired::new(name, &old.definition));
        }
    }
    // A definition current again (a rollback) is rebuilt, not cleaned up; each once.
    retire.retain(|r| mine.rules.get(&r.name) != Some(&r.definition));
    let mut seen = BTreeSet::new();
    retire.retain(|r| seen.insert((r.name.clone(), r.definition.clone())));
    Committed {
        generation,
        protocol: c.protocol.max(mine.protocol),
        rules,
        rebuild,
        retire,
        draining: None,
        expiry: mine.expiry.clone(),
        copies: mine.copies.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(rules: &[(&str, &str)]) -> Running {
        Running::new(rules.iter().map(|(n, d)| (n.to_string(), d.to_string())))
    }

    fn beat(owner: &str, r: &Running, until_ms: u64) -> Beat {
        Beat { owner: owner.into(), digest: r.digest(), protocol: r.protocol, until_ms }
    }

    fn seen<'a>(committed: Option<&'a Committed>, beats: &'a [Beat], live_leases: usize) -> Seen<'a> {
        Seen { committed, legacy: None, beats, live_leases, now_ms: 1_000 }
    }

    /// `c` marked draining by `me`, live at the tests' now.
    fn marked(c: &Committed, me: &str) -> Committed {
        Committed { draining: Some(Drain { owner: me.into(), until_ms: 5_000 }), ..c.clone() }
    }

    fn committed(r: &Running) -> Committed {
        match decide("x", r, seen(None, &[], 0)) {
            Gate::Commit(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_first_start_commits_and_rebuilds_nothing() {
        let a = running(&[("orders", "{A}")]);
        let c = committed(&a);
        assert_eq!(c.generation, 1);
        assert!(c.settled(), "{c:?}");
        assert_eq!(decide("x", &a, seen(Some(&c), &[], 3)), Gate::Run);
    }

    #[test]
    fn a_change_waits_for_the_committed_replicas_and_their_leases() {
        let old = running(&[("orders", "{A}"), ("daily", "{D}")]);
        let new = running(&[("orders", "{A}"), ("monthly", "{M}")]);
        let c = committed(&old);
        let beats = [beat("old-1", &old, 5_000), beat("new-1", &new, 5_000)];
        assert_eq!(decide("new-1", &new, seen(Some(&c), &beats, 0)), Gate::Wait(WaitReason::CommittedLive));
        // The old replica's beat expired (it was stopped), but its lease is not released yet.
        let stale = [beat("old-1", &old, 999), beat("new-1", &new, 5_000)];
        assert_eq!(decide("new-1", &new, seen(Some(&c), &stale, 1)), Gate::Wait(WaitReason::LeasesHeld));
        // An old replica keeps running meanwhile: it is the committed one.
        assert_eq!(decide("old-1", &old, seen(Some(&c), &beats, 4)), Gate::Run);
        // Nothing blocks: mark, check again a round later, then commit.
        assert_eq!(decide("new-1", &new, seen(Some(&c), &stale, 0)), Gate::Drain);
        let m = marked(&c, "new-1");
        assert_eq!(decide("new-1", &new, seen(Some(&m), &stale, 1)), Gate::Wait(WaitReason::LeasesHeld), "a lease taken meanwhile");
        assert_eq!(decide("new-2", &new, seen(Some(&m), &stale, 0)), Gate::Wait(WaitReason::Draining), "one committer");
        assert!(m.drained_by_other("old-1", 1_000), "the old replicas take no new lease");
        assert!(!m.drained_by_other("old-1", 5_000), "the mark expires");
        let Gate::Commit(next) = decide("new-1", &new, seen(Some(&m), &stale, 0)) else { panic!() };
        assert_eq!(next.generation, 2);
        assert_eq!(next.draining, None);
        assert_eq!(next.rebuild, BTreeSet::from(["monthly".to_string()]), "orders is unchanged");
        assert_eq!(next.retire, vec![Retired::new("daily", "{D}")]);
        assert_eq!(next.rules["orders"].since, 1);
        assert_eq!(next.rules["monthly"].since, 2);
        // Once committed, the new replicas run and an old one restarted now waits.
        assert_eq!(decide("new-2", &new, seen(Some(&next), &[], 0)), Gate::Run);
        assert_eq!(decide("old-2", &old, seen(Some(&next), &[], 2)), Gate::Wait(WaitReason::LeasesHeld));
        assert_eq!(decide("old-2", &old, seen(Some(&next), &[beat("new-1", &new, 5_000)], 0)), Gate::Wait(WaitReason::CommittedLive));
    }

    /// The gate's path for a change with nothing to rebuild, from `old` (the orders rule
    /// alone) to `new`: `new` waits while `old` is live, drains, commits generation 2, and
    /// `old` then waits. The committed definitions before and after.
    fn committed_without_rebuild(old: &Running, new: &Running) -> (Committed, Committed) {
        assert_eq!(old.digest(), digest([("orders", "{A}")].into_iter(), PROTOCOL, None, None));
        assert_ne!(old.digest(), new.digest());
        let c = committed(old);
        let beats = [beat("old-1", old, 5_000), beat("new-1", new, 5_000)];
        assert_eq!(decide("new-1", new, seen(Some(&c), &beats, 0)), Gate::Wait(WaitReason::CommittedLive));
        let gone = [beat("new-1", new, 5_000)];
        assert_eq!(decide("new-1", new, seen(Some(&c), &gone, 0)), Gate::Drain);
        let Gate::Commit(next) = decide("new-1", new, seen(Some(&marked(&c, "new-1")), &gone, 0)) else { panic!() };
        assert_eq!(next.generation, 2);
        assert!(next.settled(), "nothing to rebuild or retire: {next:?}");
        assert_eq!(decide("old-2", old, seen(Some(&next), &gone, 0)), Gate::Wait(WaitReason::CommittedLive));
        (c, next)
    }

    /// Stored and read back; `field` is in the text exactly when `present`.
    fn round_trips(c: &Committed, field: &str, present: bool) {
        let text = serde_json::to_string(c).unwrap();
        assert_eq!(text.contains(field), present, "{text}");
        assert_eq!(&serde_json::from_str::<Committed>(&text).unwrap(), c);
    }

    /// Naming the helper expiry attribute is a change like a rule's: the replicas that name it
    /// write nothing until none of those that do not (and would not remove expiries) is live,
    /// then commit it, with nothing to rebuild. Without one, the digest is what releases before
    /// the attribute computed, so an upgrade with unchanged config is no change.
    #[test]
    fn the_helper_expiry_attribute_is_committed_like_a_rule() {
        let old = running(&[("orders", "{A}")]);
        let new = running(&[("orders", "{A}")]).with_expiry(Some("expiresAt".into()));
        let (c, next) = committed_without_rebuild(&old, &new);
        assert_eq!(c.expiry, None);
        assert_eq!(next.expiry.as_deref(), Some("expiresAt"));
        assert_eq!(decide("new-2", &new, seen(Some(&next), &[], 0)), Gate::Run);
        for c in [&c, &next] {
            round_trips(c, "expiry", c.expiry.is_some());
        }
    }

    /// Adding, changing or removing a copy rule is a change like a rule's: a replica without
    /// the new copy rule would checkpoint past the changes it copies, so the replicas of the
    /// new config write nothing until none of the old is live, then commit, with nothing to
    /// rebuild (`reconcile --all` sets existing copies). Without copy rules, the digest is
    /// what releases before them computed.
    #[test]
    fn copy_rules_are_committed_like_rules() {
        let old = running(&[("orders", "{A}")]);
        let new = running(&[("orders", "{A}")]).with_copies(Some("names\u{0}{C}".into()));
        let (c, next) = committed_without_rebuild(&old, &new);
        assert_eq!(next.copies.as_deref(), Some("names\u{0}{C}"));
        for c in [&c, &next] {
            round_trips(c, "copies", c.copies.is_some());
        }
    }

    /// A change of `write_shards` on a live target is never committed, whether the rule keeps
    /// its name or another rule takes its target; other changes of a sharded rule are.
    #[test]
    fn a_change_of_write_shards_waits_and_says_why() {
        let def = |target: &str, shards: Option<u64>, measure: &str| {
            let mut v = serde_json::json!({"target": [["PK", target], ["SK", "TOTAL"]], "measures": {measure: "count"}});
            if let Some(n) = shards {
                v["write_shards"] = n.into();
            }
            v.to_string()
        };
        let (plain, sharded) = (def("SALES#{d}", None, "n"), def("SALES#{d}", Some(16), "n"));
        let c = committed(&running(&[("daily", &plain)]));
        for mine in [
            running(&[("daily", &sharded)]),
            running(&[("daily-sharded", &sharded)]),
            running(&[("daily", &def("SALES#{d}", Some(8), "n"))]).with_expiry(None),
        ] {
            assert_eq!(decide("new", &mine, seen(Some(&c), &[], 0)), Gate::Wait(WaitReason::ShardingChanged), "{mine:?}");
        }
        // Another variable name forms the same keys.
        let renamed = def("SALES#{day}", Some(16), "n");
        assert_eq!(decide("new", &running(&[("daily2", &renamed)]), seen(Some(&c), &[], 0)), Gate::Wait(WaitReason::ShardingChanged));
        let c16 = committed(&running(&[("daily", &sharded)]));
        assert_eq!(
            decide("new", &running(&[("daily", &def("SALES#{d}", Some(8), "n"))]), seen(Some(&c16), &[], 0)),
            Gate::Wait(WaitReason::ShardingChanged)
        );
        assert_eq!(decide("new", &running(&[("daily", &plain)]), seen(Some(&c16), &[], 0)), Gate::Wait(WaitReason::ShardingChanged));
        // Another measure on the same sharded target, or a sharded rule on a new target, is a change like any other.
        assert_eq!(decide("new", &running(&[("daily", &def("SALES#{d}", Some(16), "m"))]), seen(Some(&c16), &[], 0)), Gate::Drain);
        assert_eq!(
            decide("new", &running(&[("daily", &plain), ("hourly", &def("HOUR#{h}", Some(4), "n"))]), seen(Some(&c), &[], 0)),
            Gate::Drain
        );
        assert!(WaitReason::ShardingChanged.explain().contains("write_shards"));
    }

    #[test]
    fn two_new_definitions_at_once_commit_nothing() {
        let old = running(&[("orders", "{A}")]);
        let (b, c2) = (running(&[("orders", "{B}")]), running(&[("orders", "{C}")]));
        let c = committed(&old);
        let beats = [beat("b", &b, 5_000), beat("c", &c2, 5_000)];
        assert_eq!(decide("b", &b, seen(Some(&c), &beats, 0)), Gate::Wait(WaitReason::Conflicting));
        assert_eq!(decide("c", &c2, seen(Some(&c), &beats, 0)), Gate::Wait(WaitReason::Conflicting));
        // Replicas that agree do not block each other.
        let agree = [beat("b", &b, 5_000), beat("b2", &b, 5_000)];
        assert_eq!(decide("b", &b, seen(Some(&c), &agree, 0)), Gate::Drain);
        assert!(matches!(decide("b", &b, seen(Some(&marked(&c, "b")), &agree, 0)), Gate::Commit(_)));
    }

    #[test]
    fn a_new_generation_zeroes_carried_leftovers_again_and_restarts_their_window() {
        let g1 = Committed {
            generation: 1,
            protocol: PROTOCOL,
            rules: [("x".to_string(), RuleDef { definition: "{X}".into(), since: 1 })].into(),
            ..Committed::default()
        };
        let mut g2 = next(&g1, &running(&[("y", "{Y}")]));
        assert_eq!(g2.retire, vec![Retired::new("x", "{X}")]);
        g2.retire[0].zeroed_ms = Some(1_000);
        g2.rebuild.clear();
        assert!(g2.settled() && g2.to_remove() == 1 && g2.removal_due_ms(500) == Some(1_500));
        // y removed later: x's leftovers may share what y wrote until now.
        let g3 = next(&g2, &running(&[("z", "{Z}")]));
        assert_eq!(g3.retire, vec![Retired::new("x", "{X}"), Retired::new("y", "{Y}")], "both zeroed again, no removal due");
        assert_eq!(g3.removal_due_ms(500), None);
        assert!(!g3.settled());
    }

    #[test]
    fn a_rollback_rebuilds_the_old_definition_and_retires_the_new_one() {
        let a = running(&[("orders", "{A}")]);
        let b = running(&[("orders", "{B}")]);
        let g1 = committed(&a);
        let g2 = next(&g1, &b);
        assert_eq!(g2.retire, vec![Retired::new("orders", "{A}")]);
        // Rolled back before the rebuild of B finished: A is current again (rebuilt, since B
        // was applied meanwhile), and B's leftovers are what is cleaned up.
        let g3 = next(&g2, &a);
        assert_eq!(g3.rules["orders"].since, 3);
        assert_eq!(g3.rebuild, BTreeSet::from(["orders".to_string()]));
        assert_eq!(g3.retire, vec![Retired::new("orders", "{B}")]);
    }

    #[test]
    fn an_unfinished_rebuild_carries_over_to_the_next_generation() {
        let a = running(&[("orders", "{A}"), ("daily", "{D}")]);
        let b = running(&[("orders", "{A}"), ("daily", "{D2}")]);
        let c = running(&[("orders", "{A}"), ("daily", "{D2}"), ("extra", "{E}")]);
        let g2 = next(&committed(&a), &b);
        let g3 = next(&g2, &c);
        assert_eq!(g3.rebuild, BTreeSet::from(["daily".to_string(), "extra".to_string()]));
        assert_eq!(g3.retire, vec![Retired::new("daily", "{D}")], "not cleaned up yet: still due");
    }

    #[test]
    fn a_newer_protocol_committed_stops_an_older_release() {
        let a = running(&[("orders", "{A}")]);
        let mut newer = a.clone();
        newer.protocol = PROTOCOL + 1;
        let c = committed(&newer);
        assert_eq!(decide("old", &a, seen(Some(&c), &[], 0)), Gate::Wait(WaitReason::NewerProtocol));
        // And a newer release waits for the replicas of the committed protocol, like a change.
        let c1 = committed(&a);
        assert_eq!(decide("new", &newer, seen(Some(&c1), &[beat("old", &a, 5_000)], 0)), Gate::Wait(WaitReason::CommittedLive));
        let Gate::Commit(up) = decide("new", &newer, seen(Some(&marked(&c1, "new")), &[], 0)) else { panic!() };
        assert_eq!(up.protocol, PROTOCOL + 1);
        assert!(up.settled(), "same definitions: nothing to rebuild");
    }

    #[test]
    fn the_first_start_of_this_release_over_fingerprints_only() {
        let a = running(&[("orders", "{A}")]);
        let same: BTreeMap<String, String> = [("orders".to_string(), fingerprint::of_definition("{A}"))].into();
        let other: BTreeMap<String, String> = [("orders".to_string(), fingerprint::of_definition("{Z}"))].into();
        let with = |legacy, leases| Seen { committed: None, legacy: Some(legacy), beats: &[], live_leases: leases, now_ms: 0 };
        assert_eq!(decide("x", &a, with(&same, 3)), Gate::Wait(WaitReason::LeasesHeld), "the older replicas ignore holds: they stop first");
        let Gate::Commit(c) = decide("x", &a, with(&same, 0)) else { panic!() };
        assert!(c.settled(), "a plain upgrade rebuilds nothing");
        assert_eq!(decide("x", &a, with(&other, 3)), Gate::Wait(WaitReason::LeasesHeld));
        let Gate::Commit(c) = decide("x", &a, with(&other, 0)) else { panic!() };
        assert_eq!(c.rebuild, BTreeSet::from(["orders".to_string()]));
        assert!(c.retire.is_empty(), "the old definition is unknown");
        let mut more = same.clone();
        more.insert("daily".into(), fingerprint::of_definition("{D}"));
        assert_eq!(decide("x", &a, with(&more, 1)), Gate::Wait(WaitReason::LeasesHeld), "a removed rule: its replicas stop first");
        let Gate::Commit(c) = decide("x", &a, with(&more, 0)) else { panic!() };
        assert!(c.settled());
    }
}
