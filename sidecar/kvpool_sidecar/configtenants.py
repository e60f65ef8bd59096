"""A tenant's settings (``tenants[]``): its priority, its quota, its key space and who may act
as it. An item of :attr:`~kvpool_sidecar.config.SidecarSettings.tenants`, loaded in
:mod:`kvpool_sidecar.config`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantSettings:
    """A tenant: higher ``priority`` blocks are evicted last; a quota caps its DRAM use.

    The quota is either ``quota_bytes`` or ``quota_share``, a fraction (0, 1] of this node's
    DRAM tier; at most one of the two. Unset: no cap beyond the tier itself.

    Tenants never see each other's blocks unless they name the same ``key_space`` (by
    default each tenant is its own space); see :mod:`kvpool_sidecar.tenancy`.
    """

    name: str
    priority: int = 0
    quota_bytes: int | None = None
    quota_share: float | None = None
    key_space: str | None = None
    #: Who may act as this tenant; any one rule admits a client. ``uids`` / ``gids``: a
    #: client on the Unix socket whose user or primary group (the kernel's SO_PEERCRED, not
    #: a claim) is listed. ``token_file``: a client presenting the secret in this file (at
    #: least 16 bytes; e.g. a Kubernetes Secret mounted into the serving pod). A tenant with
    #: no rule is open to every process that can open the socket (``api.socket_mode``) and
    #: to no client over TCP, which always needs a token.
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    token_file: str | None = None

    @property
    def space(self) -> str:
        return self.key_space or self.name

    def quota(self, dram_bytes: int) -> int | None:
        """The tenant's cap in bytes on a DRAM tier of ``dram_bytes``."""
        if self.quota_share is not None:
            return max(1, int(self.quota_share * dram_bytes))
        return self.quota_bytes
