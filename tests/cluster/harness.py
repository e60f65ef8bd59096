"""A throwaway Kubernetes control plane for tests.

``ControlPlane`` runs etcd, kube-apiserver and (optionally)
kube-controller-manager, as built by ``tests/cluster/build.sh``, on free
127.0.0.1 ports with all state in a temporary directory::

    with ControlPlane(bin_dir) as cp:
        subprocess.run([kubectl, "--kubeconfig", str(cp.kubeconfig), "get", "ns"])

The API server authenticates static bearer tokens: ``cp.token`` belongs to
``admin`` (group ``system:masters``), ``cp.user_token`` to ``kvpool-test-user``
(no extra groups), and authorises with RBAC. There is no scheduler and no
kubelet: pods are stored but never run. Without the controller manager
nothing creates ServiceAccounts, so the ServiceAccount admission plugin is
disabled then; with it, owned objects are garbage-collected and
Deployments/ReplicaSets/Jobs get their pods created.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

LOG = logging.getLogger(__name__)

ADMIN_USER = "admin"
TEST_USER = "kvpool-test-user"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
_PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    """The control plane could not be started (message includes log tails)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the thread that started it dies.

    Keeps a crashed or SIGKILLed test run from leaving etcd/apiserver behind.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return "<cannot read {}: {}>".format(path, exc)
    return "\n".join(text.splitlines()[-lines:])


def generate_rsa_key(private_path: Path, public_path: Path) -> None:
    """Write a 2048-bit RSA key pair (PEM) for service-account tokens."""
    openssl = shutil.which("openssl")
    if openssl is not None:
        subprocess.run(
            [openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", str(private_path)],
            check=True, capture_output=True,
        )
        subprocess.run(
            [openssl, "pkey", "-in", str(private_path), "-pubout", "-out", str(public_path)],
            check=True, capture_output=True,
        )
    else:
        try:
            from cryptography.hazmat.primitives import serialization  # type: ignore[import-not-found,unused-ignore]
            from cryptography.hazmat.primitives.asymmetric import rsa  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise ControlPlaneError(
                "need either the openssl CLI or the cryptography package to make a key"
            ) from exc
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private_path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))
        public_path.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        ))
    private_path.chmod(0o600)


