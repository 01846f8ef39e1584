//! "Every record created before t has been applied": the evidence reconcile needs before it
//! compares a target with the truth read at t (pure).
//!
//! A shard has applied everything created before `target_ms` (t plus the margin) when its
//! lease is finished, or it applied a record created at or after `target_ms`: neither needs an
//! assumption. Only where both are missing (an idle open shard) does the empty-page rule count:
//! its reader got `reconcile.tip_evidence` empty GetRecords pages in a row, the first called at
//! or after `target_ms` (`worker::tip`). AWS bounds no run of empty pages mid-shard, so the
//! shards judged by that rule are counted and reported. A short page is not the tip (pages
//! stop at 1 MB), and a shard DescribeStream lists without a lease has applied nothing. A
//! shard created at or after `target_ms` (its id says when) has nothing to apply.

use std::collections::{BTreeMap, HashSet};

use super::ReconcileError;
use crate::state::{Lease, LeaseStore};
use crate::stream::{ShardInfo, StreamSource};

/// A shard without the evidence, and whether a live replica holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    pub shard_id: String,
    /// The replica renewing its lease; None: nobody (no lease, or an expired one).
    pub owner: Option<String>,
}

/// What shows that a shard applied everything created before the target, strongest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Evidence {
    /// Read to its end: it holds nothing more.
    Ended,
    /// A record created at or after the target was applied, and records of a shard are in
    /// the order they were written.
    RecordAfter,
    /// The empty-page rule (`reconcile.tip_evidence`): an assumption, counted.
    EmptyPages,
}

impl Evidence {
    pub fn as_str(self) -> &'static str {
        match self {
            Evidence::Ended => "ended",
            Evidence::RecordAfter => "record_after",
            Evidence::EmptyPages => "empty_pages",
        }
    }
}

/// The evidence a lease shows that everything created before `target_ms` was applied: the
/// strongest there is, so the empty-page rule judges only a shard that has neither ended nor
/// applied a record from after the target. None: no evidence yet.
pub fn evidence(lease: &Lease, target_ms: u64) -> Option<Evidence> {
    if lease.finished() {
        Some(Evidence::Ended)
    } else if lease.last_record_ms.is_some_and(|t| t >= target_ms) {
        Some(Evidence::RecordAfter)
    } else if lease.at_tip_ms.is_some_and(|t| t >= target_ms) {
        Some(Evidence::EmptyPages)
    } else {
        None
    }
}

/// Whether a lease shows everything created before `target_ms` applied.
pub fn caught_up(lease: &Lease, target_ms: u64) -> bool {
    evidence(lease, target_ms).is_some()
}

