"""The local API's read path: LOOKUP, ACQUIRE, ACQUIRE_DEVICE, RELEASE, GET_INLINE and STATS.

A read names keys of the client's key space. LOOKUP answers the prefix this node holds and,
with peers, the blocks after it that peers hold; ACQUIRE fetches from peers what this node
lacks (each block once, however often the read names it), within the tenant's share of the
index (:mod:`kvpool_sidecar.api.budget`: its turn is held for the index's part of the fetch,
not for the transfer, which has a bound of its own: :mod:`kvpool_sidecar.fetchgate`), then
leases each block at offsets in the client's arena until RELEASE. GET_INLINE copies the
blocks into the answer instead (clients without the arena); ACQUIRE_DEVICE leases GPU-tier
copies for a CUDA engine on the same device. A large batch is served a slice at a time
(:data:`~kvpool_sidecar.api.limits.BATCH_SLICE`), other clients' requests in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvpool_client.integrity import checksum
from kvpool_sidecar.api.arguments import checked_int, checked_items, checked_keys
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.limits import BATCH_SLICE, SLICE_BYTES
from kvpool_sidecar.api.pieces import copy_out
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.errors import RequestError, TierError, UnknownLeaseError
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store import Session

if TYPE_CHECKING:
    from kvpool_sidecar.api.connection import LocalConnection

logger = logging.getLogger(__name__)


def open_descriptors() -> int | None:
    """The descriptors this process holds open (None where ``/proc`` cannot say). The sidecar
    is undumpable, so only root may count them from outside."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError:
        return None


