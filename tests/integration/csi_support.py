"""The CSI node plugin as the kubelet sees it: ``python -m kvpool_csi`` on a Unix socket, and
calls shaped like the kubelet's (an inline ephemeral volume of a pod, its target directory).

Used by tests/integration/test_csi_node.py and tests/e2e/test_csi_pools.py. A "host" is a
short temporary directory holding the pools' socket directories (the plugin's
``--socket-root``, the host's /run/kvpool) and a kubelet directory; mounts go where the
kubelet's would, so the tests need root (mount(2)), and every mount left under the host is
taken off before the directory goes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.support import DEADLINE_S

#: What the kubelet calls the volume directory of a CSI volume under a pod.
CSI_PLUGIN_DIR = "kubernetes.io~csi"


def mount_refused() -> str | None:
    """Why this process cannot bind-mount (not root, or mount(2) refused), or None."""
    if os.geteuid() != 0:
        return "needs root: the node plugin mounts"
    from kvpool_csi import mounts
    from kvpool_csi.errors import MountError

    probe = Path(tempfile.mkdtemp(prefix="kvcsi-probe-"))
    try:
        (probe / "src").mkdir()
        (probe / "dst").mkdir()
        fd = os.open(probe / "src", os.O_PATH | os.O_DIRECTORY)
        try:
            mounts.bind_dir(fd, str(probe / "dst"), read_only=True)
        except MountError as e:
            return "mount(2) is refused here: {}".format(e)
        finally:
            os.close(fd)
        mounts.unmount(str(probe / "dst"))
        return None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


@dataclass
class Host:
    """One node's directories: pools' socket directories under ``run``, the kubelet's under ``kubelet``."""

    root: Path

    @property
    def run(self) -> Path:
        return self.root / "run-kvpool"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    def pool_dir(self, namespace: str, name: str) -> Path:
        """The pool's directory as the sidecar's DaemonSet makes it (created here)."""
        d = self.run / "{}.{}".format(namespace, name)
        d.mkdir(mode=0o750, parents=True, exist_ok=True)
        return d

    def unmount_all(self) -> None:
        from kvpool_csi import mounts

        prefix = str(self.root) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split(" ")[4] for line in f]
        for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
            while mounts.mount_count(point):
                mounts.unmount(point)


@contextmanager
def node_host() -> Iterator[Host]:
    """A short-pathed host directory (Unix socket paths must stay under 108 bytes)."""
    host = Host(Path(tempfile.mkdtemp(prefix="kvcsi-")))
    host.run.mkdir()
    (host.kubelet / "pods").mkdir(parents=True)
    try:
        yield host
    finally:
        host.unmount_all()
        shutil.rmtree(host.root, ignore_errors=True)


@dataclass
class Pod:
    """A pod with a kvpool CSI volume, as the kubelet would describe it to the plugin."""

    namespace: str
    name: str = "engine"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    volume: str = "kvpool"


@dataclass
class Kubelet:
    """Calls the plugin over its socket with the kubelet's requests."""

    host: Host
    channel: Any  # grpc.Channel

    @property
    def node(self) -> Any:
        from kvpool_csi.proto import csi_pb2_grpc

        return csi_pb2_grpc.NodeStub(self.channel)

    @property
    def identity(self) -> Any:
        from kvpool_csi.proto import csi_pb2_grpc

        return csi_pb2_grpc.IdentityStub(self.channel)

    def target(self, pod: Pod) -> Path:
        return self.host.kubelet / "pods" / pod.uid / "volumes" / CSI_PLUGIN_DIR / pod.volume / "mount"

    def publish_request(self, pod: Pod, pool: str | None, *, read_only: bool = True,
                        target: str | None = None, block: bool = False,
                        context: dict[str, str] | None = None) -> Any:
        """The NodePublishVolume request the kubelet sends for ``pod``'s inline volume
        (``context`` replaces the volume context when given)."""
        from kvpool_csi.proto import csi_pb2 as pb

        path = target if target is not None else str(self.target(pod))
        if target is None:
            self.target(pod).parent.mkdir(parents=True, exist_ok=True)  # the kubelet makes the volume's directory
        mode = pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
        cap = (pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=mode) if block else
               pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=mode))
        ctx = {"csi.storage.k8s.io/pod.namespace": pod.namespace, "csi.storage.k8s.io/pod.name": pod.name,
               "csi.storage.k8s.io/pod.uid": pod.uid, "csi.storage.k8s.io/serviceAccount.name": "default",
               "csi.storage.k8s.io/ephemeral": "true"}
        if pool is not None:
            ctx["pool"] = pool
        return pb.NodePublishVolumeRequest(
            volume_id="csi-" + uuid.uuid5(uuid.NAMESPACE_URL, pod.uid + pod.volume).hex, target_path=path,
            volume_capability=cap, readonly=read_only, volume_context=ctx if context is None else context)

    def publish(self, pod: Pod, pool: str | None, **kw: Any) -> Path:
        request = self.publish_request(pod, pool, **kw)
        self.node.NodePublishVolume(request, timeout=DEADLINE_S)
        return Path(request.target_path)

    def unpublish(self, target: Path | str, volume_id: str = "csi-test") -> None:
        from kvpool_csi.proto import csi_pb2 as pb

        self.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume_id,
                                                                    target_path=str(target)), timeout=DEADLINE_S)


@contextmanager
def running_plugin(host: Host, *args: str, node_id: str = "node-a") -> Iterator[Kubelet]:
    """``python -m kvpool_csi`` serving ``host`` (plus ``args``) until the block ends."""
    import grpc

    socket_path = host.root / "csi.sock"
    log_path = host.root / "plugin.log"
    argv: Sequence[str] = [sys.executable, "-m", "kvpool_csi", "--endpoint", "unix://{}".format(socket_path),
                           "--node-id", node_id, "--socket-root", str(host.run), "--kubelet-dir",
                           str(host.kubelet), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel("unix://{}".format(socket_path))
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=DEADLINE_S)
        except grpc.FutureTimeoutError as e:
            raise AssertionError("the plugin did not listen (exit {}):\n{}".format(
                proc.poll(), log_path.read_text(errors="replace")[-4000:])) from e
        yield Kubelet(host, channel)
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=DEADLINE_S)
