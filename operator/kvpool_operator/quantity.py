"""Kubernetes quantities as byte counts, and byte counts for people."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from kvpool_operator.errors import InvalidSpecError

_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|)\s*$")
_FACTORS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_UNITS = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def parse_bytes(value: object, field: str) -> int:
    """Bytes (rounded down) from an int or a quantity string such as ``"1.5Gi"``.

    Raises InvalidSpecError naming ``field`` for anything else or for a non-positive size.
    """
    if isinstance(value, bool):
        raise InvalidSpecError(field, "expected a size, got a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _QUANTITY.match(value)
        if m is None:
            raise InvalidSpecError(field, "{!r} is not a size (e.g. 4Gi, 512Mi, 1000000)".format(value))
        try:
            size = int(Decimal(m.group(1)) * _FACTORS[m.group(2)])
        except InvalidOperation as e:
            raise InvalidSpecError(field, "{!r} is not a size".format(value)) from e
    else:
        raise InvalidSpecError(field, "expected a size, got {}".format(type(value).__name__))
    if size <= 0:
        raise InvalidSpecError(field, "must be a positive size")
    return size


def parse_share(value: str, field: str) -> float:
    """A fraction in (0, 1] from a percentage such as ``"25%"``; raises InvalidSpecError."""
    try:
        share = Decimal(value.strip()[:-1]) / 100 if value.strip().endswith("%") else Decimal("nan")
    except InvalidOperation:
        share = Decimal("nan")
    if share.is_nan() or not 0 < share <= 1:
        raise InvalidSpecError(field, "{!r} is not a share of the tier (e.g. 25%)".format(value))
    return float(share)


def format_bytes(size: int) -> str:
    """``1536 -> "1.5Ki"``; binary units, at most one decimal, ``"0"`` for nothing."""
    if size <= 0:
        return "0"
    value = float(size)
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    text = "{:.1f}".format(value).rstrip("0").rstrip(".")
    return text + _UNITS[unit]
