"""Every CEL rule, evaluated by a CEL interpreter on the CRD, agrees with its Python twin."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdoperator.api import PDServiceSpec
from pdoperator.api.cel import CelRule
from pdoperator.api.rules import CEL_RULES
from pdoperator.api.validation import cel_rule_violations

MODEL = {"name": "m"}
HYBRID = {"name": "m", "architecture": "hybrid-ssm"}
EFA_ON = {"efa": {"enabled": True, "prefillDevices": 1, "decodeDevices": 1}}
MOCK_ENGINE = {"runtime": "mock", "transport": {"backend": "mock"}}
MAMBA2 = {"family": "mamba2"}
# Mamba1 is served by the mock engine only (with the builtin connector); the TP rule is tested there.
MAMBA1_MOCK = {"model": HYBRID, "ssm": {"family": "mamba1"}, "engine": MOCK_ENGINE}
# Autoscaling: the smallest spec.autoscaling that is valid, and its variants.
BOUNDS = {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 4}}
LATENCY = {"ttftMilliseconds": 1000, "tpotMilliseconds": 50}
PER_POD = {"waitingRequestsPerPrefill": 4, "runningRequestsPerDecode": 32}
PROMETHEUS = {"serverAddress": "http://prometheus.monitoring.svc:9090"}


# Both roles of TP 16, so that one spanning nodes is the only difference between neighbours.
TP16 = {"prefill": {"tensorParallelSize": 16}, "decode": {"tensorParallelSize": 16}}
AUTOSCALED = {"autoscaling": {**BOUNDS, "targets": LATENCY}}


def scaled(**autoscaling: Any) -> dict[str, Any]:
    return {"model": MODEL, "autoscaling": {**BOUNDS, "targets": LATENCY, **autoscaling}}


SPECULATIVE = '--speculative-config={"method":"ngram","num_speculative_tokens":2}'

TIER_MEMORY = {"resources": {"memory": "96Gi"}}


def tier_samples(role: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The samples of the KV tier rules of ``role``'s engines."""
    tier = {"offload": {role: {"hostMemory": "64Gi"}}}
    other = "decode" if role == "prefill" else "prefill"
    return {
        f"{role}-tier-dense-only": (
            {"model": MODEL, "kvCache": tier, role: TIER_MEMORY},
            {"model": HYBRID, "ssm": MAMBA2, "kvCache": tier, role: TIER_MEMORY},
        ),
        f"{role}-tier-builtin-vllm-only": (
            {"model": MODEL, "kvCache": tier, role: TIER_MEMORY, "engine": {"connector": "builtin"}},
            {"model": MODEL, "kvCache": tier, role: TIER_MEMORY, "engine": MOCK_ENGINE},
        ),
        f"{role}-tier-needs-pod-memory": (
            {"model": MODEL, "kvCache": tier, role: TIER_MEMORY},
            {"model": MODEL, "kvCache": tier, other: TIER_MEMORY},
        ),
    }


