//! Helper measures packed in the target item, written by a compare-and-swap on a cached image
//! (the plan for issue 27's write cost), checked with `stateright` before it is built.
//!
//! A `max` keeps, per value, how many source items hold it. Packed, those counts are
//! attributes of the target item itself, so the target's ledger makes them exactly once, and
//! the derived attribute (the greatest value with a count above zero) must follow them:
//!
//! * **CAS write.** A reader that holds an image of the item (the item its last write returned)
//!   conditions its ledger write on the item's write counter `V` (`_aggv`) still being the
//!   image's. It then knows the counts exactly and sets the derived value in the same write.
//!   A moved `V` refuses the write; the refusal returns the item, which becomes the image.
//! * **Blind write.** Without an image, the ledger write only adds the counts; the reader
//!   derives from the item it returned, by a derivation write conditioned on `V` as returned.
//! * **A failed derivation** re-reads the item (the refusal returns it) and derives again if
//!   the value is not the counts' (rule `retry`): someone else advanced `V` (a reconcile
//!   write that does not derive, such as a fence-only correction, also advances it).
//! * **A replayed write** whose records the ledger refuses entirely still checks the item it
//!   returned, and derives if the value is not the counts' (rule `check_replay`): the crash
//!   may have fallen between a blind write and its derivation.
//! * Derivation writes advance `V` too.
//!
//! Modelled: one target item (the counts of values 0..[`VALUES`], the derived value, `V`, one
//! ledger entry per source item); source items `A` and `B`, each a fixed sequence of values
//! ([`VERSIONS`]: the value after each record, None once deleted), each read by its own shard
//! reader with its own image, which writes one record or two coalesced; crashes (a reader loses
//! its image and its unfinished batch, and replays from its checkpoint); reconcile writes that
//! advance `V` without deriving; and the reader's steps (write, derive, checkpoint) each their
//! own model step, so any interleaving happens. Seeded bugs ([`PackedBugs`]) switch single
//! rules off.
//!
//! Not modelled: the spill into helper items, two replicas reading one shard at once (the
//! ledger refuses the second, as the main model shows), the cache dropping an image (a crash
//! covers it), reconcile's own corrections of the counts.

use stateright::{Model, Property};

pub use crate::check::{check_all, find_counterexample, Summary};

/// Source items.
pub const ITEMS: usize = 2;
pub const A: usize = 0;
pub const B: usize = 1;
/// Values a measure takes: 0, 1, 2.
pub const VALUES: usize = 3;
/// Each item's value after each of its records: A is inserted at 2, changed to 0 and deleted;
/// B inserted at 1 and deleted.
pub const VERSIONS: [&[Option<u8>]; ITEMS] = [&[Some(2), Some(0), None], &[Some(1), None]];

/// Single rules switched off, each to be found by the checker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PackedBugs {
    /// A replayed write the ledger refuses entirely is taken as done, without a check.
    pub no_replay_check: bool,
    /// The CAS write is not conditioned on `V`: it derives from whatever image it holds.
    pub no_version_condition: bool,
    /// A failed derivation is taken as done ("a later write is responsible").
    pub no_retry: bool,
}

#[derive(Clone, Debug)]
pub struct PackedModel {
    pub crashes: u8,
    /// Reconcile writes that advance `V` without deriving.
    pub bumps: u8,
    pub bugs: PackedBugs,
}

impl Default for PackedModel {
    fn default() -> PackedModel {
        PackedModel { crashes: 1, bumps: 1, bugs: PackedBugs::default() }
    }
}

