"""Mooncake Store baseline for ``kvpool bench``.

Mooncake is an optional benchmark dependency (PyPI
``mooncake-transfer-engine-non-cuda``, which needs the system library
``libibverbs1``); nothing here imports it in the calling process.

Layout: a ``mooncake_master`` subprocess bound to 127.0.0.1 on free ports, and
the store client(s) in separate subprocesses (``python -m kvpool_bench.mooncake
--worker ...``) that print one ``KVPOOL_MOONCAKE_RESULT {json}`` line. The
transfer-engine metadata is exchanged peer to peer (``P2PHANDSHAKE``), so no
HTTP metadata server or etcd is needed. Protocol is ``tcp``. GB/s is 1e9 bytes
per second.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib.util
import json
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

RESULT_PREFIX = "KVPOOL_MOONCAKE_RESULT "
READY_PREFIX = "KVPOOL_MOONCAKE_READY "
ROUND_PREFIX = "KVPOOL_MOONCAKE_ROUND "
HOST = "127.0.0.1"
METADATA_SERVER = "P2PHANDSHAKE"
PROTOCOL = "tcp"
MASTER_START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
DEFAULT_TIMEOUT_S = 180.0
_SEGMENT_SLACK = 32 << 20
_TAIL_LINES = 30
Results = dict[str, dict[str, float]]


def mooncake_available() -> bool:
    """True if ``mooncake.store`` imports; checked in a child, never raises."""
    try:
        if importlib.util.find_spec("mooncake") is None:
            return False
    except (ImportError, ValueError):
        return False
    return _store_imports(sys.executable)


@functools.lru_cache(maxsize=4)
def _store_imports(python: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import mooncake.store"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def size_label(nbytes: int) -> str:
    """``1048576`` -> ``"1MiB"``; falls back to bytes when not a round unit."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def run_mooncake_local(
    block_sizes: list[int],
    batch: int,
    rounds: int,
    *,
    force_tcp: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Results:
    """Put/get throughput of one store client on its own segment.

    Per block size: ``batch`` blocks per call, one untimed warm-up round, then
    ``rounds`` timed rounds of ``batch_put_from`` (fresh keys) and
    ``batch_get_into``; keys are removed after every round. Mooncake copies
    within its own segment with memcpy; ``force_tcp`` sets MC_STORE_MEMCPY=0
    so the transfer engine goes through TCP loopback instead.
    """
    sizes = _validate(block_sizes, batch, rounds)
    env = _child_env(force_tcp)
    with _master(env) as master_addr:
        args = _worker_args("local", master_addr, sizes, batch, rounds)
        return _run_worker(args, env, timeout_s)


class MooncakeRounds:
    """A local store client that runs one timed round at a time, when asked: put ``batch`` fresh
    blocks of a size from its registered buffer, get them back, remove them. ``kvpool bench
    local`` runs one after each of its own rounds, so both are measured in the same seconds
    and a ratio is a median of per-round ratios (as with memcpy), not of two runs taken
    minutes apart on a shared machine. Use :func:`mooncake_rounds`."""

    def __init__(self, worker: subprocess.Popen[bytes], timeout_s: float) -> None:
        self._worker = worker
        self._timeout_s = timeout_s

    def round(self, size: int, check: bool = False) -> tuple[float, float]:
        """Seconds of one ``batch_put_from`` and one ``batch_get_into`` of ``size``-byte blocks
        (``check``: and compare the bytes read back, untimed)."""
        stdin = self._worker.stdin
        if stdin is None:
            raise RuntimeError("mooncake worker has no stdin")
        stdin.write(f"{size} {int(check)}\n".encode())
        stdin.flush()
        line = _read_line(self._worker, ROUND_PREFIX, time.monotonic() + self._timeout_s)
        if line is None:
            raise RuntimeError("mooncake worker stopped answering rounds")
        put_s, get_s = json.loads(line)
        return float(put_s), float(get_s)


@contextlib.contextmanager
def mooncake_rounds(block_sizes: list[int], batch: int, *, timeout_s: float = DEFAULT_TIMEOUT_S
                    ) -> Iterator[MooncakeRounds]:
    """A master and a stepped local client (:class:`MooncakeRounds`), until the block ends."""
    sizes = _validate(block_sizes, batch, 1)
    env = _child_env(False)
    with _master(env) as master_addr, tempfile.TemporaryFile() as log:
        args = _worker_args("rounds", master_addr, sizes, batch, 1)
        worker = _spawn(args, env, stdout=subprocess.PIPE, log=log)
        try:
            if _read_line(worker, READY_PREFIX, time.monotonic() + timeout_s) is None:
                raise RuntimeError("mooncake worker did not become ready:\n" + _tail_file(log))
            yield MooncakeRounds(worker, timeout_s)
        finally:
            _release_writer(worker)


