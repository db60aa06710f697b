"""KVTransferVerified: is the deployment really disaggregated, or are requests served without a KV transfer?

The router counts, since it started, requests that decode confirmed were served with KV
transferred from prefill (``verified``) and requests that succeeded without that confirmation
(``unverified``): ``GET /status`` -> ``{"transfers": {"verified": V, "unverified": U}}``. A decode
that silently recomputes the prompt still answers correctly, only slower and at prefill cost:
the most common silent failure of P/D deployments, and exactly what ``unverified`` counts.
Answers that cannot say either way count as ``unconfirmable`` (absent from older routers'
answers): every answer of upstream vLLM's connectors, and vLLM's streamed answers, which carry
no ``kv_transfer_params``. While only those arrive the condition stays Unknown.

Verdicts are taken on what changed since the previous probe (so the condition recovers once
transfers work again), or on the totals when there is no previous probe or the router restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import aiohttp

from pdoperator.api.model import PDService
from pdoperator.api.status import Condition, ConditionStatus, ConditionType


@dataclass(frozen=True)
class TransferCounts:
    verified: int
    unverified: int
    unconfirmable: int = 0


class RouterStatusError(Exception):
    """The router could not be asked, or its answer is not what the contract says."""


def parse_router_status(payload: Any) -> TransferCounts:
    transfers = payload.get("transfers") if isinstance(payload, dict) else None
    if not isinstance(transfers, dict):
        raise RouterStatusError("router /status has no 'transfers' object")
    values = []
    for field in ("verified", "unverified", "unconfirmable"):
        value = transfers.get(field, 0 if field == "unconfirmable" else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RouterStatusError(
                f"router /status transfers.{field} must be a non-negative integer, got {value!r}"
            )
        values.append(value)
    return TransferCounts(*values)


@dataclass(frozen=True)
class Verdict:
    status: ConditionStatus
    reason: str
    message: str


def verdict(
    current: TransferCounts, previous: TransferCounts | None, previous_verdict: Verdict | None
) -> Verdict:
    """The verdict on the counts; ``previous_verdict`` (an earlier verdict on counts) stands while no request
    arrives."""
    restarted = previous is not None and any(
        now < before for now, before in zip(astuple(current), astuple(previous), strict=True)
    )
    base = TransferCounts(0, 0) if previous is None or restarted else previous
    new_verified = current.verified - base.verified
    new_unverified = current.unverified - base.unverified
    if new_unverified > 0:
        return Verdict(
            ConditionStatus.FALSE,
            "ServedWithoutTransfer",
            "requests are served without a KV transfer from prefill (decode computes the prompt itself)",
        )
    if new_verified > 0:
        return Verdict(
            ConditionStatus.TRUE,
            "TransfersVerified",
            "decode confirms requests are served with KV transferred from prefill",
        )
    if current.unconfirmable > base.unconfirmable:
        return Verdict(
            ConditionStatus.UNKNOWN,
            "NotConfirmable",
            "decode's answers do not say whether KV arrived by transfer: upstream vLLM connectors never do, "
            "and vLLM streams carry no "
            "kv_transfer_params (non-streaming requests with spec.engine.connector: builtin do)",
        )
    if previous_verdict is not None:
        return previous_verdict
    return Verdict(
        ConditionStatus.UNKNOWN, "NoTraffic", "no request has been served since the router started"
    )


UNREACHABLE = "RouterUnreachable"


def unreachable_verdict(error: Exception) -> Verdict:
    return Verdict(ConditionStatus.UNKNOWN, UNREACHABLE, str(error))


def as_condition(v: Verdict, previous: Condition | None, generation: int, now: str) -> Condition:
    since = (
        previous.last_transition_time
        if previous is not None and previous.status == v.status and previous.last_transition_time
        else now
    )
    return Condition(
        type=ConditionType.KV_TRANSFER_VERIFIED,
        status=v.status,
        reason=v.reason,
        message=v.message,
        last_transition_time=since,
        observed_generation=generation,
    )


# How the operator reaches a PDService's router: in the cluster, the router Service's DNS name.
RouterUrlResolver = Callable[[PDService], str]


def service_dns_resolver(cluster_domain: str) -> RouterUrlResolver:
    def resolve(pds: PDService) -> str:
        return f"http://{pds.name}-router.{pds.namespace}.svc.{cluster_domain}:{pds.spec.router.port}/status"

    return resolve


def template_resolver(template: str) -> RouterUrlResolver:
    """A URL from a template with ``{name}``, ``{namespace}`` and ``{port}`` (port-forwards, tests)."""

    def resolve(pds: PDService) -> str:
        return template.format(name=pds.name, namespace=pds.namespace, port=pds.spec.router.port)

    return resolve


async def fetch_router_status(
    session: aiohttp.ClientSession, url: str, timeout_seconds: float
) -> TransferCounts:
    try:
        async with asyncio.timeout(timeout_seconds), session.get(url) as response:
            if response.status != 200:
                raise RouterStatusError(f"GET {url} answered HTTP {response.status}")
            payload = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise RouterStatusError(f"GET {url} failed: {e or type(e).__name__}") from e
    return parse_router_status(payload)
