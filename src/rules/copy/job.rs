//! Fan-outs too large for a batch (pure): the rest of one source change's fan-out, persisted
//! in the state table as a job (DESIGN.md section 2, "Copies kept in sync").
//!
//! A batch writes the first `copy.inline_items` copies of a change itself. When its query has
//! more, the batch records a job, before its checkpoint moves, with the page the fan-out goes
//! on from; a runner (any replica) claims the job, writes page after page within the rule's
//! capacity budget, moves the job's cursor after each page, and deletes the job at the end.
//! - One job per (rule, source item): a newer change of the source replaces a pending older
//!   one (recording is conditioned on the recorded version being older), and the older one's
//!   runner, whose every step is conditioned on its version, stops at its next step.
//! - A crash loses at most the page in flight: the claim expires, another runner resumes from
//!   the cursor, and the copies' versions skip what was written.
//! - A `to` on a global secondary index reads an eventually consistent index: after its
//!   fan-out ends, the job is recorded again as a follow-up that runs the whole fan-out once
//!   more after `FOLLOW_UP_MS`, so an item the index did not show yet is written then.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::CopyChange;

/// The state table key of every copy job starts with this.
pub const JOB_PREFIX: &str = "copy-job#";
/// How long after a fan-out through a global secondary index it runs again: DynamoDB
/// propagates index updates "usually within a fraction of a second", and a follow-up a few
/// seconds later finds what the first run could not.
pub const FOLLOW_UP_MS: u64 = 5_000;

/// An item key in the table (attribute -> typed value).
pub type Key = BTreeMap<String, Value>;

/// One pending fan-out.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyJob {
    pub rule: String,
    pub change: CopyChange,
    /// The key the next page starts after (None: from the first page).
    pub cursor: Option<Key>,
    /// Copies found so far.
    pub found: u64,
    /// When the job was recorded (epoch ms).
    pub created_ms: u64,
    /// Not run before this (epoch ms).
    pub due_ms: u64,
    /// The re-run after an index's fan-out: schedules no further one.
    pub follow_up: bool,
}

impl CopyJob {
    /// The rest of `change`'s fan-out, from `cursor`, after `found` copies.
    pub fn rest(rule: &str, change: CopyChange, cursor: Key, found: u64, now_ms: u64) -> CopyJob {
        CopyJob { rule: rule.to_string(), change, cursor: Some(cursor), found, created_ms: now_ms, due_ms: now_ms, follow_up: false }
    }

    /// `change`'s fan-out once more, from the start, `FOLLOW_UP_MS` after `now_ms`.
    pub fn follow_up(rule: &str, change: CopyChange, now_ms: u64) -> CopyJob {
        CopyJob {
            rule: rule.to_string(),
            change,
            cursor: None,
            found: 0,
            created_ms: now_ms,
            due_ms: now_ms.saturating_add(FOLLOW_UP_MS),
            follow_up: true,
        }
    }

    pub fn id(&self) -> String {
        job_id(&self.rule, &self.change.source)
    }

    /// The stored form of the change's version (the jobs' order, as the copies').
    pub fn version(&self) -> String {
        self.change.version.text()
    }
}

/// The state table key of rule `rule`'s job for the source item `source`.
pub fn job_id(rule: &str, source: &Key) -> String {
    let text = serde_json::to_string(source).unwrap_or_default();
    let digest = Sha256::digest(text.as_bytes());
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{JOB_PREFIX}{rule}#{hex}")
}

/// A job as listed from the state table, with who runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredJob {
    pub job: CopyJob,
    pub owner: Option<String>,
    /// When the owner's claim lapses (epoch ms).
    pub expires_at_ms: u64,
}

impl StoredJob {
    /// Nobody runs it (never claimed, or the claim lapsed), or `owner` does.
    pub fn free_for(&self, owner: &str, now_ms: u64) -> bool {
        self.owner.as_deref().is_none_or(|o| o == owner) || self.expires_at_ms <= now_ms
    }
}

/// The jobs a replica starts now: due, free for it, not running there already, oldest first,
/// at most `room`; jobs of rules it does not have are left to a replica that has them.
pub fn to_start<'a>(
    jobs: &'a [StoredJob],
    owner: &str,
    running: &BTreeSet<String>,
    rules: &BTreeSet<&str>,
    room: usize,
    now_ms: u64,
) -> Vec<&'a StoredJob> {
    let mut due: Vec<&StoredJob> = jobs
        .iter()
        .filter(|j| j.job.due_ms <= now_ms && j.free_for(owner, now_ms))
        .filter(|j| rules.contains(j.job.rule.as_str()) && !running.contains(&j.job.id()))
        .collect();
    due.sort_by_key(|j| (j.job.due_ms, j.job.created_ms));
    due.truncate(room);
    due
}

