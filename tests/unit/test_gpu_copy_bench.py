"""The GPU copy benchmark without a GPU: it imports, refuses to run with exit status 2 and a
one-line reason, and its IPC extents really cost one copy per run. ``scripts/gpu_check.sh``
runs it on a GPU machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool_bench import gpu_copy
from kvpool_client.cudaipc import coalesce


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


no_cuda_only = pytest.mark.skipif(_cuda(), reason="checks the behaviour without CUDA")


@no_cuda_only
def test_without_cuda_it_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_copy.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("gpu_copy: ")


def test_without_torch_it_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    assert gpu_copy.main(["--reps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "gpu_copy: torch is not installed (pip install kvpool[torch])\n"


@no_cuda_only
def test_as_a_module_without_cuda() -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_bench.gpu_copy"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2 and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpu_copy: ")]
    assert lines and "CUDA is not available" in lines[0]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit) as info:
        gpu_copy.main(["--total-mib", "48"])
    assert info.value.code == 2


@pytest.mark.parametrize("run", gpu_copy.RUN_SIZES)
def test_the_ipc_extents_cost_one_copy_per_run(run: int) -> None:
    extents = gpu_copy.reversed_extents(256 << 20, run)
    assert sorted(extents) == [(i * run, run) for i in range(len(extents))]  # every run, once
    assert len(coalesce(extents)) == len(extents) == (256 << 20) // run
