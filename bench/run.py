"""The benchmark harness: ddb-aggregator next to the Lambda stream handlers users run today.

Three systems read the same source table's stream on DynamoDB Local, one at a time, each into
its own aggregates table: ddb-aggregator (the release binary, config bench/ddb-aggregator.yaml)
and the two baselines of bench/baselines (naive ADD per record, and idempotent per record with
a transaction). Measured (bench/report.py explains each figure in BENCHMARKS.md):

  catch-up   a backlog written while no consumer runs, ending with a marker order for a
             customer no other write uses; per system and run, a fresh aggregates table (and
             state table), the consumer started at TRIM_HORIZON, the time until the marker's
             aggregate is visible; then its aggregates are compared with the truth. A baseline
             that has not reached the marker within --baseline-window seconds is stopped
             (SIGTERM: it finishes its batch), and its rate is the records it handled over the
             time to its last completed batch; its aggregates are then compared with the truth
             of that prefix of the stream (its records folded by bench/commerce.py).
  cost       aggregate write requests and write capacity units per stream record.
  memory     peak RSS (VmHWM) of the consumer process just before it is stopped.
  replay     each system run once more from TRIM_HORIZON over the aggregates of its last
             catch-up run, over the same records, then compared with the truth again.
  lag        per system and run, a freshly restarted DynamoDB Local and a new source table, the
             consumer started, a generator at --lag-rate writes/s for --lag-seconds while a probe
             inserts an order for a new customer every 100 ms and polls until its aggregate is
             visible.
  micro      `cargo bench --locked --bench pipeline`, its stdout kept verbatim.

Raw figures go to bench/results/results.json; bench/report.py renders BENCHMARKS.md and the
plots from them. Run through scripts/bench, which prepares emulators, venv and binary.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench import commerce, local_aws, phases, report, workload

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ddb-aggregator", "naive", "idempotent")
BACKLOG_TABLE = "bench-backlog"
QUEUE_NAME = "bench-ddb-aggregator-dlq"
MARKER = "marker"  # the customer of the backlog's last write, used by no other write
PROBE_INTERVAL = 0.1  # one probe order every 100 ms
PROBE_POLL = 0.02  # probe aggregates polled every 20 ms
MARKER_POLL = 0.05  # the marker's aggregate polled every 50 ms
SMALL_BATCH = 1000  # ddb-aggregator's catch-up runs at this batch size too (memory per batch size)
START_TIMEOUT = 60.0  # a consumer must be polling its stream within this
STOP_TIMEOUT = 30.0  # SIGTERM, then SIGKILL


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Consumer:
    """A running consumer process (one system reading one stream into one aggregates table)."""

    def __init__(self, system: str, proc: subprocess.Popen[bytes], started: float, log_path: Path):
        self.system, self.proc, self.started, self.log_path = system, proc, started, log_path

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(
                f"{self.system} exited with {self.proc.returncode}; log {self.log_path}:\n"
                + "\n".join(tail)
            )

    def peak_rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def stop(self) -> int:
        """SIGTERM, bounded wait, then SIGKILL; returns the exit code (negative: killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def progress(self) -> dict[str, Any]:
        """records (read or handled), write_requests, wcu, at (epoch seconds when the records count was reached)."""
        raise NotImplementedError

    def final_progress(self, before_stop: dict[str, Any]) -> dict[str, Any]:
        """The figures after the process stopped (the last ones it exposed before)."""
        return before_stop

    def ready(self) -> bool:
        raise NotImplementedError


class AggregatorConsumer(Consumer):
    def __init__(self, *args: Any, metrics_port: int):
        super().__init__(*args)
        self.metrics_port = metrics_port

    def scrape(self) -> dict[str, float]:
        """Every metric of /metrics, summed over its labels."""
        import urllib.request

        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=3
        ) as r:
            text = r.read().decode()
        sums: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", line)
            if m:
                sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
        return sums

    def progress(self) -> dict[str, Any]:
        m = self.scrape()
        return {
            "records": int(m.get("ddb_aggregator_records_read_total", 0)),
            "write_requests": int(m.get("ddb_aggregator_aggregate_writes_total", 0)),
            "wcu": m.get("ddb_aggregator_write_capacity_units_total", 0.0),
            "at": time.time(),
        }

    def ready(self) -> bool:
        try:
            return self.scrape().get("ddb_aggregator_get_records_total", 0) > 0
        except OSError:
            return False


