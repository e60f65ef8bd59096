"""The scheduler's side of an engine connector, with no engine in it.

An engine asks, per request, how many of its prompt's leading tokens the pool can supply
(:meth:`PrefixPlanner.matched_tokens`), then tells where it put the request's blocks
(:meth:`PrefixPlanner.allocated`, :meth:`PrefixPlanner.scheduled`), when it preempted
(:meth:`PrefixPlanner.preempted`) and when the request finished. The planner answers
with :class:`StepPlan`: which engine blocks to load from the pool and which to save to it
in this step, each with the engine's block hashes (every worker rank turns a hash into
its own key).

Rules it keeps:

- a hit counts only if every rank holds the block (one lookup of the ranks' keys
  interleaved: block ``i`` of rank ``r`` is key ``i * ranks + r``, so the longest prefix
  divided by the number of ranks is the number of blocks all ranks hold);
- at least one prompt token is always computed (the engine needs its logits);
- the lookup of a request is cached until its state changes, so the engine may ask again
  with no side effect and no second round trip;
- a lookup that fails or times out is a miss (the engine computes), never an error; so is
  one asked once the step's lookups have taken their budget (:class:`StepBudget`);
- each block is saved once, when it is fully computed, and blocks the pool already
  held at lookup are not saved again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvpool_client.blockinfo import EngineBlock, PutHints
from kvpool_client.errors import DeadlineError, KVPoolError, RemoteError
from kvpool_client.protocol import ErrorCode

logger = logging.getLogger(__name__)

#: ``lookup(keys) -> longest held prefix`` over interleaved keys of every rank.
LookupFn = Callable[[Sequence[bytes]], int]
#: ``keys(rank, engine_hashes) -> raw pool keys`` of one rank.
KeysFn = Callable[[int, Sequence[bytes]], list[bytes]]

#: The most steps of a request a save that could not be made waits before it is planned again.
MAX_SAVE_BACKOFF = 64

C = TypeVar("C")
T = TypeVar("T")

#: The code of a :class:`RemoteError` from a sidecar that is shutting down.
_UNAVAILABLE = ErrorCode.UNAVAILABLE.name.lower()


@dataclass(slots=True)
class LoadSpec:
    """Blocks ``[start, start + len(block_ids))`` of a request to read from the pool;
    ``refused``: none of them may be (the worker reports them all failed, and the engine
    computes them)."""

    req_id: str
    start: int
    hashes: list[bytes]
    block_ids: list[int]
    refused: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Blocks ``[start, start + len(block_ids))`` of a request to write to the pool.

    ``parent`` is the engine hash of block ``start - 1`` (None at the chain's head).
    ``engine`` (one per block) and ``hints``, when the engine's connector sets them, go
    with the put: the engine's identity of each block (announced in KV events) and what
    the engine knows of the request.
    """

    req_id: str
    start: int
    hashes: list[bytes]
    block_ids: list[int]
    parent: bytes | None
    engine: list[EngineBlock | None] | None = None
    hints: PutHints | None = None


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    #: (blocks asked, blocks held) of the cached lookup
    looked_up: tuple[int, int] | None = None
    #: blocks [0, saved) are in the pool (held at lookup, loaded, or saved)
    saved: int = 0
    pending_load: tuple[int, int] | None = None
    computed_local: int = 0
    #: steps of this request to plan no save in (after a save that could not be made), and
    #: how many the last back-off was
    skip_saves: int = 0
    backoff: int = 0
    #: its steps so far, and the step of its last lost save
    steps: int = 0
    lost_at: int = 0


