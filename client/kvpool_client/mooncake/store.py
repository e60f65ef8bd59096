"""``MooncakeDistributedStore`` on kvpool: Mooncake's calls, arguments and return codes
over the node's sidecar (see the package's docstring for what is covered and how)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool_client.client import DEFAULT_SOCKET, PoolClient
from kvpool_client.errors import ConnectionLostError, KVPoolError, ProtocolError
from kvpool_client.mooncake import tensorcodec
from kvpool_client.mooncake.buffers import BufferHandle, Registry, memory_at
from kvpool_client.mooncake.codes import ErrorCode, code_of
from kvpool_client.mooncake.layout import Fragment, KeyMap, Parts
from kvpool_client.mooncake.objects import ObjectStore

T = TypeVar("T")

#: ``setup``'s parameters, in Mooncake's order.
SETUP_ARGS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
              "rdma_devices", "master_server_addr", "engine", "enable_ssd_offload", "ssd_offload_path",
              "tenant_id", "enable_client_http_server", "client_http_port", "ipc_socket_path")
_BAD = int(ErrorCode.INVALID_PARAMS)
_CLOSED = int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)


class ReplicateConfig:
    """Mooncake's replication settings: accepted and ignored (the sidecar decides where
    blocks live: its tiers, its policy, and the peers that fetch them)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False


def _value(value: object) -> memoryview:
    """A put's value as bytes; TypeError for what is not a buffer (a str, an int)."""
    v = memoryview(value)  # type: ignore[arg-type]
    if not v.c_contiguous:
        v = memoryview(v.tobytes())
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _socket_of(config: dict[str, Any]) -> str | None:
    """The sidecar's socket when ``setup`` names one: ``ipc_socket_path``, or a
    ``master_server_addr`` that is a path (``/run/...`` or ``unix:/run/...``)."""
    for value in (config.get("ipc_socket_path"), config.get("master_server_addr")):
        if isinstance(value, str) and (value.startswith("/") or value.startswith("unix:")):
            return value.removeprefix("unix:")
    return None


def _first_failure(codes: Sequence[int]) -> int:
    return next((c for c in codes if c != 0), 0)


