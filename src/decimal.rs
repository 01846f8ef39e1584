//! Exact decimal numbers within DynamoDB's number range.
//!
//! DynamoDB numbers have up to 38 significant digits and a magnitude between 1E-130 and
//! 9.99..9E+125. Sums of money must never go through floating point (0.1 + 0.2 is 0.3 here), so
//! values are a coefficient of at most 38 digits and a power of ten. Every operation is checked:
//! a result that DynamoDB could not store is an error, never a rounded value and never a panic.

use std::cmp::Ordering;
use std::fmt;

/// Most significant digits DynamoDB keeps.
pub const MAX_DIGITS: u32 = 38;
/// 10^38: coefficients stay strictly below this.
const COEF_LIMIT: i128 = 100_000_000_000_000_000_000_000_000_000_000_000_000;
/// Smallest adjusted exponent DynamoDB accepts (1E-130).
const MIN_ADJUSTED_EXP: i32 = -130;
/// Largest adjusted exponent DynamoDB accepts (9.9E+125).
const MAX_ADJUSTED_EXP: i32 = 125;

/// An exact decimal: `coef * 10^exp`, normalised (no trailing zeros in `coef`, zero has exp 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Decimal {
    coef: i128,
    exp: i32,
}

/// Why a number was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecimalError {
    #[error("not a number: {0:?}")]
    Syntax(String),
    #[error("more than 38 significant digits")]
    TooPrecise,
    #[error("magnitude outside DynamoDB's number range (1E-130 to 9.9E+125)")]
    OutOfRange,
}

fn pow10(n: u32) -> Option<i128> {
    10i128.checked_pow(n)
}

fn digits(mut v: i128) -> u32 {
    // Number of decimal digits of |v| (0 has one digit).
    let mut n = 1;
    v = v.checked_abs().unwrap_or(i128::MAX);
    while v >= 10 {
        v /= 10;
        n += 1;
    }
    n
}

impl Decimal {
    pub const ZERO: Decimal = Decimal { coef: 0, exp: 0 };
    pub const ONE: Decimal = Decimal { coef: 1, exp: 0 };

    /// Builds a normalised value, checking precision and range.
    fn new(coef: i128, exp: i64) -> Result<Decimal, DecimalError> {
        if coef == 0 {
            return Ok(Decimal::ZERO);
        }
        let mut coef = coef;
        let mut exp = exp;
        while coef % 10 == 0 {
            coef /= 10;
            exp += 1;
        }
        if coef <= -COEF_LIMIT || coef >= COEF_LIMIT {
            return Err(DecimalError::TooPrecise);
        }
        let adjusted = exp + i64::from(digits(coef)) - 1;
        if !(i64::from(MIN_ADJUSTED_EXP)..=i64::from(MAX_ADJUSTED_EXP)).contains(&adjusted) {
            return Err(DecimalError::OutOfRange);
        }
        // In range, so exp fits an i32.
        let exp = i32::try_from(exp).map_err(|_| DecimalError::OutOfRange)?;
        Ok(Decimal { coef, exp })
    }

    pub fn from_i64(v: i64) -> Decimal {
        // Any i64 has at most 19 digits: always representable.
        Decimal::new(i128::from(v), 0).unwrap_or(Decimal::ZERO)
    }

    pub fn is_zero(&self) -> bool {
        self.coef == 0
    }

    pub fn is_negative(&self) -> bool {
        self.coef < 0
    }

