"""kopf handlers: decorators only; each one calls the reconcile (or the purge).

Run with ``python -m kvpool_operator`` or ``kopf run -m kvpool_operator.handlers``.
Handlers are synchronous: kopf runs them in its thread pool, and the Kubernetes and
Redis clients they use are synchronous. A reconcile that refuses a spec (``InvalidSpec``)
also posts a Warning Event on the pool, once per distinct refusal (``kubectl describe kvp``).

kopf runs a pool's timer beside its create/update/resume handlers, so two reconciles of
one pool could overlap: they are serialized per pool here (one lock per pool uid). Two
operator processes (a rollout's old and new pod) are kept apart by the API server
instead: generated Secrets are written under a precondition (:mod:`preflight`).

What this process applied is remembered (:data:`APPLIED`, :mod:`applied`) so that a reconcile
writes no child that provably has not changed; a pool's records go when its finalizer is done.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Mapping
from typing import Any

import kopf

from kvpool_operator.applied import AppliedChildren
from kvpool_operator.deletion import finalize
from kvpool_operator.errors import TemporaryOperatorError
from kvpool_operator.kube import Kube
from kvpool_operator.manifests import GROUP, VERSION
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.status import invalid_spec_event, merge_patch

PLURAL = "kvcachepools"
FINALIZER = "kvpool.io/index-cleanup"
SETTINGS = OperatorSettings.from_env()
#: What this process applied to every pool's children (see :mod:`kvpool_operator.applied`).
APPLIED = AppliedChildren(SETTINGS.reconcile.resync_s)
_KUBE = "kvpool_kube"
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _pool_lock(body: kopf.Body) -> threading.Lock:
    """The lock that serializes the reconciles of one pool (by uid) in this process."""
    uid = str(body.metadata.get("uid") or "")
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(uid, threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's persistence in kvpool.io annotations, our finalizer name, the API client."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # The CRD is installed before the operator and namespaces are given explicitly (or all),
    # so nothing needs discovering: no cluster-scoped reads of CRDs or namespaces.
    settings.scanning.disabled = True
    memo[_KUBE] = Kube.from_environment(field_manager=SETTINGS.reconcile.field_manager,
                                        timeout_s=SETTINGS.reconcile.api_timeout_s)


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    kube = memo.get(_KUBE)
    if isinstance(kube, Kube):
        kube.close()


def _kube(memo: kopf.Memo) -> Kube:
    kube = memo.get(_KUBE)
    if not isinstance(kube, Kube):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return kube


def _run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int) -> None:
    if body.metadata.get("deletionTimestamp"):
        return  # being deleted: the finalizer's turn; children go by garbage collection
    try:
        with _pool_lock(body):
            status = reconcile(body, kube=_kube(memo), settings=SETTINGS, applied=APPLIED)
    except TemporaryOperatorError as e:
        raise kopf.TemporaryError(str(e), delay=SETTINGS.backoff(retry)) from e
    raw = body.get("status")
    previous = raw if isinstance(raw, Mapping) else None
    refused = invalid_spec_event(previous, status)
    if refused is not None:
        kopf.warn(body, reason="InvalidSpec", message=refused)
    changes = merge_patch(previous, status)
    if changes:
        patch.status.update(changes)


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int, **_: Any) -> None:
    _run(body, patch, memo, retry)


@kopf.on.update(GROUP, VERSION, PLURAL)
def on_update(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int, **_: Any) -> None:
    _run(body, patch, memo, retry)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int, **_: Any) -> None:
    _run(body, patch, memo, retry)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.reconcile.timer_interval_s,
            initial_delay=SETTINGS.reconcile.timer_initial_delay_s)
def on_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    _run(body, patch, memo, 0)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(body: kopf.Body, memo: kopf.Memo, retry: int, runtime: datetime.timedelta,
              logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any) -> None:
    """Finalizer: drain the sidecars, then purge the pool's index keys, within bounds.

    See :mod:`kvpool_operator.deletion`: the pool's deletion never hangs on the finalizer
    (an unreachable Redis, a refused API call while the namespace is being torn down).
    """
    outcome = finalize(body, kube=_kube(memo), settings=SETTINGS, retry=retry, elapsed_s=runtime.total_seconds())
    if outcome.retry_in is None:
        uid = str(body.metadata.get("uid") or "")
        with _LOCKS_GUARD:
            _LOCKS.pop(uid, None)
        APPLIED.forget(uid)
    for reason, message in outcome.warnings:
        kopf.warn(body, reason=reason, message=message)
    if outcome.retry_in is not None:
        raise kopf.TemporaryError(outcome.message, delay=outcome.retry_in)
    logger.info("%s", outcome.message)
