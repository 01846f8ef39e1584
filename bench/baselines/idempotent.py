"""Baseline (b): a Lambda stream handler made idempotent per record, Powertools-style.

Each record is one TransactWriteItems: a conditional Put of an idempotency item
(PK "IDEMP#<eventID>", SK "IDEMP", condition attribute_not_exists(PK), a `ttl` one hour ahead as
Powertools' default expiry) plus one Update with ADD per aggregate item the record touches. A
TransactionCanceled whose reason is the idempotency item's condition means the record was
already processed: it is skipped. The idempotency items live in the aggregates table.

  python -m bench.baselines.idempotent --endpoint URL --table SRC --aggregates-table AGG --stats FILE
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench import commerce
from bench.baselines.lambda_runtime import Context, add_update, main

IDEMPOTENCY_TTL_SECONDS = 3600


def handler(event: dict[str, Any], context: Context) -> None:
    ddb = context.dynamodb
    for record in event["Records"]:
        deltas = commerce.record_deltas(record)
        if not deltas:
            continue
        guard = {
            "TableName": context.table,
            "Item": {
                "PK": {"S": f"IDEMP#{record['eventID']}"},
                "SK": {"S": "IDEMP"},
                "status": {"S": "COMPLETED"},
                "ttl": {"N": str(int(time.time()) + IDEMPOTENCY_TTL_SECONDS)},
            },
            "ConditionExpression": "attribute_not_exists(PK)",
        }
        items = [{"Put": guard}] + [
            {"Update": add_update(context.table, t, d)} for t, d in deltas.items()
        ]
        try:
            context.meter.call(ddb.transact_write_items, TransactItems=items)
        except ddb.exceptions.TransactionCanceledException as e:
            reasons = e.response.get("CancellationReasons") or []
            if not (reasons and reasons[0].get("Code") == "ConditionalCheckFailed"):
                raise


if __name__ == "__main__":
    sys.exit(main("idempotent", handler, __doc__))
