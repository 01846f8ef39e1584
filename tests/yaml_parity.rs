//! The YAML parser reads what serde_yaml 0.9 (the parser before it) read. Rule fingerprints
//! hash the parsed rules, so a parser that read a value differently would rebuild every rule,
//! and in a rolling deploy old and new binaries would disagree on the definitions.
//! `tests/data/yaml/serde_yaml.json` was written once by serde_yaml 0.9.34: what it read from
//! each file of `tests/data/yaml/` (or that it refused it), from each environment-override text,
//! and the rule fingerprints of the example configs.

use std::collections::BTreeMap;
use std::path::Path;

use ddb_aggregator::config::{yaml_value, Config};
use serde_json::Value;

fn golden() -> Value {
    let text = std::fs::read_to_string("tests/data/yaml/serde_yaml.json").expect("golden file");
    serde_json::from_str(&text).expect("golden JSON")
}

/// Where the new parser refuses what serde_yaml read: `!!set`, which serde_yaml read as a
/// mapping to nulls (no config key or pattern takes one).
const REFUSED_NOW: &[(&str, &str)] = &[("set.yaml", "`!!set` was read as a mapping to nulls; now refused as an unsupported tag")];

/// Read differently, and why that cannot change a valid config: integers below i64's range are
/// read as floats (serde_yaml kept them exact). No config key takes one, and a filter pattern's
/// numeric operator takes numbers within ±5.0e9 only, so neither reading validates.
const READ_DIFFERENTLY: &[&str] = &["ints.yaml"];

#[test]
fn every_file_of_the_corpus_reads_as_serde_yaml_read_it() {
    let golden = golden();
    let values = golden["values"].as_object().expect("values");
    let mut checked = 0;
    for (name, want) in values {
        let text = std::fs::read_to_string(Path::new("tests/data/yaml").join(name)).expect("corpus file");
        let got = yaml_value(&text);
        if let Some((_, why)) = REFUSED_NOW.iter().find(|(n, _)| n == name) {
            assert!(want.get("value").is_some() && got.is_err(), "{name}: {why}; got {got:?}");
        } else if READ_DIFFERENTLY.contains(&name.as_str()) {
            let (Some(want), Ok(got)) = (want.get("value"), &got) else { panic!("{name}: {want} / {got:?}") };
            let differing: Vec<&String> = want.as_object().unwrap().keys().filter(|k| want[k.as_str()] != got[k.as_str()]).collect();
            assert_eq!(differing, ["i"], "{name}: only the integer below i64's range differs");
        } else {
            match (want.get("value"), &got) {
                (Some(want), Ok(got)) => assert_eq!(got, want, "{name}"),
                (None, Err(_)) => {}
                (want, got) => panic!("{name}: serde_yaml read {want:?}, now {got:?}"),
            }
        }
        checked += 1;
    }
    let on_disk = std::fs::read_dir("tests/data/yaml")
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "yaml"))
        .count();
    assert_eq!(checked, on_disk, "every corpus file has a golden reading");
    assert!(checked >= 40, "{checked}");
}

#[test]
fn every_environment_override_text_reads_as_serde_yaml_read_it() {
    let golden = golden();
    let scalars = golden["override_scalars"].as_object().expect("override_scalars");
    let mut differing = BTreeMap::new();
    for (text, want) in scalars {
        // The override lands on `source.table`; the value it gets is what the override read.
        let got = override_value(text);
        if &got != want {
            differing.insert(text.clone(), (want.clone(), got));
        }
    }
    assert!(differing.is_empty(), "read differently: {differing:#?}");
    assert!(scalars.len() >= 40);
}

/// The value an override gives, seen through the config's own reading of it.
fn override_value(text: &str) -> Value {
    ddb_aggregator::config::override_value(text)
}

#[test]
fn every_example_config_keeps_its_rule_fingerprints() {
    let golden = golden();
    let fingerprints = golden["fingerprints"].as_object().expect("fingerprints");
    for (file, want) in fingerprints {
        let text = std::fs::read_to_string(file).expect("example config");
        let config = Config::from_yaml(&text, Vec::<(String, String)>::new()).unwrap_or_else(|e| panic!("{file}: {e}"));
        let got: Vec<Value> = config.engine.rules.iter().map(|r| serde_json::json!([r.name.to_string(), r.fingerprint])).collect();
        assert_eq!(&Value::Array(got), want, "{file}");
    }
    assert!(fingerprints.len() >= 7);
}
