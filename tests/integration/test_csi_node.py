"""The CSI node plugin, called as the kubelet calls it: ``python -m kvpool_csi`` on a Unix
socket, NodePublishVolume bind-mounts a pool's socket directory (read-only) onto a pod's
volume directory, a real sidecar's socket is reached through that mount, NodeUnpublishVolume
takes it away; both are idempotent; bad requests get the CSI spec's gRPC codes and leave
nothing mounted. Pods mount pools of their own namespace (``--pool-lookup none``); the
cross-namespace grants read from the API server are in tests/e2e/test_csi_pools.py.

Needs root (mount(2)); skipped elsewhere, saying why.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.csi_support import Host, Kubelet, Pod, mount_refused, node_host, running_plugin
from tests.integration.support import DEADLINE_S, fresh_keys, payload

grpc = pytest.importorskip("grpc", reason="the csi extra (grpcio) is not installed")
from kvpool_csi import CSI_SPEC_VERSION, DRIVER_NAME  # noqa: E402 - after the grpc check
from kvpool_csi.mounts import mount_count  # noqa: E402
from kvpool_csi.proto import csi_pb2 as pb  # noqa: E402

_REFUSED = mount_refused()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")]

NS = "team-a"


@pytest.fixture
def host() -> Iterator[Host]:
    with node_host() as h:
        yield h


@pytest.fixture
def kubelet(host: Host) -> Iterator[Kubelet]:
    with running_plugin(host, "--pool-lookup", "none") as k:
        yield k


def code_of(call: Callable[[], object]) -> grpc.StatusCode | None:
    """The gRPC status code ``call`` fails with (None: it succeeded)."""
    try:
        call()
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()
        return code
    return None


def short_link(host: Host, target: Path) -> Path:
    """A short path to ``target`` (the kubelet's paths are too long for a socket address)."""
    link = host.root / "p{}".format(len(list(host.root.glob("p*"))))
    link.symlink_to(target)
    return link


def test_identity_and_node_info(kubelet: Kubelet) -> None:
    info = kubelet.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=DEADLINE_S)
    assert info.name == DRIVER_NAME and info.vendor_version and info.manifest["csi-spec"] == CSI_SPEC_VERSION
    # No controller service: nothing to create or attach.
    assert list(kubelet.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(),
                                                       timeout=DEADLINE_S).capabilities) == []
    probe = kubelet.identity.Probe(pb.ProbeRequest(), timeout=DEADLINE_S)
    assert probe.HasField("ready") and probe.ready.value is True
    assert kubelet.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=DEADLINE_S).node_id == "node-a"
    assert list(kubelet.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(),
                                                 timeout=DEADLINE_S).capabilities) == []
    assert code_of(lambda: kubelet.node.NodeStageVolume(pb.NodeStageVolumeRequest(), timeout=DEADLINE_S)) \
        == grpc.StatusCode.UNIMPLEMENTED


def test_a_client_reaches_the_sidecar_through_the_mount(
        kubelet: Kubelet, host: Host, sidecar_factory: Callable[..., SidecarProcess]) -> None:
    pool_dir = host.pool_dir(NS, "cache")
    sp = sidecar_factory({"api": {"socket_path": str(pool_dir / "kvpool.sock")}})
    other = host.pool_dir(NS, "other")
    (other / "marker").write_text("another pool")

    pod = Pod(NS)
    target = kubelet.publish(pod, "cache")
    assert mount_count(str(target)) == 1
    assert sorted(p.name for p in target.iterdir()) == ["kvpool.sock"]  # this pool's, no other's
    with pytest.raises(OSError) as refused:
        (target / "planted").write_text("x")
    assert refused.value.errno == errno.EROFS  # read-only: the pod cannot replace the socket
    assert os.statvfs(target).f_flag & os.ST_RDONLY

    keys = fresh_keys(3)
    datas = [payload(k, 50_000) for k in keys]
    with PoolClient(str(short_link(host, target) / "kvpool.sock"), timeout=DEADLINE_S) as client:
        assert client.put(keys, datas) == [PutStatus.STORED] * 3
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as direct:  # the same sidecar, by its own path
        assert [bytes(g) if g is not None else None for g in direct.get(keys)] == datas

    kubelet.unpublish(target)
    assert not target.exists() and mount_count(str(target)) == 0
    assert target.parent.is_dir()  # the kubelet's volume directory stays (the kubelet removes it)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as direct:  # the pool's directory is untouched
        assert direct.lookup(keys).prefix == 3


