#!/usr/bin/env python3
"""Generate DynamoDB stream records for the commerce demo table, plus the ground truth.

This is an independent oracle for the ddb-aggregator `simulate` command. It
simulates one single-table design (the one `config/commerce.yaml` describes)
from an empty table, writes one stream record per write operation, and writes
the aggregate values the two rules of that config must produce.

Table items (all keys are S):
  customers  PK=CUST#<customer>  SK=PROFILE                    name S, ...
  orders     PK=CUST#<customer>  SK=ORDER#<date>#<order_id>    status S, total N, note S,
                                                               items L, tags SS, flag BOOL, ...
  noise      keys the rules must ignore (ORDER#<day> with one part, CUST#a#b,
             ORDERS#..., PRODUCT#x, empty captures, lower-case order#, ...)

Operations: INSERT of new orders, MODIFY of status / total / both / unrelated
attributes only, PUT overwrites (MODIFY with both images), "unchanged" MODIFYs
(identical images), REMOVE by a user and by TTL (userIdentity = the DynamoDB
service), re-INSERT of deleted keys, customer PROFILE writes, writes to the
noise items, and two scripted episodes (CUST#churned, CUST#balanced) whose
aggregates net to exactly zero. Customer activity is Zipf-skewed (s = 1) over
60 customers; three "whale" customers also get huge exact totals (~1E+20 with
9 decimals), and their orders fall only on 2026-11-29 and 2026-12-03.

Records (--out): JSON lines in the GetRecords/Lambda shape, StreamViewType
NEW_AND_OLD_IMAGES, images in typed DynamoDB JSON with N values as strings,
SequenceNumber a 21-digit zero-padded increasing decimal string. With
--lambda-event the file is one JSON document {"Records": [...]} and each record
also carries eventSourceARN, as Lambda delivers it.

Truth (--expect) is computed ONLY from the final state of the table, never
from the records. For every final item with PK ~ ^CUST#([^#]+)$ (customer) and
SK ~ ^ORDER#([^#]+)#([^#]+)$ (date, order_id):
  {"PK": "CUST#<customer>", "SK": "PROFILE"}
      orderCount += 1; revenue += total; orders_<status> += 1;
      openRevenue += total and openOrders += 1 when status is PENDING or PAID
  {"PK": "SALES#<date|day>", "SK": "TOTAL"}
      orders += 1; revenue += total
where a missing `total` adds nothing (the item is still counted), a missing
`status` adds no orders_<status> and is not "open", and date|day is the date
itself for a plain YYYY-MM-DD and the UTC calendar day for a timestamp with Z
or a +hh:mm / -hh:mm offset. One JSON line per non-zero value, sorted by
(PK, SK, attribute) in code-point (= UTF-8 byte) order:
  {"target":{"PK":"...","SK":"..."},"attribute":"revenue","delta":"15.5"}
delta is a plain decimal string: no exponent, no trailing zeros, never "-0".
All arithmetic is exact `decimal` (precision 200, rounding trapped); the
script uses no floats at all.

--self-check re-reads the written files and checks: record shape and
invariants, that replaying the records rebuilds exactly the final table, that
folding per-record deltas (contribution(NewImage) - contribution(OldImage),
with a separately written copy of the rule matching) gives exactly the
final-state truth, that the expect file round-trips, and
that a second run with the same seed produces identical output.

Example:
  tests/tools/gen_records.py --seed 42 --records 10000 \\
      --out records.jsonl --expect expected.jsonl --self-check
"""

from __future__ import annotations

import argparse
import calendar
import datetime
import decimal
import json
import random
import re
import sys
import time
from bisect import bisect_right
from decimal import Decimal

# Exact arithmetic: anything that would round raises instead.
_CTX = decimal.Context(
    prec=200,
    traps=[
        decimal.InvalidOperation,
        decimal.DivisionByZero,
        decimal.Overflow,
        decimal.Underflow,
        decimal.Inexact,
        decimal.Rounded,
    ],
)
decimal.setcontext(_CTX)

JSON_SEP = (",", ":")

# --------------------------------------------------------------------------
# Rule semantics (config/commerce.yaml), implemented independently
# --------------------------------------------------------------------------

PK_RE = re.compile(r"CUST#([^#]+)")  # used with fullmatch
SK_RE = re.compile(r"ORDER#([^#]+)#([^#]+)")  # used with fullmatch
OPEN_STATUSES = ("PENDING", "PAID")

PLAIN_DATE_RE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})")
TIMESTAMP_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(Z|([+-])([0-9]{2}):([0-9]{2}))"
)

# Valid DynamoDB N strings as produced here.
N_RE = re.compile(r"-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")


