//! DynamoDB Streams shard ids (pure). Both the stream reader and the ledger on target items
//! need a shard's creation time, so it lives here rather than in either of them.

/// The creation time embedded in a DynamoDB Streams shard id
/// (`shardId-00000001796001337266-8e340a17`: epoch milliseconds), if it has one.
pub fn created_ms(shard_id: &str) -> Option<u64> {
    suffix_created_ms(shard_id.strip_prefix("shardId-")?)
}

/// [`created_ms`] of a shard id without its `shardId-` prefix (`<digits>-<hex>`).
pub fn suffix_created_ms(suffix: &str) -> Option<u64> {
    let digits = suffix.split('-').next()?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The part of a shard id that names it in ledger entries (`shardId-` dropped).
pub fn suffix(shard_id: &str) -> &str {
    shard_id.strip_prefix("shardId-").unwrap_or(shard_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_creation_time() {
        assert_eq!(created_ms("shardId-00000001796001337266-8e340a17"), Some(1_796_001_337_266));
        assert_eq!(created_ms("shardId-x-1"), None);
        assert_eq!(created_ms("other"), None);
        assert_eq!(created_ms("shardId-99999999999999999999999-1"), None, "overflow is None, not a panic");
        assert_eq!(suffix("shardId-0001-ab"), "0001-ab");
        assert_eq!(suffix("odd"), "odd");
    }
}
