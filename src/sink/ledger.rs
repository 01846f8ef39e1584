//! The idempotency ledger kept on every target item (pure).
//!
//! For each stream shard that has written to an item, the item holds one entry: the highest
//! sequence number applied from that shard. A write adds the coalesced deltas and advances the
//! entry in one conditional UpdateItem, on condition that the entry is absent or below the
//! write's first sequence number; so a replayed record is never applied twice, whichever
//! replica replays it.
//!
//! Entries are compact, because a target written from every shard (a global daily total) holds
//! one per open shard and every byte of the item costs write units: the name is
//! `_agg<namespace>.<shard>` with the shard id packed into 13 characters (its creation time and
//! its 8 hex digits), and the value is binary, a length byte and the sequence number's
//! big-endian bytes, so byte order is numeric order. About 37 bytes an entry: 200 open shards
//! fit in 8 KB. Items written by earlier versions hold `_agg:<namespace>:<shard>` (and before
//! namespaces `_agg:<shard>`) with the 40-digit padded number as a string; a write must be past
//! those too, and pruning removes them like any entry.
//!
//! Entries of finished shards are pruned so the item stays small. A stalled former owner of a
//! pruned shard must then be refused, which is what the fence does: the item keeps a floor
//! `_aggfloor:<namespace>` (a shard creation time, epoch ms, 20 digits) and a small straggler
//! set `_aggopen:<namespace>` (`,<shard>,<shard>,`): a shard is admitted when it was created at
//! or after the floor or is a straggler. Every shard created before the floor that is not a
//! straggler is finished, so its entry can go. Stragglers let one slow shard stay open without
//! holding the floor (and every other shard's entry) back. A straggler is admitted by its
//! creation time (a token that admits every shard of that millisecond) or, where most shards
//! of that time have finished, by its id, so theirs can go. The admitted set only ever shrinks:
//! a pruning write compares-and-sets the floor and straggler set it last saw on the item and
//! keeps only stragglers that set admits.
//!
//! Everything is namespaced per deployment (two rule sets or two source tables writing one
//! item never refuse or prune each other's entries).

use crate::decimal::{Decimal, DecimalError};
use crate::rules::Contribution;
use crate::shard_id::suffix_created_ms;
use crate::sink::hold::HoldWrite;

/// Prefix of the entries earlier versions wrote, of every namespace (`_agg:<namespace>:<shard>`
/// and `_agg:<shard>`), inside the reserved `_agg` space.
pub const ENTRY_PREFIX: &str = "_agg:";
/// Compact entry names start `_agg<namespace>.`; a shard id without the usual form is kept
/// whole after this mark (`_agg<namespace>.~<shard>`).
const RAW_SHARD_MARK: char = '~';
/// Digits of the packed shard ids, in ASCII order.
const DIGITS: &[u8; 64] = b"-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";
/// DynamoDB Streams sequence numbers are 21 to 40 digits.
pub const SEQUENCE_WIDTH: usize = 40;
/// Entries one write removes at most: each costs about 7 bytes of the update expression, and
/// DynamoDB refuses expressions over 4 KB.
pub const MAX_PRUNE_PER_WRITE: usize = 100;
/// Distinct creation times of open shards a floor plan may pass. Each item takes only as many
/// as pay for themselves ([`prune_for`]): a time token costs 8 bytes of the item and lets the
/// floor pass one more open shard, so the entries of shards that finished after it was created
/// (about 34 bytes each) can go. A global total during the catch-up after a long outage, when
/// each partition's backlog is a chain of unfinished shards, needs several hundred; an item
/// written by a few shards takes a few.
pub const MAX_STRAGGLERS: usize = 1000;
/// What a straggler time token and a ledger entry cost an item, bytes (the per-item floor's
/// trade: [`prune_for`]).
const TOKEN_BYTES: usize = 8;
const ENTRY_BYTES: usize = 34;
/// A straggler listed by id: the shard id's suffix and a comma.
const ID_BYTES: usize = 30;
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

/// The names one deployment's ledger uses on target items, formed once: reconcile asks
/// [`Ledger::is_own`] of every reserved attribute of every item it reads.
/// Cheap to clone: the names are shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger(std::sync::Arc<Names>);

#[derive(Debug, PartialEq, Eq)]
struct Names {
    namespace: String,
    /// The attributes with exact names: the counter, the floor, the straggler set, the
    /// written-measures set, the hold and the fold sequence.
    exact: [String; 6],
    /// The prefixes of attribute families: derivation counters, cursors, counts, walked
    /// marks and hold logs.
    prefixes: [String; 5],
}

/// Indexes into [`Names`]' `exact` names.
const VERSION: usize = 0;
const FLOOR: usize = 1;
const OPEN: usize = 2;
const MEASURES: usize = 3;
const HOLD: usize = 4;
const FOLD: usize = 5;
/// Indexes into [`Names`]' `prefixes`.
const DERIVED: usize = 0;
const CURSORS: usize = 1;
const COUNTS: usize = 2;
const WALKED: usize = 3;
const LOGS: usize = 4;

impl Ledger {
    pub fn new(namespace: &str) -> Ledger {
        let ns = namespace;
        Ledger(std::sync::Arc::new(Names {
            namespace: ns.to_string(),
            exact: [
                format!("_aggv:{ns}"),
                format!("_aggfloor:{ns}"),
                format!("_aggopen:{ns}"),
                format!("_aggm:{ns}"),
                format!("_agghold:{ns}"),
                format!("_aggfold:{ns}"),
            ],
            prefixes: [
                format!("_aggd:{ns}:"),
                format!("_aggk:{ns}:"),
                format!("_aggn:{ns}:"),
                format!("_aggw:{ns}:"),
                format!("_agglog:{ns}:"),
            ],
        }))
    }

    /// The counter's name ([`Ledger::version_attribute`]), borrowed.
    pub fn version_name(&self) -> &str {
        &self.0.exact[VERSION]
    }

    /// The written-measures set's name ([`Ledger::measures_attribute`]), borrowed.
    pub fn measures_name(&self) -> &str {
        &self.0.exact[MEASURES]
    }

    /// The floor's name ([`Ledger::floor_attribute`]), borrowed.
    pub fn floor_name(&self) -> &str {
        &self.0.exact[FLOOR]
    }

    /// The hold's name ([`Ledger::hold_attribute`]), borrowed.
    pub fn hold_name(&self) -> &str {
        &self.0.exact[HOLD]
    }

    /// The hold log's prefix ([`Ledger::log_prefix`]), borrowed.
    pub fn log_prefix_name(&self) -> &str {
        &self.0.prefixes[LOGS]
    }

    /// `_agg<namespace>.`: the prefix of this namespace's entries.
    pub fn entry_prefix(&self) -> String {
        format!("_agg{}.", self.0.namespace)
    }

    /// `_agg<namespace>.<packed shard id>`: this shard's entry.
    pub fn entry_name(&self, shard_id: &str) -> String {
        format!("{}{}", self.entry_prefix(), shard_tag(shard_id))
    }

    /// `_agg:<namespace>:<shard id without shardId->`: the entry versions before compact
    /// entries wrote (a write must be past it too).
    pub fn named_entry(&self, shard_id: &str) -> String {
        format!("{ENTRY_PREFIX}{}:{}", self.0.namespace, crate::shard_id::suffix(shard_id))
    }

    pub fn floor_attribute(&self) -> String {
        self.0.exact[FLOOR].clone()
    }

    pub fn open_attribute(&self) -> String {
        self.0.exact[OPEN].clone()
    }

    /// `_aggv:<namespace>`: a counter every ledger write (and every reconcile correction)
    /// advances, so reconcile's correction is conditioned on one attribute, however many
    /// shards the stream has had.
    pub fn version_attribute(&self) -> String {
        self.0.exact[VERSION].clone()
    }

