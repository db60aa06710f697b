"""spec.autoscaling.engine hpa and keda: a scaler per engine role, aimed at that role's StatefulSet, on the
spec's bounds, windows and targets; builtin and no autoscaling render none."""

from __future__ import annotations

from typing import Any

from pdoperator.render import render_pdservice

from tests.pdoperator.render.conftest import VARIANTS, merge


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def test_builtin_or_no_autoscaling_renders_no_scaler(make_pds, defaults):
    builtin = merge(VARIANTS["autoscaled-keda"], {"autoscaling": {"engine": "builtin"}})
    del builtin["autoscaling"]["prometheus"]
    for pds in (make_pds(), make_pds(builtin)):
        kinds = {obj["kind"] for obj in render_pdservice(pds, defaults)}
        assert not kinds & {"HorizontalPodAutoscaler", "ScaledObject"}


def test_hpa_scales_each_statefulset_on_its_queue_per_engine(make_pds, defaults):
    objects = render_pdservice(make_pds(VARIANTS["autoscaled-hpa"]), defaults)
    statefulsets = by_kind(objects, "StatefulSet")
    scalers = by_kind(objects, "HorizontalPodAutoscaler")
    assert set(scalers) == {"svc-prefill", "svc-decode"}
    for name, scaler in scalers.items():
        assert scaler["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": name,
        }
        assert name in statefulsets
        assert scaler["spec"]["behavior"] == {
            "scaleUp": {"stabilizationWindowSeconds": 15},
            "scaleDown": {
                "stabilizationWindowSeconds": 600,
                "policies": [{"type": "Percent", "value": 50, "periodSeconds": 600}],
            },
        }
    prefill, decode = scalers["svc-prefill"]["spec"], scalers["svc-decode"]["spec"]
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 4)
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    assert prefill["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]
    assert decode["metrics"][0]["pods"]["metric"] == {"name": "vllm_num_requests_running"}
    assert decode["metrics"][0]["pods"]["target"]["averageValue"] == "32"


def test_keda_scales_prefill_on_router_ttft_and_waiting_prompts_decode_on_tpot(make_pds, defaults):
    objects = render_pdservice(make_pds(VARIANTS["autoscaled-keda"]), defaults)
    scalers = by_kind(objects, "ScaledObject")
    assert set(scalers) == {"svc-prefill", "svc-decode"}
    prefill, decode = scalers["svc-prefill"]["spec"], scalers["svc-decode"]["spec"]
    assert prefill["scaleTargetRef"]["name"] == "svc-prefill"
    assert (prefill["minReplicaCount"], prefill["maxReplicaCount"]) == (0, 4)
    assert prefill["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 300,
        "policies": [{"type": "Percent", "value": 50, "periodSeconds": 300}],
    }
    ttft, waiting = prefill["triggers"]
    assert ttft["metricType"] == "Value"
    assert ttft["metadata"] == {
        "serverAddress": "http://prometheus.monitoring.svc:9090",
        "query": 'histogram_quantile(0.95, sum by (le) (rate(pd_router_ttft_seconds_bucket{namespace="ml",'
        'pod=~"svc-router-[a-z0-9]+-[a-z0-9]+"}[1m])))',
        "threshold": "0.8",
    }
    assert waiting["metricType"] == "AverageValue"
    assert (
        waiting["metadata"]["query"]
        == 'sum(vllm:num_requests_waiting{namespace="ml",pod=~"svc-prefill-[0-9]+"})'
    )
    assert waiting["metadata"]["threshold"] == "4"
    (tpot,) = decode["triggers"]  # no running-requests target in this spec
    assert tpot["metadata"]["query"].startswith("histogram_quantile(0.95, sum by (le) (rate(")
    assert (
        'vllm:request_time_per_output_token_seconds_bucket{namespace="ml",pod=~"svc-decode-[0-9]+"}'
        in (tpot["metadata"]["query"])
    )
    assert tpot["metadata"]["threshold"] == "0.04"
