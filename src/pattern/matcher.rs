//! Value matchers. Matching never allocates: case-insensitive comparisons walk lower-cased
//! character streams, numbers parse into a `Copy` decimal.

use std::net::IpAddr;

use serde_json::Value;

use crate::decimal::Decimal;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Literal {
    Str(Box<str>),
    Num(Decimal),
    Bool(bool),
    Null,
}

#[derive(Debug, Clone)]
pub(super) enum Matcher {
    Exact(Literal),
    Prefix(Box<str>),
    /// Lower-cased prefix.
    PrefixIgnoreCase(Box<str>),
    Suffix(Box<str>),
    SuffixIgnoreCase(Box<str>),
    /// Lower-cased text.
    EqualsIgnoreCase(Box<str>),
    Wildcard(Wildcard),
    AnythingBut(AnythingBut),
    Numeric(NumericRange),
    Cidr(Cidr),
}

#[derive(Debug, Clone)]
pub(super) enum AnythingBut {
    Values(Vec<Literal>),
    Prefixes(Vec<Box<str>>),
    Suffixes(Vec<Box<str>>),
    /// Lower-cased.
    IgnoreCase(Vec<Box<str>>),
    Wildcards(Vec<Wildcard>),
}

#[derive(Debug, Clone, Default)]
pub(super) struct NumericRange {
    pub equal: Option<Decimal>,
    /// (bound, inclusive)
    pub lower: Option<(Decimal, bool)>,
    pub upper: Option<(Decimal, bool)>,
}

#[derive(Debug, Clone)]
pub(super) struct Cidr {
    network: IpAddr,
    bits: u8,
}

/// A glob where `*` matches any run of characters: literal parts between the stars.
#[derive(Debug, Clone)]
pub(super) struct Wildcard {
    /// parts[0] is the prefix, the last part the suffix; len == stars + 1.
    parts: Vec<Box<str>>,
}

/// A scalar from the event, with numbers decoded once.
pub(super) enum Scalar<'a> {
    Str(&'a str),
    Num(Option<Decimal>),
    Bool(bool),
    Null,
}

fn scalar(v: &Value) -> Scalar<'_> {
    match v {
        Value::String(s) => Scalar::Str(s),
        Value::Number(n) => Scalar::Num(Decimal::parse(n.as_str()).ok()),
        Value::Bool(b) => Scalar::Bool(*b),
        _ => Scalar::Null,
    }
}

impl Matcher {
    /// `numeric_strings`: string values at this leaf are DynamoDB numbers.
    pub(super) fn matches(&self, value: &Value, numeric_strings: bool) -> bool {
        self.matches_scalar(&scalar(value), numeric_strings)
    }

    /// [`Self::matches`] on a scalar already taken from the event.
    pub(super) fn matches_scalar(&self, v: &Scalar<'_>, numeric_strings: bool) -> bool {
        // The value as a number, for numeric comparisons.
        let as_number = || match v {
            Scalar::Num(n) => *n,
            Scalar::Str(s) if numeric_strings => Decimal::parse(s).ok(),
            _ => None,
        };
        match self {
            Matcher::Exact(lit) => literal_eq(lit, v, numeric_strings),
            Matcher::Prefix(p) => matches!(v, Scalar::Str(s) if s.starts_with(&**p)),
            Matcher::Suffix(p) => matches!(v, Scalar::Str(s) if s.ends_with(&**p)),
            Matcher::PrefixIgnoreCase(p) => matches!(v, Scalar::Str(s) if prefix_ignore_case(s, p)),
            Matcher::SuffixIgnoreCase(p) => matches!(v, Scalar::Str(s) if suffix_ignore_case(s, p)),
            Matcher::EqualsIgnoreCase(p) => matches!(v, Scalar::Str(s) if equals_ignore_case(s, p)),
            Matcher::Wildcard(w) => matches!(v, Scalar::Str(s) if w.matches(s)),
            Matcher::Numeric(range) => as_number().is_some_and(|n| range.contains(n)),
            Matcher::Cidr(c) => matches!(v, Scalar::Str(s) if c.contains(s)),
            // anything-but needs a value to be present (missing fields never match), but null,
            // booleans and values of another type are "anything but" the listed ones.
            Matcher::AnythingBut(ab) => match ab {
                AnythingBut::Values(list) => !list.iter().any(|lit| literal_eq(lit, v, numeric_strings)),
                AnythingBut::Prefixes(list) => !matches!(v, Scalar::Str(s) if list.iter().any(|p| s.starts_with(&**p))),
                AnythingBut::Suffixes(list) => !matches!(v, Scalar::Str(s) if list.iter().any(|p| s.ends_with(&**p))),
                AnythingBut::IgnoreCase(list) => !matches!(v, Scalar::Str(s) if list.iter().any(|p| equals_ignore_case(s, p))),
                AnythingBut::Wildcards(list) => !matches!(v, Scalar::Str(s) if list.iter().any(|w| w.matches(s))),
            },
        }
    }
}

