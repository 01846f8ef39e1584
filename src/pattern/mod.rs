//! The AWS filter-pattern language, as Lambda applies it to DynamoDB stream records.
//!
//! A pattern is compiled once ([`Pattern::compile`]) into a flat list of leaves (a dotted path
//! and the matchers for the values found there) plus `$or` groups. Matching walks the event
//! along each leaf's path without allocating: arrays fan out, `a.b` in a pattern or an event
//! key is the same as nesting `a` then `b` (EventBridge's flattening), and a leaf's values are
//! only the scalars found at the exact path (objects are not values, so `exists` works on
//! leaves only).
//!
//! [`RawMatcher`] matches from a record's JSON text instead, reading only the fields that
//! patterns name (`test-pattern`, the pipeline bench, the conformance suite); its answer is
//! the tree walk's on the parsed text.

mod compile;
mod matcher;
mod raw;

use serde_json::Value;

pub use compile::PatternError;
use matcher::Matcher;
pub use raw::{Matched, RawMatcher};

/// Options that change how values compare.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PatternOptions {
    /// Compare DynamoDB `N` (and `NS`) string values with numeric operators and numeric
    /// literals, exactly as decimals. Lambda never does this; off by default.
    pub numeric_strings: bool,
}

/// One compiled pattern.
#[derive(Debug, Clone)]
pub struct Pattern {
    root: Node,
    /// The distinct leaf paths, indexed by [`Leaf::id`].
    paths: Box<[Box<[Box<str>]>]>,
}

/// Several patterns: an event passes if any matches (Lambda's list of filters).
#[derive(Debug, Clone)]
pub struct PatternSet {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone, Default)]
struct Node {
    leaves: Vec<Leaf>,
    /// Each group: at least one alternative must match.
    ors: Vec<Vec<Node>>,
}

#[derive(Debug, Clone)]
struct Leaf {
    path: Box<[Box<str>]>,
    /// The index of `path` in its pattern's [`Pattern::paths`].
    id: u32,
    /// Value matchers (everything but `exists`).
    matchers: Box<[Matcher]>,
    exists_true: bool,
    exists_false: bool,
    /// String values here are DynamoDB numbers (`numeric_strings` and a path ending in N/NS).
    numeric_strings: bool,
}

impl Pattern {
    /// Compiles a pattern given as JSON. Errors name the path of the offending part.
    pub fn compile(pattern: &Value, options: PatternOptions) -> Result<Pattern, PatternError> {
        compile::compile(pattern, options)
    }

    /// Parses JSON text (duplicate keys: the last one wins, as in AWS) and compiles it.
    pub fn parse(text: &str, options: PatternOptions) -> Result<Pattern, PatternError> {
        let value: Value = serde_json::from_str(text).map_err(|e| PatternError::new("", format!("not valid JSON: {e}")))?;
        Pattern::compile(&value, options)
    }

    pub fn matches(&self, event: &Value) -> bool {
        let hit = self.root.matches(event);
        // Every unit test that matches a tree also checks the matcher over text against it.
        #[cfg(test)]
        tests::same_from_text(self, event, hit);
        hit
    }
}

impl PatternSet {
    pub fn new(patterns: Vec<Pattern>) -> PatternSet {
        PatternSet { patterns }
    }

    /// Accepts one pattern object or a non-empty array of them.
    pub fn compile(value: &Value, options: PatternOptions) -> Result<PatternSet, PatternError> {
        match value {
            Value::Array(items) => {
                if items.is_empty() {
                    return Err(PatternError::new(
                        "",
                        "an empty list of patterns matches nothing; leave the filter out to match everything",
                    ));
                }
                let mut patterns = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    patterns.push(Pattern::compile(item, options).map_err(|e| e.within(&format!("[{i}]")))?);
                }
                Ok(PatternSet { patterns })
            }
            other => Ok(PatternSet { patterns: vec![Pattern::compile(other, options)?] }),
        }
    }

    pub fn matches(&self, event: &Value) -> bool {
        self.patterns.iter().any(|p| p.matches(event))
    }

    pub fn patterns(&self) -> &[Pattern] {
        &self.patterns
    }
}

