//! Key templates: `CUST#{customer}` captures from a source key, `SALES#{date|day}` expands into
//! a target key or an attribute name.
//!
//! A capture is a non-empty run of characters without `#`, so `CUST#{customer}` does not match
//! `CUST#c1#x`. To keep matching deterministic a capture must end the template or be followed by
//! `#`. An expanded value must not contain `#` and must not be empty: that would write to a key
//! nobody intended.

use std::fmt;

use chrono::{DateTime, Datelike, NaiveDate, NaiveDateTime, Timelike, Utc};

use crate::decimal::Decimal;

/// The key delimiter of single-table design.
pub const DELIMITER: char = '#';

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Literal(String),
    Var { name: String, func: Option<TimeFunc> },
}

fn literal(part: Option<&Part>) -> &str {
    match part {
        Some(Part::Literal(l)) => l.as_str(),
        _ => "",
    }
}

/// Truncation of a timestamp to a calendar unit (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeFunc {
    Hour,
    Day,
    Month,
    Year,
}

impl TimeFunc {
    fn parse(s: &str) -> Option<TimeFunc> {
        match s {
            "hour" => Some(TimeFunc::Hour),
            "day" => Some(TimeFunc::Day),
            "month" => Some(TimeFunc::Month),
            "year" => Some(TimeFunc::Year),
            _ => None,
        }
    }

    /// Whether `text` has the shape this function writes: a year of 4 or more characters,
    /// digits (signed before year 0), then `-MM`, `-DD` and `THH` as deep as the function goes. Two rules that
    /// differ only by the function (`SALES#{date|day}`, `SALES#{date|month}`) then never claim
    /// each other's items.
    fn could_write(self, text: &str) -> bool {
        fn two(s: &str, sep: char) -> Option<&str> {
            let r = s.strip_prefix(sep)?;
            r.get(..2).filter(|d| d.bytes().all(|b| b.is_ascii_digit()))?;
            r.get(2..)
        }
        // `{:04}` pads the sign too: year -1 is `-001`.
        let (unsigned, least) = text.strip_prefix(['-', '+']).map_or((text, 4), |u| (u, 3));
        let digits = unsigned.bytes().take_while(u8::is_ascii_digit).count();
        if digits < least {
            return false;
        }
        let mut rest = Some(&unsigned[digits..]);
        let depth = match self {
            TimeFunc::Year => 0,
            TimeFunc::Month => 1,
            TimeFunc::Day => 2,
            TimeFunc::Hour => 3,
        };
        for sep in ['-', '-', 'T'].into_iter().take(depth) {
            rest = rest.and_then(|r| two(r, sep));
        }
        rest == Some("")
    }

