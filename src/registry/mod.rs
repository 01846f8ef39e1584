//! The ledger registry: one item in the aggregates table that says which deployments write it,
//! per ledger namespace and source table: the state table it runs with and the stream it reads.
//!
//! A deployment moved to a state table with another name has no checkpoints, so it reads the
//! stream again from its trim horizon; with the default namespace (a hash of the state table's
//! name) its ledger entries are new too, and every record still in the stream would be counted
//! a second time. `run` reads the registry first and refuses that start ([`decide`]).
//!
//! The item's key holds [`KEY`] in every key attribute. No target has it: the rules refuse a
//! target key part equal to it, and a helper's sort key always holds a measure and a value after
//! the mark. Stream records and source items with that key (when the aggregates live in the
//! source table) are never evaluated, and reconcile never takes it for a target.

pub mod dynamodb;

use std::fmt;

/// The value of every key attribute of the registry item.
pub const KEY: &str = "#_agg#registry";

/// Whether a key (its values, in any order) is one of the service's own items in the
/// aggregates table: the registry item's, or a pending helper expiry's
/// ([`crate::sink::expiry::PENDING_PREFIX`]). Never a target's.
pub fn is_reserved_key<'a>(parts: impl IntoIterator<Item = &'a str>) -> bool {
    parts.into_iter().any(|p| p == KEY || p.starts_with(crate::sink::expiry::PENDING_PREFIX))
}

/// One deployment as the registry keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub namespace: String,
    pub source_table: String,
    pub state_table: String,
    /// The stream read when it registered (informative: a re-enabled stream has a new ARN).
    pub stream_arn: String,
    /// Epoch ms of the first registration.
    pub registered_ms: u64,
}

/// The deployment that is starting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Starting<'a> {
    pub aggregates_table: &'a str,
    pub source_table: &'a str,
    pub state_table: &'a str,
    pub stream_arn: &'a str,
    pub namespace: &'a str,
    /// `aggregates.ledger_namespace` was set (in the file or the environment).
    pub explicit: bool,
    /// The state table has read no stream yet (no lease, no stream noted; or it does not exist).
    pub state_is_new: bool,
}

/// Whether the deployment may start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Proceed,
    Refuse(Refusal),
}

/// A start refused: this source table is registered under other namespaces, and this
/// deployment, with a new state table and the default namespace, would count its records again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Refusal {
    pub aggregates_table: String,
    pub source_table: String,
    pub state_table: String,
    pub namespace: String,
    /// (namespace, state table) of each registered deployment of this source table.
    pub registered: Vec<(String, String)>,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let listed: Vec<String> = self.registered.iter().map(|(ns, state)| format!("\"{ns}\" (state table {state})")).collect();
        let old = match self.registered.as_slice() {
            [(ns, _)] => format!("\"{ns}\""),
            _ => format!(
                "the namespace of the deployment it was ({})",
                self.registered.iter().map(|(ns, _)| format!("\"{ns}\"")).collect::<Vec<_>>().join(" or ")
            ),
        };
        write!(
            f,
            "source table {} is already aggregated into {} under ledger namespace {}; this deployment's state table {} has read nothing yet and its default namespace is \"{}\", so it would read the stream again from its trim horizon and count every record still in it a second time. Set aggregates.ledger_namespace (or DDB_AGGREGATOR__AGGREGATES__LEDGER_NAMESPACE), quotes included: to {} if this is the same deployment moved to state table {} (its ledger then refuses the records it already applied), or to a new value if this is a second deployment on purpose (it counts every record again, in a ledger of its own)",
            self.source_table,
            self.aggregates_table,
            listed.join(", "),
            self.state_table,
            self.namespace,
            old,
            self.state_table,
        )
    }
}

/// Whether `this` may start, given the registry's entries (pure).
///
/// An explicit namespace always may (a move that keeps it, or a second deployment on purpose),
/// and so may a state table that has read the stream before (it resumes from its checkpoints).
/// A new state table with the default namespace is refused when the registry holds this source
/// table under another namespace and not under this one.
pub fn decide(entries: &[Entry], this: &Starting<'_>) -> Decision {
    if this.explicit || !this.state_is_new {
        return Decision::Proceed;
    }
    let of_source = || entries.iter().filter(|e| e.source_table == this.source_table);
    if of_source().any(|e| e.namespace == this.namespace) {
        return Decision::Proceed;
    }
    let mut registered: Vec<(String, String)> = of_source().map(|e| (e.namespace.clone(), e.state_table.clone())).collect();
    if registered.is_empty() {
        return Decision::Proceed;
    }
    registered.sort();
    registered.dedup();
    Decision::Refuse(Refusal {
        aggregates_table: this.aggregates_table.to_string(),
        source_table: this.source_table.to_string(),
        state_table: this.state_table.to_string(),
        namespace: this.namespace.to_string(),
        registered,
    })
}

/// The entry to write for `this` (None: the registry already says so). The first
/// registration's time is kept.
pub fn registration(entries: &[Entry], this: &Starting<'_>, now_ms: u64) -> Option<Entry> {
    let existing = entries.iter().find(|e| e.namespace == this.namespace && e.source_table == this.source_table);
    let wanted = Entry {
        namespace: this.namespace.to_string(),
        source_table: this.source_table.to_string(),
        state_table: this.state_table.to_string(),
        stream_arn: this.stream_arn.to_string(),
        registered_ms: existing.map_or(now_ms, |e| e.registered_ms),
    };
    (existing != Some(&wanted)).then_some(wanted)
}

