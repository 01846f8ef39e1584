//! The config file as a tree, before it is typed: read by serde-saphyr with the options that
//! make it read what serde_yaml 0.9 read (the parser before it; `tests/yaml_parity.rs` holds
//! it to that, so no rule's fingerprint changes with the parser), kept in the file's key order
//! (the first `source_key` is the partition key, measures keep their order), changed by the
//! environment overrides, then deserialized into [`super::raw::RawConfig`].

use std::fmt;

use indexmap::IndexMap;
use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, Deserialize, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor};

/// One node of the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Doc {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Seq(Vec<Doc>),
    Map(IndexMap<String, Doc>),
}

/// A number as the parser gave it, handed on with the same `visit_*` call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    U64(u64),
    I64(i64),
    U128(u128),
    I128(i128),
    F64(f64),
}

/// Why the text is not a config tree: where the parser says, in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct YamlError(pub String);

impl fmt::Display for YamlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// serde_yaml 0.9's reading of YAML as the config read it (through `serde_yaml::Value`): 1.2
/// booleans only, `017` and `1_000` stay text, `<<` is a plain key, a repeated key is an error.
/// Infinities and NaN, which serde_yaml read as null (`.inf`) or as text (`1e999`), are refused.
/// serde-saphyr's budgets refuse alias bombs and nesting deeper than 64 (serde_yaml took 128;
/// the reading recurses, and a config nests about 8 deep).
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
        merge_keys: serde_saphyr::MergeKeyPolicy::AsOrdinary,
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::Reject,
        reject_unsupported_tags: true,
        ignore_binary_tag_for_string: true,
    }
}

impl Doc {
    /// Parses one YAML document (an empty file is [`Doc::Null`]).
    pub fn parse(text: &str) -> Result<Doc, YamlError> {
        serde_saphyr::from_str_with_options::<Option<Doc>>(text, options())
            .map(|d| d.unwrap_or(Doc::Null))
            .map_err(|e| YamlError(one_line(&e.without_snippet().to_string())))
    }

    /// An environment override's value: a YAML scalar (`true`, `3`, `10s`), anything else
    /// (`[1]`, `a: b`, nothing) as the text itself.
    /// An integer past 64 bits stays text, as serde_yaml kept it.
    pub fn scalar(text: &str) -> Doc {
        let digits = text.trim().trim_start_matches(['-', '+']);
        let wide = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
        match Doc::parse(text) {
            Ok(Doc::Number(Number::F64(_) | Number::I128(_) | Number::U128(_))) if wide => Doc::String(text.to_string()),
            Ok(d @ (Doc::Bool(_) | Doc::Number(_) | Doc::String(_))) => d,
            _ => Doc::String(text.to_string()),
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Doc::Null)
    }

    /// This value as serde names it in a type error.
    fn unexpected(&self) -> de::Unexpected<'_> {
        match self {
            Doc::Null => de::Unexpected::Unit,
            Doc::Bool(b) => de::Unexpected::Bool(*b),
            Doc::Number(Number::U64(n)) => de::Unexpected::Unsigned(*n),
            Doc::Number(Number::I64(n)) => de::Unexpected::Signed(*n),
            Doc::Number(Number::F64(n)) => de::Unexpected::Float(*n),
            Doc::Number(_) => de::Unexpected::Other("a 128-bit integer"),
            Doc::String(s) => de::Unexpected::Str(s),
            Doc::Seq(_) => de::Unexpected::Seq,
            Doc::Map(_) => de::Unexpected::Map,
        }
    }

    /// What kind of value this is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Doc::Null => "null",
            Doc::Bool(_) => "a boolean",
            Doc::Number(_) => "a number",
            Doc::String(_) => "text",
            Doc::Seq(_) => "a list",
            Doc::Map(_) => "a mapping",
        }
    }
}

