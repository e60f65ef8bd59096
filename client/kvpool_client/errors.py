"""The client library's error hierarchy.

Every error the library raises derives from :class:`KVPoolError`, so a caller can catch
one type. Errors that come back from the sidecar carry the sidecar's error code.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base of every error raised by kvpool's client library."""


class KeyFormatError(KVPoolError, ValueError):
    """A block key or model fingerprint is malformed (wrong version, length or text)."""


class ProtocolError(KVPoolError):
    """A frame on the local wire could not be encoded or decoded."""


class ConnectionLostError(KVPoolError, ConnectionError):
    """The connection to the sidecar closed or timed out."""


class DeadlineError(KVPoolError, TimeoutError):
    """The deadline of a task of several calls (:meth:`PoolClient.within`) had passed when
    one more call was to be sent: nothing was sent, and the connection is as it was."""


class RemoteError(KVPoolError):
    """The sidecar answered a request with an error.

    ``code`` is one of :class:`kvpool_client.protocol.ErrorCode`'s names.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ChecksumMismatchError(KVPoolError):
    """A block's bytes do not match the checksum recorded when it was written."""


class IpcDescriptorError(KVPoolError, ValueError):
    """A CUDA IPC descriptor of a GPU-tier block is malformed (a missing, mistyped or
    out-of-range field); nothing was opened."""


class CudaIpcError(KVPoolError):
    """A well-formed CUDA IPC descriptor could not be opened or copied here (no CUDA, no
    such device, or the driver refused the handle)."""
