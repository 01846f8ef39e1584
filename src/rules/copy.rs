//! Copy rules (pure): what one change of a source item does to its copies, where the copies
//! are, and the version that orders the writes (DESIGN.md section 2, "Copies kept in sync").
//!
//! A source change that a copy rule acts on writes the rule's whole set of copy attributes, as
//! of that change, onto every item the rule's `to` finds: attributes the source has are set,
//! the others removed. Any one write is therefore complete on its own, and only the newest
//! matters. Each write is conditioned on the item's recorded [`Version`] being older, so a
//! replayed, retried or late record never wins over a newer one; a deleted source removes the
//! copies and leaves its version behind as a tombstone.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use super::record::{attribute, EventName, StreamRecord};
use super::template::{ExpandError, Template, VarValue};
use super::{Poison, PoisonCode, MAX_PARTITION_KEY_BYTES, MAX_SORT_KEY_BYTES};
use crate::pattern::PatternSet;

pub mod job;

/// The attribute on a copy item that records, for one rule, the source change its copies came
/// from: `_aggc:<rule>` (rule names are letters, digits, `_ - .`).
pub const VERSION_PREFIX: &str = "_aggc:";

/// The name of rule `rule`'s version attribute on its copy items.
pub fn version_attribute(rule: &str) -> String {
    format!("{VERSION_PREFIX}{rule}")
}

/// Digits of a sequence number in a [`Version`]: the Streams API allows 21 to 40.
pub const SEQUENCE_DIGITS: usize = 40;
/// Digits of a shard's creation time in a [`Version`], as in shard ids.
const CREATED_DIGITS: usize = 20;

/// One copy attribute: the name on the items `to` finds, and the source attribute it copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyAttribute {
    pub copy: String,
    pub source: String,
}

/// A sort-key condition of `to`.
#[derive(Debug, Clone)]
pub enum SortCondition {
    Equals(Template),
    BeginsWith(Template),
}

/// How a copy rule finds the items holding its copies: one partition of the table (read
/// strongly consistent) or of a global secondary index (eventually consistent), optionally
/// narrowed by a sort-key condition.
#[derive(Debug, Clone)]
pub struct Finder {
    pub index: Option<String>,
    pub partition: (String, Template),
    pub sort: Option<(String, SortCondition)>,
}

/// A `copy` rule, validated.
#[derive(Debug, Clone)]
pub struct CopyRule {
    pub name: Arc<str>,
    pub filter: Option<PatternSet>,
    /// Key attribute -> capturing template, partition key first.
    pub source_key: Vec<(String, Template)>,
    pub attributes: Vec<CopyAttribute>,
    pub to: Finder,
    /// Items one change writes in its batch (`copy.inline_items`); the rest of its fan-out
    /// is a persisted job ([`job`]).
    pub inline_items: usize,
    /// Write capacity units per second one job spends (`copy.job_capacity_per_second`).
    pub job_capacity_per_second: f64,
    /// What the rule writes, as canonical JSON (filter, source_key, attributes, to): committed
    /// with the rule definitions ([`definitions`]).
    pub definition: Arc<str>,
}

/// The copy rules as committed with the rule definitions (`name NUL definition`, by name);
/// None without copy rules.
pub fn definitions(rules: &[CopyRule]) -> Option<String> {
    let mut pairs: Vec<(&str, &str)> = rules.iter().map(|r| (&*r.name, &*r.definition)).collect();
    pairs.sort_unstable();
    (!pairs.is_empty()).then(|| pairs.iter().map(|(n, d)| format!("{n}\u{0}{d}")).collect::<Vec<_>>().join("\u{0}"))
}

/// A rendered sort-key condition.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SortValue {
    Equals(String),
    BeginsWith(String),
}

/// The query that finds one source item's copies.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct FindQuery {
    pub index: Option<String>,
    pub partition: (String, String),
    pub sort: Option<(String, SortValue)>,
}