def run_mooncake_remote(
    block_sizes: list[int],
    batch: int,
    rounds: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Results:
    """Cross-process throughput: a writer client holds the data, a reader reads it.

    The writer mounts the only segment and puts ``batch`` blocks per size. The
    reader mounts no memory, so its ``batch_get_into`` (``get_gbps``) and its
    ``batch_put_from`` of fresh keys (``put_gbps``) both cross the TCP transfer
    engine to the writer's segment.
    """
    sizes = _validate(block_sizes, batch, rounds)
    env = _child_env(False)
    with _master(env) as master_addr, tempfile.TemporaryFile() as writer_log:
        prefix = uuid.uuid4().hex[:12]
        writer_args = _worker_args("writer", master_addr, sizes, batch, rounds, prefix)
        writer = _spawn(writer_args, env, stdout=subprocess.PIPE, log=writer_log)
        try:
            deadline = time.monotonic() + timeout_s
            if _read_line(writer, READY_PREFIX, deadline) is None:
                raise RuntimeError(
                    "mooncake writer did not become ready:\n" + _tail_file(writer_log)
                )
            reader_args = _worker_args("reader", master_addr, sizes, batch, rounds, prefix)
            return _run_worker(reader_args, env, max(1.0, deadline - time.monotonic()))
        finally:
            _release_writer(writer)


# --------------------------------------------------------------------------
# Parent side: processes.


def _validate(block_sizes: Sequence[int], batch: int, rounds: int) -> list[int]:
    if not block_sizes or any(size <= 0 for size in block_sizes):
        raise ValueError(f"block sizes must be positive, got {list(block_sizes)}")
    if len(set(block_sizes)) != len(block_sizes):
        raise ValueError(f"duplicate block sizes: {list(block_sizes)}")
    if batch < 1 or rounds < 1:
        raise ValueError(f"batch and rounds must be >= 1, got {batch}, {rounds}")
    if not mooncake_available():
        raise RuntimeError(
            "mooncake is not installed or does not import: apt-get install -y "
            "libibverbs1 && pip install mooncake-transfer-engine-non-cuda"
        )
    return list(block_sizes)


def _child_env(force_tcp: bool) -> dict[str, str]:
    env = dict(os.environ)
    bench_root = str(Path(__file__).resolve().parent.parent)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = bench_root + (os.pathsep + old if old else "")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    if force_tcp:
        env["MC_STORE_MEMCPY"] = "0"
    return env


def _worker_args(
    mode: str, master: str, sizes: list[int], batch: int, rounds: int, prefix: str = ""
) -> list[str]:
    return [
        sys.executable, "-m", "kvpool_bench.mooncake", "--worker", mode,
        "--master", master, "--sizes", ",".join(str(s) for s in sizes),
        "--batch", str(batch), "--rounds", str(rounds),
        "--prefix", prefix or uuid.uuid4().hex[:12],
    ]  # fmt: skip


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _spawn(
    args: list[str], env: dict[str, str], *, stdout: int | IO[bytes], log: IO[bytes]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=stdout, stderr=log, env=env,
        start_new_session=True,
    )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


@contextlib.contextmanager
def _master(env: dict[str, str]) -> Iterator[str]:
    """Run ``mooncake_master`` on free loopback ports; yields ``host:port``."""
    with tempfile.TemporaryFile() as log:
        for attempt in range(3):
            rpc_port, metrics_port = _free_ports(2)
            args = [
                sys.executable, "-m", "mooncake.cli",
                f"--rpc_address={HOST}", f"--rpc_port={rpc_port}",
                f"--metrics_host={HOST}", f"--metrics_port={metrics_port}",
                "--enable_http_metadata_server=false",
            ]  # fmt: skip
            proc = _spawn(args, env, stdout=log, log=log)
            try:
                if _wait_listening(proc, rpc_port, log):
                    logger.debug("mooncake master on port %d (pid %d)", rpc_port, proc.pid)
                    yield f"{HOST}:{rpc_port}"
                    return
                logger.debug("mooncake master exited early, attempt %d", attempt)
            finally:
                _stop(proc)
        raise RuntimeError("mooncake_master failed to start:\n" + _tail_file(log))


@contextlib.contextmanager
def master() -> Iterator[str]:
    """A ``mooncake_master`` on free loopback ports for stores in this process (the contract
    tests of ``kvpool_client.mooncake`` run the real Mooncake Store against it); yields
    ``host:port``. Raises RuntimeError if it does not start."""
    with _master(_child_env(False)) as addr:
        yield addr


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: IO[bytes]) -> bool:
    """True once the master accepts connections, False if it exited first."""
    deadline = time.monotonic() + MASTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((HOST, port)) == 0:
                return True
        time.sleep(0.05)
    raise RuntimeError(
        f"mooncake_master not listening on port {port} after {MASTER_START_TIMEOUT_S:.0f}s:\n"
        + _tail_file(log)
    )


