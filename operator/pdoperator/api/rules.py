"""Cross-field rules of the PDService API, each written once in CEL and once in Python.

The CEL text goes into the CRD as ``x-kubernetes-validations`` on every schema node
generated from the rule's ``owner`` model, so the API server enforces it; the Python
twin (``holds``) runs in ``pdoperator.api.validation`` on the parsed model, so
``pdctl validate`` and the operator report the same error at the same path.
Tests evaluate the CEL text with a CEL interpreter and check that both agree.

CEL sees the object after the API server applied the schema defaults, exactly
like ``holds`` sees the pydantic model with its defaults: optional fields without
a default are guarded with ``has()`` in CEL and ``is not None`` in Python.
"""

from __future__ import annotations

from pdoperator.api.autoscaling import AutoscalingEngine, AutoscalingSpec, RatioRange, ReplicaRange
from pdoperator.api.cel import CelRule, Reason
from pdoperator.api.model import (
    Architecture,
    ConnectorImpl,
    ConvLayout,
    EFASpec,
    EngineSpec,
    ModelSource,
    PDServiceSpec,
    PVCSource,
    Runtime,
    ScrapePeer,
    SsmFamily,
    TransferMode,
    TransportBackend,
)
from pdoperator.api.parallel_rules import PARALLEL_RULES
from pdoperator.api.roles import RoleSpec, Toleration
from pdoperator.api.routing import RoutingPolicy


def _tp_differs(spec: PDServiceSpec) -> bool:
    return spec.prefill.tensor_parallel_size != spec.decode.tensor_parallel_size


_HYBRID = f"'{Architecture.HYBRID_SSM}'"

# vLLM reads both spellings, also as --flag=value or --flag.key=value.
_SPECULATIVE_FLAGS = ("--speculative-config", "--speculative_config")


def _no_speculative_args(spec: PDServiceSpec, role: RoleSpec) -> bool:
    return spec.model.architecture != Architecture.HYBRID_SSM or not any(
        arg.startswith(_SPECULATIVE_FLAGS) for arg in role.extra_args
    )


def _no_speculative_decoding_rule(role: str) -> CelRule:
    """Hybrid engines of ``role`` (prefill or decode) take no speculative decoding flag."""
    starts = " || ".join(f"a.startsWith('{flag}')" for flag in _SPECULATIVE_FLAGS)
    return CelRule(
        name=f"hybrid-{role}-no-speculative-decoding",
        owner=PDServiceSpec,
        cel=f"self.model.architecture != {_HYBRID} || !has(self.{role}.extraArgs) || "
        f"!self.{role}.extraArgs.exists(a, {starts})",
        message=(
            "--speculative-config is not supported with architecture hybrid-ssm "
            "(speculative decoding adds Mamba state slots the KV connector does not transfer)"
        ),
        field_path=f".{role}.extraArgs",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: _no_speculative_args(spec, getattr(spec, role)),
    )


def _tier_rules(role: str) -> tuple[CelRule, ...]:
    """A KV tier for ``role``'s engines (``spec.kvCache.offload.<role>``): attention-only models, our
    connector on vLLM, and a pod memory to grow by it."""
    has_tier = f"has(self.kvCache.offload.{role})"

    def tier(spec: PDServiceSpec) -> object:
        return getattr(spec.kv_cache.offload, role)

    return (
        CelRule(
            name=f"{role}-tier-dense-only",
            owner=PDServiceSpec,
            cel=f"!{has_tier} || self.model.architecture != {_HYBRID}",
            message="must not be set for hybrid-ssm models (the tier holds attention blocks; SSM state is "
            "not tiered)",
            field_path=f".kvCache.offload.{role}",
            reason=Reason.FORBIDDEN,
            holds=lambda spec: tier(spec) is None or spec.model.architecture != Architecture.HYBRID_SSM,
        ),
        CelRule(
            name=f"{role}-tier-builtin-vllm-only",
            owner=PDServiceSpec,
            cel=f"!{has_tier} || (self.engine.connector == 'builtin' && self.engine.runtime == 'vllm')",
            message="needs spec.engine.connector builtin and spec.engine.runtime vllm (the tier is "
            "PDConnector's)",
            field_path=f".kvCache.offload.{role}",
            reason=Reason.FORBIDDEN,
            holds=lambda spec: (
                tier(spec) is None
                or (spec.engine.connector == ConnectorImpl.BUILTIN and spec.engine.runtime == Runtime.VLLM)
            ),
        ),
        CelRule(
            name=f"{role}-tier-needs-pod-memory",
            owner=PDServiceSpec,
            cel=f"!{has_tier} || has(self.{role}.resources.memory)",
            message=f"required when spec.kvCache.offload.{role} is set (the pod's memory request and limit "
            "grow by the tier's hostMemory)",
            field_path=f".{role}.resources.memory",
            reason=Reason.REQUIRED,
            holds=lambda spec: tier(spec) is None or getattr(spec, role).resources.memory is not None,
        ),
    )


