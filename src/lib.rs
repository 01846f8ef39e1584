//! ddb-aggregator: DynamoDB stream records in, exactly-right aggregate items out.
//!
//! The pipeline, in module order: `pattern` and `rules` decide what a record changes (pure),
//! `config` turns YAML into a validated configuration, and the service modules read, write and
//! remember. Pure modules import no AWS crate.

pub mod aws;
pub mod config;
pub mod decimal;
pub mod pattern;
pub mod reconcile;
pub mod registry;
pub mod rules;
pub mod service;
pub mod shard_id;
pub mod sink;
pub mod state;
pub mod stream;
pub mod telemetry;
pub mod worker;