    /// `_aggd:<namespace>:`: the prefix of the counters that derivations of `max`, `min`,
    /// `latest` and `distinct` advance, one per derived attribute (`_aggd:<namespace>:<name>`),
    /// so a derivation from an older view of the helpers never lands after a newer one
    /// ([`crate::sink::derive`]).
    pub fn derived_prefix(&self) -> String {
        self.0.prefixes[DERIVED].clone()
    }

    /// `_aggk:<namespace>:`: the prefix of the cursors of `max`, `min` and `latest`
    /// (`_aggk:<namespace>:<name>`), where their derivations start reading helpers
    /// ([`crate::sink::derive`]).
    pub fn cursor_prefix(&self) -> String {
        self.0.prefixes[CURSORS].clone()
    }

    pub fn derivation_names(&self) -> crate::sink::DerivationNames {
        crate::sink::DerivationNames {
            counters: self.derived_prefix(),
            cursors: self.cursor_prefix(),
            counts: self.0.prefixes[COUNTS].clone(),
            walked: self.0.prefixes[WALKED].clone(),
        }
    }

    /// `_aggm:<namespace>`: the set of measure attributes this deployment wrote on the item;
    /// reconcile touches no other attribute (a user's `orders_note` stays as it is).
    pub fn measures_attribute(&self) -> String {
        self.0.exact[MEASURES].clone()
    }

    /// `_agghold:<namespace>`: a reconcile's hold on the item, `<hold id>:<expiry, epoch ms>`
    /// ([`super::hold`]).
    /// `_aggfold:<namespace>`: on a sharded target's total, the sequence of the fold that
    /// wrote it ([`crate::reconcile::sharded`]).
    pub fn fold_attribute(&self) -> String {
        self.0.exact[FOLD].clone()
    }

    pub fn hold_attribute(&self) -> String {
        self.0.exact[HOLD].clone()
    }

    /// `_agglog:<namespace>:`: the prefix of the log writers keep while a hold stands, one
    /// attribute per source item, `_agglog:<namespace>:<hold id>:<item id>`.
    pub fn log_prefix(&self) -> String {
        self.0.prefixes[LOGS].clone()
    }

    /// Whether a reserved attribute (`_agg...`) is this namespace's: an entry, the counter,
    /// the floor, the straggler set, a derivation counter or cursor, the written-measures set, a hold or
    /// a hold's log. An item holding a reserved attribute that is not is written by another
    /// deployment too.
    pub fn is_own(&self, attribute: &str) -> bool {
        self.is_entry(attribute)
            || self.0.prefixes.iter().any(|p| attribute.starts_with(p.as_str()))
            || self.0.exact.iter().any(|a| a == attribute)
    }

    /// Whether an attribute is one of this namespace's entries, compact or older.
    pub fn is_entry(&self, attribute: &str) -> bool {
        let compact =
            attribute.strip_prefix("_agg").and_then(|r| r.strip_prefix(self.0.namespace.as_str())).is_some_and(|r| r.starts_with('.'));
        let named = attribute
            .strip_prefix(ENTRY_PREFIX)
            .and_then(|r| r.strip_prefix(self.0.namespace.as_str()))
            .is_some_and(|r| r.starts_with(':'));
        compact || named
    }
}

/// Whether an attribute is a ledger entry of any namespace or version.
pub fn is_any_entry(attribute: &str) -> bool {
    attribute.starts_with(ENTRY_PREFIX) || compact_parts(attribute).is_some()
}

/// (namespace, packed shard) of a compact entry name.
fn compact_parts(name: &str) -> Option<(&str, &str)> {
    let (ns, tag) = name.strip_prefix("_agg")?.split_once('.')?;
    (check_namespace(ns).is_ok() && !tag.is_empty()).then_some((ns, tag))
}

/// A shard id packed for an entry name: its creation time (7 digits of 6 bits) and its 8 hex
/// digits (6 digits) when it has the usual form `shardId-<20 digits>-<8 hex>`, else `~` and the
/// id without `shardId-`.
pub fn shard_tag(shard_id: &str) -> String {
    let suffix = crate::shard_id::suffix(shard_id);
    let packed = suffix.split_once('-').and_then(|(ms, hex)| {
        let created: u64 = ms.parse().ok().filter(|c| *c < 1 << 42)?;
        let low = u32::from_str_radix(hex, 16).ok()?;
        // Only what unpacks to the very same text.
        (format!("{created:020}-{low:08x}") == suffix).then(|| {
            let mut tag = digits(created, 7);
            tag.push_str(&digits(u64::from(low), 6));
            tag
        })
    });
    packed.unwrap_or_else(|| format!("{RAW_SHARD_MARK}{suffix}"))
}

/// `n` in `width` digits of [`DIGITS`], most significant first.
fn digits(n: u64, width: u32) -> String {
    (0..width).rev().map(|i| char::from(DIGITS[((n >> (6 * i)) & 63) as usize])).collect()
}

/// The value of digits of [`DIGITS`]; None for any other character.
fn undigits(text: &str) -> Option<u64> {
    text.bytes().try_fold(0u64, |n, b| Some((n << 6) | DIGITS.iter().position(|d| *d == b)? as u64))
}

/// The shard id (without `shardId-`) a packed tag stands for.
fn untag(tag: &str) -> Option<String> {
    if let Some(raw) = tag.strip_prefix(RAW_SHARD_MARK) {
        return Some(raw.to_string());
    }
    if tag.len() != 13 || !tag.is_ascii() {
        return None;
    }
    let (created, low) = (undigits(&tag[..7])?, undigits(&tag[7..])?);
    Some(format!("{created:020}-{low:08x}"))
}

/// A sequence number (decimal digits, padded or not) as a compact entry value: one length byte,
/// then its big-endian bytes without leading zeros, so byte order is numeric order. None for
/// anything but 1 to 40 digits.
pub fn encode_sequence(seq: &str) -> Option<Vec<u8>> {
    let padded = pad_sequence(seq)?;
    let mut decimal: Vec<u32> = padded.bytes().map(|b| u32::from(b - b'0')).skip_while(|d| *d == 0).collect();
    let mut bytes = Vec::new();
    while !decimal.is_empty() {
        let mut rest = 0u32;
        let mut quotient = Vec::with_capacity(decimal.len());
        for d in &decimal {
            let current = rest * 10 + d;
            if !(quotient.is_empty() && current < 256) {
                quotient.push(current / 256);
            }
            rest = current % 256;
        }
        bytes.push(rest as u8);
        decimal = quotient;
    }
    bytes.push(bytes.len() as u8);
    bytes.reverse();
    Some(bytes)
}

/// The padded sequence number of a compact entry value; None if it is not one.
pub fn decode_sequence(value: &[u8]) -> Option<String> {
    let (len, bytes) = value.split_first()?;
    if usize::from(*len) != bytes.len() || bytes.len() > 17 {
        return None;
    }
    let mut decimal: Vec<u32> = vec![0];
    for b in bytes {
        let mut carry = u32::from(*b);
        for d in decimal.iter_mut().rev() {
            let v = *d * 256 + carry;
            *d = v % 10;
            carry = v / 10;
        }
        while carry > 0 {
            decimal.insert(0, carry % 10);
            carry /= 10;
        }
    }
    let text: String = decimal.iter().filter_map(|d| char::from_digit(*d, 10)).collect();
    pad_sequence(&text)
}

/// The highest sequence number an item's entries for one shard say is applied (padded): its
/// compact entry and the string entries of earlier versions.
pub fn applied_of<'a>(compact: Option<&[u8]>, older: impl IntoIterator<Item = Option<&'a str>>) -> Option<String> {
    let older = older.into_iter().flatten().map(|v| entry_sequence(v).to_string());
    compact.and_then(decode_sequence).into_iter().chain(older).max()
}

/// A pre-namespace entry name, `_agg:<shard>` (items written before namespaces).
pub fn entry_name(shard_id: &str) -> String {
    format!("{ENTRY_PREFIX}{}", crate::shard_id::suffix(shard_id))
}

