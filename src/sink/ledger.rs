//! The idempotency ledger kept on every target item (pure).
//!
//! For each stream shard that has written to an item, the item holds one attribute
//! `_agg:<namespace>:<shard>` = `<highest applied sequence number, 40 digits>@<newest record
//! time>`. A write adds the coalesced deltas and advances the entry in one conditional
//! UpdateItem, on condition that the entry is absent or below the write's first sequence
//! number; so a replayed record is never applied twice, whichever replica replays it. Sequence
//! numbers increase within a shard and are at most 40 digits, so zero-padding makes string
//! order numeric order.
//!
//! Entries of finished shards are pruned so the item stays small. A stalled former owner of a
//! pruned shard must then be refused, which is what the fence does: the item keeps a floor
//! `_aggfloor:<namespace>` (a shard creation time, epoch ms, 20 digits) and a small straggler
//! set `_aggopen:<namespace>` (`,<shard>,<shard>,`): a shard is admitted when it was created at
//! or after the floor or is a straggler. Every shard created before the floor that is not a
//! straggler is finished, so its entry can go. Stragglers let one slow shard stay open without
//! holding the floor (and every other shard's entry) back. The admitted set only ever shrinks:
//! a pruning write compares-and-sets the floor and straggler set it last saw on the item and
//! keeps only stragglers that set admits.
//!
//! Everything is namespaced per deployment (two rule sets or two source tables writing one
//! item never refuse or prune each other's entries).

use crate::decimal::{Decimal, DecimalError};
use crate::rules::Contribution;

/// Prefix of ledger entry attributes of every namespace (inside the reserved `_agg` space).
pub const ENTRY_PREFIX: &str = "_agg:";
/// DynamoDB Streams sequence numbers are 21 to 40 digits.
pub const SEQUENCE_WIDTH: usize = 40;
/// Entries one write removes at most: each costs about 7 bytes of the update expression, and
/// DynamoDB refuses expressions over 4 KB.
pub const MAX_PRUNE_PER_WRITE: usize = 100;
/// Open shards older than the floor that an item admits by name.
pub const MAX_STRAGGLERS: usize = 8;
/// DynamoDB's limit on one expression string.
pub const MAX_EXPRESSION_BYTES: usize = 4096;

/// A namespace derived from the state table's name: a short FNV-1a hash, so two deployments
/// (each with its own state table) get different ones without configuration.
pub fn default_namespace(state_table: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in state_table.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{:06x}", h & 0x00ff_ffff)
}

/// A configured namespace: 1 to 16 of `A-Z a-z 0-9 _ -`.
pub fn check_namespace(ns: &str) -> Result<&str, String> {
    let ok = (1..=16).contains(&ns.len()) && ns.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(ns)
    } else {
        Err(format!("{ns:?}: use 1 to 16 letters, digits, '_' or '-'"))
    }
}

/// The names one deployment's ledger uses on target items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    namespace: String,
}

impl Ledger {
    pub fn new(namespace: &str) -> Ledger {
        Ledger { namespace: namespace.to_string() }
    }

    /// `_agg:<namespace>:`
    pub fn entry_prefix(&self) -> String {
        format!("{ENTRY_PREFIX}{}:", self.namespace)
    }

    /// `_agg:<namespace>:<shard id without the shardId- prefix>`.
    pub fn entry_name(&self, shard_id: &str) -> String {
        format!("{}{}", self.entry_prefix(), crate::shard_id::suffix(shard_id))
    }

    pub fn floor_attribute(&self) -> String {
        format!("_aggfloor:{}", self.namespace)
    }

    pub fn open_attribute(&self) -> String {
        format!("_aggopen:{}", self.namespace)
    }

    /// `_aggv:<namespace>`: a counter every ledger write (and every reconcile correction)
    /// advances, so reconcile's correction is conditioned on one attribute, however many
    /// shards the stream has had.
    pub fn version_attribute(&self) -> String {
        format!("_aggv:{}", self.namespace)
    }

    /// `_aggm:<namespace>`: the set of measure attributes this deployment wrote on the item;
    /// reconcile touches no other attribute (a user's `orders_note` stays as it is).
    pub fn measures_attribute(&self) -> String {
        format!("_aggm:{}", self.namespace)
    }

