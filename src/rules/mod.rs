//! Rules: which records matter, what each one changes, and by how much.
//!
//! For every record and every rule whose filter matches, the old and the new image each
//! contribute values to attributes of a target item; the record's delta is new minus old.
//! Everything here is exact decimal arithmetic, and anything a rule cannot evaluate is a
//! [`Poison`] naming the rule, the measure and the attribute, never a silent zero.

pub mod coalesce;
pub mod copy;
pub mod fingerprint;
pub mod helper;
pub mod item;
pub mod record;
pub mod shards;
pub mod template;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use crate::decimal::{Decimal, DecimalError};
use crate::pattern::{Pattern, PatternSet};
pub use coalesce::{values_of, Coalescer, Contribution, TargetDelta};
use helper::{Derive, Scalar};
use record::{attribute, StreamRecord};
use template::{ExpandError, Template, VarValue};

/// Largest partition-key and sort-key values DynamoDB accepts, in bytes.
pub const MAX_PARTITION_KEY_BYTES: usize = 2048;
pub const MAX_SORT_KEY_BYTES: usize = 1024;

/// Attribute names starting with this are the service's own (ledger); measures may not use it.
pub const RESERVED_ATTRIBUTE_PREFIX: &str = "_agg";

/// The key of a target item: values in the table's key order (partition key first).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TargetKey(pub Box<[Box<str>]>);

/// Why a record could not be evaluated. `code` is a small fixed set (metrics labels, DLQ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    pub code: PoisonCode,
    pub rule: Option<Arc<str>>,
    pub message: String,
    /// Variables captured from the item's key before the failure.
    pub variables: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoisonCode {
    MalformedRecord,
    NonNumericSum,
    OutOfRange,
    KeyDelimiter,
    EmptyKeyPart,
    MissingVariable,
    BadTimestamp,
    KeyTooLong,
    ReservedAttribute,
    UnorderedValue,
}

impl PoisonCode {
    pub const ALL: [PoisonCode; 10] = [
        PoisonCode::MalformedRecord,
        PoisonCode::NonNumericSum,
        PoisonCode::OutOfRange,
        PoisonCode::KeyDelimiter,
        PoisonCode::EmptyKeyPart,
        PoisonCode::MissingVariable,
        PoisonCode::BadTimestamp,
        PoisonCode::KeyTooLong,
        PoisonCode::ReservedAttribute,
        PoisonCode::UnorderedValue,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PoisonCode::MalformedRecord => "malformed_record",
            PoisonCode::NonNumericSum => "non_numeric_sum",
            PoisonCode::OutOfRange => "out_of_range",
            PoisonCode::KeyDelimiter => "key_delimiter",
            PoisonCode::EmptyKeyPart => "empty_key_part",
            PoisonCode::MissingVariable => "missing_variable",
            PoisonCode::BadTimestamp => "bad_timestamp",
            PoisonCode::KeyTooLong => "key_too_long",
            PoisonCode::ReservedAttribute => "reserved_attribute",
            PoisonCode::UnorderedValue => "unordered_value",
        }
    }
}

impl fmt::Display for Poison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.rule {
            Some(rule) => write!(f, "{} (rule {rule}): {}", self.code.as_str(), self.message),
            None => write!(f, "{}: {}", self.code.as_str(), self.message),
        }
    }
}

/// What a measure adds per contributing image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeasureKind {
    Count,
    /// 1 per image holding a number in the attribute: the `_count` half of `avg`, so an item
    /// without the attribute leaves the average alone (as SQL's AVG skips NULL).
    CountOf(String),
    Sum(String),
    /// `sum: "qty * unitPrice"`
    Product(String, String),
    /// `max`, `min`, `latest`, `distinct`: counted per value in helper items ([`helper`]),
    /// the target's attribute derived from them.
    Helper(HelperMeasure),
}

/// A measure kept in helper items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelperMeasure {
    pub derive: Derive,
    pub value: ValueOf,
    /// `latest`'s ordering attribute.
    pub by: Option<String>,
}

/// Where a helper measure's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueOf {
    /// An attribute: N or S, as stored.
    Attribute(String),
    /// A template over captures and attributes (`"{date|day}"`): always S.
    Template(Template),
}

