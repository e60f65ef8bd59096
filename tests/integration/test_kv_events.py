"""vLLM-format KV events from a real sidecar, read by a real ZMQ subscriber.

The tagged encoding is decoded with vLLM's own ``KVEventBatch`` (where vLLM imports), the
array encoding with msgspec structs of the schema ``kvpool_sidecar.kvevents`` documents.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq

from kvpool_client.blockinfo import EngineBlock
from kvpool_client.client import PoolClient
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.process import SidecarProcess
from tests.integration.kv_subscriber import KvSubscriber, kv_config
from tests.integration.support import DEADLINE_S, fresh_keys, payload

pytestmark = pytest.mark.integration

BS = 16
Factory = Callable[..., SidecarProcess]


def _vllm_decoder() -> Callable[[bytes], Any]:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    return msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode


# The array encoding as kvpool_sidecar.kvevents documents it (vLLM's layout before 2026).
class _Event(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_counter = iter(range(1, 1 << 40))


def chain(keys: Sequence[BlockKey], **kw: Any) -> list[EngineBlock | None]:
    """Engine identities for consecutive blocks of one prompt (32-byte hashes, like vLLM's)."""
    base = next(_counter)
    hashes = [base.to_bytes(8, "big") + i.to_bytes(24, "big") for i in range(len(keys))]
    return [EngineBlock(hash=h, parent=hashes[i - 1] if i else None, block_size=BS,
                        token_ids=[(base * 31 + i * BS + t) % 50000 for t in range(BS)], **kw)
            for i, h in enumerate(hashes)]


def hashes(engine: Sequence[EngineBlock | None]) -> list[Any]:
    return [e.hash for e in engine if e is not None]


@pytest.fixture
def subscribers() -> Iterator[Callable[..., KvSubscriber]]:
    made: list[KvSubscriber] = []

    def make(sp: SidecarProcess, decode: Callable[[bytes], Any], **kw: Any) -> KvSubscriber:
        ends = sp.ready["kv_events"]
        s = KvSubscriber(ends["endpoint"], ends["replay_endpoint"], decode, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def counters(sp: SidecarProcess) -> dict[str, int]:
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        return dict(c.stats()["counters"])


def test_stored_blocks_are_announced_with_the_engine_identity(sidecar_factory: Factory,
                                                               subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config(topic="kv@{node}")})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(4)
    engine = chain(keys[:3], lora_id=7, lora_name="adapter-7", extra_keys=("salt",))
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        statuses = c.put(keys, [payload(k, 3000) for k in keys], chain=True, engine=[*engine, None])
    assert statuses == [PutStatus.STORED] * 4
    want = {(h, "CPU") for h in hashes(engine)}
    sub.until(lambda s: s.state() == want, "the three named blocks in CPU")

    seq0, topic, first = sub.batches[0]
    assert (seq0, topic) == (0, b"kv@node0")
    assert [type(e).__name__ for e in first.events] == ["AllBlocksCleared"]  # the pool starts empty
    stored = [ev for _, ev in sub.events() if type(ev).__name__ == "BlockStored"]
    assert len(stored) == 1, "one chain in one tier is one BlockStored, as vLLM sends it"
    ev = stored[0]
    assert ev.block_hashes == hashes(engine)
    assert ev.parent_block_hash is None
    assert ev.token_ids == [t for e in engine if e is not None for t in e.token_ids]
    assert (ev.block_size, ev.medium, ev.lora_id, ev.lora_name) == (BS, "CPU", 7, "adapter-7")
    assert ev.extra_keys == [("salt",)] * 3
    assert all(isinstance(b.ts, float) and b.ts > 0 for _, _, b in sub.batches)
    assert counters(sp)["kvevents_events"] == 3  # the block without an identity is not announced


def test_a_chain_continued_later_names_its_parent(sidecar_factory: Factory,
                                                  subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config()})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(4)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        c.put(keys[:2], [payload(k, 2000) for k in keys[:2]], chain=True, engine=engine[:2])
        c.put(keys[2:], [payload(k, 2000) for k in keys[2:]], chain=True, depth=2, parent=keys[1], engine=engine[2:])
    sub.until(lambda s: len(s.state()) == 4, "four blocks")
    stored = [ev for _, ev in sub.events() if type(ev).__name__ == "BlockStored"]
    assert [(ev.block_hashes, ev.parent_block_hash) for ev in stored] == \
        [(hashes(engine[:2]), None), (hashes(engine[2:]), hashes(engine)[1])]


