"""Tests on your own AWS account, or with --endpoint on the local emulators (run by scripts/live-aws).

It creates its own resources (named ddbagg-live-<8 hex>-..., tagged ddb-aggregator:live-test=<hex>),
runs ddb-aggregator against them, and deletes them at the end, on failure and on Ctrl-C too:

  1. the commerce workload (bench/workload.py) with the service running and SIGKILLed 3 times
     (each time restarted); then every aggregate must equal the truth computed from a Scan of
     the source table (bench/commerce.py), to the last digit; `reconcile --all --dry-run` must
     find no drift; two poison orders must reach the dead-letter queue;
  2. a forced reshard (AWS only): the source table's provisioned write capacity is raised so its
     partitions, and so its stream's shards, split; writes go on; exact again;
  3. TTL deletes through a rule with `ttl_deletes: ignore`, next to the same count with
     `ttl_deletes: count`. DynamoDB may take days to expire an item: until it has, the check is
     pending, its two tables are kept and a state file (.local/live-aws/<hex>.json) records them;
     `--resume <hex>` finishes it later and deletes them;
  4. the source table's stream disabled and enabled again: the service must follow the new
     stream, and the writes made while no stream was on must be repaired (no drift left);
  5. lag and write capacity as observed (probe orders timed from PutItem to their aggregate,
     the service's iterator age and end-to-end lag, WCU per write), next to the figures of a
     reference run on the emulators;
  6. what the docs list as not verified on AWS (docs/limits.md), observed: empty GetRecords
     pages mid-shard, whether a new stream's shards share one creation time, how soon a new
     stream lists its shards, LatestStreamArn after a stream is disabled, the TTL service's
     identity on stream records.

Each check prints pass, fail, skipped, observed or pending with a one-line detail; --report
writes them as JSON. Exit 0 when nothing failed, 1 when something did, 2 for bad usage, 130/143
when interrupted (after cleaning up).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.local_aws import KEY_SCHEMA as PK_SK

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / ".local" / "live-aws"
DEFAULT_BIN = "target/debug/ddb-aggregator"
TAG = "ddb-aggregator:live-test"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SUFFIX_RE = re.compile(r"[0-9a-f]{8}")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
DUMMY_KEY = "local"

# Prices of us-east-1, standard table class, as AWS lists them (2025). The plan calls the sum an
# estimate: other regions differ, and the free tier may cover some or all of it.
PRICE = {
    "wru": 0.625 / 1e6,  # on-demand write request unit
    "rru": 0.125 / 1e6,  # on-demand read request unit
    "wcu_hour": 0.00065,  # provisioned write capacity unit, per hour
    "rcu_hour": 0.00013,  # provisioned read capacity unit, per hour
    "stream_read": 0.02 / 1e5,  # DynamoDB Streams read request unit (one GetRecords call)
    "sqs_request": 0.40 / 1e6,  # SQS standard queue request
}
SOURCE_WCU = 50  # the source table is provisioned, so that raising its capacity splits it
SOURCE_RCU = 50
RESHARD_WCU = 2000  # two partitions at most 1,000 WCU each: at least one split
RESHARD_HOURS = 2  # billed by the started hour: a run can cross an hour boundary
RESHARD_WAIT = 20 * 60  # longest wait for the split to show in DescribeStream
RESHARD_RATE = 2.0  # writes per second while waiting for the split
LEASE = "3s"  # short leases: a SIGKILLed replica's shards are taken over within seconds
KILLS = (0.3, 0.55, 0.8)  # SIGKILLs, as shares of the workload's duration
TTL_EXPIRED = 5  # items written already expired
TTL_LASTING = 2  # items that expire in 30 days (deleted with the table)
TTL_PK = "CUST#ttl"
TTL_SK = "ORDER#2026-10-01#"
TTL_GIVE_UP_DAYS = 3  # DynamoDB documents expiry "within a few days"; past this the check fails

# The emulator's figures for check 5 from a reference run of this script on DynamoDB Local
# (2 cores shared with other work; scripts/live-aws --endpoint, debug build), shown next to
# what a run measures so that AWS and emulator numbers sit side by side.
EMULATOR_REFERENCE: dict[str, Any] = {
    "date": "2026-12-04",
    "probe_p50_s": 0.122,
    "probe_max_s": 0.133,
    "iterator_age_max_s": 52.2,
    "lag_p50_le_s": 60.0,
    "lag_p99_le_s": 300.0,
    "aggregate_wcu_per_write": 1.163,
    "source_wcu_per_write": 1.0,
}


def lag_text(d: dict[str, Any]) -> str:
    return (
        f"an order reaches its aggregate in {d['probe_p50_s']} s (median of 10 probes at idle, "
        f"max {d['probe_max_s']} s); under the workload iterator age max "
        f"{d['iterator_age_max_s']:.1f} s, end-to-end lag p50 <= {d['lag_p50_le_s']} s, "
        f"p99 <= {d['lag_p99_le_s']} s"
    )


STATUS_ORDER = ("fail", "pass", "observed", "pending", "skipped")


def ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_order(c: Any) -> tuple[int, str]:
    """1, 1b, 1c, 2, ..., 6e, then the run's own failures (! and !!)."""
    digits = "".join(ch for ch in c.id if ch.isdigit())
    return (int(digits) if digits else 99, c.id)


