"""Chaos through the router on real vLLM CPU engines: faults on the engines while requests flow.

    .venv/bin/python e2e/bench/chaos.py --out out/chaos                 # docs/reliability.md's figures (push)
    .venv/bin/python e2e/bench/chaos.py --mode pull --out out/chaos-pull
    .venv/bin/python e2e/bench/chaos.py --short --out DIR                # CI's form

The tiny example runs as `pdctl up --engine vllm` runs it, with 2 prefill and 2 decode engines running our
connector behind the router (transfer timeout 5 s). Clients stream requests with prompts of mixed lengths
through the router, a few at a time, while a seeded schedule strikes the engines, alternating decode and
prefill: SIGKILL of the whole engine and a restart, SIGSTOP for a few seconds then SIGCONT, a restart
(SIGTERM, as Kubernetes stops a pod). Once the schedule is done and enough requests were sent, the load
stops.

What must hold: every answer the router served (200) equals the decode engine's own answer to the same prompt
(co-located, computed once the faults stopped); every request is answered, served or refused with a named
error, within the hang bound; once all is quiet no engine holds a KV block. The report counts the answers by
status, the router's retries by cause, and the faults with when they struck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from cache_routing import Served, blocks_in_use  # e2e/bench, this script's directory
from prometheus_client.parser import text_string_to_metric_families
from streamed import stream_completion

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
TRANSFER_TIMEOUT_S = 5
FREEZE_S = 4.0
# An answer later than this is a hang: a retry budget (30 s) plus a transfer timeout plus a slow CPU engine.
HANG_BOUND_S = 60.0
REQUEST_TIMEOUT_S = 2 * HANG_BOUND_S  # the client gives up later than the bound, so a hang is measured
PROMPT_WORDS = (8, 60, 130, 300, 700)
MAX_TOKENS = 8
FAULT_KINDS = ("kill", "freeze", "restart")


@dataclass(frozen=True)
class Plan:
    requests: int  # at least this many are sent, and the load runs until the faults are done
    concurrency: int
    faults: int
    fault_gap_s: float  # between the end of one fault and the next


FULL = Plan(requests=300, concurrency=6, faults=6, fault_gap_s=8.0)
SHORT = Plan(requests=40, concurrency=4, faults=2, fault_gap_s=3.0)


@dataclass
class Fault:
    kind: str
    engine: str
    at_s: float  # since the load began
    took_s: float = 0.0


def service_document(mode: str) -> dict[str, Any]:
    document = yaml.safe_load(TINY.read_text())
    spec = document["spec"]
    spec["mode"] = mode
    spec["prefill"]["replicas"] = spec["decode"]["replicas"] = 2
    spec["engine"]["transferTimeoutSeconds"] = TRANSFER_TIMEOUT_S
    return document


def prompts(rng: random.Random, vocab: int) -> list[str]:
    """A pool of prompts of mixed lengths; requests draw from it, so each answer has a co-located twin."""
    return [
        " ".join(f"t{rng.randrange(1, vocab)}" for _ in range(length))
        for length in PROMPT_WORDS
        for _ in range(5)
    ]


def schedule(plan: Plan, engines: dict[str, list[str]], seed: int) -> list[tuple[str, str]]:
    """(kind, engine) per fault: kinds in turn, roles alternating decode and prefill, engines drawn."""
    rng = random.Random(seed)
    roles = ("decode", "prefill")
    return [
        (FAULT_KINDS[i % len(FAULT_KINDS)], rng.choice(engines[roles[i % 2]])) for i in range(plan.faults)
    ]


class Engines:
    """Strikes the plan's engines by name, as a crash, a freeze or a stop of their pod would."""

    def __init__(self, plan: Any, state_dir: Path) -> None:  # a pdoperator.local LocalPlan
        self.processes = {process.name: process for process in plan.processes}
        self.state_dir = state_dir

    def _pid(self, name: str) -> int:
        from pdoperator.local import read_state  # noqa: PLC0415

        return next(process.pid for process in read_state(self.state_dir) if process.name == name)

    def strike(self, kind: str, name: str) -> None:
        from pdoperator.local.runner import start, stop  # noqa: PLC0415

        if kind == "freeze":
            os.killpg(self._pid(name), signal.SIGSTOP)
            time.sleep(FREEZE_S)
            os.killpg(self._pid(name), signal.SIGCONT)
            return
        if kind == "kill":
            os.killpg(self._pid(name), signal.SIGKILL)
        stop(
            self.state_dir, [name]
        )  # kill: reaps what is left; restart: SIGTERM, then SIGKILL at its deadline
        start([self.processes[name]], self.state_dir)  # waits until it answers /health