/// A sequence number zero-padded to 40 digits; None if it is not 1 to 40 digits.
pub fn pad_sequence(seq: &str) -> Option<String> {
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = seq.trim_start_matches('0');
    (trimmed.len() <= SEQUENCE_WIDTH).then(|| format!("{trimmed:0>SEQUENCE_WIDTH$}"))
}

/// The shard (id without `shardId-`) an entry name belongs to, compact or older.
pub fn entry_shard(name: &str) -> Option<String> {
    if let Some((_, tag)) = compact_parts(name) {
        return untag(tag);
    }
    name.strip_prefix(ENTRY_PREFIX).map(|r| r.rsplit(':').next().unwrap_or(r).to_string())
}

/// The creation time of the shard an entry belongs to, from its name (without allocating:
/// every write's pruning looks at every entry of the item).
pub fn entry_created_ms(name: &str) -> Option<u64> {
    if let Some((_, tag)) = compact_parts(name) {
        return match tag.strip_prefix(RAW_SHARD_MARK) {
            Some(raw) => suffix_created_ms(raw),
            None if tag.len() == 13 && tag.is_ascii() => undigits(&tag[..7]),
            None => None,
        };
    }
    suffix_created_ms(name.strip_prefix(ENTRY_PREFIX)?.rsplit(':').next()?)
}

/// The padded sequence number of an older (string) entry: `<40 digits>` or `<40 digits>@<time>`.
pub fn entry_sequence(value: &str) -> &str {
    value.split('@').next().unwrap_or(value)
}

/// The floor attribute's value for a shard creation time.
pub fn floor_value(created_ms: u64) -> String {
    format!("{created_ms:020}")
}

/// The straggler set's stored form for shard suffixes: `,a,b,` (`,` when empty), each the
/// shard's creation time in 7 digits of 6 bits, so `contains(set, ",a,")` tests membership in
/// an expression of constant size. Shards created in the same millisecond (a split's children)
/// share a token: the item admits all of them and keeps all their entries, which is safe,
/// because entries are pruned only for creation times neither the floor nor the set admits.
/// Where the finished ones' entries outnumber the open ones, [`prune_for`] lists the open ones
/// by id instead, and the finished ones' entries go.
pub fn open_value(stragglers: &[String]) -> String {
    let tokens: std::collections::BTreeSet<String> = stragglers.iter().map(|x| time_token(x)).collect();
    let mut s = String::from(",");
    for t in tokens {
        s.push_str(&t);
        s.push(',');
    }
    s
}

/// [`open_value`] of `by_time`, followed by the whole ids of `by_id` (stragglers a set written
/// before time tokens admitted by id, kept so).
fn open_value_with_ids(by_time: &[String], by_id: &[String]) -> String {
    let mut s = open_value(by_time);
    for x in by_id {
        s.push_str(crate::shard_id::suffix(x));
        s.push(',');
    }
    s
}

/// A shard's token in a straggler set (without the commas): its creation time, or its whole
/// id when that has none that packs.
fn time_token(shard_id: &str) -> String {
    match suffix_created_ms(crate::shard_id::suffix(shard_id)).filter(|c| *c < 1 << 42) {
        Some(c) => digits(c, 7),
        None => format!("{RAW_SHARD_MARK}{}", crate::shard_id::suffix(shard_id)),
    }
}

/// The tokens a shard looks itself up with in a straggler set: its creation time, and its id
/// as sets written before compact entries held it.
pub fn open_tokens(shard_id: &str) -> [String; 2] {
    [format!(",{},", time_token(shard_id)), format!(",{},", crate::shard_id::suffix(shard_id))]
}

/// Whether an item with this floor and straggler set takes writes from a shard whose floor
/// value is `mine` and whose tokens are `tokens`.
pub fn admits(floor: Option<&str>, open: Option<&str>, mine: &str, tokens: &[String; 2]) -> bool {
    floor.is_none_or(|f| f <= mine) || open.is_some_and(|o| tokens.iter().any(|t| o.contains(t.as_str())))
}

/// Which shards an item may still take writes from, as one replica's lease table shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FloorPlan {
    /// Floor value: every shard created before it is finished, but the stragglers.
    pub floor: String,
    /// Shard suffixes of the open shards created before the floor.
    pub stragglers: Vec<String>,
    /// The floor as a number, and per straggler (in `stragglers`' order) what every write's
    /// pruning asks of it, worked out once.
    floor_ms: u64,
    straggler_info: Vec<Straggler>,
    /// Open stragglers per creation time, and those times in order.
    open_at: std::collections::BTreeMap<u64, usize>,
    times: Vec<u64>,
    /// The stragglers' suffixes, and their packed tags (as compact entry names end).
    suffixes: std::collections::HashSet<String>,
    tags: std::collections::HashSet<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Straggler {
    created: u64,
    /// Its token in a straggler set ([`time_token`]) and its creation time as a floor value.
    token: String,
    floor: String,
}

impl FloorPlan {
    /// A plan with this floor value and these stragglers (shard suffixes).
    pub fn new(floor: String, mut stragglers: Vec<String>) -> FloorPlan {
        let floor_ms = floor.parse().unwrap_or(0);
        // In creation order: an item's stragglers are those created before its own floor.
        stragglers.sort_by_key(|x| (suffix_created_ms(x).unwrap_or(0), x.clone()));
        let straggler_info: Vec<Straggler> = stragglers
            .iter()
            .map(|x| {
                let created = suffix_created_ms(x).unwrap_or(0);
                Straggler { created, token: time_token(x), floor: floor_value(created) }
            })
            .collect();
        let mut open_at = std::collections::BTreeMap::new();
        for s in &straggler_info {
            *open_at.entry(s.created).or_insert(0) += 1;
        }
        let suffixes = stragglers.iter().cloned().collect();
        let tags = stragglers.iter().map(|x| shard_tag(x)).collect();
        let times = open_at.keys().copied().collect();
        FloorPlan { floor, stragglers, floor_ms, straggler_info, open_at, times, suffixes, tags }
    }

