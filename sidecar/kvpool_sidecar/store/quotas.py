"""Tenants' shares of the host tier: quotas on what their blocks take, and caps on what
their sessions hold at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvpool_sidecar.errors import QuotaError
from kvpool_sidecar.store.leases import Session
from kvpool_sidecar.store.settings import StoreSettings, TenantLimits


class Quotas:
    """Per tenant: host-tier bytes its blocks take (against ``quota_bytes``) and bytes its
    client sessions hold (against ``session_share`` of the tier), both counted in what the
    blocks take in the host tier (``footprint``: whole pages), not in what they hold: a
    session of 1-byte blocks would otherwise hold a page each for a byte of its share."""

    def __init__(self, settings: StoreSettings, host_capacity: int,
                 footprint: Callable[[int, str | None], int]) -> None:
        self.settings = settings
        self.weight = footprint
        self._cap = settings.session_share * host_capacity
        #: What all the client sessions of each tenant hold (see :meth:`over_cap`).
        self._held: Counter[str] = Counter()
        #: Host-tier bytes (whole pages) each tenant's blocks and write leases take.
        self._used: Counter[str] = Counter()
        #: Host-tier bytes each tenant's reservations still evicting for will take
        #: (:meth:`making_room`).
        self._reserving: Counter[str] = Counter()

    def limits(self, tenant: str) -> TenantLimits:
        limits = self.settings.tenants.get(tenant)
        if limits is None:
            raise QuotaError(f"unknown tenant {tenant!r}")
        return limits

    def limits_or_default(self, tenant: str) -> TenantLimits:
        return self.settings.tenants.get(tenant, TenantLimits())

    def knows(self, tenant: str) -> bool:
        return tenant in self.settings.tenants

    # ------------------------------------------------------------- what blocks take
    def charge(self, tenant: str, footprint: int) -> None:
        self._used[tenant] += footprint

    def over_quota(self, tenant: str, limits: TenantLimits, need: int) -> bool:
        """Whether ``need`` more bytes take ``tenant`` past its quota, counting the room its
        reservations are still evicting for (:meth:`making_room`)."""
        return limits.quota_bytes is not None \
            and self._used[tenant] + self._reserving[tenant] + need > limits.quota_bytes

    @contextmanager
    def making_room(self, tenant: str, footprint: int) -> Iterator[None]:
        """While a reservation within ``tenant``'s quota evicts for its ``footprint``, that
        room counts against the quota (:meth:`over_quota`): the tenant's other puts took the
        room it freed, each within the quota before it was charged, and left the tenant
        holding more than its quota (a review: 42 MiB against 32). Given back when the
        reservation is charged or fails, cancelled included."""
        self._reserving[tenant] += footprint
        try:
            yield
        finally:
            self._reserving[tenant] -= footprint
            if self._reserving[tenant] <= 0:
                del self._reserving[tenant]

    # ------------------------------------------------------------- what sessions hold
    def over_cap(self, session: Session, size: int) -> bool:
        """Whether holding ``size`` more bytes (a :attr:`weight`) takes ``session`` past its
        share of the tier."""
        if not session.expiring or self.settings.session_share >= 1:  # the sidecar's own: no cap
            return False
        # per connection, and for all of a tenant's connections together (a tenant that
        # opens many connections still leaves the rest of the tier to the others)
        return session.held_bytes + size > self._cap or self._held[session.tenant] + size > self._cap

    def hold(self, session: Session, delta: int) -> None:
        session.held_bytes += delta
        if session.expiring:  # clients' sessions; the sidecar's own (peer fetches) are not capped
            self._held[session.tenant] += delta
