"""README's kubectl section, run as written (only the namespace differs) against the real
API server with the operator running: apply, get, describe, the socket path, delete (with
the managed Redis unreachable, as no pod runs here: the deletion gives up on the purge
within its deadline), and an invalid pool refused with a message that names the field."""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.fixtures import ApiServer
from tests.e2e.conftest import (
    OPERATOR_NAMESPACE,
    REPO,
    K8s,
    OperatorProcess,
    running_operator,
    wait_for,
)

pytestmark = pytest.mark.apiserver

#: A short purge deadline: the managed Redis of examples/minimal.yaml never runs here.
PURGE_DEADLINE_S = 5


def readme_block(after: str, index: int = 0) -> list[str]:
    """The lines of the ``index``-th ```sh block after the heading ``after`` in README.md."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(after):]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    return [line for line in blocks[index].splitlines() if line.strip()]


@pytest.fixture(scope="module")
def operator_short_purge(apiserver: ApiServer, kvpool_crd: str,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    with running_operator({"KUBECONFIG": str(apiserver.kubeconfig), "KVPOOL_OPERATOR_POD_NAMESPACE": OPERATOR_NAMESPACE,
                           "KVPOOL_OPERATOR_PURGE_DEADLINE": str(PURGE_DEADLINE_S)}, log_path) as operator:
        yield operator


def _run(k8s: K8s, line: str, namespace: str) -> str:
    argv = shlex.split(line.replace("team-a", namespace))
    assert argv[0] == "kubectl", line
    out = k8s.kubectl(*argv[1:])
    return out.stdout


def test_readme_kubectl_section_as_written(k8s: K8s, operator_short_purge: OperatorProcess) -> None:
    lines = readme_block("### A pool with kubectl")
    assert [shlex.split(x)[:2] for x in lines] == [["kubectl", "create"], ["kubectl", "apply"], ["kubectl", "get"],
                                                   ["kubectl", "describe"], ["kubectl", "get"], ["kubectl", "delete"]]
    ns = "kvp-readme-" + uuid.uuid4().hex[:6]
    try:
        create, apply, get, describe, socket_path, delete = lines
        assert "namespace/{} created".format(ns) in _run(k8s, create, ns)
        assert _run(k8s, apply, ns).strip() == "kvcachepool.kvpool.io/minimal created"
        # the operator reconciles it: children and status (no sidecar runs here: not Ready)
        wait_for("the operator's status on the pool", lambda: ((k8s.pool(ns, "minimal") or {}).get("status") or {})
                 .get("socketPath"), timeout=60)
        table = _run(k8s, get, ns).splitlines()
        assert table[0].split() == ["NAME", "READY", "NODES", "CAPACITY", "USED", "HIT", "RATE", "AGE"]
        assert table[1].split()[:2] == ["minimal", "False"], table
        described = _run(k8s, describe, ns)
        assert re.search(r"^Name:\s+minimal$", described, flags=re.M), described
        # no pod runs here, so neither does the managed Redis: not Ready, and the reason says why
        assert re.search(r"Reason:\s+IndexUnreachable", described) and "Events:" in described, described
        assert _run(k8s, socket_path, ns) == "/run/kvpool/{}.minimal/kvpool.sock".format(ns)
        # delete waits for the finalizer: drained (no pods), purge given up within its deadline
        assert _run(k8s, delete, ns).strip() == 'kvcachepool.kvpool.io "minimal" deleted'
        assert k8s.pool(ns, "minimal") is None
        events = k8s.kubectl("get", "events", "-n", ns, "--field-selector", "reason=IndexNotPurged",
                             "-o", "name").stdout
        assert events.strip(), "no IndexNotPurged Event for the unreachable Redis"
        assert operator_short_purge.process.poll() is None, operator_short_purge.log_tail()
    finally:
        k8s.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def test_an_invalid_pool_gets_the_message_readme_shows(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    lines = readme_block("### A pool with kubectl", 1)
    command = lines[0]
    shown = " ".join(x.lstrip("#").strip() for x in lines[1:])
    argv = shlex.split(command.replace("team-a", namespace))
    out = k8s.kubectl(*argv[1:], check=False)
    assert out.returncode != 0
    assert " ".join(out.stderr.split()) == shown, out.stderr
    assert Path(REPO / argv[-1]).exists()
    assert k8s.pool(namespace, "too-big-blocks") is None
