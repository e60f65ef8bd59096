"""The operator's settings: grouped, documented dataclasses read from ``KVPOOL_OPERATOR_*``.

This is the only module that reads the environment. Every variable is optional:

==================================  ======================================  ==============
variable                            meaning                                 default
==================================  ======================================  ==============
``KVPOOL_OPERATOR_NAMESPACES``      comma-separated namespaces to watch      all (cluster)
``KVPOOL_OPERATOR_TIMER_INTERVAL``  seconds between periodic reconciles      ``30``
``KVPOOL_OPERATOR_TIMER_DELAY``     seconds before a pool's first timer run  ``5``
``KVPOOL_OPERATOR_RESYNC``          seconds after which a pool's unchanged   ``600``
                                    children are applied again anyway (with
                                    their dry run); ``0``: apply every child
                                    on every reconcile (see below)
``KVPOOL_OPERATOR_BACKOFF_MAX``     longest retry delay after errors (s)     ``60``
``KVPOOL_OPERATOR_PURGE_RETRIES``   finalizer attempts before giving up      ``10``
``KVPOOL_OPERATOR_PURGE_DEADLINE``  seconds after a deletion began that the  ``90``
                                    finalizer stops trying to purge
``KVPOOL_OPERATOR_DRAIN_TIMEOUT``   seconds a deletion waits for the         ``60``
                                    sidecars to go before purging anyway
``KVPOOL_OPERATOR_IMAGE``           sidecar image when a pool names none,    see below
                                    and every pool's init container (the
                                    one step that runs as root)
``KVPOOL_OPERATOR_REDIS_IMAGE``     managed Redis image                      ``redis:7.4``
``KVPOOL_OPERATOR_REDIS_TIMEOUT``   Redis connect/read timeout (s)           ``3``
``KVPOOL_OPERATOR_POD_NAMESPACE``   the operator's own namespace (managed    any
                                    Redis admits the operator from it only)
``KVPOOL_OPERATOR_LIVENESS``        kopf liveness endpoint URL               none
``KVPOOL_OPERATOR_HOST_PATH_ROOTS`` comma-separated host directories under    ``/run/kvpool,
                                    which a pool's socketDir and disk path    /var/lib/kvpool,
                                    must lie (the sidecars take them over)    /mnt``
``KVPOOL_OPERATOR_PRIORITY_CLASSES`` the ``spec.priorityClassName`` values a ``*``: any but
                                    pool may set (see below)                 ``system-*``
``KVPOOL_OPERATOR_RUNTIME_CLASSES`` the ``spec.tiers.gpu.runtimeClassName``  ``nvidia``
                                    values a pool may set
``KVPOOL_OPERATOR_TOLERATION_KEYS`` the taint keys a pool's                  ``nvidia.com/gpu``
                                    ``spec.tolerations`` may tolerate
``KVPOOL_OPERATOR_GPU_IMAGES``      images, besides ``KVPOOL_OPERATOR_IMAGE``, none
                                    that may run a GPU tier (they see every
                                    GPU of the node)
==================================  ======================================  ==============

The four lists are comma-separated; an entry is a name, or a prefix ending in ``*``
(``*`` alone: anything). Set to an empty value, a list allows nothing. They bound what
whoever may create a ``KVCachePool`` gets on the nodes through the operator's DaemonSet
(:class:`PoolPolicySettings`; docs/security.md, "What a pool's creator may ask for"). A
``*`` or a prefix never matches a priority class whose name starts with ``system-``
(Kubernetes' own, which preempt other pods and are evicted last): name those exactly. A
toleration without a key (``operator: Exists``) tolerates every taint, the control
plane's included: only a ``*`` entry allows it.

A reconcile sends no request to write a child it applied itself, whose wanted manifest has
not changed since, and that is still the object it wrote, at the version the API server
returned, with the wanted labels, annotations and owner references (:mod:`applied`): no dry
run, no apply. Anything else (an edit by anyone, a deleted child, a changed spec, setting or
image, an operator restart) applies it as before, and every child is applied anyway once
``KVPOOL_OPERATOR_RESYNC`` has passed since it last was, so that a drift the API server's
versions would not show is still corrected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool_operator.errors import SettingsError

ENV_PREFIX = "KVPOOL_OPERATOR_"
DEFAULT_SIDECAR_IMAGE = "ghcr.io/kvpool/kvpool:0.1.0"
DEFAULT_REDIS_IMAGE = "redis:7.4"


@dataclass(frozen=True)
class WatchSettings:
    """Which pools this operator handles."""

    #: Namespaces to watch; empty means every namespace (cluster-wide).
    namespaces: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReconcileSettings:
    """How often and how patiently pools are reconciled."""

    #: Seconds between periodic reconciles of each pool (also refreshes the status).
    timer_interval_s: float = 30.0
    #: Seconds after a pool appears before its first periodic reconcile.
    timer_initial_delay_s: float = 5.0
    #: First retry delay after a temporary error; doubles per retry up to ``backoff_max_s``.
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    #: Finalizer attempts to purge the pool's index keys before letting the pool go anyway.
    purge_retries: int = 10
    #: Seconds after the finalizer first ran (sidecar drain included) after which it stops
    #: trying to purge the index and lets the pool go; one attempt (at most about three Redis
    #: timeouts) may still be under way when it passes.
    purge_deadline_s: float = 90.0
    #: Seconds a deletion waits for the sidecar DaemonSet and its pods to go before purging
    #: the index anyway (sidecars still running could publish again after the purge).
    drain_timeout_s: float = 60.0
    #: Seconds between checks whether the sidecar DaemonSet is gone, while draining.
    drain_poll_s: float = 1.0
    #: The field manager of the operator's server-side applies.
    field_manager: str = "kvpool-operator"
    #: Seconds a single Kubernetes API request may take.
    api_timeout_s: float = 30.0
    #: Seconds after which a child that provably has not changed since the operator applied
    #: it (:mod:`kvpool_operator.applied`) is dry-run and applied again anyway; 0: every child
    #: on every reconcile.
    resync_s: float = 600.0


@dataclass(frozen=True)
class ImageSettings:
    """Images used when a pool does not name its own."""

    sidecar: str = DEFAULT_SIDECAR_IMAGE
    redis: str = DEFAULT_REDIS_IMAGE


@dataclass(frozen=True)
class IndexSettings:
    """How the operator talks to a pool's Redis index."""

    #: Connect and read timeout in seconds.
    timeout_s: float = 3.0
    #: The namespace the operator's pods run in (the chart sets it). A managed Redis's
    #: NetworkPolicy admits the operator's pods from this namespace only; empty (e.g. an
    #: operator run outside the cluster): pods with the operator's labels from any namespace.
    operator_namespace: str = ""


