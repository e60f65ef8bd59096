"""Command packing in C for the asyncio Redis client.

redis-py's synchronous connections pack commands with ``hiredis.pack_command`` when hiredis
is installed; its asyncio connections always pack in Python, one join per argument. An
index lookup sends every key of a prefix as an argument of one command (``HMGET`` of 64
keys), where packing in Python costs a third of a loopback round trip. :func:`use_hiredis_packing`
gives one client's connections the C packer. Commands it cannot pack as they are (a first
argument holding a space, like ``"SCRIPT LOAD"``; a type hiredis refuses, like a bool) go
through redis-py's own packer, which splits or refuses them as it always has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    import hiredis

    _pack = hiredis.pack_command
except (ImportError, AttributeError):  # hiredis missing, or older than 2.2.1: redis-py packs
    _pack = None

__all__ = ["use_hiredis_packing"]

_SUBCLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _packing(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` with :meth:`pack_command` done by hiredis (one subclass per base class)."""
    known = _SUBCLASSES.get(base)
    if known is not None:
        return known

    class HiredisPacking(base):  # type: ignore[valid-type,misc]
        hiredis_packing = True

        def pack_command(self, *args: Any) -> list[bytes]:
            head = args[0]
            if _pack is not None and not (isinstance(head, str) and " " in head) \
                    and not (isinstance(head, bytes) and b" " in head):
                try:
                    return [_pack(args)]
                except TypeError:
                    pass  # redis-py's packer raises its own DataError, or copes
            packed: list[bytes] = super().pack_command(*args)
            return packed

    HiredisPacking.__name__ = HiredisPacking.__qualname__ = f"HiredisPacking{base.__name__}"
    _SUBCLASSES[base] = HiredisPacking
    return HiredisPacking


def use_hiredis_packing(client: Redis) -> bool:
    """Make the connections ``client`` opens from now on pack with hiredis; False (and no
    change) when hiredis offers no packer. Call it before the client's first command."""
    if _pack is None:
        return False
    pool = client.connection_pool
    if not getattr(pool.connection_class, "hiredis_packing", False):
        pool.connection_class = _packing(pool.connection_class)
    return True
