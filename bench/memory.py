"""Peak memory and records/s of a catch-up, the binary as users run it against the same binary
with one environment variable set (by default mimalloc's own purge delay), side by side in one
run.

The binary sets mimalloc's `purge_delay` to 0 itself (src/main.rs) unless MIMALLOC_PURGE_DELAY
is set. This writes the bench's backlog once (bench/run.py's catch-up: 20,000 commerce writes
and a marker), then catches up from TRIM_HORIZON `--runs` times per variant, alternating (in
ABBA order):
"default" (no variable: what a user who runs the binary outside the image gets) and
"purge_delay 1000" (MIMALLOC_PURGE_DELAY=1000, mimalloc 3's own default: the binary before it set
the option). Each run starts with a fresh state and aggregates table and is checked against the
truth. Prints per run records/s and peak RSS (VmHWM), then the medians and their ratio.

`--against NAME=VALUE` sets another variable in the second variant, e.g.
`--against DDB_AGGREGATOR__AGGREGATES__WRITE_CONCURRENCY=16` (the fixed write concurrency of
earlier releases, against the default window). `--against-bin PATH` runs another build in the
second variant instead, with no variable set (a build of an earlier commit, to measure a change).

Run by scripts/bench-memory, which installs and starts the emulators and builds the binary.
"""

from __future__ import annotations

import os
import statistics
import sys

from bench import run as bench


def main() -> int:
    p = bench.parser()
    p.add_argument("--runs", type=int, default=3, help="catch-ups per variant")
    p.add_argument("--batch-size", type=int, default=bench.SMALL_BATCH)
    p.add_argument(
        "--against",
        default="MIMALLOC_PURGE_DELAY=1000",
        help="NAME=VALUE: the variable the second variant sets (default: mimalloc's own purge delay)",
    )
    p.add_argument(
        "--against-bin",
        metavar="PATH",
        help="run this binary in the second variant instead of setting a variable",
    )
    a = p.parse_args()
    var, sep, val = a.against.partition("=")
    if not sep or not var:
        p.error(f"--against {a.against!r}: give NAME=VALUE")
    if a.against_bin and not os.access(a.against_bin, os.X_OK):
        p.error(f"--against-bin {a.against_bin!r}: not an executable file")
    ours = a.bin
    other = f"{var}={val}" if not a.against_bin else f"bin {a.against_bin}"
    variants = (("default", None), (other, None if a.against_bin else val))
    harness = bench.Harness(a)
    harness.write_backlog()
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in variants}
    for run in range(1, a.runs + 1):
        # ABBA: DynamoDB Local gets faster run after run, so neither variant always goes second.
        for name, value in variants if run % 2 else reversed(variants):
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value
            a.bin = a.against_bin if name != "default" and a.against_bin else ours
            tag = 10 * run + len(figures[name]) + (0 if name == "default" else 5)
            out = harness.catchup_run("ddb-aggregator", tag, batch_size=a.batch_size)
            figures[name].append((out["records_per_second"], out["peak_rss_mib"]))
            bench.log(
                f"{name} run {run}: {out['records_per_second']} records/s, peak RSS {out['peak_rss_mib']} MiB"
            )
    os.environ.pop(var, None)
    if harness.results["failures"]:
        for f in harness.results["failures"]:
            bench.log(f"FAILURE: {f}")
        return 1
    medians = {
        name: (statistics.median(r for r, _ in v), statistics.median(m for _, m in v))
        for name, v in figures.items()
    }
    print(
        f"\n| variant (batch_size {a.batch_size}, {a.runs} runs each) | records/s (median) | peak RSS MiB (median) | peak RSS per run |"
    )
    print("|---|---|---|---|")
    for name, v in figures.items():
        print(
            f"| {name} | {medians[name][0]:,.0f} | {medians[name][1]:.1f} | {', '.join(f'{m:.1f}' for _, m in v)} |"
        )
    (d_rate, d_rss), (p_rate, p_rss) = medians["default"], medians[other]
    print(f"\ndefault / {other}: records/s x{d_rate / p_rate:.2f}, peak RSS x{d_rss / p_rss:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
