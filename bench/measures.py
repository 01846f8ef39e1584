"""Write cost of each measure kind, and the speed of a rule rebuild, on DynamoDB Local.

One backlog of order writes (bench/workload.py's commerce mix, every write stamping updatedAt)
is replayed by the service once per measure kind, each time into a fresh aggregates table (no
stream) and state table, with one rule on CUST#{customer}/PROFILE holding that one measure;
then once with config/commerce-measures.yaml's rules. For each run it prints the records read,
the write capacity units the service counted (ddb_aggregator_write_capacity_units_total: the
ledger writes, helper items and derivations) and their ratio, and checks every customer's value
against the truth computed from the workload's final items (a cost for wrong numbers would mean
nothing). Last, it adds a measure to the running example deployment and restarts the service,
which rebuilds the changed rule from the items while nothing else is written: the "rule rebuilt"
log line gives items read, targets and items/s.

Run by scripts/bench-measures, which installs and starts the emulators and builds the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench import workload as wl
from bench.local_aws import client, create_table, delete_table
from bench.run import free_port

ROOT = Path(__file__).resolve().parent.parent

# Measure kind -> (its YAML under `measures:`, the attribute the marker order sets).
KINDS: dict[str, tuple[str, str]] = {
    "count": ("orderCount: count", "orderCount"),
    "sum": ("revenue: { sum: total }", "revenue"),
    "avg": ("avgOrder: { avg: total }", "avgOrder_count"),
    "max": ("largestOrder: { max: total }", "largestOrder"),
    "min": ('firstOrderDay: { min: "{date|day}" }', "firstOrderDay"),
    "latest": ("lastStatus: { latest: status, by: updatedAt }", "lastStatus"),
    "distinct": ('activeDays: { distinct: "{date|day}" }', "activeDays"),
}
EXAMPLE = "commerce-measures.yaml"
MARKER = "cmarker"

RULE = """  - name: customer-orders
    filter: { dynamodb: { Keys: { SK: { S: [{ prefix: "ORDER#" }] } } } }
    source_key: { PK: "CUST#{customer}", SK: "ORDER#{date}#{order_id}" }
    target: { PK: "CUST#{customer}", SK: "PROFILE" }
    measures:
      MEASURE
    reconcile:
      query: { PK: "CUST#{customer}", SK_begins_with: "ORDER#" }
"""


def log(msg: str) -> None:
    print(f"[bench-measures {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def head(source: str, state: str, aggregates: str, port: int, batch_size: int) -> str:
    return f"""source:
  table: {source}
  start_position: trim_horizon
  batch_size: {batch_size}
  batching_window: 0s
state:
  table: {state}
  create_table: true
  lease_duration: 10s
aggregates:
  table: {aggregates}
reconcile:
  interval: 1h
metrics:
  listen: 127.0.0.1:{port}
rules:
"""


def example_rules() -> str:
    """The rules of config/commerce-measures.yaml (everything from `rules:` on)."""
    text = (ROOT / "config" / EXAMPLE).read_text()
    return text[text.index("rules:\n") + len("rules:\n") :]


def scrape(port: int) -> dict[str, float]:
    """Metric name -> value, summed over label sets."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def labelled(port: int, name: str) -> dict[str, float]:
    """Label text -> value of one metric."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                labels, _, value = line[len(name) :].rpartition(" ")
                out[labels] = float(value)
    return out


class Service:
    def __init__(self, binary: str, config: Path, ddb: str, log_path: Path):
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL_DYNAMODB": ddb,
            "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": ddb,
            "AWS_REGION": "us-east-1",
        }
        env.update(
            {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local", "RUST_LOG": "info"}
        )
        self.log_path = log_path
        self.log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [binary, "run", "--config", str(config), "--log-format", "json"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"ddb-aggregator exited with {self.proc.returncode}; log {self.log_path}:\n{self.tail()}"
            )

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()


def wait_for(what: str, timeout: float, svc: Service, cond: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc.alive()
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; log:\n{svc.tail()}")


def settled(
    port: int, svc: Service, quiet: float = 3.0, timeout: float = 120.0
) -> dict[str, float]:
    """Metrics once the write capacity counter stopped moving for `quiet` seconds."""
    last, since = None, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc.alive()
        m = scrape(port)
        wcu = (
            m.get("ddb_aggregator_write_capacity_units_total"),
            m.get("ddb_aggregator_records_read_total"),
        )
        if wcu != last:
            last, since = wcu, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return m
        time.sleep(0.5)
    raise RuntimeError("the service kept writing")


def truth(items: dict[tuple[str, str], wl.Item]) -> dict[str, dict[str, Any]]:
    """Per customer PK, the value of every attribute the runs set, from the final items."""
    orders: dict[str, list[wl.Item]] = {}
    for (pk, sk), item in items.items():
        if sk.startswith("ORDER#"):
            orders.setdefault(pk, []).append(item)
    out: dict[str, dict[str, Any]] = {}
    for pk, mine in orders.items():
        totals = [Decimal(i["total"]["N"]) for i in mine]
        days = [i["SK"]["S"].split("#")[1] for i in mine]
        newest = max(mine, key=lambda i: (int(i["updatedAt"]["N"]), i["status"]["S"]))
        out[pk] = {
            "orderCount": Decimal(len(mine)),
            "revenue": sum(totals, Decimal(0)),
            "avgOrder_sum": sum(totals, Decimal(0)),
            "avgOrder_count": Decimal(len(mine)),
            "largestOrder": max(totals),
            "firstOrderDay": min(days),
            "lastStatus": newest["status"]["S"],
            "activeDays": Decimal(len(set(days))),
        }
    return out


def stored(ddb: Any, table: str, pks: list[str]) -> dict[str, dict[str, Any]]:
    """The PROFILE items of `pks`, values as Decimal or str."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(pks), 100):
        keys = [{"PK": {"S": pk}, "SK": {"S": "PROFILE"}} for pk in pks[i : i + 100]]
        for _ in range(50):  # unprocessed keys come back; bounded
            r = ddb.batch_get_item(RequestItems={table: {"Keys": keys, "ConsistentRead": True}})
            for item in r["Responses"].get(table, []):
                out[item["PK"]["S"]] = {
                    k: Decimal(v["N"]) if "N" in v else v.get("S") for k, v in item.items()
                }
            keys = r.get("UnprocessedKeys", {}).get(table, {}).get("Keys", [])
            if not keys:
                break
    return out