fn literal_eq(lit: &Literal, v: &Scalar<'_>, numeric_strings: bool) -> bool {
    match (lit, v) {
        (Literal::Str(a), Scalar::Str(b)) => &**a == *b,
        (Literal::Num(a), Scalar::Num(Some(b))) => a == b,
        (Literal::Num(a), Scalar::Str(b)) if numeric_strings => Decimal::parse(b).is_ok_and(|b| *a == b),
        (Literal::Bool(a), Scalar::Bool(b)) => a == b,
        (Literal::Null, Scalar::Null) => true,
        _ => false,
    }
}

fn lower(s: &str) -> impl DoubleEndedIterator<Item = char> + '_ {
    s.chars().flat_map(char::to_lowercase)
}

fn prefix_ignore_case(s: &str, lower_prefix: &str) -> bool {
    let mut value = lower(s);
    lower_prefix.chars().all(|c| value.next() == Some(c))
}

fn suffix_ignore_case(s: &str, lower_suffix: &str) -> bool {
    let mut value = s.chars().rev().flat_map(|c| c.to_lowercase().rev());
    lower_suffix.chars().rev().all(|c| value.next() == Some(c))
}

fn equals_ignore_case(s: &str, lower_text: &str) -> bool {
    lower(s).eq(lower_text.chars())
}

impl NumericRange {
    fn contains(&self, n: Decimal) -> bool {
        if let Some(e) = self.equal {
            return n == e;
        }
        let above = match self.lower {
            Some((b, inclusive)) => n > b || (inclusive && n == b),
            None => true,
        };
        let below = match self.upper {
            Some((b, inclusive)) => n < b || (inclusive && n == b),
            None => true,
        };
        above && below
    }
}

impl Cidr {
    pub(super) fn new(ip: IpAddr, bits: u8) -> Cidr {
        Cidr { network: ip, bits }
    }

    fn contains(&self, value: &str) -> bool {
        let Ok(ip) = value.parse::<IpAddr>() else {
            return false;
        };
        match (self.network, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => same_prefix(u128::from(u32::from(net)), u128::from(u32::from(ip)), self.bits, 32),
            (IpAddr::V6(net), IpAddr::V6(ip)) => same_prefix(u128::from(net), u128::from(ip), self.bits, 128),
            _ => false,
        }
    }
}

fn same_prefix(a: u128, b: u128, bits: u8, width: u32) -> bool {
    let bits = u32::from(bits).min(width);
    if bits == 0 {
        return true;
    }
    let shift = width - bits;
    a.checked_shr(shift).unwrap_or(0) == b.checked_shr(shift).unwrap_or(0)
}

impl Wildcard {
    pub(super) fn from_parts(parts: Vec<String>) -> Wildcard {
        Wildcard { parts: parts.into_iter().map(String::into_boxed_str).collect() }
    }

    /// Greedy glob match: anchored prefix and suffix, the middle parts found left to right.
    fn matches(&self, s: &str) -> bool {
        let parts = &self.parts;
        if parts.len() == 1 {
            return s == &*parts[0];
        }
        let (first, last) = (&*parts[0], &*parts[parts.len() - 1]);
        if s.len() < first.len() + last.len() || !s.starts_with(first) || !s.ends_with(last) {
            return false;
        }
        let mut rest = &s[first.len()..s.len() - last.len()];
        for mid in &parts[1..parts.len() - 1] {
            match rest.find(&**mid) {
                Some(at) => rest = &rest[at + mid.len()..],
                None => return false,
            }
        }
        true
    }
}
