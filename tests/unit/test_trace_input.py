"""Hostile trace files: ``load_trace`` and ``kvpool replay`` refuse them with a TraceError
naming the line (exit 2, one line on stderr), never a traceback, a hang or a memory blowup."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool_bench.trace import MAX_HASH_IDS, MAX_LINE_BYTES, MAX_NESTING, TraceError, load_trace
from kvpool_sidecar.cli import main as cli_main

GOOD = b'{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
# A hang guard, not a timing: a reader that opens a FIFO waits for a writer forever.
HANG_GUARD_S = 60


def trace(tmp_path: Path, *lines: bytes, name: str = "t.jsonl") -> str:
    p = tmp_path / name
    p.write_bytes(b"".join(lines))
    return str(p)


def record_of_length(n: int) -> bytes:
    """A well-formed record exactly ``n`` bytes long, its newline included."""
    head = b'{"timestamp": 1, "input_length": 600, "hash_ids": [1], "label": "'
    tail = b'"}\n'
    return head + b"x" * (n - len(head) - len(tail)) + tail


HOSTILE: dict[str, bytes] = {
    "infinity": b'{"timestamp": Infinity, "input_length": 1, "hash_ids": [1]}\n',
    "minus_infinity": b'{"timestamp": 1, "input_length": -Infinity, "hash_ids": [1]}\n',
    "nan": b'{"timestamp": 1, "input_length": 1, "hash_ids": [1], "weight": NaN}\n',
    "huge_float": b'{"timestamp": 1, "input_length": 1e400, "hash_ids": [1]}\n',
    "deep": b'{"timestamp": 1, "input_length": 1, "hash_ids": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    "too_nested": (b'{"timestamp": 1, "input_length": 1, "hash_ids": [1], "x": '
                   + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}\n"),
    "bad_utf8": b'{"timestamp": 1, "input_length": 1, "hash_ids": [1], "label": "\xff"}\n',
    "long_line": record_of_length(MAX_LINE_BYTES + 1),
    "too_many_ids": (b'{"timestamp": 1, "input_length": 1, "hash_ids": ['
                     + b",".join(b"7" for _ in range(MAX_HASH_IDS + 1)) + b"]}\n"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_line_is_a_trace_error_naming_it(tmp_path: Path, name: str) -> None:
    path = trace(tmp_path, GOOD, HOSTILE[name])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: malformed trace record"):
        load_trace(path)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_command_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    path = trace(tmp_path, GOOD, HOSTILE[name])
    assert cli_main(["replay", path, "--capacity", "10", "--no-progress", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool replay: ") and ":2: malformed trace record" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_bounds_admit_a_record_at_them(tmp_path: Path) -> None:
    ids = b",".join(b"7" for _ in range(MAX_HASH_IDS))
    nested = b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1)
    path = trace(tmp_path, record_of_length(MAX_LINE_BYTES),
                 b'{"timestamp": 2, "input_length": 1, "hash_ids": [' + ids + b'], "x": ' + nested + b"}\n",
                 record_of_length(MAX_LINE_BYTES + 1))
    got = load_trace(path, limit=2)
    assert [len(r.hash_ids) for r in got] == [1, MAX_HASH_IDS]
    with pytest.raises(TraceError, match=r":3: .*longer than"):
        load_trace(path)


def test_limit_stops_reading_before_what_follows(tmp_path: Path) -> None:
    for garbage in (HOSTILE["bad_utf8"], HOSTILE["long_line"], b"\xff" * 64 + b"\n"):
        path = trace(tmp_path, GOOD, GOOD, garbage)
        assert [r.hash_ids for r in load_trace(path, limit=2)] == [(1, 2), (1, 2)]
        with pytest.raises(TraceError, match=":3: "):
            load_trace(path)


def test_the_tenant_field_is_read_with_the_record(tmp_path: Path) -> None:
    recs = [{"timestamp": i, "input_length": 512, "hash_ids": [i], "tenant": t} for i, t in enumerate(["a", None])]
    path = trace(tmp_path, *[json.dumps(r).encode() + b"\n" for r in recs], HOSTILE["bad_utf8"])
    assert [r.tenant for r in load_trace(path, limit=2)] == ["a", None]


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[object] = []

    def read() -> None:
        try:
            got.append(load_trace(fifo))
        except TraceError as e:
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(HANG_GUARD_S)
    if reader.is_alive():  # a reader that waits for a writer: give it one, which closes at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
    assert len(got) == 1 and isinstance(got[0], TraceError), got
    assert "FIFO, not a regular file" in str(got[0])


def test_a_device_or_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="device, not a regular file"):
        load_trace(os.devnull)
    with pytest.raises(TraceError, match="directory, not a regular file"):
        load_trace(tmp_path)


def run_replay(path: str) -> subprocess.CompletedProcess[str]:
    def limit_memory() -> None:  # an old reader read /dev/zero until memory ran out: fail, not swap
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", "replay", path, "--limit", "1",
                           "--capacity", "10", "--no-progress", "--json"],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, preexec_fn=limit_memory)


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_the_command_refuses_special_files(tmp_path: Path, special: str) -> None:
    if special == "fifo":
        os.mkfifo(tmp_path / "fifo")
        special = str(tmp_path / "fifo")
    elif not Path(special).exists():
        pytest.skip(f"no {special}")
    done = run_replay(special)
    assert done.returncode == 2, done.stderr[-400:]
    assert done.stderr.startswith(f"kvpool replay: cannot read trace {special}: ")
    assert done.stderr.count("\n") == 1 and "not a regular file" in done.stderr
