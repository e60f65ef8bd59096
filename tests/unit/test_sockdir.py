"""Where a socket may lie: the directory and every symbolic link on the way to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
