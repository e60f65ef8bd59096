"""BackgroundSaver: saves held for their step's outcome, and a copy off the device that
fails (no page-locked memory) is a save dropped, its backlog given back."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from kvpool_client.engines import blockio
from kvpool_client.errors import KVPoolError

torch = pytest.importorskip("torch")


def no_sidecar() -> Any:
    raise KVPoolError("no sidecar here")


def test_held_saves_wait_for_their_step_and_count_in_the_backlog() -> None:
    saver = blockio.BackgroundSaver(no_sidecar, max_pending_bytes=3 * 4096)
    try:
        rows = torch.zeros((1, 4096), dtype=torch.uint8)
        assert saver.submit(rows, [b"k" * 48], depth=0, parent=None, hold=7)
        assert saver.submit(rows, [b"j" * 48], depth=0, parent=None, hold=8)
        assert saver.flush(1.0)  # held saves are not waited for
        assert saver.stats.failed == 0  # nor put
        saver.settle(7, False)
        assert saver.stats.dropped == 1
        saver.settle(8, True)
        assert saver.flush(5.0) and saver.stats.failed == 1  # put (and failed: no sidecar)
        assert saver.submit(rows, [b"i" * 48], depth=0, parent=None, hold=9)
        assert saver.settle_before(10) == 1 and saver.stats.dropped == 2
        assert saver._pending_bytes == 0 and saver._busy == 0  # noqa: SLF001
    finally:
        saver.close(1.0)


def test_a_copy_off_the_device_that_fails_drops_the_save_and_gives_its_backlog_back() -> None:
    saver = blockio.BackgroundSaver(no_sidecar, max_pending_bytes=1 << 20)
    try:
        rows = mock.MagicMock()
        rows.shape, rows.device.type = (1, 4096), "cuda"
        rows.numel.return_value = 4096
        fake = mock.MagicMock()
        fake.empty.side_effect = RuntimeError("CUDA error: out of memory")
        with mock.patch.object(blockio, "_torch", lambda: fake):
            assert not saver.submit(rows, [b"k" * 48], depth=0, parent=None, hold=3)
        assert saver.stats.dropped == 1
        assert saver._pending_bytes == 0 and saver._busy == 0  # noqa: SLF001
        assert saver.flush(0.5)
    finally:
        saver.close(1.0)
