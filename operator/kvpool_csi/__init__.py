"""kvpool's CSI node plugin: serving pods get their pool's socket without a hostPath.

A pod names a pool in an inline ephemeral CSI volume (driver :data:`DRIVER_NAME`,
``volumeAttributes: {pool: NAME}`` or ``{pool: NAMESPACE.NAME}``); on its node, this plugin
bind-mounts the pool's socket directory (``/run/kvpool/<namespace>.<name>``) read-only onto
the volume's target path. The serving pod's namespace then needs no hostPath and passes
Pod Security "restricted"; the plugin itself is privileged (it mounts on the host).

Identity and Node services only (no controller, nothing to attach). Modules: :mod:`.pools`
(pool references, who may mount what), :mod:`.kube` (reading a pool from the API server),
:mod:`.mounts` (bind mounts), :mod:`.node` (the gRPC services), :mod:`.settings`,
``python -m kvpool_csi`` (:mod:`.__main__`). The gRPC stubs in :mod:`.proto` are generated
from the CSI spec's ``csi.proto`` of version :data:`CSI_SPEC_VERSION`.

This package imports neither the sidecar nor the client (``.importlinter``); from the
operator it takes only the naming rules of :mod:`kvpool_operator.spec`, so that it finds
a pool's directory exactly where the operator puts it.
"""

#: The driver's name: the CSIDriver object's, the one pods name in ``csi.driver``.
DRIVER_NAME = "csi.kvpool.io"
#: The CSI spec version whose csi.proto the stubs in kvpool_csi.proto come from.
CSI_SPEC_VERSION = "1.12.0"