    /// Whether an entry (by name) is a straggler's: without allocating for a compact entry
    /// (every write to a global total asks of the entries at the stragglers' times).
    fn holds(&self, entry: &str) -> bool {
        match compact_parts(entry) {
            Some((_, tag)) => self.tags.contains(tag),
            None => entry_shard(entry).is_some_and(|s| self.suffixes.contains(&s)),
        }
    }
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
    // Stragglers are admitted by creation time, so the floor may pass MAX_STRAGGLERS distinct
    // times however many shards share them (a stream's first shards are all created at once).
    let mut times: Vec<u64> = open.iter().map(|(c, _)| *c).collect();
    times.dedup();
    let at = times.len().checked_sub(1)?.min(MAX_STRAGGLERS);
    let floor_ms = times[at].min(known_until_ms);
    let stragglers = open.iter().take_while(|(c, _)| *c < floor_ms).map(|(_, id)| crate::shard_id::suffix(id).to_string()).collect();
    Some(FloorPlan::new(floor_value(floor_ms), stragglers))
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
///
/// A straggler stays admitted by its creation time (one token admits every shard of that
/// millisecond, so their entries stay), except where the entries of that time's finished
/// shards outnumber its open ones (a stream's first shards are created at once and finish one
/// by one): those open ones are then listed by id, and the finished ones' entries go.
pub fn prune_for(plan: &FloorPlan, seen: &Seen, own: &str) -> Option<Prune> {
    // A floor this code did not write (not 20 digits) is compared as text by the write
    // condition but would be read as a number here: prune nothing.
    if seen.floor.as_ref().is_some_and(|f| *f > plan.floor || f.len() != 20 || !f.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    // The entries below the plan's floor (most writes have none but the writer's): finished
    // shards' at times no open shard has, and, per open shard's time, its finished shards'.
    let mut finished: Vec<u64> = Vec::new();
    let mut finished_at: std::collections::BTreeMap<u64, usize> = std::collections::BTreeMap::new();
    for e in seen.entries.iter().filter(|e| e.as_str() != own) {
        let Some(c) = entry_created_ms(e).filter(|c| *c < plan.floor_ms) else { continue };
        if !plan.open_at.contains_key(&c) {
            finished.push(c);
        } else if !plan.holds(e) {
            *finished_at.entry(c).or_insert(0) += 1;
        }
    }
    if finished.is_empty() && finished_at.is_empty() {
        return None;
    }
    finished.sort_unstable();
    let lowest = seen.floor.as_deref().map_or(0, |f| f.parse::<u64>().unwrap_or(plan.floor_ms));
    let plan_floor = item_floor(plan, lowest, &finished, &finished_at);
    // The plan's stragglers created before this item's floor (a prefix: they are in creation
    // order); every one of them stays admitted, whether it wrote this item or not.
    let below = plan.straggler_info.partition_point(|i| i.created < plan_floor);
    let (stragglers, straggler_info) = (&plan.stragglers[..below], &plan.straggler_info[..below]);
    // Keep only stragglers the item admits now: one it refuses was seen finished by someone.
    // (What `admits` decides, with the item's set read once: tokens hold no commas, so
    // `contains(set, ",t,")` is membership.)
    let seen_tokens: std::collections::HashSet<&str> = seen.open.as_deref().unwrap_or("").split(',').filter(|t| !t.is_empty()).collect();
    let by_floor_or_time =
        |i: &Straggler| seen.floor.as_deref().is_none_or(|f| f <= i.floor.as_str()) || seen_tokens.contains(i.token.as_str());
    // Times whose open shards go by id: those the item admits by id only already, and those
    // whose finished shards' entries outnumber them (so the item shrinks: an id token is
    // about as long as an entry).
    let by_id_times: std::collections::BTreeSet<u64> = finished_at
        .iter()
        .filter(|(c, _)| **c < plan_floor)
        .filter(|(c, n)| {
            let outnumbered = plan.open_at.get(c).is_some_and(|open| **n > *open);
            outnumbered || straggler_info.iter().find(|i| i.created == **c).is_some_and(|i| !by_floor_or_time(i))
        })
        .map(|(c, _)| *c)
        .collect();
    // Nothing this floor lets go: no finished shard's entry below it, no time going by id.
    if finished.first().is_none_or(|c| *c >= plan_floor) && by_id_times.is_empty() {
        return None;
    }
    // A straggler the item admits by floor or by its time stays in by its time (every shard of
    // that time is admitted already), unless its time goes by id. One admitted only by its
    // whole id (listed so by an earlier write, or by a set written before time tokens) stays
    // in by its id: its time could re-admit a sibling of the same millisecond whose entry went.
    let (mut by_time, mut by_id): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    for (x, info) in stragglers.iter().zip(straggler_info) {
        let admitted = by_floor_or_time(info);
        if admitted && !by_id_times.contains(&info.created) {
            by_time.push(x.clone());
        } else if admitted || seen_tokens.contains(x.as_str()) {
            by_id.push(x.clone());
        }
    }
    // The creation times the new set admits (entries of shards created then stay), and the
    // shards it admits by id.
    let kept: std::collections::HashSet<u64> = by_time.iter().map(|x| suffix_created_ms(x).unwrap_or(0)).collect();
    let ids: std::collections::HashSet<&str> = by_id.iter().map(String::as_str).collect();
    let entries: Vec<String> = seen
        .entries
        .iter()
        .filter(|e| e.as_str() != own)
        .filter(|e| entry_created_ms(e).is_some_and(|c| c < plan_floor && !kept.contains(&c)))
        .filter(|e| entry_shard(e).is_none_or(|s| !ids.contains(s.as_str())))
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
        floor: floor_value(plan_floor),
        open: open_value_with_ids(&by_time, &by_id),
    })
}

/// The floor an item takes (epoch ms): the plan's, or the creation time of one of the plan's
/// open shards, at or above `lowest` (the item's floor: the admitted set only shrinks),
/// whichever leaves the item smallest; on a tie, the higher. `finished`: the creation times
/// (in order) of the item's entries of finished shards at times no open shard has;
/// `finished_at`: per open shard's time, the item's entries of its finished shards.
///
/// Below the floor, an open shard's time costs a time token and keeps its finished shards'
/// entries, or (where those outnumber its open shards) lists its open shards by id and drops
/// them; at or above it, every finished shard's entry stays.
fn item_floor(plan: &FloorPlan, lowest: u64, finished: &[u64], finished_at: &std::collections::BTreeMap<u64, usize>) -> u64 {
    let siblings = |t: &u64| finished_at.get(t).copied().unwrap_or(0);
    let below_cost = |t: &u64| {
        let (n, open) = (siblings(t), plan.open_at.get(t).copied().unwrap_or(0));
        if n > open {
            open * ID_BYTES
        } else {
            TOKEN_BYTES + n * ENTRY_BYTES
        }
    };
    // Walk the floor down from the plan's: each step moves one open time from below the floor
    // (its token, or ids) to above it (its finished shards' entries kept), and keeps the
    // entries of finished shards created at or after the new floor.
    let mut cost: usize = plan.times.iter().map(below_cost).sum();
    let (mut best, mut best_cost) = (plan.floor_ms, cost);
    for t in plan.times.iter().rev().take_while(|t| **t >= lowest) {
        cost = cost - below_cost(t) + siblings(t) * ENTRY_BYTES;
        let kept = (finished.len() - finished.partition_point(|c| c < t)) * ENTRY_BYTES;
        if cost + kept < best_cost {
            (best, best_cost) = (*t, cost + kept);
        }
    }
    best
}

/// What one conditional write carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// Non-zero summed deltas, by attribute.
    pub adds: Vec<(String, Decimal)>,
    pub first: String,
    pub last: String,
    pub records: usize,
    /// Per source item among the planned records, what it contributes after its last one:
    /// the log a write keeps under a reconcile hold ([`super::hold`]).
    pub logs: Vec<crate::sink::hold::Logged>,
    /// A planned record has no source item id, so it cannot be logged.
    pub unidentified: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("record without a usable sequence number")]
    NoSequence,
    #[error(transparent)]
    Number(#[from] DecimalError),
}

/// An item's latest planned record: (item, its sequence number, its contribution after it).
type Latest<'a> = (&'a std::sync::Arc<str>, String, &'a [(std::sync::Arc<str>, Decimal)]);

/// Sums the contributions after `applied` (a padded sequence number, or None for all).
/// None when every contribution is applied already. Records that cancel out still give a
/// plan (with no adds): its write advances the ledger, so a replica that applied only some
/// of them cannot leave their sum half applied.
pub fn plan(contributions: &[Contribution], applied: Option<&str>) -> Result<Option<WritePlan>, PlanError> {
    let mut adds: Vec<(String, Decimal)> = Vec::new();
    let (mut first, mut last): (Option<String>, Option<String>) = (None, None);
    let mut records = 0;
    // (item, sequence of its latest planned record, its contribution after it)
    let mut logs: Vec<Latest<'_>> = Vec::new();
    let mut unidentified = false;
    for c in contributions {
        let seq = c.sequence.as_deref().and_then(pad_sequence).ok_or(PlanError::NoSequence)?;
        if applied.is_some_and(|a| seq.as_str() <= a) {
            continue;
        }
        records += 1;
        unidentified |= c.item.is_none();
        if let Some(item) = &c.item {
            match logs.iter_mut().find(|(i, _, _)| *i == item) {
                Some(log) if log.1 <= seq => *log = (item, seq.clone(), c.after_values()),
                Some(_) => {}
                None => logs.push((item, seq.clone(), c.after_values())),
            }
        }
        for (name, v) in &c.values {
            match adds.iter_mut().find(|(n, _)| n.as_str() == &**name) {
                Some((_, sum)) => *sum = sum.checked_add(*v)?,
                None => adds.push((name.to_string(), *v)),
            }
        }
        if first.as_ref().is_none_or(|f| seq < *f) {
            first = Some(seq.clone());
        }
        if last.as_ref().is_none_or(|l| seq > *l) {
            last = Some(seq);
        }
    }
    adds.retain(|(_, v)| !v.is_zero());
    adds.sort_by(|a, b| a.0.cmp(&b.0));
    match (first, last) {
        (Some(first), Some(last)) => {
            let logs =
                logs.into_iter().map(|(item, _, after)| (item.clone(), after.iter().map(|(n, v)| (n.to_string(), *v)).collect())).collect();
            Ok(Some(WritePlan { adds, first, last, records, logs, unidentified }))
        }
        _ => Ok(None),
    }
}