/// The order of one source item's changes: the creation time of the stream shard its record
/// came from, then the record's sequence number as a number.
///
/// DynamoDB Streams orders one item's records within a shard by sequence number, and a later
/// shard of the item's lineage (a child after a split or a rollover, or a shard of a re-enabled
/// stream) is created after the one before it; an item is in one shard at a time. AWS does
/// not say that sequence numbers compare across shards, so they are compared only after the
/// creation times. ApproximateCreationDateTime is whole seconds, too coarse to order anything.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    shard_created_ms: u64,
    /// The sequence number without leading zeros, left-padded to [`SEQUENCE_DIGITS`].
    sequence: String,
}

impl serde::Serialize for Version {
    fn serialize<Ser: serde::Serializer>(&self, s: Ser) -> Result<Ser::Ok, Ser::Error> {
        s.serialize_str(&self.text())
    }
}

impl<'de> serde::Deserialize<'de> for Version {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Version, D::Error> {
        let text = String::deserialize(d)?;
        Version::parse(&text).ok_or_else(|| serde::de::Error::custom(format!("not a copy version: {text:?}")))
    }
}

/// Why a record has no usable [`Version`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionError {
    Missing,
    NotDigits,
    TooLong(usize),
}

impl fmt::Display for VersionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionError::Missing => write!(f, "dynamodb.SequenceNumber is missing: a copy rule orders a source's changes by it"),
            VersionError::NotDigits => write!(f, "dynamodb.SequenceNumber must be a string of digits"),
            VersionError::TooLong(n) => {
                write!(f, "dynamodb.SequenceNumber has {n} significant digits; the Streams API allows {SEQUENCE_DIGITS}")
            }
        }
    }
}

impl Version {
    pub fn new(shard_created_ms: u64, sequence_number: &str) -> Result<Version, VersionError> {
        if sequence_number.is_empty() {
            return Err(VersionError::Missing);
        }
        if !sequence_number.bytes().all(|b| b.is_ascii_digit()) {
            return Err(VersionError::NotDigits);
        }
        let digits = sequence_number.trim_start_matches('0');
        if digits.len() > SEQUENCE_DIGITS {
            return Err(VersionError::TooLong(digits.len()));
        }
        Ok(Version { shard_created_ms, sequence: format!("{digits:0>SEQUENCE_DIGITS$}") })
    }

    /// The stored form, `<creation ms, 20 digits>.<sequence number, 40 digits>`: fixed width, so
    /// DynamoDB's string comparison (`<` in a condition) orders versions as [`Ord`] does.
    pub fn text(&self) -> String {
        format!("{:0>CREATED_DIGITS$}.{}", self.shard_created_ms, self.sequence)
    }

    /// The record's sequence number (without leading zeros).
    pub fn sequence_number(&self) -> &str {
        let digits = self.sequence.trim_start_matches('0');
        if digits.is_empty() {
            "0"
        } else {
            digits
        }
    }

    /// A stored form read back; None for anything [`Version::text`] does not write.
    pub fn parse(text: &str) -> Option<Version> {
        let (created, sequence) = text.split_once('.')?;
        let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(created, CREATED_DIGITS) || !digits(sequence, SEQUENCE_DIGITS) {
            return None;
        }
        Some(Version { shard_created_ms: created.parse().ok()?, sequence: sequence.to_string() })
    }
}

/// What one source change does to the rule's copies: on every item `find` returns, set `set`,
/// remove the rule's other copy attributes, and record `version`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CopyChange {
    /// The source item's key, typed as in `dynamodb.Keys` (a found item with this key is the
    /// source itself and is never written).
    pub source: BTreeMap<String, Value>,
    pub find: FindQuery,
    /// Copy attribute -> typed value (`{"S": "Ann"}`), in the rule's order.
    pub set: Vec<(String, Value)>,
    pub remove: Vec<String>,
    pub version: Version,
    /// The source was deleted: the copies go, and the version stays as a tombstone.
    pub deleted: bool,
    /// The source's copied attributes after the change, in the rule's order (None: absent).
    pub snapshot: Vec<Option<Value>>,
}

impl CopyChange {
    /// Whether the source still holds what this change copies (`current`: [`CopyRule::current`]).
    /// A fan-out writes a page only then: otherwise a newer change of the source exists, and a
    /// writer that lost its lease and woke up late must not put this change's values on items
    /// that carry no version yet (an item the application created after the newer change).
    pub fn still_current(&self, current: &[Option<Value>]) -> bool {
        self.snapshot == current
    }
}

