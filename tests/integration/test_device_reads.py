"""GPU-tier reads (``ACQUIRE_DEVICE``, ``get_cuda``) against a real sidecar process.

Without a GPU the sidecar has no GPU tier: every key is a miss, and what the op refuses is
refused clearly on a connection that stays usable. With one (``-m gpu``), a block read
through DRAM is copied up to the GPU tier and a client copies it out device to device.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpool_client.client import PoolClient
from kvpool_client.errors import CudaIpcError
from kvpool_client.protocol import ErrorCode, Op, PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, RawConn, fresh_keys, payload, wait_until

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
NO_GPU = {"gpu": {"enabled": False}}


def _lookup_works(conn: RawConn) -> None:
    _, status, result = conn.call(int(Op.LOOKUP), [k.raw for k in fresh_keys(1)])
    assert status == 0 and result == [0, []], result


def test_without_a_gpu_tier_stored_keys_are_misses(sidecar_factory: Factory) -> None:
    sp = sidecar_factory(NO_GPU)
    keys = fresh_keys(3)
    datas = [payload(k, 70_001) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, datas) == [PutStatus.STORED] * 3
        assert [bytes(g) for g in c.get(keys) if g is not None] == datas
        assert c.shm and not c.device_reads
    with RawConn(sp.socket_path) as conn:
        _, status, result = conn.call(int(Op.ACQUIRE_DEVICE), [k.raw for k in keys])
        assert status == 0 and result == [None] * 3, result
        _, status, result = conn.call(int(Op.RELEASE), [[1, False]])
        assert status == 0 and result == 0  # no lease was handed out
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # the DRAM path still serves them
        assert [bytes(g) for g in c.get(keys) if g is not None] == datas


def test_a_version_2_connection_is_refused_the_op_and_stays_usable(sidecar_factory: Factory) -> None:
    sp = sidecar_factory(NO_GPU)
    with RawConn(sp.socket_path, tenant=None) as conn:
        _, status, hello = conn.hello("default", version=2)
        assert status == 0 and not hello["device_reads"]
        _, status, result = conn.call(int(Op.ACQUIRE_DEVICE), [k.raw for k in fresh_keys(2)])
        assert status == int(ErrorCode.BAD_REQUEST)
        assert result[0] == "bad_request" and "protocol version 3" in result[1], result
        _lookup_works(conn)


@pytest.mark.parametrize(("args", "says"), [
    ([[b"short"]], "48 raw bytes"),
    (["not a list"], "list of keys"),
    ([[b"k" * 48] * 5000], "exceeds the limit"),
    ([], "wrong arguments"),
])
def test_bad_arguments_get_a_clear_error_and_the_connection_stays(sidecar_factory: Factory,
                                                                  args: list[object], says: str) -> None:
    sp = sidecar_factory(NO_GPU)
    with RawConn(sp.socket_path) as conn:
        _, status, result = conn.call(int(Op.ACQUIRE_DEVICE), *args)
        assert status == int(ErrorCode.BAD_REQUEST) and says in result[1], result
        _lookup_works(conn)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_get_cuda_without_cuda_is_refused_before_anything_is_asked(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(1)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, [payload(keys[0], 4096)]) == [PutStatus.STORED]
        with pytest.raises(CudaIpcError, match="needs CUDA"):
            c.get_cuda(keys, [torch.empty(4096, dtype=torch.uint8)])
        assert [bytes(g) for g in c.get(keys) if g is not None] == [payload(keys[0], 4096)]


@pytest.mark.gpu
def test_a_block_copied_up_to_the_gpu_tier_is_read_device_to_device(sidecar_factory: Factory) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sp = sidecar_factory({"gpu": {"enabled": True, "size_bytes": "16Mi", "promote_after_hits": 1}})
    keys = fresh_keys(3)
    sizes = [70_001, 4096, 1 << 20]
    datas = [payload(k, n) for k, n in zip(keys, sizes)]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.device_reads
        assert c.put(keys, datas) == [PutStatus.STORED] * 3
        for _ in range(2):  # read through DRAM: copied up after the first
            assert [bytes(g) for g in c.get(keys[:2]) if g is not None] == datas[:2]
        wait_until(lambda: c.stats()["tiers"]["gpu"]["blocks"] >= 2, "blocks copied up to the GPU tier")
        dests = [torch.zeros(sizes[0], dtype=torch.uint8, device="cuda"),
                 torch.zeros(sizes[1] // 2, dtype=torch.float16, device="cuda"),
                 torch.zeros(sizes[2], dtype=torch.uint8, device="cuda")]
        assert c.get_cuda(keys, dests) == [True, True, False]  # the third was never read: DRAM only
        assert bytes(dests[0].cpu().numpy()) == datas[0]
        assert bytes(dests[1].view(torch.uint8).cpu().numpy()) == datas[1]
        assert not dests[2].any()
        # a removed block leaves the GPU tier with the others
        assert c.remove(keys) == 3
        assert c.get_cuda(keys[:2], dests[:2]) == [False, False]
