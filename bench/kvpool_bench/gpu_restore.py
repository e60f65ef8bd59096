"""Where a GPU engine's restore of a long prefix spends its time, and how it scales with threads.

``python -m kvpool_bench.gpu_restore [--total-mib 4096] [--block-mib 8] [--threads 1,2,4,8]
[--device cuda] [--out FILE]`` stores ``--total-mib`` of blocks (8 MiB: 64 tokens of a
Llama-3-8B, all layers) in a sidecar, then reads them all back into device tensors:

- ``in_place``: :func:`~kvpool_client.tensors.get_tensors_in_place`, blocks verified in the
  registered arena and copied from it by DMA;
- ``staged``: :func:`~kvpool_client.tensors.get_tensors`, a verified copy into pinned
  staging, then DMA;

each with the copy and verify threads of ``--threads`` (:func:`~kvpool_client.integrity.set_copy_threads`),
and once more in one round (no overlap of the host's work with the DMA) at the default
thread count. Baselines measured in the same run: the same bytes host to device from torch's
pinned memory in one copy (``h2d_gbps``, the floor of any restore), a one-thread ``memmove``
of them between two host buffers (``memcpy_gbps``), and the checksum alone over the arena at
each thread count (``verify_gbps``). Every figure is a median of ``--reps`` runs after a
warm-up; every restore is checked bitwise against the stored bytes. ``--device cpu`` runs the
same logic on the CPU (no DMA; checks the script where there is no GPU).

Then the other way, a store of the same bytes from the device at the default thread count
(``store``): :func:`~kvpool_client.tensors.put_tensors_in_place` (DMA into reserved room of
the registered arena, checksummed there, in rounds) against a copy to pinned memory followed
by a put from it (``staged``), with the device-to-host copy of the same bytes into pinned
memory in one copy as the floor (``d2h_gbps``); every store is read back and compared.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def _ms(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def run(device: str, total: int, block: int, threads: Sequence[int], reps: int) -> dict[str, Any]:
    import torch

    from kvpool_client import integrity, tensors
    from kvpool_client.client import PoolClient
    from kvpool_client.tensors import get_tensors, get_tensors_in_place, register_arena_pinned, tensor_bytes
    from kvpool_sidecar.process import SidecarProcess

    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    n = total // block
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=gen)
    pinned = src.pin_memory() if cuda else src.clone()
    dst = torch.empty((n, block), dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"bench": "gpu_restore", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                           "total_bytes": n * block, "block_bytes": block, "reps": reps,
                           "default_threads": integrity.COPY_THREADS, "round_bytes": tensors.ROUND_BYTES}
    out["h2d_gbps"] = n * block / _ms(lambda: dst.copy_(pinned, non_blocking=True), sync, reps) / 1e6
    host = torch.empty_like(src)
    out["memcpy_gbps"] = n * block / _ms(lambda: ctypes.memmove(host.data_ptr(), src.data_ptr(), n * block),
                                         lambda: None, reps) / 1e6
    floor_ms = n * block / out["h2d_gbps"] / 1e6
    page = 1 << 20
    sp = SidecarProcess({"node_name": "gpu-restore", "dram": {"size_bytes": (n + 4) * block, "page_bytes": page},
                         "max_block_bytes": block, "api": {"max_session_share": 1.0}},
                        workdir=tempfile.mkdtemp(prefix="kvpool-gpu-restore-")).start()
    default = integrity.COPY_THREADS
    try:
        with PoolClient(sp.socket_path, timeout=120.0) as client:
            client.wait_prefaulted()
            keys = [i.to_bytes(6, "big") * 8 for i in range(n)]  # 48 raw bytes each
            t = time.perf_counter()
            client.put(keys, [tensor_bytes(src[i]) for i in range(n)])
            out["store_ms"] = 1e3 * (time.perf_counter() - t)
            out["arena_pinned"] = register_arena_pinned(client) if cuda else False
            rows: list[dict[str, Any]] = []

            def restore(fn: Callable[..., Any]) -> Callable[[], None]:
                def go() -> None:
                    got = fn(client, keys, [dst[i] for i in range(n)])
                    if any(g is None for g in got):
                        raise RuntimeError("a stored block was missed")
                return go

            def verify_all() -> None:
                with client.acquire(keys):
                    pass

            for k in threads:
                integrity.set_copy_threads(k)
                row: dict[str, Any] = {"threads": k}
                row["verify_gbps"] = n * block / _ms(verify_all, lambda: None, reps) / 1e6
                for name, fn in (("in_place", get_tensors_in_place), ("staged", get_tensors)):
                    dst.zero_()
                    row[name + "_ms"] = _ms(restore(fn), sync, reps)
                    row[name + "_vs_h2d_floor"] = row[name + "_ms"] / floor_ms
                    row[name + "_ok"] = bool(torch.equal(dst.cpu(), src))
                rows.append(row)
            integrity.set_copy_threads(default)
            one_round: dict[str, Any] = {"threads": default}
            old, tensors.ROUND_BYTES = tensors.ROUND_BYTES, 1 << 62
            try:
                for name, fn in (("in_place", get_tensors_in_place), ("staged", get_tensors)):
                    dst.zero_()
                    one_round[name + "_ms"] = _ms(restore(fn), sync, reps)
                    one_round[name + "_ok"] = bool(torch.equal(dst.cpu(), src))
            finally:
                tensors.ROUND_BYTES = old
            out["threads"] = rows
            out["one_round"] = one_round
            out["store"] = _stores(torch, client, keys, src, dst, pinned, sync, reps)
    finally:
        integrity.set_copy_threads(default)
        sp.stop()
    out["floor_ms"] = floor_ms
    out["ok"] = all(r["in_place_ok"] and r["staged_ok"] for r in (*out["threads"], out["one_round"], out["store"]))
    return out


def _stores(torch: Any, client: Any, keys: list[bytes], src: Any, dst: Any, pinned: Any,
            sync: Callable[[], None], reps: int) -> dict[str, Any]:
    """Median times of storing device rows ``dst`` (equal to ``src``) in place and staged."""
    from kvpool_client.protocol import PutStatus
    from kvpool_client.tensors import get_tensors, put_tensors_in_place, tensor_bytes

    n, block = dst.shape
    client.remove(keys)  # room for the stores
    out: dict[str, Any] = {"d2h_gbps": n * block / _ms(lambda: pinned.copy_(dst, non_blocking=True), sync, reps) / 1e6}

    def in_place() -> list[PutStatus]:
        return put_tensors_in_place(client, keys, [dst[i] for i in range(n)])

    def staged() -> list[PutStatus]:
        pinned.copy_(dst, non_blocking=True)
        sync()
        statuses: list[PutStatus] = client.put(keys, [tensor_bytes(pinned[i]) for i in range(n)])
        return statuses

    for name, fn in (("in_place", in_place), ("staged", staged)):
        times, ok = [], True
        for rep in range(reps + 1):  # the first is a warm-up
            sync()
            t = time.perf_counter()
            statuses = fn()
            sync()
            if rep:
                times.append(1e3 * (time.perf_counter() - t))
            ok = ok and statuses == [PutStatus.STORED] * n
            back = torch.zeros_like(src)
            got = get_tensors(client, keys, [back[i] for i in range(n)])
            ok = ok and all(g is not None for g in got) and bool(torch.equal(back, src))
            client.remove(keys)
        out[name + "_ms"] = statistics.median(times)
        out[name + "_ok"] = ok
    out["in_place_vs_d2h_floor"] = out["in_place_ms"] / (n * block / out["d2h_gbps"] / 1e6)
    out["staged_vs_in_place"] = out["staged_ms"] / out["in_place_ms"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--total-mib", type=int, default=4096)
    p.add_argument("--block-mib", type=int, default=8)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)
    threads = [int(x) for x in a.threads.split(",")]
    if a.block_mib < 1 or a.total_mib < a.block_mib or a.reps < 1 or min(threads) < 1:
        p.error("--block-mib and --reps at least 1, --total-mib at least one block, threads at least 1")
    result = run(a.device, a.total_mib << 20, a.block_mib << 20, threads, a.reps)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