class ReadRequests:
    """One connection's reads: lookups, leases of blocks to read, inline gets, the node's stats."""

    def __init__(self, client: LocalClient, *, peers: PeerReader | None, budget: IndexBudget,
                 unread: Unread[LocalConnection], inbound: Unread[LocalConnection]) -> None:
        self._client = client
        self.store = client.store
        self.limits = client.limits
        self.peers = peers
        #: Per tenant, the index lookups and fetches it may run at once (shared by its connections).
        self._budget = budget
        #: The node's bounds on answers not read and requests not yet whole (for STATS).
        self._unread = unread
        self._inbound = inbound

    def lookup(self, keys: object) -> list[Any]:
        # No per-key validation: a malformed key is simply not found (and ends the prefix).
        if not isinstance(keys, list) or len(keys) > self.limits.max_batch:
            raise RequestError(f"expected a list of at most {self.limits.max_batch} keys")
        n, runs = self.store.lookup(self._client.scoped(keys))
        return [n, runs]

    async def lookup_pool(self, keys: object) -> list[Any]:
        """Local prefix, then the blocks after it that peers hold (tier ``peer``)."""
        n, runs = self.lookup(keys)
        if self.peers is not None and isinstance(keys, list) and n < len(keys):
            asked = self._client.scoped(checked_keys(keys[n : n + self.limits.max_index_keys], self.limits))
            tenant = self._client.active_session.tenant
            more = 0
            if self.peers.takes(tenant) and self._index_allows(len(asked)):
                deadline = self.peers.lookup_deadline()  # (shorter than an engine's lookup timeout)
                async with self._index_turn_by(deadline) as turn:
                    if turn is not None:
                        more = await self.peers.remote_prefix(asked, deadline, tenant)
            if more:
                n += more
                runs.append(["peer", more])
        return [n, runs]

    async def acquire(self, keys: object) -> list[Any]:
        client = self._client
        client.need_shm()
        out: list[Any] = []
        keys = client.scoped(checked_keys(keys, self.limits))
        await self._fetch(keys)
        await self.store.prefetch(keys)
        session = client.active_session
        try:
            for n, k in enumerate(keys, 1):
                if n % BATCH_SLICE == 0:
                    await asyncio.sleep(0)  # other clients' requests between slices of a large batch
                lease = await self.store.acquire(session, k)
                extents = None if lease is None else client.mapped(lease.place)
                if lease is not None and extents is None:
                    self.store.release(session, lease.id)  # held in another space's arena: a miss here
                out.append(None if lease is None or extents is None
                           else [lease.id, lease.entry.size, lease.entry.checksum, extents])
        except BaseException:
            self._unnamed(session, out)
            raise
        return out

    async def acquire_device(self, keys: object) -> list[Any]:
        """GPU-tier copies for a local CUDA engine on the same device: per key ``[lease id,
        size, checksum, CUDA IPC descriptor]``, or None (a miss: the engine reads the block
        through ACQUIRE). Never fetches from peers: a GPU-tier hit is local by definition.
        The session's limits hold as for ACQUIRE (the store counts the lease against them)."""
        client = self._client
        if client.version < 3:
            raise RequestError("ACQUIRE_DEVICE needs protocol version 3 (this connection said hello "
                               f"with {client.version})")
        keys = client.scoped(checked_keys(keys, self.limits))
        if not client.device_reads():
            return [None] * len(keys)
        out: list[Any] = []
        session = client.active_session
        try:
            for n, k in enumerate(keys, 1):
                if n % BATCH_SLICE == 0:
                    await asyncio.sleep(0)  # other clients' requests between slices, as ACQUIRE's
                try:
                    got = await self.store.acquire_device(session, k)
                except TierError as e:  # torch refused to share the buffer: a miss, the DRAM path serves it
                    warn_once(logger, "device-share", "GPU-tier reads miss: cannot make a CUDA IPC descriptor: %s", e)
                    got = None
                out.append(None if got is None else [got[0].id, got[0].entry.size, got[0].entry.checksum, got[1]])
        except BaseException:
            self._unnamed(session, out)
            raise
        return out

    def _unnamed(self, session: Session, out: list[Any]) -> None:
        """Release the leases an ACQUIRE or ACQUIRE_DEVICE granted before it failed: its
        answer is an error, so they are never named to the client, which could not give them
        back (they held their blocks and the session's share until the connection closed)."""
        for item in out:
            if item is not None:
                with contextlib.suppress(UnknownLeaseError):
                    self.store.release(session, item[0])

    def release(self, items: object) -> int:
        checked = [(checked_int(lease_id, "lease"), bool(corrupt))
                   for lease_id, corrupt in checked_items(items, self.limits, 2)]
        n = 0
        for lease_id, corrupt in checked:
            with contextlib.suppress(UnknownLeaseError):
                self.store.release(self._client.active_session, lease_id, corrupt=corrupt)
                n += 1
        return n

    async def get_inline(self, keys: object) -> list[bytes | bytearray | None | bool]:
        """Blocks copied into the answer, which stays under the frame limit: past it, the
        rest are answered ``False`` (not sent: ask again), never built whole in memory. The
        loop turns every :data:`BATCH_SLICE` blocks or :data:`SLICE_BYTES`, and within a
        larger block (see :mod:`~kvpool_sidecar.api.pieces`)."""
        client = self._client
        out: list[bytes | bytearray | None | bool] = []
        since = 0  # bytes copied since the loop last turned
        keys = client.scoped(checked_keys(keys, self.limits))
        await self._fetch(keys)
        await self.store.prefetch(keys)
        budget = self.limits.max_frame_bytes - 1024 - 16 * len(keys)  # msgpack framing per item
        for i, k in enumerate(keys):
            lease = await self.store.acquire(client.active_session, k)
            if lease is None:
                out.append(None)
                continue
            if lease.entry.size > budget:
                self.store.release(client.active_session, lease.id)
                out += [False] * (len(keys) - i) if out else [None] + [False] * (len(keys) - i - 1)
                break
            views = self.store.host.views(lease.place)
            data: bytes | bytearray
            if lease.entry.size > SLICE_BYTES:
                try:
                    data, csum = await copy_out(views, lease.entry.size, SLICE_BYTES)
                except BaseException:  # (cancelled: the connection went) its read lease goes back
                    if client.session is not None:  # (else it went with the session)
                        with contextlib.suppress(UnknownLeaseError):
                            self.store.release(client.session, lease.id)
                    raise
                since = 0
            else:
                data = b"".join(views)
                csum = checksum(memoryview(data))
                since += len(data)
            ok = csum == lease.entry.checksum
            self.store.release(client.active_session, lease.id, corrupt=not ok)
            out.append(data if ok else None)
            budget -= len(data)
            if (i + 1) % BATCH_SLICE == 0 or since >= SLICE_BYTES:
                since = 0
                await asyncio.sleep(0)  # other clients' requests between slices of the answer
        return out

    def stats(self) -> dict[str, object]:
        return {**self.store.report.stats(), "index_throttled": self._budget.throttled,
                "unread_aborted": self._unread.aborted, "inbound_aborted": self._inbound.aborted,
                "open_fds": open_descriptors()}

    @contextlib.asynccontextmanager
    async def _index_turn_by(self, deadline: float) -> AsyncIterator[_Turn | None]:
        """This tenant's share of the node's index lookups, if its turn comes before
        ``deadline`` (loop time): yields it (held until the block ends, or until it is given
        back earlier), or None when it did not come."""
        sem = self._budget.turn(self._client.active_session.tenant)
        try:
            async with asyncio.timeout_at(deadline):
                await sem.acquire()
        except TimeoutError:
            yield None
            return
        turn = _Turn(sem)
        try:
            yield turn
        finally:
            turn.give_back()

    def _index_allows(self, keys: int) -> bool:
        """Whether this tenant is within its rate of keys asked of the index and peers."""
        tenant = self._client.active_session.tenant
        if self._budget.allows(tenant, keys):
            return True
        warn_once(logger, "index-rate", "a client of tenant %s is past api.index_keys_per_s: its index "
                  "lookups and fetches miss until its rate falls", tenant)
        return False

    async def _fetch(self, keys: list[bytes]) -> None:
        """Fetch from peers the blocks of ``keys`` this node lacks (within the tenant's budget:
        an index turn for the index's part of the fetch only, then the peers' own bound on
        the transfer). Each block counts once against the rate, however often ``keys`` name it."""
        if self.peers is None:
            return
        tenant = self._client.active_session.tenant
        missing = len({k for k in keys if not self.store.contains(k)})
        if missing and self.peers.takes(tenant) and self._index_allows(missing):
            deadline = self.peers.deadline()  # a miss by then, however long the turn takes
            async with self._index_turn_by(deadline) as turn:
                if turn is not None:
                    await self.peers.fetch(keys, deadline, tenant=tenant, indexed=turn.give_back)


class _Turn:
    """One of a tenant's index turns, given back once however often it is given back."""

    def __init__(self, sem: asyncio.Semaphore) -> None:
        self._sem: asyncio.Semaphore | None = sem

    def give_back(self) -> None:
        if self._sem is not None:
            self._sem.release()
            self._sem = None
