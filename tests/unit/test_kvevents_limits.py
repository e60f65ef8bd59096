"""What the KV-event publisher may be made to hold or do: the size of its batches (what a
subscriber that stops reading holds) and its replay loop under a flood of requests
(tests/integration/test_kv_events.py floods a real sidecar's replay socket)."""

from __future__ import annotations

import asyncio
from array import array
from collections import Counter
from typing import Any

import msgspec
import pytest

from kvpool_sidecar.bucket import TokenBucket
from kvpool_sidecar.config import KvEventsSettings
from kvpool_sidecar.events import EngineEvent, EngineEventQueue, EngineRef
from kvpool_sidecar.kvevents import KvEventPublisher
from tests.conftest import LoopTurns
from tests.unit.store_support import until

PAST_NEWEST = ((1 << 63) - 1).to_bytes(8, "big")
FROM_ZERO = (0).to_bytes(8, "big")


def _done(value: Any) -> asyncio.Future[Any]:
    """A future finished already, as pyzmq's asyncio socket returns one when it can."""
    f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    f.set_result(value)
    return f


class _Sent:
    """A PUB socket that keeps what it is given."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> asyncio.Future[None]:
        self.messages.append(frames)
        return _done(None)


class _Flooded(Exception):
    pass


class _Flood:
    """A replay ROUTER socket with the next request always waiting (a receive, and a send,
    completes at once, as pyzmq's do then), until ``requests`` are all read; notes the
    loop's turn at each receive and send."""

    def __init__(self, requests: list[list[bytes]], turns: LoopTurns) -> None:
        self.requests = iter(requests)
        self.turns = turns
        self.received: list[int] = []
        self.sent: list[tuple[int, list[Any]]] = []

    def recv_multipart(self) -> asyncio.Future[list[bytes]]:
        frames = next(self.requests, None)
        if frames is None:
            raise _Flooded
        self.received.append(self.turns.count)
        return _done(frames)

    def send_multipart(self, frames: list[Any]) -> asyncio.Future[None]:
        self.sent.append((self.turns.count, frames))
        return _done(None)


def _publisher(events: list[EngineEvent] | None = None, **settings: Any) -> KvEventPublisher:
    async def snapshot() -> list[EngineEvent]:
        return list(events or [])

    s = KvEventsSettings(enabled=True, replay_endpoint="tcp://127.0.0.1:0", **settings)
    return KvEventPublisher(s, EngineEventQueue(100_000, Counter()), snapshot, "n1")


def _long_blocks(n: int) -> list[EngineEvent]:
    """A chain of ``n`` blocks as long as a client may state them: 4,096 token ids of 5 bytes
    each (65,536 and up), 64-byte hashes, a LoRA name and extra keys."""
    hashes = [i.to_bytes(64, "big") for i in range(1, n + 1)]
    return [EngineEvent(True, "dram", "t", EngineRef(
        hash=h, parent=hashes[i - 1] if i else None, token_ids=array("I", range(70_000 + i, 74_096 + i)),
        block_size=4096, lora_name="a" * 128, extra_keys=("s" * 128,))) for i, h in enumerate(hashes)]


@pytest.mark.parametrize("path", ["queued", "resync"])
async def test_a_batch_of_long_blocks_is_cut_by_its_size_and_every_event_arrives_in_order(path: str) -> None:
    """``kv_events.hwm`` (256) bounds the batches a subscriber that stops reading holds, not
    their bytes: 1,024 blocks of 4,096 token ids had made one batch of 20 MiB (a stalled
    subscriber held 1.4 GiB). Every batch is now small enough that 256 of them stay within
    64 MiB, and the chain still arrives whole, in order, each part naming its parent."""
    blocks = _long_blocks(1100)
    removed = [EngineEvent(False, "dram", "t", e.engine) for e in blocks]
    pub = _publisher(blocks if path == "resync" else None)
    pub._pub = sent = _Sent()  # type: ignore[assignment]  # noqa: SLF001
    if path == "resync":
        await pub._resync()  # noqa: SLF001
        for ev in removed:
            pub.queue.put(False, ev.tier, ev.tenant, ev.engine)
    else:
        for ev in blocks + removed:
            pub.queue.put(ev.stored, ev.tier, ev.tenant, ev.engine)
    task = asyncio.ensure_future(pub.run())
    try:
        assert await until(lambda: not pub.queue.items)  # (a batch goes out as it leaves the queue)
    finally:
        task.cancel()
    assert pub.queue.counts["kvevents_dropped"] == 0
    sizes = [len(m[2]) for m in sent.messages]
    assert pub.settings.hwm * max(sizes) <= 64 << 20, max(sizes)
    assert [int.from_bytes(m[1], "big") for m in sent.messages] == list(range(len(sent.messages)))
    events = [ev for m in sent.messages for ev in msgspec.msgpack.decode(m[2])[1]]
    if path == "resync":
        assert events[0] == {"type": "AllBlocksCleared"}
        events = events[1:]
    stored = [ev for ev in events if ev["type"] == "BlockStored"]
    assert [h for ev in stored for h in ev["block_hashes"]] == [e.engine.hash for e in blocks]
    assert [t for ev in stored for t in ev["token_ids"]] == [t for e in blocks for t in e.engine.token_ids]
    assert len(stored) > 1
    at = {e.engine.hash: i for i, e in enumerate(blocks)}
    firsts = [at[ev["block_hashes"][0]] for ev in stored]
    assert [ev["parent_block_hash"] for ev in stored] == [blocks[i - 1].engine.hash if i else None for i in firsts]
    assert all(ev["extra_keys"] == [["s" * 128]] * len(ev["block_hashes"]) for ev in stored)
    assert events[len(stored):] == [ev for ev in events if ev["type"] == "BlockRemoved"]
    assert [h for ev in events[len(stored):] for h in ev["block_hashes"]] == [e.engine.hash for e in blocks]


async def test_the_replay_server_gives_the_loop_a_turn_between_requests(loop_turns: LoopTurns) -> None:
    """While requests keep arriving, pyzmq's receive completes at once, and awaiting a
    finished future gives the loop no turn: a flood had frozen the sidecar (every lookup of
    the local API timed out while it lasted). Well-formed, cheap and malformed requests alike."""
    pub = _publisher()
    pub._keep(0, b"batch")  # noqa: SLF001
    pub._seq = 1  # noqa: SLF001
    kinds = [[b"c", b"", PAST_NEWEST], [b"c", b"x"], [b"c", b"", b"\x01"], [b"c", b"", FROM_ZERO]]
    sock = _Flood(kinds * 250, loop_turns)
    pub._replay = sock  # type: ignore[assignment]  # noqa: SLF001
    with pytest.raises(_Flooded):
        await pub.serve_replay()
    assert len(sock.received) == 1000
    assert len(set(sock.received)) == 1000, "the loop turned after each request"


async def test_a_long_replay_gives_the_loop_turns_while_it_sends(loop_turns: LoopTurns) -> None:
    pub = _publisher()
    for seq in range(2000):
        pub._keep(seq, seq.to_bytes(4, "big"))  # noqa: SLF001
    pub._seq = 2000  # noqa: SLF001
    sock = _Flood([[b"c", b"", FROM_ZERO]], loop_turns)
    pub._replay = sock  # type: ignore[assignment]  # noqa: SLF001
    with pytest.raises(_Flooded):
        await pub.serve_replay()
    assert len(sock.sent) == 2001  # every batch, then the end marker
    assert len({turn for turn, _ in sock.sent}) >= 2000 // 256


async def test_every_replay_request_costs_the_budget_cheap_and_malformed_ones_too(loop_turns: LoopTurns) -> None:
    """The budget had counted only the batches resent: requests for nothing kept, or
    malformed, cost nothing however many came. Each counts one batch at least now; those
    past the budget are answered without a resend and counted, and only a request for
    batches asks for a resync in their place."""
    pub = _publisher(buffer_steps=4)
    for seq in range(4):
        pub._keep(seq, b"batch")  # noqa: SLF001
    pub._seq = 4  # noqa: SLF001
    pub._resends = TokenBucket(10.0, 10.0, clock=lambda: 0.0)  # noqa: SLF001  # (the settings' budget, time stopped)
    counts = pub.queue.counts
    sock = _Flood([[b"c", b"x"]] * 30 + [[b"c", b"", PAST_NEWEST]] * 30, loop_turns)
    pub._replay = sock  # type: ignore[assignment]  # noqa: SLF001
    with pytest.raises(_Flooded):
        await pub.serve_replay()
    assert counts["kvevents_replays_throttled"] == 30
    assert len(sock.sent) == 30  # the end markers of the well-formed ones
    assert not pub._resync_asked  # noqa: SLF001  # (nothing was missed)
    sock.requests = iter([[b"c", b"", FROM_ZERO]])
    with pytest.raises(_Flooded):
        await pub.serve_replay()
    assert counts["kvevents_replays_throttled"] == 31
    assert [frames[3] for _, frames in sock.sent[30:]] == [(-1).to_bytes(8, "big", signed=True)]  # no batch
    assert pub._resync_asked  # noqa: SLF001


@pytest.mark.parametrize("node", ["n1", "n" * 200])
async def test_a_subscriber_sending_a_subscription_longer_than_any_topic_is_disconnected(node: str) -> None:
    """ZMQ keeps every subscription a subscriber sends, a tree node per byte: 4,000 random
    ones of 4,000 bytes (15 MiB) had grown the sidecar by 742 MiB. A frame longer than the
    topic (at least 128 bytes: handshakes) now disconnects its sender before ZMQ keeps it;
    a subscriber of the topic is served as before."""
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message

    pub = KvEventPublisher(KvEventsSettings(enabled=True, endpoint="tcp://127.0.0.1:0", topic="kv@{node}"),
                           EngineEventQueue(1000, Counter()), _no_snapshot, node)
    await pub.start()
    ctx = zmq.asyncio.Context()
    good, long = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    topic = b"kv@" + node.encode()
    good.setsockopt(zmq.SUBSCRIBE, topic)  # (a command of 10 bytes and the topic: a long node's is 213)
    long.setsockopt(zmq.SUBSCRIBE, topic + b"x" * 200)  # (would match nothing sent here)
    events = long.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    for s in (good, long):
        s.connect(pub.endpoint)
    task = asyncio.ensure_future(pub.run())
    try:
        async with asyncio.timeout(10):
            event = parse_monitor_message(await events.recv_multipart())
        assert event["event"] == zmq.EVENT_DISCONNECTED
        async with asyncio.timeout(10):
            while not await good.poll(50):
                pub.queue.put(True, "dram", "t", EngineRef(hash=b"h" * 8, parent=None, token_ids=array("I", [1, 2]),
                                                           block_size=2))
        assert (await good.recv_multipart())[0] == topic
    finally:
        task.cancel()
        long.disable_monitor()
        for s in (good, long, events):
            s.close(0)
        ctx.term()
        await pub.stop()


async def _no_snapshot() -> list[EngineEvent]:
    return []


def test_an_ipc_endpoint_is_made_under_a_umask_that_gives_others_nothing(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """libzmq binds and listens in one call, before the chmod to 0660: under a umask of 0 a
    process of another user had connected in between, and read every batch after it."""
    import os
    import stat

    import zmq
    import zmq.asyncio

    from kvpool_sidecar import kvevents

    made: list[int] = []
    chmod = os.chmod

    def noting(path: Any, mode: int) -> None:
        made.append(stat.S_IMODE(os.stat(path).st_mode))  # as the bind made it
        chmod(path, mode)

    monkeypatch.setattr(os, "chmod", noting)
    where = tmp_path / "events"
    where.mkdir(mode=0o750)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUB)
    old = os.umask(0)
    try:
        kvevents._bind(sock, "ipc://{}/pub".format(where))  # noqa: SLF001
        assert os.umask(0) == 0  # (the process's umask is left as it was)
    finally:
        os.umask(old)
        sock.close(0)
        ctx.term()
    assert made and not made[0] & 0o007, oct(made[0])
    assert stat.S_IMODE((where / "pub").stat().st_mode) == 0o660
