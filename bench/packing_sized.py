#!/usr/bin/env python3
"""WCU per record of packed helper measures on the commerce mix, with item sizes, without DynamoDB.

A model, not a measurement (bench/packing_model.py counts writes; this one prices them). It
replays bench/workload.py's backlog (the one scripts/bench-measures writes: 500 Zipf customers,
seed 1, updatedAt stamped) in batches and prices every write at DynamoDB's rate: one WCU per KB
of the larger of the item's images, rounded up, twice that in a transaction. The design priced:

  packed   each measure's live multiset is kept in the target as one attribute per value
           (`_agg#<tag>#<encoded value>`: its count), ADDed by the target's ledger write; a value
           that reaches zero is removed by the next derivation write (the target's ledger still
           refuses any replay, so no expiry is needed inside the target)
  derive   one write per target and batch when a derived value moved, read from the ledger
           write's returned item (ALL_NEW); it also removes the zeros
  spill    when the target would pass --target-limit bytes, the measure holding most bytes moves
           for good into range items (a transaction: the target, and the ranges with a copy of
           its ledger entries)
  ranges   items `<target SK>#_agg#<tag>#<first value>` holding up to --range-limit bytes of
           values; a batch writes each range it touches through the ledger; a range that passes
           the limit splits in two (a transaction); derivations of a spilled measure read the
           ranges and write the target only when the value moved
  inline   (second row) the ledger write itself sets a value it raises past the old one (max,
           min and latest: conditioned on a shadow of the old value, which the writer knows from
           the item its last write returned), so only a value that falls back (its holder
           deleted or changed) or a distinct count that moves costs a derivation; the ledger
           write also removes the zeros its last write returned
  cas      (third row) the ledger write is conditioned on the target's write counter being the
           one of the item its writer last saw (a compare-and-swap on a cached image): it then
           knows the packed values exactly and sets every packed measure's value and removes its
           zeros itself, so packed measures cost no derivation; spilled ones derive as in the
           first row (every target here is taken to be written by one shard, as a customer's
           orders are, so the image is always current)

Item sizes: --target-base bytes for a target's keys, counters, ledger entries and marks, and
--range-base for a range item's; an attribute costs its name's bytes and its value's (a small
N: 2 bytes). Counts of `count` alone: one write per target and batch at --target-base.

  python3 bench/packing_sized.py                 # about 5 s
  python3 bench/packing_sized.py --target-limit 2048 --range-limit 2048
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workload as wl  # noqa: E402
from bench.packing_model import KINDS, batch_deltas  # noqa: E402

KB = 1024
COUNT_BYTES = 2  # a small N
TAG_BYTES = len("_agg#xx#")  # a packed value's name, before the encoded value


def encoded_len(kind: str, value: Any) -> int:
    """Bytes of a value's sortable encoding (src/rules/helper.rs): N<class><exp 3><digits>, S<text>."""

    def number(text: str) -> int:
        return 5 + len(text.replace(".", "").strip("0") or "0")

    if kind == "max":
        return number(f"{value:.2f}")
    if kind == "latest":
        by, sk = value
        return number(by) + 1 + 1 + len("SHIPPED")  # `<by>#<status>`: the longest status
    return 1 + len(value)  # a day, "2026-..-.."


def wcu(size: int, transaction: bool = False) -> int:
    return max(1, math.ceil(size / KB)) * (2 if transaction else 1)


@dataclass
class Measure:
    kind: str
    live: collections.Counter = field(default_factory=collections.Counter)
    zeros: set[Any] = field(default_factory=set)  # packed values at zero, not yet removed
    spilled: bool = False
    ranges: list[list[Any]] = field(default_factory=list)  # sorted values per range, in order

    def packed_bytes(self) -> int:
        if self.spilled:
            return 0
        return sum(
            TAG_BYTES + encoded_len(self.kind, v) + COUNT_BYTES for v in (*self.live, *self.zeros)
        )

    def derived(self) -> Any:
        if self.kind == "distinct":
            return len(self.live)
        if not self.live:
            return None
        return min(self.live) if self.kind == "min" else max(self.live)


@dataclass
class Cost:
    wcu: int = 0
    ledger: int = 0
    ranges: int = 0
    derivations: int = 0
    spills: int = 0
    splits: int = 0
    largest_target: int = 0


