"""Fixtures for the Helm chart tests.

- ``helm``: a pinned helm binary built by ``scripts/get-helm.sh`` (cached); a failed build
  FAILS the tests (set ``KVPOOL_SKIP_HELM=1`` to skip them instead).
- ``Helm``: small wrapper that runs helm against the chart and parses rendered manifests.

The API-server tests reuse the fixtures of tests/e2e/conftest.py (``apiserver``, ``k8s``,
``redis_server``) by importing them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
GET_HELM = REPO / "scripts" / "get-helm.sh"
SKIP_ENV = "KVPOOL_SKIP_HELM"
BUILD_TIMEOUT_ENV = "KVPOOL_HELM_BUILD_TIMEOUT"

Manifest = dict[str, Any]


class HelmError(RuntimeError):
    """helm exited non-zero (message: the command and its output)."""


@dataclass
class Helm:
    """The helm binary, run with an optional kubeconfig and a private home (no user config)."""

    binary: str
    home: Path
    kubeconfig: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def with_kubeconfig(self, kubeconfig: Path) -> Helm:
        return Helm(self.binary, self.home, kubeconfig, self.env)

    def run(self, *args: str, check: bool = True, stdin: str | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env,
               "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        argv = [self.binary, *args]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout,
                                check=False)
        if check and result.returncode != 0:
            raise HelmError("helm {} failed ({}):\n{}{}".format(" ".join(args), result.returncode, result.stdout,
                                                                result.stderr))
        return result

    def template(self, *set_args: str, values: Sequence[Manifest] = (), release: str = "kvpool",
                 namespace: str = "kvpool-system", extra: Sequence[str] = ()) -> list[Manifest]:
        """Rendered manifests (templates only; the CRD with --include-crds in ``extra``)."""
        args = ["template", release, str(CHART), "--namespace", namespace, *extra]
        for i, v in enumerate(values):
            path = self.home / "values-{}-{}.yaml".format(os.getpid(), i)
            path.write_text(yaml.safe_dump(v))
            args += ["--values", str(path)]
        for s in set_args:
            args += ["--set", s]
        out = self.run(*args).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def template_error(self, *set_args: str, values: Sequence[Manifest] = ()) -> str:
        """The error text of a rendering that must fail."""
        try:
            self.template(*set_args, values=values)
        except HelmError as e:
            return str(e)
        pytest.fail("helm template {} {} rendered, but it should have failed".format(set_args, values))


def build_helm() -> str:
    """Run get-helm.sh (a no-op when cached); returns the binary's path."""
    timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "1800"))
    try:
        result = subprocess.run(["bash", str(GET_HELM)], capture_output=True, text=True, timeout=timeout,
                                check=False)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail("{} timed out after {:.0f}s (set {}=1 to skip):\n{}".format(
            GET_HELM, timeout, SKIP_ENV, stderr[-4000:]), pytrace=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not os.access(lines[-1], os.X_OK):
        pytest.fail("{} failed with exit code {} (set {}=1 to skip):\n{}".format(
            GET_HELM, result.returncode, SKIP_ENV, result.stderr[-4000:]), pytrace=False)
    return lines[-1]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip("{}=1: Helm chart tests are disabled".format(SKIP_ENV))
    return Helm(build_helm(), tmp_path_factory.mktemp("helm-home"))


def by_kind(docs: Sequence[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Sequence[Manifest], kind: str) -> Manifest:
    found = by_kind(docs, kind)
    assert len(found) == 1, "expected one {}, got {}".format(kind, [d["metadata"]["name"] for d in found])
    return found[0]
