"""The benchmarks' output contracts (scripts read them), on tiny runs; no timing is judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def bench(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", "bench", *args, "--json", "--no-mooncake",
                          "--sizes-mib", "4", "--batch", "2", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_local_bench_contract() -> None:
    r = bench("local")
    for key in ("put_vs_memcpy_4MiB", "get_vs_memcpy_4MiB", "put_vs_checksummed_copy_4MiB",
                "get_vs_checksummed_copy_4MiB"):
        assert r["ratios"][key] > 0
    assert r["lookup64_p50_us"] > 0
    row = r["blocks"]["4MiB"]
    assert set(row) == {"put_gbps", "get_gbps", "memcpy_gbps", "checksummed_copy_gbps", "put_blocks_per_s",
                        "get_blocks_per_s",
                        "acquire_release_blocks_per_s", "put_sidecar_cpu_us_per_block",
                        "get_sidecar_cpu_us_per_block", "acquire_release_sidecar_cpu_us_per_block",
                        "acquire_release_capacity_blocks_per_s"}
    # the sidecar's CPU is read from /proc: every figure is a real, positive measurement
    assert all(row[k] > 0 for k in row if "sidecar_cpu" in k or "capacity" in k)


@pytest.mark.redis
def test_peer_bench_contract() -> None:
    r = bench("peer")
    for key in ("fetch_vs_raw_tcp_4MiB", "fetch_in_place_vs_raw_tcp_4MiB", "fetch_in_place_vs_raw_tcp_hashed_4MiB",
                "raw_tcp_hashed_vs_raw_tcp_4MiB", "lookup64_vs_redis_rtt"):
        assert r["ratios"][key] > 0
    assert r["lookup64_p50_us"] > 0 and r["redis_rtt_p50_us"] > 0


def test_soak_reports_every_operation_and_no_wrong_byte() -> None:
    from kvpool_bench.soak import SoakOptions, run_soak

    r = run_soak(SoakOptions(clients=2, seconds=3.0, workers=1, dram="32Mi", disk="64Mi", prompts=16))
    assert r["wrong_blocks"] == 0 and r["sidecar"]["alive_at_end"]
    assert r["operations"] == sum(v["count"] for v in r["ops"].values()) > 0
    assert set(r["ops"]) == {"put", "get", "acquire", "lookup"} and r["ops"]["put"]["count"] > 0
    assert r["sidecar"]["fds_max"] > 0 and r["sidecar"]["rss_max"] > 0
    assert all(v > 0 for v in r["ratios"].values())


def test_local_bench_takes_blocks_under_a_mebibyte_and_refuses_nonsense() -> None:
    cmd = [sys.executable, "-m", "kvpool_sidecar.cli", "bench", "local", "--json", "--no-mooncake", "--batch", "2",
           "--rounds", "2", "--sizes-mib"]
    out = subprocess.run([*cmd, "0.0625"], capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert set(r["blocks"]) == {"64KiB"} and r["ratios"]["put_vs_memcpy_64KiB"] > 0
    for bad in ("abc", "0.000001", ""):
        res = subprocess.run([*cmd, bad], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "--sizes-mib" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, option", [
    (["bench", "local", "--batch", "0"], "--batch"),  # had been a ValueError traceback
    (["bench", "peer", "--batch", "0"], "--batch"),  # a ZeroDivisionError
    (["bench", "local", "--rounds", "-3"], "--rounds"),  # a KeyFormatError
    (["bench", "churn", "--churn-seconds", "nan"], "--churn-seconds"),
    (["bench", "local", "--sizes-mib", "1e9"], "--sizes-mib"),  # a RuntimeError from Mooncake's setup
    (["bench", "local", "--sizes-mib", "inf"], "--sizes-mib"),  # an OverflowError
    (["bench", "peer", "--sizes-mib", "1024", "--batch", "100000", "--no-mooncake"], "--batch"),  # petabytes
    (["replay", "--capacity-fraction", "nan"], "--capacity-fraction"),  # a ValueError
    (["replay", "--instances", "0"], "--instances"),
    (["demo", "--limit", "x"], "--limit"),
    (["demo", "--block-bytes", "3000000000", "--limit", "5", "--no-progress"], "--block-bytes"),  # killed (OOM)
    (["demo", "--dram", "0", "--limit", "5", "--no-progress"], "dram.size_bytes"),  # a SidecarError traceback
    (["demo", "--policy", "nope", "--limit", "5", "--no-progress"], "unknown policy"),
])
def test_bench_replay_and_demo_refuse_nonsense_in_a_line(args: list[str], option: str) -> None:
    res = subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and option in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_pressure_bench_reports_both_modes_and_no_wrong_byte() -> None:
    from kvpool_bench.pressure import CALM_ROUNDS, PressureOptions, run_pressure

    r = run_pressure(PressureOptions(threads=2, block_bytes=64 << 10, batch=4, dram_mib=8, disk_mib=64))
    for mode in ("write_ahead", "write_ahead_put_waits_baseline", "on_demand_baseline"):
        m = r[mode]
        # calm: every timed round (6 batches per thread: 0.4 of 8 MiB in puts of 256 KiB), none
        # evicting (five rounds of 0.4 of the tier fit only because each round's blocks go)
        assert m["calm"]["puts"] == CALM_ROUNDS * 2 * 6 and m["calm_evicted_blocks"] == 0
        for phase in ("calm", "pressure"):
            assert m[phase]["puts"] > 0 and m[phase]["wrong_blocks"] == 0
            assert 0 < m[phase]["stored_share"] <= 1
        assert m["calm"]["stored_share"] == 1  # (calm puts find free room)
        if m["put_waits_for_disk"]:  # a put that waits for its room is stored
            assert m["pressure"]["stored_share"] == 1 and m["puts_refused_without_clean_room"] == 0
        assert m["put_p99_pressure_over_calm"] > 0
        assert m["demoted_blocks"] > 0  # the pressure phase did evict to disk
    assert r["put_p99_under_pressure_ahead_over_on_demand"] > 0
    assert r["put_p99_under_pressure_ahead_over_waits"] > 0


def test_disk_bench_reports_each_path_against_the_raw_disk(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", "bench", "disk", "--json", "--total-mib", "4",
                          "--path", str(tmp_path)], capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert set(r["blocks"]) == {"64KiB", "2MiB"} and r["fsync"] == "always"
    for label in ("64KiB", "2MiB"):
        for path in ("demote_vs_raw_write", "demote_batched_vs_raw_write", "promote_vs_raw_read",
                     "promote_batched_vs_raw_read", "promote_parallel_vs_raw_read"):
            for layout in ("", "files_"):  # segments, then one file per block
                assert r["ratios"]["{}{}_{}".format(layout, path, label)] > 0
    assert list(tmp_path.iterdir()) == []  # its files are gone


def test_a_churn_shorter_than_its_prober_takes_to_start_still_measures_lookups() -> None:
    """The prober is a process of its own, a second or so to start: a churn of 0.1 s had ended
    before it asked anything, in a RuntimeError traceback."""
    from kvpool_bench.churn import ChurnOptions, run_churn

    r = run_churn(ChurnOptions(blocks=256, batch=64, seconds=0.05))
    assert all(run["lookup_ms"]["max"] > 0 for runs in r["runs"].values() for run in runs)


def test_churn_bench_reports_both_collectors_against_each_other() -> None:
    from kvpool_bench.churn import ChurnOptions, run_churn

    r = run_churn(ChurnOptions(blocks=4096, batch=256, seconds=1.0))
    for name in ("collector", "python_gc"):
        [run] = r["runs"][name]
        assert run["replaced_blocks_per_s"] > 0
        assert 0 < run["lookup_ms"]["p50"] <= run["lookup_ms"]["max"]
        assert 0 < run["put_ms"]["p50"] <= run["put_ms"]["max"]
    assert set(r["ratios"]) == {"lookup_max_vs_python_gc", "lookup_p999_vs_python_gc", "put_max_vs_python_gc",
                                "put_p99_vs_python_gc", "replaced_rate_vs_python_gc"}
    assert all(v > 0 for v in r["ratios"].values())


def test_tenants_bench_reports_the_probe_alone_and_beside_the_flood() -> None:
    from kvpool_bench.tenants import TenantsOptions, run_tenants

    r = run_tenants(TenantsOptions(seconds=1.0, connections=2, batch=512))
    for phase in ("alone", "flood"):
        run = r["runs"][phase]
        assert run["lookups"] > 0
        assert 0 < run["lookup_ms"]["p50"] <= run["lookup_ms"]["p99"] <= run["lookup_ms"]["max"]
    assert r["runs"]["flood"]["flood_blocks_per_s"] > 0
    assert set(r["ratios"]) == {"lookup_p50_flood_vs_alone", "lookup_p99_flood_vs_alone"}
    assert all(v > 0 for v in r["ratios"].values())
