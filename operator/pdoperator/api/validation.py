"""Semantic validation of a parsed PDService: the CEL rules in Python, plus what CEL cannot say.

``validate_spec`` reports every problem as a ``FieldError`` whose path names the
field (``spec.ssm.convStateLayout``), in the same words the API server uses for the
CEL rules. The checks beyond CEL need things the CRD does not know: Kubernetes
name and label syntax, quantity arithmetic, and which flags and environment
variables the operator itself sets on the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel

from pdoperator.api.base import DNS_SUBDOMAIN
from pdoperator.api.cel import CelRule
from pdoperator.api.errors import FieldError, path_key
from pdoperator.api.model import PDServiceSpec, Runtime
from pdoperator.api.roles import RoleResources, RoleSpec
from pdoperator.api.routing import RoutingPolicy
from pdoperator.api.rules import CEL_RULES
from pdoperator.api.schema import DNS_1035_LABEL, MAX_NAME_LENGTH
from pdoperator.autoscale.policy import policy_of

DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_HUGEPAGE = 2 * 1024 * 1024
_MAX_QUANTITY = 2**63
_DEFAULT_SHM = RoleResources.model_fields["shm_size"].default
_MIN_TIER_BYTES_PER_RANK = 2**20  # below a block of any real model: a typo, not a tier

ROLES = ("prefill", "decode")

# Engine flags the operator derives from the spec, per runtime ({role} is the role being checked):
# a copy in extraArgs would fight the operator's value (the last one wins) and silently change
# the contract the router and connector rely on.
_TP = "use spec.{role}.tensorParallelSize"
_PP = "use spec.{role}.pipelineParallelSize"
_EP = "use spec.{role}.enableExpertParallel"
_NODES = "the operator sets it where an engine spans nodes (spec.{role}.gpusPerNode)"
MANAGED_FLAGS: dict[Runtime, dict[str, str]] = {
    Runtime.VLLM: {
        "--model": "use spec.model.name",
        "--served-model-name": "use spec.model.servedName",
        "--dtype": "use spec.model.dtype",
        "--max-model-len": "use spec.model.maxModelLen",
        "--tensor-parallel-size": _TP,
        "-tp": _TP,
        "--max-num-seqs": "use spec.{role}.maxNumSeqs",
        "--enable-prefix-caching": "use spec.{role}.enablePrefixCaching",
        "--no-enable-prefix-caching": "use spec.{role}.enablePrefixCaching",
        "--kv-transfer-config": "use spec.mode, spec.engine.connector and spec.engine.transport",
        "--port": "use spec.engine.port",
        "--host": "engines listen on the pod's addresses",
        "--shutdown-timeout": "use spec.engine.terminationGracePeriodSeconds",
        "--pipeline-parallel-size": _PP,
        "-pp": _PP,
        "--enable-expert-parallel": _EP,
        "-ep": _EP,
        **dict.fromkeys(
            ("--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port", "--headless"), _NODES
        ),
    },
    Runtime.MOCK: {
        "--role": "the operator sets it per role",
        "--model": "use spec.model.servedName",
        "--host": "engines listen on the pod's addresses",
        "--port": "use spec.engine.port",
        "--engine-id": "the operator derives it from the pod name",
        "--side-channel-host": "the operator sets it to the pod IP",
        "--side-channel-port": "use spec.engine.sideChannelPort",
        "--tp-size": _TP,
        "--transport": "use spec.engine.transport.backend",
        "--compat-hash": "the operator derives it from the spec",
        "--transfer-timeout": "use spec.engine.transferTimeoutSeconds",
        "--kv-device": "the operator sets it from spec.{role}.resources.gpus and "
        "spec.engine.transport.backend",
        "--max-model-len": "use spec.model.maxModelLen",
        "--num-blocks": "the operator sizes the pool for spec.model.maxModelLen",
    },
}
# vLLM flags that break the one-side-channel-port-per-pod contract (vLLM adds the data-parallel rank to the
# port).
_NO_DP = "data-parallel ranks need extra side-channel ports; scale spec.{role}.replicas instead"
UNSUPPORTED_FLAGS: dict[str, str] = {"--data-parallel-size": _NO_DP, "-dp": _NO_DP}
# Environment variables the operator sets on every engine container.
_DOWNWARD_API = "the operator sets it from the downward API"
RESERVED_ENV: dict[str, str] = {
    "POD_NAME": _DOWNWARD_API,
    "POD_NAMESPACE": _DOWNWARD_API,
    "POD_IP": _DOWNWARD_API,
    "POD_UID": _DOWNWARD_API,
    "VLLM_SSM_CONV_STATE_LAYOUT": "use spec.ssm.convStateLayout",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the operator sets it to the pod IP",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "use spec.engine.sideChannelPort",
    "HF_TOKEN": "use spec.model.source.huggingFace.tokenSecretRef",
    "HF_HOME": "the operator points it at the model cache",
    "ENGINE_NAME": "the operator sets it to the engine's (its leader pod's) name",
    "VLLM_HOST_IP": "the operator sets it to the pod IP",
}
# ... and on EFA-enabled ones (without EFA, libfabric users may pick their own provider).
_EFA_SET = "the operator sets it when spec.network.efa.enabled is true"
EFA_RESERVED_ENV: dict[str, str] = {
    "FI_PROVIDER": _EFA_SET,
    "FI_EFA_USE_DEVICE_RDMA": _EFA_SET,
    "LD_LIBRARY_PATH": _EFA_SET,
}


def _objects(model: BaseModel, path: str) -> Iterator[tuple[str, BaseModel]]:
    """Every API object in the tree under ``model`` with its field path, parents first."""
    yield path, model
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        child = f"{path}.{field.alias or name}"
        if isinstance(value, BaseModel):
            yield from _objects(value, child)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _objects(item, f"{child}[{index}]")


def cel_rule_violations(spec: PDServiceSpec) -> list[tuple[str, CelRule]]:
    """(error path, rule) for every CEL rule the spec breaks, checked by the rules' Python twins."""
    violations = []
    for path, obj in _objects(spec, "spec"):
        for rule in CEL_RULES:
            if rule.owner is type(obj) and not rule.holds(obj):
                violations.append((path + rule.field_path, rule))
    return violations


