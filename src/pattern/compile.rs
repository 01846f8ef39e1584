//! Pattern JSON -> compiled leaves, with AWS's rejections of invalid patterns.

use std::net::IpAddr;

use serde_json::{Map, Value};

use super::matcher::{AnythingBut, Cidr, Literal, Matcher, NumericRange, Wildcard};
use super::{Leaf, Node, Pattern, PatternOptions};
use crate::decimal::Decimal;

/// An invalid pattern: where (a path like `dynamodb.Keys.SK.S[0].prefix`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
pub struct PatternError {
    pub path: String,
    pub message: String,
}

impl PatternError {
    pub(crate) fn new(path: &str, message: impl Into<String>) -> PatternError {
        PatternError { path: path.to_string(), message: message.into() }
    }

    /// Prefixes the path with an outer one (`[1]`, `filter`, ...).
    pub fn within(mut self, outer: &str) -> PatternError {
        self.path = join_path(outer, &self.path);
        self
    }
}

fn join_path(outer: &str, inner: &str) -> String {
    if outer.is_empty() {
        inner.to_string()
    } else if inner.is_empty() {
        outer.to_string()
    } else if inner.starts_with('[') {
        format!("{outer}{inner}")
    } else {
        format!("{outer}.{inner}")
    }
}

fn child(path: &str, key: &str) -> String {
    join_path(path, key)
}

