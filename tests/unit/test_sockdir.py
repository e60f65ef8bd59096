"""Where a socket may lie: the directory, every directory above it and every symbolic link
on the way to it; and how the directories missing are made."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvpool_sidecar.api.local import _bind_unix
from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.sockdir import check_socket_dir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user needs root")


def _dirs(tmp_path: Path) -> Path:
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True, mode=0o750)
    real.chmod(0o750)
    return real


def test_links_of_our_own_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _dirs(tmp_path)
    (tmp_path / "mine").symlink_to(real)
    (tmp_path / "relative").symlink_to("real/sub")
    check_socket_dir(tmp_path / "mine" / "sub")
    check_socket_dir(tmp_path / "relative")
    monkeypatch.chdir(tmp_path)
    check_socket_dir(Path("mine/sub/.."))


@needs_root
@pytest.mark.parametrize("way", ["the directory", "a parent", "a parent left by '..'"])
def test_a_link_another_user_owns_is_refused_wherever_it_is_on_the_way(tmp_path: Path, way: str) -> None:
    """Such a link (planted in a sticky directory) points at our directory today and at one of
    that user's tomorrow; '..' after it is resolved where the kernel resolves it, past the link."""
    real = _dirs(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(real / "sub" if way == "a parent left by '..'" else real)
    os.lchown(theirs, 2000, 2000)
    where = {"the directory": theirs, "a parent": theirs / "sub", "a parent left by '..'": theirs / ".." / "sub"}[way]
    assert where.resolve().is_dir()
    with pytest.raises(SidecarError, match="symbolic link that uid 2000 owns"):
        check_socket_dir(where)


@pytest.mark.parametrize("mode", [0o1777, 0o1770, 0o777, 0o770])
def test_a_directory_others_may_write_is_refused_even_sticky(tmp_path: Path, mode: int) -> None:
    """Sticky (/tmp) keeps others from replacing our socket, not from binding its name while
    the sidecar is down: every client that connects then hands that process its token."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(SidecarError, match="writable by other users"):
        check_socket_dir(shared)
    shared.chmod(0o750)
    check_socket_dir(shared)


@needs_root
def test_a_directory_above_that_another_user_owns_is_refused(tmp_path: Path) -> None:
    """That user could rename the socket's directory while the sidecar runs, make one of its
    own in its place, bind ``kvpool.sock`` there and read the next client's HELLO and token."""
    above = tmp_path / "shared"
    (above / "kvpool").mkdir(parents=True, mode=0o750)
    os.chown(above, 2000, 2000)
    with pytest.raises(SidecarError, match=f"{above}, a directory on the way .* belongs to uid 2000"):
        check_socket_dir(above / "kvpool")
    with pytest.raises(SidecarError, match="belongs to uid 2000"):
        _bind_unix(str(above / "kvpool" / "kvpool.sock"), 0o660)
    assert not (above / "kvpool" / "kvpool.sock").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=oct)
def test_a_directory_above_that_others_may_write_is_refused_unless_sticky(tmp_path: Path, mode: int) -> None:
    """Without the sticky bit anyone who may write there may rename our directory (as /tmp,
    sticky, keeps them from it: only its owner, or root, may)."""
    above = tmp_path / "shared"
    (above / "kvpool").mkdir(parents=True, mode=0o750)
    above.chmod(mode)
    with pytest.raises(SidecarError, match="writable by other users without the sticky bit"):
        check_socket_dir(above / "kvpool")
    with pytest.raises(SidecarError, match="without the sticky bit"):
        _bind_unix(str(above / "kvpool" / "kvpool.sock"), 0o660)
    assert not (above / "kvpool" / "kvpool.sock").exists()
    above.chmod(mode | stat.S_ISVTX)
    check_socket_dir(above / "kvpool")


def test_the_directories_missing_are_made_and_checked(tmp_path: Path) -> None:
    """Made one at a time, none writable by others whatever the umask (a socket's clients
    of other users pass through them)."""
    old = os.umask(0)
    try:
        sock = _bind_unix(str(tmp_path / "run" / "kvpool" / "x.y" / "kvpool.sock"), 0o660)
    finally:
        os.umask(old)
    sock.close()
    for made in (tmp_path / "run", tmp_path / "run" / "kvpool", tmp_path / "run" / "kvpool" / "x.y"):
        assert made.is_dir() and not made.is_symlink() and made.stat().st_mode & 0o777 == 0o755


@needs_root
def test_a_link_another_user_owns_is_not_followed_to_make_directories(tmp_path: Path) -> None:
    """The directories missing on the way are made only once the way is checked: through a
    link another user planted, the (root) sidecar had made them in the link's target, then
    refused to start."""
    target = tmp_path / "rootonly"
    target.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    os.lchown(link, 2000, 2000)
    with pytest.raises(SidecarError, match="symbolic link that uid 2000 owns"):
        _bind_unix(str(link / "a" / "b" / "kvpool.sock"), 0o660)
    assert list(target.iterdir()) == []