class BaselineConsumer(Consumer):
    def __init__(self, *args: Any, stats_path: Path):
        super().__init__(*args)
        self.stats_path = stats_path

    def stats(self) -> dict[str, Any]:
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}

    def progress(self) -> dict[str, Any]:
        s = self.stats()
        return {
            "records": s.get("records", 0),
            "write_requests": s.get("write_requests", 0),
            "wcu": s.get("write_capacity_units", 0.0),
            "at": s.get("last_batch_at") or time.time(),
            "last_sequence_number": s.get("last_sequence_number"),
            "batch_retries": s.get("batch_retries", 0),
        }

    def final_progress(self, before_stop: dict[str, Any]) -> dict[str, Any]:
        return self.progress()

    def ready(self) -> bool:
        return bool(self.stats().get("ready"))


class Harness:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = ROOT / ".local" / "bench"
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.connect()
        self.results: dict[str, Any] = {"failures": []}
        self.records: list[dict[str, Any]] = []  # the backlog's stream records, in order
        self.truth: commerce.Aggregates = {}  # the backlog's aggregates, from a scan

    def connect(self) -> None:
        """Clients for the emulators, and the dead-letter queue ddb-aggregator is given."""
        self.ddb = local_aws.client("dynamodb", self.a.ddb_endpoint)
        self.streams = local_aws.client("dynamodbstreams", self.a.ddb_endpoint)
        self.sqs = local_aws.client("sqs", self.a.sqs_endpoint)
        self.queue_url = self.sqs.create_queue(QueueName=QUEUE_NAME)["QueueUrl"]

    def restart_emulators(self) -> None:
        """Fresh, empty emulators (scripts/local-aws restart on the same ports). DynamoDB Local
        slows down writes to every table created after its stream store has grown, even once the
        older tables are deleted (measured here: 380 writes/s on a new table of a fresh instance,
        about 30 after 20,000 stream records), so each lag run gets a fresh instance."""
        env = {
            **os.environ,
            "DDB_LOCAL_PORT": self.a.ddb_endpoint.rsplit(":", 1)[1],
            "SQS_LOCAL_PORT": self.a.sqs_endpoint.rsplit(":", 1)[1],
        }
        with open(self.work / "logs" / "local-aws-restart.log", "ab") as out:
            subprocess.run(
                [str(ROOT / "scripts/local-aws"), "restart"],
                env=env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                timeout=180,
                check=True,
            )
        self.connect()

    # ---------------------------------------------------------------- consumers

    def start(
        self,
        system: str,
        source: str,
        aggregates: str,
        tag: str,
        max_records: int | None = None,
        batch_size: int | None = None,
    ) -> Consumer:
        log_path = self.work / "logs" / f"{tag}-{system}.log"
        env = {
            **os.environ,
            "AWS_REGION": local_aws.REGION,
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_ENDPOINT_URL_DYNAMODB": self.a.ddb_endpoint,
            "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": self.a.ddb_endpoint,
            "AWS_ENDPOINT_URL_SQS": self.a.sqs_endpoint,
        }
        with open(log_path, "wb") as out:
            if system == "ddb-aggregator":
                port = free_port()
                env.update(
                    DDB_AGGREGATOR__SOURCE__TABLE=source,
                    DDB_AGGREGATOR__STATE__TABLE=f"bench-state-{tag}",  # a new table: created at start
                    DDB_AGGREGATOR__AGGREGATES__TABLE=aggregates,
                    # One deployment across runs: the replay's fresh state table keeps the ledger
                    # namespace (the default comes from the state table's name).
                    DDB_AGGREGATOR__AGGREGATES__LEDGER_NAMESPACE="bench",
                    DDB_AGGREGATOR__DEAD_LETTER__QUEUE_URL=self.queue_url,
                    DDB_AGGREGATOR__METRICS__LISTEN=f"127.0.0.1:{port}",
                    # One debug line per applied batch with its phases (bench/phases.py).
                    RUST_LOG="info,aws_config=warn,aws_smithy_runtime=warn,ddb_aggregator::phases=debug",
                )
                if batch_size is not None:
                    env["DDB_AGGREGATOR__SOURCE__BATCH_SIZE"] = str(batch_size)
                cmd = [self.a.bin, "run", "--config", str(self.a.config), "--log-format", "json"]
                started = time.time()
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
                return AggregatorConsumer(system, proc, started, log_path, metrics_port=port)
            stats = self.work / f"{tag}-{system}.stats.json"
            stats.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                "-m",
                f"bench.baselines.{system}",
                "--endpoint",
                self.a.ddb_endpoint,
                "--table",
                source,
                "--aggregates-table",
                aggregates,
                "--stats",
                str(stats),
            ]
            if max_records is not None:
                cmd += ["--max-records", str(max_records)]
            started = time.time()
            proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            return BaselineConsumer(system, proc, started, log_path, stats_path=stats)

    def wait_until(
        self, consumer: Consumer, timeout: float, poll: float, cond: Callable[[], Any]
    ) -> Any:
        """Polls cond() until it returns something truthy (returned) or timeout (None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            consumer.check_alive()
            time.sleep(poll)
        return None

    def marker_visible(self, aggregates: str) -> float | None:
        item = self.ddb.get_item(
            TableName=aggregates,
            Key={"PK": {"S": f"CUST#{MARKER}"}, "SK": {"S": "PROFILE"}},
            ConsistentRead=True,
            ProjectionExpression="orderCount",
        ).get("Item")
        if item and Decimal(item["orderCount"]["N"]) == 1:
            return time.time()
        return None

    def dead_letters(self) -> int:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url, AttributeNames=["ApproximateNumberOfMessages"]
        )
        return int(attrs["Attributes"]["ApproximateNumberOfMessages"])

    def stored(self, aggregates: str) -> commerce.Aggregates:
        return commerce.aggregates_of(local_aws.scan(self.ddb, aggregates))

    # ---------------------------------------------------------------- backlog

    def write_backlog(self) -> None:
        a = self.a
        local_aws.create_table(self.ddb, BACKLOG_TABLE, stream=True)
        gen = workload.Workload(customers=a.customers, skew=a.skew, seed=a.seed)
        log(
            f"writing the backlog: {a.backlog} writes ({a.customers} customers, skew {a.skew}, seed {a.seed}) + 1 marker"
        )
        res = workload.generate(
            gen,
            count=a.backlog,
            threads=a.threads,
            table=BACKLOG_TABLE,
            client_factory=lambda: local_aws.client("dynamodb", a.ddb_endpoint),
        )
        workload.apply(self.ddb, BACKLOG_TABLE, gen.insert_for(MARKER))
        log(f"  {res.writes} writes in {res.seconds:.1f} s ({res.rate:.0f}/s): {res.by_kind}")
        t0 = time.monotonic()
        records, shards = local_aws.read_stream(self.ddb, self.streams, BACKLOG_TABLE)
        if not records or records[-1]["dynamodb"]["Keys"]["PK"]["S"] != f"CUST#{MARKER}":
            raise RuntimeError("the backlog stream does not end with the marker record")
        self.records = records
        self.truth = commerce.truth(local_aws.scan(self.ddb, BACKLOG_TABLE))
        folded_ok = commerce.compare(commerce.fold(records), self.truth).exact
        log(
            f"  stream: {len(records)} records in {shards} shard(s), read in {time.monotonic() - t0:.1f} s; "
            f"{len(self.truth)} aggregate items in the truth; stream folded == truth: {folded_ok}"
        )
        if not folded_ok:
            raise RuntimeError(
                "folding the stream records does not give the truth of the table scan"
            )
        self.results["backlog"] = {
            "writes": res.writes + 1,
            "generator": res.as_json(),
            "stream_records": len(records),
            "shards": shards,
            "aggregate_items": len(self.truth),
        }

    def prefix_truth(self, last_sequence_number: str | None) -> commerce.Aggregates:
        """The aggregates of the stream's records up to a sequence number, each applied once."""
        if last_sequence_number is None:
            return {}
        last = int(last_sequence_number)
        return commerce.fold(
            r for r in self.records if int(r["dynamodb"]["SequenceNumber"]) <= last
        )

    # ---------------------------------------------------------------- catch-up and replay

    def catchup_run(self, system: str, run: int, batch_size: int | None = None) -> dict[str, Any]:
        tag = f"catchup{run}" if batch_size is None else f"catchup{run}-batch{batch_size}"
        aggregates = f"bench-agg-{system}-{tag}"
        local_aws.create_table(self.ddb, aggregates, stream=False)
        box = self.a.aggregator_timeout if system == "ddb-aggregator" else self.a.baseline_window
        consumer = self.start(system, BACKLOG_TABLE, aggregates, tag, batch_size=batch_size)
        try:
            visible = self.wait_until(
                consumer, box, MARKER_POLL, lambda: self.marker_visible(aggregates)
            )
            rss = consumer.peak_rss_mib()
            before = consumer.progress()
        finally:
            code = consumer.stop()
        after = consumer.final_progress(before)
        n = len(self.records)
        if visible:
            records, seconds, want = n, visible - consumer.started, self.truth
        elif system == "ddb-aggregator":
            raise RuntimeError(
                f"ddb-aggregator did not reach the marker within {box:.0f} s ({after['records']} records read)"
            )
        else:
            records, seconds = after["records"], after["at"] - consumer.started
            want = self.prefix_truth(after.get("last_sequence_number"))
        diff = commerce.compare(self.stored(aggregates), want)
        out = {
            "run": run,
            "aggregates_table": aggregates,
            "complete": bool(visible),
            "records": records,
            "seconds": round(seconds, 3),
            "records_per_second": round(records / seconds, 1) if seconds > 0 else None,
            "write_requests": after["write_requests"],
            "wcu": after["wcu"],
            "records_counted": after["records"],
            "write_requests_per_record": after["write_requests"] / after["records"]
            if after["records"]
            else None,
            "wcu_per_record": after["wcu"] / after["records"] if after["records"] else None,
            "peak_rss_mib": round(rss, 1) if rss is not None else None,
            "exit_code": code,
            "batch_retries": after.get("batch_retries"),
            "last_sequence_number": after.get("last_sequence_number"),
            "correctness": diff.as_json(),
            "batch_size": batch_size,
        }
        log(
            f"  {system} run {run}{'' if batch_size is None else f' (batch_size {batch_size})'}: "
            f"{records} records in {seconds:.2f} s = {out['records_per_second']}/s"
            f"{'' if visible else ' (stopped at the window)'}; "
            f"{after['write_requests']} writes, {after['wcu']:.0f} WCU; "
            f"RSS {out['peak_rss_mib']} MiB; {diff.summary()}"
        )
        if not diff.exact:
            self.results["failures"].append(
                f"catch-up {system} run {run}: aggregates differ from the truth: {diff.summary()}"
            )
        return out

    def raw_run(self, run: int) -> dict[str, Any]:
        """The ceiling: a bare GetRecords loop (examples/raw_getrecords.rs) over the backlog's
        stream from TRIM_HORIZON, counting records and nothing else."""
        env = {
            **os.environ,
            "AWS_REGION": local_aws.REGION,
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_ENDPOINT_URL_DYNAMODB": self.a.ddb_endpoint,
            "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": self.a.ddb_endpoint,
        }
        cmd = [str(self.a.raw_bin), "--table", BACKLOG_TABLE, "--expect", str(len(self.records))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"raw_getrecords exited {done.returncode}: {done.stderr.strip()}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        out["run"] = run
        log(
            f"  raw GetRecords loop run {run}: {out['records']} records in {out['seconds']:.2f} s "
            f"= {out['records_per_second']}/s ({out['calls']} calls, {out['shards']} shards)"
        )
        return out

    def replay(self, system: str, last: dict[str, Any]) -> dict[str, Any]:
        aggregates, k = last["aggregates_table"], last["records"]
        want = self.truth if last["complete"] else self.prefix_truth(last["last_sequence_number"])
        t0 = time.monotonic()
        if system == "ddb-aggregator":
            consumer = self.start(system, BACKLOG_TABLE, aggregates, "replay")
            try:
                seen: list[tuple[int, float]] = []

                def settled() -> bool:
                    # all records read, and nothing new for 3 s (the last batch written)
                    try:
                        count = consumer.progress()["records"]
                    except OSError:  # /metrics not listening yet
                        return False
                    if not seen or seen[-1][0] != count:
                        seen.append((count, time.monotonic()))
                    return count >= k and time.monotonic() - seen[-1][1] >= 3.0

                done = self.wait_until(consumer, self.a.aggregator_timeout, 0.2, settled)
            finally:
                consumer.stop()
        else:
            consumer = self.start(system, BACKLOG_TABLE, aggregates, "replay", max_records=k)
            try:
                exited = lambda: consumer.proc.poll() is not None  # noqa: E731 - it stops by itself at k records
                done = self.wait_until(
                    consumer, max(120.0, 4 * self.a.baseline_window), 0.2, exited
                )
            finally:
                consumer.stop()
            done = done and consumer.progress()["records"] >= k
        diff = commerce.compare(self.stored(aggregates), want)
        out = {
            "records": k,
            "complete": bool(done),
            "seconds": round(time.monotonic() - t0, 1),
            "correctness": diff.as_json(),
        }
        log(f"  {system} replay over {k} records: {diff.summary()} ({out['seconds']} s)")
        if not done:
            self.results["failures"].append(
                f"replay {system}: did not process the {k} records in time"
            )
        return out

    # ---------------------------------------------------------------- lag

    def lag_run(self, system: str, run: int) -> dict[str, Any]:
        a = self.a
        source, aggregates = f"bench-lag{run}-{system}", f"bench-agg-{system}-lag{run}"
        self.restart_emulators()
        local_aws.create_table(self.ddb, source, stream=True)
        local_aws.create_table(self.ddb, aggregates, stream=False)
        consumer = self.start(system, source, aggregates, f"lag{run}")
        pending: dict[str, float] = {}  # probe customer -> time its write was sent
        lags: list[float] = []
        seen_at: list[tuple[float, float]] = []  # (sent, visible) of every probe seen
        write_latency: list[float] = []  # the probes' PutItem round trips: the emulator alone
        lock = threading.Lock()
        probes_done, stop_polling = threading.Event(), threading.Event()
        errors: list[BaseException] = []  # from the probe threads
        try:
            if not self.wait_until(consumer, START_TIMEOUT, 0.1, consumer.ready):
                raise RuntimeError(
                    f"{system} was not polling its stream within {START_TIMEOUT:.0f} s"
                )
            start = time.time()

            def recorded(body: Callable[[], None]) -> Callable[[], None]:
                def run_body() -> None:
                    try:
                        body()
                    except Exception as e:  # noqa: BLE001 - raised by the harness thread below
                        errors.append(e)

                return run_body

            @recorded
            def probe() -> None:
                client = local_aws.client("dynamodb", a.ddb_endpoint)
                orders = workload.Workload(seed=a.seed + 500 + run, customers=1)
                i = 0
                try:
                    while (due := start + i * PROBE_INTERVAL) < start + a.lag_seconds:
                        time.sleep(max(0.0, due - time.time()))
                        customer = f"probe{i:05d}"
                        write = orders.insert_for(customer)
                        sent = time.time()
                        workload.apply(client, source, write)
                        acked = time.time()
                        with lock:
                            pending[customer] = sent
                            write_latency.append(acked - sent)
                        i += 1
                finally:
                    probes_done.set()

            @recorded
            def poll() -> None:
                # Oldest probe first, stopping at the first one not yet visible: a few GetItems
                # per tick however far behind the consumer is (polling every pending probe would
                # load DynamoDB Local in proportion to the lag being measured).
                client = local_aws.client("dynamodb", a.ddb_endpoint)
                while not errors:
                    with lock:
                        waiting = sorted(pending, key=pending.__getitem__)
                    if not waiting and probes_done.is_set():
                        return
                    for customer in waiting:
                        item = client.get_item(
                            TableName=aggregates,
                            Key={"PK": {"S": f"CUST#{customer}"}, "SK": {"S": "PROFILE"}},
                            ConsistentRead=True,
                            ProjectionExpression="orderCount",
                        ).get("Item")
                        if not item or Decimal(item["orderCount"]["N"]) != 1:
                            break
                        now = time.time()
                        with lock:
                            sent = pending.pop(customer)
                            lags.append(now - sent)
                            seen_at.append((sent, now))
                    if stop_polling.wait(PROBE_POLL):
                        return

            threads = [
                threading.Thread(target=probe, daemon=True),
                threading.Thread(target=poll, daemon=True),
            ]
            for t in threads:
                t.start()
            gen = workload.Workload(customers=a.customers, skew=a.skew, seed=a.seed + 1000 + run)
            res = workload.generate(
                gen,
                duration=a.lag_seconds,
                rate=a.lag_rate,
                threads=a.threads,
                table=source,
                client_factory=lambda: local_aws.client("dynamodb", a.ddb_endpoint),
            )
            threads[0].join(timeout=a.lag_seconds + 30)
            threads[1].join(timeout=a.lag_drain)
            stop_polling.set()
            threads[1].join(timeout=10)
            if errors:
                raise RuntimeError(f"probe failed: {errors[0]}") from errors[0]
            rss = consumer.peak_rss_mib()
        finally:
            consumer.stop()
        end = time.time()
        dead_letters = self.dead_letters()
        with lock:
            censored = sorted(end - t for t in pending.values())  # never seen: lag at least this
            seen = sorted(lags)
        every = seen + censored
        out = {
            "run": run,
            "writes": res.writes,
            "writes_per_second": round(res.rate, 1),
            "probes": len(every),
            "probes_not_seen": len(censored),
            "lag_p50": percentile(every, 50) if every else None,
            "lag_p99": percentile(every, 99) if every else None,
            "lags": [round(x, 4) for x in seen],
            "lags_not_seen_at_least": [round(x, 3) for x in censored],
            "peak_rss_mib": round(rss, 1) if rss is not None else None,
            "dead_letters": dead_letters,
            "probe_write_ms": {
                "p50": round(percentile(write_latency, 50) * 1000, 1) if write_latency else None,
                "p99": round(percentile(write_latency, 99) * 1000, 1) if write_latency else None,
            },
        }
        if system == "ddb-aggregator":
            out["phases"] = phases.breakdown(consumer.log_path, seen_at)
            out["probe_times"] = [[round(s, 4), round(v, 4)] for s, v in seen_at]
        log(
            f"  {system} lag run {run}: {res.writes} writes at {res.rate:.0f}/s, {len(every)} probes, "
            f"p50 {out['lag_p50']:.3f} s, p99 {out['lag_p99']:.3f} s"
            + (f", {len(censored)} not seen" if censored else "")
        )
        return out

    # ---------------------------------------------------------------- micro-benchmarks

    def micro(self) -> dict[str, Any]:
        t0 = time.monotonic()
        log_path = self.work / "logs" / "cargo-bench.log"
        with open(log_path, "wb") as err:
            p = subprocess.run(
                ["cargo", "bench", "--locked", "--bench", "pipeline"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                timeout=self.a.micro_timeout,
            )
        stdout = p.stdout.decode(errors="replace")
        ratio_line = next(
            (
                line.strip()
                for line in stdout.splitlines()
                if line.strip().startswith("ratio full/parse:")
            ),
            None,
        )
        out = {
            "exit_code": p.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "stdout": stdout,
            "ratio_line": ratio_line,
        }
        if p.returncode != 0:
            self.results["failures"].append(
                f"cargo bench exited with {p.returncode} (log {log_path})"
            )
        log(
            f"micro-benchmarks: exit {p.returncode} in {out['seconds']} s; {ratio_line or 'no ratio line'}"
        )
        return out

    # ---------------------------------------------------------------- the whole run

    def run(self) -> dict[str, Any]:
        a = self.a
        r = self.results
        r["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        r["machine"] = machine()
        r["versions"] = versions(a.bin)
        r["config"] = a.config.read_text()
        phases: dict[str, float] = {}
        r["phases_seconds"] = phases

        t = time.monotonic()
        self.write_backlog()
        phases["backlog"] = time.monotonic() - t

        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        r["catchup"] = runs
        raw: list[dict[str, Any]] = []
        r["catchup_raw"] = raw
        spent = dict.fromkeys(SYSTEMS, 0.0)
        for run in range(
            1, a.catchup_runs + 1
        ):  # interleaved, so drift of the machine hits every system alike
            for system in SYSTEMS:
                t = time.monotonic()
                done = self.guard(f"catch-up {system} run {run}", self.catchup_run, system, run)
                if done:
                    runs[system].append(done)
                spent[system] += time.monotonic() - t
                for old in runs[system][:-1]:  # keep only the last run's tables (the replay's)
                    local_aws.delete_table(self.ddb, old["aggregates_table"])
            if a.raw_bin.exists():  # the ceiling, in the same round
                done = self.guard(f"raw GetRecords loop run {run}", self.raw_run, run)
                if done:
                    raw.append(done)
        for system in SYSTEMS:
            phases[f"catchup {system}"] = spent[system]
        # ddb-aggregator's memory at the other batch size the issue names (the table's runs use the
        # config's 10,000): the same backlog, its own runs.
        small: list[dict[str, Any]] = []
        r["catchup_small_batch"] = small
        t = time.monotonic()
        for run in range(1, a.catchup_runs + 1):
            done = self.guard(
                f"catch-up ddb-aggregator batch_size {SMALL_BATCH} run {run}",
                self.catchup_run,
                "ddb-aggregator",
                run,
                SMALL_BATCH,
            )
            if done:
                small.append(done)
                local_aws.delete_table(self.ddb, done["aggregates_table"])
        phases[f"catchup ddb-aggregator batch_size {SMALL_BATCH}"] = time.monotonic() - t

        r["replay"] = {}
        for system in SYSTEMS:
            if runs[system]:
                t = time.monotonic()
                replayed = self.guard(f"replay {system}", self.replay, system, runs[system][-1])
                if replayed:
                    r["replay"][system] = replayed
                phases[f"replay {system}"] = time.monotonic() - t
                local_aws.delete_table(self.ddb, runs[system][-1]["aggregates_table"])
        r["dead_letters"] = (
            self.dead_letters()
        )  # each lag run adds its own (a restart empties the queue)

        lag: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        r["lag"] = lag
        spent = dict.fromkeys(SYSTEMS, 0.0)
        for run in range(1, a.lag_runs + 1):
            for system in SYSTEMS:
                t = time.monotonic()
                done = self.guard(f"lag {system} run {run}", self.lag_run, system, run)
                if done:
                    lag[system].append(done)
                    r["dead_letters"] += done["dead_letters"]
                spent[system] += time.monotonic() - t
        for system in SYSTEMS:
            phases[f"lag {system}"] = spent[system]

        if a.skip_micro:
            r["micro"] = None
        else:
            t = time.monotonic()
            r["micro"] = self.guard("micro-benchmarks", self.micro)
            phases["micro"] = time.monotonic() - t
        return r

    def guard(
        self, what: str, step: Callable[..., dict[str, Any]], *args: Any
    ) -> dict[str, Any] | None:
        """Runs one measurement and returns its figures; a failure is recorded (None) and the
        other measurements still run."""
        try:
            return step(*args)
        except Exception as e:  # noqa: BLE001 - reported in BENCHMARKS.md and the exit code
            log(f"FAILED: {what}: {e}")
            self.results["failures"].append(f"{what}: {e}")
            return None


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    os_release = (
        dict(
            line.split("=", 1)
            for line in Path("/etc/os-release").read_text().splitlines()
            if "=" in line
        )
        if Path("/etc/os-release").exists()
        else {}
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "os": f"{os_release.get('PRETTY_NAME', platform.system()).strip(chr(34))}, kernel {platform.release()}",
    }


def versions(binary: str) -> dict[str, str]:
    out: dict[str, str] = {"python": platform.python_version()}
    import boto3

    out["boto3"] = boto3.__version__
    for jar in glob.glob(str(ROOT / ".local/dynamodb-local/*/package/emulator/DynamoDBLocal.jar")):
        with zipfile.ZipFile(jar) as z:
            props = z.read("META-INF/maven/com/amazonaws/DynamoDBLocal/pom.properties").decode()
        version = re.search(r"^version=(\S+)", props, re.M)
        npm = Path(jar).parents[2].name
        out["dynamodb_local"] = (
            f"{version.group(1) if version else '?'} (npm amplify-dynamodb-simulator {npm})"
        )
    storage = os.environ.get("DDB_LOCAL_DB_DIR", "memory")
    out["dynamodb_local_storage"] = (
        "in memory" if storage in ("", "memory") else "in a file, stream records indexed"
    )
    req = (ROOT / "scripts/requirements-local-aws.txt").read_text()
    moto = re.search(r"^moto==(\S+)", req, re.M)
    out["moto"] = moto.group(1) if moto else "?"
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
    out["java"] = (java.stderr.splitlines() or ["?"])[0]
    out["ddb_aggregator"] = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    return out


def parser() -> argparse.ArgumentParser:
    """The harness's options (bench/memory.py builds its harness with them too)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bin", required=True, help="the ddb-aggregator binary")
    p.add_argument(
        "--raw-bin",
        type=Path,
        default=ROOT / "target/release/examples/raw_getrecords",
        help="the bare GetRecords loop (examples/raw_getrecords.rs): the catch-up's ceiling",
    )
    p.add_argument("--config", type=Path, default=ROOT / "bench/ddb-aggregator.yaml")
    p.add_argument(
        "--ddb-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:8120"),
    )
    p.add_argument(
        "--sqs-endpoint", default=os.environ.get("AWS_ENDPOINT_URL_SQS", "http://127.0.0.1:9444")
    )
    p.add_argument("--customers", type=int, default=500)
    p.add_argument("--skew", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=4, help="generator threads")
    p.add_argument(
        "--backlog",
        type=int,
        default=20_000,
        help="backlog writes before the marker (at least 20,000)",
    )
    p.add_argument("--catchup-runs", type=int, default=3)
    p.add_argument(
        "--baseline-window",
        type=float,
        default=15.0,
        help="seconds a baseline's catch-up run may take before it is stopped and measured on the prefix it handled",
    )
    p.add_argument(
        "--aggregator-timeout",
        type=float,
        default=300.0,
        help="seconds ddb-aggregator may take to catch up",
    )
    p.add_argument("--lag-runs", type=int, default=3)
    p.add_argument(
        "--lag-rate", type=float, default=200.0, help="generator writes per second in the lag runs"
    )
    p.add_argument(
        "--lag-seconds",
        type=float,
        default=15.0,
        help="seconds of writes per lag run (the issue asks for 20; 15 fits the budget)",
    )
    p.add_argument(
        "--lag-drain",
        type=float,
        default=15.0,
        help="seconds to wait for the last probes after the writes",
    )
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--micro-timeout", type=float, default=1200.0)
    p.add_argument(
        "--allow-small-backlog",
        action="store_true",
        help="development only: a backlog under 20,000 writes",
    )
    p.add_argument(
        "--lag-only",
        choices=SYSTEMS,
        help="development: only this system's lag runs, their figures printed and written to RESULTS/lag-only.json (no report)",
    )
    p.add_argument("--results", type=Path, default=ROOT / "bench/results")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    return p


def main() -> int:
    p = parser()
    a = p.parse_args()
    if a.backlog < 20_000 and not a.allow_small_backlog:
        p.error("--backlog must be at least 20,000 (--allow-small-backlog for development)")
    for url in (a.ddb_endpoint, a.sqs_endpoint):
        if not re.match(r"^http://127\.0\.0\.1:\d+$", url):
            p.error(f"endpoints must be http://127.0.0.1:PORT, got {url}")

    t0 = time.monotonic()
    harness = Harness(a)
    if a.lag_only:
        return lag_only(harness, a)
    results = harness.run()
    results["harness_seconds"] = round(time.monotonic() - t0, 1)
    if os.environ.get("BENCH_T0"):
        results["script_seconds_before_report"] = round(
            time.time() - float(os.environ["BENCH_T0"]), 1
        )
    if os.environ.get("BENCH_BUILD_SECONDS"):
        results["build_seconds"] = float(os.environ["BENCH_BUILD_SECONDS"])
    results["generated_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    report.write(results, a.results, a.out)
    for failure in results["failures"]:
        log(f"FAILURE: {failure}")
    log(
        f"harness done in {results['harness_seconds']} s; wrote {a.out.relative_to(ROOT)} and {a.results.relative_to(ROOT)}/"
    )
    return 1 if results["failures"] else 0


def lag_only(harness: Harness, a: argparse.Namespace) -> int:
    runs = [harness.lag_run(a.lag_only, run) for run in range(1, a.lag_runs + 1)]
    for r in runs:
        r.pop("lags", None)
        print(json.dumps(r, indent=1, default=str))
    p99s = sorted(r["lag_p99"] for r in runs if r["lag_p99"] is not None)
    if p99s:
        log(f"{a.lag_only}: lag p99 per run {p99s}, median {p99s[len(p99s) // 2]:.3f} s")
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "lag-only.json").write_text(json.dumps(runs, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
