"""Key spaces: blocks of different tenants never mix unless the pool says they may share.

Every tenant belongs to a key space (its own name unless ``tenants[].key_space`` names a
shared one). A client's block key is turned into the store's key by a keyed BLAKE2b whose
key derives from the key space, at the local API's edge, before the store, the index or a
peer sees it. Two tenants in different spaces that send the same key therefore address
different blocks, and no client can name another space's block: it chooses only the input
of its own space's hash, and finding an input whose hash equals another space's key is a
preimage of BLAKE2b.

The mapping depends only on the key space's name, so every node of a pool (and a node
restarting on a warm disk) maps a key the same way. A pool with a single key space keeps
the client's keys unchanged and pays nothing; declaring a second space re-keys the
existing one, whose earlier blocks then read as misses (never as another tenant's bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from kvpool_client.keys import RAW_KEY_BYTES

_PERSON = b"kvpool-keyspace"


def _space_key(space: str) -> bytes:
    return hashlib.blake2b(space.encode(), digest_size=32, person=_PERSON).digest()


class KeySpaces:
    """Store keys for each tenant's client keys."""

    def __init__(self, spaces: Mapping[str, str]) -> None:
        """``spaces``: tenant name -> key space name."""
        self.isolated = len(set(spaces.values())) > 1
        self._spaces = dict(spaces)
        self._hashers = {
            tenant: hashlib.blake2b(digest_size=RAW_KEY_BYTES, key=_space_key(space))
            for tenant, space in spaces.items()
        } if self.isolated else {}

    def space(self, tenant: str) -> str:
        return self._spaces.get(tenant, tenant)

    def scoped(self, tenant: str, keys: list[bytes]) -> list[bytes]:
        """The store keys of ``keys`` sent by a client of ``tenant`` (same order).

        Anything that is not a key passes through unchanged; it is found nowhere anyway.
        """
        if not self.isolated:
            return keys
        hasher = self._hashers.get(tenant)
        if hasher is None:
            hasher = self._hashers[tenant] = hashlib.blake2b(digest_size=RAW_KEY_BYTES,
                                                            key=_space_key(self.space(tenant)))
        out = []
        for k in keys:
            if type(k) is bytes and len(k) == RAW_KEY_BYTES:
                h = hasher.copy()
                h.update(k)
                out.append(h.digest())
            else:
                out.append(k)
        return out