#[derive(Debug, Clone)]
pub struct Measure {
    /// The target attribute name; may hold variables (`orders_{status}`).
    pub name: Template,
    pub kind: MeasureKind,
    pub filter: Option<Pattern>,
}

/// How reconcile finds a target's source items.
#[derive(Debug, Clone)]
pub enum ReconcileSource {
    /// Query the partition `pk`, optionally only sort keys beginning with `sk_begins_with`.
    Query {
        pk: Template,
        sk_begins_with: Option<Template>,
    },
    Scan,
}

#[derive(Debug, Clone)]
pub struct Rule {
    pub name: Arc<str>,
    pub filter: Option<PatternSet>,
    /// Key attribute -> capturing template.
    pub source_key: Vec<(String, Template)>,
    /// Target templates in the table's key order.
    pub target: Vec<(String, Template)>,
    /// `write_shards`: each target is spread over this many sub-items ([`shards`]).
    pub write_shards: Option<u16>,
    pub measures: Vec<Measure>,
    pub reconcile: ReconcileSource,
    /// Fields of the stream record its filter reads that a source item does not have
    /// (`eventName`, `userIdentity`, `dynamodb.OldImage`, ...): reconcile cannot recompute such
    /// a rule from the items, so it refuses it.
    pub stream_only: Vec<String>,
    pub ttl_deletes: TtlDeletes,
    /// What the rule's targets hold follows from this ([`fingerprint`]): kept in the state
    /// table, so `run` rebuilds a rule whose definition changed.
    pub fingerprint: String,
    /// The canonical definition the fingerprint hashes ([`fingerprint::canonical`]), kept in
    /// the state table under a generation (see `state::definitions`).
    pub definition: Arc<str>,
}

/// How a rule counts a delete by DynamoDB's TTL service (`ttl_deletes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TtlDeletes {
    /// A TTL delete is a delete (the default).
    #[default]
    Count,
    /// A TTL delete changes nothing: "orders ever placed" keeps expired orders. The items that
    /// remain cannot recompute such a rule, so reconcile refuses it.
    Ignore,
}

/// One record's effect on one target: attribute -> signed delta.
pub type TargetDeltas = Vec<(TargetKey, Vec<(String, Decimal)>)>;

impl Rule {
    /// Whether the record passes this rule's filter (no filter: every record).
    pub fn filter_matches(&self, record: &Value) -> bool {
        self.filter.as_ref().is_none_or(|f| f.matches(record))
    }

    /// The record's deltas for this rule (new image minus old image), grouped by target.
    /// Call only for records that passed [`Rule::filter_matches`].
    pub fn deltas(&self, record: &StreamRecord<'_>) -> Result<TargetDeltas, Poison> {
        let mut out: TargetDeltas = Vec::new();
        if let Some(old) = record.old_image {
            self.contribute(old, record, false, &mut out)?;
        }
        if let Some(new) = record.new_image {
            self.contribute(new, record, true, &mut out)?;
        }
        Ok(out)
    }

    /// [`Rule::deltas`], and the new image's own contributions (what the item contributes to
    /// each target after this record; none for a delete), which a write logs while reconcile
    /// holds a target ([`crate::sink::hold`]).
    pub fn deltas_after(&self, record: &StreamRecord<'_>) -> Result<(TargetDeltas, TargetDeltas), Poison> {
        let mut out: TargetDeltas = Vec::new();
        if let Some(old) = record.old_image {
            self.contribute(old, record, false, &mut out)?;
        }
        let mut after: TargetDeltas = Vec::new();
        if let Some(new) = record.new_image {
            self.contribute(new, record, true, &mut after)?;
        }
        for (target, values) in &after {
            merge(&mut out, target.clone(), values.clone(), self, &[])?;
        }
        Ok((out, after))
    }

