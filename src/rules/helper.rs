//! Helper items: the reference counts behind `max`, `min`, `latest` and `distinct`.
//!
//! These measures are not invertible: deleting the order that holds the maximum cannot be
//! undone from the maximum alone. So per (target, measure, value) a helper item next to the
//! target counts the images that hold the value. It has the target's partition key and the
//! sort key `<target SK>#_agg#<measure>#<value>`, and it is written like any count target:
//! coalesced, through the ledger, exactly once. The target's attribute is then derived from
//! the helpers whose count is above zero ([`derive`]): the greatest or least value, the value
//! with the greatest `by`, or how many values there are.
//!
//! Values are encoded so that DynamoDB's sort-key order (UTF-8 bytes) is the measure's order:
//! every N below every S, numbers numerically ([`Decimal::sortable`]), strings by their bytes
//! (the characters that sort at or below `$` escaped, so `#` can end a part).

use crate::decimal::Decimal;

/// Between the target's sort key and the helper's measure: a target key never holds it.
pub const MARK: &str = "#_agg#";
/// The helper item's attribute: how many images hold its value.
pub const REFS: &str = "refs";

/// Bytes at or below this are escaped in strings: `#` (0x23) ends a part and sorts below
/// every encoded byte.
const ESCAPE: u8 = b'$';
const ESCAPE_OFFSET: u8 = 0x40;

/// A value the measures compare: N numerically, S by bytes, every N below every S.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scalar {
    N(Decimal),
    S(String),
}

impl Scalar {
    /// Order-preserving and reversible; never holds `#`.
    pub fn encode(&self) -> String {
        match self {
            Scalar::N(n) => format!("N{}", n.sortable()),
            Scalar::S(s) => {
                let mut out = Vec::with_capacity(s.len() + 1);
                out.push(b'S');
                for b in s.bytes() {
                    if b <= ESCAPE {
                        out.extend([ESCAPE, ESCAPE_OFFSET + b]);
                    } else {
                        out.push(b);
                    }
                }
                // Only ASCII bytes were replaced by ASCII bytes: still UTF-8.
                String::from_utf8(out).unwrap_or_default()
            }
        }
    }

    pub fn decode(text: &str) -> Option<Scalar> {
        if let Some(n) = text.strip_prefix('N') {
            return Decimal::from_sortable(n).map(Scalar::N);
        }
        let s = text.strip_prefix('S')?;
        let mut out = Vec::with_capacity(s.len());
        let mut bytes = s.bytes();
        while let Some(b) = bytes.next() {
            match b {
                ESCAPE => {
                    let e = bytes.next()?.checked_sub(ESCAPE_OFFSET).filter(|e| *e <= ESCAPE)?;
                    out.push(e);
                }
                b if b < ESCAPE => return None,
                b => out.push(b),
            }
        }
        String::from_utf8(out).ok().map(Scalar::S)
    }
}

/// How a target attribute is derived from its live helpers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Derive {
    Max,
    Min,
    /// The value of the helper with the greatest `by` (ties: the greatest value).
    Latest,
    /// How many values are live.
    Distinct,
}

impl Derive {
    pub fn as_str(self) -> &'static str {
        match self {
            Derive::Max => "max",
            Derive::Min => "min",
            Derive::Latest => "latest",
            Derive::Distinct => "distinct",
        }
    }

    /// Which helper the derivation needs first, for a Query with Limit: the greatest sort
    /// key (max, latest), the least (min), or every one (distinct counts them).
    pub fn scan(self) -> HelperScan {
        match self {
            Derive::Max | Derive::Latest => HelperScan::Last,
            Derive::Min => HelperScan::First,
            Derive::Distinct => HelperScan::Count,
        }
    }

    /// The helper's sort-key part for one image's value (and its `by`, for latest).
    pub fn tail(self, value: &Scalar, by: Option<&Scalar>) -> String {
        match (self, by) {
            (Derive::Latest, Some(by)) => format!("{}#{}", by.encode(), value.encode()),
            _ => value.encode(),
        }
    }

    /// The target attribute's value for the live helper found first (or the count of live
    /// helpers, for distinct). None: nothing contributes, the attribute is removed.
    pub fn value(self, first_live: Option<&str>, live: u64) -> Option<Scalar> {
        match self {
            Derive::Distinct => (live > 0).then(|| Scalar::N(Decimal::from_i64(i64::try_from(live).unwrap_or(i64::MAX)))),
            Derive::Latest => Scalar::decode(first_live?.split_once('#')?.1),
            Derive::Max | Derive::Min => Scalar::decode(first_live?),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelperScan {
    First,
    Last,
    Count,
}

/// The sort keys of one target measure's helpers begin with this.
pub fn prefix(owner_sk: &str, measure: &str) -> String {
    format!("{owner_sk}{MARK}{measure}#")
}

/// A string above every string that begins with `prefix` and at most a string that does
/// not: `prefix` with its last byte raised by one (helper prefixes end with `#`).
pub fn successor(prefix: &str) -> String {
    match prefix.as_bytes().split_last() {
        Some((last, rest)) if *last < 0x7f => format!("{}{}", &prefix[..rest.len()], char::from(last + 1)),
        _ => format!("{prefix}{}", char::MAX),
    }
}

/// Whether helper tail `a` comes before `b` in the order `scan` reads them.
pub fn before(scan: HelperScan, a: &str, b: &str) -> bool {
    match scan {
        HelperScan::First => a < b,
        HelperScan::Last => a > b,
        HelperScan::Count => false,
    }
}

/// A helper item's sort key, taken apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelperKey<'a> {
    pub owner_sk: &'a str,
    pub measure: &'a str,
    pub tail: &'a str,
}

/// The parts of a helper's sort key; None for any other key.
pub fn parse(sk: &str) -> Option<HelperKey<'_>> {
    let at = sk.find(MARK)?;
    let (measure, tail) = sk[at + MARK.len()..].split_once('#')?;
    (!measure.is_empty() && !tail.is_empty()).then_some(HelperKey { owner_sk: &sk[..at], measure, tail })
}