def test_eviction_announces_the_removal_from_cpu(sidecar_factory: Factory,
                                                 subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"dram": {"size_bytes": "1Mi"}, "kv_events": kv_config()})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(10)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for i, k in enumerate(keys):  # 256 KiB each: four fit, the rest evict the oldest
            assert c.put([k], [payload(k, 200_000)], engine=[engine[i]]) == [PutStatus.STORED]
        held = [h for k, h in zip(keys, hashes(engine)) if c.lookup([k]).prefix == 1]
    assert 0 < len(held) < len(keys)
    sub.until(lambda s: s.state() == {(h, "CPU") for h in held}, "the state the sidecar holds")
    gone = [h for h in hashes(engine) if h not in held]
    for h in gone:
        assert sub.history(h) == [("BlockStored", "CPU"), ("BlockRemoved", "CPU")]


def test_demotion_is_stored_on_storage_before_it_leaves_cpu_and_promotion_comes_back(
        sidecar_factory: Factory, subscribers: Callable[..., KvSubscriber], tmp_path: Path) -> None:
    sp = sidecar_factory({"dram": {"size_bytes": "1Mi", "clean_share": 0},
                          "disk": {"path": str(tmp_path / "disk"), "size_bytes": "64Mi"},
                          "kv_events": kv_config()})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(8)
    engine = chain(keys)
    hs = hashes(engine)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for i, k in enumerate(keys):
            assert c.put([k], [payload(k, 200_000)], engine=[engine[i]]) == [PutStatus.STORED]
        sub.until(lambda s: {h for h, m in s.state() if m == "STORAGE"} and len(s.state()) >= len(hs),
                  "some blocks demoted")
        demoted = [h for h in hs if ("BlockRemoved", "CPU") in sub.history(h)]
        assert demoted
        for h in demoted:
            assert sub.history(h) == [("BlockStored", "CPU"), ("BlockStored", "STORAGE"), ("BlockRemoved", "CPU")]
        # a read of a demoted block promotes it: it is announced in CPU again
        first = hs.index(demoted[0])
        [got] = c.get([keys[first]])
        assert got is not None and bytes(got) == payload(keys[first], 200_000)
    sub.until(lambda s: (demoted[0], "CPU") in s.state(), "the promoted block back in CPU")
    assert sub.history(demoted[0])[-1] == ("BlockStored", "CPU")
    assert (demoted[0], "STORAGE") in sub.state()  # its disk copy stays


def test_a_missed_range_comes_from_the_replay_socket(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"kv_events": kv_config()})
    keys = fresh_keys(2)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # nobody listens yet
        for i, k in enumerate(keys):
            c.put([k], [payload(k, 1000)], engine=[engine[i]])
    decode = _vllm_decoder()
    sub = KvSubscriber(sp.ready["kv_events"]["endpoint"], sp.ready["kv_events"]["replay_endpoint"], decode)
    try:
        answers = sub.replay(0)
        assert [seq for _, seq, _ in answers] == [0, 1, 2]
        batches = [decode(p) for _, _, p in answers]
        assert [type(e).__name__ for e in batches[0].events] == ["AllBlocksCleared"]
        assert [e.block_hashes for b in batches[1:] for e in b.events] == [[h] for h in hashes(engine)]
        assert [seq for _, seq, _ in sub.replay(2)] == [2]
        assert sub.replay(3) == []  # nothing newer: only the end marker
        # a request whose sequence is not 8 bytes gets the end marker, not a hang
        dealer = sub.ctx.socket(zmq.DEALER)
        dealer.connect(sp.ready["kv_events"]["replay_endpoint"])
        dealer.send_multipart([b"", b"\x01"])
        assert dealer.poll(int(DEADLINE_S * 1000))
        assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        dealer.close(linger=0)
    finally:
        sub.close()


def test_a_replay_from_before_the_buffer_announces_everything_again(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"kv_events": kv_config(buffer_steps=2)})
    keys = fresh_keys(5)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for i, k in enumerate(keys):  # batches 1..5; only 4 and 5 are kept
            c.put([k], [payload(k, 1000)], engine=[engine[i]])
    sub = KvSubscriber(sp.ready["kv_events"]["endpoint"], sp.ready["kv_events"]["replay_endpoint"],
                       _vllm_decoder())
    try:
        assert [seq for _, seq, _ in sub.replay(0)] == [4, 5]  # later than asked: the rest is lost
        # ... and the whole state follows, from AllBlocksCleared on
        sub.until(lambda s: any(type(ev).__name__ == "AllBlocksCleared" and seq > 5 for seq, ev in s.events()),
                  "a new AllBlocksCleared")
        sub.until(lambda s: s.state() == {(h, "CPU") for h in hashes(engine)}, "every block announced again")
    finally:
        sub.close()
    assert counters(sp)["kvevents_resyncs"] >= 1