# rule name -> (a spec that satisfies it, a spec that breaks it); neighbours differ in one respect.
RULE_SAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "hybrid-requires-ssm": ({"model": HYBRID, "ssm": {"family": "mamba2"}}, {"model": HYBRID}),
    "ssm-only-for-hybrid": ({"model": MODEL}, {"model": MODEL, "ssm": {"family": "mamba2"}}),
    "heterogeneous-tp-requires-ds-layout": (
        {
            "model": HYBRID,
            "ssm": {"family": "mamba2", "convStateLayout": "SD"},
            "decode": {"tensorParallelSize": 1},
        },
        {
            "model": HYBRID,
            "ssm": {"family": "mamba2", "convStateLayout": "SD"},
            "decode": {"tensorParallelSize": 2},
        },
    ),
    "upstream-connector-requires-ds-layout": (
        {
            "model": HYBRID,
            "ssm": {"family": "gdn", "convStateLayout": "SD"},
            "mode": "pull",
            "engine": {"connector": "builtin"},
        },
        {
            "model": HYBRID,
            "ssm": {"family": "gdn", "convStateLayout": "SD"},
            "mode": "pull",
            "engine": {"connector": "vllm"},
        },
    ),
    "cache-aware-needs-attention-only-models": (
        {"model": HYBRID, "ssm": {"family": "mamba2"}, "router": {"policy": "least-loaded"}},
        {"model": HYBRID, "ssm": {"family": "mamba2"}, "router": {"policy": "cache-aware"}},
    ),
    "cache-aware-needs-prefill-prefix-caching": (
        {"model": MODEL, "router": {"policy": "cache-aware"}, "prefill": {"enablePrefixCaching": True}},
        {"model": MODEL, "router": {"policy": "cache-aware"}, "prefill": {"enablePrefixCaching": False}},
    ),
    "mamba1-requires-equal-tp": (
        {**MAMBA1_MOCK, "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2}},
        {**MAMBA1_MOCK, "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 2}},
    ),
    "mamba1-only-on-mock-with-builtin-connector": (
        MAMBA1_MOCK,
        {"model": HYBRID, "ssm": {"family": "mamba1"}, "engine": {"runtime": "vllm"}},
    ),
    "prefill-tp-above-decode-only-hybrid-or-mla": (
        {
            "model": {"name": "m", "architecture": "mla"},
            "prefill": {"tensorParallelSize": 4},
            "decode": {"tensorParallelSize": 2},
        },
        {"model": MODEL, "prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 2}},
    ),
    "tp-sizes-divide": (
        {"model": MODEL, "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 6}},
        {"model": MODEL, "prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 6}},
    ),
    "hybrid-prefill-prefix-caching-off": (
        {"model": HYBRID, "ssm": MAMBA2, "prefill": {"enablePrefixCaching": False}},
        {"model": HYBRID, "ssm": MAMBA2, "prefill": {"enablePrefixCaching": True}},
    ),
    **{name: samples for role in ("prefill", "decode") for name, samples in tier_samples(role).items()},
    "hybrid-decode-prefix-caching-off": (
        {"model": HYBRID, "ssm": {"family": "mamba2"}, "decode": {"enablePrefixCaching": False}},
        {"model": HYBRID, "ssm": {"family": "mamba2"}, "decode": {"enablePrefixCaching": True}},
    ),
    "hybrid-prefill-no-speculative-decoding": (
        {"model": MODEL, "prefill": {"extraArgs": [SPECULATIVE]}},
        {"model": HYBRID, "ssm": MAMBA2, "prefill": {"extraArgs": [SPECULATIVE]}},
    ),
    "hybrid-decode-no-speculative-decoding": (
        {
            "model": HYBRID,
            "ssm": MAMBA2,
            "decode": {"extraArgs": ["--enforce-eager", "--generation-config", "auto"]},
        },
        {
            "model": HYBRID,
            "ssm": MAMBA2,
            "decode": {"extraArgs": ["--enforce-eager", "--speculative_config", '{"method":"ngram"}']},
        },
    ),
    "efa-requires-libfabric": (
        {"model": MODEL, "network": EFA_ON, "engine": {"transport": {"backend": "LIBFABRIC"}}},
        {"model": MODEL, "network": EFA_ON, "engine": {"transport": {"backend": "UCX"}}},
    ),
    "upstream-push-requires-prefill-engine-id": (
        {"model": MODEL, "mode": "push", "engine": {"connector": "vllm", "prefillEngineId": "prefill-0"}},
        {"model": MODEL, "mode": "push", "engine": {"connector": "vllm"}},
    ),
    "fixed-prefill-engine-id-single-replica": (
        {"model": MODEL, "engine": {"connector": "vllm", "prefillEngineId": "p"}, "prefill": {"replicas": 1}},
        {"model": MODEL, "engine": {"connector": "vllm", "prefillEngineId": "p"}, "prefill": {"replicas": 2}},
    ),
    "fixed-prefill-engine-id-autoscaled-single-replica": (
        {
            **scaled(prefill={"maxReplicas": 1}),
            "engine": {"connector": "vllm", "prefillEngineId": "p"},
        },
        {**scaled(), "engine": {"connector": "vllm", "prefillEngineId": "p"}},
    ),
    "autoscaling-replica-range-ordered": (
        scaled(decode={"minReplicas": 4, "maxReplicas": 4}),
        scaled(decode={"minReplicas": 5, "maxReplicas": 4}),
    ),
    "autoscaling-ratio-range-ordered": (
        scaled(prefillPerDecode={"minPercent": 50, "maxPercent": 200}),
        scaled(prefillPerDecode={"minPercent": 250, "maxPercent": 200}),
    ),
    "autoscaling-prefill-target": (
        scaled(targets={"waitingRequestsPerPrefill": 4, "tpotMilliseconds": 50}),
        scaled(targets={"tpotMilliseconds": 50, "runningRequestsPerDecode": 32}),
    ),
    "autoscaling-decode-target": (
        scaled(targets={"ttftMilliseconds": 1000, "runningRequestsPerDecode": 32}),
        scaled(targets={"ttftMilliseconds": 1000, "waitingRequestsPerPrefill": 4}),
    ),
    "autoscaling-hpa-per-pod-targets": (
        scaled(engine="hpa", targets=PER_POD),
        scaled(engine="hpa", targets={**PER_POD, "ttftMilliseconds": 1000}),
    ),
    "autoscaling-keda-requires-prometheus": (
        scaled(engine="keda", prometheus=PROMETHEUS),
        scaled(engine="keda"),
    ),
    "autoscaling-prometheus-only-keda": (
        scaled(engine="hpa", targets=PER_POD),
        scaled(prometheus=PROMETHEUS),
    ),
    "autoscaling-ratio-only-builtin": (
        scaled(prefillPerDecode={"minPercent": 50, "maxPercent": 200}),
        scaled(engine="keda", prometheus=PROMETHEUS, prefillPerDecode={"minPercent": 50, "maxPercent": 200}),
    ),
    "autoscaling-windows-ordered": (
        scaled(scaleUpWindowSeconds=60, scaleDownWindowSeconds=60),
        scaled(scaleUpWindowSeconds=61, scaleDownWindowSeconds=60),
    ),
    "autoscaling-scaler-window-bound": (
        scaled(engine="keda", prometheus=PROMETHEUS, scaleDownWindowSeconds=3600),
        scaled(engine="keda", prometheus=PROMETHEUS, scaleDownWindowSeconds=3601),
    ),
    "autoscaling-hpa-prefill-min-replicas": (
        scaled(engine="keda", prometheus=PROMETHEUS, prefill={"minReplicas": 0, "maxReplicas": 2}),
        scaled(engine="hpa", targets=PER_POD, prefill={"minReplicas": 0, "maxReplicas": 2}),
    ),
    "autoscaling-hpa-decode-min-replicas": (
        scaled(engine="hpa", targets=PER_POD, decode={"minReplicas": 1, "maxReplicas": 2}),
        scaled(engine="hpa", targets=PER_POD, decode={"minReplicas": 0, "maxReplicas": 2}),
    ),
    "mock-transport-requires-mock-runtime": (
        {"model": MODEL, "engine": {"runtime": "mock", "transport": {"backend": "mock"}}},
        {"model": MODEL, "engine": {"runtime": "vllm", "transport": {"backend": "mock"}}},
    ),
    "mock-runtime-transport": (
        {"model": MODEL, "engine": {"runtime": "mock", "transport": {"backend": "UCX"}}},
        {"model": MODEL, "engine": {"runtime": "mock", "transport": {"backend": "LIBFABRIC"}}},
    ),
    "mock-runtime-requires-builtin-connector": (
        {"model": MODEL, "mode": "pull", "engine": {"runtime": "mock", "transport": {"backend": "mock"}}},
        {
            "model": MODEL,
            "mode": "pull",
            "engine": {"runtime": "mock", "connector": "vllm", "transport": {"backend": "mock"}},
        },
    ),
    "prefill-engine-id-only-upstream": (
        {"model": MODEL, "mode": "pull"},
        {"model": MODEL, "mode": "pull", "engine": {"prefillEngineId": "p"}},
    ),
    "side-channel-port-distinct": (
        {"model": MODEL, "engine": {"port": 8000, "sideChannelPort": 5600}},
        {"model": MODEL, "engine": {"port": 5600}},
    ),
    "efa-prefill-devices": (
        {"model": MODEL, "network": EFA_ON, "engine": {"transport": {"backend": "LIBFABRIC"}}},
        {
            "model": MODEL,
            "network": {"efa": {"enabled": True, "decodeDevices": 1}},
            "engine": {"transport": {"backend": "LIBFABRIC"}},
        },
    ),
    "efa-decode-devices": (
        {"model": MODEL, "network": EFA_ON, "engine": {"transport": {"backend": "LIBFABRIC"}}},
        {
            "model": MODEL,
            "network": {"efa": {"enabled": True, "prefillDevices": 1}},
            "engine": {"transport": {"backend": "LIBFABRIC"}},
        },
    ),
    "efa-devices-require-enabled": (
        {"model": MODEL, "network": {"efa": {"enabled": False}}},
        {"model": MODEL, "network": {"efa": {"decodeDevices": 4}}},
    ),
    "efa-privileged-requires-enabled": (
        {"model": MODEL, "network": {"efa": {"privileged": False}}},
        {"model": MODEL, "network": {"efa": {"privileged": True}}},
    ),
    "model-source-exactly-one": (
        {"model": {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "m"}}}},
        {"model": {"name": "m", "source": {"huggingFace": {}, "pvc": {"claimName": "weights", "path": "m"}}}},
    ),
    "pvc-path-inside-volume": (
        {"model": {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "models/a..b/x"}}}},
        {"model": {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "models/../etc"}}}},
    ),
    "gpus-cover-the-ranks-of-a-pod": (
        {"model": MODEL, "decode": {"tensorParallelSize": 2, "resources": {"gpus": 0}}},
        {"model": MODEL, "decode": {"tensorParallelSize": 2, "resources": {"gpus": 1}}},
    ),
    "gpus-per-node-divides-the-ranks": (
        {"model": MODEL, "decode": {"tensorParallelSize": 16, "gpusPerNode": 8}},
        {"model": MODEL, "decode": {"tensorParallelSize": 12, "gpusPerNode": 8}},
    ),
    "spanning-pods-take-a-node-of-gpus": (
        {"model": MODEL, "decode": {"tensorParallelSize": 16, "gpusPerNode": 8, "resources": {"gpus": 8}}},
        {"model": MODEL, "decode": {"tensorParallelSize": 16, "gpusPerNode": 8, "resources": {"gpus": 16}}},
    ),
    **{
        f"{role}-pipeline-parallel-needs-upstream-connector": (
            {
                "model": MODEL,
                "mode": "pull",
                "engine": {"connector": "vllm"},
                role: {"pipelineParallelSize": 2},
            },
            {"model": MODEL, role: {"pipelineParallelSize": 2}},
        )
        for role in ("prefill", "decode")
    },
    **{
        f"{role}-spanning-nodes-needs-vllm": (
            {
                "model": MODEL,
                **TP16,
                role: {"tensorParallelSize": 16, "gpusPerNode": 16},
                "engine": MOCK_ENGINE,
            },
            {
                "model": MODEL,
                **TP16,
                role: {"tensorParallelSize": 16, "gpusPerNode": 8},
                "engine": MOCK_ENGINE,
            },
        )
        for role in ("prefill", "decode")
    },
    **{
        f"{role}-spanning-nodes-without-autoscaling": (
            {"model": MODEL, **TP16, role: {"tensorParallelSize": 16, "gpusPerNode": 8}},
            {"model": MODEL, **TP16, role: {"tensorParallelSize": 16, "gpusPerNode": 8}, **AUTOSCALED},
        )
        for role in ("prefill", "decode")
    },
    "toleration-exists-without-value": (
        {"model": MODEL, "prefill": {"tolerations": [{"key": "k", "operator": "Exists"}]}},
        {"model": MODEL, "prefill": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
    ),
    "toleration-empty-key-requires-exists": (
        {"model": MODEL, "prefill": {"tolerations": [{"operator": "Exists"}]}},
        {"model": MODEL, "prefill": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
    ),
    "scrape-peer-selects": (
        {"model": MODEL, "monitoring": {"scrapers": [{"namespaceLabels": {}}]}},
        {"model": MODEL, "monitoring": {"scrapers": [{"namespaceLabels": {}}, {}]}},
    ),
    "toleration-seconds-requires-noexecute": (
        {
            "model": MODEL,
            "decode": {"tolerations": [{"key": "k", "effect": "NoExecute", "tolerationSeconds": 30}]},
        },
        {"model": MODEL, "decode": {"tolerations": [{"key": "k", "tolerationSeconds": 30}]}},
    ),
}


def python_violations(spec: dict[str, Any]) -> set[tuple[str, str]]:
    parsed = PDServiceSpec.model_validate(copy.deepcopy(spec))
    return {(path, rule.message) for path, rule in cel_rule_violations(parsed)}


def test_every_rule_has_samples():
    assert sorted(RULE_SAMPLES) == sorted(rule.name for rule in CEL_RULES)
    assert len({rule.name for rule in CEL_RULES}) == len(CEL_RULES)


@pytest.mark.parametrize("rule", CEL_RULES, ids=lambda rule: rule.name)
def test_cel_and_python_accept_the_good_sample(rule: CelRule, spec_cel_violations):
    good, _ = RULE_SAMPLES[rule.name]
    assert spec_cel_violations(good) == set()
    assert python_violations(good) == set()


@pytest.mark.parametrize("rule", CEL_RULES, ids=lambda rule: rule.name)
def test_cel_and_python_reject_the_bad_sample_with_the_same_error(rule: CelRule, spec_cel_violations):
    _, bad = RULE_SAMPLES[rule.name]
    from_cel = spec_cel_violations(bad)
    assert from_cel == python_violations(bad)
    # The sample breaks exactly this rule, so the rule itself (not a neighbour) is what is tested.
    assert {message for _, message in from_cel} == {rule.message}


def test_rules_on_repeated_objects_report_each_occurrence(spec_cel_violations):
    role = {
        "tensorParallelSize": 2,
        "resources": {"gpus": 1},
        "tolerations": [{"key": "a"}, {"operator": "Exists", "value": "x"}],
    }
    spec = {"model": MODEL, "prefill": role, "decode": role}
    expected = {
        (
            "spec.prefill.resources.gpus",
            "must be 0 (CPU engines) or at least this role's tensorParallelSize x pipelineParallelSize",
        ),
        (
            "spec.decode.resources.gpus",
            "must be 0 (CPU engines) or at least this role's tensorParallelSize x pipelineParallelSize",
        ),
        ("spec.prefill.tolerations[1].value", "must be empty when operator is Exists"),
        ("spec.decode.tolerations[1].value", "must be empty when operator is Exists"),
    }
    assert spec_cel_violations(spec) == expected
    assert python_violations(spec) == expected


@pytest.mark.parametrize(
    "arg",
    [
        "--speculative-config",
        "--speculative_config",
        SPECULATIVE,
        "--speculative_config={}",
        "--speculative-config.method=ngram",
    ],
)
def test_every_spelling_of_the_speculative_flag_is_refused_on_both_roles_of_a_hybrid(
    arg, spec_cel_violations
):
    spec = {
        "model": HYBRID,
        "ssm": MAMBA2,
        "prefill": {"extraArgs": ["--enforce-eager", arg]},
        "decode": {"extraArgs": [arg, "{}"]},
    }
    message = (
        "--speculative-config is not supported with architecture hybrid-ssm "
        "(speculative decoding adds Mamba state slots the KV connector does not transfer)"
    )
    expected = {("spec.prefill.extraArgs", message), ("spec.decode.extraArgs", message)}
    assert spec_cel_violations(spec) == expected
    assert python_violations(spec) == expected
    dense = {key: value for key, value in spec.items() if key != "ssm"} | {"model": MODEL}
    assert spec_cel_violations(dense) == python_violations(dense) == set()


def test_the_mock_engine_and_the_upstream_connector_keep_accepting_mamba1(spec_cel_violations):
    for spec in (
        MAMBA1_MOCK,
        {"model": HYBRID, "ssm": {"family": "mamba1"}, "mode": "pull", "engine": {"connector": "vllm"}},
    ):
        assert spec_cel_violations(spec) == python_violations(spec) == set()


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields)


