"""A rule change rebuilt on DynamoDB Local at size, beside one hot customer: how long the
rebuild takes, what it skipped, and what was exact afterwards.

The deployment runs config/commerce.yaml over `--orders` orders (spread over `--customers`
customers and October's days). Then the rule change of the rolling-change test: the daily rollup
re-keyed to `MONTHLY#{date|month}` and `revenue` renamed `spend`. The old replica gets SIGTERM,
the new one starts while one customer ("hot") gets an order every second, and the clock runs
from the new replica's start until `ddb_aggregator_rule_rebuild_pending` and
`ddb_aggregator_definitions_retire_pending` are 0 for every rule. Then the hot writer stops and
every target is compared with the truth computed from the table; then `reconcile --all` runs and
they are compared again.

Run by scripts/bench-rebuild, which installs and starts the emulators and builds the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.local_aws import client, create_table, delete_table, scan
from bench.reconcile_all import config_text, load_orders
from bench.run import free_port

RULES = ("customer-orders", "daily-sales")


def log(msg: str) -> None:
    print(f"[bench-rebuild {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def changed(text: str) -> str:
    out = text.replace("SALES#{date|day}", "MONTHLY#{date|month}").replace(
        "      revenue: { sum: total }\n", "      spend: { sum: total }\n"
    )
    if "MONTHLY#" not in out or "spend: { sum: total }" not in out:
        raise SystemExit(
            "config/commerce.yaml no longer has the daily rollup or `revenue` this bench changes"
        )
    return out


class Service:
    def __init__(self, binary: str, config: Path, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        env = {**env, "DDB_AGGREGATOR__METRICS__LISTEN": f"127.0.0.1:{self.port}"}
        self.out = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "run", "--config", str(config)],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def metrics(self) -> dict[str, float]:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def total(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def hot_writer(ddb_endpoint: str, table: str, stop: threading.Event, written: list[int]) -> None:
    """One order a second for customer "hot" (dated December), until `stop` (at most an hour)."""
    c = client("dynamodb", ddb_endpoint)
    for n in range(3600):
        if stop.is_set():
            return
        c.put_item(
            TableName=table,
            Item={
                "PK": {"S": "CUST#hot"},
                "SK": {"S": f"ORDER#2026-12-03#hot{n}"},
                "status": {"S": "PAID"},
                "total": {"N": f"{n % 90}.50"},
            },
        )
        written[0] += 1
        stop.wait(1.0)


def truth(items: list[dict[str, Any]]) -> dict[tuple[str, str, str], Decimal]:
    """The changed rules' values from the orders: per customer (`spend` for revenue) and month."""
    out: dict[tuple[str, str, str], Decimal] = {}

    def add(key: tuple[str, str, str], v: Decimal) -> None:
        out[key] = out.get(key, Decimal(0)) + v

    for i in items:
        pk, sk = i["PK"]["S"], i["SK"]["S"]
        if not sk.startswith("ORDER#") or "total" not in i:
            continue
        total, status, date = Decimal(i["total"]["N"]), i["status"]["S"], sk.split("#")[1]
        for a, v in (("orderCount", 1), ("spend", total), (f"orders_{status}", 1)):
            add((pk, "PROFILE", a), Decimal(v))
        if status in ("PENDING", "PAID"):
            add((pk, "PROFILE", "openRevenue"), total)
            add((pk, "PROFILE", "openOrders"), Decimal(1))
        add((f"MONTHLY#{date[:7]}", "TOTAL", "orders"), Decimal(1))
        add((f"MONTHLY#{date[:7]}", "TOTAL", "revenue"), total)
    return out


def wrong_targets(ddb: Any, table: str, want: dict[tuple[str, str, str], Decimal]) -> list[str]:
    """Targets whose stored value differs from `want`, and old ones not at 0 (daily, `revenue`)."""
    have: dict[tuple[str, str, str], Any] = {}
    for i in scan(ddb, table):
        pk, sk = i["PK"]["S"], i["SK"]["S"]
        if sk not in ("PROFILE", "TOTAL"):
            continue
        for a, v in i.items():
            if a in ("PK", "SK") or a.startswith("_agg") or "N" not in v:
                continue
            have[(pk, sk, a)] = Decimal(v["N"])
    bad = {f"{k[0]}/{k[1]}.{k[2]}" for k, v in want.items() if have.get(k, Decimal(0)) != v}
    for (pk, sk, a), v in have.items():
        left = pk.startswith("SALES#") or (sk == "PROFILE" and a == "revenue")
        if (left and v != 0) or (not left and (pk, sk, a) not in want and v != 0):
            bad.add(f"{pk}/{sk}.{a}")
    return sorted(bad)


