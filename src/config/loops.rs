//! Feedback loops: when aggregates live in the source table, the target items' own stream
//! records come back to the rules. A rule whose targets another rule's source_key and filter
//! could accept would count its own writes, forever. Rejected at validation.

use serde_json::{json, Map, Value};

use super::raw::RawRule;
use super::{err, ConfigError};
use crate::rules::copy::{Finder, SortCondition};
use crate::rules::template::{Part, Template, DELIMITER};
use crate::rules::{Engine, Rule};

pub(super) fn check(engine: &Engine) -> Result<(), ConfigError> {
    for (i, writer) in engine.rules.iter().enumerate() {
        for shape in shapes(writer) {
            for reader in &engine.rules {
                if source_key_may_match(&shape.key, reader) && filter_may_accept(&shape, reader) {
                    let what = if shape.helper { "helper items (of max, min, latest, distinct)" } else { "items" };
                    return Err(err(
                        format!("rules[{i}].target"),
                        format!(
                            "{what} written by rule {:?} could match rule {:?}'s source_key and filter, so it would aggregate its own writes (a feedback loop); use a target key that source_key cannot match (e.g. SK: PROFILE) or a separate aggregates.table",
                            writer.name, reader.name
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Copy rules: two may not keep one attribute, and when aggregates live in the source table a
/// `to` on the table may not find the target or helper items of a rule (copies would be
/// written onto them). A `to` on an index cannot be judged here: its items are the ones that
/// carry the index's key attributes, and the fan-out never writes onto the source itself.
pub(super) fn check_copies(raw: &[RawRule], engine: &Engine, aggregates_in_source: bool) -> Result<(), ConfigError> {
    let path_of = |name: &str| raw.iter().position(|r| r.name == name).map_or_else(String::new, |i| format!("rules[{i}]"));
    for (i, c) in engine.copies.iter().enumerate() {
        let at = format!("{}.copy", path_of(&c.name));
        for other in &engine.copies[..i] {
            if let Some(a) = c.attributes.iter().find(|a| other.attributes.iter().any(|b| b.copy == a.copy)) {
                return Err(err(
                    format!("{at}.attributes.{}", a.copy),
                    format!("rule {:?} keeps {} too: each copy attribute belongs to one rule", other.name, a.copy),
                ));
            }
        }
        if !aggregates_in_source || c.to.index.is_some() {
            continue;
        }
        for rule in &engine.rules {
            if let Some(shape) = shapes(rule).into_iter().find(|s| finds(&c.to, &s.key)) {
                let what = if shape.helper { "helper items" } else { "target items" };
                return Err(err(
                    format!("{at}.to"),
                    format!(
                        "could find the {what} of rule {:?} (aggregates live in the source table), so copies would be written onto them; narrow it with a sort-key condition they cannot meet",
                        rule.name
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether `to` could find an item with this key shape.
fn finds(to: &Finder, key: &[(String, Template)]) -> bool {
    let template_of = |name: &str| key.iter().find(|(k, _)| k == name).map(|(_, t)| t);
    let Some(pk) = template_of(&to.partition.0) else { return false };
    if !may_overlap(pk, &to.partition.1) {
        return false;
    }
    match &to.sort {
        None => true,
        Some((name, condition)) => template_of(name).is_some_and(|t| match condition {
            SortCondition::Equals(e) => may_overlap(t, e),
            SortCondition::BeginsWith(p) => super::copy::may_begin_with(t, p),
        }),
    }
}

/// One shape of item a rule writes: its key templates and its attributes.
struct Shape {
    key: Vec<(String, Template)>,
    attributes: Vec<Template>,
    helper: bool,
}

/// The target items a rule writes, and the helper items next to them, one per helper measure:
/// the target's sort key followed by `#_agg#<measure>#<value>` ([`crate::rules::helper`]).
fn shapes(rule: &Rule) -> Vec<Shape> {
    let mut out =
        vec![Shape { key: rule.target.clone(), attributes: rule.measures.iter().map(|m| m.name.clone()).collect(), helper: false }];
    if let (Some(_), Some(((pk_name, pk), rest))) = (rule.write_shards, rule.target.split_first()) {
        // Sub-items: the partition key followed by `#_agg#w<index>` ([`crate::rules::shards`]).
        if let Ok(sub_pk) = Template::parse(&format!("{}{}{{_index}}", pk.text(), crate::rules::shards::MARK)) {
            let mut key = vec![(pk_name.clone(), sub_pk)];
            key.extend(rest.iter().cloned());
            out.push(Shape { key, attributes: rule.measures.iter().map(|m| m.name.clone()).collect(), helper: false });
        }
    }
    let Some(((sk_name, sk), rest)) = rule.target.split_last() else { return out };
    for m in rule.measures.iter().filter(|m| matches!(m.kind, crate::rules::MeasureKind::Helper(_))) {
        let text = format!("{}{}{}#{{_value}}", sk.text(), crate::rules::helper::MARK, m.name.text());
        let Ok(helper_sk) = Template::parse(&text) else { continue };
        let mut key = rest.to_vec();
        key.push((sk_name.clone(), helper_sk));
        let refs = Template::parse(crate::rules::helper::REFS).into_iter().collect();
        out.push(Shape { key, attributes: refs, helper: true });
    }
    out
}

fn source_key_may_match(target: &[(String, Template)], reader: &Rule) -> bool {
    reader.source_key.iter().all(|(attr, source)| match target.iter().find(|(a, _)| a == attr) {
        Some((_, target)) => may_overlap(target, source),
        None => false, // target items do not have this attribute
    })
}

/// Could some expansion of `a` equal some expansion of `b`? Variables expand to non-empty
/// text without `#`, so both must have the same number of `#`-separated segments and each
/// pair of segments must be able to agree. Conservative: "maybe" counts as yes.
fn may_overlap(a: &Template, b: &Template) -> bool {
    let (sa, sb) = (segments(a), segments(b));
    sa.len() == sb.len() && sa.iter().zip(&sb).all(|(x, y)| segment_may_match(x, y))
}

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Lit(String),
    Var,
}

fn segments(t: &Template) -> Vec<Vec<Piece>> {
    let mut out = vec![Vec::new()];
    for part in t.parts() {
        match part {
            Part::Var { .. } => out.last_mut().into_iter().for_each(|s| s.push(Piece::Var)),
            Part::Literal(l) => {
                for (i, chunk) in l.split(DELIMITER).enumerate() {
                    if i > 0 {
                        out.push(Vec::new());
                    }
                    if !chunk.is_empty() {
                        out.last_mut().into_iter().for_each(|s| s.push(Piece::Lit(chunk.to_string())));
                    }
                }
            }
        }
    }
    out
}

fn literal(seg: &[Piece]) -> Option<String> {
    seg.iter().map(|p| if let Piece::Lit(l) = p { Some(l.as_str()) } else { None }).collect()
}

fn segment_may_match(x: &[Piece], y: &[Piece]) -> bool {
    match (literal(x), literal(y)) {
        (Some(a), Some(b)) => a == b,
        (Some(a), None) => glob(y, &a),
        (None, Some(b)) => glob(x, &b),
        (None, None) => {
            // Both have variables: compatible unless their fixed ends disagree.
            let first = |s: &[Piece]| if let Some(Piece::Lit(l)) = s.first() { l.clone() } else { String::new() };
            let last = |s: &[Piece]| if let Some(Piece::Lit(l)) = s.last() { l.clone() } else { String::new() };
            let (fx, fy, lx, ly) = (first(x), first(y), last(x), last(y));
            (fx.starts_with(&fy) || fy.starts_with(&fx)) && (lx.ends_with(&ly) || ly.ends_with(&lx))
        }
    }
}

/// Does the piece sequence (variables = one or more characters) match `text`?
fn glob(pieces: &[Piece], text: &str) -> bool {
    match pieces.split_first() {
        None => text.is_empty(),
        Some((Piece::Lit(l), rest)) => text.strip_prefix(l.as_str()).is_some_and(|t| glob(rest, t)),
        Some((Piece::Var, rest)) => {
            text.char_indices().skip(1).map(|(i, _)| i).chain([text.len()]).any(|i| i > 0 && glob(rest, &text[i..]))
        }
    }
}

/// Builds the stream records a target item would produce (with a few sample values for its
/// variables) and asks the reader's filter.
fn filter_may_accept(shape: &Shape, reader: &Rule) -> bool {
    let Some(filter) = &reader.filter else { return true };
    ["x", "1", "2026-01-01"].iter().any(|sample| {
        let mut image = Map::new();
        for (attr, t) in &shape.key {
            let value = t.expand(|_| Some(crate::rules::template::VarValue::Str(sample))).unwrap_or_else(|_| t.text().to_string());
            image.insert(attr.clone(), json!({ "S": value }));
        }
        let keys = Value::Object(image.clone());
        for a in &shape.attributes {
            let name = a.expand(|_| Some(crate::rules::template::VarValue::Str(sample))).unwrap_or_else(|_| a.text().to_string());
            image.insert(name, json!({"N": "1"}));
        }
        let image = Value::Object(image);
        ["INSERT", "MODIFY", "REMOVE"].iter().any(|event| {
            let mut ddb = json!({ "Keys": keys, "SequenceNumber": "1", "ApproximateCreationDateTime": 1_764_460_800, "StreamViewType": "NEW_AND_OLD_IMAGES" });
            if *event != "REMOVE" {
                ddb["NewImage"] = image.clone();
            }
            if *event != "INSERT" {
                ddb["OldImage"] = image.clone();
            }
            filter.matches(&json!({ "eventName": event, "eventSource": "aws:dynamodb", "dynamodb": ddb }))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Template {
        Template::parse(s).unwrap()
    }

    #[test]
    fn overlap() {
        assert!(!may_overlap(&t("PROFILE"), &t("ORDER#{date}#{id}")));
        assert!(may_overlap(&t("ORDER#{d}#total"), &t("ORDER#{date}#{id}")));
        assert!(may_overlap(&t("CUST#{c}"), &t("CUST#{customer}")));
        assert!(!may_overlap(&t("SALES#{d}"), &t("CUST#{customer}")));
        assert!(may_overlap(&t("{x}"), &t("CUST")));
        assert!(!may_overlap(&t("{x}"), &t("CUST#{c}")));
        assert!(may_overlap(&t("A-{x}"), &t("{y}-B")));
        assert!(!may_overlap(&t("A-{x}"), &t("B-{y}")));
        assert!(may_overlap(&t("ORDERX"), &t("ORDER{x}")));
        assert!(!may_overlap(&t("ORDER"), &t("ORDER{x}")), "a variable is never empty");
    }
}
