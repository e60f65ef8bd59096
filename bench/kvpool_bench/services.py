"""Throw-away services for benchmarks and the demo: a redis-server on a free loopback port,
what a child process has cost, and the client-side buffers the benchmarks copy from and to."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has run so far, its threads together (0 when /proc cannot say).

    Read from each thread's ``schedstat`` (nanoseconds: fine enough for a window of a
    millisecond); where the kernel keeps none, from ``stat`` (clock ticks)."""
    total, read = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            read = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended, or no schedstat
    if read:
        return total / 1e9
    return _stat_cpu_s(f"/proc/{pid}/stat")


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds a process's main thread has run so far (a sidecar's event loop; 0 when
    /proc cannot say): as :func:`process_cpu_s`, that thread alone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _stat_cpu_s(f"/proc/{pid}/task/{pid}/stat")


def _stat_cpu_s(path: str) -> float:
    """User and system CPU seconds from a ``stat`` file of /proc (0 when it cannot be read)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class TooLargeError(ValueError):
    """A bench's sizes, batch and rounds do not fit this machine's memory."""


def check_memory(need: int, what: str, smaller: str) -> None:
    """A :class:`TooLargeError` saying so where ``need`` bytes are more than half this machine's
    memory (a bench asked for blocks of 1 GiB had set out to fill an arena of hundreds, a demo
    of 3 GB blocks was killed by the kernel); ``smaller``: the options to turn down."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total // 2:
        raise TooLargeError(f"{what} needs about {need / 2**30:.1f} GiB of memory, more than half of this "
                            f"machine's {total / 2**30:.1f} GiB: ask for a smaller {smaller}")


def page_aligned(size: int, fill: bytes | None = None) -> memoryview:
    """A client buffer as an engine's pinned tensors and Mooncake's registered buffers are:
    page-aligned anonymous memory (optionally holding ``fill``), touched once already."""
    view = memoryview(mmap.mmap(-1, size))
    view[:] = fill if fill is not None else bytes(size)
    return view


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """``redis-server`` on 127.0.0.1 with no persistence, in a temporary directory."""

    def __init__(self, port: int | None = None, *, password: str | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [exe, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir)]
        if not self.host.startswith("127."):
            args += ["--protected-mode", "no"]  # reachable from test hosts on a private bridge
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port} (dir {self.dir})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
