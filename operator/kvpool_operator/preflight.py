"""What a reconcile checks before it writes anything: reads only, never a write.

Every check that can refuse a pool's spec lives here (or in :func:`spec.spec_problems`
and :func:`admission.policy_problems`, which need no reads), so that the reconcile can
decide "all or nothing" before its first write: a Secret the spec names that is missing,
too short or does not let the pool use it (:data:`POOLS_ANNOTATION`), a child's name held
by an object this pool does not own. The generated secrets (peer token, managed Redis
password) are read here too: existing ones are kept, missing ones made up in memory
and written only if the whole spec passes. These Secrets are written under a
precondition (:attr:`Secrets.held`): created only if still absent, replaced only if still
the version read here, left alone when nothing in them would change, so that two
reconciles racing (a timer and an update, two operator replicas during a rollout) never
overwrite each other's password: the loser's write is refused (409) and it retries with
the winner's.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from redis.connection import parse_url

from kvpool_operator.kube import Kube
from kvpool_operator.manifests import (
    REDIS_PASSWORD_KEY,
    TOKEN_KEY,
    ChildKey,
    Manifest,
    child_key,
    names,
    usable_redis_password,
)
from kvpool_operator.spec import PoolSpec

logger = logging.getLogger(__name__)
#: The sidecar refuses shorter peer and tenant tokens.
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


@dataclass(frozen=True)
class Secrets:
    """The pool's secrets as the reconcile would write them, and what is wrong."""

    problems: tuple[str, ...]
    #: The generated peer token (kept when the pool's Secret has one); None with spec.auth.
    token: str | None
    #: The managed Redis's password (kept when stored); None with an external Redis or
    #: when a Secret the pool does not own holds the name.
    redis_password: str | None
    #: Whether ``redis_password`` is the one stored in the pool's Secret (not made up now).
    redis_password_stored: bool
    #: The Secrets of generated values (peer token, managed Redis password) by name, as
    #: read here: None when absent (create it, never overwrite).
    held: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs)


def owned_secret_text(kube: Kube, pool: PoolRef, name: str, key: str) -> str | None:
    """One value of the pool's own Secret ``name`` (owned by the pool); None when missing,
    empty, unreadable, or the Secret is another's."""
    secret = kube.get("v1", "Secret", pool.namespace, name)
    return _secret_text(secret, key) if secret is not None and owned_by(secret, pool.uid) else None


