"""vLLM-format KV events: what this node's pool holds, told to KV-aware routers.

A router that indexes vLLM's KV events (llm-d's scheduler, Dynamo, AIBrix) subscribes to
the sidecar as it would to an engine and learns which prefixes the pool can serve. The
store queues an :class:`~kvpool_sidecar.events.EngineEvent` whenever a block whose writer
gave its engine identity (protocol 3) enters or leaves a tier; :class:`KvEventPublisher`
turns them into vLLM's wire format.

Wire format (what vLLM's ``ZmqEventPublisher`` sends; decode it with vLLM's own
``vllm.distributed.kv_events.KVEventBatch`` or any msgpack decoder):

- PUB socket; every message is three frames: the topic, the sequence number (8 bytes,
  big-endian; 0 at the sidecar's start, one per batch) and a msgpack ``EventBatch``:
  ``[ts (float, Unix seconds), [event, ...], data_parallel_rank (nil)]``. A batch holds at
  most :data:`MAX_BATCH_EVENTS` blocks and :data:`MAX_BATCH_BYTES` bytes (a chain's
  ``BlockStored`` may go on in the next batch, naming its parent as usual).
- ``tagged`` encoding (vLLM's since 2026), every event a map naming its ``type``::

      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
       "token_ids": [t, ...], "block_size": n, "lora_id": int | nil,
       "medium": "CPU" | "STORAGE", "lora_name": str | nil, "extra_keys": [[k, ...] | nil, ...]}
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "CPU" | "STORAGE"}
      {"type": "AllBlocksCleared"}

  ``extra_keys`` (one entry per block) is left out when no block has any; a hash ``h`` is
  whatever the writer gave (vLLM: its block hash bytes, or an int with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
- ``array`` encoding (vLLM before 2026): the same fields, in that order, after the type
  name: ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name
  (, extra_keys)]``, ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``.
- Replay (ROUTER, when ``replay_endpoint`` is set), as vLLM 0.33 answers it: a DEALER
  client sends ``["", first sequence number wanted (8 bytes, big-endian)]``; the answer is
  every batch still kept from there on, each as ``["", topic, seq, batch]``, then ``["", "",
  -1 (8 bytes, signed), ""]``. (A REQ socket takes only the first of several answers.)

What the events mean:

- ``medium`` ``CPU`` is the DRAM tier, ``STORAGE`` the disk tier. A block in both was
  announced in both: a demotion announces ``BlockStored STORAGE`` before ``BlockRemoved
  CPU``, a promotion ``BlockStored CPU``. Consecutive blocks of one chain (each the parent
  of the next) in one tier share one ``BlockStored``, as in vLLM.
- Only blocks whose writer gave an engine identity are announced; the others are silent.
- Sequence 0 is ``AllBlocksCleared``: the DRAM tier starts empty, and blocks adopted from
  disk at start carry no engine identity (it is not written to disk) until a writer names
  them again (a put that finds them held), when they are announced. A draining sidecar
  sends ``AllBlocksCleared`` last.
- The store never waits for the publisher: past ``queue_size`` waiting events, events are
  dropped and counted (``kvevents_dropped``) and the publisher then announces the whole
  state again (``AllBlocksCleared``, then every block), at most once per
  :data:`RESYNC_INTERVAL_S`. No sequence number is skipped, so subscribers see no gap.
- A subscriber that sees a gap asks the replay socket. If it asks for a batch no longer
  kept (``buffer_steps``, ``buffer_bytes``), it gets what is kept (the first answer is then
  later than it asked for: it should forget what it knew of this endpoint), and the whole
  state is announced again on the PUB socket shortly after.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool_sidecar.bucket import TokenBucket
from kvpool_sidecar.config import KvEventsSettings
from kvpool_sidecar.errors import EventPublishError, SidecarError
from kvpool_sidecar.events import EngineEvent, EngineEventQueue, EngineRef
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.sockdir import check_socket_dir

logger = logging.getLogger(__name__)

#: The store's tier names (``tiers.base.TierKind``) and vLLM's medium for each.
MEDIA = {"dram": "CPU", "disk": "STORAGE"}
#: Most block events in one batch.
MAX_BATCH_EVENTS = 1024
#: The most bytes of one batch (unless a single block's event is larger; the largest a
#: client may state is about 30 KiB): a subscriber that stops reading holds at most
#: ``kv_events.hwm`` batches, 64 MiB at the default 256. (A count of events alone did not
#: bound them: a block's token ids may take 20 KiB, 1,024 such blocks 20 MiB, and one
#: stalled subscriber had held 1.4 GiB of the sidecar.)
MAX_BATCH_BYTES = 256 << 10
#: The most a batch's frame adds to its events (its timestamp, an ``AllBlocksCleared``).
BATCH_OVERHEAD_BYTES = 64
#: The most an event adds to its blocks' hashes, token ids, LoRA name and extra keys (the
#: field names, medium, block size, LoRA id, array headers).
EVENT_OVERHEAD_BYTES = 160
#: A replay's batches sent between two turns of the event loop.
REPLAY_SLICE = 256
#: The shortest time between two announcements of the whole state.
RESYNC_INTERVAL_S = 10.0
#: The largest frame a replay request may have (an empty one, then 8 bytes): a larger one
#: disconnects its sender before ZMQ buffers it.
MAX_REQUEST_FRAME_BYTES = 64
#: The largest frame a subscriber may send, where the topic is shorter: its handshake's
#: READY (28 bytes from libzmq's SUB, more from others that name an identity) and its
#: subscriptions. ZMQ keeps a subscriber's every subscription in a tree, a node per byte of
#: each: one connection's 4,000 random subscriptions of 4,000 bytes (15 MiB, under the
#: 4 KiB this was) had grown the sidecar by 742 MiB and held its loop for 1.8 s.
MAX_FRAME_BYTES = 128
#: What precedes the prefix in a subscription sent as a ZMTP 3.1 command.
SUBSCRIBE_COMMAND = b"\x09SUBSCRIBE"
#: Frames of a replay from this size up are sent as references to the kept batches (smaller
#: ones are copied: a reference costs more than a copy of a few hundred bytes).
ZERO_COPY_BYTES = 1024

def _frame(payload: bytes) -> bytes | zmq.Frame:
    """A kept batch as a replay sends it: from :data:`ZERO_COPY_BYTES` up, a frame that
    refers to the kept bytes instead of a copy. A client that asks and never reads holds
    what ZMQ queued for it (up to the high-water mark), which had been a copy of the whole
    buffer per client. (The socket's own ``copy_threshold`` does not reach the socket that
    ``zmq.asyncio`` sends through, which keeps 64 KiB.)"""
    return zmq.Frame(payload, copy=False) if len(payload) >= ZERO_COPY_BYTES else payload


#: The end of a replay: sequence -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long a draining sidecar waits for its last messages to leave.
CLOSE_LINGER_MS = 500

Hash = int | bytes


@dataclass(slots=True)
class _Run:
    """One event being built: stored blocks of one chain, or removed blocks, in one medium."""

    stored: bool
    medium: str
    hashes: list[Hash]
    parent: Hash | None = None
    tokens: list[int] = field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    lora_name: str | None = None
    extra: list[tuple[Any, ...] | None] = field(default_factory=list)

    @classmethod
    def of(cls, ev: EngineEvent, medium: str) -> _Run:
        r = ev.engine
        if not ev.stored:
            return cls(False, medium, [r.hash])
        return cls(True, medium, [r.hash], r.parent, list(r.token_ids), r.block_size, r.lora_id, r.lora_name,
                   [tuple(r.extra_keys) or None])

    def takes(self, ev: EngineEvent, medium: str) -> bool:
        if ev.stored != self.stored or medium != self.medium:
            return False
        r = ev.engine
        return not self.stored or (
            r.parent == self.hashes[-1] and r.block_size == self.block_size and r.lora_id == self.lora_id
            and r.lora_name == self.lora_name and len(self.tokens) == len(self.hashes) * self.block_size)

    def add(self, r: EngineRef) -> None:
        self.hashes.append(r.hash)
        if self.stored:
            self.tokens += r.token_ids
            self.extra.append(tuple(r.extra_keys) or None)


def runs(events: Iterable[EngineEvent]) -> list[_Run]:
    """Events merged as vLLM sends them: a chain's consecutive blocks in one ``BlockStored``."""
    out: list[_Run] = []
    for ev in events:
        medium = MEDIA[ev.tier]
        if out and out[-1].takes(ev, medium):
            out[-1].add(ev.engine)
        else:
            out.append(_Run.of(ev, medium))
    return out


