#!/usr/bin/env bash
# kvpool GPU check: run on a machine with an NVIDIA GPU, from anywhere in a copy of the repo.
#
#   bash scripts/gpu_check.sh          # results under $OUT when set, else a temp folder
#
# 1. a venv at $KVPOOL_GPU_VENV (default /tmp/kvpool-gpu-venv) that also sees the
#    interpreter's own packages (so a preinstalled CUDA torch is reused, not re-downloaded);
# 2. pip install -e '.[sidecar,dev,torch,hf]' when a package index answers; otherwise (offline
#    GPU machines) wheels from $KVPOOL_WHEELS (default build/gpu-wheels, which
#    scripts/gpu_wheels.sh fills where pip can reach an index) over
#    what the interpreter already has, and the project's source folders on the venv's path
#    (what an editable install does, with no build backend needed);
# 3. nvidia-smi -L, torch's view of CUDA (no CUDA => exit 2: every gpu test would just skip);
# 4. TTFT of a Llama-3-8B-shaped random model (bf16) on 4k/16k/32k-token prefixes: full
#    prefill against the prefix restored from the pool plus a 256-token suffix
#    (python -m kvpool_bench.gpu_ttft; needs transformers);
# 5. a restore of 4 GiB into the GPU, in place and through staging, by copy threads, against
#    one pinned host->device copy of the same bytes (python -m kvpool_bench.gpu_restore);
# 6. pytest -q -m gpu -rs over the test modules that hold GPU tests;
# 7. host->device copy of 1 GiB: sidecar arena registered pinned vs pageable memory (and
#    torch's own pinned memory as the physical baseline), GB/s and ratios;
# 8. copy rates in 64 KiB / 2 MiB / 32 MiB runs: host->device from a registered sidecar arena
#    vs torch pinned memory, device->device through a CUDA IPC descriptor opened in a second
#    process vs a plain copy_ (python -m kvpool_bench.gpu_copy; one JSON line);
# 9. on the machine's CPU cores, no GPU: `kvpool bench peer` at 4 MiB (receives pipelined
#    and not) and `kvpool bench local`
#    at 64 KiB, 512 KiB and 2 MiB, against raw loopback TCP, memcpy and (with Mooncake's wheel
#    in $KVPOOL_MOONCAKE_WHEELS, default build/gpu-mooncake) Mooncake Store, to set the
#    development machines' 2 cores apart (redis-server from build/gpu-wheels/bin when the
#    machine has none).
# Each step has its own time limit (together under 10 minutes); the TTFT comes first because
# it is the figure the pool exists for.
# Exit status: 0 only when every step passed. Budget: under 10 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d -t kvpool-gpu-XXXX)}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY0="${PYTHON:-python3}"
VENV="${KVPOOL_GPU_VENV:-/tmp/kvpool-gpu-venv}"
WHEELS="${KVPOOL_WHEELS:-build/gpu-wheels}"
status=0
step() { echo; echo "=== $* ($(date +%T))"; }
# KVPOOL_GPU_STEPS="ttft restore" runs only those of the steps after "devices" (names: ttft,
# restore, pytest, pinned, rates, benches); unset, it runs them all.
want() { [[ -z "${KVPOOL_GPU_STEPS:-}" || " $KVPOOL_GPU_STEPS " == *" $1 "* ]]; }
for s in ${KVPOOL_GPU_STEPS:-}; do
  case "$s" in ttft|restore|pytest|pinned|rates|benches) ;; *) echo "KVPOOL_GPU_STEPS: no step named '$s'" >&2; exit 2 ;; esac
done

step "venv $VENV"
if "$PY0" -m venv --system-site-packages "$VENV"; then
  PIP=("$VENV/bin/python" -m pip)
else  # an interpreter without ensurepip: borrow its pip
  "$PY0" -m venv --system-site-packages --without-pip "$VENV" || exit 1
  PIP=("$PY0" -m pip --python "$VENV/bin/python")
fi
PY="$VENV/bin/python"
# When python3 is itself a venv (as on the device machine), --system-site-packages reaches
# only the base interpreter; a .pth file adds the parent's site-packages after the venv's own.
VSITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY0" -c 'import site; print("\n".join(site.getsitepackages()))' > "$VSITE/_kvpool_parent.pth"

step "install"
index="${PIP_INDEX_URL:-https://pypi.org/simple}"
if timeout 20 "$PY" -c "import urllib.request as u; u.urlopen('${index%/}/pip/', timeout=10)" 2>/dev/null \
   && timeout 300 "${PIP[@]}" install -q -e '.[sidecar,dev,torch,hf]'; then
  echo "installed .[sidecar,dev,torch,hf] from $index"
else
  echo "no package index: offline install over the interpreter's packages"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "${PIP[@]}" install -q --no-index --no-deps "$WHEELS"/*.whl || status=1
  fi
  printf '%s\n' "$PWD/client" "$PWD/sidecar" "$PWD/operator" "$PWD/bench" > "$VSITE/_kvpool_src.pth"
fi
"$PY" - <<'EOF' || status=1
import importlib
need = ["torch", "pytest", "msgpack", "xxhash", "yaml", "aiohttp", "sortedcontainers", "prometheus_client",
        "zstandard", "pynvml", "transformers", "kvpool_client.tensors", "kvpool_sidecar.tiers.gpu",
        "kvpool_client.engines.hf", "kvpool_client.cudaipc", "kvpool_sidecar.tiers.gpu_ipc", "kvpool_bench.gpu_copy"]
missing = []
for m in need:
    try:
        importlib.import_module(m)
    except ImportError as e:
        missing.append(f"{m} ({e})")
print("missing: " + ", ".join(missing) if missing else "all modules import")
raise SystemExit(1 if missing else 0)
EOF

step "devices"
nvidia-smi -L || status=1
"$PY" -c '
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    raise SystemExit("CUDA is not available to torch: the gpu tests would only skip")
print("device 0:", torch.cuda.get_device_name(0))
' || exit 2

if want ttft; then
step "TTFT, Llama-3-8B-shaped random model: full prefill vs prefix restored from the pool + 256-token suffix"
# 4k/16k/32k-token prefixes; the pool round trip on CUDA (store, restore through pinned
# staging and straight from the pinned arena), bit-identical restores. One JSON line.
timeout 240 "$PY" -m kvpool_bench.gpu_ttft --device cuda --out "$OUT/gpu_ttft.json" || status=1
fi

if want restore; then
step "restore of 4 GiB into the GPU: in place vs staged, by copy threads, against the H2D floor"
# where a long prefix's restore spends its time (python -m kvpool_bench.gpu_restore; one JSON line)
timeout 200 "$PY" -m kvpool_bench.gpu_restore --threads 1,2,4,8,16 --out "$OUT/gpu_restore.json" || status=1
fi

if want pytest; then
step "pytest -m gpu"
# only the modules that hold GPU tests: collecting the rest imports packages (kopf, the
# Kubernetes client) that a GPU machine need not have
mapfile -t gpu_tests < <(grep -rlE "mark\.gpu" tests --include='test_*.py' | sort)
timeout 150 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
  --junitxml="$OUT/gpu_pytest.xml" "${gpu_tests[@]}" || status=1
fi

if want pinned; then
step "1 GiB host->device: arena pinned vs pageable"
timeout 90 "$PY" - "$OUT/gpu_copy.json" <<'EOF' || status=1
import json, sys, tempfile
import torch
from kvpool_client.client import PoolClient
from kvpool_client.tensors import arena_tensor, register_arena_pinned, unregister_arena_pinned
from kvpool_sidecar.process import SidecarProcess

N, REPS = 1 << 30, 5
dev = torch.empty(N, dtype=torch.uint8, device="cuda")

def gbps(src: torch.Tensor, to_device: bool = True) -> float:
    a, b = (dev, src) if to_device else (src, dev)
    a.copy_(b, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        a.copy_(b, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return N * REPS / (start.elapsed_time(end) / 1e3) / 1e9

sp = SidecarProcess({"node_name": "gpu-check", "dram": {"size_bytes": "1200Mi"}},
                    workdir=tempfile.mkdtemp(prefix="kvpool-gpu-")).start()
try:
    with PoolClient(sp.socket_path) as c:
        pageable = torch.full((N,), 7, dtype=torch.uint8)
        r = {"bytes": N, "reps": REPS, "pageable_h2d": gbps(pageable)}
        r["torch_pinned_h2d"] = gbps(torch.full((N,), 7, dtype=torch.uint8, pin_memory=True))
        r["arena_registered"] = register_arena_pinned(c)
        arena = arena_tensor(c)[:N]
        arena.fill_(7)
        r["arena_is_pinned"] = arena.is_pinned()
        r["arena_h2d"] = gbps(arena)
        r["arena_d2h"] = gbps(arena, to_device=False)
        r["ratio_arena_vs_pageable"] = r["arena_h2d"] / r["pageable_h2d"]
        r["ratio_arena_vs_torch_pinned"] = r["arena_h2d"] / r["torch_pinned_h2d"]
        del arena
        unregister_arena_pinned(c)
finally:
    sp.stop()
for k, v in r.items():
    print(f"{k:30s} {v:.2f}" if isinstance(v, float) else f"{k:30s} {v}")
json.dump(r, open(sys.argv[1], "w"), indent=2)
raise SystemExit(0 if r["arena_registered"] and r["arena_is_pinned"] else "the arena was not pinned")
EOF
fi

if want rates; then
step "copy rates by run size: arena H2D vs torch pinned, CUDA IPC D2D (second process) vs plain copy_"
timeout 90 "$PY" -m kvpool_bench.gpu_copy --out "$OUT/gpu_copy_rates.json" || status=1
fi

if want benches; then
step "CPU benches on this machine's $(nproc) cores: bench peer (4 MiB), bench local (64 KiB, 512 KiB, 2 MiB)"
mooncake="${KVPOOL_MOONCAKE_WHEELS:-build/gpu-mooncake}"
if ! "$PY" -c 'import mooncake.store' 2>/dev/null && compgen -G "$mooncake/*.whl" >/dev/null; then
  "${PIP[@]}" install -q --no-index --no-deps "$mooncake"/*.whl || echo "Mooncake's wheel did not install"
fi
command -v redis-server >/dev/null || export PATH="$PWD/$WHEELS/bin:$PATH"
verbs=""
ldconfig -p | grep -q 'libibverbs\.so\.1 ' || verbs="$PWD/$WHEELS/bin/verbs"
# `kvpool bench`, with or without the entry point an offline install lacks
cat > "$OUT/run_kvpool.py" <<'EOF'
import argparse, sys
from kvpool_bench.cli import register
if __name__ == "__main__":  # the benches start processes by spawn, which import this file
    parser = argparse.ArgumentParser(prog="kvpool")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:])
    sys.exit(args.func(args))
EOF
[[ -z "$verbs" ]] || export LD_LIBRARY_PATH="$verbs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVPOOL_SIDECAR_LOGS="$OUT/sidecar-logs"  # what the benches' sidecars logged (an error storm, say)
# receives pipelined (the default on this many cores) and not, in turn
for mode in on off; do
  timeout 120 "$PY" "$OUT/run_kvpool.py" bench peer --sizes-mib 4 --json --pipelined-receive "$mode" \
    > "$OUT/bench_peer_$mode.json" || status=1
  cat "$OUT/bench_peer_$mode.json"
done
timeout 240 "$PY" "$OUT/run_kvpool.py" bench local --sizes-mib 0.0625,0.5,2 --json > "$OUT/bench_local.json" || status=1
cat "$OUT/bench_local.json"
fi

step "done: status $status; results in $OUT"
exit "$status"
