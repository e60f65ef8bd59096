"""The client's background pre-fault of the arena: every page, in steps, and it stops when told."""

from __future__ import annotations

import mmap
import threading

import pytest

from kvpool_client import memory

PAGE = mmap.PAGESIZE
STEPS = 16


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each step's (offset, size), with the step made one page."""
    calls: list[tuple[int, int]] = []
    real = memory._populate
    monkeypatch.setattr(memory, "STEP", PAGE)

    def populate(addr: int, size: int) -> bool:
        calls.append((addr, size))
        return real(addr, size)

    monkeypatch.setattr(memory, "_populate", populate)
    return calls


def test_every_page_is_made_writable_in_steps(steps: list[tuple[int, int]]) -> None:
    mm = mmap.mmap(-1, STEPS * PAGE, flags=mmap.MAP_SHARED)
    prefault = memory.BackgroundPrefault(mm)
    prefault.wait()
    base = steps[0][0]
    assert [(a - base, n) for a, n in steps] == [(i * PAGE, PAGE) for i in range(STEPS)]
    mm[-1:] = b"x"  # still a working mapping
    prefault.cancel()  # after the end: returns
    mm.close()


def test_a_stopped_prefault_takes_no_further_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    in_step, go_on = threading.Event(), threading.Event()
    real = memory._populate
    monkeypatch.setattr(memory, "STEP", PAGE)

    def held_first_step(addr: int, size: int) -> bool:
        calls.append(addr)
        in_step.set()
        go_on.wait()
        return real(addr, size)

    monkeypatch.setattr(memory, "_populate", held_first_step)
    mm = mmap.mmap(-1, STEPS * PAGE, flags=mmap.MAP_SHARED)
    prefault = memory.BackgroundPrefault(mm)
    assert in_step.wait(10)
    prefault.stop()  # told while its first step is under way (the client closing)
    go_on.set()
    prefault.wait()
    assert len(calls) == 1  # that step finished; none after it
    mm.close()
