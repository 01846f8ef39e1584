//! Shard lineage: a child shard is read only after its parent is read to its end and
//! checkpointed. A parent that DescribeStream no longer lists (trimmed after 24 h) does not
//! block its children.

use std::collections::HashSet;

use super::ShardInfo;

/// Shards that may be read now: not finished, and whose parent is finished or gone.
pub fn ready<'a>(shards: &'a [ShardInfo], finished: &dyn Fn(&str) -> bool) -> Vec<&'a ShardInfo> {
    let listed: HashSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
    shards
        .iter()
        .filter(|s| !finished(&s.shard_id))
        .filter(|s| match &s.parent {
            None => true,
            Some(p) => !listed.contains(p.as_str()) || finished(p),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: &str, parent: Option<&str>) -> ShardInfo {
        ShardInfo { shard_id: id.into(), parent: parent.map(Into::into), closed: false }
    }

    #[test]
    fn children_wait_for_parents() {
        let shards = vec![shard("a", None), shard("b", Some("a")), shard("c", Some("a")), shard("d", Some("b")), shard("e", Some("gone"))];
        let ids = |f: &dyn Fn(&str) -> bool| ready(&shards, f).iter().map(|s| s.shard_id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&|_| false), vec!["a", "e"]);
        assert_eq!(ids(&|s| s == "a"), vec!["b", "c", "e"]);
        assert_eq!(ids(&|s| s == "a" || s == "b"), vec!["c", "d", "e"]);
    }
}
