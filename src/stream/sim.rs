//! An in-memory stream for unit tests: shards with parents, splits and rollovers, iterators
//! that can be expired, and trimming that makes old positions unreadable. It also logs which
//! shard each record was read from, so tests can check the reading order.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{json, Value};

use super::{Page, Position, Records, ShardInfo, StreamError, StreamSource};

#[derive(Debug, Default)]
struct SimShard {
    parent: Option<String>,
    /// (sequence number, record as JSON text): text, not a tree, because a long simulation
    /// holds every record of the retention window (a `Value` tree took about 9 KB a record).
    /// Empty once trimmed by retention ([`SimStream::retain_after`]).
    records: Vec<(u64, Box<str>)>,
    /// Records below this index had their text dropped (never readable again).
    freed: usize,
    closed: bool,
    /// When it was closed (epoch ms), for DescribeStream's 24 h memory.
    closed_at: Option<u64>,
    /// Records with index below this are trimmed.
    trimmed: usize,
    /// Append time (epoch ms) of each record, for retention.
    appended: Vec<u64>,
}

#[derive(Debug, Default)]
struct State {
    shards: BTreeMap<String, SimShard>,
    next_seq: u64,
    /// Iterators issued before this generation are expired.
    generation: u64,
    next_shard: u64,
    /// (shard, sequence) in the order GetRecords returned them.
    reads: Vec<(String, u64)>,
    /// GetRecords calls that should fail with throttling before succeeding.
    throttles: u32,
    /// GetRecords calls that answer an empty page though records follow (a stretch of the
    /// shard without records, which AWS documents may take several calls to pass).
    empty_pages: u32,
    /// Runs of empty pages mid-shard, per shard: at a position (the index of the record they
    /// stand before), how many empty pages every iterator chain that reaches it answers
    /// before that record (a stretch of the shard without records: each reader passing it
    /// takes as many calls; a new iterator there takes them again).
    empty_on: BTreeMap<String, BTreeMap<usize, u32>>,
    /// DynamoDB Local's answer to GetRecords on an empty shard: TrimmedDataAccess.
    trimmed_when_empty: bool,
    /// Reading order is not logged (long simulations).
    quiet: bool,
}

#[derive(Debug, Default)]
pub struct SimStream {
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // A test that panicked while holding the lock already failed; keep going for others.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimStream {
    pub fn new() -> SimStream {
        SimStream::default()
    }

    /// A new open shard; ids embed an increasing creation time like real shard ids.
    pub fn add_shard(&self, parent: Option<&str>) -> String {
        let mut s = lock(&self.state);
        s.next_shard += 1;
        let id = format!("shardId-{:020}-{:08x}", 1_700_000_000_000u64 + s.next_shard, s.next_shard);
        s.shards.insert(id.clone(), SimShard { parent: parent.map(str::to_string), ..Default::default() });
        id
    }

    /// A new open shard created at `created_ms` (its id embeds it, as real ids do).
    pub fn add_shard_at(&self, parent: Option<&str>, created_ms: u64) -> String {
        let mut s = lock(&self.state);
        s.next_shard += 1;
        let id = format!("shardId-{created_ms:020}-{:08x}", s.next_shard);
        s.shards.insert(id.clone(), SimShard { parent: parent.map(str::to_string), ..Default::default() });
        id
    }

    /// Sequence numbers from here on start at `first` (real ones are 21 digits or more; the
    /// ledger's entry sizes depend on it).
    pub fn start_sequences_at(&self, first: u64) {
        let mut s = lock(&self.state);
        s.next_seq = s.next_seq.max(first.saturating_sub(1));
    }

    /// The sequence number the next record gets.
    pub fn next_sequence(&self) -> u64 {
        lock(&self.state).next_seq + 1
    }

    /// Appends a record (a stream record JSON; its SequenceNumber is set here). Returns the
    /// sequence number.
    pub fn append(&self, shard: &str, record: Value) -> u64 {
        self.append_at(shard, record, 0)
    }

    /// [`SimStream::append`] at a time (epoch ms), for retention.
    pub fn append_at(&self, shard: &str, mut record: Value, at_ms: u64) -> u64 {
        let mut s = lock(&self.state);
        s.next_seq += 1;
        let seq = s.next_seq;
        record["dynamodb"]["SequenceNumber"] = json!(format!("{seq:021}"));
        if let Some(sh) = s.shards.get_mut(shard) {
            assert!(!sh.closed, "append to a closed shard");
            sh.records.push((seq, record.to_string().into_boxed_str()));
            sh.appended.push(at_ms);
        }
        seq
    }

