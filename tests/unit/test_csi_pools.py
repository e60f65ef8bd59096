"""The CSI plugin's pool references and grants, without gRPC or mounts (the real plugin is
tested in tests/integration/test_csi_node.py and, reading pools from the API server, in
tests/e2e/test_csi_pools.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("grpc", reason="the csi extra (grpcio) is not installed")
from kvpool_csi.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, SettingsError  # noqa: E402
from kvpool_csi.pools import PoolGrants, PoolRef, SameNamespace, parse_pool_ref  # noqa: E402
from kvpool_csi.settings import from_args  # noqa: E402
from kvpool_operator.spec import default_socket_dir  # noqa: E402


def test_pool_references() -> None:
    assert parse_pool_ref("cache", "team-a") == PoolRef("team-a", "cache")
    assert parse_pool_ref("infra.cache", "team-a") == PoolRef("infra", "cache")
    assert parse_pool_ref("0ns.c-1", "team-a") == PoolRef("0ns", "c-1")  # namespaces may start with a digit
    for bad in ("", ".", "..", "../x", "a/b", "a.b.c", "A", "a_b", "1cache", "x." + "c" * 41, "n" * 64 + ".c",
                "cache ", "ns.", ".cache", "cache\n", "infra\n.cache", "infra.cache\n"):
        with pytest.raises(InvalidArgument):
            parse_pool_ref(bad, "team-a")
    with pytest.raises(InvalidArgument):
        parse_pool_ref("cache", "../team-a")  # the pod's namespace is checked too
    with pytest.raises(InvalidArgument):
        parse_pool_ref("cache", "team-a\n")  # ("$" matches before a final newline: names match whole)


def test_the_directory_is_the_operators_even_when_cut() -> None:
    short = PoolRef("team-a", "cache")
    assert short.socket_dir_name == "team-a.cache"
    long = PoolRef("n" * 63, "p" * 40)
    assert "/run/kvpool/" + long.socket_dir_name == default_socket_dir("n" * 63, "p" * 40)
    assert len(long.socket_dir_name) < len("n" * 63 + "." + "p" * 40)
    # a pool of the same namespace named after the cut form gets a directory of its own
    cut = long.socket_dir_name.split(".", 1)[1]
    twin = cut.replace("_", "-")
    assert default_socket_dir("n" * 63, twin) != default_socket_dir("n" * 63, "p" * 40)


def test_same_namespace_only() -> None:
    SameNamespace().check(PoolRef("team-a", "cache"), "team-a")
    with pytest.raises(PermissionDenied):
        SameNamespace().check(PoolRef("infra", "cache"), "team-a")


def test_grants_come_from_the_pool() -> None:
    pools: dict[tuple[str, str], dict[str, Any]] = {
        ("infra", "shared"): {"spec": {"api": {"allowedNamespaces": ["team-a"]}}},
        ("infra", "closed"): {"spec": {"api": {"httpPort": 9466}}},
        ("infra", "moved"): {"spec": {"api": {"socketDir": "/run/kvpool/infra.shared",
                                              "allowedNamespaces": ["team-a"]}}},
        ("infra", "same"): {"spec": {"api": {"socketDir": "/run/kvpool/infra.same/"}}},
    }
    grants = PoolGrants(lambda ns, name: pools.get((ns, name)))
    grants.check(PoolRef("infra", "shared"), "team-a")
    grants.check(PoolRef("infra", "closed"), "infra")  # its own namespace needs no listing
    grants.check(PoolRef("infra", "same"), "infra")    # socketDir spelling the default is the default
    for ref, ns, error in [(PoolRef("infra", "shared"), "team-b", PermissionDenied),
                           (PoolRef("infra", "closed"), "team-a", PermissionDenied),
                           (PoolRef("infra", "absent"), "team-a", PermissionDenied),  # same answer as unlisted
                           (PoolRef("infra", "absent"), "infra", NotFound),
                           (PoolRef("infra", "moved"), "team-a", FailedPrecondition)]:
        with pytest.raises(error):
            grants.check(ref, ns)


def test_settings() -> None:
    s = from_args(["--node-id", "n1", "--pool-lookup", "none"], {})
    assert s.socket_path == "/csi/csi.sock" and s.api is None and str(s.socket_root) == "/run/kvpool"
    s = from_args(["--pool-lookup", "api"], {"KVPOOL_NODE_NAME": "n2", "CSI_ENDPOINT": "unix:///p/c.sock",
                                             "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert s.node_id == "n2" and s.socket_path == "/p/c.sock"
    assert s.api is not None and s.api.server == "https://[fd00::1]:443"
    for argv, env in [([], {}),                                             # no node id
                      (["--node-id", "n", "--endpoint", "tcp://x:1"], {}),
                      (["--node-id", "n", "--kubelet-dir", "/var/lib/kubelet/"], {}),
                      (["--node-id", "n"], {})]:                             # api lookup outside a pod
        with pytest.raises(SettingsError):
            from_args(argv, env)
