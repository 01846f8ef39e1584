#!/usr/bin/env python3
"""Demo data for ddb-aggregator on the local emulators (run with the .local venv's python).

  demo_data.py setup             (re)create the commerce-main table with a NEW_AND_OLD_IMAGES
                                 stream, and the dead-letter queue
  demo_data.py write [--seed N]  write customers and orders: inserts, status changes, total
                                 changes, deletes
  demo_data.py poison            write one order whose total is not a number (a poison record)
  demo_data.py drift             set CUST#c1's orderCount to a wrong value, then write an order
                                 for c1 (so the service's schedule reconciles c1)
  demo_data.py show [--check]    print the aggregate items next to the truth computed from a
                                 scan of the orders; with --check exit 1 unless they agree

Endpoints come from AWS_ENDPOINT_URL_DYNAMODB / AWS_ENDPOINT_URL_SQS (scripts/local-aws env).
"""

import argparse
import os
import random
import sys
from collections import defaultdict
from decimal import Decimal

import boto3

TABLE = os.environ.get("DEMO_TABLE", "commerce-main")
STATE = os.environ.get("DEMO_STATE", "ddb-aggregator-state")
QUEUE = os.environ.get("DEMO_QUEUE", "ddb-aggregator-dlq")
STATUSES = ["PENDING", "PAID", "SHIPPED", "CANCELLED"]


def ddb():
    return boto3.client(
        "dynamodb",
        endpoint_url=os.environ["AWS_ENDPOINT_URL_DYNAMODB"],
        region_name=os.environ.get("AWS_REGION", "us-east-1"),
    )


def setup():
    c = ddb()
    try:
        c.delete_table(TableName=TABLE)
        c.get_waiter("table_not_exists").wait(TableName=TABLE)
    except c.exceptions.ResourceNotFoundException:
        pass
    c.create_table(
        TableName=TABLE,
        BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[
            {"AttributeName": "PK", "AttributeType": "S"},
            {"AttributeName": "SK", "AttributeType": "S"},
        ],
        KeySchema=[
            {"AttributeName": "PK", "KeyType": "HASH"},
            {"AttributeName": "SK", "KeyType": "RANGE"},
        ],
        StreamSpecification={"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"},
    )
    c.get_waiter("table_exists").wait(TableName=TABLE)
    # The state table is per stream; a fresh demo starts from a fresh one.
    try:
        c.delete_table(TableName=STATE)
    except c.exceptions.ResourceNotFoundException:
        pass
    sqs = boto3.client(
        "sqs",
        endpoint_url=os.environ["AWS_ENDPOINT_URL_SQS"],
        region_name=os.environ.get("AWS_REGION", "us-east-1"),
    )
    sqs.create_queue(QueueName=QUEUE)
    print(f"created table {TABLE} (stream NEW_AND_OLD_IMAGES) and queue {QUEUE}")


def write(seed):
    rng = random.Random(seed)
    c = ddb()
    writes = 0
    for i in range(1, 6):
        c.put_item(
            TableName=TABLE,
            Item={
                "PK": {"S": f"CUST#c{i}"},
                "SK": {"S": "PROFILE"},
                "name": {"S": f"Customer {i}"},
            },
        )
        writes += 1
    orders = {}
    for n in range(1, 61):
        cust = f"c{rng.randint(1, 5)}"
        day = f"2026-11-{rng.randint(27, 30):02d}"
        key = {"PK": {"S": f"CUST#{cust}"}, "SK": {"S": f"ORDER#{day}#o{n:03d}"}}
        total = Decimal(rng.randint(100, 20000)) / 100
        status = rng.choice(["PENDING", "PAID"])
        # The application copies the customer's name onto the order it places; the copy rule
        # (customer-name-on-orders) keeps it in sync afterwards.
        name = {"S": f"Customer {cust[1:]}"}
        c.put_item(
            TableName=TABLE,
            Item={**key, "status": {"S": status}, "total": {"N": str(total)}, "customerName": name},
        )
        orders[n] = key
        writes += 1
    for n in rng.sample(sorted(orders), 20):
        c.update_item(
            TableName=TABLE,
            Key=orders[n],
            UpdateExpression="SET #s = :s",
            ExpressionAttributeNames={"#s": "status"},
            ExpressionAttributeValues={":s": {"S": rng.choice(["SHIPPED", "CANCELLED", "PAID"])}},
        )
        writes += 1
    for n in rng.sample(sorted(orders), 10):
        c.update_item(
            TableName=TABLE,
            Key=orders[n],
            UpdateExpression="SET #t = :t",
            ExpressionAttributeNames={"#t": "total"},
            ExpressionAttributeValues={":t": {"N": str(Decimal(rng.randint(100, 20000)) / 100)}},
        )
        writes += 1
    for n in rng.sample(sorted(orders), 8):
        c.delete_item(TableName=TABLE, Key=orders.pop(n))
        writes += 1
    print(
        f"wrote {writes} changes: 5 customers, 60 orders, 20 status changes, 10 total changes, 8 deletes"
    )