def check(
    kind: str,
    want: dict[str, dict[str, Any]],
    got: dict[str, dict[str, Any]],
    attributes: list[str],
) -> int:
    """Number of (customer, attribute) values that differ; prints the first few."""
    wrong = 0
    for pk in sorted(set(want) | set(got)):
        for a in attributes:
            w = want.get(pk, {}).get(a)
            g = got.get(pk, {}).get(a)
            if a in ("orderCount", "revenue", "avgOrder_sum", "avgOrder_count") and (w or 0) == (
                g or 0
            ):
                continue  # a counter that fell to 0 stays as 0
            if w != g:
                wrong += 1
                if wrong <= 5:
                    log(f"  {kind}: {pk} {a}: stored {g!r}, truth {w!r}")
    return wrong


def attributes_of(kind: str) -> list[str]:
    if kind == EXAMPLE:
        return [
            "orderCount",
            "revenue",
            "avgOrder_sum",
            "avgOrder_count",
            "largestOrder",
            "firstOrderDay",
            "lastStatus",
            "activeDays",
        ]
    if kind == "avg":
        return ["avgOrder_sum", "avgOrder_count"]
    return [KINDS[kind][1]]


def one_run(
    a: argparse.Namespace, ddb: Any, kind: str, work: wl.Workload, records: int, tmp: Path
) -> dict[str, Any]:
    name = re.sub(r"[^a-z0-9]", "-", kind.lower())
    aggregates, state = f"measures-agg-{name}", f"measures-state-{name}"
    create_table(ddb, aggregates, stream=False)
    delete_table(ddb, state)
    port = free_port()
    rules = example_rules() if kind == EXAMPLE else RULE.replace("MEASURE", KINDS[kind][0])
    config = tmp / f"{name}.yaml"
    config.write_text(head(a.source, state, aggregates, port, a.batch_size) + rules)
    marker_attribute = "orderCount" if kind == EXAMPLE else KINDS[kind][1]
    started = time.monotonic()
    svc = Service(a.bin, config, a.ddb_endpoint, tmp / f"{name}.log")
    try:

        def marker() -> bool:
            item = ddb.get_item(
                TableName=aggregates,
                Key={"PK": {"S": f"CUST#{MARKER}"}, "SK": {"S": "PROFILE"}},
                ConsistentRead=True,
            )
            return marker_attribute in item.get("Item", {})

        wait_for(f"the marker order's {marker_attribute}", a.timeout, svc, marker)
        m = settled(port, svc)
        seconds = time.monotonic() - started
        derivations = labelled(port, "ddb_aggregator_derivations_total")
    finally:
        svc.stop()
    want = truth(work.items)
    wrong = check(kind, want, stored(ddb, aggregates, sorted(want)), attributes_of(kind))
    read = m.get("ddb_aggregator_records_read_total", 0.0)
    wcu = m.get("ddb_aggregator_write_capacity_units_total", 0.0)
    row = {
        "kind": kind,
        "records": int(read),
        "wcu": wcu,
        "wcu_per_record": wcu / read if read else None,
        "aggregate_writes": int(m.get("ddb_aggregator_aggregate_writes_total", 0)),
        "derivations_written": int(derivations.get('{outcome="written"}', 0)),
        "derivations_lost": int(derivations.get('{outcome="lost_race"}', 0)),
        "seconds": round(seconds, 1),
        "customers_checked": len(want),
        "wrong_values": wrong,
    }
    if read != records:
        row["note"] = f"read {int(read)} records, the backlog has {records}"
    log(json.dumps(row))
    if kind != EXAMPLE:
        delete_table(ddb, aggregates)
        delete_table(ddb, state)
    return row


