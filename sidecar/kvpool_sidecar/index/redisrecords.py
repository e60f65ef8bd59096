"""What the index reads back from Redis, taken within bounds: node names, node records and
holder values.

Anyone who can write to Redis writes these, so nothing they hold may make this raise, nor
hand on what makes its reader raise or stall: a nodes set is read as at most :data:`MAX_NODES` names
(:func:`bounded_names`), a node record whose fields are too long, of the wrong JSON shape or
not finite is none (:func:`node_record`), and a holders value too long is no holders, or
only its first holders (:func:`held_values`). What the Redis server can measure is bounded
there already, before it is sent (:mod:`~kvpool_sidecar.index.redisbounds`). A reply of the
wrong shape (an integer where a list comes, a list of the wrong length: a server or a proxy
that does not answer as Redis does) raises :class:`~kvpool_sidecar.errors.IndexUnavailableError`
(:func:`strings`, :func:`values`), the index's failure, where it had raised ``TypeError``
wherever it was first used.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.index.redisbounds import JSON_FIELDS, SCALAR_FIELDS
from kvpool_sidecar.ratelog import warn_once

logger = logging.getLogger(__name__)

#: What a node's name may be (and a pool's).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")

#: Bounds on what the index reads, which anyone who can write to Redis controls. A pool of
#: more nodes than this is not supported; a nodes set past it (a writer filling it with fake
#: names) is read as the nodes live at the last refresh plus a random sample of the rest, so
#: lookups stay one short trip instead of one check per fake name, past their deadline.
MAX_NODES = 4096
#: A holders value longer than this (one key's holders: a few dozen bytes a holder) is
#: read as no holders; splitting a forged value of megabytes would stall the event loop.
MAX_HOLDERS_BYTES = 64 << 10
#: Node names a lookup checks for liveness at most (names seen in holder values only).
MAX_CHECKS = 256
#: A node record's JSON fields longer than this are malformed (the record is skipped; a
#: node's tiers and its GPUs take a few hundred bytes each; parsing 8 KiB of JSON crafted to
#: be slow takes about half a millisecond).
MAX_RECORD_FIELD_BYTES = 8 << 10
#: The longest node name (:data:`NODE_NAME`).
MAX_NAME_BYTES = 253
#: A node record's other fields longer than this are malformed too (an address, a time, a
#: signature in hex and a version are all far shorter).
MAX_RECORD_SCALAR_BYTES = 256
#: Holders of one key read from its value at most (the rest are not looked at): enough to
#: choose among, and what a lookup splits and checks stays bounded whatever a value holds.
MAX_HOLDERS_PER_KEY = 64


def malformed(what: str) -> IndexUnavailableError:
    """The index's failure for a reply of the wrong shape (``what`` names it)."""
    return IndexUnavailableError(f"redis index: a reply of the wrong shape ({what}): not an answer Redis gives")


def strings(reply: Any, what: str) -> list[str]:
    """``reply`` when it is a list of strings (members of a set, names), else
    :class:`IndexUnavailableError`; ``what`` names it in the message."""
    if not isinstance(reply, list) or not all(isinstance(x, str) for x in reply):
        raise malformed(what)
    return reply


#: What a holders value may be in a reply: a string, or nil (no such field).
_VALUE_TYPES = frozenset((str, type(None)))


def held_reply(reply: Any, n: int) -> list[str | None]:
    """The holders values of ``n`` fields from their script's reply
    (:func:`~kvpool_sidecar.index.redisbounds.held_command`): a list of ``n`` strings or nils,
    or one string, every field's value; else :class:`IndexUnavailableError`."""
    if isinstance(reply, str):
        return [reply] * n
    if not isinstance(reply, list) or len(reply) != n or not set(map(type, reply)) <= _VALUE_TYPES:
        raise malformed("holders values")
    return reply


def bounded_names(names: Iterable[str], live: set[str]) -> list[str]:
    """``names`` when there are at most :data:`MAX_NODES`, else the live ones first and a
    random sample of the rest (see :data:`MAX_NODES`); sorted."""
    names = [x for x in names if NODE_NAME.fullmatch(x)]  # no node of the pool has another name
    if len(names) <= MAX_NODES:
        return sorted(names)
    warn_once(logger, "index-nodes", "index: the nodes set holds %d names, past the %d a pool may have; "
              "reading the live ones and a sample (is someone writing fake names to Redis?)", len(names), MAX_NODES)
    kept = [x for x in names if x in live][:MAX_NODES]
    rest = [x for x in names if x not in live]
    kept += random.sample(rest, min(len(rest), MAX_NODES - len(kept)))
    return sorted(kept)


def finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:16]!r} is not a finite number")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text!r} is not a number")


def _json(text: str) -> Any:
    """JSON whose numbers are all finite (``Infinity``, ``NaN`` and ``1e999`` are refused)."""
    return json.loads(text, parse_float=finite, parse_constant=_no_constant)


def node_record(name: str, h: dict[str, str]) -> dict[str, Any] | None:
    """A node hash's parsed fields, or None when any is malformed: the wrong JSON shape, too
    deep or too long, a number that is not finite (anyone who can write to Redis writes
    these; nothing here may raise, nor hand on what makes the reader raise)."""
    if any(len(h.get(f, "")) > MAX_RECORD_FIELD_BYTES for f in JSON_FIELDS) \
            or any(len(h.get(f, "")) > MAX_RECORD_SCALAR_BYTES for f in SCALAR_FIELDS):
        return None
    try:
        tiers, gpus = _json(h.get("tiers", "{}")), _json(h.get("gpus", "[]"))
        if not isinstance(tiers, dict) or not isinstance(gpus, list) \
                or not all(isinstance(t, dict) for t in tiers.values()):
            return None
        return {"name": name, "address": h.get("address", ""), "heartbeat": finite(h.get("heartbeat", "0")),
                "tiers": tiers, "hits": int(h.get("hits", 0)), "misses": int(h.get("misses", 0)), "gpus": gpus,
                "version": h.get("version", ""), "stamp": h.get("heartbeat", ""), "sig": h.get("sig", "")}
    except (ValueError, TypeError, RecursionError):
        return None


def _split_holders(value: str) -> list[str]:
    """A holders value's first :data:`MAX_HOLDERS_PER_KEY` holders."""
    return value.split(" ", MAX_HOLDERS_PER_KEY)[:MAX_HOLDERS_PER_KEY]


def held_values(replies: Sequence[Sequence[str | None]]) -> tuple[list[list[str] | None], list[list[str]]]:
    """The holders hash's replies (:func:`values`; nil past the bound) as one holder list (or
    None) per key, and the distinct lists: equal values (a chain's keys mostly share their
    holders) are split once, into one list."""
    if len(replies) == 1 and replies[0]:
        first = replies[0][0]
        if first is not None and len(first) <= MAX_HOLDERS_BYTES and replies[0].count(first) == len(replies[0]):
            every = _split_holders(first)  # the usual chain
            return [every] * len(replies[0]), [every]
    split: dict[str, list[str]] = {}
    out: list[list[str] | None] = []
    for reply in replies:
        for v in reply:
            if v is None or len(v) > MAX_HOLDERS_BYTES:  # (see MAX_HOLDERS_BYTES)
                out.append(None)
                continue
            got = split.get(v)
            if got is None:
                got = split[v] = _split_holders(v)
            out.append(got)
    return out, list(split.values())
