//! DynamoDB-specific behaviour of the pattern language (the generic cases live in
//! tests/pattern_conformance.rs).

use serde_json::{json, Value};

use super::*;

fn p(v: Value) -> Pattern {
    Pattern::compile(&v, PatternOptions::default()).unwrap()
}

fn pn(v: Value) -> Pattern {
    Pattern::compile(&v, PatternOptions { numeric_strings: true }).unwrap()
}

fn err(v: Value) -> String {
    Pattern::compile(&v, PatternOptions::default()).unwrap_err().to_string()
}

fn order_record() -> Value {
    json!({
        "eventID": "e1", "eventName": "MODIFY", "eventVersion": "1.1", "eventSource": "aws:dynamodb",
        "awsRegion": "us-east-1",
        "dynamodb": {
            "ApproximateCreationDateTime": 1764460800,
            "Keys": {"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"}},
            "NewImage": {"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"},
                         "status": {"S": "PAID"}, "total": {"N": "150.50"}, "tags": {"SS": ["a", "b"]},
                         "scores": {"NS": ["1", "250"]}},
            "OldImage": {"PK": {"S": "CUST#c1"}, "SK": {"S": "ORDER#2026-11-30#o1"},
                         "status": {"S": "PENDING"}, "total": {"N": "150.50"}},
            "SequenceNumber": "000000000000000000001", "SizeBytes": 120, "StreamViewType": "NEW_AND_OLD_IMAGES"
        }
    })
}

fn ttl_delete() -> Value {
    json!({
        "eventName": "REMOVE",
        "userIdentity": {"type": "Service", "principalId": "dynamodb.amazonaws.com"},
        "dynamodb": {"ApproximateCreationDateTime": 1764460800.5, "Keys": {"PK": {"S": "CUST#c1"}},
                     "OldImage": {"PK": {"S": "CUST#c1"}}, "SequenceNumber": "2"}
    })
}

#[test]
fn type_descriptor_is_part_of_the_path() {
    let rec = order_record();
    assert!(p(json!({"dynamodb": {"Keys": {"SK": {"S": [{"prefix": "ORDER#"}]}}}})).matches(&rec));
    // Without the descriptor the key is an object, not a value.
    assert!(!p(json!({"dynamodb": {"Keys": {"SK": [{"prefix": "ORDER#"}]}}})).matches(&rec));
    // The wrong descriptor is a missing field.
    assert!(!p(json!({"dynamodb": {"Keys": {"SK": {"N": [{"prefix": "ORDER#"}]}}}})).matches(&rec));
    assert!(p(json!({"dynamodb": {"NewImage": {"status": {"S": ["PAID", "SHIPPED"]}}}})).matches(&rec));
    assert!(!p(json!({"dynamodb": {"OldImage": {"status": {"S": ["PAID", "SHIPPED"]}}}})).matches(&rec));
    // Dotted paths are the same as nesting.
    assert!(p(json!({"dynamodb.NewImage.status.S": ["PAID"]})).matches(&rec));
    // String sets are arrays: any member matches.
    assert!(p(json!({"dynamodb": {"NewImage": {"tags": {"SS": ["b"]}}}})).matches(&rec));
}