/// What a write returned of the item: its counter, counts and derived value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Image {
    pub version: u8,
    pub counts: [u8; VALUES],
    pub derived: Option<u8>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Nothing in flight: the next step writes records after the checkpoint.
    #[default]
    Idle,
    /// Written up to `upto`; a derivation conditioned on `V = seen` is due.
    Derive { upto: u8, seen: u8 },
    /// Written (and derived) up to `upto`: the checkpoint is due.
    Written { upto: u8 },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Reader {
    pub checkpoint: u8,
    pub phase: Phase,
    pub image: Option<Image>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The target item.
    pub counts: [u8; VALUES],
    pub derived: Option<u8>,
    pub version: u8,
    pub entry: [u8; ITEMS],
    pub readers: [Reader; ITEMS],
    pub crashes_left: u8,
    pub bumps_left: u8,
    /// Ghost: examples the checks must reach.
    pub stale_cas: bool,
    pub derivation_retried: bool,
    pub replay_derived: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Item `i`'s reader writes its next `n` records.
    Write(usize, u8),
    Derive(usize),
    Checkpoint(usize),
    Crash(usize),
    /// A reconcile write that advances `V` and nothing else.
    Bump,
}

pub mod names {
    pub const COUNTED_ONCE: &str = "the counts are the applied records' values, each once";
    pub const DERIVED: &str = "at quiescence the derived value is the counts' greatest";
    pub const EX_STALE: &str = "a CAS write is refused on a stale image";
    pub const EX_RETRY: &str = "a failed derivation derives again";
    pub const EX_REPLAY: &str = "a refused replay derives";
}

/// The value item `i` holds after `records` of its records (None: none, or deleted).
fn holds(i: usize, records: u8) -> Option<u8> {
    match records {
        0 => None,
        n => VERSIONS[i][usize::from(n) - 1],
    }
}

/// The greatest value with a count above zero.
pub fn greatest(counts: &[u8; VALUES]) -> Option<u8> {
    (0..VALUES).rev().find(|&v| counts[v] > 0).and_then(|v| u8::try_from(v).ok())
}

/// The counts the applied records give: the truth the item must hold.
fn applied_counts(st: &State) -> [u8; VALUES] {
    let mut c = [0; VALUES];
    for i in 0..ITEMS {
        if let Some(v) = holds(i, st.entry[i]) {
            c[usize::from(v)] += 1;
        }
    }
    c
}

/// `counts` moved by item `i` going from `from` to `to` records (saturating: a count the model
/// would take below zero stays at zero, and the exactness property then fails).
fn moved(mut counts: [u8; VALUES], i: usize, from: u8, to: u8) -> [u8; VALUES] {
    if let Some(v) = holds(i, from) {
        counts[usize::from(v)] = counts[usize::from(v)].saturating_sub(1);
    }
    if let Some(v) = holds(i, to) {
        counts[usize::from(v)] += 1;
    }
    counts
}

fn image(st: &State) -> Image {
    Image { version: st.version, counts: st.counts, derived: st.derived }
}

fn quiescent(st: &State) -> bool {
    (0..ITEMS).all(|i| usize::from(st.readers[i].checkpoint) == VERSIONS[i].len() && st.readers[i].phase == Phase::Idle)
}

impl PackedModel {
    fn write(&self, st: &mut State, i: usize, n: u8) {
        let r = st.readers[i];
        let upto = r.checkpoint + n;
        if st.entry[i] >= upto {
            // The ledger refuses every record: a replay. The refusal returns the item.
            st.readers[i].image = Some(image(st));
            let consistent = st.derived == greatest(&st.counts);
            st.readers[i].phase = if consistent || self.bugs.no_replay_check {
                Phase::Written { upto }
            } else {
                st.replay_derived = true;
                Phase::Derive { upto, seen: st.version }
            };
            return;
        }
        // Records at or below the entry are dropped; the rest move the counts.
        let from = st.entry[i].max(r.checkpoint);
        match r.image {
            Some(img) if img.version == st.version || self.bugs.no_version_condition => {
                let counts = moved(img.counts, i, from, upto);
                st.counts = moved(st.counts, i, from, upto);
                st.derived = greatest(&counts);
                st.version += 1;
                st.entry[i] = upto;
                st.readers[i].image = Some(image(st));
                st.readers[i].phase = Phase::Written { upto };
            }
            Some(_) => {
                // Refused on `V`: the refusal's item is the new image; the reader tries again.
                st.stale_cas = true;
                st.readers[i].image = Some(image(st));
            }
            None => {
                st.counts = moved(st.counts, i, from, upto);
                st.version += 1;
                st.entry[i] = upto;
                st.readers[i].image = Some(image(st));
                st.readers[i].phase =
                    if st.derived == greatest(&st.counts) { Phase::Written { upto } } else { Phase::Derive { upto, seen: st.version } };
            }
        }
    }

