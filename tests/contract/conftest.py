"""Real Redis for the contract suites: a redis-server, a 3-shard Redis Cluster, and servers
on demand (with a password, or to kill and restart), all on loopback in temp dirs."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT_S = 15.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port = port + 10000)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 <= 65535 and _bindable(port + 10000):
            return port


def _answers(port: int, tls: bool = False) -> bool:
    """True when something on ``port`` answers a PING with a RESP reply (even NOAUTH)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            s = raw
            if tls:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                s = ctx.wrap_socket(raw)
            s.sendall(b"PING\r\n")
            return s.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


def self_signed_cert(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (``openssl`` CLI): (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


class RedisServer:
    """One ``redis-server`` process without persistence; restartable on the same port.

    ``config``: a redis.conf read first (the options given here override it), as the
    operator's managed Redis reads the one in its Secret.
    """

    def __init__(self, workdir: Path, *args: str, port: int | None = None, cluster: bool = False,
                 tls: tuple[Path, Path] | None = None, config: Path | None = None) -> None:
        self.workdir = workdir
        self.args = list(args)
        self.config = config
        self.cluster = cluster
        self.tls = tls
        self.port = port or free_port(cluster_bus=cluster)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [REDIS_SERVER, *([str(self.config)] if self.config else []), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000"]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls[0]),
                    "--tls-key-file", str(self.tls[1]), "--tls-ca-cert-file", str(self.tls[0]),
                    "--tls-auth-clients", "no"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd + self.args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.port, tls=self.tls is not None):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on {self.port} did not start; see {self.workdir}/redis.log")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: the data in memory is lost (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


class RedisClusterProcs:
    """``shards`` cluster-enabled servers joined by ``redis-cli --cluster create``, no replicas."""

    def __init__(self, workdir: Path, shards: int = 3) -> None:
        self.servers = [RedisServer(workdir / f"shard{i}", cluster=True) for i in range(shards)]

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def start(self) -> RedisClusterProcs:
        if REDIS_CLI is None:
            pytest.skip("redis-cli is not installed")
        for s in self.servers:
            s.start()
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while not all(self._ok(p) for p in self.ports):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _ok(port: int) -> bool:
        out = subprocess.run([REDIS_CLI or "redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, timeout=10)
        return b"cluster_state:ok" in out.stdout

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server shared by the session (tests use distinct pool names)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A real 3-shard Redis Cluster on loopback, shared by the session."""
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Start extra servers (``redis_factory("--requirepass", "pw")``, or with a redis.conf:
    ``redis_factory(config=path)``); stopped after the test."""
    started: list[RedisServer] = []

    def start(*args: str, port: int | None = None, tls: tuple[Path, Path] | None = None,
              config: Path | None = None) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis-extra"), *args, port=port, tls=tls,
                             config=config).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def slow_pipelines(index: Any, delay_s: float) -> Callable[[], None]:
    """Make every pipeline ``index`` sends wait ``delay_s`` before it executes (a slow link
    or a busy server); returns the undo."""
    real = index._r.pipeline

    def slow(*args: Any, **kw: Any) -> Any:
        pipe = real(*args, **kw)
        execute = pipe.execute

        async def slowly(*a: Any, **k: Any) -> Any:
            await asyncio.sleep(delay_s)
            return await execute(*a, **k)

        pipe.execute = slowly
        return pipe

    index._r.pipeline = slow

    def undo() -> None:
        index._r.pipeline = real

    return undo
