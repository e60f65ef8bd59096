"""A pool's deletion (the finalizer): drain the sidecars, then purge the index, within bounds.

The pool's children stay while its finalizer runs (garbage collection waits for the pool
itself to go), so without a drain the sidecars would live on after the purge and publish
their blocks again. In order:

1. **Drain.** The sidecar DaemonSet is deleted with foreground propagation: it stays,
   with a deletionTimestamp, until the garbage collector has removed its pods. The
   finalizer waits for it to be gone, polling every ``drain_poll_s``, at most until
   ``drain_timeout_s`` after it first ran. Not gone by then (a kubelet that does not
   answer, no garbage collector), or the API refuses us: a log line and a Warning Event
   ``SidecarsNotDrained``, and the purge runs anyway.
2. **Purge.** Every ``kvp:<pool>:*`` key is deleted. A failure (Redis unreachable, its
   password Secret unreadable) is retried with backoff until ``purge_retries`` attempts
   or ``purge_deadline_s`` after the finalizer first ran, whichever comes first; then a
   log line and a Warning Event ``IndexNotPurged``, and the pool goes (its keys expire
   or stay; ``kvpool status`` shows them). So a pool whose Redis is unreachable is gone
   within ``purge_deadline_s`` plus one attempt (about three Redis timeouts).

The managed Redis and the Secrets stay until the pool is gone (the purge needs them);
then garbage collection removes them with the other children.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_operator.errors import IndexUnavailableError, InvalidSpecError, KubernetesApiError, TemporaryOperatorError
from kvpool_operator.kube import Kube
from kvpool_operator.manifests import names
from kvpool_operator.preflight import PoolRef, owned_by
from kvpool_operator.reconcile import purge_index
from kvpool_operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], None]


@dataclass(frozen=True)
class Outcome:
    """What one run of the finalizer decided."""

    #: None: done, the pool may go; else run again after this many seconds.
    retry_in: float | None
    #: For the log (and the retry's reason).
    message: str
    #: Warning Events to post on the pool: (reason, message).
    warnings: tuple[tuple[str, str], ...] = ()


def drain_sidecars(kube: Kube, pool: PoolRef, budget_s: float, *, poll_s: float, clock: Clock = time.monotonic,
                   sleep: Sleep = time.sleep) -> bool:
    """Delete the pool's sidecar DaemonSet (foreground) and wait until it is gone.

    True when it is gone (or was never there, or is not this pool's); False when it is
    still there after ``budget_s`` seconds (no wait at all when the budget is spent).
    """
    name = names(pool.name).sidecar
    deadline = clock() + max(0.0, budget_s)
    deleted = False
    while True:
        current = kube.get("apps/v1", "DaemonSet", pool.namespace, name)
        if current is None or not owned_by(current, pool.uid):
            return True
        meta = current.get("metadata") or {}
        if not deleted and not meta.get("deletionTimestamp"):
            logger.info("pool %s/%s: deleting DaemonSet %s and waiting for its pods before the purge",
                        pool.namespace, pool.name, name)
            kube.delete("apps/v1", "DaemonSet", pool.namespace, name, uid=meta.get("uid"), foreground=True)
            deleted = True
            continue
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        sleep(min(poll_s, remaining))


def finalize(body: Mapping[str, Any], *, kube: Kube, settings: OperatorSettings, retry: int, elapsed_s: float,
             clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> Outcome:
    """One run of the finalizer; ``elapsed_s``: seconds since its first run (kopf's runtime)."""
    r = settings.reconcile
    pool = PoolRef.from_body(body)
    started = clock()
    warnings: list[tuple[str, str]] = []
    drain_budget = r.drain_timeout_s - elapsed_s
    try:
        drained = drain_sidecars(kube, pool, drain_budget, poll_s=r.drain_poll_s, clock=clock, sleep=sleep)
        why = "its DaemonSet {!r} was still there after {:.0f}s".format(names(pool.name).sidecar, r.drain_timeout_s)
    except (TemporaryOperatorError, KubernetesApiError) as e:  # e.g. 403: the namespace is being torn down
        drained, why = False, "the API server refused: {}".format(e)
    if not drained and drain_budget > 0:  # told once: on the run whose wait ran out
        message = "purging the index while sidecars may still run ({}); they may publish again".format(why)
        logger.warning("pool %s/%s: %s", pool.namespace, pool.name, message)
        warnings.append(("SidecarsNotDrained", message))
    try:
        removed = purge_index(body, kube=kube, settings=settings)
    except InvalidSpecError as e:  # nothing to connect to: nothing to purge
        return Outcome(None, "not purging the index of an invalid pool: {}".format(e), tuple(warnings))
    except (IndexUnavailableError, TemporaryOperatorError, KubernetesApiError) as e:
        spent = elapsed_s + (clock() - started)
        left = r.purge_deadline_s - spent
        attempts = retry + 1
        if attempts >= r.purge_retries or left <= 0:
            message = ("gave up purging the pool's index keys after {:.0f}s and {} attempt(s): {}; its keys may "
                       "remain in Redis").format(spent, attempts, e)
            logger.warning("pool %s/%s: %s", pool.namespace, pool.name, message)
            return Outcome(None, message, (*warnings, ("IndexNotPurged", message)))
        return Outcome(min(settings.backoff(retry), left), "purging the index failed: {}".format(e), tuple(warnings))
    return Outcome(None, "purged {} index keys".format(removed), tuple(warnings))
