//! The replica's decisions, as pure functions of what it read (leases, the shard listing, the
//! clock): where a new reader starts, which leases are lost or finished for good, which leases
//! to take. The worker loop only carries them out, so each is tested here exhaustively.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::StartPosition;
use crate::state::{Checkpoint, Lease};
use crate::stream::{Position, ShardInfo};

/// Where a reader starts. `start_position` applies only to a shard without known ancestry: a
/// child of a shard the service knows (a lease, or a parent DescribeStream lists) starts at
/// TRIM_HORIZON, or `latest` would skip the first records of every rollover and split.
pub fn initial_position(checkpoint: Option<&Checkpoint>, parent_known: bool, start: StartPosition) -> Option<Position> {
    match checkpoint {
        Some(Checkpoint::ShardEnd) => None,
        Some(Checkpoint::Sequence(s)) => Some(Position::After(s.clone())),
        Some(Checkpoint::TrimHorizon) => Some(Position::TrimHorizon),
        None if parent_known => Some(Position::TrimHorizon),
        None => Some(match start {
            StartPosition::TrimHorizon => Position::TrimHorizon,
            StartPosition::Latest => Position::Latest,
        }),
    }
}

/// Whether a reader starting at `position` with the lease at fencing `counter` follows an
/// earlier reader of the same LATEST start: a shard with no checkpoint read from LATEST, taken
/// more than once (every take advances the counter; the first makes it 1). The earlier reader's
/// LATEST was before this one's, and what came in between may be skipped (pure).
pub fn latest_taken_again(position: &Position, counter: u64) -> bool {
    *position == Position::Latest && counter > 1
}

/// Whether the service knows `lease`'s parent: it has a lease for it, or DescribeStream lists it.
pub fn parent_known(lease: &Lease, leases: &BTreeMap<String, Lease>, listed: &BTreeSet<&str>) -> bool {
    lease.parent.as_deref().is_some_and(|p| leases.contains_key(p) || listed.contains(p))
}

/// A shard drops out of DescribeStream 24 h after it closes, so only one created longer ago
/// than that can be lost; a newer one missing from a listing is eventual consistency.
pub const RETENTION_MS: u64 = 24 * 60 * 60 * 1000;
/// How long a shard must be missing from every listing before its lease counts as lost (one
/// odd DescribeStream answer is not a loss).
pub const LOST_AFTER_MS: u64 = 10 * 60 * 1000;

/// Unfinished leases whose shard DescribeStream no longer lists: records not yet applied are
/// gone (an outage longer than the retention, a parent chain stalled past 24 h). A lease is
/// lost once its shard was missing from every listing for [`LOST_AFTER_MS`] (`missing_since`:
/// when each unlisted shard was first seen missing) and, when its id carries a creation time,
/// was created more than [`RETENTION_MS`] ago.
pub fn lost_leases<'a>(
    listed: &BTreeSet<&str>,
    leases: &'a BTreeMap<String, Lease>,
    missing_since: &BTreeMap<String, u64>,
    now_ms: u64,
) -> Vec<&'a Lease> {
    leases
        .values()
        .filter(|l| !l.finished() && !listed.contains(l.shard_id.as_str()))
        .filter(|l| crate::shard_id::created_ms(&l.shard_id).is_none_or(|created| now_ms.saturating_sub(created) > RETENTION_MS))
        .filter(|l| missing_since.get(&l.shard_id).is_some_and(|t| now_ms.saturating_sub(*t) > LOST_AFTER_MS))
        .collect()
}

