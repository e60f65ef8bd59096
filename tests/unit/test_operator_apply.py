"""The reconcile never half-applies: every refusal before the first write, Events for each; it
writes no child that provably has not changed since it applied it."""

from __future__ import annotations

import copy
import datetime
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kopf
import pytest

from kvpool_operator import handlers
from kvpool_operator import index as redis_index
from kvpool_operator.applied import AppliedChildren
from kvpool_operator.errors import SettingsError
from kvpool_operator.index import IndexSnapshot
from kvpool_operator.kube import resource_path
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import ImageSettings, OperatorSettings
from kvpool_operator.status import invalid_spec_event
from tests.unit.operator_support import FakeKube, pool_body

SETTINGS = OperatorSettings()
EXTERNAL = {"redis": {"external": {"url": "redis://r:1/0"}}}


@pytest.fixture(autouse=True)
def empty_index(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextmanager
    def connect(url: str, password: str | None, **_: Any) -> Iterator[object]:
        yield object()

    monkeypatch.setattr(redis_index, "connect", connect)
    monkeypatch.setattr(redis_index, "read_snapshot", lambda client, pool_id, url="": IndexSnapshot())


def ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def applied_pool(spec: dict[str, Any]) -> FakeKube:
    """A pool whose children a valid spec has created."""
    kube = FakeKube()
    status = reconcile(pool_body(spec), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert ready(status)["reason"] != "InvalidSpec"
    kube.calls.clear()
    return kube


def test_the_status_says_where_serving_pods_find_the_socket() -> None:
    """status.socketPath: the pool's own socket (kubectl get kvp -o jsonpath='{.status.socketPath}')."""
    status = reconcile(pool_body(EXTERNAL), kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
    assert status["socketPath"] == "/run/kvpool/ns.p/kvpool.sock"
    custom = reconcile(pool_body({**EXTERNAL, "api": {"socketDir": "/var/run/kv"}}), kube=FakeKube(),
                       settings=SETTINGS)  # type: ignore[arg-type]
    assert custom["socketPath"] == "/var/run/kv/kvpool.sock"


def _foreign_configmap(kube: FakeKube) -> None:
    kube.objects[resource_path("v1", "ConfigMap", "ns", "p-config")] = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-config", "namespace": "ns"}, "data": {}}


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("memory-below-dram", {**EXTERNAL, "tiers": {"dram": {"size": "4Gi"}}, "resources": {"limits": {"memory": "1Gi"}}},
     "spec.resources.limits.memory"),
    ("missing-auth-secret", {**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}, "spec.auth.secretRef"),
    ("missing-tenant-token", {**EXTERNAL, "tenants": [{"name": "a", "tokenSecret": {"name": "gone"}}]},
     "spec.tenants[0].tokenSecret"),
    ("missing-redis-password", {"redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "gone"}}}},
     "spec.redis.external.passwordSecretRef"),
    ("size-too-large", {**EXTERNAL, "tiers": {"dram": {"size": "1000000Ei"}}}, "spec.tiers.dram.size"),
]


@pytest.mark.parametrize("spec,field", [(s, f) for _, s, f in INVALID], ids=[i for i, _, _ in INVALID])
def test_an_invalid_spec_changes_no_child(spec: dict[str, Any], field: str) -> None:
    kube = applied_pool(EXTERNAL)
    before = copy.deepcopy(kube.objects)
    status = reconcile(pool_body(spec, generation=2), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert (ready(status)["reason"], ready(status)["status"]) == ("InvalidSpec", "False")
    assert field in ready(status)["message"]
    assert kube.writes() == [] and kube.objects == before  # not even the DaemonSet


def test_a_foreign_object_under_a_childs_name_stops_every_write() -> None:
    kube = FakeKube()
    _foreign_configmap(kube)
    status = reconcile(pool_body(EXTERNAL), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert "ConfigMap 'p-config' already exists and does not belong to this pool" in ready(status)["message"]
    assert kube.writes() == []
    assert list(kube.objects) == [resource_path("v1", "ConfigMap", "ns", "p-config")]


def test_a_child_refused_in_the_dry_run_changes_nothing() -> None:
    kube = applied_pool({})
    before = copy.deepcopy(kube.objects)
    kube.reject_kind = "StatefulSet"  # e.g. 422: a field of the StatefulSet that cannot change
    status = reconcile(pool_body({"logLevel": "DEBUG"}, generation=2), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    assert ready(status)["reason"] == "InvalidSpec"
    assert "StatefulSet 'p-redis' was rejected by the API server" in ready(status)["message"]
    assert "no child was changed" in ready(status)["message"]
    assert kube.writes() == [] and kube.objects == before


def test_a_child_refused_for_real_stops_before_the_rest() -> None:
    kube = applied_pool({})
    daemonset = copy.deepcopy(kube.objects[resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")])
    kube.reject_kind, kube.reject_only_for_real = "StatefulSet", True  # passed the dry run, then refused
    status = reconcile(pool_body({"logLevel": "DEBUG"}, generation=2), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    message = ready(status)["message"]
    assert ready(status)["reason"] == "InvalidSpec" and ready(status)["status"] == "False"
    assert "StatefulSet 'p-redis' was rejected" in message
    assert "not applied after it: NetworkPolicy 'p-sidecar', Service 'p-sidecar', DaemonSet 'p-sidecar'" in message
    applied = [(kind, name) for verb, kind, name in kube.writes() if verb == "apply"]
    assert applied[-1] == ("StatefulSet", "p-redis")  # the refused one was the last attempted
    assert ("DaemonSet", "p-sidecar") not in applied
    assert kube.objects[resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")] == daemonset  # old spec kept
    assert not [c for c in kube.writes() if c[0] == "delete"]  # no stale-child clean-up either


def test_children_are_applied_after_what_they_depend_on() -> None:
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    dry = [(k, n) for verb, k, n in kube.calls if verb == "dry-run"]
    real = [(k, n) for verb, k, n in kube.calls if verb in ("apply", "create")]
    assert dry == real and len(real) == 9
    assert kube.calls.index(("apply", "ConfigMap", "p-config")) > kube.calls.index(("dry-run", "DaemonSet",
                                                                                    "p-sidecar"))  # all checked first
    order = [k + "/" + n for k, n in real]
    assert order[0] == "ConfigMap/p-config" and order[-1] == "DaemonSet/p-sidecar"
    assert order.index("Secret/p-redis") < order.index("StatefulSet/p-redis")
    assert order.index("NetworkPolicy/p-redis") < order.index("StatefulSet/p-redis")
    assert order.index("NetworkPolicy/p-sidecar") < order.index("DaemonSet/p-sidecar")
    assert order.index("Secret/p-auth") < order.index("DaemonSet/p-sidecar")


# -- Events ---------------------------------------------------------------------------------


def _status(reason: str, message: str, generation: int = 1) -> dict[str, Any]:
    return {"conditions": [{"type": "Ready", "status": "False", "reason": reason, "message": message,
                            "observedGeneration": generation}]}


def test_invalid_spec_event_once_per_distinct_refusal() -> None:
    new = _status("InvalidSpec", "spec.auth.secretRef: Secret 'x' not found")
    message = invalid_spec_event(None, new)
    assert message is not None and "spec.auth.secretRef: Secret 'x' not found" in message
    assert "not applied" in message
    assert invalid_spec_event(new, new) is None  # the timer's re-run: told already
    assert invalid_spec_event(new, _status("InvalidSpec", "other")) is not None
    assert invalid_spec_event(new, _status("InvalidSpec", new["conditions"][0]["message"], 2)) is not None
    assert invalid_spec_event(None, _status("NoLiveSidecars", "none yet")) is None


def test_the_handler_posts_a_warning_event_for_an_invalid_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, **kw: posted.append(kw))
    monkeypatch.setattr(handlers, "Kube", FakeKube)
    memo = kopf.Memo()
    memo[handlers._KUBE] = FakeKube()  # noqa: SLF001
    body = kopf.Body(pool_body({**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}))
    patch = kopf.Patch()
    handlers._run(body, patch, memo, 0)  # noqa: SLF001
    assert [p["reason"] for p in posted] == ["InvalidSpec"]
    assert "spec.auth.secretRef: Secret 'gone' not found" in posted[0]["message"]
    # The same refusal again, with the status written: no second Event.
    again = kopf.Body({**pool_body({**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}),
                       "status": dict(patch["status"])})
    handlers._run(again, kopf.Patch(), memo, 0)  # noqa: SLF001
    assert len(posted) == 1


# -- children that have not changed are not written --------------------------------------------


class Clock:
    """The records' clock: it moves when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


RESYNC_S = 600.0
#: Every child of a pool with a managed Redis (the default), in apply order.
CHILDREN = [("ConfigMap", "p-config"), ("Secret", "p-auth"), ("Secret", "p-redis"), ("NetworkPolicy", "p-redis"),
            ("Service", "p-redis"), ("StatefulSet", "p-redis"), ("NetworkPolicy", "p-sidecar"),
            ("Service", "p-sidecar"), ("DaemonSet", "p-sidecar")]
#: Those written by server-side apply (the generated Secrets are not: see _write).
APPLIED_CHILDREN = [c for c in CHILDREN if c[0] != "Secret"]


def remembering_pool(spec: dict[str, Any] | None = None) -> tuple[FakeKube, AppliedChildren, Clock]:
    """A pool whose children a valid spec has created, with the records of that apply."""
    kube, clock = FakeKube(), Clock()
    applied = AppliedChildren(RESYNC_S, clock=clock)
    status = reconcile(pool_body(spec), kube=kube, settings=SETTINGS, applied=applied)  # type: ignore[arg-type]
    assert ready(status)["reason"] != "InvalidSpec"
    assert kube.writes() == [
        ("apply", k, n) if k != "Secret" else ("create", k, n) for k, n in CHILDREN]
    kube.calls.clear()
    kube.reads.clear()
    return kube, applied, clock


def again(kube: FakeKube, applied: AppliedChildren, spec: dict[str, Any] | None = None,
          generation: int = 1) -> dict[str, Any]:
    return reconcile(pool_body(spec, generation), kube=kube, settings=SETTINGS,  # type: ignore[arg-type]
                     applied=applied)


def dry_run_then_apply(*children: tuple[str, str]) -> list[tuple[str, str, str]]:
    """The calls of a reconcile that writes ``children`` (and nothing else)."""
    return [("dry-run", k, n) for k, n in children] + [("apply", k, n) for k, n in children]


def test_a_reconcile_in_which_nothing_changed_writes_nothing() -> None:
    kube, applied, clock = remembering_pool()
    before = copy.deepcopy(kube.objects)
    clock.now += RESYNC_S - 1
    status = again(kube, applied)
    assert kube.calls == []  # no dry run, no apply, no create
    assert kube.objects == before
    assert sorted(kube.reads) == sorted(CHILDREN)  # one read of each child, nothing else
    assert status["nodes"]["desired"] == 3 and status["nodes"]["podsReady"] == 2  # the DaemonSet as read
    assert len(applied) == len(APPLIED_CHILDREN)


def test_the_status_a_controller_writes_moves_no_generation_and_writes_nothing() -> None:
    kube, applied, _ = remembering_pool()

    def rolled(ds: dict[str, Any]) -> None:
        ds["status"] = {"desiredNumberScheduled": 5, "numberReady": 5}

    kube.edit("apps/v1", "DaemonSet", "p-sidecar", rolled)
    kube.edit("apps/v1", "StatefulSet", "p-redis", lambda s: s.update(status={"readyReplicas": 1}))
    status = again(kube, applied)
    assert kube.calls == []
    assert status["nodes"]["desired"] == 5  # from the DaemonSet read in this reconcile


def _drop_label(obj: dict[str, Any]) -> None:
    del obj["metadata"]["labels"]["app.kubernetes.io/managed-by"]


def _retag(obj: dict[str, Any]) -> None:
    obj["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"


def _add_label(obj: dict[str, Any]) -> None:  # as an older operator's apply, under its field manager
    obj["metadata"]["labels"]["kvpool.io/legacy"] = "1"
    obj["metadata"].setdefault("annotations", {})["kvpool.io/legacy"] = "1"


def _loosen_owner(obj: dict[str, Any]) -> None:  # still the pool's (else: a foreign object), not as applied
    obj["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = False


def _scale(obj: dict[str, Any]) -> None:
    obj["spec"]["replicas"] = 3


def _edit_data(obj: dict[str, Any]) -> None:
    obj["data"] = {"sidecar.yaml": "log_level: TRACE\n"}


def _new_node_selector(obj: dict[str, Any]) -> None:
    obj["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "other"}


def _recreate(obj: dict[str, Any]) -> None:  # deleted and created again by someone, as it was
    obj["metadata"]["uid"] = "someone-elses"


def _deleting(obj: dict[str, Any]) -> None:
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"


EDITS: list[tuple[str, str, str, str, Any]] = [
    ("configmap-data", "v1", "ConfigMap", "p-config", _edit_data),
    ("configmap-label-removed", "v1", "ConfigMap", "p-config", _drop_label),
    ("daemonset-spec", "apps/v1", "DaemonSet", "p-sidecar", _new_node_selector),
    ("daemonset-label-removed", "apps/v1", "DaemonSet", "p-sidecar", _drop_label),  # no new generation
    ("daemonset-label-changed", "apps/v1", "DaemonSet", "p-sidecar", _retag),
    ("daemonset-owner-changed", "apps/v1", "DaemonSet", "p-sidecar", _loosen_owner),
    ("daemonset-label-added", "apps/v1", "DaemonSet", "p-sidecar", _add_label),  # no new generation either
    ("statefulset-label-added", "apps/v1", "StatefulSet", "p-redis", _add_label),
    ("daemonset-being-deleted", "apps/v1", "DaemonSet", "p-sidecar", _deleting),
    ("statefulset-scaled", "apps/v1", "StatefulSet", "p-redis", _scale),
    ("statefulset-recreated", "apps/v1", "StatefulSet", "p-redis", _recreate),
    ("service-label-removed", "v1", "Service", "p-sidecar", _drop_label),
    ("networkpolicy-owner-changed", "networking.k8s.io/v1", "NetworkPolicy", "p-redis", _loosen_owner),
]


@pytest.mark.parametrize("api_version,kind,name,edit", [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_a_child_edited_by_anyone_is_applied_again_after_its_dry_run(api_version: str, kind: str, name: str,
                                                                     edit: Any) -> None:
    kube, applied, _ = remembering_pool()
    wanted = copy.deepcopy(kube.objects[resource_path(api_version, kind, "ns", name)])
    kube.edit(api_version, kind, name, edit)
    again(kube, applied)
    assert kube.calls == dry_run_then_apply((kind, name))  # that child only, dry run first
    restored = kube.objects[resource_path(api_version, kind, "ns", name)]
    assert {k: v for k, v in restored.items() if k != "metadata"} == {
        k: v for k, v in wanted.items() if k != "metadata"}
    assert restored["metadata"]["labels"] == wanted["metadata"]["labels"]
    assert restored["metadata"]["ownerReferences"] == wanted["metadata"]["ownerReferences"]
    kube.calls.clear()
    again(kube, applied)  # and then it is left alone again
    assert kube.calls == []


def test_a_deleted_child_is_applied_again() -> None:
    kube, applied, _ = remembering_pool()
    del kube.objects[resource_path("v1", "Service", "ns", "p-sidecar")]
    again(kube, applied)
    assert kube.calls == dry_run_then_apply(("Service", "p-sidecar"))
    assert resource_path("v1", "Service", "ns", "p-sidecar") in kube.objects


def test_an_edited_generated_secret_is_written_again_under_its_precondition() -> None:
    kube, applied, _ = remembering_pool()
    kube.edit("v1", "Secret", "p-auth", _drop_label)
    again(kube, applied)
    assert kube.calls == dry_run_then_apply(("Secret", "p-auth"))


def test_a_spec_change_applies_what_it_changes_after_their_dry_runs() -> None:
    kube, applied, _ = remembering_pool()
    again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    # The sidecar's config, and the DaemonSet whose pods carry its hash; nothing else changes.
    assert kube.calls == dry_run_then_apply(("ConfigMap", "p-config"), ("DaemonSet", "p-sidecar"))
    kube.calls.clear()
    again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    assert kube.calls == []


def test_a_changed_setting_applies_what_it_changes() -> None:
    kube, applied, _ = remembering_pool()
    settings = OperatorSettings(images=ImageSettings(redis="redis:7.4.3"))
    reconcile(pool_body(), kube=kube, settings=settings, applied=applied)  # type: ignore[arg-type]
    assert kube.calls == dry_run_then_apply(("StatefulSet", "p-redis"))


def test_every_child_is_applied_again_once_the_resync_period_has_passed() -> None:
    kube, applied, clock = remembering_pool()
    clock.now += RESYNC_S
    again(kube, applied)
    assert kube.calls == dry_run_then_apply(*APPLIED_CHILDREN)
    kube.calls.clear()
    clock.now += RESYNC_S - 1  # counted from that apply
    again(kube, applied)
    assert kube.calls == []


def test_a_resync_period_of_zero_applies_every_child_every_time() -> None:
    kube = FakeKube()
    applied = AppliedChildren(0)
    for _ in range(2):
        kube.calls.clear()
        reconcile(pool_body(EXTERNAL), kube=kube, settings=SETTINGS, applied=applied)  # type: ignore[arg-type]
        assert [c for c in kube.calls if c[0] == "apply"] == [
            ("apply", k, n) for k, n in [("ConfigMap", "p-config"), ("NetworkPolicy", "p-sidecar"),
                                         ("Service", "p-sidecar"), ("DaemonSet", "p-sidecar")]]
    assert len(applied) == 0
    assert OperatorSettings.from_env({"KVPOOL_OPERATOR_RESYNC": "0"}).reconcile.resync_s == 0
    assert OperatorSettings.from_env({}).reconcile.resync_s == 600
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SettingsError, match="KVPOOL_OPERATOR_RESYNC"):
            OperatorSettings.from_env({"KVPOOL_OPERATOR_RESYNC": bad})


def test_a_refused_dry_run_still_writes_nothing_and_is_tried_again() -> None:
    kube, applied, _ = remembering_pool()
    before = copy.deepcopy(kube.objects)
    kube.reject_kind = "DaemonSet"
    status = again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    assert "DaemonSet 'p-sidecar' was rejected by the API server" in ready(status)["message"]
    assert kube.writes() == [] and kube.objects == before  # not even the ConfigMap, which passed
    kube.reject_kind = None
    kube.calls.clear()
    again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    assert kube.calls == dry_run_then_apply(("ConfigMap", "p-config"), ("DaemonSet", "p-sidecar"))


def test_a_child_refused_for_real_is_the_one_applied_next_time() -> None:
    kube, applied, _ = remembering_pool()
    kube.reject_kind, kube.reject_only_for_real = "DaemonSet", True
    status = again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    assert "not applied after it: none" in ready(status)["message"]
    assert kube.writes() == [("apply", "ConfigMap", "p-config"), ("apply", "DaemonSet", "p-sidecar")]
    kube.reject_kind = None
    kube.calls.clear()
    again(kube, applied, {"logLevel": "DEBUG"}, generation=2)
    assert kube.calls == dry_run_then_apply(("DaemonSet", "p-sidecar"))  # the ConfigMap was applied


def test_the_records_are_bounded() -> None:
    kube, applied, clock = remembering_pool()
    # Children the pool no longer wants are forgotten with them.
    again(kube, applied, EXTERNAL, generation=2)
    assert len(applied) == 4  # the ConfigMap, and the sidecars' NetworkPolicy, Service and DaemonSet
    # A pool never reconciled again is forgotten once its records could skip nothing.
    other = FakeKube()
    clock.now += RESYNC_S
    reconcile(pool_body(EXTERNAL, name="q", uid="q-uid"), kube=other, settings=SETTINGS,  # type: ignore[arg-type]
              applied=applied)
    assert len(applied) == 4  # only q's
    applied.forget("q-uid")
    assert len(applied) == 0


def test_the_handlers_write_nothing_unchanged_and_forget_a_deleted_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    records = AppliedChildren(RESYNC_S)
    monkeypatch.setattr(handlers, "APPLIED", records)
    monkeypatch.setattr(handlers, "Kube", FakeKube)
    monkeypatch.setattr(redis_index, "purge", lambda client, pool_id, url="": 0)
    kube = FakeKube()
    memo = kopf.Memo()
    memo[handlers._KUBE] = kube  # noqa: SLF001
    body = pool_body(EXTERNAL)
    handlers._run(kopf.Body(body), kopf.Patch(), memo, 0)  # noqa: SLF001
    assert len(records) == 4
    kube.calls.clear()
    handlers.on_timer(body=kopf.Body(body), patch=kopf.Patch(), memo=memo)
    assert kube.calls == []
    deleting = {**body, "metadata": {**body["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    handlers.on_delete(body=kopf.Body(deleting), memo=memo, retry=0, runtime=datetime.timedelta(seconds=0),
                       logger=logging.getLogger("test"))
    assert len(records) == 0
