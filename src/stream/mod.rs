//! Reading the stream: a narrow [`StreamSource`] trait (DynamoDB Streams in production, an
//! in-memory simulator in tests), shard lineage, and per-shard polling.

pub mod dynamodb;
pub mod lineage;
pub mod sim;

use std::future::Future;

use serde_json::Value;

/// One shard as DescribeStream lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub shard_id: String,
    pub parent: Option<String>,
    /// Closed shards have an ending sequence number; reading one to its end yields no next
    /// iterator.
    pub closed: bool,
}

/// Where a new shard iterator starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Position {
    TrimHorizon,
    Latest,
    After(String),
    /// The record with this sequence number first (re-reading one record for its letter).
    At(String),
}

/// One GetRecords answer: records in the GetRecords/Lambda JSON shape.
#[derive(Debug, Default)]
pub struct Page {
    pub records: Records,
    /// None: the shard is closed and fully read.
    pub next_iterator: Option<String>,
}

/// A page's records, each made in the GetRecords/Lambda JSON shape only as it is taken
/// ([`Iterator`]): a page of 1,000 records is never held as 1,000 JSON trees at once.
pub struct Records {
    len: usize,
    first_created_ms: Option<u64>,
    iter: Box<dyn Iterator<Item = Value> + Send>,
}

impl Records {
    /// Records already in the JSON shape.
    pub fn new(values: Vec<Value>) -> Records {
        let first_created_ms = values.iter().find_map(created_ms);
        Records { len: values.len(), first_created_ms, iter: Box::new(values.into_iter()) }
    }

    /// `len` records made one by one by `iter`, the first with a creation time created at
    /// `first_created_ms`.
    pub fn lazy(len: usize, first_created_ms: Option<u64>, iter: impl Iterator<Item = Value> + Send + 'static) -> Records {
        Records { len, first_created_ms, iter: Box::new(iter) }
    }

    /// Records not yet taken.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// ApproximateCreationDateTime (ms) of the page's first record that has one.
    pub fn first_created_ms(&self) -> Option<u64> {
        self.first_created_ms
    }
}

impl Default for Records {
    fn default() -> Records {
        Records::new(Vec::new())
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records").field("len", &self.len).field("first_created_ms", &self.first_created_ms).finish()
    }
}

impl Iterator for Records {
    type Item = Value;

    fn next(&mut self) -> Option<Value> {
        let next = self.iter.next()?;
        self.len = self.len.saturating_sub(1);
        Some(next)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len, Some(self.len))
    }
}

impl ExactSizeIterator for Records {}

/// ApproximateCreationDateTime of a record in the JSON shape, in epoch ms.
pub fn created_ms(record: &Value) -> Option<u64> {
    record
        .pointer("/dynamodb/ApproximateCreationDateTime")
        .and_then(Value::as_number)
        .and_then(|n| crate::decimal::Decimal::parse(n.as_str()).ok())
        .and_then(|t| t.checked_mul(crate::decimal::Decimal::from_i64(1000)).ok())
        .and_then(|t| t.trunc_i64())
        .and_then(|t| u64::try_from(t).ok())
}

/// Stream errors, mapped from the SDK where it is called; the rest of the code never sees SDK
/// error types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("shard iterator expired")]
    ExpiredIterator,
    /// The requested position is older than the stream's 24 h retention: data was lost.
    #[error("trimmed data: {0}")]
    TrimmedData(String),
    #[error("throttled: {0}")]
    Throttled(String),
    #[error("not found: {0}")]
    NotFound(String),
    /// GetShardIterator answered without an iterator: the shard is closed and read.
    #[error("no iterator for shard {0} (closed and read)")]
    NoIterator(String),
    #[error("transient stream error: {0}")]
    Transient(String),
    #[error("stream error: {0}")]
    Fatal(String),
}

impl StreamError {
    pub fn is_retriable(&self) -> bool {
        matches!(self, StreamError::Throttled(_) | StreamError::Transient(_) | StreamError::ExpiredIterator)
    }
}

/// A stream of item changes, split into shards.
pub trait StreamSource: Send + Sync + 'static {
    /// Every shard of the stream (all pages).
    fn shards(&self) -> impl Future<Output = Result<Vec<ShardInfo>, StreamError>> + Send;
    fn iterator(&self, shard_id: &str, position: &Position) -> impl Future<Output = Result<String, StreamError>> + Send;
    fn records(&self, iterator: &str, limit: u32) -> impl Future<Output = Result<Page, StreamError>> + Send;
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_page_counts_down_as_its_records_are_made() {
        let made = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = made.clone();
        let mut records = Records::lazy(
            3,
            Some(1_000),
            (0..3).map(move |i| {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                json!({ "n": i })
            }),
        );
        assert_eq!((records.len(), records.first_created_ms()), (3, Some(1_000)));
        assert_eq!(made.load(std::sync::atomic::Ordering::Relaxed), 0, "nothing is made before it is taken");
        assert_eq!(records.next(), Some(json!({ "n": 0 })));
        assert_eq!((records.len(), made.load(std::sync::atomic::Ordering::Relaxed)), (2, 1));
        assert_eq!(records.by_ref().count(), 2);
        assert!(records.is_empty());
        let page = Records::new(vec![json!({}), json!({ "dynamodb": { "ApproximateCreationDateTime": 1764460800.5 } })]);
        assert_eq!((page.len(), page.first_created_ms()), (2, Some(1_764_460_800_500)));
    }
}
