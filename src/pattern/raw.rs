//! Matching straight from a record's JSON text, without building a tree per record.
//!
//! The fields that patterns name form a tree of field names ([`Trie`]). One pass over the text
//! descends into named fields only: every other value is skipped unbuilt, and the scalars found
//! at named paths are kept, strings borrowed from the text where they hold no escape. The
//! patterns are then evaluated over what was kept. The pass is a strict scanner of our own
//! ([`fast`]); wherever it declines (the text is not JSON, or holds something it leaves to
//! serde_json), the text is parsed into a tree and matched as such. So a text is valid here
//! exactly when `serde_json::from_str::<Value>` accepts it, with serde_json's own error when
//! not, and the result equals [`super::Pattern::matches`] on the parsed tree:
//! - arrays fan out and objects are not values, as in the tree walk;
//! - an event key with dots stands for its segments (`"a.b"` is `a` then `b`);
//! - a named field given twice in one object (JSON allows it; a parsed tree keeps the last)
//!   makes the scan give up, and the record is parsed and matched as a tree instead.

use std::borrow::Cow;

use serde_json::Value;
use smallvec::SmallVec;

use super::matcher::Scalar;
use super::{Pattern, PatternSet};
use crate::decimal::Decimal;

/// The key serde_json (with `arbitrary_precision`) gives a number's text under: a parsed tree
/// reads an object that starts with it as a number, so the scanner leaves such texts to it.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Named paths as a tree of field names; node 0 is the root.
#[derive(Debug, Clone)]
struct Trie {
    nodes: Vec<TrieNode>,
}

#[derive(Debug, Clone, Default)]
struct TrieNode {
    children: Vec<(Box<str>, u32)>,
    /// The id of the path that ends here, if any.
    path: Option<u32>,
}

impl Trie {
    fn new() -> Trie {
        Trie { nodes: vec![TrieNode::default()] }
    }

    /// The id of `path` (ids count up from 0 in the order paths are first added).
    fn insert(&mut self, path: &[Box<str>], next_id: &mut u32) -> u32 {
        let mut node = 0;
        for seg in path {
            node = match self.child(node, seg) {
                Some(c) => c,
                None => {
                    let c = self.node_count();
                    self.nodes.push(TrieNode::default());
                    self.nodes[node as usize].children.push((seg.clone(), c));
                    c
                }
            };
        }
        *self.nodes[node as usize].path.get_or_insert_with(|| {
            let id = *next_id;
            *next_id += 1;
            id
        })
    }

    fn node_count(&self) -> u32 {
        u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)
    }

    fn child(&self, node: u32, name: &str) -> Option<u32> {
        self.nodes[node as usize].children.iter().find(|(n, _)| &**n == name).map(|&(_, c)| c)
    }

    /// The node an event key leads to from `node`: a key with dots walks one segment per part
    /// (names never hold a dot, so at most one child can begin a dotted key).
    fn key(&self, node: u32, key: &str) -> Option<u32> {
        let k = key.as_bytes();
        for (name, c) in &self.nodes[node as usize].children {
            let n = name.as_bytes();
            if k.len() == n.len() {
                if k == n {
                    return Some(*c);
                }
            } else if k.len() > n.len() && k[n.len()] == b'.' && k.starts_with(n) {
                return self.key(*c, &key[n.len() + 1..]);
            }
        }
        None
    }
}

mod fast;

/// A scalar found at a named path.
#[derive(Debug)]
enum Found<'de> {
    Str(Cow<'de, str>),
    Num(Option<Decimal>),
    Bool(bool),
    Null,
}

impl Found<'_> {
    fn scalar(&self) -> Scalar<'_> {
        match self {
            Found::Str(s) => Scalar::Str(s),
            Found::Num(n) => Scalar::Num(*n),
            Found::Bool(b) => Scalar::Bool(*b),
            Found::Null => Scalar::Null,
        }
    }
}