/// serde-saphyr's messages may span lines and address its caller; a config error is one line
/// for the person who wrote the file.
fn one_line(message: &str) -> String {
    let m = message.trim().strip_prefix("error: ").unwrap_or(message.trim());
    let m = m.replace(", set DuplicateKeyPolicy in Options if acceptable", "");
    m.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl<'de> Deserialize<'de> for Doc {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Doc, D::Error> {
        d.deserialize_any(DocVisitor)
    }
}

struct DocVisitor;

impl<'de> Visitor<'de> for DocVisitor {
    type Value = Doc;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Doc, E> {
        Ok(Doc::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Doc, E> {
        Ok(Doc::Number(Number::I64(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Doc, E> {
        Ok(Doc::Number(Number::U64(v)))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Doc, E> {
        Ok(Doc::Number(Number::I128(v)))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Doc, E> {
        Ok(Doc::Number(Number::U128(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Doc, E> {
        Ok(Doc::Number(Number::F64(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Doc, E> {
        Ok(Doc::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Doc, E> {
        Ok(Doc::String(v))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Doc, E> {
        Err(E::custom("binary values (!!binary) are not supported in the config"))
    }
    fn visit_unit<E>(self) -> Result<Doc, E> {
        Ok(Doc::Null)
    }
    fn visit_none<E>(self) -> Result<Doc, E> {
        Ok(Doc::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Doc, D::Error> {
        Doc::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Doc, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Doc::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Doc, A::Error> {
        let mut out = IndexMap::new();
        while let Some(key) = map.next_key::<Doc>()? {
            // Keys are text: `1:`, `true:` or `~:` as a key was refused before too.
            let Doc::String(k) = key else {
                return Err(de::Error::custom(format!("a mapping key must be text, not {}", key.kind())));
            };
            let v = map.next_value::<Doc>()?;
            if out.insert(k.clone(), v).is_some() {
                return Err(de::Error::custom(format!("duplicate mapping key: {k}")));
            }
        }
        Ok(Doc::Map(out))
    }
}

impl<'de> Deserializer<'de> for Doc {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self {
            Doc::Null => visitor.visit_unit(),
            Doc::Bool(b) => visitor.visit_bool(b),
            Doc::Number(Number::U64(n)) => visitor.visit_u64(n),
            Doc::Number(Number::I64(n)) => visitor.visit_i64(n),
            Doc::Number(Number::U128(n)) => visitor.visit_u128(n),
            Doc::Number(Number::I128(n)) => visitor.visit_i128(n),
            Doc::Number(Number::F64(n)) => visitor.visit_f64(n),
            Doc::String(s) => visitor.visit_string(s),
            Doc::Seq(items) => visitor.visit_seq(SeqDeserializer::new(items.into_iter())),
            Doc::Map(map) => visitor.visit_map(MapDeserializer::new(map.into_iter())),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self {
            Doc::Null => visitor.visit_none(),
            other => visitor.visit_some(other),
        }
    }

    /// A null where a list is wanted is an empty one (as serde_yaml's Value: `rules:` with
    /// nothing after it is "at least one rule is needed", not a type error).
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self {
            Doc::Null => visitor.visit_seq(SeqDeserializer::new(std::iter::empty::<Doc>())),
            Doc::Seq(items) => visitor.visit_seq(SeqDeserializer::new(items.into_iter())),
            other => Err(de::Error::invalid_type(other.unexpected(), &visitor)),
        }
    }

    /// A null where a mapping is wanted is an empty one (as serde_yaml's Value).
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self {
            Doc::Null => visitor.visit_map(MapDeserializer::new(std::iter::empty::<(String, Doc)>())),
            Doc::Map(map) => visitor.visit_map(MapDeserializer::new(map.into_iter())),
            other => Err(de::Error::invalid_type(other.unexpected(), &visitor)),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_map(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct tuple
        tuple_struct enum identifier ignored_any
    }
}

impl<'de> IntoDeserializer<'de, de::value::Error> for Doc {
    type Deserializer = Doc;

    fn into_deserializer(self) -> Doc {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_the_files_order_and_numbers_their_kind() {
        let d = Doc::parse("b: 1\na: -2\nc: [1.5, x, ~]\n").unwrap();
        let Doc::Map(m) = d else { panic!("{d:?}") };
        assert_eq!(m.keys().collect::<Vec<_>>(), ["b", "a", "c"]);
        assert_eq!(m["b"], Doc::Number(Number::U64(1)));
        assert_eq!(m["a"], Doc::Number(Number::I64(-2)));
        assert_eq!(m["c"], Doc::Seq(vec![Doc::Number(Number::F64(1.5)), Doc::String("x".into()), Doc::Null]));
    }

    #[test]
    fn errors_are_one_line_with_a_place_and_empty_text_is_null() {
        let e = Doc::parse("a:\n  b: 1\n c: 2\n").unwrap_err();
        assert!(!e.0.contains('\n') && e.0.contains("line 3"), "{e}");
        assert_eq!(Doc::parse("").unwrap(), Doc::Null);
        assert_eq!(Doc::parse("# only a comment\n").unwrap(), Doc::Null);
    }

    #[test]
    fn repeated_and_non_text_keys_and_wrong_shapes_are_refused_as_serde_yaml_refused_them() {
        let e = Doc::parse("a: 1\nb: 2\na: 3\n").unwrap_err();
        assert!(e.0.contains("duplicate mapping key: a") && !e.0.contains("Options"), "{e}");
        assert!(Doc::parse("1: x\n").unwrap_err().0.contains("a mapping key must be text, not a number"));
        assert!(Doc::parse("~: x\n").unwrap_err().0.contains("not null"));
        // A list where a section (a struct) is wanted is a type error, not a tuple.
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Section {
            table: String,
        }
        let e = Section::deserialize(Doc::parse("[t]").unwrap()).unwrap_err().to_string();
        assert!(e.contains("invalid type: sequence"), "{e}");
        // Null where a list or a mapping is wanted is an empty one.
        assert!(Vec::<String>::deserialize(Doc::Null).unwrap().is_empty());
        assert!(IndexMap::<String, String>::deserialize(Doc::Null).unwrap().is_empty());
    }

    #[test]
    fn override_values_are_scalars_or_their_own_text() {
        assert_eq!(Doc::scalar("true"), Doc::Bool(true));
        assert_eq!(Doc::scalar("yes"), Doc::String("yes".into()));
        assert_eq!(Doc::scalar("3"), Doc::Number(Number::U64(3)));
        assert_eq!(Doc::scalar("[1]"), Doc::String("[1]".into()));
        assert_eq!(Doc::scalar(""), Doc::String(String::new()));
    }
}
