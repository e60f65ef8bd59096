"""The requests of one peer read (:class:`~kvpool_sidecar.peers.PeerReader`): a first round
to the holders chosen, and, as soon as a request finds its holder failing, the keys the read
missed of that holder asked once more of their other holders.

A holder that died while its record is still believed refuses at once; the read that meets it
had waited for every other request of its first round before asking again, so beside a slow
holder it had no time left to ask, and missed blocks another holder had.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple


class Answer(NamedTuple):
    """One request's outcome (:meth:`PeerReader._timed_fetch`)."""

    #: Which of its blocks arrived.
    got: list[bool]
    #: Seconds from when its turns came to its end.
    took: float
    #: Whether the transport's fetch failed before its time ran out (``Transport.failing``).
    failed: bool


#: One request: the holder's address and the keys asked of it.
Request = tuple[str, list[bytes]]
#: Asks a holder for keys (one request, within the read's deadline).
Ask = Callable[[str, list[bytes]], Awaitable[Answer]]
#: The keys (in read order) that have another holder to ask, by the address chosen, never one
#: of those given.
Regroup = Callable[[list[bytes], list[list[str]], set[str]], dict[str, list[bytes]]]
#: Judges the holders of a round's requests by their answers.
Judge = Callable[[list[Request], list[Answer]], None]


def requests_of(groups: dict[str, list[bytes]], most: int) -> list[Request]:
    """Each holder's keys in requests of at most ``most`` (what its transport takes: a peer
    refuses a longer one whole, at once)."""
    most = max(1, most)
    return [(addr, ks[i : i + most]) for addr, ks in groups.items() for i in range(0, len(ks), most)]


def _retrieve(task: asyncio.Task[Answer]) -> None:
    """Mark a request's error seen: :meth:`ReadRounds.run` raises the first it meets, and the
    others (requests ending in the same wait, or cancelled with the read) are nobody's to see."""
    if not task.cancelled():
        task.exception()


class ReadRounds:
    """Runs one read's requests; :meth:`run` returns how many blocks arrived."""

    def __init__(self, keys: Sequence[bytes], holders: Sequence[list[str]], *, ask: Ask, regroup: Regroup,
                 judge: Judge, time_left: Callable[[], bool], most: int) -> None:
        self._holders = dict(zip(keys, holders))
        self._order = {k: i for i, k in enumerate(keys)}
        self._ask, self._regroup, self._judge = ask, regroup, judge
        self._time_left = time_left
        self._most = most
        self._tasks: dict[asyncio.Task[Answer], tuple[Request, bool]] = {}
        #: The holders a request of this read's first round found failing.
        self._failing: set[str] = set()
        #: The first round's keys that did not arrive, by holder, not asked again yet.
        self._missed: dict[str, list[bytes]] = {}
        self._cut = len(keys)

    def _launch(self, requests: list[Request], again: bool) -> set[asyncio.Task[Answer]]:
        started = set()
        for addr, ks in requests:
            task = asyncio.ensure_future(self._ask(addr, ks))
            task.add_done_callback(_retrieve)
            self._tasks[task] = ((addr, ks), again)
            started.add(task)
        return started

    async def run(self, groups: dict[str, list[bytes]]) -> int:
        got = 0
        rounds: tuple[list[tuple[Request, Answer]], list[tuple[Request, Answer]]] = ([], [])
        pending = self._launch(requests_of(groups, self._most), False)
        first_left, judged = len(pending), False
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    request, again = self._tasks.pop(task)
                    answer = task.result()
                    got += sum(answer.got)
                    rounds[again].append((request, answer))
                    if again:
                        continue
                    first_left -= 1
                    addr, ks = request
                    self._missed.setdefault(addr, []).extend(k for k, ok in zip(ks, answer.got) if not ok)
                    if answer.failed:
                        self._failing.add(addr)
                if first_left == 0 and not judged:  # (before the regroup: it skips holders backed off)
                    judged = True
                    self._judge(*_unzip(rounds[0]))
                pending |= self._again()
        finally:
            for task in pending:
                task.cancel()
            if pending:  # (as gather did: a transfer cancelled may still write into its rooms)
                await asyncio.wait(pending)
        if rounds[1]:
            self._judge(*_unzip(rounds[1]))
        return got

    def _again(self) -> set[asyncio.Task[Answer]]:
        """Ask other holders, once, for the keys this read missed of a holder one of its first
        round's requests found failing (those of its requests turned away by the gate, or
        answered before another failed, included), while there is time to move blocks."""
        retry = [k for addr in self._failing for k in self._missed.pop(addr, [])]
        if not retry or not self._time_left():
            return set()
        retry = sorted((k for k in retry if self._order[k] < self._cut), key=self._order.__getitem__)
        groups = self._regroup(retry, [self._holders[k] for k in retry], self._failing)
        asked = {k for ks in groups.values() for k in ks}
        # the read's prefix ends at the first key left without a holder: later retries stop there
        self._cut = min([self._cut] + [self._order[k] for k in retry if k not in asked])
        return self._launch(requests_of(groups, self._most), True)


def _unzip(pairs: list[tuple[Request, Answer]]) -> tuple[list[Request], list[Answer]]:
    return [r for r, _ in pairs], [a for _, a in pairs]
