"""The node plugin's settings, from arguments and the environment (the only module that
reads either).

==========================  ========================  =====================================
argument                    environment               default
==========================  ========================  =====================================
``--endpoint``              ``CSI_ENDPOINT``          ``unix:///csi/csi.sock``
``--node-id``               ``KVPOOL_NODE_NAME``      required (the chart: ``spec.nodeName``)
``--socket-root``                                     ``/run/kvpool`` (the pools' directories)
``--kubelet-dir``                                     ``/var/lib/kubelet``
``--pool-lookup``                                     ``api`` (read pools) or ``none``
``--api-server``                                      in-cluster (``KUBERNETES_SERVICE_*``)
``--api-token-file``                                  the pod's ServiceAccount token
``--api-ca-file``                                     the pod's ServiceAccount CA
``--api-timeout``                                     ``5`` seconds
==========================  ========================  =====================================
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool_csi.errors import SettingsError
from kvpool_csi.kube import SERVICE_ACCOUNT_DIR, ApiAccess
from kvpool_operator.spec import SOCKET_ROOT

DEFAULT_ENDPOINT = "unix:///csi/csi.sock"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"


@dataclass(frozen=True)
class CsiSettings:
    """Everything the plugin is told."""

    #: The Unix socket the kubelet (through node-driver-registrar) calls the plugin on.
    endpoint: str
    #: This node's name (NodeGetInfo): the Kubernetes node the plugin runs on.
    node_id: str
    #: Where the pools' socket directories are (the host's /run/kvpool, mounted at this path).
    socket_root: Path
    #: The kubelet's root directory; targets must lie in its ``pods/`` directory.
    kubelet_dir: Path
    #: How to read pools (``--pool-lookup api``); None: pods mount their own namespace's pools only.
    api: ApiAccess | None
    verbose: bool = False

    @property
    def socket_path(self) -> str:
        """The endpoint as a filesystem path."""
        return self.endpoint[len("unix://"):] if self.endpoint.startswith("unix://") else self.endpoint


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvpool_csi",
                                description="kvpool's CSI node plugin: mounts a pool's socket directory into pods.")
    p.add_argument("--endpoint", help="unix:///PATH or PATH of the plugin's socket (default: $CSI_ENDPOINT or {})"
                   .format(DEFAULT_ENDPOINT))
    p.add_argument("--node-id", help="this node's name (default: $KVPOOL_NODE_NAME)")
    p.add_argument("--socket-root", default=SOCKET_ROOT, help="the pools' socket directories' parent")
    p.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR, help="the kubelet's root directory")
    p.add_argument("--pool-lookup", choices=("api", "none"), default="api",
                   help="api: read each pool (its spec.api.allowedNamespaces); none: own namespace only")
    p.add_argument("--api-server", help="API server URL (default: in-cluster)")
    p.add_argument("--api-token-file", default=str(SERVICE_ACCOUNT_DIR / "token"))
    p.add_argument("--api-ca-file", default=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
    p.add_argument("--api-timeout", type=float, default=5.0, help="seconds one pool read may take")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


def from_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> CsiSettings:
    """Parse ``argv``; raises :class:`SettingsError` for values that cannot work."""
    args = parser().parse_args(argv)
    endpoint = args.endpoint or environ.get("CSI_ENDPOINT") or DEFAULT_ENDPOINT
    path = endpoint[len("unix://"):] if endpoint.startswith("unix://") else endpoint
    if not path.startswith("/") or "://" in path:
        raise SettingsError("--endpoint {!r}: a Unix socket, unix:///ABSOLUTE/PATH".format(endpoint))
    node_id = args.node_id or environ.get("KVPOOL_NODE_NAME") or ""
    if not node_id:
        raise SettingsError("no node id: give --node-id or set KVPOOL_NODE_NAME (the chart sets it to spec.nodeName)")
    for flag, value in (("--socket-root", args.socket_root), ("--kubelet-dir", args.kubelet_dir)):
        if not os.path.isabs(value) or os.path.normpath(value) != value:
            raise SettingsError("{} {!r}: an absolute, normalized path".format(flag, value))
    if not args.api_timeout > 0:
        raise SettingsError("--api-timeout must be positive")
    api: ApiAccess | None = None
    if args.pool_lookup == "api":
        server = args.api_server or ApiAccess.in_cluster(environ).server
        api = ApiAccess(server, Path(args.api_token_file), Path(args.api_ca_file), args.api_timeout)
    return CsiSettings(endpoint=endpoint, node_id=node_id, socket_root=Path(args.socket_root),
                       kubelet_dir=Path(args.kubelet_dir), api=api, verbose=args.verbose)
