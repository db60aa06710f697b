"""The PDService status: what the operator observes and writes back, in Kubernetes' condition conventions."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from pdoperator.api.model import ApiModel


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    INVALID = "Invalid"


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SPEC_VALID = "SpecValid"
    KV_TRANSFER_VERIFIED = "KVTransferVerified"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class StatusModel(ApiModel):
    """Base for status objects: what the operator wrote, read back leniently (a field another version wrote is
    dropped, not refused)."""

    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: Annotated[
        ConditionType, Field(description="Ready, Progressing, Degraded, SpecValid or KVTransferVerified.")
    ]
    status: Annotated[ConditionStatus, Field(description="True, False or Unknown.")]
    reason: Annotated[
        str, Field(description="CamelCase reason for the last transition.", max_length=1024)
    ] = ""
    message: Annotated[str, Field(description="Human-readable detail.", max_length=32768)] = ""
    last_transition_time: Annotated[
        str | None,
        Field(description="When status last changed (RFC 3339).", json_schema_extra={"format": "date-time"}),
    ] = None
    observed_generation: Annotated[
        int | None, Field(description="Generation the condition was computed for.", ge=0)
    ] = None


class RoleStatus(StatusModel):
    """Replica counts of one role."""

    desired_replicas: Annotated[int, Field(description="Replicas the spec asks for.", ge=0)] = 0
    ready_replicas: Annotated[int, Field(description="Replicas ready to serve.", ge=0)] = 0
    summary: Annotated[str, Field(description="ready/desired, shown by kubectl get.")] = "0/0"


class RoleScaleStatus(StatusModel):
    """How many engines of one role run, and how many of them take new requests."""

    replicas: Annotated[int, Field(description="Engines the role's StatefulSet runs.", ge=0)] = 0
    serving: Annotated[
        int,
        Field(
            description="Engines the router sends new requests to (the lowest ordinals); the others drain "
            "and are removed once idle.",
            ge=0,
        ),
    ] = 0


class AutoscalingStatus(StatusModel):
    """What spec.autoscaling decided last, and why."""

    prefill: Annotated[RoleScaleStatus, Field(description="Prefill engines.")] = Field(
        default_factory=RoleScaleStatus
    )
    decode: Annotated[RoleScaleStatus, Field(description="Decode engines.")] = Field(
        default_factory=RoleScaleStatus
    )
    reason: Annotated[str, Field(description="Why the roles have these counts.", max_length=4096)] = ""
    last_scale_time: Annotated[
        str | None,
        Field(description="When a count last changed (RFC 3339).", json_schema_extra={"format": "date-time"}),
    ] = None
    draining_since: Annotated[
        str | None,
        Field(
            description="Since when engines have been draining (RFC 3339); unset while none drains.",
            json_schema_extra={"format": "date-time"},
        ),
    ] = None


class PDServiceStatus(StatusModel):
    """Observed state, written by the operator."""

    phase: Annotated[Phase, Field(description="Pending, Progressing, Ready, Degraded or Invalid.")] = (
        Phase.PENDING
    )
    observed_generation: Annotated[
        int | None, Field(description="metadata.generation the status describes.", ge=0)
    ] = None
    prefill: Annotated[RoleStatus, Field(description="Prefill replicas.")] = Field(default_factory=RoleStatus)
    decode: Annotated[RoleStatus, Field(description="Decode replicas.")] = Field(default_factory=RoleStatus)
    router: Annotated[RoleStatus, Field(description="Router replicas.")] = Field(default_factory=RoleStatus)
    router_endpoint: Annotated[
        str | None, Field(description="In-cluster URL of the router's OpenAI API.")
    ] = None
    autoscaling: Annotated[
        AutoscalingStatus | None, Field(description="The autoscaler's last decision (spec.autoscaling).")
    ] = None
    conditions: Annotated[
        list[Condition],
        Field(
            description="Ready, Progressing, Degraded, SpecValid, KVTransferVerified.",
            json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        ),
    ] = Field(default_factory=list)
