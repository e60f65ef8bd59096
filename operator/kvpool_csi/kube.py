"""Reading one KVCachePool from the API server: one authenticated GET with a deadline.

The plugin needs a single read (``get`` on ``kvcachepools``, granted by the chart's
ClusterRole), so it speaks HTTPS itself rather than load a Kubernetes client library into
a privileged process on every node. The ServiceAccount token is read for every request
(the kubelet rotates projected tokens).
"""

from __future__ import annotations

import ipaddress
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool_csi.errors import FailedPrecondition, SettingsError, Unavailable

#: Where a pod finds its ServiceAccount's token and the cluster's CA.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The largest answer read (a KVCachePool is a few KiB).
MAX_ANSWER_BYTES = 1 << 20
GROUP, VERSION, PLURAL = "kvpool.io", "v1alpha1", "kvcachepools"


@dataclass(frozen=True)
class ApiAccess:
    """How to reach the API server: its URL, a bearer token file and the CA that signed it."""

    server: str
    token_file: Path
    ca_file: Path
    timeout_s: float = 5.0

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ, timeout_s: float = 5.0) -> ApiAccess:
        """The API server as a pod sees it (``KUBERNETES_SERVICE_HOST``/``_PORT``, its ServiceAccount)."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise SettingsError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set: not in a pod? "
                                "Give --api-server, --api-token-file and --api-ca-file, or --pool-lookup none")
        try:
            ipaddress.IPv6Address(host)
            host = "[{}]".format(host)
        except ValueError:
            pass
        return cls("https://{}:{}".format(host, port), SERVICE_ACCOUNT_DIR / "token",
                   SERVICE_ACCOUNT_DIR / "ca.crt", timeout_s)

    def read_pool(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pool as JSON, or None when it does not exist.

        Raises :class:`Unavailable` when the API server does not answer in time or fails, and
        :class:`FailedPrecondition` when it refuses the plugin (no token, RBAC).
        """
        url = "{}/apis/{}/{}/namespaces/{}/{}/{}".format(
            self.server.rstrip("/"), GROUP, VERSION, urllib.parse.quote(namespace, safe=""), PLURAL,
            urllib.parse.quote(name, safe=""))
        try:
            token = self.token_file.read_text().strip()
            context = ssl.create_default_context(cafile=str(self.ca_file))
        except (OSError, ssl.SSLError) as e:
            raise FailedPrecondition("cannot read the plugin's API credentials: {}".format(e)) from e
        request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token,
                                                       "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as answer:
                body = answer.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            if e.code in (401, 403):
                raise FailedPrecondition("the API server refused to show the CSI node plugin pool {}/{} (HTTP {}): "
                                         "it needs get on kvcachepools.kvpool.io (the chart's ClusterRole)".format(
                                             namespace, name, e.code)) from e
            raise Unavailable("the API server answered HTTP {} for pool {}/{}".format(e.code, namespace, name)) from e
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out (socket.timeout is an OSError)
            raise Unavailable("cannot reach the API server at {}: {}".format(self.server, e)) from e
        if len(body) > MAX_ANSWER_BYTES:
            raise Unavailable("the API server's answer for pool {}/{} is larger than {} bytes".format(
                namespace, name, MAX_ANSWER_BYTES))
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise Unavailable("the API server's answer for pool {}/{} is not JSON".format(namespace, name)) from e
        if not isinstance(obj, dict):
            raise Unavailable("the API server's answer for pool {}/{} is not an object".format(namespace, name))
        return obj
