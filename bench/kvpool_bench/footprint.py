"""What a policy costs the sidecar: CPU per call, and the bytes of its shadows and learning.

:class:`TimedPolicy` wraps a policy and adds up the time spent in every call the store makes
into it (victims included, one step of their iteration at a time). :func:`state_bytes`
measures, object by object (``sys.getsizeof`` over everything they reach), the structures a
policy keeps besides its own order of the resident blocks: the shadow caches of its duel and
its learning state (see ``PrefixAwarePolicy.learning_state``).
"""

from __future__ import annotations

import gc
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvpool_sidecar.policy import BlockMeta, EvictionPolicy

_T = TypeVar("_T")

#: What a walk never counts: code and classes are shared by every instance.
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType)


class TimedPolicy:
    """``policy`` with the time spent in it added up (``seconds``)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.seconds = 0.0

    def _timed(self, call: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        t = time.perf_counter()
        try:
            return call(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - t

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        return self._timed(self.policy.admit, tier, meta)

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        self._timed(self.policy.inserted, tier, meta)

    def accessed(self, tier: str, meta: BlockMeta, *, again: bool = False) -> None:
        self._timed(self.policy.accessed, tier, meta, again=again)

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        self._timed(self.policy.bypassed, tier, meta)

    def sized(self, capacity: int) -> None:
        self.policy.sized(capacity)

    def bounded(self, tenants: frozenset[str]) -> None:
        self.policy.bounded(tenants)

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        self._timed(self.policy.skipped, tier, meta)

    def restored(self, tier: str, meta: BlockMeta) -> None:
        self._timed(self.policy.restored, tier, meta)

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        self._timed(self.policy.removed, tier, meta, evicted=evicted)

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        t = time.perf_counter()
        it = self.policy.victims(tier, tenant)
        self.seconds += time.perf_counter() - t
        while True:
            t = time.perf_counter()
            m = next(it, None)
            self.seconds += time.perf_counter() - t
            if m is None:
                return
            yield m


def deep_bytes(root: object, seen: set[int]) -> int:
    """Bytes of ``root`` and everything it reaches that is not in ``seen`` (which grows)."""
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP) or obj is None:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def state_bytes(policy: EvictionPolicy) -> dict[str, int] | None:
    """Bytes of each part of ``policy``'s shadows and learning state; None if it has none."""
    parts: Any = getattr(policy, "learning_state", None)
    if parts is None:
        return None
    seen: set[int] = set()
    return {name: deep_bytes(obj, seen) for name, obj in parts().items()}