def utc_day(date: str) -> str:
    """`{date|day}`: plain dates as-is, timestamps with Z/offset -> UTC day."""
    if PLAIN_DATE_RE.fullmatch(date):
        y, m, d = (int(x) for x in PLAIN_DATE_RE.fullmatch(date).groups())
        datetime.date(y, m, d)  # validates
        return date
    m = TIMESTAMP_RE.fullmatch(date)
    if not m:
        raise ValueError(f"unsupported date for |day: {date!r}")
    y, mo, d, hh, mi, ss = (int(x) for x in m.groups()[:6])
    local = datetime.datetime(y, mo, d, hh, mi, ss)
    if m.group(7) == "Z":
        offset = datetime.timedelta(0)
    else:
        sign = 1 if m.group(8) == "+" else -1
        offset = sign * datetime.timedelta(hours=int(m.group(9)), minutes=int(m.group(10)))
    return (local - offset).date().isoformat()


def parse_n(s: str) -> Decimal:
    if not isinstance(s, str) or not N_RE.fullmatch(s):
        raise ValueError(f"bad N string {s!r}")
    return Decimal(s)


def sig_digits(d: Decimal) -> int:
    if d == 0:
        return 1
    return len(d.normalize().as_tuple().digits)


def contribution(item: dict | None) -> dict:
    """What one item image contributes: {(PK, SK, attribute): Decimal}."""
    out: dict = {}
    if item is None:
        return out
    pk = item.get("PK", {}).get("S")
    sk = item.get("SK", {}).get("S")
    if pk is None or sk is None:
        return out
    mp = PK_RE.fullmatch(pk)
    ms = SK_RE.fullmatch(sk)
    if not mp or not ms:
        return out
    customer = mp.group(1)
    date = ms.group(1)
    total = None
    if "total" in item and "N" in item["total"]:
        total = parse_n(item["total"]["N"])
    status = None
    if "status" in item and "S" in item["status"]:
        status = item["status"]["S"]

    def add(target, attr, value):
        k = (target[0], target[1], attr)
        out[k] = out.get(k, Decimal(0)) + value

    cust = (f"CUST#{customer}", "PROFILE")
    add(cust, "orderCount", Decimal(1))
    if total is not None:
        add(cust, "revenue", total)
    if status is not None:
        add(cust, f"orders_{status}", Decimal(1))
    if status in OPEN_STATUSES:
        add(cust, "openOrders", Decimal(1))
        if total is not None:
            add(cust, "openRevenue", total)

    sales = (f"SALES#{utc_day(date)}", "TOTAL")
    add(sales, "orders", Decimal(1))
    if total is not None:
        add(sales, "revenue", total)
    return out


def contribution_alt(item: dict | None) -> dict:
    """A second, separately written version of `contribution` (string splitting
    and datetime.fromisoformat instead of regexes), used by the self-check fold
    so that the two truths do not share the rule-matching code."""
    if not item:
        return {}
    pk = item["PK"]["S"]
    sk = item["SK"]["S"]
    if not pk.startswith("CUST#") or not sk.startswith("ORDER#"):
        return {}
    customer = pk[len("CUST#"):]
    parts = sk[len("ORDER#"):].split("#")
    if not customer or "#" in customer or len(parts) != 2 or "" in parts:
        return {}
    date = parts[0]
    if "T" in date:
        dt = datetime.datetime.fromisoformat(date)
        if dt.tzinfo is None:
            raise ValueError(f"timestamp without offset: {date!r}")
        day = dt.astimezone(datetime.timezone.utc).date().isoformat()
    else:
        day = datetime.date.fromisoformat(date).isoformat()
    total = Decimal(item["total"]["N"]) if "N" in item.get("total", {}) else None
    status = item["status"]["S"] if "S" in item.get("status", {}) else None
    one = Decimal(1)
    rows = [((pk, "PROFILE"), "orderCount", one), ((f"SALES#{day}", "TOTAL"), "orders", one)]
    if status is not None:
        rows.append(((pk, "PROFILE"), "orders_" + status, one))
    is_open = status == "PENDING" or status == "PAID"
    if is_open:
        rows.append(((pk, "PROFILE"), "openOrders", one))
    if total is not None:
        rows.append(((pk, "PROFILE"), "revenue", total))
        rows.append(((f"SALES#{day}", "TOTAL"), "revenue", total))
        if is_open:
            rows.append(((pk, "PROFILE"), "openRevenue", total))
    out: dict = {}
    for (tpk, tsk), attr, v in rows:
        out[(tpk, tsk, attr)] = out.get((tpk, tsk, attr), Decimal(0)) + v
    return out


def fold_into(acc: dict, contrib: dict, sign: int) -> None:
    for k, v in contrib.items():
        acc[k] = acc.get(k, Decimal(0)) + (v if sign > 0 else -v)


def format_delta(d: Decimal) -> str:
    if d == 0:
        raise ValueError("zero deltas are not written")
    s = format(d.normalize(), "f")
    if "E" in s or "e" in s or s in ("0", "-0"):
        raise AssertionError(f"bad delta format {s!r}")
    if Decimal(s) != d:
        raise AssertionError(f"formatting changed value {d!r} -> {s!r}")
    return s


def truth_lines(acc: dict) -> list[str]:
    lines = []
    for (pk, sk, attr) in sorted(acc):
        v = acc[(pk, sk, attr)]
        if v == 0:
            continue
        if sig_digits(v) > 38:
            raise AssertionError(f"{pk}/{sk}/{attr}={v} exceeds 38 significant digits")
        obj = {"target": {"PK": pk, "SK": sk}, "attribute": attr, "delta": format_delta(v)}
        lines.append(json.dumps(obj, separators=JSON_SEP, ensure_ascii=False))
    return lines