/// A value in an expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExprValue {
    /// A string set (never empty: DynamoDB refuses empty sets).
    Ss(Vec<String>),
    S(String),
    B(Vec<u8>),
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

/// Builds the conditional UpdateItem of a write. The condition: this shard's entries (compact,
/// and the two older forms) are absent or below the write's first record; the item admits this
/// shard (floor or straggler set); for a pruning write, the floor and straggler set are still
/// what was seen; and the item holds no reconcile hold, or the very one the write logs under
/// or ends ([`super::hold`]).
pub fn expressions(w: &super::LedgerWrite) -> Expressions {
    let mut names = vec![
        ("#l".to_string(), w.entry_name.clone()),
        ("#k".to_string(), w.named_entry.clone()),
        ("#g".to_string(), w.legacy_entry.clone()),
    ];
    let first = encode_sequence(&w.first).unwrap_or_default();
    let mut values = vec![
        (":l".to_string(), ExprValue::B(w.entry_value.clone())),
        (":fb".to_string(), ExprValue::B(first)),
        (":first".to_string(), ExprValue::S(w.first.clone())),
    ];
    let mut condition = String::from(
        "(attribute_not_exists(#l) OR #l < :fb) AND (attribute_not_exists(#k) OR #k < :first) AND (attribute_not_exists(#g) OR #g < :first)",
    );
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
        let [packed, older] = &f.tokens;
        values.push((":me".into(), ExprValue::S(packed.clone())));
        values.push((":me0".into(), ExprValue::S(older.clone())));
        condition.push_str(" AND (attribute_not_exists(#f) OR #f <= :mine OR contains(#o, :me) OR contains(#o, :me0))");
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
    let mut removes: Vec<String> = Vec::new();
    if let Some(p) = w.prune.as_ref().filter(|p| w.fence.is_some() && !p.entries.is_empty()) {
        for (i, e) in p.entries.iter().enumerate() {
            names.push((format!("#p{i}"), e.clone()));
            removes.push(format!("#p{i}"));
        }
    }
    names.push(("#h".into(), w.ledger.hold_attribute()));
    match &w.hold {
        HoldWrite::Absent => condition.push_str(" AND attribute_not_exists(#h)"),
        HoldWrite::Log { seen, logs } => {
            condition.push_str(" AND #h = :h");
            values.push((":h".into(), ExprValue::S(seen.clone())));
            for (i, (name, value)) in logs.iter().enumerate() {
                sets.push(format!("#y{i} = :y{i}"));
                names.push((format!("#y{i}"), name.clone()));
                values.push((format!(":y{i}"), ExprValue::S(value.clone())));
            }
        }
        HoldWrite::Clear { seen, remove } => {
            condition.push_str(" AND #h = :h");
            values.push((":h".into(), ExprValue::S(seen.clone())));
            removes.push("#h".into());
            for (i, name) in remove.iter().enumerate() {
                names.push((format!("#z{i}"), name.clone()));
                removes.push(format!("#z{i}"));
            }
        }
    }
    if let Some(e) = &w.expiry {
        names.push(("#x".into(), e.attribute.clone()));
        removes.push("#x".into());
    }
    let mut update = format!("ADD {} ", adds.join(", "));
    update.push_str("SET ");
    update.push_str(&sets.join(", "));
    if !removes.is_empty() {
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
            values: crate::rules::values_of(values.iter().map(|(n, v)| (n, Decimal::parse(v).unwrap()))),
            ..Default::default()
        }
    }

    #[test]
    fn a_namespace_owns_its_reserved_names_and_no_others() {
        let (ours, theirs) = (Ledger::new("ns"), Ledger::new("ns2"));
        let d = ours.derivation_names();
        let names = [
            ours.entry_name("shardId-00000001764460800000-0000000a"),
            ours.named_entry("shardId-00000001764460800000-0000000a"),
            ours.version_attribute(),
            ours.floor_attribute(),
            ours.open_attribute(),
            ours.measures_attribute(),
            ours.hold_attribute(),
            ours.fold_attribute(),
            format!("{}orders_max", d.counters),
            format!("{}orders_max", d.cursors),
            format!("{}uniq", d.counts),
            format!("{}uniq", d.walked),
            format!("{}h1:item", ours.log_prefix()),
        ];
        for n in &names {
            assert!(ours.is_own(n), "{n}");
            assert!(!theirs.is_own(n), "{n} is not ns2's");
        }
        assert_eq!(
            (ours.version_name(), ours.floor_name(), ours.measures_name(), ours.hold_name(), ours.log_prefix_name()),
            ("_aggv:ns", "_aggfloor:ns", "_aggm:ns", "_agghold:ns", "_agglog:ns:")
        );
        assert!(!ours.is_own("_aggv:ns:x") && !ours.is_own("orders") && !ours.is_own("_aggvx"));
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
        assert_eq!(decode_sequence(&encode_sequence(&all.last).unwrap()), Some(all.last.clone()));
        assert_eq!(entry_sequence(&format!("{}@1764460800", all.last)), all.last, "an older entry's time is not its number");
        assert_eq!(entry_name("shardId-00000001796001337266-8e340a17"), "_agg:00000001796001337266-8e340a17");
    }

    #[test]
    fn compact_values_order_like_the_numbers_they_stand_for() {
        // Byte order of the encoded values is DynamoDB's order for B attributes.
        let numbers = ["1", "9", "10", "255", "256", "65535", "65536", "300000000000000499659", "4421584500000000017450439091"];
        let forty = "9".repeat(40);
        let mut all: Vec<&str> = numbers.to_vec();
        all.push(&forty);
        for w in all.windows(2) {
            let (a, b) = (encode_sequence(w[0]).unwrap(), encode_sequence(w[1]).unwrap());
            assert!(a < b, "{} < {}", w[0], w[1]);
        }
        for n in &all {
            assert_eq!(decode_sequence(&encode_sequence(n).unwrap()), pad_sequence(n), "{n}");
        }
        assert_eq!(encode_sequence("000000000000000000001"), encode_sequence("1"), "padding does not change the value");
        assert_eq!(encode_sequence(&forty).unwrap().len(), 18, "40 digits fit 17 bytes");
        assert_eq!(encode_sequence("4421584500000000017450439091").unwrap().len(), 13, "a 28-digit AWS number: 13 bytes");
        assert_eq!(encode_sequence(&"9".repeat(41)), None);
        assert_eq!(encode_sequence("12a"), None);
        // Random pairs keep their order too.
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2000 {
            let (a, b) = (rng.u128(..) >> rng.u32(0..127), rng.u128(..) >> rng.u32(0..127));
            let (ea, eb) = (encode_sequence(&a.to_string()).unwrap(), encode_sequence(&b.to_string()).unwrap());
            assert_eq!(a.cmp(&b), ea.cmp(&eb), "{a} vs {b}");
            assert_eq!(decode_sequence(&ea).unwrap().trim_start_matches('0'), a.to_string().trim_start_matches('0'));
        }
        assert_eq!(decode_sequence(&[3, 1]), None, "a length that does not match is no value");
        assert_eq!(decode_sequence(&[]), None);
    }

    #[test]
    fn compact_names_pack_a_shard_into_13_characters() {
        let l = Ledger::new("a1b2c3");
        let shard = "shardId-00000001796001337266-8e340a17";
        let name = l.entry_name(shard);
        assert_eq!(name.len(), "_agga1b2c3.".len() + 13, "{name}");
        assert!(l.is_entry(&name) && is_any_entry(&name));
        assert_eq!(entry_shard(&name).as_deref(), Some("00000001796001337266-8e340a17"));
        assert_eq!(entry_created_ms(&name), Some(1_796_001_337_266));
        // Older forms are entries of the namespace too, and parse the same.
        let named = l.named_entry(shard);
        assert_eq!(named, "_agg:a1b2c3:00000001796001337266-8e340a17");
        assert!(l.is_entry(&named) && is_any_entry(&named));
        assert_eq!(entry_shard(&named), entry_shard(&name));
        // An id of another form is kept whole.
        for odd in ["shardId-1-ab", "odd", "shardId-00000001796001337266-8E340A17", "shardId-99999999999999999999-00000000"] {
            let n = l.entry_name(odd);
            assert!(n.contains('~'), "{n}");
            assert_eq!(entry_shard(&n).as_deref(), Some(crate::shard_id::suffix(odd)));
        }
        // Other namespaces and the ledger's other attributes are not this namespace's entries.
        let other = Ledger::new("a1b2c");
        assert!(!other.is_entry(&name) && !l.is_entry(&other.entry_name(shard)));
        for a in [l.floor_attribute(), l.open_attribute(), l.version_attribute(), l.measures_attribute()] {
            assert!(!l.is_entry(&a) && !is_any_entry(&a), "{a}");
        }
        // Distinct shards, distinct names.
        let names: std::collections::BTreeSet<String> = (0..500u64)
            .map(|i| l.entry_name(&format!("shardId-{:020}-{:08x}", 1_796_001_337_266 + i / 7, i * 2_654_435_761 % (1 << 32))))
            .collect();
        assert_eq!(names.len(), 500);
    }

    #[test]
    fn shards_created_at_once_do_not_hold_the_floor() {
        // A new stream's 200 first shards share one creation time, and more of their children
        // are open than the plan passes. The floor passes the first shards' time.
        let mut open: Vec<String> = (0..200).map(|i| id(1000, i)).collect();
        open.extend((0..MAX_STRAGGLERS as u64 + 30).map(|i| id(2000 + i, 1000 + i as u32)));
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        assert_eq!(plan.floor, floor_value(2000 + MAX_STRAGGLERS as u64 - 1));
        assert_eq!(plan.stragglers.len(), 200 + MAX_STRAGGLERS - 1);
        assert_eq!(open_value(&plan.stragglers).len(), 1 + 8 * MAX_STRAGGLERS, "one token per time");
        for o in &open {
            assert!(admits(
                Some(&plan.floor),
                Some(&open_value(&plan.stragglers)),
                &floor_value(crate::shard_id::created_ms(o).unwrap()),
                &open_tokens(o)
            ));
        }
    }

    #[test]
    fn open_shards_of_a_mostly_finished_creation_time_are_kept_by_id() {
        // A stream's first six shards share one creation time; four finished, two are open.
        // Their time admits all six, so it goes: the two open ones are listed by id and the
        // four finished ones' entries are pruned.
        let l = Ledger::new("ns");
        let roots: Vec<String> = (0..6).map(|i| id(1000, i)).collect();
        let own = id(2000, 9);
        let name = |x: &String| l.entry_name(x);
        let suffix = |x: &String| crate::shard_id::suffix(x).to_string();
        let plan = FloorPlan::new(floor_value(1500), vec![suffix(&roots[0]), suffix(&roots[1])]);
        let entries: Vec<String> = roots.iter().chain([&own]).map(name).collect();
        let seen = Seen { entries, floor: None, open: None };
        let p = prune_for(&plan, &seen, &name(&own)).unwrap();
        assert_eq!(p.entries, roots[2..].iter().map(name).collect::<Vec<_>>());
        assert_eq!(p.open, format!(",{},{},", suffix(&roots[0]), suffix(&roots[1])), "by id, no time token");
        let mine = floor_value(1000);
        assert!(roots[..2].iter().all(|r| admits(Some(&p.floor), Some(&p.open), &mine, &open_tokens(r))));
        assert!(roots[2..].iter().all(|r| !admits(Some(&p.floor), Some(&p.open), &mine, &open_tokens(r))), "finished roots refused");
        // Root 0 finishes: its entry goes, root 1 stays by id (its time would re-admit roots
        // 2 to 5), although one finished entry no longer outnumbers one open shard.
        let seen = Seen { entries: vec![name(&roots[0]), name(&roots[1]), name(&own)], floor: Some(p.floor.clone()), open: Some(p.open) };
        let later = FloorPlan::new(floor_value(1500), vec![suffix(&roots[1])]);
        let q = prune_for(&later, &seen, &name(&own)).unwrap();
        assert_eq!((q.entries, q.open.clone()), (vec![name(&roots[0])], format!(",{},", suffix(&roots[1]))));
        // A stale plan that still holds root 0 open never brings it (or the time) back.
        let seen =
            Seen { entries: vec![name(&roots[1]), name(&id(1200, 7)), name(&own)], floor: Some(q.floor), open: Some(q.open.clone()) };
        let r = prune_for(&plan, &seen, &name(&own)).unwrap();
        assert_eq!((r.entries, r.open), (vec![name(&id(1200, 7))], q.open));
        // Two open and one finished: the time stays (an id costs about what an entry does).
        let plan = FloorPlan::new(floor_value(1500), vec![suffix(&roots[0]), suffix(&roots[1])]);
        let seen = Seen { entries: [&roots[0], &roots[1], &roots[2], &own].map(name).to_vec(), floor: None, open: None };
        assert_eq!(prune_for(&plan, &seen, &name(&own)), None);
    }

    #[test]
    fn split_children_created_in_one_millisecond_share_a_straggler_token_safely() {
        // Children 7a (finished) and 7b (open) of one split were created at the same time; 7b
        // is a straggler. The set admits both, so 7a's entry must stay until the time leaves it.
        let l = Ledger::new("ns");
        let (a, b, own) = (id(7, 0xa), id(7, 0xb), id(900, 1));
        let plan = FloorPlan::new(floor_value(800), vec![crate::shard_id::suffix(&b).to_string()]);
        let seen = Seen { entries: vec![l.entry_name(&a), l.entry_name(&b), l.entry_name(&own)], floor: None, open: None };
        assert_eq!(prune_for(&plan, &seen, &l.entry_name(&own)), None, "nothing prunable: both children are admitted");
        let open = open_value(&plan.stragglers);
        assert_eq!(open.len(), 9, "one 7-digit token: {open}");
        assert!(admits(Some(&plan.floor), Some(&open), &floor_value(7), &open_tokens(&a)));
        // 7b finishes: the next plan drops the time, and both entries go with it.
        let later = FloorPlan::new(floor_value(850), vec![]);
        let seen = Seen { floor: Some(plan.floor.clone()), open: Some(open), ..seen };
        let p = prune_for(&later, &seen, &l.entry_name(&own)).unwrap();
        assert_eq!(p.entries, vec![l.entry_name(&a), l.entry_name(&b)]);
        assert!(!admits(Some(&p.floor), Some(&p.open), &floor_value(7), &open_tokens(&a)));
        // A stale plan that still holds 7b cannot bring the time back once the item refuses it.
        let seen = Seen { entries: vec![l.entry_name(&own)], floor: Some(p.floor.clone()), open: Some(p.open.clone()) };
        let stale = FloorPlan::new(floor_value(900), vec![crate::shard_id::suffix(&b).to_string()]);
        assert_eq!(prune_for(&stale, &seen, &l.entry_name(&own)), None);
        let seen = Seen { entries: vec![l.entry_name(&id(880, 2)), l.entry_name(&own)], ..seen };
        assert_eq!(prune_for(&stale, &seen, &l.entry_name(&own)).unwrap().open, ",");
    }

    #[test]
    fn a_straggler_set_of_the_previous_format_never_readmits_a_pruned_sibling() {
        // Before time tokens: children x (finished, entry pruned) and y (open) of one split were
        // created at 7; the item kept y by id and refuses x. The first pruning write now must
        // not turn y into time 7's token, which would admit x again.
        let l = Ledger::new("ns");
        let (x, y, own, done) = (id(7, 0xa), id(7, 0xb), id(900, 1), id(20, 2));
        let older = format!(",{},", crate::shard_id::suffix(&y));
        assert!(!admits(Some(&floor_value(10)), Some(&older), &floor_value(7), &open_tokens(&x)));
        let plan = FloorPlan::new(floor_value(800), vec![crate::shard_id::suffix(&y).to_string()]);
        let seen = Seen {
            entries: vec![l.entry_name(&done), l.entry_name(&y), l.entry_name(&own)],
            floor: Some(floor_value(10)),
            open: Some(older),
        };
        let p = prune_for(&plan, &seen, &l.entry_name(&own)).unwrap();
        assert_eq!(p.entries, vec![l.entry_name(&done)], "y's entry stays");
        assert!(admits(Some(&p.floor), Some(&p.open), &floor_value(7), &open_tokens(&y)), "y still admitted: {}", p.open);
        assert!(!admits(Some(&p.floor), Some(&p.open), &floor_value(7), &open_tokens(&x)), "x stays refused: {}", p.open);
    }

    #[test]
    fn two_hundred_open_shards_fit_in_8_kb() {
        // A global daily total written from every shard of a 200-partition stream, with AWS-sized
        // (28-digit) sequence numbers: the entries alone.
        let l = Ledger::new(&default_namespace("ddb-aggregator-state"));
        let bytes: usize = (0..200u64)
            .map(|i| {
                let name =
                    l.entry_name(&format!("shardId-{:020}-{:08x}", 1_796_001_337_266 + i * 72_000, 0x8e34_0a17_u32.wrapping_add(i as u32)));
                name.len() + encode_sequence(&format!("44215845{:020}", i * 1_000_003)).unwrap().len()
            })
            .sum();
        assert!(bytes <= 7_500, "{bytes} bytes");
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
        assert_eq!(entry_shard(&e).as_deref(), Some("0001-aa"));
        assert!(e.starts_with(&a.entry_prefix()));
        assert!(check_namespace("prod-eu_1").is_ok());
        assert!(check_namespace("").is_err() && check_namespace("a:b").is_err() && check_namespace(&"x".repeat(17)).is_err());
    }

    #[test]
    fn one_slow_shard_does_not_hold_the_floor_back() {
        // More open shards than the plan passes, created one per millisecond from 1000, and one
        // slow shard created at 10 still open.
        let mut open: Vec<String> = (0..MAX_STRAGGLERS as u64 + 100).map(|i| id(1000 + i, i as u32)).collect();
        open.push(id(10, 999));
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        assert_eq!(plan.floor, floor_value(1000 + MAX_STRAGGLERS as u64 - 1), "the floor passes the slow shard");
        assert_eq!(plan.stragglers.len(), MAX_STRAGGLERS);
        assert!(plan.stragglers.contains(&crate::shard_id::suffix(&id(10, 999)).to_string()));
        // Every open shard stays admitted; a finished one created before the floor does not.
        let open_set = open_value(&plan.stragglers);
        for o in &open {
            let mine = floor_value(crate::shard_id::created_ms(o).unwrap());
            assert!(admits(Some(&plan.floor), Some(&open_set), &mine, &open_tokens(o)), "{o}");
        }
        assert!(!admits(Some(&plan.floor), Some(&open_set), &floor_value(500), &open_tokens(&id(500, 5))));
        // A set written before compact entries still admits its stragglers.
        let older_set = format!(",{},", crate::shard_id::suffix(&id(10, 999)));
        assert!(admits(Some(&plan.floor), Some(&older_set), &floor_value(10), &open_tokens(&id(10, 999))));
        assert!(!admits(Some(&plan.floor), Some(&older_set), &floor_value(11), &open_tokens(&id(11, 998))));
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
        let plan = FloorPlan::new(floor_value(5000), vec![crate::shard_id::suffix(&id(3, 3)).to_string()]);
        let seen = Seen { entries, floor: Some(floor_value(2)), open: Some(",".into()) };
        let p = prune_for(&plan, &seen, &own).unwrap();
        assert_eq!(p.entries.len(), MAX_PRUNE_PER_WRITE);
        assert!(!p.entries.contains(&own));
        // Shard 3 was created after the item's floor (2): admitted, so it may stay a straggler.
        assert_eq!(p.open, open_value(&plan.stragglers));
        assert!(!p.entries.contains(&l.entry_name(&id(3, 3))), "a straggler's entry is kept");
        // Shard 1 is refused by the item (created before its floor 2, not a straggler): a stale
        // view that still thinks it open must not admit it again.
        let stale = FloorPlan::new(floor_value(5000), vec![crate::shard_id::suffix(&id(1, 1)).to_string()]);
        assert_eq!(prune_for(&stale, &seen, &own).unwrap().open, ",", "a refused shard is not re-admitted");
        // A plan below the item's floor prunes nothing.
        let behind = Seen { floor: Some(floor_value(6000)), ..seen.clone() };
        assert_eq!(prune_for(&plan, &behind, &own), None);
        // The largest pruning write stays within DynamoDB's 4 KB expression limit.
        let w = super::super::LedgerWrite {
            key: vec![("PK".into(), "SALES#2026-11-30".into()), ("SK".into(), "TOTAL".into())],
            adds: (0..20).map(|i| (format!("m{i}"), Decimal::from_i64(1))).collect(),
            ledger: l.clone(),
            entry_name: own.clone(),
            named_entry: l.named_entry(&id(5000, 1)),
            legacy_entry: entry_name(&id(5000, 1)),
            version_attribute: l.version_attribute(),
            measures_attribute: l.measures_attribute(),
            entry_value: encode_sequence("1").unwrap(),
            first: pad_sequence("1").unwrap(),
            fence: Some(super::super::Fence {
                floor_attribute: l.floor_attribute(),
                open_attribute: l.open_attribute(),
                mine: floor_value(5000),
                tokens: open_tokens(&id(5000, 1)),
            }),
            prune: Some(p),
            hold: HoldWrite::Absent,
            expiry: Some(crate::sink::ExpiryWrite { attribute: "expiresAt".into() }),
        };
        let e = expressions(&w);
        assert!(e.longest() <= MAX_EXPRESSION_BYTES, "{} bytes", e.longest());
        assert!(e.update.contains(" REMOVE #p0,") && e.condition.contains("#f = :sf AND #o = :so"), "{e:?}");
    }
}

