"""One level-based, idempotent reconcile: desired children vs observed, then the status.

Called alike on create, update, resume and by the timer; running it twice in a row
changes nothing the second time (server-side apply of the same objects, the generated
token kept). It raises only temporary errors (the handler retries them with backoff);
anything that retrying cannot fix becomes a message in the Ready/Degraded conditions.

Never half-applied, as far as the API allows:

1. Every check that can refuse the spec runs first, with reads only (:mod:`preflight`):
   the spec's own shape and combinations, the Secrets it names, child names held by
   objects this pool does not own. Any problem: nothing is written, every existing child
   stays exactly as it was, and the status says why (``InvalidSpec``).
2. The API server then validates every child without storing it (server-side apply with
   ``dryRun=All``: schema, immutable fields, admission). A refusal (e.g. 422 for a
   StatefulSet field that cannot change): nothing is written either.
3. Only then are the children applied, in :func:`manifests.build_children`'s order (what
   the others depend on first: ConfigMap, Secrets, NetworkPolicies, Services, the managed
   Redis, the DaemonSet last). If one is still refused (a race, a webhook, a quota), the
   reconcile stops there: the children after it are not applied and keep their previous
   spec, stale children are not removed, and the status names the refused child and
   those not applied (``InvalidSpec``); the next reconcile tries again.

A child that provably has not changed since the operator applied it (the same manifest, and
the very object it wrote at the version the API server returned, wanted metadata in place:
:mod:`applied`) is left out of steps 2 and 3: it is neither dry-run nor written. So a
reconcile in which nothing changed reads the children and writes nothing; the dry run still
covers everything that will be written. Every child is dry-run and applied anyway once
``resync_s`` has passed since it last was, and any edit of a child (by anyone), its deletion
or a change of what the operator wants of it applies it again as above.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import kopf

from kvpool_operator import index as redis_index
from kvpool_operator.admission import policy_problems
from kvpool_operator.applied import AppliedChildren, carries_metadata
from kvpool_operator.errors import IndexUnavailableError, InvalidSpecError, KubernetesApiError, TemporaryApiError
from kvpool_operator.kube import Kube
from kvpool_operator.manifests import (
    ChildKey,
    Manifest,
    build_children,
    child_key,
    names,
    possible_children,
    redis_password_ref,
    redis_url,
)
from kvpool_operator.preflight import (PoolRef, check_secrets, external_password, owned_by, owned_secret_text,
                                      read_children)
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.spec import PoolSpec, host_path_problems, parse_spec, spec_problems
from kvpool_operator.status import Observation, build_status, pool_figures

logger = logging.getLogger(__name__)

__all__ = ["PoolRef", "apply_children", "observe_index", "purge_index", "reconcile", "remove_stale_children"]


def _cluster(spec: PoolSpec) -> bool:
    return spec.external_redis is not None and spec.external_redis.cluster


def _label(child: Manifest) -> str:
    return "{} {!r}".format(child["kind"], child["metadata"]["name"])


#: What a Secret of a generated value holds that the reconcile writes.
_SECRET_FIELDS = ("data", "type")


def _unchanged(child: Manifest, stored: Mapping[str, Any]) -> bool:
    """Whether a generated Secret holds what the reconcile would write. Its wanted labels,
    annotations and owner references must be there, where others may be too
    (:func:`applied.carries_metadata`): labels an older operator copied from its pool when it
    created the Secret, which this one's applies never remove, or another controller's owner
    reference (compared whole, they made it apply the Secret on every reconcile)."""
    return all(child.get(f) == stored.get(f) for f in _SECRET_FIELDS) and carries_metadata(child, stored)


def _write(kube: Kube, child: Manifest, held: Mapping[str, Mapping[str, Any] | None], *, dry_run: bool = False
           ) -> dict[str, Any] | None:
    """Apply one child; a Secret of a generated value (:attr:`preflight.Secrets.held`) only
    under a precondition: created if it was absent, left alone if nothing in it changes,
    else applied at the version read. Another reconcile's write in between: a
    TemporaryApiError (409). None when nothing was written."""
    name = child["metadata"]["name"]
    if child["kind"] != "Secret" or name not in held:
        return kube.apply(child, dry_run=dry_run)
    stored = held[name]
    if stored is None:
        return kube.create(child, dry_run=dry_run)
    if _unchanged(child, stored):
        return None
    version = (stored.get("metadata") or {}).get("resourceVersion")
    if version:
        child = {**child, "metadata": {**child["metadata"], "resourceVersion": version}}
    return kube.apply(child, dry_run=dry_run)


def _generated(child: Manifest, held: Mapping[str, Mapping[str, Any] | None]) -> bool:
    return child["kind"] == "Secret" and child["metadata"]["name"] in held


def apply_children(kube: Kube, children: list[Manifest],
                   held: Mapping[str, Mapping[str, Any] | None] | None = None, *,
                   applied: AppliedChildren | None = None, pool_uid: str = "",
                   stored: Mapping[ChildKey, Mapping[str, Any] | None] | None = None
                   ) -> tuple[str | None, dict[str, Any] | None]:
    """Validate every child to write with a dry run, then apply them in order; (problem, DaemonSet).

    ``problem`` is None when all were applied. On a refusal in the dry run nothing is
    written; on one in the real apply the children after the refused one are not
    applied (see the module's docstring). Temporary errors and 401/403 (the operator may
    not act: not this child's fault) are raised. ``held``: the Secrets written only under
    a precondition (see :func:`_write`). ``applied``: the records of what this process
    applied, of pool ``pool_uid``; a child they show unchanged from ``stored`` (the children
    as read in this reconcile, by :func:`manifests.child_key`) is left alone, neither dry-run
    nor applied. The DaemonSet returned is the one stored then, or the apply's answer.
    """
    held = held or {}
    stored = stored or {}
    daemonset: dict[str, Any] | None = None
    todo: list[Manifest] = []
    for child in children:
        current = stored.get(child_key(child))
        if (applied is not None and not _generated(child, held)
                and applied.unchanged(pool_uid, child, current)):
            if child["kind"] == "DaemonSet" and current is not None:
                daemonset = dict(current)
        else:
            todo.append(child)
    if len(todo) < len(children):
        logger.debug("%d of %d children unchanged since applied: not written", len(children) - len(todo),
                     len(children))
    children = todo
    for child in children:
        try:
            _write(kube, child, held, dry_run=True)
        except TemporaryApiError:
            raise
        except KubernetesApiError as e:  # rejected: e.g. an affinity the API server refuses
            if e.status in (401, 403):
                raise
            return "{} was rejected by the API server: {}; no child was changed".format(_label(child), e), None
    for i, child in enumerate(children):
        try:
            answer = _write(kube, child, held)
        except TemporaryApiError:
            raise
        except KubernetesApiError as e:
            if e.status in (401, 403):
                raise
            rest = ", ".join(_label(c) for c in children[i + 1:]) or "none"
            return "{} was rejected by the API server: {}; not applied after it: {}".format(
                _label(child), e, rest), None
        if applied is not None and answer is not None and not _generated(child, held):
            applied.remember(pool_uid, child, answer)
        if child["kind"] == "DaemonSet":
            daemonset = answer
    return None, daemonset


def remove_stale_children(kube: Kube, pool: PoolRef, children: list[Manifest]) -> None:
    """Delete children this pool owns but no longer wants (e.g. managed Redis after a switch)."""
    wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children}
    for api_version, kind, name in possible_children(pool.name):
        if (api_version, kind, name) in wanted:
            continue
        current = kube.get(api_version, kind, pool.namespace, name)
        if current is not None and owned_by(current, pool.uid):
            logger.info("deleting %s %s/%s: no longer part of the pool", kind, pool.namespace, name)
            kube.delete(api_version, kind, pool.namespace, name, uid=current["metadata"].get("uid"))


#: What the status says of any failure to use an external Redis (the log has the details).
UNAVAILABLE_EXTERNAL = ("cannot use the Redis at {}: it could not be reached, or did not answer as a Redis this "
                        "pool can use (the operator's log has the details)")


def _public(error: IndexUnavailableError, spec: PoolSpec, pool: PoolRef) -> IndexUnavailableError:
    """The error as the pool's status and Events may show it.

    An external Redis's URL is the pool creator's choice, so what the operator met there
    (a refused connection, a name that did not resolve, a timeout, something that is no
    Redis) would tell them from where the operator stands which hosts and ports answer:
    one message and one reason for all of it; the log has the details. The managed Redis's
    errors are shown as they are.
    """
    if spec.external_redis is None:
        return error
    logger.warning("pool %s/%s: the external Redis is unavailable (%s): %s", pool.namespace, pool.name,
                   error.reason, error)
    return IndexUnavailableError(UNAVAILABLE_EXTERNAL.format(redis_index.redact(spec.external_redis.url)),
                                 "Unreachable")


def observe_index(spec: PoolSpec, pool: PoolRef, kube: Kube, settings: OperatorSettings,
                  managed_password: str | None = None) -> tuple[Observation, str | None]:
    """Read the index; returns a partial observation (figures or error) and a password problem.

    ``managed_password``: the managed Redis's, when the caller has it at hand (else it is
    read from the pool's Secret). The error of an external Redis is one generic message
    (:func:`_public`).
    """
    url = redis_url(spec)
    password = managed_password
    problem: str | None = None
    ref = redis_password_ref(spec)
    if password is None and ref is not None:
        if spec.external_redis is not None:
            password, problem = external_password(kube, spec, pool)
        else:
            password = owned_secret_text(kube, pool, *ref)  # (the pool's own: as the purge, see there)
            problem = None if password is not None else "spec.redis.managed: Secret {!r} key {!r} not found".format(
                *ref)
        if problem is not None:
            return Observation(0, spec.pool_id, url, index_error=problem, index_reason="MissingSecret"), problem
    try:
        with redis_index.connect(url, password, timeout_s=settings.index.timeout_s,
                                 cluster=_cluster(spec)) as client:
            snapshot = redis_index.read_snapshot(client, spec.pool_id, url)
    except IndexUnavailableError as e:
        shown = _public(e, spec, pool)
        return Observation(0, spec.pool_id, url, index_error=str(shown), index_reason=shown.reason), None
    return Observation(0, spec.pool_id, url, figures=pool_figures(snapshot.live)), None


def reconcile(body: Mapping[str, Any], *, kube: Kube, settings: OperatorSettings,
              now: datetime | None = None, applied: AppliedChildren | None = None) -> dict[str, Any]:
    """Bring the pool's children in line with its spec; return the new ``status``.

    ``applied``: what this process applied before (:mod:`applied`), to leave alone the
    children that provably have not changed since; None: every child is applied.

    Raises TemporaryApiError when the API server could not be reached or refused for a
    reason that may pass (the caller retries with backoff). A refusal for good (e.g. 403:
    the operator's RBAC lacks a permission) stops the reconcile and becomes the Ready and
    Degraded conditions (``ApiRefused``); the timer tries again.
    """
    pool = PoolRef.from_body(body)
    spec_raw = body.get("spec") or {}
    previous_status = body.get("status") or {}
    now = now or datetime.now(timezone.utc)
    try:
        spec = parse_spec(pool.name, pool.namespace, spec_raw)
    except InvalidSpecError as e:
        obs = Observation(pool.generation, "{}.{}".format(pool.namespace, pool.name), "", problems=[str(e)],
                          index_error="not checked: the spec is invalid", index_reason="InvalidSpec")
        return build_status(obs, previous_status, now)
    try:
        return _reconcile_valid(body, pool, spec, kube, settings, previous_status, now, applied)
    except TemporaryApiError:
        raise
    except KubernetesApiError as e:
        logger.warning("pool %s/%s: the API server refused a request: %s", pool.namespace, pool.name, e)
        obs = Observation(pool.generation, spec.pool_id, redis_url(spec), problems=tuple(spec_problems(spec)),
                          index_error="not checked: the API server refused a request", index_reason="ApiRefused",
                          api_error="the API server refused a request: {}".format(e), socket_path=spec.socket_path)
        return build_status(obs, previous_status, now)


def _reconcile_valid(body: Mapping[str, Any], pool: PoolRef, spec: PoolSpec, kube: Kube,
                     settings: OperatorSettings, previous_status: Mapping[str, Any],
                     now: datetime, applied: AppliedChildren | None) -> dict[str, Any]:
    # 1. Everything that can refuse the spec, with reads only.
    problems = (spec_problems(spec) + host_path_problems(spec, settings.host_path_roots)
                + policy_problems(spec, settings.pool_policy, settings.images.sidecar))
    found = check_secrets(kube, spec, pool)
    problems.extend(found.problems)
    children = build_children(spec, token=found.token, sidecar_image=settings.images.sidecar,
                              redis_image=settings.images.redis, redis_password=found.redis_password,
                              operator_namespace=settings.index.operator_namespace or None)
    stored, foreign = read_children(kube, pool, children, found.held)
    problems.extend(foreign)
    daemonset: dict[str, Any] | None = None
    if problems:
        logger.warning("pool %s/%s: not applying an invalid spec: %s", pool.namespace, pool.name,
                       "; ".join(problems))
        # Nothing written: the status shows the children as they are.
        current = stored.get(("apps/v1", "DaemonSet", names(pool.name).sidecar))
        daemonset = dict(current) if current is not None and owned_by(current, pool.uid) else None
    else:
        # 2 and 3: the API server's dry run of every child to write, then the applies.
        # Owner references only: kopf.adopt would also copy the pool's labels onto every
        # child, Secrets included (a label that a replicator acts on, say). The children
        # are found by name and owner uid (possible_children, owned_by), and carry the
        # operator's own labels (manifests.labels).
        kopf.append_owner_reference(children, owner=body)  # type: ignore[arg-type]
        rejected, daemonset = apply_children(kube, children, found.held, applied=applied, pool_uid=pool.uid,
                                             stored=stored)
        if rejected is None:
            remove_stale_children(kube, pool, children)
            if applied is not None:
                applied.keep_only(pool.uid, (child_key(c) for c in children))
        else:
            logger.warning("pool %s/%s: %s", pool.namespace, pool.name, rejected)
            problems.append(rejected)
    if spec.managed_redis is not None and not found.redis_password_stored and problems:
        index_obs = Observation(0, spec.pool_id, redis_url(spec), index_reason="InvalidSpec",
                                index_error="not checked: the managed Redis is not set up (the spec is invalid)")
    else:
        index_obs, password_problem = observe_index(spec, pool, kube, settings, found.redis_password)
        if password_problem and password_problem not in problems:
            problems.append(password_problem)
    ds_status = (daemonset or {}).get("status") or {}
    obs = Observation(
        generation=pool.generation,
        pool_id=spec.pool_id,
        index_url=index_obs.index_url,
        problems=tuple(problems),
        index_error=index_obs.index_error,
        index_reason=index_obs.index_reason,
        figures=index_obs.figures,
        desired=int(ds_status.get("desiredNumberScheduled") or 0),
        pods_ready=int(ds_status.get("numberReady") or 0),
        socket_path=spec.socket_path,
    )
    return build_status(obs, previous_status, now)


def purge_index(body: Mapping[str, Any], *, kube: Kube, settings: OperatorSettings) -> int:
    """The finalizer's work: delete the pool's ``kvp:<pool>:*`` keys. Raises IndexUnavailableError
    (for an external Redis, the generic one of :func:`_public`: the Events show it)."""
    pool = PoolRef.from_body(body)
    spec = parse_spec(pool.name, pool.namespace, body.get("spec") or {})
    url = redis_url(spec)
    ref = redis_password_ref(spec)
    password = None
    if spec.external_redis is not None:
        password, problem = external_password(kube, spec, pool)
        if problem is not None:
            raise IndexUnavailableError(problem, "MissingSecret")
    elif ref is not None:
        password = owned_secret_text(kube, pool, *ref)
        if password is None:
            # the pool's own Secret is gone, or was never the pool's (a Secret of that name
            # held by another refuses the pool): no managed Redis of this pool's ran, and
            # another's password goes to no one (it had gone to whatever answered at the
            # Service of that name)
            return 0
    try:
        with redis_index.connect(url, password, timeout_s=settings.index.timeout_s,
                                 cluster=_cluster(spec)) as client:
            return redis_index.purge(client, spec.pool_id, url)
    except IndexUnavailableError as e:
        raise _public(e, spec, pool) from e