/// What one pass over a record kept: (path id, scalar) in the order met.
pub(super) struct Scanned<'de> {
    found: Kept<'de>,
}

impl<'de> Scanned<'de> {
    fn new(found: Kept<'de>) -> Scanned<'de> {
        Scanned { found }
    }
}

/// Scalars kept by a scan: a stream record's patterns name a handful.
type Kept<'de> = SmallVec<[(u32, Found<'de>); 8]>;

impl Scanned<'_> {
    /// The values found at path `id`.
    pub(super) fn at(&self, id: u32) -> impl Iterator<Item = Scalar<'_>> {
        self.found.iter().filter(move |(i, _)| *i == id).map(|(_, v)| v.scalar())
    }
}

/// The scan could not decide from the text alone (a named field given twice in one object).
struct Ambiguous;

/// One pattern within a [`RawMatcher`]: which set it belongs to, and its path ids in the
/// matcher's trie (indexed by the pattern's own path ids).
#[derive(Debug, Clone)]
struct Entry {
    set: usize,
    pattern: Pattern,
    ids: Box<[u32]>,
}

/// Several pattern sets (one per rule, say) matched together from raw JSON: one pass over
/// the text serves them all.
#[derive(Debug, Clone)]
pub struct RawMatcher {
    trie: Trie,
    entries: Vec<Entry>,
    sets: usize,
}

impl RawMatcher {
    /// A matcher for `sets`; [`Self::matching`] answers in the same order.
    pub fn new<'a>(sets: impl IntoIterator<Item = &'a PatternSet>) -> RawMatcher {
        let mut trie = Trie::new();
        let mut next_id = 0;
        let mut entries = Vec::new();
        let mut count = 0;
        for (set, patterns) in sets.into_iter().enumerate() {
            count = set + 1;
            for pattern in patterns.patterns() {
                let ids = pattern.paths.iter().map(|p| trie.insert(p, &mut next_id)).collect();
                entries.push(Entry { set, pattern: pattern.clone(), ids });
            }
        }
        RawMatcher { trie, entries, sets: count }
    }

    /// Which sets match the record `text`. Err: `text` is not JSON (serde_json's own error,
    /// as `serde_json::from_str` gives it).
    pub fn matching(&self, text: &str) -> Result<Matched, serde_json::Error> {
        let mut out = Matched::new(self.sets);
        match fast::scan(&self.trie, text) {
            Ok(Ok(scanned)) => {
                for e in &self.entries {
                    if !out.get(e.set) && e.pattern.root.matches_scanned(&scanned, &e.ids) {
                        out.set(e.set);
                    }
                }
            }
            // Parsed as a tree: for the answer, or for the error as `from_str` words it.
            Ok(Err(Ambiguous)) | Err(fast::Declined) => {
                let tree: Value = serde_json::from_str(text)?;
                for e in &self.entries {
                    if !out.get(e.set) && e.pattern.root.matches(&tree) {
                        out.set(e.set);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The sets a record matched, by their index in [`RawMatcher::new`]'s list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    words: SmallVec<[u64; 1]>,
}

impl Matched {
    fn new(sets: usize) -> Matched {
        Matched { words: SmallVec::from_elem(0, sets.div_ceil(64).max(1)) }
    }

    fn set(&mut self, i: usize) {
        if let Some(w) = self.words.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }

    /// Whether set `i` matched.
    pub fn get(&self, i: usize) -> bool {
        self.words.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// How many sets matched.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

impl Pattern {
    /// [`Pattern::matches`] from the record's JSON text, without parsing it into a tree. Err:
    /// `text` is not JSON. For many records, build a [`RawMatcher`] once instead.
    pub fn matches_json(&self, text: &str) -> Result<bool, serde_json::Error> {
        let set = PatternSet::new(vec![self.clone()]);
        Ok(RawMatcher::new([&set]).matching(text)?.get(0))
    }
}