_HPA_MAX_WINDOW_S = 3600


def _hpa_min_replicas_rule(role: str) -> CelRule:
    """An hpa role keeps one engine (an HPA scales to zero only behind an alpha feature gate; KEDA does)."""
    return CelRule(
        name=f"autoscaling-hpa-{role}-min-replicas",
        owner=AutoscalingSpec,
        cel=f"self.engine != 'hpa' || self.{role}.minReplicas >= 1",
        message="must be at least 1 when engine is hpa (use keda or builtin to scale to zero)",
        field_path=f".{role}.minReplicas",
        holds=lambda scaling: (
            scaling.engine != AutoscalingEngine.HPA or getattr(scaling, role).min_replicas >= 1
        ),
    )


_LATENCY_TARGETS = "has(self.targets.ttftMilliseconds) || has(self.targets.tpotMilliseconds)"

AUTOSCALING_RULES: tuple[CelRule, ...] = (
    CelRule(
        name="autoscaling-replica-range-ordered",
        owner=ReplicaRange,
        cel="self.minReplicas <= self.maxReplicas",
        message="must be at most maxReplicas",
        field_path=".minReplicas",
        holds=lambda bounds: bounds.min_replicas <= bounds.max_replicas,
    ),
    CelRule(
        name="autoscaling-ratio-range-ordered",
        owner=RatioRange,
        cel="self.minPercent <= self.maxPercent",
        message="must be at most maxPercent",
        field_path=".minPercent",
        holds=lambda ratio: ratio.min_percent <= ratio.max_percent,
    ),
    CelRule(
        name="autoscaling-prefill-target",
        owner=AutoscalingSpec,
        cel="has(self.targets.ttftMilliseconds) || has(self.targets.waitingRequestsPerPrefill)",
        message="needs a prefill target: ttftMilliseconds or waitingRequestsPerPrefill",
        field_path=".targets",
        reason=Reason.REQUIRED,
        holds=lambda scaling: (
            scaling.targets.ttft_milliseconds is not None
            or scaling.targets.waiting_requests_per_prefill is not None
        ),
    ),
    CelRule(
        name="autoscaling-decode-target",
        owner=AutoscalingSpec,
        cel="has(self.targets.tpotMilliseconds) || has(self.targets.runningRequestsPerDecode)",
        message="needs a decode target: tpotMilliseconds or runningRequestsPerDecode",
        field_path=".targets",
        reason=Reason.REQUIRED,
        holds=lambda scaling: (
            scaling.targets.tpot_milliseconds is not None
            or scaling.targets.running_requests_per_decode is not None
        ),
    ),
    CelRule(
        name="autoscaling-hpa-per-pod-targets",
        owner=AutoscalingSpec,
        cel=f"self.engine != 'hpa' || !({_LATENCY_TARGETS})",
        message="ttftMilliseconds and tpotMilliseconds need engine builtin or keda (an HPA averages per-pod "
        "metrics: use waitingRequestsPerPrefill and runningRequestsPerDecode)",
        field_path=".targets",
        reason=Reason.FORBIDDEN,
        holds=lambda scaling: (
            scaling.engine != AutoscalingEngine.HPA
            or (scaling.targets.ttft_milliseconds is None and scaling.targets.tpot_milliseconds is None)
        ),
    ),
    CelRule(
        name="autoscaling-keda-requires-prometheus",
        owner=AutoscalingSpec,
        cel="self.engine != 'keda' || has(self.prometheus)",
        message="required when engine is keda (its triggers query Prometheus)",
        field_path=".prometheus",
        reason=Reason.REQUIRED,
        holds=lambda scaling: scaling.engine != AutoscalingEngine.KEDA or scaling.prometheus is not None,
    ),
    CelRule(
        name="autoscaling-prometheus-only-keda",
        owner=AutoscalingSpec,
        cel="self.engine == 'keda' || !has(self.prometheus)",
        message="may only be set when engine is keda",
        field_path=".prometheus",
        reason=Reason.FORBIDDEN,
        holds=lambda scaling: scaling.engine == AutoscalingEngine.KEDA or scaling.prometheus is None,
    ),
    CelRule(
        name="autoscaling-ratio-only-builtin",
        owner=AutoscalingSpec,
        cel="self.engine == 'builtin' || !has(self.prefillPerDecode)",
        message="may only be set when engine is builtin (per-role HPA or KEDA objects cannot keep a ratio)",
        field_path=".prefillPerDecode",
        reason=Reason.FORBIDDEN,
        holds=lambda scaling: (
            scaling.engine == AutoscalingEngine.BUILTIN or scaling.prefill_per_decode is None
        ),
    ),
    CelRule(
        name="autoscaling-windows-ordered",
        owner=AutoscalingSpec,
        cel="self.scaleUpWindowSeconds <= self.scaleDownWindowSeconds",
        message="must be at most scaleDownWindowSeconds (scale up fast, down slowly)",
        field_path=".scaleUpWindowSeconds",
        holds=lambda scaling: scaling.scale_up_window_seconds <= scaling.scale_down_window_seconds,
    ),
    CelRule(
        name="autoscaling-scaler-window-bound",
        owner=AutoscalingSpec,
        cel=f"self.engine == 'builtin' || self.scaleDownWindowSeconds <= {_HPA_MAX_WINDOW_S}",
        message=f"must be at most {_HPA_MAX_WINDOW_S} when engine is hpa or keda (the longest stabilization "
        "window of a HorizontalPodAutoscaler)",
        field_path=".scaleDownWindowSeconds",
        holds=lambda scaling: (
            scaling.engine == AutoscalingEngine.BUILTIN
            or scaling.scale_down_window_seconds <= _HPA_MAX_WINDOW_S
        ),
    ),
    *(_hpa_min_replicas_rule(role) for role in ("prefill", "decode")),
)