def test_a_full_queue_drops_counts_and_announces_everything_again(sidecar_factory: Factory,
                                                                   subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config(queue_size=4)})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(16)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # one commit: 16 events at once
        assert c.put(keys, [payload(k, 1000) for k in keys], chain=True, engine=engine) == [PutStatus.STORED] * 16
    sub.until(lambda s: s.state() == {(h, "CPU") for h in hashes(engine)}, "all 16 blocks, dropped ones too")
    seqs = [seq for seq, _, _ in sub.batches]
    assert seqs == list(range(len(seqs))), "no gap in the sequence numbers"
    assert any(type(ev).__name__ == "AllBlocksCleared" and seq > 0 for seq, ev in sub.events())
    got = counters(sp)
    assert got["kvevents_dropped"] > 0 and got["kvevents_resyncs"] >= 1


def test_the_array_encoding_decodes_with_the_documented_schema(sidecar_factory: Factory,
                                                               subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config(encoding="array", replay_endpoint=None)})
    sub = subscribers(sp, msgspec.msgpack.Decoder(type=ArrayBatch).decode)
    assert sub.replay_endpoint is None
    client = PoolClient(sp.socket_path, timeout=DEADLINE_S)
    probes: list[Any] = []

    def probe() -> None:
        [k] = fresh_keys(1)
        [e] = chain([k])
        probes.append(e)
        client.put([k], [payload(k, 500)], engine=[e])

    try:
        sub.warm_up(probe)
        keys = fresh_keys(3)
        engine = chain(keys)
        client.put(keys, [payload(k, 500) for k in keys], chain=True, engine=engine)
        sub.until(lambda s: {(h, "CPU") for h in hashes(engine)} <= s.state(), "the chain")
    finally:
        client.close()
    [ev] = [ev for _, ev in sub.events() if isinstance(ev, BlockStored) and ev.block_hashes == hashes(engine)]
    assert (ev.parent_block_hash, ev.block_size, ev.medium, ev.lora_id, ev.lora_name, ev.extra_keys) == \
        (None, BS, "CPU", None, None, None)
    assert ev.token_ids == [t for e in engine if e is not None for t in e.token_ids]
    # the raw form: positional, the type name first
    last = sub.batches[-1]
    assert isinstance(last[2], ArrayBatch)


def test_puts_without_an_engine_identity_are_silent(sidecar_factory: Factory,
                                                    subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config()})
    sub = subscribers(sp, _vllm_decoder())
    silent, [marker_key] = fresh_keys(3), fresh_keys(1)
    [marker] = chain([marker_key])
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(silent, [payload(k, 800) for k in silent], chain=True) == [PutStatus.STORED] * 3
        c.put([marker_key], [payload(marker_key, 800)], engine=[marker])
    sub.until(lambda s: (marker.hash, "CPU") in s.state(), "the marker block")
    assert [type(ev).__name__ for _, ev in sub.events()] == ["AllBlocksCleared", "BlockStored"]
    assert counters(sp)["kvevents_events"] == 1


def test_a_block_named_later_is_announced_then_and_a_drain_clears(sidecar_factory: Factory,
                                                                  subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"kv_events": kv_config()})
    sub = subscribers(sp, _vllm_decoder())
    keys = fresh_keys(3)
    engine = chain(keys)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        sub.warm_up(lambda: c.put(keys[:1], [payload(keys[0], 800)], engine=engine[:1]))
        c.put(keys[1:], [payload(k, 800) for k in keys[1:]], chain=True, depth=1, parent=keys[0])  # unnamed
        assert c.put(keys[1:], [payload(k, 800) for k in keys[1:]], chain=True, depth=1, parent=keys[0],
                     engine=engine[1:]) == [PutStatus.EXISTS] * 2
    sub.until(lambda s: s.state() == {(h, "CPU") for h in hashes(engine)}, "the blocks, named now")
    sub.replay_endpoint = None  # it goes with the sidecar: from here on, SUB alone
    sp.stop()
    sub.until(lambda s: s.batches[-1][0] > 0 and s.state() == set(), "AllBlocksCleared at the drain")
    assert [type(ev).__name__ for ev in sub.batches[-1][2].events] == ["AllBlocksCleared"]


