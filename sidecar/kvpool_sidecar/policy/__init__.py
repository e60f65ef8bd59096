"""Which blocks to admit and which to evict: the policy interface and its implementations.

A policy sees each tier's resident blocks through its notifications (``inserted``,
``accessed``, ``removed``, ``admit``, and ``bypassed``, ``skipped``, ``restored``) and answers
one question, ``victims(tier)``: the resident blocks of that tier in the order they should
go. The store skips victims it may not evict (pinned or being read) and stops iterating
before it changes anything, so a policy may yield straight from its live structures. The
pinned blocks it walked past it then reports as ``skipped`` (they go last until their last
pin goes: ``restored``).

Priorities come first in every policy here: a block of a lower-priority tenant goes before
any block of a higher-priority one. ``victims(tier, tenant)`` restricts the order to one
tenant's blocks, which the store uses when that tenant is over its quota.

Tiers are named by strings (``"dram"``, ``"disk"``, ``"gpu"``) so that this package
depends on nothing else in the sidecar; the trace replay drives the same classes.

Modules: :mod:`~kvpool_sidecar.policy.base` (the interface: :class:`BlockMeta`, :class:`Hints`,
:class:`EvictionPolicy`, and :class:`ShadowPolicy`, what a duel's shadow asks more), :mod:`~kvpool_sidecar.policy.lru` (:class:`LRUPolicy`),
:mod:`~kvpool_sidecar.policy.prefix` (:class:`PrefixAwarePolicy`, the default) with its
tiers' ordered residents (:mod:`~kvpool_sidecar.policy.tierstate`), their ranks
(:mod:`~kvpool_sidecar.policy.ranks`), their walk in eviction order
(:mod:`~kvpool_sidecar.policy.victims`), what each access teaches it
(:mod:`~kvpool_sidecar.policy.accesses`) and its tail rule
(:mod:`~kvpool_sidecar.policy.tails`), and :mod:`~kvpool_sidecar.policy.registry` (the
policies by name).
"""

from kvpool_sidecar.policy.base import BlockMeta, EvictionPolicy, Hints, ShadowPolicy
from kvpool_sidecar.policy.lru import LRUPolicy
from kvpool_sidecar.policy.prefix import MAX_CHILDREN, PrefixAwarePolicy
from kvpool_sidecar.policy.ranks import ARC, LEARNED, MAX_RELATIVE_VALUE, ORDERS, RECENCY
from kvpool_sidecar.policy.registry import POLICIES, make_policy

__all__ = ["ARC", "LEARNED", "MAX_CHILDREN", "MAX_RELATIVE_VALUE", "ORDERS", "POLICIES", "RECENCY", "BlockMeta",
           "EvictionPolicy", "Hints", "LRUPolicy", "PrefixAwarePolicy", "ShadowPolicy", "make_policy"]