    fn poison(&self, code: PoisonCode, message: String, captures: &[(&str, &str)]) -> Poison {
        Poison {
            code,
            rule: Some(self.name.clone()),
            message,
            variables: captures.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// Adds one image's contributions (negated for the old image) to `out`.
    fn contribute<'i>(&self, image: &'i Value, record: &StreamRecord<'i>, positive: bool, out: &mut TargetDeltas) -> Result<(), Poison> {
        let mut captures: Vec<(&str, &'i str)> = Vec::with_capacity(4);
        for (attr, template) in &self.source_key {
            let key = attribute(image, attr)
                .or_else(|| record.keys.get(attr).and_then(|v| v.as_object()).and_then(|m| m.iter().next()).map(|(t, v)| (t.as_str(), v)));
            let value = match key {
                Some(("S" | "N", Value::String(s))) => s.as_str(),
                _ => return Ok(()), // no such key attribute: not an item of this rule
            };
            if !template.capture(value, &mut captures) {
                return Ok(());
            }
        }
        // The same variable captured twice (in PK and SK) must agree.
        for (i, (name, value)) in captures.iter().enumerate() {
            if captures[..i].iter().any(|(n, v)| n == name && v != value) {
                return Ok(());
            }
        }
        // An N attribute used as a variable that is not a usable number: reported instead of
        // "missing" when the expansion fails.
        let bad_number: Cell<Option<(String, DecimalError)>> = Cell::new(None);
        let mut lookup = |name: &str| -> Option<VarValue<'i>> {
            if let Some((_, v)) = captures.iter().find(|(n, _)| *n == name) {
                return Some(VarValue::Str(v));
            }
            match attribute(image, name) {
                Some(("S", Value::String(s))) => Some(VarValue::Str(s)),
                Some(("N", Value::String(s))) => match Decimal::parse(s) {
                    Ok(n) => Some(VarValue::Num(n)),
                    Err(e) => {
                        bad_number.set(Some((name.to_string(), e)));
                        None
                    }
                },
                _ => None,
            }
        };
        let mut key_parts = Vec::with_capacity(self.target.len());
        for (i, (attr, template)) in self.target.iter().enumerate() {
            let value =
                template.expand(&mut lookup).map_err(|e| self.expand_poison(e, bad_number.take(), &format!("target.{attr}"), &captures))?;
            // A sub-item's partition key is the target's and `#_agg#w<index>`.
            let limit = match (i, self.write_shards) {
                (0, None) => MAX_PARTITION_KEY_BYTES,
                (0, Some(_)) => MAX_PARTITION_KEY_BYTES - shards::SUFFIX_MAX_BYTES,
                _ => MAX_SORT_KEY_BYTES,
            };
            if value.len() > limit {
                return Err(self.poison(
                    PoisonCode::KeyTooLong,
                    format!("target.{attr}: expanded key is {} bytes, DynamoDB allows {limit}", value.len()),
                    &captures,
                ));
            }
            if value.contains(helper::MARK) {
                return Err(self.poison(
                    PoisonCode::ReservedAttribute,
                    format!(
                        "target.{attr}: expands to {value:?}, which holds {:?}, the mark of the service's helper items and sub-items",
                        helper::MARK
                    ),
                    &captures,
                ));
            }
            if crate::registry::is_reserved_key([value.as_str()]) {
                return Err(self.poison(
                    PoisonCode::ReservedAttribute,
                    format!("target.{attr}: expands to {value:?}, a key of the service's own items (its ledger registry, pending helper expiries)"),
                    &captures,
                ));
            }
            key_parts.push(value.into_boxed_str());
        }
        let target = TargetKey(key_parts.into_boxed_slice());
        let mut values: Vec<(String, Decimal)> = Vec::with_capacity(self.measures.len());
        let sign = if positive { Decimal::ONE } else { -Decimal::ONE };
        for measure in &self.measures {
            if let Some(filter) = &measure.filter {
                if !filter.matches(image) {
                    continue;
                }
            }
            let at = || format!("measures.{}", measure.name);
            let value = match &measure.kind {
                MeasureKind::Count => Some(Decimal::ONE),
                MeasureKind::CountOf(attr) => self.number(image, attr, &at(), &captures)?.map(|_| Decimal::ONE),
                MeasureKind::Sum(attr) => self.number(image, attr, &at(), &captures)?,
                MeasureKind::Product(a, b) => match (self.number(image, a, &at(), &captures)?, self.number(image, b, &at(), &captures)?) {
                    (Some(x), Some(y)) => Some(
                        x.checked_mul(y)
                            .map_err(|e| self.poison(PoisonCode::OutOfRange, format!("{}: {a} * {b}: {e}", at()), &captures))?,
                    ),
                    _ => None,
                },
                MeasureKind::Helper(h) => {
                    let Some(tail) = self.helper_tail(h, image, &mut lookup, &bad_number, &at(), &captures)? else { continue };
                    let Some(name) = self.measure_name(measure, &mut lookup, &bad_number, &captures)? else { continue };
                    let helper = self.helper_key(&target, &name, &tail, &at(), &captures)?;
                    merge(out, helper, vec![(helper::REFS.to_string(), sign)], self, &captures)?;
                    continue;
                }
            };
            let Some(value) = value else { continue };
            let Some(name) = self.measure_name(measure, &mut lookup, &bad_number, &captures)? else { continue };
            values.push((name, if positive { value } else { -value }));
        }
        if values.is_empty() {
            return Ok(());
        }
        merge(out, target, values, self, &captures)
    }

    /// A measure's attribute name for this image. A name formed from an attribute the item
    /// does not have (`orders_{status}` without status) contributes nothing, like a sum over
    /// an absent attribute.
    fn measure_name<'i>(
        &self,
        measure: &Measure,
        lookup: &mut impl FnMut(&str) -> Option<VarValue<'i>>,
        bad_number: &Cell<Option<(String, DecimalError)>>,
        captures: &[(&str, &str)],
    ) -> Result<Option<String>, Poison> {
        let at = format!("measures.{}", measure.name);
        let name = match measure.name.expand(lookup) {
            Ok(name) => name,
            Err(e) => {
                return match (e, bad_number.take()) {
                    (ExpandError::Missing(_), None) => Ok(None),
                    (e, bad) => Err(self.expand_poison(e, bad, &at, captures)),
                }
            }
        };
        if name.starts_with(RESERVED_ATTRIBUTE_PREFIX) || self.target.iter().any(|(k, _)| *k == name) {
            return Err(self.poison(PoisonCode::ReservedAttribute, format!("{at}: expands to a key or reserved attribute name"), captures));
        }
        if matches!(measure.kind, MeasureKind::Helper(_)) && name.contains(template::DELIMITER) {
            return Err(self.poison(
                PoisonCode::KeyDelimiter,
                format!("{at}: expands to {name:?}; a helper key part may not hold '#'"),
                captures,
            ));
        }
        Ok(Some(name))
    }

