//! Correcting a target written every second: a hold, and a log its writers keep while it
//! stands (DESIGN: "Changing a running deployment", rebuilds that finish), checked with
//! `stateright`.
//!
//! The counter protocol of the main model ([`crate`]) corrects a target only when its write
//! counter `V` stays still from before the truth read until the correction; a target written
//! every second never does. This protocol does not wait for quiet:
//!
//! 1. **Hold.** Reconcile sets a hold (its id) on the target item and an empty log, before it
//!    reads the truth. A hold left by an earlier attempt that expired may be replaced.
//! 2. **Truth.** It reads every source item's contribution to the target (time `t`).
//! 3. **Wait** until every record created before `t` has been applied.
//! 4. **Read** the target: its counter, its log, and whether the hold is still its own.
//! 5. **Correct**: `value := Σ log[i] for the items in the log + Σ truth[i] for the others`,
//!    conditioned on the counter as read in (4) and the hold being its own; the same write
//!    removes hold and log. A moved counter: back to (4). Hold gone: give up (try later).
//!
//! **Writers** (the ledger writes of the shard readers) apply their batch as ever, and:
//! * while a live hold stands, also set `log[i]` := item `i`'s contribution after the batch,
//!   for every source item `i` whose records the batch applies to the target;
//! * over an expired hold (its owner crashed, or too slow), remove hold and log in the same
//!   write: a hold never makes the item grow for ever, and the owner's correction then fails.
//!
//! Why (5) is right: an item in the log had a record applied after the hold; its logged value
//! is its contribution after its last applied record (one item's records are applied in
//! order). An item not in the log had no record applied after the hold; every record of it
//! created before `t` was applied (3), and none created after `t` was (it would be after the
//! hold, so logged): its applied contribution is its truth.
//!
//! Modelled: one target item; source items `A` and `B`, each a fixed sequence of versions
//! ([`CONTRIB`]: the contribution after each record), each read by its own shard reader, which
//! applies one record or two coalesced in one write; records are produced over time (a
//! logical clock dates them); one reconciler that may crash (its hold stays), a hold that may
//! expire while its owner still works, and an external corruption for reconcile to repair.
//! Seeded bugs ([`HoldBugs`]) switch single rules off.

use stateright::{Model, Property};

pub use crate::check::{check_all, find_counterexample, Summary};

/// Source items.
pub const ITEMS: usize = 2;
pub const A: usize = 0;
pub const B: usize = 1;
/// Records per item at most.
pub const MAX_VERSIONS: usize = 3;
/// Each item's contribution to the target after each of its records: A is inserted (1),
/// updated (3) and deleted (0); B inserted (2) and deleted (0).
pub const CONTRIB: [&[i8]; ITEMS] = [&[1, 3, 0], &[2, 0]];

/// Single rules switched off, each to be found by the checker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HoldBugs {
    /// Writers do not log while a hold stands.
    pub no_log: bool,
    /// The hold is set after the truth read instead of before.
    pub hold_after_truth: bool,
    /// A writer over an expired hold writes as if there were none, leaving hold and log.
    pub expired_hold_kept: bool,
    /// Neither the read (4) nor the correction (5) checks that the hold is still its own.
    pub no_hold_check: bool,
}

#[derive(Clone, Debug)]
pub struct HoldModel {
    pub crashes: u8,
    pub expiries: u8,
    pub corruptions: u8,
    /// Reconcile runs (each: hold, truth, wait, read, correct or give up).
    pub runs: u8,
    pub bugs: HoldBugs,
}

