"""Mooncake-format request traces: one JSON object a line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
where ``hash_ids`` are the prefix blocks (512 tokens each): equal ids at the same position
mean the same prefix. Optional kvpool extensions: ``tenant`` (see replay.py), ``session``
(the conversation a request belongs to) and ``label`` (a class an engine or router gave it).

A trace is read line by line (stopping at ``limit`` records) from a regular file in UTF-8.
A line holds at most ``MAX_LINE_BYTES`` bytes, a record at most ``MAX_HASH_IDS`` hash ids
and nests at most ``MAX_NESTING`` levels (the format needs 2), and its numbers are finite:
anything else is a TraceError naming the line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

TRACE_BLOCK_TOKENS = 512
# Real traces: the shared one's longest line is 2.7 KB (374 ids); Mooncake's records name a few
# thousand ids at most. 1 MiB holds about 100,000 ids of 8 digits.
MAX_LINE_BYTES = 1 << 20
MAX_HASH_IDS = 65_536  # 32M tokens of prompt at 512 tokens a block
MAX_NESTING = 8

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class TraceError(ValueError):
    """A trace file is missing, not a regular file, or a line of it is malformed."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None
    label: str | None = None
    tenant: str | None = None


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text} is out of range")
    return v


def _no_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _check_nesting(text: str) -> None:
    """Refuse a record nested deeper than MAX_NESTING before json recurses into it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    for c in brackets:
        depth += 1 if c in "[{" else -1
        if depth > MAX_NESTING:
            raise ValueError(f"nested more than {MAX_NESTING} levels deep")


def parse_record(text: str) -> TraceRequest:
    """One trace line as a request; raises ValueError, KeyError or TypeError if malformed."""
    _check_nesting(text)
    rec = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    if not isinstance(rec, dict):
        raise TypeError(f"a record must be a JSON object, not {type(rec).__name__}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError("hash_ids must be a list of integers")
    if len(ids) > MAX_HASH_IDS:
        raise ValueError(f"{len(ids)} hash_ids, more than {MAX_HASH_IDS}")
    session, label, tenant = rec.get("session"), rec.get("label"), rec.get("tenant")
    return TraceRequest(int(rec["timestamp"]), int(rec["input_length"]), int(rec.get("output_length", 0)),
                        tuple(ids), None if session is None else str(session),
                        None if label is None else str(label), None if tenant is None else str(tenant))


def _open_regular(p: Path) -> BinaryIO:
    """Open a regular file for reading; a FIFO, device or directory is refused, not waited on."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from e
    opened = False
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or other special file"
            raise TraceError(f"cannot read trace {p}: it is {kind}, not a regular file")
        f = os.fdopen(fd, "rb")
        opened = True
        return f
    finally:
        if not opened:
            os.close(fd)


def _lines(p: Path, f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """Numbered lines, each read no further than MAX_LINE_BYTES (its newline included)."""
    n = 0
    while True:
        try:
            line = f.readline(MAX_LINE_BYTES + 1)
        except OSError as e:
            raise TraceError(f"cannot read trace {p}: {e.strerror}") from e
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_BYTES:
            raise TraceError(f"{p}:{n}: malformed trace record: line longer than {MAX_LINE_BYTES} bytes")
        yield n, line


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a trace, reading no further than ``limit`` records; raises TraceError naming
    the file, and the line of any malformed record."""
    p = Path(path)
    out: list[TraceRequest] = []
    with _open_regular(p) as f:
        for n, raw in _lines(p, f):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                req = parse_record(line)
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise TraceError(f"{p}:{n}: malformed trace record: {e}") from e
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    return out


def distinct_blocks(trace: list[TraceRequest]) -> int:
    return len({h for r in trace for h in r.hash_ids})


def default_trace_path() -> Path:
    """``$KVPOOL_TRACE``, else ``../shared/traces/synthetic_trace.jsonl`` from the working directory."""
    env = os.environ.get("KVPOOL_TRACE")
    if env:
        return Path(env)
    return Path.cwd().parent / "shared" / "traces" / "synthetic_trace.jsonl"