    /// The helper's sort-key part for this image: None when the image holds no value (or no
    /// `by`, for latest).
    fn helper_tail<'i>(
        &self,
        h: &HelperMeasure,
        image: &'i Value,
        lookup: &mut impl FnMut(&str) -> Option<VarValue<'i>>,
        bad_number: &Cell<Option<(String, DecimalError)>>,
        at: &str,
        captures: &[(&str, &str)],
    ) -> Result<Option<String>, Poison> {
        let value = match &h.value {
            ValueOf::Attribute(attr) => self.scalar(image, attr, at, captures)?,
            ValueOf::Template(t) => match t.expand(lookup) {
                Ok(v) => Some(Scalar::S(v)),
                Err(e) => match (e, bad_number.take()) {
                    (ExpandError::Missing(_), None) => None,
                    (e, bad) => return Err(self.expand_poison(e, bad, at, captures)),
                },
            },
        };
        let Some(value) = value else { return Ok(None) };
        let by = match &h.by {
            Some(attr) => match self.scalar(image, attr, &format!("{at}.by"), captures)? {
                Some(by) => Some(by),
                None => return Ok(None),
            },
            None => None,
        };
        Ok(Some(h.derive.tail(&value, by.as_ref())))
    }

    /// An N or S attribute as a comparable value: None when absent or NULL.
    fn scalar(&self, image: &Value, attr: &str, at: &str, captures: &[(&str, &str)]) -> Result<Option<Scalar>, Poison> {
        match attribute(image, attr) {
            None | Some(("NULL", _)) => Ok(None),
            Some(("S", Value::String(s))) => Ok(Some(Scalar::S(s.clone()))),
            Some(("N", _)) => Ok(self.number(image, attr, at, captures)?.map(Scalar::N)),
            Some((t, _)) => Err(self.poison(
                PoisonCode::UnorderedValue,
                format!("{at}: attribute {attr} is of type {t}; max, min, latest and distinct compare N or S"),
                captures,
            )),
        }
    }

    /// The helper item of `target` for one measure value: the target's sort key, the mark,
    /// the measure and the value.
    fn helper_key(&self, target: &TargetKey, name: &str, tail: &str, at: &str, captures: &[(&str, &str)]) -> Result<TargetKey, Poison> {
        let mut parts = target.0.to_vec();
        let sorted = parts.len() > 1;
        let Some(last) = parts.last_mut().filter(|_| sorted) else {
            return Err(self.poison(PoisonCode::KeyTooLong, format!("{at}: helper items need a table with a sort key"), captures));
        };
        if last.contains(helper::MARK) {
            return Err(self.poison(
                PoisonCode::ReservedAttribute,
                format!("{at}: the target's sort key {last:?} holds {:?}, which marks helper items", helper::MARK),
                captures,
            ));
        }
        let sk = format!("{}{tail}", helper::prefix(last, name));
        if sk.len() > MAX_SORT_KEY_BYTES {
            return Err(self.poison(
                PoisonCode::KeyTooLong,
                format!("{at}: the helper item's sort key is {} bytes, DynamoDB allows {MAX_SORT_KEY_BYTES}", sk.len()),
                captures,
            ));
        }
        *last = sk.into_boxed_str();
        Ok(TargetKey(parts.into_boxed_slice()))
    }

    /// A numeric attribute: None when absent or NULL (sparse data contributes nothing).
    fn number(&self, image: &Value, attr: &str, at: &str, captures: &[(&str, &str)]) -> Result<Option<Decimal>, Poison> {
        match attribute(image, attr) {
            None | Some(("NULL", _)) => Ok(None),
            Some(("N", Value::String(s))) => Decimal::parse(s).map(Some).map_err(|e| {
                let code = match e {
                    DecimalError::Syntax(_) => PoisonCode::NonNumericSum,
                    _ => PoisonCode::OutOfRange,
                };
                self.poison(
                    code,
                    format!(
                        "{at}: attribute {attr}: {}",
                        if code == PoisonCode::NonNumericSum { "N value is not a number".to_string() } else { e.to_string() }
                    ),
                    captures,
                )
            }),
            Some((t, _)) => {
                Err(self.poison(PoisonCode::NonNumericSum, format!("{at}: attribute {attr} is of type {t}, a sum needs N"), captures))
            }
        }
    }

    fn expand_poison(&self, e: ExpandError, bad_number: Option<(String, DecimalError)>, at: &str, captures: &[(&str, &str)]) -> Poison {
        if let Some((name, e)) = bad_number {
            let code = if matches!(e, DecimalError::Syntax(_)) { PoisonCode::NonNumericSum } else { PoisonCode::OutOfRange };
            return self.poison(code, format!("{at}: variable {{{name}}}: N attribute is not a usable number ({e})"), captures);
        }
        let (code, message) = match e {
            ExpandError::Missing(name) => (
                PoisonCode::MissingVariable,
                format!("{at}: variable {{{name}}} is neither a capture nor an S or N attribute of the image"),
            ),
            ExpandError::Empty(name) => (PoisonCode::EmptyKeyPart, format!("{at}: variable {{{name}}} is empty")),
            ExpandError::Delimiter(name) => (PoisonCode::KeyDelimiter, format!("{at}: variable {{{name}}} contains the key delimiter '#'")),
            ExpandError::BadTimestamp { name, why } => (PoisonCode::BadTimestamp, format!("{at}: variable {{{name}}}: {why}")),
        };
        self.poison(code, message, captures)
    }
}

