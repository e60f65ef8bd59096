"""Mutual authentication of peer connections with the pool's shared secret.

Both sides prove they hold the token without sending it: each sends a random nonce and
answers the other's with ``HMAC-SHA256(token, label | nonce_other | nonce_own)``. A peer
that cannot answer, answers wrongly or stalls past the deadline is disconnected.

The handshake also derives a key for the connection, ``HMAC-SHA256(token, "session" |
client nonce | server nonce)``, that only the two ends can compute. Every block sent on the
connection carries a keyed BLAKE3 MAC under it (:func:`block_mac`) over the request id, the
block's index, key, size, checksum and tenant, and every byte of the block. A node that
relays someone else's handshake (a fake holder written into the index) can pass the
handshake, but cannot make one block the fetching node accepts.

Node records in the index are signed with the token as well (:func:`sign_node`), so a
writer to Redis without it cannot add a holder that peers would contact.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from typing import Any

import blake3

from kvpool_sidecar.config import read_secret

NONCE_BYTES = 32
PROOF_BYTES = 32
_SERVER = b"kvpool-peer-v1-server"
_CLIENT = b"kvpool-peer-v1-client"
_SESSION = b"kvpool-peer-v2-session"
_NODE = b"kvpool-node-v1"
MAC_BYTES = 32
_BLOCK = struct.Struct("<QIQQ")


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read the pool's secret; at least 16 bytes after stripping whitespace."""
    return read_secret(path, "peer.token_file")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, server_side: bool, theirs: bytes, ours: bytes) -> bytes:
    label = _SERVER if server_side else _CLIENT
    return hmac.new(token, label + theirs + ours, hashlib.sha256).digest()


def check(token: bytes, server_side: bool, theirs: bytes, ours: bytes, answer: bytes) -> bool:
    """Whether ``answer`` is the proof the *other* side owes us."""
    expected = proof(token, not server_side, ours, theirs)
    return hmac.compare_digest(expected, answer)


def session_key(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The connection's key: only holders of the token who saw both nonces compute it."""
    return hmac.new(token, _SESSION + client_nonce + server_nonce, hashlib.sha256).digest()


def block_mac(key: bytes, rid: int, index: int, block_key: bytes, size: int, csum: int, tenant: str) -> Any:
    """A keyed BLAKE3 hasher primed with the block's header; update it with the bytes."""
    h = blake3.blake3(key=key)
    h.update(_BLOCK.pack(rid & (2**64 - 1), index, size, csum & (2**64 - 1)))
    h.update(block_key)
    h.update(tenant.encode("utf-8"))
    return h


def sign_node(token: bytes, pool: str, node: str, address: str, stamp: str) -> str:
    """The signature of a node record (hex): its name, address and heartbeat time."""
    msg = b"\0".join(x.encode("utf-8") for x in (pool, node, address, stamp))
    return hmac.new(token, _NODE + msg, hashlib.sha256).hexdigest()


def check_node(token: bytes, pool: str, node: str, address: str, stamp: str, sig: str) -> bool:
    return hmac.compare_digest(sign_node(token, pool, node, address, stamp), sig)
