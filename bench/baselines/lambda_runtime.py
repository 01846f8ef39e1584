"""A local stand-in for Lambda's DynamoDB Streams event source mapping, to drive a handler as
Lambda does with its defaults:

- DescribeStream lists the shards; a shard is read only after its parent has been read to its
  end (or when the parent is no longer listed), one sequential reader per shard
  (ParallelizationFactor 1), from TRIM_HORIZON;
- GetRecords with BatchSize 100; an idle shard is polled 4 times per second;
- the handler gets one batch per call as `handler({"Records": [...]}, context)`; when it raises,
  the whole batch is retried (MaximumRetryAttempts -1: until it succeeds, or until stopped);
- SIGTERM (or SIGINT) stops it after the batch in flight (so do --max-records and
  --max-seconds).

Its counters (records processed, batches, retries, write requests and write capacity units the
handler consumed) are rewritten to a JSON stats file after every batch.

Handlers count their writes through `context.meter` (ReturnConsumedCapacity=TOTAL on every
write). A write that fails counts as a request with no capacity (DynamoDB reports none).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from bench.local_aws import client

BATCH_SIZE = 100  # Lambda's default BatchSize for DynamoDB Streams
IDLE_POLL_SECONDS = 0.25  # Lambda polls each shard 4 times per second
DISCOVER_SECONDS = 5.0  # how often the shard list is read again

Handler = Callable[[dict[str, Any], "Context"], None]


@dataclass
class Stats:
    system: str
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    ready: bool = False  # every shard known at start has had its first GetRecords
    records: int = 0  # records of batches the handler completed
    last_batch_at: float | None = None  # when the last of them completed (epoch seconds)
    batches: int = 0
    batch_retries: int = 0
    write_requests: int = 0
    write_capacity_units: float = 0.0
    last_sequence_number: str | None = None
    stopped: bool = False


class Meter:
    """Counts the handler's write requests and the capacity DynamoDB reports for them."""

    def __init__(self, stats: Stats, lock: threading.Lock):
        self.stats, self.lock = stats, lock

    def call(self, operation: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        try:
            response = operation(ReturnConsumedCapacity="TOTAL", **kwargs)
        except Exception:
            with self.lock:
                self.stats.write_requests += 1
            raise
        consumed = response.get("ConsumedCapacity") or []
        if isinstance(consumed, dict):
            consumed = [consumed]
        with self.lock:
            self.stats.write_requests += 1
            self.stats.write_capacity_units += sum(c.get("CapacityUnits", 0.0) for c in consumed)
        return response


@dataclass
class Context:
    """What a handler gets besides the event: the DynamoDB client, its table, the meter."""

    dynamodb: Any
    table: str
    meter: Meter


def add_update(table: str, target: tuple[str, str], deltas: dict[str, Decimal]) -> dict[str, Any]:
    """UpdateItem parameters that ADD each delta to the target item's attributes."""
    names = {f"#a{i}": name for i, name in enumerate(sorted(deltas))}
    return {
        "TableName": table,
        "Key": {"PK": {"S": target[0]}, "SK": {"S": target[1]}},
        "UpdateExpression": "ADD " + ", ".join(f"#a{i} :v{i}" for i in range(len(names))),
        "ExpressionAttributeNames": names,
        "ExpressionAttributeValues": {
            f":v{i}": {"N": str(deltas[name])} for i, name in enumerate(sorted(deltas))
        },
    }


class Poller:
    def __init__(self, args: argparse.Namespace, system: str, handler: Handler):
        self.args = args
        self.handler = handler
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.stats = Stats(system)
        self.streams = client("dynamodbstreams", args.endpoint)
        ddb = client("dynamodb", args.endpoint)
        self.context = Context(ddb, args.aggregates_table, Meter(self.stats, self.lock))
        self.stream_arn = ddb.describe_table(TableName=args.table)["Table"]["LatestStreamArn"]
        self.finished: set[str] = set()  # shards read to their end
        self.started: dict[str, threading.Thread] = {}
        self.first_polls: set[str] = set()
        self.initial: set[str] | None = None

    def save(self) -> None:
        """Rewrites the stats file atomically (caller holds the lock)."""
        self.stats.updated_at = time.time()
        tmp = f"{self.args.stats}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(self.stats), f)
        os.replace(tmp, self.args.stats)

    def shards(self) -> list[dict[str, Any]]:
        shards: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"StreamArn": self.stream_arn}
        while True:
            desc = self.streams.describe_stream(**kwargs)["StreamDescription"]
            shards.extend(desc["Shards"])
            if not desc.get("LastEvaluatedShardId"):
                return shards
            kwargs["ExclusiveStartShardId"] = desc["LastEvaluatedShardId"]

    def run(self) -> None:
        deadline = time.monotonic() + self.args.max_seconds
        while not self.stop.is_set():
            if time.monotonic() > deadline:
                print(f"stopping after --max-seconds {self.args.max_seconds:.0f}", file=sys.stderr)
                self.stop.set()
                break
            listed = self.shards()
            ids = {s["ShardId"] for s in listed}
            if self.initial is None:
                self.initial = ids
                if not ids:
                    self.mark_polled("")
            for shard in listed:
                sid, parent = shard["ShardId"], shard.get("ParentShardId")
                with self.lock:
                    parent_done = parent is None or parent not in ids or parent in self.finished
                if sid in self.started or not parent_done:
                    continue
                t = threading.Thread(target=self.read_shard, args=(sid,), daemon=True)
                self.started[sid] = t
                t.start()
            self.stop.wait(DISCOVER_SECONDS)
        for t in self.started.values():
            t.join(timeout=60)
        with self.lock:
            self.stats.stopped = True
            self.save()

    def mark_polled(self, shard_id: str) -> None:
        with self.lock:
            self.first_polls.add(shard_id)
            if (
                not self.stats.ready
                and self.initial is not None
                and self.initial <= self.first_polls
            ):
                self.stats.ready = True
                self.save()

    def iterator(self, shard_id: str, after: str | None) -> str:
        kwargs: dict[str, Any] = {"StreamArn": self.stream_arn, "ShardId": shard_id}
        if after is None:
            kwargs["ShardIteratorType"] = "TRIM_HORIZON"
        else:
            kwargs.update(ShardIteratorType="AFTER_SEQUENCE_NUMBER", SequenceNumber=after)
        return self.streams.get_shard_iterator(**kwargs)["ShardIterator"]

    def read_shard(self, shard_id: str) -> None:
        last: str | None = None  # sequence number of the last record handled
        it: str | None = self.iterator(shard_id, None)
        while it is not None and not self.stop.is_set():
            try:
                page = self.streams.get_records(ShardIterator=it, Limit=BATCH_SIZE)
            except Exception as e:  # noqa: BLE001 - expired iterator, throttling: resume from the last record
                print(
                    f"GetRecords on {shard_id} failed ({e}); resuming after {last}", file=sys.stderr
                )
                self.stop.wait(1.0)
                it = self.iterator(shard_id, last)
                continue
            self.mark_polled(shard_id)
            records = page["Records"]
            if self.args.max_records is not None:
                with self.lock:
                    records = records[: max(0, self.args.max_records - self.stats.records)]
            if records:
                if not self.handle(records):
                    return  # stopped while the batch kept failing
                last = records[-1]["dynamodb"]["SequenceNumber"]
            it = page.get("NextShardIterator")
            if self.args.max_records is not None and self.stats.records >= self.args.max_records:
                self.stop.set()
            elif not page["Records"]:
                self.stop.wait(IDLE_POLL_SECONDS)
        if it is None:
            with self.lock:
                self.finished.add(shard_id)

    def handle(self, records: list[dict[str, Any]]) -> bool:
        """Calls the handler until it succeeds (True), or until stopped (False)."""
        event = {"Records": [{**r, "eventSourceARN": self.stream_arn} for r in records]}
        backoff = 0.1
        while True:
            try:
                self.handler(event, self.context)
                break
            except Exception as e:  # noqa: BLE001 - Lambda retries the whole batch
                print(
                    f"handler failed ({type(e).__name__}: {e}); retrying the batch of {len(records)}",
                    file=sys.stderr,
                )
                with self.lock:
                    self.stats.batch_retries += 1
                    self.save()
                if self.stop.wait(backoff):
                    return False
                backoff = min(backoff * 2, 2.0)
        with self.lock:
            self.stats.records += len(records)
            self.stats.batches += 1
            self.stats.last_sequence_number = records[-1]["dynamodb"]["SequenceNumber"]
            self.stats.last_batch_at = time.time()
            self.save()
        return True


def main(system: str, handler: Handler, doc: str | None) -> int:
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--endpoint", default="http://127.0.0.1:8000", help="DynamoDB (and Streams) endpoint"
    )
    p.add_argument("--table", required=True, help="source table (its stream is read)")
    p.add_argument("--aggregates-table", required=True)
    p.add_argument(
        "--stats", required=True, metavar="FILE", help="JSON counters, rewritten after every batch"
    )
    p.add_argument("--max-records", type=int, help="stop after handling this many records")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=900.0,
        help="stop after this long at most (a bound if nobody stops it)",
    )
    args = p.parse_args()
    poller = Poller(args, system, handler)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: poller.stop.set())
    with poller.lock:
        poller.save()
    poller.run()
    return 0
