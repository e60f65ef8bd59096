"""The tiered block store (see :mod:`kvpool_sidecar.store.facade`).

Layers, each importing only those below it (an import-linter contract checks it):
``facade`` over ``report`` over ``host``, ``promotion`` and ``writeahead`` over ``mover`` and
``pins`` over ``room`` over ``ledger`` over ``threads`` over ``quotas`` over ``leases`` over
``entries`` over ``settings``.
"""

from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.facade import PREFETCH_PARALLEL, TieredStore
from kvpool_sidecar.store.leases import ReadLease, Session, WriteLease
from kvpool_sidecar.store.promotion import split_batches
from kvpool_sidecar.store.writeahead import WRITE_AHEAD_BATCH_BYTES
from kvpool_sidecar.store.settings import StoreSettings, TenantLimits
from kvpool_sidecar.tiers.base import TierKind

__all__ = ["PREFETCH_PARALLEL", "WRITE_AHEAD_BATCH_BYTES", "Entry", "ReadLease", "Session", "StoreSettings", "TenantLimits",
           "TierKind", "TieredStore", "WriteLease", "split_batches"]
