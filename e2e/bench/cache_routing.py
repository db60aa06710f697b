"""Cache-aware vs least-loaded routing on real vLLM CPU engines, side by side in one run.

    .venv/bin/python e2e/bench/cache_routing.py --out out/cache-routing    # docs/benchmarks.md's figures
    .venv/bin/python e2e/bench/cache_routing.py --short --out DIR           # CI's form (a few minutes)

The tiny example runs as `pdctl up --engine vllm` runs it, with 2 prefill engines and 1 decode engine under
``spec.router.policy: cache-aware`` (so the engines publish vLLM's KV cache events). Each prefill engine's KV
cache holds fewer blocks than the workload's prefixes need: which prefill a prompt goes to decides whether
its prefix is still cached there, as in production, where the cache is the scarce resource.

The workload: a few long shared prefixes (system prompts), each opening several conversations with a random
question; every answer is followed by another random question (multi-turn: each turn's prompt is the whole
conversation so far). Conversations run a few at a time. Phases alternate the router's policy (ABBA in the
full form, AB in the short one) by rewriting its config, which it reloads in place; every phase draws fresh
prefixes, so none inherits the previous one's cache.

Per phase it reports the prefill engines' prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, in tokens), TTFT p50/p99 as the client sees it through the router, and how
the requests spread over the prefills. After the phases every prompt is sent to the decode engine alone
(co-located, no KV transfer): its answer must equal the one served through the router; then every engine's KV
cache must drain to zero blocks in use.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from streamed import stream_completion  # e2e/bench, this script's directory

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
POLICIES = ("least-loaded", "cache-aware")
# ABBA: an effect of the run's age (warmer allocator, fuller caches) falls on both policies alike.
FULL_ORDER = ("least-loaded", "cache-aware", "cache-aware", "least-loaded")
SHORT_ORDER = ("least-loaded", "cache-aware")
BLOCK_SIZE = 64
REQUEST_TIMEOUT_S = 300.0
DRAIN_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Workload:
    prefixes: int
    prefix_tokens: int
    conversations_per_prefix: int
    turns: int
    question_tokens: int
    answer_tokens: int
    concurrency: int
    prefill_blocks: int  # each prefill's KV cache: fewer blocks than the prefixes of a phase need


# Each prefill holds 96 blocks of 64 tokens (6,144 tokens: six prefixes), a phase's prefixes need 16,384:
# under least-loaded each prefill sees them all and keeps about 6 in 16; split in two, each keeps 6 in 8.
FULL = Workload(
    prefixes=16,
    prefix_tokens=1024,
    conversations_per_prefix=3,
    turns=3,
    question_tokens=32,
    answer_tokens=8,
    concurrency=4,
    prefill_blocks=96,
)
SHORT = dataclasses.replace(FULL, conversations_per_prefix=2, turns=2)


@dataclass
class Served:
    phase: int
    policy: str
    prompt: str
    ttft_s: float | None = None
    latency_s: float | None = None
    text: str = ""
    error: str | None = None


@dataclass
class PhaseReport:
    phase: int
    policy: str
    requests: int
    failed: int
    hit_rate: float
    prefix_tokens_hit: float
    prefix_tokens_queried: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    seconds: float
    requests_per_prefill: dict[str, float] = field(default_factory=dict)
    # the router's expectation: prompt tokens it believed cached where it sent them, over all prompt tokens
    expected_hit_rate: float = 0.0
    prefill_leg_ms: float = 0.0  # mean, as the router measured it
    decode_leg_ms: float = 0.0


def words(rng: random.Random, count: int, vocab: int) -> str:
    return " ".join(f"t{rng.randrange(1, vocab)}" for _ in range(count))


def service_document(workload: Workload) -> dict[str, Any]:
    document = yaml.safe_load(TINY.read_text())
    spec = document["spec"]
    spec["prefill"]["replicas"] = 2
    spec["prefill"]["extraArgs"] = ["--num-gpu-blocks-override", str(workload.prefill_blocks)]
    spec["router"]["policy"] = "cache-aware"
    spec["router"]["cacheAware"] = {"blockSize": BLOCK_SIZE}
    return document


def metric(url: str, family_name: str, suffix: str = "_total", **labels: str) -> float:
    """The ``family_name`` samples of ``url``'s /metrics named with ``suffix`` and carrying ``labels``,
    summed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            total += sum(
                s.value
                for s in family.samples
                if s.name == f"{family_name}{suffix}" and all(s.labels.get(k) == v for k, v in labels.items())
            )
    return total