    /// Whether an attribute is one of this namespace's entries.
    pub fn is_entry(&self, attribute: &str) -> bool {
        attribute.strip_prefix(ENTRY_PREFIX).and_then(|r| r.strip_prefix(self.namespace.as_str())).is_some_and(|r| r.starts_with(':'))
    }
}

/// A pre-namespace entry name, `_agg:<shard>` (items written before namespaces).
pub fn entry_name(shard_id: &str) -> String {
    format!("{ENTRY_PREFIX}{}", crate::shard_id::suffix(shard_id))
}

/// The namespace prefix (`_agg:<namespace>:`) of an entry name.
pub fn entry_prefix_of(entry_name: &str) -> &str {
    entry_name.rfind(':').map_or(entry_name, |i| &entry_name[..=i])
}

/// A sequence number zero-padded to 40 digits; None if it is not 1 to 40 digits.
pub fn pad_sequence(seq: &str) -> Option<String> {
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = seq.trim_start_matches('0');
    (trimmed.len() <= SEQUENCE_WIDTH).then(|| format!("{trimmed:0>SEQUENCE_WIDTH$}"))
}

/// The shard part of an entry name (after the last `:`).
pub fn entry_shard(name: &str) -> Option<&str> {
    name.strip_prefix(ENTRY_PREFIX).map(|r| r.rsplit(':').next().unwrap_or(r))
}

/// The creation time of the shard an entry belongs to, from its name.
pub fn entry_created_ms(name: &str) -> Option<u64> {
    crate::shard_id::created_ms(&format!("shardId-{}", entry_shard(name)?))
}

/// The stored entry: padded last sequence number, then `@` and the newest record time.
pub fn entry_value(last_padded: &str, newest_created: Option<Decimal>) -> String {
    match newest_created.and_then(Decimal::trunc_i64) {
        Some(t) => format!("{last_padded}@{t}"),
        None => last_padded.to_string(),
    }
}

/// The padded sequence number of a stored entry.
pub fn entry_sequence(value: &str) -> &str {
    value.split('@').next().unwrap_or(value)
}

/// The record time of a stored entry (epoch seconds).
pub fn entry_time(value: &str) -> Option<i64> {
    value.split_once('@').and_then(|(_, t)| t.parse().ok())
}

/// The floor attribute's value for a shard creation time.
pub fn floor_value(created_ms: u64) -> String {
    format!("{created_ms:020}")
}

/// The straggler set's stored form: `,a,b,` (`,` when empty), so `contains(set, ",a,")`
/// tests membership in an expression of constant size.
pub fn open_value(stragglers: &[String]) -> String {
    let mut s = String::from(",");
    for x in stragglers {
        s.push_str(x);
        s.push(',');
    }
    s
}

/// The token a shard looks itself up with in a straggler set.
pub fn open_token(shard_id: &str) -> String {
    format!(",{},", crate::shard_id::suffix(shard_id))
}

/// Whether an item with this floor and straggler set takes writes from a shard whose floor
/// value is `mine`.
pub fn admits(floor: Option<&str>, open: Option<&str>, mine: &str, token: &str) -> bool {
    floor.is_none_or(|f| f <= mine) || open.is_some_and(|o| o.contains(token))
}

/// Which shards an item may still take writes from, as one replica's lease table shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FloorPlan {
    /// Floor value: every shard created before it is finished, but the stragglers.
    pub floor: String,
    /// Shard suffixes of the open shards created before the floor.
    pub stragglers: Vec<String>,
}

/// The floor plan for the shards not yet finished (ids): the floor as high as
/// [`MAX_STRAGGLERS`] stragglers allow, but never above `known_until_ms`, the time up to which
/// the caller knows every shard (its last DescribeStream, less a margin): a shard it has not
/// seen yet (a paginated lease scan is no snapshot, a listing can predate a split) was created
/// after that, so the floor cannot pass it. None when a shard id carries no creation time
/// (then nothing is pruned) or nothing is open.
pub fn floor_plan<'a>(unfinished: impl IntoIterator<Item = &'a str>, known_until_ms: u64) -> Option<FloorPlan> {
    let mut open: Vec<(u64, &str)> = Vec::new();
    for id in unfinished {
        open.push((crate::shard_id::created_ms(id)?, id));
    }
    open.sort_unstable();
    let at = open.len().checked_sub(1)?.min(MAX_STRAGGLERS);
    let floor_ms = open[at].0.min(known_until_ms);
    let stragglers = open.iter().take_while(|(c, _)| *c < floor_ms).map(|(_, id)| crate::shard_id::suffix(id).to_string()).collect();
    Some(FloorPlan { floor: floor_value(floor_ms), stragglers })
}