impl Node {
    fn matches(&self, event: &Value) -> bool {
        self.leaves.iter().all(|leaf| leaf.matches(event)) && self.ors.iter().all(|group| group.iter().any(|alt| alt.matches(event)))
    }

    /// [`Self::matches`] over what a [`raw`] scan kept; `ids` maps the pattern's path ids to
    /// the scan's.
    fn matches_scanned(&self, scanned: &raw::Scanned<'_>, ids: &[u32]) -> bool {
        self.leaves.iter().all(|leaf| leaf.matches_scanned(scanned, ids))
            && self.ors.iter().all(|group| group.iter().any(|alt| alt.matches_scanned(scanned, ids)))
    }

    /// Gives each leaf the id of its path in `paths`, adding paths not seen yet.
    fn number_paths(&mut self, paths: &mut Vec<Box<[Box<str>]>>) {
        for leaf in &mut self.leaves {
            let at = paths.iter().position(|p| *p == leaf.path).unwrap_or_else(|| {
                paths.push(leaf.path.clone());
                paths.len() - 1
            });
            leaf.id = u32::try_from(at).unwrap_or(u32::MAX);
        }
        for alt in self.ors.iter_mut().flatten() {
            alt.number_paths(paths);
        }
    }
}

impl Leaf {
    fn matches(&self, event: &Value) -> bool {
        let mut found = false;
        let hit = walk(event, &self.path, &mut |v| {
            found = true;
            self.exists_true || self.matchers.iter().any(|m| m.matches(v, self.numeric_strings))
        });
        hit || (self.exists_false && !found)
    }

    fn matches_scanned(&self, scanned: &raw::Scanned<'_>, ids: &[u32]) -> bool {
        let Some(&id) = ids.get(self.id as usize) else { return false };
        let mut found = false;
        for v in scanned.at(id) {
            found = true;
            if self.exists_true || self.matchers.iter().any(|m| m.matches_scalar(&v, self.numeric_strings)) {
                return true;
            }
        }
        self.exists_false && !found
    }
}

/// Visits the scalar values at `path`; stops and returns true as soon as `f` does.
fn walk<'v>(value: &'v Value, path: &[Box<str>], f: &mut dyn FnMut(&'v Value) -> bool) -> bool {
    let Some((seg, rest)) = path.split_first() else {
        return match value {
            Value::Array(items) => items.iter().any(|item| walk(item, path, f)),
            Value::Object(_) => false,
            scalar => f(scalar),
        };
    };
    match value {
        Value::Object(map) => {
            if let Some(child) = map.get(&**seg) {
                if walk(child, rest, f) {
                    return true;
                }
            }
            if !rest.is_empty() {
                // Event keys that contain dots stand for several pattern segments.
                for (key, child) in map {
                    if key.len() > seg.len() && key.as_bytes()[seg.len()] == b'.' && key.starts_with(&**seg) {
                        if let Some(consumed) = dotted_key_consumes(key, path) {
                            if walk(child, &path[consumed..], f) {
                                return true;
                            }
                        }
                    }
                }
            }
            false
        }
        Value::Array(items) => items.iter().any(|item| walk(item, path, f)),
        _ => false,
    }
}

/// If `key` is `path[0].path[1]...path[j]` (j >= 1), the number of segments it covers.
fn dotted_key_consumes(key: &str, path: &[Box<str>]) -> Option<usize> {
    let mut rest = key;
    for (i, seg) in path.iter().enumerate() {
        rest = rest.strip_prefix(&**seg)?;
        if rest.is_empty() {
            return (i >= 1).then_some(i + 1);
        }
        rest = rest.strip_prefix('.')?;
    }
    None
}

#[cfg(test)]
mod tests;
