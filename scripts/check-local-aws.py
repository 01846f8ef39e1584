#!/usr/bin/env python3
"""Checks the local emulators started by scripts/local-aws against what the
project relies on: DynamoDB Local (tables, conditional writes, consumed
capacity, DynamoDB Streams) and moto's SQS.

Run it with the venv that scripts/local-aws builds (it has boto3):

    scripts/local-aws start
    .local/venv/bin/python scripts/check-local-aws.py        # or:
    scripts/local-aws python scripts/check-local-aws.py

Endpoints come from AWS_ENDPOINT_URL_DYNAMODB / AWS_ENDPOINT_URL_SQS, else
from DDB_LOCAL_PORT / SQS_LOCAL_PORT (defaults 8000 / 9324) on 127.0.0.1.
Every call has short timeouts and the whole run is bounded by --timeout.
It creates uniquely named tables and a queue and deletes them at the end.
Exit status: 0 all checks passed, 1 some check failed, 2 setup error/timeout.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import signal
import sys
import time
import traceback
import uuid

try:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError
except ImportError:  # run by a python without boto3: use the venv's, if built
    _venv_py = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", ".local", "venv", "bin", "python"
    )
    if os.path.exists(_venv_py) and os.path.realpath(sys.executable) != os.path.realpath(_venv_py):
        os.execv(_venv_py, [_venv_py, os.path.abspath(__file__), *sys.argv[1:]])
    sys.exit(
        "error: boto3 missing; run scripts/local-aws install, then .local/venv/bin/python "
        + sys.argv[0]
    )

RESULTS = {"passed": 0, "failed": 0}


def check(name: str, ok: bool, detail: object = "") -> bool:
    RESULTS["passed" if ok else "failed"] += 1
    print(f"{'ok  ' if ok else 'FAIL'} {name}{f'  [{detail}]' if detail != '' else ''}", flush=True)
    return ok


def info(name: str, value: object) -> None:
    print(f"info {name}: {value}", flush=True)


class Timeout(BaseException):
    pass


def on_alarm(_signum, _frame):
    raise Timeout()


def err_code(e: ClientError) -> str:
    return e.response.get("Error", {}).get("Code", "")


def poll(fn, until, timeout_s: float, interval_s: float = 0.05):
    """Call fn() until until(result) or timeout; returns (result, seconds)."""
    t0 = time.monotonic()
    while True:
        r = fn()
        if until(r) or time.monotonic() - t0 >= timeout_s:
            return r, time.monotonic() - t0
        time.sleep(interval_s)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ddb-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB")
        or f"http://127.0.0.1:{os.environ.get('DDB_LOCAL_PORT', '8000')}",
    )
    ap.add_argument(
        "--sqs-endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL_SQS")
        or f"http://127.0.0.1:{os.environ.get('SQS_LOCAL_PORT', '9324')}",
    )
    ap.add_argument("--timeout", type=int, default=180, help="bound on the whole run, seconds")
    ap.add_argument(
        "--skip-page-cap",
        action="store_true",
        help="skip the 1,100-item GetRecords page-size check (the slowest part)",
    )
    args = ap.parse_args()

    for v in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):  # explicit dummy credentials only
        os.environ.pop(v, None)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)

    cfg = Config(
        connect_timeout=2, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"}
    )
    main_sess = boto3.session.Session(
        aws_access_key_id="local", aws_secret_access_key="local", region_name="us-east-1"
    )
    ddb = main_sess.client("dynamodb", endpoint_url=args.ddb_endpoint, config=cfg)
    streams = main_sess.client("dynamodbstreams", endpoint_url=args.ddb_endpoint, config=cfg)
    sqs = main_sess.client("sqs", endpoint_url=args.sqs_endpoint, config=cfg)

    # Keep the raw GetRecords body, to see wire formats boto3 would convert.
    raw_bodies: list[bytes] = []
    streams.meta.events.register(
        "after-call.dynamodb-streams.GetRecords",
        lambda http_response, **_: raw_bodies.append(http_response.content),
    )

    info("endpoints", f"dynamodb {args.ddb_endpoint}, sqs {args.sqs_endpoint}")
    suffix = uuid.uuid4().hex[:8]
    tables: list[str] = []
    queues: list[str] = []
    try:
        try:
            ddb.list_tables(Limit=1)
            sqs.list_queues()
        except Exception as e:  # noqa: BLE001
            print(
                f"error: emulators not reachable ({e}); run scripts/local-aws start",
                file=sys.stderr,
            )
            return 2
        check_dynamodb(ddb, streams, raw_bodies, suffix, tables, args)
        check_shared_db(args.ddb_endpoint, cfg, tables[0])
        check_sqs(sqs, suffix, queues)
    except Timeout:
        RESULTS["failed"] += 1
        print(f"FAIL whole run exceeded --timeout {args.timeout}s", flush=True)
    except Exception:  # noqa: BLE001 - report any crash as a failure
        RESULTS["failed"] += 1
        print("FAIL unexpected error:", flush=True)
        traceback.print_exc(file=sys.stdout)
    finally:
        signal.alarm(30)  # bounded cleanup
        try:
            for t in tables:
                try:
                    ddb.delete_table(TableName=t)
                except ClientError:
                    pass
            for q in queues:
                try:
                    sqs.delete_queue(QueueUrl=q)
                except ClientError:
                    pass
        except Timeout:
            print("warning: cleanup timed out", flush=True)
        signal.alarm(0)

    print(f"{RESULTS['passed']} passed, {RESULTS['failed']} failed", flush=True)
    return 0 if RESULTS["failed"] == 0 else 1


def create_stream_table(ddb, name: str) -> dict:
    return ddb.create_table(
        TableName=name,
        AttributeDefinitions=[
            {"AttributeName": "PK", "AttributeType": "S"},
            {"AttributeName": "SK", "AttributeType": "S"},
        ],
        KeySchema=[
            {"AttributeName": "PK", "KeyType": "HASH"},
            {"AttributeName": "SK", "KeyType": "RANGE"},
        ],
        BillingMode="PAY_PER_REQUEST",
        StreamSpecification={"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"},
    )["TableDescription"]


def key(pk: str, sk: str = "1") -> dict:
    return {"PK": {"S": pk}, "SK": {"S": sk}}


def check_dynamodb(ddb, streams, raw_bodies, suffix, tables, args) -> None:
    print("== DynamoDB Local: table + stream", flush=True)
    # A first table with one record, so that a sequence number from outside
    # the main table's shard exists even on a freshly started server.
    foreign = f"check-local-aws-{suffix}-other"
    tables.append(foreign)
    foreign_arn = create_stream_table(ddb, foreign)["LatestStreamArn"]
    ddb.put_item(TableName=foreign, Item=key("x"))
    foreign_shard = streams.describe_stream(StreamArn=foreign_arn)["StreamDescription"]["Shards"][
        0
    ]["ShardId"]
    foreign_seq = streams.get_records(
        ShardIterator=streams.get_shard_iterator(
            StreamArn=foreign_arn, ShardId=foreign_shard, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
    )["Records"][0]["dynamodb"]["SequenceNumber"]

    table = f"check-local-aws-{suffix}"
    tables.insert(0, table)
    td = create_stream_table(ddb, table)
    # DynamoDB Local makes tables ACTIVE at once; wait (bounded) anyway.
    ddb.get_waiter("table_exists").wait(
        TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 20}
    )
    stream_arn = td.get("LatestStreamArn", "")
    check(
        "CreateTable with NEW_AND_OLD_IMAGES returns LatestStreamArn",
        re.fullmatch(
            rf"arn:aws:dynamodb:[^:]+:\d{{12}}:table/{table}/stream/"
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}",
            stream_arn,
        )
        is not None,
        stream_arn,
    )
    info("TableStatus right after CreateTable", td["TableStatus"])
    info("TableArn", td.get("TableArn"))

    sd = streams.describe_stream(StreamArn=stream_arn)["StreamDescription"]
    shards = sd["Shards"]
    check(
        "DescribeStream: ENABLED, NEW_AND_OLD_IMAGES, one shard",
        sd["StreamStatus"] == "ENABLED"
        and sd["StreamViewType"] == "NEW_AND_OLD_IMAGES"
        and len(shards) == 1,
        f"{sd['StreamStatus']} {sd['StreamViewType']} shards={len(shards)}",
    )
    shard_id = shards[0]["ShardId"]
    check(
        "shard id looks like shardId-<20 digits>-<8 hex>",
        re.fullmatch(r"shardId-\d{20}-[0-9a-f]{8}", shard_id) is not None,
        shard_id,
    )
    info("shard SequenceNumberRange", shards[0]["SequenceNumberRange"])
    info("StreamLabel", sd.get("StreamLabel"))

    it0 = streams.get_shard_iterator(
        StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    info("shard iterator length", len(it0))
    empty = streams.get_records(ShardIterator=it0)
    check(
        "GetRecords on the empty open shard: 0 records and a NextShardIterator",
        not empty["Records"] and "NextShardIterator" in empty,
    )
    chained_iter = empty["NextShardIterator"]

    # Writes: expected stream events INSERT a, MODIFY a, INSERT b, REMOVE a.
    t_write = time.monotonic()
    ddb.put_item(TableName=table, Item={**key("a"), "n": {"N": "1"}, "s": {"S": "first"}})
    ddb.update_item(
        TableName=table,
        Key=key("a"),
        UpdateExpression="ADD n :one SET s = :s",
        ExpressionAttributeValues={":one": {"N": "1"}, ":s": {"S": "second"}},
    )
    ddb.put_item(TableName=table, Item={**key("b"), "n": {"N": "10"}})
    ddb.put_item(
        TableName=table, Item={**key("b"), "n": {"N": "10"}}
    )  # no change: no record expected
    ddb.delete_item(TableName=table, Key=key("a"))
    ddb.delete_item(TableName=table, Key=key("missing"))  # nothing deleted: no record expected

    # Chained iterator from before the writes: how long until records show?
    got: list[dict] = []

    def fetch():
        nonlocal chained_iter
        r = streams.get_records(ShardIterator=chained_iter)
        got.extend(r["Records"])
        chained_iter = r.get("NextShardIterator", chained_iter)
        return got

    _, waited = poll(fetch, lambda g: len(g) >= 4, timeout_s=15)
    info(
        "time from first write until 4 records were readable (s)",
        f"{time.monotonic() - t_write:.3f}",
    )
    check("4 records arrive on an iterator taken before the writes", len(got) == 4, len(got))
    extra = streams.get_records(ShardIterator=chained_iter)["Records"]
    check(
        "no-op PutItem and DeleteItem of a missing item emit no record (as in real DynamoDB)",
        not extra,
        [r["eventName"] for r in extra],
    )

    raw_bodies.clear()
    recs = streams.get_records(
        ShardIterator=streams.get_shard_iterator(
            StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
    )["Records"]
    names = [r["eventName"] for r in recs]
    check(
        "TRIM_HORIZON GetRecords: INSERT, MODIFY, INSERT, REMOVE",
        names == ["INSERT", "MODIFY", "INSERT", "REMOVE"],
        names,
    )
    if len(recs) == 4:
        ins, mod, ins_b, rem = (r["dynamodb"] for r in recs)
        check(
            "INSERT has NewImage, no OldImage",
            "NewImage" in ins and "OldImage" not in ins and ins["NewImage"]["n"] == {"N": "1"},
        )
        check(
            "MODIFY has OldImage n=1/s=first and NewImage n=2/s=second",
            mod.get("OldImage", {}).get("n") == {"N": "1"}
            and mod.get("NewImage", {}).get("n") == {"N": "2"}
            and mod["OldImage"].get("s") == {"S": "first"}
            and mod["NewImage"].get("s") == {"S": "second"},
        )
        check(
            "REMOVE has OldImage n=2, no NewImage",
            "NewImage" not in rem and rem.get("OldImage", {}).get("n") == {"N": "2"},
        )
        check(
            "every record has Keys {PK, SK}",
            all(set(r["Keys"]) == {"PK", "SK"} for r in (ins, mod, ins_b, rem)),
        )
        seqs = [r["SequenceNumber"] for r in (ins, mod, ins_b, rem)]
        check(
            "sequence numbers are digit strings, strictly increasing as numbers",
            all(s.isdigit() for s in seqs) and all(int(x) < int(y) for x, y in zip(seqs, seqs[1:])),
            seqs,
        )
        info("sequence number lengths", sorted({len(s) for s in seqs}))
        info("SizeBytes", [r.get("SizeBytes") for r in (ins, mod, ins_b, rem)])
        r0 = recs[0]
        info(
            "record envelope",
            {k: r0.get(k) for k in ("eventVersion", "eventSource", "awsRegion")}
            | {
                "eventID": r0.get("eventID"),
                "StreamViewType": r0["dynamodb"].get("StreamViewType"),
            },
        )
        check(
            "eventSource is aws:dynamodb", all(r.get("eventSource") == "aws:dynamodb" for r in recs)
        )
        # Wire format of ApproximateCreationDateTime (boto3 turns it into a datetime).
        raw = json.loads(raw_bodies[-1]) if raw_bodies else {}
        raw_ts = [r["dynamodb"].get("ApproximateCreationDateTime") for r in raw.get("Records", [])]
        now = time.time()
        check(
            "ApproximateCreationDateTime on the wire is epoch seconds (a JSON number near now)",
            bool(raw_ts)
            and all(isinstance(t, (int, float)) and now - 130 <= t <= now + 5 for t in raw_ts),
            f"{raw_ts} now={now:.3f}",
        )
        if raw_ts:
            info(
                "ApproximateCreationDateTime is a whole minute",
                all(float(t) % 60 == 0 for t in raw_ts),
            )

        # Other iterator types.
        def seqs_from(kind, seq=None):
            kw = {"SequenceNumber": seq} if seq else {}
            it = streams.get_shard_iterator(
                StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType=kind, **kw
            )
            return [
                r["dynamodb"]["SequenceNumber"]
                for r in streams.get_records(ShardIterator=it["ShardIterator"])["Records"]
            ]

        check(
            "AT_SEQUENCE_NUMBER(2nd) gives records 2..4",
            seqs_from("AT_SEQUENCE_NUMBER", seqs[1]) == seqs[1:],
        )
        check(
            "AFTER_SEQUENCE_NUMBER(2nd) gives records 3..4",
            seqs_from("AFTER_SEQUENCE_NUMBER", seqs[1]) == seqs[2:],
        )
        check("LATEST gives nothing", seqs_from("LATEST") == [])
        check(
            "Limit=2 gives 2 records",
            len(streams.get_records(ShardIterator=it0, Limit=2)["Records"]) == 2,
        )
        check(
            "an iterator can be read twice (same records)",
            len(streams.get_records(ShardIterator=it0)["Records"]) == 4,
        )
        info(
            "sequence numbers of the other table's record and of this table's",
            f"{foreign_seq} < {seqs}",
        )
        try:
            seqs_from("AT_SEQUENCE_NUMBER", foreign_seq)
            check("AT_SEQUENCE_NUMBER from before the shard is rejected", False)
        except ClientError as e:
            check(
                "AT_SEQUENCE_NUMBER from before the shard is rejected with ValidationException",
                err_code(e) == "ValidationException",
                f"{err_code(e)}: {e.response['Error'].get('Message')}",
            )
        try:
            r = seqs_from("AT_SEQUENCE_NUMBER", "9" * 21)
            info("AT_SEQUENCE_NUMBER past the shard's end", f"accepted, {len(r)} records")
        except ClientError as e:
            info(
                "AT_SEQUENCE_NUMBER past the shard's end",
                f"{err_code(e)}: {e.response['Error'].get('Message')} "
                f"(HTTP {e.response['ResponseMetadata']['HTTPStatusCode']})",
            )

    print("== DynamoDB Local: errors for bad / expired iterators", flush=True)
    try:
        streams.get_records(ShardIterator="not-an-iterator-" + "x" * 40)
        check("garbage iterator is rejected", False)
    except ClientError as e:
        check(
            "garbage iterator is rejected",
            err_code(e) == "ValidationException",
            f"{err_code(e)}: {e.response['Error'].get('Message')}",
        )
    try:
        streams.get_shard_iterator(
            StreamArn=stream_arn,
            ShardId="shardId-00000000000000000000-00000000",
            ShardIteratorType="TRIM_HORIZON",
        )
        check("unknown shard id is rejected", False)
    except ClientError as e:
        check(
            "unknown shard id is rejected",
            err_code(e) == "ResourceNotFoundException",
            f"{err_code(e)}: {e.response['Error'].get('Message')}",
        )
    # DynamoDB Local's iterator is "<streamArn>|001|base64(<shardId>|<seq>|<created epoch ms>)".
    # Back-dating the creation time shows what an expired iterator (15 min) gets.
    forged = None
    try:
        arn_part, ver, b64 = it0.split("|")
        shard_part, seq_part, created = base64.b64decode(b64).decode().split("|")
        old = str(int(created) - 16 * 60 * 1000).zfill(len(created))
        forged = (
            f"{arn_part}|{ver}|"
            + base64.b64encode(f"{shard_part}|{seq_part}|{old}".encode()).decode()
        )
    except ValueError:
        info(
            "expired-iterator check", "skipped: iterator format is not the known DynamoDB Local one"
        )
    if forged:
        try:
            streams.get_records(ShardIterator=forged)
            check("an iterator older than 15 minutes is rejected", False)
        except ClientError as e:
            check(
                "an iterator older than 15 minutes is rejected with ExpiredIteratorException",
                err_code(e) == "ExpiredIteratorException",
                f"{err_code(e)}: {e.response['Error'].get('Message')!r}, HTTP {e.response['ResponseMetadata']['HTTPStatusCode']}",
            )

    print("== DynamoDB Local: conditional writes and consumed capacity", flush=True)
    try:
        ddb.update_item(
            TableName=table,
            Key=key("b"),
            UpdateExpression="SET n = :n",
            ConditionExpression="n = :expected",
            ExpressionAttributeValues={":n": {"N": "11"}, ":expected": {"N": "999"}},
            ReturnValuesOnConditionCheckFailure="ALL_OLD",
        )
        check("failed condition raises ConditionalCheckFailedException", False)
    except ClientError as e:
        check(
            "failed condition raises ConditionalCheckFailedException",
            err_code(e) == "ConditionalCheckFailedException",
            err_code(e),
        )
        item = e.response.get("Item")
        check(
            "ReturnValuesOnConditionCheckFailure=ALL_OLD returns the current item",
            item == {**key("b"), "n": {"N": "10"}},
            item,
        )
    try:
        ddb.put_item(
            TableName=table,
            Item={**key("b"), "n": {"N": "1"}},
            ConditionExpression="attribute_not_exists(PK)",
        )
        check("failed PutItem condition without ALL_OLD", False)
    except ClientError as e:
        check(
            "failed PutItem condition without ReturnValuesOnConditionCheckFailure returns no Item",
            err_code(e) == "ConditionalCheckFailedException" and "Item" not in e.response,
        )

    caps = {}
    caps["PutItem small"] = ddb.put_item(
        TableName=table, Item={**key("c"), "n": {"N": "1"}}, ReturnConsumedCapacity="TOTAL"
    )["ConsumedCapacity"]
    caps["PutItem ~2.5KB"] = ddb.put_item(
        TableName=table,
        Item={**key("big"), "blob": {"S": "x" * 2500}},
        ReturnConsumedCapacity="TOTAL",
    )["ConsumedCapacity"]
    caps["UpdateItem"] = ddb.update_item(
        TableName=table,
        Key=key("c"),
        UpdateExpression="ADD n :one",
        ExpressionAttributeValues={":one": {"N": "1"}},
        ReturnConsumedCapacity="TOTAL",
    )["ConsumedCapacity"]
    caps["GetItem consistent"] = ddb.get_item(
        TableName=table, Key=key("c"), ConsistentRead=True, ReturnConsumedCapacity="TOTAL"
    )["ConsumedCapacity"]
    caps["GetItem eventual"] = ddb.get_item(
        TableName=table, Key=key("c"), ReturnConsumedCapacity="TOTAL"
    )["ConsumedCapacity"]
    caps["Query"] = ddb.query(
        TableName=table,
        KeyConditionExpression="PK = :p",
        ExpressionAttributeValues={":p": {"S": "c"}},
        ReturnConsumedCapacity="TOTAL",
    )["ConsumedCapacity"]
    tx = ddb.transact_write_items(
        TransactItems=[
            {"Put": {"TableName": table, "Item": {**key("tx1"), "n": {"N": "1"}}}},
            {
                "Update": {
                    "TableName": table,
                    "Key": key("c"),
                    "UpdateExpression": "ADD n :one",
                    "ExpressionAttributeValues": {":one": {"N": "1"}},
                }
            },
        ],
        ReturnConsumedCapacity="TOTAL",
    )
    caps["TransactWriteItems (2 items)"] = tx.get("ConsumedCapacity")
    try:
        ddb.update_item(
            TableName=table,
            Key=key("c"),
            UpdateExpression="SET n = :n",
            ConditionExpression="attribute_not_exists(PK)",
            ExpressionAttributeValues={":n": {"N": "0"}},
            ReturnConsumedCapacity="TOTAL",
        )
    except ClientError as e:
        caps["UpdateItem, condition failed"] = e.response.get("ConsumedCapacity", "(none in error)")
    for k, v in caps.items():
        info(f"ConsumedCapacity {k}", v)
    check(
        "ReturnConsumedCapacity=TOTAL gives TableName and CapacityUnits > 0 on writes and reads",
        all(
            isinstance(caps[k], dict)
            and caps[k].get("TableName") == table
            and caps[k].get("CapacityUnits", 0) > 0
            for k in ("PutItem small", "UpdateItem", "GetItem consistent", "Query")
        ),
    )

    # Transactions show up as one record per item.
    tail = streams.get_records(
        ShardIterator=streams.get_shard_iterator(
            StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
    )["Records"][4:]
    tail_names = [(r["eventName"], r["dynamodb"]["Keys"]["PK"]["S"]) for r in tail]
    check(
        "later writes (incl. the transaction) are in the stream, one record per item",
        ("INSERT", "tx1") in tail_names and tail_names.count(("MODIFY", "c")) == 2,
        tail_names,
    )
    check(
        "the failed conditional writes left no record",
        all(k != "b" for _, k in tail_names),
        tail_names,
    )

    print("== DynamoDB Local: stream disabled closes the shard", flush=True)
    ddb.update_table(TableName=table, StreamSpecification={"StreamEnabled": False})
    sd2 = streams.describe_stream(StreamArn=stream_arn)["StreamDescription"]
    rng = sd2["Shards"][0]["SequenceNumberRange"] if sd2["Shards"] else {}
    check(
        "after disabling: stream DISABLED and the shard has an EndingSequenceNumber",
        sd2["StreamStatus"] == "DISABLED" and "EndingSequenceNumber" in rng,
        f"{sd2['StreamStatus']} {rng}",
    )
    last = streams.get_records(ShardIterator=it0)
    check(
        "reading a closed shard to its end: records and no NextShardIterator",
        len(last["Records"]) >= 4 and "NextShardIterator" not in last,
        f"{len(last['Records'])} records, NextShardIterator={'NextShardIterator' in last}",
    )

    if args.skip_page_cap:
        return
    print("== DynamoDB Local: GetRecords page size", flush=True)
    table2 = f"check-local-aws-{suffix}-bulk"
    tables.append(table2)
    arn2 = create_stream_table(ddb, table2)["LatestStreamArn"]
    t0 = time.monotonic()
    for start in range(0, 1100, 25):
        reqs = [
            {"PutRequest": {"Item": {**key(f"p{i}"), "n": {"N": str(i)}}}}
            for i in range(start, start + 25)
        ]
        unprocessed = ddb.batch_write_item(RequestItems={table2: reqs}).get("UnprocessedItems", {})
        if unprocessed:
            raise RuntimeError(
                f"BatchWriteItem left unprocessed items: {len(unprocessed.get(table2, []))}"
            )
    info("1,100 items by BatchWriteItem (s)", f"{time.monotonic() - t0:.2f}")
    shard2 = streams.describe_stream(StreamArn=arn2)["StreamDescription"]["Shards"][0]["ShardId"]
    it = streams.get_shard_iterator(
        StreamArn=arn2, ShardId=shard2, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    pages = []
    for _ in range(10):
        r = streams.get_records(ShardIterator=it)
        pages.append(len(r["Records"]))
        it = r.get("NextShardIterator")
        if not it or sum(pages) >= 1100:
            break
    check(
        "GetRecords without Limit returns at most 1000 records a page; 1,100 records in all",
        pages[0] == 1000 and sum(pages) == 1100,
        pages,
    )


def check_shared_db(endpoint: str, cfg: Config, table: str) -> None:
    print("== DynamoDB Local: -sharedDb", flush=True)
    # DynamoDB Local (>= 1.23) only accepts access key ids made of letters and
    # digits; anything else is UnrecognizedClientException, even with -sharedDb.
    bad = boto3.session.Session(
        aws_access_key_id="not-alnum", aws_secret_access_key="x", region_name="us-east-1"
    ).client("dynamodb", endpoint_url=endpoint, config=cfg)
    try:
        bad.list_tables(Limit=1)
        info("access key id with a '-'", "accepted")
    except ClientError as e:
        info("access key id with a '-'", f"{err_code(e)}: {e.response['Error'].get('Message')}")
    other = boto3.session.Session(
        aws_access_key_id="SomeoneElse2",
        aws_secret_access_key="other-secret",
        region_name="eu-west-1",
    )
    ddb2 = other.client("dynamodb", endpoint_url=endpoint, config=cfg)
    st2 = other.client("dynamodbstreams", endpoint_url=endpoint, config=cfg)
    names = ddb2.list_tables()["TableNames"]
    check("a client with another access key and region sees the same table", table in names)
    item = ddb2.get_item(TableName=table, Key=key("b"), ConsistentRead=True).get("Item")
    check("... and reads the same item", item == {**key("b"), "n": {"N": "10"}}, item)
    streams_seen = [s["TableName"] for s in st2.list_streams(TableName=table)["Streams"]]
    check("... and ListStreams for it", table in streams_seen, streams_seen)
    arn = ddb2.describe_table(TableName=table)["Table"]["TableArn"]
    info("TableArn seen by the eu-west-1 client", arn)


def check_sqs(sqs, suffix: str, queues: list[str]) -> None:
    print("== moto: SQS", flush=True)
    url = sqs.create_queue(QueueName=f"check-local-aws-{suffix}")["QueueUrl"]
    queues.append(url)
    info("QueueUrl", url)
    check(
        "CreateQueue returns a URL ending in the queue name",
        url.endswith(f"/check-local-aws-{suffix}"),
        url,
    )
    body = json.dumps({"hello": "world", "n": 1})
    attrs = {
        "kind": {"DataType": "String", "StringValue": "counter-delta"},
        "count": {"DataType": "Number", "StringValue": "42"},
        "blob": {"DataType": "Binary", "BinaryValue": b"\x00\x01\x02"},
    }
    sent = sqs.send_message(QueueUrl=url, MessageBody=body, MessageAttributes=attrs)
    check(
        "SendMessage returns MessageId and MD5OfMessageBody",
        sent.get("MD5OfMessageBody") == hashlib.md5(body.encode()).hexdigest()
        and "MessageId" in sent,
    )
    check("SendMessage returns MD5OfMessageAttributes", bool(sent.get("MD5OfMessageAttributes")))
    msgs, _ = poll(
        lambda: sqs.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            MessageAttributeNames=["All"],
            AttributeNames=["All"],
        ).get("Messages", []),
        bool,
        timeout_s=10,
        interval_s=0.2,
    )
    check(
        "ReceiveMessage returns the message", len(msgs) == 1 and msgs[0]["Body"] == body, len(msgs)
    )
    if msgs:
        m = msgs[0]
        got = m.get("MessageAttributes", {})
        check(
            "message attributes round-trip (String, Number, Binary)",
            got.get("kind", {}).get("StringValue") == "counter-delta"
            and got.get("count", {}).get("StringValue") == "42"
            and got.get("count", {}).get("DataType") == "Number"
            and got.get("blob", {}).get("BinaryValue") == b"\x00\x01\x02",
            got,
        )
        check(
            "MD5OfMessageAttributes matches the send",
            m.get("MD5OfMessageAttributes") == sent.get("MD5OfMessageAttributes"),
        )
        info("system attributes", sorted(m.get("Attributes", {})))
        sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
        left = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0, VisibilityTimeout=0).get(
            "Messages", []
        )
        check("after DeleteMessage the queue is empty", not left, len(left))


if __name__ == "__main__":
    sys.exit(main())