class MooncakeDistributedStore:
    """A drop-in for ``mooncake.store.MooncakeDistributedStore`` (the subset listed in the
    package docstring). Thread-safe: one call at a time goes to the sidecar.

    The one class of the project past 25 methods, on purpose: its public methods are
    Mooncake's, one for one, because engines call them on this object; each is a few lines
    over :class:`~kvpool_client.mooncake.objects.ObjectStore`, where the work is."""

    def __init__(self, *, socket_path: str | None = None, host: str | None = None, port: int | None = None,
                 tenant: str | None = None, token: str | bytes | None = None, namespace: str | None = None,
                 timeout: float = 10.0, block_bytes: int | None = None) -> None:
        """All optional (Mooncake's constructor takes none): the sidecar's Unix socket
        (default ``$KVPOOL_SOCKET_PATH``, else ``/run/kvpool/kvpool.sock``) or its TCP
        ``host``/``port``; the tenant (default: ``setup``'s ``tenant_id``) and its token
        (default: ``$KVPOOL_TOKEN_FILE``); the key ``namespace`` (default
        ``$KVPOOL_MOONCAKE_NAMESPACE``, else none); the deadline of every call (its sidecar
        calls end within it in all, past it the call answers as a lost sidecar does); and the
        largest block to write (default: the sidecar's ``max_block_bytes``, at most what one
        TCP answer holds)."""
        self._socket_path = socket_path
        self._host, self._port = host, port
        self._tenant, self._token = tenant, token
        self._namespace = namespace
        self._timeout = timeout
        self._block_bytes = block_bytes
        self._lock = threading.RLock()
        self._objects: ObjectStore | None = None
        #: Set by ``setup`` and cleared by ``close``: whom to (re)connect to as whom.
        self._setup: dict[str, Any] | None = None
        self._buffers = Registry()

    # ------------------------------------------------------------------ lifecycle
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect to the node's sidecar: ``setup(local_hostname, metadata_server, ...)`` or
        ``setup(config_dict)`` as in Mooncake. Here ``local_hostname`` is what
        ``get_hostname`` answers, ``tenant_id`` the kvpool tenant, and ``ipc_socket_path``
        or a ``master_server_addr`` that is a path (``unix:`` optional) the sidecar's
        socket; the segment and buffer sizes, protocol, devices and a ``host:port`` master
        address are accepted and ignored (the sidecar owns the memory and the transport).
        0, or a code."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            config = dict(args[0])
        else:
            if len(args) > len(SETUP_ARGS):
                raise TypeError(f"setup() takes at most {len(SETUP_ARGS)} arguments")
            config = dict(zip(SETUP_ARGS, args)) | kwargs
        unknown = sorted(set(config) - set(SETUP_ARGS))
        if unknown:
            raise TypeError(f"setup() got unknown arguments: {', '.join(unknown)}")
        if not isinstance(config.get("local_hostname"), str) or "metadata_server" not in config:
            raise TypeError("setup() needs local_hostname (a str) and metadata_server")
        with self._lock:
            self._disconnect()
            self._setup = config
            try:
                self._objects = self._connect()
            except KVPoolError as e:
                self._setup = None
                return int(code_of(e))
        return 0

    def _connect(self) -> ObjectStore:
        cfg = self._setup or {}
        tenant = self._tenant or str(cfg.get("tenant_id") or "default")
        path = self._socket_path or _socket_of(cfg) or os.environ.get("KVPOOL_SOCKET_PATH") or DEFAULT_SOCKET
        namespace = self._namespace if self._namespace is not None else os.environ.get("KVPOOL_MOONCAKE_NAMESPACE", "")
        client = PoolClient(path, host=self._host, port=self._port, tenant=tenant, token=self._token,
                            timeout=self._timeout)
        try:
            return ObjectStore(client, KeyMap(namespace), self._block_bytes)
        except KVPoolError:
            client.close()
            raise

    def _disconnect(self) -> None:
        if self._objects is not None:
            self._objects.client.close()
            self._objects = None

    def close(self) -> int:
        """Disconnect (the pool keeps what was put) and forget the registered buffers."""
        with self._lock:
            self._disconnect()
            self._setup = None
            self._buffers.clear()
        return 0

    def health_check(self) -> int:
        """0: the sidecar answers; 1: not set up (or closed); 2: the sidecar is unreachable."""
        with self._lock:
            if self._setup is None:
                return 1

        def ping(objects: ObjectStore) -> int:
            objects.client.stats()
            return 0

        return self._run(ping, lambda code: 2)

    def get_hostname(self) -> str:
        """``setup``'s ``local_hostname`` ("" before it)."""
        return str((self._setup or {}).get("local_hostname", ""))

    def _run(self, op: Callable[[ObjectStore], T], failed: Callable[[int], T]) -> T:
        """Run ``op`` on the connection (reconnecting after a lost one), its pool calls within
        one deadline; a pool error becomes ``failed(code)`` (past the deadline: RPC_FAIL, as
        for a call that timed out, and the connection is kept: nothing was sent). So does a
        MemoryError (NO_AVAILABLE_HANDLE: this process had no room for what the call needed),
        which must not escape a call Mooncake's callers expect a code from; it may have cut a
        pool call short between its request and its answer, so the connection is dropped as
        a lost one is."""
        with self._lock:
            if self._setup is None:
                return failed(_CLOSED)
            try:
                if self._objects is None:
                    self._objects = self._connect()
                with self._objects.task(self._timeout):
                    return op(self._objects)
            except KVPoolError as e:
                code, lost = int(code_of(e)), isinstance(e, (ConnectionLostError, ProtocolError))
            except MemoryError:
                code, lost = int(ErrorCode.NO_AVAILABLE_HANDLE), True
            # only here, the error gone: its traceback's frames hold views of the shared arena
            # (heads read), and the arena is not unmapped while a view of it lives (BufferError)
            if lost:
                self._disconnect()  # the next call connects afresh (a restarted sidecar)
            return failed(code)

    # ------------------------------------------------------------------ put / upsert
    def _store(self, keys: Sequence[str], values: Sequence[Parts], upsert: bool) -> list[int]:
        """Put (or replace: see ``ObjectStore.replace``) each value; INVALID_PARAMS for an
        empty key or value."""
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"a key must be a str, not {type(k).__name__}")
        ok = [i for i, (k, v) in enumerate(zip(keys, values)) if k and sum(p.nbytes for p in v)]
        codes = [_BAD] * len(keys)

        def run(objects: ObjectStore) -> list[int]:
            if upsert:
                for i in ok:
                    codes[i] = int(objects.replace(keys[i], values[i]))
                return codes
            for i, code in zip(ok, objects.put([keys[i] for i in ok], [values[i] for i in ok])):
                codes[i] = int(code)
            return codes

        return self._run(run, lambda code: [code if i in ok else _BAD for i in range(len(keys))]) if ok else codes

    def _batch(self, keys: Sequence[str], values: Sequence[object], upsert: bool) -> int:
        if len(keys) != len(values):
            return _BAD
        views = [_value(v) for v in values]
        if any(not k or not v.nbytes for k, v in zip(keys, views)):
            return _BAD  # as Mooncake: the whole batch is refused, nothing is stored
        return _first_failure(self._store(keys, [[v] for v in views], upsert)) if keys else 0

    def put(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) unless ``key`` holds a value already (then 0 too)."""
        return self._store([key], [[_value(value)]], False)[0]

    def put_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        views = [_value(p) for p in parts]
        if not sum(v.nbytes for v in views):
            return 0  # as Mooncake: nothing to store is not an error here
        return self._store([key], [views], False)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[object], config: ReplicateConfig | None = None) -> int:
        """0 if every value was stored (or its key held one), else the first failure."""
        return self._batch(keys, values, False)

    def upsert(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        """Store ``value``, replacing what ``key`` holds on this node; where it cannot be
        stored, the old value stays."""
        return self._store([key], [[_value(value)]], True)[0]

    def upsert_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        views = [_value(p) for p in parts]
        if not sum(v.nbytes for v in views):
            return 0
        return self._store([key], [views], True)[0]

    def upsert_batch(self, keys: Sequence[str], values: Sequence[object],
                     config: ReplicateConfig | None = None) -> int:
        return self._batch(keys, values, True)

    # ------------------------------------------------------------------ get
    def _read(self, keys: Sequence[str], alloc: Callable[[int], bytearray] = bytearray) -> list[bytearray | None]:
        return self._run(lambda o: [v if isinstance(v, bytearray) else None for v in o.read(keys, [None] * len(keys),
                                                                                            alloc)],
                         lambda code: [None] * len(keys))

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when the key holds none (or the read failed)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [b"" if v is None else bytes(v) for v in self._read(keys)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a :class:`BufferHandle`, or None."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return [v if isinstance(v, BufferHandle) else None for v in self._read(keys, BufferHandle)]

    def get_size(self, key: str) -> int:
        """The value's length in bytes, or a code (OBJECT_NOT_FOUND)."""
        return self._run(lambda o: int(o.sizes([key])[0]), lambda code: code)

    def is_exist(self, key: str) -> int:
        """1 if the pool holds the key (here or on a peer), 0 if not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._run(lambda o: o.exists(keys), lambda code: [-1] * len(keys))

    # ------------------------------------------------------------------ remove
    def remove(self, key: str, force: bool = False) -> int:
        """Delete the key's value from this node: 0, OBJECT_NOT_FOUND, ILLEGAL_CLIENT
        (another tenant of a shared key space wrote it: not this tenant's to remove), or
        OBJECT_HAS_LEASE (its head is being brought from disk right now: try again).
        ``force`` is accepted: kvpool holds no lease after a put or a get, so there is
        nothing to force."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._run(lambda o: [int(c) for c in o.remove(keys)], lambda code: [code] * len(keys))

    # ------------------------------------------------------------------ registered memory
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow the zero-copy calls to use ``size`` bytes of host memory at ``buffer_ptr``."""
        with self._lock:
            if self._setup is None:
                return _CLOSED
            return 0 if self._buffers.register(buffer_ptr, size) else _BAD

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            if self._setup is None:
                return _CLOSED
            return 0 if self._buffers.unregister(buffer_ptr) else _BAD

    def _from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], upsert: bool) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [_BAD] * len(keys)
        with self._lock:
            views = [self._buffers.view(p, n) for p, n in zip(ptrs, sizes)]
            ok = [i for i, v in enumerate(views) if v is not None and v.nbytes]
            out = [_BAD] * len(keys)
            got = self._store([keys[i] for i in ok], [[views[i]] for i in ok], upsert)  # type: ignore[list-item]
            for i, code in zip(ok, got):
                out[i] = code
            return out

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes of registered memory at ``buffer_ptr``. As in Mooncake, a
        size of 0 stores nothing and answers 0."""
        return 0 if size == 0 else self._from([key], [buffer_ptr], [size], False)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        return self._from(keys, buffer_ptrs, sizes, False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return 0 if size == 0 else self._from([key], [buffer_ptr], [size], True)[0]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._from(keys, buffer_ptrs, sizes, True)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the value into registered memory: its length, or a code (INVALID_PARAMS when
        ``size`` is smaller than the value)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_BAD] * len(keys)
        with self._lock:
            views = [self._buffers.view(p, n) for p, n in zip(buffer_ptrs, sizes)]
            ok = [i for i, v in enumerate(views) if v is not None]
            out = [_BAD] * len(keys)

            def run(o: ObjectStore) -> list[int]:
                got = o.read([keys[i] for i in ok], [views[i] for i in ok])
                return [int(g) if isinstance(g, int) else _BAD for g in got]

            for i, code in zip(ok, self._run(run, lambda code: [code] * len(ok))):
                out[i] = code
            return out

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Byte ranges of objects into registered buffers; ``results[i][j][k]`` is the
        length of fragment ``k`` of key ``j`` into buffer ``i``, or a code (see Mooncake's
        documentation for the shapes; any shape that does not match is INVALID_PARAMS)."""
        levels = (all_keys, all_dst_offsets, all_src_offsets, all_sizes)

        def width(i: int, j: int) -> int:
            return max([len(lv[i][j]) for lv in levels[1:] if i < len(lv) and j < len(lv[i])] or [1])

        out = [[[_BAD] * width(i, j) for j in range(len(all_keys[i]) if i < len(all_keys) else 1)]
               for i in range(len(buffer_ptrs))]
        if any(len(lv) != len(buffer_ptrs) for lv in levels):
            return out
        with self._lock:
            jobs: list[tuple[list[int], str, list[int], list[Fragment]]] = []  # (answers, key, which, fragments)
            for i, ptr in enumerate(buffer_ptrs):
                end = self._buffers.end_of(ptr)
                if end is None or any(len(lv[i]) != len(all_keys[i]) for lv in levels):
                    continue
                for j, key in enumerate(all_keys[i]):
                    fr = (all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j])
                    if not len(fr[0]) == len(fr[1]) == len(fr[2]):
                        continue
                    todo = [k for k, (d, s, n) in enumerate(zip(*fr)) if min(d, s, n) >= 0 and ptr + d + n <= end]
                    jobs.append((out[i][j], key, todo,
                                 [(fr[1][k], fr[2][k], memory_at(ptr + fr[0][k], fr[2][k])) for k in todo]))
            done = 0

            def run(o: ObjectStore) -> None:  # one deadline for all the keys
                nonlocal done
                for answers, key, todo, frags in jobs:
                    for k, code in zip(todo, o.read_ranges(key, frags)):
                        answers[k] = int(code)
                    done += 1

            def failed(code: int) -> None:  # the keys not read yet
                for answers, _, todo, _ in jobs[done:]:
                    for k in todo:
                        answers[k] = code

            self._run(run, failed)
        return out

    # ------------------------------------------------------------------ tensors
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor (kvpool's own encoding; see :mod:`.tensorcodec`)."""
        return self.batch_put_tensor([key], [tensor])[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self.put_tensor(key, tensor)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._tensors([key], [tensor], True)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._tensors(keys, tensors_list, False)

    def _tensors(self, keys: Sequence[str], tensors: Sequence[Any], upsert: bool) -> list[int]:
        if len(keys) != len(tensors):
            return [_BAD] * len(keys)
        out = [_BAD] * len(keys)
        ok = [i for i, t in enumerate(tensors) if tensorcodec.is_tensor(t)]
        values: list[Parts] = []
        for i in list(ok):
            try:
                values.append(tensorcodec.encode(tensors[i]))
            except (ValueError, RuntimeError):  # (torch's errors are RuntimeErrors): this tensor alone fails
                ok.remove(i)
        for i, code in zip(ok, self._store([keys[i] for i in ok], values, upsert)):
            out[i] = code
        return out

    def get_tensor(self, key: str) -> Any:
        """The tensor, or None (no value, or not a tensor's)."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        return [None if v is None else tensorcodec.decode(v) for v in self._read(keys)]
