"""Rules on an engine's parallel layout: how its ranks fill pods, and which layouts each connector moves KV
between (``pdoperator.api.rules`` says how a rule's CEL and Python twin are kept in agreement)."""

from __future__ import annotations

from pdoperator.api.cel import CelRule
from pdoperator.api.model import ConnectorImpl, PDServiceSpec, Runtime
from pdoperator.api.roles import RoleSpec

ROLES = ("prefill", "decode")

_RANKS = "self.tensorParallelSize * self.pipelineParallelSize"
_SPANS = f"(has(self.gpusPerNode) && {_RANKS} > self.gpusPerNode)"


def _spans(role: str) -> str:
    """CEL at the spec: engines of ``role`` span nodes."""
    ranks = f"self.{role}.tensorParallelSize * self.{role}.pipelineParallelSize"
    return f"(has(self.{role}.gpusPerNode) && {ranks} > self.{role}.gpusPerNode)"


def _role(spec: PDServiceSpec, role: str) -> RoleSpec:
    return spec.prefill if role == "prefill" else spec.decode


def _pipeline_rule(role: str) -> CelRule:
    return CelRule(
        name=f"{role}-pipeline-parallel-needs-upstream-connector",
        owner=PDServiceSpec,
        cel=f"self.engine.connector == '{ConnectorImpl.VLLM}' || self.{role}.pipelineParallelSize == 1",
        message="must be 1 with spec.engine.connector builtin, which pairs tensor-parallel ranks that each "
        "hold every layer; pipeline parallel needs spec.engine.connector vllm",
        field_path=f".{role}.pipelineParallelSize",
        holds=lambda spec: (
            spec.engine.connector is ConnectorImpl.VLLM or _role(spec, role).pipeline_parallel_size == 1
        ),
    )


def _spanning_runtime_rule(role: str) -> CelRule:
    return CelRule(
        name=f"{role}-spanning-nodes-needs-vllm",
        owner=PDServiceSpec,
        cel=f"self.engine.runtime == '{Runtime.VLLM}' || !{_spans(role)}",
        message="must cover the engine's ranks unless spec.engine.runtime is vllm (a mock engine is one "
        "process)",
        field_path=f".{role}.gpusPerNode",
        holds=lambda spec: spec.engine.runtime is Runtime.VLLM or not _role(spec, role).spans_nodes,
    )


def _spanning_autoscaling_rule(role: str) -> CelRule:
    return CelRule(
        name=f"{role}-spanning-nodes-without-autoscaling",
        owner=PDServiceSpec,
        cel=f"!has(self.autoscaling) || !{_spans(role)}",
        message="must cover the engine's ranks while spec.autoscaling is set: the autoscalers drain and "
        "scale single-pod engines only so far",
        field_path=f".{role}.gpusPerNode",
        holds=lambda spec: spec.autoscaling is None or not _role(spec, role).spans_nodes,
    )


PARALLEL_RULES: tuple[CelRule, ...] = (
    CelRule(
        name="gpus-cover-the-ranks-of-a-pod",
        owner=RoleSpec,
        cel=f"{_SPANS} || !has(self.resources.gpus) || self.resources.gpus == 0 || "
        f"self.resources.gpus >= {_RANKS}",
        message="must be 0 (CPU engines) or at least this role's tensorParallelSize x pipelineParallelSize",
        field_path=".resources.gpus",
        holds=lambda role: (
            role.spans_nodes
            or role.resources.gpus is None
            or role.resources.gpus == 0
            or role.resources.gpus >= role.world_size
        ),
    ),
    CelRule(
        name="gpus-per-node-divides-the-ranks",
        owner=RoleSpec,
        cel=f"!{_SPANS} || ({_RANKS}) % self.gpusPerNode == 0",
        message="must divide tensorParallelSize x pipelineParallelSize when an engine spans nodes (every "
        "node runs as many of its ranks)",
        field_path=".gpusPerNode",
        holds=lambda role: not role.spans_nodes or role.world_size % (role.gpus_per_node or 1) == 0,
    ),
    CelRule(
        name="spanning-pods-take-a-node-of-gpus",
        owner=RoleSpec,
        cel=f"!{_SPANS} || !has(self.resources.gpus) || self.resources.gpus == self.gpusPerNode",
        message="must be unset or equal gpusPerNode when an engine spans nodes",
        field_path=".resources.gpus",
        holds=lambda role: (
            not role.spans_nodes or role.resources.gpus is None or role.resources.gpus == role.gpus_per_node
        ),
    ),
    *(_pipeline_rule(role) for role in ROLES),
    *(_spanning_runtime_rule(role) for role in ROLES),
    *(_spanning_autoscaling_rule(role) for role in ROLES),
)