def completion_body(model: str, prompt: str, *, stream: bool) -> dict[str, Any]:
    """Greedy, exactly MAX_TOKENS tokens: the same answer wherever it is computed."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def colocated_answers(decode_url: str, model: str, pool: Sequence[str]) -> dict[str, str]:
    """Each prompt's answer from the decode engine alone (no KV transfer), asked once all is quiet."""
    answers = {}
    for prompt in pool:
        body = completion_body(model, prompt, stream=False)
        request = urllib.request.Request(
            f"{decode_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            answers[prompt] = json.loads(response.read())["choices"][0]["text"]
    return answers


def router_retries(endpoint: str) -> dict[str, float]:
    """The router's retries so far, by cause."""
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["cause"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "pd_router_retries"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def load(
    endpoint: str, model: str, pool: list[str], plan: Plan, *, faults_done: threading.Event, seed: int
) -> list[Served]:
    """Requests drawn from ``pool``, ``plan.concurrency`` at a time, until ``plan.requests`` were sent and the
    faults are done."""
    rng = random.Random(seed)
    served: list[Served] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def client(session: aiohttp.ClientSession) -> None:
        while len(served) < plan.requests or not faults_done.is_set():
            turn = Served(phase=len(served), policy="chaos", prompt=rng.choice(pool))
            served.append(turn)
            streamed = await stream_completion(
                session, endpoint, completion_body(model, turn.prompt, stream=True)
            )
            turn.text, turn.error, turn.ttft_s = streamed.text, streamed.error, streamed.ttft_s
            turn.latency_s = time.monotonic() - streamed.started
            if turn.error is not None:
                await asyncio.sleep(0.2)  # refused while engines restart: do not spin

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(plan.concurrency)))
    return served


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdconnector.sim.tiny_model import VOCAB_SIZE, TinyModel, write_tiny_model  # noqa: PLC0415
    from pdoperator.api import parse_pdservice  # noqa: PLC0415
    from pdoperator.local import down, local_variant, plan_local_run, up  # noqa: PLC0415
    from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice  # noqa: PLC0415

    plan = SHORT if args.short else FULL
    model_dir = write_tiny_model(args.out / "tiny-model", TinyModel.DENSE)
    pds = local_variant(parse_pdservice(service_document(args.mode)), runtime="vllm", dtype="float32")
    state_dir = args.out / "state"
    local = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir, model_dir=model_dir)
    model = pds.spec.model.served_name or pds.spec.model.name
    engines = {
        role.value: [p.name for p in local.processes if p.role is role]
        for role in (ComponentRole.PREFILL, ComponentRole.DECODE)
    }
    urls = [p.url for p in local.processes if p.role is not ComponentRole.ROUTER]
    decode_url = next(p.url for p in local.processes if p.role is ComponentRole.DECODE)
    pool = prompts(random.Random(args.seed), VOCAB_SIZE)
    strikes = schedule(plan, engines, args.seed)
    faults: list[Fault] = []
    faults_done = threading.Event()
    up(local, state_dir)
    try:
        striker = Engines(local, state_dir)
        began = time.monotonic()

        def strike_all() -> None:
            try:
                for kind, name in strikes:
                    time.sleep(plan.fault_gap_s)
                    fault = Fault(kind, name, round(time.monotonic() - began, 1))
                    striker.strike(kind, name)
                    fault.took_s = round(time.monotonic() - began - fault.at_s, 1)
                    faults.append(fault)
                    print(f"fault {len(faults)}/{len(strikes)}: {asdict(fault)}", flush=True)
            finally:
                faults_done.set()

        thread = threading.Thread(target=strike_all, daemon=True)
        thread.start()
        served = asyncio.run(load(local.endpoint, model, pool, plan, faults_done=faults_done, seed=args.seed))
        thread.join()
        seconds = time.monotonic() - began
        retries = router_retries(local.endpoint)
        colocated = colocated_answers(decode_url, model, pool)
        mismatches = [
            {"request": s.phase, "routed": s.text, "colocated": colocated[s.prompt]}
            for s in served
            if s.error is None and s.text.strip() != colocated[s.prompt].strip()
        ]
        in_use = blocks_in_use(urls)
    finally:
        down(state_dir)
    latencies = [s.latency_s for s in served if s.latency_s is not None]
    errors = Counter((s.error or "")[:8] for s in served if s.error is not None)  # "HTTP 502" etc.
    return {
        "mode": args.mode,
        "plan": asdict(plan),
        "seconds": round(seconds, 1),
        "requests": len(served),
        "served": len(served) - sum(errors.values()),
        "errors": dict(errors),
        "error_examples": sorted({s.error for s in served if s.error is not None})[:10],
        "wrong": len(mismatches),
        "mismatches": mismatches[:10],
        "slowest_s": round(max(latencies, default=0.0), 2),
        "hangs": sum(1 for seconds in latencies if seconds > HANG_BOUND_S),
        "hang_bound_s": HANG_BOUND_S,
        "faults": [asdict(fault) for fault in faults],
        "retries_by_cause": retries,
        "kv_cache_usage_after": in_use,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for the report and the run's state"
    )
    parser.add_argument("--mode", choices=("push", "pull"), default="push")
    parser.add_argument("--short", action="store_true", help="CI's form: fewer requests, two faults")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (args.out / f"chaos-{args.mode}.json").write_text(json.dumps(report, indent=2))
    print(
        json.dumps({k: v for k, v in report.items() if k not in ("mismatches", "error_examples")}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
