"""The names of a pool's keys in Redis (schema: docs/redis-schema.md). Names only: nothing
here talks to Redis."""

from __future__ import annotations

__all__ = ["PoolKeys"]


class PoolKeys:
    """Every key of pool ``pool`` starts with ``kvp:<pool>:``."""

    __slots__ = ("prefix", "nodes", "held", "blk_prefix")

    def __init__(self, pool: str) -> None:
        self.prefix = f"kvp:{pool}:"
        #: The set of node names that ever registered.
        self.nodes = self.prefix + "nodes"
        #: The holders hash (one Redis server only).
        self.held = self.prefix + "held"
        #: Block sets are this prefix and the block's hex digest.
        self.blk_prefix = self.prefix + "blk:"

    def node(self, node: str) -> str:
        """The node's record (a hash with a TTL)."""
        return f"{self.prefix}node:{node}"

    def inv(self, node: str) -> str:
        """The node's inventory: hex digests of the blocks it published."""
        return f"{self.prefix}inv:{node}"

    def blk(self, hexkey: str) -> str:
        """A block's set of holders ``node@tier``."""
        return self.blk_prefix + hexkey

    def claim(self, node: str) -> str:
        """A sweeper's claim on dead node ``node``."""
        return f"{self.prefix}sweeping:{node}"

    def sentinel(self, node: str, tag: int) -> str:
        """The node's sentinel on the shard whose lowest slot tag ``{s<tag>}`` lands in."""
        return f"{self.prefix}alive:{node}:{{s{tag}}}"
