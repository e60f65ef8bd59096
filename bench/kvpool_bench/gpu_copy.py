"""Copy rates into a GPU: from the sidecar's shared arena, and through a CUDA IPC descriptor.

``python -m kvpool_bench.gpu_copy [--total-mib 256] [--reps 5] [--out FILE]`` prints ONE
JSON line of rates in GB/s, each next to a baseline measured in the same run, for copies cut
into runs of 64 KiB, 2 MiB and 32 MiB (``--total-mib`` moved per measurement, one
``copy_`` per run, median of ``--reps`` timings after a warm-up, each ended by a stream
synchronize):

- ``h2d``: host -> device from a :class:`~kvpool_sidecar.tiers.dram.SharedArena` (the DRAM
  tier's memfd arena) page-locked with ``cudaHostRegister``, against torch's own pinned
  memory (``pin_memory=True``), the physical limit; ``ratio_arena_vs_torch_pinned``.
- ``d2d``: device -> device from a buffer of this process (a GPU tier's allocation) into a
  second, spawned process that opens it through a msgpack-packed descriptor from
  :func:`kvpool_sidecar.tiers.gpu_ipc.ipc_descriptor` and copies with
  :meth:`kvpool_client.cudaipc.OpenedDescriptor.copy_into`, against a plain same-device
  ``copy_`` between two buffers of that child; ``ratio_ipc_vs_plain``. The block's extents
  are the runs in reverse order, so none coalesce: one copy per run, as in the baseline.
  A second process because CUDA refuses to open an IPC handle in the process that made it.
  ``ipc_open_ms`` is the time to open each descriptor (once, as the format requires).

Both paths check the bytes that arrived (``h2d_bytes_ok``, ``ipc_bytes_ok``). Exit status:
0, 1 when a check failed (bytes, pinning, the child), 2 with a one-line message when torch
or CUDA is missing. The module imports neither torch nor CUDA until it runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvpool_bench.mooncake import size_label

RUN_SIZES = (64 << 10, 2 << 20, 32 << 20)
#: How long the parent waits for the child's figures (it opens CUDA and copies ~1 GiB).
CHILD_DEADLINE_S = 180.0


def cuda_missing() -> str | None:
    """Why this benchmark cannot run here (no torch, no CUDA), or ``None``."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install kvpool[torch])"
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    return None