def say(msg: str) -> None:
    print(f"[live-aws {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop, clean up, exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    # One-shot: from here on a second SIGINT/SIGTERM only says that cleanup is running, so it
    # cannot interrupt the cleanup the first one started.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _cleaning_up)
    raise Interrupted(signum)


def _cleaning_up(signum: int, _frame: Any) -> None:
    print(
        f"\n[live-aws] {signal.Signals(signum).name} ignored: deleting what this run created, "
        "please wait (every step is bounded)",
        flush=True,
    )


@contextlib.contextmanager
def signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------- settings and clients


@dataclass
class Settings:
    endpoint: str | None
    sqs_endpoint: str | None
    region: str
    duration: float
    rate: float
    reshard: bool
    ttl_wait: float
    keep: bool
    yes: bool
    report: Path | None
    binary: Path
    build: bool  # the default binary is missing: cargo build --locked after the confirmation

    @property
    def local(self) -> bool:
        return self.endpoint is not None

    def describe(self) -> str:
        if self.local:
            return f"emulators: DynamoDB {self.endpoint}, SQS {self.sqs_endpoint}"
        return f"AWS region {self.region}"


class Aws:
    """boto3 clients for one region; in endpoint mode bound to the given loopback endpoints."""

    def __init__(self, s: Settings):
        import boto3
        from botocore.config import Config

        self.s = s
        self.config = Config(
            connect_timeout=5,
            read_timeout=30,
            retries={"mode": "standard", "max_attempts": 8},
            max_pool_connections=16,
            # Endpoint mode stays on loopback: botocore would send even 127.0.0.1 through an
            # HTTP(S)_PROXY of the environment.
            proxies={} if s.local else None,
        )
        self.session = boto3.session.Session(region_name=s.region)
        self.ddb = self.client("dynamodb")
        self.streams = self.client("dynamodbstreams")
        self.sqs = self.client("sqs")

    def client(self, service: str) -> Any:
        endpoint = self.s.sqs_endpoint if service == "sqs" else self.s.endpoint
        return self.session.client(service, endpoint_url=endpoint, config=self.config)

    def account(self) -> str:
        """The AWS account of the credentials ('local' in endpoint mode)."""
        if self.s.local:
            return "local"
        sts = self.session.client("sts", config=self.config)
        return str(sts.get_caller_identity()["Account"])

    def service_env(self) -> dict[str, str]:
        """The environment of the ddb-aggregator processes: the same credentials and region,
        and in endpoint mode the same endpoints. No DDB_AGGREGATOR__* of the user's (they could
        point the service at other tables or queues; the harness sets what it needs itself),
        no AWS_IGNORE_CONFIGURED_ENDPOINT_URLS; in endpoint mode no proxy (loopback only), on
        AWS no AWS_ENDPOINT_URL*."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DDB_AGGREGATOR__") and k != "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"
        }
        env["AWS_REGION"] = self.s.region
        env.setdefault("RUST_LOG", "info")
        if not self.s.local:
            for k in [k for k in env if k.startswith("AWS_ENDPOINT_URL")]:
                del env[k]
        else:
            assert self.s.endpoint and self.s.sqs_endpoint
            for k in [k for k in env if k.upper() in PROXY_VARS]:
                del env[k]
            env["NO_PROXY"] = env["no_proxy"] = ",".join(LOOPBACK)
            env["AWS_ENDPOINT_URL_DYNAMODB"] = self.s.endpoint
            env["AWS_ENDPOINT_URL_DYNAMODB_STREAMS"] = self.s.endpoint
            env["AWS_ENDPOINT_URL_SQS"] = self.s.sqs_endpoint
        return env


def error_code(e: BaseException) -> str:
    return getattr(e, "response", {}).get("Error", {}).get("Code", "")


def loopback_url(url: str, what: str) -> str:
    """The URL if it names a loopback host (127.0.0.1, localhost, ::1), else Usage."""
    u = urllib.parse.urlparse(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None:
        raise Usage(f"{what} must be http://HOST:PORT, got {url!r}")
    if u.hostname not in LOOPBACK:
        raise Usage(
            f"{what} {url} is not on loopback: endpoint mode only talks to local emulators "
            f"({', '.join(LOOPBACK)}); without --endpoint it uses your AWS account"
        )
    return url.rstrip("/")


class Usage(Exception):
    """Bad usage: exit 2 with this message."""


# ---------------------------------------------------------------- names and resources


@dataclass(frozen=True)
class Names:
    suffix: str

    def table(self, role: str) -> str:
        return f"ddbagg-live-{self.suffix}-{role}"

    @property
    def orders(self) -> str:
        return self.table("orders")

    @property
    def aggregates(self) -> str:
        return self.table("aggregates")

    @property
    def state(self) -> str:
        return self.table("state")

    @property
    def probe(self) -> str:
        return self.table("probe")

    @property
    def ttl(self) -> str:
        return self.table("ttl")

    @property
    def ttl_state(self) -> str:
        return self.table("ttl-state")

    @property
    def queue(self) -> str:
        return self.table("dlq")


# The state table's schema, as `state.create_table: true` would create it (src/state/dynamodb.rs).
SHARD_ID = {
    "AttributeDefinitions": [{"AttributeName": "shard_id", "AttributeType": "S"}],
    "KeySchema": [{"AttributeName": "shard_id", "KeyType": "HASH"}],
}
NEW_AND_OLD = {"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"}


class Resources:
    """What this run created, so that cleanup deletes exactly that (and whatever is left of it
    after a failure or an interrupt). A name is recorded before its create call."""

    def __init__(self, aws: Aws, suffix: str):
        self.aws = aws
        self.suffix = suffix
        self.tables: list[str] = []
        self.queue_names: dict[str, str] = {}  # name -> URL ('' until created)
        self.tagging_note: str | None = None
        # table -> (seconds from CreateTable until its stream listed a shard, the shards)
        self.new_streams: dict[str, tuple[float | None, list[dict[str, Any]]]] = {}

    def create_table(
        self,
        name: str,
        schema: dict[str, Any],
        *,
        stream: dict[str, Any] | None = None,
        provisioned: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        self.tables.append(name)
        kwargs: dict[str, Any] = {
            "TableName": name,
            **schema,
            "Tags": [{"Key": TAG, "Value": self.suffix}],
        }
        if provisioned:
            kwargs["BillingMode"] = "PROVISIONED"
            kwargs["ProvisionedThroughput"] = {
                "ReadCapacityUnits": provisioned[1],
                "WriteCapacityUnits": provisioned[0],
            }
        else:
            kwargs["BillingMode"] = "PAY_PER_REQUEST"
        if stream:
            kwargs["StreamSpecification"] = stream
        try:
            created = self.aws.ddb.create_table(**kwargs)["TableDescription"]
        except Exception as e:
            if error_code(e) == "ResourceInUseException":
                # Not this run's table: never delete it.
                self.tables.remove(name)
                raise RuntimeError(
                    f"table {name} already exists, so it is not this run's: left alone, not "
                    "deleted; run again (a new suffix)"
                ) from e
            raise
        t0 = time.monotonic()
        if stream:
            # 6c: how soon DescribeStream lists the new stream's shards, from CreateTable on.
            listed, shards = wait_listed(self.aws.streams, created["LatestStreamArn"], 300, t0)
            self.new_streams[name] = (listed, shards)
        desc = wait_active(self.aws.ddb, name)
        self.check_tags(desc["TableArn"], name)
        return desc

    def check_tags(self, arn: str, name: str) -> None:
        """The tag is set at creation; read it back (retried for about 30 s: ListTagsOfResource
        is eventually consistent). DynamoDB Local has no tagging API (it accepts and drops
        CreateTable's tags): tolerated in endpoint mode only."""
        deadline = time.monotonic() + 30
        while True:
            try:
                tags = self.aws.ddb.list_tags_of_resource(ResourceArn=arn).get("Tags", [])
            except Exception as e:  # noqa: BLE001 - judged by mode below
                if self.aws.s.local:
                    self.tagging_note = f"the emulator does not tag tables ({error_code(e) or e})"
                    return
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
                continue
            if {"Key": TAG, "Value": self.suffix} in tags:
                return
            if self.aws.s.local:
                self.tagging_note = "the emulator dropped the tables' tags"
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"table {name} lacks its tag {TAG}={self.suffix}: {tags}")
            time.sleep(2)

    def create_queue(self, name: str) -> str:
        """CreateQueue returns the URL of an existing queue of that name too: a queue that is
        not new (tagged for another run, or created before the call) is refused, not recorded."""
        try:  # CreateQueue would return an existing queue's URL (and, on moto, retag it)
            existing = self.aws.sqs.get_queue_url(QueueName=name)["QueueUrl"]
        except Exception as e:
            if "NonExistentQueue" not in error_code(e) and "QueueDoesNotExist" not in str(e):
                raise
        else:
            raise RuntimeError(
                f"queue {name} already exists ({existing}), so it is not this run's: left "
                "alone, not deleted; run again (a new suffix)"
            )
        self.queue_names[name] = ""
        called = time.time()
        try:
            url = self.aws.sqs.create_queue(QueueName=name, tags={TAG: self.suffix})["QueueUrl"]
            attrs = self.aws.sqs.get_queue_attributes(
                QueueUrl=url, AttributeNames=["CreatedTimestamp"]
            ).get("Attributes", {})
            tags = self.aws.sqs.list_queue_tags(QueueUrl=url).get("Tags", {})
        except Exception:
            self.queue_names[name] = ""  # find it by name at cleanup (tag-checked there)
            raise
        created = float(attrs.get("CreatedTimestamp", called))
        mine = tags.get(TAG)
        if (mine is not None and mine != self.suffix) or created < called - 120:
            del self.queue_names[name]
            raise RuntimeError(
                f"queue {name} already existed (created {time.ctime(created)}, tag {TAG}="
                f"{mine}): not this run's, left alone; run again (a new suffix)"
            )
        self.queue_names[name] = url
        return url

    def tagged(
        self, kind: str, name: str, read: Callable[[], dict[str, str] | None]
    ) -> bool | None:
        """On AWS, before a delete of a run found by name (resume, discard): whether the
        resource carries TAG=suffix (True), does not (False: skipped, with a message), or is
        gone (None). Retried for about 30 s while it has no tags at all (eventual consistency
        right after a create). Endpoint mode: True (the emulator does not keep tags)."""
        if self.aws.s.local:
            return True
        deadline = time.monotonic() + 30
        while True:
            tags = read()
            if tags is None:
                return None
            if tags.get(TAG) == self.suffix:
                return True
            if tags or time.monotonic() > deadline:
                say(
                    f"{kind} {name}: not tagged {TAG}={self.suffix} ({tags or 'no tags'}): "
                    "not this run's, left alone"
                )
                return False
            time.sleep(3)

    def table_tags(self, name: str) -> dict[str, str] | None:
        try:
            arn = self.aws.ddb.describe_table(TableName=name)["Table"]["TableArn"]
            tags = self.aws.ddb.list_tags_of_resource(ResourceArn=arn).get("Tags", [])
        except Exception as e:
            if error_code(e) == "ResourceNotFoundException":
                return None
            raise
        return {t["Key"]: t["Value"] for t in tags}

    def queue_tags(self, url: str) -> dict[str, str] | None:
        try:
            return dict(self.aws.sqs.list_queue_tags(QueueUrl=url).get("Tags", {}))
        except Exception as e:
            if "NonExistentQueue" in error_code(e) or "QueueDoesNotExist" in str(e):
                return None
            raise

    def owned(self, kind: str, name: str, tags: Callable[[], dict[str, str] | None]) -> bool:
        """Whether a resource found by a run's suffix carries its tag (`tagged`); says so when it
        is already gone."""
        ok = self.tagged(kind, name, tags)
        if ok is None:
            say(f"{kind} {name}: already gone")
        return bool(ok)

    def delete(self, keep: set[str], verify_tags: bool = False) -> list[str]:
        """Deletes every table and queue not in `keep`; returns what could not be deleted. With
        `verify_tags` (a run found by its suffix), on AWS only what is tagged TAG=suffix."""
        left: list[str] = []
        for name in self.tables:
            if name in keep:
                continue
            try:
                if verify_tags and not self.owned(
                    "table", name, lambda name=name: self.table_tags(name)
                ):
                    continue
                delete_table(self.aws.ddb, name, 1800 if not self.aws.s.local else 60)
            except Exception as e:  # noqa: BLE001 - reported as a leftover
                left.append(f"table {name} ({e})")
        for name, url in self.queue_names.items():
            try:
                if not url:  # interrupted while creating it: find it by name
                    url = self.aws.sqs.get_queue_url(QueueName=name)["QueueUrl"]
                if verify_tags and not self.owned(
                    "queue", name, lambda url=url: self.queue_tags(url)
                ):
                    continue
                self.aws.sqs.delete_queue(QueueUrl=url)
                say(f"deleted queue {name}")
            except Exception as e:  # noqa: BLE001 - reported as a leftover, unless gone
                if "NonExistentQueue" in error_code(e) or "QueueDoesNotExist" in str(e):
                    say(f"queue {name}: already gone")
                else:
                    left.append(f"queue {name} ({e})")
        return left


def wait_active(ddb: Any, name: str, timeout: float = 600) -> dict[str, Any]:
    """DescribeTable until ACTIVE; ResourceNotFoundException right after CreateTable is "not
    yet" (DescribeTable is eventually consistent) until the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            t = ddb.describe_table(TableName=name)["Table"]
            status = t["TableStatus"]
        except Exception as e:
            if error_code(e) != "ResourceNotFoundException" or time.monotonic() > deadline:
                raise
            t, status = {}, "not found yet"
        if status == "ACTIVE":
            return t
        if time.monotonic() > deadline:
            raise TimeoutError(f"table {name} not ACTIVE after {timeout:.0f} s ({status})")
        time.sleep(1)


def delete_table(ddb: Any, name: str, timeout: float) -> None:
    """DeleteTable, retried while the table is still being created or updated (a capacity
    change can keep it UPDATING for minutes)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ddb.delete_table(TableName=name)
            say(f"deleted table {name}")
            return
        except Exception as e:  # noqa: BLE001 - retried or re-raised by code
            code = error_code(e)
            if code == "ResourceNotFoundException":
                say(f"table {name}: already gone")
                return
            if code not in ("ResourceInUseException", "LimitExceededException"):
                raise
            if time.monotonic() > deadline:
                raise
            say(f"table {name} is busy ({code}); deleting it again in 10 s")
            time.sleep(10)


# ---------------------------------------------------------------- processes and metrics

CHILDREN: list[subprocess.Popen[bytes]] = []
try:  # loaded here, not in the forked child
    _LIBC: Any = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None
# Metrics are on loopback: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _die_with_parent() -> None:
    """In the child: SIGKILL it when this process dies (Linux PR_SET_PDEATHSIG), so a harness
    killed with SIGKILL leaves no service running. Children are started from the main thread."""
    if _LIBC is not None and sys.platform.startswith("linux"):
        _LIBC.prctl(1, int(signal.SIGKILL))


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        p = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the terminal's Ctrl-C reaches this script only
            preexec_fn=_die_with_parent,
        )
    CHILDREN.append(p)
    return p


def kill_children() -> None:
    for p in CHILDREN:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value of a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def total(m: dict[str, float], name: str) -> float:
    """A metric summed over its label sets."""
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def quantile(m: dict[str, float], name: str, q: float) -> tuple[float | None, float]:
    """(the upper bound of the bucket holding quantile q, the sample count) of a histogram."""
    buckets: list[tuple[float, float]] = []
    for k, v in m.items():
        if k.startswith(name + "_bucket{"):
            le = k.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), v))
    buckets.sort()
    count = m.get(name + "_count", 0.0)
    if not buckets or count <= 0:
        return None, count
    for le, n in buckets:
        if n >= q * count:
            return le, count
    return math.inf, count