CEL_RULES: tuple[CelRule, ...] = (
    # ------------------------------------------------------------ spec: model shape vs. TP
    CelRule(
        name="hybrid-requires-ssm",
        owner=PDServiceSpec,
        cel=f"self.model.architecture != {_HYBRID} || has(self.ssm)",
        message="required when spec.model.architecture is hybrid-ssm",
        field_path=".ssm",
        reason=Reason.REQUIRED,
        holds=lambda spec: spec.model.architecture != Architecture.HYBRID_SSM or spec.ssm is not None,
    ),
    CelRule(
        name="ssm-only-for-hybrid",
        owner=PDServiceSpec,
        cel=f"self.model.architecture == {_HYBRID} || !has(self.ssm)",
        message="must not be set unless spec.model.architecture is hybrid-ssm",
        field_path=".ssm",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: spec.model.architecture == Architecture.HYBRID_SSM or spec.ssm is None,
    ),
    CelRule(
        name="heterogeneous-tp-requires-ds-layout",
        owner=PDServiceSpec,
        cel="!has(self.ssm) || self.prefill.tensorParallelSize == self.decode.tensorParallelSize || "
        "self.ssm.convStateLayout == 'DS'",
        message=(
            "must be DS when spec.prefill.tensorParallelSize differs from spec.decode.tensorParallelSize "
            "(each decode rank needs its shard of x, B and C contiguous)"
        ),
        field_path=".ssm.convStateLayout",
        holds=lambda spec: (
            spec.ssm is None or not _tp_differs(spec) or spec.ssm.conv_state_layout == ConvLayout.DS
        ),
    ),
    CelRule(
        name="upstream-connector-requires-ds-layout",
        owner=PDServiceSpec,
        cel="!has(self.ssm) || self.engine.connector != 'vllm' || self.ssm.convStateLayout == 'DS'",
        message="must be DS with spec.engine.connector vllm (upstream NIXL connectors transfer SSM conv "
        "state only in the DS layout)",
        field_path=".ssm.convStateLayout",
        holds=lambda spec: (
            spec.ssm is None
            or spec.engine.connector != ConnectorImpl.VLLM
            or spec.ssm.conv_state_layout == ConvLayout.DS
        ),
    ),
    CelRule(
        name="mamba1-requires-equal-tp",
        owner=PDServiceSpec,
        cel="!has(self.ssm) || self.ssm.family != 'mamba1' || self.prefill.tensorParallelSize == "
        "self.decode.tensorParallelSize",
        message=(
            "mamba1 requires spec.prefill.tensorParallelSize to equal spec.decode.tensorParallelSize "
            "(heterogeneous TP is unsupported for Mamba1)"
        ),
        field_path=".ssm.family",
        holds=lambda spec: spec.ssm is None or spec.ssm.family != SsmFamily.MAMBA1 or not _tp_differs(spec),
    ),
    CelRule(
        name="mamba1-only-on-mock-with-builtin-connector",
        owner=PDServiceSpec,
        cel="!has(self.ssm) || self.ssm.family != 'mamba1' || self.engine.runtime != 'vllm' || "
        "self.engine.connector != 'builtin'",
        message="mamba1 is supported by the mock engine only (spec.engine.runtime mock); PDConnector serves "
        "mamba2 and gdn hybrids through vLLM",
        field_path=".ssm.family",
        holds=lambda spec: (
            spec.ssm is None
            or spec.ssm.family != SsmFamily.MAMBA1
            or spec.engine.runtime != Runtime.VLLM
            or spec.engine.connector != ConnectorImpl.BUILTIN
        ),
    ),
    CelRule(
        name="prefill-tp-above-decode-only-hybrid-or-mla",
        owner=PDServiceSpec,
        cel="self.prefill.tensorParallelSize <= self.decode.tensorParallelSize || self.model.architecture "
        f"in [{_HYBRID}, 'mla']",
        message="may exceed spec.decode.tensorParallelSize only when spec.model.architecture is hybrid-ssm "
        "or mla",
        field_path=".prefill.tensorParallelSize",
        holds=lambda spec: (
            spec.prefill.tensor_parallel_size <= spec.decode.tensor_parallel_size
            or spec.model.architecture in (Architecture.HYBRID_SSM, Architecture.MLA)
        ),
    ),
    CelRule(
        name="tp-sizes-divide",
        owner=PDServiceSpec,
        cel=(
            "self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0 || "
            "self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0"
        ),
        message="must divide or be a multiple of spec.prefill.tensorParallelSize",
        field_path=".decode.tensorParallelSize",
        holds=lambda spec: (
            spec.prefill.tensor_parallel_size % spec.decode.tensor_parallel_size == 0
            or spec.decode.tensor_parallel_size % spec.prefill.tensor_parallel_size == 0
        ),
    ),
    CelRule(
        name="hybrid-prefill-prefix-caching-off",
        owner=PDServiceSpec,
        cel=f"self.model.architecture != {_HYBRID} || !has(self.prefill.enablePrefixCaching) || "
        "!self.prefill.enablePrefixCaching",
        message=(
            "must not be true for hybrid-ssm models (on GPUs vLLM then keeps Mamba state in its 'align' "
            "cache mode, "
            "whose state block placement the KV connector does not model)"
        ),
        field_path=".prefill.enablePrefixCaching",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: (
            spec.model.architecture != Architecture.HYBRID_SSM
            or spec.prefill.enable_prefix_caching is not True
        ),
    ),
    CelRule(
        name="hybrid-decode-prefix-caching-off",
        owner=PDServiceSpec,
        cel=f"self.model.architecture != {_HYBRID} || !has(self.decode.enablePrefixCaching) || "
        "!self.decode.enablePrefixCaching",
        message="must not be true for hybrid-ssm models (decode prefix caching breaks on SSM state received "
        "over NIXL)",
        field_path=".decode.enablePrefixCaching",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: (
            spec.model.architecture != Architecture.HYBRID_SSM
            or spec.decode.enable_prefix_caching is not True
        ),
    ),
    *(_no_speculative_decoding_rule(role) for role in ("prefill", "decode")),
    # ------------------------------------------------------------ spec: KV tiers
    *(rule for role in ("prefill", "decode") for rule in _tier_rules(role)),
    # ------------------------------------------------------------ spec: routing
    CelRule(
        name="cache-aware-needs-attention-only-models",
        owner=PDServiceSpec,
        cel=f"self.router.policy != '{RoutingPolicy.CACHE_AWARE}' || self.model.architecture != {_HYBRID}",
        message="cache-aware is not supported with architecture hybrid-ssm (its engines run without prefix "
        "caching, so there is no cache to route to)",
        field_path=".router.policy",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: (
            spec.router.policy is not RoutingPolicy.CACHE_AWARE
            or spec.model.architecture != Architecture.HYBRID_SSM
        ),
    ),
    CelRule(
        name="cache-aware-needs-prefill-prefix-caching",
        owner=PDServiceSpec,
        cel=f"self.router.policy != '{RoutingPolicy.CACHE_AWARE}' || !has(self.prefill.enablePrefixCaching) "
        "|| self.prefill.enablePrefixCaching",
        message="must not be false under spec.router.policy cache-aware (it routes prompts to the prefill "
        "caching their prefix)",
        field_path=".prefill.enablePrefixCaching",
        reason=Reason.FORBIDDEN,
        holds=lambda spec: (
            spec.router.policy is not RoutingPolicy.CACHE_AWARE
            or spec.prefill.enable_prefix_caching is not False
        ),
    ),
    # ------------------------------------------------------------ spec: transport and connector
    CelRule(
        name="efa-requires-libfabric",
        owner=PDServiceSpec,
        cel="!self.network.efa.enabled || self.engine.transport.backend == 'LIBFABRIC'",
        message="must be LIBFABRIC when spec.network.efa.enabled is true (UCX on EFA silently falls back to "
        "TCP)",
        field_path=".engine.transport.backend",
        holds=lambda spec: (
            not spec.network.efa.enabled or spec.engine.transport.backend == TransportBackend.LIBFABRIC
        ),
    ),
    CelRule(
        name="upstream-push-requires-prefill-engine-id",
        owner=PDServiceSpec,
        cel="self.mode != 'push' || self.engine.connector != 'vllm' || has(self.engine.prefillEngineId)",
        message="required when spec.mode is push and spec.engine.connector is vllm (the upstream push "
        "connector needs a fixed prefill engine id)",
        field_path=".engine.prefillEngineId",
        reason=Reason.REQUIRED,
        holds=lambda spec: (
            spec.mode != TransferMode.PUSH
            or spec.engine.connector != ConnectorImpl.VLLM
            or spec.engine.prefill_engine_id is not None
        ),
    ),
    CelRule(
        name="fixed-prefill-engine-id-autoscaled-single-replica",
        owner=PDServiceSpec,
        cel="!has(self.engine.prefillEngineId) || !has(self.autoscaling) || "
        "self.autoscaling.prefill.maxReplicas <= 1",
        message="must be at most 1 when spec.engine.prefillEngineId is set (prefill pods sharing one engine "
        "id would alias each other)",
        field_path=".autoscaling.prefill.maxReplicas",
        holds=lambda spec: (
            spec.engine.prefill_engine_id is None
            or spec.autoscaling is None
            or spec.autoscaling.prefill.max_replicas <= 1
        ),
    ),
    CelRule(
        name="fixed-prefill-engine-id-single-replica",
        owner=PDServiceSpec,
        cel="!has(self.engine.prefillEngineId) || self.prefill.replicas <= 1",
        message="must be at most 1 when spec.engine.prefillEngineId is set (prefill pods sharing one engine "
        "id would alias each other)",
        field_path=".prefill.replicas",
        holds=lambda spec: spec.engine.prefill_engine_id is None or spec.prefill.replicas <= 1,
    ),
    # ------------------------------------------------------------ engine
    CelRule(
        name="mock-transport-requires-mock-runtime",
        owner=EngineSpec,
        cel="self.transport.backend != 'mock' || self.runtime == 'mock'",
        message="mock requires spec.engine.runtime mock (vLLM engines move KV over NIXL)",
        field_path=".transport.backend",
        holds=lambda engine: (
            engine.transport.backend != TransportBackend.MOCK or engine.runtime == Runtime.MOCK
        ),
    ),
    CelRule(
        name="mock-runtime-transport",
        owner=EngineSpec,
        cel="self.runtime != 'mock' || self.transport.backend in ['mock', 'UCX']",
        message="must be mock or UCX when spec.engine.runtime is mock (mock engines move KV over TCP or "
        "NIXL's UCX backend)",
        field_path=".transport.backend",
        holds=lambda engine: (
            engine.runtime != Runtime.MOCK
            or engine.transport.backend in (TransportBackend.MOCK, TransportBackend.UCX)
        ),
    ),
    CelRule(
        name="mock-runtime-requires-builtin-connector",
        owner=EngineSpec,
        cel="self.runtime != 'mock' || self.connector == 'builtin'",
        message="must be builtin when spec.engine.runtime is mock",
        field_path=".connector",
        holds=lambda engine: engine.runtime != Runtime.MOCK or engine.connector == ConnectorImpl.BUILTIN,
    ),
    CelRule(
        name="prefill-engine-id-only-upstream",
        owner=EngineSpec,
        cel="self.connector == 'vllm' || !has(self.prefillEngineId)",
        message="may only be set with spec.engine.connector vllm (the builtin connector derives engine ids "
        "from pod names)",
        field_path=".prefillEngineId",
        reason=Reason.FORBIDDEN,
        holds=lambda engine: engine.connector == ConnectorImpl.VLLM or engine.prefill_engine_id is None,
    ),
    CelRule(
        name="side-channel-port-distinct",
        owner=EngineSpec,
        cel="self.sideChannelPort != self.port",
        message="must differ from spec.engine.port",
        field_path=".sideChannelPort",
        holds=lambda engine: engine.side_channel_port != engine.port,
    ),
    # ------------------------------------------------------------ EFA
    CelRule(
        name="efa-prefill-devices",
        owner=EFASpec,
        cel="!self.enabled || self.prefillDevices > 0",
        message="must be greater than 0 when spec.network.efa.enabled is true",
        field_path=".prefillDevices",
        holds=lambda efa: not efa.enabled or efa.prefill_devices > 0,
    ),
    CelRule(
        name="efa-decode-devices",
        owner=EFASpec,
        cel="!self.enabled || self.decodeDevices > 0",
        message="must be greater than 0 when spec.network.efa.enabled is true",
        field_path=".decodeDevices",
        holds=lambda efa: not efa.enabled or efa.decode_devices > 0,
    ),
    CelRule(
        name="efa-devices-require-enabled",
        owner=EFASpec,
        cel="self.enabled || (self.prefillDevices == 0 && self.decodeDevices == 0)",
        message="prefillDevices and decodeDevices must be 0 unless enabled is true",
        holds=lambda efa: efa.enabled or (efa.prefill_devices == 0 and efa.decode_devices == 0),
    ),
    CelRule(
        name="efa-privileged-requires-enabled",
        owner=EFASpec,
        cel="self.enabled || !self.privileged",
        message="must be false unless spec.network.efa.enabled is true",
        field_path=".privileged",
        reason=Reason.FORBIDDEN,
        holds=lambda efa: efa.enabled or not efa.privileged,
    ),
    # ------------------------------------------------------------ model source
    CelRule(
        name="model-source-exactly-one",
        owner=ModelSource,
        cel="has(self.huggingFace) != has(self.pvc)",
        message="exactly one of huggingFace or pvc must be set",
        holds=lambda source: (source.hugging_face is None) != (source.pvc is None),
    ),
    CelRule(
        name="scrape-peer-selects",
        owner=ScrapePeer,
        cel="has(self.namespaceLabels) || has(self.podLabels)",
        message="set namespaceLabels, podLabels or both ({} selects all)",
        holds=lambda peer: peer.namespace_labels is not None or peer.pod_labels is not None,
    ),
    CelRule(
        name="pvc-path-inside-volume",
        owner=PVCSource,
        cel="!self.path.matches('(^|/)[.][.](/|$)')",
        message="must not contain '..' segments",
        field_path=".path",
        holds=lambda pvc: ".." not in pvc.path.split("/"),
    ),
    *AUTOSCALING_RULES,
    # ------------------------------------------------------------ roles
    *PARALLEL_RULES,
    CelRule(
        name="toleration-exists-without-value",
        owner=Toleration,
        cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        message="must be empty when operator is Exists",
        field_path=".value",
        reason=Reason.FORBIDDEN,
        holds=lambda tol: tol.operator != "Exists" or not tol.value,
    ),
    CelRule(
        name="toleration-empty-key-requires-exists",
        owner=Toleration,
        cel="(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        message="must be Exists when key is empty (an empty key matches every taint)",
        field_path=".operator",
        holds=lambda tol: bool(tol.key) or tol.operator == "Exists",
    ),
    CelRule(
        name="toleration-seconds-requires-noexecute",
        owner=Toleration,
        cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        message="may only be set when effect is NoExecute",
        field_path=".tolerationSeconds",
        reason=Reason.FORBIDDEN,
        holds=lambda tol: tol.toleration_seconds is None or tol.effect == "NoExecute",
    ),
)
