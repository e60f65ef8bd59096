"""A pool's status from what the operator observed: pure functions, no I/O.

Figures come from the sidecars' heartbeat hashes in the index (docs/redis-schema.md):
``tiers`` (JSON per tier: capacity_bytes, used_bytes, blocks), ``hits``, ``misses``.
Conditions:

- ``IndexReachable``: the operator could read the pool's Redis.
- ``Ready``: the pool serves: index reachable, spec workable, at least one live sidecar.
- ``Degraded``: something needs attention: an unworkable spec, an unreachable index,
  or fewer live sidecars than nodes the DaemonSet targets.

Each condition carries ``observedGeneration``; ``lastTransitionTime`` only moves when
the condition's status changes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvpool_operator.quantity import format_bytes

logger = logging.getLogger(__name__)

TIERS = ("gpu", "dram", "disk")
READY, INDEX_REACHABLE, DEGRADED = "Ready", "IndexReachable", "Degraded"
#: The largest count a status takes, each figure and each sum of them: the API server
#: refuses a whole status patch with an integer past int64, so a figure a writer to Redis
#: made bigger (or several that add up past it) had frozen the status.
MAX_FIGURE = 2**62


def _capped(*figures: int) -> int:
    return min(MAX_FIGURE, sum(figures))


@dataclass(frozen=True)
class TierFigures:
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0

    def __add__(self, other: TierFigures) -> TierFigures:
        return TierFigures(_capped(self.capacity_bytes, other.capacity_bytes),
                           _capped(self.used_bytes, other.used_bytes), _capped(self.blocks, other.blocks))


@dataclass(frozen=True)
class PoolFigures:
    """Sums over the live sidecars."""

    live: int = 0
    tiers: Mapping[str, TierFigures] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    #: GPUs the live sidecars found (NVML), by model name; and how many report ill health.
    gpu_models: Mapping[str, int] = field(default_factory=dict)
    gpus_unhealthy: int = 0

    @property
    def capacity_bytes(self) -> int:
        return _capped(*(t.capacity_bytes for t in self.tiers.values()))

    @property
    def used_bytes(self) -> int:
        return _capped(*(t.used_bytes for t in self.tiers.values()))

    @property
    def blocks(self) -> int:
        return _capped(*(t.blocks for t in self.tiers.values()))

    @property
    def hit_ratio(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


def _int(value: object) -> int:
    """A figure of a heartbeat, in ``[0, MAX_FIGURE]``; malformed ones count as zero."""
    text = str(value)
    if len(text) > 24:  # (past int64 anyway; int() of a long string costs quadratic time)
        return 0
    try:
        return min(MAX_FIGURE, max(0, int(text)))
    except ValueError:
        return 0


def node_tiers(fields: Mapping[str, str]) -> dict[str, TierFigures]:
    """A heartbeat hash's ``tiers`` field; malformed parts count as zero."""
    try:
        raw = json.loads(fields.get("tiers") or "{}")
    except ValueError:
        logger.warning("ignoring a heartbeat with malformed tiers JSON")
        return {}
    if not isinstance(raw, dict):
        return {}
    result: dict[str, TierFigures] = {}
    for name, tier in raw.items():
        if name in TIERS and isinstance(tier, dict):
            result[name] = TierFigures(_int(tier.get("capacity_bytes", 0)), _int(tier.get("used_bytes", 0)),
                                       _int(tier.get("blocks", 0)))
    return result


def node_gpus(fields: Mapping[str, str]) -> list[tuple[str, bool]]:
    """A heartbeat hash's ``gpus`` field as ``(model name, healthy)``; malformed parts are
    skipped (at most 64 GPUs a node, names cut to 64 characters)."""
    try:
        raw = json.loads(fields.get("gpus") or "[]")
    except ValueError:
        return []
    out: list[tuple[str, bool]] = []
    for g in raw[:64] if isinstance(raw, list) else ():
        if isinstance(g, dict) and isinstance(g.get("name"), str):
            health = g.get("health")
            ok = not isinstance(health, dict) or health.get("ok") is not False
            out.append((g["name"][:64], ok))
    return out


#: GPU models a pool's status names at most; past them, GPUs count under OTHER_GPU_MODELS.
#: Heartbeats come from Redis, where a writer could name a new model for every GPU of every
#: node (4,096 x 64: a status of 18 MB, which the API server refuses at every reconcile).
MAX_GPU_MODELS = 64
OTHER_GPU_MODELS = "(other)"


def pool_figures(live: Mapping[str, Mapping[str, str]]) -> PoolFigures:
    """Sum the heartbeat hashes of the live nodes."""
    tiers: dict[str, TierFigures] = {}
    models: dict[str, int] = {}
    hits = misses = unhealthy = 0
    for fields in live.values():
        for name, figures in node_tiers(fields).items():
            tiers[name] = tiers.get(name, TierFigures()) + figures
        hits = _capped(hits, _int(fields.get("hits", 0)))
        misses = _capped(misses, _int(fields.get("misses", 0)))
        for model, ok in node_gpus(fields):
            if model not in models and len(models) >= MAX_GPU_MODELS:
                model = OTHER_GPU_MODELS
            models[model] = models.get(model, 0) + 1
            unhealthy += not ok
    return PoolFigures(live=len(live), tiers=tiers, hits=hits, misses=misses, gpu_models=models,
                       gpus_unhealthy=unhealthy)