def rebuild(a: argparse.Namespace, ddb: Any, work: wl.Workload, tmp: Path) -> dict[str, Any]:
    """The example deployment again, with a measure added to customer-orders: the service
    rebuilds that rule from the items at start-up."""
    name = re.sub(r"[^a-z0-9]", "-", EXAMPLE)
    aggregates, state = f"measures-agg-{name}", f"measures-state-{name}"
    port = free_port()
    rules = example_rules().replace(
        "      largestOrder: { max: total }\n",
        "      largestOrder: { max: total }\n      smallestOrder: { min: total }\n",
        1,
    )
    assert "smallestOrder" in rules, "config/commerce-measures.yaml no longer has largestOrder"
    config = tmp / "rebuild.yaml"
    config.write_text(head(a.source, state, aggregates, port, a.batch_size) + rules)
    svc = Service(a.bin, config, a.ddb_endpoint, tmp / "rebuild.log")
    try:

        def rebuilt() -> dict[str, Any] | None:
            return next(
                (line for line in svc.lines() if line.get("message") == "rule rebuilt"), None
            )

        line = wait_for("the rule rebuilt line", a.timeout, svc, rebuilt)
    finally:
        svc.stop()
    want = truth(work.items)
    got = stored(ddb, aggregates, sorted(want))
    smallest = {
        pk: min(
            Decimal(i["total"]["N"])
            for (p, sk), i in work.items.items()
            if p == pk and sk.startswith("ORDER#")
        )
        for pk in want
    }
    wrong = sum(1 for pk, s in smallest.items() if got.get(pk, {}).get("smallestOrder") != s)
    row = {
        "rule": line.get("rule"),
        "items": line.get("items"),
        "targets": line.get("targets"),
        "drifts": line.get("drifts"),
        "seconds": line.get("seconds"),
        "items_per_second": line.get("items_per_second"),
        "smallestOrder_wrong": wrong,
    }
    log("rebuild " + json.dumps(row))
    return row


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bin", required=True, help="the ddb-aggregator binary")
    p.add_argument(
        "--ddb-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:8140"),
    )
    p.add_argument("--source", default="measures-src", help="the backlog table (recreated)")
    p.add_argument(
        "--writes", type=int, default=17_000, help="backlog writes (one stream record each)"
    )
    p.add_argument("--customers", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument(
        "--kinds",
        default=",".join([*KINDS, EXAMPLE]),
        help="comma-separated: " + ", ".join([*KINDS, EXAMPLE]),
    )
    p.add_argument(
        "--no-rebuild", action="store_true", help="skip the rebuild after the example run"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--json-out", type=Path, help="also write the rows as JSON")
    a = p.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS and k != EXAMPLE]
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {', '.join([*KINDS, EXAMPLE])}")
    if a.writes < 1 or a.batch_size < 1:
        p.error("--writes and --batch-size must be at least 1")
    ddb = client("dynamodb", a.ddb_endpoint)
    create_table(ddb, a.source, stream=True)
    work = wl.Workload(customers=a.customers, seed=a.seed, updated_at=True)
    t = time.monotonic()
    result = wl.generate(
        work,
        count=a.writes,
        threads=4,
        client_factory=lambda: client("dynamodb", a.ddb_endpoint),
        table=a.source,
    )
    wl.apply(ddb, a.source, work.insert_for(MARKER))
    records = result.writes + 1
    log(
        f"backlog: {records} writes in {time.monotonic() - t:.0f} s {json.dumps(result.by_kind)}; {len(work.items)} orders remain"
    )
    rows: list[dict[str, Any]] = []
    rebuilt = None
    with tempfile.TemporaryDirectory(prefix="bench-measures-") as d:
        for kind in kinds:
            rows.append(one_run(a, ddb, kind, work, records, Path(d)))
        if EXAMPLE in kinds and not a.no_rebuild:
            rebuilt = rebuild(a, ddb, work, Path(d))
    print()
    print(
        f"{records} stream records ({a.customers} customers, seed {a.seed}), batch_size {a.batch_size}, DynamoDB Local"
    )
    print(
        f"{'measures':<24} {'WCU/record':>10} {'WCU':>8} {'ledger writes':>13} {'derivations':>11} {'seconds':>8} {'wrong':>6}"
    )
    for r in rows:
        print(
            f"{r['kind']:<24} {r['wcu_per_record']:>10.3f} {r['wcu']:>8.0f} {r['aggregate_writes']:>13} "
            f"{r['derivations_written']:>11} {r['seconds']:>8} {r['wrong_values']:>6}"
        )
    if rebuilt:
        print(
            f"rebuild of {rebuilt['rule']} (a measure added): {rebuilt['items']} items, {rebuilt['targets']} targets, "
            f"{rebuilt['drifts']} drifts in {rebuilt['seconds']:.1f} s = {rebuilt['items_per_second']} items/s; "
            f"smallestOrder wrong: {rebuilt['smallestOrder_wrong']}"
        )
    if a.json_out:
        a.json_out.write_text(
            json.dumps({"records": records, "runs": rows, "rebuild": rebuilt}, indent=2) + "\n"
        )
    bad = sum(r["wrong_values"] for r in rows) + (rebuilt["smallestOrder_wrong"] if rebuilt else 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