/// Adds one image's values on `target` to `out`, summing with what earlier images added.
fn merge(
    out: &mut TargetDeltas,
    target: TargetKey,
    values: Vec<(String, Decimal)>,
    rule: &Rule,
    captures: &[(&str, &str)],
) -> Result<(), Poison> {
    let Some((_, existing)) = out.iter_mut().find(|(t, _)| *t == target) else {
        out.push((target, values));
        return Ok(());
    };
    for (name, v) in values {
        match existing.iter_mut().find(|(n, _)| *n == name) {
            Some((_, sum)) => {
                *sum = sum.checked_add(v).map_err(|e| rule.poison(PoisonCode::OutOfRange, format!("measure {name}: {e}"), captures))?
            }
            None => existing.push((name, v)),
        }
    }
    Ok(())
}

/// All rules, in config order, with the target table's key attribute names.
#[derive(Debug, Clone)]
pub struct Engine {
    pub rules: Vec<Rule>,
    /// The `copy` rules, in config order ([`copy`]).
    pub copies: Vec<copy::CopyRule>,
    pub key_names: Vec<String>,
    /// Per rule, the first rule with the same filter: its result is reused for this record.
    pub filter_of: Vec<usize>,
}

/// What one record did.
#[derive(Debug, Default)]
pub struct RecordReport {
    /// Rules whose filter matched.
    pub matched: Vec<usize>,
    pub poisons: Vec<Poison>,
}

