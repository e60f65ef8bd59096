"""A Mooncake Store-compatible API over the pool: code written for Mooncake Store's
``MooncakeDistributedStore`` runs on kvpool by changing one import::

    from kvpool_client.mooncake import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", "localhost:50051")
    store.put("hello", b"world")
    assert store.get("hello") == b"world"

``setup`` connects to the node's sidecar over ``$KVPOOL_SOCKET_PATH`` (default
``/run/kvpool/kvpool.sock``; a ``master_server_addr`` or ``ipc_socket_path`` that is a
path, ``unix:`` optional, names it instead) as the tenant ``tenant_id`` (default
``default``, with the token in ``$KVPOOL_TOKEN_FILE`` where the tenant has one). Its other
arguments (metadata server, segment and buffer sizes, protocol, RDMA devices, a
``host:port`` master address) are accepted and ignored: the sidecar owns the memory, the
tiers and the transfers between nodes. The
constructor takes kvpool's own options as keywords (socket path or TCP address, tenant,
token, namespace, deadline); Mooncake's code passes none and gets the defaults.

**Covered** (Mooncake's arguments, return values and codes): ``setup``, ``close``,
``health_check``, ``get_hostname``; ``put``, ``put_parts``, ``put_batch``, ``upsert``,
``upsert_parts``, ``upsert_batch``; ``get``, ``get_batch``, ``get_buffer``,
``batch_get_buffer``, ``get_size``; ``is_exist``, ``batch_is_exist``; ``remove``,
``batch_remove``; ``register_buffer``, ``unregister_buffer``, ``put_from``,
``batch_put_from``, ``upsert_from``, ``batch_upsert_from``, ``get_into``,
``batch_get_into``, ``get_into_ranges``; ``put_tensor``, ``pub_tensor``, ``upsert_tensor``,
``batch_put_tensor``, ``get_tensor``, ``batch_get_tensor``. ``ReplicateConfig`` and
``force`` are accepted and ignored. Codes are Mooncake's (:class:`ErrorCode`): a miss is
``OBJECT_NOT_FOUND`` (-704), bad arguments ``INVALID_PARAMS`` (-600), no room
``NO_AVAILABLE_HANDLE`` (-200), a lost sidecar or a call past its deadline ``RPC_FAIL``
(-900), a call before ``setup`` or after ``close`` ``UNAVAILABLE_IN_CURRENT_STATUS``
(-1010); ``get`` answers ``b""`` on a miss, ``is_exist`` 1/0/-1, batch calls one answer per
key. The constructor's ``timeout`` bounds each call as a whole, a batch included.

**Not covered** (calling one raises AttributeError): ``remove_all`` and ``remove_by_regex``
(the pool holds hashes of keys, never the keys, so it cannot list or match them); replica
descriptors, copy/move tasks, segment mounting, ``setup_dummy``/``init_all``, the
memory-pool allocator and SSD offload (the sidecar owns placement, memory and tiers); the
put/get sessions and multi-buffer forms (``batch_*_multi_buffer*``); ``put_from_with_metadata``;
the tensor-parallel and ``*_with_parallelism`` tensor calls, ``*_tensor_into``,
``*_tensor_from`` and CUDA destinations (they expose Mooncake's own tensor layout and
device memory; here tensors are copied through host memory in kvpool's own encoding).

**Where kvpool differs.** A put of a key that holds a value answers 0 and keeps the old
value, as in Mooncake (a value some of whose chunks were evicted is not held: the put writes
it again). A put or upsert of a key another client is writing at that moment answers
``REPLICA_IS_NOT_READY`` (-703): nothing was stored, try again (Mooncake answers 0 there). An upsert writes the new
value before it replaces the old one: one that cannot be stored (larger than the node's
tiers, no room, the quota) leaves the old value, unless making room for the new value
evicted it, or another client wrote the key in the moment of the swap (its value stays). There is no lease: ``remove`` right after a put or get succeeds (Mooncake
answers OBJECT_HAS_LEASE until its lease expires, unless ``force``); OBJECT_HAS_LEASE means
the value's head is being brought from disk at that moment. Where tenants share a key space
(``tenants[].key_space``), each reads the others' values but may not remove or upsert them:
``ILLEGAL_CLIENT`` (-601).
Zero-copy calls need every address range inside a buffer registered with
``register_buffer`` (else INVALID_PARAMS, never a stray write); only host memory is
supported. ``get_batch([])`` answers ``[]``.

**Values larger than a block** (the sidecar's ``max_block_bytes``, or less where one
block must fit one TCP answer, ``api.max_frame_bytes``, so that a value put over the Unix
socket is read over TCP too) are split into chunk
blocks under derived keys, with a header in the first block (length, block count, a random
per-put nonce that names the chunks, and the whole value's xxh3 checksum): a read
reassembles and verifies the whole value, and a value whose chunks were evicted reads as a
miss. Blocks are at least 4 KiB (``setup`` answers an error on a sidecar whose
``max_block_bytes`` is smaller): a head that names smaller chunks, or a value larger than the
node's tiers, is not one a store wrote (any writer of the key space can put a head block)
and reads as a miss. See :mod:`.layout` for how keys map to pool keys (BLAKE2b-256, keyed by a fingerprint
of the ``mooncake-api`` model and the namespace, never truncated).

**Across nodes.** Every node's sidecar serves what it holds to the others, so a value put on
one node is found (``is_exist``) and read (``get``) from every node of the pool. A put
checks this node only for a value under its key. ``remove`` and ``upsert`` act on this
node's copy only: copies that other nodes fetched earlier
survive, so after an ``upsert`` a reader on another node may still read the old value until
its copy is evicted. Use a new key for a new value when every node must see it. A tenant
removes only blocks it wrote itself, in its own key space.
"""

from __future__ import annotations

from kvpool_client.mooncake.buffers import BufferHandle
from kvpool_client.mooncake.codes import ErrorCode
from kvpool_client.mooncake.layout import KeyMap
from kvpool_client.mooncake.store import MooncakeDistributedStore, ReplicateConfig

__all__ = ["BufferHandle", "ErrorCode", "KeyMap", "MooncakeDistributedStore", "ReplicateConfig"]
