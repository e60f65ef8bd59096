"""The CSI plugin's errors: each carries the gRPC status code the CSI spec asks for.

The services translate them at the boundary (:mod:`kvpool_csi.node`): the kubelet sees the
code and the message, shows the message in the pod's events and retries later.
"""

from __future__ import annotations

import grpc


class CsiError(Exception):
    """Base of every error the plugin raises on purpose; ``code`` is what the caller gets."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class SettingsError(CsiError):
    """The plugin's own settings (arguments, environment) are invalid: it does not start."""


class InvalidArgument(CsiError):
    """A request the plugin never serves as it is: a bad pool reference or target path."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CsiError):
    """The pool, or its socket directory on this node, does not exist (yet)."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(CsiError):
    """The pod's namespace may not mount that pool's socket."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(CsiError):
    """Something on the node or in the cluster must change first (RBAC, a pool's spec)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(CsiError):
    """The target path already holds a different mount."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(CsiError):
    """A temporary failure (the API server did not answer in time): retrying may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class Internal(CsiError):
    """Something that should not happen did: a bug, or a node in a state the plugin does not know."""


class MountError(CsiError):
    """A mount(2) or umount2(2) call failed (``errno`` holds its error number)."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno
