"""Mutual authentication of peer connections with the pool's shared secret.

Both sides prove they hold the token without sending it: each sends a random nonce and
answers the other's with ``HMAC-SHA256(token, label | nonce_other | nonce_own)``. A peer
that cannot answer, answers wrongly or stalls past the deadline is disconnected.

The handshake also derives a key for the connection, ``HMAC-SHA256(token, "session" |
client nonce | server nonce)``, that only the two ends can compute. Every block sent on the
connection carries a MAC under it (:class:`BlockMac`) over the request id, the block's index,
key, size, checksum and tenant, and every byte of the block: AES-256-GMAC (GCM over
authenticated data only, NIST SP 800-38D), which OpenSSL computes with the CPU's carry-less
multiply at several times the speed of a keyed BLAKE3 on one core. A node that relays
someone else's handshake (a fake holder written into the index) can pass the handshake, but
cannot make one block the fetching node accepts.

GMAC must never use one nonce twice under a key. The *sender* picks each block's nonce from
a counter of its own for the connection (:class:`Sealer`: nothing the other side sends
chooses it) and sends it beside the tag; the receiver checks the tag under the nonce it is
given. A forged or altered nonce fails the tag like altered bytes do, and a block replayed
from an earlier answer fails it too: the MAC covers the request id, which the receiver
picked at random for each request (:func:`new_request_id`), so that a relay on the path
cannot ask the holder ahead of time for an answer under an id the receiver will use later.

Every control frame on the connection (a request, an answer's header) carries a MAC too
(:class:`FrameSeal`): HMAC-SHA256 under the connection's key over the frame's bytes and its
place in its direction's sequence, after the msgpack body and checked before any of it is
decoded (a forged frame had been decoded whole, up to 16 MiB of lists, and encoded again for
its MAC: about a second of the event loop each). A host on the path can neither slip in a request of its own (it
would read the answer's blocks) nor rewrite an answer's header, whose sizes and tenants
decide the room a fetch reserves, and may evict for, before any block's MAC is checked;
nor replay or drop a frame without the next one failing.

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

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvpool_client.protocol import HEADER, encode
from kvpool_sidecar.config import read_secret

NONCE_BYTES = 32
PROOF_BYTES = 32
_SERVER = b"kvpool-peer-v1-server"
_CLIENT = b"kvpool-peer-v1-client"
_SESSION = b"kvpool-peer-v2-session"
_NODE = b"kvpool-node-v1"
_FRAME = (b"kvpool-frame-v3-request", b"kvpool-frame-v3-answer")
#: A control frame's MAC: HMAC-SHA256, first bytes.
FRAME_TAG_BYTES = 16
#: A block's MAC on the wire: the sender's nonce, then the GMAC tag.
NONCE_LEN = 12
TAG_LEN = 16
MAC_BYTES = NONCE_LEN + TAG_LEN
_BLOCK = struct.Struct("<QIQQ")
_NONCE = struct.Struct("<4sQ")
_NONCE_LABEL = b"kvpb"
#: A node record's signature: HMAC-SHA256 in hex.
SIG_HEX_LEN = 64


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read the pool's secret; at least 16 bytes after stripping whitespace."""
    return read_secret(path, "peer.token_file")


def new_request_id() -> int:
    """A fetch's request id: random, so that nobody who watched or relayed the earlier requests
    of a connection can ask the holder for an answer under an id the fetching node will use
    later and play it back then (requests are not MACed; the answers' MACs cover the id)."""
    return secrets.randbits(63)


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


class Sealer:
    """A sender's side of one connection: its key, and a counter that gives every block it
    MACs a nonce of its own (nothing the other side sends chooses it)."""

    __slots__ = ("key", "_next")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._next = 0

    def mac(self, rid: int, index: int, block_key: bytes, size: int, csum: int, tenant: str) -> BlockMac:
        """A new block's MAC, under the next nonce."""
        nonce = _NONCE.pack(_NONCE_LABEL, self._next)
        self._next += 1
        return BlockMac(self.key, rid, index, block_key, size, csum, tenant, nonce)


