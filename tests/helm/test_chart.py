"""The chart without a cluster: lint, render, Kubernetes schemas, security and RBAC rules.

Rendered manifests are validated with kubernetes-validate (strict: unknown fields fail)
for the oldest Kubernetes the chart supports and for the harness's version; KVCachePools
rendered from values are validated against the CRD's own openAPIV3Schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpool_operator.manifests import OPERATOR_POD_LABELS
from kvpool_operator.settings import OperatorSettings, PoolPolicySettings
from tests.helm.conftest import CHART, REPO, Helm, Manifest, by_kind, one

pytestmark = pytest.mark.helm

#: The oldest Kubernetes in Chart.yaml's kubeVersion, the harness's, the newest schemas.
K8S_VERSIONS = ("1.28.0", "1.33.0", "1.37.0")
ROOT_CRD = REPO / "crds" / "kvcachepools.kvpool.io.yaml"
CHART_CRD = CHART / "crds" / "kvcachepools.kvpool.io.yaml"
STANDARD_LABELS = ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")
SELECTOR = {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/instance": "kvpool",
            "app.kubernetes.io/component": "operator"}

#: Values that switch on everything the defaults leave off.
EVERYTHING: Manifest = {
    "watch": {"clusterWide": False, "namespaces": ["team-a", "team-b"]},
    "image": {"repository": "registry.example.com/kvpool/operator", "tag": "0.1.0",
              "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
    "imagePullSecrets": ["regcred"],
    "poolDefaults": {"sidecarImage": {"repository": "registry.example.com/kvpool/kvpool", "tag": "0.1.0"},
                     "redisImage": {"repository": "registry.example.com/redis", "tag": "7.4.2"}},
    "operator": {"timerInterval": 10, "verbose": True, "healthPort": 9090,
                 "extraEnv": [{"name": "TZ", "value": "UTC"}],
                 "poolPolicy": {"priorityClasses": ["kv-*", "system-node-critical"], "runtimeClasses": [],
                                "tolerationKeys": ["nvidia.com/gpu", "example.com/*"],
                                "gpuImages": ["registry.example.com/kvpool-gpu:*"]}},
    "serviceAccount": {"create": True, "name": "kvpool-op", "annotations": {"example.com/role": "kvpool"}},
    "commonLabels": {"team": "ml-infra"},
    "podAnnotations": {"example.com/scrape": "false"},
    "podLabels": {"tier": "control"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "15s"},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "kvpool"}},
    "pools": [
        {"name": "minimal", "namespace": "team-a"},
        {"name": "tiered", "namespace": "team-b", "labels": {"cost-center": "42"},
         "spec": yaml.safe_load((REPO / "examples" / "disk-and-tenants.yaml").read_text())["spec"]},
    ],
    "keepPoolsOnUninstall": False,
}


# ---------------------------------------------------------------------------- helpers


def validate_k8s(doc: Manifest, version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, version, strict=True)


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(ROOT_CRD.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
    return schema


def validate_pool(doc: Manifest) -> None:
    """Against the CRD's structural schema (the x-kubernetes-* extensions are ignored)."""
    jsonschema.Draft7Validator(crd_schema()).validate(doc)


def container(docs: Sequence[Manifest]) -> Manifest:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(c)


def env_of(docs: Sequence[Manifest]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(docs)["env"]}


