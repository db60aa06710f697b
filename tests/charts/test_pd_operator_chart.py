"""The Helm chart, checked with the real helm binary and offline Kubernetes 1.35 schemas."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pdoperator.api import PDService, PDServiceSpec
from pdoperator.render import RenderDefaults, render_pdservice

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pd-operator"
KUBERNETES_VERSION = "1.35.0"
# Kinds that are not built into Kubernetes and so have no offline schema in kubernetes-validate.
CUSTOM_KINDS = {"PDService", "ServiceMonitor", "PodMonitor", "ClusterKopfPeering", "KopfPeering"}


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, check=False)


def render(helm: Path, *set_args: str, namespace: str = "pd-system") -> list[dict[str, Any]]:
    args = ["template", "pdo", str(CHART), "--namespace", namespace]
    for value in set_args:
        args += ["--set", value]
    result = helm_run(helm, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def test_chart_lints_clean_with_default_values(helm: Path) -> None:
    result = helm_run(helm, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("replicaCount=0", "at '/replicaCount': minimum: got 0, want 1"),
        (
            "image.pullPolicy=Sometimes",
            "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        ("watchNamespaces={Bad_NS}", "at '/watchNamespaces/0': 'Bad_NS' does not match pattern"),
        ("logFormat=xml", "at '/logFormat': value must be one of 'json', 'plain'"),
        ("metrics.serviceMonitor.enabled=true", "at '/metrics/enabled': value must be true"),
        ("health.port=80", "at '/health/port': minimum: got 80, want 1,024"),
        ("image.tag=bad tag", "at '/image/tag': 'bad tag' does not match pattern"),
        ("unknownKey=1", "additional properties 'unknownKey' not allowed"),
        (
            "metrics.serviceMonitor.interval=soon",
            "at '/metrics/serviceMonitor/interval': 'soon' does not match pattern",
        ),
        ("podMonitor.interval=soon", "at '/podMonitor/interval': 'soon' does not match pattern"),
    ],
)
def test_lint_rejects_bad_values_with_a_message_naming_the_value(
    helm: Path, value: str, message: str
) -> None:
    result = helm_run(helm, "lint", str(CHART), "--set", value)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


@pytest.mark.parametrize(
    "set_args",
    [
        pytest.param((), id="default"),
        pytest.param(("watchNamespaces={team-a,team-b}",), id="namespaced"),
        pytest.param(
            ("metrics.enabled=true", "metrics.serviceMonitor.enabled=true", "replicaCount=2"),
            id="metrics-and-peering",
        ),
        pytest.param(("samplePDService.enabled=true",), id="sample"),
        pytest.param(("podMonitor.enabled=true", "watchNamespaces={team-a}"), id="podmonitor"),
    ],
)
def test_rendered_objects_pass_strict_kubernetes_validation(helm: Path, set_args: tuple[str, ...]) -> None:
    docs = render(helm, *set_args)
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_sample_pdservice_validates_against_the_crd_schema(helm: Path) -> None:
    (sample,) = by_kind(render(helm, "samplePDService.enabled=true"), "PDService")
    crd = yaml.safe_load((CHART / "crds" / "pdservices.inference.pdoperator.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(sample, schema)


def test_default_install_watches_all_namespaces_with_a_cluster_role(helm: Path) -> None:
    docs = render(helm)
    (deployment,) = by_kind(docs, "Deployment")
    assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert by_kind(docs, "ClusterRole")
    assert not by_kind(docs, "Role")


def test_namespaced_install_grants_namespaced_rules_only_in_the_watched_namespaces(helm: Path) -> None:
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args
    assert "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    roles = by_kind(docs, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert sorted(binding["metadata"]["namespace"] for binding in by_kind(docs, "RoleBinding")) == [
        "team-a",
        "team-b",
    ]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    cluster_resources = {resource for rule in cluster_role["rules"] for resource in rule["resources"]}
    namespaced_resources = {resource for rule in roles[0]["rules"] for resource in rule["resources"]}
    assert not cluster_resources & namespaced_resources - {"customresourcedefinitions"}


def test_chart_rbac_rules_are_the_operators_own(helm: Path) -> None:
    from pdoperator.rbac import rbac_rules_document  # noqa: PLC0415 - the operator's rule list is the source

    committed = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    assert committed == rbac_rules_document(), (
        "charts/pd-operator/files/rbac-rules.yaml drifted: run `make rbac`"
    )


def test_operator_runs_non_root_with_a_read_only_root_filesystem_and_health_probes(helm: Path) -> None:
    (deployment,) = by_kind(render(helm), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    assert container["readinessProbe"]["httpGet"]["port"] == "health"
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["resources"]["limits"]["memory"]


def test_default_images_follow_the_app_version_and_reach_the_operator(helm: Path) -> None:
    (deployment,) = by_kind(render(helm), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    version = chart_metadata()["appVersion"]
    assert container["image"] == f"ghcr.io/pd-operator/pd-operator:{version}"
    assert env["PD_OPERATOR_ROUTER_IMAGE"] == container["image"]
    assert env["PD_OPERATOR_MOCK_ENGINE_IMAGE"] == container["image"]
    assert env["PD_OPERATOR_ENGINE_IMAGE"] == f"ghcr.io/pd-operator/pd-engine:{version}"


def test_the_operator_knows_its_own_pods_so_engine_policies_can_admit_its_autoscaler(helm: Path) -> None:
    (deployment,) = by_kind(render(helm), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    defaults = RenderDefaults(
        operator_namespace="pd-system", operator_pod_labels=env["PD_OPERATOR_POD_LABELS"]["value"]
    )
    labels = defaults.operator_pods()
    assert labels == deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_more_than_one_replica_turns_on_peering_with_a_peering_object_kopf_can_update(helm: Path) -> None:
    single_docs = render(helm)
    (single,) = by_kind(single_docs, "Deployment")
    assert not [
        arg
        for arg in single["spec"]["template"]["spec"]["containers"][0]["args"]
        if arg.startswith("--peering")
    ]
    assert not by_kind(single_docs, "ClusterKopfPeering")
    docs = render(helm, "replicaCount=3")
    (several,) = by_kind(docs, "Deployment")
    assert "--peering=pdo-pd-operator" in several["spec"]["template"]["spec"]["containers"][0]["args"]
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "pdo-pd-operator"
    namespaced = render(helm, "replicaCount=2", "watchNamespaces={team-a,team-b}")
    assert sorted(p["metadata"]["namespace"] for p in by_kind(namespaced, "KopfPeering")) == [
        "team-a",
        "team-b",
    ]


def test_chart_ships_the_kopf_peering_crds_the_rbac_rules_name() -> None:
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text()))
    plurals = {crd["spec"]["names"]["plural"] for crd in crds}
    rules = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    granted = {
        resource
        for scope in rules.values()
        for rule in scope
        if rule["apiGroups"] == ["kopf.dev"]
        for resource in rule["resources"]
    }
    assert plurals == granted == {"clusterkopfpeerings", "kopfpeerings"}
    for crd in crds:
        kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


def test_metrics_service_and_service_monitor_only_when_enabled(helm: Path) -> None:
    assert not by_kind(render(helm), "ServiceMonitor")
    docs = render(helm, "metrics.enabled=true", "metrics.serviceMonitor.enabled=true")
    (service,) = by_kind(docs, "Service")
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    exact = all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())
    return exact and all(
        labels.get(e["key"]) in e["values"]
        for e in selector.get("matchExpressions", [])
        if e["operator"] == "In"
    )


def test_pod_monitor_scrapes_the_engines_and_routers_the_operator_renders_and_nothing_else(
    helm: Path,
) -> None:
    assert not by_kind(render(helm), "PodMonitor")
    (monitor,) = by_kind(
        render(helm, "podMonitor.enabled=true", "podMonitor.labels.release=kube-prometheus"), "PodMonitor"
    )
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")

    document = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    pds = PDService(
        name=document["metadata"]["name"],
        namespace="default",
        spec=PDServiceSpec.model_validate(document["spec"]),
    )
    pods = [
        o["spec"]["template"]
        for o in render_pdservice(pds, RenderDefaults())
        if o["kind"] in ("StatefulSet", "Deployment")
    ]
    assert len(pods) == 3  # prefill, decode, router
    for pod in pods:
        assert _matches(monitor["spec"]["selector"], pod["metadata"]["labels"])
        assert endpoint["port"] in [
            port["name"] for c in pod["spec"]["containers"] for port in c.get("ports", [])
        ]
    (operator,) = by_kind(render(helm), "Deployment")
    assert not _matches(monitor["spec"]["selector"], operator["spec"]["template"]["metadata"]["labels"])

    (scoped,) = by_kind(
        render(helm, "podMonitor.enabled=true", "watchNamespaces={team-a,team-b}"), "PodMonitor"
    )
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def chart_metadata() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_app_version_is_the_project_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart_metadata()["appVersion"] == project["version"]
    assert chart_metadata()["version"] == project["version"]


def test_chart_crd_is_the_generated_crd() -> None:
    top = (REPO / "crds" / "pdservices.inference.pdoperator.dev.yaml").read_text()
    chart = (CHART / "crds" / "pdservices.inference.pdoperator.dev.yaml").read_text()
    assert chart == top, "charts/pd-operator/crds drifted from crds/: run `make crd`"


def _undescribed(schema: dict[str, Any], path: str) -> list[str]:
    missing = [] if "description" in schema or "$ref" in schema or path == "" else [path]
    for name, child in schema.get("properties", {}).items():
        missing += _undescribed(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict) and schema["items"].get("type") == "object":
        missing += _undescribed(schema["items"], f"{path}[]")
    return missing


def test_every_value_in_the_values_schema_is_described() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert _undescribed(schema, "") == []


def test_default_values_satisfy_the_values_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