def truth_from_table(table: dict) -> dict:
    acc: dict = {}
    for item in table.values():
        fold_into(acc, contribution(item), +1)
    return {k: v for k, v in acc.items() if v != 0}


# --------------------------------------------------------------------------
# Table simulation
# --------------------------------------------------------------------------

STATUSES = ("PENDING", "PAID", "SHIPPED", "CANCELLED", "REFUNDED")
SPECIAL_CUSTOMERS = ("zoë", "42", "x", "ACME-Corp", "a.b_c-d", "O'Neil")
N_CUSTOMERS = 60
TAGS = ("gift", "express", "b2b", "promo", "fragile", "repeat")
NOTES = ("leave at door", "call first", "ring twice", "", "fragile – handle with care", "n/a")
SKUS = ("SKU-1", "SKU-2", "SKU-3", "BOOK-9", "TEA-12")
NAMES = ("Ada", "Grace", "Linus", "Zoë", "Ümit", "José", "Barbara", "Ken")
OFFSETS = ("+02:00", "-05:00", "+05:30", "+05:45", "-09:30", "+14:00", "-12:00", "+00:00", "+01:00", "-03:00")
EDGE_DATES = (
    "2026-12-31T23:30:00-01:00",  # UTC 2027-01-01
    "2027-01-01T00:30:00+01:00",  # UTC 2026-12-31
    "2026-12-31T23:59:59Z",
    "2027-01-01T00:00:00Z",
    "2028-03-01T01:00:00+02:00",  # UTC 2028-02-29 (leap day)
    "2028-02-29",
    "2026-11-30T23:59:59Z",
    "2026-12-01T01:30:00+02:00",  # UTC 2026-11-30
    "2026-11-30T20:00:00-05:00",  # UTC 2026-12-01
    "2026-12-01T00:00:00+00:00",
)
START_EPOCH = calendar.timegm((2026, 11, 28, 0, 0, 0))
TABLE_NAME = "commerce-main"
STREAM_ARN = f"arn:aws:dynamodb:us-east-1:123456789012:table/{TABLE_NAME}/stream/2026-11-28T00:00:00.000"

OP_WEIGHTS = (
    ("insert_order", 300),
    ("modify_status", 150),
    ("modify_total", 80),
    ("modify_both", 70),
    ("modify_unrelated", 80),
    ("put_overwrite", 40),
    ("remove_user", 60),
    ("remove_ttl", 30),
    ("modify_unchanged", 20),
    ("reinsert_order", 20),
    ("profile", 80),
    ("noise", 50),
    ("scripted", 10),
)


def weighted(rng: random.Random, cum: list[int], items):
    return items[bisect_right(cum, rng.randrange(cum[-1]))]


def cumulative(weights) -> list[int]:
    out, s = [], 0
    for w in weights:
        s += w
        out.append(s)
    return out


class Pool:
    """A set with deterministic O(1) random choice and removal."""

    def __init__(self):
        self.items: list = []
        self.index: dict = {}

    def __len__(self):
        return len(self.items)

    def __contains__(self, x):
        return x in self.index

    def add(self, x):
        if x not in self.index:
            self.index[x] = len(self.items)
            self.items.append(x)

    def remove(self, x):
        i = self.index.pop(x)
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self.index[last] = i

    def choice(self, rng):
        return self.items[rng.randrange(len(self.items))]