/// The per-item floor: what it chooses, and a property check of [`prune_for`] against the
/// rules the model checks (the floor never drops, no open shard is refused, no entry goes
/// whose shard the item still admits).
#[cfg(test)]
mod floor_tests {
    use super::*;
    use proptest::prelude::*;

    fn id(created: u64, n: u32) -> String {
        format!("shardId-{created:020}-{n:08x}")
    }

    #[test]
    fn an_item_written_by_few_shards_takes_a_floor_that_needs_no_tokens() {
        // 300 open shards created at 1000..1300 (another partition's chain); the item holds
        // the entries of two finished shards of long ago and its writer's.
        let l = Ledger::new("ns");
        let open: Vec<String> = (0..300).map(|i| id(1000 + i, i as u32)).collect();
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        assert_eq!(plan.floor, floor_value(1299));
        let (old, older, own) = (id(600, 1), id(500, 2), id(1250, 250));
        let seen = Seen { entries: [&older, &old, &own].map(|x| l.entry_name(x)).to_vec(), floor: None, open: None };
        let p = prune_for(&plan, &seen, &l.entry_name(&own)).unwrap();
        assert_eq!((p.floor.as_str(), p.open.as_str()), (floor_value(1000).as_str(), ","), "no token: 299 would cost 2.4 KB");
        assert_eq!(p.entries, vec![l.entry_name(&older), l.entry_name(&old)]);
        assert!(open.iter().all(|o| admits(
            Some(&p.floor),
            Some(&p.open),
            &floor_value(crate::shard_id::created_ms(o).unwrap()),
            &open_tokens(o)
        )));
    }