class Service:
    """`ddb-aggregator run` for one config; restarted processes of it add their counters up
    (a SIGKILLed process is scraped just before its kill, a stopped one just before SIGTERM)."""

    def __init__(self, name: str, binary: Path, config: Path, env: dict[str, str], logs: Path):
        self.name = name
        self.binary = binary
        self.config = config
        self.env = env
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        self.kills = 0
        self.carried: dict[str, float] = {}
        self.exit_codes: list[int] = []

    @property
    def log(self) -> Path:
        return self.logs / f"{self.name}-{self.starts}.log"

    def start(self) -> None:
        self.port = free_port()
        self.starts += 1
        env = {**self.env, "DDB_AGGREGATOR__METRICS__LISTEN": f"127.0.0.1:{self.port}"}
        cmd = [str(self.binary), "run", "--config", str(self.config), "--log-format", "json"]
        self.proc = spawn(cmd, env, self.log)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name}: ddb-aggregator exited with {self.proc.returncode}; "
                f"log {self.log}:\n{self.tail()}"
            )

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def get(self, path: str, timeout: float = 3) -> tuple[int, str]:
        try:
            url = f"http://127.0.0.1:{self.port}{path}"
            with _OPENER.open(url, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, ""
        except OSError:
            return 0, ""

    def scrape(self) -> dict[str, float]:
        """This process's metrics ({} while it does not answer)."""
        status, text = self.get("/metrics")
        return parse_metrics(text) if status == 200 else {}

    def metrics(self) -> dict[str, float]:
        """Counters and histograms summed over every process of this service, gauges of the
        running one."""
        now = self.scrape()
        out = dict(self.carried)
        for k, v in now.items():
            out[k] = out.get(k, 0.0) + v if _cumulative(k) else v
        return out

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.get("/readyz")[0] == 200:
                return
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def _carry(self) -> None:
        for k, v in self.scrape().items():
            if _cumulative(k):
                self.carried[k] = self.carried.get(k, 0.0) + v

    def kill(self) -> None:
        assert self.proc is not None
        self.check_alive()
        self._carry()
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.kills += 1

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (finish the batch, checkpoint, release leases), SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self._carry()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            code = -9
        self.exit_codes.append(code)
        return code


def _cumulative(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith(("_total", "_bucket", "_sum", "_count"))


# ---------------------------------------------------------------- configs

COMMERCE_HEAD = """# Written by bench/live_aws.py for one run; the rules are those of config/commerce.yaml.
source:
  table: {orders}
  start_position: trim_horizon
state:
  table: {state}
  create_table: false
  lease_duration: {lease}
aggregates:
  table: {aggregates}
dead_letter:
  queue_url: {queue}
reconcile:
  interval: 0s  # no schedule: exactness must come from the stream (requested repairs still run)
metrics:
  listen: 127.0.0.1:9464
"""

TTL_CONFIG = """# Written by bench/live_aws.py: one count that ignores TTL deletes, one that counts them.
source:
  table: {ttl}
  start_position: trim_horizon
state:
  table: {state}
  create_table: false
  lease_duration: {lease}
reconcile:
  interval: 0s
metrics:
  listen: 127.0.0.1:9464
rules:
  - name: ttl-placed
    ttl_deletes: ignore
    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [{{ prefix: "ORDER#" }}] }} }} }} }}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "PLACED" }}
    measures: {{ ordersPlaced: count }}
  - name: ttl-live
    ttl_deletes: count
    filter: {{ dynamodb: {{ Keys: {{ SK: {{ S: [{{ prefix: "ORDER#" }}] }} }} }} }}
    source_key: {{ PK: "CUST#{{customer}}", SK: "ORDER#{{date}}#{{order_id}}" }}
    target: {{ PK: "CUST#{{customer}}", SK: "LIVE" }}
    measures: {{ ordersLive: count }}
"""


def commerce_config(n: Names, queue: str) -> str:
    text = (ROOT / "config" / "commerce.yaml").read_text()
    rules = text[text.index("\nrules:\n") + 1 :]
    head = COMMERCE_HEAD.format(
        orders=n.orders, state=n.state, aggregates=n.aggregates, queue=queue, lease=LEASE
    )
    return head + rules


# ---------------------------------------------------------------- report


@dataclass
class Check:
    id: str
    title: str
    status: str = "skipped"
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Report:
    def __init__(self, suffix: str, s: Settings, kind: str = "run"):
        self.suffix = suffix
        self.s = s
        self.kind = kind
        self.started = time.time()
        self.t0 = time.monotonic()
        self.checks: list[Check] = []
        self.notes: list[str] = []

    def add(self, c: Check) -> Check:
        self.checks = [x for x in self.checks if x.id != c.id]
        self.checks.append(c)
        say(f"{c.status:<8} {c.title}: {c.detail}")
        return c

    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.t0

    def table(self) -> str:
        width = max([len(c.title) for c in self.checks] + [10])
        lines = [
            f"live-aws {self.kind} {self.suffix} ({self.s.describe()}): "
            f"{len(self.checks)} checks in {self.seconds:.0f} s",
            f"  {'':<4}{'result':<9}{'check':<{width + 2}}detail",
        ]
        for c in sorted(self.checks, key=check_order):
            lines.append(f"  {c.id:<4}{c.status:<9}{c.title:<{width + 2}}{c.detail}")
        counts = {s: sum(c.status == s for c in self.checks) for s in STATUS_ORDER}
        lines.append(
            "  "
            + (", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no check finished")
            + " (observed: recorded, not judged; pending: finish with --resume)"
        )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "suffix": self.suffix,
            "mode": "endpoint" if self.s.local else "aws",
            "endpoint": self.s.endpoint,
            "sqs_endpoint": self.s.sqs_endpoint,
            "region": self.s.region,
            "started": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc)
            .isoformat(timespec="seconds")
            .replace("+00:00", "Z"),
            "seconds": round(self.seconds, 1),
            "failed": self.failed(),
            "checks": [c.__dict__ for c in sorted(self.checks, key=check_order)],
            "notes": self.notes,
            "emulator_reference": EMULATOR_REFERENCE,
        }

    def finish(self) -> None:
        print()
        print(self.table(), flush=True)
        if self.s.report:
            self.s.report.parent.mkdir(parents=True, exist_ok=True)
            self.s.report.write_text(json.dumps(self.as_json(), indent=2, default=str) + "\n")
            print(f"  report: {self.s.report}", flush=True)


# ---------------------------------------------------------------- the writes