/// Finished leases that can be deleted: DescribeStream no longer lists the shard and every
/// child lease holds a checkpoint (the KCL's rule), so the lease scan does not grow with the
/// stream's age and a deleted lease is never created again from the listing.
pub fn deletable_leases<'a>(listed: &BTreeSet<&str>, leases: &'a BTreeMap<String, Lease>) -> Vec<&'a Lease> {
    // Parents with a child that holds no checkpoint yet (one pass: the table holds thousands).
    let waiting: BTreeSet<&str> = leases.values().filter(|c| c.checkpoint.is_none()).filter_map(|c| c.parent.as_deref()).collect();
    leases.values().filter(|l| l.finished() && !listed.contains(l.shard_id.as_str()) && !waiting.contains(l.shard_id.as_str())).collect()
}

/// The shards that may still write, as a floor plan needs them: every lease not finished, and
/// every listed shard without a lease (its lease's creation failed this round, or another
/// replica's is not seen yet). A floor must never pass a shard that has not started.
pub fn unfinished<'a>(leases: &'a BTreeMap<String, Lease>, listed: &'a [ShardInfo]) -> impl Iterator<Item = &'a str> {
    let unleased = listed.iter().filter(|s| !leases.contains_key(&s.shard_id)).map(|s| s.shard_id.as_str());
    leases.values().filter(|l| !l.finished()).map(|l| l.shard_id.as_str()).chain(unleased)
}

/// A new lease for a listed shard. A shard whose child already holds a checkpoint was read to
/// its end (its lease was deleted; an eventually consistent listing showed it again), so it
/// starts finished instead of being read twice.
pub fn new_lease(shard: &ShardInfo, leases: &BTreeMap<String, Lease>) -> Lease {
    let mut lease = Lease::new(&shard.shard_id, shard.parent.as_deref());
    if leases.values().any(|c| c.parent.as_deref() == Some(shard.shard_id.as_str()) && c.checkpoint.is_some()) {
        lease.checkpoint = Some(Checkpoint::ShardEnd);
    }
    lease
}

