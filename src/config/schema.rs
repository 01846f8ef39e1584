//! The config file's JSON Schema, for editors (the YAML language server reads the
//! `# yaml-language-server: $schema=` line of a config) and pre-commit (`check-jsonschema`).
//! Generated from [`super::raw::RawConfig`], each field's doc comment as its description;
//! `ddb-aggregator schema` prints it and `config/schema.json` is that output, kept current by
//! a test. The types here exist only for the schema: the settings the raw config reads as text
//! (so that validation can name a missing unit), the measures and the filter patterns, which
//! the raw config keeps as JSON values and validation checks key by key.

use std::borrow::Cow;

use schemars::generate::SchemaSettings;
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

use super::raw::RawConfig;

/// The schema as `ddb-aggregator schema` prints it (draft-07: what the YAML language server and
/// most editors read).
pub fn json() -> String {
    let schema = SchemaSettings::draft07().into_generator().into_root_schema_for::<RawConfig>();
    let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
    text.push('\n');
    text
}

/// `250ms`, `10s`, `5m`, `1h`, `1d`.
pub struct Duration;

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^[0-9]+(ms|s|m|h|d)$",
            "description": "A whole number and a unit: ms, s, m, h or d (250ms, 10s, 5m, 1h, 1d)."
        })
    }
}

/// A whole number the raw config reads as text (so `"3"` in an environment override works).
pub struct Whole;

impl JsonSchema for Whole {
    fn schema_name() -> Cow<'static, str> {
        "WholeNumber".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "anyOf": [{ "type": "integer", "minimum": 0 }, { "type": "string", "pattern": "^[0-9]+$" }] })
    }
}

/// One of a few words.
macro_rules! words {
    ($name:ident, $title:literal, [$($word:literal),+]) => {
        pub struct $name;
        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                $title.into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({ "type": "string", "enum": [$($word),+] })
            }
        }
    };
}

words!(StartPosition, "StartPosition", ["trim_horizon", "latest"]);
words!(RetryMode, "RetryMode", ["standard", "adaptive"]);
words!(Scope, "ReconcileScope", ["touched", "all"]);
words!(TtlDeletes, "TtlDeletes", ["count", "ignore"]);

/// A rule's `filter`: one pattern, or a list of them (a record matches if any matches).
pub struct Filter;

impl JsonSchema for Filter {
    fn schema_name() -> Cow<'static, str> {
        "Filter".into()
    }
    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        let pattern = g.subschema_for::<Pattern>();
        json_schema!({ "anyOf": [pattern, { "type": "array", "items": pattern }] })
    }
}

/// A filter pattern in Lambda's language: the record's fields as nested mappings, each leaf a
/// list of values or operators; `$or` takes a list of patterns.
pub struct Pattern;

impl JsonSchema for Pattern {
    fn schema_name() -> Cow<'static, str> {
        "FilterPattern".into()
    }
    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        let this = g.subschema_for::<Pattern>();
        let value = g.subschema_for::<PatternValue>();
        json_schema!({
            "type": "object",
            "description": "A filter pattern (Lambda's language): fields as nested mappings, each leaf a list of values or operators; $or takes a list of patterns.",
            "properties": { "$or": { "type": "array", "minItems": 2, "items": this } },
            "additionalProperties": { "anyOf": [this, { "type": "array", "items": value }] }
        })
    }
}

/// One element of a pattern's list: a value to equal, or one operator.
pub struct PatternValue;

impl JsonSchema for PatternValue {
    fn schema_name() -> Cow<'static, str> {
        "FilterValue".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let text_or_ignore_case = json_schema!({ "anyOf": [
            { "type": "string" },
            { "type": "object", "properties": { "equals-ignore-case": { "type": "string" } }, "required": ["equals-ignore-case"], "additionalProperties": false }
        ] });
        let strings = json_schema!({ "anyOf": [{ "type": "string" }, { "type": "array", "items": { "type": "string" } }] });
        let operator = |name: &str, arg: Schema| json_schema!({ "type": "object", "properties": { (name): arg }, "required": [name], "additionalProperties": false });
        let anything_but_of = json_schema!({ "type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": false, "properties": {
            "prefix": strings, "suffix": strings, "equals-ignore-case": strings, "wildcard": strings
        } });
        json_schema!({ "anyOf": [
            { "type": ["string", "number", "boolean", "null"] },
            operator("prefix", text_or_ignore_case.clone()),
            operator("suffix", text_or_ignore_case),
            operator("equals-ignore-case", json_schema!({ "type": "string" })),
            operator("wildcard", json_schema!({ "type": "string" })),
            operator("anything-but", json_schema!({ "anyOf": [
                { "type": ["string", "number"] },
                { "type": "array", "items": { "type": ["string", "number"] } },
                anything_but_of
            ] })),
            operator("numeric", json_schema!({ "type": "array", "minItems": 2, "maxItems": 4, "items": { "type": ["string", "number"] } })),
            operator("exists", json_schema!({ "type": "boolean" })),
            operator("cidr", json_schema!({ "type": "string" }))
        ] })
    }
}

