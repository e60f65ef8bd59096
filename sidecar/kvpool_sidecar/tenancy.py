"""Key spaces: blocks of different tenants never mix unless the pool says they may share.

Every tenant belongs to a key space (its own name unless ``tenants[].key_space`` names a
shared one). A client's block key is turned into the store's key by a keyed BLAKE2b whose
key derives from the key space, at the local API's edge, before the store, the index or a
peer sees it. Two tenants in different spaces that send the same key therefore address
different blocks, and no client can name another space's block: it chooses only the input
of its own space's hash, and finding an input whose hash equals another space's key is a
preimage of BLAKE2b.

The mapping depends only on the key space's name, so every node of a pool (and a node
restarting on a warm disk) maps a key the same way, and a space's blocks keep their keys
when other spaces come or go. A pool with a single key space maps its keys too (about half
a microsecond a key): had it kept the client's keys as they came, a client could name any
store key, and so read the blocks another space had left behind, on a node's disk or on a
peer still configured with that space, after the pool went down to one space (anyone can
compute another space's keys: the mapping is keyed by the space's name, not a secret).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_sidecar.config import read_secret

_PERSON = b"kvpool-keyspace"


def _space_key(space: str) -> bytes:
    return hashlib.blake2b(space.encode(), digest_size=32, person=_PERSON).digest()


class KeySpaces:
    """Store keys for each tenant's client keys."""

    def __init__(self, spaces: Mapping[str, str]) -> None:
        """``spaces``: tenant name -> key space name."""
        self.isolated = len(set(spaces.values())) > 1
        self._spaces = dict(spaces)
        self._hashers = {tenant: hashlib.blake2b(digest_size=RAW_KEY_BYTES, key=_space_key(space))
                         for tenant, space in spaces.items()}

    def space(self, tenant: str) -> str:
        return self._spaces.get(tenant, tenant)

    def scoped(self, tenant: str, keys: list[bytes]) -> list[bytes]:
        """The store keys of ``keys`` sent by a client of ``tenant`` (same order).

        Anything that is not a key passes through unchanged; it is found nowhere anyway.
        """
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


@dataclass(frozen=True)
class Credentials:
    """What the kernel says of a Unix-socket client (SO_PEERCRED at accept time)."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class _Rules:
    uids: frozenset[int]
    gids: frozenset[int]
    token: bytes | None

    @property
    def open(self) -> bool:
        return not self.uids and not self.gids and self.token is None


class TenantAccess:
    """Who may act as which tenant: proved by the kernel or a secret, never by a name.

    A client names a tenant in its HELLO; it is admitted when its peer credentials match
    the tenant's ``uids`` or ``gids``, or it presents the tenant's token. A tenant with no
    rule admits any Unix-socket client (the socket's permissions decide who that is) and no
    TCP client. Refusals say the same for an unknown tenant and a wrong proof.
    """

    def __init__(self, rules: Mapping[str, _Rules], shared_arena: str = "per-space") -> None:
        self._rules = dict(rules)
        self.shared_arena = shared_arena

    @classmethod
    def from_settings(cls, tenants: Sequence[object], shared_arena: str = "per-space") -> TenantAccess:
        rules: dict[str, _Rules] = {}
        for i, t in enumerate(tenants):
            name = str(getattr(t, "name"))
            token_file = getattr(t, "token_file", None)
            token = read_secret(token_file, f"tenants[{i}].token_file") if token_file else None
            rules[name] = _Rules(frozenset(getattr(t, "uids", ())), frozenset(getattr(t, "gids", ())), token)
        return cls(rules, shared_arena)

    @classmethod
    def with_tokens(cls, tokens: Mapping[str, bytes], shared_arena: str = "per-space") -> TenantAccess:
        """Tenants admitted by a token alone (and over TCP)."""
        rules = {name: _Rules(frozenset(), frozenset(), token) for name, token in tokens.items()}
        return cls(rules, shared_arena)

    def admits(self, tenant: object, token: object, cred: Credentials | None) -> bool:
        """Whether this client may act as ``tenant`` (``cred`` None: a TCP client)."""
        rules = self._rules.get(tenant) if isinstance(tenant, str) else None
        if rules is None:
            return False
        if isinstance(token, str):
            token = token.encode()
        if rules.token is not None and isinstance(token, bytes) and hmac.compare_digest(rules.token, token):
            return True
        if cred is None:
            return False  # TCP: only a token proves anything
        if rules.open:
            return True
        return cred.uid in rules.uids or cred.gid in rules.gids

    def may_map_arena(self) -> bool:
        """Whether admitted Unix-socket clients get their DRAM arena mapped (with
        ``per-space``, the store keeps one arena per key space: a client's own)."""
        return self.shared_arena != "never"
