"""The table of bad PDServices: each one is rejected with exactly these errors (field path + message)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pdoperator.api import API_VERSION, PDServiceSpec, SpecError, parse_pdservice, validate_spec

DELETE = object()
HYBRID = {"name": "m", "architecture": "hybrid-ssm"}
EFA_LIBFABRIC = {
    "network": {"efa": {"enabled": True, "prefillDevices": 2, "decodeDevices": 2}},
    "engine": {"transport": {"backend": "LIBFABRIC"}},
    "prefill": {"resources": {"memory": "64Gi"}},
    "decode": {"resources": {"cpu": "8"}},
}
MOCK_ENGINE = {"engine": {"runtime": "mock", "transport": {"backend": "mock"}}}


def _merge(base: Any, patch: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    merged = dict(base)
    for key, value in patch.items():
        if value is DELETE:
            merged.pop(key, None)
        else:
            merged[key] = _merge(base.get(key), value)
    return merged


def document(spec: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A valid PDService with ``spec`` merged into its spec and ``top`` into the object."""
    base = {
        "apiVersion": API_VERSION,
        "kind": "PDService",
        "metadata": {"name": "svc", "namespace": "ns"},
        "spec": {"model": {"name": "m"}},
    }
    return _merge(base, {**top, "spec": spec or {}})


CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    # ------------------------------------------------------------ object level
    (
        "wrong apiVersion",
        document(apiVersion="v1"),
        ['apiVersion: must be inference.pdoperator.dev/v1alpha1 (got "v1")'],
    ),
    ("wrong kind", document(kind="Deployment"), ['kind: must be PDService (got "Deployment")']),
    ("unknown top-level field", document(specs={}), ["specs: unknown field"]),
    ("no metadata", document(metadata=DELETE), ["metadata: required"]),
    ("no name", document(metadata={"name": DELETE}), ["metadata.name: required"]),
    (
        "name with capitals",
        document(metadata={"name": "Qwen3"}),
        [
            "metadata.name: must start with a lowercase letter, end with a letter or digit, and contain "
            "only lowercase letters, digits and '-'"
        ],
    ),
    (
        "name too long for child objects",
        document(metadata={"name": "a" * 45}),
        [
            "metadata.name: must be at most 44 characters (child StatefulSets add '-prefill' and a revision "
            "hash)"
        ],
    ),
    (
        "namespace not a DNS label",
        document(metadata={"namespace": "Team_A"}),
        [
            "metadata.namespace: must be a DNS label: at most 63 lowercase letters, digits and '-', "
            "starting and ending alphanumeric"
        ],
    ),
    (
        "generation not a number",
        document(metadata={"generation": "one"}),
        ['metadata.generation: must be a non-negative integer (got "one")'],
    ),
    ("no spec", {key: value for key, value in document().items() if key != "spec"}, ["spec: required"]),
    ("spec is a list", {**document(), "spec": [1]}, ["spec: must be an object (got [1])"]),
    # ------------------------------------------------------------ structure: types, enums, bounds, patterns
    ("no model", document({"model": DELETE}), ["spec.model: required"]),
    ("empty model name", document({"model": {"name": ""}}), ["spec.model.name: must not be empty"]),
    ("misspelled role", document({"prefil": {}}), ["spec.prefil: unknown field (did you mean prefill?)"]),
    (
        "mode not an enum value",
        document({"mode": "pul"}),
        ["spec.mode: must be 'push' or 'pull' (got \"pul\")"],
    ),
    (
        "dtype not supported",
        document({"model": {"dtype": "fp8"}}),
        ["spec.model.dtype: must be 'auto', 'bfloat16', 'float16' or 'float32' (got \"fp8\")"],
    ),
    (
        "context too short",
        document({"model": {"maxModelLen": 8}}),
        ["spec.model.maxModelLen: must be at least 16 (got 8)"],
    ),
    (
        "TP zero",
        document({"prefill": {"tensorParallelSize": 0}}),
        ["spec.prefill.tensorParallelSize: must be at least 1 (got 0)"],
    ),
    (
        "TP as a string",
        document({"decode": {"tensorParallelSize": "8"}}),
        ['spec.decode.tensorParallelSize: must be an integer (got "8")'],
    ),
    (
        "TP as a float",
        document({"decode": {"tensorParallelSize": 2.5}}),
        ["spec.decode.tensorParallelSize: must be an integer (got 2.5)"],
    ),
    (
        "negative replicas",
        document({"prefill": {"replicas": -1}}),
        ["spec.prefill.replicas: must be at least 0 (got -1)"],
    ),
    (
        "prefix caching as text",
        document({"decode": {"enablePrefixCaching": "no"}}),
        ['spec.decode.enablePrefixCaching: must be true or false (got "no")'],
    ),
    (
        "transport backend unknown",
        document({"engine": {"transport": {"backend": "TCP"}}}),
        ["spec.engine.transport.backend: must be 'LIBFABRIC', 'UCX' or 'mock' (got \"TCP\")"],
    ),
    (
        "privileged side-channel port",
        document({"engine": {"sideChannelPort": 80}}),
        ["spec.engine.sideChannelPort: must be at least 1024 (got 80)"],
    ),
    (
        "router port out of range",
        document({"router": {"port": 70000}}),
        ["spec.router.port: must be at most 65535 (got 70000)"],
    ),
    (
        "router policy unknown",
        document({"router": {"policy": "random"}}),
        ["spec.router.policy: must be 'least-loaded', 'round-robin' or 'cache-aware' (got \"random\")"],
    ),
    (
        "cache-aware routing of a hybrid model",
        document({"model": HYBRID, "ssm": {"family": "mamba2"}, "router": {"policy": "cache-aware"}}),
        [
            "spec.router.policy: cache-aware is not supported with architecture hybrid-ssm (its engines run "
            "without prefix caching, so there is no cache to route to)"
        ],
    ),
    (
        "cache-aware routing without prefill prefix caching",
        document({"router": {"policy": "cache-aware"}, "prefill": {"enablePrefixCaching": False}}),
        [
            "spec.prefill.enablePrefixCaching: must not be false under spec.router.policy cache-aware (it "
            "routes prompts to the prefill caching their prefix)"
        ],
    ),
    (
        "cache-aware routing with a block size of the user's",
        document({"router": {"policy": "cache-aware"}, "prefill": {"extraArgs": ["--block-size=32"]}}),
        [
            "spec.prefill.extraArgs[0]: --block-size is set by the operator; use "
            "spec.router.cacheAware.blockSize under the cache-aware policy"
        ],
    ),
    (
        "cache-aware routing with hash seeds that differ",
        document(
            {
                "router": {"policy": "cache-aware"},
                "prefill": {"env": [{"name": "PYTHONHASHSEED", "value": "1"}]},
                "decode": {"env": [{"name": "PYTHONHASHSEED", "value": "2"}]},
            }
        ),
        [
            "spec.decode.env[0].value: PYTHONHASHSEED must equal spec.prefill's ('1', got '2') under the "
            "cache-aware policy (it seeds the block hashes the router matches)"
        ],
    ),
    (
        "cache-aware block size out of range",
        document({"router": {"policy": "cache-aware", "cacheAware": {"blockSize": 0}}}),
        ["spec.router.cacheAware.blockSize: must be at least 1 (got 0)"],
    ),
    (
        "router retries out of range",
        document({"router": {"retries": {"attempts": 0, "budgetSeconds": 7200}}}),
        [
            "spec.router.retries.attempts: must be at least 1 (got 0)",
            "spec.router.retries.budgetSeconds: must be at most 3600 (got 7200)",
        ],
    ),
    (
        "api key ref without key",
        document({"router": {"apiKeySecretRef": {"name": "api"}}}),
        ["spec.router.apiKeySecretRef.key: required"],
    ),
    (
        "memory not a quantity",
        document({"prefill": {"resources": {"memory": "lots"}}}),
        ['spec.prefill.resources.memory: must be a Kubernetes quantity such as 16Gi, 500m or 2 (got "lots")'],
    ),
    (
        "cpu as a bare number",
        document({"decode": {"resources": {"cpu": 2}}}),
        ["spec.decode.resources.cpu: must be a string (got 2); quote values like 1 or 500m in YAML"],
    ),
    (
        "node selector value not a string",
        document({"prefill": {"nodeSelector": {"zone": 1}}}),
        ["spec.prefill.nodeSelector[zone]: must be a string (got 1); quote values like 1 or 500m in YAML"],
    ),
    (
        "toleration effect unknown",
        document({"prefill": {"tolerations": [{"key": "k", "effect": "Sometimes"}]}}),
        [
            "spec.prefill.tolerations[0].effect: must be 'NoSchedule', 'PreferNoSchedule' or 'NoExecute' "
            '(got "Sometimes")'
        ],
    ),
    (
        "env name starting with a digit",
        document({"decode": {"env": [{"name": "1X", "value": "v"}]}}),
        [
            "spec.decode.env[0].name: must be an environment variable name: letters, digits, '_', '-' and "
            "'.', not starting with a digit (got \"1X\")"
        ],
    ),
    (
        "extraArgs not a list",
        document({"prefill": {"extraArgs": "--foo"}}),
        ['spec.prefill.extraArgs: must be a list (got "--foo")'],
    ),
    ("role not an object", document({"decode": "big"}), ['spec.decode: must be an object (got "big")']),
    (
        "PVC claim name with capitals",
        document({"model": {"source": {"pvc": {"claimName": "Weights", "path": "m"}}}}),
        [
            "spec.model.source.pvc.claimName: must be a DNS subdomain: lowercase letters, digits, '-' and "
            "'.', "
            'starting and ending alphanumeric (got "Weights")'
        ],
    ),
    (
        "absolute PVC path",
        document({"model": {"source": {"pvc": {"claimName": "weights", "path": "/models/m"}}}}),
        [
            "spec.model.source.pvc.path: must be a path relative to the volume root (no leading '/') (got "
            '"/models/m")'
        ],
    ),
    (
        "ssm without family",
        document({"model": HYBRID, "ssm": {"convStateLayout": "DS"}}),
        ["spec.ssm.family: required"],
    ),
    # ------------------------------------------------------------ CEL rules
    (
        "hybrid without ssm",
        document({"model": HYBRID}),
        ["spec.ssm: required when spec.model.architecture is hybrid-ssm"],
    ),
    (
        "dense with ssm",
        document({"ssm": {"family": "mamba2"}}),
        ["spec.ssm: must not be set unless spec.model.architecture is hybrid-ssm"],
    ),
    (
        "heterogeneous TP with SD layout",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba2", "convStateLayout": "SD"},
                "decode": {"tensorParallelSize": 2},
            }
        ),
        [
            "spec.ssm.convStateLayout: must be DS when spec.prefill.tensorParallelSize differs from "
            "spec.decode.tensorParallelSize "
            "(each decode rank needs its shard of x, B and C contiguous)"
        ],
    ),
    (
        "upstream connector with SD layout",
        document(
            {
                "model": HYBRID,
                "mode": "pull",
                "ssm": {"family": "gdn", "convStateLayout": "SD"},
                "engine": {"connector": "vllm"},
            }
        ),
        [
            "spec.ssm.convStateLayout: must be DS with spec.engine.connector vllm "
            "(upstream NIXL connectors transfer SSM conv state only in the DS layout)"
        ],
    ),
    (
        "mamba1 with heterogeneous TP",
        document(
            {"model": HYBRID, "ssm": {"family": "mamba1"}, "decode": {"tensorParallelSize": 2}, **MOCK_ENGINE}
        ),
        [
            "spec.ssm.family: mamba1 requires spec.prefill.tensorParallelSize to equal "
            "spec.decode.tensorParallelSize "
            "(heterogeneous TP is unsupported for Mamba1)"
        ],
    ),
    (
        "mamba1 through vLLM with the builtin connector",
        document({"model": HYBRID, "ssm": {"family": "mamba1"}}),
        [
            "spec.ssm.family: mamba1 is supported by the mock engine only (spec.engine.runtime mock); "
            "PDConnector serves mamba2 and gdn hybrids through vLLM"
        ],
    ),
    (
        "mamba1 through vLLM with heterogeneous TP",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba1"},
                "prefill": {"tensorParallelSize": 2},
                "decode": {"tensorParallelSize": 4},
            }
        ),
        [
            "spec.ssm.family: mamba1 requires spec.prefill.tensorParallelSize to equal "
            "spec.decode.tensorParallelSize "
            "(heterogeneous TP is unsupported for Mamba1)",
            "spec.ssm.family: mamba1 is supported by the mock engine only (spec.engine.runtime mock); "
            "PDConnector serves mamba2 and gdn hybrids through vLLM",
        ],
    ),
    (
        "dense model with prefill TP above decode TP",
        document({"prefill": {"tensorParallelSize": 2}}),
        [
            "spec.prefill.tensorParallelSize: may exceed spec.decode.tensorParallelSize only when "
            "spec.model.architecture is hybrid-ssm or mla"
        ],
    ),
    (
        "TP sizes that do not divide",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba2"},
                "prefill": {"tensorParallelSize": 3},
                "decode": {"tensorParallelSize": 2},
            }
        ),
        ["spec.decode.tensorParallelSize: must divide or be a multiple of spec.prefill.tensorParallelSize"],
    ),
    (
        "hybrid prefill with prefix caching",
        document({"model": HYBRID, "ssm": {"family": "gdn"}, "prefill": {"enablePrefixCaching": True}}),
        [
            "spec.prefill.enablePrefixCaching: must not be true for hybrid-ssm models (on GPUs vLLM then "
            "keeps Mamba state in its "
            "'align' cache mode, whose state block placement the KV connector does not model)"
        ],
    ),
    (
        "hybrid decode with prefix caching",
        document({"model": HYBRID, "ssm": {"family": "mamba2"}, "decode": {"enablePrefixCaching": True}}),
        [
            "spec.decode.enablePrefixCaching: must not be true for hybrid-ssm models (decode prefix caching "
            "breaks on SSM state received over NIXL)"
        ],
    ),
    (
        "hybrid prefill with speculative decoding",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba2"},
                "prefill": {"extraArgs": ['--speculative-config={"method":"ngram"}']},
            }
        ),
        [
            "spec.prefill.extraArgs: --speculative-config is not supported with architecture hybrid-ssm "
            "(speculative decoding adds Mamba state slots the KV connector does not transfer)"
        ],
    ),
    (
        "hybrid decode with speculative decoding in underscore spelling",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba2"},
                "decode": {"extraArgs": ["--enforce-eager", "--speculative_config", "{}"]},
            }
        ),
        [
            "spec.decode.extraArgs: --speculative-config is not supported with architecture hybrid-ssm "
            "(speculative decoding adds Mamba state slots the KV connector does not transfer)"
        ],
    ),
    (
        "hybrid with speculative decoding and prefix caching on both roles",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "gdn"},
                "prefill": {"enablePrefixCaching": True, "extraArgs": ["--speculative_config.method=ngram"]},
                "decode": {"enablePrefixCaching": True, "extraArgs": ["--speculative-config", "{}"]},
            }
        ),
        [
            "spec.prefill.enablePrefixCaching: must not be true for hybrid-ssm models (on GPUs vLLM then "
            "keeps Mamba state in its "
            "'align' cache mode, whose state block placement the KV connector does not model)",
            "spec.decode.enablePrefixCaching: must not be true for hybrid-ssm models (decode prefix caching "
            "breaks on SSM state received over NIXL)",
            "spec.prefill.extraArgs: --speculative-config is not supported with architecture hybrid-ssm "
            "(speculative decoding adds Mamba state slots the KV connector does not transfer)",
            "spec.decode.extraArgs: --speculative-config is not supported with architecture hybrid-ssm "
            "(speculative decoding adds Mamba state slots the KV connector does not transfer)",
        ],
    ),
    (
        "EFA over UCX",
        document(_merge(EFA_LIBFABRIC, {"engine": {"transport": {"backend": "UCX"}}})),
        [
            "spec.engine.transport.backend: must be LIBFABRIC when spec.network.efa.enabled is true (UCX on "
            "EFA silently falls back to TCP)"
        ],
    ),
    (
        "upstream push without a prefill engine id",
        document({"engine": {"connector": "vllm"}}),
        [
            "spec.engine.prefillEngineId: required when spec.mode is push and spec.engine.connector is vllm "
            "(the upstream push connector needs a fixed prefill engine id)"
        ],
    ),
    (
        "fixed prefill engine id on two replicas",
        document({"engine": {"connector": "vllm", "prefillEngineId": "prefill"}, "prefill": {"replicas": 2}}),
        [
            "spec.prefill.replicas: must be at most 1 when spec.engine.prefillEngineId is set "
            "(prefill pods sharing one engine id would alias each other)"
        ],
    ),
    (
        "mock transport with vLLM engines",
        document({"engine": {"transport": {"backend": "mock"}}}),
        [
            "spec.engine.transport.backend: mock requires spec.engine.runtime mock (vLLM engines move KV "
            "over NIXL)"
        ],
    ),
    (
        "mock engines over LIBFABRIC",
        document({"engine": {"runtime": "mock", "transport": {"backend": "LIBFABRIC"}}}),
        [
            "spec.engine.transport.backend: must be mock or UCX when spec.engine.runtime is mock (mock "
            "engines move KV over TCP or NIXL's UCX backend)"
        ],
    ),
    (
        "mock engines with the upstream connector",
        document({"mode": "pull", **_merge(MOCK_ENGINE, {"engine": {"connector": "vllm"}})}),
        ["spec.engine.connector: must be builtin when spec.engine.runtime is mock"],
    ),
    (
        "prefill engine id with the builtin connector",
        document({"engine": {"prefillEngineId": "prefill"}}),
        [
            "spec.engine.prefillEngineId: may only be set with spec.engine.connector vllm (the builtin "
            "connector derives engine ids from pod names)"
        ],
    ),
    (
        "side channel on the HTTP port",
        document({"engine": {"sideChannelPort": 8000}}),
        ["spec.engine.sideChannelPort: must differ from spec.engine.port"],
    ),
    (
        "EFA without prefill devices",
        document(_merge(EFA_LIBFABRIC, {"network": {"efa": {"prefillDevices": 0}}})),
        ["spec.network.efa.prefillDevices: must be greater than 0 when spec.network.efa.enabled is true"],
    ),
    (
        "EFA without decode devices",
        document(_merge(EFA_LIBFABRIC, {"network": {"efa": {"decodeDevices": 0}}})),
        ["spec.network.efa.decodeDevices: must be greater than 0 when spec.network.efa.enabled is true"],
    ),
    (
        "EFA devices while EFA is off",
        document({"network": {"efa": {"prefillDevices": 16}}}),
        ["spec.network.efa: prefillDevices and decodeDevices must be 0 unless enabled is true"],
    ),
    (
        "privileged while EFA is off",
        document({"network": {"efa": {"privileged": True}}}),
        ["spec.network.efa.privileged: must be false unless spec.network.efa.enabled is true"],
    ),
    (
        "empty model source",
        document({"model": {"source": {}}}),
        ["spec.model.source: exactly one of huggingFace or pvc must be set"],
    ),
    (
        "two model sources",
        document({"model": {"source": {"huggingFace": {}, "pvc": {"claimName": "weights", "path": "m"}}}}),
        ["spec.model.source: exactly one of huggingFace or pvc must be set"],
    ),
    (
        "PVC path escaping the volume",
        document({"model": {"source": {"pvc": {"claimName": "weights", "path": "m/../../etc"}}}}),
        ["spec.model.source.pvc.path: must not contain '..' segments"],
    ),
    (
        "fewer GPUs than TP",
        document(
            {
                "prefill": {"tensorParallelSize": 4, "resources": {"gpus": 2}},
                "decode": {"tensorParallelSize": 4},
            }
        ),
        [
            "spec.prefill.resources.gpus: must be 0 (CPU engines) or at least this role's "
            "tensorParallelSize x pipelineParallelSize"
        ],
    ),
    (
        "Exists toleration with a value",
        document({"decode": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "true"}]}}),
        ["spec.decode.tolerations[0].value: must be empty when operator is Exists"],
    ),
    (
        "keyless Equal toleration",
        document({"decode": {"tolerations": [{"key": "a"}, {"value": "x"}]}}),
        [
            "spec.decode.tolerations[1].operator: must be Exists when key is empty (an empty key matches "
            "every taint)"
        ],
    ),
    (
        "toleration seconds without NoExecute",
        document(
            {"prefill": {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}}
        ),
        ["spec.prefill.tolerations[0].tolerationSeconds: may only be set when effect is NoExecute"],
    ),
    # ------------------------------------------------------------ beyond CEL
    (
        "TP flag in extraArgs",
        document({"prefill": {"extraArgs": ["--enforce-eager", "--tensor-parallel-size=4"]}}),
        [
            "spec.prefill.extraArgs[1]: --tensor-parallel-size is set by the operator; use "
            "spec.prefill.tensorParallelSize"
        ],
    ),
    (
        "KV transfer config through a dotted underscore flag",
        document({"decode": {"extraArgs": ["--kv_transfer_config.kv_connector=X"]}}),
        [
            "spec.decode.extraArgs[0]: --kv-transfer-config is set by the operator; use spec.mode, "
            "spec.engine.connector and spec.engine.transport"
        ],
    ),
    (
        "short TP flag",
        document({"decode": {"extraArgs": ["-tp", "2"]}}),
        ["spec.decode.extraArgs[0]: -tp is set by the operator; use spec.decode.tensorParallelSize"],
    ),
    (
        "data parallelism",
        document({"prefill": {"extraArgs": ["--data-parallel-size", "2"]}}),
        [
            "spec.prefill.extraArgs[0]: --data-parallel-size is not supported: "
            "data-parallel ranks need extra side-channel ports; scale spec.prefill.replicas instead"
        ],
    ),
    (
        "engine id flag for mock engines",
        document({**MOCK_ENGINE, "decode": {"extraArgs": ["--engine-id=x"]}}),
        [
            "spec.decode.extraArgs[0]: --engine-id is set by the operator; the operator derives it from the "
            "pod name"
        ],
    ),
    (
        "conv layout through env",
        document({"prefill": {"env": [{"name": "VLLM_SSM_CONV_STATE_LAYOUT", "value": "SD"}]}}),
        [
            "spec.prefill.env[0].name: VLLM_SSM_CONV_STATE_LAYOUT is set by the operator; use "
            "spec.ssm.convStateLayout"
        ],
    ),
    (
        "side channel host through env",
        document({"decode": {"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"}]}}),
        [
            "spec.decode.env[0].name: VLLM_NIXL_SIDE_CHANNEL_HOST is set by the operator; the operator sets "
            "it to the pod IP"
        ],
    ),
    (
        "libfabric provider through env with EFA on",
        document(_merge(EFA_LIBFABRIC, {"decode": {"env": [{"name": "FI_PROVIDER", "value": "tcp"}]}})),
        [
            "spec.decode.env[0].name: FI_PROVIDER is set by the operator; the operator sets it when "
            "spec.network.efa.enabled is true"
        ],
    ),
    (
        "duplicate env names",
        document(
            {"prefill": {"env": [{"name": "A", "value": "1"}, {"name": "B"}, {"name": "A", "value": "2"}]}}
        ),
        ["spec.prefill.env[2]: duplicate name A (first set in env[0])"],
    ),
    (
        "node selector key with a space",
        document({"decode": {"nodeSelector": {"instance type": "p5"}}}),
        [
            "spec.decode.nodeSelector[instance type]: key must be a label key: an optional DNS subdomain "
            "and '/', then at most 63 "
            "letters, digits, '-', '_' or '.'"
        ],
    ),
    (
        "node selector value too long",
        document({"decode": {"nodeSelector": {"pool": "p" * 64}}}),
        [
            "spec.decode.nodeSelector[pool]: value must be a label value: at most 63 letters, digits, '-', "
            "'_' or '.', starting and "
            "ending alphanumeric"
        ],
    ),
    (
        "metrics scraper that selects nothing",
        document({"monitoring": {"scrapers": [{"podLabels": {"app": "prometheus"}}, {}]}}),
        ["spec.monitoring.scrapers[1]: set namespaceLabels, podLabels or both ({} selects all)"],
    ),
    (
        "metrics scraper with a bad namespace label key",
        document(
            {
                "monitoring": {
                    "scrapers": [
                        {"namespaceLabels": {"kubernetes.io/metadata.name": "monitoring", "team name": "obs"}}
                    ]
                }
            }
        ),
        [
            "spec.monitoring.scrapers[0].namespaceLabels[team name]: key must be a label key: an optional "
            "DNS subdomain and '/', then "
            "at most 63 letters, digits, '-', '_' or '.'"
        ],
    ),
    (
        "metrics scraper with a bad pod label value",
        document({"monitoring": {"scrapers": [{"podLabels": {"app": "-prometheus"}}]}}),
        [
            "spec.monitoring.scrapers[0].podLabels[app]: value must be a label value: at most 63 letters, "
            "digits, '-', '_' or '.', "
            "starting and ending alphanumeric"
        ],
    ),
    (
        "too many metrics scrapers",
        document({"monitoring": {"scrapers": [{"podLabels": {}}] * 17}}),
        ["spec.monitoring.scrapers: must have at most 16 items"],
    ),
    (
        "zero CPU",
        document({"prefill": {"resources": {"cpu": "0"}}}),
        ["spec.prefill.resources.cpu: must be a positive Kubernetes quantity such as 500m or 2"],
    ),
    (
        "malformed memory that the pattern lets through",
        document({"prefill": {"resources": {"memory": "1.2.3Gi"}}}),
        ["spec.prefill.resources.memory: must be a positive Kubernetes quantity such as 1Gi"],
    ),
    (
        "decode tier on a hybrid model",
        document(
            {
                "model": HYBRID,
                "ssm": {"family": "mamba2"},
                "kvCache": {"offload": {"decode": {"hostMemory": "64Gi"}}},
                "decode": {"resources": {"memory": "96Gi"}},
            }
        ),
        [
            "spec.kvCache.offload.decode: must not be set for hybrid-ssm models (the tier holds attention "
            "blocks; SSM state is not tiered)"
        ],
    ),
    (
        "decode tier on mock engines",
        document(
            _merge(
                MOCK_ENGINE,
                {
                    "kvCache": {"offload": {"decode": {"hostMemory": "1Gi"}}},
                    "decode": {"resources": {"memory": "2Gi", "shmSize": "1Gi"}},
                },
            )
        ),
        [
            "spec.kvCache.offload.decode: needs spec.engine.connector builtin and spec.engine.runtime vllm "
            "(the tier is PDConnector's)"
        ],
    ),
    (
        "decode tier without pod memory",
        document({"kvCache": {"offload": {"decode": {"hostMemory": "64Gi"}}}}),
        [
            "spec.decode.resources.memory: required when spec.kvCache.offload.decode is set (the pod's "
            "memory request and limit grow by the tier's hostMemory)"
        ],
    ),
    (
        "decode tier smaller than a MiB per rank",
        document(
            {
                "kvCache": {"offload": {"decode": {"hostMemory": "1Mi"}}},
                "decode": {"tensorParallelSize": 2, "resources": {"memory": "96Gi"}},
            }
        ),
        [
            "spec.kvCache.offload.decode.hostMemory: must be a Kubernetes quantity of at least 2Mi (1Mi for "
            "each of the 2 ranks of a decode pod), such as 64Gi"
        ],
    ),
    (
        "prefill tier without pod memory, and smaller than a MiB per rank",
        document({"kvCache": {"offload": {"prefill": {"hostMemory": "512Ki"}}}}),
        [
            "spec.prefill.resources.memory: required when spec.kvCache.offload.prefill is set (the pod's "
            "memory request and limit grow by the tier's hostMemory)",
            "spec.kvCache.offload.prefill.hostMemory: must be a Kubernetes quantity of at least 1Mi (1Mi for "
            "each of the 1 ranks of a prefill pod), such as 64Gi",
        ],
    ),
    (
        "decode tier size not a quantity",
        document(
            {
                "kvCache": {"offload": {"decode": {"hostMemory": "lots"}}},
                "decode": {"resources": {"memory": "96Gi"}},
            }
        ),
        [
            "spec.kvCache.offload.decode.hostMemory: must be a Kubernetes quantity such as 16Gi, 500m or 2 "
            '(got "lots")'
        ],
    ),
    (
        "shm larger than memory",
        document({"decode": {"resources": {"memory": "8Gi"}}}),
        [
            "spec.decode.resources.shmSize: must not exceed spec.decode.resources.memory "
            "(the memory-backed /dev/shm counts against the memory limit; shmSize defaults to 16Gi)"
        ],
    ),
    (
        "EFA hugepages without cpu or memory on a role",
        document(_merge(EFA_LIBFABRIC, {"decode": {"resources": {"cpu": DELETE}}})),
        [
            "spec.decode.resources: must set cpu or memory when spec.network.efa requests hugepages "
            "(Kubernetes rejects pods that request hugepages without a cpu or memory request)"
        ],
    ),
    (
        "hugepages not whole 2Mi pages",
        document({"network": {"efa": {"hugepages": "3Mi"}}}),
        ["spec.network.efa.hugepages: must be a whole number of 2Mi pages such as 5Gi (or 0)"],
    ),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 40
    assert len({name for name, _, _ in CASES}) == len(CASES)


