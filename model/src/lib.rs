//! An exhaustive model of ddb-aggregator's exactly-once protocol, checked with `stateright`.
//!
//! What is modelled (DESIGN.md section 2: "Exactly once", "Shards, leases, checkpoints",
//! "Reconcile", "At production scale"), abstractly and with small bounds:
//!
//! * One target item: `value`, one ledger entry per shard (the highest sequence number applied
//!   from it), the floor `F` (a shard creation time) and the straggler set `O` (shards created
//!   before `F` that stay admitted because they were open when `F` was raised).
//! * A parent shard P (created at time 1) split into C1 and C2 (created at 2 and 3). Each shard
//!   holds 1 or 2 records with sequence numbers 1, 2; each record adds its weight (+1 unless a
//!   test says otherwise). A child is read only after P's lease is checkpointed at SHARD_END.
//! * The state table: one lease per shard with owner, fencing counter, an abstract "expired"
//!   bit and the checkpoint.
//! * Two replicas. A replica may hold several leases, with one reader per leased shard. Every
//!   step of a reader is a separate model step (take, read a batch, write it, checkpoint), so a
//!   crash (all local memory lost) or a pause (the replica does not act while others do, then
//!   acts with its stale memory) can fall between any two. `Expire` makes a lease takeable
//!   while its owner still believes it holds it: that, plus interleaving, is the pause.
//! * Writes to the item are the conditional ledger writes. A write may also prune: remove
//!   entries of finished shards, raise `F` and set `O`, computed from a possibly stale view of
//!   the lease table, compare-and-set on the `(F, O)` it was computed from.
//! * Every ledger write advances the item's write counter `V`. Reconcile, as the code does it:
//!   (1) reads `V`; (2) reads the truth (the records produced so far); (3) waits until every
//!   shard's checkpoint covers the records that existed at (2); (4) reads the item and retries
//!   if `V` moved since (1); (5) writes `value := truth` (advancing `V`) conditioned on `V`
//!   still being as read in (1). An external corruption (+1 on the value) gives it something to
//!   repair.
//!
//! Ghost state (not part of the system, only for the properties) counts how often each
//! record's effect reached the item, the drift injected by corruption, and what was fenced.
//!
//! Seeded bugs ([`Bugs`]) switch single rules off, so the tests show the checker finds the
//! failure each rule prevents.
//!
//! A rule definition change during a rolling deploy (old and new replicas side by side, two
//! target items, a generation in the state table, a rebuild) is a separate model:
//! [`definitions`].
//!
//! Correcting a target written all the time (a hold its writers log under) is a third:
//! [`hold`].
//!
//! Helper measures packed in the target, written by a compare-and-swap on a cached image, is a
//! fourth: [`packed`]; the counts moving out of the target into helper items, and targets
//! written before packing existed, a fifth: [`spill`].

use stateright::{Model, Property};

pub mod check;
pub mod definitions;
pub mod hold;
pub mod packed;
pub mod spill;

/// Shards: P = 0, C1 = 1, C2 = 2.
pub const SHARDS: usize = 3;
pub const P: usize = 0;
pub const C1: usize = 1;
pub const C2: usize = 2;
/// Replicas running the service.
pub const REPLICAS: usize = 2;
/// Records per shard at most (sequence numbers 1..=MAX_RECORDS).
pub const MAX_RECORDS: usize = 2;

/// A set of shards as bits (bit s = shard s).
pub type Set = u8;

fn bit(s: usize) -> Set {
    1 << s
}

fn has(set: Set, s: usize) -> bool {
    set & bit(s) != 0
}

fn set_of(f: impl Fn(usize) -> bool) -> Set {
    (0..SHARDS).filter(|&s| f(s)).fold(0, |a, s| a | bit(s))
}

/// A shard's creation time; shard ids embed it, and a floor is one of these. P = 1, C1 = 2,
/// C2 = 3; 0 means "no floor".
pub fn created(s: usize) -> u8 {
    s as u8 + 1
}

/// The parent whose SHARD_END a shard waits for.
pub fn parent(s: usize) -> Option<usize> {
    (s != P).then_some(P)
}

