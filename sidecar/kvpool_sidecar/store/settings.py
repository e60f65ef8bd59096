"""What the store is told beyond its tiers and policy."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TenantLimits:
    priority: int = 0
    #: The most bytes of the host tier (DRAM) the tenant's blocks may take; None: no limit.
    quota_bytes: int | None = None


@dataclass(frozen=True)
class StoreSettings:
    """The store's settings (the sidecar's names for them in brackets)."""

    tenants: dict[str, TenantLimits] = field(default_factory=lambda: {"default": TenantLimits()})
    block_max_bytes: int = 256 << 20
    #: The most of the host tier one client session, and all the client sessions of one
    #: tenant together, may hold at once (write leases, read leases, pins), as a share of
    #: it: past it a put answers QUOTA, a get misses and a pin does not take, so one client
    #: or tenant cannot hold the node (the sidecar's own sessions: no cap).
    #: (``api.max_session_share``, 0.5)
    session_share: float = 1.0
    #: Whether a block evicted from a tier is first copied to the next colder one
    #: (``policy.demote``).
    demote: bool = True
    lease_timeout_s: float = 30.0
    #: The share of the host tier kept free or already copied to the next colder tier
    #: ahead of need (a background writer, :meth:`TieredStore.write_ahead`), so a put that
    #: needs room evicts a clean block at once instead of waiting for a disk write. 0 (the
    #: default here, and the trace replay's: victims in the policy's exact order): demote
    #: only on demand. (``dram.clean_share``, 0.1)
    clean_share: float = 0.0
    #: With ``clean_share`` above 0: whether a put that finds no room free or already copied
    #: down waits for a block's copy down (True: the default here, where no background
    #: writer runs unless the caller drives :meth:`TieredStore.write_ahead`) or is answered
    #: FULL at once, the write-ahead woken (``dram.put_waits_for_disk``, false).
    put_waits_for_disk: bool = True
    #: Reads of a block in the host tier after which it is copied up to the tier above
    #: (the GPU tier), when there is one and the policy admits it there
    #: (``tiers.gpu.promote_after_hits``, 2).
    promote_hits: int = 2
