#!/usr/bin/env python3
"""Workload generator for the single-table commerce model of config/commerce.yaml.

Items: PK=CUST#<customer>, SK=ORDER#<YYYY-MM-DD>#<order_id>, attributes status (S: PENDING,
PAID, SHIPPED, CANCELLED) and total (N, 2 decimals). Customer activity is Zipf-skewed (the
customer of rank k is picked with probability proportional to 1/k^s), and each write is one of:

  insert      PutItem of a new order (PENDING or PAID); a share of them are "expiring" orders
              (abandoned carts) that carry an expiresAt (epoch seconds) in the past
  status      UpdateItem SET status: PENDING -> PAID|CANCELLED, PAID -> SHIPPED|CANCELLED
  total       UpdateItem SET total to a different amount
  delete      DeleteItem of an order
  ttl_delete  the TTL sweeper: DeleteItem of an expiring order, here and now (DynamoDB's own
              sweep, which DynamoDB Local also runs, takes from seconds there to about two days
              on AWS). These are ordinary DeleteItem calls; in --records-out they carry the
              userIdentity that real TTL deletes have (Service, dynamodb.amazonaws.com)

Every write changes its item, so each one yields exactly one stream record. When an operation
has no candidate (no open order for the chosen customer, no expiring order yet) an insert is
written instead. The sequence of writes is a function of --seed and the other options alone.

--records-out FILE also writes the equivalent DynamoDB stream records, one JSON object per line
in the shape GetRecords returns (NEW_AND_OLD_IMAGES, 21-digit increasing sequence numbers,
ApproximateCreationDateTime in epoch seconds, SizeBytes approximated as the sum of attribute
name and value lengths). With --offline nothing is sent to DynamoDB: only the file is written,
for `ddb-aggregator simulate` and micro-benchmarks.

With --rate 0 the writes go as fast as a few threads (--threads) can send them; a customer's
writes always go through the same thread, so each item's writes stay in order. Importable: the
benchmark harness (bench/run.py) uses Workload and generate() in-process.

  python bench/workload.py --endpoint http://127.0.0.1:8120 --table bench-src --count 20000
  python bench/workload.py --offline --count 50000 --records-out records.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import itertools
import json
import queue
import random
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

NEXT_STATUSES = {"PENDING": ("PAID", "CANCELLED"), "PAID": ("SHIPPED", "CANCELLED")}
FIRST_DAY = datetime.date(2026, 10, 1)  # orders are dated FIRST_DAY .. FIRST_DAY + days - 1
TTL_USER_IDENTITY = {"type": "Service", "principalId": "dynamodb.amazonaws.com"}

Item = dict[str, dict[str, str]]  # a DynamoDB item in the low-level JSON shape
ItemKey = tuple[str, str]  # (PK, SK)


@dataclass(frozen=True)
class Mix:
    """Shares of the write kinds (normalised), and the share of inserts that expire."""

    insert: float = 0.45
    status: float = 0.30
    total: float = 0.12
    delete: float = 0.05
    ttl_delete: float = 0.08
    expiring: float = 0.15

    def kinds(self) -> tuple[list[str], list[float]]:
        names = ["insert", "status", "total", "delete", "ttl_delete"]
        return names, list(itertools.accumulate(getattr(self, n) for n in names))


@dataclass
class Write:
    """One write: its kind, the customer it belongs to and the item before and after."""

    kind: str
    customer: str
    key: Item
    old: Item | None
    new: Item | None

    def stream_record(
        self, sequence: int, created: float, region: str, event_id: str
    ) -> dict[str, Any]:
        """The stream record DynamoDB emits for this write (NEW_AND_OLD_IMAGES)."""
        ddb: dict[str, Any] = {"ApproximateCreationDateTime": int(created), "Keys": self.key}
        if self.new is not None:
            ddb["NewImage"] = self.new
        if self.old is not None:
            ddb["OldImage"] = self.old
        ddb["SequenceNumber"] = f"{sequence:021d}"
        ddb["SizeBytes"] = sum(_size(i) for i in (self.key, self.new, self.old) if i)
        ddb["StreamViewType"] = "NEW_AND_OLD_IMAGES"
        event = "INSERT" if self.old is None else "REMOVE" if self.new is None else "MODIFY"
        record: dict[str, Any] = {
            "eventID": event_id,
            "eventName": event,
            "eventVersion": "1.1",
            "eventSource": "aws:dynamodb",
            "awsRegion": region,
            "dynamodb": ddb,
        }
        if self.kind == "ttl_delete":
            record["userIdentity"] = TTL_USER_IDENTITY
        return record


def _size(item: Item) -> int:
    return sum(len(name) + len(next(iter(value.values()))) for name, value in item.items())


def _amount(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


class Workload:
    """A deterministic sequence of writes over a model of the table it has written so far."""

    def __init__(
        self,
        customers: int = 500,
        skew: float = 1.1,
        seed: int = 1,
        days: int = 30,
        mix: Mix = Mix(),
        updated_at: bool = False,
    ):
        """`updated_at`: every insert and change also sets updatedAt (N), a number that grows
        with each write (the `by` of a `latest` measure); off by default, so the main
        benchmark's items keep their size."""
        if customers < 1 or days < 1:
            raise ValueError("customers and days must be at least 1")
        self.updated_at = updated_at
        self._clock = 0
        self.rng = random.Random(seed)
        self.mix = mix
        self.days = days
        self.customers = [f"c{k:05d}" for k in range(1, customers + 1)]
        self._customer_cum = list(
            itertools.accumulate(1 / k**skew for k in range(1, customers + 1))
        )
        self._kind_names, self._kind_cum = mix.kinds()
        self.items: dict[ItemKey, Item] = {}
        self.live: dict[str, list[ItemKey]] = {}  # the customer's orders
        self.open: dict[str, list[ItemKey]] = {}  # the customer's PENDING or PAID orders
        self.expiring: list[ItemKey] = []  # orders with an expiresAt, awaiting the sweeper
        self._next_order = 0

    def _stamp(self, item: Item) -> Item:
        if self.updated_at:
            self._clock += 1
            item["updatedAt"] = {"N": str(self._clock)}
        return item

    def customer(self) -> str:
        return self.customers[
            bisect.bisect_left(self._customer_cum, self.rng.random() * self._customer_cum[-1])
        ]

    def next(self) -> Write:
        """The next write; the model is updated as if it had been applied."""
        kind = self._kind_names[
            bisect.bisect_left(self._kind_cum, self.rng.random() * self._kind_cum[-1])
        ]
        customer = self.customer()
        if kind == "status" and self.open.get(customer):
            return self._set_status(self.rng.choice(self.open[customer]))
        if kind == "total" and self.live.get(customer):
            return self._set_total(self.rng.choice(self.live[customer]))
        if kind == "delete" and self.live.get(customer):
            return self._delete(self.rng.choice(self.live[customer]), "delete")
        if kind == "ttl_delete" and self.expiring:
            return self._delete(self.expiring[self.rng.randrange(len(self.expiring))], "ttl_delete")
        return self.insert_for(customer, expiring=self.rng.random() < self.mix.expiring)

    def insert_for(self, customer: str, expiring: bool = False) -> Write:
        """A new order for any customer (the harness uses it for marker and probe orders)."""
        self._next_order += 1
        day = FIRST_DAY + datetime.timedelta(days=self.rng.randrange(self.days))
        pk, sk = f"CUST#{customer}", f"ORDER#{day.isoformat()}#o{self._next_order:07d}"
        item: Item = {
            "PK": {"S": pk},
            "SK": {"S": sk},
            "status": {"S": self.rng.choice(("PENDING", "PAID"))},
            "total": {"N": _amount(self.rng.randint(100, 50_000))},
        }
        self._stamp(item)
        if expiring:
            midnight = datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.UTC)
            item["expiresAt"] = {
                "N": str(int(midnight.timestamp()) + 3600 * self.rng.randint(1, 24))
            }
            self.expiring.append((pk, sk))
        self.items[(pk, sk)] = item
        self.live.setdefault(customer, []).append((pk, sk))
        self.open.setdefault(customer, []).append((pk, sk))
        return Write("insert", customer, _key(pk, sk), None, item)

    def _set_status(self, key: ItemKey) -> Write:
        old = self.items[key]
        status = self.rng.choice(NEXT_STATUSES[old["status"]["S"]])
        new = self._stamp({**old, "status": {"S": status}})
        self.items[key] = new
        if status not in NEXT_STATUSES:
            self.open[_customer(key)].remove(key)
        return Write("status", _customer(key), _key(*key), old, new)

    def _set_total(self, key: ItemKey) -> Write:
        old = self.items[key]
        cents = self.rng.randint(100, 50_000)
        while _amount(cents) == old["total"]["N"]:
            cents = self.rng.randint(100, 50_000)
        new = self._stamp({**old, "total": {"N": _amount(cents)}})
        self.items[key] = new
        return Write("total", _customer(key), _key(*key), old, new)

    def _delete(self, key: ItemKey, kind: str) -> Write:
        customer = _customer(key)
        old = self.items.pop(key)
        self.live[customer].remove(key)
        if key in self.open[customer]:
            self.open[customer].remove(key)
        if "expiresAt" in old:
            self.expiring.remove(key)
        return Write(kind, customer, _key(*key), old, None)


