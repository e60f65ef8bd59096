"""What the vLLM connector's scheduler side tells its workers of a step, and what the workers
tell it back (vLLM carries both between the processes).

:class:`KVPoolConnectorMetadata`: the blocks to load before the step's forward and to save
after it, and which held saves to put or drop; :class:`KVPoolWorkerMetadata`: the steps the
workers loaded in, those in which a load failed, and the saves they could not make. The
connector is :class:`~kvpool_client.engines.vllm.KVPoolConnector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpool_client.engines.prefix import LoadSpec, SaveSpec


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the workers do in one step: blocks to load before the forward, to save after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: This step's number; whether its saves are held until the outcome of its loads (or of
    #: an earlier step's) is known; and the held steps now known: put (True) or drop.
    step: int = -1
    hold: bool = False
    verdicts: dict[int, bool] = field(default_factory=dict)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers say of a step: the steps they loaded in, those in which a load failed
    (on any worker: vLLM joins the workers' metadata with :meth:`aggregate`), and the saves
    they could not make (no room in the backlog or on the device): ``(request, first block,
    engine hashes)``, saved again while the request runs."""

    steps: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    lost: list[tuple[str, int, list[bytes]]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPoolWorkerMetadata):
            return self
        return KVPoolWorkerMetadata(self.steps | other.steps, self.failed | other.failed, self.lost + other.lost)


__all__ = ["KVPoolConnectorMetadata", "KVPoolWorkerMetadata"]
