"""The ``kvpool`` command: ``sidecar`` and ``status`` here; ``demo``, ``bench`` and ``replay``
come from the benchmarks package, which registers them as a plugin (entry point group
``kvpool.commands``: a function that adds its subcommands to the parser), so the sidecar
never imports it."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from kvpool_client.errors import KVPoolError
from kvpool_sidecar.argtypes import finite
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
        for name, t in _tiers_of(n.get("tiers")).items():
            agg = tiers.setdefault(name, {"capacity_bytes": 0, "used_bytes": 0, "blocks": 0})
            for field in agg:
                agg[field] += t[field]
    hits = sum(_count(n.get("hits", 0)) or 0 for n in nodes)
    misses = sum(_count(n.get("misses", 0)) or 0 for n in nodes)
    return {"pool": pool, "nodes": nodes, "tiers": tiers, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None}


#: A tier's figures, in a node record (any writer to Redis may write one) or a STATS answer.
TIER_FIELDS = ("capacity_bytes", "used_bytes", "blocks")


def _count(value: object) -> int | None:
    """A count or a size: a non-negative integer (JSON may write one as a float), else None."""
    if type(value) is int and value >= 0:
        return value
    if type(value) is float and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    return None


def _tiers_of(raw: object) -> dict[str, dict[str, int]]:
    """The tiers of a node record or a STATS answer whose figures are counts (a missing one is
    0); the others are left out: a record any writer to Redis may have forged, with a size of
    ``"lots"``, had ended ``kvpool status --redis`` in a traceback, showing no node at all."""
    out: dict[str, dict[str, int]] = {}
    if not isinstance(raw, dict):
        return out
    for name, t in raw.items():
        if not isinstance(name, str) or not isinstance(t, dict):
            continue
        counts = {f: _count(t.get(f, 0)) for f in TIER_FIELDS}
        if all(c is not None for c in counts.values()):
            out[name] = {f: c or 0 for f, c in counts.items()}
    return out


def _shown(value: object) -> str:
    """``value`` as text fit for a terminal: what a sidecar or a Redis record says is printed
    with its control characters escaped (an escape sequence in a node's address would
    otherwise reach the user's terminal)."""
    text = value if isinstance(value, str) else repr(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:256])


def _print_tiers(tiers: object, indent: str = "  ") -> None:
    for name, t in _tiers_of(tiers).items():
        pct = 100.0 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        print(f"{indent}{_shown(name):<5} {t['used_bytes'] / 2**20:10.1f} / {t['capacity_bytes'] / 2**20:.0f} MiB "
              f"({pct:.0f}%)  {t['blocks']} blocks")


def _as_json(value: dict[str, Any]) -> str | None:
    """``value`` as one line of JSON (bytes as hex), or None where it holds what JSON cannot."""
    try:
        return json.dumps(value, default=lambda o: o.hex() if isinstance(o, bytes) else repr(o))
    except (TypeError, ValueError):  # (a key that is no string or number, a cycle cannot come from msgpack)
        return None


def _cmd_pool_status(args: argparse.Namespace) -> int:
    try:
        st = _pool_status(args.redis, args.pool, args.timeout)
    except SidecarError as e:  # the index unreachable, or no such pool (PoolNameError)
        print(f"kvpool status: {e}", file=sys.stderr)
        return 1
    if args.json:
        text = _as_json(st)
        if text is None:
            print("kvpool status: the index holds node records that cannot be written as JSON", file=sys.stderr)
            return 1
        print(text)
        return 0
    rate = "n/a" if st["hit_rate"] is None else f"{st['hit_rate']:.3f}"
    print(f"pool {_shown(st['pool'])}  nodes {len(st['nodes'])}  hit rate {rate} ({st['hits']} hits, "
          f"{st['misses']} misses)")
    if not st["nodes"]:
        print("  no live sidecar: the pool's nodes are registered, but none has heartbeated lately")
    _print_tiers(st["tiers"])
    for n in st["nodes"]:
        gpus = n.get("gpus")
        print(f"  node {_shown(n.get('name'))}  {_shown(n.get('address') or '-')}  "
              f"gpus {len(gpus) if isinstance(gpus, list) else 0}")
        _print_tiers(n.get("tiers"), "    ")
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
        text = _as_json({"node": info.get("node"), **stats})
        if text is None:
            print(f"kvpool status: a STATS answer that cannot be written as JSON (socket {path})", file=sys.stderr)
            return 1
        print(text)
        return 0
    # (the answer is a map, any map: a sidecar of another version, or whatever listens on the
    # socket, had ended the command in a KeyError or TypeError traceback)
    print(f"node {_shown(info.get('node'))}  blocks {_shown(stats.get('blocks', '?'))}  "
          f"policy {_shown(stats.get('policy', '?'))}  sessions {_shown(stats.get('sessions', '?'))}")
    _print_tiers(stats.get("tiers"))
    counters = stats.get("counters")
    hits = misses = 0
    if isinstance(counters, dict):
        hits, misses = _count(counters.get("get_hit", 0)) or 0, _count(counters.get("get_miss", 0)) or 0
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
    st.add_argument("--timeout", type=finite(zero=False), default=5.0,
                    help="seconds to wait for the sidecar (or the index), in all; default 5")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_status)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