def test_only_the_listed_tenants_are_announced(sidecar_factory: Factory,
                                               subscribers: Callable[..., KvSubscriber]) -> None:
    sp = sidecar_factory({"tenants": [{"name": "default"}, {"name": "other"}],
                          "kv_events": kv_config(tenants=["default"])})
    sub = subscribers(sp, _vllm_decoder())
    mine, theirs = fresh_keys(2), fresh_keys(2)
    e_mine, e_theirs = chain(mine), chain(theirs)
    with PoolClient(sp.socket_path, tenant="other", timeout=DEADLINE_S) as c:
        assert c.put(theirs, [payload(k, 700) for k in theirs], chain=True, engine=e_theirs) == [PutStatus.STORED] * 2
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        c.put(mine, [payload(k, 700) for k in mine], chain=True, engine=e_mine)
    sub.until(lambda s: {(h, "CPU") for h in hashes(e_mine)} <= s.state(), "the listed tenant's blocks")
    assert sub.state() == {(h, "CPU") for h in hashes(e_mine)}
    assert counters(sp)["kvevents_events"] == 2


@pytest.mark.parametrize(("section", "message"), [
    ({"enabled": True, "encoding": "json"}, "kv_events.encoding"),
    ({"enabled": True, "endpoint": "udp://x:1"}, "kv_events.endpoint"),
    ({"enabled": True, "tenants": ["nobody"]}, "kv_events.tenants"),
    ({"enabled": True, "buffer_steps": 0}, "kv_events.buffer_steps"),
    ({"enabled": "yes"}, "kv_events.enabled"),
    ({"enabled": True, "replay": "tcp://*:5558"}, "kv_events: unknown setting"),
])
def test_bad_settings_are_a_clear_error_and_exit_2(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"api": {"socket_path": str(tmp_path / "s.sock")}, "kv_events": section}))
    proc = subprocess.run([sys.executable, "-m", "kvpool_sidecar", "--config", str(path)], capture_output=True,
                          text=True, timeout=DEADLINE_S, env={**os.environ}, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_an_address_in_use_stops_the_start_with_its_name(sidecar_factory: Factory) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:0")
    address = taken.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with pytest.raises(SidecarError, match="kv_events: cannot open " + address):
            sidecar_factory({"kv_events": {"enabled": True, "endpoint": address}})
    finally:
        taken.close(linger=0)
        ctx.term()


def test_ipc_endpoints_are_the_sidecars_groups_whatever_its_umask(sidecar_factory: Factory, tmp_path: Path) -> None:
    """An ``ipc://`` socket file is made 0660 (a replay request on one carries every announced
    tenant's token ids back), not what a umask of 000 would leave: open to every user."""
    where = tmp_path / "events"
    where.mkdir(mode=0o750)
    old = os.umask(0)
    try:  # the sidecar inherits the umask
        sp = sidecar_factory({"kv_events": kv_config(endpoint="ipc://{}/pub".format(where),
                                                     replay_endpoint="ipc://{}/replay".format(where))})
    finally:
        os.umask(old)
    assert sp.ready["kv_events"]["endpoint"] == "ipc://{}/pub".format(where)
    assert [oct(stat.S_IMODE((where / n).stat().st_mode)) for n in ("pub", "replay")] == [oct(0o660)] * 2


def test_an_ipc_endpoint_in_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    where = tmp_path / "events"
    where.mkdir()
    where.chmod(0o777)  # anyone could put a socket of their own in its place
    sp = SidecarProcess({"node_name": "n", "dram": {"size_bytes": "4Mi"},
                         "kv_events": kv_config(endpoint="ipc://{}/pub".format(where), replay_endpoint=None)},
                        workdir=tmp_path / "work")
    try:
        with pytest.raises(SidecarError, match="writable by other users"):
            sp.start(timeout=DEADLINE_S)
    finally:
        sp.stop()


def _replay_answers(dealer: zmq.Socket, requests: int) -> tuple[int, int]:
    """Batches and end markers received until ``requests`` end markers came."""
    batches = ends = 0
    while ends < requests:
        assert dealer.poll(int(DEADLINE_S * 1000)), (batches, ends)
        frames = dealer.recv_multipart()
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            ends += 1
        else:
            batches += 1
    return batches, ends


def test_an_oversized_replay_request_disconnects_its_sender_and_replays_go_on(sidecar_factory: Factory) -> None:
    """A replay request is an empty frame and 8 bytes: a 1 MiB one is dropped with its
    sender's connection before ZMQ buffers it (it is never answered), and others are served."""
    sp = sidecar_factory({"kv_events": kv_config()})
    keys = fresh_keys(2)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, [payload(k, 1000) for k in keys], engine=chain(keys)) == [PutStatus.STORED] * 2
    ctx = zmq.Context()
    big, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (big, good):
            s.connect(sp.ready["kv_events"]["replay_endpoint"])
        big.send_multipart([b"", b"\x00" * (1 << 20)])
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        batches, _ = _replay_answers(good, 1)
        assert batches >= 2  # sequence 0 (everything cleared) and the puts
        assert not big.poll(1000)  # (an answer comes within milliseconds: the good one did)
    finally:
        big.close(linger=0)
        good.close(linger=0)
        ctx.term()