def test_the_base_document_is_valid():
    parsed = parse_pdservice(document())
    assert (parsed.namespace, parsed.name) == ("ns", "svc")


@pytest.mark.parametrize(
    ("document", "expected"),
    [(doc, expected) for _, doc, expected in CASES],
    ids=[name for name, _, _ in CASES],
)
def test_bad_spec_is_rejected_with_exact_errors(document, expected):
    with pytest.raises(SpecError) as caught:
        parse_pdservice(document)
    assert [str(error) for error in caught.value.errors] == expected


def test_all_problems_are_reported_together():
    bad = document(
        {"mode": "both", "model": HYBRID, "prefill": {"env": [{"name": "HF_TOKEN", "value": "x"}]}},
        metadata={"name": "Bad"},
    )
    with pytest.raises(SpecError) as caught:
        parse_pdservice(bad)
    # Metadata problems come with the structural ones; semantic checks need a spec that parses.
    assert [str(error) for error in caught.value.errors] == [
        "metadata.name: must start with a lowercase letter, end with a letter or digit, and contain only "
        "lowercase letters, digits and '-'",
        "spec.mode: must be 'push' or 'pull' (got \"both\")",
    ]
    fixed = _merge(bad, {"spec": {"mode": "push"}})
    with pytest.raises(SpecError) as caught:
        parse_pdservice(fixed)
    assert [str(error) for error in caught.value.errors] == [
        "metadata.name: must start with a lowercase letter, end with a letter or digit, and contain only "
        "lowercase letters, digits and '-'",
        "spec.ssm: required when spec.model.architecture is hybrid-ssm",
        "spec.prefill.env[0].name: HF_TOKEN is set by the operator; use "
        "spec.model.source.huggingFace.tokenSecretRef",
    ]