    #[test]
    fn a_total_behind_a_chain_of_open_shards_takes_a_floor_above_the_chain() {
        // Ten open shards at 1000, 1010, ..., 1090 (a catch-up's chains) and 30 finished
        // shards' entries in between: nine tokens (72 bytes) instead of 30 entries.
        let l = Ledger::new("ns");
        let mut open: Vec<String> = (0..10).map(|i| id(1000 + 10 * i, i as u32)).collect();
        let own = id(1100, 99);
        open.push(own.clone());
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        let finished: Vec<String> = (0..30).map(|i| id(1001 + 3 * i, 100 + i as u32)).collect();
        let seen = Seen { entries: finished.iter().chain([&own]).map(|x| l.entry_name(x)).collect(), floor: None, open: None };
        let p = prune_for(&plan, &seen, &l.entry_name(&own)).unwrap();
        assert_eq!(p.floor, floor_value(1090), "the 1090 shard's token (8 bytes) is kept by its own floor");
        assert_eq!(p.open.matches(',').count(), 10, "nine time tokens: {}", p.open);
        assert_eq!(p.entries.len(), 27, "three share an open shard's millisecond (1010, 1040, 1070): its token admits them");
        // An item whose floor is 1050 already cannot go below it.
        let seen = Seen { floor: Some(floor_value(1050)), open: Some(",".into()), ..seen };
        let q = prune_for(&plan, &seen, &l.entry_name(&own)).unwrap();
        assert!(q.floor >= floor_value(1050), "{}", q.floor);
    }