def _check_name(name: str) -> list[FieldError]:
    errors = []
    if len(name) > MAX_NAME_LENGTH:
        errors.append(
            FieldError(
                "metadata.name",
                f"must be at most {MAX_NAME_LENGTH} characters (child StatefulSets add '-prefill' and a "
                "revision hash)",
            )
        )
    if not re.match(DNS_1035_LABEL, name):
        errors.append(
            FieldError(
                "metadata.name",
                "must start with a lowercase letter, end with a letter or digit, and contain only lowercase "
                "letters, digits and '-'",
            )
        )
    return errors


def _check_namespace(namespace: str) -> list[FieldError]:
    if len(namespace) <= 63 and re.match(DNS_1123_LABEL, namespace):
        return []
    return [
        FieldError(
            "metadata.namespace",
            "must be a DNS label: at most 63 lowercase letters, digits and '-', starting and ending "
            "alphanumeric",
        )
    ]


def _flag_name(arg: str) -> str | None:
    """The normalized flag an argument sets (``--kv_transfer_config.x=1`` -> ``--kv-transfer-config``), or
    None for a value."""
    if not arg.startswith("-") or arg in ("-", "--"):
        return None
    dashes = "--" if arg.startswith("--") else "-"
    name = re.split(r"[=.]", arg[len(dashes) :], maxsplit=1)[0]
    return dashes + name.replace("_", "-")


# What the cache-aware policy renders onto vLLM engines: the router must hash prompts exactly as they do.
CACHE_AWARE_FLAGS = {
    "--block-size": "use spec.router.cacheAware.blockSize under the cache-aware policy",
    "--kv-events-config": "the cache-aware policy publishes the KV cache events the router reads",
    "--prefix-caching-hash-algo": "the cache-aware router hashes prompts with vLLM's default (sha256)",
}


def managed_flags(spec: PDServiceSpec) -> dict[str, str]:
    """The engine flags the operator sets for ``spec`` (flag -> what to use instead)."""
    runtime = spec.engine.runtime
    if runtime is Runtime.VLLM and spec.router.policy is RoutingPolicy.CACHE_AWARE:
        return {**MANAGED_FLAGS[runtime], **CACHE_AWARE_FLAGS}
    return MANAGED_FLAGS[runtime]


