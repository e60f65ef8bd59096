"""Mutual authentication of peer connections with the pool's shared secret.

Both sides prove they hold the token without sending it: each sends a random nonce and
answers the other's with ``HMAC-SHA256(token, label | nonce_other | nonce_own)``. A peer
that cannot answer, answers wrongly or stalls past the deadline is disconnected.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from kvpool_sidecar.errors import ConfigError

NONCE_BYTES = 32
PROOF_BYTES = 32
_SERVER = b"kvpool-peer-v1-server"
_CLIENT = b"kvpool-peer-v1-client"


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read the pool's secret; at least 16 bytes after stripping whitespace."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"peer.token_file: cannot read {path}: {e.strerror}") from e
    if len(token) < 16:
        raise ConfigError(f"peer.token_file: the token in {path} is shorter than 16 bytes")
    return token


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, server_side: bool, theirs: bytes, ours: bytes) -> bytes:
    label = _SERVER if server_side else _CLIENT
    return hmac.new(token, label + theirs + ours, hashlib.sha256).digest()


def check(token: bytes, server_side: bool, theirs: bytes, ours: bytes, answer: bytes) -> bool:
    """Whether ``answer`` is the proof the *other* side owes us."""
    expected = proof(token, not server_side, ours, theirs)
    return hmac.compare_digest(expected, answer)
