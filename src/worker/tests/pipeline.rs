//! Pipelined batches: the next batch is read and evaluated while one writes, and every crash
//! point of that window replays exactly. The write gate of the memory table holds a batch's
//! writes in flight for as long as a test needs.
//!
//! The crash points, and the test of each:
//! - the replica dies while batch 1 writes (none or some of its writes landed) and batch 2 is
//!   read ahead: nothing of batch 2 was written, the checkpoint is where batch 1 started, and
//!   the next owner replays both; or batch 1 is checkpointed and batch 2 writes (none or some
//!   of its writes landed) with batch 3 read ahead
//!   ([`a_crash_while_a_batch_is_read_ahead_replays_exactly`]);
//! - the lease is lost while batch 1 writes: its checkpoint is refused and batch 2 is never
//!   written ([`a_lease_lost_while_a_batch_writes_never_writes_the_batch_read_ahead`]);
//! - the replica stops while batch 1 writes: batch 1 finishes and checkpoints, batch 2 is left
//!   to the next owner ([`a_replica_stopping_while_a_batch_writes_finishes_that_batch_only`]);
//! - what reconcile reads as applied (`last_record_ms`, `at_tip_ms`) and the checkpoint stay
//!   unpublished while batch 1 writes, although batch 2 is read
//!   ([`the_next_batch_is_read_while_one_writes_and_nothing_of_it_is_published`]);
//! - the tip's evidence (`at_tip_ms`) and a closed shard's SHARD_END wait for the batch in
//!   flight ([`the_tip_and_the_shard_end_wait_for_the_batch_in_flight`]);
//! - batch 1 fails: batch 2, read ahead, is dropped and both are read again
//!   ([`a_failed_batch_drops_the_batch_read_ahead_and_reads_both_again`]).
//!
//! Not tested here: a stop that arrives during a GetRecords call with a batch in flight (the
//! simulated stream answers at once); the reader then lands the batch in flight as it does
//! for every exit ([`super::super::shard`]).
//!
//! Writes of one batch land before any of the next: the ledger's argument, and the property
//! test `overlapping_readers_with_any_batch_cuts_apply_every_record_once`, rest on that.

use super::*;
use crate::state::{Checkpoint, LeaseStore};

/// 30 orders on one shard: batches of 7 (the tests' batch size).
fn thirty_orders(fakes: &Fakes) -> (String, Vec<Value>) {
    let shard = fakes.0.add_shard(None);
    let records: Vec<Value> = (1..=30)
        .map(|n| order(&format!("c{}", n % 5), n, "INSERT", &format!("{n}.25"), if n % 2 == 0 { "PAID" } else { "PENDING" }))
        .collect();
    for r in &records {
        fakes.0.append(&shard, r.clone());
    }
    (shard, records)
}

/// A replica that reads ahead (`source.read_ahead`), batches of 7.
fn start(fakes: &Fakes, name: &str) -> Replica {
    start_config(fakes, name, None, config_with(&[("SOURCE__BATCH_SIZE", "7"), ("SOURCE__READ_AHEAD", "true")]))
}

fn new_fakes() -> Fakes {
    (Arc::new(SimStream::new()), Arc::new(MemoryLeases::new()), Arc::new(MemoryAggregates::new()))
}

/// Waits (bounded, 10 s) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..400 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting until {what}");
}

/// 30 orders, a replica reading them, batch 1's writes waiting at the gate and batch 2 read.
async fn batch_one_writing() -> (Fakes, String, Vec<Value>, Replica) {
    let fakes = new_fakes();
    let (shard, records) = thirty_orders(&fakes);
    fakes.2.close_writes_after(0);
    let r = start(&fakes, "r1");
    read_ahead_of(&fakes, 1).await;
    (fakes, shard, records, r)
}

/// Batch `n`'s writes wait at the gate and batch n+1 has been read.
async fn read_ahead_of(fakes: &Fakes, n: usize) {
    let read = 7 * (n + 1);
    until(&format!("batch {n} writes and batch {} is read", n + 1), || fakes.2.writes_waiting() > 0 && fakes.0.reads().len() >= read).await;
}

/// How many target writes the records make as one batch.
fn targets_of(records: &[Value]) -> u64 {
    let engine = config().engine;
    let mut batch = Coalescer::new();
    for r in records {
        engine.apply(r, &mut batch);
    }
    batch.into_targets().len() as u64
}

/// Every value written is the one batch 1 alone gives its attribute (batch 1's writes landed
/// whole or not at all, nothing later landed).
fn only_batch_one(fakes: &Fakes, records: &[Value]) {
    let one = expected(&records[..7]);
    for (key, value) in fakes.2.numbers() {
        assert_eq!(one.get(&key), Some(&value), "{key:?}: written by a later batch");
    }
}

fn lease_of(fakes: &Fakes, shard: &str) -> Lease {
    fakes.1.snapshot().into_iter().find(|l| l.shard_id == shard).expect("the shard's lease")
}

/// The sequence number the stream gave the `n`th record appended (1-based).
fn sequence(n: u64) -> Checkpoint {
    Checkpoint::Sequence(format!("{n:021}"))
}

#[tokio::test]
async fn the_next_batch_is_read_while_one_writes_and_nothing_of_it_is_published() {
    let (fakes, shard, records, r) = batch_one_writing().await;
    // One batch read ahead, not more: batch 3 waits until batch 2 writes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(fakes.0.reads().len(), 14, "records read while batch 1 writes");
    let lease = lease_of(&fakes, &shard);
    assert_eq!((lease.checkpoint, lease.last_record_ms, lease.at_tip_ms), (None, None, None), "published before batch 1 was written");
    assert!(fakes.2.numbers().is_empty());
    fakes.2.open_writes();
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(lease_of(&fakes, &shard).checkpoint, Some(sequence(30)));
}

