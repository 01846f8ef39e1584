//! The AWS-validated event-pattern cases (see tests/data/event-patterns/NOTICE.md).
//! File name suffix: none = must match, `_NEG` = must not match, `_EXC` = must be rejected.
//! Each event is matched twice: as a parsed tree and from its JSON text.

use std::path::Path;

use ddb_aggregator::pattern::{Pattern, PatternOptions};
use serde_json::Value;

fn data_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/event-patterns")
}

#[test]
fn all_aws_validated_cases() {
    let mut checked = 0;
    let mut failures = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(data_dir()).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".json5") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let case: Value = json5::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stem = name.trim_end_matches(".json5");
        let compiled = Pattern::compile(&case["EventPattern"], PatternOptions::default());
        let outcome = if stem.ends_with("_EXC") {
            match compiled {
                Err(_) => Ok(()),
                Ok(_) => Err("accepted an invalid pattern".to_string()),
            }
        } else {
            let expected = !stem.ends_with("_NEG");
            match compiled {
                Err(e) => Err(format!("rejected a valid pattern: {e}")),
                Ok(p) => {
                    let text = serde_json::to_string(&case["Event"]).unwrap();
                    match (p.matches(&case["Event"]), p.matches_json(&text)) {
                        (tree, Ok(raw)) if tree == expected && raw == expected => Ok(()),
                        (tree, raw) => Err(format!("expected match = {expected}; from the tree {tree}, from the text {raw:?}")),
                    }
                }
            }
        };
        if let Err(why) = outcome {
            failures.push(format!("{name}: {why}"));
        }
        checked += 1;
    }
    // The raw pair with duplicate keys in the pattern text: the last key wins.
    let event: Value = serde_json::from_str(&std::fs::read_to_string(data_dir().join("complex_multi_key_event.json")).unwrap()).unwrap();
    let pattern = Pattern::parse(
        &std::fs::read_to_string(data_dir().join("complex_multi_key_event_pattern.json")).unwrap(),
        PatternOptions::default(),
    )
    .unwrap();
    let event_text = std::fs::read_to_string(data_dir().join("complex_multi_key_event.json")).unwrap();
    if !pattern.matches(&event) || !pattern.matches_json(&event_text).unwrap() {
        failures.push("complex_multi_key_event: expected a match (from the tree and from the text)".into());
    }
    checked += 1;
    assert!(failures.is_empty(), "{} of {checked} cases failed:\n{}", failures.len(), failures.join("\n"));
    // 155 JSON5 cases plus the raw pair: the 157 files of the set.
    assert_eq!(checked, 156, "every case of the conformance set ran");
}