class Capacity:
    """Write capacity that DynamoDB reports for the workload's own writes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.units = 0.0
        self.writes = 0
        self.reported = 0


class CountingClient:
    """A DynamoDB client whose item writes ask for and add up their ConsumedCapacity (what
    bench/workload.py's apply() calls)."""

    def __init__(self, client: Any, cap: Capacity):
        self.c = client
        self.cap = cap

    def _counted(self, r: dict[str, Any]) -> dict[str, Any]:
        units = r.get("ConsumedCapacity", {}).get("CapacityUnits")
        with self.cap.lock:
            self.cap.writes += 1
            if units is not None:
                self.cap.units += float(units)
                self.cap.reported += 1
        return r

    def put_item(self, **kw: Any) -> dict[str, Any]:
        return self._counted(self.c.put_item(ReturnConsumedCapacity="TOTAL", **kw))

    def update_item(self, **kw: Any) -> dict[str, Any]:
        return self._counted(self.c.update_item(ReturnConsumedCapacity="TOTAL", **kw))

    def delete_item(self, **kw: Any) -> dict[str, Any]:
        return self._counted(self.c.delete_item(ReturnConsumedCapacity="TOTAL", **kw))


class Writer:
    """The commerce workload (bench/workload.py) in a background thread."""

    THREADS = 4

    def __init__(self, aws: Aws, table: str, work: Any, cap: Capacity):
        self.aws = aws
        self.table = table
        self.work = work
        self.cap = cap
        # Made here, in the main thread (a boto3 session is not thread-safe; its clients are).
        self.clients = [CountingClient(aws.client("dynamodb"), cap) for _ in range(self.THREADS)]
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def start(
        self, *, duration: float | None = None, count: int | None = None, rate: float
    ) -> None:
        from bench import workload as wl

        self.stop.clear()
        self.result, self.error = None, None
        handed = iter(self.clients)

        def body() -> None:
            try:
                self.result = wl.generate(
                    self.work,
                    count=count,
                    duration=duration,
                    rate=rate,
                    threads=self.THREADS,
                    client_factory=lambda: next(handed),
                    table=self.table,
                    stop=self.stop,
                )
            except BaseException as e:  # noqa: BLE001 - handed to the main thread by join()
                self.error = e

        self.thread = threading.Thread(target=body, name="writer", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float = 300) -> Any:
        assert self.thread is not None
        deadline = time.monotonic() + timeout
        while self.thread.is_alive():
            if time.monotonic() > deadline:
                self.stop.set()
                raise TimeoutError(f"the writer did not finish within {timeout:.0f} s")
            self.thread.join(timeout=0.5)
        if self.error:
            raise RuntimeError(f"the workload failed: {self.error}") from self.error
        return self.result

    def run(self, *, duration: float | None = None, count: int | None = None, rate: float) -> Any:
        self.start(duration=duration, count=count, rate=rate)
        return self.join()


# ---------------------------------------------------------------- streams


def list_shards(streams: Any, arn: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every shard DescribeStream lists (all pages), and the last page's description."""
    shards: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"StreamArn": arn}
    for _ in range(1000):
        desc = streams.describe_stream(**kwargs)["StreamDescription"]
        shards.extend(desc.get("Shards", []))
        last = desc.get("LastEvaluatedShardId")
        if not last:
            return shards, desc
        kwargs["ExclusiveStartShardId"] = last
    raise RuntimeError(f"DescribeStream of {arn}: more than 1000 pages")


def is_open(shard: dict[str, Any]) -> bool:
    return "EndingSequenceNumber" not in shard.get("SequenceNumberRange", {})


def created_ms(shard_id: str) -> int | None:
    """The creation time DynamoDB puts in a shard id (shardId-<ms>-<hex>), as src/shard_id.rs."""
    parts = shard_id.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def roots(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids = {s["ShardId"] for s in shards}
    return [s for s in shards if s.get("ParentShardId") not in ids]


def creation_times(shards: list[dict[str, Any]]) -> str:
    """'4 shards, 1 creation time' of a stream's root shards."""
    rs = roots(shards)
    times = {created_ms(s["ShardId"]) for s in rs}
    return f"{len(rs)} shard{'s' * (len(rs) != 1)}, {len(times)} creation time{'s' * (len(times) != 1)}"


def wait_listed(
    streams: Any, arn: str, timeout: float, since: float
) -> tuple[float | None, list[dict[str, Any]]]:
    """(seconds from `since` until DescribeStream lists a shard of the stream, its shards);
    (None, []) if not within `timeout`."""
    while True:
        try:
            shards, _ = list_shards(streams, arn)
        except Exception as e:  # noqa: BLE001 - a stream just created may not be found yet
            if error_code(e) != "ResourceNotFoundException":
                raise
            shards = []
        if shards:
            return time.monotonic() - since, shards
        if time.monotonic() - since > timeout:
            return None, []
        time.sleep(0.2)


@dataclass
class ShardRead:
    shard: str
    records: list[dict[str, Any]] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # records per GetRecords page
    closed: bool = False  # read to its end (NextShardIterator absent)
    complete: bool = False  # read to its end, or (an open shard) to its tip

    @property
    def mid_empty(self) -> int:
        """Empty pages followed by a page with records: empty pages before the tip."""
        last = max((i for i, n in enumerate(self.pages) if n), default=-1)
        return sum(1 for n in self.pages[:last] if n == 0)

    @property
    def longest_mid_run(self) -> int:
        last = max((i for i, n in enumerate(self.pages) if n), default=-1)
        run = best = 0
        for n in self.pages[:last]:
            run = run + 1 if n == 0 else 0
            best = max(best, run)
        return best


def read_shard(
    streams: Any,
    arn: str,
    shard: str,
    *,
    deadline: float,
    limit: int = 1000,
    pause: float = 0.0,
    tip_empties: int = 20,
    max_calls: int = 2000,
    open_shard: bool = True,
) -> ShardRead:
    """A bare GetRecords loop from TRIM_HORIZON, as a consumer without ddb-aggregator's logic
    would run it: until the shard's end, `tip_empties` empty pages in a row on an open shard (its
    tip), `max_calls` calls or the deadline. A closed shard (`open_shard=False`) is read to its
    end whatever its empty pages (an empty run there is not a tip)."""
    out = ShardRead(shard)
    it = streams.get_shard_iterator(StreamArn=arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")[
        "ShardIterator"
    ]
    trailing = 0
    while it and len(out.pages) < max_calls and time.monotonic() < deadline:
        try:
            page = streams.get_records(ShardIterator=it, Limit=limit)
        except Exception as e:  # noqa: BLE001 - throttling (the service reads the shard too)
            if error_code(e) not in ("LimitExceededException", "ThrottlingException"):
                raise
            time.sleep(1)
            continue
        n = len(page["Records"])
        out.records.extend(page["Records"])
        out.pages.append(n)
        trailing = trailing + 1 if n == 0 else 0
        it = page.get("NextShardIterator")
        if it is None:
            out.closed = out.complete = True
        elif open_shard and trailing >= tip_empties:
            out.complete = True
            break
        if pause:
            time.sleep(pause)
    return out


def read_stream(
    aws: Aws, arn: str, timeout: float | None = None, limit: int = 1000
) -> list[ShardRead]:
    """Every shard of a stream, read with read_shard (parents first is not needed here), within
    `timeout` (default: 60 s + 10 s a shard, at most 10 min)."""
    shards, _ = list_shards(aws.streams, arn)
    if timeout is None:
        timeout = min(60 + 10 * len(shards), 600)
    deadline = time.monotonic() + timeout
    pause = 0.0 if aws.s.local else 0.25  # AWS allows 5 GetRecords calls a second per shard
    return [
        read_shard(
            aws.streams,
            arn,
            s["ShardId"],
            deadline=deadline,
            limit=limit,
            pause=pause,
            max_calls=2000 if is_open(s) else 100_000,
            open_shard=is_open(s),
        )
        for s in shards
    ]


# ---------------------------------------------------------------- exactness


@dataclass
class Exactness:
    exact: bool
    values: int  # aggregate values in the truth
    targets: int
    summary: str
    seconds: float


def compare_now(aws: Aws, n: Names) -> Exactness:
    from bench import commerce
    from bench.local_aws import scan

    t0 = time.monotonic()
    want = commerce.truth(scan(aws.ddb, n.orders))
    stored = commerce.aggregates_of(scan(aws.ddb, n.aggregates))
    diff = commerce.compare(stored, want)
    return Exactness(
        diff.exact,
        sum(len(a) for a in want.values()),
        len(want),
        diff.summary(),
        time.monotonic() - t0,
    )


def wait_exact(aws: Aws, n: Names, svc: Service, timeout: float) -> tuple[Exactness, float]:
    """Compares until exact or `timeout`; (the last comparison, seconds waited)."""
    t0 = time.monotonic()
    while True:
        svc.check_alive()
        e = compare_now(aws, n)
        waited = time.monotonic() - t0
        if e.exact or waited > timeout:
            return e, waited
        time.sleep(1 if aws.s.local else 3)


def run_reconcile(
    s: Settings, env: dict[str, str], config: Path
) -> tuple[int, dict[str, Any], str]:
    """`reconcile --all --dry-run --output json`: (exit code, summary, stderr tail)."""
    cmd = [str(s.binary), "reconcile", "--config", str(config), "--all", "--dry-run"]
    cmd += ["--output", "json", "--wait", "90s"]
    p = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    CHILDREN.append(p)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    summary: dict[str, Any] = {}
    for line in out.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict) and "summary" in obj:
                summary = obj["summary"]
    tail = "\n".join(err.decode(errors="replace").splitlines()[-5:])
    return p.returncode, summary, tail


def reconcile_check(
    report: Report, cid: str, title: str, s: Settings, env: dict[str, str], config: Path
) -> Check:
    code, summary, tail = run_reconcile(s, env, config)
    c = Check(cid, title, data={"exit": code, "summary": summary})
    drifts = summary.get("drifts")
    if code == 0 and drifts == 0:
        c.status = "pass"
        c.detail = (
            f"exit 0, 0 drifts in {summary.get('targets_checked')} targets "
            f"({summary.get('items_read')} items read in {float(summary.get('seconds', 0)):.1f} s; "
            f"shards judged by the empty-page rule: {len(summary.get('shards_by_empty_pages', []))})"
        )
    else:
        c.status = "fail"
        c.detail = f"exit {code}, drifts {drifts}, summary {summary or '-'}; {tail}"
    return report.add(c)


# ---------------------------------------------------------------- TTL


class Ttl:
    """Check 3: TTL deletes through `ttl_deletes: ignore`. Its own source and state tables (kept
    while DynamoDB has not expired the items), its own service, and a state file for --resume."""

    def __init__(self, aws: Aws, s: Settings, state: dict[str, Any], workdir: Path, name: str):
        self.aws = aws
        self.s = s
        self.state = state
        self.workdir = workdir
        self.config = workdir / "ttl.yaml"
        self.svc = Service(name, s.binary, self.config, aws.service_env(), workdir)

    @staticmethod
    def state_path(suffix: str) -> Path:
        return STATE_DIR / f"{suffix}.json"

    @classmethod
    def new(cls, aws: Aws, s: Settings, n: Names, workdir: Path, account: str) -> Ttl:
        """The run's state (every resource it may create, the account) with the TTL check's,
        saved before anything is created, so that `--resume <suffix> --discard` finds them
        even after a kill -9 during the setup. Cleanup forgets it once everything is deleted."""
        state = {
            "suffix": n.suffix,
            "mode": "endpoint" if s.local else "aws",
            "endpoint": s.endpoint,
            "region": s.region,
            "account": account,
            "run_tables": [n.orders, n.aggregates, n.state, n.probe, n.ttl, n.ttl_state],
            "queue": n.queue,
            "tables": [n.ttl, n.ttl_state],
            "table": n.ttl,
            "state_table": n.ttl_state,
            "expired": TTL_EXPIRED,
            "lasting": TTL_LASTING,
        }
        t = cls(aws, s, state, workdir, "ttl")
        t.save()
        return t

    def begin(self, res: Resources) -> None:
        """Creates the tables, starts the service and writes the items."""
        aws, st = self.aws, self.state
        res.create_table(st["table"], PK_SK, stream=NEW_AND_OLD)
        res.create_table(st["state_table"], SHARD_ID)
        aws.ddb.update_time_to_live(
            TableName=st["table"],
            TimeToLiveSpecification={"Enabled": True, "AttributeName": "expiresAt"},
        )
        self.write_config()
        self.svc.start()
        self.svc.wait_ready()
        now = int(time.time())

        def order(sk: str, expires: int | None) -> dict[str, Any]:
            item = {"PK": {"S": TTL_PK}, "SK": {"S": sk}, "status": {"S": "PENDING"}}
            if expires is not None:
                item["expiresAt"] = {"N": str(expires)}
            return item

        # Expired an hour ago: DynamoDB deletes them when it gets to them.
        for i in range(st["expired"]):
            aws.ddb.put_item(TableName=st["table"], Item=order(f"{TTL_SK}e{i}", now - 3600))
        for i in range(st["lasting"]):
            aws.ddb.put_item(TableName=st["table"], Item=order(f"{TTL_SK}k{i}", now + 30 * 86400))
        # A user's delete: the ignoring rule subtracts it, unlike the TTL deletes.
        aws.ddb.put_item(TableName=st["table"], Item=order(f"{TTL_SK}u0", None))
        aws.ddb.delete_item(
            TableName=st["table"], Key={"PK": {"S": TTL_PK}, "SK": {"S": f"{TTL_SK}u0"}}
        )
        st["written_at"] = now
        self.save()
        say(
            f"TTL: {st['expired']} expired orders, {st['lasting']} lasting ones and one deleted "
            f"by hand in {st['table']}"
        )

    def write_config(self) -> None:
        self.config.write_text(
            TTL_CONFIG.format(ttl=self.state["table"], state=self.state["state_table"], lease=LEASE)
        )

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_path(self.state["suffix"]).write_text(json.dumps(self.state, indent=2) + "\n")

    def forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.state_path(self.state["suffix"]).unlink()

    def expired_left(self) -> int:
        r = self.aws.ddb.query(
            TableName=self.state["table"],
            KeyConditionExpression="PK = :pk AND begins_with(SK, :e)",
            ExpressionAttributeValues={":pk": {"S": TTL_PK}, ":e": {"S": f"{TTL_SK}e"}},
            ConsistentRead=True,
        )
        return int(r["Count"])

    def stored(self) -> tuple[int | None, int | None]:
        def value(sk: str, attr: str) -> int | None:
            item = self.aws.ddb.get_item(
                TableName=self.state["table"],
                Key={"PK": {"S": TTL_PK}, "SK": {"S": sk}},
                ConsistentRead=True,
            ).get("Item", {})
            return int(item[attr]["N"]) if attr in item else None

        return value("PLACED", "ordersPlaced"), value("LIVE", "ordersLive")

    def identities(self) -> tuple[dict[str, int], dict[str, int], bool]:
        """REMOVE records of the TTL table's stream by userIdentity ('none' for a user's): of
        every key, of the expired keys only, and whether the whole stream was read (closed
        shards to their end, open ones to their tip) within the deadline."""
        arn = self.aws.ddb.describe_table(TableName=self.state["table"])["Table"]["LatestStreamArn"]
        out: dict[str, int] = {}
        expired: dict[str, int] = {}
        reads = read_stream(self.aws, arn)
        for r in reads:
            for rec in r.records:
                if rec.get("eventName") != "REMOVE":
                    continue
                u = rec.get("userIdentity")
                key = f"{u.get('Type')}/{u.get('PrincipalId')}" if u else "none"
                out[key] = out.get(key, 0) + 1
                sk = rec.get("dynamodb", {}).get("Keys", {}).get("SK", {}).get("S", "")
                if sk.startswith(f"{TTL_SK}e"):
                    expired[key] = expired.get(key, 0) + 1
        return out, expired, all(r.complete for r in reads)

    def finish(self, report: Report, wait: float, look: bool = True) -> str:
        """Checks 3 and 6e; 'done' (the tables can go) or 'pending' (keep them). Waits up to
        `wait` seconds for DynamoDB to expire the items; `look=False` leaves the check pending
        without looking (--ttl-wait 0: CI exercises --resume, the emulator expiring at once)."""
        st = self.state
        if not self.svc.running():
            self.svc.start()
        deadline = time.monotonic() + wait
        left = self.expired_left() if look else st["expired"]
        while look and left and time.monotonic() < deadline:
            self.svc.check_alive()
            time.sleep(2)
            left = self.expired_left()
        age_h = (time.time() - st.get("written_at", time.time())) / 3600
        if left:
            if age_h > 24 * TTL_GIVE_UP_DAYS:
                report.add(
                    Check(
                        "3",
                        "TTL deletes with ttl_deletes: ignore",
                        "fail",
                        f"{left} of {st['expired']} expired items still there {age_h:.0f} h after "
                        f"they were written (DynamoDB documents expiry within a few days)",
                    )
                )
                self.svc.stop()
                return "done"
            code = self.svc.stop()  # checkpoint what it applied; the next --resume goes on
            report.add(
                Check(
                    "3",
                    "TTL deletes with ttl_deletes: ignore",
                    "pending",
                    (
                        f"{left} of {st['expired']} expired items not yet deleted by DynamoDB "
                        f"after {ago(age_h * 3600)}"
                        if look
                        else "not looked at in this run (--ttl-wait 0)"
                    )
                    + f"; kept {', '.join(st['tables'])}; finish with "
                    f"scripts/live-aws --resume {st['suffix']} (within a day of the deletes, while "
                    f"the stream holds them; the service stopped with exit {code})",
                    {"expired_left": left},
                )
            )
            return "pending"
        # Every expired item is gone: the service must have applied the deletes.
        want = (st["expired"] + st["lasting"], st["lasting"])
        t0 = time.monotonic()
        got = self.stored()
        while got != want and time.monotonic() - t0 < 120:
            self.svc.check_alive()
            time.sleep(1)
            got = self.stored()
        ids, expired_ids, complete = self.identities()
        ttl_identity = "Service/dynamodb.amazonaws.com"
        service = expired_ids.get(ttl_identity, 0)
        others = {k: v for k, v in expired_ids.items() if k != ttl_identity}
        found = sum(expired_ids.values())
        m = self.svc.metrics()
        trimmed = total(m, "ddb_aggregator_trimmed_data_total")
        code = self.svc.stop()
        c = Check("3", "TTL deletes with ttl_deletes: ignore", data={"identities": ids})
        c.data.update(
            {
                "expired_identities": expired_ids,
                "stream_read_complete": complete,
                "placed": got[0],
                "live": got[1],
                "want": want,
                "exit": code,
            }
        )
        if others:
            # DynamoDB deleted them, but not as the TTL service: the rule would count them as
            # a user's deletes.
            c.status = "fail"
            c.detail = (
                f"REMOVE records of the expired items carry userIdentity "
                f"{', '.join(f'{k} ({v})' for k, v in sorted(others.items()))}, not "
                f"{ttl_identity}: ttl_deletes: ignore would count them as a user's deletes"
            )
        elif found < st["expired"] and not complete:
            c.status = "pending"
            c.detail = (
                f"the stream read found {found} of {st['expired']} TTL deletes but did not reach "
                f"every shard's end within its deadline; run scripts/live-aws --resume "
                f"{st['suffix']} again"
            )
            report.add(c)
            return "pending"
        elif found < st["expired"] or trimmed:
            c.status = "skipped"
            c.detail = (
                f"the stream holds {service} of {st['expired']} TTL deletes (trimmed data "
                f"{trimmed:.0f}): resumed too late, the stream keeps records 24 h"
            )
        elif got == want:
            c.status = "pass"
            c.detail = (
                f"{st['expired']} TTL deletes: ordersPlaced stays {got[0]} (ignore; the user's "
                f"delete subtracted), ordersLive {got[1]} (count); all expired when checked, "
                f"{ago(age_h * 3600)} after their writes"
            )
        else:
            c.status = "fail"
            c.detail = (
                f"ordersPlaced {got[0]} (want {want[0]}), ordersLive {got[1]} (want {want[1]}) "
                f"after 120 s; log {self.svc.log}"
            )
        report.add(c)
        report.add(
            Check(
                "6e",
                "TTL service's identity on records",
                "observed",
                ", ".join(f"{v} REMOVE with userIdentity {k}" for k, v in sorted(ids.items()))
                + " (the user's delete: none)",
                {"identities": ids},
            )
        )
        return "done"


# ---------------------------------------------------------------- the run


class Run:
    def __init__(self, s: Settings, aws: Aws, suffix: str, account: str):
        self.s = s
        self.account = account
        self.aws = aws
        self.n = Names(suffix)
        self.report = Report(suffix, s)
        self.res = Resources(aws, suffix)
        self.workdir = STATE_DIR / suffix
        self.config = self.workdir / "commerce.yaml"
        self.svc: Service | None = None
        self.ttl: Ttl | None = None
        self.ttl_outcome = ""
        self.cap = Capacity()
        self.writer: Writer | None = None
        self.lag_samples: list[float] = []
        self.streams_seen: dict[str, str] = {}  # 6b: a new stream's shards
        self.listing: dict[str, float | None] = {}  # 6c: seconds until they were listed
        self.after_workload: dict[str, float] = {}
        self.workload_writes = 0
        self.poison_records = 2
        self.probe_records = 0
        self.probe_lags: list[float] = []

    # ------------------------------------------------ setup

    def setup(self) -> str:
        n, aws = self.n, self.aws
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The state file first: a kill -9 from here on leaves it for --resume --discard.
        self.ttl = Ttl.new(aws, self.s, n, self.workdir, self.account)
        say(f"creating tables and the queue (suffix {n.suffix})")
        self.res.create_table(
            n.orders, PK_SK, stream=NEW_AND_OLD, provisioned=(SOURCE_WCU, SOURCE_RCU)
        )
        self.res.create_table(n.aggregates, PK_SK)
        self.res.create_table(n.state, SHARD_ID)
        self.res.create_table(n.probe, PK_SK, stream=NEW_AND_OLD)
        queue = self.res.create_queue(n.queue)
        if self.res.tagging_note:
            self.report.notes.append(self.res.tagging_note)
        for label, table in (("source (provisioned)", n.orders), ("probe (on-demand)", n.probe)):
            listed, shards = self.res.new_streams[table]
            self.streams_seen[label] = creation_times(shards)
            self.listing[label] = listed
        self.ttl.begin(self.res)
        self.config.write_text(commerce_config(n, queue))
        return queue

    # ------------------------------------------------ check 1

    def workload(self) -> None:
        from bench import workload as wl

        s, aws, n = self.s, self.aws, self.n
        self.svc = Service("main", s.binary, self.config, aws.service_env(), self.workdir)
        svc = self.svc
        svc.start()
        svc.wait_ready()
        work = wl.Workload(customers=60, days=10, seed=int(n.suffix, 16) % 1000)
        self.writer = Writer(aws, n.orders, work, self.cap)
        # Two poison records (a total that is text: non_numeric_sum): the insert, then its delete.
        poison_key = {"PK": {"S": "CUST#poison"}, "SK": {"S": "ORDER#2026-10-02#p1"}}
        aws.ddb.put_item(TableName=n.orders, Item={**poison_key, "total": {"S": "n/a"}})
        say(
            f"workload: {s.rate:g} writes/s for {s.duration:g} s, "
            f"SIGKILL at {', '.join(f'{k * s.duration:.0f}' for k in KILLS)} s"
        )
        t0 = time.monotonic()
        self.writer.start(duration=s.duration, rate=s.rate)
        kills = [t0 + k * s.duration for k in KILLS]
        poison_deleted = False
        while self.writer.alive():
            now = time.monotonic()
            if not poison_deleted and now > t0 + 0.15 * s.duration:
                aws.ddb.delete_item(TableName=n.orders, Key=poison_key)
                poison_deleted = True
            if kills and now >= kills[0]:
                kills.pop(0)
                svc.kill()
                say(f"SIGKILLed the service ({svc.kills}); restarting it")
                time.sleep(0.5)
                svc.start()
            else:
                svc.check_alive()
            m = svc.scrape()
            if "ddb_aggregator_iterator_age_max_seconds" in m:
                self.lag_samples.append(m["ddb_aggregator_iterator_age_max_seconds"])
            time.sleep(0.5 if s.local else 1)
        result = self.writer.join()
        if not poison_deleted:
            aws.ddb.delete_item(TableName=n.orders, Key=poison_key)
        self.workload_writes = result.writes
        ex, waited = wait_exact(aws, n, svc, 120 if s.local else 300)
        m = svc.metrics()
        reconciles = total(m, "ddb_aggregator_reconcile_runs_total")
        c = Check("1", f"exact after {svc.kills} SIGKILLs", data={"writes": result.writes})
        c.data.update({"kills": svc.kills, "values": ex.values, "targets": ex.targets})
        c.data.update({"settled_s": round(waited, 1), "reconcile_runs": reconciles})
        if ex.exact and not reconciles:
            c.status = "pass"
            c.detail = (
                f"{result.writes} writes ({result.writes / max(result.seconds, 1e-9):.1f}/s), "
                f"{svc.kills} SIGKILLs each restarted: {ex.values} values of {ex.targets} "
                f"targets equal a scan's truth, {waited:.1f} s after the last write"
            )
        elif ex.exact:
            c.status = "fail"
            c.detail = f"exact, but a reconcile ran ({reconciles:.0f}): data loss was detected"
        else:
            c.status = "fail"
            c.detail = f"not exact {waited:.0f} s after the last write: {ex.summary}"
        self.report.add(c)
        self.probe_lags = self.probe_lag(10)
        self.after_workload = svc.metrics()

    def probe_lag(self, count: int) -> list[float]:
        """Seconds from an order's PutItem until its customer's aggregate shows it, order by
        order with the service idle: lag measured by the client's clock alone (DynamoDB Local
        dates stream records to the minute, so the service's own lag figures are coarse there)."""
        aws, n = self.aws, self.n
        assert self.svc
        lags: list[float] = []
        target = {"PK": {"S": "CUST#probe"}, "SK": {"S": "PROFILE"}}
        for i in range(count):
            item = {
                "PK": {"S": "CUST#probe"},
                "SK": {"S": f"ORDER#2026-10-03#probe{i}"},
                "status": {"S": "PAID"},
                "total": {"N": "1.50"},
            }
            t0 = time.monotonic()
            aws.ddb.put_item(TableName=n.orders, Item=item)
            self.probe_records += 1
            while time.monotonic() - t0 < 60:
                got = aws.ddb.get_item(TableName=n.aggregates, Key=target, ConsistentRead=True)
                if int(got.get("Item", {}).get("orderCount", {}).get("N", "0")) > i:
                    lags.append(time.monotonic() - t0)
                    break
                time.sleep(0.02 if self.s.local else 0.05)
            else:
                self.svc.check_alive()
                raise TimeoutError(f"probe order {i} not applied within 60 s")
        return lags

    def dead_letters(self, queue: str) -> None:
        """1c: both poison records' letters (reason non_numeric_sum), at least once each."""
        seen: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(seen) < self.poison_records and time.monotonic() < deadline:
            r = self.aws.sqs.receive_message(
                QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=2, VisibilityTimeout=30
            )
            for msg in r.get("Messages", []):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    letter = json.loads(msg["Body"])
                    seen[letter["sequence_number"]] = letter["reason"]["code"]
        codes = sorted(set(seen.values()))
        ok = len(seen) == self.poison_records and codes == ["non_numeric_sum"]
        self.report.add(
            Check(
                "1c",
                "poison records dead-lettered",
                "pass" if ok else "fail",
                f"{len(seen)} of {self.poison_records} poison records in the queue, reasons {codes}",
                {"letters": seen},
            )
        )

    # ------------------------------------------------ check 6a

    def empty_pages(self) -> None:
        arn = self.aws.ddb.describe_table(TableName=self.n.orders)["Table"]["LatestStreamArn"]
        reads = read_stream(self.aws, arn, timeout=90, limit=100)
        records = sum(len(r.records) for r in reads)
        expected = self.workload_writes + self.poison_records + self.probe_records
        mid = sum(r.mid_empty for r in reads)
        full = sum(1 for r in reads for p in r.pages if p)
        tip = sum(len(r.pages) for r in reads) - full - mid
        longest = max((r.longest_mid_run for r in reads), default=0)
        self.report.add(
            Check(
                "6a",
                "empty GetRecords pages mid-shard",
                "observed",
                f"{mid} empty pages before a shard's tip (longest run {longest}), {full} pages "
                f"with records (Limit 100), {tip} empty at the tips, over {len(reads)} "
                f"shard{'s' * (len(reads) != 1)}; {records} of {expected} records found by a "
                "bare GetRecords loop from TRIM_HORIZON",
                {
                    "shards": [
                        {"shard": r.shard, "pages": r.pages, "closed": r.closed} for r in reads
                    ],
                    "records": records,
                    "expected": expected,
                },
            )
        )

    # ------------------------------------------------ check 2

    def reshard(self) -> None:
        title = "exact through a shard split"
        if self.s.local:
            self.report.add(Check("2", title, "skipped", "skipped (emulator cannot split shards)"))
            return
        if not self.s.reshard:
            self.report.add(Check("2", title, "skipped", "skipped (--skip-reshard)"))
            return
        aws, n = self.aws, self.n
        assert self.svc and self.writer
        arn = aws.ddb.describe_table(TableName=n.orders)["Table"]["LatestStreamArn"]
        before, _ = list_shards(aws.streams, arn)
        open_before = sum(map(is_open, before))
        say(
            f"reshard: raising {n.orders} to {RESHARD_WCU} WCU; waiting up to "
            f"{RESHARD_WAIT // 60} min for its stream to list more open shards"
        )
        aws.ddb.update_table(
            TableName=n.orders,
            ProvisionedThroughput={
                "ReadCapacityUnits": SOURCE_RCU,
                "WriteCapacityUnits": RESHARD_WCU,
            },
        )
        t0 = time.monotonic()
        self.writer.start(duration=RESHARD_WAIT, rate=RESHARD_RATE)
        split_after = None
        shards = before
        while time.monotonic() - t0 < RESHARD_WAIT:
            self.svc.check_alive()
            shards, _ = list_shards(aws.streams, arn)
            if sum(map(is_open, shards)) > open_before:
                split_after = time.monotonic() - t0
                break
            time.sleep(15)
        self.writer.stop.set()
        self.writer.join()
        # The capacity change may keep the table UPDATING after the split; check 4 needs it ACTIVE.
        wait_active(aws.ddb, n.orders, RESHARD_WAIT)
        say("reshard: writing on for 30 s")
        self.writer.run(duration=30, rate=self.s.rate)
        ex, waited = wait_exact(aws, n, self.svc, 300)
        data = {
            "open_before": open_before,
            "open_after": sum(map(is_open, shards)),
            "shards_listed": len(shards),
            "split_after_s": split_after,
        }
        if not ex.exact:
            status, detail = "fail", f"not exact {waited:.0f} s after the writes: {ex.summary}"
        elif split_after is None:
            status = "observed"
            detail = (
                f"no split within {RESHARD_WAIT // 60} min of raising to {RESHARD_WCU} WCU "
                f"({open_before} open shards); still exact ({ex.values} values)"
            )
        else:
            status = "pass"
            detail = (
                f"{open_before} -> {data['open_after']} open shards {split_after / 60:.1f} min "
                f"after raising to {RESHARD_WCU} WCU; {ex.values} values exact"
            )
        self.report.add(Check("2", title, status, detail, data))

    # ------------------------------------------------ check 4

    def stream_switch(self) -> None:
        aws, n, s = self.aws, self.n, self.s
        assert self.svc and self.writer
        title = "stream disabled and enabled again"
        old = aws.ddb.describe_table(TableName=n.orders)["Table"]["LatestStreamArn"]
        runs_before = total(self.svc.metrics(), "ddb_aggregator_reconcile_runs_total")
        say("stream: disabling it")
        update_stream(aws.ddb, n.orders, {"StreamEnabled": False})
        wait_active(aws.ddb, n.orders)
        after = aws.ddb.describe_table(TableName=n.orders)["Table"]
        latest = after.get("LatestStreamArn")
        old_status, closed, listed = "", 0, 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            shards, desc = list_shards(aws.streams, old)
            old_status = desc.get("StreamStatus", "")
            closed, listed = sum(not is_open(x) for x in shards), len(shards)
            if old_status == "DISABLED" and closed == listed:
                break
            time.sleep(2)
        if latest == old:
            seen = "kept the old ARN"
        elif latest is None:
            seen = "no LatestStreamArn"
        else:
            seen = "another ARN"
        self.report.add(
            Check(
                "6d",
                "LatestStreamArn after disable",
                "observed",
                f"DescribeTable: {seen} (StreamSpecification "
                f"{after.get('StreamSpecification', 'absent')}); old stream {old_status}, "
                f"{closed} of {listed} shards closed",
                {"latest": latest, "old": old, "old_status": old_status},
            )
        )
        gap = max(10, int(s.rate * 3))
        self.writer.run(count=gap, rate=s.rate)
        say(f"stream: {gap} writes while it is off (never streamed); enabling it again")
        t_enable = time.monotonic()
        update_stream(aws.ddb, n.orders, NEW_AND_OLD)
        new = old
        while new == old and time.monotonic() - t_enable < 120:
            new = aws.ddb.describe_table(TableName=n.orders)["Table"].get("LatestStreamArn", old)
            if new == old:
                time.sleep(0.5)
        listed, new_shards = wait_listed(aws.streams, new, 300, t_enable)
        wait_active(aws.ddb, n.orders)
        self.streams_seen["source after re-enable"] = creation_times(new_shards)
        self.listing["source after re-enable"] = listed
        self.writer.run(duration=5, rate=s.rate)
        # The service must follow the new stream: the state table names the stream it reads.
        t0 = time.monotonic()
        followed = None
        while time.monotonic() - t0 < 120:
            self.svc.check_alive()
            item = aws.ddb.get_item(
                TableName=n.state, Key={"shard_id": {"S": "stream-read"}}, ConsistentRead=True
            ).get("Item", {})
            if item.get("followed_arn", {}).get("S") == new:
                followed = time.monotonic() - t_enable
                break
            time.sleep(1)
        # Then the requested reconcile repairs what was written while no stream was on.
        ex, waited = wait_exact(self.aws, n, self.svc, 180 if s.local else 300)
        deadline = time.monotonic() + 120
        m = self.svc.metrics()
        while m.get("ddb_aggregator_reconcile_requested", 0) and time.monotonic() < deadline:
            time.sleep(1)
            m = self.svc.metrics()
        runs = total(m, "ddb_aggregator_reconcile_runs_total") - runs_before
        data = {
            "old": old,
            "new": new,
            "gap_writes": gap,
            "followed_after_s": followed,
            "reconcile_runs": runs,
            "exact_after_s": round(waited, 1),
        }
        if new == old:
            status, detail = "fail", "enabling the stream again gave no new LatestStreamArn"
        elif followed is None:
            status, detail = "fail", f"the service did not follow the new stream in 120 s: {new}"
        elif not ex.exact:
            status, detail = "fail", f"not exact {waited:.0f} s after the switch: {ex.summary}"
        elif runs < 1:
            status, detail = "fail", "exact, but no reconcile ran: the gap was not repaired"
        else:
            status = "pass"
            detail = (
                f"followed the new stream {followed:.0f} s after it was enabled; {gap} writes made "
                f"while it was off repaired by the requested reconcile ({runs:.0f} run); "
                f"{ex.values} values exact"
            )
        self.report.add(Check("4", title, status, detail, data))

    # ------------------------------------------------ checks 5 and 6

    def observed(self) -> None:
        assert self.svc
        m = self.after_workload
        ref = EMULATOR_REFERENCE
        where = "this run (emulator)" if self.s.local else "AWS"
        p50, count = quantile(m, "ddb_aggregator_end_to_end_lag_seconds", 0.5)
        p99, _ = quantile(m, "ddb_aggregator_end_to_end_lag_seconds", 0.99)
        p50 = None if p50 is None or math.isinf(p50) else p50
        p99 = None if p99 is None or math.isinf(p99) else p99
        age_max = max(self.lag_samples, default=0.0)
        age_med = statistics.median(self.lag_samples) if self.lag_samples else 0.0
        probe_p50 = statistics.median(self.probe_lags) if self.probe_lags else None
        probe_max = max(self.probe_lags, default=None)
        data = {
            "probe_p50_s": None if probe_p50 is None else round(probe_p50, 3),
            "probe_max_s": None if probe_max is None else round(probe_max, 3),
            "probes": len(self.probe_lags),
            "iterator_age_max_s": age_max,
            "iterator_age_median_s": age_med,
            "lag_p50_le_s": p50,
            "lag_p99_le_s": p99,
            "lag_records": count,
        }
        self.report.add(
            Check(
                "5a",
                "lag",
                "observed",
                f"{where}: {lag_text(data)}; emulator reference {ref['date']}: {lag_text(ref)} "
                "(DynamoDB Local dates records to the minute, so there the figures from record "
                "times read up to 60 s high)",
                {**data, "reference": ref},
            )
        )
        wcu = total(m, "ddb_aggregator_write_capacity_units_total")
        writes = max(self.workload_writes + self.poison_records + self.probe_records, 1)
        src = self.cap.units / self.cap.reported if self.cap.reported else None
        src_text = f"{src:.2f}" if src is not None else "not reported"
        self.report.add(
            Check(
                "5b",
                "write capacity",
                "observed",
                f"{where}: aggregates {wcu / writes:.3f} WCU per source write ({wcu:.0f} WCU, "
                f"{writes} writes, 2 rules); the source writes {src_text} WCU each "
                f"(ConsumedCapacity); emulator reference {ref['date']}: "
                f"{ref['aggregate_wcu_per_write']} and {ref['source_wcu_per_write']}",
                {
                    "aggregate_wcu": wcu,
                    "source_writes": writes,
                    "aggregate_wcu_per_write": wcu / writes,
                    "source_wcu_per_write": src,
                    "reference": ref,
                },
            )
        )
        self.report.add(
            Check(
                "6b",
                "a new stream's shards' creation times",
                "observed",
                "; ".join(f"{k}: {v}" for k, v in self.streams_seen.items()),
                dict(self.streams_seen),
            )
        )
        listing = {k: (None if v is None else round(v, 1)) for k, v in self.listing.items()}
        self.report.add(
            Check(
                "6c",
                "a new stream's listing lag",
                "observed",
                "DescribeStream listed a new stream's shards "
                + "; ".join(
                    f"{k}: {'not within 300 s' if v is None else f'{v} s'}"
                    for k, v in listing.items()
                )
                + " after the CreateTable or UpdateTable call returned",
                listing,
            )
        )

    # ------------------------------------------------ all of it

    def main(self) -> int:
        """Every check, then the cleanup; the exit code. SIGINT and SIGTERM raise Interrupted
        (main() installs the handler), which ends the checks but never the cleanup."""
        self.report.notes.append(f"service logs and configs: {self.workdir.relative_to(ROOT)}/")
        interrupted: Interrupted | None = None
        try:
            queue = self.setup()
            self.workload()
            env = self.aws.service_env()
            reconcile_check(
                self.report, "1b", "reconcile --all --dry-run", self.s, env, self.config
            )
            self.dead_letters(queue)
            self.empty_pages()
            self.reshard()
            self.stream_switch()
            reconcile_check(
                self.report, "4b", "reconcile --all --dry-run, after", self.s, env, self.config
            )
            assert self.ttl
            self.ttl_outcome = self.ttl.finish(
                self.report, self.s.ttl_wait, look=self.s.ttl_wait > 0
            )
            self.observed()
        except Interrupted as e:
            interrupted = e
            self.report.notes.append(f"interrupted by {e}: stopped early and cleaned up")
        except Exception as e:  # noqa: BLE001 - reported as a failed check, then cleaned up
            traceback.print_exc()
            self.report.add(Check("!", "the run itself", "fail", f"{type(e).__name__}: {e}"))
        finally:
            with signals(_cleaning_up):
                self.cleanup(interrupted is not None)
        if (
            interrupted is None
            and self.ttl_outcome == "pending"
            and self.s.local
            and not self.s.keep
        ):
            # CI: the emulator expires items itself, so --resume can be exercised at once.
            say(f"endpoint mode: finishing the pending TTL check: --resume {self.n.suffix}")
            try:
                if resume(self.s, self.aws, self.n.suffix, self.report) == "done":
                    self.report.notes.append(f"check 3 finished by --resume {self.n.suffix}")
            except Interrupted as e:
                interrupted = e
        self.report.finish()
        if interrupted is not None:
            return 128 + interrupted.signum
        return 1 if self.report.failed() else 0

    def cleanup(self, interrupted: bool) -> None:
        if self.writer:
            self.writer.stop.set()
        for svc in (self.svc, self.ttl.svc if self.ttl else None):
            if svc is not None and svc.running():
                code = svc.stop(timeout=30)
                say(f"stopped the {svc.name} service (exit {code})")
        kill_children()
        if self.writer and self.writer.thread:
            self.writer.thread.join(timeout=10)
        keep: set[str] = set()
        if self.ttl_outcome == "pending" and not interrupted:
            keep = set(self.ttl.state["tables"]) if self.ttl else set()
        if self.s.keep:
            # The state file stays: --resume <suffix> --discard deletes them later.
            self.report.notes.append(
                "--keep: nothing deleted: tables "
                + ", ".join(self.res.tables)
                + "; queue "
                + ", ".join(self.res.queue_names)
                + f"; delete them with {discard_command(self.s, self.n.suffix)}"
            )
            return
        left = self.res.delete(keep)
        if keep:
            self.report.notes.append(
                f"kept for --resume {self.n.suffix}: {', '.join(sorted(keep))} "
                f"(state: {Ttl.state_path(self.n.suffix).relative_to(ROOT)})"
            )
        elif not left and self.ttl:
            self.ttl.forget()  # everything is deleted
        if left:
            self.report.add(Check("!!", "cleanup", "fail", leftover_message(self.s, self.n, left)))


def discard_command(s: Settings, suffix: str) -> str:
    where = f" --endpoint {s.endpoint} --sqs-endpoint {s.sqs_endpoint}" if s.local else ""
    return f"scripts/live-aws --resume {suffix} --discard{where}"


def leftover_message(s: Settings, n: Names, left: list[str]) -> str:
    hourly = RESHARD_WCU * PRICE["wcu_hour"] + SOURCE_RCU * PRICE["rcu_hour"]
    return (
        f"not deleted, still there: {'; '.join(left)}. The orders table {n.orders} may still be "
        f"provisioned at {RESHARD_WCU:,} WCU (about ${hourly:.2f} an hour on AWS) if the reshard "
        f"raised it. The state file stays; delete them with {discard_command(s, n.suffix)} "
        f"(it deletes only what is tagged {TAG}={n.suffix})"
    )


def update_stream(ddb: Any, table: str, spec: dict[str, Any], timeout: float = 900) -> None:
    """UpdateTable StreamSpecification, retried while the table or its old stream is busy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ddb.update_table(TableName=table, StreamSpecification=spec)
            return
        except Exception as e:  # noqa: BLE001 - retried or re-raised by code
            code = error_code(e)
            if code == "ValidationException":
                # A retry after a lost response finds the change made: done. Else a real error.
                now = ddb.describe_table(TableName=table)["Table"].get("StreamSpecification", {})
                if spec.get("StreamEnabled"):
                    if now.get("StreamEnabled") and now.get("StreamViewType") == spec.get(
                        "StreamViewType"
                    ):
                        return
                elif not now.get("StreamEnabled"):
                    return
                raise
            if code not in ("ResourceInUseException", "LimitExceededException"):
                raise
            if time.monotonic() > deadline:
                raise
            say(f"UpdateTable {table}: {code} ({e}); again in 10 s")
            time.sleep(10)


# ---------------------------------------------------------------- resume


def load_state(suffix: str) -> dict[str, Any]:
    path = Ttl.state_path(suffix)
    if not path.exists():
        known = sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []
        raise Usage(
            f"no pending TTL check {suffix!r} ({path.relative_to(ROOT)} does not exist); "
            f"pending: {', '.join(known) or 'none'}"
        )
    return json.loads(path.read_text())


def leftovers(aws: Aws, suffix: str) -> Resources:
    """Every resource a run with this suffix may have created (deleting a missing one is fine)."""
    n = Names(suffix)
    res = Resources(aws, suffix)
    res.tables = [n.orders, n.aggregates, n.state, n.probe, n.ttl, n.ttl_state]
    res.queue_names = {n.queue: ""}
    return res


def resume(s: Settings, aws: Aws, suffix: str, report: Report, discard: bool = False) -> str:
    """Finishes a pending TTL check: 'done' (its tables deleted, and whatever else of the run is
    left) or 'pending' (kept). With `discard`, deletes whatever is left of the run without
    checking (also after a kill -9, and without the state file). On AWS only what is tagged
    TAG=suffix is deleted. The state file goes once nothing is left."""
    path = Ttl.state_path(suffix)
    state = None if discard and not path.exists() else load_state(suffix)
    workdir = STATE_DIR / suffix
    workdir.mkdir(parents=True, exist_ok=True)
    ttl = None
    if state is not None:
        ttl = Ttl(aws, s, state, workdir, "ttl-resume")
        ttl.write_config()
    outcome = "pending"
    interrupted: Interrupted | None = None
    try:
        if discard:
            outcome = "done"
            report.add(Check("3", "TTL deletes with ttl_deletes: ignore", "skipped", "--discard"))
        else:
            assert ttl is not None
            # --ttl-wait 0 means "do not wait in the run"; a resume still waits a while.
            outcome = ttl.finish(report, s.ttl_wait or (120.0 if s.local else 60.0))
    except Interrupted as e:
        interrupted = e
        report.notes.append(f"interrupted by {e}: the TTL tables stay for another --resume")
    except Exception as e:  # noqa: BLE001 - reported, the tables stay for another --resume
        traceback.print_exc()
        report.add(Check("!", "resume", "fail", f"{type(e).__name__}: {e}"))
    finally:
        with signals(_cleaning_up):
            if ttl is not None and ttl.svc.running():
                ttl.svc.stop(timeout=30)
            kill_children()
            if outcome == "done" and interrupted is None:
                # The TTL tables and whatever the main run left (deleting a missing one is fine).
                left = leftovers(aws, suffix).delete(set(), verify_tags=True)
                if left:
                    report.add(
                        Check("!!", "cleanup", "fail", leftover_message(s, Names(suffix), left))
                    )
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
    if interrupted is not None:
        raise interrupted
    return outcome


# ---------------------------------------------------------------- plan and cost


def estimate(s: Settings) -> tuple[list[tuple[str, str, float]], float]:
    """(item, quantity, dollars) rows and their sum, for a run on AWS with these settings.
    Upper bounds where the service decides (it coalesces, so it usually writes far less)."""
    writes = s.rate * s.duration + 2  # the workload and two poison records
    writes += max(10, s.rate * 3) + s.rate * 5  # the stream switch
    run_s = s.duration + 300 + s.ttl_wait  # set-up, settling, reconciles, the switch
    if s.reshard:
        writes += RESHARD_RATE * RESHARD_WAIT + s.rate * 30
        run_s += RESHARD_WAIT + 300
    hours = math.ceil(run_s / 3600)  # provisioned capacity is billed by the hour
    shards = 4 if s.reshard else 2  # the source's and the TTL table's, at most
    provisioned = (SOURCE_WCU * PRICE["wcu_hour"] + SOURCE_RCU * PRICE["rcu_hour"]) * hours
    wru = writes * 2 * 2 + run_s * shards * 2  # 2 rules x 2 KB items; leases, checkpoints
    rru = 200 * (writes * 300 / 4096 + 50)  # consistent scans of both tables, reconciles
    calls = run_s * shards * 10 + 3000  # a shard is polled at most 10 times a second
    rows = [
        (
            f"source table, {SOURCE_WCU} WCU + {SOURCE_RCU} RCU provisioned",
            f"{hours} h, {writes:,.0f} writes",
            provisioned,
        )
    ]
    if s.reshard:
        rows.append(
            (
                f"reshard: {RESHARD_WCU} WCU, billed by the hour",
                f"<= {RESHARD_HOURS} h",
                (RESHARD_WCU - SOURCE_WCU) * PRICE["wcu_hour"] * RESHARD_HOURS,
            )
        )
    rows += [
        ("aggregate and lease writes, on-demand", f"<= {wru:,.0f} WRU", wru * PRICE["wru"]),
        ("scans and reconciles, on-demand", f"<= {rru:,.0f} RRU", rru * PRICE["rru"]),
        ("DynamoDB Streams GetRecords", f"<= {calls:,.0f} calls", calls * PRICE["stream_read"]),
        ("SQS requests", "<= 200", 200 * PRICE["sqs_request"]),
    ]
    return rows, sum(r[2] for r in rows)


def plan(s: Settings, n: Names, who: str) -> str:
    rows, dollars = estimate(s)
    lines = [
        f"live-aws: plan ({s.describe()}{', ' + who if who else ''})",
        f"  creates, tagged {TAG}={n.suffix}, and deletes at the end (on failure and Ctrl-C too):",
        f"    table {n.orders:<40} source: stream NEW_AND_OLD_IMAGES, provisioned "
        f"{SOURCE_WCU} WCU / {SOURCE_RCU} RCU",
        f"    table {n.aggregates:<40} aggregates, on-demand",
        f"    table {n.state:<40} leases and checkpoints, on-demand",
        f"    table {n.probe:<40} on-demand with a stream, only described (its shards)",
        f"    table {n.ttl:<40} TTL check: stream, TTL on expiresAt, on-demand",
        f"    table {n.ttl_state:<40} TTL check's leases (the two TTL tables stay until",
        "                                                   DynamoDB expires the items: --resume)",
        f"    queue {n.queue:<40} SQS dead-letter queue",
        f"  runs {s.binary.relative_to(ROOT) if s.binary.is_relative_to(ROOT) else s.binary}:",
        f"    1. {s.rate * s.duration:,.0f} commerce writes ({s.rate:g}/s for {s.duration:g} s) "
        f"with the service SIGKILLed {len(KILLS)} times; exact vs a scan; reconcile --all "
        "--dry-run; 2 poison records dead-lettered",
        "    2. "
        + (
            "skipped on the emulator (it cannot split shards)"
            if s.local
            else (
                f"raise the source to {RESHARD_WCU} WCU so its shards split (wait up to "
                f"{RESHARD_WAIT // 60} min, {RESHARD_RATE:g} writes/s meanwhile); exact"
                if s.reshard
                else "skipped (--skip-reshard)"
            )
        ),
        f"    3. TTL: {TTL_EXPIRED} expired items through ttl_deletes: ignore and count "
        + (
            f"(waits up to {s.ttl_wait:g} s for the expiry, else pending)"
            if s.ttl_wait
            else "(left pending: --ttl-wait 0)"
        ),
        "    4. disable and enable the source's stream; the service follows; reconcile repairs",
        "    5./6. observed: lag, WCU, empty pages mid-shard, shard creation times, listing lag,",
        "       LatestStreamArn after disable, the TTL service's identity",
    ]
    title = "  cost on AWS" if not s.local else "  cost: $0 here (emulators); the same run on AWS"
    lines.append(
        f"{title}, an ESTIMATE at us-east-1 prices of 2025 (other regions differ; the free tier "
        "may cover some):"
    )
    for item, qty, usd in rows:
        lines.append(f"    {item:<52} {qty:<26} ${usd:.4f}")
    lines.append(f"    {'total: an estimate, an upper bound of about':<52} {'':<26} ${dollars:.2f}")
    return "\n".join(lines)


def confirm(s: Settings, what: str) -> None:
    if s.yes:
        return
    if not sys.stdin.isatty():
        print(
            "live-aws: stdin is not a terminal, so there is nobody to confirm: "
            "pass --yes to run without the question",
            file=sys.stderr,
        )
        raise SystemExit(2)
    answer = input(f"{what} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        print("live-aws: nothing done")
        raise SystemExit(0)


# ---------------------------------------------------------------- credentials and main


def credentials(s: Settings) -> str | None:
    """In AWS mode: who the default chain's credentials are ('' when STS cannot say), or None
    when the chain finds none. In endpoint mode: dummy ones, always."""
    if s.local:
        for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            os.environ.pop(k, None)
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": DUMMY_KEY,
                "AWS_SECRET_ACCESS_KEY": DUMMY_KEY,
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_REGION": s.region,
            }
        )
        return "dummy credentials"
    import boto3

    session = boto3.session.Session(region_name=s.region)
    try:
        creds = session.get_credentials()
    except Exception as e:  # noqa: BLE001 - a broken profile is "no usable credentials"
        print(f"live-aws: the AWS credential chain failed: {e}")
        return None
    if creds is None:
        return None
    try:
        from botocore.config import Config

        quick = Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2})
        me = session.client("sts", config=quick).get_caller_identity()
        return f"account {me['Account']}, {me['Arn']}"
    except Exception as e:  # noqa: BLE001 - shown in the plan; the run's first call would fail too
        raise SystemExit(
            f"live-aws: credentials found, but STS GetCallerIdentity with them failed: {e}"
        ) from e


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/live-aws",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  scripts/live-aws                                  # your AWS account (asks first; ~25 min, up to ~$2.60)
  scripts/live-aws --skip-reshard                   # a few minutes, a few cents
  scripts/live-aws --resume 1a2b3c4d                # finish a pending TTL check, delete its tables
  DDB_LOCAL_PORT=8111 SQS_LOCAL_PORT=9435 scripts/local-aws start
  SQS_LOCAL_PORT=9435 scripts/live-aws --endpoint http://127.0.0.1:8111 --yes   # CI, ~1 min

AWS credentials and region come from boto3's default chain (environment, profiles, SSO, roles);
without credentials it says so and exits 0. It never runs without --yes or a "y" on a terminal.
Docs: docs/live-aws.md.""",
    )
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="DynamoDB and DynamoDB Streams endpoint of local emulators (loopback only); "
        "dummy credentials are used",
    )
    p.add_argument(
        "--sqs-endpoint",
        metavar="URL",
        help="SQS endpoint with --endpoint (default http://127.0.0.1:$SQS_LOCAL_PORT)",
    )
    p.add_argument(
        "--region",
        help="AWS region (default $AWS_REGION, $AWS_DEFAULT_REGION, the profile's region, "
        "else us-east-1)",
    )
    p.add_argument("--yes", action="store_true", help="run without asking for confirmation")
    p.add_argument("--report", metavar="PATH", type=Path, help="write the results as JSON here")
    p.add_argument(
        "--resume",
        metavar="SUFFIX",
        help="finish the pending TTL check of an earlier run (its 8 hex digits) and delete its tables",
    )
    p.add_argument(
        "--discard",
        action="store_true",
        help="with --resume: delete the pending check's tables without checking",
    )
    p.add_argument(
        "--keep", action="store_true", help="delete nothing at the end (debugging; delete by hand)"
    )
    p.add_argument(
        "--skip-reshard",
        action="store_true",
        help=f"skip check 2 (on AWS it raises the source to {RESHARD_WCU} WCU, up to about $2.55 of "
        "the estimate (2 hours billed), "
        f"and waits up to {RESHARD_WAIT // 60} min)",
    )
    p.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="the workload of check 1 (default 60 on AWS, 20 on the emulator)",
    )
    p.add_argument(
        "--rate",
        type=float,
        metavar="WRITES",
        help="writes per second (default 10 on AWS, 20 on the emulator)",
    )
    p.add_argument(
        "--ttl-wait",
        type=float,
        metavar="SECONDS",
        help="how long to wait for DynamoDB to expire the TTL items before the check is "
        "pending (default 60 on AWS, 120 on the emulator; 0 exercises --resume)",
    )
    p.add_argument(
        "--bin",
        metavar="PATH",
        help=f"the ddb-aggregator binary (default {DEFAULT_BIN}, built with cargo build "
        "--locked if missing)",
    )
    return p