fn index(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

/// Most `*` a wildcard may hold; AWS refuses more as "too complex".
const MAX_WILDCARD_STARS: usize = 5;

pub(super) fn compile(pattern: &Value, options: PatternOptions) -> Result<Pattern, PatternError> {
    let Value::Object(map) = pattern else {
        return Err(PatternError::new("", "a pattern must be a JSON object"));
    };
    let mut root = compile_object(map, &[], "", options)?;
    let mut paths = Vec::new();
    root.number_paths(&mut paths);
    Ok(Pattern { root, paths: paths.into_boxed_slice() })
}

fn compile_object(map: &Map<String, Value>, prefix: &[Box<str>], path: &str, options: PatternOptions) -> Result<Node, PatternError> {
    let mut node = Node::default();
    for (key, value) in map {
        let here = child(path, key);
        if key == "$or" {
            let Value::Array(alternatives) = value else {
                return Err(PatternError::new(&here, "$or must be an array of objects"));
            };
            if alternatives.len() < 2 {
                return Err(PatternError::new(&here, "$or needs at least two alternatives"));
            }
            let mut group = Vec::with_capacity(alternatives.len());
            for (i, alt) in alternatives.iter().enumerate() {
                let Value::Object(alt_map) = alt else {
                    return Err(PatternError::new(&index(&here, i), "each $or alternative must be an object"));
                };
                group.push(compile_object(alt_map, prefix, &index(&here, i), options)?);
            }
            node.ors.push(group);
            continue;
        }
        let mut full: Vec<Box<str>> = prefix.to_vec();
        full.extend(key.split('.').map(Box::from));
        match value {
            Value::Object(inner) => {
                let sub = compile_object(inner, &full, &here, options)?;
                node.leaves.extend(sub.leaves);
                node.ors.extend(sub.ors);
            }
            Value::Array(items) => node.leaves.push(compile_leaf(items, full, &here, options)?),
            _ => return Err(PatternError::new(&here, format!("\"{key}\" must be an object or an array"))),
        }
    }
    Ok(node)
}

fn compile_leaf(items: &[Value], path: Vec<Box<str>>, here: &str, options: PatternOptions) -> Result<Leaf, PatternError> {
    if items.is_empty() {
        return Err(PatternError::new(here, "empty arrays are not allowed"));
    }
    let mut matchers = Vec::with_capacity(items.len());
    let mut exists_true = false;
    let mut exists_false = false;
    for (i, item) in items.iter().enumerate() {
        let at = index(here, i);
        match compile_matcher(item, &at)? {
            Compiled::Exists(true) => exists_true = true,
            Compiled::Exists(false) => exists_false = true,
            Compiled::Value(m) => matchers.push(m),
        }
    }
    let numeric_strings = options.numeric_strings && matches!(path.last().map(|s| &**s), Some("N") | Some("NS"));
    Ok(Leaf { path: path.into_boxed_slice(), id: 0, matchers: matchers.into_boxed_slice(), exists_true, exists_false, numeric_strings })
}

enum Compiled {
    Exists(bool),
    Value(Matcher),
}

fn number(n: &serde_json::Number, at: &str) -> Result<Decimal, PatternError> {
    Decimal::parse(n.as_str()).map_err(|e| PatternError::new(at, format!("number {n} cannot be compared exactly: {e}")))
}

fn literal(value: &Value, at: &str) -> Result<Literal, PatternError> {
    Ok(match value {
        Value::Null => Literal::Null,
        Value::Bool(b) => Literal::Bool(*b),
        Value::Number(n) => Literal::Num(number(n, at)?),
        Value::String(s) => Literal::Str(s.as_str().into()),
        _ => return Err(PatternError::new(at, "match value must be a string, number, true, false, or null")),
    })
}

fn compile_matcher(item: &Value, at: &str) -> Result<Compiled, PatternError> {
    let Value::Object(map) = item else {
        return Ok(Compiled::Value(Matcher::Exact(literal(item, at)?)));
    };
    if map.len() != 1 {
        return Err(PatternError::new(at, "only one key allowed in a match expression"));
    }
    let Some((op, arg)) = map.iter().next() else {
        return Err(PatternError::new(at, "only one key allowed in a match expression"));
    };
    let at_op = child(at, op);
    let m = match op.as_str() {
        "exists" => match arg {
            Value::Bool(b) => return Ok(Compiled::Exists(*b)),
            _ => return Err(PatternError::new(&at_op, "exists match pattern must be either true or false")),
        },
        "prefix" | "suffix" => {
            let is_prefix = op == "prefix";
            match arg {
                Value::String(s) if is_prefix => Matcher::Prefix(s.as_str().into()),
                Value::String(s) => Matcher::Suffix(s.as_str().into()),
                Value::Object(inner) => {
                    let s = ignore_case_arg(inner, &at_op)?;
                    if is_prefix {
                        Matcher::PrefixIgnoreCase(s)
                    } else {
                        Matcher::SuffixIgnoreCase(s)
                    }
                }
                _ => return Err(PatternError::new(&at_op, format!("{op} match pattern must be a string"))),
            }
        }
        "equals-ignore-case" => match arg {
            Value::String(s) => Matcher::EqualsIgnoreCase(lowercase(s)),
            _ => return Err(PatternError::new(&at_op, "equals-ignore-case match pattern must be a string")),
        },
        "wildcard" => match arg {
            Value::String(s) => Matcher::Wildcard(Wildcard::compile(s).map_err(|m| PatternError::new(&at_op, m))?),
            _ => return Err(PatternError::new(&at_op, "wildcard match pattern must be a string")),
        },
        "anything-but" => Matcher::AnythingBut(anything_but(arg, &at_op)?),
        "numeric" => Matcher::Numeric(numeric(arg, &at_op)?),
        "cidr" => Matcher::Cidr(cidr(arg, &at_op)?),
        other => return Err(PatternError::new(&at_op, format!("unrecognized match type {other:?} (operators are lower case: prefix, suffix, equals-ignore-case, wildcard, anything-but, numeric, exists, cidr)"))),
    };
    Ok(Compiled::Value(m))
}

/// `{"equals-ignore-case": "text"}` inside prefix or suffix.
fn ignore_case_arg(inner: &Map<String, Value>, at: &str) -> Result<Box<str>, PatternError> {
    match (inner.len(), inner.get("equals-ignore-case")) {
        (1, Some(Value::String(s))) => Ok(lowercase(s)),
        (1, Some(_)) => Err(PatternError::new(&child(at, "equals-ignore-case"), "equals-ignore-case match pattern must be a string")),
        _ => Err(PatternError::new(at, "only equals-ignore-case may be nested here")),
    }
}

fn lowercase(s: &str) -> Box<str> {
    s.chars().flat_map(char::to_lowercase).collect::<String>().into_boxed_str()
}

fn strings(arg: &Value, at: &str, what: &str, allow_empty_string: bool) -> Result<Vec<String>, PatternError> {
    let one = |v: &Value, at: &str| -> Result<String, PatternError> {
        match v {
            Value::String(s) if s.is_empty() && !allow_empty_string => {
                Err(PatternError::new(at, format!("an empty {what} is not allowed inside anything-but")))
            }
            Value::String(s) => Ok(s.clone()),
            _ => Err(PatternError::new(at, format!("{what} match pattern must be a string or an array of strings"))),
        }
    };
    match arg {
        Value::Array(items) if items.is_empty() => Err(PatternError::new(at, "empty arrays are not allowed")),
        Value::Array(items) => items.iter().enumerate().map(|(i, v)| one(v, &index(at, i))).collect(),
        other => Ok(vec![one(other, at)?]),
    }
}

fn anything_but(arg: &Value, at: &str) -> Result<AnythingBut, PatternError> {
    match arg {
        Value::String(_) | Value::Number(_) => Ok(AnythingBut::Values(vec![literal(arg, at)?])),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(PatternError::new(at, "empty arrays are not allowed"));
            }
            let mut values = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                let at_i = index(at, i);
                match v {
                    Value::String(_) | Value::Number(_) => values.push(literal(v, &at_i)?),
                    _ => {
                        return Err(PatternError::new(
                            &at_i,
                            "inside an anything-but list only strings and numbers are allowed (null, booleans, objects and arrays are not)",
                        ))
                    }
                }
            }
            let strings = values.iter().filter(|l| matches!(l, Literal::Str(_))).count();
            if strings != 0 && strings != values.len() {
                return Err(PatternError::new(at, "an anything-but list must hold only strings or only numbers"));
            }
            Ok(AnythingBut::Values(values))
        }
        Value::Object(inner) => {
            if inner.len() != 1 {
                return Err(PatternError::new(at, "anything-but takes exactly one of prefix, suffix, equals-ignore-case, wildcard"));
            }
            let Some((op, v)) = inner.iter().next() else {
                return Err(PatternError::new(at, "anything-but takes exactly one of prefix, suffix, equals-ignore-case, wildcard"));
            };
            let at_op = child(at, op);
            match op.as_str() {
                "prefix" => Ok(AnythingBut::Prefixes(strings(v, &at_op, "prefix", false)?.into_iter().map(Into::into).collect())),
                "suffix" => Ok(AnythingBut::Suffixes(strings(v, &at_op, "suffix", false)?.into_iter().map(Into::into).collect())),
                "equals-ignore-case" => {
                    Ok(AnythingBut::IgnoreCase(strings(v, &at_op, "equals-ignore-case", true)?.iter().map(|s| lowercase(s)).collect()))
                }
                "wildcard" => {
                    let list = strings(v, &at_op, "wildcard", true)?;
                    let mut out = Vec::with_capacity(list.len());
                    for s in &list {
                        out.push(Wildcard::compile(s).map_err(|m| PatternError::new(&at_op, m))?);
                    }
                    Ok(AnythingBut::Wildcards(out))
                }
                other => Err(PatternError::new(&at_op, format!("unsupported anything-but pattern: {other:?}"))),
            }
        }
        _ => Err(PatternError::new(
            at,
            "anything-but must be a string, a number, an array of them, or an object with prefix, suffix, equals-ignore-case or wildcard",
        )),
    }
}