/// What a write learned of an item's ledger (from the item after the write).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// Entry names of this namespace.
    pub entries: Vec<String>,
    pub floor: Option<String>,
    pub open: Option<String>,
}

/// The pruning part of a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prune {
    pub entries: Vec<String>,
    /// The floor and straggler set the item had when it was last seen: the write sets new ones
    /// only if they are unchanged.
    pub seen_floor: Option<String>,
    pub seen_open: Option<String>,
    pub floor: String,
    pub open: String,
}

/// What the next write to an item may prune, given what was seen on it and the current plan;
/// `own` is the writing shard's entry (never pruned). None when there is nothing to prune or
/// the plan would lower the item's floor (another replica saw further).
pub fn prune_for(plan: &FloorPlan, seen: &Seen, own: &str) -> Option<Prune> {
    if seen.floor.as_ref().is_some_and(|f| *f > plan.floor) {
        return None;
    }
    // Keep only stragglers the item admits now: one it refuses was seen finished by someone.
    let stragglers: Vec<String> = plan
        .stragglers
        .iter()
        .filter(|x| admits(seen.floor.as_deref(), seen.open.as_deref(), &plan_floor_of(x), &format!(",{x},")))
        .cloned()
        .collect();
    let entries: Vec<String> = seen
        .entries
        .iter()
        .filter(|e| e.as_str() != own)
        .filter(|e| entry_shard(e).is_some_and(|s| !stragglers.iter().any(|x| x == s)))
        .filter(|e| entry_created_ms(e).is_some_and(|c| floor_value(c) < plan.floor))
        .take(MAX_PRUNE_PER_WRITE)
        .cloned()
        .collect();
    if entries.is_empty() {
        return None;
    }
    Some(Prune {
        entries,
        seen_floor: seen.floor.clone(),
        seen_open: seen.open.clone(),
        floor: plan.floor.clone(),
        open: open_value(&stragglers),
    })
}

/// A straggler's own floor value (from its suffix); unparseable ids sort first.
fn plan_floor_of(suffix: &str) -> String {
    floor_value(crate::shard_id::created_ms(&format!("shardId-{suffix}")).unwrap_or(0))
}

/// What one conditional write carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// Non-zero summed deltas, by attribute.
    pub adds: Vec<(String, Decimal)>,
    pub first: String,
    pub last: String,
    pub newest_created: Option<Decimal>,
    pub records: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("record without a usable sequence number")]
    NoSequence,
    #[error(transparent)]
    Number(#[from] DecimalError),
}

/// Sums the contributions after `applied` (a padded sequence number, or None for all).
/// None when every contribution is applied already. Records that cancel out still give a
/// plan (with no adds): its write advances the ledger, so a replica that applied only some
/// of them cannot leave their sum half applied.
pub fn plan(contributions: &[Contribution], applied: Option<&str>) -> Result<Option<WritePlan>, PlanError> {
    let mut adds: Vec<(String, Decimal)> = Vec::new();
    let (mut first, mut last): (Option<String>, Option<String>) = (None, None);
    let mut newest: Option<Decimal> = None;
    let mut records = 0;
    for c in contributions {
        let seq = c.sequence.as_deref().and_then(pad_sequence).ok_or(PlanError::NoSequence)?;
        if applied.is_some_and(|a| seq.as_str() <= a) {
            continue;
        }
        records += 1;
        for (name, v) in &c.values {
            match adds.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => *sum = sum.checked_add(*v)?,
                None => adds.push((name.clone(), *v)),
            }
        }
        if first.as_ref().is_none_or(|f| seq < *f) {
            first = Some(seq.clone());
        }
        if last.as_ref().is_none_or(|l| seq > *l) {
            last = Some(seq);
        }
        if let Some(t) = c.created {
            if newest.is_none_or(|n| t > n) {
                newest = Some(t);
            }
        }
    }
    adds.retain(|(_, v)| !v.is_zero());
    adds.sort_by(|a, b| a.0.cmp(&b.0));
    match (first, last) {
        (Some(first), Some(last)) => Ok(Some(WritePlan { adds, first, last, newest_created: newest, records })),
        _ => Ok(None),
    }
}

