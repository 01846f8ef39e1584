//! Coalescing: the deltas of many records summed per target item, so a batch of 1,000 records
//! touching 10 customers becomes at most 10 writes.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use super::TargetKey;
use crate::decimal::{Decimal, DecimalError};

/// One record's deltas on one target, kept so a write can be redone without the records at
/// or below a sequence number the target's ledger has already applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contribution {
    /// Shared by the record's contributions to other targets.
    pub sequence: Option<Arc<str>>,
    /// The rule that produced it.
    pub rule: Option<Arc<str>>,
    /// ApproximateCreationDateTime, epoch seconds.
    pub created: Option<Decimal>,
    /// Measure names are interned per batch ([`Coalescer`]): one copy of each.
    pub values: Vec<(Arc<str>, Decimal)>,
    /// The source item's id for this rule ([`super::item::item_id`]); None where records
    /// come without one (unit tests).
    pub item: Option<Arc<str>>,
    /// What the item contributes to the target after this record (its new image's values on
    /// this target; empty when it no longer contributes): logged under a reconcile hold. None:
    /// the same as `values` (an insert), kept once ([`Contribution::after_values`]).
    pub after: Option<Vec<(Arc<str>, Decimal)>>,
}

impl Contribution {
    /// What the item contributes to the target after this record.
    pub fn after_values(&self) -> &[(Arc<str>, Decimal)] {
        self.after.as_deref().unwrap_or(&self.values)
    }
}

/// `(name, value)` pairs with names as given, for contributions in tests and tools.
pub fn values_of<N: AsRef<str>>(pairs: impl IntoIterator<Item = (N, Decimal)>) -> Vec<(Arc<str>, Decimal)> {
    pairs.into_iter().map(|(n, v)| (Arc::from(n.as_ref()), v)).collect()
}

/// The source item a record is of, and its contributions after the record, per target.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub item: &'a Arc<str>,
    pub after: &'a [(TargetKey, Vec<(String, Decimal)>)],
}

/// The summed deltas of one target item, with the span of sequence numbers that fed it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetDelta {
    /// Attribute -> summed delta. May hold zeros until [`Coalescer::into_targets`].
    pub attributes: BTreeMap<String, Decimal>,
    /// Per record, in the order added (stream order within a shard).
    pub contributions: Vec<Contribution>,
    /// How many (record, rule) pairs contributed.
    pub records: u64,
    pub first_sequence: Option<String>,
    pub last_sequence: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Coalescer {
    targets: BTreeMap<TargetKey, TargetDelta>,
    records: u64,
    /// The measure names of this batch's contributions, one copy each.
    names: HashSet<Arc<str>>,
    /// The sequence number of the record added last, shared by its contributions.
    last_record: Option<Arc<str>>,
}

/// Sequence numbers are decimal strings of varying length: compare as numbers.
pub fn sequence_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let a = a.trim_start_matches('0');
    let b = b.trim_start_matches('0');
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

impl Coalescer {
    pub fn new() -> Coalescer {
        Coalescer::default()
    }

    /// Adds one record's deltas. All or nothing: if any sum would leave DynamoDB's number
    /// range, the sums already changed are restored and the error returned.
    pub fn add(
        &mut self,
        sequence: Option<&str>,
        created: Option<Decimal>,
        rule: Option<&Arc<str>>,
        deltas: Vec<(TargetKey, Vec<(String, Decimal)>)>,
    ) -> Result<(), DecimalError> {
        self.add_from(sequence, created, rule, deltas, None)
    }