    pub fn close(&self, shard: &str) {
        self.close_at(shard, 0);
    }

    fn close_at(&self, shard: &str, at_ms: u64) {
        if let Some(sh) = lock(&self.state).shards.get_mut(shard) {
            sh.closed = true;
            sh.closed_at = Some(at_ms);
        }
    }

    /// Closes `shard` at `at_ms` and opens `children` children created then.
    pub fn reshard_at(&self, shard: &str, children: usize, at_ms: u64) -> Vec<String> {
        self.close_at(shard, at_ms);
        (0..children).map(|_| self.add_shard_at(Some(shard), at_ms)).collect()
    }

    /// The stream's retention: records appended before `cutoff_ms` become unreadable, and
    /// shards closed before it leave the listing. Returns the shards forgotten, with whether
    /// each still held records (the simulation's way to see what a reader never reached).
    pub fn retain_after(&self, cutoff_ms: u64) -> Vec<String> {
        let mut s = lock(&self.state);
        for sh in s.shards.values_mut() {
            let n = sh.appended.partition_point(|t| *t < cutoff_ms);
            sh.trimmed = sh.trimmed.max(n);
            // Trimmed for good: their text goes (the positions stay).
            for r in &mut sh.records[sh.freed..sh.trimmed] {
                r.1 = Box::from("");
            }
            sh.freed = sh.trimmed;
        }
        let gone: Vec<String> =
            s.shards.iter().filter(|(_, sh)| sh.closed_at.is_some_and(|c| c < cutoff_ms)).map(|(id, _)| id.clone()).collect();
        for id in &gone {
            s.shards.remove(id);
            s.empty_on.remove(id);
        }
        gone
    }

    /// Stops logging the reading order (memory for long runs).
    pub fn quiet(&self) {
        lock(&self.state).quiet = true;
    }

    /// Shards listed now.
    pub fn shard_count(&self) -> usize {
        lock(&self.state).shards.len()
    }

    /// Sequence number of the last record of `shard`, if it has one.
    pub fn last_sequence(&self, shard: &str) -> Option<u64> {
        lock(&self.state).shards.get(shard).and_then(|sh| sh.records.last().map(|(s, _)| *s))
    }

    /// Closes `shard` and opens two children.
    pub fn split(&self, shard: &str) -> (String, String) {
        self.close(shard);
        (self.add_shard(Some(shard)), self.add_shard(Some(shard)))
    }

    /// Closes `shard` and opens one child (DynamoDB rolls shards over every few hours).
    pub fn rollover(&self, shard: &str) -> String {
        self.close(shard);
        self.add_shard(Some(shard))
    }

    pub fn expire_iterators(&self) {
        lock(&self.state).generation += 1;
    }

    /// Makes the first `n` records of `shard` unreadable (older than retention).
    pub fn trim(&self, shard: &str, n: usize) {
        if let Some(sh) = lock(&self.state).shards.get_mut(shard) {
            sh.trimmed = n.min(sh.records.len()).max(sh.freed);
        }
    }

    /// Removes a shard from the listing (DescribeStream forgets shards after 24 h).
    pub fn forget(&self, shard: &str) {
        let mut s = lock(&self.state);
        s.shards.remove(shard);
        s.empty_on.remove(shard);
    }

    /// From now on GetRecords on a shard without records fails with TrimmedDataAccess, as
    /// DynamoDB Local answers for a TRIM_HORIZON iterator of an empty shard.
    pub fn trimmed_when_empty(&self) {
        lock(&self.state).trimmed_when_empty = true;
    }

    /// The next `n` GetRecords calls that have records to return answer an empty page instead,
    /// with an iterator at the same place.
    pub fn empty_pages_next(&self, n: u32) {
        lock(&self.state).empty_pages = n;
    }

    /// A run of `n` empty pages on `shard` before the next record appended there: every
    /// iterator chain that reaches that record answers `n` empty pages first (added to a run
    /// already there).
    pub fn empty_pages_on(&self, shard: &str, n: u32) {
        let mut s = lock(&self.state);
        let at = s.shards.get(shard).map_or(0, |sh| sh.records.len());
        *s.empty_on.entry(shard.to_string()).or_default().entry(at).or_default() += n;
    }

    /// The pages of the run before `shard`'s next record ([`SimStream::empty_pages_on`]).
    pub fn empty_pages_pending(&self, shard: &str) -> u32 {
        let s = lock(&self.state);
        let at = s.shards.get(shard).map_or(0, |sh| sh.records.len());
        s.empty_on.get(shard).and_then(|runs| runs.get(&at)).copied().unwrap_or(0)
    }