#[test]
fn n_values_are_strings_unless_numeric_strings_is_on() {
    let rec = order_record();
    let gt100 = json!({"dynamodb": {"NewImage": {"total": {"N": [{"numeric": [">", 100]}]}}}});
    assert!(!p(gt100.clone()).matches(&rec), "Lambda never matches N strings numerically");
    assert!(pn(gt100).matches(&rec));
    let exact_num = json!({"dynamodb": {"NewImage": {"total": {"N": [150.5]}}}});
    assert!(!p(exact_num.clone()).matches(&rec));
    assert!(pn(exact_num).matches(&rec), "150.50 equals 150.5 as a decimal");
    // The string form always compares as a string.
    assert!(p(json!({"dynamodb": {"NewImage": {"total": {"N": ["150.50"]}}}})).matches(&rec));
    assert!(!p(json!({"dynamodb": {"NewImage": {"total": {"N": ["150.5"]}}}})).matches(&rec));
    // Exact decimal comparison: no float rounding at the boundary.
    let boundary = r#"{"dynamodb": {"NewImage": {"total": {"N": [{"numeric": [">", 150.49999999999999999]}]}}}}"#;
    assert!(Pattern::parse(boundary, PatternOptions { numeric_strings: true }).unwrap().matches(&rec));
    let not_above = json!({"dynamodb": {"NewImage": {"total": {"N": [{"numeric": [">", 150.5]}]}}}});
    assert!(!pn(not_above).matches(&rec));
    // anything-but with numbers compares numerically too.
    assert!(!pn(json!({"dynamodb": {"NewImage": {"total": {"N": [{"anything-but": [150.5]}]}}}})).matches(&rec));
    assert!(p(json!({"dynamodb": {"NewImage": {"total": {"N": [{"anything-but": [150.5]}]}}}})).matches(&rec));
    // Number sets: any member.
    assert!(pn(json!({"dynamodb": {"NewImage": {"scores": {"NS": [{"numeric": [">=", 250]}]}}}})).matches(&rec));
    // Only N/NS leaves are numeric: an S holding digits is still a string.
    let s_digits = json!({"dynamodb": {"Keys": {"PK": {"S": [{"numeric": [">", 0]}]}}}});
    assert!(!pn(s_digits).matches(&json!({"dynamodb": {"Keys": {"PK": {"S": "5"}}}})));
}

#[test]
fn approximate_creation_date_time_is_a_number() {
    let rec = order_record();
    assert!(p(json!({"dynamodb": {"ApproximateCreationDateTime": [{"numeric": [">=", 1764460800, "<", 1764547200]}]}})).matches(&rec));
    assert!(!p(json!({"dynamodb": {"ApproximateCreationDateTime": [{"numeric": ["<", 1764460800]}]}})).matches(&rec));
    assert!(p(json!({"dynamodb": {"ApproximateCreationDateTime": [1764460800.5]}})).matches(&ttl_delete()));
}

#[test]
fn event_name_and_ttl_deletes() {
    let rec = order_record();
    assert!(p(json!({"eventName": ["INSERT", "MODIFY"]})).matches(&rec));
    assert!(!p(json!({"eventName": ["REMOVE"]})).matches(&rec));
    let ttl = json!({"userIdentity": {"type": ["Service"], "principalId": ["dynamodb.amazonaws.com"]}});
    assert!(p(ttl.clone()).matches(&ttl_delete()));
    assert!(!p(ttl).matches(&rec));
    // "Everything but TTL deletes".
    let not_ttl = json!({"userIdentity": {"principalId": [{"exists": false}]}});
    assert!(p(not_ttl.clone()).matches(&rec));
    assert!(!p(not_ttl).matches(&ttl_delete()));
}

#[test]
fn exists_on_leaves_and_intermediate_nodes() {
    let rec = order_record();
    assert!(p(json!({"dynamodb": {"NewImage": {"status": {"S": [{"exists": true}]}}}})).matches(&rec));
    // An intermediate node is never a value: exists true does not match it ...
    assert!(!p(json!({"dynamodb": {"NewImage": {"status": [{"exists": true}]}}})).matches(&rec));
    // ... and exists false does.
    assert!(p(json!({"dynamodb": {"NewImage": {"status": [{"exists": false}]}}})).matches(&rec));
    assert!(p(json!({"dynamodb": {"NewImage": {"missing": {"S": [{"exists": false}]}}}})).matches(&rec));
    // An INSERT has no OldImage: everything below it is absent.
    assert!(p(json!({"dynamodb": {"OldImage": {"status": {"S": [{"exists": false}]}}}})).matches(&json!({"dynamodb": {"NewImage": {}}})));
}

#[test]
fn or_and_pattern_lists() {
    let rec = order_record();
    let or = p(json!({"dynamodb": {"$or": [
        {"NewImage": {"status": {"S": ["SHIPPED"]}}},
        {"OldImage": {"status": {"S": ["PENDING"]}}}
    ]}}));
    assert!(or.matches(&rec));
    let set = PatternSet::compile(&json!([{"eventName": ["INSERT"]}, {"eventName": ["MODIFY"]}]), PatternOptions::default()).unwrap();
    assert!(set.matches(&rec));
    let set = PatternSet::compile(&json!([{"eventName": ["INSERT"]}, {"eventName": ["REMOVE"]}]), PatternOptions::default()).unwrap();
    assert!(!set.matches(&rec));
}