    fn derive(&self, st: &mut State, i: usize) {
        let Phase::Derive { upto, seen } = st.readers[i].phase else { return };
        if st.version == seen {
            st.derived = greatest(&st.counts);
            st.version += 1;
            st.readers[i].image = Some(image(st));
            st.readers[i].phase = Phase::Written { upto };
            return;
        }
        st.readers[i].image = Some(image(st));
        st.readers[i].phase = if self.bugs.no_retry || st.derived == greatest(&st.counts) {
            Phase::Written { upto }
        } else {
            st.derivation_retried = true;
            Phase::Derive { upto, seen: st.version }
        };
    }
}

impl Model for PackedModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            counts: [0; VALUES],
            derived: None,
            version: 0,
            entry: [0; ITEMS],
            readers: [Reader::default(); ITEMS],
            crashes_left: self.crashes,
            bumps_left: self.bumps,
            stale_cas: false,
            derivation_retried: false,
            replay_derived: false,
        }]
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
                Phase::Derive { .. } => out.push(Action::Derive(i)),
                Phase::Written { .. } => out.push(Action::Checkpoint(i)),
            }
            if st.crashes_left > 0 && (r.phase != Phase::Idle || r.image.is_some()) {
                out.push(Action::Crash(i));
            }
        }
        if st.bumps_left > 0 {
            out.push(Action::Bump);
        }
    }

    fn next_state(&self, prev: &State, action: Action) -> Option<State> {
        let mut st = prev.clone();
        match action {
            Action::Write(i, n) => self.write(&mut st, i, n),
            Action::Derive(i) => self.derive(&mut st, i),
            Action::Checkpoint(i) => {
                let Phase::Written { upto } = st.readers[i].phase else { return None };
                st.readers[i].checkpoint = upto;
                st.readers[i].phase = Phase::Idle;
            }
            Action::Crash(i) => {
                st.crashes_left -= 1;
                st.readers[i].phase = Phase::Idle;
                st.readers[i].image = None;
            }
            Action::Bump => {
                st.bumps_left -= 1;
                st.version += 1;
            }
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(names::COUNTED_ONCE, |_, st: &State| st.counts == applied_counts(st)),
            Property::always(names::DERIVED, |_, st: &State| !quiescent(st) || st.derived == greatest(&st.counts)),
            Property::sometimes(names::EX_STALE, |_, st: &State| st.stale_cas),
            Property::sometimes(names::EX_RETRY, |_, st: &State| st.derivation_retried),
            Property::sometimes(names::EX_REPLAY, |_, st: &State| st.replay_derived),
        ]
    }
}

/// One state on a line.
pub fn describe(st: &State) -> String {
    let reader = |i: usize| {
        let r = &st.readers[i];
        let img = r.image.map_or("-".to_string(), |m| format!("V{} {:?} d{:?}", m.version, m.counts, m.derived));
        format!("{}: ckpt {} {:?} image[{img}]", ["A", "B"][i], r.checkpoint, r.phase)
    };
    format!(
        "item counts={:?} derived={:?} V={} entry A{} B{} | {} | {}",
        st.counts,
        st.derived,
        st.version,
        st.entry[A],
        st.entry[B],
        reader(A),
        reader(B)
    )
}