def reversed_extents(total: int, run: int) -> list[tuple[int, int]]:
    """``total // run`` runs of ``run`` bytes, last first: no two neighbours are adjacent."""
    return [(i * run, run) for i in reversed(range(total // run))]


def _gbps(copy: Callable[[], None], sync: Callable[[], None], nbytes: int, reps: int) -> float:
    """GB/s of ``copy`` (which moves ``nbytes``): the median of ``reps`` timed runs."""
    copy()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _chunked(dst: Any, src: Any, extents: Sequence[tuple[int, int]]) -> Callable[[], None]:
    """One ``copy_`` per extent of ``src`` into ``dst``'s bytes laid end to end."""
    def copy() -> None:
        pos = 0
        for off, n in extents:
            dst[pos : pos + n].copy_(src[off : off + n], non_blocking=True)
            pos += n
    return copy


def _pattern(total: int, device: str) -> Any:
    """Bytes both processes can compute: ``i % 251``."""
    import torch

    return (torch.arange(total, dtype=torch.int32, device=device) % 251).to(torch.uint8)


@contextmanager
def _registered(t: Any) -> Iterator[bool]:
    """Page-lock CPU tensor ``t``'s memory for DMA for the block (``cudaHostRegister``).

    ``kvpool_client.tensors.register_arena_pinned`` does this for a client's mapping of the
    arena; here the arena is the sidecar's own, with no client.
    """
    import torch

    get_cudart: Callable[[], Any] = torch.cuda.cudart
    cudart = get_cudart()
    ok = int(cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)) == 0
    try:
        yield ok
    finally:
        if ok:
            cudart.cudaHostUnregister(t.data_ptr())


def host_to_device(total: int, reps: int) -> dict[str, Any]:
    """Arena (registered) vs torch pinned memory, host -> device, per run size."""
    import torch

    from kvpool_sidecar.tiers.dram import SharedArena

    sync = torch.cuda.synchronize
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(_pattern(total, "cpu"))
    arena = SharedArena(total, name="kvpool-bench-gpu-copy")
    out: dict[str, Any] = {}
    try:
        host = torch.frombuffer(arena.view, dtype=torch.uint8)
        host.copy_(pinned)
        with _registered(host) as ok:
            out["arena_pinned"] = ok and host.is_pinned()
            for run in RUN_SIZES:
                ext = [(i * run, run) for i in range(total // run)]
                arena_rate = _gbps(_chunked(dst, host, ext), sync, total, reps)
                dst.zero_()
                _chunked(dst, host, ext)()
                sync()
                ok_bytes = torch.equal(dst.cpu(), host)
                pinned_rate = _gbps(_chunked(dst, pinned, ext), sync, total, reps)
                out[size_label(run)] = {"copies": len(ext), "arena_gbps": arena_rate, "torch_pinned_gbps": pinned_rate,
                                        "ratio_arena_vs_torch_pinned": arena_rate / pinned_rate, "bytes_ok": ok_bytes}
        del host
    finally:
        arena.close()
    return out


def _ipc_child(packed: bytes, conn: Any) -> None:
    """In a spawned process: open each descriptor once, time its copies and a plain one."""
    import msgpack
    import torch

    from kvpool_client.cudaipc import open_storage

    job = msgpack.unpackb(packed, raw=False)
    total, reps = int(job["total"]), int(job["reps"])
    sync = torch.cuda.synchronize
    expect = _pattern(total, "cuda")
    src = expect.clone()
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    for run, desc in zip(job["runs"], job["descriptors"]):
        t = time.perf_counter()
        opened = open_storage(desc)
        open_ms = 1e3 * (time.perf_counter() - t)
        dst.zero_()
        opened.copy_into(dst)
        order = torch.tensor([off // run for off, _ in desc["extents"]], device="cuda")
        ok = torch.equal(dst, expect.view(-1, run)[order].reshape(-1))
        ipc_rate = _gbps(lambda o=opened: o.copy_into(dst), sync, total, reps)  # type: ignore[misc]
        plain_rate = _gbps(_chunked(dst, src, reversed_extents(total, run)), sync, total, reps)
        out[size_label(run)] = {"copies": len(desc["extents"]), "ipc_gbps": ipc_rate, "plain_gbps": plain_rate,
                                "ratio_ipc_vs_plain": ipc_rate / plain_rate, "bytes_ok": ok, "ipc_open_ms": open_ms}
        del opened  # gives the sidecar's reference back
    sync()
    conn.send(out)
    conn.close()


def device_to_device(total: int, reps: int) -> dict[str, Any]:
    """IPC-opened (another process) vs plain same-device D2D, per run size."""
    import msgpack
    import torch

    from kvpool_sidecar.tiers.gpu_ipc import ipc_descriptor

    buffer = _pattern(total, "cuda")  # the GPU tier's allocation; alive until the child has exited
    torch.cuda.synchronize()
    descs = [ipc_descriptor(buffer, reversed_extents(total, run)) for run in RUN_SIZES]
    packed = msgpack.packb({"total": total, "reps": reps, "runs": list(RUN_SIZES), "descriptors": descs},
                           use_bin_type=True)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_ipc_child, args=(packed, theirs), name="kvpool-gpu-copy-child")
    child.start()
    theirs.close()
    try:
        got: dict[str, Any] = mine.recv() if mine.poll(CHILD_DEADLINE_S) else {}
    except EOFError:  # the child died before it answered; its exit code says more
        got = {}
    finally:
        child.join(timeout=60)
        if child.exitcode is None:
            child.kill()
            child.join()
    if not got:
        return {"error": f"the IPC child answered nothing (exit code {child.exitcode})"}
    return got


def run(total: int, reps: int) -> dict[str, Any]:
    """Both measurements, and whether every check passed (``ok``)."""
    import torch

    h2d = host_to_device(total, reps)
    d2d = device_to_device(total, reps)
    ok = bool(h2d.get("arena_pinned")) and "error" not in d2d and all(
        part.get("bytes_ok") for part in (*_per_size(h2d), *_per_size(d2d)))
    return {"bench": "gpu_copy", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "total_bytes": total, "reps": reps, "h2d": h2d, "d2d": d2d,
            "h2d_bytes_ok": all(p.get("bytes_ok") for p in _per_size(h2d)),
            "ipc_bytes_ok": "error" not in d2d and all(p.get("bytes_ok") for p in _per_size(d2d)), "ok": ok}


def _per_size(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [part[size_label(run)] for run in RUN_SIZES if isinstance(part.get(size_label(run)), dict)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement (MiB; a multiple of 32)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (the median is kept)")
    p.add_argument("--out", help="also write the JSON line to this file")
    args = p.parse_args(argv)
    if args.total_mib < 32 or args.total_mib % 32 or args.reps < 1:
        p.error("--total-mib must be a positive multiple of 32 and --reps at least 1")
    reason = cuda_missing()
    if reason is not None:
        print(f"gpu_copy: {reason}", file=sys.stderr)
        return 2
    result = run(args.total_mib << 20, args.reps)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