/// The registry item's attribute holding one entry: one per (namespace, source table).
pub fn entry_attribute(namespace: &str, source_table: &str) -> String {
    format!("{ENTRY_PREFIX}{namespace}:{source_table}")
}

/// Entry attributes start with this; namespaces and table names hold no `:`.
pub const ENTRY_PREFIX: &str = "ns:";

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ns: &str, source: &str, state: &str) -> Entry {
        Entry {
            namespace: ns.into(),
            source_table: source.into(),
            state_table: state.into(),
            stream_arn: format!("arn:{source}"),
            registered_ms: 1,
        }
    }

    fn starting<'a>(state: &'a str, ns: &'a str) -> Starting<'a> {
        Starting {
            aggregates_table: "aggs",
            source_table: "orders",
            state_table: state,
            stream_arn: "arn:orders",
            namespace: ns,
            explicit: false,
            state_is_new: true,
        }
    }

    #[test]
    fn a_moved_deployment_with_the_default_namespace_is_refused() {
        let entries = [entry("aaaaaa", "orders", "state-1")];
        let Decision::Refuse(r) = decide(&entries, &starting("state-2", "bbbbbb")) else { panic!("not refused") };
        assert_eq!(r.registered, vec![("aaaaaa".to_string(), "state-1".to_string())]);
        let m = r.to_string();
        assert!(m.contains("aggregates.ledger_namespace"), "{m}");
        assert!(m.contains("to \"aaaaaa\" if this is the same deployment moved to state table state-2"), "{m}");
        assert!(m.contains("or to a new value if this is a second deployment on purpose"), "{m}");
        assert!(m.contains("default namespace is \"bbbbbb\""), "{m}");
    }

    #[test]
    fn what_may_start() {
        let entries = [entry("aaaaaa", "orders", "state-1"), entry("cccccc", "payments", "state-3")];
        assert_eq!(decide(&[], &starting("state-2", "bbbbbb")), Decision::Proceed, "the first deployment");
        assert_eq!(decide(&entries, &starting("state-1", "aaaaaa")), Decision::Proceed, "itself (its state table recreated)");
        assert_eq!(
            decide(&entries, &Starting { explicit: true, ..starting("state-2", "aaaaaa") }),
            Decision::Proceed,
            "moved, namespace kept"
        );
        assert_eq!(
            decide(&entries, &Starting { explicit: true, ..starting("state-2", "blue") }),
            Decision::Proceed,
            "a second one on purpose"
        );
        assert_eq!(
            decide(&entries, &Starting { state_is_new: false, ..starting("state-2", "bbbbbb") }),
            Decision::Proceed,
            "a state table that read the stream before resumes from its checkpoints (two deployments that ran before the registry)"
        );
        let other_source = [entry("aaaaaa", "payments", "state-1")];
        assert_eq!(decide(&other_source, &starting("state-2", "bbbbbb")), Decision::Proceed, "another source table's deployment");
        let both = [entry("aaaaaa", "orders", "state-1"), entry("bbbbbb", "orders", "state-2")];
        assert_eq!(decide(&both, &starting("state-2", "bbbbbb")), Decision::Proceed, "registered itself before");
    }

    #[test]
    fn a_dropped_explicit_namespace_is_refused_too() {
        // Same state table, recreated empty, without the namespace it ran with.
        let entries = [entry("blue", "orders", "state-1")];
        assert!(matches!(decide(&entries, &starting("state-1", "aaaaaa")), Decision::Refuse(_)));
    }

    #[test]
    fn several_registered_deployments_are_all_named() {
        let entries = [entry("blue", "orders", "state-b"), entry("aaaaaa", "orders", "state-1")];
        let Decision::Refuse(r) = decide(&entries, &starting("state-2", "bbbbbb")) else { panic!("not refused") };
        let m = r.to_string();
        assert!(m.contains("\"aaaaaa\" (state table state-1), \"blue\" (state table state-b)"), "{m}");
        assert!(m.contains("to the namespace of the deployment it was (\"aaaaaa\" or \"blue\")"), "{m}");
    }

    #[test]
    fn registration_is_written_once_and_follows_a_move() {
        let this = starting("state-2", "aaaaaa");
        let first = registration(&[], &this, 7).expect("absent: written");
        assert_eq!((first.state_table.as_str(), first.registered_ms), ("state-2", 7));
        assert_eq!(registration(std::slice::from_ref(&first), &this, 9), None, "unchanged: not written again");
        let moved = registration(&[entry("aaaaaa", "orders", "state-1")], &this, 9).expect("moved: rewritten");
        assert_eq!((moved.state_table.as_str(), moved.registered_ms), ("state-2", 1), "the first registration's time kept");
    }

    #[test]
    fn the_key_is_recognised() {
        assert!(is_reserved_key([KEY]));
        assert!(is_reserved_key(["x", KEY]));
        assert!(!is_reserved_key(["CUST#1", "PROFILE"]));
        assert!(KEY.starts_with(crate::rules::helper::MARK), "in the helpers' reserved space");
        assert_eq!(crate::rules::helper::parse(KEY), None, "never a helper's sort key");
        assert_eq!(entry_attribute("aaaaaa", "orders"), "ns:aaaaaa:orders");
    }
}
