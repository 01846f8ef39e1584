"""Baseline (a): the naive Lambda stream handler most users start with.

For each record and each aggregate item it touches, one UpdateItem that ADDs the record's
deltas (bench/commerce.py computes them as the two rules of config/commerce.yaml define).
Nothing makes it idempotent: a retried batch or a replayed stream applies records again.

  python -m bench.baselines.naive --endpoint URL --table SRC --aggregates-table AGG --stats FILE
"""

from __future__ import annotations

import sys
from typing import Any

from bench import commerce
from bench.baselines.lambda_runtime import Context, add_update, main


def handler(event: dict[str, Any], context: Context) -> None:
    for record in event["Records"]:
        for target, deltas in commerce.record_deltas(record).items():
            context.meter.call(
                context.dynamodb.update_item, **add_update(context.table, target, deltas)
            )


if __name__ == "__main__":
    sys.exit(main("naive", handler, __doc__))
