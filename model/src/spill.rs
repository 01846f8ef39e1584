//! A packed measure moving out of its target into helper items (the spill), and targets
//! written before packing existed: the counts stay exactly once (the plan for issue 27's
//! write cost), checked with `stateright` before it is built.
//!
//! [`crate::packed`] checks the derived value while the counts are packed. Here the counts move:
//!
//! * **Place.** The target records where a measure's counts live: packed in it (`P`) or in
//!   one helper item per value (`H`). A writer learns it from the item its last write returned
//!   (its image); without one it writes packed deltas on condition that the place is `P`, and a
//!   refusal tells it `H`.
//! * **Spill.** When the target grows, one transaction moves the packed counts into the
//!   helpers, sets the place to `H`, and gives each helper a copy of the target's ledger entries
//!   (rule `copy_entries`): a replay of a record the target applied is then refused by the
//!   helper too.
//! * **On helpers**, a batch's target write carries no packed deltas (a ledger-only write for
//!   this measure), and each helper it changes gets its own ledger write; the writes of one
//!   batch go out in any order.
//! * **Unknown place** (rule `existing_is_helpers`): a target without a place that exists
//!   already (it has a write counter) was written before packing, and its helpers may hold a
//!   record whose target write landed while its helper write did not (a crash in between):
//!   such a target stays on helpers. Only a target never written starts packed.
//!
//! Modelled: one target (place, packed counts of the values 0 and 1, ledger entries, write
//! counter) and one helper per value (count, ledger entries, whether it exists); source items
//! A (values 1, 0, deleted) and B (0, deleted), each read by its own shard reader with its own
//! image, one record or two coalesced per batch; one spill at any time; crashes; and, in the
//! `legacy` start, a target written by the older release: A's first record applied to the
//! target but not to its helper, A's reader about to replay it. Seeded bugs ([`SpillBugs`]).
//!
//! Not modelled: the derived value (see [`crate::packed`]), expiry of zero helpers (the main
//! crate's argument), two replicas reading one shard at once.

use stateright::{Model, Property};

pub use crate::check::{check_all, find_counterexample, Summary};

pub const ITEMS: usize = 2;
pub const A: usize = 0;
pub const B: usize = 1;
pub const VALUES: usize = 2;
/// Each item's value after each of its records (None: deleted).
pub const VERSIONS: [&[Option<u8>]; ITEMS] = [&[Some(1), Some(0), None], &[Some(0), None]];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SpillBugs {
    /// The spill creates the helpers without the target's ledger entries.
    pub no_entry_copy: bool,
    /// A writer without an image writes packed deltas without conditioning on the place.
    pub no_place_condition: bool,
    /// A target without a place starts packed if no helper exists, even if it was written.
    pub unknown_is_packed: bool,
}

#[derive(Clone, Debug)]
pub struct SpillModel {
    pub crashes: u8,
    /// Start from a target the older release wrote (see the module's doc).
    pub legacy: bool,
    pub bugs: SpillBugs,
}

