//! The scanner for matching from text: a strict JSON reader over the bytes that keeps the
//! scalars at named paths and skips everything else without decoding it.
//!
//! It accepts only what serde_json accepts (the grammar of RFC 8259: no trailing commas, no
//! leading zeros, no control characters in strings, only the escapes JSON defines), and it
//! declines rather than guess: on anything it does not accept, and on what it leaves to
//! serde_json (a `\u` escape, a named key with an escape, a key spelled like serde_json's
//! number disguise, nesting as deep as serde_json's limit of 128), the caller parses the text
//! into a tree with serde_json instead, which then gives the error or the same answer.

use std::borrow::Cow;

use smallvec::SmallVec;

use super::{Ambiguous, Found, Kept, Scanned, Trie, NUMBER_TOKEN};
use crate::decimal::Decimal;

/// The scanner will not decide this text; serde_json will.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Declined;

type Step<T = ()> = Result<T, Declined>;

/// serde_json's recursion limit: it refuses a text nested this deep (127 levels parse).
const MAX_DEPTH: u32 = 128;

pub(super) fn scan<'de>(trie: &Trie, text: &'de str) -> Step<Result<Scanned<'de>, Ambiguous>> {
    let mut s = Scanner { trie, text, at: 0, depth: 0, found: SmallVec::new(), ambiguous: false };
    s.value(Some(0))?;
    s.whitespace();
    if s.at != text.len() {
        return Err(Declined);
    }
    if s.ambiguous {
        return Ok(Err(Ambiguous));
    }
    Ok(Ok(Scanned::new(s.found)))
}

struct Scanner<'t, 'de> {
    trie: &'t Trie,
    text: &'de str,
    at: usize,
    depth: u32,
    found: Kept<'de>,
    ambiguous: bool,
}