def _packed(value: int | bytes | str | None) -> int:
    """The most bytes msgpack takes for ``value``."""
    if value is None:
        return 1
    if isinstance(value, int):
        return 9
    return 5 + len(value.encode() if isinstance(value, str) else value)


def event_bytes(ev: EngineEvent) -> int:
    """An upper bound of the bytes that ``ev`` adds to an encoded batch (counted as an
    event of its own, each token id as 5 bytes)."""
    r = ev.engine
    if not ev.stored:
        return EVENT_OVERHEAD_BYTES + _packed(r.hash)
    return (EVENT_OVERHEAD_BYTES + 5 * len(r.token_ids) + _packed(r.hash) + _packed(r.parent)
            + _packed(r.lora_name) + sum(_packed(x) for x in r.extra_keys))


def take_batch(items: deque[EngineEvent]) -> list[EngineEvent]:
    """The oldest of ``items``, taken from it, that make one batch: at most
    :data:`MAX_BATCH_EVENTS` events, encoded in at most :data:`MAX_BATCH_BYTES` (by
    :func:`event_bytes`), or the first alone where it is larger."""
    out: list[EngineEvent] = []
    room = MAX_BATCH_BYTES - BATCH_OVERHEAD_BYTES
    while items and len(out) < MAX_BATCH_EVENTS:
        size = event_bytes(items[0])
        if size > room and out:
            break
        room -= size
        out.append(items.popleft())
    return out


