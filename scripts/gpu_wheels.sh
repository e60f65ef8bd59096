#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine with no network (its image has Python 3.12,
# torch, transformers and most of what the sidecar needs): the packages it lacks, at the
# versions this checkout's venv has, for CPython 3.12 on x86-64 Linux, into build/gpu-wheels
# (or $1), with this machine's redis-server and the libraries it and Mooncake's wheel load
# (bin/, for the CPU benches the check also runs there). Then carry that folder to the GPU
# machine with the checkout. Mooncake's wheel (46 MB, the benches' baseline) goes to
# build/gpu-mooncake (or $2): it is carried alone, in a call of its own, as the two together
# pass the 64 MiB one call may carry, and stays there for the next call while the machine is warm.
#
#   bash scripts/gpu_wheels.sh            # after make setup
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-build/gpu-wheels}"
mooncake_dest="${2:-build/gpu-mooncake}"
py="${PYTHON:-.venv/bin/python}"
need=(redis hiredis zstandard cryptography cffi pycparser pyzmq msgspec pytest-asyncio)
mkdir -p "$dest"
freeze="$("$py" -m pip list --format=freeze 2>/dev/null)"
download() {  # download DEST PIN: the CPython 3.12 x86-64 wheel of PIN
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$1" "$2"
}
for name in "${need[@]}"; do
  pin="$(grep -i "^${name}==" <<<"$freeze" || true)"
  if [[ -z "$pin" ]]; then
    echo "gpu_wheels: $name is not installed in $py (run make setup first)" >&2
    exit 1
  fi
  download "$dest" "$pin"
done

# redis-server behind a wrapper that finds its libraries (all but glibc's) next to it, and
# libibverbs, which Mooncake's wheel loads
mkdir -p "$dest/bin/lib"
exe="$(readlink -f "$(command -v redis-server)")"
verbs="$(ldconfig -p | awk '/libibverbs\.so\.1 /{print $NF; exit}')"
cp "$exe" "$dest/bin/lib/redis-server"
for lib in $(ldd "$exe" | awk '$3 ~ /^\// {print $3}'); do
  case "$(basename "$lib")" in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
    *) cp -L "$lib" "$dest/bin/lib/" ;;
  esac
done
mkdir -p "$dest/bin/verbs"  # on LD_LIBRARY_PATH for the benches only where the machine lacks it
cp -L "$verbs" $(ldd "$verbs" | awk '$3 ~ /libnl/ {print $3}') "$dest/bin/verbs/"
cat > "$dest/bin/redis-server" <<'EOF'
#!/bin/sh
lib="$(dirname "$(readlink -f "$0")")/lib"
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$lib/redis-server" "$@"
EOF
chmod +x "$dest/bin/redis-server"

pin="$(grep -i "^mooncake-transfer-engine-non-cuda==" <<<"$freeze" || true)"
if [[ -n "$pin" ]]; then
  mkdir -p "$mooncake_dest"
  download "$mooncake_dest" "$pin"
fi
echo "gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheels and redis-server in $dest ($(du -sh "$dest" | cut -f1))," \
  "Mooncake in $mooncake_dest ($(du -sh "$mooncake_dest" 2>/dev/null | cut -f1))"
