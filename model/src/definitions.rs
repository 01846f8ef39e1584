//! A rule definition change during a rolling deploy (DESIGN: "Changing a running deployment"),
//! checked with `stateright`.
//!
//! Old and new replicas run side by side. The state table holds the committed definitions
//! under a generation: 1 = OLD, 2 = NEW. OLD maps every record to the target item `T_old` (a
//! daily key, say), NEW maps it to `T_new` (a monthly key). Each target item has its own ledger
//! (one entry per shard: the highest sequence number applied) and write counter `V`, as the
//! target item of the main model ([`crate`]).
//!
//! * **Replicas** publish a heartbeat with the definitions they run. A replica whose
//!   definitions are the committed ones works as in the main model: take, read, write,
//!   checkpoint. One whose definitions differ takes no lease, and when it learns that its
//!   definitions are no longer the committed ones it drops what it holds in memory and releases
//!   its leases (it writes nothing more).
//! * **The commit.** A NEW replica reads the state table at generation 1 and checks that
//!   (a) no live replica publishes the committed (OLD) definitions and (b) no lease is held
//!   unexpired by anyone. Later, in its own step, it commits NEW as generation 2, conditional
//!   on the generation still being 1. A pause may fall between the check and the commit.
//! * **The rebuild** runs once NEW is committed: the reconcile procedure of the main model (read
//!   `V`, read the truth, wait until every checkpoint covers the records the truth saw, read the
//!   item and retry if `V` moved, write `value := truth` conditioned on `V`) applied to `T_new`
//!   with truth = every record produced, and to `T_old` with truth = 0.
//! * **Rolling deploy.** Every replica starts OLD or NEW ([`RolloutModel::configs`]). An OLD
//!   replica may be replaced by a NEW one (`Upgrade`: a graceful stop that releases the leases
//!   it knows, then a restart with NEW). A crash drops all memory and restarts the replica with
//!   the same definitions; its leases stay in the table until they expire.
//! * **Pauses.** A replica's heartbeat may lapse (`Lapse`) and a lease may expire (`Expire`)
//!   while its owner still believes it holds it. Without [`RolloutModel::deadline`], a replica
//!   acts later on its old beliefs: an old batch, an old lease, an old generation. With it, a
//!   replica whose heartbeat lapsed does nothing until it renews it (reading the generation
//!   again), and a reader writes and checkpoints only while its lease is valid.
//! * **Generation fence** ([`RolloutModel::fence`]): every target write carries the writer's
//!   generation (the one it last read), the item records the highest generation written, and a
//!   write from a lower one is refused: the reader drops its lease and reads the generation
//!   again. The rebuild's writes carry generation 2.
//! * **Generation leases** ([`RolloutModel::generation_leases`]): takes and checkpoints are
//!   conditional on the state table's generation being the one the replica read. **Drain**
//!   ([`RolloutModel::drain`]): the committer first marks generation 1 as draining (takes at
//!   generation 1 are then refused), and only then checks (a) and (b).
//!
//! The protocol as briefed has none of the three; README.md ("Definition changes") says which
//! the checker shows to be needed, with and without the renewal deadline.
//!
//! Ghost state counts how often each record's effect is in each target item.

use crate::{Batch, Checkpoint, Lease, Phase, Reader};
use stateright::{Model, Property};

/// Shards: a parent P and, when its shape says so, one child C (read after P's SHARD_END).
pub const SHARDS: usize = 2;
pub const P: usize = 0;
pub const C: usize = 1;
/// Records per shard at most.
pub const MAX_RECORDS: usize = 2;
/// Replica slots.
pub const MAX_REPLICAS: usize = 3;
/// Target items, indexed by the definitions that map records to them.
pub const OLD: usize = 0;
pub const NEW: usize = 1;

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Def {
    #[default]
    Old,
    New,
}

impl Def {
    /// The target item these definitions map every record to.
    pub fn target(self) -> usize {
        match self {
            Def::Old => OLD,
            Def::New => NEW,
        }
    }
}

