"""60 bits of a block key's hash that no client can predict, for what the policy remembers of
keys it no longer holds (ARC's ghosts, the estimator's followed keys, the tail rule's).

Python's ``hash`` of the key alone is keyed by the process's hash seed, which is public where
``PYTHONHASHSEED`` is set (the README asks for it with vLLM's ``xxhash`` schemes, and a
sidecar may inherit it): a client could then search offline for keys that share their bits.
Each process hashes its keys behind a random secret of its own instead.
"""

from __future__ import annotations

import os

#: The secret every key is hashed behind, drawn when the process starts.
_SECRET = os.urandom(16)

#: The bits kept: an int of 32 bytes (CPython's two 30-bit digits).
_BITS = (1 << 60) - 1


def key_hash(key: bytes) -> int:
    """60 bits of ``key``'s hash behind this process's secret."""
    return hash(_SECRET + key) & _BITS