class BlockMac:
    """One block's MAC: AES-256-GMAC under the connection's key and a nonce, primed with the
    block's header; :meth:`update` it with the bytes, in as many pieces as they come.

    :meth:`digest` is what goes on the wire (nonce and tag, :data:`MAC_BYTES`); a receiver
    builds its own from the nonce the sender sent and compares the two with
    ``hmac.compare_digest``.
    """

    __slots__ = ("_ctx", "_nonce", "_digest")

    def __init__(self, key: bytes, rid: int, index: int, block_key: bytes, size: int, csum: int, tenant: str,
                 nonce: bytes) -> None:
        if len(key) != 32 or len(nonce) != NONCE_LEN:
            raise ValueError("a block MAC needs a 32-byte key and a 12-byte nonce")
        self._nonce = nonce
        self._digest: bytes | None = None
        self._ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._ctx.authenticate_additional_data(
            _BLOCK.pack(rid & (2**64 - 1), index, size, csum & (2**64 - 1)) + block_key + tenant.encode("utf-8"))

    @property
    def nonce(self) -> bytes:
        return self._nonce

    def update(self, data: Any) -> None:
        self._ctx.authenticate_additional_data(data)

    def digest(self) -> bytes:
        if self._digest is None:
            self._ctx.finalize()
            self._digest = self._nonce + self._ctx.tag
        return self._digest


class FrameSeal:
    """One end's MACs of a connection's control frames: it seals the frames it sends (a tag
    after the msgpack body, within the frame's length) and checks those it receives, each
    direction counted on its own, before they are decoded. ``client``: the end that sends
    requests and receives answers."""

    __slots__ = ("key", "_labels", "_sent", "_received")

    def __init__(self, key: bytes, *, client: bool) -> None:
        self.key = key
        self._labels = _FRAME if client else _FRAME[::-1]  # (what it sends, what it receives)
        self._sent = self._received = 0

    def _tag(self, label: bytes, count: int, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self.key, label + count.to_bytes(8, "little"), hashlib.sha256)
        mac.update(payload)
        return mac.digest()[:FRAME_TAG_BYTES]

    def seal(self, body: list[Any]) -> bytes:
        """The frame that sends ``body``: its length, its msgpack bytes, their tag."""
        return self.seal_payload(encode(body)[HEADER.size:])

    def seal_payload(self, payload: bytes) -> bytes:
        """The frame that sends the msgpack bytes ``payload`` (:meth:`seal`)."""
        tag = self._tag(self._labels[0], self._sent, payload)
        self._sent += 1
        return HEADER.pack(len(payload) + FRAME_TAG_BYTES) + payload + tag

    def open(self, frame: bytes | memoryview) -> memoryview | None:
        """The msgpack bytes of a received frame (what follows its length), its tag checked
        and taken off; None when the tag is not the next frame's from the other end (forged,
        altered, replayed or out of turn): the connection must end, nothing of it decoded."""
        view = memoryview(frame)
        if view.nbytes < FRAME_TAG_BYTES:
            return None
        payload, tag = view[:-FRAME_TAG_BYTES], view[-FRAME_TAG_BYTES:]
        if not hmac.compare_digest(self._tag(self._labels[1], self._received, payload), bytes(tag)):
            return None
        self._received += 1
        return payload


def block_mac(key: bytes, rid: int, index: int, block_key: bytes, size: int, csum: int, tenant: str,
              nonce: bytes) -> BlockMac:
    """A receiver's MAC of one block under the connection's ``key``, with the ``nonce`` its
    sender chose (see :class:`BlockMac`); raises ValueError for a nonce of the wrong size."""
    return BlockMac(key, rid, index, block_key, size, csum, tenant, nonce)


def sign_node(token: bytes, pool: str, node: str, address: str, stamp: str) -> str:
    """The signature of a node record (hex): its name, address and heartbeat time."""
    msg = b"\0".join(x.encode("utf-8") for x in (pool, node, address, stamp))
    return hmac.new(token, _NODE + msg, hashlib.sha256).hexdigest()


def check_node(token: bytes, pool: str, node: str, address: str, stamp: str, sig: str) -> bool:
    """Whether ``sig`` signs the record; False, never an exception, for any string a writer to
    Redis may put there (``hmac.compare_digest`` refuses str that is not ASCII)."""
    if len(sig) != SIG_HEX_LEN or not sig.isascii():
        return False
    return hmac.compare_digest(sign_node(token, pool, node, address, stamp).encode("ascii"), sig.encode("ascii"))
