"""NodePublishVolume and NodeUnpublishVolume: checks, then a read-only bind of the pool's
socket directory onto the pod's volume directory, and its removal.

Requests come from the kubelet over the plugin's socket, which only root on the node can
reach; every field is still checked as if it came from anyone, because its values come from
a pod spec (the ``pool`` attribute, the volume's name in the target path):

- the volume context holds ``pool`` and the kubelet's pod information
  (``csi.storage.k8s.io/*``; the CSIDriver's ``podInfoOnMount: true``), nothing else;
  only inline ephemeral volumes are served, and only read-only;
- the target is ``<kubelet-dir>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume>/mount``,
  for the pod named in the context, with no symlink on the way;
- the pod's namespace must be allowed to mount the pool (:mod:`kvpool_csi.pools`);
- the pool's directory must exist on this node and be a directory, not a symlink.

Both calls are idempotent, as the CSI spec asks: publishing what is already published, or
unpublishing what is not, succeeds. One lock orders them (they take milliseconds).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool_csi import mounts
from kvpool_csi.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, MountError, NotFound
from kvpool_csi.pools import Access, PoolRef, parse_pool_ref

logger = logging.getLogger("kvpool_csi")

#: The volume attribute naming the pool (``NAME`` or ``NAMESPACE.NAME``).
POOL_ATTRIBUTE = "pool"
#: What the kubelet adds with ``podInfoOnMount: true`` (and for inline ephemeral volumes).
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
KNOWN_ATTRIBUTES = frozenset({POOL_ATTRIBUTE, POD_NAMESPACE, POD_NAME, POD_UID, SERVICE_ACCOUNT, EPHEMERAL})
#: Where the kubelet puts a pod's CSI volume: <kubelet-dir>/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount.
TARGET_SHAPE = ("<pod uid>", "volumes", "kubernetes.io~csi", "<volume>", "mount")
#: Mounts stacked on one target that unpublish takes off before it gives up.
MAX_STACKED = 16


@dataclass(frozen=True)
class Publish:
    """What NodePublishVolume asks for (the fields of the CSI request this plugin reads)."""

    volume_id: str
    target_path: str
    read_only: bool
    #: The capability's access type: "mount", "block", or "" when the request has none.
    access_type: str
    volume_context: Mapping[str, str]


class NodePlugin:
    """The node's side of the driver: which directory goes where, and the mounts."""

    def __init__(self, *, node_id: str, socket_root: Path, kubelet_dir: Path, access: Access) -> None:
        self.node_id = node_id
        self.socket_root = socket_root
        self.kubelet_dir = kubelet_dir
        self.access = access
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ checks

    def check_target(self, target: str, pod_uid: str | None) -> str:
        """``target`` when it is a CSI volume directory of the kubelet (of pod ``pod_uid``)."""
        if not target or "\0" in target:
            raise InvalidArgument("no target path")
        if not os.path.isabs(target) or os.path.normpath(target) != target:
            raise InvalidArgument("target path {!r} is not an absolute, normalized path".format(target))
        pods = os.path.join(self.kubelet_dir, "pods") + "/"
        parts = target[len(pods):].split("/") if target.startswith(pods) else []
        if (len(parts) != len(TARGET_SHAPE) or parts[1:3] != list(TARGET_SHAPE[1:3])
                or parts[4] != TARGET_SHAPE[4] or not parts[0] or not parts[3]):
            raise InvalidArgument("target path {!r} is not {}{}".format(target, pods, "/".join(TARGET_SHAPE)))
        if pod_uid is not None and parts[0] != pod_uid:
            raise InvalidArgument("target path {!r} is not in the directory of pod {}".format(target, pod_uid))
        parent = os.path.dirname(target)
        expected = os.path.join(os.path.realpath(self.kubelet_dir), "pods", *parts[:4])
        if os.path.lexists(parent) and os.path.realpath(parent) != expected:
            raise InvalidArgument("target path {!r} goes through a symlink".format(target))
        return target

    def pool_dir(self, pool: PoolRef) -> str:
        return os.path.join(self.socket_root, pool.socket_dir_name)

    # ------------------------------------------------------------------ publish

    def publish(self, req: Publish) -> None:
        if not req.volume_id:
            raise InvalidArgument("no volume id")
        if not req.access_type:
            raise InvalidArgument("no volume capability")
        if req.access_type != "mount":
            raise InvalidArgument("a kvpool volume is a directory: use it as a filesystem volume, not a block device")
        ctx = req.volume_context
        unknown = sorted(set(ctx) - KNOWN_ATTRIBUTES)
        if unknown:
            raise InvalidArgument("unknown volume attribute(s) {}: a kvpool volume takes only {!r}".format(
                ", ".join(unknown), POOL_ATTRIBUTE))
        if ctx.get(EPHEMERAL) != "true":
            raise InvalidArgument("only inline ephemeral volumes are served (a pod's csi: volume), not "
                                  "PersistentVolumes")
        pod_namespace = ctx.get(POD_NAMESPACE)
        pod_uid = ctx.get(POD_UID)
        if not pod_namespace or not pod_uid:
            raise FailedPrecondition("the kubelet sent no pod information: the CSIDriver object needs "
                                     "podInfoOnMount: true")
        if not req.read_only:
            raise InvalidArgument("mount the kvpool volume with readOnly: true: a writable mount of the socket "
                                  "directory would let the pod replace the pool's socket")
        if POOL_ATTRIBUTE not in ctx:
            raise InvalidArgument("no pool: set volumeAttributes: {pool: NAME} (or NAMESPACE.NAME)")
        pool = parse_pool_ref(ctx[POOL_ATTRIBUTE], pod_namespace)
        target = self.check_target(req.target_path, pod_uid)
        self.access.check(pool, pod_namespace)
        source = self.pool_dir(pool)
        with self._lock:
            fd = self._open_pool_dir(pool, source)
            try:
                if self._already_published(fd, target):
                    logger.info("pool %s already mounted at %s", pool, target)
                    return
                self._bind(fd, target)
            finally:
                os.close(fd)
        logger.info("mounted pool %s (%s) read-only for pod %s/%s at %s", pool, source, pod_namespace,
                    ctx.get(POD_NAME, "?"), target)

    def _open_pool_dir(self, pool: PoolRef, source: str) -> int:
        """An O_PATH descriptor of the pool's directory (never through a symlink)."""
        try:
            return os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise NotFound("pool {}'s socket directory {} does not exist on node {}: the pool runs no sidecar "
                           "here (yet), or the plugin's --socket-root is not the host's {}".format(
                               pool, source, self.node_id, self.socket_root)) from e
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                raise FailedPrecondition("pool {}'s socket path {} is not a directory (a symlink?)".format(
                    pool, source)) from e
            raise Internal("cannot open {}: {}".format(source, e)) from e

    def _already_published(self, fd: int, target: str) -> bool:
        """True when ``target`` already shows this directory read-only; raises when it holds
        anything else."""
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise AlreadyExists("target path {} exists and is not a directory".format(target))
        if not mounts.mount_count(target):
            return False
        src = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (src.st_dev, src.st_ino) and os.statvfs(target).f_flag & os.ST_RDONLY:
            return True
        raise AlreadyExists("target path {} already holds another mount".format(target))

    def _shows_a_pool_dir(self, target: str) -> bool:
        """Whether the mount on top of ``target`` may be this plugin's: read-only, of the
        socket root's filesystem. (Not the pool directory's inode: a pool deleted while a pod
        used it leaves a bind of a removed directory, which must still come off.)"""
        try:
            return (os.stat(target).st_dev == os.stat(self.socket_root).st_dev
                    and bool(os.statvfs(target).f_flag & os.ST_RDONLY))
        except OSError:
            return False

    def _bind(self, fd: int, target: str) -> None:
        created = False
        try:
            os.mkdir(target, 0o755)
            created = True
        except FileExistsError:
            pass  # an empty directory left by an earlier call: mount over it
        except FileNotFoundError as e:
            raise InvalidArgument("the target's parent {} does not exist".format(os.path.dirname(target))) from e
        try:
            mounts.bind_dir(fd, target, read_only=True)
        except MountError as e:
            if created:
                os.rmdir(target)
            raise Internal(str(e)) from e

    # ------------------------------------------------------------------ unpublish

    def unpublish(self, volume_id: str, target_path: str) -> None:
        if not volume_id:
            raise InvalidArgument("no volume id")
        target = self.check_target(target_path, None)
        with self._lock:
            for _ in range(MAX_STACKED):
                if not mounts.mount_count(target):
                    break
                if not self._shows_a_pool_dir(target):
                    raise FailedPrecondition("target path {} holds a mount this plugin did not make: left in place"
                                             .format(target))
                try:
                    mounts.unmount(target)
                except MountError as e:
                    raise Internal(str(e)) from e
            else:
                raise Internal("{} still has mounts after {} unmounts".format(target, MAX_STACKED))
            try:
                st = os.lstat(target)
            except FileNotFoundError:
                logger.info("volume %s: %s is not published (nothing to do)", volume_id, target)
                return
            if not stat.S_ISDIR(st.st_mode):
                raise FailedPrecondition("target path {} is not a directory: left in place".format(target))
            try:
                os.rmdir(target)
            except OSError as e:
                raise Internal("cannot remove {}: {}".format(target, e)) from e
        logger.info("volume %s: unmounted and removed %s", volume_id, target)