def settings(a: argparse.Namespace) -> Settings:
    endpoint = sqs = None
    if a.endpoint:
        endpoint = loopback_url(a.endpoint, "--endpoint")
        sqs_url = a.sqs_endpoint
        if not sqs_url:
            port = os.environ.get("SQS_LOCAL_PORT")
            if not port:
                raise Usage(
                    "--endpoint needs --sqs-endpoint URL or SQS_LOCAL_PORT in the environment"
                )
            sqs_url = f"http://127.0.0.1:{port}"
        sqs = loopback_url(sqs_url, "the SQS endpoint")
    elif a.sqs_endpoint:
        raise Usage("--sqs-endpoint goes with --endpoint")
    else:
        redirect = sorted(k for k in os.environ if k.startswith("AWS_ENDPOINT_URL"))
        if redirect:
            raise Usage(
                f"{', '.join(redirect)} set: without --endpoint this runs on AWS, and those would "
                "send its calls elsewhere. Unset them, or give --endpoint for the emulators"
            )
    local = endpoint is not None
    region = a.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region and not local:
        import boto3

        region = boto3.session.Session().region_name  # the profile's region, as boto3 finds it
    region = region or "us-east-1"
    duration = a.duration if a.duration is not None else (20.0 if local else 60.0)
    rate = a.rate if a.rate is not None else (20.0 if local else 10.0)
    if not 5 <= duration <= 3600:
        raise Usage("--duration must be 5 to 3600 seconds")
    if not 1 <= rate <= 200:
        raise Usage("--rate must be 1 to 200 writes per second")
    ttl_wait = a.ttl_wait if a.ttl_wait is not None else (120.0 if local else 60.0)
    if not 0 <= ttl_wait <= 3600:
        raise Usage("--ttl-wait must be 0 to 3600 seconds")
    binary = Path(a.bin) if a.bin else ROOT / DEFAULT_BIN
    build = False
    if not binary.is_file():
        if a.bin:
            raise Usage(f"--bin {a.bin}: no such file")
        build = True
    if a.discard and not a.resume:
        raise Usage("--discard goes with --resume")
    if a.resume is not None and not SUFFIX_RE.fullmatch(a.resume):
        raise Usage(f"--resume takes a run's suffix, 8 hex digits (0-9, a-f), got {a.resume!r}")
    return Settings(
        endpoint=endpoint,
        sqs_endpoint=sqs,
        region=region,
        duration=duration,
        rate=rate,
        reshard=not a.skip_reshard,
        ttl_wait=ttl_wait,
        keep=a.keep,
        yes=a.yes,
        report=a.report,
        binary=binary,
        build=build,
    )