@dataclass(frozen=True)
class Observation:
    """Everything one reconcile learnt about a pool."""

    generation: int
    pool_id: str
    index_url: str
    #: Unworkable parts of the spec, each naming its field; empty when all is well.
    problems: Sequence[str] = ()
    #: None when the index was read; else why not, with a CamelCase reason.
    index_error: str | None = None
    index_reason: str = ""
    figures: PoolFigures = field(default_factory=PoolFigures)
    #: From the DaemonSet's status.
    desired: int = 0
    pods_ready: int = 0
    #: A request the API server refused for good (e.g. 403: RBAC missing), which stopped
    #: the reconcile part way; None when every request went through.
    api_error: str | None = None
    #: Where the sidecars' socket is on each node (the path serving pods mount the directory
    #: of); empty when the spec could not be read.
    socket_path: str = ""


#: The longest condition message the CRD takes (the API server refuses a status patch past
#: it, and the pool had kept its last conditions, Ready among them, while its spec was refused).
MAX_MESSAGE = 4096


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    if len(message) > MAX_MESSAGE:
        more = " ... ({} characters in all)".format(len(message))
        message = message[: MAX_MESSAGE - len(more)] + more
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions(obs: Observation) -> list[dict[str, Any]]:
    """Ready, IndexReachable and Degraded (without timestamps)."""
    live, desired = obs.figures.live, obs.desired
    reachable = obs.index_error is None
    if reachable:
        index = _condition(INDEX_REACHABLE, True, "Connected",
                           "read kvp:{}:* at {}".format(obs.pool_id, obs.index_url))
    else:
        index = _condition(INDEX_REACHABLE, False, obs.index_reason or "Unreachable", obs.index_error or "")
    nodes = "{} sidecar(s) live, {} node(s) targeted by the DaemonSet".format(live, desired)
    if obs.api_error is not None:
        ready = _condition(READY, False, "ApiRefused", obs.api_error)
    elif obs.problems:
        ready = _condition(READY, False, "InvalidSpec", "; ".join(obs.problems))
    elif not reachable:
        ready = _condition(READY, False, "IndexUnreachable", obs.index_error or "")
    elif live == 0:
        ready = _condition(READY, False, "NoLiveSidecars",
                           "no sidecar has a live heartbeat in the index yet ({} nodes targeted)".format(desired))
    else:
        ready = _condition(READY, True, "PoolReady", nodes)
    if obs.api_error is not None:
        degraded = _condition(DEGRADED, True, "ApiRefused", obs.api_error)
    elif obs.problems:
        degraded = _condition(DEGRADED, True, "InvalidSpec", "; ".join(obs.problems))
    elif not reachable:
        degraded = _condition(DEGRADED, True, "IndexUnreachable", obs.index_error or "")
    elif live < desired:
        degraded = _condition(DEGRADED, True, "SidecarsMissing", nodes)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", nodes)
    return [ready, index, degraded]


def _timestamp(now: datetime) -> str:
    return now.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_status(obs: Observation, previous: Mapping[str, Any] | None, now: datetime) -> dict[str, Any]:
    """The whole ``status`` for an observation; keeps transition times of unchanged conditions."""
    before: dict[str, Mapping[str, Any]] = {}
    for c in (previous or {}).get("conditions") or ():
        if isinstance(c, Mapping) and isinstance(c.get("type"), str):
            before[c["type"]] = c
    stamped = []
    for c in conditions(obs):
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"] and old.get("lastTransitionTime")
        c["lastTransitionTime"] = old["lastTransitionTime"] if same and old is not None else _timestamp(now)
        c["observedGeneration"] = obs.generation
        stamped.append(c)
    figures = obs.figures
    status: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "conditions": stamped,
        "index": {"pool": obs.pool_id, "url": obs.index_url},
        "nodes": {"desired": obs.desired, "ready": figures.live, "podsReady": obs.pods_ready},
        "summary": {"nodes": "{}/{}".format(figures.live, obs.desired)},
    }
    if obs.socket_path:
        status["socketPath"] = obs.socket_path
    if obs.index_error is None:
        status["tiers"] = {
            name: {"capacityBytes": t.capacity_bytes, "usedBytes": t.used_bytes, "blocks": t.blocks}
            for name, t in sorted(figures.tiers.items())
        }
        status.update(capacityBytes=figures.capacity_bytes, usedBytes=figures.used_bytes, blocks=figures.blocks,
                      hits=figures.hits, misses=figures.misses)
        status["summary"].update(capacity=format_bytes(figures.capacity_bytes), used=format_bytes(figures.used_bytes))
        if figures.gpu_models:
            status["gpus"] = {"count": sum(figures.gpu_models.values()), "unhealthy": figures.gpus_unhealthy,
                              "models": dict(sorted(figures.gpu_models.items()))}
        ratio = figures.hit_ratio
        if ratio is not None:
            status["hitRatio"] = round(ratio, 4)
            status["summary"]["hitRate"] = "{:.1f}%".format(100 * ratio)
    return status


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) turning ``old`` into ``new``: absent keys become null."""
    patch: dict[str, Any] = {}
    old = old or {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def ready_status(status: Mapping[str, Any] | None) -> str | None:
    """The Ready condition's status ("True", "False", ...) in a status, if any."""
    value = _ready(status).get("status")
    return str(value) if value is not None else None


def _ready(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    for c in (status or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == READY:
            return c
    return {}


def invalid_spec_event(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str | None:
    """The message of the ``InvalidSpec`` Warning Event to post, or None.

    One Event for each refusal a person has not been told about yet: when the new Ready
    condition says ``InvalidSpec`` and the previous status did not say the same thing for
    the same generation (the timer's re-runs of an unchanged pool post nothing more).
    """
    ready = _ready(new)
    if ready.get("reason") != "InvalidSpec":
        return None
    before = _ready(previous)
    if (before.get("reason"), before.get("message"), before.get("observedGeneration")) == (
            "InvalidSpec", ready.get("message"), ready.get("observedGeneration")):
        return None
    return "the pool's spec was not applied (existing children are left as they were): {}".format(
        ready.get("message") or "")
