//! Write sharding (DESIGN.md, "Hot targets"): a rule with `write_shards: N` spreads each of its
//! targets over N sub-items, so that no single item takes a write from every shard of the
//! stream. Each stream shard always writes the same sub-item ([`sub_index`]), so a
//! sub-item's ledger holds only the entries of its own shards. The unsuffixed target keeps
//! the total, folded from the sub-items (`crate::reconcile::sharded`).
//!
//! A sub-item's partition key is the target's with [`MARK`] and its index appended
//! (`SALES#2026-11-30#_agg#w3`), so the sub-items land on different partitions. No template
//! can produce a key holding `#_agg#` (a target key that does is poison), so a sub-item never
//! collides with another rule's target.

use super::helper;
use super::TargetKey;

/// What a sub-item's partition key ends with, before its index.
pub const MARK: &str = "#_agg#w";

/// Versioned with the rule's fingerprint: a different mapping is a different rule.
pub const MAPPING: &str = "fnv1a64-mod-v1";

/// The longest suffix a sub-item adds to its target's partition key (`#_agg#w99`).
pub const SUFFIX_MAX_BYTES: usize = MARK.len() + 2;

/// Fewest and most sub-items a target may have.
pub const MIN_SHARDS: u16 = 2;
pub const MAX_SHARDS: u16 = 100;

/// The sub-item a stream shard writes: FNV-1a of its id, modulo `n` (fixed: changing it
/// would move a shard's writes to a sub-item whose ledger never saw it).
pub fn sub_index(shard_id: &str, n: u16) -> u16 {
    let n = u64::from(n.max(1));
    // The remainder is below n, which fits in u16.
    u16::try_from(super::fingerprint::fnv1a(shard_id.as_bytes()) % n).unwrap_or(0)
}

/// The key of sub-item `i` of `target`.
pub fn sub_key(target: &TargetKey, i: u16) -> TargetKey {
    let mut parts = target.0.to_vec();
    if let Some(pk) = parts.first_mut() {
        *pk = format!("{pk}{MARK}{i}").into_boxed_str();
    }
    TargetKey(parts.into_boxed_slice())
}

/// Every sub-item of `target`, in index order.
pub fn sub_keys(target: &TargetKey, n: u16) -> Vec<TargetKey> {
    (0..n).map(|i| sub_key(target, i)).collect()
}

/// The target and index of a sub-item's key; None for any other key.
pub fn parse(key: &TargetKey) -> Option<(TargetKey, u16)> {
    let pk = key.0.first()?;
    let at = pk.rfind(MARK)?;
    let digits = &pk[at + MARK.len()..];
    if digits.is_empty() || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit()) || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    let i: u16 = digits.parse().ok()?;
    let owner = &pk[..at];
    if owner.is_empty() || owner.contains(helper::MARK) {
        return None;
    }
    let mut parts = key.0.to_vec();
    parts[0] = Box::from(owner);
    Some((TargetKey(parts.into_boxed_slice()), i))
}

/// The target a key stands for: a sub-item's target, else the key itself.
pub fn unsharded(key: &TargetKey) -> TargetKey {
    parse(key).map_or_else(|| key.clone(), |(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(parts: &[&str]) -> TargetKey {
        TargetKey(parts.iter().map(|p| Box::from(*p)).collect())
    }

    #[test]
    fn a_sub_item_key_parses_back_to_its_target_and_index() {
        let t = key(&["SALES#2026-11-30", "TOTAL"]);
        for i in [0, 7, 15, 99] {
            let s = sub_key(&t, i);
            assert_eq!(s, key(&[&format!("SALES#2026-11-30#_agg#w{i}"), "TOTAL"]));
            assert_eq!(parse(&s), Some((t.clone(), i)));
            assert_eq!(unsharded(&s), t);
        }
        assert_eq!(sub_keys(&t, 3).len(), 3);
        for other in [
            key(&["SALES#2026-11-30", "TOTAL"]),
            key(&["SALES#_agg#w", "TOTAL"]),
            key(&["SALES#_agg#w01", "TOTAL"]),
            key(&["SALES#_agg#w1x", "TOTAL"]),
            key(&["#_agg#w1", "TOTAL"]),
            key(&["SALES#_agg#w1000", "TOTAL"]),
        ] {
            assert_eq!(parse(&other), None, "{other:?}");
        }
    }

    /// The mapping is fixed (a release that changed it would send a shard's writes to a
    /// sub-item whose ledger never saw that shard), and it spreads real shard ids.
    #[test]
    fn the_mapping_is_fixed_and_spreads_shard_ids() {
        assert_eq!(sub_index("shardId-00000001700000000000-00000001", 16), sub_index("shardId-00000001700000000000-00000001", 16));
        assert_eq!(super::super::fingerprint::fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c, "FNV-1a 64 as published");
        let mut seen = [0u32; 16];
        for s in 0..1600u32 {
            let i = sub_index(&format!("shardId-00000001700000000000-{s:08x}"), 16);
            seen[usize::from(i)] += 1;
        }
        assert!(seen.iter().all(|n| (60..=140).contains(n)), "1,600 shards over 16 sub-items: {seen:?}");
        assert_eq!(sub_index("x", 1), 0);
        assert_eq!(sub_index("x", 0), 0, "never a division by zero");
    }
}