class PrefixPlanner:
    """Per-request hit lengths, loads and saves for one engine's scheduler."""

    def __init__(self, lookup: LookupFn, keys: KeysFn, *, ranks: int, block_tokens: int,
                 save: bool = True, hold_back: int = 0) -> None:
        if ranks <= 0 or block_tokens <= 0 or hold_back < 0:
            raise KVPoolError("a planner needs at least one rank and one token per block, and holds back no "
                              "fewer than 0 blocks")
        self._lookup = lookup
        self._keys = keys
        self.ranks = ranks
        self.block_tokens = block_tokens
        self.save = save
        #: The last blocks of a prefix found in the pool that are computed again all the same
        #: (1 where a drafter's KV at a block's last token depends on the next block's first:
        #: EAGLE layers sharing the group).
        self.hold_back = hold_back
        self._reqs: dict[str, _Request] = {}
        #: engine hashes this engine saved lately: a prefix it computed again (a local
        #: prefix-cache hit, before its first save landed) is not saved twice
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        self.saved_memory = 1 << 16

    # ------------------------------------------------------------ lookups
    def _held(self, hashes: Sequence[bytes]) -> int | None:
        """Blocks of ``hashes`` every rank finds in the pool; None where the lookup failed (a
        miss now, asked again the next time)."""
        if not hashes:
            return 0
        per_rank = [self._keys(r, hashes) for r in range(self.ranks)]
        keys = [per_rank[r][i] for i in range(len(hashes)) for r in range(self.ranks)]
        try:
            n = self._lookup(keys)
        except KVPoolError as e:
            logger.info("pool lookup failed, counted as a miss: %s", e)
            return None
        return max(0, min(n, len(keys))) // self.ranks

    def matched_tokens(self, req_id: str, hashes: Sequence[bytes], num_computed_tokens: int,
                       num_prompt_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` the pool can supply (0 on any failure).

        ``num_prompt_tokens``: the tokens the engine will run the request on (for a request
        resumed after a preemption, its output so far too); the last one is always computed.
        """
        usable = min(len(hashes), max(0, num_prompt_tokens - 1) // self.block_tokens)
        req = self._reqs.get(req_id)
        if req is None:
            req = self._reqs[req_id] = _Request(list(hashes))
        else:
            req.hashes = list(hashes)
        if req.looked_up is None or req.looked_up[0] != usable:
            found = self._held(req.hashes[:usable])
            # (a failed lookup is not kept: a request still waiting asks again at its next step)
            req.looked_up = None if found is None else (usable, found)
        held = max(0, req.looked_up[1] - self.hold_back) if req.looked_up else 0  # (the rest: not saved again)
        req.computed_local = num_computed_tokens
        hit_tokens = held * self.block_tokens
        return hit_tokens - num_computed_tokens if hit_tokens > num_computed_tokens else 0

    # ------------------------------------------------------------ state changes
    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The engine allocated the request's blocks; ``num_external_tokens`` come from the pool."""
        req = self._reqs.get(req_id)
        if req is None:
            return
        req.block_ids = list(block_ids)
        held = req.looked_up[1] if req.looked_up else 0
        req.saved = max(req.saved, held)
        if num_external_tokens > 0:
            start = req.computed_local // self.block_tokens
            end = (req.computed_local + num_external_tokens) // self.block_tokens
            req.pending_load = (start, min(end, held))
        req.looked_up = None  # the next question (after a preemption) asks the pool again

    def scheduled(self, req_id: str, hashes: Sequence[bytes], block_ids: Sequence[int] | None,
                  computed_after_step: int, *, replace: bool = False) -> tuple[LoadSpec | None, SaveSpec | None]:
        """The request runs this step: what to load before it and save after it.

        ``block_ids`` are all the request's blocks (``replace``: a new or resumed request)
        or the ones added since the last step.
        """
        req = self._reqs.get(req_id)
        if req is None:
            req = self._reqs[req_id] = _Request(list(hashes))
        req.hashes = list(hashes)
        if replace:
            req.block_ids = list(block_ids or ())
        elif block_ids:
            req.block_ids += list(block_ids)
        load = None
        if req.pending_load is not None:
            start, end = req.pending_load
            req.pending_load = None
            end = min(end, len(req.block_ids), len(req.hashes))
            if end > start:
                load = LoadSpec(req_id, start, req.hashes[start:end], req.block_ids[start:end])
        req.steps += 1
        if req.skip_saves > 0:  # its last save could not be made: planned again after a back-off
            req.skip_saves -= 1
            return load, None
        save = None
        done = min(computed_after_step // self.block_tokens, len(req.hashes), len(req.block_ids))
        start = req.saved
        while start < done and req.hashes[start] in self._saved:
            start += 1
        if self.save and done > start:
            parent = req.hashes[start - 1] if start > 0 else None
            save = SaveSpec(req_id, start, req.hashes[start:done], req.block_ids[start:done], parent)
            for h in save.hashes:
                self._saved[h] = None
            while len(self._saved) > self.saved_memory:
                self._saved.popitem(last=False)
        req.saved = max(req.saved, done)
        return load, save

    def table(self, req_id: str) -> Sequence[int]:
        """The engine blocks of the request as last scheduled, not copied (the planner only
        appends to it or replaces it)."""
        req = self._reqs.get(req_id)
        return req.block_ids if req is not None else ()

    def tables(self) -> list[list[int]]:
        """The engine blocks of every request, as last scheduled."""
        return [req.block_ids for req in self._reqs.values()]

    def unsaved(self, req_id: str, start: int, hashes: Sequence[bytes] = ()) -> None:
        """Blocks ``start`` on of the request are not in the pool after all (a save that was
        dropped, a load that failed): saved again once the engine has computed them, and
        ``hashes`` are no longer taken as saved by this engine."""
        for h in hashes:
            self._saved.pop(h, None)
        req = self._reqs.get(req_id)
        if req is not None:
            req.saved = min(req.saved, start)

    def cut(self, save: SaveSpec, keep: int) -> SaveSpec | None:
        """``save`` (as :meth:`scheduled` planned it) cut to its first ``keep`` blocks (None
        when that is none); the rest are never saved for this request (they hold wrong KV),
        and no longer taken as saved by this engine."""
        for h in save.hashes[keep:]:
            self._saved.pop(h, None)
        if keep <= 0:
            return None
        return SaveSpec(save.req_id, save.start, save.hashes[:keep], save.block_ids[:keep], save.parent)

    def lost(self, req_id: str, start: int, hashes: Sequence[bytes]) -> None:
        """A save of the request's blocks ``start`` on (``hashes``) could not be made (no room
        in the workers' backlog or on the device): :meth:`unsaved`, and planned again once the
        request has run :data:`MAX_SAVE_BACKOFF` steps at most (1, 2, 4, ... after each loss
        that follows the last one's retry; 1 again after a while without), so that a backlog
        that stays full costs no gathering every step."""
        self.unsaved(req_id, start, hashes)
        req = self._reqs.get(req_id)
        if req is not None:
            again = req.steps - req.lost_at <= 2 * req.backoff + 2
            req.backoff = min(2 * req.backoff, MAX_SAVE_BACKOFF) if again and req.backoff else 1
            req.lost_at = req.steps
            req.skip_saves = req.backoff

    def preempted(self, req_id: str) -> None:
        """The engine freed the request's blocks; what it saved stays saved."""
        req = self._reqs.get(req_id)
        if req is not None:
            req.block_ids = []
            req.pending_load = None
            req.looked_up = None

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._reqs)


class StepBudget:
    """The seconds one engine step's pool lookups may take in all (the engine asks once per
    waiting request within one step: a sidecar that answers each lookup just within its
    timeout had stalled a step that long per request).

    :meth:`run` runs a lookup given the seconds left (its deadline), timed; once the step's
    lookups have taken the budget, each further one of the step fails at once with
    :class:`KVPoolError` (a miss) without running, and ``spent`` is called once (the
    connector backs its lookups off: a sidecar that slow is skipped for a while, as a
    failed one is). :meth:`new_step` gives the budget back. One thread (the scheduler's).
    """

    def __init__(self, seconds: float, spent: Callable[[float], None] | None = None) -> None:
        if not seconds > 0:
            raise KVPoolError("a step's lookup budget must be positive")
        self.seconds = seconds
        self._spent_cb = spent
        self._used = 0.0

    def new_step(self) -> None:
        self._used = 0.0

    def left(self) -> float:
        """Seconds left to this step's lookups (0 or less: none)."""
        return self.seconds - self._used

    def run(self, lookup: Callable[[float], T]) -> T:
        left = self.left()
        if left <= 0:
            raise KVPoolError(f"this step's pool lookups took their budget ({self.seconds} s) already")
        started = time.monotonic()
        try:
            return lookup(left)
        finally:
            self._used += time.monotonic() - started
            if self._used >= self.seconds and self._spent_cb is not None:
                self._spent_cb(self._used)


class Reconnecting(Generic[C]):
    """A client made on demand, dropped on failure, and not retried before a back-off.

    ``call(fn)`` runs ``fn(client)``; a :class:`KVPoolError` closes the client and is
    raised, and for ``backoff_s`` afterwards every call fails at once without trying the
    sidecar (a dead sidecar costs the engine nothing per request). Raised, and leaving the
    client as it was, with no back-off: a :class:`DeadlineError` (a task's deadline passed
    before a call was sent: nothing is owed on the connection) and a :class:`RemoteError`
    (the sidecar answered the call with an error, a batch it refused say: the connection
    serves the next call), except ``unavailable`` (the sidecar is shutting down: its
    successor is connected to after the back-off). :meth:`back_off` starts a back-off with
    the client kept. Thread-safe.
    """

    def __init__(self, connect: Callable[[], C], *, backoff_s: float = 2.0) -> None:
        self._connect = connect
        self._backoff_s = backoff_s
        self._client: C | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[C], T]) -> T:
        with self._lock:
            if time.monotonic() < self._down_until:
                raise KVPoolError("the sidecar is unavailable (backing off)")
            client = self._client
            if client is None:
                try:
                    client = self._client = self._connect()
                except KVPoolError:
                    self._down_until = time.monotonic() + self._backoff_s
                    raise
            try:
                return fn(client)
            except DeadlineError:  # the task ran out of time before a call was sent: the connection is as it was
                raise
            except RemoteError as e:  # answered: the connection is as it was, unless the sidecar is going away
                if e.code == _UNAVAILABLE:
                    self._drop()
                    self._down_until = time.monotonic() + self._backoff_s
                raise
            except KVPoolError:
                self._drop()
                self._down_until = time.monotonic() + self._backoff_s
                raise

    def back_off(self) -> None:
        """Fail every call at once for ``backoff_s`` from now, keeping the client (a sidecar
        that answers, but too slowly to be worth asking: :class:`StepBudget`)."""
        with self._lock:
            self._down_until = time.monotonic() + self._backoff_s

    def _drop(self) -> None:
        client, self._client = self._client, None
        close = getattr(client, "close", None)
        if close is not None:
            try:
                close()
            except (KVPoolError, OSError, BufferError) as e:
                logger.debug("closing a failed pool client: %s", e)

    def close(self) -> None:
        with self._lock:
            self._drop()


__all__ = ["MAX_SAVE_BACKOFF", "KeysFn", "LoadSpec", "LookupFn", "PrefixPlanner", "Reconnecting", "SaveSpec",
           "StepBudget", "StepPlan"]
