"""pytest fixtures for the real Kubernetes control plane.

Import the fixture into a test module (or a conftest.py)::

    from tests.cluster.fixtures import apiserver  # noqa: F401

The first use builds etcd/kube-apiserver with ``tests/cluster/build.sh``
(10-20 minutes cold, cached in ``$KVPOOL_ENVTEST_CACHE`` or
``~/.cache/kvpool-envtest`` afterwards). A failed build FAILS the tests that
need it; set ``KVPOOL_SKIP_APISERVER=1`` to skip them instead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.harness import ControlPlane, ControlPlaneError

LOG = logging.getLogger(__name__)

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
SKIP_ENV = "KVPOOL_SKIP_APISERVER"
BUILD_TIMEOUT_ENV = "KVPOOL_APISERVER_BUILD_TIMEOUT"


class ApiServerBuildError(RuntimeError):
    """build.sh failed or timed out."""


@dataclass(frozen=True)
class ApiServer:
    """What a test needs to talk to the running control plane."""

    kubeconfig: Path
    url: str
    token: str
    ca_file: Path
    kubectl: str
    bin_dir: Path
    user_kubeconfig: Path  # kvpool-test-user: authenticated, no RBAC grants
    control_plane: ControlPlane

    def kubectl_argv(self, *args: str) -> list[str]:
        return [self.kubectl, "--kubeconfig", str(self.kubeconfig), *args]

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Wait until CustomResourceDefinition ``crd`` is Established. (``kubectl wait
        --for=condition=Established`` fails at once, instead of waiting, when it reads the
        CRD before the API server has given it any condition.)"""
        argv = self.kubectl_argv("get", "crd", crd, "-o",
                                 'jsonpath={.status.conditions[?(@.type=="Established")].status}')
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            last = (r.stdout + r.stderr).strip()
            if r.returncode == 0 and r.stdout.strip() == "True":
                return
            time.sleep(0.2)  # polling the API server: no event to wait on from here
        pytest.fail(f"CRD {crd} not Established within {timeout:.0f}s (last answer: {last!r})")


def build_binaries() -> Path:
    """Run build.sh (a no-op when cached) and return the bin directory."""
    timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "3600"))
    try:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise ApiServerBuildError(
            "{} timed out after {:.0f}s; stderr tail:\n{}".format(BUILD_SCRIPT, timeout, stderr[-4000:])
        ) from exc
    if result.returncode != 0:
        raise ApiServerBuildError(
            "{} failed with exit code {}; stderr tail:\n{}".format(
                BUILD_SCRIPT, result.returncode, result.stderr[-4000:])
        )
    lines = result.stdout.strip().splitlines()
    if not lines:
        raise ApiServerBuildError("{} printed no bin directory".format(BUILD_SCRIPT))
    bin_dir = Path(lines[-1])
    for name in ("etcd", "kube-apiserver", "kubectl"):
        if not os.access(bin_dir / name, os.X_OK):
            raise ApiServerBuildError("{} has no executable {}".format(bin_dir, name))
    return bin_dir


@pytest.fixture(scope="session")
def apiserver() -> Iterator[ApiServer]:
    """A running etcd + kube-apiserver (+ kube-controller-manager) for the session."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip("{}=1: real Kubernetes API server tests are disabled".format(SKIP_ENV))
    try:
        bin_dir = build_binaries()
    except ApiServerBuildError as exc:
        pytest.fail("could not build the Kubernetes control plane (set {}=1 to skip):\n{}".format(
            SKIP_ENV, exc), pytrace=False)
    plane = ControlPlane(bin_dir)
    try:
        plane.start()
    except ControlPlaneError as exc:
        pytest.fail("could not start the Kubernetes control plane:\n{}".format(exc), pytrace=False)
    try:
        yield ApiServer(
            kubeconfig=plane.kubeconfig,
            url=plane.url,
            token=plane.token,
            ca_file=plane.ca_file,
            kubectl=str(bin_dir / "kubectl"),
            bin_dir=bin_dir,
            user_kubeconfig=plane.workdir / "kubeconfig-user",
            control_plane=plane,
        )
    finally:
        plane.stop()