/// The floor part of a write's condition: `F` absent (0), the shard created at or after `F`,
/// or a straggler. A shard outside it may have had its entry pruned, so its writes are
/// refused: the ledger could no longer recognise a replay.
pub fn admitted(floor: u8, stragglers: Set, s: usize) -> bool {
    created(s) >= floor || has(stragglers, s)
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Checkpoint {
    None,
    /// Every record up to and including this sequence number is applied.
    At(u8),
    /// The shard is closed and every record of it is applied. Final.
    End,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Lease {
    pub owner: Option<u8>,
    /// Fencing token: incremented by every take; checkpoints are conditional on it.
    pub counter: u8,
    /// The owner did not renew in time: another replica may take the lease. The owner need
    /// not know (it is paused) and may still act on what it has in memory.
    pub expired: bool,
    pub checkpoint: Checkpoint,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Item {
    pub value: i8,
    /// Ledger: entry[s] = highest sequence number applied from shard s; 0 = absent (sequence
    /// numbers start at 1, so "absent or below first" is "below first").
    pub entry: [u8; SHARDS],
    /// The floor `F`; 0 = absent.
    pub floor: u8,
    /// The straggler set `O`.
    pub stragglers: Set,
    /// The write counter `V` (`_aggv:<namespace>`): every ledger write and correction adds 1.
    pub version: u8,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Read into memory, not yet (fully) in the item.
    Read,
    /// Every record of it is in the item (or was found applied already): may checkpoint.
    Written,
    /// Seeded bug (d) only: checkpointed before it was written.
    CheckpointedUnwritten,
}

/// Records first..=last of the reader's shard, held in a replica's memory. `first` moves up
/// when a write finds some of them applied already.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Batch {
    pub first: u8,
    pub last: u8,
    pub phase: Phase,
}

/// What a replica believes about one shard it leased.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Reader {
    /// The lease counter it took the lease with.
    pub counter: u8,
    /// Its position: the checkpoint it took the lease at, advanced by its own checkpoints.
    pub pos: u8,
    pub batch: Option<Batch>,
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Replica {
    pub readers: [Option<Reader>; SHARDS],
    /// `(F, O)` as in the item's last response to this replica (ALL_NEW after a write,
    /// ReturnValuesOnConditionCheckFailure after a refused one). Kept only for seeded bug (e):
    /// with the compare-and-set, a pruning write computed from anything but the item's current
    /// `(F, O)` is refused and only refreshes this copy, so the model starts pruning writes
    /// from the current `(F, O)` and keeps no copy (fewer states, same behaviours).
    pub seen: Option<(u8, Set)>,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Recon {
    Idle,
    /// (1) The write counter as read before the truth.
    Snapshot {
        version: u8,
    },
    /// (2) Truth read at time t: `at_t` = records that existed at t, per shard. `version`:
    /// the counter of (1) (None only under seeded bug (i), which reads it after the truth).
    Truth {
        version: Option<u8>,
        truth: i8,
        at_t: [u8; SHARDS],
    },
    /// (3) Every checkpoint covers `at_t`.
    Caught {
        version: u8,
        truth: i8,
    },
    /// (4) Item read: its counter had not moved since (1).
    ItemRead {
        truth: i8,
        version: u8,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    /// Records per shard (fixed per initial state).
    pub n: [u8; SHARDS],
    /// Records in the stream so far.
    pub produced: [u8; SHARDS],
    pub leases: [Lease; SHARDS],
    pub item: Item,
    pub replicas: [Replica; REPLICAS],
    pub recon: Recon,
    pub crashes_left: u8,
    pub expiries_left: u8,
    pub corruptions_left: u8,
    pub recon_writes_left: u8,
    // Ghost state.
    /// applied[s][k-1]: how many times record k of shard s reached the item (saturates at 2).
    pub applied: [[u8; MAX_RECORDS]; SHARDS],
    /// value - (weights of the applied records): added by corruption, zeroed by reconcile.
    pub drift: i8,
    pub fenced_finished: bool,
    pub fenced_unfinished: bool,
    pub recon_worse: bool,
    pub recon_repaired: bool,
}

/// A pruning write's extra: the view (finished shards as the replica saw them), the new floor
/// `F'` and stragglers `O'`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Prune {
    /// Shards finished in the view.
    pub view: Set,
    /// Shards the view counts as open (see [`Listing`]).
    pub open: Set,
    pub floor: u8,
    pub keep: Set,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    /// The source table changes: the next record of shard s appears in the stream.
    Produce(usize),
    /// Replica r takes the available lease of shard s (conditional on the counter it read).
    Take(usize, usize),
    /// Replica r's renewal of shard s fails (somebody took it): the reader stops.
    LoseLease(usize, usize),
    /// Replica r reads records pos+1..=last of shard s into memory.
    Read {
        r: usize,
        s: usize,
        last: u8,
    },
    /// Replica r writes its batch of shard s, maybe pruning.
    Write {
        r: usize,
        s: usize,
        prune: Option<Prune>,
    },
    /// Replica r checkpoints its written batch of shard s.
    Checkpoint(usize, usize),
    /// Replica r loses all its memory; its leases stay in the table until they expire.
    Crash(usize),
    /// Lease s expires (its owner is paused, or cannot reach the table).
    Expire(usize),
    /// Somebody changes the item's value behind the service's back.
    Corrupt,
    ReconSnapshot,
    ReconTruth,
    ReconWait,
    ReconItem,
    ReconWrite,
}

/// Seeded bugs: each switches one rule of the protocol off.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bugs {
    /// (a) Pruning without the floor condition: writes check the ledger entry only.
    pub no_floor_check: bool,
    /// (b) `O'` taken from the (stale) view alone, not constrained to the admitted set.
    pub stragglers_unconstrained: bool,
    /// (c) A batch whose deltas cancel out is not written (no ledger-only write).
    pub skip_zero_writes: bool,
    /// (d) Checkpoint before the write.
    pub checkpoint_before_write: bool,
    /// (e) Pruning writes are not compare-and-set on the `(F, O)` they were computed from.
    pub no_cas: bool,
    /// (f) `F'` may be below the current floor.
    pub floor_may_drop: bool,
    /// (g) `O'` may leave out shards that are open in the view.
    pub stragglers_incomplete: bool,
    /// (h) Reconcile writes without the counter condition.
    pub recon_unconditional: bool,
    /// (i) Reconcile reads the counter after the truth instead of before it.
    pub recon_late_snapshot: bool,
    /// (k) Reconcile does not wait for the checkpoints to cover its truth (`--no-wait` with a
    /// live consumer).
    pub recon_no_wait: bool,
    /// (l) With [`ProtocolModel::time_tokens`]: pruning keeps the entries of the straggler
    /// shards only, not of every shard their times admit.
    pub prune_by_shard: bool,
    /// (m) With [`ProtocolModel::ids_for_shared_times`]: a straggler the item admits by its id
    /// only may go back to being admitted by its creation time.
    pub id_back_to_time: bool,
}

/// Which shards a pruning replica's view of the lease table lists (and so can count as open).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Listing {
    /// The rule the model checks: a shard not known finished counts as open, listed or not;
    /// `F'` is any creation time at or above `F`.
    #[default]
    NotFinishedIsOpen,
    /// The code's floor plan (`ledger::floor_plan` over the replica's lease map): open = listed
    /// and not finished, `F'` = the creation time of a listed open shard, where the listing may
    /// miss any lease (a paginated scan, leases created by another replica in any order).
    ListedAnySubset,
    /// As `ListedAnySubset`, but a listing that shows a shard also shows every shard created
    /// before it (leases created, and seen, in creation order).
    ListedCreationPrefix,
}

/// The model and its bounds.
#[derive(Clone, Debug)]
pub struct ProtocolModel {
    /// Records per shard (P, C1, C2), 1 or 2 each: one initial state per shape.
    pub shapes: Vec<[u8; SHARDS]>,
    /// Each record's contribution: weights[s][k-1].
    pub weights: [[i8; MAX_RECORDS]; SHARDS],
    /// Crashes in a run, over both replicas.
    pub crashes: u8,
    /// Lease expiries in a run: each lets a paused (or crashed) owner's lease be taken.
    pub expiries: u8,
    /// Records appear one by one while the replicas run; otherwise the stream is complete
    /// from the start (children are still read only after the parent's SHARD_END).
    pub dynamic_production: bool,
    pub pruning: bool,
    pub corruption: bool,
    pub reconcile: bool,
    /// Identify states that differ only by swapping the two replicas (halves the states;
    /// counterexample traces then may swap replica numbers between steps).
    pub symmetry: bool,
    pub listing: Listing,
    /// The straggler set as the code keeps it since compact entries: creation times, not
    /// shards; and the split's children C1 and C2 created in the same millisecond (both at 2),
    /// so one token admits both. Pruning then removes an entry only for a time that neither
    /// `F'` nor `O'` admits, and `F'` may go above both children (3).
    pub time_tokens: bool,
    /// With [`ProtocolModel::time_tokens`]: a straggler may also be admitted by its id (the
    /// code does so for a creation time whose finished shards' entries outnumber its open
    /// ones, so those entries can go). The set then holds time tokens in bits 0 to 2 and id
    /// tokens in bits 3 to 5 ([`id_token`]). A straggler the item admits by floor or time may
    /// be kept either way; one it admits by id only stays by id, since its time could
    /// re-admit a sibling whose entry went.
    pub ids_for_shared_times: bool,
    pub bugs: Bugs,
}

/// The bit of shard `s`'s id token in a straggler set (see [`ProtocolModel::ids_for_shared_times`]).
pub fn id_token(s: usize) -> Set {
    bit(s + SHARDS)
}

impl Default for ProtocolModel {
    fn default() -> Self {
        ProtocolModel {
            shapes: vec![[2, 2, 2]],
            weights: [[1; MAX_RECORDS]; SHARDS],
            crashes: 1,
            expiries: 1,
            dynamic_production: false,
            pruning: true,
            corruption: false,
            reconcile: false,
            symmetry: false,
            listing: Listing::NotFinishedIsOpen,
            time_tokens: false,
            ids_for_shared_times: false,
            bugs: Bugs::default(),
        }
    }
}

/// Every shape with 1 or 2 records per shard.
pub fn all_shapes() -> Vec<[u8; SHARDS]> {
    let mut v = Vec::new();
    for p in 1..=2 {
        for c1 in 1..=2 {
            for c2 in 1..=2 {
                v.push([p, c1, c2]);
            }
        }
    }
    v
}

/// Property names.
pub mod names {
    pub const NO_DOUBLE_APPLY: &str = "no record applied twice";
    pub const VALUE_MATCHES: &str = "value = applied records + injected drift";
    pub const FINISHED_MEANS_APPLIED: &str = "a shard at SHARD_END has every record applied";
    pub const QUIESCENT_EXACTLY_ONCE: &str = "quiescent => every record applied exactly once";
    pub const QUIESCENT_VALUE: &str = "quiescent => value exact (up to unrepaired drift)";
    pub const FENCED_ONLY_IF_FINISHED: &str = "fenced only if finished";
    pub const RECON_NEVER_WORSE: &str = "reconcile never makes drift worse";
    pub const EX_PRUNED: &str = "example: P's entry pruned and the floor raised";
    pub const EX_STRAGGLER: &str = "example: a straggler admitted below the floor";
    pub const EX_FENCED: &str = "example: a stale write fenced by the floor";
    pub const EX_BY_ID: &str = "example: a straggler kept by id, its sibling of one millisecond pruned";
    pub const EX_DONE: &str = "example: every shard at SHARD_END";
    pub const EX_REPAIRED: &str = "example: reconcile repaired injected drift, everything read";
}

impl ProtocolModel {
    fn weight(&self, s: usize, k: u8) -> i8 {
        self.weights[s][k as usize - 1]
    }

    fn weight_sum(&self, s: usize, first: u8, last: u8) -> i8 {
        (first..=last).map(|k| self.weight(s, k)).sum()
    }

    /// Weights of the records applied, with multiplicity.
    pub fn applied_weight(&self, st: &State) -> i8 {
        (0..SHARDS)
            .flat_map(|s| (1..=st.n[s]).map(move |k| (s, k)))
            .map(|(s, k)| self.weight(s, k) * st.applied[s][k as usize - 1] as i8)
            .sum()
    }

    pub fn total_weight(&self, st: &State) -> i8 {
        (0..SHARDS).map(|s| self.weight_sum(s, 1, st.n[s])).sum()
    }

    fn produced_weight(&self, st: &State) -> i8 {
        (0..SHARDS).map(|s| self.weight_sum(s, 1, st.produced[s])).sum()
    }

    /// A shard's creation time in this model (C2 shares C1's with [`ProtocolModel::time_tokens`]).
    pub fn created_at(&self, s: usize) -> u8 {
        if self.time_tokens && s == C2 {
            created(C1)
        } else {
            created(s)
        }
    }

    /// [`admitted`], with the straggler set read as creation times when tokens are times.
    pub fn admits(&self, floor: u8, stragglers: Set, s: usize) -> bool {
        if !self.time_tokens {
            return admitted(floor, stragglers, s);
        }
        self.admits_by_time(floor, stragglers, s) || stragglers & id_token(s) != 0
    }

    /// Whether the item admits shard `s` by the floor or by a time token (not by its id).
    fn admits_by_time(&self, floor: u8, stragglers: Set, s: usize) -> bool {
        self.created_at(s) >= floor || (0..SHARDS).any(|t| has(stragglers, t) && self.created_at(t) == self.created_at(s))
    }

    /// Whether a pruning write to `F'` with stragglers `keep` still admits shard `t`'s time.
    fn kept(&self, keep: Set, floor: u8, t: usize) -> bool {
        if self.bugs.prune_by_shard {
            return has(keep, t) || keep & id_token(t) != 0;
        }
        self.admits(floor, keep, t)
    }

    /// The pruning writes replica `r` may send for shard `s`.
    ///
    /// The view's finished set is any subset of the shards finished now (never the writer's
    /// own shard): a lease-table scan is paginated and may be arbitrarily old (a paused
    /// replica), but SHARD_END is final, so a shard it shows finished is finished. Which shards
    /// count as open depends on [`Listing`]. `(F, O)` are the item's current ones (see
    /// [`Replica::seen`]).
    fn prune_choices(&self, st: &State, r: usize, s: usize, out: &mut Vec<Prune>) {
        let (floor, stragglers) = match (self.bugs.no_cas, st.replicas[r].seen) {
            (false, _) => (st.item.floor, st.item.stragglers),
            (true, Some(seen)) => seen,
            (true, None) => return,
        };
        let finished = set_of(|t| st.leases[t].checkpoint == Checkpoint::End);
        // F' >= F: lowering the floor would re-admit pruned shards.
        let lowest = if self.bugs.floor_may_drop { 2 } else { floor.max(2) };
        let all = set_of(|_| true);
        let listings: Vec<Set> = match self.listing {
            Listing::NotFinishedIsOpen => vec![all],
            Listing::ListedAnySubset => (0..=all).filter(|l| has(*l, s)).collect(),
            Listing::ListedCreationPrefix => (0..SHARDS).map(|t| set_of(|u| u <= t)).filter(|l| has(*l, s)).collect(),
        };
        for listed in listings {
            for view in (0..=finished & listed).filter(|v| v & !(finished & listed) == 0 && !has(*v, s)) {
                let unfinished = listed & !view;
                let floors: Vec<u8> = match self.listing {
                    Listing::NotFinishedIsOpen => (lowest..=created(SHARDS - 1)).collect(),
                    _ => (0..SHARDS).filter(|&t| has(unfinished, t)).map(|t| self.created_at(t)).filter(|&f| f >= lowest).collect(),
                };
                for new_floor in floors {
                    self.push_prunes(st, (floor, stragglers), view, unfinished, new_floor, out);
                }
            }
        }
    }

    /// The pruning writes for one view (finished shards, and the shards it counts as open)
    /// and `F'`, from the item's `(F, O)` as the writer knows them.
    fn push_prunes(&self, st: &State, (floor, stragglers): (u8, Set), view: Set, unfinished: Set, new_floor: u8, out: &mut Vec<Prune>) {
        // Shards the item admits: O' keeps shards from this set only, so no view, however
        // stale, re-admits a shard whose entry is (or may be) pruned.
        let admitted_now = set_of(|t| self.admits(floor, stragglers, t));
        let below = set_of(|t| self.created_at(t) < new_floor);
        // Every shard created before F' that is open in the view (and admitted) stays admitted
        // as a straggler: leaving one out would fence an unfinished shard.
        let keep = if self.bugs.stragglers_unconstrained { unfinished & below } else { admitted_now & unfinished & below };
        let subsets = if self.bugs.stragglers_incomplete { keep } else { 0 };
        for drop in (0..=subsets).filter(|d| d & !subsets == 0) {
            for keep in self.token_choices(keep & !drop, (floor, stragglers)) {
                // Skip writes that change nothing beyond a plain write.
                let pruned = set_of(|t| has(view & below, t) && !self.kept(keep, new_floor, t));
                let prunes_entry = (0..SHARDS).any(|t| has(pruned, t) && st.item.entry[t] != 0);
                if (new_floor, keep) != (st.item.floor, st.item.stragglers) || prunes_entry {
                    out.push(Prune { view, open: unfinished, floor: new_floor, keep });
                }
            }
        }
    }

    /// The straggler sets that keep the shards `keep`: each by a time token, or (with
    /// [`ProtocolModel::ids_for_shared_times`]) by its id; by time only if the item admits
    /// it by floor or time now (bug (m): also if only by id).
    fn token_choices(&self, keep: Set, (floor, stragglers): (u8, Set)) -> Vec<Set> {
        if !self.ids_for_shared_times {
            return vec![keep];
        }
        let mut out = vec![0];
        for t in (0..SHARDS).filter(|&t| has(keep, t)) {
            let by_time = self.bugs.id_back_to_time || self.admits_by_time(floor, stragglers, t);
            out = out.iter().flat_map(|o| [Some(o | id_token(t)), by_time.then_some(o | bit(t))]).flatten().collect();
        }
        out
    }

    fn all_applied(st: &State, s: usize) -> bool {
        (1..=st.n[s]).all(|k| st.applied[s][k as usize - 1] >= 1)
    }

    /// Evidence that every record that existed at `at_t` is applied: each checkpoint covers it.
    fn covers(st: &State, at_t: [u8; SHARDS]) -> bool {
        (0..SHARDS).all(|s| match st.leases[s].checkpoint {
            Checkpoint::End => true,
            Checkpoint::At(c) => c >= at_t[s],
            Checkpoint::None => at_t[s] == 0,
        })
    }

    /// Everything in the reader's batch is in the item.
    fn settle(st: &mut State, r: usize, s: usize) {
        let reader = st.replicas[r].readers[s].as_mut().expect("reader");
        let batch = reader.batch.as_mut().expect("batch");
        match batch.phase {
            Phase::Read => batch.phase = Phase::Written,
            Phase::CheckpointedUnwritten => {
                reader.batch = None;
                if reader.pos == st.n[s] {
                    st.replicas[r].readers[s] = None;
                }
            }
            Phase::Written => unreachable!("a written batch is not written again"),
        }
    }

    /// Puts the replica with the smaller memory first (renaming lease owners to match).
    fn canonical(st: &mut State) {
        if st.replicas[1] < st.replicas[0] {
            st.replicas.swap(0, 1);
            for lease in &mut st.leases {
                lease.owner = lease.owner.map(|o| 1 - o);
            }
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        self.shapes
            .iter()
            .map(|&n| State {
                n,
                produced: if self.dynamic_production { [0; SHARDS] } else { n },
                leases: [Lease { owner: None, counter: 0, expired: false, checkpoint: Checkpoint::None }; SHARDS],
                item: Item { value: 0, entry: [0; SHARDS], floor: 0, stragglers: 0, version: 0 },
                replicas: [Replica::default(); REPLICAS],
                recon: Recon::Idle,
                crashes_left: self.crashes,
                expiries_left: self.expiries,
                corruptions_left: u8::from(self.corruption),
                recon_writes_left: u8::from(self.reconcile),
                applied: [[0; MAX_RECORDS]; SHARDS],
                drift: 0,
                fenced_finished: false,
                fenced_unfinished: false,
                recon_worse: false,
                recon_repaired: false,
            })
            .collect()
    }

    fn actions(&self, st: &State, actions: &mut Vec<Action>) {
        for s in 0..SHARDS {
            // Children get records only after the parent closed (the split).
            if st.produced[s] < st.n[s] && parent(s).is_none_or(|p| st.produced[p] == st.n[p]) {
                actions.push(Action::Produce(s));
            }
            let lease = &st.leases[s];
            if st.expiries_left > 0 && lease.owner.is_some() && !lease.expired {
                actions.push(Action::Expire(s));
            }
        }
        let mut prunes = Vec::new();
        for r in 0..REPLICAS {
            let rep = &st.replicas[r];
            for s in 0..SHARDS {
                let lease = &st.leases[s];
                let Some(reader) = &rep.readers[s] else {
                    // Take: free or expired, not finished, and the parent at SHARD_END.
                    if (lease.owner.is_none() || lease.expired)
                        && lease.checkpoint != Checkpoint::End
                        && parent(s).is_none_or(|p| st.leases[p].checkpoint == Checkpoint::End)
                    {
                        actions.push(Action::Take(r, s));
                    }
                    continue;
                };
                if lease.owner != Some(r as u8) || lease.counter != reader.counter {
                    actions.push(Action::LoseLease(r, s));
                }
                match reader.batch {
                    None => {
                        for last in reader.pos + 1..=st.produced[s] {
                            actions.push(Action::Read { r, s, last });
                        }
                    }
                    Some(b) => {
                        if b.phase != Phase::Written {
                            actions.push(Action::Write { r, s, prune: None });
                            if self.pruning {
                                prunes.clear();
                                self.prune_choices(st, r, s, &mut prunes);
                                actions.extend(prunes.iter().map(|&p| Action::Write { r, s, prune: Some(p) }));
                            }
                        }
                        if b.phase == Phase::Written || (self.bugs.checkpoint_before_write && b.phase == Phase::Read) {
                            actions.push(Action::Checkpoint(r, s));
                        }
                    }
                }
            }
            if st.crashes_left > 0 && *rep != Replica::default() {
                actions.push(Action::Crash(r));
            }
        }
        if st.corruptions_left > 0 {
            actions.push(Action::Corrupt);
        }
        match st.recon {
            Recon::Idle if st.recon_writes_left > 0 && self.bugs.recon_late_snapshot => actions.push(Action::ReconTruth),
            Recon::Idle if st.recon_writes_left > 0 => actions.push(Action::ReconSnapshot),
            Recon::Idle => {}
            Recon::Snapshot { .. } => actions.push(Action::ReconTruth),
            Recon::Truth { version: None, .. } => actions.push(Action::ReconSnapshot),
            // The wait: evidence that every record created before the truth read is applied.
            Recon::Truth { at_t, .. } if self.bugs.recon_no_wait || Self::covers(st, at_t) => actions.push(Action::ReconWait),
            Recon::Truth { .. } => {}
            Recon::Caught { .. } => actions.push(Action::ReconItem),
            Recon::ItemRead { .. } => actions.push(Action::ReconWrite),
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut st = last.clone();
        match action {
            Action::Produce(s) => st.produced[s] += 1,
            Action::Expire(s) => {
                st.leases[s].expired = true;
                st.expiries_left -= 1;
            }
            Action::Take(r, s) => {
                let lease = &mut st.leases[s];
                lease.owner = Some(r as u8);
                lease.counter += 1;
                lease.expired = false;
                let pos = match lease.checkpoint {
                    Checkpoint::None => 0,
                    Checkpoint::At(c) => c,
                    Checkpoint::End => unreachable!("finished leases are not taken"),
                };
                st.replicas[r].readers[s] = Some(Reader { counter: lease.counter, pos, batch: None });
            }
            Action::LoseLease(r, s) => st.replicas[r].readers[s] = None,
            Action::Read { r, s, last } => {
                let reader = st.replicas[r].readers[s].as_mut().expect("reader");
                reader.batch = Some(Batch { first: reader.pos + 1, last, phase: Phase::Read });
            }
            Action::Write { r, s, prune } => self.write(&mut st, r, s, prune),
            Action::Checkpoint(r, s) => {
                let reader = st.replicas[r].readers[s].expect("reader");
                let b = reader.batch.expect("batch");
                let lease = &mut st.leases[s];
                // Conditional on owner and counter: a replica that lost the lease cannot move
                // the checkpoint (it forgets the lease instead).
                if lease.owner == Some(r as u8) && lease.counter == reader.counter {
                    let end = b.last == st.n[s];
                    lease.checkpoint = if end { Checkpoint::End } else { Checkpoint::At(b.last) };
                    if end {
                        // Finished: released, and never taken again.
                        lease.owner = None;
                        lease.expired = false;
                    }
                    let reader = st.replicas[r].readers[s].as_mut().expect("reader");
                    reader.pos = b.last;
                    if b.phase == Phase::Read {
                        // Bug (d): the write is still to come.
                        reader.batch.as_mut().expect("batch").phase = Phase::CheckpointedUnwritten;
                    } else {
                        reader.batch = None;
                        if end {
                            st.replicas[r].readers[s] = None;
                        }
                    }
                } else {
                    st.replicas[r].readers[s] = None;
                }
            }
            Action::Crash(r) => {
                st.replicas[r] = Replica::default();
                st.crashes_left -= 1;
            }
            Action::Corrupt => {
                st.item.value += 1;
                st.drift += 1;
                st.corruptions_left -= 1;
            }
            Action::ReconSnapshot => {
                st.recon = match st.recon {
                    Recon::Truth { version: None, truth, at_t } => Recon::Truth { version: Some(st.item.version), truth, at_t },
                    _ => Recon::Snapshot { version: st.item.version },
                }
            }
            Action::ReconTruth => {
                let version = match st.recon {
                    Recon::Snapshot { version } => Some(version),
                    _ => None,
                };
                st.recon = Recon::Truth { version, truth: self.produced_weight(&st), at_t: st.produced };
            }
            Action::ReconWait => {
                let Recon::Truth { version: Some(version), truth, .. } = st.recon else { unreachable!("wait before truth read") };
                st.recon = Recon::Caught { version, truth };
            }
            Action::ReconItem => {
                let Recon::Caught { version, truth } = st.recon else { unreachable!("item read before the wait") };
                // A write landed since (1): the item may hold a record the truth did not see.
                st.recon = if st.item.version != version { Recon::Idle } else { Recon::ItemRead { truth, version } };
            }
            Action::ReconWrite => {
                let Recon::ItemRead { truth, version } = st.recon else { unreachable!("write before item read") };
                st.recon = Recon::Idle;
                // Conditioned on the counter being as read in (1): no stream write landed since.
                if st.item.version == version || self.bugs.recon_unconditional {
                    st.item.version = st.item.version.wrapping_add(1);
                    let applied = self.applied_weight(&st);
                    if (truth - applied).abs() > (st.item.value - applied).abs() {
                        st.recon_worse = true;
                    }
                    st.recon_repaired |= st.drift != 0;
                    st.item.value = truth;
                    // Reconcile claims the value is exact now: VALUE_MATCHES checks the claim.
                    st.drift = 0;
                    st.recon_writes_left -= 1;
                }
            }
        }
        if self.symmetry {
            Self::canonical(&mut st);
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut v = vec![
            Property::always(names::NO_DOUBLE_APPLY, |_, st: &State| st.applied.iter().flatten().all(|&c| c <= 1)),
            Property::always(names::VALUE_MATCHES, |m: &Self, st: &State| st.item.value == m.applied_weight(st) + st.drift),
            // Pruning and reconcile take SHARD_END as proof that a shard is fully applied.
            Property::always(names::FINISHED_MEANS_APPLIED, |_, st: &State| {
                (0..SHARDS).all(|s| st.leases[s].checkpoint != Checkpoint::End || Self::all_applied(st, s))
            }),
            Property::always(names::QUIESCENT_EXACTLY_ONCE, |_, st: &State| {
                !quiescent(st) || (0..SHARDS).all(|s| (1..=st.n[s]).all(|k| st.applied[s][k as usize - 1] == 1))
            }),
            Property::always(names::QUIESCENT_VALUE, |m: &Self, st: &State| {
                !quiescent(st) || st.item.value - st.drift == m.total_weight(st)
            }),
            Property::always(names::FENCED_ONLY_IF_FINISHED, |_, st: &State| !st.fenced_unfinished),
            Property::always(names::RECON_NEVER_WORSE, |_, st: &State| !st.recon_worse),
            Property::sometimes(names::EX_DONE, |_, st: &State| all_finished(st)),
        ];
        if self.pruning {
            v.push(Property::sometimes(names::EX_PRUNED, |_, st: &State| {
                st.item.floor >= 2 && st.item.entry[P] == 0 && st.applied[P][0] > 0
            }));
            v.push(Property::sometimes(names::EX_STRAGGLER, |_, st: &State| st.item.stragglers != 0));
            v.push(Property::sometimes(names::EX_FENCED, |_, st: &State| st.fenced_finished));
        }
        if self.pruning && self.ids_for_shared_times {
            // C1 and C2 share a creation time: one listed by id, the other's entry pruned.
            v.push(Property::sometimes(names::EX_BY_ID, |_, st: &State| {
                let by_id = |s: usize| st.item.stragglers & id_token(s) != 0 && st.item.stragglers & (bit(C1) | bit(C2)) == 0;
                (by_id(C1) && st.item.entry[C2] == 0 && st.applied[C2][0] > 0)
                    || (by_id(C2) && st.item.entry[C1] == 0 && st.applied[C1][0] > 0)
            }));
        }
        if self.reconcile && self.corruption {
            v.push(Property::sometimes(names::EX_REPAIRED, |_, st: &State| st.recon_repaired && all_finished(st)));
        }
        v
    }
}

impl ProtocolModel {
    /// The conditional ledger write (UpdateItem with a condition expression).
    fn write(&self, st: &mut State, r: usize, s: usize, prune: Option<Prune>) {
        let b = st.replicas[r].readers[s].expect("reader").batch.expect("batch");
        if self.bugs.skip_zero_writes && self.weight_sum(s, b.first, b.last) == 0 {
            // Bug (c): nothing to add, so no write; the entry does not advance.
            Self::settle(st, r, s);
            return;
        }
        let item = st.item;
        // The floor part: refuses shards whose entries may be pruned.
        let floor_ok = self.bugs.no_floor_check || self.admits(item.floor, item.stragglers, s);
        // The ledger part: no record of the write is applied yet.
        let entry_ok = item.entry[s] < b.first;
        // A pruning write is compare-and-set on the (F, O) it was computed from: if they
        // changed since, its O' could re-admit a shard pruned meanwhile. The model computes
        // it from the current (F, O), so the compare-and-set holds: the refused case changes
        // nothing but the replica's copy of (F, O).
        // Bug (e): computed from `seen`, and the write only requires F <= F' (what the code
        // does today).
        let cas_ok = match prune {
            Some(p) if self.bugs.no_cas => item.floor <= p.floor,
            _ => true,
        };
        if floor_ok && entry_ok && cas_ok {
            for k in b.first..=b.last {
                let c = &mut st.applied[s][k as usize - 1];
                *c = (*c + 1).min(2);
                st.item.value += self.weight(s, k);
            }
            st.item.entry[s] = b.last;
            st.item.version = st.item.version.wrapping_add(1);
            if let Some(p) = prune {
                // Remove entries only of shards finished in the view, created before F', not
                // kept as stragglers (never the writer's own entry).
                for t in 0..SHARDS {
                    if t != s && has(p.view, t) && !self.kept(p.keep, p.floor, t) && self.created_at(t) < p.floor {
                        st.item.entry[t] = 0;
                    }
                }
                st.item.floor = p.floor;
                st.item.stragglers = p.keep;
            }
            if self.bugs.no_cas {
                st.replicas[r].seen = Some((st.item.floor, st.item.stragglers));
            }
            Self::settle(st, r, s);
            return;
        }
        // The refused write returns the item as it is.
        if self.bugs.no_cas {
            st.replicas[r].seen = Some((item.floor, item.stragglers));
        }
        if !floor_ok {
            // Fenced: the shard is below the floor. Only a replay of a finished shard may be
            // refused so; otherwise its records are lost (the service alerts).
            if Self::all_applied(st, s) {
                st.fenced_finished = true;
            } else {
                st.fenced_unfinished = true;
            }
            st.replicas[r].readers[s] = None;
        } else if !entry_ok {
            // Drop the records at or below the entry and retry with the rest.
            if item.entry[s] >= b.last {
                Self::settle(st, r, s);
            } else {
                let reader = st.replicas[r].readers[s].as_mut().expect("reader");
                reader.batch.as_mut().expect("batch").first = item.entry[s] + 1;
            }
        }
        // A refused pruning write (bug (e) runs only) just refreshed `seen`: retry later.
    }
}

/// Every shard is checkpointed at SHARD_END.
pub fn all_finished(st: &State) -> bool {
    st.leases.iter().all(|l| l.checkpoint == Checkpoint::End)
}

/// Every shard at SHARD_END and no replica holds a batch it has not written.
pub fn quiescent(st: &State) -> bool {
    all_finished(st)
        && st.replicas.iter().flat_map(|r| r.readers.iter().flatten()).all(|rd| rd.batch.is_none_or(|b| b.phase == Phase::Written))
}

const SHARD_NAMES: [&str; SHARDS] = ["P", "C1", "C2"];
const REPLICA_NAMES: [&str; REPLICAS] = ["A", "B"];

fn set_name(set: Set) -> String {
    let times = (0..SHARDS).filter(|&s| has(set, s)).map(|s| SHARD_NAMES[s].to_string());
    let ids = (0..SHARDS).filter(|&s| set & id_token(s) != 0).map(|s| format!("id:{}", SHARD_NAMES[s]));
    format!("{{{}}}", times.chain(ids).collect::<Vec<_>>().join(","))
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (sn, rn) = (SHARD_NAMES, REPLICA_NAMES);
        match *self {
            Action::Produce(s) => write!(f, "stream: a new record in {}", sn[s]),
            Action::Take(r, s) => write!(f, "{} takes lease {}", rn[r], sn[s]),
            Action::LoseLease(r, s) => write!(f, "{} finds lease {} taken, stops that reader", rn[r], sn[s]),
            Action::Read { r, s, last } => write!(f, "{} reads {} up to #{last}", rn[r], sn[s]),
            Action::Write { r, s, prune: None } => write!(f, "{} writes its {} batch", rn[r], sn[s]),
            Action::Write { r, s, prune: Some(p) } => write!(
                f,
                "{} writes its {} batch, setting F'={} O'={} and pruning by a view with finished={} open={}",
                rn[r],
                sn[s],
                p.floor,
                set_name(p.keep),
                set_name(p.view),
                set_name(p.open)
            ),
            Action::Checkpoint(r, s) => write!(f, "{} checkpoints {}", rn[r], sn[s]),
            Action::Crash(r) => write!(f, "{} crashes", rn[r]),
            Action::Expire(s) => write!(f, "lease {} expires (owner paused)", sn[s]),
            Action::Corrupt => write!(f, "external write: value += 1"),
            Action::ReconSnapshot => write!(f, "reconcile reads the item's write counter"),
            Action::ReconTruth => write!(f, "reconcile reads the truth"),
            Action::ReconWait => write!(f, "reconcile sees every checkpoint cover the records its truth saw"),
            Action::ReconItem => write!(f, "reconcile reads the item (counter unchanged)"),
            Action::ReconWrite => write!(f, "reconcile writes value := truth if the counter is as first read"),
        }
    }
}

/// One line about the item and the lease table.
pub fn describe(st: &State) -> String {
    let entry = |s: usize| if st.item.entry[s] == 0 { "-".to_string() } else { st.item.entry[s].to_string() };
    let cp = |s: usize| match st.leases[s].checkpoint {
        Checkpoint::None => "-".to_string(),
        Checkpoint::At(c) => c.to_string(),
        Checkpoint::End => "END".to_string(),
    };
    let applied: Vec<String> = (0..SHARDS).map(|s| format!("{}{:?}", SHARD_NAMES[s], &st.applied[s][..st.n[s] as usize])).collect();
    format!(
        "value={} ledger[P={} C1={} C2={}] F={} O={} | checkpoints[P={} C1={} C2={}] | applied {}",
        st.item.value,
        entry(P),
        entry(C1),
        entry(C2),
        st.item.floor,
        set_name(st.item.stragglers),
        cp(P),
        cp(C1),
        cp(C2),
        applied.join(" ")
    )
}

/// What an exhaustive run found.
#[derive(Debug)]
pub struct Summary {
    pub unique_states: usize,
    pub total_states: usize,
    pub max_depth: usize,
    pub seconds: f64,
    /// Properties with a discovery: counterexamples of `always` properties (failures) and
    /// examples of `sometimes` ones.
    pub discoveries: Vec<(&'static str, Vec<Action>)>,
    /// `always` properties violated, and `sometimes` properties never met.
    pub failures: Vec<&'static str>,
}

/// Runs the BFS checker over every reachable state.
pub fn check_all(model: ProtocolModel, threads: usize) -> Summary {
    use stateright::{Checker, Expectation};
    let properties = model.properties();
    let start = std::time::Instant::now();
    let checker = model.checker().threads(threads).spawn_bfs().join();
    let seconds = start.elapsed().as_secs_f64();
    let mut discoveries: Vec<_> = checker.discoveries().into_iter().map(|(name, path)| (name, path.into_actions())).collect();
    discoveries.sort_by_key(|(name, _)| *name);
    let failures = properties
        .iter()
        .filter(|p| match p.expectation {
            Expectation::Sometimes => !discoveries.iter().any(|(n, _)| *n == p.name),
            _ => discoveries.iter().any(|(n, _)| *n == p.name),
        })
        .map(|p| p.name)
        .collect();
    Summary {
        unique_states: checker.unique_state_count(),
        total_states: checker.state_count(),
        max_depth: checker.max_depth(),
        seconds,
        discoveries,
        failures,
    }
}

/// Searches for a counterexample to `property` and returns a shortest one, as (action, state
/// after it) steps. BFS stops at the first discovery, but stateright may keep a slightly
/// deeper one found in the same block, so it searches again below that depth until none is
/// left.
pub fn find_counterexample(model: ProtocolModel, property: &'static str) -> Option<Vec<(Action, State)>> {
    use stateright::{Checker, HasDiscoveries};
    let search = |depth: Option<usize>| {
        let mut builder = model.clone().checker().finish_when(HasDiscoveries::AnyOf([property].into_iter().collect()));
        if let Some(d) = depth {
            builder = builder.target_max_depth(d);
        }
        builder.spawn_bfs().join().discovery(property).map(|path| {
            let steps = path.into_vec();
            steps.windows(2).map(|w| (w[0].1.expect("an action between states"), w[1].0.clone())).collect::<Vec<_>>()
        })
    };
    let mut best = search(None)?;
    // A trace of k actions ends at depth k + 1; depth limit d explores traces of < d - 1 actions.
    while let Some(shorter) = search(Some(best.len() + 1)) {
        best = shorter;
    }
    Some(best)
}