_tolerations = st.lists(
    _optional(
        key=st.sampled_from(["", "nvidia.com/gpu"]),
        operator=st.sampled_from(["Exists", "Equal"]),
        value=st.sampled_from(["", "v"]),
        effect=st.sampled_from(["NoSchedule", "NoExecute"]),
        tolerationSeconds=st.integers(0, 60),
    ),
    max_size=2,
)
_role = _optional(
    replicas=st.integers(0, 3),
    tensorParallelSize=st.sampled_from([1, 2, 3, 4, 8]),
    resources=_optional(gpus=st.integers(0, 9)),
    enablePrefixCaching=st.booleans(),
    tolerations=_tolerations,
    extraArgs=st.lists(
        st.sampled_from(
            [
                "--enforce-eager",
                "--speculative-config",
                SPECULATIVE,
                "--speculative_config.method=ngram",
                "{}",
            ]
        ),
        max_size=2,
    ),
)
_pvc = st.fixed_dictionaries(
    {"claimName": st.just("weights"), "path": st.sampled_from(["m", "a/../b", "..", "a..b", "a/.."])}
)
_specs = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries(
            {"name": st.just("m"), "architecture": st.sampled_from(["dense", "hybrid-ssm", "mla"])},
            optional={"source": _optional(huggingFace=st.just({}), pvc=_pvc)},
        )
    },
    optional={
        "mode": st.sampled_from(["push", "pull"]),
        "ssm": st.fixed_dictionaries(
            {"family": st.sampled_from(["mamba2", "mamba1", "gdn"])},
            optional={"convStateLayout": st.sampled_from(["DS", "SD"])},
        ),
        "prefill": _role,
        "decode": _role,
        "engine": _optional(
            runtime=st.sampled_from(["vllm", "mock"]),
            connector=st.sampled_from(["builtin", "vllm"]),
            transport=_optional(backend=st.sampled_from(["LIBFABRIC", "UCX", "mock"])),
            port=st.sampled_from([8000, 5600]),
            sideChannelPort=st.sampled_from([5600, 8000]),
            prefillEngineId=st.just("prefill-0"),
        ),
        "router": _optional(policy=st.sampled_from(["least-loaded", "round-robin", "cache-aware"])),
        "network": _optional(
            efa=_optional(
                enabled=st.booleans(),
                prefillDevices=st.integers(0, 2),
                decodeDevices=st.integers(0, 2),
                privileged=st.booleans(),
            )
        ),
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_specs)
def test_cel_and_python_agree_on_random_specs(spec, spec_cel_violations):
    assert spec_cel_violations(spec) == python_violations(spec)
