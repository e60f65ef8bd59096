"""The disk tier: round trips, warm restart, torn files, crashes, capacity and a real full disk."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import random
import re
import shutil
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import zstandard

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers import disk as disk_mod
from kvpool_sidecar.tiers import fsfree as fsfree_mod
from kvpool_sidecar.tiers.base import BlockRecord, TierKind
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.diskformat import FLAG_SHUFFLE, FLAG_ZSTD, decode_payload, encode_payload, header_length

MiB = 1 << 20
TierFactory = Callable[..., DiskTier]


def make_key(i: int) -> bytes:
    return hashlib.blake2b(b"key%d" % i, digest_size=48).digest()


def random_payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def kv_like_payload(size: int, seed: int) -> bytes:
    """Gaussian bf16 values (the top halves of float32s), like a KV cache."""
    rnd = random.Random(seed)
    f32 = struct.pack(f"<{size // 2}f", *(rnd.gauss(0, 1) for _ in range(size // 2)))
    out = bytearray(size)
    out[0 : size // 2 * 2 : 2], out[1 : size // 2 * 2 : 2] = f32[2::4], f32[3::4]
    return bytes(out)


def block(i: int, payload: bytes, tenant: str = "default") -> tuple[BlockRecord, list[memoryview]]:
    """A record and its payload split into uneven views, as the DRAM arena hands them over."""
    rec = BlockRecord(make_key(i), len(payload), checksum(memoryview(payload)), tenant)
    mv = memoryview(payload)
    cut1, cut2 = len(payload) // 3, len(payload) // 3 + 7
    return rec, [mv[:cut1], mv[cut1:cut2], mv[cut2:]]


def read_back(tier: DiskTier, key: bytes) -> bytes:
    rec = tier.record(key)
    assert rec is not None
    buf = bytearray(rec.size)
    assert tier.read_into(key, memoryview(buf)) == rec
    return bytes(buf)


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


def disk_usage(root: Path) -> int:
    return sum(p.stat().st_size for p in block_files(root))


@pytest.fixture
def make_tier(tmp_path: Path) -> TierFactory:
    def factory(root: Path | None = None, open_: bool = True, **kw: Any) -> DiskTier:
        kw.setdefault("size_bytes", 64 * MiB)
        tier = DiskTier(DiskSettings(path=str(root or tmp_path / "disk"), **kw))
        if open_:
            tier.open()
        return tier
    return factory


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("fsync", ["never", "always"])
def test_round_trip(make_tier: TierFactory, tmp_path: Path, compression: str, fsync: str) -> None:
    tier = make_tier(compression=compression, fsync=fsync)
    assert tier.kind is TierKind.DISK and len(tier) == 0 and tier.used_bytes == 0
    payloads = {0: random_payload(300_000, 1), 1: kv_like_payload(200_000, 2), 2: b"", 3: b"x"}
    total = 0
    for i, data in payloads.items():
        rec, views = block(i, data, tenant="tenant-ü")
        n = tier.write(rec, views)
        assert n == tier.stored_bytes(rec.key) <= tier.estimate_bytes(len(data))
        assert n <= tier.estimate_bytes(len(data), rec.tenant)
        total += n
    assert len(tier) == 4 and sorted(tier.keys()) == sorted(make_key(i) for i in payloads)
    for i, data in payloads.items():
        assert tier.contains(make_key(i))
        assert read_back(tier, make_key(i)) == data
    assert tier.used_bytes == total == disk_usage(tmp_path / "disk")
    assert tier.free_bytes == tier.capacity_bytes - total
    assert temp_files(tmp_path / "disk") == []
    # Writing a key already held is a no-op that reports its size.
    rec, views = block(0, payloads[0], tenant="tenant-ü")
    assert tier.write(rec, views) == tier.stored_bytes(rec.key) and tier.used_bytes == total


def test_block_files_are_readable_by_their_owner_only(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    rec, views = block(7, random_payload(5000, 7))
    tier.write(rec, views)
    root = tmp_path / "disk"
    modes = [stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]]
    assert modes and all(m & 0o077 == 0 for m in modes), [oct(m) for m in modes]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_directory_another_user_owns_is_refused(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    rec, views = block(7, random_payload(5000, 7))
    tier.write(rec, views)
    for p in [tmp_path / "disk", *(tmp_path / "disk").rglob("*")]:
        os.chown(p, 2000, 2000)  # as if another user had made it, and planted the blocks in it
    with pytest.raises(TierIOError, match="belongs to uid 2000"):
        make_tier()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user needs root")
def test_a_disk_path_through_another_users_symlink_is_refused(make_tier: TierFactory, tmp_path: Path) -> None:
    """A link another user owns on the way to ``disk.path`` could be pointed at a directory of
    theirs: refused, as on the way to the socket's directory (one of ours is followed)."""
    (tmp_path / "real").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    make_tier(root=link / "disk")
    os.lchown(link, 2000, 2000)
    with pytest.raises(TierIOError, match=re.escape(f"goes through {link}, a symbolic link that uid 2000 owns")):
        make_tier(root=link / "disk")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user needs root")