/// The pure decision of one derivation: the attribute's value from the helpers' (tail, refs)
/// in sort-key order. The stores compute the same with a Query; tests use this.
pub fn derive<'a>(how: Derive, helpers: impl IntoIterator<Item = (&'a str, Decimal)>) -> Option<Scalar> {
    let live: Vec<&str> = helpers.into_iter().filter(|(_, n)| *n > Decimal::ZERO).map(|(t, _)| t).collect();
    let first = match how.scan() {
        HelperScan::First => live.iter().min(),
        HelperScan::Last | HelperScan::Count => live.iter().max(),
    };
    how.value(first.copied(), live.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Scalar {
        Scalar::N(Decimal::parse(s).unwrap())
    }

    fn s(v: &str) -> Scalar {
        Scalar::S(v.to_string())
    }

    #[test]
    fn encodings_sort_as_the_values_and_read_back() {
        let values = [
            n("-5"),
            n("0"),
            n("2.5"),
            n("10"),
            s(""),
            s(" "),
            s("!x"),
            s("#"),
            s("$"),
            s("%"),
            s("2026-11-30"),
            s("2026-11-30 10:00"),
            s("2026-11-30T10:00"),
            s("a"),
            s("a\u{0}"),
            s("a b"),
            s("ab"),
            s("é"),
        ];
        for w in values.windows(2) {
            assert!(w[0] < w[1], "{:?} < {:?}", w[0], w[1]);
            let (a, b) = (w[0].encode(), w[1].encode());
            assert!(a < b, "{a:?} < {b:?}");
            assert!(format!("{a}#z") < format!("{b}#a"), "a part ended by # keeps the order: {a:?} {b:?}");
        }
        for v in &values {
            assert!(!v.encode().contains('#'), "{v:?}");
            assert_eq!(Scalar::decode(&v.encode()).as_ref(), Some(v));
        }
        for bad in ["", "X", "S#", "S$", "S$z", "Nq"] {
            assert_eq!(Scalar::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn keys_take_apart() {
        let sk = format!("{}{}", prefix("PROFILE#x", "lastStatus"), Derive::Latest.tail(&s("PAID"), Some(&n("7"))));
        let k = parse(&sk).unwrap();
        assert_eq!((k.owner_sk, k.measure), ("PROFILE#x", "lastStatus"));
        assert_eq!(Derive::Latest.value(Some(k.tail), 1), Some(s("PAID")));
        assert_eq!(parse("PROFILE"), None);
        assert_eq!(parse("PROFILE#_agg#m"), None, "no tail");
    }

    #[test]
    fn derivations_skip_helpers_without_references() {
        let tails: Vec<(String, Decimal)> =
            [("9", 0), ("7", 1), ("3", 2), ("12", 0)].iter().map(|(v, c)| (n(v).encode(), Decimal::from_i64(*c))).collect();
        let h = || tails.iter().map(|(t, c)| (t.as_str(), *c));
        assert_eq!(derive(Derive::Max, h()), Some(n("7")), "12 and 9 were deleted");
        assert_eq!(derive(Derive::Min, h()), Some(n("3")));
        assert_eq!(derive(Derive::Distinct, h()), Some(n("2")));
        let none: Vec<(&str, Decimal)> = vec![("N1", Decimal::ZERO)];
        assert_eq!(derive(Derive::Max, none.clone()), None, "nothing contributes: the attribute goes");
        assert_eq!(derive(Derive::Distinct, none), None);
        let latest =
            [(Derive::Latest.tail(&s("SHIPPED"), Some(&s("2026-12-02"))), 1), (Derive::Latest.tail(&s("PAID"), Some(&s("2026-12-01"))), 1)];
        assert_eq!(derive(Derive::Latest, latest.iter().map(|(t, c)| (t.as_str(), Decimal::from_i64(*c)))), Some(s("SHIPPED")));
    }
}
