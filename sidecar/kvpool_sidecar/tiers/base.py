"""What every tier shares: tier names and the record a block carries between tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TierKind(str, enum.Enum):
    """Tiers from hottest to coldest."""

    GPU = "gpu"
    DRAM = "dram"
    DISK = "disk"

    @property
    def rank(self) -> int:
        """0 for the hottest tier; used to order holders and promotions."""
        return _RANK[self]


_RANK = {TierKind.GPU: 0, TierKind.DRAM: 1, TierKind.DISK: 2}


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """The identity and integrity of one block's payload, the same in every tier.

    ``key`` is the 48-byte raw :class:`kvpool_client.keys.BlockKey`; ``checksum`` is the
    xxh3-64 of the payload (:mod:`kvpool_client.integrity`) fixed when the block was first
    committed; ``tenant`` names the owner whose quota the block counts against.
    """

    key: bytes
    size: int
    checksum: int
    tenant: str = "default"