def test_a_link_another_user_plants_after_the_check_is_not_followed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory is made and checked by path after its links were checked: a link of
    another user's planted in between (a cleaner had removed the directory from a sticky
    /tmp) had been followed, and the directory it named, root's own, chmodded 0700 and
    used for tenants' blocks."""
    from kvpool_sidecar.tiers import diskformat

    target = tmp_path / "roots"
    target.mkdir(mode=0o755)
    disk = tmp_path / "disk"
    makedirs = os.makedirs

    def racing(path: str, *args: Any, **kwargs: Any) -> None:
        if Path(path) == disk:  # the other user's link lands just now
            disk.symlink_to(target)
            os.lchown(disk, 2000, 2000)
        makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", racing)
    with pytest.raises(PermissionError, match="a symbolic link that uid 2000 owns"):
        diskformat.make_private_dir(str(disk))
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_what_another_user_wrote_into_the_tier_is_never_taken_for_its_own(make_tier: TierFactory,
                                                                          tmp_path: Path) -> None:
    """The root is the tier's, but a block file or a subdirectory in it is another user's
    (written while the host directory was still open to a group): the file is discarded,
    not served; the subdirectory refuses the tier (its owner could fill it under us)."""
    tier = make_tier()
    rec, views = block(7, random_payload(5000, 7))
    tier.write(rec, views)
    (planted,) = [p for p in (tmp_path / "disk").rglob("*") if p.is_file()]
    os.chown(planted, 2000, 2000)
    again = make_tier()
    assert again.used_bytes == 0 and not planted.exists()
    os.chown(planted.parent, 2000, 2000)
    with pytest.raises(TierIOError, match="belongs to uid 2000"):
        make_tier()


def test_zstd_shuffle_shrinks_16bit_data_and_stores_random_data_raw(make_tier: TierFactory) -> None:
    tier = make_tier(compression="zstd")
    kv, kv_views = block(0, kv_like_payload(100_000, 3))
    rnd, rnd_views = block(1, random_payload(100_000, 4))
    assert tier.write(kv, kv_views) < 0.8 * kv.size
    assert tier.write(rnd, rnd_views) == header_length(len(b"default")) + rnd.size


def test_shuffle_format_and_gain() -> None:
    payload = kv_like_payload(200_001, 7)  # odd length: the even plane holds one byte more
    flags, stored = encode_payload(memoryview(payload), 1)
    assert flags == FLAG_ZSTD | FLAG_SHUFFLE
    assert zstandard.ZstdDecompressor().decompress(stored) == payload[0::2] + payload[1::2]
    plain = zstandard.ZstdCompressor(level=1).compress(payload)
    assert len(stored) < 0.97 * len(plain)


@pytest.mark.parametrize("fsync", ["never", "always"])
def test_fsync_setting(make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch, fsync: str) -> None:
    tier = make_tier(fsync=fsync)
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    tier.write(*block(0, b"s" * 1000))
    # The block's subdirectory is new: the root is synced after creating it, then the
    # file before its rename, then the subdirectory after it.
    assert synced == (["dir", "file", "dir"] if fsync == "always" else [])