def _check_extra_args(spec: PDServiceSpec, role: str) -> list[FieldError]:
    errors = []
    args = getattr(spec, role).extra_args
    runtime = spec.engine.runtime
    managed = managed_flags(spec)
    unsupported = UNSUPPORTED_FLAGS if runtime is Runtime.VLLM else {}
    for index, arg in enumerate(args):
        flag = _flag_name(arg)
        path = f"spec.{role}.extraArgs[{index}]"
        if flag in managed:
            errors.append(
                FieldError(path, f"{flag} is set by the operator; {managed[flag].format(role=role)}")
            )
        elif flag in unsupported:
            errors.append(FieldError(path, f"{flag} is not supported: {unsupported[flag].format(role=role)}"))
    return errors


def _check_env(role: str, spec: RoleSpec, efa_enabled: bool) -> list[FieldError]:
    errors = []
    reserved = RESERVED_ENV | (EFA_RESERVED_ENV if efa_enabled else {})
    first_index: dict[str, int] = {}
    for index, var in enumerate(spec.env):
        path = f"spec.{role}.env[{index}].name"
        if var.name in reserved:
            errors.append(FieldError(path, f"{var.name} is set by the operator; {reserved[var.name]}"))
        if var.name in first_index:
            # env is a list-map keyed by name: the API server reports a duplicate on the item, not its name.
            errors.append(
                FieldError(
                    f"spec.{role}.env[{index}]",
                    f"duplicate name {var.name} (first set in env[{first_index[var.name]}])",
                )
            )
        first_index.setdefault(var.name, index)
    return errors


