"""Which pool a volume names, whether the pod may mount it, and where its socket lives.

A volume's ``pool`` attribute is ``NAME`` (a pool of the pod's own namespace) or
``NAMESPACE.NAME``. Both parts must follow the names the API server gives pools (a
namespace is a DNS label; a pool name is a DNS label of at most 40 characters that starts
with a letter, as the CRD requires), so a reference can never spell a path: no ``/``, no
``..``, nothing but ``[a-z0-9-]`` around one dot. The directory is the operator's
``default_socket_dir`` of that pool, taken relative to the plugin's socket root.

Who may mount what (an :class:`Access`):

- :class:`SameNamespace` (``--pool-lookup none``): a pod mounts pools of its own namespace
  only, and the plugin reads nothing from the API server.
- :class:`PoolGrants` (``--pool-lookup api``, the chart's default): the plugin reads the
  pool; a pod mounts it when the pool is in the pod's namespace or lists the pod's
  namespace in ``spec.api.allowedNamespaces``. A pool with its own ``spec.api.socketDir``
  is not served (its directory could be anything, another pool's included).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool_csi.errors import FailedPrecondition, Internal, InvalidArgument, NotFound, PermissionDenied
from kvpool_operator.spec import SOCKET_ROOT, default_socket_dir

#: A namespace: an RFC 1123 label.
NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
NAMESPACE_MAX = 63
#: A pool's name, as the CRD's rule on metadata.name has it.
POOL_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
POOL_NAME_MAX = 40


@dataclass(frozen=True)
class PoolRef:
    """One pool: its namespace and name, both checked."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return "{}/{}".format(self.namespace, self.name)

    @property
    def socket_dir_name(self) -> str:
        """The pool's directory under the socket root (``<namespace>.<name>``, cut when long)."""
        full = default_socket_dir(self.namespace, self.name)
        prefix = SOCKET_ROOT + "/"
        name = full[len(prefix):] if full.startswith(prefix) else ""
        if not name or "/" in name or name in (".", ".."):  # the naming rules make this impossible
            raise Internal("pool {} has no directory of its own under {}: {!r}".format(self, SOCKET_ROOT, full))
        return name


def check_namespace(namespace: str, what: str) -> str:
    if len(namespace) > NAMESPACE_MAX or not NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgument("{} {!r} is not a namespace name (a DNS label)".format(what, namespace))
    return namespace


def parse_pool_ref(value: str, pod_namespace: str) -> PoolRef:
    """``NAME`` (in ``pod_namespace``) or ``NAMESPACE.NAME``; anything else is refused."""
    check_namespace(pod_namespace, "the pod's namespace")
    namespace, dot, name = value.rpartition(".")
    if not dot:
        namespace = pod_namespace
    elif "." in namespace:
        raise InvalidArgument("pool {!r}: write NAME or NAMESPACE.NAME".format(value))
    else:
        check_namespace(namespace, "pool {!r}: namespace".format(value))
    if len(name) > POOL_NAME_MAX or not POOL_NAME_RE.fullmatch(name):
        raise InvalidArgument("pool {!r}: {!r} is not a pool name (a DNS label of at most {} characters that "
                              "starts with a letter)".format(value, name, POOL_NAME_MAX))
    return PoolRef(namespace, name)


class Access(Protocol):
    """Decides whether a pod of ``pod_namespace`` may mount ``pool``'s socket directory."""

    def check(self, pool: PoolRef, pod_namespace: str) -> None:
        """Return when allowed; raise a :class:`~kvpool_csi.errors.CsiError` saying why not."""


class SameNamespace:
    """Pods mount pools of their own namespace only; nothing is read from the API server."""

    def check(self, pool: PoolRef, pod_namespace: str) -> None:
        if pool.namespace != pod_namespace:
            raise PermissionDenied(
                "a pod of namespace {} may not mount pool {}: this node plugin serves pods the pools of their "
                "own namespace only (it runs with --pool-lookup none, so it cannot read a pool's "
                "spec.api.allowedNamespaces)".format(pod_namespace, pool))


#: Reads one pool (the KVCachePool object as JSON) or returns None when there is none.
PoolReader = Callable[[str, str], "Mapping[str, Any] | None"]


class PoolGrants:
    """Reads the pool: it must exist, keep the default socket directory, and allow the pod's
    namespace (its own, or one listed in ``spec.api.allowedNamespaces``)."""

    def __init__(self, read_pool: PoolReader) -> None:
        self._read = read_pool

    def check(self, pool: PoolRef, pod_namespace: str) -> None:
        obj = self._read(pool.namespace, pool.name)
        own = pool.namespace == pod_namespace
        spec = obj.get("spec") if obj is not None else None
        api = spec.get("api") if isinstance(spec, Mapping) else None
        api = api if isinstance(api, Mapping) else {}
        allowed = api.get("allowedNamespaces") or []
        if not own and (obj is None or not isinstance(allowed, list) or pod_namespace not in allowed):
            # The same answer whether the pool is missing or does not allow the namespace: a pod's
            # events do not tell other namespaces' pool names.
            raise PermissionDenied(
                "a pod of namespace {ns} may not mount pool {pool}: there is no such pool, or it does not "
                "list {ns} in spec.api.allowedNamespaces".format(ns=pod_namespace, pool=pool))
        if obj is None:
            raise NotFound("there is no KVCachePool {}".format(pool))
        socket_dir = api.get("socketDir")
        default = default_socket_dir(pool.namespace, pool.name)
        if socket_dir and str(socket_dir).rstrip("/") != default:
            raise FailedPrecondition(
                "pool {} keeps its socket in spec.api.socketDir {!r}; this driver serves only pools with the "
                "default directory {} (remove socketDir, or mount the directory with a hostPath)".format(
                    pool, socket_dir, default))
