"""The CSI Identity and Node services over gRPC, and the server on the plugin's Unix socket.

No Controller service (nothing to create or attach: the CSIDriver says
``attachRequired: false`` and ``volumeLifecycleModes: [Ephemeral]``). Node capabilities: none
(no staging, no volume stats). Errors leave as the gRPC status their
:class:`~kvpool_csi.errors.CsiError` carries.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from concurrent import futures
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn, TypeVar

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from kvpool_csi import CSI_SPEC_VERSION, DRIVER_NAME
from kvpool_csi.errors import CsiError, SettingsError
from kvpool_csi.node import NodePlugin, Publish
from kvpool_csi.proto import csi_pb2 as pb
from kvpool_csi.proto import csi_pb2_grpc as pb_grpc

T = TypeVar("T")
#: Requests served at once (the kubelet sends a few per pod start).
WORKERS = 4

_READ_ONLY_MODES = (pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
                    pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY)


def _answer(context: grpc.ServicerContext, call: Callable[[], T]) -> T:
    """``call()``, with a :class:`CsiError` turned into its gRPC status."""
    try:
        return call()
    except CsiError as e:
        context.abort(e.code, str(e))


def _unimplemented(context: grpc.ServicerContext, what: str) -> NoReturn:
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "{} is not offered by {}".format(what, DRIVER_NAME))


def vendor_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:
        return "0.0.0"


class IdentityService(pb_grpc.IdentityServicer):
    """GetPluginInfo, GetPluginCapabilities (none: no controller), Probe."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def GetPluginInfo(self, request: pb.GetPluginInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=vendor_version(),
                                        manifest={"csi-spec": CSI_SPEC_VERSION})

    def GetPluginCapabilities(self, request: pb.GetPluginCapabilitiesRequest,
                              context: grpc.ServicerContext) -> pb.GetPluginCapabilitiesResponse:
        return pb.GetPluginCapabilitiesResponse()

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        # Ready when the pools' directories are there to mount (the host's /run/kvpool).
        return pb.ProbeResponse(ready=BoolValue(value=os.path.isdir(self.plugin.socket_root)))


class NodeService(pb_grpc.NodeServicer):
    """NodePublishVolume, NodeUnpublishVolume, NodeGetInfo, NodeGetCapabilities."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def NodePublishVolume(self, request: pb.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodePublishVolumeResponse:
        cap = request.volume_capability
        access_type = (cap.WhichOneof("access_type") or "") if request.HasField("volume_capability") else ""
        read_only = request.readonly or cap.access_mode.mode in _READ_ONLY_MODES
        publish = Publish(volume_id=request.volume_id, target_path=request.target_path, read_only=read_only,
                          access_type=access_type, volume_context=dict(request.volume_context))
        _answer(context, lambda: self.plugin.publish(publish))
        return pb.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: pb.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext) -> pb.NodeUnpublishVolumeResponse:
        _answer(context, lambda: self.plugin.unpublish(request.volume_id, request.target_path))
        return pb.NodeUnpublishVolumeResponse()

    def NodeGetInfo(self, request: pb.NodeGetInfoRequest, context: grpc.ServicerContext) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=self.plugin.node_id)

    def NodeGetCapabilities(self, request: pb.NodeGetCapabilitiesRequest,
                            context: grpc.ServicerContext) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse()

    def NodeStageVolume(self, request: pb.NodeStageVolumeRequest,
                        context: grpc.ServicerContext) -> pb.NodeStageVolumeResponse:
        _unimplemented(context, "NodeStageVolume")

    def NodeUnstageVolume(self, request: pb.NodeUnstageVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodeUnstageVolumeResponse:
        _unimplemented(context, "NodeUnstageVolume")

    def NodeGetVolumeStats(self, request: pb.NodeGetVolumeStatsRequest,
                           context: grpc.ServicerContext) -> pb.NodeGetVolumeStatsResponse:
        _unimplemented(context, "NodeGetVolumeStats")

    def NodeExpandVolume(self, request: pb.NodeExpandVolumeRequest,
                         context: grpc.ServicerContext) -> pb.NodeExpandVolumeResponse:
        _unimplemented(context, "NodeExpandVolume")


def serve(plugin: NodePlugin, socket_path: str) -> grpc.Server:
    """Start the services on ``socket_path`` (a stale socket there is replaced); the caller
    stops the returned server."""
    try:
        if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            os.unlink(socket_path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvpool-csi"))
    pb_grpc.add_IdentityServicer_to_server(IdentityService(plugin), server)
    pb_grpc.add_NodeServicer_to_server(NodeService(plugin), server)
    try:
        server.add_insecure_port("unix://" + socket_path)
    except RuntimeError as e:
        raise SettingsError("cannot listen on {}: {}".format(socket_path, e)) from e
    server.start()
    return server
