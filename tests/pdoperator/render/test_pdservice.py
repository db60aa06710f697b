"""The set of children: names, labels, selectors, order, Services, policies, budgets, determinism."""

from __future__ import annotations

import copy

import pytest
from pdoperator.render import RenderDefaults, owner_reference, render_pdservice
from pdoperator.render.defaults import ENVIRONMENT
from pdoperator.render.manifest_yaml import dump_manifests

EXPECTED_OBJECTS = [
    ("NetworkPolicy", "svc-engines"),
    ("NetworkPolicy", "svc-router"),
    ("PodDisruptionBudget", "svc-prefill"),
    ("PodDisruptionBudget", "svc-decode"),
    ("PodDisruptionBudget", "svc-router"),
    ("ConfigMap", "svc-router"),
    ("Service", "svc-prefill"),
    ("Service", "svc-decode"),
    ("Service", "svc-router"),
    ("Deployment", "svc-router"),
    ("StatefulSet", "svc-prefill"),
    ("StatefulSet", "svc-decode"),
]


def by_kind_and_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_children_are_named_after_the_pdservice_and_ordered_for_apply(make_pds):
    objects = render_pdservice(make_pds(), RenderDefaults())
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == EXPECTED_OBJECTS


def test_every_child_lives_in_the_namespace_and_carries_the_instance_labels(make_pds):
    for obj in render_pdservice(make_pds(namespace="team-a"), RenderDefaults()):
        assert obj["metadata"]["namespace"] == "team-a"
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pd-operator"
        assert labels["app.kubernetes.io/instance"] == "svc"
        assert labels["app.kubernetes.io/managed-by"] == "pd-operator"
        assert "ownerReferences" not in obj["metadata"]


def test_role_objects_carry_role_and_component_labels(make_pds):
    objects = by_kind_and_name(render_pdservice(make_pds(), RenderDefaults()))
    for kind, role in (("StatefulSet", "prefill"), ("StatefulSet", "decode"), ("Deployment", "router")):
        labels = objects[kind, f"svc-{role}"]["metadata"]["labels"]
        assert labels["inference.pdoperator.dev/role"] == role
        assert labels["app.kubernetes.io/component"] == role


def test_workload_selectors_match_their_pods_and_services(make_pds):
    objects = by_kind_and_name(render_pdservice(make_pds(), RenderDefaults()))
    for kind, name in (
        ("StatefulSet", "svc-prefill"),
        ("StatefulSet", "svc-decode"),
        ("Deployment", "svc-router"),
    ):
        workload = objects[kind, name]
        selector = workload["spec"]["selector"]["matchLabels"]
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert objects["Service", name]["spec"]["selector"] == selector
        assert objects["PodDisruptionBudget", name]["spec"]["selector"]["matchLabels"] == selector


def test_engine_statefulsets_are_governed_by_headless_services_of_ready_pods(make_pds):
    objects = by_kind_and_name(
        render_pdservice(make_pds({"engine": {"sideChannelPort": 5700}}), RenderDefaults())
    )
    for role in ("prefill", "decode"):
        sts = objects["StatefulSet", f"svc-{role}"]
        assert sts["spec"]["serviceName"] == f"svc-{role}"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        service = objects["Service", f"svc-{role}"]["spec"]
        assert service["clusterIP"] == "None"
        assert service["publishNotReadyAddresses"] is False
        assert [(p["name"], p["port"], p["targetPort"]) for p in service["ports"]] == [
            ("http", 8000, "http"),
            ("side-channel", 5700, "side-channel"),
        ]
        # Service links would put <SERVICE>_PORT variables (VLLM_PORT for a Service named vllm) into vLLM's
        # environment.
        assert sts["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_engines_admit_peers_on_every_port_and_the_router_on_http_only(make_pds):
    policy = by_kind_and_name(render_pdservice(make_pds(), RenderDefaults()))["NetworkPolicy", "svc-engines"][
        "spec"
    ]
    engines = {
        "matchLabels": {"app.kubernetes.io/name": "pd-operator", "app.kubernetes.io/instance": "svc"},
        "matchExpressions": [
            {"key": "inference.pdoperator.dev/role", "operator": "In", "values": ["prefill", "decode"]}
        ],
    }
    assert policy["podSelector"] == engines
    assert policy["policyTypes"] == ["Ingress"]
    peers, router = policy["ingress"]
    # NIXL's TCP/UCX transports connect on ports chosen at run time: peers get every port.
    assert peers == {"from": [{"podSelector": engines}]}
    router_pods = {
        "app.kubernetes.io/name": "pd-operator",
        "app.kubernetes.io/instance": "svc",
        "inference.pdoperator.dev/role": "router",
    }
    assert router["from"] == [{"podSelector": {"matchLabels": router_pods}}]
    assert router["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_metrics_scrapers_are_admitted_to_the_engines_http_port_only_with_their_selectors_as_given(make_pds):
    scrapers = [
        {
            "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"},
            "podLabels": {"app": "prometheus"},
        },
        {"podLabels": {}},
    ]
    pds = make_pds({"monitoring": {"scrapers": scrapers}})
    policy = by_kind_and_name(render_pdservice(pds, RenderDefaults()))["NetworkPolicy", "svc-engines"]["spec"]
    assert policy["ingress"][-1] == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app": "prometheus"}},
            },
            {"podSelector": {"matchLabels": {}}},  # every pod of this namespace, none of another
        ],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    without = by_kind_and_name(render_pdservice(make_pds(), RenderDefaults()))[
        "NetworkPolicy", "svc-engines"
    ]["spec"]
    assert len(without["ingress"]) == len(policy["ingress"]) - 1