/// A value in an expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExprValue {
    /// A string set (never empty: DynamoDB refuses empty sets).
    Ss(Vec<String>),
    S(String),
    N(String),
}

/// The UpdateItem of one ledger write, as DynamoDB receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expressions {
    pub update: String,
    pub condition: String,
    pub names: Vec<(String, String)>,
    pub values: Vec<(String, ExprValue)>,
}

impl Expressions {
    /// The longer of the two expression strings (DynamoDB's limit is per expression).
    pub fn longest(&self) -> usize {
        self.update.len().max(self.condition.len())
    }
}

/// Builds the conditional UpdateItem of a write. The condition: this shard's entry is absent
/// or below the write's first record; the item admits this shard (floor or straggler set);
/// and, for a pruning write, the floor and straggler set are still what was seen.
pub fn expressions(w: &super::LedgerWrite) -> Expressions {
    let mut names = vec![("#l".to_string(), w.entry_name.clone()), ("#g".to_string(), w.legacy_entry.clone())];
    let mut values = vec![(":l".to_string(), ExprValue::S(w.entry_value.clone())), (":first".to_string(), ExprValue::S(w.first.clone()))];
    let mut condition = String::from("(attribute_not_exists(#l) OR #l < :first) AND (attribute_not_exists(#g) OR #g < :first)");
    let mut sets = vec!["#l = :l".to_string()];
    let mut adds = Vec::with_capacity(w.adds.len() + 2);
    for (i, (name, v)) in w.adds.iter().enumerate() {
        adds.push(format!("#m{i} :m{i}"));
        names.push((format!("#m{i}"), name.clone()));
        values.push((format!(":m{i}"), ExprValue::N(v.to_string())));
    }
    adds.push("#v :one".into());
    names.push(("#v".into(), w.version_attribute.clone()));
    values.push((":one".into(), ExprValue::N("1".into())));
    if !w.adds.is_empty() {
        adds.push("#w :w".into());
        names.push(("#w".into(), w.measures_attribute.clone()));
        values.push((":w".into(), ExprValue::Ss(w.adds.iter().map(|(n, _)| n.clone()).collect())));
    }
    if let Some(f) = &w.fence {
        names.push(("#f".into(), f.floor_attribute.clone()));
        names.push(("#o".into(), f.open_attribute.clone()));
        values.push((":mine".into(), ExprValue::S(f.mine.clone())));
        values.push((":me".into(), ExprValue::S(f.token.clone())));
        condition.push_str(" AND (attribute_not_exists(#f) OR #f <= :mine OR contains(#o, :me))");
        if let Some(p) = &w.prune {
            match &p.seen_floor {
                Some(v) => {
                    condition.push_str(" AND #f = :sf");
                    values.push((":sf".into(), ExprValue::S(v.clone())));
                }
                None => condition.push_str(" AND attribute_not_exists(#f)"),
            }
            match &p.seen_open {
                Some(v) => {
                    condition.push_str(" AND #o = :so");
                    values.push((":so".into(), ExprValue::S(v.clone())));
                }
                None => condition.push_str(" AND attribute_not_exists(#o)"),
            }
            sets.push("#f = :nf".into());
            sets.push("#o = :no".into());
            values.push((":nf".into(), ExprValue::S(p.floor.clone())));
            values.push((":no".into(), ExprValue::S(p.open.clone())));
        }
    }
    let mut update = format!("ADD {} ", adds.join(", "));
    update.push_str("SET ");
    update.push_str(&sets.join(", "));
    if let Some(p) = w.prune.as_ref().filter(|p| w.fence.is_some() && !p.entries.is_empty()) {
        let removes: Vec<String> = (0..p.entries.len()).map(|i| format!("#p{i}")).collect();
        for (n, e) in removes.iter().zip(&p.entries) {
            names.push((n.clone(), e.clone()));
        }
        update.push_str(" REMOVE ");
        update.push_str(&removes.join(", "));
    }
    Expressions { update, condition, names, values }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(seq: &str, values: &[(&str, &str)]) -> Contribution {
        Contribution {
            sequence: Some(seq.into()),
            rule: None,
            created: Some(Decimal::from_i64(1_764_460_800)),
            values: values.iter().map(|(n, v)| (n.to_string(), Decimal::parse(v).unwrap())).collect(),
        }
    }

    #[test]
    fn padding_orders_like_numbers() {
        let a = pad_sequence("9").unwrap();
        let b = pad_sequence("000000000000000000010").unwrap();
        assert_eq!(a.len(), 40);
        assert!(a < b);
        assert_eq!(pad_sequence(&"1".repeat(40)).unwrap(), "1".repeat(40));
        assert_eq!(pad_sequence(&"1".repeat(41)), None);
        assert_eq!(pad_sequence("12a"), None);
        assert_eq!(pad_sequence(""), None);
    }

    #[test]
    fn plans_skip_applied_records() {
        let cs = [c("10", &[("n", "1"), ("rev", "2.5")]), c("11", &[("n", "1")]), c("12", &[("rev", "-2.5")])];
        let all = plan(&cs, None).unwrap().unwrap();
        assert_eq!(all.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=2"]);
        assert_eq!(all.first, pad_sequence("10").unwrap());
        assert_eq!(all.last, pad_sequence("12").unwrap());
        assert_eq!(all.records, 3);
        let rest = plan(&cs, Some(&pad_sequence("10").unwrap())).unwrap().unwrap();
        assert_eq!(rest.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=1", "rev=-2.5"]);
        assert_eq!(rest.first, pad_sequence("11").unwrap());
        assert_eq!(plan(&cs, Some(&pad_sequence("12").unwrap())).unwrap(), None);
        let v = entry_value(&all.last, all.newest_created);
        assert_eq!(entry_sequence(&v), all.last);
        assert_eq!(entry_time(&v), Some(1_764_460_800));
        assert_eq!(entry_name("shardId-00000001796001337266-8e340a17"), "_agg:00000001796001337266-8e340a17");
    }

    #[test]
    fn records_that_cancel_out_still_advance_the_ledger() {
        // An order inserted, re-priced and deleted: the sums are zero, but a replica may have
        // applied the insert alone; the write must still go out to find that out.
        let cs = [c("10", &[("n", "1"), ("rev", "448.3")]), c("11", &[("rev", "-194.86")]), c("12", &[("n", "-1"), ("rev", "-253.44")])];
        let p = plan(&cs, None).unwrap().unwrap();
        assert!(p.adds.is_empty());
        assert_eq!((p.first, p.last, p.records), (pad_sequence("10").unwrap(), pad_sequence("12").unwrap(), 3));
        let rest = plan(&cs, Some(&pad_sequence("10").unwrap())).unwrap().unwrap();
        assert_eq!(rest.adds.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["n=-1", "rev=-448.3"]);
    }

    fn id(created: u64, n: u32) -> String {
        format!("shardId-{created:020}-{n:08x}")
    }

    #[test]
    fn namespaces_separate_deployments() {
        let (a, b) = (Ledger::new(&default_namespace("state-a")), Ledger::new(&default_namespace("state-b")));
        assert_ne!(a, b);
        assert_eq!(default_namespace("state-a"), default_namespace("state-a"), "stable across restarts");
        let e = a.entry_name("shardId-0001-aa");
        assert!(a.is_entry(&e) && !b.is_entry(&e));
        assert_eq!(entry_shard(&e), Some("0001-aa"));
        assert_eq!(entry_prefix_of(&e), a.entry_prefix());
        assert!(check_namespace("prod-eu_1").is_ok());
        assert!(check_namespace("").is_err() && check_namespace("a:b").is_err() && check_namespace(&"x".repeat(17)).is_err());
    }

    #[test]
    fn one_slow_shard_does_not_hold_the_floor_back() {
        // 200 open shards created at 1000..1200, one slow shard created at 10 still open.
        let mut open: Vec<String> = (0..200).map(|i| id(1000 + i, i as u32)).collect();
        open.push(id(10, 999));
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        assert_eq!(plan.floor, floor_value(1000 + MAX_STRAGGLERS as u64 - 1), "the floor passes the slow shard");
        assert_eq!(plan.stragglers.len(), MAX_STRAGGLERS);
        assert!(plan.stragglers.contains(&crate::shard_id::suffix(&id(10, 999)).to_string()));
        // Every open shard stays admitted; a finished one created before the floor does not.
        let open_set = open_value(&plan.stragglers);
        for o in &open {
            let mine = floor_value(crate::shard_id::created_ms(o).unwrap());
            assert!(admits(Some(&plan.floor), Some(&open_set), &mine, &open_token(o)), "{o}");
        }
        assert!(!admits(Some(&plan.floor), Some(&open_set), &floor_value(500), &open_token(&id(500, 5))));
        assert_eq!(floor_plan(["odd-id"], u64::MAX), None, "no creation time: prune nothing");
        assert_eq!(floor_plan(std::iter::empty::<&str>(), u64::MAX), None);
        // A shard this replica has not seen yet was created after its last listing: the floor
        // stays at or below that time (the model checker's counterexample without this cap).
        let capped = floor_plan(open.iter().map(String::as_str), 1003).unwrap();
        assert_eq!(capped.floor, floor_value(1003));
        assert_eq!(capped.stragglers.len(), 4, "only the open shards created before the capped floor");
    }

    #[test]
    fn pruning_is_capped_and_never_readmits_a_refused_shard() {
        let l = Ledger::new("ns");
        let own = l.entry_name(&id(5000, 1));
        let mut entries: Vec<String> = (0..1000).map(|i| l.entry_name(&id(i, i as u32))).collect();
        entries.push(own.clone());
        let plan = FloorPlan { floor: floor_value(5000), stragglers: vec![crate::shard_id::suffix(&id(3, 3)).to_string()] };
        let seen = Seen { entries, floor: Some(floor_value(2)), open: Some(",".into()) };
        let p = prune_for(&plan, &seen, &own).unwrap();
        assert_eq!(p.entries.len(), MAX_PRUNE_PER_WRITE);
        assert!(!p.entries.contains(&own));
        // Shard 3 was created after the item's floor (2): admitted, so it may stay a straggler.
        assert_eq!(p.open, open_value(&plan.stragglers));
        assert!(!p.entries.contains(&l.entry_name(&id(3, 3))), "a straggler's entry is kept");
        // Shard 1 is refused by the item (created before its floor 2, not a straggler): a stale
        // view that still thinks it open must not admit it again.
        let stale = FloorPlan { floor: floor_value(5000), stragglers: vec![crate::shard_id::suffix(&id(1, 1)).to_string()] };
        assert_eq!(prune_for(&stale, &seen, &own).unwrap().open, ",", "a refused shard is not re-admitted");
        // A plan below the item's floor prunes nothing.
        let behind = Seen { floor: Some(floor_value(6000)), ..seen.clone() };
        assert_eq!(prune_for(&plan, &behind, &own), None);
        // The largest pruning write stays within DynamoDB's 4 KB expression limit.
        let w = super::super::LedgerWrite {
            key: vec![("PK".into(), "SALES#2026-11-30".into()), ("SK".into(), "TOTAL".into())],
            adds: (0..20).map(|i| (format!("m{i}"), Decimal::from_i64(1))).collect(),
            entry_name: own.clone(),
            legacy_entry: entry_name(&id(5000, 1)),
            version_attribute: l.version_attribute(),
            measures_attribute: l.measures_attribute(),
            entry_value: entry_value(&pad_sequence("1").unwrap(), None),
            first: pad_sequence("1").unwrap(),
            fence: Some(super::super::Fence {
                floor_attribute: l.floor_attribute(),
                open_attribute: l.open_attribute(),
                mine: floor_value(5000),
                token: open_token(&id(5000, 1)),
            }),
            prune: Some(p),
        };
        let e = expressions(&w);
        assert!(e.longest() <= MAX_EXPRESSION_BYTES, "{} bytes", e.longest());
        assert!(e.update.contains(" REMOVE #p0,") && e.condition.contains("#f = :sf AND #o = :so"), "{e:?}");
    }
}
