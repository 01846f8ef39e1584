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
#[derive(Debug, Clone, Default)]
pub struct Page {
    pub records: Vec<Value>,
    /// None: the shard is closed and fully read.
    pub next_iterator: Option<String>,
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
