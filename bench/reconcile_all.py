"""Reconcile at scale on DynamoDB Local: `reconcile --all` over a growing table (items/s and peak
RSS at each size, to show memory does not grow with the table), and the service's schedule
reconciling thousands of touched targets (targets/s).

Run by scripts/bench-reconcile, which installs and starts the emulators and builds the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.local_aws import client, create_table, delete_table

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench-reconcile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def config_text(table: str, state: str) -> str:
    text = (ROOT / "config/commerce.yaml").read_text()
    text = text.replace("table: commerce-main", f"table: {table}", 2)
    text = text.replace("table: ddb-aggregator-state", f"table: {state}")
    return text


def load_orders(
    ddb: Any, table: str, start: int, count: int, customers: int, threads: int = 4
) -> None:
    """Writes orders start..start+count, spread over `customers`, with a few writer threads."""

    def part(lo: int, hi: int) -> None:
        c = client("dynamodb", ddb.meta.endpoint_url)  # one client per thread
        pending: list[dict[str, Any]] = []
        for n in range(lo, hi):
            item = {
                "PK": {"S": f"CUST#c{n % customers}"},
                "SK": {"S": f"ORDER#2026-10-{1 + n % 28:02}#o{n}"},
                "status": {"S": ("PENDING", "PAID", "SHIPPED")[n % 3]},
                "total": {"N": f"{n % 500}.{n % 100:02}"},
            }
            pending.append({"PutRequest": {"Item": item}})
            if len(pending) == 25 or n == hi - 1:
                req = {table: pending}
                for _ in range(50):
                    out = c.batch_write_item(RequestItems=req)
                    req = out.get("UnprocessedItems") or {}
                    if not req:
                        break
                    time.sleep(0.05)
                pending = []

    step = count // threads
    workers = [
        threading.Thread(
            target=part,
            args=(start + i * step, start + (count if i == threads - 1 else (i + 1) * step)),
        )
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[int, str, str, int]:
    """Runs `cmd`; returns (exit code, stdout, stderr, peak RSS in KiB) of that process alone."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(), err.read().decode(), usage.ru_maxrss


def reconcile_all(binary: str, config: Path, env: dict[str, str]) -> dict[str, Any]:
    code, out, err, rss_kib = run_measured(
        [binary, "reconcile", "--config", str(config), "--all", "--no-wait", "--output", "json"],
        env,
    )
    if code not in (0, 1):
        raise SystemExit(f"reconcile --all failed ({code}): {err[-2000:]}")
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    return {
        "items_read": summary["items_read"],
        "seconds": summary["seconds"],
        "items_per_s": summary["items_read"] / max(summary["seconds"], 1e-3),
        "targets": summary["targets_checked"],
        "peak_rss_mib": rss_kib / 1024,
    }


def schedule_throughput(
    binary: str, config: Path, env: dict[str, str], ddb: Any, table: str, targets: int
) -> dict[str, Any]:
    """Starts `run` with a short schedule, touches `targets` new customers, and adds up the
    schedule's own reports (targets, seconds) from its log until they cover them all."""
    env = {
        **env,
        "DDB_AGGREGATOR__RECONCILE__INTERVAL": "20s",
        "DDB_AGGREGATOR__METRICS__LISTEN": "127.0.0.1:0",
    }
    logf = tempfile.NamedTemporaryFile(delete=False)
    svc = subprocess.Popen(
        [binary, "run", "--config", str(config)], stdout=logf, stderr=subprocess.STDOUT, env=env
    )
    try:
        time.sleep(5)
        load_orders(ddb, table, 10_000_000, targets, targets)
        deadline = time.time() + 600
        while time.time() < deadline:
            time.sleep(2)
            t, s, runs = 0, 0.0, 0
            for line in Path(logf.name).read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                fields = rec.get("fields", rec)
                if (
                    fields.get("message") == "scheduled reconcile done"
                    and int(fields.get("targets", 0)) > 0
                ):
                    t, s, runs = t + int(fields["targets"]), s + float(fields["seconds"]), runs + 1
            # Both rules' targets: a customer's profile and the daily totals.
            if t >= targets:
                return {"targets": t, "seconds": s, "runs": runs, "targets_per_s": t / max(s, 1e-3)}
        raise SystemExit(
            "the schedule did not report within 10 minutes:\n" + Path(logf.name).read_text()[-3000:]
        )
    finally:
        svc.terminate()
        svc.wait(timeout=30)
        os.unlink(logf.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bin", required=True)
    p.add_argument(
        "--ddb-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:8130"),
    )
    p.add_argument("--sizes", default="50000,200000", help="table sizes to measure, ascending")
    p.add_argument("--customers", type=int, default=5000)
    p.add_argument("--schedule-targets", type=int, default=2000)
    a = p.parse_args()
    ddb = client("dynamodb", a.ddb_endpoint)
    table, state = "bench-reconcile", "bench-reconcile-state"
    for t in (table, state):
        delete_table(ddb, t)
    create_table(ddb, table, stream=True)
    work = Path(tempfile.mkdtemp())
    config = work / "config.yaml"
    config.write_text(config_text(table, state) + "\n")
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL_DYNAMODB": a.ddb_endpoint,
        "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": a.ddb_endpoint,
        "AWS_ENDPOINT_URL": a.ddb_endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "DDB_AGGREGATOR__STATE__CREATE_TABLE": "true",
        "RUST_LOG": "info",
    }
    # The schedule first, on a small table: a scan rule's touched targets are read with a scan.
    log(f"schedule: {a.schedule_targets} touched targets")
    sched = schedule_throughput(a.bin, config, env, ddb, table, a.schedule_targets)
    log(f"  {sched['targets']} targets in {sched['seconds']:.1f}s")
    rows = []
    loaded = 0
    for size in [int(s) for s in a.sizes.split(",")]:
        log(f"loading orders {loaded}..{size}")
        t0 = time.time()
        load_orders(ddb, table, loaded, size - loaded, a.customers)
        log(f"  {size - loaded} orders in {time.time() - t0:.0f}s")
        loaded = size
        r = reconcile_all(a.bin, config, env)
        r["orders"] = size
        log(
            f"  reconcile --all: {r['items_read']} items in {r['seconds']:.1f}s "
            f"({r['items_per_s']:.0f}/s), peak RSS {r['peak_rss_mib']:.1f} MiB"
        )
        rows.append(r)
    print()
    print("| orders | items read | seconds | items/s | peak RSS (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['orders']:,} | {r['items_read']:,} | {r['seconds']:.1f} | {r['items_per_s']:,.0f} | {r['peak_rss_mib']:.1f} |"
        )
    print()
    print(
        f"schedule: {sched['targets']:,} touched targets reconciled in {sched['seconds']:.1f}s "
        f"over {sched['runs']} run(s) ({sched['targets_per_s']:.0f} targets/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