def _label_key_valid(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.match(DNS_SUBDOMAIN, prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.match(name))


def _check_labels(field: str, labels: dict[str, str]) -> list[FieldError]:
    errors = []
    for key, value in labels.items():
        path = f"{field}[{path_key(key)}]"
        if not _label_key_valid(key):
            errors.append(
                FieldError(
                    path,
                    "key must be a label key: an optional DNS subdomain and '/', then at most 63 letters, "
                    "digits, '-', '_' or '.'",
                )
            )
        if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
            errors.append(
                FieldError(
                    path,
                    "value must be a label value: at most 63 letters, digits, '-', '_' or '.', starting and "
                    "ending alphanumeric",
                )
            )
    return errors


def _quantity(text: str) -> Decimal | None:
    """The value of a Kubernetes quantity, or None when it is not one (or beyond what Kubernetes stores)."""
    try:
        amount = parse_quantity(text)
    except (ValueError, ArithmeticError):
        return None
    return amount if amount.is_finite() and abs(amount) <= _MAX_QUANTITY else None


def _check_tiers(spec: PDServiceSpec) -> list[FieldError]:
    errors = []
    for role in ("prefill", "decode"):
        tier = getattr(spec.kv_cache.offload, role)
        if tier is None:
            continue
        role_spec = getattr(spec, role)
        ranks = role_spec.world_size // role_spec.nodes
        amount = _quantity(tier.host_memory)
        if amount is None or amount < ranks * _MIN_TIER_BYTES_PER_RANK:
            errors.append(
                FieldError(
                    f"spec.kvCache.offload.{role}.hostMemory",
                    f"must be a Kubernetes quantity of at least {ranks}Mi (1Mi for each of the {ranks} ranks "
                    f"of a {role} pod), such as 64Gi",
                )
            )
    return errors


def _check_resources(role: str, resources: RoleResources, hugepages_requested: bool) -> list[FieldError]:
    errors = []
    path = f"spec.{role}.resources"
    if hugepages_requested and resources.cpu is None and resources.memory is None:
        reason = "Kubernetes rejects pods that request hugepages without a cpu or memory request"
        errors.append(
            FieldError(path, f"must set cpu or memory when spec.network.efa requests hugepages ({reason})")
        )
    for field, text, example in (
        ("cpu", resources.cpu, "500m or 2"),
        ("memory", resources.memory, "1Gi"),
        ("shmSize", resources.shm_size, "16Gi"),
    ):
        amount = None if text is None else _quantity(text)
        if text is not None and (amount is None or amount <= 0):
            errors.append(
                FieldError(f"{path}.{field}", f"must be a positive Kubernetes quantity such as {example}")
            )
    memory = None if resources.memory is None else _quantity(resources.memory)
    shm = _quantity(resources.shm_size)
    if memory is not None and shm is not None and 0 < memory < shm:
        reason = (
            f"the memory-backed /dev/shm counts against the memory limit; shmSize defaults to {_DEFAULT_SHM}"
        )
        errors.append(FieldError(f"{path}.shmSize", f"must not exceed {path}.memory ({reason})"))
    return errors


def _check_hugepages(text: str) -> list[FieldError]:
    amount = _quantity(text)
    if amount is None or amount < 0 or amount % _HUGEPAGE:
        return [
            FieldError("spec.network.efa.hugepages", "must be a whole number of 2Mi pages such as 5Gi (or 0)")
        ]
    return []


def _hash_seed(role: RoleSpec) -> tuple[int | None, str | None]:
    """(index, value) of the role's PYTHONHASHSEED, which seeds vLLM's prefix-cache block hashes."""
    return next(
        ((i, var.value) for i, var in enumerate(role.env) if var.name == "PYTHONHASHSEED"), (None, None)
    )


def _check_cache_aware(spec: PDServiceSpec) -> list[FieldError]:
    """Under the cache-aware policy the router hashes prompts with the prefill's seed; decode's events must
    hash the same blocks alike."""
    if spec.router.policy is not RoutingPolicy.CACHE_AWARE:
        return []
    (_, prefill_seed), (index, decode_seed) = _hash_seed(spec.prefill), _hash_seed(spec.decode)
    if prefill_seed == decode_seed:
        return []
    path = "spec.decode.env" if index is None else f"spec.decode.env[{index}].value"
    return [
        FieldError(
            path,
            f"PYTHONHASHSEED must equal spec.prefill's ({prefill_seed!r}, got {decode_seed!r}) under the "
            "cache-aware policy (it seeds the block hashes the router matches)",
        )
    ]


def _check_autoscaling(spec: PDServiceSpec, found: list[FieldError]) -> list[FieldError]:
    """Bounds and ratio range must admit a replica pair (CEL cannot search them); checked once the rules on
    spec.autoscaling hold, so one mistake is reported once."""
    if spec.autoscaling is None or any(e.path.startswith("spec.autoscaling") for e in found):
        return []
    try:
        policy_of(spec.autoscaling)
    except ValueError as e:
        return [FieldError("spec.autoscaling", str(e))]
    return []


def validate_metadata(name: str, namespace: str) -> list[FieldError]:
    """Problems with the object's name and namespace (child objects derive their names from them)."""
    return _check_name(name) + _check_namespace(namespace)


def spec_errors(spec: PDServiceSpec) -> list[FieldError]:
    """Every semantic problem of a structurally valid spec: CEL rules first, then the checks CEL cannot
    express."""
    errors = [FieldError(path, rule.message) for path, rule in cel_rule_violations(spec)]
    hugepages = _quantity(spec.network.efa.hugepages)
    hugepages_requested = spec.network.efa.enabled and hugepages is not None and hugepages > 0
    for role in ROLES:
        role_spec: RoleSpec = getattr(spec, role)
        errors += _check_extra_args(spec, role)
        errors += _check_env(role, role_spec, spec.network.efa.enabled)
        errors += _check_labels(f"spec.{role}.nodeSelector", role_spec.node_selector)
        errors += _check_resources(role, role_spec.resources, hugepages_requested)
    errors += _check_hugepages(spec.network.efa.hugepages)
    errors += _check_autoscaling(spec, errors)
    errors += _check_cache_aware(spec)
    errors += _check_tiers(spec)
    for index, peer in enumerate(spec.monitoring.scrapers):
        for field, labels in (("namespaceLabels", peer.namespace_labels), ("podLabels", peer.pod_labels)):
            errors += _check_labels(f"spec.monitoring.scrapers[{index}].{field}", labels or {})
    return errors


def validate_spec(spec: PDServiceSpec, name: str, namespace: str = "default") -> list[FieldError]:
    """Every semantic problem of a structurally valid PDService, in a stable order; empty when valid."""
    return validate_metadata(name, namespace) + spec_errors(spec)