    /// [`Coalescer::add`], keeping which source item each contribution is of and what the
    /// item contributes after the record.
    pub fn add_from(
        &mut self,
        sequence: Option<&str>,
        created: Option<Decimal>,
        rule: Option<&Arc<str>>,
        deltas: Vec<(TargetKey, Vec<(String, Decimal)>)>,
        source: Option<Source<'_>>,
    ) -> Result<(), DecimalError> {
        let mut applied: Vec<(&TargetKey, &str, Decimal)> = Vec::new();
        let mut failure = None;
        'outer: for (target, values) in &deltas {
            // A record whose deltas on a target are all zero does not touch it.
            if values.iter().all(|(_, v)| v.is_zero()) {
                continue;
            }
            // Clone keys only when they are new: most records hit targets seen before.
            if !self.targets.contains_key(target) {
                self.targets.insert(target.clone(), TargetDelta::default());
            }
            let Some(entry) = self.targets.get_mut(target) else { continue };
            for (name, v) in values.iter().filter(|(_, v)| !v.is_zero()) {
                if !entry.attributes.contains_key(name) {
                    entry.attributes.insert(name.clone(), Decimal::ZERO);
                }
                let Some(sum) = entry.attributes.get_mut(name) else { continue };
                match sum.checked_add(*v) {
                    Ok(s) => {
                        *sum = s;
                        applied.push((target, name, *v));
                    }
                    Err(e) => {
                        failure = Some(e);
                        break 'outer;
                    }
                }
            }
        }
        if let Some(e) = failure {
            for (target, name, v) in applied {
                if let Some(sum) = self.targets.get_mut(target).and_then(|t| t.attributes.get_mut(name)) {
                    // Restoring a value that was representable before cannot fail.
                    *sum = sum.checked_sub(v).unwrap_or(*sum);
                }
            }
            return Err(e);
        }
        self.records += 1;
        let shared = self.sequence(sequence);
        for (target, mut values) in deltas {
            values.retain(|(_, v)| !v.is_zero());
            if values.is_empty() {
                continue;
            }
            let after = source.and_then(|s| s.after.iter().find(|(t, _)| *t == target)).map(|(_, v)| v.as_slice()).unwrap_or_default();
            // Most records are inserts, whose contribution after is their delta: kept once.
            let after = (after != values.as_slice()).then(|| self.interned(after));
            let values = self.interned(&values);
            if let Some(entry) = self.targets.get_mut(&target) {
                entry.records += 1;
                entry.contributions.push(Contribution {
                    sequence: shared.clone(),
                    rule: rule.cloned(),
                    created,
                    values,
                    item: source.map(|s| s.item.clone()),
                    after,
                });
                if let Some(seq) = sequence {
                    if entry.first_sequence.as_deref().is_none_or(|f| sequence_cmp(seq, f).is_lt()) {
                        entry.first_sequence = Some(seq.to_string());
                    }
                    if entry.last_sequence.as_deref().is_none_or(|l| sequence_cmp(seq, l).is_gt()) {
                        entry.last_sequence = Some(seq.to_string());
                    }
                }
            }
        }
        Ok(())
    }

    /// `values` with their names interned.
    fn interned(&mut self, values: &[(String, Decimal)]) -> Vec<(Arc<str>, Decimal)> {
        values
            .iter()
            .map(|(name, v)| {
                let name = match self.names.get(name.as_str()) {
                    Some(n) => n.clone(),
                    None => {
                        let n: Arc<str> = Arc::from(name.as_str());
                        self.names.insert(n.clone());
                        n
                    }
                };
                (name, *v)
            })
            .collect()
    }

    /// The record's sequence number, shared with its contributions of other rules.
    fn sequence(&mut self, sequence: Option<&str>) -> Option<Arc<str>> {
        let seq = sequence?;
        match &self.last_record {
            Some(last) if &**last == seq => Some(last.clone()),
            _ => {
                let shared: Arc<str> = Arc::from(seq);
                self.last_record = Some(shared.clone());
                Some(shared)
            }
        }
    }

    /// Records added (that had at least one rule evaluate without poison).
    pub fn records(&self) -> u64 {
        self.records
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// The deltas per target, sorted by target key, zero sums left out of `attributes`.
    ///
    /// A target whose records cancel out (an order inserted and deleted in one batch) is kept:
    /// its write still has to advance the ledger. Had a replica that died applied the insert
    /// alone, skipping the target would leave the insert counted for ever; the ledger-only
    /// write finds the insert applied and applies the delete.
    pub fn into_targets(self) -> Vec<(TargetKey, TargetDelta)> {
        self.targets
            .into_iter()
            .filter_map(|(key, mut delta)| {
                delta.attributes.retain(|_, v| !v.is_zero());
                (!delta.contributions.is_empty()).then_some((key, delta))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> TargetKey {
        TargetKey(vec![Box::from(s), Box::from("PROFILE")].into_boxed_slice())
    }

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap()
    }

    #[test]
    fn sums_per_target_and_drops_zeros() {
        let mut c = Coalescer::new();
        for i in 0..1000 {
            let cust = format!("CUST#c{}", i % 10);
            c.add(
                Some(&format!("{:021}", i + 1)),
                None,
                None,
                vec![(key(&cust), vec![("orderCount".into(), Decimal::ONE), ("revenue".into(), d("0.1"))])],
            )
            .unwrap();
        }
        c.add(Some("5000"), None, None, vec![(key("CUST#c0"), vec![("revenue".into(), d("-10"))])]).unwrap();
        let targets = c.into_targets();
        assert_eq!(targets.len(), 10, "1,000 records on 10 customers: 10 writes");
        let (k, first) = &targets[0];
        assert_eq!(k, &key("CUST#c0"));
        assert_eq!(first.attributes["orderCount"].to_string(), "100");
        assert!(!first.attributes.contains_key("revenue"), "100 * 0.1 - 10 is exactly zero and dropped");
        assert_eq!(first.first_sequence.as_deref(), Some("000000000000000000001"));
        assert_eq!(first.last_sequence.as_deref(), Some("5000"));
        assert_eq!(targets[1].1.attributes["revenue"].to_string(), "10");
    }

    #[test]
    fn a_failing_record_changes_nothing() {
        let mut c = Coalescer::new();
        let max = d(&"9".repeat(38));
        c.add(None, None, None, vec![(key("a"), vec![("x".into(), max)])]).unwrap();
        let err = c.add(None, None, None, vec![(key("b"), vec![("y".into(), Decimal::ONE)]), (key("a"), vec![("x".into(), d("0.5"))])]);
        assert!(err.is_err());
        let targets = c.into_targets();
        assert_eq!(targets.len(), 1, "b's partial sum was rolled back (zero, dropped)");
        assert_eq!(targets[0].1.attributes["x"], max);
        assert_eq!(targets[0].1.records, 1);
    }

    #[test]
    fn sequence_numbers_compare_numerically() {
        assert!(sequence_cmp("9", "10").is_lt());
        assert!(sequence_cmp("000000000000000000009", "10").is_lt());
        assert!(sequence_cmp(
            "49658361752382621885697088319781165717078428243510427650",
            "49658361752382621885697088319781165717078428243510427651"
        )
        .is_lt());
        assert!(sequence_cmp("010", "10").is_eq());
    }
}
