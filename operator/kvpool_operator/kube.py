"""A small, typed adapter over the Kubernetes API: server-side apply, create, get, delete.

The only module that imports the ``kubernetes`` client. Its errors become
:class:`KubernetesApiError` (permanent: the request itself is wrong) or
:class:`TemporaryApiError` (no answer, 409, 429, 5xx: worth retrying).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvpool_operator.errors import KubernetesApiError, TemporaryApiError

#: (apiVersion, kind) -> plural, for the kinds the operator manages.
PLURALS: Mapping[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("apps/v1", "DaemonSet"): "daemonsets",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
}
_TEMPORARY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


#: A namespace or an object's name as they go into a path: a DNS-1123 subdomain (a label
#: is one), at most 253 characters.
_SEGMENT = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """``/api/v1/namespaces/ns/configmaps/name`` and the like."""
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise KubernetesApiError("kind {} {} is not managed by this operator".format(api_version, kind), 0) from None
    for part in (namespace, name):
        if part is not None and not _SEGMENT.fullmatch(part):
            # (a name from a spec such as "../../team-b/secrets/x" had reached another
            # namespace's objects: every name is checked, whoever gave it)
            raise KubernetesApiError("{!r} is not a name the API allows".format(part[:64]), 422, "Invalid")
    base = "/api/{}".format(api_version) if "/" not in api_version else "/apis/{}".format(api_version)
    path = "{}/namespaces/{}/{}".format(base, namespace, plural)
    return path if name is None else "{}/{}".format(path, name)


class Kube:
    """Synchronous API calls (the handlers run in kopf's thread pool)."""

    def __init__(self, api: Any, *, field_manager: str, timeout_s: float) -> None:
        self._api = api
        self.field_manager = field_manager
        self.timeout_s = timeout_s

    @classmethod
    def from_environment(cls, *, field_manager: str, timeout_s: float) -> Kube:
        """In-cluster credentials inside a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
        try:
            if "KUBERNETES_SERVICE_HOST" in os.environ and "KUBECONFIG" not in os.environ:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                api = client.ApiClient(configuration)
            else:
                api = config.new_client_from_config(  # type: ignore[no-untyped-call]
                    config_file=os.environ.get("KUBECONFIG") or None)
        except config.ConfigException as e:
            raise KubernetesApiError("no Kubernetes credentials: {}".format(e), 0) from e
        return cls(api, field_manager=field_manager, timeout_s=timeout_s)

    def close(self) -> None:
        self._api.close()

    # -- requests ---------------------------------------------------------------------

    def _request(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                 content_type: str = "application/json") -> dict[str, Any] | None:
        """The decoded JSON answer; None for 404; raises KubernetesApiError otherwise."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            req = self._api.param_serialize(method, path, query_params=query or [], header_params=headers,
                                            body=body, auth_settings=["BearerToken"])
            response = self._api.call_api(*req, _request_timeout=self.timeout_s)
            response.read()
        except ApiException as e:
            return self._fail(method, path, int(e.status or 0), e.reason or "", e.body)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise TemporaryApiError("{} {}: no answer from the API server: {}".format(method, path, e), 0) from e
        if response.status == 404:
            return None
        if not 200 <= response.status < 300:
            return self._fail(method, path, response.status, response.reason or "", response.data)
        try:
            data = json.loads(response.data or b"{}")
        except ValueError as e:
            raise TemporaryApiError("{} {}: undecodable answer".format(method, path), response.status) from e
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _fail(method: str, path: str, status: int, reason: str, body: Any) -> None:
        if status == 404:
            return None
        message = reason
        try:
            decoded = json.loads(body) if body else {}
            if isinstance(decoded, dict) and decoded.get("message"):
                message = str(decoded["message"])
                reason = str(decoded.get("reason") or reason)
        except (ValueError, TypeError):
            pass
        error = TemporaryApiError if status in _TEMPORARY_STATUSES or status == 0 else KubernetesApiError
        raise error("{} {}: {} {}".format(method, path, status, message), status, reason)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._request("GET", resource_path(api_version, kind, namespace, name))

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply (force: the operator owns its children's fields).

        ``dry_run``: the API server validates and admits the object (defaulting, immutable
        fields, admission webhooks) and answers what it would store, but stores nothing.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", self.field_manager), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        result = self._request("PATCH", path, body=dict(obj), content_type="application/apply-patch+yaml",
                               query=query)
        if result is None:  # the namespace went away under us
            raise TemporaryApiError("PATCH {}: not found".format(path), 404)
        return result

    def create(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create ``obj``; never overwrites: an object of that name already there is a
        TemporaryApiError (409 AlreadyExists)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        query = [("fieldManager", self.field_manager)]
        if dry_run:
            query.append(("dryRun", "All"))
        result = self._request("POST", path, body=dict(obj), query=query)
        if result is None:  # the namespace went away under us
            raise TemporaryApiError("POST {}: not found".format(path), 404)
        return result

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None,
               foreground: bool = False) -> bool:
        """Delete if present; with ``uid``, only that very object.

        Dependents (e.g. a DaemonSet's pods) go in the background, or with ``foreground``
        first: the object then stays, with a deletionTimestamp, until they are gone.
        """
        body: dict[str, Any] = {"propagationPolicy": "Foreground" if foreground else "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        return self._request("DELETE", resource_path(api_version, kind, namespace, name), body=body) is not None