    /// Parses the text forms DynamoDB and JSON use: `-12.5`, `+3`, `.5`, `1E+2`, `1.5e-3`.
    /// Leading and trailing zeros do not count as significant digits.
    pub fn parse(s: &str) -> Result<Decimal, DecimalError> {
        let syntax = || DecimalError::Syntax(s.chars().take(64).collect());
        let bytes = s.as_bytes();
        let mut i = 0;
        let mut negative = false;
        if let Some(&c) = bytes.first() {
            if c == b'-' || c == b'+' {
                negative = c == b'-';
                i = 1;
            }
        }
        let mut coef: i128 = 0;
        let mut exp: i64 = 0;
        let mut any_digit = false;
        let mut seen_point = false;
        let mut sig_digits: u32 = 0;
        // Zeros seen after the last non-zero digit and not yet folded into coef: folding them
        // lazily lets "1000000...000" (many trailing zeros) parse without overflowing.
        let mut pending_zeros: i64 = 0;
        while i < bytes.len() {
            let c = bytes[i];
            match c {
                b'0'..=b'9' => {
                    any_digit = true;
                    let d = i128::from(c - b'0');
                    if seen_point {
                        exp -= 1;
                    }
                    if d == 0 {
                        if coef != 0 {
                            pending_zeros += 1;
                        }
                    } else {
                        // Fold the pending zeros, then the digit.
                        let zeros = u32::try_from(pending_zeros).map_err(|_| DecimalError::TooPrecise)?;
                        sig_digits = sig_digits.saturating_add(zeros + 1);
                        if sig_digits > MAX_DIGITS {
                            return Err(DecimalError::TooPrecise);
                        }
                        let scale = pow10(zeros + 1).ok_or(DecimalError::TooPrecise)?;
                        coef = coef.checked_mul(scale).and_then(|v| v.checked_add(d)).ok_or(DecimalError::TooPrecise)?;
                        pending_zeros = 0;
                    }
                }
                b'.' if !seen_point => seen_point = true,
                b'e' | b'E' => break,
                _ => return Err(syntax()),
            }
            i += 1;
        }
        if !any_digit {
            return Err(syntax());
        }
        // Trailing zeros of the digit string scale the value instead of the coefficient.
        exp += pending_zeros;
        if i < bytes.len() {
            // Exponent part.
            let rest = &s[i + 1..];
            let (negative_exp, exp_digits) = match rest.as_bytes().first() {
                Some(b'+') => (false, &rest[1..]),
                Some(b'-') => (true, &rest[1..]),
                _ => (false, rest),
            };
            if exp_digits.is_empty() || !exp_digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(syntax());
            }
            if exp_digits.len() > 9 {
                return if coef == 0 { Ok(Decimal::ZERO) } else { Err(DecimalError::OutOfRange) };
            }
            let e: i64 = exp_digits.parse().map_err(|_| syntax())?;
            let e = if negative_exp { -e } else { e };
            exp += e;
        }
        if negative {
            coef = -coef;
        }
        Decimal::new(coef, exp)
    }

    fn align(a: Decimal, b: Decimal) -> Result<(i128, i128, i64), DecimalError> {
        // Brings both coefficients to the smaller exponent.
        let (lo, hi) = if a.exp <= b.exp { (a, b) } else { (b, a) };
        let shift = u32::try_from(i64::from(hi.exp) - i64::from(lo.exp)).map_err(|_| DecimalError::TooPrecise)?;
        let scaled = if hi.coef == 0 { 0 } else { pow10(shift).and_then(|p| hi.coef.checked_mul(p)).ok_or(DecimalError::TooPrecise)? };
        if a.exp <= b.exp {
            Ok((lo.coef, scaled, i64::from(lo.exp)))
        } else {
            Ok((scaled, lo.coef, i64::from(lo.exp)))
        }
    }

    pub fn checked_add(self, other: Decimal) -> Result<Decimal, DecimalError> {
        if other.is_zero() {
            return Ok(self);
        }
        if self.is_zero() {
            return Ok(other);
        }
        let (x, y, exp) = Decimal::align(self, other)?;
        let sum = x.checked_add(y).ok_or(DecimalError::TooPrecise)?;
        Decimal::new(sum, exp)
    }

    pub fn checked_sub(self, other: Decimal) -> Result<Decimal, DecimalError> {
        self.checked_add(-other)
    }

    pub fn checked_mul(self, other: Decimal) -> Result<Decimal, DecimalError> {
        if self.is_zero() || other.is_zero() {
            return Ok(Decimal::ZERO);
        }
        let coef = self.coef.checked_mul(other.coef).ok_or(DecimalError::TooPrecise)?;
        Decimal::new(coef, i64::from(self.exp) + i64::from(other.exp))
    }

    /// The value as an integer when it is one and fits an i64.
    pub fn to_i64(self) -> Option<i64> {
        if self.exp < 0 {
            return None;
        }
        let scale = pow10(u32::try_from(self.exp).ok()?)?;
        i64::try_from(self.coef.checked_mul(scale)?).ok()
    }

    /// Integer part (truncated toward zero) as i64, for epoch seconds with fractions.
    pub fn trunc_i64(self) -> Option<i64> {
        if self.exp >= 0 {
            return self.to_i64();
        }
        let shift = u32::try_from(-i64::from(self.exp)).ok()?;
        match pow10(shift) {
            Some(p) => i64::try_from(self.coef / p).ok(),
            None => Some(0), // |value| < 1
        }
    }
}

/// Sort keys of [`Decimal::sortable`]: a class letter for the sign, so negatives sort first.
const SORT_NEGATIVE: char = 'A';
const SORT_ZERO: char = 'B';
const SORT_POSITIVE: char = 'C';
/// Ends a negative value's digits: above every digit, so -1 ("8~") sorts above -1.5 ("84~").
const SORT_NEGATIVE_END: char = '~';
/// Added to the adjusted exponent (-130..=125) so it is three digits.
const SORT_EXP_OFFSET: i32 = 500;

