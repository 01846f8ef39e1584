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

/// Where the new parser refuses what serde_yaml read (no config can rely on these):
const REFUSED_NOW: &[(&str, &str)] = &[
    ("set.yaml", "`!!set` was read as a mapping to nulls; now refused as an unsupported tag"),
    ("nonfinite.yaml", "`.inf` and `.nan` were read as null; now refused"),
    ("overflow.yaml", "`1e999` was read as the text \"1e999\"; now refused as an infinity"),
    ("nested_100.yaml", "nesting 100 deep was read; now refused past 64"),
];

/// Where the new parser reads what serde_yaml refused: an integer below i64's range (serde_yaml's
/// Value had no 128-bit integers) now reads as a float. No config key or pattern takes one (a
/// numeric operator's numbers are within ±5.0e9), so no config that ran before reads differently.
const ACCEPTED_NOW: &[&str] = &["ints.yaml"];

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
        } else if ACCEPTED_NOW.contains(&name.as_str()) {
            assert!(want.get("error").is_some(), "{name}: serde_yaml refused it: {want}");
            let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(got["i"].as_f64(), Some(-9.223372036854776e18), "{name}: {got}");
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
        let got = override_value(text);
        if NON_FINITE_OVERRIDES.contains(&text.as_str()) {
            // serde_yaml set null, which a setting took as unset (its default, silently); now the
            // text itself, which a number setting refuses.
            assert_eq!((want, &got), (&Value::Null, &Value::String(text.clone())), "{text}");
            continue;
        }
        if &got != want {
            differing.insert(text.clone(), (want.clone(), got));
        }
    }
    assert!(differing.is_empty(), "read differently: {differing:#?}");
    assert!(scalars.len() >= 40);
}

/// Override texts read differently on purpose.
const NON_FINITE_OVERRIDES: &[&str] = &[".inf", ".nan"];

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