#: Host directories under which pools may put their socket directory and disk tier.
DEFAULT_HOST_PATH_ROOTS = ("/run/kvpool", "/var/lib/kvpool", "/mnt")
#: The prefix of Kubernetes' own priority classes; a pattern never matches it.
RESERVED_PRIORITY_PREFIX = "system-"


def name_allowed(name: str, allowed: tuple[str, ...], *, reserved_prefix: str | None = None) -> bool:
    """Whether ``name`` is in ``allowed``: equal to an entry, or starting with the part of
    an entry before its final ``*`` (``*`` alone: anything). A name that starts with
    ``reserved_prefix`` matches an entry of the same spelling only, never a pattern."""
    for entry in allowed:
        if entry == name:
            return True
        if entry.endswith("*") and name.startswith(entry[:-1]):
            if reserved_prefix is None or not name.startswith(reserved_prefix):
                return True
    return False


@dataclass(frozen=True)
class PoolPolicySettings:
    """What whoever may create a pool may ask for on the nodes (entries: see :func:`name_allowed`).

    The pool's creator chooses the sidecar's image (``spec.image``), so each of these is a
    way onto the nodes for code of their choice: a priority class that preempts the nodes'
    critical pods, tolerations that place it on the control plane, a runtime class that
    runs it differently, and, with a GPU tier, every GPU of the node.
    """

    #: ``spec.priorityClassName`` values; a pattern never matches a ``system-`` class.
    priority_classes: tuple[str, ...] = ("*",)
    #: ``spec.tiers.gpu.runtimeClassName`` values ("" -- no runtime class -- is always allowed).
    runtime_classes: tuple[str, ...] = ("nvidia",)
    #: Taint keys a toleration may name; a toleration without a key needs ``*``.
    toleration_keys: tuple[str, ...] = ("nvidia.com/gpu",)
    #: Images that may run a GPU tier (``NVIDIA_VISIBLE_DEVICES=all``) besides the
    #: operator's own sidecar image (``KVPOOL_OPERATOR_IMAGE``), which always may.
    gpu_images: tuple[str, ...] = ()