def _run_worker(args: list[str], env: dict[str, str], timeout_s: float) -> Results:
    try:
        done = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, env=env, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"mooncake worker timed out after {timeout_s:.1f}s:\n" + _tail(exc.stderr)
        ) from exc
    lines = done.stdout.decode(errors="replace").splitlines()
    found = [ln[len(RESULT_PREFIX) :] for ln in lines if ln.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"mooncake worker failed (exit {done.returncode}):\n" + _tail(done.stderr)
        )
    result: Results = json.loads(found[-1])
    return result


def _read_line(proc: subprocess.Popen[bytes], prefix: str, deadline: float) -> str | None:
    """First stdout line starting with ``prefix``; None on EOF or deadline."""
    if proc.stdout is None:
        return None
    fd, pending = proc.stdout.fileno(), b""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith(prefix):
                return text[len(prefix) :]
    return None


def _release_writer(writer: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if writer.stdin is not None:
            writer.stdin.write(b"done\n")
            writer.stdin.close()
    try:
        writer.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("mooncake writer %d did not exit; terminating", writer.pid)
    _stop(writer)


def _tail(data: bytes | str | None) -> str:
    if data is None:
        return "(no output)"
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return "\n".join(text.splitlines()[-_TAIL_LINES:]) or "(no output)"


def _tail_file(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    return _tail(log.read())


# --------------------------------------------------------------------------
# Worker side: runs in the child process, imports mooncake.


class _Buffer:
    """Page-aligned anonymous memory with its raw address."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))


def _fill(buf: _Buffer, size: int, count: int) -> None:
    for i in range(count):
        buf.mem[i * size : (i + 1) * size] = bytes([i % 251 + 1]) * size


def _check(label: str, codes: list[int], want: int) -> None:
    bad = [code for code in codes if code != want]
    if bad:
        raise RuntimeError(f"{label}: {len(bad)}/{len(codes)} failed, codes {sorted(set(bad))}")


def _timed(call: Callable[[], list[int]], label: str, want: int) -> float:
    start = time.perf_counter()
    codes = call()
    elapsed = time.perf_counter() - start
    _check(label, codes, want)
    return elapsed


def _connect(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # setup(local_hostname, metadata_server, global_segment_size,
    #       local_buffer_size, protocol, rdma_devices, master_server_addr)
    code = store.setup(HOST, METADATA_SERVER, segment, 0, PROTOCOL, "", master)
    if code != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup failed with {code}")
    return store


def _register(store: Any, size: int) -> _Buffer:
    buf = _Buffer(size)
    code = store.register_buffer(buf.addr, size)
    if code != 0:
        raise RuntimeError(f"register_buffer({size}) failed with {code}")
    return buf


def _put_get(
    store: Any, src: _Buffer, dst: _Buffer, keys: list[str], size: int, get_keys: list[str]
) -> tuple[float, float]:
    """Put ``keys`` from ``src``, get ``get_keys`` into ``dst``, remove ``keys``."""
    sizes = [size] * len(keys)
    src_ptrs = [src.addr + i * size for i in range(len(keys))]
    dst_ptrs = [dst.addr + i * size for i in range(len(keys))]
    put_s = _timed(lambda: store.batch_put_from(keys, src_ptrs, sizes), "batch_put_from", 0)
    get_s = _timed(lambda: store.batch_get_into(get_keys, dst_ptrs, sizes), "batch_get_into", size)
    _check("batch_remove", store.batch_remove(keys, True), 0)
    return put_s, get_s


def _measure(
    store: Any, opts: argparse.Namespace, sizes: list[int], stored: str | None
) -> Results:
    """Time put of fresh keys and get of ``stored``-prefixed keys (or the fresh ones)."""
    span = opts.batch * max(sizes)
    src, dst = _register(store, span), _register(store, span)
    out: Results = {}
    for size in sizes:
        _fill(src, size, opts.batch)
        get_keys = [f"{stored}-{size}-{i}" for i in range(opts.batch)] if stored else None
        put_s = get_s = 0.0
        for rnd in range(opts.rounds + 1):  # round 0 warms up and is not timed
            keys = [f"{opts.prefix}-{size}-{rnd}-{i}" for i in range(opts.batch)]
            put_t, get_t = _put_get(store, src, dst, keys, size, get_keys or keys)
            if rnd == 0 and src.mem[: opts.batch * size] != dst.mem[: opts.batch * size]:
                raise RuntimeError(f"data read back differs from data written, block {size}")
            if rnd:
                put_s, get_s = put_s + put_t, get_s + get_t
        moved = opts.batch * size * opts.rounds
        out[size_label(size)] = {"put_gbps": moved / put_s / 1e9, "get_gbps": moved / get_s / 1e9}
    return out


def _worker_local(opts: argparse.Namespace, sizes: list[int]) -> Results:
    store = _connect(opts.master, 2 * opts.batch * max(sizes) + _SEGMENT_SLACK)
    out = _measure(store, opts, sizes, None)
    store.close()
    return out


def _worker_rounds(opts: argparse.Namespace, sizes: list[int]) -> Results:
    """One round per line of stdin (``SIZE CHECK``), its put and get seconds on stdout; ends
    at ``done`` or end of input."""
    span = opts.batch * max(sizes)
    store = _connect(opts.master, 2 * span + _SEGMENT_SLACK)
    src, dst = _register(store, span), _register(store, span)
    filled = 0
    print(READY_PREFIX + "{}", flush=True)
    for n, line in enumerate(sys.stdin):
        parts = line.split()
        if len(parts) != 2:
            break
        size, check = int(parts[0]), parts[1] == "1"
        if size != filled:
            _fill(src, size, opts.batch)
            filled = size
        keys = [f"{opts.prefix}-{size}-{n}-{i}" for i in range(opts.batch)]
        put_s, get_s = _put_get(store, src, dst, keys, size, keys)
        if check and src.mem[: opts.batch * size] != dst.mem[: opts.batch * size]:
            raise RuntimeError(f"data read back differs from data written, block {size}")
        print(ROUND_PREFIX + json.dumps([put_s, get_s]), flush=True)
    store.close()
    return {}


def _worker_writer(opts: argparse.Namespace, sizes: list[int]) -> Results:
    stored = opts.batch * sum(sizes)
    store = _connect(opts.master, stored + 2 * opts.batch * max(sizes) + _SEGMENT_SLACK)
    src = _register(store, stored)
    offset = 0
    for size in sizes:
        keys = [f"{opts.prefix}-{size}-{i}" for i in range(opts.batch)]
        ptrs = [src.addr + offset + i * size for i in range(opts.batch)]
        for i in range(opts.batch):
            src.mem[offset + i * size : offset + (i + 1) * size] = bytes([i % 251 + 1]) * size
        _check("batch_put_from", store.batch_put_from(keys, ptrs, [size] * opts.batch), 0)
        offset += opts.batch * size
    print(READY_PREFIX + json.dumps({"keys": opts.batch * len(sizes)}), flush=True)
    sys.stdin.readline()  # parent writes a line, or closes stdin, when the reader is done
    store.close()
    return {}


def _worker_reader(opts: argparse.Namespace, sizes: list[int]) -> Results:
    store = _connect(opts.master, 0)  # no segment: every transfer is remote
    out = _measure(store, opts, sizes, opts.prefix)
    store.close()
    return out


_WORKERS: dict[str, Callable[[argparse.Namespace, list[int]], Results]] = {
    "local": _worker_local,
    "rounds": _worker_rounds,
    "writer": _worker_writer,
    "reader": _worker_reader,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvpool_bench.mooncake")
    parser.add_argument("--worker", choices=sorted(_WORKERS), help="internal: child mode")
    parser.add_argument("--remote", action="store_true", help="run the two-client benchmark")
    parser.add_argument("--force-tcp", action="store_true", help="MC_STORE_MEMCPY=0 (local)")
    parser.add_argument("--master", default="")
    parser.add_argument("--sizes", default=f"{1 << 20},{4 << 20}", help="bytes, comma list")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix", default="kvpool-bench")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = _parse(argv)
    sizes = [int(part) for part in opts.sizes.split(",") if part]
    if opts.worker is None:
        if opts.remote:
            result = run_mooncake_remote(sizes, opts.batch, opts.rounds)
        else:
            result = run_mooncake_local(sizes, opts.batch, opts.rounds, force_tcp=opts.force_tcp)
        print(json.dumps(result, indent=2))
        return 0
    try:
        result = _WORKERS[opts.worker](opts, sizes)
    except Exception:  # top-level guard of the child: report and exit non-zero
        traceback.print_exc()
        return 1
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