def test_views_of_other_formats(make_tier: TierFactory) -> None:
    tier = make_tier()
    data = random_payload(4096, 5)
    rec = BlockRecord(make_key(0), 4096, checksum(memoryview(data)))
    tier.write(rec, [memoryview(data).cast("H")])
    out = bytearray(4096)
    tier.read_into(rec.key, memoryview(out).cast("H"))
    assert out == data


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_warm_restart(make_tier: TierFactory, tmp_path: Path, compression: str) -> None:
    tier = make_tier(compression=compression)
    payloads = {i: kv_like_payload(50_000, i) if i % 2 else random_payload(50_000, i) for i in range(20)}
    for i, data in payloads.items():
        tier.write(*block(i, data, tenant=f"t{i % 3}"))
    tier.delete(make_key(0))
    del payloads[0]
    again = make_tier(compression=compression, open_=False)
    records = again.open()
    assert sorted(records, key=lambda r: r.key) == sorted((tier.record(make_key(i)) for i in payloads),
                                                          key=lambda r: r.key if r else b"")
    assert again.discarded_on_open == 0 and len(again) == 19
    assert again.used_bytes == tier.used_bytes == disk_usage(tmp_path / "disk")
    for i, data in payloads.items():
        assert read_back(again, make_key(i)) == data
        assert again.record(make_key(i)) == BlockRecord(make_key(i), len(data),
                                                       checksum(memoryview(data)), f"t{i % 3}")


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-1])


def _append(p: Path) -> None:
    p.write_bytes(p.read_bytes() + b"\0")


def _flip(offset: int) -> Callable[[Path], None]:
    def flip(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[offset] ^= 0x01
        p.write_bytes(bytes(data))
    return flip


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _header_only(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: header_length(len(b"default"))])


HEADER_DAMAGE = {
    "truncated": _truncate, "appended": _append, "garbage": _garbage, "empty": _empty,
    "header-only": _header_only, "magic": _flip(0), "version": _flip(4), "flags": _flip(6),
    "key": _flip(20), "size": _flip(60), "checksum": _flip(76), "tenant": _flip(86),
    "header-checksum": _flip(93),
}


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("damage", sorted(HEADER_DAMAGE))
def test_torn_or_invalid_file_is_discarded_at_open_and_never_read(
    make_tier: TierFactory, tmp_path: Path, compression: str, damage: str
) -> None:
    tier = make_tier(compression=compression)
    good, bad = kv_like_payload(10_000, 1), kv_like_payload(10_000, 2)
    tier.write(*block(0, good))
    tier.write(*block(1, bad))
    bad_path = next(p for p in block_files(tmp_path / "disk") if p.name.startswith(make_key(1).hex()))
    HEADER_DAMAGE[damage](bad_path)
    # Read by the running tier: caught by the header, size or payload checks.
    with pytest.raises(CorruptBlockError):
        tier.read_into(make_key(1), memoryview(bytearray(10_000)))
    assert not tier.contains(make_key(1)) and not bad_path.exists()
    assert tier.used_bytes == disk_usage(tmp_path / "disk")
    # Discarded by a restart.
    tier.write(*block(1, bad))
    HEADER_DAMAGE[damage](bad_path)
    again = make_tier(compression=compression, open_=False)
    assert [r.key for r in again.open()] == [make_key(0)]
    assert again.discarded_on_open == 1 and not bad_path.exists()
    assert read_back(again, make_key(0)) == good
    assert again.used_bytes == disk_usage(tmp_path / "disk")


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_flipped_payload_byte_is_caught_at_read(make_tier: TierFactory, tmp_path: Path, compression: str) -> None:
    tier = make_tier(compression=compression)
    tier.write(*block(0, kv_like_payload(50_000, 1)))
    path = block_files(tmp_path / "disk")[0]
    _flip(path.stat().st_size - 100)(path)
    again = make_tier(compression=compression, open_=False)
    assert len(again.open()) == 1  # open reads headers only
    with pytest.raises(CorruptBlockError, match="corrupt"):
        again.read_into(make_key(0), memoryview(bytearray(50_000)))
    assert len(again) == 0 and again.used_bytes == 0 and not path.exists()
    assert make_tier(open_=False).open() == []


