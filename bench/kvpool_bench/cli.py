"""The ``kvpool demo``, ``kvpool bench`` and ``kvpool replay`` subcommands, added to the
``kvpool`` command as a plugin (entry point group ``kvpool.commands``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpool_client.errors import KVPoolError
from kvpool_sidecar.argtypes import count, finite

#: The largest block ``--sizes-mib`` takes (a larger one had failed deep in the Mooncake
#: baseline's setup, or in the sidecar's, with a traceback).
MAX_BLOCK_MIB = 1024


_positive = finite(zero=False)
_not_negative = finite(zero=True)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvpool_bench.demo import run_demo
    from kvpool_bench.services import TooLargeError
    from kvpool_bench.trace import TraceError, default_trace_path
    from kvpool_sidecar.errors import SidecarError

    try:
        run_demo(str(args.trace or default_trace_path()), limit=args.limit, block_bytes=args.block_bytes,
                 dram=args.dram, disk=args.disk, policy=args.policy, progress=not args.no_progress,
                 as_json=args.json)
    except (TraceError, TooLargeError, SidecarError) as e:
        # (a sidecar refusing --dram, --disk or --policy says why: its own line, not a traceback)
        print(f"kvpool demo: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    asked = args.sizes_mib if args.sizes_mib is not None else ("0.0625,2" if args.what == "disk" else "1,4")
    try:
        sizes = [int(float(x) * (1 << 20)) for x in asked.split(",")]
    except (ValueError, OverflowError):
        sizes = []
    if not sizes or min(sizes) < 4096 or max(sizes) > MAX_BLOCK_MIB << 20:
        print(f"kvpool bench: --sizes-mib wants sizes in MiB from 4 KiB to {MAX_BLOCK_MIB} MiB each, e.g. "
              f"0.0625,1,4 (got {asked!r})", file=sys.stderr)
        return 2
    if args.what in ("local", "peer"):
        from kvpool_bench.services import TooLargeError

        try:
            result = _data_path_bench(args, sizes)
        except TooLargeError as e:
            print(f"kvpool bench: {e}", file=sys.stderr)
            return 2
    elif args.what == "pressure":
        from kvpool_bench.pressure import PressureOptions, run_pressure

        result = run_pressure(PressureOptions())
    elif args.what == "churn":
        from kvpool_bench.churn import ChurnOptions, run_churn

        result = run_churn(ChurnOptions(blocks=args.blocks, seconds=args.churn_seconds, repeats=args.repeats))
    elif args.what == "tenants":
        from kvpool_bench.tenants import TenantsOptions, run_tenants

        try:
            topts = TenantsOptions(seconds=args.flood_seconds, connections=args.flood_connections,
                                   batch=args.flood_batch, policy=args.flood_policy)
        except ValueError as e:
            print(f"kvpool bench tenants: {e}", file=sys.stderr)
            return 2
        result = run_tenants(topts)
    elif args.what == "disk":
        from kvpool_bench.disk import DiskBenchOptions, run_disk_bench

        result = run_disk_bench(DiskBenchOptions(sizes=tuple(sizes), total_bytes=int(args.total_mib * (1 << 20)),
                                                 fsync=args.fsync, path=args.path))
    elif args.what == "soak":
        from kvpool_bench.soak import SoakOptions, run_soak

        result = run_soak(SoakOptions(clients=args.clients, seconds=args.seconds))
    elif args.what == "engine":
        from kvpool_bench.engine import EngineBenchOptions, ModelSpec, run_engine_bench
        from kvpool_bench.trace import TraceError, default_trace_path

        opts = EngineBenchOptions(
            trace=str(args.trace or default_trace_path()), limit=args.limit, instances=args.instances,
            tokens_per_block=args.tokens_per_block, max_blocks=args.max_blocks,
            capacity_fraction=args.capacity_fraction, check_every=args.check_every, pool_policy=args.pool_policy,
            segments=args.segments,
            spec=ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                           intermediate=args.intermediate, vocab=args.vocab))
        try:
            result = run_engine_bench(opts, progress=None if args.json else lambda m: print(m, file=sys.stderr))
        except (TraceError, ValueError, KVPoolError) as e:
            print(f"kvpool bench engine: {e}", file=sys.stderr)
            return 2
    else:
        print(f"kvpool bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _data_path_bench(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """``kvpool bench local`` or ``kvpool bench peer``."""
    if args.what == "local":
        from kvpool_bench.local import run_local_bench

        return run_local_bench(sizes, batch=args.batch, rounds=args.rounds, mooncake=not args.no_mooncake)
    from kvpool_bench.peer import run_peer_bench

    pipelined = {"auto": None, "on": True, "off": False}[args.pipelined_receive]
    return run_peer_bench(sizes, batch=args.batch, rounds=args.rounds, mooncake=not args.no_mooncake,
                          pipelined=pipelined)


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvpool_bench.replay import ReplayError, ReplayOptions, TenantSpec, main_replay, parse_fractions
    from kvpool_bench.trace import TraceError, default_trace_path
    from kvpool_sidecar.errors import ConfigError

    try:
        opts = ReplayOptions(
            policy=args.policy, instances=args.instances, routing=args.routing, private=args.private,
            tenants=tuple(TenantSpec.parse(t) for t in args.tenant), share_tenants=args.share_tenants,
            bytes_per_token=args.bytes_per_token, seed=args.seed, progress=not args.no_progress,
            oracles=args.oracles, hints=not args.no_hints)
        fractions = parse_fractions(args.sweep)
        out = main_replay(str(args.trace or default_trace_path()), opts, fraction=args.capacity_fraction,
                          blocks=args.capacity, disk_fraction=args.disk_fraction, disk_blocks=args.disk_capacity,
                          limit=args.limit, plot=args.plot, sweep_fractions=fractions,
                          sweep_policies=[p for p in args.plot_policies.split(",") if p])
    except (TraceError, ReplayError, ConfigError) as e:
        print(f"kvpool replay: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


def register(sub: Any) -> None:
    """Add ``demo``, ``bench`` and ``replay`` to the ``kvpool`` command's subparsers."""
    d = sub.add_parser("demo", help="replay a trace through a local pool with synthetic KV")
    d.add_argument("--trace", help="Mooncake-format trace (default: $KVPOOL_TRACE, else "
                                   "../shared/traces/synthetic_trace.jsonl from the working directory)")
    d.add_argument("--limit", type=count(1), help="replay only the first N requests")
    d.add_argument("--block-bytes", type=count(1), default=64 << 10, help="synthetic KV bytes per 512-token block")
    d.add_argument("--dram", default="512Mi", help="DRAM tier size")
    d.add_argument("--disk", default="2Gi", help="disk tier size")
    d.add_argument("--policy", default="prefix", help="eviction policy")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="benchmarks that report ratios against same-run baselines")
    b.add_argument("what", choices=["local", "peer", "engine", "soak", "pressure", "disk", "churn", "tenants"])
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.add_argument("--sizes-mib", default=None,
                   help="block sizes in MiB, comma-separated (default 1,4; for disk 0.0625,2)")
    b.add_argument("--batch", type=count(1), default=16)
    b.add_argument("--rounds", type=count(1), default=8)
    b.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake Store baseline")
    b.add_argument("--pipelined-receive", choices=["auto", "on", "off"], default="auto",
                   help="bench peer: the sidecars' peer.pipelined_receive (auto: on with 4 CPUs or more)")
    dk = b.add_argument_group("disk", "kvpool bench disk: demote and promote against raw writes and reads "
                                      "(--sizes-mib 0.0625,2 there)")
    dk.add_argument("--fsync", choices=["always", "never"], default="always", help="the disk tier's fsync policy")
    dk.add_argument("--total-mib", type=_positive, default=256.0, help="MiB moved per block size and path")
    dk.add_argument("--path", default=None, help="directory on the filesystem to measure (default: the temp dir)")
    ch = b.add_argument_group("churn", "kvpool bench churn: latency while a large store's blocks are replaced, "
                                       "against Python's own garbage collector")
    ch.add_argument("--blocks", type=count(1), default=300_000, help="blocks of 4 KiB held")
    ch.add_argument("--churn-seconds", type=_positive, default=30.0, help="seconds of replacing per run")
    ch.add_argument("--repeats", type=count(1), default=1, help="runs of each, alternated")
    te = b.add_argument_group("tenants", "kvpool bench tenants: one tenant's lookups while another floods the "
                                         "sidecar with reads, against the same lookups alone")
    te.add_argument("--flood-seconds", type=_positive, default=8.0, help="seconds of lookups in each phase")
    te.add_argument("--flood-connections", type=count(1), default=4, help="the flooding tenant's connections")
    te.add_argument("--flood-batch", type=count(1), default=4096, help="blocks of 4 KiB in each of its reads")
    te.add_argument("--flood-policy", default="prefix", help="the sidecar's eviction policy")
    so = b.add_argument_group("soak", "kvpool bench soak: mixed clients under eviction pressure, bytes checked")
    so.add_argument("--clients", type=count(1), default=32)
    so.add_argument("--seconds", type=_positive, default=300.0)
    e = b.add_argument_group("engine", "kvpool bench engine: a random Llama-shaped model served on a trace")
    e.add_argument("--trace", help="Mooncake-format trace (default: $KVPOOL_TRACE, else "
                                   "../shared/traces/synthetic_trace.jsonl from the working directory)")
    e.add_argument("--limit", type=count(1), default=None, help="serve the first N requests (default: all)")
    e.add_argument("--instances", type=count(1), default=2, help="engine instances (processes)")
    e.add_argument("--tokens-per-block", type=count(1), default=64, help="tokens per trace block (512 in the trace)")
    e.add_argument("--max-blocks", type=count(1), default=6, help="trace blocks per request at most")
    e.add_argument("--capacity-fraction", type=_positive, default=0.25,
                   help="total KV memory (private caches, pool) as a fraction of the distinct blocks")
    e.add_argument("--check-every", type=count(0), default=10,
                   help="recompute every Nth reusing request's prefix locally and compare bitwise (0: never)")
    e.add_argument("--pool-policy", default="prefix", help="the pool sidecar's eviction policy")
    e.add_argument("--segments", type=count(1), default=8, help="trace segments; the modes take turns on each")
    e.add_argument("--layers", type=count(1), default=4)
    e.add_argument("--hidden", type=count(1), default=256)
    e.add_argument("--heads", type=count(1), default=8)
    e.add_argument("--kv-heads", type=count(1), default=2)
    e.add_argument("--intermediate", type=count(1), default=512)
    e.add_argument("--vocab", type=count(1), default=512)
    b.set_defaults(func=_cmd_bench)

    r = sub.add_parser("replay", help="replay a trace through the store and policies; compare with LRU and Belady")
    r.add_argument("trace", nargs="?", help="Mooncake-format trace (default: $KVPOOL_TRACE, else "
                                            "../shared/traces/synthetic_trace.jsonl from the working directory)")
    r.add_argument("--policy", default="prefix", help="eviction policy (default: prefix)")
    cap = r.add_mutually_exclusive_group()
    cap.add_argument("--capacity", type=count(1), help="DRAM capacity in blocks, all instances together")
    cap.add_argument("--capacity-fraction", type=_positive, default=0.10,
                     help="DRAM capacity as a fraction of the trace's distinct blocks (default 0.10)")
    dcap = r.add_mutually_exclusive_group()
    dcap.add_argument("--disk-capacity", type=count(0), help="disk capacity in blocks (default: no disk tier)")
    dcap.add_argument("--disk-fraction", type=_not_negative, help="disk capacity as a fraction of distinct blocks")
    r.add_argument("--instances", type=count(1), default=1, help="serving instances")
    r.add_argument("--routing", default="round-robin", choices=["round-robin", "random", "prefix"])
    r.add_argument("--private", action="store_true",
                   help="one private cache per instance (capacity split evenly) instead of one shared pool")
    r.add_argument("--tenant", action="append", default=[], metavar="NAME[:PRIORITY[:QUOTA]]",
                   help="declare a tenant; QUOTA in bytes, NNNb blocks or NN%% of the tier (repeatable)")
    r.add_argument("--share-tenants", action="store_true", help="tenants may hit each other's blocks")
    r.add_argument("--bytes-per-token", type=count(1), default=131072, help="KV bytes per token (sizes only)")
    r.add_argument("--limit", type=count(1), help="replay only the first N requests")
    r.add_argument("--oracles", action="store_true",
                   help="also report LRU with admission oracles (knows if, or when, a block is reused)")
    r.add_argument("--seed", type=int, default=0, help="seed of random routing")
    r.add_argument("--no-hints", action="store_true",
                   help="put without the hints an engine would give (prompt length; session and label where the "
                        "trace has them)")
    r.add_argument("--plot", metavar="PNG", help="also write hit rate against capacity to this PNG")
    r.add_argument("--sweep", default="0.02,0.05,0.1,0.25", help="capacity fractions for --plot")
    r.add_argument("--plot-policies", default="lru,prefix", help="policies for --plot, comma-separated")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--json", action="store_true", help="one line of JSON")
    r.set_defaults(func=_cmd_replay)

