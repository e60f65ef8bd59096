"""One level-based, idempotent reconcile: desired children vs observed, then the status.

Called alike on create, update, resume and by the timer; running it twice in a row
changes nothing the second time (server-side apply of the same objects, the generated
token kept). It raises only temporary errors (the handler retries them with backoff);
anything that retrying cannot fix becomes a message in the Ready/Degraded conditions.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import kopf

from kvpool_operator import index as redis_index
from kvpool_operator.errors import IndexUnavailableError, InvalidSpecError, KubernetesApiError, TemporaryApiError
from kvpool_operator.kube import Kube
from kvpool_operator.manifests import (
    REDIS_PASSWORD_KEY,
    TOKEN_KEY,
    Manifest,
    build_children,
    names,
    possible_children,
    redis_password_ref,
    redis_url,
    usable_redis_password,
)
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.spec import PoolSpec, parse_spec, spec_problems
from kvpool_operator.status import Observation, build_status, pool_figures

logger = logging.getLogger(__name__)
#: The sidecar refuses shorter peer tokens.
MIN_TOKEN_BYTES = 16


@dataclass(frozen=True)
class PoolRef:
    """The few facts about the KVCachePool object a reconcile needs besides its spec."""

    name: str
    namespace: str
    uid: str
    generation: int

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolRef:
        meta = body.get("metadata") or {}
        return cls(name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")),
                   uid=str(meta.get("uid", "")), generation=int(meta.get("generation") or 0))


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs)


def _secret_text(secret: Mapping[str, Any], key: str) -> str | None:
    """One value of a Secret as text; None when missing, empty or unreadable."""
    raw = (secret.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        return base64.b64decode(raw).decode() or None
    except (binascii.Error, UnicodeDecodeError):
        return None  # unreadable: generate a new one


def _existing_token(kube: Kube, spec: PoolSpec, pool: PoolRef) -> str | None:
    secret = kube.get("v1", "Secret", spec.namespace, names(spec.name).auth)
    if secret is None or not _owned_by(secret, pool.uid):
        return None
    return _secret_text(secret, TOKEN_KEY)


def _managed_redis_password(kube: Kube, spec: PoolSpec, pool: PoolRef) -> tuple[str | None, str | None]:
    """(password, problem) of the managed Redis.

    The password in the pool's Secret; generated only when there is none (or it cannot be
    used), so a reconcile never changes the password of a running Redis. None, with a
    problem, when a Secret the pool does not own holds the name.
    """
    name = names(spec.name).redis
    secret = kube.get("v1", "Secret", pool.namespace, name)
    if secret is not None and not _owned_by(secret, pool.uid):
        return None, "Secret {!r} already exists and does not belong to this pool; rename or delete it".format(name)
    existing = _secret_text(secret, REDIS_PASSWORD_KEY) if secret is not None else None
    if existing is not None and usable_redis_password(existing):
        return existing, None
    if existing is not None:
        logger.warning("pool %s/%s: the password in Secret %s cannot be used in redis.conf; generating a new one",
                       pool.namespace, pool.name, name)
    return secrets.token_urlsafe(32), None


def _cluster(spec: PoolSpec) -> bool:
    return spec.external_redis is not None and spec.external_redis.cluster


def _check_token_secret(kube: Kube, namespace: str, name: str, key: str, field: str) -> str | None:
    """A problem message when the peer token Secret, its key or a long enough token is missing."""
    secret = kube.get("v1", "Secret", namespace, name)
    if secret is None:
        return "{}: Secret {!r} not found in namespace {!r}".format(field, name, namespace)
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        return "{}: Secret {!r} has no key {!r}".format(field, name, key)
    try:
        size = len(base64.b64decode(raw).strip())
    except binascii.Error:
        size = 0
    if size < MIN_TOKEN_BYTES:
        return "{}: the token in Secret {!r} key {!r} must be at least {} bytes".format(
            field, name, key, MIN_TOKEN_BYTES)
    return None


def apply_children(kube: Kube, body: Mapping[str, Any], pool: PoolRef, children: list[Manifest]) -> tuple[
        list[str], dict[str, Any] | None]:
    """Apply the children it may own; returns (problems, the applied DaemonSet)."""
    problems: list[str] = []
    daemonset: dict[str, Any] | None = None
    kopf.adopt(children, owner=body)  # type: ignore[arg-type]
    for child in children:
        meta = child["metadata"]
        current = kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        if current is not None and not _owned_by(current, pool.uid):
            problems.append("{} {!r} already exists and does not belong to this pool; rename or delete it".format(
                child["kind"], meta["name"]))
            continue
        try:
            applied = kube.apply(child)
        except TemporaryApiError:
            raise
        except KubernetesApiError as e:  # rejected: e.g. an affinity the API server refuses
            if e.status in (401, 403):
                raise  # not this child's fault: the operator may not act (ApiRefused)
            problems.append("{} {!r} was rejected by the API server: {}".format(child["kind"], meta["name"], e))
            continue
        if child["kind"] == "DaemonSet":
            daemonset = applied
    return problems, daemonset


def remove_stale_children(kube: Kube, pool: PoolRef, children: list[Manifest]) -> None:
    """Delete children this pool owns but no longer wants (e.g. managed Redis after a switch)."""
    wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children}
    for api_version, kind, name in possible_children(pool.name):
        if (api_version, kind, name) in wanted:
            continue
        current = kube.get(api_version, kind, pool.namespace, name)
        if current is not None and _owned_by(current, pool.uid):
            logger.info("deleting %s %s/%s: no longer part of the pool", kind, pool.namespace, name)
            kube.delete(api_version, kind, pool.namespace, name, uid=current["metadata"].get("uid"))


def observe_index(spec: PoolSpec, kube: Kube, settings: OperatorSettings,
                  managed_password: str | None = None) -> tuple[Observation, str | None]:
    """Read the index; returns a partial observation (figures or error) and a password problem.

    ``managed_password``: the managed Redis's, when the caller has it at hand (else it is
    read from the pool's Secret).
    """
    url = redis_url(spec)
    password = managed_password
    problem: str | None = None
    ref = redis_password_ref(spec)
    if password is None and ref is not None:
        password = kube.secret_value(spec.namespace, *ref)
        if password is None:
            field = "spec.redis.managed" if spec.managed_redis is not None else "spec.redis.external.passwordSecretRef"
            problem = "{}: Secret {!r} key {!r} not found".format(field, *ref)
            return Observation(0, spec.pool_id, url, index_error=problem, index_reason="MissingSecret"), problem
    try:
        with redis_index.connect(url, password, timeout_s=settings.index.timeout_s,
                                 cluster=_cluster(spec)) as client:
            snapshot = redis_index.read_snapshot(client, spec.pool_id, url)
    except IndexUnavailableError as e:
        return Observation(0, spec.pool_id, url, index_error=str(e), index_reason=e.reason), None
    return Observation(0, spec.pool_id, url, figures=pool_figures(snapshot.live)), None


def reconcile(body: Mapping[str, Any], *, kube: Kube, settings: OperatorSettings,
              now: datetime | None = None) -> dict[str, Any]:
    """Bring the pool's children in line with its spec; return the new ``status``.

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
        return _reconcile_valid(body, pool, spec, kube, settings, previous_status, now)
    except TemporaryApiError:
        raise
    except KubernetesApiError as e:
        logger.warning("pool %s/%s: the API server refused a request: %s", pool.namespace, pool.name, e)
        obs = Observation(pool.generation, spec.pool_id, redis_url(spec), problems=tuple(spec_problems(spec)),
                          index_error="not checked: the API server refused a request", index_reason="ApiRefused",
                          api_error="the API server refused a request: {}".format(e))
        return build_status(obs, previous_status, now)


