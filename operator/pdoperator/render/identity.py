"""Engine identity: the compatibility hash and the engine ids derived from it.

A prefill and a decode engine can exchange KV blocks only if they agree on everything
that shapes those blocks and the protocol that moves them. The compatibility hash
covers exactly those settings. It goes into the pods' template labels, every engine id
and the router config, so that after a change new prefill pods never pair with old
decode pods (their ids no longer share the suffix), while a change that keeps engines
compatible (replicas, resources, scheduling, served name) leaves running pods alone.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdoperator.api.model import PDServiceSpec, Runtime
from pdoperator.api.roles import RoleSpec

from .cache_routing import engine_block_size
from .defaults import RenderDefaults
from .names import ComponentRole

COMPAT_HASH_LENGTH = 10


def engine_image(spec: PDServiceSpec, role: ComponentRole, defaults: RenderDefaults) -> str:
    """The image one engine role runs: its own override, else the service-wide one, else the operator's
    default for the runtime."""
    runtime_default = (
        defaults.mock_engine_image if spec.engine.runtime is Runtime.MOCK else defaults.engine_image
    )
    return role_spec(spec, role).image or spec.engine.image or runtime_default


def role_spec(spec: PDServiceSpec, role: ComponentRole) -> RoleSpec:
    return spec.prefill if role is ComponentRole.PREFILL else spec.decode


def _compatibility_inputs(spec: PDServiceSpec, defaults: RenderDefaults) -> dict[str, Any]:
    model = spec.model
    pvc = model.source.pvc
    return {
        "mode": spec.mode.value,
        "model": {
            "name": model.name,
            # Different weights produce different KV even under the same display name.
            "weights": {"pvc": pvc.claim_name, "path": pvc.path} if pvc else "huggingFace",
            "dtype": model.dtype.value,
            "maxModelLen": model.max_model_len,
            "architecture": model.architecture.value,
        },
        "ssm": spec.ssm.model_dump(mode="json", by_alias=True) if spec.ssm else None,
        "engine": {
            "runtime": spec.engine.runtime.value,
            "connector": spec.engine.connector.value,
            "transport": spec.engine.transport.backend.value,
            # the cache-aware policy renders --block-size onto both roles
            **({"blockSize": block_size} if (block_size := engine_block_size(spec)) is not None else {}),
        },
        # Per role: the image (vLLM and connector versions), TP (shard layout), and the
        # free-form args and env, which can change the KV layout (--block-size,
        # --kv-cache-dtype, attention backend variables) in ways rendering cannot see.
        **{
            role.value: {
                "image": engine_image(spec, role, defaults),
                "tensorParallelSize": role_spec(spec, role).tensor_parallel_size,
                # which layers a rank holds; only where set, so specs without it keep their hash
                **(
                    {"pipelineParallelSize": pp}
                    if (pp := role_spec(spec, role).pipeline_parallel_size) > 1
                    else {}
                ),
                "extraArgs": role_spec(spec, role).extra_args,
                "env": [env.model_dump(mode="json") for env in role_spec(spec, role).env],
            }
            for role in (ComponentRole.PREFILL, ComponentRole.DECODE)
        },
    }


def compatibility_hash(spec: PDServiceSpec, defaults: RenderDefaults) -> str:
    """A short stable digest (lowercase hex, valid as a label value) of the KV-compatibility settings.

    ``defaults`` matter because they supply the engine image of roles whose spec names none.
    """
    canonical = json.dumps(_compatibility_inputs(spec, defaults), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:COMPAT_HASH_LENGTH]


def engine_id(spec: PDServiceSpec, role: ComponentRole, pod_name: str, compat_hash: str) -> str:
    """The engine id of one pod: ``<pod name>-<compat hash>``.

    ``pod_name`` is ``$(POD_NAME)`` inside the pod template (expanded by the kubelet) and
    the real pod name in the router config. A fixed ``engine.prefillEngineId`` (needed by
    upstream's push connector) replaces the prefill engines' ids verbatim.
    """
    if role is ComponentRole.PREFILL and spec.engine.prefill_engine_id:
        return spec.engine.prefill_engine_id
    return f"{pod_name}-{compat_hash}"
