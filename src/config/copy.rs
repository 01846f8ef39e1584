//! `copy` rules: a rule with `copy` in place of `target` and `measures`, validated into a
//! [`CopyRule`] (DESIGN.md section 2, "Copies kept in sync").

use std::collections::BTreeSet;

use super::raw::{RawCopy, RawRule};
use super::{err, pattern_err, template, ConfigError};
use crate::pattern::{PatternOptions, PatternSet};
use crate::rules::copy::{CopyAttribute, CopyRule, Finder, SortCondition};
use crate::rules::template::Template;
use crate::rules::RESERVED_ATTRIBUTE_PREFIX;

/// The `to` entry that names a global secondary index.
const INDEX: &str = "index";
const BEGINS_WITH: &str = "_begins_with";

pub(super) fn validate(path: &str, r: &RawRule, copy: &RawCopy) -> Result<CopyRule, ConfigError> {
    refuse_aggregate_settings(path, r)?;
    let options = PatternOptions { numeric_strings: r.numeric_strings };
    let filter = match &r.filter {
        None => None,
        Some(v) => {
            keys_only(&format!("{path}.filter"), v)?;
            Some(PatternSet::compile(v, options).map_err(|e| pattern_err(&format!("{path}.filter"), e))?)
        }
    };
    let source_key = super::source_key(path, r)?;
    let captures: BTreeSet<&str> = source_key.iter().flat_map(|(_, t)| t.variables()).collect();
    let at = format!("{path}.copy.to");
    let to = finder(&at, &copy.to, &source_key)?;
    let used: BTreeSet<&str> =
        to.partition.1.variables().chain(to.sort.iter().flat_map(|(_, c)| condition_template(c).variables())).collect();
    if let Some(v) = used.difference(&captures).next() {
        return Err(err(&at, format!("{{{v}}} is not captured by source_key: the copies are found from the source item's key")));
    }
    if let Some(v) = captures.difference(&used).next() {
        return Err(err(
            &at,
            format!("does not use {{{v}}}, which source_key captures: sources that differ only in it would share one set of copies"),
        ));
    }
    let key_names: Vec<&str> = source_key
        .iter()
        .map(|(k, _)| k.as_str())
        .chain([to.partition.0.as_str()])
        .chain(to.sort.iter().map(|(k, _)| k.as_str()))
        .collect();
    let attributes = attributes(&format!("{path}.copy.attributes"), copy, &key_names)?;
    if to.index.is_none() {
        source_found(&at, &source_key, &to)?;
    }
    let (inline_items, job_capacity_per_second) = pacing(&format!("{path}.copy"), copy)?;
    let definition = serde_json::json!({
        "filter": r.filter,
        "numeric_strings": r.numeric_strings,
        "source_key": r.source_key.iter().collect::<Vec<_>>(),
        "attributes": copy.attributes.iter().collect::<Vec<_>>(),
        "to": copy.to.iter().collect::<Vec<_>>(),
    })
    .to_string()
    .into();
    Ok(CopyRule { name: r.name.as_str().into(), filter, source_key, attributes, to, inline_items, job_capacity_per_second, definition })
}

/// Most copies a change writes in its batch.
pub const MAX_INLINE_ITEMS: u64 = 1_000;
pub const DEFAULT_INLINE_ITEMS: usize = 100;
pub const DEFAULT_JOB_CAPACITY: f64 = 500.0;
/// A job above this would pass what one partition key takes many times over.
const MAX_JOB_CAPACITY: f64 = 40_000.0;

/// `inline_items` and `job_capacity_per_second`, with their defaults.
fn pacing(path: &str, copy: &RawCopy) -> Result<(usize, f64), ConfigError> {
    let inline = match copy.inline_items {
        None => DEFAULT_INLINE_ITEMS,
        Some(n) if (1..=MAX_INLINE_ITEMS).contains(&n) => usize::try_from(n).unwrap_or(DEFAULT_INLINE_ITEMS),
        Some(n) => {
            return Err(err(
                format!("{path}.inline_items"),
                format!("{n} is out of range: a batch writes 1 to {MAX_INLINE_ITEMS} copies of a change, and a job the rest"),
            ))
        }
    };
    let capacity = match copy.job_capacity_per_second {
        None => DEFAULT_JOB_CAPACITY,
        Some(c) if (1.0..=MAX_JOB_CAPACITY).contains(&c) => c,
        Some(c) => {
            return Err(err(
                format!("{path}.job_capacity_per_second"),
                format!("{c} is out of range: give 1 to {MAX_JOB_CAPACITY} write capacity units per second"),
            ))
        }
    };
    Ok((inline, capacity))
}