/// The definitions committed under a generation: 1 = OLD, 2 = NEW.
pub fn committed_def(generation: u8) -> Def {
    if generation >= 2 {
        Def::New
    } else {
        Def::Old
    }
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Replica {
    /// The slot runs a replica (runs with fewer than [`MAX_REPLICAS`] leave some empty).
    pub present: bool,
    /// The definitions it runs (and publishes in its heartbeat).
    pub config: Def,
    /// The generation it last read from the state table.
    pub generation: u8,
    /// Its heartbeat is fresh (other replicas count it as live).
    pub live: bool,
    /// Its commit: 0 = none, 1 = it marked the state table draining, 2 = it found (a) and (b)
    /// true at generation 1 and will commit NEW.
    pub commit_step: u8,
    pub readers: [Option<Reader>; SHARDS],
}

impl Replica {
    /// It runs the definitions of the generation it last read.
    pub fn current(&self) -> bool {
        self.config == committed_def(self.generation)
    }
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub struct Target {
    /// Ledger: the highest sequence number applied per shard (0 = absent).
    pub entry: [u8; SHARDS],
    /// The write counter `V`: every ledger write and rebuild write adds 1.
    pub version: u8,
    /// With the fence: the highest generation written (0 = none).
    pub generation: u8,
}

/// One target's rebuild, the reconcile procedure of the main model.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Rebuild {
    /// Not started (before the commit), or retrying from step 1.
    Pending,
    /// (1) `V` read.
    Snapshot { version: u8 },
    /// (2) Truth read: the records produced then (`T_new` gets their sum, `T_old` gets 0).
    Truth { version: u8, at_t: [u8; SHARDS] },
    /// (3) Every checkpoint covers `at_t`.
    Caught { version: u8, at_t: [u8; SHARDS] },
    /// (4) Item read, `V` unchanged since (1).
    ItemRead { version: u8, at_t: [u8; SHARDS] },
    /// (5) Written.
    Done,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RebuildOrder {
    /// `T_new`'s rebuild reads its truth only after `T_old`'s rebuild wrote it (with the fence,
    /// no OLD write lands in `T_old` after that).
    #[default]
    OldThenNew,
    /// The two rebuilds run side by side, in any interleaving.
    Concurrent,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    pub n: [u8; SHARDS],
    pub produced: [u8; SHARDS],
    pub leases: [Lease; SHARDS],
    /// The state table's generation.
    pub committed: u8,
    /// With [`RolloutModel::drain`]: a NEW replica marked generation 1 as draining.
    pub draining: bool,
    pub targets: [Target; 2],
    pub replicas: [Replica; MAX_REPLICAS],
    pub rebuild: [Rebuild; 2],
    pub crashes_left: u8,
    pub lapses_left: u8,
    pub expiries_left: u8,
    // Ghost state.
    /// counts[t][s][k-1]: how many times record k of shard s is in target t's value
    /// (saturates at 2). A rebuild write sets it to what its truth holds.
    pub counts: [[[u8; MAX_RECORDS]; SHARDS]; 2],
    /// A consumer write landed in `T_old` after the commit.
    pub old_after_commit: bool,
    /// A consumer write landed in `T_old` after its rebuild wrote 0.
    pub old_after_rebuild: bool,
    /// A write was refused by the generation fence.
    pub fenced: bool,
    /// A rebuild went back to step 1.
    pub retried: bool,
    /// A take or checkpoint was refused for its generation.
    pub refused_by_generation: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    /// The next record of shard s appears in the stream.
    Produce(usize),
    Take(usize, usize),
    LoseLease(usize, usize),
    Read {
        r: usize,
        s: usize,
        last: u8,
    },
    Write(usize, usize),
    Checkpoint(usize, usize),
    /// Memory lost, restarted with the same definitions (reads the generation).
    Crash(usize),
    /// An OLD replica is stopped gracefully (releasing the leases it knows) and replaced by a
    /// NEW one.
    Upgrade(usize),
    /// Replica r's heartbeat lapses (it is paused): others no longer count it as live.
    Lapse(usize),
    /// Lease s expires while its owner may still believe it holds it.
    Expire(usize),
    /// Replica r renews its heartbeat and reads the generation; a replica that finds its
    /// definitions are not the committed ones drops its batches and releases its leases.
    Heartbeat(usize),
    /// With [`RolloutModel::drain`]: a NEW replica marks generation 1 as draining (takes at
    /// generation 1 are refused from now on).
    Drain(usize),
    /// A NEW replica finds (a) and (b) true at generation 1.
    Prepare(usize),
    /// It commits NEW as generation 2, conditional on the generation being 1.
    Commit(usize),
    RebuildSnapshot(usize),
    RebuildTruth(usize),
    RebuildWait(usize),
    RebuildItem(usize),
    RebuildWrite(usize),
}

/// Seeded bugs of the definition change.
#[derive(Clone, Copy, Debug, Default)]
pub struct RolloutBugs {
    /// The commit does not check (a): a live replica still publishes OLD.
    pub no_live_check: bool,
    /// The commit does not check (b): a lease is still held unexpired.
    pub no_lease_check: bool,
}

#[derive(Clone, Debug)]
pub struct RolloutModel {
    /// Records per shard (P, C); C = 0 means P has no child.
    pub shapes: Vec<[u8; SHARDS]>,
    /// The definitions each replica starts with (at most [`MAX_REPLICAS`]).
    pub configs: Vec<Def>,
    pub crashes: u8,
    /// Heartbeat lapses in a run.
    pub lapses: u8,
    /// Lease expiries in a run.
    pub expiries: u8,
    /// Records appear one by one while the replicas run (else all exist from the start).
    pub dynamic_production: bool,
    /// The renewal deadline holds: a replica stops when it can no longer prove its heartbeat or
    /// its lease (so a pause never lets it act on old beliefs).
    pub deadline: bool,
    /// The per-target generation fence.
    pub fence: bool,
    /// Takes and checkpoints are conditional on the state table's generation being the one the
    /// replica last read (the lease write and the definitions item in one transaction). A
    /// refused one makes the replica release the lease and read the generation.
    pub generation_leases: bool,
    /// The committer first marks generation 1 as draining (with `generation_leases`, a take at
    /// generation 1 is then refused), and only then checks (a) and (b).
    pub drain: bool,
    pub order: RebuildOrder,
    pub symmetry: bool,
    pub bugs: RolloutBugs,
}

impl Default for RolloutModel {
    fn default() -> Self {
        RolloutModel {
            shapes: vec![[2, 0], [1, 1]],
            configs: vec![Def::Old, Def::Old],
            crashes: 1,
            lapses: 1,
            expiries: 1,
            dynamic_production: true,
            deadline: false,
            fence: true,
            generation_leases: true,
            drain: false,
            order: RebuildOrder::Concurrent,
            symmetry: true,
            bugs: RolloutBugs::default(),
        }
    }
}

/// Property names.
pub mod names {
    pub const NO_DOUBLE_NEW: &str = "no record applied twice to T_new";
    pub const NO_DOUBLE_OLD: &str = "no record applied twice to T_old";
    pub const OLD_STAYS_ZERO: &str = "no record applied under the old definition after T_old's rebuild";
    pub const OLD_NOT_AFTER_COMMIT: &str = "no record applied under the old definition after the commit";
    pub const QUIESCENT_AFTER: &str = "quiescent after the change => T_new = every record once, T_old = 0";
    pub const QUIESCENT_BEFORE: &str = "quiescent before the change => T_old = every record once, T_new = 0";
    pub const EX_CHANGED: &str = "example: committed, rebuilt, every shard at SHARD_END";
    pub const EX_RETRIED: &str = "example: a rebuild retried (V moved)";
    pub const EX_STALE_OLD: &str = "example: an OLD write landed after the commit";
    pub const EX_FENCED: &str = "example: a stale write refused by the generation fence";
    pub const EX_REFUSED_GENERATION: &str = "example: a stale take or checkpoint refused for its generation";
}

/// Every shard at SHARD_END and no replica holds a batch it has not written.
pub fn quiescent(st: &State) -> bool {
    st.leases.iter().all(|l| l.checkpoint == Checkpoint::End)
        && st.replicas.iter().flat_map(|r| r.readers.iter().flatten()).all(|rd| rd.batch.is_none_or(|b| b.phase == Phase::Written))
}

fn changed(st: &State) -> bool {
    st.committed == 2 && st.rebuild.iter().all(|b| *b == Rebuild::Done)
}

impl RolloutModel {
    fn covers(st: &State, at_t: [u8; SHARDS]) -> bool {
        (0..SHARDS).all(|s| match st.leases[s].checkpoint {
            Checkpoint::End => true,
            Checkpoint::At(c) => c >= at_t[s],
            Checkpoint::None => at_t[s] == 0,
        })
    }

    fn exact(st: &State, t: usize, want: u8) -> bool {
        (0..SHARDS).all(|s| (0..st.n[s] as usize).all(|k| st.counts[t][s][k] == want))
    }

    /// Releases lease s if replica r still holds it under the counter it took it with.
    fn release(st: &mut State, r: usize, s: usize) {
        if let Some(rd) = st.replicas[r].readers[s] {
            let lease = &mut st.leases[s];
            if lease.owner == Some(r as u8) && lease.counter == rd.counter {
                lease.owner = None;
                lease.expired = false;
            }
        }
        st.replicas[r].readers[s] = None;
    }

    /// Replica r reads the generation; if its definitions are not the committed ones, it drops
    /// its batches and releases its leases.
    fn learn(st: &mut State, r: usize) {
        st.replicas[r].generation = st.committed;
        if !st.replicas[r].current() {
            for s in 0..SHARDS {
                Self::release(st, r, s);
            }
        }
    }

    /// (a) and (b) as the committing replica reads them now.
    fn may_commit(&self, st: &State) -> bool {
        let committed = committed_def(st.committed);
        let a = self.bugs.no_live_check || !st.replicas.iter().any(|q| q.present && q.live && q.config == committed);
        let b = self.bugs.no_lease_check || st.leases.iter().all(|l| l.owner.is_none() || l.expired);
        a && b
    }

    /// Puts the replicas in order (renaming lease owners to match).
    fn canonical(st: &mut State) {
        // Present replicas fill the first slots; only they are permuted.
        let present = st.replicas.iter().filter(|r| r.present).count();
        let mut order: Vec<usize> = (0..MAX_REPLICAS).collect();
        order[..present].sort_by_key(|&i| st.replicas[i]);
        let mut rename = [0u8; MAX_REPLICAS];
        for (new, &old) in order.iter().enumerate() {
            rename[old] = new as u8;
        }
        let old = st.replicas;
        for (new, &i) in order.iter().enumerate() {
            st.replicas[new] = old[i];
        }
        for lease in &mut st.leases {
            lease.owner = lease.owner.map(|o| rename[o as usize]);
        }
    }

    fn write(&self, st: &mut State, r: usize, s: usize) {
        let rep = st.replicas[r];
        let b = rep.readers[s].expect("reader").batch.expect("batch");
        let t = rep.config.target();
        let item = st.targets[t];
        let fence_ok = !self.fence || item.generation <= rep.generation;
        let entry_ok = item.entry[s] < b.first;
        if fence_ok && entry_ok {
            for k in b.first..=b.last {
                let c = &mut st.counts[t][s][k as usize - 1];
                *c = (*c + 1).min(2);
            }
            let item = &mut st.targets[t];
            item.entry[s] = b.last;
            item.version = item.version.wrapping_add(1);
            if self.fence {
                item.generation = item.generation.max(rep.generation);
            }
            if t == OLD && st.committed == 2 {
                st.old_after_commit = true;
                st.old_after_rebuild |= st.rebuild[OLD] == Rebuild::Done;
            }
            Self::written(st, r, s);
        } else if !fence_ok {
            // Refused by the fence: the reader drops its lease and reads the generation.
            st.fenced = true;
            Self::release(st, r, s);
            Self::learn(st, r);
        } else if item.entry[s] >= b.last {
            Self::written(st, r, s);
        } else {
            let reader = st.replicas[r].readers[s].as_mut().expect("reader");
            reader.batch.as_mut().expect("batch").first = item.entry[s] + 1;
        }
    }

    fn written(st: &mut State, r: usize, s: usize) {
        let reader = st.replicas[r].readers[s].as_mut().expect("reader");
        reader.batch.as_mut().expect("batch").phase = Phase::Written;
    }
}

impl Model for RolloutModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        assert!(self.configs.len() <= MAX_REPLICAS);
        let mut replicas = [Replica::default(); MAX_REPLICAS];
        for (r, &config) in self.configs.iter().enumerate() {
            replicas[r] = Replica { present: true, config, generation: 1, live: true, commit_step: 0, readers: [None; SHARDS] };
        }
        self.shapes
            .iter()
            .map(|&n| {
                let lease = |s: usize| Lease {
                    owner: None,
                    counter: 0,
                    expired: false,
                    // A shard with no records does not exist: count it as finished.
                    checkpoint: if n[s] == 0 { Checkpoint::End } else { Checkpoint::None },
                };
                let mut st = State {
                    n,
                    produced: if self.dynamic_production { [0; SHARDS] } else { n },
                    leases: [lease(P), lease(C)],
                    committed: 1,
                    draining: false,
                    targets: [Target::default(); 2],
                    replicas,
                    rebuild: [Rebuild::Pending; 2],
                    crashes_left: self.crashes,
                    lapses_left: self.lapses,
                    expiries_left: self.expiries,
                    counts: [[[0; MAX_RECORDS]; SHARDS]; 2],
                    old_after_commit: false,
                    old_after_rebuild: false,
                    fenced: false,
                    retried: false,
                    refused_by_generation: false,
                };
                if self.symmetry {
                    Self::canonical(&mut st);
                }
                st
            })
            .collect()
    }

    fn actions(&self, st: &State, actions: &mut Vec<Action>) {
        for s in 0..SHARDS {
            if st.produced[s] < st.n[s] && (s == P || st.produced[P] == st.n[P]) {
                actions.push(Action::Produce(s));
            }
            if st.expiries_left > 0 && st.leases[s].owner.is_some() && !st.leases[s].expired {
                actions.push(Action::Expire(s));
            }
        }
        for r in 0..MAX_REPLICAS {
            let rep = &st.replicas[r];
            if !rep.present {
                continue;
            }
            if !rep.live || rep.generation != st.committed {
                actions.push(Action::Heartbeat(r));
            }
            // Only an OLD replica's heartbeat matters to a decision ((a)); a NEW replica's
            // pause is its lease expiring.
            if st.lapses_left > 0 && rep.live && rep.config == Def::Old {
                actions.push(Action::Lapse(r));
            }
            // The crash the rollout adds to the main model's: an OLD replica restarted mid-rollout
            // (it still runs OLD). A NEW replica's crash is the main model's.
            if st.crashes_left > 0 && rep.config == Def::Old && rep.readers.iter().any(Option::is_some) {
                actions.push(Action::Crash(r));
            }
            if rep.config == Def::Old {
                actions.push(Action::Upgrade(r));
            }
            // Under the deadline, a replica that cannot prove its heartbeat has stopped.
            if self.deadline && !rep.live {
                continue;
            }
            for s in 0..SHARDS {
                let lease = &st.leases[s];
                let Some(reader) = &rep.readers[s] else {
                    if rep.current()
                        && (lease.owner.is_none() || lease.expired)
                        && lease.checkpoint != Checkpoint::End
                        && (s == P || st.leases[P].checkpoint == Checkpoint::End)
                    {
                        actions.push(Action::Take(r, s));
                    }
                    continue;
                };
                let held = lease.owner == Some(r as u8) && lease.counter == reader.counter;
                if !held {
                    actions.push(Action::LoseLease(r, s));
                }
                // Under the deadline, a reader writes and checkpoints only with a valid lease.
                let valid = !self.deadline || (held && !lease.expired);
                match reader.batch {
                    None if rep.current() => {
                        for last in reader.pos + 1..=st.produced[s] {
                            actions.push(Action::Read { r, s, last });
                        }
                    }
                    None => {}
                    Some(b) if valid && b.phase == Phase::Read => actions.push(Action::Write(r, s)),
                    Some(_) if valid => actions.push(Action::Checkpoint(r, s)),
                    Some(_) => {}
                }
            }
            if rep.config == Def::New && st.committed == 1 {
                if self.drain && !st.draining && rep.commit_step == 0 {
                    actions.push(Action::Drain(r));
                }
                if rep.commit_step < 2 && (!self.drain || st.draining) && self.may_commit(st) {
                    actions.push(Action::Prepare(r));
                }
            }
            if rep.commit_step == 2 {
                actions.push(Action::Commit(r));
            }
        }
        if st.committed == 2 {
            for t in [OLD, NEW] {
                match st.rebuild[t] {
                    Rebuild::Pending if t == OLD || self.order == RebuildOrder::Concurrent || st.rebuild[OLD] == Rebuild::Done => {
                        actions.push(Action::RebuildSnapshot(t))
                    }
                    Rebuild::Pending | Rebuild::Done => {}
                    Rebuild::Snapshot { .. } => actions.push(Action::RebuildTruth(t)),
                    Rebuild::Truth { at_t, .. } if Self::covers(st, at_t) => actions.push(Action::RebuildWait(t)),
                    Rebuild::Truth { .. } => {}
                    Rebuild::Caught { .. } => actions.push(Action::RebuildItem(t)),
                    Rebuild::ItemRead { .. } => actions.push(Action::RebuildWrite(t)),
                }
            }
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
            Action::Lapse(r) => {
                st.replicas[r].live = false;
                st.lapses_left -= 1;
            }
            Action::Heartbeat(r) => {
                st.replicas[r].live = true;
                Self::learn(&mut st, r);
            }
            Action::Take(r, _) if self.generation_leases && (st.committed != st.replicas[r].generation || st.draining) => {
                st.refused_by_generation = true;
                Self::learn(&mut st, r);
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
            Action::Write(r, s) => self.write(&mut st, r, s),
            Action::Checkpoint(r, s) => {
                let reader = st.replicas[r].readers[s].expect("reader");
                let b = reader.batch.expect("batch");
                let lease = &mut st.leases[s];
                let held = lease.owner == Some(r as u8) && lease.counter == reader.counter;
                if held && self.generation_leases && st.committed != st.replicas[r].generation {
                    st.refused_by_generation = true;
                    Self::release(&mut st, r, s);
                    Self::learn(&mut st, r);
                } else if held {
                    let end = b.last == st.n[s];
                    lease.checkpoint = if end { Checkpoint::End } else { Checkpoint::At(b.last) };
                    if end {
                        lease.owner = None;
                        lease.expired = false;
                        st.replicas[r].readers[s] = None;
                    } else {
                        let reader = st.replicas[r].readers[s].as_mut().expect("reader");
                        reader.pos = b.last;
                        reader.batch = None;
                    }
                } else {
                    st.replicas[r].readers[s] = None;
                }
            }
            Action::Crash(r) => {
                let rep = &mut st.replicas[r];
                *rep = Replica { present: true, config: rep.config, generation: st.committed, live: true, ..Replica::default() };
                st.crashes_left -= 1;
            }
            Action::Upgrade(r) => {
                for s in 0..SHARDS {
                    Self::release(&mut st, r, s);
                }
                st.replicas[r] = Replica { present: true, config: Def::New, generation: st.committed, live: true, ..Replica::default() };
            }
            Action::Drain(r) => {
                st.draining = true;
                st.replicas[r].commit_step = 1;
            }
            Action::Prepare(r) => st.replicas[r].commit_step = 2,
            Action::Commit(r) => {
                st.replicas[r].commit_step = 0;
                if st.committed == 1 {
                    st.committed = 2;
                    st.draining = false;
                    st.replicas[r].generation = 2;
                } else {
                    Self::learn(&mut st, r);
                }
            }
            Action::RebuildSnapshot(t) => st.rebuild[t] = Rebuild::Snapshot { version: st.targets[t].version },
            Action::RebuildTruth(t) => {
                let Rebuild::Snapshot { version } = st.rebuild[t] else { unreachable!() };
                st.rebuild[t] = Rebuild::Truth { version, at_t: st.produced };
            }
            Action::RebuildWait(t) => {
                let Rebuild::Truth { version, at_t } = st.rebuild[t] else { unreachable!() };
                st.rebuild[t] = Rebuild::Caught { version, at_t };
            }
            Action::RebuildItem(t) => {
                let Rebuild::Caught { version, at_t } = st.rebuild[t] else { unreachable!() };
                if st.targets[t].version == version {
                    st.rebuild[t] = Rebuild::ItemRead { version, at_t };
                } else {
                    st.rebuild[t] = Rebuild::Pending;
                    st.retried = true;
                }
            }
            Action::RebuildWrite(t) => {
                let Rebuild::ItemRead { version, at_t } = st.rebuild[t] else { unreachable!() };
                if st.targets[t].version == version {
                    // value := truth: T_new holds exactly the records the truth saw, T_old none.
                    for (counts, &seen) in st.counts[t].iter_mut().zip(&at_t) {
                        for (k, c) in counts.iter_mut().enumerate() {
                            *c = u8::from(t == NEW && k < seen as usize);
                        }
                    }
                    let item = &mut st.targets[t];
                    item.version = item.version.wrapping_add(1);
                    if self.fence {
                        item.generation = item.generation.max(2);
                    }
                    st.rebuild[t] = Rebuild::Done;
                } else {
                    st.rebuild[t] = Rebuild::Pending;
                    st.retried = true;
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
            Property::always(names::NO_DOUBLE_NEW, |_, st: &State| st.counts[NEW].iter().flatten().all(|&c| c <= 1)),
            Property::always(names::NO_DOUBLE_OLD, |_, st: &State| st.counts[OLD].iter().flatten().all(|&c| c <= 1)),
            Property::always(names::OLD_STAYS_ZERO, |_, st: &State| !st.old_after_rebuild),
            Property::always(names::QUIESCENT_AFTER, |_, st: &State| {
                !(quiescent(st) && changed(st)) || (Self::exact(st, NEW, 1) && Self::exact(st, OLD, 0))
            }),
            Property::always(names::QUIESCENT_BEFORE, |_, st: &State| {
                !(quiescent(st) && st.committed == 1) || (Self::exact(st, OLD, 1) && Self::exact(st, NEW, 0))
            }),
            Property::sometimes(names::EX_CHANGED, |_, st: &State| quiescent(st) && changed(st)),
            Property::sometimes(names::EX_RETRIED, |_, st: &State| st.retried),
        ];
        if self.lapses == 0 || self.deadline {
            // Nobody acts on a stale generation: nothing reaches T_old once NEW is committed.
            v.push(Property::always(names::OLD_NOT_AFTER_COMMIT, |_, st: &State| !st.old_after_commit));
        } else {
            v.push(Property::sometimes(names::EX_STALE_OLD, |_, st: &State| st.old_after_commit));
            if self.fence {
                v.push(Property::sometimes(names::EX_FENCED, |_, st: &State| st.fenced));
            }
            if self.generation_leases {
                v.push(Property::sometimes(names::EX_REFUSED_GENERATION, |_, st: &State| st.refused_by_generation));
            }
        }
        v
    }
}

const SHARD_NAMES: [&str; SHARDS] = ["P", "C"];
const REPLICA_NAMES: [&str; MAX_REPLICAS] = ["A", "B", "C"];
const TARGET_NAMES: [&str; 2] = ["T_old", "T_new"];

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (sn, rn, tn) = (SHARD_NAMES, REPLICA_NAMES, TARGET_NAMES);
        match *self {
            Action::Produce(s) => write!(f, "stream: a new record in {}", sn[s]),
            Action::Take(r, s) => write!(f, "{} takes lease {}", rn[r], sn[s]),
            Action::LoseLease(r, s) => write!(f, "{} finds lease {} taken, stops that reader", rn[r], sn[s]),
            Action::Read { r, s, last } => write!(f, "{} reads {} up to #{last}", rn[r], sn[s]),
            Action::Write(r, s) => write!(f, "{} writes its {} batch", rn[r], sn[s]),
            Action::Checkpoint(r, s) => write!(f, "{} checkpoints {}", rn[r], sn[s]),
            Action::Crash(r) => write!(f, "{} crashes and restarts", rn[r]),
            Action::Upgrade(r) => write!(f, "{} is stopped (releasing its leases) and replaced by a NEW replica", rn[r]),
            Action::Lapse(r) => write!(f, "{}'s heartbeat lapses (paused)", rn[r]),
            Action::Expire(s) => write!(f, "lease {} expires (owner paused)", sn[s]),
            Action::Heartbeat(r) => write!(f, "{} renews its heartbeat and reads the generation", rn[r]),
            Action::Drain(r) => write!(f, "{} marks generation 1 as draining", rn[r]),
            Action::Prepare(r) => write!(f, "{} finds no live OLD replica and no unexpired lease", rn[r]),
            Action::Commit(r) => write!(f, "{} commits NEW as generation 2 if the generation is 1", rn[r]),
            Action::RebuildSnapshot(t) => write!(f, "rebuild of {} reads V", tn[t]),
            Action::RebuildTruth(t) => write!(f, "rebuild of {} reads the truth", tn[t]),
            Action::RebuildWait(t) => write!(f, "rebuild of {} sees the checkpoints cover its truth", tn[t]),
            Action::RebuildItem(t) => write!(f, "rebuild of {} reads the item (retries if V moved)", tn[t]),
            Action::RebuildWrite(t) => write!(f, "rebuild of {} writes value := truth if V is as read", tn[t]),
        }
    }
}

/// One line about the generation, the target items, the lease table and the replicas.
pub fn describe(st: &State) -> String {
    let value = |t: usize| -> u8 { st.counts[t].iter().flatten().sum() };
    let entries = |t: usize| -> String {
        (0..SHARDS).filter(|&s| st.n[s] > 0).map(|s| format!("{}={}", SHARD_NAMES[s], st.targets[t].entry[s])).collect::<Vec<_>>().join(" ")
    };
    let target = |t: usize| {
        let tg = &st.targets[t];
        let fence = if tg.generation > 0 { format!(" g={}", tg.generation) } else { String::new() };
        let applied: Vec<String> =
            (0..SHARDS).filter(|&s| st.n[s] > 0).map(|s| format!("{}{:?}", SHARD_NAMES[s], &st.counts[t][s][..st.n[s] as usize])).collect();
        format!("{}[value={} ledger({}) V={}{} applied {}]", TARGET_NAMES[t], value(t), entries(t), tg.version, fence, applied.join(" "))
    };
    let lease = |s: usize| {
        let l = &st.leases[s];
        let cp = match l.checkpoint {
            Checkpoint::None => "-".to_string(),
            Checkpoint::At(c) => c.to_string(),
            Checkpoint::End => "END".to_string(),
        };
        let owner = l.owner.map_or("-", |o| REPLICA_NAMES[o as usize]);
        format!("{}:{}{} cp={}", SHARD_NAMES[s], owner, if l.expired { "(expired)" } else { "" }, cp)
    };
    let replicas: Vec<String> = (0..MAX_REPLICAS)
        .filter(|&r| st.replicas[r].present)
        .map(|r| {
            let rep = &st.replicas[r];
            format!("{}={:?}@g{}{}", REPLICA_NAMES[r], rep.config, rep.generation, if rep.live { "" } else { "(lapsed)" })
        })
        .collect();
    format!(
        "gen={} {} {} | leases {} | produced {:?} | {}",
        st.committed,
        target(OLD),
        target(NEW),
        (0..SHARDS).filter(|&s| st.n[s] > 0).map(lease).collect::<Vec<_>>().join(" "),
        &st.produced,
        replicas.join(" ")
    )
}

/// What an exhaustive run found.
#[derive(Debug)]
pub struct Summary {
    pub unique_states: usize,
    pub total_states: usize,
    pub max_depth: usize,
    pub seconds: f64,
    pub discoveries: Vec<(&'static str, Vec<Action>)>,
    /// `always` properties violated, and `sometimes` properties never met.
    pub failures: Vec<&'static str>,
}

/// Runs the BFS checker over every reachable state.
pub fn check_all(model: RolloutModel, threads: usize) -> Summary {
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

/// A shortest counterexample to `property`, as (action, state after it) steps (see
/// [`crate::find_counterexample`]).
pub fn find_counterexample(model: RolloutModel, property: &'static str) -> Option<Vec<(Action, State)>> {
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
    while let Some(shorter) = search(Some(best.len() + 1)) {
        best = shorter;
    }
    Some(best)
}