def test_autoscaling_bounds_that_no_ratio_admits_are_reported_on_spec_autoscaling():
    spec = PDServiceSpec.model_validate(
        {
            "model": {"name": "m"},
            "autoscaling": {
                "prefill": {"minReplicas": 4, "maxReplicas": 4},
                "decode": {"minReplicas": 1, "maxReplicas": 1},
                "targets": {"ttftMilliseconds": 500, "tpotMilliseconds": 40},
                "prefillPerDecode": {"minPercent": 50, "maxPercent": 200},
            },
        }
    )
    errors = validate_spec(spec, "m")
    assert [e.path for e in errors] == ["spec.autoscaling"]
    assert "keep the ratio" in errors[0].message


def test_an_hpa_role_must_keep_an_engine_and_its_window_fit_an_hpa():
    spec = PDServiceSpec.model_validate(
        {
            "model": {"name": "m"},
            "autoscaling": {
                "engine": "hpa",
                "prefill": {"minReplicas": 0, "maxReplicas": 2},
                "decode": {"maxReplicas": 2},
                "targets": {"waitingRequestsPerPrefill": 4, "runningRequestsPerDecode": 16},
                "scaleDownWindowSeconds": 7200,
            },
        }
    )
    assert [str(e) for e in validate_spec(spec, "m")] == [
        "spec.autoscaling.scaleDownWindowSeconds: must be at most 3600 when engine is hpa or keda "
        "(the longest stabilization window of a HorizontalPodAutoscaler)",
        "spec.autoscaling.prefill.minReplicas: must be at least 1 when engine is hpa (use keda or builtin to "
        "scale to zero)",
    ]