def test_replays_asked_faster_than_two_buffers_a_second_are_answered_by_a_resync(sidecar_factory: Factory) -> None:
    """Each replay from the start resends the whole buffer: a flood of them would keep the
    loop resending. Past two buffers a second, a request gets its end marker and a resync on
    the PUB socket instead, and is counted."""
    steps = 4
    sp = sidecar_factory({"kv_events": kv_config(buffer_steps=steps)})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for k in fresh_keys(steps):
            assert c.put([k], [payload(k, 1000)], engine=chain([k])) == [PutStatus.STORED]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(sp.ready["kv_events"]["replay_endpoint"])
        asked, batches = 40, 0
        for _ in range(asked):  # one after the other (a client's answers beyond SNDHWM are dropped)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            batches += _replay_answers(dealer, 1)[0]
        assert 0 < batches < asked * steps / 2, batches  # (all answered in full: 40 x 5)
        assert counters(sp)["kvevents_replays_throttled"] > 0
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_replays_are_throttled_by_their_bytes_too(sidecar_factory: Factory) -> None:
    """A buffer of few large batches passed the count of batches a second many times over:
    the bytes resent count too (two buffers' worth a second)."""
    sp = sidecar_factory({"kv_events": kv_config(buffer_bytes=64 << 10)})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for _ in range(4):  # batches of 128 blocks: a few kept, tens of KiB together
            keys = fresh_keys(128)
            assert c.put(keys, [payload(k, 600) for k in keys], engine=chain(keys)) == [PutStatus.STORED] * 128
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(sp.ready["kv_events"]["replay_endpoint"])
        for _ in range(10):  # 10 whole buffers at once: the count of batches (2 x 10,001 a second) allows them all
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            _replay_answers(dealer, 1)
        assert counters(sp)["kvevents_replays_throttled"] > 0
    finally:
        dealer.close(linger=0)
        ctx.term()


async def test_a_replay_sends_the_kept_batches_by_reference() -> None:
    """A client that asks and never reads holds what ZMQ queued for it: copies of the whole
    buffer each had taken a node's memory (12 such clients, 712 MiB). The batches of 1 KiB
    and more now go by reference to the kept ones: what the kernel's socket buffers do not
    take stays queued as ZMQ frames that hold the kept bytes, not copies of them."""
    import sys
    from collections import Counter

    from kvpool_sidecar.config import KvEventsSettings
    from kvpool_sidecar.events import EngineEventQueue
    from kvpool_sidecar.kvevents import KvEventPublisher
    from tests.unit.store_support import until

    async def nothing() -> list[Any]:
        return []

    def refs(objects: list[bytes]) -> list[int]:
        return [sys.getrefcount(o) for o in objects]

    pub = KvEventPublisher(KvEventsSettings(**kv_config()), EngineEventQueue(100, Counter()), nothing, "n1")
    await pub.start()
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    try:
        kept = [i.to_bytes(4, "big") * 1024 for i in range(4000)]  # 4 KiB each: under pyzmq's own 64 KiB
        for body in kept:
            pub._keep(pub._seq, body)  # noqa: SLF001
            pub._seq += 1  # noqa: SLF001
        before = refs(kept)
        assert pub.replay_endpoint is not None
        reader.setsockopt(zmq.RCVHWM, 1)
        reader.setsockopt(zmq.RCVBUF, 4096)
        reader.connect(pub.replay_endpoint)
        reader.send_multipart([b"", (1).to_bytes(8, "big")])  # and never reads
        task = asyncio.ensure_future(pub.serve_replay())
        try:
            assert await until(lambda: sum(a > b for a, b in zip(refs(kept), before)) > len(kept) // 2)
        finally:
            task.cancel()
    finally:
        reader.close(linger=0)
        ctx.term()
        await pub.stop()
