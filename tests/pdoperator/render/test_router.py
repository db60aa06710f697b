"""The router's children: its config (the engines it may use), ConfigMap, Deployment and Service."""

from __future__ import annotations

from pdconnector.router.config import parse_router_config
from pdoperator.render import RenderDefaults, build_router_config, render_pdservice


def router_objects(pds, defaults=None):
    objects = render_pdservice(pds, defaults or RenderDefaults())
    return {
        o["kind"]: o
        for o in objects
        if o["metadata"]["name"] == f"{pds.name}-router"
        and o["kind"] in {"ConfigMap", "Deployment", "Service"}
    }


def test_router_config_lists_every_replicas_stable_pod_dns_name(make_pds):
    config = build_router_config(make_pds(namespace="team-a"), RenderDefaults())
    assert config.prefill.service == "svc-prefill.team-a.svc.cluster.local"
    assert [b.host for b in config.prefill.backends] == [
        "svc-prefill-0.svc-prefill.team-a.svc.cluster.local",
        "svc-prefill-1.svc-prefill.team-a.svc.cluster.local",
    ]
    assert [b.name for b in config.decode.backends] == ["svc-decode-0", "svc-decode-1", "svc-decode-2"]
    assert config.prefill.replicas == 2
    assert config.decode.replicas == 3


def test_router_config_carries_mode_model_policy_and_prefill_coordinates(make_pds):
    pds = make_pds(
        {
            "mode": "pull",
            "prefill": {"tensorParallelSize": 1},
            "decode": {"tensorParallelSize": 4},
            "engine": {
                "sideChannelPort": 5900,
                "transferTimeoutSeconds": 15,
                "kvLoadFailurePolicy": "recompute",
            },
            "router": {"policy": "round-robin"},
        }
    )
    config = build_router_config(pds, RenderDefaults())
    assert (config.mode, config.served_model_name, config.policy, config.connector) == (
        "pull",
        "qwen3-8b",
        "round-robin",
        "builtin",
    )
    assert (config.prefill.tp_size, config.decode.tp_size) == (1, 4)
    assert config.prefill.side_channel_port == 5900
    assert config.prefill.http_port == 8000
    assert config.timeouts.transfer_s == 15
    assert config.kv_load_failure_policy == "recompute"
    assert config.api_key_env is None


def test_the_retry_budget_reaches_the_router_and_defaults_to_three_pairs_within_thirty_seconds(make_pds):
    assert build_router_config(make_pds(), RenderDefaults()).retries.model_dump() == {
        "attempts": 3,
        "budget_s": 30.0,
    }
    pds = make_pds({"router": {"retries": {"attempts": 1, "budgetSeconds": 5}}})
    assert build_router_config(pds, RenderDefaults()).retries.model_dump() == {"attempts": 1, "budget_s": 5.0}


def test_the_cluster_domain_comes_from_the_defaults(make_pds):
    config = build_router_config(make_pds(), RenderDefaults(cluster_domain="corp.internal"))
    assert config.decode.backends[0].host == "svc-decode-0.svc-decode.ml.svc.corp.internal"


def test_the_configmap_holds_the_config_as_router_yaml(make_pds):
    pds = make_pds()
    configmap = router_objects(pds)["ConfigMap"]
    assert set(configmap["data"]) == {"router.yaml"}
    assert parse_router_config(configmap["data"]["router.yaml"]) == build_router_config(pds, RenderDefaults())


def test_the_router_runs_pd_router_on_the_mounted_config_directory(make_pds):
    deployment = router_objects(make_pds({"router": {"replicas": 3}}))["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    assert router["image"] == RenderDefaults().router_image
    assert router["command"] == ["pd-router", "--config", "/etc/pd-router/router.yaml"]
    # A directory mount (no subPath) is what lets ConfigMap updates reach the running router.
    assert router["volumeMounts"] == [{"name": "config", "mountPath": "/etc/pd-router", "readOnly": True}]
    assert pod["volumes"] == [{"name": "config", "configMap": {"name": "svc-router"}}]
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["securityContext"]["runAsNonRoot"] is True
    assert "env" not in router


def test_the_api_key_reaches_the_router_from_the_secret(make_pds):
    pds = make_pds({"router": {"apiKeySecretRef": {"name": "router-key", "key": "token"}}})
    (router,) = router_objects(pds)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert router["env"] == [
        {"name": "PD_ROUTER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "router-key", "key": "token"}}}
    ]
    assert build_router_config(pds, RenderDefaults()).api_key_env == "PD_ROUTER_API_KEY"


def test_the_router_service_maps_the_spec_port_to_the_routers_http_port(make_pds):
    service = router_objects(make_pds({"router": {"port": 80}}))["Service"]["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_a_router_image_in_the_spec_wins_over_the_default(make_pds):
    deployment = router_objects(make_pds({"router": {"image": "mirror.local/pd-operator:0.1.0"}}))[
        "Deployment"
    ]
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "mirror.local/pd-operator:0.1.0"
    )
