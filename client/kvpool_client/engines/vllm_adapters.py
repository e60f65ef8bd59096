"""The block hashes of the vLLM connector's requests that run a LoRA adapter: vLLM's hashes
keyed with the identity of the adapter's files.

``cache_salt`` is already in vLLM's block hash, and so are an adapter's name and path; its
weights are not (one path holds other weights on another deployment, or after an update in
place), so :class:`AdapterHashes` keys each such request's hashes with the files' identity
(:class:`~kvpool_client.engines.weights.AdapterIdentities`, pinned for the engine's life)
and says when a request's adapter files changed since. The connector is
:class:`~kvpool_client.engines.vllm.KVPoolConnector`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool_client.engines.weights import AdapterIdentities

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class _Keyed:
    """A running request's block hashes (vLLM's) and the same keyed with its adapter's
    identity (``key``; None: the request uses no pool blocks)."""

    key: bytes | None
    raw: list[bytes] = field(default_factory=list)
    mixed: list[bytes] = field(default_factory=list)


def adapter_of(lora: Any) -> tuple[object, str]:
    """What an engine loads an adapter's weights once for: its id (and path)."""
    return getattr(lora, "lora_int_id", None), str(getattr(lora, "lora_path", "") or "")


def adapter_hash(identity: bytes, block_hash: bytes) -> bytes:
    """A block hash of a request with a LoRA adapter, keyed with the adapter files' identity
    (``b""`` where its path is no local directory: vLLM's hash, which holds the adapter's name
    and path, is then all that names it)."""
    return hashlib.blake2b(block_hash, digest_size=32, key=identity, person=b"kvpool-lora").digest()


class AdapterHashes:
    """Per running request with a LoRA adapter: its hashes keyed with the adapter's identity."""

    def __init__(self) -> None:
        self.identities = AdapterIdentities()
        self._requests: dict[str, _Keyed] = {}

    def hashes(self, rid: str, lora: Any, hashes: list[bytes]) -> list[bytes]:
        """``hashes`` keyed with the identity of the adapter's files, pinned for the engine's
        life (:class:`~kvpool_client.engines.weights.AdapterIdentities`); none at all for a
        request first seen after its adapter's files changed. Kept per request (a request
        seen before keeps its hashes, so that a load planned for it is still made, refused:
        see :meth:`KVPoolConnector.get_num_new_matched_tokens
        <kvpool_client.engines.vllm.KVPoolConnector.get_num_new_matched_tokens>` and
        :meth:`~kvpool_client.engines.vllm.KVPoolConnector.build_connector_meta`), and made
        again from the first hash vLLM changed (a streamed request's input)."""
        known = self._requests.get(rid)
        if known is None:
            path = str(getattr(lora, "lora_path", "") or "")
            identity = self.identities.pin(adapter_of(lora), path)
            known = self._requests[rid] = _Keyed(None if identity is None else bytes.fromhex(identity))
        if known.key is None:
            return []
        n = len(known.raw)
        if n and (n > len(hashes) or known.raw[n - 1] != hashes[n - 1]):
            same = next((i for i, (a, b) in enumerate(zip(known.raw, hashes)) if a != b), min(n, len(hashes)))
            del known.raw[same:], known.mixed[same:]
        key = known.key
        known.mixed.extend(adapter_hash(key, h) for h in hashes[len(known.raw):])
        known.raw.extend(hashes[len(known.raw):])
        return list(known.mixed)

    def changed(self, request: Request, *, look: bool = False) -> bool:
        """Whether the request's adapter's files changed since the engine first saw them;
        ``look``: read their stamp now (a few ``stat`` calls) rather than go by what earlier
        requests found."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return False
        adapter = adapter_of(lora)
        if look and adapter not in self.identities.changed:
            self.identities.pin(adapter, adapter[1])
        return adapter in self.identities.changed

    def finished(self, rid: str) -> None:
        """The request is done: its hashes are forgotten."""
        self._requests.pop(rid, None)


__all__ = ["AdapterHashes", "adapter_hash", "adapter_of"]