    /// DynamoDB's limits at the worst: more open creation times than a plan passes, each with
    /// finished shards in between. The set is a value (not part of the 4 KB expression), at
    /// most a token per time the plan passes, and smaller than the entries it lets go; one
    /// write removes at most MAX_PRUNE_PER_WRITE entries.
    #[test]
    fn the_largest_straggler_set_stays_within_its_bound() {
        let l = Ledger::new("ns");
        let open: Vec<String> = (0..MAX_STRAGGLERS as u64 + 100).map(|i| id(10_000 + 10 * i, i as u32)).collect();
        let own = open[MAX_STRAGGLERS + 50].clone();
        let plan = floor_plan(open.iter().map(String::as_str), u64::MAX).unwrap();
        let finished: Vec<String> = (0..3 * MAX_STRAGGLERS as u64).map(|i| id(10_001 + 10 * (i / 3) + i % 3, 100_000 + i as u32)).collect();
        let seen = Seen { entries: finished.iter().chain([&own]).map(|x| l.entry_name(x)).collect(), floor: None, open: None };
        let p = prune_for(&plan, &seen, &l.entry_name(&own)).unwrap();
        assert_eq!(p.floor, plan.floor, "3 entries between each pair of times: every token pays for itself");
        assert_eq!(p.open.len(), 1 + TOKEN_BYTES * MAX_STRAGGLERS);
        assert!(p.open.len() < finished.len() * ENTRY_BYTES / 10);
        assert_eq!(p.entries.len(), MAX_PRUNE_PER_WRITE);
    }

    /// A floor this code did not write (not 20 digits) is not read as a number: nothing is
    /// pruned, so no shard the write condition refuses as text is admitted again.
    #[test]
    fn a_floor_of_another_form_prunes_nothing() {
        let l = Ledger::new("ns");
        let (open, finished, own) = (id(500, 1), id(400, 2), id(1500, 3));
        let plan = floor_plan([open.as_str(), own.as_str()], u64::MAX).unwrap();
        let entries = vec![l.entry_name(&finished), l.entry_name(&own)];
        let seen = Seen { entries, floor: Some("00000000000000001".into()), open: Some(",".into()) };
        assert_eq!(prune_for(&plan, &seen, &l.entry_name(&own)), None);
        let seen = Seen { floor: Some(floor_value(1)), ..seen };
        assert!(prune_for(&plan, &seen, &l.entry_name(&own)).is_some(), "the same floor in 20 digits");
    }

    /// Shards 0..n: creation times, which are open now, which were open when an earlier
    /// prune ran (a superset), which wrote the item, the writer.
    type Case = (Vec<u64>, Vec<bool>, Vec<bool>, Vec<bool>, usize);

    fn case() -> impl Strategy<Value = Case> {
        (2usize..40).prop_flat_map(|n| {
            (
                prop::collection::vec(1000u64..1060, n),
                prop::collection::vec(any::<bool>(), n),
                prop::collection::vec(any::<bool>(), n),
                prop::collection::vec(any::<bool>(), n),
                0..n,
            )
        })
    }

    /// Checks one prune against the rules; returns the item as it leaves it.
    fn check(l: &Ledger, ids: &[String], unfinished: &[&str], seen: &Seen, p: &Prune, own: &str) -> Result<Seen, TestCaseError> {
        let created = |x: &str| floor_value(crate::shard_id::created_ms(x).unwrap());
        let before = |x: &str| admits(seen.floor.as_deref(), seen.open.as_deref(), &created(x), &open_tokens(x));
        let after = |x: &str| admits(Some(&p.floor), Some(&p.open), &created(x), &open_tokens(x));
        prop_assert!(seen.floor.as_ref().is_none_or(|f| p.floor >= *f), "the floor dropped");
        for u in unfinished {
            prop_assert!(!before(u) || after(u), "open shard {} refused: {:?}", u, p);
        }
        for x in ids {
            prop_assert!(before(x) || !after(x), "{} admitted again: {:?}", x, p);
        }
        for e in &p.entries {
            let shard = ids.iter().find(|x| l.entry_name(x) == *e).unwrap();
            prop_assert!(!unfinished.contains(&shard.as_str()), "an open shard's entry went: {}", shard);
            prop_assert!(!after(shard), "{} is still admitted after its entry went", shard);
            prop_assert!(*e != l.entry_name(own));
        }
        let entries = seen.entries.iter().filter(|e| !p.entries.contains(e)).cloned().collect();
        Ok(Seen { entries, floor: Some(p.floor.clone()), open: Some(p.open.clone()) })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Two prunes in a row, the first from an older view (more shards open), as two
        /// replicas' writes land: neither refuses an open shard, re-admits a refused one, or
        /// drops an entry its shard is still admitted with.
        #[test]
        fn a_prune_never_refuses_an_open_shard_nor_drops_an_admitted_entry((times, open, was_open, wrote, writer) in case()) {
            let l = Ledger::new("ns");
            let ids: Vec<String> = times.iter().enumerate().map(|(i, t)| id(*t, i as u32)).collect();
            let own = ids[writer].clone();
            let now: Vec<&str> = (0..ids.len()).filter(|i| open[*i] || *i == writer).map(|i| ids[i].as_str()).collect();
            let then: Vec<&str> = (0..ids.len()).filter(|i| open[*i] || was_open[*i] || *i == writer).map(|i| ids[i].as_str()).collect();
            let entries: Vec<String> = (0..ids.len()).filter(|i| wrote[*i] || *i == writer).map(|i| l.entry_name(&ids[i])).collect();
            let mut seen = Seen { entries, floor: None, open: None };
            for unfinished in [&then, &now] {
                let plan = floor_plan(unfinished.iter().copied(), u64::MAX).unwrap();
                if let Some(p) = prune_for(&plan, &seen, &l.entry_name(&own)) {
                    seen = check(&l, &ids, unfinished, &seen, &p, &own)?;
                }
            }
        }
    }
}
