"""Python stubs of the CSI spec's ``csi.proto`` (package ``csi.v1``), generated: do not edit.

``scripts/gen_csi_stubs.sh`` writes ``csi_pb2``/``csi_pb2_grpc`` and their ``.pyi`` files
from ``csi.proto`` (the spec's version is ``kvpool_csi.CSI_SPEC_VERSION``).
"""
