#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine with no network (its image has Python 3.12,
# torch, transformers and most of what the sidecar needs): the packages it lacks, at the
# versions this checkout's venv has, for CPython 3.12 on x86-64 Linux, into build/gpu-wheels
# (or $1). Then carry that folder to the GPU machine with the checkout.
#
#   bash scripts/gpu_wheels.sh            # after make setup
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-build/gpu-wheels}"
py="${PYTHON:-.venv/bin/python}"
need=(redis hiredis zstandard cryptography cffi pycparser pyzmq msgspec pytest-asyncio)
mkdir -p "$dest"
freeze="$("$py" -m pip list --format=freeze 2>/dev/null)"
for name in "${need[@]}"; do
  pin="$(grep -i "^${name}==" <<<"$freeze" || true)"
  if [[ -z "$pin" ]]; then
    echo "gpu_wheels: $name is not installed in $py (run make setup first)" >&2
    exit 1
  fi
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "$pin"
done
echo "gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1))"