impl<'de> Scanner<'_, 'de> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.at += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Step {
        self.whitespace();
        if self.peek() != Some(byte) {
            return Err(Declined);
        }
        self.at += 1;
        Ok(())
    }

    /// Whether a scalar at `node` would be kept.
    fn named(&self, node: Option<u32>) -> bool {
        node.is_some_and(|n| self.trie.nodes[n as usize].path.is_some())
    }

    fn keep(&mut self, node: Option<u32>, value: impl FnOnce() -> Found<'de>) {
        if let Some(id) = node.and_then(|n| self.trie.nodes[n as usize].path) {
            self.found.push((id, value()));
        }
    }

    /// A value at trie node `node` (None: nothing below is named, so it is only checked).
    fn value(&mut self, node: Option<u32>) -> Step {
        self.whitespace();
        match self.peek().ok_or(Declined)? {
            b'{' => self.nested(|s| s.object(node)),
            b'[' => self.nested(|s| s.array(node)),
            b'"' => {
                let (text, escaped) = self.string()?;
                if escaped && self.named(node) {
                    return Err(Declined);
                }
                self.keep(node, || Found::Str(Cow::Borrowed(text)));
                Ok(())
            }
            b't' => self.literal("true", node, Found::Bool(true)),
            b'f' => self.literal("false", node, Found::Bool(false)),
            b'n' => self.literal("null", node, Found::Null),
            b'-' | b'0'..=b'9' => {
                let text = self.number()?;
                self.keep(node, || Found::Num(Decimal::parse(text).ok()));
                Ok(())
            }
            _ => Err(Declined),
        }
    }

    fn nested(&mut self, inner: impl FnOnce(&mut Self) -> Step) -> Step {
        self.depth += 1;
        if self.depth >= MAX_DEPTH {
            return Err(Declined);
        }
        inner(self)?;
        self.depth -= 1;
        Ok(())
    }

    fn literal(&mut self, word: &str, node: Option<u32>, value: Found<'de>) -> Step {
        if !self.text.as_bytes()[self.at..].starts_with(word.as_bytes()) {
            return Err(Declined);
        }
        self.at += word.len();
        self.keep(node, || value);
        Ok(())
    }

    fn object(&mut self, node: Option<u32>) -> Step {
        self.at += 1; // '{'
        self.whitespace();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(());
        }
        // Named keys met in this object, to tell a key given twice.
        let mut seen: SmallVec<[u32; 8]> = SmallVec::new();
        loop {
            self.whitespace();
            if self.peek() != Some(b'"') {
                return Err(Declined);
            }
            let (key, escaped) = self.string()?;
            if key == NUMBER_TOKEN {
                return Err(Declined);
            }
            let child = match node {
                // Named paths below: an escaped key would have to be decoded first.
                Some(n) if escaped && !self.trie.nodes[n as usize].children.is_empty() => return Err(Declined),
                Some(n) if !escaped => self.trie.key(n, key),
                _ => None,
            };
            self.expect(b':')?;
            if let Some(c) = child {
                if seen.contains(&c) {
                    self.ambiguous = true;
                }
                seen.push(c);
            }
            self.value(child)?;
            if self.closed(b'}')? {
                return Ok(());
            }
        }
    }

    fn array(&mut self, node: Option<u32>) -> Step {
        self.at += 1; // '['
        self.whitespace();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(());
        }
        loop {
            // Arrays fan out: each element stands where the array does.
            self.value(node)?;
            if self.closed(b']')? {
                return Ok(());
            }
        }
    }

    /// After a member or element: a comma (false: another follows) or `close` (true).
    fn closed(&mut self, close: u8) -> Step<bool> {
        self.whitespace();
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                Ok(false)
            }
            Some(b) if b == close => {
                self.at += 1;
                Ok(true)
            }
            _ => Err(Declined),
        }
    }

    /// A string at `"`: its text between the quotes, escapes left as written, and whether it
    /// holds one. Only the one-character escapes are taken (a `\u` escape declines, so
    /// serde_json judges its surrogates); callers decline a named string with an escape.
    fn string(&mut self) -> Step<(&'de str, bool)> {
        let bytes = self.text.as_bytes();
        let start = self.at + 1;
        let mut i = start;
        let mut escaped = false;
        loop {
            match bytes.get(i).copied().ok_or(Declined)? {
                b'"' => break,
                b'\\' => match bytes.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                        escaped = true;
                        i += 2;
                    }
                    _ => return Err(Declined),
                },
                0..=0x1f => return Err(Declined),
                _ => i += 1,
            }
        }
        self.at = i + 1;
        // Both ends are ASCII quotes, so both are char boundaries.
        Ok((self.text.get(start..i).ok_or(Declined)?, escaped))
    }

    /// A number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, its text.
    fn number(&mut self) -> Step<&'de str> {
        let bytes = self.text.as_bytes();
        let start = self.at;
        let mut i = start;
        let digits = |i: &mut usize| {
            let from = *i;
            while bytes.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i > from
        };
        if bytes.get(i) == Some(&b'-') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                digits(&mut i);
            }
            _ => return Err(Declined),
        }
        if bytes.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return Err(Declined);
            }
        }
        if matches!(bytes.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(bytes.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !digits(&mut i) {
                return Err(Declined);
            }
        }
        self.at = i;
        self.text.get(start..i).ok_or(Declined)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Trie;
    use super::*;

    fn trie(paths: &[&[&str]]) -> Trie {
        let mut t = Trie::new();
        let mut next = 0;
        for p in paths {
            let p: Vec<Box<str>> = p.iter().map(|s| Box::from(*s)).collect();
            t.insert(&p, &mut next);
        }
        t
    }

    fn kept(t: &Trie, text: &str) -> Step<Vec<(u32, String)>> {
        match scan(t, text)? {
            Ok(s) => Ok(s.found.iter().map(|(i, v)| (*i, format!("{v:?}"))).collect()),
            Err(Ambiguous) => Ok(vec![(u32::MAX, "ambiguous".into())]),
        }
    }

    #[test]
    fn a_stream_record_is_scanned_without_serde_json() {
        let t = trie(&[&["eventName"], &["dynamodb", "NewImage", "status", "S"], &["dynamodb", "ApproximateCreationDateTime"]]);
        let record = r#"{"eventID":"1","eventName":"MODIFY","dynamodb":{"ApproximateCreationDateTime":1764496800.5,
            "Keys":{"PK":{"S":"CUST#c1"}},"NewImage":{"status":{"S":"PAID"},"note":{"S":"a \"quoted\"\n line"}},
            "SequenceNumber":"1"}}"#;
        let got = kept(&t, record).unwrap();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[0].1.contains("MODIFY") && got[1].1.contains("17644968005") && got[2].1.contains("PAID"), "{got:?}");
    }

    #[test]
    fn it_declines_what_it_does_not_accept_or_leaves_to_serde_json() {
        let t = trie(&[&["a", "b"]]);
        for text in [
            r#"{"a": {"b": "x\u0041"}}"#, // a \u escape
            r#"{"a": {"b": "x\n"}}"#,     // an escaped named value
            r#"{"\u0061": {"b": "x"}}"#,  // an escaped key
            r#"{"a\n": {"b": "x"}}"#,     // an escaped key where names lie below
            r#"{"$serde_json::private::Number": "1"}"#,
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": -}"#,
            r#"{"a": 1e}"#,
            r#"{"a": tru}"#,
            r#"{"a": [1,]}"#,
            r#"{"a": 1,}"#,
            r#"{"a" 1}"#,
            "{\"a\": \"\t\"}", // a raw control character
            r#"{"a": "x"} x"#,
            r#"{"a": "x"#,
            "",
        ] {
            assert_eq!(kept(&t, text), Err(Declined), "{text}");
        }
        // serde_json parses 127 levels and refuses 128.
        let deep = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        assert_eq!(kept(&t, &deep), Err(Declined));
        let ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
        assert!(serde_json::from_str::<serde_json::Value>(&ok).is_ok());
        assert!(kept(&t, &ok).is_ok());
        // Escapes where nothing is named are only checked; a repeated named key is ambiguous.
        assert!(kept(&t, r#"{"c": {"d\n": "x\t\""}, "a": {"b": 1}}"#).unwrap().len() == 1);
        assert_eq!(kept(&t, r#"{"a": {"b": 1, "b": 2}}"#).unwrap()[0].1, "ambiguous");
    }
}