/// A replica on a runtime of its own: shutting the runtime down drops every task of the
/// replica where it stands, as a crash does.
fn start_crashable(fakes: &Fakes, name: &'static str) -> tokio::runtime::Runtime {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let fakes = fakes.clone();
    rt.spawn(async move {
        let r = start(&fakes, name);
        let _ = r.handle.await;
    });
    rt
}

#[tokio::test]
async fn a_crash_while_a_batch_is_read_ahead_replays_exactly() {
    let fakes = new_fakes();
    let one = targets_of(&thirty_orders(&fakes).1[..7]);
    assert!(one >= 4, "batch 1 writes {one} targets");
    for landed in [0, 1, one - 1, one, one + 2] {
        let fakes = new_fakes();
        let (shard, records) = thirty_orders(&fakes);
        fakes.2.close_writes_after(landed);
        let crashing = start_crashable(&fakes, "r1");
        // Batch 1 waits for a write, or (all its writes through) batch 2 does.
        let writing = if landed < one { 1 } else { 2 };
        read_ahead_of(&fakes, writing).await;
        crashing.shutdown_background();
        let lease = lease_of(&fakes, &shard);
        if writing == 1 {
            assert_eq!((lease.checkpoint, lease.last_record_ms), (None, None), "{landed} writes landed");
            only_batch_one(&fakes, &records);
        } else {
            assert_eq!(lease.checkpoint, Some(sequence(7)), "{landed} writes landed");
        }
        fakes.2.open_writes();
        let r = start(&fakes, "r2");
        settle(&fakes, &expected(&records), 0).await;
        r.cancel.cancel();
        r.handle.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn a_lease_lost_while_a_batch_writes_never_writes_the_batch_read_ahead() {
    let (fakes, shard, records, r) = batch_one_writing().await;
    let held = lease_of(&fakes, &shard);
    let hour = 3_600_000;
    assert!(fakes.1.take(&held, "thief", now_ms() + hour).await.unwrap().is_some());
    // Batch 1's writes passed the lease check before they waited: they land, its checkpoint
    // is refused, and the reader stops.
    fakes.2.open_writes();
    until("batch 1 is written", || fakes.2.numbers() == expected(&records[..7])).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    assert_eq!(fakes.2.numbers(), expected(&records[..7]), "written after the lease was lost");
    let lease = lease_of(&fakes, &shard);
    assert_eq!((lease.owner.as_deref(), lease.checkpoint), (Some("thief"), None));
}

#[tokio::test]
async fn a_replica_stopping_while_a_batch_writes_finishes_that_batch_only() {
    let (fakes, shard, records, r) = batch_one_writing().await;
    r.cancel.cancel();
    fakes.2.open_writes();
    r.handle.await.unwrap().unwrap();
    assert_eq!(fakes.2.numbers(), expected(&records[..7]));
    assert_eq!(lease_of(&fakes, &shard).checkpoint, Some(sequence(7)));
    let r = start(&fakes, "r2");
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_tip_and_the_shard_end_wait_for_the_batch_in_flight() {
    for closed in [false, true] {
        let fakes = new_fakes();
        let shard = fakes.0.add_shard(None);
        let records: Vec<Value> = (1..=7).map(|n| order("c1", n, "INSERT", "2.50", "PAID")).collect();
        for r in &records {
            fakes.0.append(&shard, r.clone());
        }
        if closed {
            fakes.0.close(&shard);
        }
        fakes.2.close_writes_after(0);
        let r = start(&fakes, "r1");
        until("the batch writes", || fakes.2.writes_waiting() > 0).await;
        // Empty pages at the tip (2 are evidence in these tests) or the shard's end come next;
        // neither may be published while the batch writes.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let lease = lease_of(&fakes, &shard);
        assert_eq!((lease.checkpoint, lease.at_tip_ms, lease.last_record_ms), (None, None, None), "closed: {closed}");
        fakes.2.open_writes();
        settle(&fakes, &expected(&records), usize::from(closed)).await;
        let want = if closed { Checkpoint::ShardEnd } else { sequence(7) };
        until("the checkpoint", || lease_of(&fakes, &shard).checkpoint == Some(want.clone())).await;
        r.cancel.cancel();
        r.handle.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn a_failed_batch_drops_the_batch_read_ahead_and_reads_both_again() {
    let (fakes, shard, records, r) = batch_one_writing().await;
    // A write that fails for good fails batch 1 (no retry within the batch).
    fakes.2.fail_next_for_good(1);
    fakes.2.open_writes();
    settle(&fakes, &expected(&records), 0).await;
    r.cancel.cancel();
    r.handle.await.unwrap().unwrap();
    let reads = fakes.0.reads();
    let times = |seq: u64| reads.iter().filter(|(s, n)| *s == shard && *n == seq).count();
    // Batch 1 and batch 2 (read ahead, dropped) are read again; batch 3 once.
    assert_eq!((times(1), times(8), times(15)), (2, 2, 1), "reads: {reads:?}");
    assert_eq!(lease_of(&fakes, &shard).checkpoint, Some(sequence(30)));
}

#[test]
fn a_due_batch_waits_for_the_one_in_flight_only_at_the_tip() {
    use super::super::shard::cut_now;
    // (full, shard_end, busy) -> cut now
    let cases = [
        ((false, false, false), true), // nothing in flight
        ((true, false, true), true),   // a full batch behind one in flight: read ahead as far as it goes
        ((false, true, true), true),   // the shard's end
        ((false, false, true), false), // the tip with a batch in flight: wait, then poll once more
    ];
    for ((full, end, busy), cut) in cases {
        assert_eq!(cut_now(full, end, busy), cut, "full {full}, shard end {end}, busy {busy}");
    }
}