fn numeric(arg: &Value, at: &str) -> Result<NumericRange, PatternError> {
    let Value::Array(items) = arg else {
        return Err(PatternError::new(at, "numeric must be an array like [\">\", 0, \"<=\", 5]"));
    };
    if items.is_empty() {
        return Err(PatternError::new(at, "empty arrays are not allowed"));
    }
    let op_at = |i: usize, allowed: &[&str]| -> Result<String, PatternError> {
        match items.get(i) {
            Some(Value::String(s)) if allowed.contains(&s.as_str()) => Ok(s.clone()),
            Some(Value::String(s)) => Err(PatternError::new(
                &index(at, i),
                format!("unrecognized numeric operator {s:?} here (expected one of {})", allowed.join(" ")),
            )),
            Some(other) => Err(PatternError::new(&index(at, i), format!("expected a numeric operator, found {other}"))),
            None => Err(PatternError::new(at, "missing numeric operator")),
        }
    };
    let num_at = |i: usize, op: &str| -> Result<Decimal, PatternError> {
        match items.get(i) {
            Some(Value::Number(n)) => number(n, &index(at, i)),
            Some(_) => Err(PatternError::new(&index(at, i), format!("value of {op} must be numeric"))),
            None => Err(PatternError::new(at, format!("value of {op} is missing"))),
        }
    };
    let first = op_at(0, &["<", "<=", "=", ">", ">="])?;
    let first_value = num_at(1, &first)?;
    let mut range = NumericRange::default();
    match first.as_str() {
        "=" => range.equal = Some(first_value),
        ">" => range.lower = Some((first_value, false)),
        ">=" => range.lower = Some((first_value, true)),
        "<" => range.upper = Some((first_value, false)),
        _ => range.upper = Some((first_value, true)),
    }
    if items.len() == 2 {
        return Ok(range);
    }
    if range.lower.is_none() {
        return Err(PatternError::new(
            at,
            "too many elements in numeric expression: only a lower bound (> or >=) may be followed by an upper bound",
        ));
    }
    let second = op_at(2, &["<", "<="])?;
    let second_value = num_at(3, &second)?;
    if second_value <= first_value {
        return Err(PatternError::new(at, "bottom of a numeric range must be less than its top"));
    }
    if items.len() > 4 {
        return Err(PatternError::new(at, "too many terms in numeric range expression"));
    }
    range.upper = Some((second_value, second == "<="));
    Ok(range)
}