impl Default for HoldModel {
    fn default() -> HoldModel {
        HoldModel { crashes: 1, expiries: 1, corruptions: 1, runs: 2, bugs: HoldBugs::default() }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hold {
    pub id: u8,
    /// The writers' clocks say it is past its time.
    pub expired: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    #[default]
    Idle,
    /// (1) done (or, with `hold_after_truth`, about to be).
    Held,
    /// (2) done at time `t`, with each item's contribution then.
    Truth { t: u8, truth: [i8; ITEMS] },
    /// (3) done.
    Waited { t: u8, truth: [i8; ITEMS] },
    /// (4) done: the counter as read and the value to write.
    Read { t: u8, truth: [i8; ITEMS], seen: u8, want: i8 },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Records produced per item, and each one's creation time.
    pub produced: [u8; ITEMS],
    pub created: [[u8; MAX_VERSIONS]; ITEMS],
    pub clock: u8,
    /// Records of each item applied to the target.
    pub applied: [u8; ITEMS],
    /// The target item.
    pub value: i8,
    pub counter: u8,
    pub hold: Option<Hold>,
    pub log: [Option<i8>; ITEMS],
    /// The reconciler: its phase, the id of its current hold, ids used, runs, faults left.
    pub phase: Phase,
    pub my_hold: u8,
    pub next_id: u8,
    pub runs_left: u8,
    pub crashes_left: u8,
    pub expiries_left: u8,
    pub corruptions_left: u8,
    /// Ghost: a correction wrote a value other than the applied records' sum; a correction
    /// landed with a record logged during its hold (a busy target corrected); one repaired a
    /// corruption.
    pub wrong: bool,
    pub corrected_busy: bool,
    pub repaired: bool,
    /// Ghost: the corruption not repaired yet.
    pub drift: i8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Produce(usize),
    /// A reader applies the next `n` records of an item in one write.
    Apply(usize, u8),
    Corrupt,
    Expire,
    PlaceHold,
    ReadTruth,
    Wait,
    ReadItem,
    Correct,
    Crash,
}

pub mod names {
    pub const EXACT: &str = "a correction writes the applied records' sum";
    pub const TRACKED: &str = "the value is the applied records' sum plus unrepaired corruption";
    pub const EX_BUSY: &str = "a target written during its hold is corrected";
    pub const EX_REPAIRED: &str = "a corruption is repaired";
}

fn contrib(item: usize, records: u8) -> i8 {
    match records {
        0 => 0,
        n => CONTRIB[item][n as usize - 1],
    }
}

fn applied_sum(st: &State) -> i8 {
    (0..ITEMS).map(|i| contrib(i, st.applied[i])).sum()
}

impl HoldModel {
    fn truth(st: &State) -> [i8; ITEMS] {
        [contrib(A, st.produced[A]), contrib(B, st.produced[B])]
    }

    fn hold_is_mine(&self, st: &State) -> bool {
        self.bugs.no_hold_check || st.hold.is_some_and(|h| h.id == st.my_hold)
    }

    fn place_hold(st: &mut State) {
        st.next_id += 1;
        st.my_hold = st.next_id;
        st.hold = Some(Hold { id: st.my_hold, expired: false });
        st.log = [None; ITEMS];
    }

    fn apply(&self, st: &mut State, item: usize, n: u8) {
        let before = contrib(item, st.applied[item]);
        st.applied[item] += n;
        let after = contrib(item, st.applied[item]);
        st.value += after - before;
        st.counter += 1;
        match st.hold {
            Some(h) if h.expired && !self.bugs.expired_hold_kept => {
                st.hold = None;
                st.log = [None; ITEMS];
            }
            Some(h) if !h.expired && !self.bugs.no_log => st.log[item] = Some(after),
            _ => {}
        }
    }
}

impl Model for HoldModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            produced: [0; ITEMS],
            created: [[0; MAX_VERSIONS]; ITEMS],
            clock: 0,
            applied: [0; ITEMS],
            value: 0,
            counter: 0,
            hold: None,
            log: [None; ITEMS],
            phase: Phase::Idle,
            my_hold: 0,
            next_id: 0,
            runs_left: self.runs,
            crashes_left: self.crashes,
            expiries_left: self.expiries,
            corruptions_left: self.corruptions,
            wrong: false,
            corrected_busy: false,
            repaired: false,
            drift: 0,
        }]
    }

    fn actions(&self, st: &State, out: &mut Vec<Action>) {
        for (i, versions) in CONTRIB.iter().enumerate() {
            if (st.produced[i] as usize) < versions.len() {
                out.push(Action::Produce(i));
            }
            for n in 1..=2 {
                if st.applied[i] + n <= st.produced[i] {
                    out.push(Action::Apply(i, n));
                }
            }
        }
        if st.corruptions_left > 0 {
            out.push(Action::Corrupt);
        }
        if st.expiries_left > 0 && st.hold.is_some_and(|h| !h.expired) {
            out.push(Action::Expire);
        }
        match st.phase {
            Phase::Idle if st.runs_left > 0 => out.push(if self.bugs.hold_after_truth { Action::ReadTruth } else { Action::PlaceHold }),
            Phase::Idle => {}
            Phase::Held => out.push(Action::ReadTruth),
            Phase::Truth { .. } => out.push(Action::Wait),
            Phase::Waited { .. } => out.push(Action::ReadItem),
            Phase::Read { .. } => out.push(Action::Correct),
        }
        if st.crashes_left > 0 && st.phase != Phase::Idle {
            out.push(Action::Crash);
        }
    }

    fn next_state(&self, prev: &State, action: Action) -> Option<State> {
        let mut st = prev.clone();
        match action {
            Action::Produce(i) => {
                st.created[i][st.produced[i] as usize] = st.clock;
                st.produced[i] += 1;
                st.clock += 1;
            }
            Action::Apply(i, n) => self.apply(&mut st, i, n),
            Action::Corrupt => {
                st.corruptions_left -= 1;
                // A user's edit: it does not advance the ledger's counter.
                st.value += 1;
                st.drift += 1;
            }
            Action::Expire => {
                st.expiries_left -= 1;
                st.hold = st.hold.map(|h| Hold { expired: true, ..h });
            }
            Action::PlaceHold => {
                // (1): over no hold or an expired one (a crashed attempt's) only.
                if st.hold.is_some_and(|h| !h.expired) {
                    return None;
                }
                st.runs_left -= 1;
                Self::place_hold(&mut st);
                st.phase = Phase::Held;
            }
            Action::ReadTruth => {
                if self.bugs.hold_after_truth {
                    if st.hold.is_some_and(|h| !h.expired) {
                        return None;
                    }
                    st.runs_left -= 1;
                }
                let (t, truth) = (st.clock, Self::truth(&st));
                st.clock += 1;
                st.phase = Phase::Truth { t, truth };
            }
            Action::Wait => {
                let Phase::Truth { t, truth } = st.phase else { return None };
                let before_t = |i: usize| st.created[i][..st.produced[i] as usize].iter().filter(|&&c| c < t).count() as u8;
                if (0..ITEMS).any(|i| st.applied[i] < before_t(i)) {
                    return None;
                }
                if self.bugs.hold_after_truth {
                    // Records created after the truth read and applied before this hold are
                    // in neither the truth nor the log.
                    if st.hold.is_some_and(|h| !h.expired) {
                        return None;
                    }
                    Self::place_hold(&mut st);
                }
                st.phase = Phase::Waited { t, truth };
            }
            Action::ReadItem => {
                let Phase::Waited { t, truth } = st.phase else { return None };
                if !self.hold_is_mine(&st) {
                    st.phase = Phase::Idle; // the hold is gone: try again later
                    return Some(st);
                }
                let want = (0..ITEMS).map(|i| st.log[i].unwrap_or(truth[i])).sum();
                st.phase = Phase::Read { t, truth, seen: st.counter, want };
            }
            Action::Correct => {
                let Phase::Read { t, truth, seen, want } = st.phase else { return None };
                if !self.hold_is_mine(&st) {
                    st.phase = Phase::Idle;
                    return Some(st);
                }
                if st.counter != seen {
                    st.phase = Phase::Waited { t, truth };
                    return Some(st);
                }
                st.wrong |= want != applied_sum(&st);
                st.corrected_busy |= st.log.iter().any(Option::is_some);
                st.repaired |= st.drift != 0 && want == applied_sum(&st);
                st.value = want;
                st.drift = st.value - applied_sum(&st);
                st.counter += 1;
                st.hold = None;
                st.log = [None; ITEMS];
                st.phase = Phase::Idle;
            }
            Action::Crash => {
                st.crashes_left -= 1;
                st.phase = Phase::Idle;
            }
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(names::EXACT, |_, st: &State| !st.wrong),
            Property::always(names::TRACKED, |_, st: &State| st.value == applied_sum(st) + st.drift),
            Property::sometimes(names::EX_BUSY, |_, st: &State| st.corrected_busy),
            Property::sometimes(names::EX_REPAIRED, |_, st: &State| st.repaired),
        ]
    }
}

/// One state on a line.
pub fn describe(st: &State) -> String {
    let log: Vec<String> = (0..ITEMS).filter_map(|i| st.log[i].map(|v| format!("{}={v}", ["A", "B"][i]))).collect();
    format!(
        "produced A{} B{} applied A{} B{} | target value={} V={} hold={:?} log[{}] | reconcile {:?} | applied sum {}",
        st.produced[A],
        st.produced[B],
        st.applied[A],
        st.applied[B],
        st.value,
        st.counter,
        st.hold,
        log.join(" "),
        st.phase,
        applied_sum(st)
    )
}