def gen_total(rng: random.Random, whale: bool = False) -> str | None:
    """A DynamoDB N string, or None (missing `total`).

    Only "whale" customers get the huge exact values (~1E+20 with 9 decimals,
    29 significant digits), so most aggregates stay human-scale and a failure
    points at either big-number or ordinary handling. The exponent range of all
    values is kept within 1E-9 .. 1E+20, so every sum stays well within 38
    significant digits."""
    if whale and rng.randrange(2) == 0:
        r = rng.randrange(5)
        if r == 0:
            return "12345678901234567890.123456789"
        if r == 1:
            return "1E+20"
        ip = rng.randrange(10**18, 10**20)
        fp = rng.randrange(10**9)
        return f"{ip}.{fp:09d}"
    r = rng.randrange(1000)
    if r < 720:  # up to 2 decimals, several spellings
        cents = rng.randrange(1, 100000)
        s = f"{cents // 100}.{cents % 100:02d}"
        v = rng.randrange(4)
        if v == 0 and s.endswith("0"):
            s = s.rstrip("0").rstrip(".")  # "10.5", "10"
        elif v == 1 and cents % 100 == 0:
            s = str(cents // 100)
        return s
    if r < 830:  # float traps
        return rng.choice(("0.1", "0.2", "0.3", "0.7", "1.1", "2.675", "1.005", "0.01", "10.05", "0.10"))
    if r < 890:  # exponent notation
        if rng.randrange(3) == 0:
            return rng.choice(("1E+2", "2.5E+3", "1E+0", "15E-1", "1.23E+2", "5E-2", "1E-3"))
        m = rng.randrange(1, 1000)
        e = rng.randrange(-5, 4)
        return f"{m}E{e:+d}"
    if r < 925:  # tiny
        return rng.choice(("0.00012", "0.000000001", "0.000001", f"0.0000{rng.randrange(1, 100000):05d}"))
    if r < 960:
        return None  # missing total: the order is still counted
    if r < 985:  # negative (adjustments)
        cents = rng.randrange(1, 10000)
        return f"-{cents // 100}.{cents % 100:02d}"
    return rng.choice(("0", "0.00", "0.0", "0E+2"))


# Whale orders are dated only on these days (UTC day == the plain date), so the
# other SALES#<day> totals stay human-scale.
WHALE_DATES = (
    "2026-11-29",
    "2026-11-29T10:15:00+02:00",
    "2026-12-03",
    "2026-12-03T12:00:00Z",
    "2026-12-03T23:00:00+05:00",
)


def gen_date(rng: random.Random) -> str:
    r = rng.randrange(100)
    if r < 4:
        return rng.choice(EDGE_DATES)
    day = datetime.date(2026, 11, 25) + datetime.timedelta(days=rng.randrange(11))
    if r < 40:
        return day.isoformat()
    if rng.randrange(2):
        hh = rng.choice((0, 1, 22, 23))  # near midnight: crosses days with offsets
    else:
        hh = rng.randrange(24)
    t = f"{day.isoformat()}T{hh:02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
    if r < 70:
        return t + "Z"
    return t + rng.choice(OFFSETS)


class Generator:
    def __init__(self, seed: int, n_records: int, lambda_event: bool):
        self.rng = random.Random(seed)
        self.n_records = n_records
        self.lambda_event = lambda_event
        self.table: dict = {}  # (pk, sk) -> item (typed DynamoDB JSON); never mutated in place
        self.orders = Pool()  # live keys matching the rules
        self.ttl_orders = Pool()  # live order keys carrying expiresAt
        self.deleted_orders = Pool()  # keys of deleted orders (for re-insert)
        self.noise = Pool()  # live keys the rules must ignore
        self.profiles = Pool()  # live PROFILE keys
        self.records: list = []
        self.stats: dict = {}
        self.seq = self.rng.randrange(10**15, 10**16)
        self.clock = START_EPOCH
        self.order_counter = 0
        customers = [f"c{i:03d}" for i in range(N_CUSTOMERS - len(SPECIAL_CUSTOMERS))]
        customers += list(SPECIAL_CUSTOMERS)
        self.rng.shuffle(customers)  # Zipf rank order differs per seed
        self.customers = customers
        # three whales: one heavy, one medium, one light customer by Zipf rank
        self.whales = {f"CUST#{customers[i]}" for i in (1, 7, 20)}
        self.customer_cum = cumulative([10**9 // (rank + 1) for rank in range(len(customers))])
        self.script = self.scripted_steps()
        self.op_cum = cumulative([w for _, w in OP_WEIGHTS])
        self.op_names = [n for n, _ in OP_WEIGHTS]

    # ---- helpers -------------------------------------------------------
    def pick_customer(self) -> str:
        return weighted(self.rng, self.customer_cum, self.customers)

    def new_order_id(self) -> str:
        self.order_counter += 1
        rng = self.rng
        style = rng.randrange(4)
        if style == 0:
            return f"{self.order_counter:06d}"
        if style == 1:
            return f"o-{self.order_counter}-{rng.getrandbits(24):06x}"
        return f"ORD{self.order_counter:05d}{rng.getrandbits(16):04X}"

    def unrelated_attrs(self) -> dict:
        rng = self.rng
        a: dict = {}
        if rng.randrange(10) < 8:
            a["note"] = {"S": rng.choice(NOTES)}
        if rng.randrange(10) < 7:
            items = []
            for _ in range(rng.randrange(1, 4)):
                m = {
                    "sku": {"S": rng.choice(SKUS)},
                    "qty": {"N": str(rng.randrange(1, 5))},
                    "price": {"N": f"{rng.randrange(1, 5000) // 100}.{rng.randrange(100):02d}"},
                }
                if rng.randrange(4) == 0:
                    # nested `total`/`status`: only the top-level attributes count
                    m["total"] = {"N": str(rng.randrange(1, 1000))}
                    m["status"] = {"S": "PAID"}
                items.append({"M": m})
            a["items"] = {"L": items}
        if rng.randrange(10) < 6:
            k = rng.randrange(1, 4)
            a["tags"] = {"SS": rng.sample(TAGS, k)}
        if rng.randrange(10) < 5:
            a["flag"] = {"BOOL": bool(rng.randrange(2))}
        if rng.randrange(20) == 0:
            a["meta"] = {
                "M": {
                    "src": {"S": "import"},
                    "none": {"NULL": True},
                    "ns": {"NS": ["1", "2.5", "1E+3"]},
                    "blob": {"B": "aGVsbG8="},
                    "nested": {"L": [{"N": "7"}, {"S": "x"}, {"BOOL": False}, {"M": {}}]},
                }
            }
        return a

    def order_item(self, pk: str, sk: str) -> dict:
        rng = self.rng
        item = {"PK": {"S": pk}, "SK": {"S": sk}}
        if rng.randrange(100) < 97:
            r = rng.randrange(10)
            status = "PENDING" if r < 5 else "PAID" if r < 8 else rng.choice(STATUSES[2:])
            item["status"] = {"S": status}
        t = gen_total(rng, pk in self.whales)
        if t is not None:
            item["total"] = {"N": t}
        item.update(self.unrelated_attrs())
        if rng.randrange(10) < 3:
            item["expiresAt"] = {"N": str(self.clock + rng.randrange(3600, 86400 * 30))}
        return item

    def count(self, name: str):
        self.stats[name] = self.stats.get(name, 0) + 1

    # ---- table writes -> stream records --------------------------------
    def emit(self, key, old, new, ttl=False):
        rng = self.rng
        self.seq += rng.randrange(1, 10**6)
        self.clock += rng.randrange(0, 8)
        if old is None and new is None:
            raise AssertionError("no-op")
        event = "INSERT" if old is None else "REMOVE" if new is None else "MODIFY"
        keys = {"PK": {"S": key[0]}, "SK": {"S": key[1]}}
        ddb: dict = {"ApproximateCreationDateTime": self.clock, "Keys": keys}
        if new is not None:
            ddb["NewImage"] = new
        if old is not None:
            ddb["OldImage"] = old
        size = len(json.dumps([keys, new, old], separators=JSON_SEP, ensure_ascii=False).encode())
        seq = f"{self.seq:021d}"
        assert len(seq) == 21
        ddb["SequenceNumber"] = seq
        ddb["SizeBytes"] = size
        ddb["StreamViewType"] = "NEW_AND_OLD_IMAGES"
        rec: dict = {
            "eventID": f"{rng.getrandbits(128):032x}",
            "eventName": event,
            "eventVersion": "1.1",
            "eventSource": "aws:dynamodb",
            "awsRegion": "us-east-1",
            "dynamodb": ddb,
        }
        if self.lambda_event:
            rec["eventSourceARN"] = STREAM_ARN
        if ttl:
            rec["userIdentity"] = {"type": "Service", "principalId": "dynamodb.amazonaws.com"}
        self.records.append(rec)

    def put(self, key, item):
        old = self.table.get(key)
        self.table[key] = item
        self.emit(key, old, item)

    def delete(self, key, ttl=False):
        old = self.table.pop(key)
        self.emit(key, old, None, ttl=ttl)

    def set_order(self, key, item):
        """Put an order item and keep pools in sync."""
        self.put(key, item)
        self.orders.add(key)
        if key in self.deleted_orders:
            self.deleted_orders.remove(key)
        if "expiresAt" in item:
            self.ttl_orders.add(key)
        elif key in self.ttl_orders:
            self.ttl_orders.remove(key)

    def drop_order(self, key, ttl=False):
        self.delete(key, ttl=ttl)
        self.orders.remove(key)
        if key in self.ttl_orders:
            self.ttl_orders.remove(key)
        self.deleted_orders.add(key)

    # ---- operations ----------------------------------------------------
    def scripted_steps(self) -> list:
        """Fixed episodes, interleaved with the random traffic, whose aggregates
        net to exactly zero (so the "zero values are left out" rule is always
        exercised). Their keys are kept out of the random pools."""

        def order(key, status, total):
            item = {"PK": {"S": key[0]}, "SK": {"S": key[1]}, "status": {"S": status}, "total": {"N": total}}
            item["note"] = {"S": "scripted"}
            return item

        def put(key, status, total):
            return lambda: self.put(key, order(key, status, total))

        def remove(key, ttl=False):
            return lambda: self.delete(key, ttl=ttl)

        # CUST#churned: two orders that are later deleted -> no lines for
        # CUST#churned nor SALES#2026-10-01 at all.
        a = ("CUST#churned", "ORDER#2026-10-01#A1")
        b = ("CUST#churned", "ORDER#2026-10-01T12:00:00Z#A2")
        # CUST#balanced: revenue nets to 0 (5.5 + -5.50); the PENDING order is
        # cancelled, so openOrders/openRevenue/orders_PENDING end at 0 too.
        # The second order's UTC day is 2026-10-03.
        c = ("CUST#balanced", "ORDER#2026-10-02#B1")
        d = ("CUST#balanced", "ORDER#2026-10-02T23:00:00-01:00#B2")
        return [
            put(a, "PENDING", "10.05"),
            put(c, "PENDING", "5.5"),
            put(b, "PAID", "0.1"),
            put(d, "SHIPPED", "-5.50"),
            put(a, "SHIPPED", "10.05"),
            put(b, "PAID", "0.2"),
            put(c, "CANCELLED", "5.5"),
            remove(a),
            remove(b, ttl=True),
        ]

    def op_scripted(self):
        if not self.script:
            self.op_insert_order()
            return
        self.script.pop(0)()
        self.count("scripted")

    def op_insert_order(self):
        cid = self.pick_customer()
        pk = f"CUST#{cid}"
        date = self.rng.choice(WHALE_DATES) if pk in self.whales else gen_date(self.rng)
        key = (pk, f"ORDER#{date}#{self.new_order_id()}")
        assert key not in self.table
        self.set_order(key, self.order_item(*key))
        self.count("insert_order")

    def op_modify(self, what: str):
        rng = self.rng
        key = self.orders.choice(rng)
        old = self.table[key]
        new = dict(old)
        if what in ("status", "both"):
            r = rng.randrange(20)
            cur = old.get("status", {}).get("S")
            if r == 0 and cur is not None:
                del new["status"]  # attribute removed
            else:
                new["status"] = {"S": rng.choice([s for s in STATUSES if s != cur])}
        if what in ("total", "both"):
            whale = key[0] in self.whales
            t = gen_total(rng, whale)
            while t is not None and "total" in old and old["total"]["N"] == t:
                t = gen_total(rng, whale)
            if t is None and "total" not in old:
                t = "1.00"
            if t is None:
                del new["total"]
            else:
                new["total"] = {"N": t}
        if what == "unrelated":
            for name, value in self.unrelated_attrs().items():
                new[name] = value
            if "note" in new and rng.randrange(3) == 0:
                del new["note"]
            new["note2"] = {"S": f"edit {rng.randrange(10**6)}"}
        self.set_order(key, new)
        self.count(f"modify_{what}")

    def op_put_overwrite(self):
        key = self.orders.choice(self.rng)
        self.set_order(key, self.order_item(*key))
        self.count("put_overwrite")

    def op_remove(self, ttl: bool):
        if ttl:
            key = self.ttl_orders.choice(self.rng)
        else:
            key = self.orders.choice(self.rng)
        self.drop_order(key, ttl=ttl)
        self.count("remove_ttl" if ttl else "remove_user")

    def op_reinsert(self):
        key = self.deleted_orders.choice(self.rng)
        self.set_order(key, self.order_item(*key))
        self.count("reinsert_order")

    def op_unchanged(self):
        rng = self.rng
        pool = (self.orders, self.profiles, self.noise)[rng.randrange(3)]
        if len(pool) == 0:
            pool = self.orders
        key = pool.choice(rng)
        item = self.table[key]
        self.table[key] = item
        self.emit(key, item, item)  # identical images
        self.count("modify_unchanged")

    def op_profile(self):
        rng = self.rng
        cid = self.pick_customer()
        key = (f"CUST#{cid}", "PROFILE")
        if key in self.profiles and rng.randrange(25) == 0:
            self.delete(key)
            self.profiles.remove(key)
            self.count("profile_remove")
            return
        if key in self.profiles:
            new = dict(self.table[key])
            new["name"] = {"S": f"{rng.choice(NAMES)} {rng.randrange(1000)}"}
            if rng.randrange(2):
                new["email"] = {"S": f"{cid}@example.com"}
            self.count("profile_modify")
        else:
            new = {
                "PK": {"S": key[0]},
                "SK": {"S": key[1]},
                "name": {"S": rng.choice(NAMES)},
                "status": {"S": "ACTIVE"},
            }
            if rng.randrange(3) == 0:
                # looks like an order but the SK does not match: must be ignored
                new["total"] = {"N": "999"}
            self.count("profile_insert")
        self.put(key, new)
        self.profiles.add(key)

    def noise_key(self):
        rng = self.rng
        cid = self.pick_customer()
        day = (datetime.date(2026, 11, 25) + datetime.timedelta(days=rng.randrange(11))).isoformat()
        oid = self.new_order_id()
        kind = rng.randrange(11)
        return {
            0: (f"CUST#{cid}", f"ORDER#{day}"),  # one part after ORDER#
            1: (f"CUST#{cid}#b", f"ORDER#{day}#{oid}"),  # capture would contain '#'
            2: ("CUST#a#b", f"ORDER#{day}#{oid}"),
            3: (f"CUST#{cid}", f"ORDERS#{day}#{oid}"),  # other prefix
            4: ("PRODUCT#x", f"ORDER#{day}#{oid}"),  # PK template mismatch
            5: ("CUST#", f"ORDER#{day}#{oid}"),  # empty customer
            6: (f"CUST#{cid}", f"ORDER##{oid}"),  # empty date
            7: (f"CUST#{cid}", f"ORDER#{day}#"),  # empty order_id
            8: (f"CUST#{cid}", f"ORDER#{day}#{oid}#extra"),  # three parts
            9: (f"CUST#{cid}", f"order#{day}#{oid}"),  # prefix is case-sensitive
            10: (f"cust#{cid}", f"ORDER#{day}#{oid}"),  # PK literal is case-sensitive
        }[kind]

    def op_noise(self):
        rng = self.rng
        r = rng.randrange(10)
        if len(self.noise) == 0 or r < 5:
            key = self.noise_key()
            while key in self.table:
                key = self.noise_key()
            item = self.order_item(*key)
            item["status"] = {"S": rng.choice(OPEN_STATUSES)}
            item["total"] = {"N": f"{rng.randrange(1, 100000) // 100}.{rng.randrange(100):02d}"}
            self.put(key, item)
            self.noise.add(key)
            self.count("noise_insert")
        elif r < 8:
            key = self.noise.choice(rng)
            new = dict(self.table[key])
            new["status"] = {"S": rng.choice(STATUSES)}
            new["total"] = {"N": str(rng.randrange(1, 500))}
            self.put(key, new)
            self.count("noise_modify")
        else:
            key = self.noise.choice(rng)
            self.delete(key, ttl=rng.randrange(4) == 0)
            self.noise.remove(key)
            self.count("noise_remove")

    def step(self):
        op = weighted(self.rng, self.op_cum, self.op_names)
        have_orders = len(self.orders) > 0
        if op == "insert_order" or not have_orders and op not in ("profile", "noise", "reinsert_order", "scripted"):
            self.op_insert_order()
        elif op == "modify_status":
            self.op_modify("status")
        elif op == "modify_total":
            self.op_modify("total")
        elif op == "modify_both":
            self.op_modify("both")
        elif op == "modify_unrelated":
            self.op_modify("unrelated")
        elif op == "put_overwrite":
            self.op_put_overwrite()
        elif op == "remove_user":
            self.op_remove(ttl=False)
        elif op == "remove_ttl":
            if len(self.ttl_orders):
                self.op_remove(ttl=True)
            else:
                self.op_remove(ttl=False)
        elif op == "modify_unchanged":
            self.op_unchanged()
        elif op == "reinsert_order":
            if len(self.deleted_orders):
                self.op_reinsert()
            else:
                self.op_insert_order()
        elif op == "profile":
            self.op_profile()
        elif op == "noise":
            self.op_noise()
        elif op == "scripted":
            self.op_scripted()
        else:
            raise AssertionError(op)

    def run(self):
        while len(self.records) < self.n_records:
            before = len(self.records)
            self.step()
            assert len(self.records) == before + 1
        return self


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def records_text(records: list, lambda_event: bool) -> str:
    if lambda_event:
        return json.dumps({"Records": records}, separators=JSON_SEP, ensure_ascii=False) + "\n"
    return "".join(json.dumps(r, separators=JSON_SEP, ensure_ascii=False) + "\n" for r in records)


def write_text(path: str, text: str):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


# --------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def check_n_values(value, where):
    """Every N / NS string must be a valid number with <= 38 significant digits."""
    if isinstance(value, dict):
        check(len(value) == 1, f"{where}: typed value must have one key: {value}")
        (t, v), = value.items()
        if t == "N":
            check(sig_digits(parse_n(v)) <= 38, f"{where}: N {v} > 38 digits")
        elif t == "NS":
            for x in v:
                check(sig_digits(parse_n(x)) <= 38, f"{where}: NS {x} > 38 digits")
        elif t == "L":
            for x in v:
                check_n_values(x, where)
        elif t == "M":
            for x in v.values():
                check_n_values(x, where)
        elif t in ("S", "B"):
            check(isinstance(v, str), f"{where}: {t} must be a string")
        elif t in ("SS", "BS"):
            check(isinstance(v, list) and v and len(set(v)) == len(v), f"{where}: bad {t}")
        elif t == "BOOL":
            check(isinstance(v, bool), f"{where}: BOOL")
        elif t == "NULL":
            check(v is True, f"{where}: NULL")
        else:
            raise AssertionError(f"{where}: unknown type {t}")


def self_check(args, gen: Generator, lines: list[str]) -> dict:
    # 1. Read the records back from the file actually written.
    with open(args.out, encoding="utf-8") as f:
        text = f.read()
    if args.lambda_event:
        doc = json.loads(text)
        check(list(doc) == ["Records"], "lambda event must be {Records: [...]}")
        records = doc["Records"]
    else:
        records = [json.loads(line) for line in text.splitlines()]
    check(len(records) == args.records, f"expected {args.records} records, got {len(records)}")

    # 2. Shape and invariants, replay, and the per-record fold.
    replay: dict = {}
    folded: dict = {}
    prev_seq = None
    prev_time = None
    ids = set()
    for i, rec in enumerate(records):
        where = f"record {i}"
        check(rec["eventVersion"] == "1.1" and rec["eventSource"] == "aws:dynamodb", where)
        check(rec["awsRegion"] == "us-east-1", where)
        check(re.fullmatch(r"[0-9a-f]{32}", rec["eventID"]) is not None, f"{where}: eventID")
        check(rec["eventID"] not in ids, f"{where}: duplicate eventID")
        ids.add(rec["eventID"])
        ddb = rec["dynamodb"]
        seq = ddb["SequenceNumber"]
        check(re.fullmatch(r"\d{21}", seq) is not None, f"{where}: SequenceNumber {seq}")
        check(prev_seq is None or int(seq) > int(prev_seq), f"{where}: sequence not increasing")
        prev_seq = seq
        t = ddb["ApproximateCreationDateTime"]
        check(isinstance(t, int) and (prev_time is None or t >= prev_time), f"{where}: time")
        prev_time = t
        check(ddb["StreamViewType"] == "NEW_AND_OLD_IMAGES", where)
        check(isinstance(ddb["SizeBytes"], int) and ddb["SizeBytes"] > 0, where)
        keys = ddb["Keys"]
        check(list(keys) == ["PK", "SK"], f"{where}: Keys")
        key = (keys["PK"]["S"], keys["SK"]["S"])
        new = ddb.get("NewImage")
        old = ddb.get("OldImage")
        name = rec["eventName"]
        if name == "INSERT":
            check(new is not None and old is None and key not in replay, f"{where}: INSERT")
        elif name == "MODIFY":
            check(new is not None and old is not None, f"{where}: MODIFY images")
            check(replay.get(key) == old, f"{where}: MODIFY OldImage != current item")
        elif name == "REMOVE":
            check(new is None and old is not None, f"{where}: REMOVE images")
            check(replay.get(key) == old, f"{where}: REMOVE OldImage != current item")
        else:
            raise AssertionError(f"{where}: eventName {name}")
        if "userIdentity" in rec:
            check(name == "REMOVE", f"{where}: userIdentity only on TTL REMOVE")
            check(rec["userIdentity"] == {"type": "Service", "principalId": "dynamodb.amazonaws.com"}, where)
        for img in (new, old):
            if img is not None:
                check(img["PK"] == keys["PK"] and img["SK"] == keys["SK"], f"{where}: image keys")
                for attr, v in img.items():
                    check_n_values(v, f"{where}.{attr}")
        if new is None:
            del replay[key]
        else:
            replay[key] = new
        fold_into(folded, contribution_alt(new), +1)
        fold_into(folded, contribution_alt(old), -1)

    check(replay == gen.table, "replaying the records does not rebuild the final table")
    folded = {k: v for k, v in folded.items() if v != 0}
    truth = truth_from_table(gen.table)
    if folded != truth:
        diff = sorted(set(folded) ^ set(truth) | {k for k in folded if k in truth and folded[k] != truth[k]})
        raise AssertionError(f"fold != final-state truth, e.g. {diff[:5]}")

    # 3. The expect file round-trips to the same truth, sorted, compact, no zeros.
    with open(args.expect, encoding="utf-8") as f:
        written = f.read().splitlines()
    check(written == lines, "expect file differs from computed lines")
    parsed = {}
    prev = None
    for line in written:
        obj = json.loads(line)
        check(json.dumps(obj, separators=JSON_SEP, ensure_ascii=False) == line, "not compact")
        check(list(obj) == ["target", "attribute", "delta"] and list(obj["target"]) == ["PK", "SK"], line)
        k = (obj["target"]["PK"], obj["target"]["SK"], obj["attribute"])
        check(prev is None or k > prev, f"expect not strictly sorted at {line}")
        prev = k
        d = obj["delta"]
        check(re.fullmatch(r"-?\d+(\.\d*[1-9])?", d) is not None and d != "-0", f"delta format {d}")
        check(not re.match(r"-?0\d", d), f"leading zero {d}")
        parsed[k] = Decimal(d)
    check(parsed == truth, "expect file does not parse back to the truth")

    # 4. Determinism: a second run gives byte-identical output.
    again = Generator(args.seed, args.records, args.lambda_event).run()
    check(records_text(again.records, args.lambda_event) == text, "second run differs (records)")
    check(truth_lines(truth_from_table(again.table)) == lines, "second run differs (truth)")

    return {"records_checked": len(records), "truth_values": len(truth)}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
    p.add_argument("--records", type=int, default=10000, help="number of stream records (default 10000)")
    p.add_argument("--out", required=True, help="stream records file (JSON lines, or one Lambda event)")
    p.add_argument("--expect", required=True, help="ground-truth file (JSON lines)")
    p.add_argument("--lambda-event", action="store_true",
                   help='write --out as one Lambda event document {"Records": [...]}')
    p.add_argument("--self-check", action="store_true",
                   help="verify the output (replay, per-record fold == final-state truth, determinism)")
    args = p.parse_args(argv)
    if args.records < 1:
        p.error("--records must be >= 1")

    t0 = time.perf_counter_ns()
    gen = Generator(args.seed, args.records, args.lambda_event).run()
    lines = truth_lines(truth_from_table(gen.table))
    write_text(args.out, records_text(gen.records, args.lambda_event))
    write_text(args.expect, "".join(line + "\n" for line in lines))
    t1 = time.perf_counter_ns()

    summary = {
        "seed": args.seed,
        "records": len(gen.records),
        "expect_lines": len(lines),
        "final_items": len(gen.table),
        "live_orders": len(gen.orders),
        "ops": dict(sorted(gen.stats.items())),
        "generate_ms": (t1 - t0) // 10**6,
    }
    if args.self_check:
        summary["self_check"] = self_check(args, gen, lines)
        summary["self_check_ms"] = (time.perf_counter_ns() - t1) // 10**6
    print(json.dumps(summary, ensure_ascii=False), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