/// A target: key attribute to template, and optionally `write_shards`.
pub struct Target;

impl JsonSchema for Target {
    fn schema_name() -> Cow<'static, str> {
        "Target".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "object",
            "properties": {
                "write_shards": {
                    "type": "integer",
                    "minimum": 2,
                    "maximum": 100,
                    "description": "Spread each target over this many sub-items, for a target written from many shards (a global daily total); count, sum and avg only."
                }
            },
            "additionalProperties": { "type": "string", "minLength": 1, "description": "A key attribute's template." }
        })
    }
}

/// A measure: `count`, or a mapping that names its kind and may hold a `where` pattern.
pub struct Measure;

impl JsonSchema for Measure {
    fn schema_name() -> Cow<'static, str> {
        "Measure".into()
    }
    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        let pattern = g.subschema_for::<Pattern>();
        let attribute = |what: &str| json_schema!({ "type": "string", "minLength": 1, "description": what });
        let kind = |description: &str, keys: Vec<(&str, Schema)>| {
            let mut properties = serde_json::Map::new();
            let mut required = Vec::new();
            for (k, s) in keys {
                properties.insert(k.to_string(), s.to_value());
                required.push(k.to_string());
            }
            properties.insert("where".into(), pattern.clone().to_value());
            json_schema!({ "type": "object", "description": description, "properties": properties, "required": required, "additionalProperties": false })
        };
        json_schema!({ "anyOf": [
            { "type": "string", "enum": ["count"], "description": "The number of matching items." },
            kind("The number of matching items.", vec![("count", json_schema!({ "const": true }))]),
            kind("The exact decimal sum of an N attribute, or of the product of two (\"price * qty\").", vec![("sum", attribute("An attribute name, or \"ATTR * ATTR\"."))]),
            kind("An average, kept as <name>_sum and <name>_count (readers divide).", vec![("avg", attribute("An attribute name."))]),
            kind("The largest value (helper items next to the target; needs a sort key).", vec![("max", attribute("An attribute name (N or S) or a template such as \"{date|day}\"."))]),
            kind("The smallest value (helper items next to the target; needs a sort key).", vec![("min", attribute("An attribute name (N or S) or a template such as \"{date|day}\"."))]),
            kind("The number of distinct values (helper items next to the target; needs a sort key).", vec![("distinct", attribute("An attribute name (N or S) or a template such as \"{date|day}\"."))]),
            kind("The value of the item with the highest `by` (helper items next to the target; needs a sort key).", vec![
                ("latest", attribute("An attribute name (N or S) or a template such as \"{date|day}\".")),
                ("by", attribute("The attribute that orders the items (N or S), e.g. updatedAt."))
            ])
        ] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_schema_is_what_the_code_generates() {
        let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/schema.json")).unwrap_or_default();
        assert!(committed == json(), "config/schema.json is stale: run `cargo run -- schema > config/schema.json`");
    }

    #[test]
    fn measures_and_patterns_have_typed_subschemas() {
        let schema: serde_json::Value = serde_json::from_str(&json()).unwrap();
        let defs = &schema["definitions"];
        assert_eq!(defs["Measure"]["anyOf"].as_array().map(Vec::len), Some(8));
        assert!(defs["FilterPattern"]["additionalProperties"]["anyOf"].is_array());
        let rule = &defs["Rule"];
        assert_eq!(rule["additionalProperties"], false);
        assert_eq!(rule["properties"]["measures"]["additionalProperties"]["$ref"], "#/definitions/Measure");
        assert_eq!(defs["Target"]["properties"]["write_shards"]["maximum"], 100);
    }
}