@dataclass(frozen=True)
class OperatorSettings:
    """Everything the operator is configured with."""

    watch: WatchSettings = field(default_factory=WatchSettings)
    reconcile: ReconcileSettings = field(default_factory=ReconcileSettings)
    images: ImageSettings = field(default_factory=ImageSettings)
    index: IndexSettings = field(default_factory=IndexSettings)
    #: kopf's liveness endpoint (e.g. ``http://0.0.0.0:8080/healthz``); none when empty.
    liveness_endpoint: str | None = None
    #: A pool's host directories (``spec.api.socketDir``, ``spec.tiers.disk.path``) must lie
    #: strictly under one of these: its sidecars' init container hands them to their user.
    host_path_roots: tuple[str, ...] = DEFAULT_HOST_PATH_ROOTS
    #: What a pool's creator may ask for on the nodes.
    pool_policy: PoolPolicySettings = field(default_factory=PoolPolicySettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        """Settings from ``KVPOOL_OPERATOR_*`` variables; raises SettingsError naming the variable."""
        env = os.environ if env is None else env
        namespaces = tuple(ns.strip() for ns in env.get(ENV_PREFIX + "NAMESPACES", "").split(",") if ns.strip())
        reconcile = ReconcileSettings(
            timer_interval_s=_float(env, "TIMER_INTERVAL", ReconcileSettings.timer_interval_s),
            timer_initial_delay_s=_float(env, "TIMER_DELAY", ReconcileSettings.timer_initial_delay_s),
            backoff_max_s=_float(env, "BACKOFF_MAX", ReconcileSettings.backoff_max_s),
            purge_retries=_positive_int(env, "PURGE_RETRIES", ReconcileSettings.purge_retries),
            purge_deadline_s=_float(env, "PURGE_DEADLINE", ReconcileSettings.purge_deadline_s),
            drain_timeout_s=_float(env, "DRAIN_TIMEOUT", ReconcileSettings.drain_timeout_s),
            resync_s=_float(env, "RESYNC", ReconcileSettings.resync_s, zero=True),
        )
        images = ImageSettings(
            sidecar=env.get(ENV_PREFIX + "IMAGE") or DEFAULT_SIDECAR_IMAGE,
            redis=env.get(ENV_PREFIX + "REDIS_IMAGE") or DEFAULT_REDIS_IMAGE,
        )
        index = IndexSettings(timeout_s=_float(env, "REDIS_TIMEOUT", IndexSettings.timeout_s),
                              operator_namespace=env.get(ENV_PREFIX + "POD_NAMESPACE", "").strip())
        return cls(
            watch=WatchSettings(namespaces=namespaces),
            reconcile=reconcile,
            images=images,
            index=index,
            liveness_endpoint=env.get(ENV_PREFIX + "LIVENESS") or None,
            host_path_roots=_roots(env),
            pool_policy=PoolPolicySettings(
                priority_classes=_names(env, "PRIORITY_CLASSES", PoolPolicySettings.priority_classes),
                runtime_classes=_names(env, "RUNTIME_CLASSES", PoolPolicySettings.runtime_classes),
                toleration_keys=_names(env, "TOLERATION_KEYS", PoolPolicySettings.toleration_keys),
                gpu_images=_names(env, "GPU_IMAGES", PoolPolicySettings.gpu_images),
            ),
        )

    def backoff(self, retry: int) -> float:
        """Delay before retry number ``retry`` (0-based): exponential, capped."""
        r = self.reconcile
        return float(min(r.backoff_max_s, r.backoff_base_s * (2 ** min(retry, 30))))


def _roots(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get(ENV_PREFIX + "HOST_PATH_ROOTS")
    if raw is None:
        return DEFAULT_HOST_PATH_ROOTS
    roots = tuple(r.strip().rstrip("/") for r in raw.split(",") if r.strip())
    for r in roots:
        if not r.startswith("/") or os.path.normpath(r) != r:
            raise SettingsError("{}HOST_PATH_ROOTS: {!r} is not a normalized absolute path".format(ENV_PREFIX, r))
    return roots


def _names(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list; unset: ``default``; set but empty: nothing. A ``*`` may only end an entry."""
    raw = env.get(ENV_PREFIX + name)
    if raw is None:
        return default
    entries = tuple(e.strip() for e in raw.split(",") if e.strip())
    for e in entries:
        if "*" in e[:-1]:
            raise SettingsError("{}{}: {!r}: a '*' may only end an entry".format(ENV_PREFIX, name, e))
    return entries


def _float(env: Mapping[str, str], name: str, default: float, *, zero: bool = False) -> float:
    """A number that must be positive (``zero``: or 0), and finite."""
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as e:
        raise SettingsError("{}{}: expected a number, got {!r}".format(ENV_PREFIX, name, raw)) from e
    if not (0 <= value if zero else 0 < value) or not value < float("inf"):
        raise SettingsError("{}{}: must be {}".format(ENV_PREFIX, name, "0 or more" if zero else "positive"))
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as e:
        raise SettingsError("{}{}: expected an integer, got {!r}".format(ENV_PREFIX, name, raw)) from e
    if value <= 0:
        raise SettingsError("{}{}: must be positive".format(ENV_PREFIX, name))
    return value