def _key(pk: str, sk: str) -> Item:
    return {"PK": {"S": pk}, "SK": {"S": sk}}


def _customer(key: ItemKey) -> str:
    return key[0].split("#", 1)[1]


def apply(client: Any, table: str, write: Write) -> None:
    """Sends one write to DynamoDB (the low-level boto3 client)."""
    if write.kind == "insert":
        assert write.new is not None
        client.put_item(TableName=table, Item=write.new)
    elif write.kind in ("status", "total"):
        assert write.new is not None
        names, values, sets = {"#a": write.kind}, {":v": write.new[write.kind]}, ["#a = :v"]
        if "updatedAt" in write.new:
            names["#u"], values[":u"] = "updatedAt", write.new["updatedAt"]
            sets.append("#u = :u")
        client.update_item(
            TableName=table,
            Key=write.key,
            UpdateExpression="SET " + ", ".join(sets),
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )
    else:
        client.delete_item(TableName=table, Key=write.key)


def dynamodb_client(endpoint: str, region: str = "us-east-1") -> Any:
    """A low-level DynamoDB client for a local endpoint (bounded timeouts, standard retries)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "dynamodb",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id="local",
        aws_secret_access_key="local",
        config=Config(
            connect_timeout=3,
            read_timeout=20,
            retries={"mode": "standard", "max_attempts": 5},
            max_pool_connections=16,
        ),
    )


@dataclass
class Result:
    writes: int = 0
    seconds: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.writes / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "writes": self.writes,
            "seconds": round(self.seconds, 3),
            "writes_per_second": round(self.rate, 1),
            "by_kind": self.by_kind,
        }


class RecordWriter:
    """Writes the stream records of a sequence of writes as JSON lines."""

    def __init__(self, out: TextIO, region: str, seed: int):
        self.out = out
        self.region = region
        self.sequence = 0
        self.rng = random.Random(seed)  # event ids, separate from the workload's own draws

    def write(self, w: Write) -> None:
        self.sequence += 1
        event_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        json.dump(
            w.stream_record(self.sequence, time.time(), self.region, event_id),
            self.out,
            separators=(",", ":"),
        )
        self.out.write("\n")


def generate(
    workload: Workload,
    *,
    count: int | None = None,
    duration: float | None = None,
    rate: float = 0.0,
    threads: int = 4,
    client_factory: Callable[[], Any] | None = None,
    table: str = "",
    records: RecordWriter | None = None,
    stop: threading.Event | None = None,
) -> Result:
    """Produces writes until `count` writes, `duration` seconds or `stop`, whichever comes first.

    With a client_factory each write is sent to `table` (one client per thread, a customer's
    writes always on the same thread); without one (offline) only `records` is written.
    `rate` > 0 paces the writes (writes per second over the whole run)."""
    if count is None and duration is None:
        raise ValueError("give count or duration")
    stop = stop or threading.Event()
    result = Result()
    started = time.monotonic()
    deadline = started + duration if duration is not None else float("inf")
    failure: list[BaseException] = []
    queues: list[queue.Queue[Write | None]] = []
    workers: list[threading.Thread] = []

    def worker(q: queue.Queue[Write | None]) -> None:
        assert client_factory is not None
        client = client_factory()
        while (w := q.get()) is not None:
            if failure:
                continue  # drain after a failure; the dispatcher stops
            try:
                apply(client, table, w)
            except Exception as e:  # noqa: BLE001 - reported by the dispatcher
                failure.append(e)

    if client_factory is not None:
        for _ in range(max(1, threads)):
            q: queue.Queue[Write | None] = queue.Queue(maxsize=256)
            queues.append(q)
            workers.append(threading.Thread(target=worker, args=(q,), daemon=True))
        for t in workers:
            t.start()
    try:
        for i in itertools.count():
            now = time.monotonic()
            due = started + i / rate if rate > 0 else now
            if (
                (count is not None and i >= count)
                or max(now, due) >= deadline
                or stop.is_set()
                or failure
            ):
                break
            if due > now:
                time.sleep(due - now)
            w = workload.next()
            if queues:
                # Bounded: a stalled endpoint fails the run instead of hanging it.
                queues[zlib.crc32(w.customer.encode()) % len(queues)].put(w, timeout=120)
            if records is not None:
                records.write(w)
            result.writes += 1
            result.by_kind[w.kind] = result.by_kind.get(w.kind, 0) + 1
    finally:
        for q in queues:
            q.put(None, timeout=120)
        for t in workers:
            t.join(timeout=120)
    result.seconds = time.monotonic() - started
    if failure:
        raise RuntimeError(f"a write failed: {failure[0]}") from failure[0]
    if any(t.is_alive() for t in workers):
        raise RuntimeError("writer threads did not finish within 120 s")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--customers", type=int, default=500)
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent s of customer activity")
    p.add_argument("--days", type=int, default=30, help="orders are spread over this many days")
    p.add_argument(
        "--rate", type=float, default=0.0, help="writes per second; 0: as fast as possible"
    )
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--count", type=int, help="number of writes")
    p.add_argument("--duration", type=float, help="seconds to write for")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--endpoint", default="http://127.0.0.1:8000")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--table", default="commerce-main")
    p.add_argument(
        "--records-out",
        metavar="FILE",
        help="also write the equivalent stream records (JSON lines)",
    )
    p.add_argument(
        "--offline", action="store_true", help="write only --records-out, send nothing to DynamoDB"
    )
    a = p.parse_args(argv)
    if a.count is None and a.duration is None:
        p.error("give --count or --duration")
    if a.offline and not a.records_out:
        p.error("--offline needs --records-out")
    workload = Workload(customers=a.customers, skew=a.skew, seed=a.seed, days=a.days)
    factory = None if a.offline else (lambda: dynamodb_client(a.endpoint, a.region))
    with (
        open(a.records_out, "w", encoding="utf-8")
        if a.records_out
        else contextlib.nullcontext() as out
    ):
        result = generate(
            workload,
            count=a.count,
            duration=a.duration,
            rate=a.rate,
            threads=a.threads,
            client_factory=factory,
            table=a.table,
            records=RecordWriter(out, a.region, a.seed) if out else None,
        )
    print(json.dumps(result.as_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
