"""The finalizer drains the sidecars before the purge and never holds a deletion for long."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kopf
import pytest

from kvpool_operator import handlers
from kvpool_operator import index as redis_index
from kvpool_operator.deletion import drain_sidecars, finalize
from kvpool_operator.errors import KubernetesApiError
from kvpool_operator.kube import resource_path
from kvpool_operator.preflight import PoolRef
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import OperatorSettings
from tests.unit.operator_support import FakeKube, pool_body

SETTINGS = OperatorSettings()
SPEC = {"redis": {"external": {"url": "redis://r:6379/0"}}}
DS_PATH = resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")


class ForbiddenKube:
    """An API client whose token may no longer read anything (the namespace's RoleBinding went)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
        raise KubernetesApiError("GET {}: 403 forbidden".format(kind), 403, "Forbidden")


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class SlowGarbageCollector(FakeKube):
    """A foreground-deleted DaemonSet stays (with a deletionTimestamp) for ``polls`` more reads."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None,
               foreground: bool = False) -> bool:
        if not (kind == "DaemonSet" and foreground):
            return super().delete(api_version, kind, namespace, name, uid=uid, foreground=foreground)
        self.calls.append(("delete-foreground", kind, name))
        self.objects[DS_PATH]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = super().get(api_version, kind, namespace, name)
        if kind == "DaemonSet" and found is not None and found["metadata"].get("deletionTimestamp"):
            if self.polls <= 0:
                self.objects.pop(DS_PATH)
                return None
            self.polls -= 1
        return found


def _pool_with_children(kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Reconcile the pool into ``kube``; returns the purge log (``kube.calls`` cleared)."""
    @contextmanager
    def connect(url: str, password: str | None, **_: Any) -> Iterator[object]:
        yield object()

    monkeypatch.setattr(redis_index, "connect", connect)
    monkeypatch.setattr(redis_index, "read_snapshot", lambda *a, **k: redis_index.IndexSnapshot())
    purged: list[str] = []

    def purge(client: object, pool_id: str, url: str = "") -> int:
        purged.append(pool_id)
        kube.calls.append(("purge", "index", pool_id))
        return 4

    monkeypatch.setattr(redis_index, "purge", purge)
    reconcile(pool_body(SPEC), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    kube.calls.clear()
    return purged


def test_the_sidecars_are_gone_before_the_purge(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = SlowGarbageCollector(polls=3)
    _pool_with_children(kube, monkeypatch)
    time = FakeTime()
    outcome = finalize(pool_body(SPEC), kube=kube, settings=SETTINGS, retry=0,  # type: ignore[arg-type]
                       elapsed_s=0.0, clock=time.clock, sleep=time.sleep)
    assert outcome.retry_in is None and outcome.message == "purged 4 index keys" and outcome.warnings == ()
    assert kube.calls == [("delete-foreground", "DaemonSet", "p-sidecar"), ("purge", "index", "ns.p")]
    assert time.slept == [SETTINGS.reconcile.drain_poll_s] * 3  # waited for the pods, then purged


def test_a_drain_that_does_not_end_is_bounded_then_the_purge_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = SlowGarbageCollector(polls=10**6)
    _pool_with_children(kube, monkeypatch)
    time = FakeTime()
    outcome = finalize(pool_body(SPEC), kube=kube, settings=SETTINGS, retry=0,  # type: ignore[arg-type]
                       elapsed_s=0.0, clock=time.clock, sleep=time.sleep)
    assert time.now == pytest.approx(SETTINGS.reconcile.drain_timeout_s)
    assert [w[0] for w in outcome.warnings] == ["SidecarsNotDrained"]
    assert "still there after 60s" in outcome.warnings[0][1]
    assert kube.calls[-1] == ("purge", "index", "ns.p") and outcome.retry_in is None
    # A later run (its budget spent) waits no more and says it no more.
    kube.calls.clear()
    later = finalize(pool_body(SPEC), kube=kube, settings=SETTINGS, retry=1,  # type: ignore[arg-type]
                     elapsed_s=61.0, clock=time.clock, sleep=time.sleep)
    assert time.now == pytest.approx(SETTINGS.reconcile.drain_timeout_s) and later.warnings == ()


def test_someone_elses_daemonset_is_not_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    kube.objects[DS_PATH] = {"apiVersion": "apps/v1", "kind": "DaemonSet",
                             "metadata": {"name": "p-sidecar", "namespace": "ns", "uid": "x"}}
    assert drain_sidecars(kube, PoolRef("p", "ns", "pool-uid", 1), 5.0, poll_s=1.0)  # type: ignore[arg-type]
    assert kube.calls == [] and DS_PATH in kube.objects


def test_an_unreachable_redis_is_given_up_at_the_deadline() -> None:
    """A real connection to a closed port; the pool goes once the deadline has passed."""
    settings = OperatorSettings.from_env({"KVPOOL_OPERATOR_PURGE_RETRIES": "1000",
                                          "KVPOOL_OPERATOR_PURGE_DEADLINE": "30",
                                          "KVPOOL_OPERATOR_REDIS_TIMEOUT": "0.2"})
    body = pool_body({"redis": {"external": {"url": "redis://127.0.0.1:1/0"}}})
    early = finalize(body, kube=FakeKube(), settings=settings, retry=3, elapsed_s=10.0)  # type: ignore[arg-type]
    assert early.retry_in is not None and 0 < early.retry_in <= 20.0 and early.warnings == ()
    late = finalize(body, kube=FakeKube(), settings=settings, retry=4, elapsed_s=30.0)  # type: ignore[arg-type]
    assert late.retry_in is None
    assert [w[0] for w in late.warnings] == ["IndexNotPurged"]
    assert "gave up purging" in late.warnings[0][1] and "127.0.0.1:1" in late.warnings[0][1]


def test_the_retry_delay_never_passes_the_deadline() -> None:
    settings = OperatorSettings.from_env({"KVPOOL_OPERATOR_PURGE_RETRIES": "1000",
                                          "KVPOOL_OPERATOR_PURGE_DEADLINE": "30",
                                          "KVPOOL_OPERATOR_BACKOFF_MAX": "600"})
    body = pool_body({"redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "pw"}}}})
    outcome = finalize(body, kube=ForbiddenKube(), settings=settings, retry=9,  # type: ignore[arg-type]
                       elapsed_s=25.0)
    assert outcome.retry_in is not None and outcome.retry_in <= 5.0


def test_a_refused_api_call_is_retried_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "Kube", ForbiddenKube)
    warned: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, **kw: warned.append(kw))
    memo = kopf.Memo()
    memo[handlers._KUBE] = ForbiddenKube()  # noqa: SLF001
    body = kopf.Body({**pool_body({"redis": {"external": {"url": "redis://r:6379",
                                                          "passwordSecretRef": {"name": "pw"}}}}),
                      "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                                   "deletionTimestamp": "2026-11-30T00:00:00Z"}})
    log = logging.getLogger("test")
    with pytest.raises(kopf.TemporaryError):  # a later attempt may be allowed
        handlers.on_delete(body=body, memo=memo, retry=0, runtime=datetime.timedelta(seconds=0), logger=log)
    # The drain could not even look: said once, on the first run; the purge is retried.
    assert [w["reason"] for w in warned] == ["SidecarsNotDrained"]
    warned.clear()
    last = handlers.SETTINGS.reconcile.purge_retries - 1
    handlers.on_delete(body=body, memo=memo, retry=last, logger=log,  # returns: the finalizer goes
                       runtime=datetime.timedelta(seconds=handlers.SETTINGS.reconcile.drain_timeout_s + 1))
    assert [w["reason"] for w in warned] == ["IndexNotPurged"] and "403" in warned[0]["message"]
    warned.clear()
    handlers.on_delete(body=body, memo=memo, retry=0, logger=log,  # the deadline alone ends it too
                       runtime=datetime.timedelta(seconds=handlers.SETTINGS.reconcile.purge_deadline_s))
    assert [w["reason"] for w in warned] == ["IndexNotPurged"]