class _Process:
    """One child process with its output going to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")
        LOG.debug("starting %s: %s", name, " ".join(argv))
        try:
            self.popen: subprocess.Popen[bytes] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no stray Ctrl-C; stop() does it in order
                preexec_fn=_die_with_parent,
            )
        except OSError:
            self._log.close()
            raise

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        return _tail(self.log_path, lines)

    def stop(self, timeout: float = 15.0) -> None:
        if self.running():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                LOG.warning("%s did not exit %.0fs after SIGTERM; killing it", self.name, timeout)
                self.popen.kill()
                self.popen.wait(timeout=timeout)
        self._log.close()


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on 127.0.0.1."""

    def __init__(
        self,
        bin_dir: Path | str,
        *,
        workdir: Path | str | None = None,
        controller_manager: bool | None = None,
        startup_timeout: float = 90.0,
        extra_apiserver_args: Sequence[str] = (),
        keep_workdir: bool = False,
    ) -> None:
        """``controller_manager=None`` runs it when the binary is in bin_dir."""
        self.bin_dir = Path(bin_dir)
        kcm = self.bin_dir / "kube-controller-manager"
        self.with_controller_manager = (
            os.access(kcm, os.X_OK) if controller_manager is None else controller_manager
        )
        self.startup_timeout = startup_timeout
        self.extra_apiserver_args = tuple(extra_apiserver_args)
        self._given_workdir = Path(workdir) if workdir is not None else None
        self._keep_workdir = keep_workdir or workdir is not None
        self.workdir = Path()
        self.token = secrets.token_hex(24)
        self.user_token = secrets.token_hex(24)
        self.etcd_url = ""
        self.url = ""
        self._processes: list[_Process] = []
        self._started = False

    # -- paths -----------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        """CA bundle for the apiserver's self-signed serving certificate."""
        return self.workdir / "certs" / "apiserver.crt"

    def _binary(self, name: str) -> str:
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError("{} not found or not executable (run tests/cluster/build.sh)".format(path))
        return str(path)

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._started:
            raise ControlPlaneError("already started")
        self._started = True
        if self._given_workdir is not None:
            self.workdir = self._given_workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvpool-cp-"))
        atexit.register(self.stop)
        try:
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfig(self.kubeconfig, self.token, ADMIN_USER)
            self._write_kubeconfig(self.workdir / "kubeconfig-user", self.user_token, TEST_USER)
            self._wait_for("namespace default", lambda: self._get("/api/v1/namespaces/default") == 200)
            if self.with_controller_manager:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        LOG.info("control plane up: %s (kubeconfig %s)", self.url, self.kubeconfig)

    def stop(self) -> None:
        """Stop the controller manager, apiserver and etcd (in that order)."""
        atexit.unregister(self.stop)
        while self._processes:
            proc = self._processes.pop()
            proc.stop()
        if self._started and not self._keep_workdir and self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._started = False

    def log_tail(self, name: str, lines: int = 40) -> str:
        for proc in self._processes:
            if proc.name == name:
                return proc.tail(lines)
        return _tail(self.workdir / "{}.log".format(name), lines)

    # -- components ------------------------------------------------------------

    def _spawn(self, name: str, argv: Sequence[str]) -> _Process:
        proc = _Process(name, argv, self.workdir / "{}.log".format(name))
        self._processes.append(proc)
        return proc

    def _start_etcd(self) -> None:
        client_port, peer_port = free_port(), free_port()
        self.etcd_url = "http://127.0.0.1:{}".format(client_port)
        peer_url = "http://127.0.0.1:{}".format(peer_port)
        proc = self._spawn("etcd", [
            self._binary("etcd"),
            "--name=default",
            "--data-dir={}".format(self.workdir / "etcd"),
            "--listen-client-urls={}".format(self.etcd_url),
            "--advertise-client-urls={}".format(self.etcd_url),
            "--listen-peer-urls={}".format(peer_url),
            "--initial-advertise-peer-urls={}".format(peer_url),
            "--initial-cluster=default={}".format(peer_url),
            "--unsafe-no-fsync=true",  # test data: speed over durability
            "--log-level=warn",
        ])

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as resp:
                    body: dict[str, object] = json.load(resp)
                    return body.get("health") == "true"
            except (OSError, ValueError):
                return False

        self._wait_for("etcd", healthy, proc)

    def _start_apiserver(self) -> None:
        port = free_port()
        self.url = "https://127.0.0.1:{}".format(port)
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(
            '{},{},admin-uid,"system:masters"\n{},{},test-user-uid\n'.format(
                self.token, ADMIN_USER, self.user_token, TEST_USER)
        )
        tokens.chmod(0o600)
        sa_key, sa_pub = self.workdir / "sa.key", self.workdir / "sa.pub"
        generate_rsa_key(sa_key, sa_pub)
        disabled = [] if self.with_controller_manager else ["ServiceAccount"]
        argv = [
            self._binary("kube-apiserver"),
            "--etcd-servers={}".format(self.etcd_url),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--secure-port={}".format(port),
            "--cert-dir={}".format(certs),
            "--token-auth-file={}".format(tokens),
            "--authorization-mode=RBAC",
            "--service-account-issuer={}".format(SERVICE_ACCOUNT_ISSUER),
            "--service-account-key-file={}".format(sa_pub),
            "--service-account-signing-key-file={}".format(sa_key),
            "--service-cluster-ip-range={}".format(SERVICE_CLUSTER_IP_RANGE),
            "--allow-privileged=true",
            # The `kubernetes` Service would point at 127.0.0.1, which
            # Endpoints validation rejects: don't reconcile it.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ]
        if disabled:
            argv.append("--disable-admission-plugins={}".format(",".join(disabled)))
        argv.extend(self.extra_apiserver_args)
        proc = self._spawn("kube-apiserver", argv)
        self._wait_for("kube-apiserver /readyz", lambda: self._get("/readyz") == 200, proc)

    def _start_controller_manager(self) -> None:
        proc = self._spawn("kube-controller-manager", [
            self._binary("kube-controller-manager"),
            "--kubeconfig={}".format(self.kubeconfig),
            # No /healthz server: it would need a client CA in the apiserver
            # (extension-apiserver-authentication) and a port; readiness is
            # checked through the apiserver below instead.
            "--secure-port=0",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            "--service-account-private-key-file={}".format(self.workdir / "sa.key"),
            "--root-ca-file={}".format(self.ca_file),
            "--cluster-name=kvpool-test",
        ])
        # The serviceaccount controller creating default/default shows the
        # controllers are running.
        self._wait_for(
            "kube-controller-manager (ServiceAccount default/default)",
            lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default") == 200,
            proc,
        )

    # -- helpers -----------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the serving cert once the apiserver has written it."""
        if self.ca_file.exists():
            return ssl.create_default_context(cafile=str(self.ca_file))
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _get(self, path: str) -> int:
        """HTTP status of an admin GET (0 when the server cannot be reached)."""
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": "Bearer " + self.token})
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.ssl_context()) as resp:
                status: int = resp.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:  # refused, TLS, timeouts (URLError is an OSError)
            return 0

    def _wait_for(self, what: str, ready: Callable[[], bool], proc: _Process | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if proc is not None and not proc.running():
                raise ControlPlaneError("{} exited with code {} while waiting for {}; log tail:\n{}".format(
                    proc.name, proc.popen.returncode, what, proc.tail()))
            if ready():
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    "--- {} ({}) ---\n{}".format(p.name, p.log_path, p.tail()) for p in self._processes)
                raise ControlPlaneError("{} not ready after {:.0f}s; log tails:\n{}".format(
                    what, self.startup_timeout, tails))
            time.sleep(0.25)

    def _write_kubeconfig(self, path: Path, token: str, user: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kvpool-test", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "kvpool-test", "context": {
                "cluster": "kvpool-test", "user": user, "namespace": "default"}}],
            "current-context": "kvpool-test",
        }
        # JSON is YAML: kubectl and the Python client read it as is.
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)