impl CopyRule {
    /// Whether the record passes this rule's filter (no filter: every record).
    pub fn filter_matches(&self, record: &Value) -> bool {
        self.filter.as_ref().is_none_or(|f| f.matches(record))
    }

    /// The change `record` makes to this rule's copies: None for an item the rule's
    /// `source_key` does not capture, and for a record that changes no copied attribute (an
    /// INSERT counts as a change from none; a new source without copied attributes has no
    /// copies to set, and older changes are refused by the tombstone of its delete). A REMOVE
    /// always writes: its version is the tombstone. `shard_created_ms` is the creation time of
    /// the shard the record came from (None: its id says none, and the record cannot be
    /// ordered against the records of other shards: poison).
    pub fn change(&self, record: &StreamRecord<'_>, shard_created_ms: Option<u64>) -> Result<Option<CopyChange>, Poison> {
        let Some(captures) = self.capture(record.keys) else { return Ok(None) };
        let poison = |code, message: String| Poison {
            code,
            rule: Some(self.name.clone()),
            message,
            variables: captures.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        let none = || vec![None; self.attributes.len()];
        let new = record.new_image.map_or_else(none, |image| self.snapshot(image));
        let old = record.old_image.map_or_else(none, |image| self.snapshot(image));
        if record.event_name != EventName::Remove && new == old {
            return Ok(None);
        }
        let created = shard_created_ms.ok_or_else(|| {
            poison(
                PoisonCode::MalformedRecord,
                "the record's shard id carries no creation time, which orders a source's changes across shards".into(),
            )
        })?;
        let version =
            Version::new(created, record.sequence_number.unwrap_or("")).map_err(|e| poison(PoisonCode::MalformedRecord, e.to_string()))?;
        let find = self.find_query(&captures).map_err(|(code, m)| poison(code, m))?;
        let (mut set, mut remove) = (Vec::new(), Vec::new());
        for (a, value) in self.attributes.iter().zip(&new) {
            match value {
                Some(v) => set.push((a.copy.clone(), v.clone())),
                None => remove.push(a.copy.clone()),
            }
        }
        let source = record.keys.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Ok(Some(CopyChange { source, find, set, remove, version, deleted: record.event_name == EventName::Remove, snapshot: new }))
    }

    /// The query that finds the copies of the source item with these keys (None: the rule's
    /// `source_key` does not capture them).
    pub fn find_for(&self, keys: &serde_json::Map<String, Value>) -> Option<FindQuery> {
        self.find_query(&self.capture(keys)?).ok()
    }

    /// The copied attributes of a source item as read from the table (None: it does not exist).
    pub fn current(&self, item: Option<&serde_json::Map<String, Value>>) -> Vec<Option<Value>> {
        match item {
            Some(i) => self.snapshot(&Value::Object(i.clone())),
            None => vec![None; self.attributes.len()],
        }
    }

    /// The source attributes this rule copies, each once (two copies of one attribute would
    /// name one document path twice in a projection, which DynamoDB refuses).
    pub fn source_attributes(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(self.attributes.len());
        for a in &self.attributes {
            if !out.contains(&a.source) {
                out.push(a.source.clone());
            }
        }
        out
    }

    /// The variables `source_key` captures from the record's keys, or None if it does not
    /// capture them (the item is not one of this rule's sources).
    fn capture<'r>(&self, keys: &'r serde_json::Map<String, Value>) -> Option<Vec<(&str, &'r str)>> {
        let mut captures = Vec::with_capacity(4);
        for (attr, template) in &self.source_key {
            let value = match keys.get(attr).and_then(|v| attribute_of(v)) {
                Some(("S" | "N", Value::String(s))) => s.as_str(),
                _ => return None,
            };
            if !template.capture(value, &mut captures) {
                return None;
            }
        }
        let agree = captures.iter().enumerate().all(|(i, (n, v))| captures[..i].iter().all(|(m, w)| m != n || w == v));
        agree.then_some(captures)
    }

    /// The copied attributes' values in `image`, in the rule's order.
    fn snapshot(&self, image: &Value) -> Vec<Option<Value>> {
        self.attributes.iter().map(|a| image.get(&a.source).filter(|_| attribute(image, &a.source).is_some()).cloned()).collect()
    }