    /// Writes the truncated time: `2026-11-30T13`, `2026-11-30`, `2026-11`, `2026`.
    fn write(self, t: &NaiveDateTime, out: &mut String) {
        use std::fmt::Write;
        let _ = write!(out, "{:04}", t.year());
        if self != TimeFunc::Year {
            let _ = write!(out, "-{:02}", t.month());
        }
        if matches!(self, TimeFunc::Day | TimeFunc::Hour) {
            let _ = write!(out, "-{:02}", t.day());
        }
        if self == TimeFunc::Hour {
            let _ = write!(out, "T{:02}", t.hour());
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TimeFunc::Hour => "hour",
            TimeFunc::Day => "day",
            TimeFunc::Month => "month",
            TimeFunc::Year => "year",
        }
    }
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    text: String,
    parts: Vec<Part>,
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Template {
    /// Parses `text`; `{name}` or `{name|func}` are variables.
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(format!("unmatched '}}' at position {}", text.len() - rest.len() + open));
            }
            literal.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                return Err(format!("unclosed '{{' at position {}", text.len() - rest.len() + open));
            };
            let inner = &after[..close];
            let (name, func) = match inner.split_once('|') {
                Some((n, f)) => {
                    let func = TimeFunc::parse(f.trim()).ok_or_else(|| {
                        format!("unknown template function {:?} in {{{inner}}} (known: day, hour, month, year)", f.trim())
                    })?;
                    (n.trim(), Some(func))
                }
                None => (inner.trim(), None),
            };
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("variable name {name:?} must be letters, digits or _"));
            }
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal)));
            }
            parts.push(Part::Var { name: name.to_string(), func });
            rest = &after[close + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Template { text: text.to_string(), parts })
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn variables(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Var { name, .. } => Some(name.as_str()),
            Part::Literal(_) => None,
        })
    }

    pub fn is_literal(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Literal(_)))
    }

    /// Checks that this template can capture: no functions, each capture followed by `#` or
    /// the end.
    pub fn check_capturing(&self) -> Result<(), String> {
        for (i, part) in self.parts.iter().enumerate() {
            if let Part::Var { name, func } = part {
                if let Some(f) = func {
                    return Err(format!("{{{name}|{}}}: functions apply to target templates, not to captures", f.name()));
                }
                match self.parts.get(i + 1) {
                    None => {}
                    Some(Part::Literal(l)) if l.starts_with(DELIMITER) => {}
                    Some(_) => return Err(format!("capture {{{name}}} must be followed by '#' or end the template")),
                }
            }
        }
        Ok(())
    }

    /// Whether `text` could be an expansion of this template (each variable standing for a
    /// non-empty run of characters without `#`, of the shape its time function writes).
    pub fn matches_expansion(&self, text: &str) -> bool {
        fn go(parts: &[Part], text: &str) -> bool {
            match parts.split_first() {
                None => text.is_empty(),
                Some((Part::Literal(l), rest)) => text.strip_prefix(l.as_str()).is_some_and(|t| go(rest, t)),
                Some((Part::Var { func, .. }, rest)) => {
                    let limit = text.find(DELIMITER).unwrap_or(text.len());
                    text[..limit]
                        .char_indices()
                        .map(|(i, c)| i + c.len_utf8())
                        .filter(|&end| func.is_none_or(|f| f.could_write(&text[..end])))
                        .any(|end| go(rest, &text[end..]))
                }
            }
        }
        go(&self.parts, text)
    }

    /// Whether some expansion of this template could equal some expansion of `other`: exact
    /// when either is literal; otherwise judged by the literal text before the first and after
    /// the last variable (an over-approximation: it may say yes where no text is shared).
    pub fn may_overlap(&self, other: &Template) -> bool {
        match (self.is_literal(), other.is_literal()) {
            (true, true) => self.text == other.text,
            (true, false) => other.matches_expansion(&self.text),
            (false, true) => self.matches_expansion(&other.text),
            (false, false) if self.time_shapes_differ(other) => false,
            (false, false) => {
                let (p1, s1) = self.literal_ends();
                let (p2, s2) = other.literal_ends();
                (p1.starts_with(p2) || p2.starts_with(p1)) && (s1.ends_with(s2) || s2.ends_with(s1))
            }
        }
    }

    /// Whether the two are the same text around one variable each, truncated by different
    /// time functions (`SALES#{date|day}` and `SALES#{date|month}`): their expansions never
    /// meet, as they hold different numbers of `-` after the year (0, 1, 2) and only the hour
    /// holds a `T`.
    fn time_shapes_differ(&self, other: &Template) -> bool {
        fn shape(t: &Template) -> Option<(&str, TimeFunc, &str)> {
            match t.parts.as_slice() {
                [Part::Var { func: Some(f), .. }] => Some(("", *f, "")),
                [Part::Literal(a), Part::Var { func: Some(f), .. }] => Some((a, *f, "")),
                [Part::Var { func: Some(f), .. }, Part::Literal(b)] => Some(("", *f, b)),
                [Part::Literal(a), Part::Var { func: Some(f), .. }, Part::Literal(b)] => Some((a, *f, b)),
                _ => None,
            }
        }
        matches!((shape(self), shape(other)), (Some((a1, f1, b1)), Some((a2, f2, b2))) if a1 == a2 && b1 == b2 && f1 != f2)
    }

    /// The literal text before the first variable and after the last.
    fn literal_ends(&self) -> (&str, &str) {
        (literal(self.parts.first()), literal(self.parts.last()))
    }

    /// Matches `value`, pushing `(variable, captured text)`; false if it does not match.
    pub fn capture<'t, 'v>(&'t self, value: &'v str, out: &mut Vec<(&'t str, &'v str)>) -> bool {
        let mut pos = 0;
        for part in &self.parts {
            let rest = &value[pos..];
            match part {
                Part::Literal(l) => {
                    if !rest.starts_with(l.as_str()) {
                        return false;
                    }
                    pos += l.len();
                }
                Part::Var { name, .. } => {
                    let len = rest.find(DELIMITER).unwrap_or(rest.len());
                    if len == 0 {
                        return false;
                    }
                    out.push((name.as_str(), &rest[..len]));
                    pos += len;
                }
            }
        }
        pos == value.len()
    }

    /// Expands with `lookup(name)`; each variable's value must be non-empty and free of `#`.
    pub fn expand<'a>(&self, mut lookup: impl FnMut(&str) -> Option<VarValue<'a>>) -> Result<String, ExpandError> {
        let mut out = String::with_capacity(self.text.len() + 16);
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Var { name, func } => {
                    let value = lookup(name).ok_or_else(|| ExpandError::Missing(name.clone()))?;
                    let start = out.len();
                    match (value, func) {
                        (VarValue::Str(s), None) => out.push_str(s),
                        (VarValue::Num(n), None) => {
                            use std::fmt::Write;
                            let _ = write!(out, "{n}");
                        }
                        (v, Some(f)) => {
                            let t = timestamp(v).map_err(|why| ExpandError::BadTimestamp { name: name.clone(), why })?;
                            f.write(&t, &mut out);
                        }
                    }
                    let expanded = &out[start..];
                    if expanded.is_empty() {
                        return Err(ExpandError::Empty(name.clone()));
                    }
                    if expanded.contains(DELIMITER) {
                        return Err(ExpandError::Delimiter(name.clone()));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A variable's value: a captured string, or an image attribute (S or N).
#[derive(Debug, Clone, Copy)]
pub enum VarValue<'a> {
    Str(&'a str),
    Num(Decimal),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpandError {
    Missing(String),
    Empty(String),
    Delimiter(String),
    BadTimestamp { name: String, why: String },
}

/// Latest instant we accept as epoch seconds: 9999-12-31T23:59:59Z. Larger values are most
/// likely milliseconds and would silently land in the year 50000.
const MAX_EPOCH_SECONDS: i64 = 253_402_300_799;

/// Reads an ISO-8601 string (a date, or a date-time with or without offset: with an offset it
/// is converted to UTC) or epoch seconds (a number, or a string of digits).
fn timestamp(v: VarValue<'_>) -> Result<NaiveDateTime, String> {
    match v {
        VarValue::Num(n) => epoch(n),
        VarValue::Str(s) => {
            if let Some(t) = iso8601(s) {
                return Ok(t);
            }
            match Decimal::parse(s) {
                Ok(n) => epoch(n),
                Err(_) => Err("neither an ISO-8601 date/time nor epoch seconds".to_string()),
            }
        }
    }
}

fn epoch(n: Decimal) -> Result<NaiveDateTime, String> {
    let secs = n.trunc_i64().ok_or("epoch seconds out of range")?;
    if !(0..=MAX_EPOCH_SECONDS).contains(&secs) {
        return Err("epoch seconds out of range (0 to year 9999; milliseconds are not seconds)".to_string());
    }
    DateTime::<Utc>::from_timestamp(secs, 0).map(|t| t.naive_utc()).ok_or_else(|| "epoch seconds out of range".to_string())
}

fn iso8601(s: &str) -> Option<NaiveDateTime> {
    // The common shapes first: a plain date, then a full date-time with Z or an offset.
    if s.len() == 10 {
        return NaiveDate::parse_from_str(s, "%Y-%m-%d").ok()?.and_hms_opt(0, 0, 0);
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.naive_utc());
    }
    for fmt in ["%Y-%m-%dT%H:%M%:z", "%Y-%m-%dT%H:%M%#z"] {
        if let Ok(t) = DateTime::parse_from_str(s, fmt) {
            return Some(t.naive_utc());
        }
    }
    if let Some(no_z) = s.strip_suffix('Z').or_else(|| s.strip_suffix('z')) {
        if let Some(t) = naive(no_z) {
            return Some(t);
        }
    }
    naive(s)
}

fn naive(s: &str) -> Option<NaiveDateTime> {
    for fmt in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, fmt) {
            return Some(t);
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return d.and_hms_opt(0, 0, 0);
    }
    // Year-month and year alone (only 4-digit years, so "1764460800" stays epoch seconds).
    let bytes = s.as_bytes();
    if s.len() == 7 && bytes[4] == b'-' {
        return NaiveDate::parse_from_str(&format!("{s}-01"), "%Y-%m-%d").ok()?.and_hms_opt(0, 0, 0);
    }
    if s.len() == 4 && bytes.iter().all(u8::is_ascii_digit) {
        return NaiveDate::parse_from_str(&format!("{s}-01-01"), "%Y-%m-%d").ok()?.and_hms_opt(0, 0, 0);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps() {
        let t = |a: &str| Template::parse(a).unwrap();
        let cases = [
            ("PROFILE", "PROFILE", true),
            ("PROFILE", "TOTAL", false),
            ("orders_{status}", "orders_total", true),
            ("orders_{status}", "orderCount", false),
            ("orders_{status}", "orders_{kind}", true),
            ("CUST#{c}", "SALES#{d}", false),
            ("SALES#{date|day}", "SALES#{date|month}", false),
            ("SALES#{date|day}", "SALES#{date|hour}", false),
            ("SALES#{date|day}", "SALES#{other|day}", true),
            ("SALES#{date|day}", "SALES#{date}", true),
            ("{a}#{b}", "x#y", true),
            ("{a}#{b}", "x#y#z", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(t(a).may_overlap(&t(b)), want, "{a} / {b}");
            assert_eq!(t(b).may_overlap(&t(a)), want, "{b} / {a}");
        }
    }

    fn expand(t: &str, v: VarValue<'_>) -> Result<String, ExpandError> {
        Template::parse(t).unwrap().expand(|_| Some(v))
    }

    #[test]
    fn captures() {
        let t = Template::parse("ORDER#{date}#{order_id}").unwrap();
        let mut out = Vec::new();
        assert!(t.capture("ORDER#2026-11-30#o1", &mut out));
        assert_eq!(out, vec![("date", "2026-11-30"), ("order_id", "o1")]);
        for bad in ["ORDER#2026-11-30", "ORDER##o1", "ORDER#d#", "ORDER#d#o1#x", "ORDERS#d#o1", "order#d#o1", ""] {
            out.clear();
            assert!(!t.capture(bad, &mut out), "{bad}");
        }
        let c = Template::parse("CUST#{customer}").unwrap();
        assert!(!c.capture("CUST#c1#x", &mut out));
        assert!(!c.capture("CUST#", &mut out));
        let literal = Template::parse("PROFILE").unwrap();
        assert!(literal.capture("PROFILE", &mut out));
        assert!(!literal.capture("PROFILEX", &mut out));
    }

    #[test]
    fn expansions() {
        let t = Template::parse("orders_{status}").unwrap();
        assert!(t.matches_expansion("orders_PAID"));
        assert!(!t.matches_expansion("orders_"));
        assert!(!t.matches_expansion("orderCount"));
        assert!(!t.matches_expansion("orders_A#B"));
        let k = Template::parse("SALES#{date|day}").unwrap();
        assert!(k.matches_expansion("SALES#2026-11-30"));
        assert!(!k.matches_expansion("SALES#"));
        assert!(Template::parse("a{x}b{y}").unwrap().matches_expansion("a1b2b3"));
        // A time function's expansions have its shape only: a daily and a monthly rule never
        // claim each other's targets (reconcile and a rebuild would zero them).
        assert!(!k.matches_expansion("SALES#2026-11"));
        assert!(!Template::parse("{r}-{d|month}").unwrap().matches_expansion("eu-2026-11-30"), "11-30 is no month");
        assert!(Template::parse("{r}-{d|month}").unwrap().matches_expansion("eu-west-2026-11"));
        assert!(Template::parse("Y#{d|year}").unwrap().matches_expansion("Y#-001"), "before year 0");
        assert!(!Template::parse("Y#{d|year}").unwrap().matches_expansion("Y#é-1-2"));
        let shapes = ["2026", "2026-11", "2026-11-30", "2026-11-30T13"];
        for (f, want) in [("year", 0), ("month", 1), ("day", 2), ("hour", 3)] {
            let t = Template::parse(&format!("S#{{d|{f}}}#T")).unwrap();
            let matched: Vec<usize> = (0..4).filter(|&i| t.matches_expansion(&format!("S#{}#T", shapes[i]))).collect();
            assert_eq!(matched, [want], "{f}");
        }
    }

    #[test]
    fn capture_rules() {
        assert!(Template::parse("A#{x}{y}").unwrap().check_capturing().is_err());
        assert!(Template::parse("A#{x}-b").unwrap().check_capturing().is_err());
        assert!(Template::parse("A#{x|day}").unwrap().check_capturing().is_err());
        assert!(Template::parse("A#{x}#B#{y}").unwrap().check_capturing().is_ok());
        assert!(Template::parse("{x}").unwrap().check_capturing().is_ok());
    }

    #[test]
    fn parse_errors() {
        assert!(Template::parse("A#{x").unwrap_err().contains("unclosed"));
        assert!(Template::parse("A#x}").unwrap_err().contains("unmatched"));
        assert!(Template::parse("A#{}").unwrap_err().contains("variable name"));
        assert!(Template::parse("A#{a b}").unwrap_err().contains("variable name"));
        assert!(Template::parse("A#{x|week}").unwrap_err().contains("unknown template function"));
    }

    #[test]
    fn time_functions() {
        let s = |x| VarValue::Str(x);
        assert_eq!(expand("S#{d|day}", s("2026-11-30")).unwrap(), "S#2026-11-30");
        assert_eq!(expand("{d|day}", s("2026-11-30T23:59:59Z")).unwrap(), "2026-11-30");
        assert_eq!(expand("{d|day}", s("2026-12-01T01:30:00+02:00")).unwrap(), "2026-11-30");
        assert_eq!(expand("{d|day}", s("2026-11-30T22:30:00-02:00")).unwrap(), "2026-12-01");
        assert_eq!(expand("{d|day}", s("2026-11-30T22:30")).unwrap(), "2026-11-30");
        assert_eq!(expand("{d|hour}", s("2026-11-30T13:48:01.123Z")).unwrap(), "2026-11-30T13");
        assert_eq!(expand("{d|month}", s("2026-11-30")).unwrap(), "2026-11");
        assert_eq!(expand("{d|year}", s("2026-11")).unwrap(), "2026");
        assert_eq!(expand("{d|day}", s("1764460800")).unwrap(), "2025-11-30");
        assert_eq!(expand("{d|day}", VarValue::Num(Decimal::parse("1764547199.9").unwrap())).unwrap(), "2025-11-30");
        assert!(matches!(expand("{d|day}", s("yesterday")), Err(ExpandError::BadTimestamp { .. })));
        assert!(matches!(expand("{d|day}", s("1764460800000")), Err(ExpandError::BadTimestamp { .. })), "milliseconds");
        assert!(matches!(expand("{d|day}", s("-5")), Err(ExpandError::BadTimestamp { .. })));
        assert!(matches!(expand("{d|day}", s("2026-02-30")), Err(ExpandError::BadTimestamp { .. })));
    }

    #[test]
    fn expansion_refuses_delimiters_and_empty_values() {
        assert_eq!(expand("CUST#{c}", VarValue::Str("c1#x")), Err(ExpandError::Delimiter("c".into())));
        assert_eq!(expand("CUST#{c}", VarValue::Str("")), Err(ExpandError::Empty("c".into())));
        assert_eq!(Template::parse("CUST#{c}").unwrap().expand(|_| None), Err(ExpandError::Missing("c".into())));
        assert_eq!(expand("orders_{n}", VarValue::Num(Decimal::parse("1.50").unwrap())).unwrap(), "orders_1.5");
    }
}