/// The shards `behind` does not wait for that only the empty-page rule shows caught up:
/// listed shards, and unfinished leases the listing misses, created before the target.
pub fn by_empty_pages(listed: &[ShardInfo], leases: &BTreeMap<String, Lease>, target_ms: u64) -> Vec<String> {
    let younger = |id: &str| crate::shard_id::created_ms(id).is_some_and(|c| c >= target_ms);
    let listed_ids: HashSet<&str> = listed.iter().map(|s| s.shard_id.as_str()).collect();
    let unlisted = leases.keys().filter(|id| !listed_ids.contains(id.as_str()));
    let mut out: Vec<String> = listed
        .iter()
        .map(|s| &s.shard_id)
        .chain(unlisted)
        .filter(|id| !younger(id))
        .filter(|id| leases.get(id.as_str()).and_then(|l| evidence(l, target_ms)) == Some(Evidence::EmptyPages))
        .cloned()
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Every shard still behind `target_ms`: listed shards without a lease or without evidence,
/// and unfinished leases the listing misses that are younger than the stream's retention (a
/// listing can lag; an older one is lost, its records are gone, and the worker counts it).
pub fn behind(listed: &[ShardInfo], leases: &BTreeMap<String, Lease>, target_ms: u64, now_ms: u64) -> Vec<Behind> {
    let owner = |l: &Lease| l.owner.clone().filter(|_| !l.available(now_ms));
    // A shard created at or after the target holds no record created before it: with hundreds
    // of partitions a child is created every minute or so, and waiting for each new one to be
    // leased made reconcile give up.
    let younger = |id: &str| crate::shard_id::created_ms(id).is_some_and(|c| c >= target_ms);
    let mut out: Vec<Behind> = listed
        .iter()
        .filter(|s| !younger(&s.shard_id))
        .filter_map(|s| match leases.get(&s.shard_id) {
            None => Some(Behind { shard_id: s.shard_id.clone(), owner: None }),
            Some(l) if caught_up(l, target_ms) => None,
            Some(l) => Some(Behind { shard_id: s.shard_id.clone(), owner: owner(l) }),
        })
        .collect();
    out.extend(awaited_children(listed, leases, now_ms));
    // Sets, not scans: a stream of hundreds of partitions lists and leases thousands of shards.
    let listed_ids: HashSet<&str> = listed.iter().map(|s| s.shard_id.as_str()).collect();
    let unlisted =
        leases.values().filter(|l| !caught_up(l, target_ms) && !younger(&l.shard_id) && !listed_ids.contains(l.shard_id.as_str()));
    for l in unlisted {
        let lost = crate::shard_id::created_ms(&l.shard_id).is_some_and(|c| now_ms.saturating_sub(c) > crate::worker::plan::RETENTION_MS);
        if !lost {
            out.push(Behind { shard_id: l.shard_id.clone(), owner: owner(l) });
        }
    }
    out
}

/// The fence: the oldest creation time among the shards this deployment may still apply
/// (listed without a finished lease, or leased and unfinished). Every shard created before it
/// is finished, lost, or of a stream no longer followed (the table's stream was disabled and
/// enabled again), so a target item's floor may rise to it: a reader still on the old stream
/// (a paused process, a watcher that has not ticked yet) is then refused instead of applying a
/// record a correction already counted. A child not listed yet was created after a listed
/// shard (closed shards stay listed for 24 hours). None when no shard qualifies or an id
/// carries no creation time.
pub fn fence_ms(listed: &[ShardInfo], leases: &BTreeMap<String, Lease>) -> Option<u64> {
    let open_listed = listed.iter().filter(|s| leases.get(&s.shard_id).is_none_or(|l| !l.finished())).map(|s| s.shard_id.as_str());
    let open_leased = leases.values().filter(|l| !l.finished()).map(|l| l.shard_id.as_str());
    let mut fence: Option<u64> = None;
    for id in open_listed.chain(open_leased) {
        let created = crate::shard_id::created_ms(id)?;
        fence = Some(fence.map_or(created, |f| f.min(created)));
    }
    fence
}

/// How long after a shard was read to its end its children may still be missing from
/// DescribeStream (eventually consistent; seconds in practice). A closed shard always has a
/// child unless the stream was disabled, so past this reconcile stops waiting for one.
pub const CHILD_LISTING_LAG_MS: u64 = 10 * 60 * 1000;

/// How long after a shard was read to its end its children are waited for even when one is
/// listed: a split has two, and the listing may show one before the other.
pub const CHILD_SETTLE_MS: u64 = 30 * 1000;

/// Shards read to their end within [`CHILD_SETTLE_MS`], or within [`CHILD_LISTING_LAG_MS`]
/// while neither the listing nor the lease table shows a child: a child may hold records
/// created before the target that nobody applied, so reconcile waits (reported under the
/// parent's id).
fn awaited_children(listed: &[ShardInfo], leases: &BTreeMap<String, Lease>, now_ms: u64) -> Vec<Behind> {
    let parents: HashSet<&str> =
        listed.iter().filter_map(|s| s.parent.as_deref()).chain(leases.values().filter_map(|l| l.parent.as_deref())).collect();
    let has_child = |id: &str| parents.contains(id);
    let ended_ago = |l: &Lease| l.at_tip_ms.map(|t| now_ms.saturating_sub(t));
    leases
        .values()
        .filter(|l| l.finished())
        .filter(|l| match ended_ago(l) {
            Some(ago) if ago < CHILD_SETTLE_MS => true,
            Some(ago) if ago < CHILD_LISTING_LAG_MS => !has_child(&l.shard_id),
            _ => false,
        })
        .map(|l| Behind { shard_id: format!("{} (its children, not settled in the listing yet)", l.shard_id), owner: None })
        .collect()
}

/// What one look at the stream's listing and the lease table shows.
#[derive(Debug, Clone, Default)]
pub struct Standing {
    /// The shards still behind the target.
    pub behind: Vec<Behind>,
    /// The leases as read.
    pub leases: BTreeMap<String, Lease>,
    /// [`fence_ms`] of this look.
    pub fence_ms: Option<u64>,
    /// [`by_empty_pages`] of this look.
    pub by_empty_pages: Vec<String>,
}

/// Reads the stream's listing and the lease table: the shards still behind `target_ms`, the
/// leases as read, and the fence.
pub async fn standing<S: StreamSource, L: LeaseStore>(stream: &S, leases: &L, target_ms: u64) -> Result<Standing, ReconcileError> {
    let listed = stream.shards().await.map_err(|e| ReconcileError::Aws(format!("listing the stream's shards: {e}")))?;
    let leases: BTreeMap<String, Lease> = leases
        .list()
        .await
        .map_err(|e| ReconcileError::Aws(format!("reading the state table: {e}")))?
        .into_iter()
        .map(|l| (l.shard_id.clone(), l))
        .collect();
    let behind = behind(&listed, &leases, target_ms, crate::state::now_ms());
    let fence_ms = fence_ms(&listed, &leases);
    let by_empty_pages = by_empty_pages(&listed, &leases, target_ms);
    Ok(Standing { behind, leases, fence_ms, by_empty_pages })
}

/// Whether reconcile must read some shards itself: one is behind and nobody holds it.
pub fn needs_a_consumer(behind: &[Behind]) -> bool {
    behind.iter().any(|b| b.owner.is_none())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Checkpoint;

    const DAY: u64 = 24 * 60 * 60 * 1000;

    fn shard(id: &str) -> ShardInfo {
        ShardInfo { shard_id: id.into(), parent: None, closed: false }
    }

    fn lease(id: &str, f: impl FnOnce(&mut Lease)) -> (String, Lease) {
        let mut l = Lease::new(id, None);
        f(&mut l);
        (id.to_string(), l)
    }

    #[test]
    fn only_real_evidence_counts() {
        let now = 10 * DAY;
        let t = now - 1_000;
        let leases: BTreeMap<String, Lease> = [
            lease("tip", |l| l.at_tip_ms = Some(t)),
            lease("old-tip", |l| l.at_tip_ms = Some(t - 1)),
            lease("newer-record", |l| l.last_record_ms = Some(t + 5)),
            lease("done", |l| l.checkpoint = Some(Checkpoint::ShardEnd)),
            lease("held", |l| {
                l.owner = Some("r1".into());
                l.expires_at_ms = now + 5_000;
            }),
            lease("expired", |l| {
                l.owner = Some("r1".into());
                l.expires_at_ms = now - 1;
            }),
        ]
        .into();
        let listed: Vec<ShardInfo> = ["tip", "old-tip", "newer-record", "done", "held", "expired", "unleased"].map(shard).into();
        let got = behind(&listed, &leases, t, now);
        assert_eq!(
            got,
            [
                Behind { shard_id: "old-tip".into(), owner: None },
                Behind { shard_id: "held".into(), owner: Some("r1".into()) },
                Behind { shard_id: "expired".into(), owner: None },
                Behind { shard_id: "unleased".into(), owner: None },
            ]
        );
        assert!(needs_a_consumer(&got));
        assert!(!needs_a_consumer(&got[1..2]), "a live owner is waited for");
    }

    #[test]
    fn the_evidence_needing_no_assumption_comes_first() {
        let t = 10 * DAY;
        let ended = |l: &mut Lease| l.checkpoint = Some(Checkpoint::ShardEnd);
        type Case = (&'static str, fn(&mut Lease), Option<Evidence>);
        let cases: [Case; 9] = [
            ("nothing", |_| {}, None),
            ("ended", |l| l.checkpoint = Some(Checkpoint::ShardEnd), Some(Evidence::Ended)),
            (
                "ended, also empty pages",
                |l| {
                    l.checkpoint = Some(Checkpoint::ShardEnd);
                    l.at_tip_ms = Some(10 * DAY);
                },
                Some(Evidence::Ended),
            ),
            ("a record from the target on", |l| l.last_record_ms = Some(10 * DAY), Some(Evidence::RecordAfter)),
            ("a record from before the target", |l| l.last_record_ms = Some(10 * DAY - 1), None),
            (
                "a record after and empty pages after",
                |l| {
                    l.last_record_ms = Some(10 * DAY + 5);
                    l.at_tip_ms = Some(10 * DAY + 9);
                },
                Some(Evidence::RecordAfter),
            ),
            (
                "an idle shard: empty pages from the target on",
                |l| {
                    l.last_record_ms = Some(10 * DAY - 60_000);
                    l.at_tip_ms = Some(10 * DAY);
                },
                Some(Evidence::EmptyPages),
            ),
            ("empty pages from before the target", |l| l.at_tip_ms = Some(10 * DAY - 1), None),
            ("a checkpoint is no evidence", |l| l.checkpoint = Some(Checkpoint::Sequence("9".into())), None),
        ];
        for (what, f, want) in cases {
            let (_, l) = lease("s", f);
            assert_eq!(evidence(&l, t), want, "{what}");
            assert_eq!(caught_up(&l, t), want.is_some(), "{what}");
        }
        let (_, l) = lease("s", ended);
        assert_eq!(evidence(&l, u64::MAX).map(Evidence::as_str), Some("ended"));
    }

    #[test]
    fn the_shards_judged_by_empty_pages_are_named() {
        let t = 10 * DAY;
        let id = |n: u32| format!("shardId-{:020}-{n:08x}", t - DAY);
        let (idle, busy, done, unlisted, young) = (id(1), id(2), id(3), id(4), format!("shardId-{t:020}-00000005"));
        let leases: BTreeMap<String, Lease> = [
            lease(&idle, |l| l.at_tip_ms = Some(t)),
            lease(&busy, |l| {
                l.at_tip_ms = Some(t);
                l.last_record_ms = Some(t + 1);
            }),
            lease(&done, |l| {
                l.checkpoint = Some(Checkpoint::ShardEnd);
                l.at_tip_ms = Some(t - DAY); // its children long settled
            }),
            lease(&unlisted, |l| l.at_tip_ms = Some(t + 2)),
            lease(&young, |l| l.at_tip_ms = Some(t)),
        ]
        .into();
        let listed: Vec<ShardInfo> = [idle.as_str(), busy.as_str(), done.as_str(), young.as_str()].map(shard).into();
        assert_eq!(
            by_empty_pages(&listed, &leases, t),
            [idle.clone(), unlisted],
            "the idle shard and the unlisted lease; not the busy one (a record after), the ended one, or one created after the target"
        );
        assert!(behind(&listed, &leases, t, t).is_empty());
        assert!(by_empty_pages(&listed, &leases, t + 3).is_empty(), "evidence from before a later target judges nothing");
    }

    #[test]
    fn a_shard_created_after_the_target_is_not_waited_for() {
        let now = 10 * DAY;
        let target = now - 60_000;
        let older = format!("shardId-{:020}-0000000a", target - 1);
        let younger = format!("shardId-{:020}-0000000b", target);
        let listed: Vec<ShardInfo> = [older.as_str(), younger.as_str()].map(shard).into();
        let leases: BTreeMap<String, Lease> = [lease(&younger, |_| {})].into();
        let got = behind(&listed, &leases, target, now);
        assert_eq!(got, [Behind { shard_id: older, owner: None }], "a younger shard holds nothing created before the target");
    }

    #[test]
    fn the_fence_is_the_oldest_shard_that_may_still_write() {
        let id = |t: u64, n: u32| format!("shardId-{t:020}-{n:08x}");
        let finished = |l: &mut Lease| l.checkpoint = Some(Checkpoint::ShardEnd);
        let (done, open, unleased, unlisted) = (id(100, 1), id(200, 2), id(300, 3), id(150, 4));
        let listed: Vec<ShardInfo> = [done.as_str(), open.as_str(), unleased.as_str()].map(shard).into();
        let mut leases: BTreeMap<String, Lease> = [lease(&done, finished), lease(&open, |_| {})].into();
        assert_eq!(fence_ms(&listed, &leases), Some(200), "a finished shard no longer writes: the fence passes it");
        leases.extend([lease(&unlisted, |_| {})]);
        assert_eq!(fence_ms(&listed, &leases), Some(150), "an unfinished lease the listing misses still writes");
        leases.clear();
        assert_eq!(fence_ms(&listed, &leases), Some(100), "a listed shard nobody leased yet will be read");
        assert_eq!(fence_ms(&[], &BTreeMap::new()), None, "nothing known: no fence");
        let odd: Vec<ShardInfo> = vec![shard("shard-without-a-time")];
        assert_eq!(fence_ms(&odd, &BTreeMap::new()), None, "an id without a creation time: no fence");
    }

    #[test]
    fn an_unlisted_lease_waits_unless_it_is_past_the_retention() {
        let now = 10 * DAY;
        let young = format!("shardId-{:020}-0000000a", now - DAY / 2);
        let old = format!("shardId-{:020}-0000000b", now - 2 * DAY);
        let leases: BTreeMap<String, Lease> = [lease(&young, |_| {}), lease(&old, |_| {})].into();
        let got = behind(&[], &leases, now, now);
        assert_eq!(got, [Behind { shard_id: young, owner: None }], "the listing may lag; a lost shard's records are gone");
    }

    #[test]
    fn a_shard_read_to_its_end_waits_for_its_child_to_be_listed() {
        let now = 10 * DAY;
        let ended = |ago: u64| {
            move |l: &mut Lease| {
                l.checkpoint = Some(Checkpoint::ShardEnd);
                l.at_tip_ms = Some(now - ago);
            }
        };
        let minute = 60_000;
        let mut leases: BTreeMap<String, Lease> = [
            lease("p", ended(minute)),
            lease("q", ended(minute)),
            lease("r", ended(minute)),
            lease("s", ended(CHILD_LISTING_LAG_MS)),
            lease("t", ended(1_000)),
        ]
        .into();
        // q's child is listed; r's child has a lease already; p's child is not visible yet;
        // s ended long enough ago that no child is coming (the stream was disabled); t ended a
        // second ago: its one listed child may have a sibling the listing does not show yet.
        let listed = vec![
            ShardInfo { shard_id: "q1".into(), parent: Some("q".into()), closed: false },
            ShardInfo { shard_id: "t1".into(), parent: Some("t".into()), closed: false },
        ];
        leases.insert("r1".into(), Lease::new("r1", Some("r")));
        leases.get_mut("r1").unwrap().at_tip_ms = Some(now);
        let got = behind(&listed, &leases, now - 500, now);
        let names: Vec<&str> = got.iter().map(|b| b.shard_id.as_str()).collect();
        assert_eq!(
            names,
            ["q1", "t1", "p (its children, not settled in the listing yet)", "t (its children, not settled in the listing yet)"],
            "q1 and t1 are listed without a lease, r1 is at its tip, s is past the lag"
        );
    }
}
