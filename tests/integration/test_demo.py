"""``kvpool demo`` (the README's first command) on the start of the shared trace: every
byte it serves is checked, and it says where its time went."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_bench.demo import PARTS, run_demo
from kvpool_bench.trace import default_trace_path

pytestmark = pytest.mark.integration


def test_the_demo_serves_right_bytes_and_accounts_for_its_time(capsys: pytest.CaptureFixture[str]) -> None:
    s = run_demo(str(default_trace_path()), limit=200, block_bytes=16 << 10, dram="2Mi", disk="64Mi",
                 progress=False, as_json=True)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(s))
    assert s["requests"] == 200 and s["wrong_bytes_served"] == 0
    assert 0 < s["hit_rate"] < 1 and s["hit_blocks"] > 0
    assert s["disk_bytes"]["written"] > 0  # 2 MiB of DRAM: the trace's blocks spill to disk
    parts = s["time_s"]
    assert set(parts) == set(PARTS) and all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= s["seconds"]  # the parts are within the loop's time
    assert s["sidecar_cpu_s"] > 0 and s["sidecar_loop_cpu_s"] > 0  # (threads that ended leave the first)
    assert s["client_cpu_in_pool_calls_s"] > 0
    disk = s["disk_seconds"]  # the disk tier's own: writing what it was sent, from its threads
    assert set(disk) == {"write", "sync", "read", "read_cached", "delete"} and disk["write"] > 0


def test_the_demo_command_prints_its_breakdown() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", "demo", "--limit", "50", "--no-progress"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "wrong bytes served 0" in out
    assert "time, demo's own" in out and "time, pool calls" in out and "on its event loop" in out
    assert "time, disk         writing" in out