def caught_up(svc: Service, records: int, timeout: float) -> float:
    t0 = time.time()
    last, still = -1.0, 0
    while time.time() - t0 < timeout:
        read = svc.total("ddb_aggregator_records_read_total")
        still = still + 1 if read == last and read >= records else 0
        if still >= 5:
            return time.time() - t0
        last = read
        time.sleep(1)
    raise SystemExit(
        f"the service did not read {records} records in {timeout:.0f}s (read {last:.0f}):\n{svc.log_tail()}"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bin", required=True)
    p.add_argument(
        "--ddb-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:8130"),
    )
    p.add_argument("--orders", type=int, default=100_000)
    p.add_argument("--customers", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the rebuild")
    a = p.parse_args()
    ddb = client("dynamodb", a.ddb_endpoint)
    table, state = "bench-rebuild", "bench-rebuild-state"
    for t in (table, state):
        delete_table(ddb, t)
    create_table(ddb, table, stream=True)
    work = Path(tempfile.mkdtemp())
    old, new = work / "old.yaml", work / "new.yaml"
    old.write_text(config_text(table, state) + "\n")
    new.write_text(changed(old.read_text()))
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL_DYNAMODB": a.ddb_endpoint,
        "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": a.ddb_endpoint,
        "AWS_ENDPOINT_URL": a.ddb_endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "RUST_LOG": "info",
    }
    svc = Service(a.bin, old, env, work / "old.log")
    try:
        time.sleep(3)
        t0 = time.time()
        load_orders(ddb, table, 0, a.orders, a.customers)
        log(f"{a.orders} orders written in {time.time() - t0:.0f}s")
        log(f"the old definitions applied them {caught_up(svc, a.orders, 1800):.0f}s later")
    finally:
        svc.stop()
    stop, written = threading.Event(), [0]
    hot = threading.Thread(target=hot_writer, args=(a.ddb_endpoint, table, stop, written))
    hot.start()
    time.sleep(3)
    svc = Service(a.bin, new, env, work / "new.log")
    started = time.time()
    try:
        while True:
            m = svc.metrics()
            pending = sum(
                m.get(f'ddb_aggregator_rule_rebuild_pending{{rule="{r}"}}', 1.0) for r in RULES
            )
            retire = m.get("ddb_aggregator_definitions_retire_pending", 1.0)
            if (
                m
                and pending == 0
                and retire == 0
                and "rule rebuilt" in svc.log_path.read_text(errors="replace")
            ):
                break
            if time.time() - started > a.timeout:
                raise SystemExit(
                    f"the rebuild did not finish in {a.timeout:.0f}s (pending {pending}, retire {retire}):\n{svc.log_tail()}"
                )
            time.sleep(1)
        took = time.time() - started
        skipped = {
            r: m.get(f'ddb_aggregator_rule_rebuild_skipped_targets_total{{rule="{r}"}}', 0.0)
            for r in RULES
        }
        lines = [
            json.loads(x)
            for x in svc.log_path.read_text(errors="replace").splitlines()
            if x.startswith("{")
        ]
        rebuilt = [
            x.get("fields", x) for x in lines if x.get("fields", x).get("message") == "rule rebuilt"
        ]
        stop.set()
        hot.join()
        time.sleep(5)
        want = truth(scan(ddb, table))
        after_rebuild = wrong_targets(ddb, table, want)
    finally:
        stop.set()
        svc.stop()
    code = subprocess.run(
        [a.bin, "reconcile", "--config", str(new), "--all", "--no-wait"],
        env=env,
        capture_output=True,
        text=True,
    )
    after_reconcile = wrong_targets(ddb, table, truth(scan(ddb, table)))
    print()
    print(
        f"rebuild of {a.orders:,} orders ({a.customers:,} customers) beside one customer written every second"
    )
    print(
        f"  finished in {took:.1f} s with {written[0]} hot orders written meanwhile; skipped targets: {skipped}"
    )
    for r in rebuilt:
        print(
            "  "
            + json.dumps(
                {
                    k: r.get(k)
                    for k in ("rule", "items", "targets", "drifts", "seconds", "items_per_second")
                }
            )
        )
    print(
        f"  after the rebuild, hot writer stopped: {len(after_rebuild)} of {len(want)} values wrong {after_rebuild[:6]}"
    )
    print(
        f"  after reconcile --all (exit {code.returncode}): {len(after_reconcile)} wrong {after_reconcile[:6]}"
    )
    return 0 if not after_reconcile else 1


if __name__ == "__main__":
    sys.exit(main())