def per_engine(
    urls: Sequence[str], family_name: str, suffix: str = "_total", **labels: str
) -> dict[str, float]:
    return {url: metric(url, family_name, suffix, **labels) for url in urls}


async def complete_turn(
    session: aiohttp.ClientSession, endpoint: str, model: str, served: Served, max_tokens: int
) -> None:
    body = {
        "model": model,
        "prompt": served.prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    streamed = await stream_completion(session, endpoint, body)
    served.text, served.error, served.ttft_s = streamed.text, streamed.error, streamed.ttft_s
    served.latency_s = time.monotonic() - streamed.started


async def run_phase(
    endpoint: str, model: str, workload: Workload, *, phase: int, policy: str, vocab: int
) -> list[Served]:
    rng = random.Random(1000 + phase)
    prefixes = [words(rng, workload.prefix_tokens, vocab) for _ in range(workload.prefixes)]
    conversations = [p for p in prefixes for _ in range(workload.conversations_per_prefix)]
    rng.shuffle(conversations)
    served: list[Served] = []
    gate = asyncio.Semaphore(workload.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def converse(session: aiohttp.ClientSession, prefix: str, seed: int) -> None:
        own = random.Random(seed)
        context = prefix
        async with gate:
            for _ in range(workload.turns):
                prompt = f"{context} {words(own, workload.question_tokens, vocab)}"
                turn = Served(phase, policy, prompt)
                served.append(turn)
                await complete_turn(session, endpoint, model, turn, workload.answer_tokens)
                if turn.error is not None:
                    return
                context = f"{prompt} {turn.text.strip()}"

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(converse(session, prefix, rng.randrange(2**31)) for prefix in conversations))
    return served


def percentile_ms(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else float("nan")


def set_policy(state_dir: Path, endpoint: str, policy: str) -> None:
    """Rewrite the running router's config with ``policy`` and wait until it serves under it."""
    from pdconnector.router.config import dump_router_config, load_router_config  # noqa: PLC0415
    from pdoperator.local.runner import write_router_config  # noqa: PLC0415

    config = load_router_config(state_dir / "router.yaml")
    write_router_config(state_dir, dump_router_config(config.model_copy(update={"policy": policy})))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{endpoint}/status", timeout=10) as response:
            if json.loads(response.read())["policy"] == policy:
                return
        time.sleep(0.25)
    raise RuntimeError(f"the router did not take policy {policy} within 30 s")


def colocated_mismatches(decode_url: str, model: str, served: Sequence[Served]) -> list[dict[str, str]]:
    """Requests whose routed answer differs from the decode engine's own answer to the same prompt."""
    mismatches = []
    for turn in served:
        body = json.dumps(
            {
                "model": model,
                "prompt": turn.prompt,
                "max_tokens": len(turn.text.split()) or 1,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"{decode_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        if text.strip() != turn.text.strip():
            mismatches.append({"phase": str(turn.phase), "routed": turn.text, "colocated": text})
    return mismatches


def blocks_in_use(urls: Sequence[str]) -> dict[str, float]:
    """Each engine's KV cache usage once all are at zero, or as they are at the deadline."""
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    while True:
        usage = per_engine(urls, "vllm:kv_cache_usage_perc", suffix="")
        if not any(usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def readings(prefills: Sequence[str], router: str) -> dict[str, dict[str, float]]:
    """The counters a phase is measured by, as they stand: per prefill engine, and the router's."""
    engines = {name: per_engine(prefills, name) for name in _PREFILL_COUNTERS}
    routed = {
        "expected_cached": per_engine([router], "pd_router_prefix_tokens", kind="cached"),
        "expected_prompt": per_engine([router], "pd_router_prefix_tokens", kind="prompt"),
        **{
            f"{role}_leg_{part}": per_engine([router], "pd_router_leg_seconds", f"_{part}", role=role)
            for role in ("prefill", "decode")
            for part in ("sum", "count")
        },
    }
    return {**engines, **routed}


def moved(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {
        name: {url: v - before[name].get(url, 0.0) for url, v in values.items()}
        for name, values in after.items()
    }


def _ratio(part: dict[str, float], whole: dict[str, float], scale: float = 1.0) -> float:
    total = sum(whole.values())
    return round(scale * sum(part.values()) / total, 4) if total else 0.0


def phase_report(
    *, phase: int, policy: str, served: Sequence[Served], change: dict[str, dict[str, float]], seconds: float
) -> PhaseReport:
    ok = [s for s in served if s.error is None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    return PhaseReport(
        phase=phase,
        policy=policy,
        requests=len(served),
        failed=len(served) - len(ok),
        hit_rate=_ratio(change["vllm:prefix_cache_hits"], change["vllm:prefix_cache_queries"]),
        prefix_tokens_hit=sum(change["vllm:prefix_cache_hits"].values()),
        prefix_tokens_queried=sum(change["vllm:prefix_cache_queries"].values()),
        ttft_p50_ms=percentile_ms(ttfts, 0.5),
        ttft_p99_ms=percentile_ms(ttfts, 0.99),
        latency_p50_ms=percentile_ms([s.latency_s for s in ok if s.latency_s is not None], 0.5),
        seconds=round(seconds, 1),
        requests_per_prefill=change["vllm:request_success"],
        expected_hit_rate=_ratio(change["expected_cached"], change["expected_prompt"]),
        prefill_leg_ms=round(_ratio(change["prefill_leg_sum"], change["prefill_leg_count"], 1000), 1),
        decode_leg_ms=round(_ratio(change["decode_leg_sum"], change["decode_leg_count"], 1000), 1),
    )


def summarise(phases: Sequence[PhaseReport], served: Sequence[Served]) -> dict[str, dict[str, float]]:
    """Per policy, over all its phases: hit rate (tokens), TTFT p50 and p99 of all its requests."""
    summary = {}
    for policy in POLICIES:
        mine = [p for p in phases if p.policy == policy]
        queried = sum(p.prefix_tokens_queried for p in mine)
        ttfts = [s.ttft_s for s in served if s.policy == policy and s.error is None and s.ttft_s is not None]
        summary[policy] = {
            "hit_rate": round(sum(p.prefix_tokens_hit for p in mine) / queried, 4) if queried else 0.0,
            "ttft_p50_ms": percentile_ms(ttfts, 0.5),
            "ttft_p99_ms": percentile_ms(ttfts, 0.99),
            "requests": sum(p.requests for p in mine),
            "failed": sum(p.failed for p in mine),
        }
    return summary


def table(phases: Sequence[PhaseReport], summary: dict[str, dict[str, float]]) -> str:
    lines = [
        "| phase | policy | requests | failed | prefill prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms "
        "| requests per prefill | router's expected hit rate | prefill / decode leg ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        spread = " / ".join(f"{n:g}" for n in p.requests_per_prefill.values())
        expected = f"{p.expected_hit_rate:.1%}" if p.policy == "cache-aware" else "(not hashed)"
        lines.append(
            f"| {p.phase} | {p.policy} | {p.requests} | {p.failed} | {p.hit_rate:.1%} | {p.ttft_p50_ms} | "
            f"{p.ttft_p99_ms} | {spread} | {expected} | "
            f"{p.prefill_leg_ms} / {p.decode_leg_ms} |"
        )
    for policy, s in summary.items():
        lines.append(
            f"| all | **{policy}** | {s['requests']} | {s['failed']} | **{s['hit_rate']:.1%}** | "
            f"**{s['ttft_p50_ms']}** | {s['ttft_p99_ms']} | | | |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdconnector.sim.tiny_model import VOCAB_SIZE, TinyModel, write_tiny_model  # noqa: PLC0415
    from pdoperator.api import parse_pdservice  # noqa: PLC0415
    from pdoperator.local import down, local_variant, plan_local_run, up  # noqa: PLC0415
    from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice  # noqa: PLC0415

    workload = SHORT if args.short else FULL
    order = SHORT_ORDER if args.short else FULL_ORDER
    model_dir = write_tiny_model(args.out / "tiny-model", TinyModel.DENSE_WIDE)
    pds = local_variant(parse_pdservice(service_document(workload)), runtime="vllm", dtype="float32")
    state_dir = args.out / "state"
    plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir, model_dir=model_dir)
    model = pds.spec.model.served_name or pds.spec.model.name
    prefills = [p.url for p in plan.processes if p.role is ComponentRole.PREFILL]
    decode = next(p.url for p in plan.processes if p.role is ComponentRole.DECODE)
    phases: list[PhaseReport] = []
    served: list[Served] = []
    up(plan, state_dir)
    try:
        # Warm-up: every engine's kernels for the prompt lengths the phases send, outside any phase.
        # A whole phase first, measured by neither policy: the engines compile their kernels for the batch
        # shapes a phase brings (a shorter warm-up left the first phase measured ~2x slower at decode). The
        # short form asserts no latency, so a quarter of the prefixes does there.
        warm_up = dataclasses.replace(workload, prefixes=workload.prefixes // 4) if args.short else workload
        asyncio.run(run_phase(plan.endpoint, model, warm_up, phase=0, policy="warm-up", vocab=VOCAB_SIZE))
        for index, policy in enumerate(order, start=1):
            set_policy(state_dir, plan.endpoint, policy)
            before = readings(prefills, plan.endpoint)
            began = time.monotonic()
            turns = asyncio.run(
                run_phase(plan.endpoint, model, workload, phase=index, policy=policy, vocab=VOCAB_SIZE)
            )
            seconds = time.monotonic() - began
            change = moved(readings(prefills, plan.endpoint), before)
            phases.append(
                phase_report(phase=index, policy=policy, served=turns, change=change, seconds=seconds)
            )
            served += turns
            print(table(phases[-1:], {}), flush=True)
        mismatches = colocated_mismatches(decode, model, [s for s in served if s.error is None])
        in_use = blocks_in_use([*prefills, decode])
    finally:
        down(state_dir)
    summary = summarise(phases, served)
    return {
        "workload": asdict(workload),
        "block_size": BLOCK_SIZE,
        "phases": [asdict(p) for p in phases],
        "summary": summary,
        "failures": [s.error for s in served if s.error is not None][:20],
        "requests": [
            {
                "phase": s.phase,
                "policy": s.policy,
                "ttft_ms": None if s.ttft_s is None else round(1000 * s.ttft_s, 1),
                "latency_ms": None if s.latency_s is None else round(1000 * s.latency_s, 1),
                "error": s.error,
            }
            for s in served
        ],
        "compared_with_colocated": len([s for s in served if s.error is None]),
        "colocated_mismatches": mismatches,
        "kv_cache_usage_after": in_use,
        "table": table(phases, summary),
    }


# Prefill counters read around each phase: hit and queried prompt tokens, finished requests.
_PREFILL_COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for the report and the run's state"
    )
    parser.add_argument("--short", action="store_true", help="CI's form: fewer conversations, two phases")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (args.out / "cache_routing.json").write_text(json.dumps(report, indent=2))
    (args.out / "summary.md").write_text(report["table"] + "\n")
    print(report["table"])
    print(json.dumps({k: report[k] for k in ("summary", "colocated_mismatches", "kv_cache_usage_after")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
