#!/usr/bin/env bash
# Regenerate the CSI node plugin's Python stubs (operator/kvpool_csi/proto/) from csi.proto.
#
# csi.proto is the Container Storage Interface spec's, version CSI_SPEC_VERSION in
# operator/kvpool_csi/__init__.py (github.com/container-storage-interface/spec, tag vX.Y.Z);
# replace the file to move to another spec version, then run this script. The generators
# run in a throwaway virtualenv, pinned: grpcio-tools 1.71 writes code that needs protobuf
# >= 5.29 and grpcio >= 1.71 at run time (the `csi` extra's floor), and mypy-protobuf writes
# the .pyi files that mypy checks the plugin against.
set -euo pipefail
cd "$(dirname "$0")/.."
PROTO_DIR=operator/kvpool_csi/proto
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet 'grpcio-tools==1.71.0' 'mypy-protobuf==3.6.0'
PATH="$venv/bin:$PATH" "$venv/bin/python" -m grpc_tools.protoc -I operator \
  --python_out=operator --grpc_python_out=operator --mypy_out=operator --mypy_grpc_out=operator \
  "$PROTO_DIR/csi.proto"
echo "gen_csi_stubs: $(ls "$PROTO_DIR" | tr '\n' ' ')"