AUTOSCALED = {
    "autoscaling": {
        "prefill": {"maxReplicas": 4},
        "decode": {"maxReplicas": 4},
        "targets": {"ttftMilliseconds": 1000, "tpotMilliseconds": 50},
    }
}
OPERATOR_PODS = RenderDefaults(
    operator_namespace="pd-system",
    operator_pod_labels="app.kubernetes.io/name=pd-operator-controller,app.kubernetes.io/instance=r",
)


def test_under_the_builtin_autoscaler_the_operator_pods_reach_the_engines_http_port_only(make_pds):
    def engine_ingress(pds, defaults):
        return by_kind_and_name(render_pdservice(pds, defaults))["NetworkPolicy", "svc-engines"]["spec"][
            "ingress"
        ]

    admitted = engine_ingress(make_pds(AUTOSCALED), OPERATOR_PODS)
    assert admitted[-1] == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pd-system"}},
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "pd-operator-controller",
                        "app.kubernetes.io/instance": "r",
                    }
                },
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    baseline = engine_ingress(make_pds(), OPERATOR_PODS)
    assert len(admitted) == len(baseline) + 1, "without autoscaling the operator reads no engine"
    assert engine_ingress(make_pds(AUTOSCALED), RenderDefaults()) == baseline, "unknown operator pods: none"


def test_a_malformed_operator_label_list_names_its_variable():
    with pytest.raises(ValueError, match=r"PD_OPERATOR_POD_LABELS='app': expected k=v"):
        RenderDefaults(operator_namespace="pd-system", operator_pod_labels="app").operator_pods()


def pod_annotations(objects):
    workloads = [o for o in objects if "template" in o.get("spec", {})]
    return {
        (o["kind"], o["metadata"]["name"]): o["spec"]["template"]["metadata"].get("annotations", {})
        for o in workloads
    }


def test_scrape_annotations_are_opt_in_so_an_operator_upgrade_does_not_roll_the_engines(make_pds):
    for pod in pod_annotations(render_pdservice(make_pds(), RenderDefaults())).values():
        assert not any(key.startswith("prometheus.io/") for key in pod)


def test_scrape_annotations_name_each_pods_metrics_port(make_pds):
    pds = make_pds({"monitoring": {"podAnnotations": True}, "engine": {"port": 8100}})
    annotations = pod_annotations(render_pdservice(pds, RenderDefaults()))
    engine = {"prometheus.io/scrape": "true", "prometheus.io/port": "8100", "prometheus.io/path": "/metrics"}
    assert annotations["StatefulSet", "svc-prefill"].items() >= engine.items()
    assert annotations["StatefulSet", "svc-decode"].items() >= engine.items()
    assert annotations["Deployment", "svc-router"] == {**engine, "prometheus.io/port": "8000"}


def test_the_router_port_is_open_to_everyone(make_pds):
    policy = by_kind_and_name(render_pdservice(make_pds(), RenderDefaults()))["NetworkPolicy", "svc-router"][
        "spec"
    ]
    assert policy["podSelector"]["matchLabels"]["inference.pdoperator.dev/role"] == "router"
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


def test_every_role_has_a_budget_of_one_unavailable_pod_whatever_its_replicas(make_pds):
    for replicas in (0, 1, 5):
        pds = make_pds(
            {
                "prefill": {"replicas": replicas},
                "decode": {"replicas": replicas},
                "router": {"replicas": replicas},
            }
        )
        budgets = [o for o in render_pdservice(pds, RenderDefaults()) if o["kind"] == "PodDisruptionBudget"]
        assert [b["spec"]["maxUnavailable"] for b in budgets] == [1, 1, 1]


def test_rendering_is_deterministic_and_returns_fresh_objects(make_pds):
    pds = make_pds({"prefill": {"affinity": {"podAffinity": {}}}})
    first, second = render_pdservice(pds, RenderDefaults()), render_pdservice(pds, RenderDefaults())
    assert first == second
    assert dump_manifests(first) == dump_manifests(second)
    pristine = copy.deepcopy(second)
    first[-1]["spec"]["template"]["spec"]["containers"][0]["args"].append("--mutated")
    first[0]["metadata"]["labels"]["x"] = "y"
    assert second == pristine
    assert render_pdservice(pds, RenderDefaults()) == pristine


def test_owner_reference_makes_the_pdservice_the_controller(make_pds):
    pds = make_pds().model_copy(update={"uid": "1234-abcd"})
    assert owner_reference(pds) == {
        "apiVersion": "inference.pdoperator.dev/v1alpha1",
        "kind": "PDService",
        "name": "svc",
        "uid": "1234-abcd",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_defaults_come_from_the_operators_environment_and_empty_values_are_ignored():
    environ = {
        ENVIRONMENT["router_image"]: "registry.local/pd-operator:dev",
        ENVIRONMENT["engine_image"]: "registry.local/pd-engine:dev",
        ENVIRONMENT["mock_engine_image"]: "",
    }
    defaults = RenderDefaults.from_environ(environ)
    assert defaults.router_image == "registry.local/pd-operator:dev"
    assert defaults.engine_image == "registry.local/pd-engine:dev"
    assert defaults.mock_engine_image == RenderDefaults().mock_engine_image
    assert RenderDefaults.from_environ({}) == RenderDefaults()