#[test]
fn case_insensitive_operators_handle_unicode() {
    let ev = json!({"v": "ÄrgerLICH.PNG"});
    assert!(p(json!({"v": [{"prefix": {"equals-ignore-case": "äRGER"}}]})).matches(&ev));
    assert!(p(json!({"v": [{"suffix": {"equals-ignore-case": "lich.png"}}]})).matches(&ev));
    assert!(p(json!({"v": [{"equals-ignore-case": "ärgerlich.png"}]})).matches(&ev));
    assert!(!p(json!({"v": [{"equals-ignore-case": "ärgerlich.pn"}]})).matches(&ev));
}

#[test]
fn wildcards() {
    let m = |w: &str, s: &str| p(json!({"v": [{"wildcard": w}]})).matches(&json!({"v": s}));
    assert!(m("a*", "a"));
    assert!(m("*", ""));
    assert!(m("a*b*c", "abc"));
    assert!(m("a*b*c", "axxbyyc"));
    assert!(!m("a*b*c", "axxbyy"));
    assert!(!m("ab*ba", "aba"), "prefix and suffix may not overlap");
    assert!(m(r"a\*b", "a*b"));
    assert!(!m(r"a\*b", "axb"));
    assert!(m(r"a\\*", r"a\zzz"));
}

#[test]
fn errors_say_where() {
    assert_eq!(
        err(json!({"dynamodb": {"Keys": {"SK": {"S": [{"prefix": 5}]}}}})),
        "dynamodb.Keys.SK.S[0].prefix: prefix match pattern must be a string"
    );
    assert_eq!(err(json!({"dynamodb": {"Keys": {"SK": {"S": []}}}})), "dynamodb.Keys.SK.S: empty arrays are not allowed");
    assert_eq!(err(json!({"eventName": "INSERT"})), "eventName: \"eventName\" must be an object or an array");
    assert!(err(json!({"a": [{"numeric": [">", 5, "<", 1]}]})).starts_with("a[0].numeric: bottom"));
    assert!(err(json!({"a": [{"wildcard": "x**"}]})).starts_with("a[0].wildcard: consecutive wildcard"));
    assert!(err(json!({"a": [{"Prefix": "x"}]})).contains("unrecognized match type \"Prefix\""));
    assert!(err(json!({"$or": [{"a": ["x"]}, 5]})).starts_with("$or[1]: "));
    assert!(err(json!(["x"])).contains("JSON object"));
    assert!(err(json!({"a": [{"cidr": "10.0.0.0/33"}]})).contains("at most 32"));
    assert!(err(json!({"a": [{"anything-but": {"prefix": ""}}]})).contains("empty prefix"));
    let huge = Pattern::parse(r#"{"a": [{"numeric": [">", 1e400]}]}"#, PatternOptions::default()).unwrap_err().to_string();
    assert!(huge.starts_with("a[0].numeric[1]: "), "{huge}");
}

#[test]
fn compile_and_match_never_panic_on_odd_input() {
    // A few adversarial shapes; the property test in tests/ goes further.
    for v in [json!({}), json!({"": [""]}), json!({"a.": ["x"]}), json!({".": ["x"]}), json!({"a..b": ["x"]})] {
        let pat = p(v);
        for ev in [json!(null), json!([]), json!({"a": [[["x"]]]}), json!({"a.": {"": "x"}}), json!({"": "x"})] {
            let _ = pat.matches(&ev);
        }
    }
    assert!(p(json!({"a": ["x"]})).matches(&json!({"a": [[["x"]]]})), "nested arrays flatten");
}

/// Called by every [`Pattern::matches`] in unit tests: the matcher over JSON text agrees with
/// the tree walk on the same event.
pub(super) fn same_from_text(pattern: &Pattern, event: &Value, hit: bool) {
    let text = serde_json::to_string(event).unwrap();
    assert_eq!(pattern.matches_json(&text).unwrap(), hit, "text and tree disagree on {text}");
}

#[test]
fn text_matching_handles_escapes_dotted_keys_and_numbers() {
    let m = |pat: Value, text: &str| {
        let pat = p(pat);
        let raw = pat.matches_json(text).unwrap();
        assert_eq!(raw, pat.matches(&serde_json::from_str(text).unwrap()), "{text}");
        raw
    };
    // Escaped keys and values are decoded before they compare.
    assert!(m(json!({"a": {"b": ["x\"y"]}}), r#"{"\u0061": {"b": "x\"y"}}"#));
    assert!(m(json!({"a": [{"prefix": "é"}]}), r#"{"a": "\u00e9t\u00e9"}"#));
    // A key with dots is its segments, at any level.
    assert!(m(json!({"a": {"b": {"c": ["x"]}}}), r#"{"a.b": {"c": "x"}}"#));
    assert!(m(json!({"a": {"b": {"c": ["x"]}}}), r#"{"a": {"b.c": "x"}}"#));
    assert!(!m(json!({"a": {"b": ["x"]}}), r#"{"a.": {"b": "x"}}"#));
    // Numbers keep their text: exact decimals, and large ones.
    assert!(m(json!({"n": [{"numeric": [">", 150]}]}), r#"{"n": 150.0000000000000000001}"#));
    assert!(!m(json!({"n": [{"numeric": [">", 150]}]}), r#"{"n": 150.0000000000000000000}"#));
    assert!(m(json!({"n": [150.5]}), r#"{"n": 1.505e2}"#));
    assert!(!m(json!({"n": [{"numeric": [">", 0]}]}), r#"{"n": 1e400}"#));
    // Arrays fan out at any depth; objects are not values.
    assert!(m(json!({"a": {"b": ["x"]}}), r#"{"a": [{"b": "y"}, [{"b": ["x"]}]]}"#));
    assert!(!m(json!({"a": [{"exists": true}]}), r#"{"a": {"b": 1}}"#));
    assert!(m(json!({"a": [{"exists": false}]}), r#"{"a": {"b": 1}}"#));
    // A path that is a leaf for one pattern and passes through for another.
    let set = PatternSet::compile(&json!([{"a": ["x"]}, {"a": {"b": [1]}}]), PatternOptions::default()).unwrap();
    let raw = RawMatcher::new([&set, &PatternSet::compile(&json!({"a": {"c": [null]}}), PatternOptions::default()).unwrap()]);
    let hits = raw.matching(r#"{"a": [{"b": 1}, "y", {"c": null}]}"#).unwrap();
    assert!(hits.get(0) && hits.get(1) && hits.count() == 2);
    assert_eq!(raw.matching(r#"{"a": "y"}"#).unwrap().count(), 0);
}

#[test]
fn text_matching_gives_serde_json_errors_and_defers_on_repeated_keys() {
    let pat = p(json!({"a": ["x"]}));
    let deep = format!(r#"{{"a": "x", "z": {}{}}}"#, "[".repeat(200), "]".repeat(200));
    for bad in [
        r#"{"a": "x""#,
        r#"{"a": "x"} 1"#,
        r#"{"b": tru, "a": "x"}"#,
        r#"{"b": "\q", "a": "x"}"#,
        "",
        "[1,]",
        // Where the scanner declines, the tree decides: a lone surrogate, nesting past
        // serde_json's limit, its number disguise with no number, all under unnamed keys.
        r#"{"a": "x", "z": "\ud800"}"#,
        deep.as_str(),
        r#"{"a": "x", "z": {"$serde_json::private::Number": "abc"}}"#,
    ] {
        let want = serde_json::from_str::<Value>(bad).unwrap_err().to_string();
        assert_eq!(pat.matches_json(bad).unwrap_err().to_string(), want, "{bad}");
    }
    // A named key given twice: a parsed tree keeps the last, and so does the answer.
    assert!(!pat.matches_json(r#"{"a": "x", "a": "y"}"#).unwrap());
    assert!(pat.matches_json(r#"{"a": "y", "a": "x"}"#).unwrap());
    // Unnamed keys given twice change nothing.
    assert!(pat.matches_json(r#"{"b": 1, "b": 2, "a": "x"}"#).unwrap());
    // serde_json's number disguise means what it does to serde_json: a number as an object's
    // first key, an ordinary key after another.
    let five = p(json!({"a": [5]}));
    assert!(five.matches_json(r#"{"a": {"$serde_json::private::Number": "5"}}"#).unwrap());
    let elsewhere = r#"{"a": {"x": 1, "$serde_json::private::Number": "5"}}"#;
    assert!(serde_json::from_str::<Value>(elsewhere).unwrap()["a"].is_object());
    assert!(!five.matches_json(elsewhere).unwrap());
}

mod text_properties {
    use proptest::prelude::*;
    use serde_json::Value;

    use super::super::{Pattern, PatternOptions};

    /// JSON texts over a few field names (dotted ones and repeats included), as text so that
    /// repeated keys survive.
    fn text() -> impl Strategy<Value = String> {
        let key = prop_oneof![Just("a"), Just("b"), Just("a.b"), Just("b.a"), Just("\\u0061"), Just("a\\n")];
        let leaf = prop_oneof![
            Just("\"x\"".to_string()),
            Just("\"y\"".to_string()),
            Just("1".to_string()),
            Just("1.50".to_string()),
            Just("null".to_string()),
            Just("true".to_string()),
            Just("\"x\\\"\"".to_string()),
            Just("-0.5e+2".to_string()),
        ];
        leaf.prop_recursive(4, 24, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key.clone(), inner), 0..4)
                    .prop_map(|kv| format!("{{{}}}", kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect::<Vec<_>>().join(","))),
            ]
        })
    }

    fn pattern() -> impl Strategy<Value = Pattern> {
        let path = prop_oneof![Just("a"), Just("b"), Just("a.b"), Just("b.a.b"), Just("a.a")];
        let test = prop_oneof![
            Just(r#"["x"]"#),
            Just(r#"[1.5]"#),
            Just(r#"[null, true]"#),
            Just(r#"[{"exists": true}]"#),
            Just(r#"[{"exists": false}]"#),
            Just(r#"[{"anything-but": "x"}]"#),
            Just(r#"[{"numeric": [">", 1]}]"#),
        ];
        prop::collection::vec((path, test), 1..3).prop_map(|leaves| {
            let body: Vec<String> = leaves.iter().map(|(p, t)| format!("\"{p}\": {t}")).collect();
            Pattern::parse(&format!("{{{}}}", body.join(",")), PatternOptions::default()).unwrap()
        })
    }

    /// A byte of JSON's syntax, or a near miss.
    fn edit_byte() -> impl Strategy<Value = u8> {
        prop::sample::select(b"{}[],:\"\\ 0-.eEtx\n\t".to_vec())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// From text or from the parsed tree, the answer is the same.
        #[test]
        fn text_and_tree_agree(text in text(), pattern in pattern()) {
            let tree: Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(pattern.matches_json(&text).unwrap(), pattern.root.matches(&tree), "{}", text);
        }

        /// A text with one byte changed, removed or added: rejected exactly when serde_json
        /// rejects it (with its error), and otherwise the parsed tree's answer.
        #[test]
        fn broken_texts_are_judged_as_serde_json_judges_them(
            text in text(), pattern in pattern(), at in any::<prop::sample::Index>(), byte in edit_byte(), how in 0..3u8,
        ) {
            let mut bytes = text.into_bytes();
            let i = at.index(bytes.len() + 1);
            match how {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => { bytes.remove(i); }
                _ => bytes.insert(i, byte),
            }
            let text = String::from_utf8(bytes).unwrap();
            match serde_json::from_str::<Value>(&text) {
                Ok(tree) => prop_assert_eq!(pattern.matches_json(&text).unwrap(), pattern.root.matches(&tree), "{}", text),
                Err(e) => prop_assert_eq!(pattern.matches_json(&text).unwrap_err().to_string(), e.to_string(), "{}", text),
            }
        }
    }
}