impl Decimal {
    /// A string whose byte order is the numeric order: the sort-key part of a helper item
    /// (`max`, `min`, `latest`). Class letter, three exponent digits, then the digits
    /// (complemented for negatives, which end in `~`). No `#`, always ASCII.
    pub fn sortable(&self) -> String {
        if self.coef == 0 {
            return SORT_ZERO.to_string();
        }
        let digits = self.coef.unsigned_abs().to_string();
        // In range by construction: -130..=125.
        let adjusted = self.exp + i32::try_from(digits.len()).unwrap_or(0) - 1;
        if self.coef > 0 {
            format!("{SORT_POSITIVE}{:03}{digits}", adjusted + SORT_EXP_OFFSET)
        } else {
            let complement: String = digits.bytes().map(|b| char::from(b'9' - (b - b'0'))).collect();
            format!("{SORT_NEGATIVE}{:03}{complement}{SORT_NEGATIVE_END}", SORT_EXP_OFFSET - adjusted)
        }
    }

    /// The value of a [`Decimal::sortable`] string; None for anything else.
    pub fn from_sortable(s: &str) -> Option<Decimal> {
        let mut chars = s.chars();
        let class = chars.next()?;
        if class == SORT_ZERO {
            return (s.len() == 1).then_some(Decimal::ZERO);
        }
        let exp: i32 = s.get(1..4)?.parse().ok()?;
        let body = s.get(4..)?;
        let (digits, adjusted, negative) = match class {
            SORT_POSITIVE => (body.to_string(), exp - SORT_EXP_OFFSET, false),
            SORT_NEGATIVE => {
                let body = body.strip_suffix(SORT_NEGATIVE_END)?;
                (body.bytes().map(|b| char::from(b'9'.wrapping_sub(b.wrapping_sub(b'0')))).collect(), SORT_EXP_OFFSET - exp, true)
            }
            _ => return None,
        };
        if digits.is_empty() || digits.len() > MAX_DIGITS as usize || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.starts_with('0')
        {
            return None;
        }
        let coef: i128 = digits.parse().ok()?;
        let exp = i64::from(adjusted) - (digits.len() as i64 - 1);
        let d = Decimal::new(if negative { -coef } else { coef }, exp).ok()?;
        (d.sortable() == s).then_some(d)
    }
}

impl std::ops::Neg for Decimal {
    type Output = Decimal;
    fn neg(self) -> Decimal {
        // |coef| < 10^38 so negation cannot overflow.
        Decimal { coef: -self.coef, exp: self.exp }
    }
}

impl Ord for Decimal {
    fn cmp(&self, other: &Self) -> Ordering {
        let sign = |d: &Decimal| d.coef.signum();
        match sign(self).cmp(&sign(other)) {
            Ordering::Equal => {}
            o => return o,
        }
        if self.coef == 0 {
            return Ordering::Equal;
        }
        let adj = |d: &Decimal| i64::from(d.exp) + i64::from(digits(d.coef));
        let magnitude = match adj(self).cmp(&adj(other)) {
            Ordering::Equal => {
                // Same magnitude: the exponents differ by at most 37, so aligning fits.
                match Decimal::align(*self, *other) {
                    Ok((x, y, _)) => return x.cmp(&y),
                    Err(_) => Ordering::Equal,
                }
            }
            o => o,
        };
        if self.coef > 0 {
            magnitude
        } else {
            magnitude.reverse()
        }
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Decimal {
    /// Plain notation, as DynamoDB accepts it: `-12.5`, `100`, `0.001`. Never an exponent.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::with_capacity(48);
        if self.coef < 0 {
            s.push('-');
        }
        let digits = self.coef.unsigned_abs().to_string();
        if self.exp >= 0 {
            s.push_str(&digits);
            for _ in 0..self.exp {
                s.push('0');
            }
        } else {
            let frac = usize::try_from(-i64::from(self.exp)).unwrap_or(0);
            if digits.len() > frac {
                let (int, dec) = digits.split_at(digits.len() - frac);
                s.push_str(int);
                s.push('.');
                s.push_str(dec);
            } else {
                s.push_str("0.");
                for _ in 0..frac - digits.len() {
                    s.push('0');
                }
                s.push_str(&digits);
            }
        }
        f.pad(&s)
    }
}

impl std::str::FromStr for Decimal {
    type Err = DecimalError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Decimal::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sortable_strings_sort_as_the_numbers_do_and_read_back() {
        let values = [
            "-9.9E+125",
            "-100",
            "-2",
            "-1.5",
            "-1.25",
            "-1",
            "-0.001",
            "-1E-130",
            "0",
            "1E-130",
            "0.001",
            "1",
            "1.25",
            "1.5",
            "2",
            "10",
            "100",
            "123456789012345678901234567890.12345678",
            "9.9E+125",
        ];
        let parsed: Vec<Decimal> = values.iter().map(|v| Decimal::parse(v).unwrap()).collect();
        for w in parsed.windows(2) {
            assert!(w[0] < w[1], "{} < {}", w[0], w[1]);
            let (a, b) = (w[0].sortable(), w[1].sortable());
            assert!(a < b, "{a} < {b}");
            // Followed by the helper key's separator, the order holds too (latest's `by`).
            assert!(format!("{a}#x") < format!("{b}#x"), "{a}# < {b}#");
        }
        for d in &parsed {
            assert_eq!(Decimal::from_sortable(&d.sortable()), Some(*d), "{d}");
            assert!(!d.sortable().contains('#'));
        }
        for bad in ["", "B0", "C", "C500", "C5000", "C50001x", "A500", "A5008", "D5001", "C9991"] {
            assert_eq!(Decimal::from_sortable(bad), None, "{bad:?}");
        }
    }

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap()
    }