impl Default for SpillModel {
    fn default() -> SpillModel {
        SpillModel { crashes: 1, legacy: false, bugs: SpillBugs::default() }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    Packed,
    Helpers,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Helper {
    pub exists: bool,
    pub count: u8,
    pub entry: [u8; ITEMS],
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    #[default]
    Idle,
    /// A batch up to `upto` whose counts go to the helpers: the target's ledger-only write and
    /// each helper's write still to do, in any order.
    OnHelpers { upto: u8, target: bool, helper: [bool; VALUES] },
    /// Written up to `upto`: the checkpoint is due.
    Written { upto: u8 },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Reader {
    pub checkpoint: u8,
    pub phase: Phase,
    /// The place the item its last write returned showed (None: no image).
    pub place: Option<Place>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The target: the place (None: not recorded), packed counts, ledger, write counter.
    pub place: Option<Place>,
    pub packed: [u8; VALUES],
    pub entry: [u8; ITEMS],
    pub version: u8,
    pub helpers: [Helper; VALUES],
    pub readers: [Reader; ITEMS],
    pub spilled: bool,
    pub crashes_left: u8,
    /// Ghost: a batch moved to the helpers after its packed write was refused; a helper write
    /// applied records after the spill.
    pub rerouted: bool,
    pub helper_applied: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Item `i`'s reader starts a batch of its next `n` records (a packed write lands in this
    /// step; a batch on helpers only decides here).
    Write(usize, u8),
    TargetWrite(usize),
    HelperWrite(usize, usize),
    Checkpoint(usize),
    Spill,
    Crash(usize),
}

pub mod names {
    pub const EXACT: &str = "at quiescence every value's count is its items', each record once";
    pub const PACKED_EMPTY: &str = "a target on helpers holds no packed counts";
    pub const EX_SPILLED_MID_STREAM: &str = "records reach the helpers after a spill";
    pub const EX_REROUTED: &str = "a packed write refused by the place goes to the helpers";
}

fn holds(i: usize, records: u8) -> Option<u8> {
    match records {
        0 => None,
        n => VERSIONS[i][usize::from(n) - 1],
    }
}

/// Item `i`'s change to value `v`'s count from `from` to `to` records: -1, 0 or +1.
fn change(i: usize, v: usize, from: u8, to: u8) -> i8 {
    let has = |n: u8| i8::from(holds(i, n).is_some_and(|x| usize::from(x) == v));
    has(to) - has(from)
}

/// Whether a batch of item `i` from `from` to `to` records has a record that holds value `v`
/// before or after it: such a helper gets a write even if the batch's changes to it cancel
/// (a ledger-only write), since a batch read again may apply only part of its records.
fn touches(i: usize, v: usize, from: u8, to: u8) -> bool {
    (from..=to).any(|n| holds(i, n).is_some_and(|x| usize::from(x) == v))
}

/// A count moved by `d` (a count taken below zero becomes 255, which no property accepts).
fn add(count: u8, d: i8) -> u8 {
    u8::try_from(i16::from(count) + i16::from(d)).unwrap_or(u8::MAX)
}

fn quiescent(st: &State) -> bool {
    (0..ITEMS).all(|i| usize::from(st.readers[i].checkpoint) == VERSIONS[i].len() && st.readers[i].phase == Phase::Idle)
}

/// Every value's count at the end of the stream.
fn final_counts() -> [u8; VALUES] {
    let mut c = [0; VALUES];
    for (i, versions) in VERSIONS.iter().enumerate() {
        if let Some(v) = holds(i, u8::try_from(versions.len()).unwrap_or(0)) {
            c[usize::from(v)] += 1;
        }
    }
    c
}

impl SpillModel {
    /// The place a writer without an image decides for the target as it is.
    fn place_of_unknown(&self, st: &State) -> Place {
        let written = st.version > 0;
        if !written || (self.bugs.unknown_is_packed && !st.helpers.iter().any(|h| h.exists)) {
            Place::Packed
        } else {
            Place::Helpers
        }
    }

    fn write(&self, st: &mut State, i: usize, n: u8) {
        let upto = st.readers[i].checkpoint + n;
        // Without an image a writer tries a packed write; its condition says otherwise.
        if st.readers[i].place == Some(Place::Helpers) {
            st.readers[i].phase = Phase::OnHelpers { upto, target: false, helper: [false; VALUES] };
            return;
        }
        // A packed write, on condition of the ledger and of the place: recorded as packed, or
        // not recorded on a target never written. A refusal returns the item.
        let place_ok = match st.place {
            Some(p) => p == Place::Packed,
            None => self.place_of_unknown(st) == Place::Packed,
        };
        if !place_ok && !self.bugs.no_place_condition {
            st.rerouted = true;
            st.readers[i].place = Some(Place::Helpers);
            return; // the next Write step routes to the helpers
        }
        if st.entry[i] < upto {
            let from = st.entry[i].max(st.readers[i].checkpoint);
            for v in 0..VALUES {
                st.packed[v] = add(st.packed[v], change(i, v, from, upto));
            }
            st.entry[i] = upto;
            st.version += 1;
            st.place = st.place.or(Some(Place::Packed));
        }
        st.readers[i].place = st.place;
        st.readers[i].phase = Phase::Written { upto };
    }

    fn target_write(st: &mut State, i: usize) {
        let Phase::OnHelpers { upto, helper, .. } = st.readers[i].phase else { return };
        if st.entry[i] < upto {
            st.entry[i] = upto;
            st.version += 1;
        }
        st.place = st.place.or(Some(Place::Helpers));
        st.readers[i].place = st.place;
        st.readers[i].phase = Phase::OnHelpers { upto, target: true, helper };
    }

    fn helper_write(st: &mut State, i: usize, v: usize) {
        let Phase::OnHelpers { upto, target, mut helper } = st.readers[i].phase else { return };
        let h = &mut st.helpers[v];
        let from = h.entry[i].max(st.readers[i].checkpoint);
        if h.entry[i] < upto {
            h.count = add(h.count, change(i, v, from, upto));
            h.entry[i] = upto;
            h.exists = true;
            st.helper_applied |= st.spilled;
        }
        helper[v] = true;
        st.readers[i].phase = Phase::OnHelpers { upto, target, helper };
    }

    fn spill(&self, st: &mut State) {
        st.spilled = true;
        for v in 0..VALUES {
            let h = &mut st.helpers[v];
            h.exists = true;
            h.count = st.packed[v];
            h.entry = if self.bugs.no_entry_copy { [0; ITEMS] } else { st.entry };
        }
        st.packed = [0; VALUES];
        st.place = Some(Place::Helpers);
        st.version += 1;
    }
}

impl Model for SpillModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut st = State {
            place: None,
            packed: [0; VALUES],
            entry: [0; ITEMS],
            version: 0,
            helpers: [Helper::default(); VALUES],
            readers: [Reader::default(); ITEMS],
            spilled: false,
            crashes_left: self.crashes,
            rerouted: false,
            helper_applied: false,
        };
        if self.legacy {
            // The older release applied A's first record to the target (its counters) and
            // crashed before the helper write; A's reader will replay it.
            st.entry[A] = 1;
            st.version = 1;
        }
        vec![st]
    }

    fn actions(&self, st: &State, out: &mut Vec<Action>) {
        for (i, versions) in VERSIONS.iter().enumerate() {
            let r = &st.readers[i];
            match r.phase {
                Phase::Idle => {
                    for n in 1..=2u8 {
                        if usize::from(r.checkpoint + n) <= versions.len() {
                            out.push(Action::Write(i, n));
                        }
                    }
                }
                Phase::OnHelpers { upto, target, helper } => {
                    if !target {
                        out.push(Action::TargetWrite(i));
                    }
                    for (v, done) in helper.iter().enumerate() {
                        if !done && touches(i, v, r.checkpoint, upto) {
                            out.push(Action::HelperWrite(i, v));
                        }
                    }
                    let helpers_done = (0..VALUES).all(|v| helper[v] || !touches(i, v, r.checkpoint, upto));
                    if target && helpers_done {
                        out.push(Action::Checkpoint(i));
                    }
                }
                Phase::Written { .. } => out.push(Action::Checkpoint(i)),
            }
            if st.crashes_left > 0 && (r.phase != Phase::Idle || r.place.is_some()) {
                out.push(Action::Crash(i));
            }
        }
        if !st.spilled && st.place == Some(Place::Packed) {
            out.push(Action::Spill);
        }
    }

    fn next_state(&self, prev: &State, action: Action) -> Option<State> {
        let mut st = prev.clone();
        match action {
            Action::Write(i, n) => self.write(&mut st, i, n),
            Action::TargetWrite(i) => Self::target_write(&mut st, i),
            Action::HelperWrite(i, v) => Self::helper_write(&mut st, i, v),
            Action::Checkpoint(i) => {
                let upto = match st.readers[i].phase {
                    Phase::Written { upto } | Phase::OnHelpers { upto, .. } => upto,
                    Phase::Idle => return None,
                };
                st.readers[i].checkpoint = upto;
                st.readers[i].phase = Phase::Idle;
            }
            Action::Spill => self.spill(&mut st),
            Action::Crash(i) => {
                st.crashes_left -= 1;
                st.readers[i].phase = Phase::Idle;
                st.readers[i].place = None;
            }
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(names::EXACT, |_, st: &State| {
                let counts: Vec<u8> = (0..VALUES).map(|v| st.packed[v] + st.helpers[v].count).collect();
                !quiescent(st) || counts == final_counts()
            }),
            Property::always(names::PACKED_EMPTY, |_, st: &State| st.place != Some(Place::Helpers) || st.packed == [0; VALUES]),
            Property::sometimes(names::EX_REROUTED, |_, st: &State| st.rerouted && quiescent(st)),
        ];
        // A target the older release wrote stays on helpers: it never spills.
        if !self.legacy {
            properties.push(Property::sometimes(names::EX_SPILLED_MID_STREAM, |_, st: &State| st.helper_applied && quiescent(st)));
        }
        properties
    }
}

/// One state on a line.
pub fn describe(st: &State) -> String {
    let reader = |i: usize| {
        let r = &st.readers[i];
        format!("{}: ckpt {} {:?} place {:?}", ["A", "B"][i], r.checkpoint, r.phase, r.place)
    };
    let helper = |v: usize| {
        let h = &st.helpers[v];
        if h.exists {
            format!("H{v}: {} entry A{} B{}", h.count, h.entry[A], h.entry[B])
        } else {
            format!("H{v}: -")
        }
    };
    format!(
        "target place={:?} packed={:?} entry A{} B{} V={} | {} | {} | {} | {}",
        st.place,
        st.packed,
        st.entry[A],
        st.entry[B],
        st.version,
        helper(0),
        helper(1),
        reader(A),
        reader(B)
    )
}