def encode_event(run: _Run | None, *, array: bool) -> Any:
    """One event as msgpack-ready data (``None``: ``AllBlocksCleared``)."""
    fields: list[tuple[str, Any]] = []
    if run is None:
        kind = "AllBlocksCleared"
    elif run.stored:
        kind = "BlockStored"
        fields = [("block_hashes", run.hashes), ("parent_block_hash", run.parent), ("token_ids", run.tokens),
                  ("block_size", run.block_size), ("lora_id", run.lora_id), ("medium", run.medium),
                  ("lora_name", run.lora_name)]
        if any(x is not None for x in run.extra):
            fields.append(("extra_keys", run.extra))
    else:
        kind = "BlockRemoved"
        fields = [("block_hashes", run.hashes), ("medium", run.medium)]
    if array:
        return [kind, *(value for _, value in fields)]
    return {"type": kind, **dict(fields)}


#: The mode of an ``ipc://`` endpoint's socket file: the sidecar's user and group (as the
#: local API's socket), whatever the process's umask.
IPC_MODE = 0o660


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; the address bound (a port of 0 or ``*`` resolved). An ``ipc://``
    path goes only in a directory no other user can change, and is made :data:`IPC_MODE`."""
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    path = Path(address[len("ipc://"):]) if address.startswith("ipc://") else None
    if path is not None:
        try:
            check_socket_dir(path.parent)
        except (SidecarError, OSError) as e:
            raise EventPublishError(f"kv_events: {address}: {e}") from e
    if path is None:
        sock.bind(address)
    else:
        # libzmq binds and listens in one call: the file is made under a umask that leaves
        # others nothing, or a process of another user could connect before the chmod (one
        # did, under a umask of 0, and read every batch after it)
        umask = os.umask(0o777)  # (read it: for that instant the umask is the tightest)
        os.umask(umask | 0o007)
        try:
            sock.bind(address)
        finally:
            os.umask(umask)
        os.chmod(path, IPC_MODE)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class KvEventPublisher:
    """Sends the store's engine events as vLLM KV-event batches, and answers replays."""

    def __init__(self, settings: KvEventsSettings, queue: EngineEventQueue,
                 snapshot: Callable[[], Awaitable[list[EngineEvent]]], node: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.queue = queue
        self._snapshot = snapshot
        self._clock = clock
        self._topic = settings.topic.replace("{node}", node).encode()
        self._array = settings.encoding == "array"
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque()
        self._kept_bytes = 0
        self._resync_asked = False
        self._last_resync = float("-inf")
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        #: Batches resent per second, over all replay requests: two whole buffers a second
        #: (past it a request is answered by a full resync on PUB, as one from before the
        #: buffer is), so a flood of requests cannot keep the loop resending.
        self._resends = TokenBucket(2.0 * (settings.buffer_steps + 1), 2.0 * (settings.buffer_steps + 1))
        #: The same in bytes: the kept batches may be few and large (a buffer of 64 MiB in
        #: 640 batches passed the count above 31 times a second).
        self._resent_bytes = TokenBucket(2.0 * settings.buffer_bytes, 2.0 * settings.buffer_bytes)
        #: The addresses bound (or connected to), once started.
        self.endpoint = ""
        self.replay_endpoint: str | None = None

    async def start(self) -> None:
        """Open the sockets and send sequence 0, ``AllBlocksCleared``."""
        s = self.settings
        self._ctx = ctx = zmq.asyncio.Context()
        address = s.endpoint
        try:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, s.hwm)
            # a subscription is a prefix of the topics it wants (a command of 10 bytes and
            # the prefix, from libzmq 4.3.3 on; a flag byte and the prefix before), and one
            # longer than the topic matches nothing sent here: a longer frame disconnects
            # its sender before ZMQ reads it into its subscription tree (see MAX_FRAME_BYTES)
            self._pub.setsockopt(zmq.MAXMSGSIZE, max(MAX_FRAME_BYTES, len(SUBSCRIBE_COMMAND) + len(self._topic)))
            if s.connect:
                self._pub.connect(address)
                self.endpoint = address
            else:
                self.endpoint = _bind(self._pub, address)
            if s.replay_endpoint is not None:
                address = s.replay_endpoint
                self._replay = ctx.socket(zmq.ROUTER)
                # room for a whole replay and its end marker per client (ZMQ counts a
                # pipe's messages as read only every half high-water mark)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (s.buffer_steps + 1))
                # a request is an empty frame and 8 bytes: a larger one disconnects its sender
                # before ZMQ buffers it
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME_BYTES)
                self.replay_endpoint = _bind(self._replay, address)
        except zmq.ZMQError as e:
            self._close(0)
            raise EventPublishError(f"kv_events: cannot open {address}: {e}") from e
        await self._publish([], cleared=True)
        logger.info("KV events on %s (replay: %s, %s encoding)", self.endpoint, self.replay_endpoint or "none",
                     s.encoding)

    def loops(self) -> dict[str, Callable[[], Awaitable[None]]]:
        out: dict[str, Callable[[], Awaitable[None]]] = {"kv-events": self.run}
        if self._replay is not None:
            out["kv-events-replay"] = self.serve_replay
        return out

    # ------------------------------------------------------------ publishing
    async def run(self) -> None:
        """Publish queued events as they come; announce the whole state when asked to."""
        q = self.queue
        while True:
            wait: float | None = None
            if q.lost or self._resync_asked:
                wait = self._last_resync + RESYNC_INTERVAL_S - time.monotonic()
                if wait <= 0:
                    await self._resync()
                    continue
            if not q.items:
                q.ready.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await q.ready.wait()
                continue
            await self._publish(take_batch(q.items))
            await asyncio.sleep(0)  # a long backlog does not keep the clients waiting

    async def _resync(self) -> None:
        """``AllBlocksCleared`` and every block held: a consumer that lost track starts over."""
        q = self.queue
        # the snapshot covers what is queued; what the store does from here on queues after it
        # (while the snapshot is read, a slice per turn of the loop, too: those events say the
        # same as it, or newer)
        q.items.clear()
        q.lost = self._resync_asked = False
        self._last_resync = time.monotonic()
        state = deque(e for e in await self._snapshot() if q.admits(e.tenant))  # (a slice per turn of the loop)
        q.counts["kvevents_resyncs"] += 1
        logger.info("announcing all %d KV events again", len(state))
        cleared = True
        while cleared or state:
            await self._publish(take_batch(state), cleared=cleared)
            cleared = False
            await asyncio.sleep(0)

    async def _publish(self, events: list[EngineEvent], *, cleared: bool = False) -> None:
        body = [encode_event(None, array=self._array)] if cleared else []
        body += [encode_event(r, array=self._array) for r in runs(events)]
        payload = self._encoder.encode([self._clock(), body, None])
        seq = self._seq
        self._seq += 1
        self._keep(seq, payload)
        counts = self.queue.counts
        counts["kvevents_batches"] += 1
        counts["kvevents_events"] += len(events)
        if self._pub is None:
            return
        try:
            await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        except zmq.ZMQError as e:  # PUB drops at its high-water mark instead of failing: rare
            counts["kvevents_send_failed"] += 1
            warn_once(logger, "kv-events-send", "a KV-event batch could not be sent: %s", e)

    def _keep(self, seq: int, payload: bytes) -> None:
        s, kept = self.settings, self._kept
        kept.append((seq, payload))
        self._kept_bytes += len(payload)
        while len(kept) > s.buffer_steps or (self._kept_bytes > s.buffer_bytes and len(kept) > 1):
            self._kept_bytes -= len(kept.popleft()[1])

    # ------------------------------------------------------------ replay
    async def serve_replay(self) -> None:
        """Answer replay requests one at a time, the event loop turning after each."""
        sock = self._replay
        while sock is not None:
            frames = await sock.recv_multipart()
            await self._answer(sock, frames)
            # a receive completes at once while requests wait, and awaiting a finished future
            # gives the loop no turn: a flood of requests had held it (every lookup of the
            # local API timed out while it lasted)
            await asyncio.sleep(0)

    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Answer one request. Each costs the replay budget one batch at least (those for
        nothing kept, and malformed ones, too): past it, requests are answered without a
        resend and counted (``kvevents_replays_throttled``)."""
        if len(frames) != 3 or frames[1]:
            self._resends.take(1)
            warn_once(logger, "kv-replay", "a KV-event replay request of %d frames is malformed; ignored",
                      len(frames))
            return
        client, _, start_raw = frames
        self.queue.counts["kvevents_replays"] += 1
        if len(start_raw) == 8:
            start = int.from_bytes(start_raw, "big")
            oldest = self._kept[0][0] if self._kept else self._seq
            if start < oldest:  # lost for good: the whole state follows on the PUB socket
                self._resync_asked = True
                self.queue.ready.set()
            skip = min(max(0, start - oldest), len(self._kept))  # (the kept batches' sequences follow on)
            resend: list[tuple[int, bytes]] = []
            count = len(self._kept) - skip
            size = sum(len(p) for _, p in itertools.islice(self._kept, skip, None)) if count else 0
            if not self._take_resend(max(count, 1), size):
                self.queue.counts["kvevents_replays_throttled"] += 1
                warn_once(logger, "kv-replay-rate", "KV-event replays are asked for faster than two buffers a "
                          "second; answered without a resend (by a resync on the PUB socket where batches were "
                          "asked for)")
                if count:  # too much asked lately: answered as a request from before the buffer is
                    self._resync_asked = True
                    self.queue.ready.set()
            else:
                resend = list(itertools.islice(self._kept, skip, None))  # (the publisher goes on while this sends)
            for i, (seq, payload) in enumerate(resend, 1):
                await sock.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), _frame(payload)])
                if i % REPLAY_SLICE == 0:
                    await asyncio.sleep(0)  # (a send completes at once too)
        else:
            self._resends.take(1)
            warn_once(logger, "kv-replay", "a KV-event replay request's sequence is %d bytes, not 8", len(start_raw))
        await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    def _take_resend(self, count: int, size: int) -> bool:
        """Whether ``count`` batches of ``size`` bytes may be resent now (both buckets; a
        request one of them refuses takes nothing from the other)."""
        if not self._resends.take(count):
            return False
        if not self._resent_bytes.take(size):
            self._resends.give(count)
            return False
        return True

    # ------------------------------------------------------------ shutdown
    async def stop(self) -> None:
        """Say ``AllBlocksCleared`` (this node's pool is going away), then close."""
        if self._pub is not None:
            await self._publish([], cleared=True)
        ctx = self._close(CLOSE_LINGER_MS)
        if ctx is not None:
            await asyncio.to_thread(ctx.term)  # waits up to the linger for the last messages

    def _close(self, linger_ms: int) -> zmq.asyncio.Context | None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._pub = self._replay = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None and linger_ms == 0:
            ctx.term()
            return None
        return ctx