/// Which leases to take this round: free ready leases up to this replica's share (ready
/// shards / live replicas); with none free, one from the busiest replica above its share.
pub fn leases_to_take<'a>(
    ready: &[String],
    leases: &'a BTreeMap<String, Lease>,
    me: &str,
    running: &BTreeSet<String>,
    now_ms: u64,
) -> Vec<&'a Lease> {
    let mut owners: BTreeMap<&str, usize> = BTreeMap::new();
    owners.insert(me, 0);
    for l in ready.iter().filter_map(|id| leases.get(id)) {
        if let (Some(o), false) = (&l.owner, l.available(now_ms)) {
            *owners.entry(o.as_str()).or_default() += 1;
        }
    }
    let target = ready.len().div_ceil(owners.len().max(1));
    let free: Vec<&Lease> = ready
        .iter()
        .filter_map(|id| leases.get(id))
        .filter(|l| !running.contains(&l.shard_id) && l.available(now_ms))
        .take(target.saturating_sub(running.len()))
        .collect();
    if !free.is_empty() || running.len() >= target {
        return free;
    }
    let busiest = owners.iter().filter(|(o, _)| **o != me).max_by_key(|(_, n)| **n);
    match busiest {
        Some((victim, n)) if *n > target => ready
            .iter()
            .filter_map(|id| leases.get(id))
            .find(|l| l.owner.as_deref() == Some(*victim) && !l.available(now_ms))
            .into_iter()
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 24 * 60 * 60 * 1000;

    fn id(created: u64, n: u32) -> String {
        format!("shardId-{created:020}-{n:08x}")
    }

    fn lease(id: &str, parent: Option<&str>, cp: Option<Checkpoint>) -> Lease {
        Lease { checkpoint: cp, ..Lease::new(id, parent) }
    }

    /// A listed shard whose lease could not be created (a throttled PutItem) still holds the
    /// floor back: pruning past it would refuse every write it makes once it starts.
    #[test]
    fn a_listed_shard_without_a_lease_counts_as_unfinished() {
        let (done, open, unleased) = (id(1000, 1), id(1100, 2), id(1050, 3));
        let leases: BTreeMap<String, Lease> = [lease(&done, None, Some(Checkpoint::ShardEnd)), lease(&open, None, None)]
            .into_iter()
            .map(|l| (l.shard_id.clone(), l))
            .collect();
        let listed: Vec<ShardInfo> =
            [&done, &open, &unleased].iter().map(|s| ShardInfo { shard_id: s.to_string(), parent: None, closed: false }).collect();
        let mut got: Vec<&str> = unfinished(&leases, &listed).collect();
        got.sort_unstable();
        assert_eq!(got, vec![unleased.as_str(), open.as_str()]);
        let plan = crate::sink::ledger::floor_plan(unfinished(&leases, &listed), u64::MAX).unwrap();
        assert_eq!(plan.floor, crate::sink::ledger::floor_value(1100), "the floor stops at the open lease, keeping the unleased shard");
        assert_eq!(plan.stragglers, vec![crate::shard_id::suffix(&unleased).to_string()]);
    }

    fn map(ls: Vec<Lease>) -> BTreeMap<String, Lease> {
        ls.into_iter().map(|l| (l.shard_id.clone(), l)).collect()
    }

    #[test]
    fn latest_applies_only_to_shards_without_known_ancestry() {
        use StartPosition::*;
        let seq = Checkpoint::Sequence("7".into());
        assert_eq!(initial_position(Some(&seq), true, Latest), Some(Position::After("7".into())));
        assert_eq!(initial_position(Some(&Checkpoint::ShardEnd), false, Latest), None);
        assert_eq!(initial_position(None, true, Latest), Some(Position::TrimHorizon), "a rollover child is read from its start");
        assert_eq!(initial_position(None, false, Latest), Some(Position::Latest));
        assert!(!latest_taken_again(&Position::Latest, 1), "the first reader");
        assert!(latest_taken_again(&Position::Latest, 2), "a second reader of a LATEST start");
        assert!(!latest_taken_again(&Position::TrimHorizon, 5), "the horizon loses nothing");
        assert!(!latest_taken_again(&Position::After("7".into()), 5), "a checkpoint loses nothing");
        let horizon = Checkpoint::TrimHorizon;
        assert_eq!(
            initial_position(Some(&horizon), false, Latest),
            Some(Position::TrimHorizon),
            "a reader that started at the horizon and applied nothing"
        );
        assert_eq!(initial_position(None, false, TrimHorizon), Some(Position::TrimHorizon));

        let (p, c, orphan) = (id(1, 1), id(2, 2), id(3, 3));
        let leases = map(vec![lease(&p, None, Some(Checkpoint::ShardEnd)), lease(&c, Some(&p), None), lease(&orphan, Some("gone"), None)]);
        let none = BTreeSet::new();
        assert!(parent_known(&leases[&c], &leases, &none));
        assert!(!parent_known(&leases[&orphan], &leases, &none), "a parent trimmed long ago is unknown");
        assert!(parent_known(&leases[&orphan], &leases, &BTreeSet::from(["gone"])), "a listed parent is known");
    }

    #[test]
    fn unlisted_unfinished_old_leases_are_lost() {
        let now = 10 * DAY;
        let (old, fresh, done) = (id(now - 2 * DAY, 1), id(now - 1000, 2), id(now - 3 * DAY, 3));
        let leases = map(vec![
            lease(&old, None, Some(Checkpoint::Sequence("5".into()))),
            lease(&fresh, None, None),
            lease(&done, None, Some(Checkpoint::ShardEnd)),
            lease("odd-id", None, None),
        ]);
        let listed = BTreeSet::new();
        let long_ago = now - LOST_AFTER_MS - 1;
        let missing: BTreeMap<String, u64> = [&old, &fresh, &done].iter().map(|id| (id.to_string(), long_ago)).collect();
        let lost: Vec<&str> = lost_leases(&listed, &leases, &missing, now).iter().map(|l| l.shard_id.as_str()).collect();
        assert_eq!(lost, vec![old.as_str()], "a new shard not listed yet and a finished one are not lost");
        let just_now: BTreeMap<String, u64> = [(old.clone(), now - 1000)].into();
        assert!(lost_leases(&listed, &leases, &just_now, now).is_empty(), "one listing without it is not a loss");
        let mut with_odd = missing.clone();
        with_odd.insert("odd-id".to_string(), long_ago);
        assert_eq!(lost_leases(&listed, &leases, &with_odd, now).len(), 2, "an id without a time is lost once missing for long");
        let listed = BTreeSet::from([old.as_str()]);
        assert!(lost_leases(&listed, &leases, &missing, now).is_empty(), "listed shards are never lost");
    }

    #[test]
    fn finished_leases_go_once_unlisted_and_children_checkpointed() {
        let (p, a, b) = (id(1, 1), id(2, 2), id(3, 3));
        let mut leases = map(vec![
            lease(&p, None, Some(Checkpoint::ShardEnd)),
            lease(&a, Some(&p), Some(Checkpoint::Sequence("9".into()))),
            lease(&b, Some(&p), None),
        ]);
        let ids = |v: Vec<&Lease>| v.iter().map(|l| l.shard_id.clone()).collect::<Vec<_>>();
        assert!(deletable_leases(&BTreeSet::new(), &leases).is_empty(), "child b holds no checkpoint yet");
        leases.get_mut(&b).unwrap().checkpoint = Some(Checkpoint::Sequence("3".into()));
        assert_eq!(ids(deletable_leases(&BTreeSet::new(), &leases)), vec![p.clone()]);
        assert!(deletable_leases(&BTreeSet::from([p.as_str()]), &leases).is_empty(), "still listed");
        // Listed again after deletion: created finished, never read twice.
        leases.remove(&p);
        let again = new_lease(&ShardInfo { shard_id: p.clone(), parent: None, closed: true }, &leases);
        assert_eq!(again.checkpoint, Some(Checkpoint::ShardEnd));
        let fresh = new_lease(&ShardInfo { shard_id: id(9, 9), parent: Some(b.clone()), closed: false }, &leases);
        assert_eq!(fresh.checkpoint, None);
    }

    #[test]
    fn takes_its_share_then_balances_from_the_busiest() {
        let now = 1_000;
        let ids: Vec<String> = (0..4).map(|i| id(i, i as u32)).collect();
        let owned = |o: &str| Lease { owner: Some(o.into()), expires_at_ms: now + 10, ..Lease::new("x", None) };
        let mut leases = map(ids.iter().map(|i| Lease::new(i, None)).collect());
        let running = BTreeSet::new();
        assert_eq!(leases_to_take(&ids, &leases, "me", &running, now).len(), 4, "alone: everything");
        for i in &ids {
            leases.insert(i.clone(), Lease { shard_id: i.clone(), ..owned("other") });
        }
        let took = leases_to_take(&ids, &leases, "me", &running, now);
        assert_eq!(took.len(), 1, "one lease from the busiest replica, 4 > share 2");
        let running: BTreeSet<String> = ids[..2].iter().cloned().collect();
        for i in &ids[..2] {
            leases.insert(i.clone(), Lease { shard_id: i.clone(), ..owned("me") });
        }
        assert!(leases_to_take(&ids, &leases, "me", &running, now).is_empty(), "at its share: nothing");
        leases.insert(
            ids[3].clone(),
            Lease { shard_id: ids[3].clone(), owner: Some("other".into()), expires_at_ms: now, ..Lease::new("x", None) },
        );
        let running1: BTreeSet<String> = ids[..1].iter().cloned().collect();
        let took = leases_to_take(&ids, &leases, "me", &running1, now);
        assert_eq!(took.iter().map(|l| l.shard_id.clone()).collect::<Vec<_>>(), vec![ids[3].clone()], "an expired lease is free");
    }
}
