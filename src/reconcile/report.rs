//! What a reconcile found and did.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::decimal::Decimal;
use crate::rules::TargetKey;
use crate::telemetry::names;

/// A stored attribute: its number, or the text of a value that is not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    Missing,
    Number(Decimal),
    Other(String),
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stored::Missing => f.write_str("-"),
            Stored::Number(n) => write!(f, "{n}"),
            Stored::Other(s) => write!(f, "{s:?}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Drift {
    pub rule: String,
    pub target: TargetKey,
    pub attribute: String,
    pub stored: Stored,
    pub truth: Decimal,
    pub corrected: bool,
}

impl Drift {
    pub fn difference(&self) -> Option<Decimal> {
        match &self.stored {
            Stored::Missing => Some(self.truth),
            Stored::Number(n) => self.truth.checked_sub(*n).ok(),
            Stored::Other(_) => None,
        }
    }
}

#[derive(Debug, Default)]
pub struct Report {
    pub drifts: Vec<Drift>,
    /// Targets whose write counter kept moving: reported, not forced.
    pub not_quiet: Vec<(String, TargetKey)>,
    /// Targets that could not be read or corrected (rule, target, why): the others went on.
    pub failed: Vec<(String, TargetKey, String)>,
    pub items_read: u64,
    /// Read capacity units consumed (both tables).
    pub read_units: f64,
    pub targets_checked: u64,
    pub poisons: u64,
    pub elapsed: Duration,
    /// Rules left out: their definition cannot be recomputed from the items (why, per rule).
    pub refused: Vec<String>,
    /// Shards only the empty-page rule (`reconcile.tip_evidence`) showed caught up, in any
    /// wait of the run: idle open shards, judged by an assumption AWS does not promise.
    pub by_empty_pages: BTreeSet<String>,
    /// Such judgements, a shard counted once per wait.
    pub empty_page_judgements: u64,
    /// Per rule: the helper items (of max, min, latest, distinct) its first round read.
    pub helpers: BTreeMap<String, HelperCount>,
    /// Copy items of copy rules compared with their source.
    pub copies_checked: u64,
    /// Copy items that differed from their source.
    pub copy_drifts: Vec<super::copies::CopyDrift>,
    /// Sources left out because a fan-out job of theirs is pending (it writes their copies).
    pub copy_sources_pending: u64,
}

/// Helper items by state: a count above zero, or at zero (expiring, where the table's TTL
/// attribute is configured, or kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HelperCount {
    pub live: u64,
    pub zero: u64,
}

impl Report {
    /// Counts the shards one wait for evidence judged by the empty-page rule.
    pub fn judged_by_empty_pages(&mut self, shards: &[String]) {
        if shards.is_empty() {
            return;
        }
        metrics::counter!(names::RECONCILE_TIP_BY_EMPTY_PAGES).increment(shards.len() as u64);
        self.empty_page_judgements += shards.len() as u64;
        self.by_empty_pages.extend(shards.iter().cloned());
    }

    pub fn uncorrected(&self) -> usize {
        self.drifts.iter().filter(|d| !d.corrected).count()
            + self.not_quiet.len()
            + self.failed.len()
            + self.copy_drifts.iter().filter(|d| !d.corrected).count()
    }
}