def _secret_text(secret: Mapping[str, Any], key: str) -> str | None:
    """One value of a Secret as text; None when missing, empty or unreadable."""
    raw = (secret.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        return base64.b64decode(raw).decode() or None
    except (binascii.Error, UnicodeDecodeError):
        return None  # unreadable: generate a new one


def _peer_token(kube: Kube, spec: PoolSpec, pool: PoolRef, held: dict[str, Mapping[str, Any] | None]) -> str:
    """The pool's generated peer token: the stored one, else a new one."""
    name = names(spec.name).auth
    secret = held[name] = kube.get("v1", "Secret", spec.namespace, name)
    if secret is not None and owned_by(secret, pool.uid):
        token = _secret_text(secret, TOKEN_KEY)
        if token is not None:
            return token
    return secrets.token_urlsafe(32)


def _managed_redis_password(kube: Kube, spec: PoolSpec, pool: PoolRef,
                            held: dict[str, Mapping[str, Any] | None]) -> tuple[str | None, bool, str | None]:
    """(password, stored, problem) of the managed Redis.

    The password in the pool's Secret; generated only when there is none (or it cannot be
    used), so a reconcile never changes the password of a running Redis. None, with a
    problem, when a Secret the pool does not own holds the name.
    """
    name = names(spec.name).redis
    secret = held[name] = kube.get("v1", "Secret", pool.namespace, name)
    if secret is not None and not owned_by(secret, pool.uid):
        return None, False, "Secret {!r} already exists and does not belong to this pool; rename or delete it".format(
            name)
    existing = _secret_text(secret, REDIS_PASSWORD_KEY) if secret is not None else None
    if existing is not None and usable_redis_password(existing):
        return existing, True, None
    if existing is not None:
        logger.warning("pool %s/%s: the password in Secret %s cannot be used in redis.conf; generating a new one",
                       pool.namespace, pool.name, name)
    return secrets.token_urlsafe(32), False, None


#: The annotation by which a Secret's owner lets pools of its namespace use it: the pools'
#: names, comma-separated, or ``*`` for every pool of the namespace. A pool's sidecars run
#: the image its creator names and get every Secret it names mounted, so without the
#: Secret's consent anyone who may create a pool could read any Secret of the namespace.
POOLS_ANNOTATION = "kvpool.io/pools"
#: The annotation by which a Secret's owner lets pools send its value, as an external
#: Redis's password, to the hosts it lists (``host:port``, comma-separated).
REDIS_HOSTS_ANNOTATION = "kvpool.io/redis-hosts"


def _annotation(secret: Mapping[str, Any], name: str) -> str:
    return str(((secret.get("metadata") or {}).get("annotations") or {}).get(name) or "")


def secret_use_problem(secret: Mapping[str, Any], pool: PoolRef, name: str, field: str) -> str | None:
    """A problem when the pool may not use the Secret it names in ``field``.

    A Secret owned by another KVCachePool (its generated peer token or Redis password) is
    never used; one owned by this pool always may be; any other only when its
    :data:`POOLS_ANNOTATION` names this pool (or is ``*``).
    """
    refs = [r for r in (secret.get("metadata") or {}).get("ownerReferences") or () if isinstance(r, Mapping)]
    for ref in refs:
        if (ref.get("kind") == "KVCachePool" and str(ref.get("apiVersion") or "").startswith("kvpool.io/")
                and ref.get("uid") != pool.uid):
            return "{}: Secret {!r} belongs to KVCachePool {!r}; a pool never uses another pool's Secret".format(
                field, name, ref.get("name"))
    if any(ref.get("uid") == pool.uid for ref in refs):
        return None
    allowed = {p.strip() for p in _annotation(secret, POOLS_ANNOTATION).split(",") if p.strip()}
    if "*" in allowed or pool.name in allowed:
        return None
    return ("{}: Secret {!r} does not let this pool use it: the pool's sidecars (which run the image the pool "
            "names) would get it mounted. If they may, annotate the Secret {}={} (a comma-separated list of pools "
            "of namespace {!r}, or '*' for all of them)".format(field, name, POOLS_ANNOTATION, pool.name,
                                                                pool.namespace))


def check_token_secret(kube: Kube, pool: PoolRef, name: str, key: str, field: str) -> str | None:
    """A problem message when a token Secret is missing, does not let the pool use it
    (:func:`secret_use_problem`), or lacks the key or a long enough token."""
    secret = kube.get("v1", "Secret", pool.namespace, name)
    if secret is None:
        return "{}: Secret {!r} not found in namespace {!r}".format(field, name, pool.namespace)
    refused = secret_use_problem(secret, pool, name, field)
    if refused is not None:
        return refused
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


def _host_port(netloc: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host[:port]`` (Redis's 6379 by default); None when it does not parse."""
    try:
        parts = urlsplit("//" + netloc.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host.lower(), port or 6379) if host else None


def password_destination_problem(secret: Mapping[str, Any], spec: PoolSpec) -> str | None:
    """A problem when the external Redis's password Secret does not let its value go to the
    spec's Redis: a Secret names, in its :data:`REDIS_HOSTS_ANNOTATION`, the ``host:port``
    its value may be sent to. Without the check, a pool the Secret lets use it (or the
    operator, reading it for that pool) could send it to a Redis of the pool creator's own:
    the operator and every sidecar send it in its ``AUTH``."""
    ext = spec.external_redis
    if ext is None or ext.password is None:
        return None
    allowed = _annotation(secret, REDIS_HOSTS_ANNOTATION)
    try:  # where redis-py will connect: the URL as the client reads it (query options included)
        parsed = parse_url(ext.url)  # type: ignore[no-untyped-call]
        dest: tuple[str, int] | None = (str(parsed.get("host") or "").lower(), int(parsed.get("port") or 6379))
    except ValueError:
        dest = None
    if dest is not None and dest[0] and dest in {_host_port(h) for h in allowed.split(",") if h.strip()}:
        return None
    return ("spec.redis.external.passwordSecretRef: Secret {!r} does not let its value be sent to {}:{} "
            "(annotate the Secret {}={}:{})".format(ext.password.name, *(dest or ("?", 0)),
                                                     REDIS_HOSTS_ANNOTATION, *(dest or ("?", 0))))


def external_password(kube: Kube, spec: PoolSpec, pool: PoolRef) -> tuple[str | None, str | None]:
    """The external Redis's password and a problem: ``(None, problem)`` when its Secret is
    missing, does not let the pool use it (:func:`secret_use_problem`) or does not let its
    value go to the spec's Redis (:func:`password_destination_problem`)."""
    ext = spec.external_redis
    if ext is None or ext.password is None:
        return None, None
    secret = kube.get("v1", "Secret", spec.namespace, ext.password.name)
    if secret is None:
        return None, missing_password_problem(spec)
    problem = (secret_use_problem(secret, pool, ext.password.name, "spec.redis.external.passwordSecretRef")
               or password_destination_problem(secret, spec))
    if problem is not None:
        return None, problem
    raw = (secret.get("data") or {}).get(ext.password.key)
    try:
        password = base64.b64decode(raw).decode() if raw is not None else None
    except (binascii.Error, UnicodeDecodeError):
        password = None
    return password, None if password is not None else missing_password_problem(spec)


def missing_password_problem(spec: PoolSpec) -> str | None:
    """The message for an external Redis password Secret (or key) that is not there."""
    ref = spec.external_redis.password if spec.external_redis is not None else None
    if ref is None:
        return None
    return "spec.redis.external.passwordSecretRef: Secret {!r} key {!r} not found".format(ref.name, ref.key)


def check_secrets(kube: Kube, spec: PoolSpec, pool: PoolRef) -> Secrets:
    """Read every Secret the pool uses or generates; nothing is written."""
    problems: list[str] = []
    held: dict[str, Mapping[str, Any] | None] = {}
    token: str | None = None
    if spec.auth is None:
        token = _peer_token(kube, spec, pool, held)
    else:
        problem = check_token_secret(kube, pool, spec.auth.name, spec.auth.key, "spec.auth.secretRef")
        if problem:
            problems.append(problem)
    for i, tenant in enumerate(spec.tenants):
        if tenant.token_secret is not None:
            problem = check_token_secret(kube, pool, tenant.token_secret.name, tenant.token_secret.key,
                                         "spec.tenants[{}].tokenSecret".format(i))
            if problem:
                problems.append(problem)
    _, problem = external_password(kube, spec, pool)
    if problem is not None:
        problems.append(problem)
    redis_password: str | None = None
    stored = False
    if spec.managed_redis is not None:
        redis_password, stored, taken = _managed_redis_password(kube, spec, pool, held)
        if taken:
            problems.append(taken)
    return Secrets(tuple(problems), token, redis_password, stored, held)


def read_children(kube: Kube, pool: PoolRef, children: Iterable[Manifest],
                  secrets_read: Mapping[str, Mapping[str, Any] | None] | None = None
                  ) -> tuple[dict[ChildKey, Mapping[str, Any] | None], list[str]]:
    """Every child as stored (None when absent), and a problem for each child whose name an
    object this pool does not own already holds. ``secrets_read``: Secrets this reconcile has
    read already, by name (:attr:`Secrets.held`): not read again. The reconcile also decides
    from these reads which children it need not write (:mod:`applied`)."""
    stored: dict[ChildKey, Mapping[str, Any] | None] = {}
    problems = []
    for child in children:
        meta = child["metadata"]
        if child["kind"] == "Secret" and secrets_read is not None and meta["name"] in secrets_read:
            current = secrets_read[meta["name"]]
        else:
            current = kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        stored[child_key(child)] = current
        if current is not None and not owned_by(current, pool.uid):
            problems.append("{} {!r} already exists and does not belong to this pool; rename or delete it".format(
                child["kind"], meta["name"]))
    return stored, problems
