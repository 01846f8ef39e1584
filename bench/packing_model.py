#!/usr/bin/env python3
"""Write counts of helper-measure storage designs on the commerce mix, without DynamoDB.

A model, not a measurement: it replays bench/workload.py's backlog (the one scripts/bench-measures
writes: 500 Zipf customers, seed 1, updatedAt stamped) in batches, keeps each customer's live
multiset of one measure's values, and counts the writes each design would send per stream record:

  per-value    one helper item per value (what the service does today): the target's ledger
               write, one write per helper whose count changed, one derivation per target whose
               helpers changed
  packed       the live multiset as attributes of the target while it holds at most --pack
               values (the ledger write carries the changes; a derivation only when the derived
               value moved, read from the write's returned item), one helper per value beyond
  chunked      packed as above, and beyond it helper items that each hold a range of up to
               --chunk values (filled to 3/4 after a split): one write per range touched

It counts writes, not WCU: every item is taken to be under 1 KB, which a packed target holding
--pack values of several measures is not (about 20 to 35 bytes per value). Derivations of
several measures of one target share one write in the service; here each measure is alone.

  python3 bench/packing_model.py                 # max, min, latest, distinct; pack 32, chunk 64
  python3 bench/packing_model.py --pack 16 --chunk 128 --kinds max,latest
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workload as wl  # noqa: E402

Value = Any

# The measure kinds of bench-measures' rows, as the value each order contributes (None: none).
KINDS: dict[str, Callable[[dict[str, Any]], Value]] = {
    "max": lambda item: float(item["total"]["N"]),  # max: total
    "min": lambda item: item["SK"]["S"].split("#")[1],  # min: "{date|day}"
    # latest: status, by: updatedAt (a helper per version of each order)
    "latest": lambda item: (item["updatedAt"]["N"], item["SK"]["S"]),
    "distinct": lambda item: item["SK"]["S"].split("#")[1],  # distinct: "{date|day}"
}


def derived(kind: str, live: collections.Counter) -> Value:
    """The measure's value over a live multiset (values at zero are removed)."""
    if kind == "distinct":
        return len(live)
    if not live:
        return None
    return min(live) if kind == "min" else max(live)


def batch_deltas(kind: str, batch: list[wl.Write]) -> tuple[set[str], dict[str, dict[Value, int]]]:
    """The customers a batch touches, and the net change of each value per customer."""
    touched: set[str] = set()
    deltas: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    value = KINDS[kind]
    for w in batch:
        touched.add(w.customer)
        old = value(w.old) if w.old else None
        new = value(w.new) if w.new else None
        if old == new:
            continue
        if old is not None:
            deltas[w.customer][old] -= 1
        if new is not None:
            deltas[w.customer][new] += 1
    return touched, {c: {v: n for v, n in d.items() if n} for c, d in deltas.items()}


def ranges_touched(live: collections.Counter, changed: dict[Value, int], chunk: int) -> int:
    """Range items a change touches, the live values cut every 3/4 of `chunk` in order."""
    step = max(1, chunk * 3 // 4)
    order = {v: i // step for i, v in enumerate(sorted(set(live) | set(changed)))}
    return len({order[v] for v in changed})


def run(
    kind: str, writes: list[wl.Write], batch: int, design: str, pack: int, chunk: int
) -> dict[str, float]:
    """Writes per record of one design, split into ledger writes, helper writes, derivations."""
    live: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    spilled: set[str] = set()
    out = collections.Counter()
    for b in range(0, len(writes), batch):
        touched, deltas = batch_deltas(kind, writes[b : b + batch])
        out["ledger"] += len(touched)
        for customer, changed in deltas.items():
            if not changed:
                continue
            ms = live[customer]
            before = derived(kind, ms)
            for v, n in changed.items():
                ms[v] += n
                if ms[v] == 0:
                    del ms[v]
            moved = derived(kind, ms) != before
            if design != "per-value" and customer not in spilled and len(ms) > pack:
                spilled.add(customer)
            if design == "per-value" or (customer in spilled and design == "packed"):
                out["helpers"] += len(changed)
                out["derivations"] += 1
            elif customer in spilled:
                out["helpers"] += ranges_touched(ms, changed, chunk)
                out["derivations"] += int(moved)
            else:
                out["derivations"] += int(moved)
    n = len(writes)
    return {k: out[k] / n for k in ("ledger", "helpers", "derivations")} | {"spilled": len(spilled)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=17_000)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--pack", type=int, default=32, help="values a target holds before it spills")
    p.add_argument("--chunk", type=int, default=64, help="values a range item holds at most")
    p.add_argument("--kinds", default="max,min,latest,distinct")
    a = p.parse_args(argv)
    kinds = a.kinds.split(",")
    if any(k not in KINDS for k in kinds):
        p.error(f"--kinds: each of {', '.join(KINDS)}")
    if min(a.writes, a.batch_size, a.pack, a.chunk) < 1:
        p.error("--writes, --batch-size, --pack and --chunk must be at least 1")
    work = wl.Workload(customers=500, seed=1, updated_at=True)
    writes = [work.next() for _ in range(a.writes)]
    print(
        f"{a.writes} writes, batches of {a.batch_size}; pack {a.pack} values, ranges of {a.chunk}"
    )
    print(
        "| measure | design | writes per record | ledger | helpers | derivations | x count | targets spilled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        for design in ("per-value", "packed", "chunked"):
            r = run(kind, writes, a.batch_size, design, a.pack, a.chunk)
            total = r["ledger"] + r["helpers"] + r["derivations"]
            print(
                f"| {kind} | {design} | {total:.3f} | {r['ledger']:.3f} | {r['helpers']:.3f} | "
                f"{r['derivations']:.3f} | {total / r['ledger']:.2f} | {r['spilled']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