class Model:
    def __init__(self, kinds: list[str], a: argparse.Namespace):
        self.kinds, self.a = kinds, a
        self.targets: dict[str, dict[str, Measure]] = collections.defaultdict(
            lambda: {k: Measure(k) for k in kinds}
        )
        self.cost = Cost()

    def target_size(self, ms: dict[str, Measure]) -> int:
        return self.a.target_base + sum(m.packed_bytes() for m in ms.values())

    def range_size(self, m: Measure, values: list[Any]) -> int:
        return self.a.range_base + sum(1 + encoded_len(m.kind, v) + COUNT_BYTES for v in values)

    def batch(self, customer: str, deltas: dict[str, dict[Any, int]]) -> None:
        ms = self.targets[customer]
        before = self.target_size(ms)
        if self.a.design != "plain":
            for m in ms.values():
                m.zeros.clear()  # removed by this ledger write, as its last returned item showed
        moved = False
        for kind, changed in deltas.items():
            m = ms[kind]
            old = m.derived()
            touched_ranges = self.touched_ranges(m, changed) if m.spilled else set()
            for v, n in changed.items():
                m.live[v] += n
                if m.live[v] == 0:
                    del m.live[v]
                    if not m.spilled:
                        m.zeros.add(v)
                else:
                    m.zeros.discard(v)
            new = m.derived()
            if new != old and not self.inlined(m, old, new, changed):
                moved = True
            if m.spilled:
                self.write_ranges(m, changed, touched_ranges)
        after = self.target_size(ms)
        self.cost.ledger += 1
        self.cost.wcu += wcu(max(before, after))
        if moved:
            for m in ms.values():
                m.zeros.clear()
            self.cost.derivations += 1
            self.cost.wcu += wcu(after)
        self.spill(ms)
        self.cost.largest_target = max(self.cost.largest_target, self.target_size(ms))

    def inlined(self, m: Measure, old: Any, new: Any, changed: dict[Any, int]) -> bool:
        """Whether the ledger write itself sets the new value: under `cas` any packed measure's;
        under `inline` a value it raised that beats the old one (a condition on the old value's
        shadow attribute makes that safe)."""
        if self.a.design == "plain":
            return False
        if self.a.design == "cas":
            return not m.spilled
        if m.kind == "distinct" or new is None or changed.get(new, 0) <= 0:
            return False
        if old is None:
            return True
        return new < old if m.kind == "min" else new > old

    def touched_ranges(self, m: Measure, changed: dict[Any, int]) -> set[int]:
        return {self.range_of(m, v) for v in changed}

    @staticmethod
    def range_of(m: Measure, value: Any) -> int:
        for i in range(len(m.ranges) - 1, 0, -1):
            if m.ranges[i] and value >= m.ranges[i][0]:
                return i
        return 0

    def write_ranges(self, m: Measure, changed: dict[Any, int], touched: set[int]) -> None:
        for v in changed:
            r = m.ranges[self.range_of(m, v)]
            if v in m.live and v not in r:
                r.append(v)
                r.sort()
            elif v not in m.live and v in r:
                r.remove(v)
        for i in sorted(touched, reverse=True):
            self.cost.ranges += 1
            self.cost.wcu += wcu(self.range_size(m, m.ranges[i]))
            if self.range_size(m, m.ranges[i]) > self.a.range_limit:
                r = m.ranges[i]
                half = len(r) // 2
                m.ranges[i : i + 1] = [r[:half], r[half:]]
                self.cost.splits += 1
                self.cost.wcu += wcu(self.range_size(m, r[:half]), True)
                self.cost.wcu += wcu(self.range_size(m, r[half:]), True)

    def spill(self, ms: dict[str, Measure]) -> None:
        while self.target_size(ms) > self.a.target_limit:
            packed = [m for m in ms.values() if not m.spilled]
            if not packed:
                return
            m = max(packed, key=Measure.packed_bytes)
            before = self.target_size(ms)
            m.spilled, m.zeros = True, set()
            values = sorted(m.live)
            step = max(1, self.a.values_per_new_range)
            m.ranges = [values[i : i + step] for i in range(0, len(values), step)] or [[]]
            self.cost.spills += 1
            self.cost.wcu += wcu(before, True)
            self.cost.wcu += sum(wcu(self.range_size(m, r), True) for r in m.ranges)


def run(kinds: list[str], writes: list[wl.Write], a: argparse.Namespace) -> Cost:
    model = Model(kinds, a)
    for b in range(0, len(writes), a.batch_size):
        batch = writes[b : b + a.batch_size]
        per_kind = {k: batch_deltas(k, batch) for k in kinds}
        touched = set().union(*(t for t, _ in per_kind.values()))
        for customer in sorted(touched):
            model.batch(customer, {k: d.get(customer, {}) for k, (_, d) in per_kind.items()})
    return model.cost


def count_wcu(writes: list[wl.Write], batch_size: int) -> int:
    return sum(
        len({w.customer for w in writes[b : b + batch_size]})
        for b in range(0, len(writes), batch_size)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=17_000)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument(
        "--target-base", type=int, default=400, help="a target's bytes without packed values"
    )
    p.add_argument(
        "--range-base", type=int, default=200, help="a range item's bytes without values"
    )
    p.add_argument(
        "--target-limit",
        type=int,
        default=KB,
        help="bytes a target may reach before a measure spills",
    )
    p.add_argument(
        "--range-limit", type=int, default=KB, help="bytes a range may reach before it splits"
    )
    p.add_argument(
        "--values-per-new-range", type=int, default=20, help="values per range at a spill"
    )
    a = p.parse_args(argv)
    if min(a.writes, a.batch_size, a.target_base, a.range_base, a.target_limit, a.range_limit) < 1:
        p.error("sizes and counts must be at least 1")
    work = wl.Workload(customers=500, seed=1, updated_at=True)
    writes = [work.next() for _ in range(a.writes)]
    n = len(writes)
    count = count_wcu(writes, a.batch_size)
    # The measures example: count, sum, two avg and the four helper measures on PROFILE, and the
    # orders-placed rule's own target (count-like) on PLACED.
    rows = [([k], k) for k in KINDS] + [(list(KINDS), "example (+ PLACED)")]
    print(
        f"{n} writes, batches of {a.batch_size}; target base {a.target_base} B, limit "
        f"{a.target_limit} B; range base {a.range_base} B, limit {a.range_limit} B"
    )
    print(f"count: {count / n:.3f} WCU per record")
    print(
        "| measure | design | WCU per record | x count | ledger | range writes | derivations | spills | splits | largest target B |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (kinds, label), design in itertools.product(rows, ("plain", "inline", "cas")):
        a.design = design
        c = run(kinds, writes, a)
        total = c.wcu + (count if label.startswith("example") else 0)
        print(
            f"| {label} | {design} | {total / n:.3f} | {total / count:.2f} | {c.ledger / n:.3f} | "
            f"{c.ranges / n:.3f} | {c.derivations / n:.3f} | {c.spills} | {c.splits} | {c.largest_target} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