/// A copy rule writes the items `copy.to` finds: the settings of a rule with targets do not apply.
fn refuse_aggregate_settings(path: &str, r: &RawRule) -> Result<(), ConfigError> {
    if !r.target.is_empty() {
        return Err(err(
            format!("{path}.target"),
            "a copy rule writes the items its copy.to finds: leave target out (or put the measures in a rule of their own)",
        ));
    }
    if !r.measures.is_empty() {
        return Err(err(format!("{path}.measures"), "a copy rule keeps copies, not measures: put the measures in a rule of their own"));
    }
    if r.reconcile.is_some() {
        return Err(err(format!("{path}.reconcile"), "a copy rule's copies are found with copy.to: leave reconcile out"));
    }
    if r.ttl_deletes.is_some() {
        return Err(err(
            format!("{path}.ttl_deletes"),
            "a copy rule removes the copies of a source deleted by TTL, as of any deleted source: leave ttl_deletes out",
        ));
    }
    Ok(())
}

fn condition_template(c: &SortCondition) -> &Template {
    match c {
        SortCondition::Equals(t) | SortCondition::BeginsWith(t) => t,
    }
}

/// `copy.to`: on the table, its partition key (the first in `source_key`) and optionally its
/// sort key (`SK` or `SK_begins_with`); on an index, `index` and the index's partition key
/// first, then optionally its sort key.
fn finder(at: &str, to: &indexmap::IndexMap<String, String>, source_key: &[(String, Template)]) -> Result<Finder, ConfigError> {
    let index = match to.get(INDEX) {
        None => None,
        Some(name)
            if (3..=255).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) =>
        {
            Some(name.clone())
        }
        Some(name) => return Err(err(format!("{at}.{INDEX}"), format!("{name:?} is not an index name (3-255 letters, digits, _ - .)"))),
    };
    let entries: Vec<(&String, &String)> = to.iter().filter(|(k, _)| k.as_str() != INDEX).collect();
    let (table_pk, table_sk) = (&source_key[0].0, source_key.get(1).map(|(k, _)| k));
    let mut partition = None;
    let mut sort = None;
    for (i, (key, text)) in entries.iter().enumerate() {
        let here = format!("{at}.{key}");
        let t = template(&here, text)?;
        let sort_name = key.strip_suffix(BEGINS_WITH);
        let is_partition = match &index {
            None => *key == table_pk,
            Some(_) => i == 0 && sort_name.is_none(),
        };
        if is_partition {
            if t.text().is_empty() {
                return Err(err(&here, "a partition key value may not be empty"));
            }
            partition = Some(((*key).clone(), t));
            continue;
        }
        if sort.is_some() || (index.is_some() && i > 1) {
            return Err(err(&here, "unknown key: copy.to takes a partition key and at most one sort-key condition"));
        }
        let name = sort_name.unwrap_or(key.as_str());
        if index.is_none() && table_sk.is_some_and(|sk| sk != name) {
            let sk = table_sk.map(String::as_str).unwrap_or_default();
            return Err(err(
                &here,
                format!("unknown key: on the table, give {table_pk} and optionally {sk} or {sk}{BEGINS_WITH} (the key attributes named in source_key); add index: NAME to query an index"),
            ));
        }
        let condition = if sort_name.is_some() { SortCondition::BeginsWith(t) } else { SortCondition::Equals(t) };
        sort = Some((name.to_string(), condition));
    }
    let partition = partition.ok_or_else(|| match &index {
        None => err(at, format!("the table's partition key {table_pk} is required (a template of source_key's variables)")),
        Some(i) => err(at, format!("index {i}'s partition key is required, first after index (e.g. GSI1PK: \"CUST#{{customer}}\")")),
    })?;
    Ok(Finder { index, partition, sort })
}

/// Most attributes one copy rule keeps: each takes about 14 bytes of the write's update
/// expression, which DynamoDB caps at 4 KB.
pub const MAX_COPY_ATTRIBUTES: usize = 100;

/// A copy rule's filter may test the record's keys (and `eventSource`) only: every change of a
/// source item must reach the rule, its delete (which has no NewImage) among them.
fn keys_only(at: &str, filter: &serde_json::Value) -> Result<(), ConfigError> {
    use serde_json::Value;
    let refuse = |field: &str| {
        err(
            at,
            format!("a copy rule's filter may test dynamodb.Keys and eventSource only, not {field}: a source change the filter skips (a delete has no NewImage) would leave its copies stale"),
        )
    };
    let patterns: Vec<&Value> = match filter {
        Value::Array(list) => list.iter().collect(),
        other => vec![other],
    };
    for p in patterns {
        let Some(fields) = p.as_object() else { continue };
        for (k, v) in fields {
            match k.as_str() {
                "eventSource" => {}
                "dynamodb" => {
                    if let Some(inner) = v.as_object().and_then(|o| o.keys().find(|k| k.as_str() != "Keys")) {
                        return Err(refuse(&format!("dynamodb.{inner}")));
                    }
                }
                other => return Err(refuse(other)),
            }
        }
    }
    Ok(())
}