/// What the pending jobs amount to: how many, and the age of the oldest (ms; 0 for none).
pub fn pending(jobs: &[StoredJob], now_ms: u64) -> (usize, u64) {
    let oldest = jobs.iter().map(|j| now_ms.saturating_sub(j.job.created_ms)).max().unwrap_or(0);
    (jobs.len(), oldest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::copy::{FindQuery, Version};
    use serde_json::json;

    fn change(customer: &str, seq: &str) -> CopyChange {
        CopyChange {
            source: BTreeMap::from([
                ("PK".to_string(), json!({"S": format!("CUST#{customer}")})),
                ("SK".to_string(), json!({"S": "PROFILE"})),
            ]),
            find: FindQuery { index: None, partition: ("PK".into(), format!("CUST#{customer}")), sort: None },
            set: vec![("customerName".into(), json!({"S": "Ann"}))],
            remove: vec![],
            version: Version::new(1, seq).unwrap_or_else(|e| panic!("{e}")),
            deleted: false,
            snapshot: vec![Some(json!({"S": "Ann"}))],
        }
    }

    fn stored(customer: &str, owner: Option<&str>, expires: u64, created: u64) -> StoredJob {
        let mut job = CopyJob::rest("names", change(customer, "100"), BTreeMap::new(), 0, created);
        job.due_ms = created;
        StoredJob { job, owner: owner.map(str::to_string), expires_at_ms: expires }
    }

    #[test]
    fn one_job_per_rule_and_source_item_whatever_the_change() {
        let a = CopyJob::rest("names", change("c1", "100"), BTreeMap::new(), 0, 0);
        let b = CopyJob::rest("names", change("c1", "200"), BTreeMap::new(), 0, 0);
        let c = CopyJob::rest("names", change("c2", "100"), BTreeMap::new(), 0, 0);
        let d = CopyJob::rest("tiers", change("c1", "100"), BTreeMap::new(), 0, 0);
        assert_eq!(a.id(), b.id());
        assert_ne!(a.id(), c.id());
        assert_ne!(a.id(), d.id());
        assert!(a.id().starts_with("copy-job#names#"));
        assert!(a.version() < b.version());
    }

    #[test]
    fn a_replica_starts_due_free_jobs_of_its_rules_oldest_first_within_its_room() {
        let jobs = vec![
            stored("c1", None, 0, 30),
            stored("c2", Some("other"), 2_000, 10), // held by a live runner
            stored("c3", Some("other"), 500, 20),   // its claim lapsed
            stored("c4", Some("me"), 2_000, 40),    // this replica's own, from before a restart
            stored("c5", None, 0, 5),
        ];
        let rules = BTreeSet::from(["names"]);
        let ids = |v: Vec<&StoredJob>| v.iter().map(|j| j.job.change.find.partition.1.clone()).collect::<Vec<_>>();
        assert_eq!(ids(to_start(&jobs, "me", &BTreeSet::new(), &rules, 10, 1_000)), ["CUST#c5", "CUST#c3", "CUST#c1", "CUST#c4"]);
        assert_eq!(ids(to_start(&jobs, "me", &BTreeSet::new(), &rules, 2, 1_000)), ["CUST#c5", "CUST#c3"]);
        let running = BTreeSet::from([jobs[4].job.id()]);
        assert_eq!(ids(to_start(&jobs, "me", &running, &rules, 2, 1_000)), ["CUST#c3", "CUST#c1"]);
        assert!(to_start(&jobs, "me", &BTreeSet::new(), &BTreeSet::from(["tiers"]), 10, 1_000).is_empty());
    }

    #[test]
    fn a_follow_up_waits_its_delay() {
        let job = CopyJob::follow_up("names", change("c1", "100"), 1_000);
        let jobs = vec![StoredJob { job, owner: None, expires_at_ms: 0 }];
        let rules = BTreeSet::from(["names"]);
        assert!(to_start(&jobs, "me", &BTreeSet::new(), &rules, 1, 1_000 + FOLLOW_UP_MS - 1).is_empty());
        assert_eq!(to_start(&jobs, "me", &BTreeSet::new(), &rules, 1, 1_000 + FOLLOW_UP_MS).len(), 1);
    }

    #[test]
    fn pending_counts_the_jobs_and_ages_the_oldest() {
        let jobs = vec![stored("c1", None, 0, 300), stored("c2", None, 0, 100)];
        assert_eq!(pending(&jobs, 1_000), (2, 900));
        assert_eq!(pending(&[], 1_000), (0, 0));
    }

    #[test]
    fn the_change_survives_its_stored_form() {
        let c = change("c1", "00123");
        let text = serde_json::to_string(&c).unwrap_or_default();
        let back: CopyChange = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(back, c);
        assert!(serde_json::from_str::<CopyChange>(&text.replace("00000000000000000001.", "1.")).is_err());
    }
}