    fn find_query(&self, captures: &[(&str, &str)]) -> Result<FindQuery, (PoisonCode, String)> {
        let lookup = |name: &str| captures.iter().find(|(n, _)| *n == name).map(|(_, v)| VarValue::Str(v));
        let render = |at: String, t: &Template, limit: usize| -> Result<String, (PoisonCode, String)> {
            let value = t.expand(lookup).map_err(|e| expand_error(&at, e))?;
            if value.len() > limit {
                return Err((PoisonCode::KeyTooLong, format!("{at}: expanded key is {} bytes, DynamoDB allows {limit}", value.len())));
            }
            Ok(value)
        };
        let (pk_name, pk) = &self.to.partition;
        let partition = (pk_name.clone(), render(format!("copy.to.{pk_name}"), pk, MAX_PARTITION_KEY_BYTES)?);
        if partition.1.is_empty() {
            return Err((PoisonCode::EmptyKeyPart, format!("copy.to.{pk_name}: expands to an empty key")));
        }
        let sort = match &self.to.sort {
            None => None,
            Some((name, SortCondition::Equals(t))) => {
                Some((name.clone(), SortValue::Equals(render(format!("copy.to.{name}"), t, MAX_SORT_KEY_BYTES)?)))
            }
            Some((name, SortCondition::BeginsWith(t))) => {
                Some((name.clone(), SortValue::BeginsWith(render(format!("copy.to.{name}_begins_with"), t, MAX_SORT_KEY_BYTES)?)))
            }
        };
        Ok(FindQuery { index: self.to.index.clone(), partition, sort })
    }
}

/// A `to` template that cannot expand (its variables are the source key's captures, so only a
/// capture of an odd shape gets here).
fn expand_error(at: &str, e: ExpandError) -> (PoisonCode, String) {
    match e {
        ExpandError::Missing(name) => (PoisonCode::MissingVariable, format!("{at}: variable {{{name}}} is not captured")),
        ExpandError::Empty(name) => (PoisonCode::EmptyKeyPart, format!("{at}: variable {{{name}}} is empty")),
        ExpandError::Delimiter(name) => (PoisonCode::KeyDelimiter, format!("{at}: variable {{{name}}} contains the key delimiter '#'")),
        ExpandError::BadTimestamp { name, why } => (PoisonCode::BadTimestamp, format!("{at}: variable {{{name}}}: {why}")),
    }
}

/// A table's keys as DescribeTable gives them: the table's (partition key first), and each
/// global secondary index's by name.
#[derive(Debug, Clone, Default)]
pub struct TableKeys {
    pub table: Vec<String>,
    pub indexes: Vec<(String, Vec<String>)>,
    /// Key attributes (of the table or an index) whose type is not S.
    pub not_text: Vec<String>,
    /// Indexes that project only some attributes, with the non-key ones they project (an
    /// index that projects everything is not here).
    pub partial: Vec<(String, Vec<String>)>,
}

/// Checks a copy rule's `to` against the table it queries: the key attributes it names are
/// the table's (or the index's), partition key first. The message says what to change.
pub fn check_table(rule: &CopyRule, keys: &TableKeys, table: &str) -> Result<(), String> {
    let (what, names) = match &rule.to.index {
        None => (format!("table {table}"), keys.table.as_slice()),
        Some(i) => match keys.indexes.iter().find(|(n, _)| n == i) {
            Some((_, names)) => (format!("index {i} of table {table}"), names.as_slice()),
            None => {
                let known: Vec<&str> = keys.indexes.iter().map(|(n, _)| n.as_str()).collect();
                return Err(format!(
                    "rule {}: copy.to names index {i}, which table {table} does not have (its global secondary indexes: {known:?})",
                    rule.name
                ));
            }
        },
    };
    let pk_ok = names.first() == Some(&rule.to.partition.0);
    let sk_ok = rule.to.sort.as_ref().is_none_or(|(sk, _)| names.get(1) == Some(sk));
    if !pk_ok || !sk_ok {
        return Err(format!(
            "rule {}: copy.to's key attributes are not those of {what}: its keys are {names:?} (partition key first)",
            rule.name
        ));
    }
    let used = std::iter::once(&rule.to.partition.0).chain(rule.to.sort.as_ref().map(|(k, _)| k));
    if let Some(k) = used.into_iter().find(|k| keys.not_text.contains(k)) {
        return Err(format!("rule {}: copy.to's key attribute {k} is not of type S in {what}: templates make text keys", rule.name));
    }
    // A fan-out reads each copy's version through the index, and reconcile its copies too.
    let projected = rule.to.index.as_ref().and_then(|i| keys.partial.iter().find(|(n, _)| n == i));
    if let Some((index, projected)) = projected {
        let needed = std::iter::once(version_attribute(&rule.name)).chain(rule.attributes.iter().map(|a| a.copy.clone()));
        let missing: Vec<String> = needed.filter(|a| !projected.contains(a)).collect();
        if !missing.is_empty() {
            return Err(format!(
                "rule {}: index {index} of table {table} does not project {missing:?}: a fan-out reads each copy's version through it, and reconcile its copies; project ALL, or INCLUDE these",
                rule.name
            ));
        }
    }
    Ok(())
}

