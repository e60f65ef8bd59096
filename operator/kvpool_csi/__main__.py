"""``python -m kvpool_csi``: run the CSI node plugin until SIGTERM or SIGINT.

Settings: :mod:`kvpool_csi.settings`. The chart runs it in a privileged container of a
DaemonSet beside node-driver-registrar, with the host's /var/lib/kubelet (bidirectional
mount propagation) and /run/kvpool mounted at the same paths.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kvpool_csi import DRIVER_NAME
from kvpool_csi.errors import SettingsError
from kvpool_csi.node import NodePlugin
from kvpool_csi.pools import Access, PoolGrants, SameNamespace
from kvpool_csi.service import serve
from kvpool_csi.settings import from_args

logger = logging.getLogger("kvpool_csi")
#: Seconds that requests in flight get to finish at shutdown.
STOP_GRACE_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = from_args(argv)
    except SettingsError as e:
        print("kvpool-csi: {}".format(e), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if settings.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    access: Access = PoolGrants(settings.api.read_pool) if settings.api is not None else SameNamespace()
    plugin = NodePlugin(node_id=settings.node_id, socket_root=settings.socket_root,
                        kubelet_dir=settings.kubelet_dir, access=access)
    try:
        server = serve(plugin, settings.socket_path)
    except SettingsError as e:
        print("kvpool-csi: {}".format(e), file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logger.info("%s serving node %s on %s (pools under %s, kubelet %s, pool lookup: %s)", DRIVER_NAME,
                settings.node_id, settings.socket_path, settings.socket_root, settings.kubelet_dir,
                "api " + settings.api.server if settings.api is not None else "none (own namespace only)")
    stop.wait()
    logger.info("stopping")
    server.stop(STOP_GRACE_S).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