impl Engine {
    /// Evaluates `record` against every rule and adds the deltas to `batch`. A rule that
    /// cannot evaluate the record reports a poison and adds nothing; other rules still apply.
    pub fn apply(&self, record: &Value, batch: &mut Coalescer) -> RecordReport {
        let mut report = RecordReport::default();
        let decoded = match StreamRecord::decode(record) {
            Ok(r) => r,
            Err(message) => {
                report.poisons.push(Poison { code: PoisonCode::MalformedRecord, rule: None, message, variables: BTreeMap::new() });
                return report;
            }
        };
        // The ledger registry's own item, when the aggregates live in the source table.
        if crate::registry::is_reserved_key(decoded.keys.values().filter_map(|v| v.get("S").and_then(Value::as_str))) {
            return report;
        }
        // Filter results per rule, reused by later rules with the same filter.
        let mut passed = [false; 32];
        for (i, rule) in self.rules.iter().enumerate() {
            let shared = self.filter_of.get(i).copied().filter(|&j| j < i && j < passed.len());
            let pass = match shared {
                Some(j) => passed[j],
                None => rule.filter_matches(record),
            };
            if let Some(slot) = passed.get_mut(i) {
                *slot = pass;
            }
            if !pass || (decoded.ttl_delete && rule.ttl_deletes == TtlDeletes::Ignore) {
                continue;
            }
            report.matched.push(i);
            let result = rule.deltas_after(&decoded).and_then(|(deltas, after)| {
                let item = item::item_id(&rule.name, decoded.keys);
                let source = coalesce::Source { item: &item, after: &after };
                batch.add_from(decoded.sequence_number, decoded.approximate_creation, Some(&rule.name), deltas, Some(source)).map_err(|e| {
                    Poison {
                        code: PoisonCode::OutOfRange,
                        rule: Some(rule.name.clone()),
                        message: format!("the batch's running sum would leave DynamoDB's number range: {e}"),
                        variables: BTreeMap::new(),
                    }
                })
            });
            if let Err(p) = result {
                report.poisons.push(p);
            }
        }
        report
    }

    /// Evaluates `record` against every copy rule and adds its changes to `batch`
    /// ([`copy::CopyRule::change`]; `shard_created_ms`: the creation time of the shard it came
    /// from). `matched` holds indexes into [`Engine::copies`]. A malformed record is reported
    /// by [`Engine::apply`], so here it is only skipped.
    pub fn apply_copies(&self, record: &Value, shard_created_ms: Option<u64>, batch: &mut copy::CopyBatch) -> RecordReport {
        let mut report = RecordReport::default();
        if self.copies.is_empty() {
            return report;
        }
        let Ok(decoded) = StreamRecord::decode(record) else { return report };
        if crate::registry::is_reserved_key(decoded.keys.values().filter_map(|v| v.get("S").and_then(Value::as_str))) {
            return report;
        }
        for (i, rule) in self.copies.iter().enumerate() {
            if !rule.filter_matches(record) {
                continue;
            }
            report.matched.push(i);
            match rule.change(&decoded, shard_created_ms) {
                Ok(Some(change)) => batch.add(i, change, record),
                Ok(None) => {}
                Err(p) => report.poisons.push(p),
            }
        }
        report
    }
}

#[cfg(test)]
mod tests;