def test_publish_and_unpublish_are_idempotent(kubelet: Kubelet, host: Host) -> None:
    (host.pool_dir(NS, "cache") / "kvpool.sock").write_text("")
    pod = Pod(NS)
    target = kubelet.publish(pod, "cache")
    assert kubelet.publish(pod, "cache") == target  # again: success, still one mount
    assert mount_count(str(target)) == 1
    # The same target asked for another pool's directory: refused, the first mount stays.
    host.pool_dir(NS, "other")
    assert code_of(lambda: kubelet.publish(pod, "other")) == grpc.StatusCode.ALREADY_EXISTS
    assert mount_count(str(target)) == 1 and (target / "kvpool.sock").exists()
    kubelet.unpublish(target)
    kubelet.unpublish(target)  # again: nothing to do, success
    kubelet.unpublish(kubelet.target(Pod(NS)))  # never published: success
    assert not target.exists()
    # An empty target directory left by an interrupted publish is mounted over.
    target.mkdir()
    kubelet.publish(pod, "cache")
    assert mount_count(str(target)) == 1 and (target / "kvpool.sock").exists()
    kubelet.unpublish(target)
    assert not target.exists()


def test_unpublish_leaves_a_mount_it_did_not_make(kubelet: Kubelet, host: Host) -> None:
    """Another driver's mount at a CSI target path (a tmpfs holding data) is not taken off,
    nor its directory removed: the call fails with FAILED_PRECONDITION."""
    target = kubelet.target(Pod(NS))
    target.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(target)], check=True)  # (the host fixture unmounts it)
    (target / "data").write_text("another driver's")
    assert code_of(lambda: kubelet.unpublish(target, "csi-other")) == grpc.StatusCode.FAILED_PRECONDITION
    assert mount_count(str(target)) == 1 and (target / "data").read_text() == "another driver's"


def test_a_pool_deleted_while_published_is_still_unpublished(kubelet: Kubelet, host: Host) -> None:
    """The bind of a pool directory removed meanwhile (the pool deleted before its pods) still
    comes off: the pod's volume is never stuck."""
    pool_dir = host.pool_dir(NS, "gone")
    target = kubelet.publish(Pod(NS), "gone")
    pool_dir.rmdir()
    kubelet.unpublish(target)
    assert not target.exists() and mount_count(str(target)) == 0


@pytest.mark.parametrize("pool", [
    "", "../etc", "a/b", "team-a/cache", "Team-A.cache", "team-a.Cache", "a.b.c", ".cache", "team-a.",
    "team-a..cache", "9cache", "cache-", "c" * 41, "n" * 64 + ".cache", "cache\0", "team-a.cache/..",
])
def test_bad_pool_names_are_refused(kubelet: Kubelet, host: Host, pool: str) -> None:
    host.pool_dir(NS, "cache")
    pod = Pod(NS)
    assert code_of(lambda: kubelet.publish(pod, pool)) == grpc.StatusCode.INVALID_ARGUMENT
    assert not kubelet.target(pod).exists()


