"""Helpers for the operator's tests: an in-memory Kubernetes API, pool bodies, a CRD schema walk."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterator
from typing import Any

from kvpool_operator.errors import KubernetesApiError, TemporaryApiError
from kvpool_operator.kube import resource_path
from kvpool_operator.preflight import POOLS_ANNOTATION

#: The kinds whose metadata.generation the fake keeps (the API server keeps it for more).
GENERATION_KINDS = ("DaemonSet", "StatefulSet")


class FakeKube:
    """Enough of :class:`kvpool_operator.kube.Kube` for the reconcile: objects by path.

    ``reject_kind``: applies of that kind are refused (422), dry runs too unless
    ``reject_only_for_real``. ``calls`` records every write: ("apply"|"create"|"dry-run"|"delete", kind,
    name); ``reads`` every GET: (kind, name). Like the API server, a create of an existing object
    and an apply whose ``metadata.resourceVersion`` is not the stored one are refused (409);
    ``before_write`` runs before each write (another reconcile racing this one). Like it too,
    an object gets a new uid when it is created; every change bumps its resourceVersion, and a
    change to anything but its metadata and status bumps a DaemonSet's or StatefulSet's
    ``metadata.generation`` (:meth:`edit` changes an object as another client would).
    """

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.applies = 0
        self.fail_with: Exception | None = None
        self.reject_kind: str | None = None
        self.reject_only_for_real = False
        self.calls: list[tuple[str, str, str]] = []
        self.reads: list[tuple[str, str]] = []
        self.before_write: Callable[[str, str], None] | None = None
        self._version = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append((kind, name))
        obj = self.objects.get(resource_path(api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        return self._write("apply", obj, dry_run)

    def create(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        return self._write("create", obj, dry_run)

    def _write(self, verb: str, obj: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        meta = obj["metadata"]
        self.calls.append(("dry-run" if dry_run else verb, obj["kind"], meta["name"]))
        if self.before_write is not None:
            self.before_write(obj["kind"], meta["name"])
        if self.fail_with is not None:
            raise self.fail_with
        if obj["kind"] == self.reject_kind and not (dry_run and self.reject_only_for_real):
            raise KubernetesApiError("PATCH: 422 spec.template.spec.affinity: Invalid value", 422, "Invalid")
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        current = self.objects.get(path)
        if verb == "create" and current is not None:
            raise TemporaryApiError("POST: 409 secrets {!r} already exists".format(meta["name"]), 409, "AlreadyExists")
        wanted = meta.get("resourceVersion")
        if wanted is not None and (current is None or current["metadata"].get("resourceVersion") != wanted):
            raise TemporaryApiError("PATCH: 409 the object has been modified", 409, "Conflict")
        stored = copy.deepcopy(obj)
        if current is None:
            self._version += 1
            stored["metadata"]["uid"] = "uid-{}-{}".format(meta["name"], self._version)
        else:
            stored["metadata"]["uid"] = current["metadata"]["uid"]
        stored["metadata"].pop("resourceVersion", None)
        if obj["kind"] == "DaemonSet":
            stored["status"] = {"desiredNumberScheduled": 3, "numberReady": 2}
        if obj["kind"] in GENERATION_KINDS:
            stored["metadata"]["generation"] = (current or {}).get("metadata", {}).get("generation", 0)
        if current is None or not self._same(current, stored):
            self._stamp(stored, current)
        else:  # like the API server: a write that changes nothing keeps it
            stored["metadata"]["resourceVersion"] = current["metadata"].get("resourceVersion")
        if dry_run:
            return stored
        self.applies += 1
        self.objects[path] = stored
        return copy.deepcopy(stored)

    @staticmethod
    def _same(current: dict[str, Any], new: dict[str, Any]) -> bool:
        def bare(obj: dict[str, Any]) -> dict[str, Any]:
            return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}

        return bare(current) == bare(new)

    def _stamp(self, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        """A new resourceVersion; a new generation too where the API server would bump it."""
        self._version += 1
        new["metadata"]["resourceVersion"] = str(self._version)
        if new["kind"] in GENERATION_KINDS:
            def spec(obj: dict[str, Any] | None) -> Any:
                return None if obj is None else {k: v for k, v in obj.items() if k not in ("metadata", "status")}

            generation = int((old or {}).get("metadata", {}).get("generation") or 0)
            new["metadata"]["generation"] = generation + 1 if spec(old) != spec(new) else generation

    def edit(self, api_version: str, kind: str, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Another client changes a stored object of namespace ``ns`` (``change`` edits it in place)."""
        path = resource_path(api_version, kind, "ns", name)
        old = self.objects[path]
        new = copy.deepcopy(old)
        change(new)
        if not self._same(old, new):
            self._stamp(new, old)
        self.objects[path] = new

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None,
               foreground: bool = False) -> bool:
        self.calls.append(("delete-foreground" if foreground else "delete", kind, name))
        return self.objects.pop(resource_path(api_version, kind, namespace, name), None) is not None

    def add_secret(self, name: str, annotations: dict[str, str] | None = None, *, pools: str | None = None,
                   owners: list[dict[str, Any]] | None = None, **data: str) -> None:
        """A Secret of namespace ``ns``; ``pools``: the pools it lets use it (``kvpool.io/pools``);
        ``owners``: its ownerReferences."""
        annotations = dict(annotations or {})
        if pools is not None:
            annotations[POOLS_ANNOTATION] = pools
        meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": "u-" + name, "annotations": annotations}
        if owners:
            meta["ownerReferences"] = owners
        self.objects[resource_path("v1", "Secret", "ns", name)] = {
            "apiVersion": "v1", "kind": "Secret", "metadata": meta,
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}

    def writes(self) -> list[tuple[str, str, str]]:
        """The calls that changed something (dry runs excluded)."""
        return [c for c in self.calls if c[0] != "dry-run"]


def walk_schema(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node of an OpenAPI schema with its dotted path (``[]``: list items, ``{}``: map values)."""
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from walk_schema(child, "{}.{}".format(path, key))
    if isinstance(node.get("items"), dict):
        yield from walk_schema(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk_schema(node["additionalProperties"], path + "{}")


def pool_body(spec: dict[str, Any] | None = None, generation: int = 1, *, name: str = "p", uid: str = "pool-uid",
              labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid, "generation": generation}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool", "metadata": meta, "spec": spec or {}}
