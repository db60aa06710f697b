"""`pdctl up --autoscale`: the operator's builtin autoscaler over a local run.

The same rounds as in the cluster (``pdoperator.autoscale.rounds``: read the router's and every engine's
``/metrics``, plan, move the scale), and the same consequences turned into processes instead of StatefulSet
replicas: a new scale is rendered exactly as the operator renders it, planned into local processes, and
applied in the order that fails no request. New engines start and answer /health before the router's config
names them; engines that leave are first marked draining in the router's config, and only stopped in a later
round, once the router and the engine say nothing is left on them.

Each round appends one JSON line to ``<state dir>/autoscale.jsonl`` (time, the scale, the reason), which is
what the load-ramp benchmark plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdoperator.api import PDService
from pdoperator.api.autoscaling import AutoscalingSpec
from pdoperator.autoscale.planner import Replicas
from pdoperator.autoscale.policy import policy_of
from pdoperator.autoscale.rounds import History, autoscale_round
from pdoperator.autoscale.scale import Scale, initial_scale
from pdoperator.reconcile.metrics_source import MetricsUrls, read_metrics
from pdoperator.reconcile.scaling import scaled
from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice
from pdoperator.render.names import pod_name

from .plan import LocalPlan, plan_local_run
from .runner import is_running, read_state, start, stop, write_router_config

ROUNDS_FILE = "autoscale.jsonl"
METRICS_TIMEOUT_S = 2.0


def starting_scale(pds: PDService) -> Scale:
    """Where the roles of an autoscaled local run start (the requested counts, fitted into the bounds)."""
    scaling = _scaling(pds)
    return initial_scale(policy_of(scaling), Replicas(pds.spec.prefill.replicas, pds.spec.decode.replicas))


def local_plan(pds: PDService, scale: Scale | None, state_dir: Path, model_dir: Path | None) -> LocalPlan:
    """The processes and router config of ``pds`` (at ``scale``, when autoscaled), rendered as the operator
    renders it."""
    at_scale = pds if scale is None else scaled(pds, scale)
    return plan_local_run(
        at_scale, render_pdservice(at_scale, RenderDefaults()), state_dir, model_dir=model_dir
    )


def _scaling(pds: PDService) -> AutoscalingSpec:
    if pds.spec.autoscaling is None:
        raise ValueError(f"{pds.namespace}/{pds.name} has no spec.autoscaling: nothing to autoscale")
    return pds.spec.autoscaling


@dataclass
class LocalAutoscaler:
    pds: PDService
    state_dir: Path
    scale: Scale
    model_dir: Path | None = None
    interval_s: float = 2.0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        scaling = _scaling(self.pds)
        self.policy = policy_of(scaling)
        self.percentile = scaling.targets.percentile
        self.drain_timeout_s = scaling.drain_timeout_seconds
        self.history = History()
        self.draining_since: float | None = None
        self.plan = local_plan(self.pds, self.scale, self.state_dir, self.model_dir)

    def _urls(self) -> MetricsUrls:
        urls = {process.name: process.url for process in self.plan.processes}
        return MetricsUrls(
            router=lambda pds: f"{self.plan.endpoint}/metrics",
            engine=lambda pds, role, ordinal: f"{urls.get(pod_name(pds, role, ordinal), '')}/metrics",
        )

    async def run(self, stop_event: asyncio.Event) -> None:
        """Rounds every ``interval_s`` until ``stop_event`` is set or the router is gone (`pdctl down`)."""
        async with aiohttp.ClientSession() as session:
            while not stop_event.is_set():
                if not self._router_running():
                    return
                await self.round(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_event.wait(), self.interval_s)

    def _router_running(self) -> bool:
        routers = {process.name for process in self.plan.processes if process.role is ComponentRole.ROUTER}
        return any(process.name in routers and is_running(process) for process in read_state(self.state_dir))

    async def round(self, session: aiohttp.ClientSession) -> Scale:
        """One round: read, decide, apply; returns the scale after it."""
        readings = await read_metrics(session, self._urls(), self.pds, self.scale, METRICS_TIMEOUT_S)
        expired = (
            self.draining_since is not None and self.clock() - self.draining_since >= self.drain_timeout_s
        )
        decided = autoscale_round(
            self.policy,
            self.percentile,
            self.history,
            self.scale,
            readings,
            pod_name=lambda role, ordinal: pod_name(self.pds, ComponentRole(role.value), ordinal),
            drain_expired=expired,
            routers_reloaded=True,  # a local run has one router, the one whose metrics say draining
        )
        self.history = decided.history
        changed = decided.scale != self.scale
        if changed:
            await asyncio.to_thread(self._apply, decided.scale)
        self._record(decided.reason, changed)
        return self.scale

    def _apply(self, scale: Scale) -> None:
        """Move the processes and the router's config to ``scale``: new engines up and healthy before the
        router names them, leaving ones stopped only after the config that drops them."""
        plan = local_plan(self.pds, scale, self.state_dir, self.model_dir)
        wanted = {process.name for process in plan.processes}
        running = {process.name for process in read_state(self.state_dir) if is_running(process)}
        start([process for process in plan.processes if process.name not in running], self.state_dir)
        write_router_config(self.state_dir, plan.router_config)
        stop(self.state_dir, running - wanted)
        self.plan, self.scale = plan, scale
        if not scale.draining:
            self.draining_since = None
        elif self.draining_since is None:
            self.draining_since = self.clock()

    def _record(self, reason: str, changed: bool) -> None:
        line = {
            "at": time.time(),
            "prefill": {"replicas": self.scale.prefill.replicas, "serving": self.scale.prefill.serving},
            "decode": {"replicas": self.scale.decode.replicas, "serving": self.scale.decode.serving},
            "changed": changed,
            "reason": reason,
        }
        with (self.state_dir / ROUNDS_FILE).open("a") as rounds:
            rounds.write(json.dumps(line) + "\n")