    #[test]
    fn point_one_plus_point_two_is_point_three() {
        assert_eq!(d("0.1").checked_add(d("0.2")).unwrap(), d("0.3"));
        assert_eq!(d("0.1").checked_add(d("0.2")).unwrap().to_string(), "0.3");
    }

    #[test]
    fn parses_and_prints_canonically() {
        for (input, out) in [
            ("0", "0"),
            ("-0", "0"),
            ("000.000", "0"),
            ("15.50", "15.5"),
            ("1E+2", "100"),
            ("1e2", "100"),
            ("1.5e-3", "0.0015"),
            (".5", "0.5"),
            ("+7", "7"),
            ("-12.340", "-12.34"),
            ("100", "100"),
            ("12345678901234567890.123456789", "12345678901234567890.123456789"),
        ] {
            assert_eq!(d(input).to_string(), out, "{input}");
        }
    }

    #[test]
    fn rejects_bad_syntax() {
        for bad in ["", "-", ".", "abc", "1..2", "1e", "1e+", "1e-", "--1", "1e5x", "0x10", "1 ", " 1", "NaN", "inf", "1e--2", "1e+-2"] {
            assert!(matches!(Decimal::parse(bad), Err(DecimalError::Syntax(_))), "{bad:?}");
        }
    }

    #[test]
    fn precision_and_range_follow_dynamodb() {
        let max = "9".repeat(38);
        assert_eq!(d(&max).to_string(), max);
        assert_eq!(Decimal::parse(&"9".repeat(39)), Err(DecimalError::TooPrecise));
        // Trailing zeros are not significant.
        assert_eq!(d(&format!("1{}", "0".repeat(100))).to_string().len(), 101);
        assert!(Decimal::parse("1E-130").is_ok());
        assert_eq!(Decimal::parse("1E-131"), Err(DecimalError::OutOfRange));
        assert!(Decimal::parse("9.9E+125").is_ok());
        assert_eq!(Decimal::parse("1E+126"), Err(DecimalError::OutOfRange));
        assert_eq!(Decimal::parse("1E+999999"), Err(DecimalError::OutOfRange));
        assert!(Decimal::parse("1E+9999999").is_err());
        // A sum that needs 39 digits is refused, not rounded.
        assert_eq!(d(&max).checked_add(d("0.1")), Err(DecimalError::TooPrecise));
        assert_eq!(d(&max).checked_add(Decimal::ONE).unwrap().to_string(), format!("1{}", "0".repeat(38)));
        assert_eq!(d("1E+20").checked_add(d("1E-20")), Err(DecimalError::TooPrecise));
        assert_eq!(d("1E+100").checked_mul(d("1E+100")), Err(DecimalError::OutOfRange));
    }

    #[test]
    fn ordering_is_numeric() {
        let mut v: Vec<Decimal> = ["3", "-1", "2.5", "300.0", "1E+2", "-0.5", "0", "99.99"].iter().map(|s| d(s)).collect();
        v.sort();
        let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
        assert_eq!(s, ["-1", "-0.5", "0", "2.5", "3", "99.99", "100", "300"]);
        assert_eq!(d("300.0"), d("300"));
        assert!(d("1E-130") > Decimal::ZERO);
        assert!(d("-1E+125") < d("-9E+124"));
    }

    #[test]
    fn arithmetic() {
        assert_eq!(d("10").checked_sub(d("15")).unwrap().to_string(), "-5");
        assert_eq!(d("2.5").checked_mul(d("4")).unwrap().to_string(), "10");
        assert_eq!(d("0.01").checked_mul(d("3")).unwrap().to_string(), "0.03");
        assert_eq!(d("1234.5678").trunc_i64(), Some(1234));
        assert_eq!(d("-0.5").trunc_i64(), Some(0));
        assert_eq!(d("1E+30").to_i64(), None);
    }
}
