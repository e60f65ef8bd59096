"""The index as the read path sees it: while it fails, reads stop asking it for a while.

A read that misses locally asks the index (Redis) which peers hold its blocks, within a
deadline: ``peer.lookup_timeout_s`` for the peers' part of a ``LOOKUP`` (0.25 s),
``peer.fetch_timeout_s`` for a fetch (2 s). With Redis stopped, gone or unreachable, each of
them had waited out its deadline (or redis-py's retries) every time: every ``LOOKUP`` of a
prompt not wholly held here took 250 ms, and a vLLM scheduler step that looked up four new
requests took a second, for as long as the outage lasted. Peers that fail are backed off
(:class:`~kvpool_sidecar.peers.PeerReader`); the index now is too.

After the index fails a read (an error, or no answer within the read's deadline where the
read gave it at least :data:`SLOW_S` of it), reads skip it, as a miss at once, for
:data:`BACKOFF_S` (0.5 s, doubled at each failure in a row up to 8 s). Then one read asks
it again (the others keep skipping it until that one's answer): an answer ends the
back-off; a failure doubles it. A read whose own deadline was too short to judge the index
by (it had waited for its turn, say) neither ends nor lengthens a back-off. Reads that fail
together, each begun before the first of them started the back-off, are one failure: each
had doubled it, so a stall of 0.3 s that failed the 8 lookups then in flight had made every
read skip the index for 8 s, not 0.5 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from kvpool_sidecar.errors import IndexDataError, SidecarError

#: Seconds reads skip the index after it failed one: the first back-off, and the longest.
BACKOFF_S = (0.5, 8.0)


class IndexWatch:
    """Whether reads ask the index now (:meth:`asking`), from how its last answers went."""

    def __init__(self, slow_s: float, *, backoff_s: tuple[float, float] = BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: A read that gave the index this long and got no answer counts as a failure (the
        #: shortest deadline a read gives it: ``peer.lookup_timeout_s``).
        self.slow_s = slow_s
        self.backoff_s = backoff_s
        self._clock = clock
        #: Until when reads skip the index (0: it answers), and the back-off after the next failure.
        self._until = 0.0
        self._next = backoff_s[0]
        #: A read is asking the index after a back-off: the others keep skipping it.
        self._probing = False
        #: When the last back-off began: a read begun before it that fails is the same failure.
        self._since = float("-inf")

    @property
    def down(self) -> bool:
        """Whether the index's last answer was a failure (reads skip it, or one probes it)."""
        return self._until > 0.0

    def skipping(self) -> bool:
        """Whether a read skips the index now (a miss at once): after a failure, until the
        back-off ends, and then while one read asks it again."""
        if self._until == 0.0:
            return False
        return self._probing or self._clock() < self._until

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        """Around one read's calls to the index, where :meth:`skipping` said no just before
        (with no wait between: the read that asks after a back-off is then the only one): a
        :class:`SidecarError`, or a ``TimeoutError`` after at least :attr:`slow_s`, starts or
        doubles the back-off; an answer ends it. Errors go on to the caller."""
        probe = self._until > 0.0  # (the others skip meanwhile: only this read probes)
        if probe:
            self._probing = True
        started = self._clock()
        try:
            yield
        except IndexDataError:
            # it answered, with a value no member writes: that read misses, the others go on
            # (one such value, read by one read in ten, had made every tenant skip the index
            # for seconds at a time, and nine reads in ten of intact blocks miss)
            self._answered()
            raise
        except SidecarError:
            self._failed(started, probe)
            raise
        except TimeoutError:
            if self._clock() - started >= self.slow_s:
                self._failed(started, probe)
            elif probe:
                self._probing = False  # (too short a wait to judge the index by)
            raise
        except BaseException:  # cancelled: says nothing of the index
            if probe:
                self._probing = False
            raise
        self._answered()

    def _answered(self) -> None:
        self._until, self._next, self._probing = 0.0, self.backoff_s[0], False

    def _failed(self, started: float, probe: bool) -> None:
        if not probe and started < self._since:
            return  # begun before the back-off now running began: the failure that started it
        now = self._clock()
        self._since = now
        self._until = now + self._next
        self._next = min(self.backoff_s[1], self._next * 2)
        if probe:
            self._probing = False
