"""The descriptor cache the segment disk tier reads through (tiers/descriptors.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvpool_sidecar.tiers import descriptors
from kvpool_sidecar.tiers.descriptors import DescriptorCache


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def files(tmp_path: Path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"%d" % i * 64)
        paths.append(str(p))
    return paths


def test_a_descriptor_is_kept_between_operations(tmp_path: Path) -> None:
    (path,) = files(tmp_path, 1)
    before = open_fds()
    cache = DescriptorCache(limit=2)
    with cache.opened(1, path) as fd:
        first = fd
    os.unlink(path)  # a second open would fail now: only the kept descriptor can read it
    with cache.opened(1, path) as fd:
        assert fd == first and os.pread(fd, 2, 0) == b"00"
    cache.close()
    assert open_fds() == before


def test_at_most_limit_descriptors_stay_open(tmp_path: Path) -> None:
    paths = files(tmp_path, 10)
    before = open_fds()
    cache = DescriptorCache(limit=3)
    for i, path in enumerate(paths):
        with cache.opened(i, path) as fd:
            assert os.pread(fd, 1, 0) == b"%d" % i
        assert len(open_fds() - before) <= 3 and len(cache) <= 3
    cache.close()
    assert open_fds() == before


def test_a_descriptor_in_use_is_closed_by_its_last_user_not_before(tmp_path: Path) -> None:
    """Closed while a read still holds it, its number could go to the next file opened, and
    that read would read another file."""
    paths = files(tmp_path, 3)
    before = open_fds()
    cache = DescriptorCache(limit=1)
    with cache.opened(0, paths[0]) as held:
        with cache.opened(1, paths[1]):  # evicts key 0 from the cache while it is in use
            pass
        cache.discard(0)
        cache.close()
        assert os.pread(held, 1, 0) == b"0" and os.fstat(held).st_ino == os.stat(paths[0]).st_ino
        assert len(cache) == 1  # dropped, still held
    assert len(cache) == 0 and open_fds() == before


def test_discard_forgets_the_file(tmp_path: Path) -> None:
    (path,) = files(tmp_path, 1)
    cache = DescriptorCache(limit=4)
    with cache.opened(7, path):
        pass
    cache.discard(7)
    os.unlink(path)
    with pytest.raises(FileNotFoundError), cache.opened(7, path):
        pass
    assert len(cache) == 0


def test_a_descriptor_opened_across_a_discard_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss opens the file outside the lock: a discard (the segment dropped, its file
    deleted) that comes meanwhile must not leave the deleted file's descriptor cached."""
    (path,) = files(tmp_path, 1)
    before = open_fds()
    cache = DescriptorCache(limit=4)
    real_open = os.open

    def racing_open(p: str, flags: int, *args: int) -> int:
        fd = real_open(p, flags, *args)
        cache.discard(3)  # as another thread dropping the segment would
        os.unlink(p)
        return fd

    monkeypatch.setattr(descriptors.os, "open", racing_open)
    with cache.opened(3, path) as fd:
        assert os.pread(fd, 1, 0) == b"0"  # this use still reads it
    monkeypatch.undo()
    assert len(cache) == 0 and open_fds() == before


def test_threads_share_a_small_cache_without_reading_the_wrong_file(tmp_path: Path) -> None:
    paths = files(tmp_path, 6)
    before = open_fds()
    cache = DescriptorCache(limit=2)
    wrong: list[tuple[int, bytes]] = []
    start = threading.Barrier(4)

    def reader(seed: int) -> None:
        start.wait()
        for n in range(2000):
            i = (seed * 7 + n * 5) % len(paths)
            with cache.opened(i, paths[i]) as fd:
                got = os.pread(fd, 1, 0)
            if got != b"%d" % i:
                wrong.append((i, got))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert len(cache) <= 2
    cache.close()
    assert open_fds() == before


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        DescriptorCache(limit=0)
