"""The finalizer never holds a pool's deletion forever."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest

from kvpool_operator import handlers
from kvpool_operator.errors import KubernetesApiError


class ForbiddenKube:
    """An API client whose token may no longer read the pool's Secrets."""

    def secret_value(self, namespace: str, name: str, key: str) -> str:
        raise KubernetesApiError("GET secrets/pw: 403 forbidden", 403, "Forbidden")


BODY = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "deletionTimestamp": "2026-11-30T00:00:00Z"},
        "spec": {"redis": {"external": {"url": "redis://r:6379", "passwordSecretRef": {"name": "pw"}}}}}


def test_a_refused_api_call_is_retried_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "Kube", ForbiddenKube)
    warned: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, **kw: warned.append(kw))
    memo = kopf.Memo()
    memo[handlers._KUBE] = ForbiddenKube()  # noqa: SLF001
    body = kopf.Body(BODY)
    log = logging.getLogger("test")
    with pytest.raises(kopf.TemporaryError):  # a later attempt may be allowed
        handlers.on_delete(body=body, memo=memo, retry=0, logger=log)
    assert warned == []
    last = handlers.SETTINGS.reconcile.purge_retries - 1
    handlers.on_delete(body=body, memo=memo, retry=last, logger=log)  # returns: the finalizer goes
    assert [w["reason"] for w in warned] == ["IndexNotPurged"] and "403" in warned[0]["message"]