def reachable(aws: Aws) -> None:
    """In endpoint mode: both emulators answer, else a clear message (exit 1)."""
    try:
        aws.ddb.list_tables(Limit=1)
        aws.sqs.list_queues()
    except Exception as e:  # noqa: BLE001 - the message says what to do
        raise SystemExit(
            f"live-aws: the emulators do not answer ({e}); start them, e.g. "
            "DDB_LOCAL_PORT=8111 SQS_LOCAL_PORT=9435 scripts/local-aws start"
        ) from e


def build(s: Settings) -> None:
    if not s.build:
        return
    say(f"{DEFAULT_BIN} is missing: cargo build --locked")
    subprocess.run(["cargo", "build", "--locked"], cwd=ROOT, check=True)
    if not s.binary.is_file():
        raise SystemExit(f"live-aws: cargo build did not produce {s.binary}")


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        s = settings(a)
    except Usage as e:
        print(f"live-aws: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return start(a, s)
    except Interrupted as e:
        print(f"\nlive-aws: interrupted by {e}", file=sys.stderr)
        return 128 + e.signum
    except Usage as e:
        print(f"live-aws: {e}", file=sys.stderr)
        return 2


def start(a: argparse.Namespace, s: Settings) -> int:
    who = credentials(s)
    if who is None:
        print(
            "live-aws: no AWS credentials found (boto3's default chain: environment, "
            "~/.aws/credentials and config, SSO, container and instance roles), so nothing was "
            "run. Configure credentials to test on your account, or use --endpoint for the "
            "local emulators."
        )
        return 0
    aws = Aws(s)
    if s.local:
        reachable(aws)
    account = aws.account()
    if a.resume:
        return resume_command(a, s, aws, who, account)
    suffix = secrets.token_hex(4)
    print(plan(s, Names(suffix), who))
    confirm(s, "Create these resources and run?")
    build(s)
    return Run(s, aws, suffix, account).main()


def resume_command(a: argparse.Namespace, s: Settings, aws: Aws, who: str, account: str) -> int:
    mode = "endpoint" if s.local else "aws"
    state: dict[str, Any] | None = None
    if Ttl.state_path(a.resume).exists() or not a.discard:
        state = load_state(a.resume)
    if state is not None:
        if state["mode"] != mode or (not s.local and state["region"] != s.region):
            where = f" in {state['region']}" if state["mode"] == "aws" else ""
            raise Usage(
                f"{a.resume} ran in {state['mode']} mode{where}: resume it the same way "
                "(--endpoint for the emulators, --region for AWS)"
            )
        if state.get("account", account) != account:
            raise Usage(
                f"{a.resume} ran in AWS account {state['account']}; these credentials are of "
                f"account {account}: resume it with that account's credentials"
            )
    if a.discard:
        n = Names(a.resume)
        what = (
            f"delete whatever is left of run {a.resume} without checking: tables "
            f"{n.table('{orders,aggregates,state,probe,ttl,ttl-state}')}, queue {n.queue}"
            + (
                f" (on AWS only those tagged {TAG}={a.resume})"
                if not s.local
                else " (emulators: no tag check)"
            )
            + ("" if state is not None else "; no state file: found by the suffix")
        )
    else:
        assert state is not None
        what = (
            f"check the TTL deletes in {state['table']} (waiting up to {s.ttl_wait:g} s for "
            "DynamoDB), then delete its tables and whatever else of the run is left; if still "
            "pending, keep them"
        )
    print(f"live-aws: resume {a.resume} ({s.describe()}, {who}): {what}")
    confirm(s, "Proceed?")
    build(s)
    report = Report(a.resume, s, kind="resume")
    try:
        resume(s, aws, a.resume, report, discard=a.discard)
    except Interrupted as e:
        report.finish()
        return 128 + e.signum
    report.finish()
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