def test_bad_target_paths_are_refused(kubelet: Kubelet, host: Host, tmp_path: Path) -> None:
    host.pool_dir(NS, "cache")
    pod = Pod(NS)
    good = kubelet.target(pod)
    pods = host.kubelet / "pods"
    outside = tmp_path / "elsewhere"
    for target in [
        str(outside / "mount"),                                                 # not the kubelet's
        "{}/../{}".format(pods, good.relative_to(pods)),                       # not normalized
        "{}/{}/volumes/kubernetes.io~csi/kvpool/../../../../x/mount".format(pods, pod.uid),
        "{}/{}/volumes/kubernetes.io~csi/kvpool/mount".format(pods, Pod(NS).uid),  # another pod's
        "{}/{}/volumes/kubernetes.io~empty-dir/kvpool/mount".format(pods, pod.uid),  # another plugin's
        "{}/{}/volumes/kubernetes.io~csi/kvpool".format(pods, pod.uid),      # wrong shape
        "{}/{}/volumes/kubernetes.io~csi/kvpool/mount/".format(pods, pod.uid),  # trailing slash
    ]:
        assert code_of(lambda: kubelet.publish(pod, "cache", target=target)) == grpc.StatusCode.INVALID_ARGUMENT, \
            target
    relative = kubelet.publish_request(pod, "cache")
    relative.target_path = "pods/{}/volumes/kubernetes.io~csi/kvpool/mount".format(pod.uid)
    assert code_of(lambda: kubelet.node.NodePublishVolume(relative, timeout=DEADLINE_S)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert not good.exists()
    # A symlink on the way: the volume directory points elsewhere.
    outside.mkdir(exist_ok=True)
    good.parent.rmdir()  # made by the kubelet (publish_request); now a symlink instead
    good.parent.symlink_to(outside)
    assert code_of(lambda: kubelet.publish(pod, "cache")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: kubelet.unpublish(good)) == grpc.StatusCode.INVALID_ARGUMENT
    assert list(outside.iterdir()) == [] and mount_count(str(outside / "mount")) == 0
    # Unpublish checks its target too: nothing outside the kubelet's pods is unmounted.
    assert code_of(lambda: kubelet.unpublish(outside / "mount")) == grpc.StatusCode.INVALID_ARGUMENT


def test_pools_of_another_namespace_are_refused(kubelet: Kubelet, host: Host) -> None:
    host.pool_dir("team-b", "cache")
    pod = Pod(NS)
    assert code_of(lambda: kubelet.publish(pod, "team-b.cache")) == grpc.StatusCode.PERMISSION_DENIED
    assert not kubelet.target(pod).exists()
    # Its own namespace, spelled out, is the same as the bare name.
    host.pool_dir(NS, "cache")
    assert mount_count(str(kubelet.publish(pod, "team-a.cache"))) == 1


def test_a_missing_or_odd_pool_directory_is_refused(kubelet: Kubelet, host: Host, tmp_path: Path) -> None:
    pod = Pod(NS)
    assert code_of(lambda: kubelet.publish(pod, "cache")) == grpc.StatusCode.NOT_FOUND  # no sidecar here yet
    assert not kubelet.target(pod).exists()
    (host.run / "{}.{}".format(NS, "linked")).symlink_to(tmp_path)  # never followed
    assert code_of(lambda: kubelet.publish(pod, "linked")) == grpc.StatusCode.FAILED_PRECONDITION
    (host.run / "{}.{}".format(NS, "file")).write_text("")
    assert code_of(lambda: kubelet.publish(pod, "file")) == grpc.StatusCode.FAILED_PRECONDITION
    assert not kubelet.target(pod).exists()
    # Once the sidecar's directory appears, the kubelet's retry succeeds.
    host.pool_dir(NS, "cache")
    assert mount_count(str(kubelet.publish(pod, "cache"))) == 1


def test_requests_the_driver_does_not_serve_are_refused(kubelet: Kubelet, host: Host) -> None:
    host.pool_dir(NS, "cache")
    pod = Pod(NS)
    base = dict(kubelet.publish_request(pod, "cache").volume_context)
    invalid = [
        lambda: kubelet.publish(pod, "cache", read_only=False),          # a writable socket directory
        lambda: kubelet.publish(pod, "cache", block=True),               # a block volume
        lambda: kubelet.publish(pod, None),                              # no pool
        lambda: kubelet.publish(pod, "cache", context={**base, "Pool": "cache"}),  # a typo
        lambda: kubelet.publish(pod, "cache", context={**base, "csi.storage.k8s.io/ephemeral": "false"}),
        lambda: kubelet.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            target_path=str(kubelet.target(pod)), volume_context=base, readonly=True), timeout=DEADLINE_S),
        lambda: kubelet.unpublish(kubelet.target(pod), volume_id=""),
    ]
    for call in invalid:
        assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
    # Without the kubelet's pod information (a CSIDriver without podInfoOnMount).
    no_pod = {k: v for k, v in base.items() if not k.startswith("csi.storage.k8s.io/pod.")}
    assert code_of(lambda: kubelet.publish(pod, "cache", context=no_pod)) == grpc.StatusCode.FAILED_PRECONDITION
    assert not kubelet.target(pod).exists()