def rules(docs: Sequence[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            for r in d["rules"]:
                yield d, r


def grants(docs: Sequence[Manifest], group: str, resource: str, verb: str) -> list[Manifest]:
    """The Roles/ClusterRoles that grant ``verb`` on ``group/resource``."""
    return [d for d, r in rules(docs)
            if group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]]


# ---------------------------------------------------------------------------- files


def test_chart_crd_is_the_repo_crd() -> None:
    assert CHART_CRD.read_bytes() == ROOT_CRD.read_bytes(), (
        "charts/kvpool/crds/ differs from crds/: cp {} {}".format(ROOT_CRD, CHART_CRD))
    assert [p.name for p in (CHART / "crds").iterdir()] == [ROOT_CRD.name]


def test_values_match_the_schema_and_every_value_is_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    jsonschema.Draft7Validator(schema).validate(EVERYTHING)

    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented: list[str] = []

    def walk(props: dict[str, Any], value: Any, path: tuple[str, ...], start: int, indent: int) -> None:
        for key, sub in props.items():
            assert "description" in sub, "values.schema.json: {} has no description".format(".".join(path + (key,)))
            if not isinstance(value, dict) or key not in value:
                continue
            pattern = re.compile(r"^{}{}:".format(" " * indent, re.escape(key)))
            at = next((i for i in range(start, len(lines)) if pattern.match(lines[i])), None)
            assert at is not None, "values.yaml: {} not found".format(".".join(path + (key,)))
            before = [ln for ln in lines[:at] if ln.strip()]
            if not before or not before[-1].lstrip().startswith("#"):
                undocumented.append(".".join(path + (key,)))
            if sub.get("additionalProperties") is False and "properties" in sub:  # a group of settings
                walk(sub["properties"], value[key], path + (key,), at + 1, indent + 2)

    walk(schema["properties"], values, (), 0, 0)
    assert not undocumented, "values without a comment above them: {}".format(undocumented)
    # The schema names every top-level value (additionalProperties: false catches typos).
    assert set(values) <= set(schema["properties"])


def test_dashboard_uses_only_the_sidecars_series() -> None:
    """Every series and label value the dashboard queries is one the sidecar's exporter produces.

    The exporter (kvpool_sidecar.metrics) is fed one of every event, since some families
    (evictions, corrupt blocks) only appear once their counter is non-zero.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpool_client.protocol import PutStatus
    from kvpool_sidecar.metrics import StoreMetrics

    dashboard = json.loads((CHART / "dashboards" / "kvpool.json").read_text())
    assert dashboard["uid"] == "kvpool" and dashboard["panels"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 10

    registry = CollectorRegistry()
    metrics = StoreMetrics(registry)
    metrics.lookup(hits=3, misses=1)
    metrics.get(hit=True, size=10)
    metrics.get(hit=False)
    for status in PutStatus:
        metrics.put(status, 10)
    metrics.demoted(10)
    metrics.promoted(10)
    for tier in ("gpu", "dram", "disk"):
        metrics.evicted(tier)
        metrics.corrupt(tier)
    metrics.observe("lookup", 1e-4)
    metrics.track_tiers(lambda: {"dram": (100, 10, 1), "disk": (1000, 10, 1)})
    metrics.track_io(lambda: {"disk": {"write": 1.0, "sync": 0.5, "read": 0.25, "read_cached": 0.125, "delete": 0.1}})
    series: dict[str, set[tuple[str, str]]] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in fam.samples:
            series.setdefault(sample.name, set()).update(sample.labels.items())

    used = set()
    for expr in exprs:
        for name, selector in re.findall(r"\b(kvpool_[a-z_]+)(\{[^}]*\})?", expr):
            used.add(name)
            assert name in series, "{!r} in {!r} is not exported by the sidecar ({})".format(
                name, expr, sorted(series))
            for label, value in re.findall(r'(\w+)=~?"([^"$]*)"', selector or ""):
                for alt in value.split("|"):
                    assert (label, alt) in series[name], "{}{{{}={!r}}} is never exported".format(name, label, alt)
    # The dashboard shows every family the issue lists.
    assert used >= {"kvpool_blocks_total", "kvpool_bytes_total", "kvpool_evictions_total",
                    "kvpool_corrupt_blocks_total", "kvpool_tier_bytes", "kvpool_tier_blocks",
                    "kvpool_request_seconds_bucket", "kvpool_disk_io_seconds_total"}


# ---------------------------------------------------------------------------- lint and render


def test_helm_lint(helm: Helm, tmp_path: Path) -> None:
    helm.run("lint", "--strict", str(CHART))
    everything = tmp_path / "everything.yaml"
    everything.write_text(yaml.safe_dump(EVERYTHING))
    helm.run("lint", "--strict", str(CHART), "--values", str(everything))
    helm.run("lint", "--strict", str(CHART), "--set", "watch.clusterWide=true,rbac.scanCluster=false")


@pytest.mark.parametrize("values", [
    pytest.param([], id="defaults"),
    pytest.param([EVERYTHING], id="everything"),
    pytest.param([{"watch": {"clusterWide": True, "namespaces": []}, "pools": [{"name": "a", "namespace": "x"}],
                   "serviceMonitor": {"enabled": True}}], id="cluster-wide"),
    pytest.param([{"rbac": {"create": False, "scanCluster": True},
                   "serviceAccount": {"create": False, "name": "existing"}}], id="bring-your-own-rbac"),
])
def test_rendered_manifests_are_valid(helm: Helm, values: list[Manifest]) -> None:
    docs = helm.template(values=values)
    assert docs
    for doc in docs:
        kind = doc["kind"]
        meta = doc["metadata"]
        assert all(label in meta.get("labels", {}) for label in STANDARD_LABELS), (kind, meta)
        if kind == "KVCachePool":
            validate_pool(doc)
        elif kind == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]["endpoints"][0]["port"] == "http"
        else:
            for version in K8S_VERSIONS:
                validate_k8s(doc, version)
    crd = [d for d in helm.template(values=values, extra=["--include-crds"])
           if d["kind"] == "CustomResourceDefinition"]
    assert crd == [yaml.safe_load(ROOT_CRD.read_text())]
    for version in K8S_VERSIONS:
        validate_k8s(crd[0], version)


def test_default_render(helm: Helm) -> None:
    docs = helm.template()
    assert sorted(d["kind"] for d in docs) == sorted(["ServiceAccount", "Role", "RoleBinding", "Deployment"])
    deploy = one(docs, "Deployment")
    assert deploy["metadata"]["namespace"] == "kvpool-system"
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    # Selector labels minimal, and a subset of the pod's labels.
    assert deploy["spec"]["selector"]["matchLabels"] == SELECTOR
    pod = deploy["spec"]["template"]
    assert SELECTOR.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"] == "kvpool"

    c = container(docs)
    assert c["command"] == ["python", "-m", "kvpool_operator"]
    assert c["image"] == "ghcr.io/kvpool/kvpool-operator:0.1.0"
    env = env_of(docs)
    assert env["KVPOOL_OPERATOR_NAMESPACES"] == "kvpool-system"
    assert env["KVPOOL_OPERATOR_IMAGE"] == "ghcr.io/kvpool/kvpool:0.1.0"
    assert env["KVPOOL_OPERATOR_REDIS_IMAGE"] == "redis:7.4.2"
    assert env["KVPOOL_OPERATOR_LIVENESS"] == "http://0.0.0.0:8080/healthz"
    # What a pool's creator may ask for: the chart's defaults are the operator's.
    assert env["KVPOOL_OPERATOR_PRIORITY_CLASSES"] == "*" and env["KVPOOL_OPERATOR_GPU_IMAGES"] == ""
    assert env["KVPOOL_OPERATOR_TOLERATION_KEYS"] == "nvidia.com/gpu"
    assert env["KVPOOL_OPERATOR_RUNTIME_CLASSES"] == "nvidia"
    assert OperatorSettings.from_env(env).pool_policy == PoolPolicySettings()
    # values kept from a chart without the policy (helm upgrade --reuse-values): the operator's defaults
    env = env_of(helm.template("operator.poolPolicy=null"))
    assert not any(name.startswith(("KVPOOL_OPERATOR_PRIORITY", "KVPOOL_OPERATOR_GPU")) for name in env)
    assert OperatorSettings.from_env(env).pool_policy == PoolPolicySettings()
    # A managed Redis's NetworkPolicy admits the operator by these labels, from this namespace.
    assert env["KVPOOL_OPERATOR_POD_NAMESPACE"] == "kvpool-system"
    assert OPERATOR_POD_LABELS.items() <= pod["metadata"]["labels"].items()
    # Probes hit kopf's health endpoint on the declared port.
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_security_context(helm: Helm) -> None:
    for values in ([], [EVERYTHING]):
        docs = helm.template(values=values)
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        c = container(docs)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}


def test_images_are_pinned(helm: Helm) -> None:
    for values in ([], [EVERYTHING]):
        docs = helm.template(values=values)
        env = env_of(docs)
        for image in (container(docs)["image"], env["KVPOOL_OPERATOR_IMAGE"], env["KVPOOL_OPERATOR_REDIS_IMAGE"]):
            name = image.split("@")[0]
            assert re.search(r":[0-9]+\.[0-9]+\.[0-9]+$", name), "not pinned to a release: {}".format(image)
    assert container(helm.template(values=[EVERYTHING]))["image"] == \
        "registry.example.com/kvpool/operator:0.1.0@sha256:" + "a" * 64
    for bad in ("image.tag=latest", "poolDefaults.sidecarImage.tag=latest", "poolDefaults.redisImage.tag=latest",
                "image.tag="):
        assert "tag" in helm.template_error(bad)


def test_namespaced_rbac_is_least_privilege(helm: Helm) -> None:
    for values in ([], [EVERYTHING]):
        docs = helm.template(values=values)
        watched = env_of(docs)["KVPOOL_OPERATOR_NAMESPACES"].split(",")
        roles = by_kind(docs, "Role")
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
        assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == sorted(watched)
        # Nothing cluster-scoped by default; with scanning asked for, only read-only CRDs and
        # namespaces.
        assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
        (cluster_role,) = by_kind(helm.template("rbac.scanCluster=true", values=values), "ClusterRole")
        assert cluster_role["rules"] == [
            {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
             "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}]
        sa = one(docs, "ServiceAccount")["metadata"]
        for binding in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                                            "namespace": sa["namespace"]}]
        assert_no_dangerous_grants(docs)


def test_cluster_wide_rbac(helm: Helm) -> None:
    docs = helm.template("watch.clusterWide=true")
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    assert env_of(docs)["KVPOOL_OPERATOR_NAMESPACES"] == ""
    assert [d["metadata"]["name"] for d in by_kind(docs, "ClusterRole")] == ["kvpool-system-kvpool"]
    assert grants(docs, "", "secrets", "get")
    assert_no_dangerous_grants(docs)
    docs = helm.template("watch.clusterWide=true", "rbac.scanCluster=true")
    names = sorted(d["metadata"]["name"] for d in by_kind(docs, "ClusterRole"))
    assert names == ["kvpool-system-kvpool", "kvpool-system-kvpool-scan"]
    scan = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"].endswith("-scan")][0]
    assert [r["resources"] for r in scan["rules"]] == [["customresourcedefinitions"]]  # kopf lists no namespaces
    assert_no_dangerous_grants(docs)


def assert_no_dangerous_grants(docs: Sequence[Manifest]) -> None:
    for role, rule in rules(docs):
        where = "{} {}".format(role["kind"], role["metadata"]["name"])
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], where
        assert not rule.get("resourceNames"), where
        for resource in rule["resources"]:
            assert not resource.startswith("pods"), "{} grants {}".format(where, resource)
            assert resource not in ("nodes", "serviceaccounts", "serviceaccounts/token", "roles", "rolebindings",
                                    "clusterroles", "clusterrolebindings", "deployments", "jobs", "cronjobs",
                                    "mutatingwebhookconfigurations", "validatingwebhookconfigurations"), where
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]), where
    for verb in ("list", "watch"):
        assert not grants(docs, "", "secrets", verb), "secrets must never be listed or watched"
    for verb in ("create", "delete", "update"):
        assert not grants(docs, "kvpool.io", "kvcachepools", verb), "the operator does not manage pools' lifecycle"


def test_non_default_render(helm: Helm) -> None:
    docs = helm.template(values=[EVERYTHING], release="ml")
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]
    assert deploy["metadata"]["name"] == "ml-kvpool"
    assert deploy["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "ml"
    assert pod["metadata"]["labels"]["tier"] == "control" and deploy["metadata"]["labels"]["team"] == "ml-infra"
    assert pod["metadata"]["annotations"] == {"example.com/scrape": "false"}
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "kvpool-op"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"} and spec["tolerations"] and spec["affinity"]
    c = container(docs)
    assert c["args"] == ["--verbose"] and c["imagePullPolicy"] == "Always"
    env = env_of(docs)
    assert env["KVPOOL_OPERATOR_NAMESPACES"] == "team-a,team-b"
    assert env["KVPOOL_OPERATOR_TIMER_INTERVAL"] == "10"
    assert env["KVPOOL_OPERATOR_LIVENESS"] == "http://0.0.0.0:9090/healthz" and env["TZ"] == "UTC"
    assert env["KVPOOL_OPERATOR_IMAGE"] == "registry.example.com/kvpool/kvpool:0.1.0"
    assert env["KVPOOL_OPERATOR_POD_NAMESPACE"] == "kvpool-system"
    assert OperatorSettings.from_env(env).pool_policy == PoolPolicySettings(
        ("kv-*", "system-node-critical"), (), ("nvidia.com/gpu", "example.com/*"),
        ("registry.example.com/kvpool-gpu:*",))
    assert OPERATOR_POD_LABELS.items() <= pod["metadata"]["labels"].items()
    renamed = one(helm.template("nameOverride=kv", release="other"), "Deployment")["spec"]["template"]
    assert OPERATOR_POD_LABELS.items() <= renamed["metadata"]["labels"].items()  # whatever the chart is called

    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "sidecar"
    assert sm["spec"]["endpoints"][0]["interval"] == "15s"

    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvpool.json"])["uid"] == "kvpool"

    pools = {p["metadata"]["name"]: p for p in by_kind(docs, "KVCachePool")}
    assert pools["minimal"]["metadata"]["namespace"] == "team-a" and pools["minimal"]["spec"] == {}
    assert pools["tiered"]["spec"]["tiers"]["disk"]["path"] == "/mnt/default.tiered"
    assert pools["tiered"]["metadata"]["labels"]["cost-center"] == "42"
    assert "annotations" not in pools["minimal"]["metadata"]  # keepPoolsOnUninstall: false

    kept = one(helm.template("pools[0].name=a"), "KVCachePool")
    assert kept["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert kept["metadata"]["namespace"] == "kvpool-system"


def test_bad_values_are_refused(helm: Helm) -> None:
    assert "does not watch" in helm.template_error("pools[0].name=a", "pools[0].namespace=elsewhere")
    for bad in ("watch.clusterWide=true,watch.namespaces={a}",
                "securityContext.readOnlyRootFilesystem=false",
                "securityContext.allowPrivilegeEscalation=true",
                "pools[0].name=Not_A_Name",
                "operator.timerInterval=0",
                "operator.poolPolicy.gpuImages={a*b}",
                "unknownValue=1"):
        assert "schema" in helm.template_error(bad).lower(), bad
