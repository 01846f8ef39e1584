"""Where a lag run's time goes.

ddb-aggregator logs one line per applied batch (target `ddb_aggregator::phases`, at debug):
the poll wait before the GetRecords call that returned its first record, the GetRecords time,
evaluation, dead letters, the target writes and the checkpoint, and the line's own time is
the batch's end. Each probe of a lag run (written at `sent`, its aggregate seen at `visible`)
is matched with the batch that made it visible: the latest batch whose writes started by
`visible` and whose GetRecords call returned after `sent` (a probe's own UpdateItem may end
before the batch's slowest one, so its batch's writes can end after it is visible; when the
harness's poll is late, the match can be a later batch than the true one). Its lag then
splits exactly into

- before_read: from the write to the start of that batch's GetRecords call, of which
  - poll_wait: the batch's own idle wait before that call (ours: the poll interval; the
    time after the previous batch was applied, not while it was),
  - earlier_batch: the part of the rest while an earlier batch was being read, written or
    checkpointed (one reader per shard: the next GetRecords waits for it),
  - not_readable: the remainder (polls that ran before the record was in DynamoDB Local's
    stream, and the gaps between them);
- get_records, evaluate, dead_letters: the batch's phases;
- writes: from the start of the batch's writes to the end of them or to `visible`, whichever
  comes first;
- visible_after: from the end of the writes to the harness seeing the aggregate (its 20 ms
  poll and GetItem), when the writes ended first.

The checkpoint is not in any probe's lag directly: it delays the next batch (its time shows in
`earlier` of the probes that batch applies).
"""

from __future__ import annotations

import bisect
import json
from datetime import datetime
from pathlib import Path
from typing import Any

PHASES = ("poll_wait", "get_records", "evaluate", "dead_letters", "writes", "checkpoint")
PARTS = (
    "poll_wait",
    "earlier_batch",
    "not_readable",
    "get_records",
    "evaluate",
    "dead_letters",
    "writes",
    "visible_after",
)
EPS = 0.002  # seconds of clock and rounding slack between the harness and the service's log


def batches(log_path: Path) -> list[dict[str, Any]]:
    """The batch phase lines of a ddb-aggregator JSON log, ordered by the end of their writes."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict) or e.get("message") != "batch phases":
            continue
        try:
            end = datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()
            s = {p: float(e[f"{p}_ms"]) / 1000.0 for p in PHASES}
        except (KeyError, ValueError, TypeError):
            continue
        writes_end = end - s["checkpoint"]
        writes_start = writes_end - s["writes"]
        read_start = writes_start - s["dead_letters"] - s["evaluate"] - s["get_records"]
        out.append(
            {
                "records": int(e.get("records", 0)),
                "writes_start": writes_start,
                "writes_end": writes_end,
                "read_start": read_start,
                "end": end,
                **s,
            }
        )
    out.sort(key=lambda b: b["writes_start"])
    return out


def attribute(
    sent: float, visible: float, found: list[dict[str, Any]], starts: list[float]
) -> dict[str, float] | None:
    """The probe's lag by part (they add up to visible - sent), or None when no batch fits."""
    i = bisect.bisect_right(starts, visible + EPS) - 1
    if i >= 0 and found[i]["read_start"] + found[i]["get_records"] >= sent - EPS:
        b = found[i]
        before_read = max(0.0, b["read_start"] - sent)
        wait = min(b["poll_wait"], before_read)
        busy = busy_overlap(found, i, sent, b["read_start"] - wait)
        return {
            "poll_wait": wait,
            "earlier_batch": busy,
            "not_readable": max(0.0, before_read - wait - busy),
            "get_records": b["get_records"],
            "evaluate": b["evaluate"],
            "dead_letters": b["dead_letters"],
            "writes": max(0.0, min(visible, b["writes_end"]) - b["writes_start"]),
            "visible_after": max(0.0, visible - b["writes_end"]),
        }
    return None


def busy_overlap(found: list[dict[str, Any]], before: int, start: float, end: float) -> float:
    """Seconds of [start, end] during which one of the batches before index `before` was busy
    (from its GetRecords call to its checkpoint's end)."""
    total = 0.0
    j = before - 1
    while j >= 0 and found[j]["end"] > start:
        lo, hi = max(start, found[j]["read_start"]), min(end, found[j]["end"])
        total += max(0.0, hi - lo)
        j -= 1
    return min(total, max(0.0, end - start))


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def breakdown(log_path: Path, probes: list[tuple[float, float]]) -> dict[str, Any]:
    """Phase quantiles over the run's batches, and the lag of its slowest probes by part."""
    found = batches(log_path)
    starts = [b["writes_start"] for b in found]
    per_phase = {
        p: {
            "p50_ms": round(quantile([b[p] for b in found], 0.5) * 1000, 2),
            "p99_ms": round(quantile([b[p] for b in found], 0.99) * 1000, 2),
        }
        for p in PHASES
    }
    lags = [v - s for s, v in probes]
    p99 = quantile(lags, 0.99)
    p90 = quantile(lags, 0.90)

    def group(threshold: float) -> dict[str, Any]:
        chosen = [(s, v) for s, v in probes if v - s >= threshold - 1e-9]
        parts = [attribute(s, v, found, starts) for s, v in chosen]
        matched = [p for p in parts if p is not None]
        mean = {
            k: (sum(p[k] for p in matched) / len(matched) * 1000 if matched else 0.0) for k in PARTS
        }
        return {
            "threshold_s": round(threshold, 4),
            "probes": len(chosen),
            "matched": len(matched),
            "mean_lag_ms": round(sum(v - s for s, v in chosen) / len(chosen) * 1000, 1)
            if chosen
            else 0.0,
            "mean_parts_ms": {k: round(x, 1) for k, x in mean.items()},
        }

    every = [attribute(s, v, found, starts) for s, v in probes]
    return {
        "batches": len(found),
        "records_per_batch_p50": quantile([float(b["records"]) for b in found], 0.5),
        "phases": per_phase,
        "all": group(0.0),
        "p90": group(p90),
        "p99": group(p99),
        "probes_matched": sum(1 for p in every if p is not None),
    }
