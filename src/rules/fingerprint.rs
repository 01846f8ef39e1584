//! Rule fingerprints: a short hash of everything in a rule's definition that decides what its
//! targets hold (filter, keys, targets, measures, TTL deletes; not its name or how reconcile
//! finds the items). Kept in the state table, they let `run` see that a rule is new or changed
//! and rebuild its targets (DESIGN.md, "Measures beyond count and sum").

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::config::raw::RawRule;

/// Bumped when the canonical form changes (every rule then rebuilds once).
const VERSION: &str = "v1";

/// The fingerprint of a rule as written: `v1:` and 16 hex digits of FNV-1a over its
/// [`canonical`] definition.
pub fn of(rule: &RawRule) -> String {
    of_definition(&canonical(rule))
}

/// The fingerprint of a canonical definition (as kept in the state table).
pub fn of_definition(canonical: &str) -> String {
    format!("{VERSION}:{:016x}", fnv1a(canonical.as_bytes()))
}

/// A rule's definition as canonical JSON text: everything that decides what its targets hold,
/// object keys sorted, measures by name. Kept in the state table, so a later release knows
/// what an old definition wrote ([`crate::config::rule_from_definition`] reads it back).
pub fn canonical(rule: &RawRule) -> String {
    let measures: BTreeMap<&str, &Value> = rule.measures.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let target: Vec<(&String, &Value)> = rule.target.iter().filter(|(k, _)| k.as_str() != crate::config::WRITE_SHARDS).collect();
    let mut canonical = json!({
        "filter": rule.filter,
        "numeric_strings": rule.numeric_strings,
        "source_key": rule.source_key.iter().collect::<Vec<_>>(),
        "target": target,
        "measures": measures,
        "ttl_deletes": rule.ttl_deletes.as_deref().unwrap_or("count"),
    });
    // Only a sharded rule carries these, so every other rule's fingerprint stays as it was.
    if let (Some(n), Some(o)) = (rule.target.get(crate::config::WRITE_SHARDS), canonical.as_object_mut()) {
        let n = n.as_u64().or_else(|| n.as_str().and_then(|s| s.parse().ok())).map_or_else(|| n.clone(), Value::from);
        o.insert(crate::config::WRITE_SHARDS.into(), n);
        o.insert("shard_mapping".into(), Value::String(super::shards::MAPPING.into()));
    }
    // serde_json's maps are sorted by key (no preserve_order): the text is canonical.
    canonical.to_string()
}

/// FNV-1a, 64 bits: a stable hash (the standard library's is not stable across releases).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Why a rule is rebuilt, if it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rebuild {
    /// Not in the state table: added to a running deployment.
    New,
    /// Its definition changed since the fingerprint was recorded.
    Changed { was: String },
}

/// Which rules a start rebuilds (pure), given the fingerprints recorded (None: none ever, a
/// deployment's first start, which records them all and rebuilds nothing: the stream builds
/// the targets, and a backfill is `reconcile --all`).
pub fn due<'r>(rules: impl IntoIterator<Item = (&'r str, &'r str)>, recorded: Option<&BTreeMap<String, String>>) -> Vec<(String, Rebuild)> {
    let Some(recorded) = recorded else { return Vec::new() };
    rules
        .into_iter()
        .filter_map(|(name, fp)| match recorded.get(name) {
            None => Some((name.to_string(), Rebuild::New)),
            Some(was) if was != fp => Some((name.to_string(), Rebuild::Changed { was: was.clone() })),
            Some(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn fingerprints(text: &str) -> Vec<(String, String)> {
        Config::from_yaml(text, Vec::<(String, String)>::new())
            .unwrap()
            .engine
            .rules
            .iter()
            .map(|r| (r.name.to_string(), r.fingerprint.clone()))
            .collect()
    }

    #[test]
    fn what_the_targets_hold_changes_the_fingerprint_and_nothing_else_does() {
        let demo = include_str!("../../config/commerce.yaml");
        let base = fingerprints(demo);
        assert!(base[0].1.starts_with("v1:") && base[0].1.len() == 19, "{base:?}");
        assert_ne!(base[0].1, base[1].1);
        let month = demo.replace("SALES#{date|day}", "SALES#{date|month}");
        let changed = fingerprints(&month);
        assert_eq!(changed[0], base[0], "customer-orders is as it was");
        assert_ne!(changed[1].1, base[1].1, "daily-sales now buckets by month");
        // Comments, spacing and how reconcile finds items do not change what targets hold.
        let cosmetic = demo.replace("rules:\n", "# the rules\nrules:\n");
        assert_eq!(fingerprints(&cosmetic), base);
    }

    #[test]
    fn a_first_start_rebuilds_nothing_then_new_and_changed_rules_rebuild() {
        let rules = [("a", "v1:1"), ("b", "v1:2")];
        assert!(due(rules, None).is_empty(), "first start: recorded, not rebuilt");
        let recorded: BTreeMap<String, String> = [("a".to_string(), "v1:1".to_string()), ("b".to_string(), "v1:9".to_string())].into();
        assert_eq!(due(rules, Some(&recorded)), [("b".to_string(), Rebuild::Changed { was: "v1:9".into() })]);
        let only_a: BTreeMap<String, String> = [("a".to_string(), "v1:1".to_string())].into();
        assert_eq!(due(rules, Some(&only_a)), [("b".to_string(), Rebuild::New)]);
    }
}