/// `{"S": "x"}` -> ("S", "x").
fn attribute_of(typed: &Value) -> Option<(&str, &Value)> {
    let m = typed.as_object()?;
    (m.len() == 1).then(|| m.iter().next().map(|(t, v)| (t.as_str(), v)))?
}

/// The changes of one batch, the newest per (rule, source item), each with the record it came
/// from (for a dead letter): each change is complete, so the older ones need not be written.
#[derive(Debug, Clone, Default)]
pub struct CopyBatch {
    changes: BTreeMap<(usize, String), (CopyChange, Value)>,
}

impl CopyBatch {
    pub fn add(&mut self, rule: usize, change: CopyChange, record: &Value) {
        let source = serde_json::to_string(&change.source).unwrap_or_default();
        match self.changes.entry((rule, source)) {
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert((change, record.clone()));
            }
            std::collections::btree_map::Entry::Occupied(mut e) => {
                if change.version > e.get().0.version {
                    e.insert((change, record.clone()));
                }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    pub fn len(&self) -> usize {
        self.changes.len()
    }

    /// (rule index, change, its record), by rule and source key.
    pub fn into_changes(self) -> impl Iterator<Item = (usize, CopyChange, Value)> {
        self.changes.into_iter().map(|((rule, _), (c, r))| (rule, c, r))
    }
}

/// What one copy item holds of one rule: its copy attributes and the version they came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyState {
    pub values: BTreeMap<String, Value>,
    pub version: Option<String>,
}

impl CopyState {
    /// Whether a write of `change` goes through: the item records no version of this rule, or
    /// an older one (the write's condition).
    pub fn accepts(&self, change: &CopyChange) -> bool {
        self.version.as_deref().is_none_or(|v| v < change.version.text().as_str())
    }

    /// The conditional write of `change`: true if it went through.
    pub fn apply(&mut self, change: &CopyChange) -> bool {
        if !self.accepts(change) {
            return false;
        }
        for name in &change.remove {
            self.values.remove(name);
        }
        for (name, value) in &change.set {
            self.values.insert(name.clone(), value.clone());
        }
        self.version = Some(change.version.text());
        true
    }
}

/// The rule of DESIGN.md's example for unit tests: `name` copies `attributes` (copy, source)
/// from `CUST#{customer}` / `PROFILE` onto the customer's `ORDER#` items.
#[cfg(test)]
pub(crate) fn example(name: &str, attributes: &[(&str, &str)]) -> CopyRule {
    let t = |s: &str| Template::parse(s).unwrap_or_else(|e| panic!("{s}: {e:?}"));
    CopyRule {
        name: name.into(),
        filter: None,
        source_key: vec![("PK".into(), t("CUST#{customer}")), ("SK".into(), t("PROFILE"))],
        attributes: attributes.iter().map(|(c, s)| CopyAttribute { copy: c.to_string(), source: s.to_string() }).collect(),
        to: Finder {
            index: None,
            partition: ("PK".into(), t("CUST#{customer}")),
            sort: Some(("SK".into(), SortCondition::BeginsWith(t("ORDER#")))),
        },
        inline_items: 100,
        job_capacity_per_second: 500.0,
        definition: "{}".into(),
    }
}

#[cfg(test)]
mod tests;
