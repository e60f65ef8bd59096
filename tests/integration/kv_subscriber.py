"""A KV-event consumer as a router runs one, for the tests: a ZMQ SUB socket for the live
stream and a DEALER on the replay socket for gaps; batches are applied in sequence order.

Decoding is the caller's: vLLM's own ``KVEventBatch`` decoder, or msgspec structs of the
documented schema. Events are read by their class name (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so both kinds of decoded objects work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import zmq

from tests.integration.support import DEADLINE_S, wait_until

Decode = Callable[[bytes], Any]
END_SEQ = -1


class KvSubscriber:
    def __init__(self, endpoint: str, replay: str | None, decode: Decode, *, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decode = decode
        #: ``(seq, topic, batch)`` in the order applied; ``live``: the seqs that came on SUB.
        self.batches: list[tuple[int, bytes, Any]] = []
        self.live: set[int] = set()
        self.next_seq = 0

    # ------------------------------------------------------------ reading
    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq >= self.next_seq:  # (a batch seen twice, on SUB and in a replay, counts once)
            self.batches.append((seq, topic, self.decode(payload)))
            self.next_seq = seq + 1

    def drain(self) -> int:
        """Apply what arrived on SUB; a gap is filled from the replay socket first."""
        n = 0
        while self.sub.poll(0):
            topic, seq_raw, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_raw, "big")
            if seq > self.next_seq and self.replay_endpoint is not None:
                self.catch_up()
            self.live.add(seq)
            self._apply(topic, seq, payload)
            n += 1
        return n

    def replay(self, start: int) -> list[tuple[bytes, int, bytes]]:
        """One replay request: every answer up to the end marker, as ``(topic, seq, payload)``."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(int(DEADLINE_S * 1000)), "no answer from the replay socket"
                empty, topic, seq_raw, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq == END_SEQ:
                    assert topic == b"" and payload == b""
                    return out
                out.append((topic, seq, payload))
        finally:
            dealer.close(linger=0)

    def catch_up(self) -> None:
        for topic, seq, payload in self.replay(self.next_seq):
            self._apply(topic, seq, payload)

    def poll(self) -> None:
        self.drain()
        if self.replay_endpoint is not None:
            self.catch_up()

    def until(self, pred: Callable[[KvSubscriber], bool], what: str) -> None:
        """Read (SUB, then replay) until ``pred`` holds; fail at the tests' deadline."""
        wait_until(lambda: self.poll() or pred(self), what)

    def warm_up(self, probe: Callable[[], object]) -> None:
        """Make ``probe`` publish until one of its batches comes on SUB: from then on the
        subscription is live (a SUB socket that just connected misses what is sent before)."""
        wait_until(lambda: probe() or self.drain() > 0, "the SUB socket to receive")

    # ------------------------------------------------------------ what it learned
    def events(self) -> Iterator[tuple[int, Any]]:
        for seq, _, batch in self.batches:
            for ev in batch.events:
                yield seq, ev

    def state(self) -> set[tuple[Any, str]]:
        """``(hash, medium)`` held, after every event applied in order."""
        held: set[tuple[Any, str]] = set()
        for _, ev in self.events():
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                held.clear()
            elif kind == "BlockStored":
                held |= {(h, ev.medium) for h in ev.block_hashes}
            elif kind == "BlockRemoved":
                held -= {(h, ev.medium) for h in ev.block_hashes}
        return held

    def history(self, block_hash: Any) -> list[tuple[str, str]]:
        """``(event, medium)`` of every event that names ``block_hash``, in order."""
        return [(type(ev).__name__, ev.medium) for _, ev in self.events()
                if block_hash in getattr(ev, "block_hashes", ())]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def kv_config(**kw: Any) -> dict[str, Any]:
    """A ``kv_events`` section on free ports, with replay."""
    return {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0", **kw}
