"""The ``kvpool`` command: ``sidecar`` and ``status`` here; ``demo``, ``bench`` and ``replay``
come from the benchmarks package, which registers them as a plugin (entry point group
``kvpool.commands``: a function that adds its subcommands to the parser), so the sidecar
never imports it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from kvpool_client.errors import KVPoolError
from kvpool_sidecar.errors import SidecarError

#: Where other packages register subcommands of ``kvpool``.
COMMANDS_GROUP = "kvpool.commands"


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from kvpool_sidecar.__main__ import main as sidecar_main

    return sidecar_main(["--config", args.config] if args.config else [])


class PoolNameError(SidecarError):
    """``kvpool status --pool`` named no pool of the index, or several."""


def resolve_pool(asked: str, known: Sequence[str]) -> str:
    """The index's name of the pool a user named, given the pools the index ``known``s.

    A pool the operator runs is ``<namespace>.<name>`` in the index; users also type
    kubectl's ``<namespace>/<name>``, or the bare ``<name>``, which is taken when exactly one
    pool of the index has it. Raises :class:`PoolNameError` saying which pools there are.
    """
    pool = asked.replace("/", ".", 1) if asked.count("/") == 1 else asked
    if pool in known:
        return pool
    if "." not in pool:
        matches = [p for p in known if p.partition(".")[2] == pool]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise PoolNameError("pool {!r} is in several namespaces: {}; give <namespace>.<name>".format(
                asked, ", ".join(matches)))
    there = ", ".join(known) if known else "none"
    raise PoolNameError("no pool {!r} in this index (pools there: {}). A pool the operator runs is "
                        "<namespace>.<name> (or <namespace>/<name>); a sidecar's own is its config's "
                        "pool".format(asked, there))


def _pool_status(url: str, pool: str, timeout: float) -> dict[str, Any]:
    import asyncio

    from kvpool_sidecar.index.redis import RedisIndex, RedisIndexSettings

    async def read() -> tuple[str, list[dict[str, Any]]]:
        lister = RedisIndex(url, RedisIndexSettings(deadline_s=timeout))
        try:
            name = resolve_pool(pool, await lister.pools())
        finally:
            await lister.close()
        idx = RedisIndex(url, RedisIndexSettings(pool=name, deadline_s=timeout))
        try:
            return name, await idx.nodes()
        finally:
            await idx.close()

    pool, nodes = asyncio.run(read())
    tiers: dict[str, dict[str, int]] = {}
    for n in nodes:
        for name, t in n.get("tiers", {}).items():
            agg = tiers.setdefault(name, {"capacity_bytes": 0, "used_bytes": 0, "blocks": 0})
            for field in agg:
                agg[field] += int(t.get(field, 0))
    hits = sum(int(n.get("hits", 0)) for n in nodes)
    misses = sum(int(n.get("misses", 0)) for n in nodes)
    return {"pool": pool, "nodes": nodes, "tiers": tiers, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None}


def _print_tiers(tiers: dict[str, Any], indent: str = "  ") -> None:
    for name, t in tiers.items():
        pct = 100.0 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        print(f"{indent}{name:<5} {t['used_bytes'] / 2**20:10.1f} / {t['capacity_bytes'] / 2**20:.0f} MiB ({pct:.0f}%)"
              f"  {t['blocks']} blocks")


def _cmd_pool_status(args: argparse.Namespace) -> int:
    try:
        st = _pool_status(args.redis, args.pool, args.timeout)
    except SidecarError as e:  # the index unreachable, or no such pool (PoolNameError)
        print(f"kvpool status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st))
        return 0
    rate = "n/a" if st["hit_rate"] is None else f"{st['hit_rate']:.3f}"
    print(f"pool {st['pool']}  nodes {len(st['nodes'])}  hit rate {rate} ({st['hits']} hits, {st['misses']} misses)")
    if not st["nodes"]:
        print("  no live sidecar: the pool's nodes are registered, but none has heartbeated lately")
    _print_tiers(st["tiers"])
    for n in st["nodes"]:
        print(f"  node {n['name']}  {n.get('address') or '-'}  gpus {len(n.get('gpus', []))}")
        _print_tiers(n.get("tiers", {}), "    ")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    if args.redis:
        return _cmd_pool_status(args)
    from kvpool_client.calls import DEFAULT_SOCKET
    from kvpool_client.client import PoolClient
    from kvpool_client.errors import ConnectionLostError

    path = args.socket or DEFAULT_SOCKET
    try:
        with PoolClient(path, timeout=args.timeout) as c:
            stats = c.stats()
            info = c.info
    except ConnectionLostError as e:
        print(f"kvpool status: {e} (socket {path})", file=sys.stderr)
        return 1
    except KVPoolError as e:
        print(f"kvpool status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"node": info.get("node"), **stats}))
        return 0
    print(f"node {info.get('node')}  blocks {stats['blocks']}  policy {stats['policy']}  sessions {stats['sessions']}")
    _print_tiers(stats["tiers"])
    c = stats.get("counters", {})
    hits, misses = c.get("get_hit", 0), c.get("get_miss", 0)
    if hits + misses:
        print(f"  hit rate {hits / (hits + misses):.3f} ({hits} hits, {misses} misses)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: a shared, tiered KV-cache pool.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sidecar", help="run the per-node sidecar daemon")
    s.add_argument("--config", help="settings file (YAML)")
    s.set_defaults(func=_cmd_sidecar)

    for plugin in entry_points(group=COMMANDS_GROUP):
        plugin.load()(sub)  # e.g. kvpool_bench.cli:register adds demo, bench and replay

    st = sub.add_parser("status", help="a sidecar's (or with --redis, a pool's) tiers, blocks and hit rate")
    st.add_argument("--socket", default=None,
                    help="the sidecar's Unix socket (default: $KVPOOL_SOCKET_PATH, else "
                         "/run/kvpool/kvpool.sock). It says HELLO as tenant default: where that "
                         "tenant has a token, set $KVPOOL_TOKEN_FILE to the token's file")
    st.add_argument("--redis", default=os.environ.get("KVPOOL_REDIS_URL"),
                    help="the pool's Redis URL: show every node of the pool ($KVPOOL_REDIS_URL)")
    st.add_argument("--pool", default="default",
                    help="pool name (with --redis): <namespace>.<name> for a pool the operator runs "
                         "(<namespace>/<name>, or a name only one namespace has, work too); default: default")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_status)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
