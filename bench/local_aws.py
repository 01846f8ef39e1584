"""Table and stream helpers for the harness, against DynamoDB Local on 127.0.0.1."""

from __future__ import annotations

import time
from typing import Any

import boto3
from botocore.config import Config

REGION = "us-east-1"
KEY_SCHEMA = {
    "AttributeDefinitions": [
        {"AttributeName": "PK", "AttributeType": "S"},
        {"AttributeName": "SK", "AttributeType": "S"},
    ],
    "KeySchema": [
        {"AttributeName": "PK", "KeyType": "HASH"},
        {"AttributeName": "SK", "KeyType": "RANGE"},
    ],
}


def client(service: str, endpoint: str) -> Any:
    """A low-level client with bounded timeouts (local endpoints, dummy credentials)."""
    return boto3.session.Session().client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="local",
        aws_secret_access_key="local",
        config=Config(
            connect_timeout=3,
            read_timeout=30,
            retries={"mode": "standard", "max_attempts": 5},
            max_pool_connections=16,
        ),
    )


def delete_table(ddb: Any, name: str) -> None:
    try:
        ddb.delete_table(TableName=name)
    except ddb.exceptions.ResourceNotFoundException:
        return
    ddb.get_waiter("table_not_exists").wait(
        TableName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60}
    )


def create_table(ddb: Any, name: str, stream: bool) -> None:
    """(Re)creates an on-demand table keyed PK/SK, with a NEW_AND_OLD_IMAGES stream if asked."""
    delete_table(ddb, name)
    kwargs: dict[str, Any] = {"TableName": name, "BillingMode": "PAY_PER_REQUEST", **KEY_SCHEMA}
    if stream:
        kwargs["StreamSpecification"] = {
            "StreamEnabled": True,
            "StreamViewType": "NEW_AND_OLD_IMAGES",
        }
    ddb.create_table(**kwargs)
    ddb.get_waiter("table_exists").wait(
        TableName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60}
    )


def scan(ddb: Any, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"TableName": name, "ConsistentRead": True}
    while True:
        page = ddb.scan(**kwargs)
        items.extend(page["Items"])
        if "LastEvaluatedKey" not in page:
            return items
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def read_stream(
    ddb: Any, streams: Any, table: str, timeout: float = 300.0
) -> tuple[list[dict[str, Any]], int]:
    """Every record of the table's stream, shards parent first, and the number of shards.

    An open shard is read until GetRecords returns an empty page (DynamoDB Local returns
    everything available up to the limit, so an empty page is the tip)."""
    arn = ddb.describe_table(TableName=table)["Table"]["LatestStreamArn"]
    shards: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"StreamArn": arn}
    while True:
        desc = streams.describe_stream(**kwargs)["StreamDescription"]
        shards.extend(desc["Shards"])
        if not desc.get("LastEvaluatedShardId"):
            break
        kwargs["ExclusiveStartShardId"] = desc["LastEvaluatedShardId"]
    ids = {s["ShardId"] for s in shards}
    ordered: list[dict[str, Any]] = []
    done: set[str] = set()
    while len(ordered) < len(shards):  # parents first (a parent that is not listed counts as read)
        ready = [
            s
            for s in shards
            if s["ShardId"] not in done
            and (s.get("ParentShardId") not in ids or s.get("ParentShardId") in done)
        ]
        if not ready:
            raise RuntimeError(f"stream of {table}: shard lineage has a cycle")
        for s in ready:
            ordered.append(s)
            done.add(s["ShardId"])
    deadline = time.monotonic() + timeout
    records: list[dict[str, Any]] = []
    for shard in ordered:
        it = streams.get_shard_iterator(
            StreamArn=arn, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while it is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading the stream of {table} took over {timeout:.0f} s")
            page = streams.get_records(ShardIterator=it, Limit=1000)
            records.extend(page["Records"])
            if not page["Records"]:
                break
            it = page.get("NextShardIterator")
    return records, len(shards)
