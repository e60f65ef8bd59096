"""What the operator last applied to each child, so that a reconcile writes nothing it provably need not.

Each reconcile (on every change, and by the timer every 30 s per pool) would otherwise send
every child a server-side-apply dry run and then the apply itself, changed or not.
:class:`AppliedChildren` remembers, per child (pool uid, apiVersion, kind, name), a digest
of the manifest last applied successfully and what the API server answered for it: the
object's uid and its version. A child is *unchanged*, and the reconcile neither dry-runs nor
applies it, only while all of these hold:

- the manifest the reconcile wants has that digest (the same spec, token, images, settings
  and owner reference: everything the operator would write);
- the object read in this same reconcile is that object (its uid), at that version, and is
  not being deleted. The version is ``metadata.generation`` for the kinds whose controllers
  keep writing their status (DaemonSet, StatefulSet: the API server bumps it on any change
  to their spec), else ``metadata.resourceVersion`` (bumped by any change at all);
- its labels and annotations hold the wanted entries, and its owner references the wanted
  ones; for the kinds versioned by generation, its labels, annotations and owner references
  are those the apply returned, exactly (a change to metadata bumps no generation: labels an
  older operator's apply added, under this operator's field manager, which this one's apply
  removes, had stayed until the resync);
- it was applied less than ``resync_s`` ago (``KVPOOL_OPERATOR_RESYNC``): every child is
  dry-run and applied at least that often anyway, in case of a drift that neither version
  shows (none is known).

Anything else (the first reconcile after the operator starts, an edit by anyone, a deleted
or re-created child, a changed spec, setting or image) applies the child exactly as before.
The records live in this process only, a few hundred bytes each. A pool's are forgotten when
its finalizer is done (:meth:`AppliedChildren.forget`), those of the children it no longer
wants at each of its reconciles (:meth:`AppliedChildren.keep_only`), and, once per
``resync_s``, those of every pool none of whose records could skip anything any more: they
are bounded by the children of the pools applied within the last ``resync_s``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_operator.manifests import ChildKey, Manifest, child_key

#: Kinds whose version is ``metadata.generation`` (their controllers write their status,
#: which bumps the resourceVersion every time); the others' is ``metadata.resourceVersion``.
GENERATION_KINDS = frozenset({"DaemonSet", "StatefulSet"})
#: Maps of a child's metadata whose wanted entries must be there; others may be too (labels
#: an older operator copied, another controller's annotations), as server-side apply keeps them.
METADATA_MAPS = ("labels", "annotations")

Clock = Callable[[], float]


def digest(child: Manifest) -> str:
    """A digest of everything the operator would write for ``child``."""
    return hashlib.sha256(json.dumps(child, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def version(kind: str, obj: Mapping[str, Any]) -> str | None:
    """The version of a stored ``obj`` of ``kind`` that changes whenever what the operator
    applies to it changes (see the module); None when it has none."""
    meta = obj.get("metadata") or {}
    value = meta.get("generation") if kind in GENERATION_KINDS else meta.get("resourceVersion")
    return None if value is None or value == "" else str(value)


def carries_metadata(child: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether ``stored`` has ``child``'s labels and annotations (others may be there too)
    and its owner references (others' too: another controller's)."""
    meta, stored_meta = child.get("metadata") or {}, stored.get("metadata") or {}
    stored_refs = list(stored_meta.get("ownerReferences") or ())
    return (all(ref in stored_refs for ref in meta.get("ownerReferences") or ())
            and all(dict(meta.get(f) or {}).items() <= dict(stored_meta.get(f) or {}).items() for f in METADATA_MAPS))


def metadata_digest(obj: Mapping[str, Any]) -> str:
    """A digest of ``obj``'s labels, annotations and owner references."""
    meta = obj.get("metadata") or {}
    return digest({f: meta.get(f) for f in ("labels", "annotations", "ownerReferences")})


@dataclass(frozen=True)
class _Record:
    digest: str
    uid: str
    version: str
    #: :func:`metadata_digest` of the apply's answer (checked for :data:`GENERATION_KINDS`).
    meta: str
    #: When it was applied (the clock of :class:`AppliedChildren`).
    at: float


class AppliedChildren:
    """The records of one operator process, shared by the reconciles of all its pools
    (kopf runs them in a thread pool: every method takes a lock)."""

    def __init__(self, resync_s: float, *, clock: Clock = time.monotonic) -> None:
        #: 0 (or less): nothing is remembered, every child is applied on every reconcile.
        self.resync_s = resync_s
        self._clock = clock
        self._pools: dict[str, dict[ChildKey, _Record]] = {}
        self._lock = threading.Lock()
        self._next_sweep = clock() + resync_s

    def unchanged(self, pool_uid: str, child: Manifest, stored: Mapping[str, Any] | None) -> bool:
        """Whether ``child`` need be neither dry-run nor applied: ``stored`` (the object as
        read in this reconcile; None when absent) is what the operator last applied and
        still holds it (see the module)."""
        if self.resync_s <= 0 or stored is None:
            return False
        with self._lock:
            record = self._pools.get(pool_uid, {}).get(child_key(child))
        if record is None or self._clock() - record.at >= self.resync_s:
            return False
        meta = stored.get("metadata") or {}
        return (meta.get("uid") == record.uid and version(child["kind"], stored) == record.version
                and not meta.get("deletionTimestamp") and digest(child) == record.digest
                and carries_metadata(child, stored)
                and (child["kind"] not in GENERATION_KINDS or metadata_digest(stored) == record.meta))

    def remember(self, pool_uid: str, child: Manifest, answer: Mapping[str, Any]) -> None:
        """``child`` was applied (for real) and the API server answered ``answer``."""
        if self.resync_s <= 0:
            return
        meta = answer.get("metadata") or {}
        uid, ver = meta.get("uid"), version(child["kind"], answer)
        key, now = child_key(child), self._clock()
        with self._lock:
            records = self._pools.setdefault(pool_uid, {})
            if uid and ver is not None:
                records[key] = _Record(digest(child), str(uid), ver, metadata_digest(answer), now)
            else:  # an answer without them: nothing to recognize the object by
                records.pop(key, None)
            self._sweep(now)

    def keep_only(self, pool_uid: str, keys: Iterable[ChildKey]) -> None:
        """Forget the pool's records but those of ``keys`` (the children it still wants)."""
        wanted = set(keys)
        with self._lock:
            records = self._pools.get(pool_uid)
            if records is None:
                return
            for key in [k for k in records if k not in wanted]:
                del records[key]
            if not records:
                del self._pools[pool_uid]

    def forget(self, pool_uid: str) -> None:
        """Forget every record of the pool (it is gone)."""
        with self._lock:
            self._pools.pop(pool_uid, None)

    def __len__(self) -> int:
        """The number of records held."""
        with self._lock:
            return sum(len(records) for records in self._pools.values())

    def _sweep(self, now: float) -> None:
        """Once per ``resync_s``: drop the pools none of whose records can skip anything (a
        pool deleted while this process did not see its finalizer run, say). Lock held."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.resync_s
        for uid in [u for u, records in self._pools.items()
                    if all(now - r.at >= self.resync_s for r in records.values())]:
            del self._pools[uid]