def _reconcile_valid(body: Mapping[str, Any], pool: PoolRef, spec: PoolSpec, kube: Kube,
                     settings: OperatorSettings, previous_status: Mapping[str, Any],
                     now: datetime) -> dict[str, Any]:
    problems = spec_problems(spec)
    token: str | None = None
    if spec.auth is None:
        token = _existing_token(kube, spec, pool) or secrets.token_urlsafe(32)
    else:
        missing = _check_token_secret(kube, spec.namespace, spec.auth.name, spec.auth.key, "spec.auth.secretRef")
        if missing:
            problems.append(missing)
    redis_password: str | None = None
    if spec.managed_redis is not None:
        redis_password, taken = _managed_redis_password(kube, spec, pool)
        if taken:
            problems.append(taken)
    children = build_children(spec, token=token, sidecar_image=settings.images.sidecar,
                              redis_image=settings.images.redis, redis_password=redis_password,
                              operator_namespace=settings.index.operator_namespace or None)
    apply_problems, daemonset = apply_children(kube, body, pool, children)
    problems.extend(apply_problems)
    remove_stale_children(kube, pool, children)
    index_obs, password_problem = observe_index(spec, kube, settings, redis_password)
    if password_problem:
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
    )
    if problems:
        logger.warning("pool %s/%s: %s", pool.namespace, pool.name, "; ".join(problems))
    return build_status(obs, previous_status, now)


def purge_index(body: Mapping[str, Any], *, kube: Kube, settings: OperatorSettings) -> int:
    """The finalizer's work: delete the pool's ``kvp:<pool>:*`` keys. Raises IndexUnavailableError."""
    pool = PoolRef.from_body(body)
    spec = parse_spec(pool.name, pool.namespace, body.get("spec") or {})
    url = redis_url(spec)
    ref = redis_password_ref(spec)
    password = kube.secret_value(spec.namespace, *ref) if ref is not None else None
    with redis_index.connect(url, password, timeout_s=settings.index.timeout_s, cluster=_cluster(spec)) as client:
        return redis_index.purge(client, spec.pool_id, url)