def poison():
    ddb().put_item(
        TableName=TABLE,
        Item={
            "PK": {"S": "CUST#c2"},
            "SK": {"S": "ORDER#2026-11-30#poison"},
            "status": {"S": "PAID"},
            "total": {"S": "12 EUR"},
        },
    )
    print("wrote one poison order (total is a string)")


def drift():
    c = ddb()
    c.update_item(
        TableName=TABLE,
        Key={"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}},
        UpdateExpression="SET orderCount = :v",
        ExpressionAttributeValues={":v": {"N": "999"}},
    )
    c.put_item(
        TableName=TABLE,
        Item={
            "PK": {"S": "CUST#c1"},
            "SK": {"S": "ORDER#2026-11-30#late"},
            "status": {"S": "PAID"},
            "total": {"N": "1"},
        },
    )
    print("set CUST#c1 orderCount to 999 and wrote an order for c1")


def scan():
    c = ddb()
    items = []
    kwargs = {"TableName": TABLE, "ConsistentRead": True}
    while True:
        page = c.scan(**kwargs)
        items.extend(page["Items"])
        if "LastEvaluatedKey" not in page:
            return items
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def truth(items):
    t = defaultdict(Decimal)
    for it in items:
        pk, sk = it["PK"]["S"], it["SK"]["S"]
        parts = sk.split("#")
        if not (
            pk.startswith("CUST#")
            and len(pk.split("#")) == 2
            and len(parts) == 3
            and parts[0] == "ORDER"
        ):
            continue
        if "total" in it and "N" not in it["total"]:
            continue  # a poison item: both rules refuse it (it is in the dead-letter queue)
        total = Decimal(it["total"]["N"]) if "total" in it else None
        status = it.get("status", {}).get("S")
        prof = (pk, "PROFILE")
        t[prof + ("orderCount",)] += 1
        if total is not None:
            t[prof + ("revenue",)] += total
        if status:
            t[prof + (f"orders_{status}",)] += 1
            if status in ("PENDING", "PAID"):
                t[prof + ("openOrders",)] += 1
                if total is not None:
                    t[prof + ("openRevenue",)] += total
        day = (f"SALES#{parts[1][:10]}", "TOTAL")
        t[day + ("orders",)] += 1
        if total is not None:
            t[day + ("revenue",)] += total
    return {k: v for k, v in t.items() if v != 0}


RENAMED = "Ada (renamed)"


def rename():
    # UpdateItem, not PutItem: the profile also holds the customer's aggregates.
    ddb().update_item(
        TableName=TABLE,
        Key={"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}},
        UpdateExpression="SET #n = :n",
        ExpressionAttributeNames={"#n": "name"},
        ExpressionAttributeValues={":n": {"S": RENAMED}},
    )
    print(f"renamed customer c1 to {RENAMED!r}")


def copies(check):
    items = scan()
    names = {
        it["PK"]["S"]: it.get("name", {}).get("S") for it in items if it["SK"]["S"] == "PROFILE"
    }
    orders = [it for it in items if it["SK"]["S"].startswith("ORDER#")]
    stale = [o for o in orders if o.get("customerName", {}).get("S") != names.get(o["PK"]["S"])]
    if check:
        sys.exit(1 if stale or names.get("CUST#c1") != RENAMED else 0)
    for o in orders:
        if o["PK"]["S"] == "CUST#c1":
            print(
                f"{o['PK']['S'] + ' / ' + o['SK']['S']:<36} customerName = {o.get('customerName', {}).get('S')}"
            )
    print(f"\n{len(orders)} orders; {len(orders) - len(stale)} carry their customer's current name")
    return not stale


def show(check):
    items = scan()
    want = truth(items)
    got = {}
    for it in items:
        if it["SK"]["S"] in ("PROFILE", "TOTAL"):
            for a, v in it.items():
                if "N" in v and not a.startswith("_agg"):
                    if Decimal(v["N"]) != 0:
                        got[(it["PK"]["S"], it["SK"]["S"], a)] = Decimal(v["N"])
    if check:
        sys.exit(0 if got == want else 1)
    print(f"{'target':<28} {'attribute':<18} {'stored':>10} {'truth':>10}")
    for k in sorted(set(got) | set(want)):
        g, w = got.get(k, Decimal(0)), want.get(k, Decimal(0))
        mark = "" if g == w else "   <-- differs"
        print(f"{k[0] + ' / ' + k[1]:<28} {k[2]:<18} {g:>10} {w:>10}{mark}")
    ok = got == want
    print(
        f"\n{len(want)} aggregate values; {'all equal the truth computed from the orders' if ok else 'DIFFERENCES FOUND'}"
    )
    return ok


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "command", choices=["setup", "write", "poison", "drift", "show", "rename", "copies"]
    )
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    if a.command == "setup":
        setup()
    elif a.command == "write":
        write(a.seed)
    elif a.command == "poison":
        poison()
    elif a.command == "drift":
        drift()
    elif a.command == "rename":
        rename()
    elif a.command == "copies":
        sys.exit(0 if copies(a.check) else 1)
    else:
        sys.exit(0 if show(a.check) else 1)


if __name__ == "__main__":
    main()
