"""Batches served in pieces, so that the client's copies overlap the sidecar's own work.

A put is two round trips (ALLOC, then COMMIT) with the client's copy between them, and a get
one and a half (ACQUIRE, the copy out, then a RELEASE not waited for); an acquire verifies
what it holds in place after its ACQUIRE. Sent whole, a batch's
copy waits for the sidecar to have served every block of it, and the sidecar then waits
for the copy: on the development machines an ALLOC of 64 blocks took 1.2 ms and its
COMMIT 1.1 ms beside 3 ms of copying 32 MiB. :class:`~kvpool_client.client.PoolClient`
sends such a batch as pieces instead: a few pieces' requests ahead of the one it copies
(:data:`AHEAD`), each piece copied as soon as its answer comes while the sidecar serves the
next, and committed (or released) as soon as it is copied. The first piece is small so the
copying starts early (:data:`FIRST_PIECE_BYTES`); the next ones double up to
:data:`MAX_PIECE_BYTES`, to spread each request's own cost over more blocks. Batches of 64
blocks of 512 KiB, whole against in pieces in one process on the development machines
(median of 40 rounds each, five runs): put 6.3-6.6 against 7.1-7.7 GB/s, get 7.5-7.7
against 8.1-8.6 (the client's checksummed copy alone: 8.5-9.8). An ``acquire`` given the blocks' sizes
(what an engine's load in rounds passes: :class:`~kvpool_client.tensors.HeldRounds`) is
verified in pieces too: 512 blocks of 512 KiB held and verified in place in 21.4 ms whole
against 15.4 in pieces, 2,048 of 64 KiB in 65.4 against 31.9.

Only batches that one thread copies (blocks under a mebibyte on average: see
:mod:`kvpool_client.integrity`) go in pieces: a batch of larger blocks is copied by several
threads, which the pieces' smaller copies would give up, and on a machine of few cores
those threads already keep every core busy. A put of small blocks goes whole too
(:data:`MIN_PUT_BLOCK`): there the sidecar's work per block outweighs the copy, and another
request only adds to it. A put goes in pieces only to a sidecar that says ``put_pieces`` at
HELLO: each piece is an ALLOC of its own, sent before the pieces ahead of it are committed,
and an older sidecar's walk of a put's own chain (the blocks its room must not be made from)
stopped at blocks pending in another request, so a chain put in pieces into a full tier
evicted its own head. A piece holds at most the sidecar's ``max_batch`` keys, and a batch
that goes whole goes in requests of at most that many too (the client cuts :func:`pieces`'
answer, or the whole batch, to it: the sidecar refuses a longer request whole); to an older
sidecar, such a put's requests go one after another, each committed before the next.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_client.integrity import one_thread

#: The first piece's bytes (at least one block): its answer comes soon, and the copying starts.
FIRST_PIECE_BYTES = 2 << 20

#: The most bytes of a later piece (at least one block).
MAX_PIECE_BYTES = 8 << 20

#: Requests of one call in flight ahead of the piece being copied: a few, well under the
#: sidecar's ``api.max_inflight`` (8) with the piece's own COMMIT or RELEASE beside them,
#: so that the sidecar never stops reading the connection while the client sends.
AHEAD = 3

#: Puts of blocks smaller than this on average go whole (see the module's docstring).
MIN_PUT_BLOCK = 256 << 10


def pieces(sizes: Sequence[int], *, put: bool, most: int = 4096) -> list[tuple[int, int]] | None:
    """The pieces (``[start, end)`` indices, of at most ``most`` blocks: the sidecar's
    ``max_batch``) in which a batch of blocks of ``sizes`` bytes goes, or None where it goes
    whole: one piece only, a batch that several threads copy, or a put of small blocks."""
    n = len(sizes)
    total = sum(sizes)
    if n < 2 or not one_thread(sizes) or (put and total < MIN_PUT_BLOCK * n):
        return None
    out: list[tuple[int, int]] = []
    start, budget = 0, FIRST_PIECE_BYTES
    while start < n:
        end, taken = start + 1, sizes[start]
        while end < n and end - start < most and taken + sizes[end] <= budget:
            taken += sizes[end]
            end += 1
        out.append((start, end))
        start, budget = end, min(2 * budget, MAX_PIECE_BYTES)
    return out if len(out) > 1 else None
