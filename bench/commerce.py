"""The two rules of config/commerce.yaml, in exact decimal arithmetic (the benchmark's oracle).

Rule customer-orders, target (CUST#<customer>, PROFILE):
    orderCount (count), revenue (sum total), orders_<status> (count),
    openRevenue (sum total where status in PENDING, PAID), openOrders (count, same condition).
Rule daily-sales, target (SALES#<date>, TOTAL):
    orders (count), revenue (sum total).

Both rules take stream records whose Keys.SK starts with "ORDER#" and whose keys match
PK "CUST#{customer}", SK "ORDER#{date}#{order_id}" (each capture non-empty, without "#").
The delta of a record is contributions(new image) - contributions(old image), zero deltas
dropped. `truth` computes every aggregate from the order items of a scan; `compare` says how a
system's aggregate items differ from it.

Only what the benchmark's workload produces is covered: `{date|day}` accepts a plain
YYYY-MM-DD date, and a `total` that is not of type N raises ValueError (the service would
dead-letter such a record; the workload never writes one).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

Target = tuple[str, str]  # (PK, SK) of an aggregate item
Aggregates = dict[Target, dict[str, Decimal]]
Image = Mapping[str, Mapping[str, Any]]  # a DynamoDB item in the low-level JSON shape

OPEN_STATUSES = ("PENDING", "PAID")
# Count measures of both rules (orders_<status> too); every other numeric attribute is a sum.
COUNT_ATTRIBUTES = ("orderCount", "openOrders", "orders")
# The sort keys of the rules' targets: an aggregates table may hold other items (the idempotent
# baseline keeps its idempotency items there), which are not aggregates.
TARGET_SORT_KEYS = ("PROFILE", "TOTAL")


def order_key(keys: Image) -> tuple[str, str] | None:
    """(customer, date) if the keys are an order's (filter and source_key of both rules)."""
    pk, sk = keys.get("PK", {}).get("S"), keys.get("SK", {}).get("S")
    if pk is None or sk is None or not sk.startswith("ORDER#"):
        return None
    pk_parts, sk_parts = pk.split("#"), sk.split("#")
    if len(pk_parts) != 2 or pk_parts[0] != "CUST" or len(sk_parts) != 3:
        return None
    customer, date, order_id = pk_parts[1], sk_parts[1], sk_parts[2]
    if not (customer and date and order_id):
        return None
    return customer, date


def day_of(date: str) -> str:
    """`{date|day}` for the plain dates the workload writes."""
    return datetime.date.fromisoformat(date).isoformat()


def contributions(image: Image | None) -> Aggregates:
    """What one item image adds to the aggregates (nothing for an absent image or a non-order)."""
    if not image:
        return {}
    key = order_key(image)
    if key is None:
        return {}
    customer, date = key
    total: Decimal | None = None
    if "total" in image and "NULL" not in image["total"]:
        if "N" not in image["total"]:
            raise ValueError(f"total of {image['PK']['S']}/{image['SK']['S']} is not a number")
        total = Decimal(image["total"]["N"])
    status = image.get("status", {}).get("S")

    profile: dict[str, Decimal] = {"orderCount": Decimal(1)}
    daily: dict[str, Decimal] = {"orders": Decimal(1)}
    if total is not None:
        profile["revenue"] = total
        daily["revenue"] = total
    if status:
        profile[f"orders_{status}"] = Decimal(1)
        if status in OPEN_STATUSES:
            profile["openOrders"] = Decimal(1)
            if total is not None:
                profile["openRevenue"] = total
    return {(f"CUST#{customer}", "PROFILE"): profile, (f"SALES#{day_of(date)}", "TOTAL"): daily}


def add_into(into: Aggregates, delta: Aggregates, sign: int = 1) -> None:
    """into += sign * delta, attribute by attribute (zeros are kept; see `nonzero`)."""
    for target, attrs in delta.items():
        acc = into.setdefault(target, {})
        for name, value in attrs.items():
            acc[name] = acc.get(name, Decimal(0)) + sign * value


def nonzero(aggs: Aggregates) -> Aggregates:
    """The same aggregates without zero attributes and without targets left empty."""
    out: Aggregates = {}
    for target, attrs in aggs.items():
        kept = {name: value for name, value in attrs.items() if value != 0}
        if kept:
            out[target] = kept
    return out


