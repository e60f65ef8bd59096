"""The operator's error hierarchy.

Library errors (Kubernetes API, Redis) are translated at the boundary into these, so
that the handlers decide on one question only: is it worth retrying?

- :class:`TemporaryOperatorError` and its subclasses: retry with backoff
  (the handlers raise ``kopf.TemporaryError``).
- :class:`InvalidSpecError`: the pool asks for something that cannot work and that the
  CRD schema cannot reject; retrying does not help until the spec changes, so it is
  reported as a condition instead.
"""

from __future__ import annotations


class OperatorError(Exception):
    """Base of every error the operator raises on purpose."""


class SettingsError(OperatorError):
    """The operator's own settings (``KVPOOL_OPERATOR_*`` variables) are invalid."""


class InvalidSpecError(OperatorError):
    """A pool spec that cannot work; ``field`` names the spec field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__("{}: {}".format(field, message))
        self.field = field
        self.message = message


class TemporaryOperatorError(OperatorError):
    """Something that may work on a later attempt (API unavailable, conflicts)."""


class KubernetesApiError(OperatorError):
    """The Kubernetes API refused a request; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class TemporaryApiError(KubernetesApiError, TemporaryOperatorError):
    """The API server was unreachable, overloaded (429/5xx) or reported a conflict."""


class IndexUnavailableError(OperatorError):
    """The pool's Redis index could not be reached or refused us (not retried: a status)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