    /// Whether a run stands before `shard`'s next record: one injected now would join it into
    /// one longer run.
    pub fn empty_run_unpassed(&self, shard: &str) -> bool {
        self.empty_pages_pending(shard) > 0
    }

    pub fn throttle_next(&self, n: u32) {
        lock(&self.state).throttles = n;
    }

    /// (shard, sequence) of every record returned so far, in order.
    pub fn reads(&self) -> Vec<(String, u64)> {
        lock(&self.state).reads.clone()
    }
}

fn encode(shard: &str, index: usize, generation: u64) -> String {
    encode_seen(shard, index, generation, 0)
}

/// An iterator that has answered `seen` empty pages of the run at `index`.
fn encode_seen(shard: &str, index: usize, generation: u64, seen: u32) -> String {
    format!("{shard}|{index}|{generation}|{seen}")
}

fn decode(it: &str) -> Option<(String, usize, u64, u32)> {
    let mut p = it.rsplitn(4, '|');
    let seen = p.next()?.parse().ok()?;
    let generation = p.next()?.parse().ok()?;
    let index = p.next()?.parse().ok()?;
    Some((p.next()?.to_string(), index, generation, seen))
}

impl StreamSource for SimStream {
    async fn shards(&self) -> Result<Vec<ShardInfo>, StreamError> {
        let s = lock(&self.state);
        Ok(s.shards.iter().map(|(id, sh)| ShardInfo { shard_id: id.clone(), parent: sh.parent.clone(), closed: sh.closed }).collect())
    }

    async fn iterator(&self, shard_id: &str, position: &Position) -> Result<String, StreamError> {
        let s = lock(&self.state);
        let sh = s.shards.get(shard_id).ok_or_else(|| StreamError::NotFound(shard_id.to_string()))?;
        let index = match position {
            Position::TrimHorizon => sh.trimmed,
            Position::Latest => sh.records.len(),
            Position::After(seq) | Position::At(seq) => {
                let seq: u64 = seq.parse().map_err(|_| StreamError::Fatal(format!("bad sequence number {seq}")))?;
                let at = matches!(position, Position::At(_));
                let idx = sh.records.iter().position(|(s, _)| *s > seq || (at && *s == seq)).unwrap_or(sh.records.len());
                if idx < sh.trimmed {
                    return Err(StreamError::TrimmedData(format!("{shard_id}: position {seq} is trimmed")));
                }
                idx
            }
        };
        Ok(encode(shard_id, index, s.generation))
    }

    async fn records(&self, iterator: &str, limit: u32) -> Result<Page, StreamError> {
        let mut s = lock(&self.state);
        if s.throttles > 0 {
            s.throttles -= 1;
            return Err(StreamError::Throttled("simulated".into()));
        }
        let (shard, index, generation, seen) = decode(iterator).ok_or_else(|| StreamError::Fatal("bad iterator".into()))?;
        if generation < s.generation {
            return Err(StreamError::ExpiredIterator);
        }
        let current = s.generation;
        let sh = s.shards.get(&shard).ok_or_else(|| StreamError::NotFound(shard.clone()))?;
        if index < sh.trimmed || (s.trimmed_when_empty && sh.records.is_empty()) {
            return Err(StreamError::TrimmedData(format!("{shard}: iterator points at trimmed data")));
        }
        let has_records = index < sh.records.len();
        if s.empty_pages > 0 && has_records {
            s.empty_pages -= 1;
            return Ok(Page { records: Records::default(), next_iterator: Some(encode(&shard, index, current)) });
        }
        let end = (index + limit as usize).min(sh.records.len());
        let mut records: Vec<(u64, Value)> = Vec::with_capacity(end.saturating_sub(index));
        for (seq, text) in &sh.records[index..end] {
            let record = serde_json::from_str(text).map_err(|e| StreamError::Fatal(format!("record {seq} of {shard}: {e}")))?;
            records.push((*seq, record));
        }
        let done = sh.closed && end == sh.records.len();
        let run = s.empty_on.get(&shard).and_then(|runs| runs.get(&index)).copied().unwrap_or(0);
        if has_records && seen < run {
            return Ok(Page { records: Records::default(), next_iterator: Some(encode_seen(&shard, index, current, seen + 1)) });
        }
        let next_iterator = (!done).then(|| encode(&shard, end, current));
        if !s.quiet {
            for (seq, _) in &records {
                s.reads.push((shard.clone(), *seq));
            }
        }
        Ok(Page { records: Records::new(records.into_iter().map(|(_, r)| r).collect()), next_iterator })
    }
}