fn cidr(arg: &Value, at: &str) -> Result<Cidr, PatternError> {
    let Value::String(s) = arg else {
        return Err(PatternError::new(at, "cidr match pattern must be a string like \"10.0.0.0/24\""));
    };
    let Some((ip, bits)) = s.split_once('/') else {
        return Err(PatternError::new(at, format!("malformed CIDR {s:?}: one '/' required")));
    };
    let bits: u8 = bits.parse().map_err(|_| PatternError::new(at, format!("malformed CIDR {s:?}: mask bits must be an integer")))?;
    let ip: IpAddr = ip.parse().map_err(|_| PatternError::new(at, format!("nonstandard IP address {ip:?}")))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if bits > max {
        return Err(PatternError::new(at, format!("malformed CIDR {s:?}: at most {max} mask bits")));
    }
    Ok(Cidr::new(ip, bits))
}

impl Wildcard {
    /// `*` matches any run of characters (also none); `\*` and `\\` are a literal star and
    /// backslash. AWS refuses `**` and patterns with too many stars.
    fn compile(s: &str) -> Result<Wildcard, String> {
        let mut parts: Vec<String> = vec![String::new()];
        let mut chars = s.char_indices().peekable();
        let mut stars = 0;
        let mut prev_star = false;
        while let Some((pos, c)) = chars.next() {
            match c {
                '*' => {
                    if prev_star {
                        return Err(format!("consecutive wildcard characters at position {pos}"));
                    }
                    stars += 1;
                    parts.push(String::new());
                    prev_star = true;
                    continue;
                }
                '\\' => match chars.next() {
                    Some((_, e @ ('*' | '\\'))) => {
                        if let Some(last) = parts.last_mut() {
                            last.push(e);
                        }
                    }
                    _ => return Err(format!("invalid escape at position {pos}: only \\* and \\\\ are allowed")),
                },
                c => {
                    if let Some(last) = parts.last_mut() {
                        last.push(c);
                    }
                }
            }
            prev_star = false;
        }
        if stars > MAX_WILDCARD_STARS {
            return Err(format!("rule is too complex: at most {MAX_WILDCARD_STARS} wildcard characters are allowed, found {stars}"));
        }
        Ok(Wildcard::from_parts(parts))
    }
}