def record_deltas(record: Mapping[str, Any]) -> Aggregates:
    """The delta a stream record applies to each target: new minus old, zeros dropped."""
    ddb = record["dynamodb"]
    if order_key(ddb.get("Keys", {})) is None:  # the rules' filter on Keys.SK, and source_key
        return {}
    delta: Aggregates = {}
    add_into(delta, contributions(ddb.get("NewImage")))
    add_into(delta, contributions(ddb.get("OldImage")), sign=-1)
    return nonzero(delta)


def truth(items: Iterable[Image]) -> Aggregates:
    """Every aggregate, from the items of a scan of the source table."""
    acc: Aggregates = {}
    for item in items:
        add_into(acc, contributions(item))
    return nonzero(acc)


def fold(records: Iterable[Mapping[str, Any]]) -> Aggregates:
    """The aggregates that applying each record's delta exactly once to empty targets gives."""
    acc: Aggregates = {}
    for record in records:
        add_into(acc, record_deltas(record))
    return nonzero(acc)


def aggregates_of(items: Iterable[Image]) -> Aggregates:
    """The aggregates stored in a scan of an aggregates table (numbers on target items only;
    the service's `_agg*` ledger attributes left out)."""
    out: Aggregates = {}
    for item in items:
        pk, sk = item["PK"]["S"], item["SK"]["S"]
        if sk not in TARGET_SORT_KEYS:
            continue
        attrs = {
            name: Decimal(value["N"])
            for name, value in item.items()
            if "N" in value and not name.startswith("_agg")
        }
        out[(pk, sk)] = attrs
    return nonzero(out)


def is_count(attribute: str) -> bool:
    return attribute in COUNT_ATTRIBUTES or attribute.startswith("orders_")


@dataclass
class Diff:
    """How stored aggregates differ from the truth (all zero when exact)."""

    attributes_differing: int = 0
    targets_differing: int = 0
    count_abs_diff: Decimal = Decimal(0)  # sum of |stored - truth| over count attributes
    sum_abs_diff: Decimal = Decimal(0)  # sum of |stored - truth| over sum attributes
    extra_orders: Decimal = Decimal(0)  # sum of (stored - truth) of orderCount over customers
    extra_revenue: Decimal = Decimal(0)  # sum of (stored - truth) of revenue over customers
    truth_orders: Decimal = Decimal(0)  # sum of orderCount over customers in the truth

    @property
    def exact(self) -> bool:
        return self.attributes_differing == 0

    def summary(self) -> str:
        if self.exact:
            return "exact"
        share = (
            f" ({100 * self.extra_orders / self.truth_orders:+.0f}% of the orders)"
            if self.truth_orders
            else ""
        )
        return (
            f"{self.extra_orders:+} orders{share}, revenue {self.extra_revenue:+}; "
            f"{self.attributes_differing} attributes of {self.targets_differing} items differ"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "summary": self.summary(),
            "attributes_differing": self.attributes_differing,
            "targets_differing": self.targets_differing,
            "count_abs_diff": str(self.count_abs_diff),
            "sum_abs_diff": str(self.sum_abs_diff),
            "extra_orders": str(self.extra_orders),
            "extra_revenue": str(self.extra_revenue),
            "truth_orders": str(self.truth_orders),
        }


def compare(stored: Aggregates, want: Aggregates) -> Diff:
    """Differences between stored aggregates and the truth (both as `nonzero` gives them)."""
    diff = Diff()
    diff.truth_orders = sum(
        (a.get("orderCount", Decimal(0)) for t, a in want.items() if t[1] == "PROFILE"), Decimal(0)
    )
    for target in set(stored) | set(want):
        got, exp = stored.get(target, {}), want.get(target, {})
        differing = 0
        for name in set(got) | set(exp):
            d = got.get(name, Decimal(0)) - exp.get(name, Decimal(0))
            if d == 0:
                continue
            differing += 1
            if is_count(name):
                diff.count_abs_diff += abs(d)
            else:
                diff.sum_abs_diff += abs(d)
            if target[1] == "PROFILE" and name == "orderCount":
                diff.extra_orders += d
            if target[1] == "PROFILE" and name == "revenue":
                diff.extra_revenue += d
        if differing:
            diff.attributes_differing += differing
            diff.targets_differing += 1
    return diff
