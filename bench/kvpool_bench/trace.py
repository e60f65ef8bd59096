"""Mooncake-format request traces: one JSON object a line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
where ``hash_ids`` are the prefix blocks (512 tokens each): equal ids at the same position
mean the same prefix. Optional kvpool extensions: ``tenant`` (see replay.py), ``session``
(the conversation a request belongs to) and ``label`` (a class an engine or router gave it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file is missing or a line of it is malformed."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None
    label: str | None = None


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Parse a trace; raises TraceError naming the line of any malformed record."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from e
    out: list[TraceRequest] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids = rec["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TypeError("hash_ids must be a list of integers")
            session, label = rec.get("session"), rec.get("label")
            req = TraceRequest(int(rec["timestamp"]), int(rec["input_length"]), int(rec.get("output_length", 0)),
                               tuple(ids), None if session is None else str(session),
                               None if label is None else str(label))
        except (ValueError, KeyError, TypeError) as e:
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