/// `copy.attributes`: copy attribute -> source attribute, both top-level names; a copy is not a
/// key attribute or one of the service's own.
fn attributes(at: &str, copy: &RawCopy, key_names: &[&str]) -> Result<Vec<CopyAttribute>, ConfigError> {
    if copy.attributes.is_empty() {
        return Err(err(at, "name at least one, copy attribute: source attribute (e.g. customerName: name)"));
    }
    if copy.attributes.len() > MAX_COPY_ATTRIBUTES {
        return Err(err(
            at,
            format!("{} attributes: at most {MAX_COPY_ATTRIBUTES} (a write's expression is capped at 4 KB)", copy.attributes.len()),
        ));
    }
    let top_level = |s: &str| !s.is_empty() && !s.contains('.') && !s.contains('[');
    let mut out = Vec::with_capacity(copy.attributes.len());
    for (name, source) in &copy.attributes {
        let here = format!("{at}.{name}");
        if !top_level(name) || name.starts_with(RESERVED_ATTRIBUTE_PREFIX) || key_names.contains(&name.as_str()) {
            return Err(err(
                &here,
                format!("a copy is a top-level attribute (no '.' or '['), not a key attribute, and does not start with {RESERVED_ATTRIBUTE_PREFIX:?}"),
            ));
        }
        if !top_level(source) {
            return Err(err(&here, format!("{source:?}: give the source item's attribute by name (top-level: no '.' or '[')")));
        }
        out.push(CopyAttribute { copy: name.clone(), source: source.clone() });
    }
    Ok(out)
}

/// Refuses a `to` on the table that could find the source item itself: its copies would be
/// written onto the source, whose own record would come back as a change (a feedback loop).
fn source_found(at: &str, source_key: &[(String, Template)], to: &Finder) -> Result<(), ConfigError> {
    let (pk_name, pk) = &to.partition;
    let same_partition = source_key.iter().find(|(k, _)| k == pk_name).is_some_and(|(_, t)| t.may_overlap(pk));
    if !same_partition {
        return Ok(());
    }
    let source_sort = source_key.get(1).map(|(_, t)| t);
    let found = match (&to.sort, source_sort) {
        (None, _) | (Some(_), None) => true,
        (Some((_, SortCondition::Equals(t))), Some(s)) => t.may_overlap(s),
        (Some((_, SortCondition::BeginsWith(p))), Some(s)) => may_begin_with(s, p),
    };
    if found {
        return Err(err(
            at,
            "could find the source item itself, so its copies would be written onto the source (a feedback loop); narrow it with a sort-key condition the source cannot meet (e.g. SK_begins_with: \"ORDER#\")",
        ));
    }
    Ok(())
}

/// Whether some expansion of `t` could begin with some expansion of `prefix`: judged by their
/// literal starts (an over-approximation).
pub(super) fn may_begin_with(t: &Template, prefix: &Template) -> bool {
    let start = |x: &Template| -> String {
        x.parts()
            .iter()
            .map_while(|p| match p {
                crate::rules::template::Part::Literal(l) => Some(l.clone()),
                crate::rules::template::Part::Var { .. } => None,
            })
            .collect()
    };
    let (s, p) = (start(t), start(prefix));
    // A literal is its own start; a template with variables may go on from its start.
    s.starts_with(&p) || (!t.is_literal() && p.starts_with(&s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Template {
        Template::parse(s).unwrap()
    }

    #[test]
    fn begins_with_judged_by_literal_starts() {
        assert!(!may_begin_with(&t("PROFILE"), &t("ORDER#")));
        assert!(may_begin_with(&t("ORDER#{id}"), &t("ORDER#")));
        assert!(may_begin_with(&t("ORDER#{id}"), &t("ORD")));
        assert!(may_begin_with(&t("{x}"), &t("ORDER#")));
        assert!(!may_begin_with(&t("LINE#{id}"), &t("ORDER#{d}")));
        assert!(may_begin_with(&t("ORDER#2026"), &t("ORDER#{d}")));
        assert!(!may_begin_with(&t("ORDE"), &t("ORDER#{d}")), "a literal shorter than the prefix's start cannot begin with it");
    }
}