def test_misplaced_and_misnamed_files_are_discarded(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    tier.write(*block(0, b"a" * 100))
    tier.write(*block(1, b"b" * 100))
    files = {p.name[:96]: p for p in block_files(tmp_path / "disk")}
    # Block 1's valid file renamed to another key's name, and block 0's moved to the root.
    files[make_key(1).hex()].rename(files[make_key(1).hex()].with_name(make_key(2).hex() + ".kvb"))
    files[make_key(0).hex()].rename(tmp_path / "disk" / files[make_key(0).hex()].name)
    (tmp_path / "disk" / "not-a-block.txt").write_text("left alone")
    again = make_tier(open_=False)
    assert again.open() == [] and again.discarded_on_open == 2
    assert block_files(tmp_path / "disk") == [] and (tmp_path / "disk" / "not-a-block.txt").exists()


def test_leftover_temp_file_is_removed_at_open(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    rec, views = block(0, b"z" * 1000)
    tier.write(rec, views)
    final = block_files(tmp_path / "disk")[0]
    tmp = final.with_name(f".{final.name}.123.0.tmp")
    shutil.copy(final, tmp)
    final.unlink()
    again = make_tier(open_=False)
    assert again.open() == [] and again.discarded_on_open == 0 and not tmp.exists()


_CRASH_CHILD = """
import os, sys
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_client.integrity import checksum
real = os.writev
def dying_writev(fd, bufs):
    real(fd, [memoryview(bufs[0])[:50]])  # half a header reaches the file, then the process dies
    os._exit(17)
os.writev = dying_writev
tier = DiskTier(DiskSettings(path=sys.argv[1], size_bytes=1 << 30, fsync=sys.argv[2]))
tier.open()
data = b"k" * 100000
tier.write(BlockRecord(bytes(range(48)), len(data), checksum(memoryview(data))), [memoryview(data)])
"""


@pytest.mark.parametrize("fsync", ["never", "always"])
def test_process_killed_mid_write_leaves_no_block(make_tier: TierFactory, tmp_path: Path, fsync: str) -> None:
    root = tmp_path / "disk"
    proc = subprocess.run([sys.executable, "-c", _CRASH_CHILD, str(root), fsync], capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr
    assert len(temp_files(root)) == 1 and block_files(root) == []
    tier = make_tier(open_=False)
    assert tier.open() == [] and temp_files(root) == [] and tier.used_bytes == 0


def test_io_error_mid_write_cleans_up(make_tier: TierFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    real = os.writev

    def failing_writev(fd: int, bufs: list[memoryview]) -> int:
        real(fd, [memoryview(bufs[0])[:10]])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "writev", failing_writev)
    rec, views = block(0, random_payload(10_000, 1))
    with pytest.raises(TierIOError, match="EIO"):
        tier.write(rec, views)
    assert not tier.contains(rec.key) and tier.used_bytes == 0 and tier.free_bytes == tier.capacity_bytes
    assert temp_files(tmp_path / "disk") == [] and block_files(tmp_path / "disk") == []
    monkeypatch.setattr(os, "writev", real)
    tier.write(rec, views)
    assert read_back(tier, rec.key) == bytes(random_payload(10_000, 1))


def test_rename_failure_cleans_up(make_tier: TierFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(fsync="always")

    def failing_rename(src: str, dst: str) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(TierIOError, match="EROFS"):
        tier.write(*block(0, b"q" * 1000))
    assert list((tmp_path / "disk").rglob("*.*")) == [] and len(tier) == 0


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_source_checksum_mismatch_is_caught_at_write(make_tier: TierFactory, tmp_path: Path, compression: str) -> None:
    tier = make_tier(compression=compression)
    data = bytearray(kv_like_payload(600_000, 1))
    rec, _ = block(0, bytes(data))
    data[599_999] ^= 0x80  # the hotter tier's copy rotted after the checksum was fixed
    with pytest.raises(CorruptBlockError):
        tier.write(rec, [memoryview(data)])
    with pytest.raises(CorruptBlockError):
        tier.write(rec, [memoryview(data)[:-1]])  # wrong length
    assert len(tier) == 0 and tier.used_bytes == 0 and tier.free_bytes == tier.capacity_bytes
    assert list((tmp_path / "disk").rglob("*.*")) == []


def test_capacity_accounting_across_write_delete_restart(make_tier: TierFactory, tmp_path: Path) -> None:
    one = header_length(len(b"default")) + 1000
    tier = make_tier(size_bytes=3 * one)
    for i in range(3):
        assert tier.write(*block(i, random_payload(1000, i))) == one
    assert tier.used_bytes == 3 * one and tier.free_bytes == 0
    with pytest.raises(TierFullError):
        tier.write(*block(3, random_payload(1000, 3)))
    assert not tier.contains(make_key(3)) and len(block_files(tmp_path / "disk")) == 3
    assert tier.delete(make_key(1)) == one and tier.delete(make_key(1)) == 0
    assert tier.used_bytes == 2 * one and tier.free_bytes == one
    tier.write(*block(3, random_payload(1000, 3)))
    again = make_tier(size_bytes=3 * one, open_=False)
    again.open()
    assert again.used_bytes == 3 * one == disk_usage(tmp_path / "disk") and again.free_bytes == 0


def test_files_beyond_capacity_are_kept_and_reported(
    make_tier: TierFactory, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    for i in range(4):
        tier.write(*block(i, b"w" * 1000))
    small = make_tier(size_bytes=1000, open_=False)
    with caplog.at_level(logging.WARNING, logger=disk_mod.__name__):
        assert len(small.open()) == 4
    assert "exceed the capacity" in caplog.text
    assert small.used_bytes == tier.used_bytes and small.free_bytes == 0


def test_concurrent_writes_never_overrun_capacity(make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    one = header_length(len(b"default")) + 20_000
    tier = make_tier(size_bytes=2 * one)
    arrived = threading.Condition()
    outcomes: list[str] = []
    real = os.writev

    def arrive(outcome: str) -> None:
        with arrived:
            outcomes.append(outcome)
            arrived.notify_all()

    def held_writev(fd: int, bufs: list[memoryview]) -> int:
        # Hold every write in flight until all four writers got in or were refused.
        arrive("in flight")
        with arrived:
            assert arrived.wait_for(lambda: len(outcomes) >= 4, timeout=10)
        return real(fd, bufs)

    def worker(i: int) -> None:
        try:
            tier.write(*block(i, random_payload(20_000, i)))
        except TierFullError:
            arrive("full")

    monkeypatch.setattr(os, "writev", held_writev)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["full", "full", "in flight", "in flight"]
    assert tier.used_bytes == 2 * one and len(tier) == 2 and tier.free_bytes == 0
    for key in tier.keys():
        read_back(tier, key)


def test_read_errors(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    tier.write(*block(0, b"r" * 100))
    with pytest.raises(KeyError):
        tier.read_into(make_key(9), memoryview(bytearray(100)))
    with pytest.raises(ValueError):
        tier.read_into(make_key(0), memoryview(bytearray(99)))
    with pytest.raises(ValueError):
        tier.read_into(make_key(0), memoryview(bytes(100)))
    assert read_back(tier, make_key(0)) == b"r" * 100  # a caller's mistake keeps the block
    with pytest.raises(ValueError):
        tier.write(BlockRecord(b"short", 1, checksum(memoryview(b"x"))), [memoryview(b"x")])


def test_missing_directory_is_created_at_open(make_tier: TierFactory, tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "disk"
    tier = make_tier(root=root, open_=False)
    assert tier.open() == [] and root.is_dir()


def test_uncreatable_directory_raises_tier_io_error(make_tier: TierFactory, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    tier = make_tier(root=tmp_path / "file" / "disk", open_=False)
    with pytest.raises(TierIOError, match="ENOTDIR") as info:
        tier.open()
    assert str(tmp_path / "file" / "disk") in str(info.value)


def test_directory_removed_at_run_time(make_tier: TierFactory, tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = make_tier(fsync="always")
    tier.write(*block(0, b"o" * 1000))
    shutil.rmtree(root)
    tier.write(*block(1, b"n" * 1000))  # recreated once, then written
    assert read_back(tier, make_key(1)) == b"n" * 1000
    with pytest.raises(TierIOError, match="ENOENT"):
        tier.read_into(make_key(0), memoryview(bytearray(1000)))
    assert tier.keys() == [make_key(1)] and tier.used_bytes == disk_usage(root)
    # A directory that cannot come back: clean error, no reservation leaked.
    shutil.rmtree(root)
    root.write_text("now a file")
    with pytest.raises(TierIOError):
        tier.write(*block(2, b"m" * 1000))
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes and not tier.contains(make_key(2))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root and CAP_SYS_ADMIN)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", str(mnt).encode(), b"tmpfs", 0, b"size=1m") != 0:
        err = ctypes.get_errno()
        if err == errno.EPERM:
            pytest.skip("cannot mount a tmpfs here (EPERM: not root or no CAP_SYS_ADMIN)")
        pytest.fail(f"mount tmpfs failed: {errno.errorcode.get(err, err)}")
    try:
        yield mnt
    finally:
        if libc.umount2(str(mnt).encode(), 0) != 0:
            libc.umount2(str(mnt).encode(), 2)  # MNT_DETACH


def test_real_full_disk(make_tier: TierFactory, tiny_tmpfs: Path) -> None:
    """A filesystem smaller than the tier's size: the tier shrinks to what it has (writes
    past it are TierFullError, so the store evicts instead of failing every demotion) and
    grows back when space returns."""
    root = tiny_tmpfs / "disk"
    tier = make_tier(root=root, size_bytes=64 * MiB)
    stored: dict[int, bytes] = {}
    with pytest.raises((TierFullError, TierIOError)):
        for i in range(20):
            data = random_payload(100_000, i)
            tier.write(*block(i, data))
            stored[i] = data
    assert 5 <= len(stored) < 20 and len(tier) == len(stored)
    assert temp_files(root) == []
    assert tier.used_bytes == disk_usage(root) and tier.free_bytes < 100_000  # shrunk to the filesystem
    for i, data in stored.items():
        assert read_back(tier, make_key(i)) == data
    tier.delete(make_key(0))  # room again: the next write succeeds
    tier.write(*block(99, random_payload(100_000, 99)))
    assert read_back(tier, make_key(99)) == random_payload(100_000, 99)
    # someone else's file takes the rest, then goes: the tier follows the filesystem
    hog = tiny_tmpfs / "hog"
    hog.write_bytes(b"\0" * max(0, tier.free_bytes - 4096))
    assert tier.free_bytes < 8192
    with pytest.raises(TierFullError):
        tier.write(*block(100, random_payload(100_000, 100)))
    hog.unlink()
    for k in list(stored)[1:3]:
        tier.delete(make_key(k))
    assert tier.free_bytes >= 100_000
    tier.write(*block(100, random_payload(100_000, 100)))
    assert read_back(tier, make_key(100)) == random_payload(100_000, 100)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), repeat=st.integers(1, 40), level=st.integers(1, 9))
def test_encode_decode_round_trip(data: bytes, repeat: int, level: int) -> None:
    for payload in (data, data * repeat):
        flags, stored = encode_payload(memoryview(payload), level)
        if flags:
            assert flags == FLAG_ZSTD | FLAG_SHUFFLE and len(stored) < len(payload)
        else:
            assert bytes(stored) == payload
        out = bytearray(len(payload))
        decode_payload(flags, stored, memoryview(out))
        assert out == payload


def test_decode_rejects_wrong_content_size() -> None:
    payload = b"ab" * 1000
    flags, stored = encode_payload(memoryview(payload), 3)
    assert flags
    with pytest.raises(CorruptBlockError):
        decode_payload(flags, stored, memoryview(bytearray(len(payload) - 1)))
    with pytest.raises(CorruptBlockError):
        decode_payload(flags, b"\x28\xb5\x2f\xfd garbage", memoryview(bytearray(len(payload))))


def test_a_different_block_under_a_held_key_replaces_it(make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier()
    old, new = random_payload(10_000, 1), random_payload(7_000, 2)
    tier.write(*block(1, old))
    tier.write(*block(1, old))  # the same block again: kept as is
    assert read_back(tier, make_key(1)) == old
    tier.write(*block(1, new))  # another record under the key (a stale file): replaced
    assert read_back(tier, make_key(1)) == new
    assert len(block_files(tmp_path / "disk")) == 1
    assert tier.used_bytes == disk_usage(tmp_path / "disk")


# ---------------------------------------------------------------- batched writes
@pytest.mark.parametrize("fsync", ["never", "always"])
def test_write_many_stores_a_batch_with_one_sync(make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path, fsync: str) -> None:
    tier = make_tier(fsync=fsync)
    for i in range(3):  # the subdirectories exist: what follows syncs only for the batch
        tier.write(*block(100 + i, b"d"))
    synced: list[str] = []
    real_fsync, real_syncfs = os.fsync, disk_mod._syncfs

    def spy_fsync(fd: int) -> None:
        synced.append("fsync")
        real_fsync(fd)

    def spy_syncfs(path: str) -> None:
        synced.append("syncfs")
        real_syncfs(path)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(disk_mod, "_syncfs", spy_syncfs)
    datas = [random_payload(50_000 + i, i) for i in range(8)]
    items = [block(i, d) for i, d in enumerate(datas)]
    bad_rec, bad_views = block(8, random_payload(1000, 8))
    items.insert(3, (BlockRecord(bad_rec.key, bad_rec.size, bad_rec.checksum ^ 1, bad_rec.tenant), bad_views))
    out = tier.write_many(items)
    assert isinstance(out[3], CorruptBlockError) and not tier.contains(bad_rec.key)
    assert [r for i, r in enumerate(out) if i != 3] == [tier.stored_bytes(make_key(i)) for i in range(8)]
    assert all(read_back(tier, make_key(i)) == d for i, d in enumerate(datas))
    assert synced == (["syncfs"] if fsync == "always" else [])
    assert temp_files(tmp_path / "disk") == []
    # blocks already held cost no sync
    synced.clear()
    assert tier.write_many(items[:2]) == out[:2] and synced == []


def test_a_failed_batch_sync_keeps_no_block_of_it(make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    tier = make_tier(fsync="always")
    held, held_views = block(0, random_payload(2000, 0))
    tier.write(held, held_views)

    def failing(path: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(disk_mod, "_syncfs", failing)
    items = [(held, held_views)] + [block(i, random_payload(3000, i)) for i in (1, 2)]
    out = tier.write_many(items)
    assert out[0] == tier.stored_bytes(held.key)  # it was durable before this batch
    assert all(isinstance(r, TierIOError) and "sync" in str(r) for r in out[1:])
    assert tier.contains(held.key) and not tier.contains(make_key(1)) and not tier.contains(make_key(2))
    assert [p.name for p in block_files(tmp_path / "disk")] == [held.key.hex() + ".kvb"]
    assert tier.used_bytes == disk_usage(tmp_path / "disk")


def test_prefetch_hints_the_files_it_holds(make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    for i in range(3):
        tier.write(*block(i, random_payload(5000, i)))
    hinted: list[int] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hinted.append(os.fstat(fd).st_size)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    assert tier.prefetch([make_key(0), make_key(9), make_key(2)]) == 2  # 9 is not held: skipped
    assert hinted == [tier.stored_bytes(make_key(0)), tier.stored_bytes(make_key(2))]
    assert read_back(tier, make_key(2)) == random_payload(5000, 2)


def test_the_filesystem_is_asked_once_a_while_far_from_its_end_and_every_time_near_it(
        make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(size_bytes=64 * MiB)
    now = [100.0]
    monkeypatch.setattr(tier, "clock", lambda: now[0])
    fs_free = [tier.capacity_bytes + fsfree_mod.FS_SLACK_BYTES + 8 * MiB]
    asked: list[str] = []

    def statvfs(path: str) -> Any:
        asked.append(path)
        return type("Fs", (), {"f_bavail": fs_free[0] // 4096, "f_frsize": 4096})()

    monkeypatch.setattr(fsfree_mod.os, "statvfs", statvfs)
    tier.write(*block(1, random_payload(MiB, 1)))
    now[0] += fsfree_mod.FS_FREE_TTL_S
    asked.clear()
    for _ in range(50):  # far from the end: one answer stands for FS_FREE_TTL_S
        assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes
    assert len(asked) == 1
    now[0] += fsfree_mod.FS_FREE_TTL_S
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes and len(asked) == 2
    # near the end (someone else's files took most of it): asked on every call, and believed
    fs_free[0] = 3 * MiB
    now[0] += fsfree_mod.FS_FREE_TTL_S
    asked.clear()
    for room in (3 * MiB, 2 * MiB, MiB):
        fs_free[0] = room
        assert tier.free_bytes == room
    assert len(asked) == 3
    with pytest.raises(TierFullError):
        tier.write(*block(2, random_payload(2 * MiB, 2)))


def test_a_late_release_during_a_failed_write_of_its_key_leaves_no_file(tmp_path: Path) -> None:
    """A detached block's release that runs while a write of its key is in flight leaves the
    file to that write (which renames its own over it). Where the write fails, the older file
    goes with it: it had stayed on disk, uncounted, and the next open served it again."""
    tier = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=16 * MiB))
    tier.open()
    rec, views = block(1, random_payload(5000, 1))
    tier.write(rec, views)
    free = tier.detach(rec.key)
    assert free is not None and not tier.contains(rec.key)
    real = tier._write

    def failing(*args: Any) -> Any:
        free()  # the late release, while the write is in flight
        raise TierIOError("disk tier: the device went away")

    tier._write = failing  # type: ignore[method-assign]
    again, views = block(1, random_payload(5000, 2))
    with pytest.raises(TierIOError):
        tier.write(again, views)
    tier._write = real  # type: ignore[method-assign]
    assert block_files(tmp_path / "disk") == [] and tier.used_bytes == 0
    assert tier.open() == []
    # a write that succeeds keeps its own file
    tier.write(rec, block(1, random_payload(5000, 1))[1])
    free = tier.detach(rec.key)
    assert free is not None
    tier._write = lambda *args: (free(), real(*args))[1]  # type: ignore[method-assign]
    tier.write(again, views)
    assert read_back(tier, rec.key) == random_payload(5000, 2)


def test_a_release_unlinks_outside_the_lock_and_a_write_of_its_key_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop takes the tier's lock (room for every put and demotion): an unlink held
    under it had held the loop as long (140-150 ms behind 50 ms unlinks, in a review). A write
    of the key that begins meanwhile waits for the unlink, so its new file is never the one
    unlinked."""
    tier = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=16 * MiB))
    tier.open()
    rec, views = block(1, random_payload(5000, 1))
    tier.write(rec, views)
    free = tier.detach(rec.key)
    assert free is not None
    unlinking, go = threading.Event(), threading.Event()

    def slow_unlink(path: str) -> None:
        unlinking.set()
        go.wait(10)
        os.unlink(path)

    monkeypatch.setattr(disk_mod, "_unlink", slow_unlink)
    release = threading.Thread(target=free)
    release.start()
    assert unlinking.wait(10)
    looked = threading.Thread(target=lambda: tier.free_bytes)
    looked.start()
    looked.join(5)
    assert not looked.is_alive()  # the lock is free while the unlink runs
    again, new_views = block(1, random_payload(5000, 2))
    writer = threading.Thread(target=tier.write, args=(again, new_views))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()  # the write of the key waits for the unlink ...
    go.set()
    release.join(10)
    writer.join(10)
    assert read_back(tier, rec.key) == random_payload(5000, 2)  # ... so its own file stays
    assert block_files(tmp_path / "disk") != [] and tier.open() != []


def test_a_write_waits_for_every_unlink_of_its_key_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two late releases of one key unlink at once (the first block's, then the second's): a
    write that begins when the first is done must still wait for the second, whose unlink
    would take its new file."""
    tier = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=16 * MiB))
    tier.open()
    releases = []
    for version in (1, 2):
        rec, views = block(1, random_payload(5000, version))
        tier.write(rec, views)
        free = tier.detach(rec.key)
        assert free is not None
        releases.append(free)
    started, gates = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    calls = iter(range(2))

    def slow_unlink(path: str) -> None:
        i = next(calls)
        started[i].set()
        gates[i].wait(10)
        if os.path.exists(path):
            os.unlink(path)

    monkeypatch.setattr(disk_mod, "_unlink", slow_unlink)
    threads = [threading.Thread(target=free) for free in releases]
    for t in threads:
        t.start()
    assert started[0].wait(10) and started[1].wait(10)
    gates[0].set()
    threads[0].join(10)  # the first unlink is over; the second still runs
    again, views = block(1, random_payload(5000, 3))
    writer = threading.Thread(target=tier.write, args=(again, views))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()
    gates[1].set()
    threads[1].join(10)
    writer.join(10)
    assert read_back(tier, again.key) == random_payload(5000, 3)


def test_a_delete_during_a_write_of_its_key_leaves_the_file_to_that_write(tmp_path: Path) -> None:
    """``delete`` (a tier's plain release) had unlinked whatever file lay under the key, also
    the one a write of the key had just renamed into place."""
    tier = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=16 * MiB))
    tier.open()
    rec, views = block(1, random_payload(5000, 1))
    tier.write(rec, views)
    real = tier._write

    def deleted_meanwhile(*args: Any) -> Any:
        written = real(*args)  # renamed into place ...
        assert tier.delete(rec.key) > 0  # ... and the older block deleted before it is counted
        return written

    tier._write = deleted_meanwhile  # type: ignore[method-assign]
    again, new_views = block(1, random_payload(5000, 2))
    tier.write(again, new_views)
    tier._write = real  # type: ignore[method-assign]
    assert read_back(tier, rec.key) == random_payload(5000, 2)
