"""Router cost: added latency against calling the engines directly, and throughput per router core, per
dispatch.

Run: ``python -m pdconnector.bench.router_bench [--requests N] [--duration S] [--concurrency C]``.

One run starts 2 prefill + 2 decode mock engines (the connector core's transfer worker over the TCP mock
transport), a co-located reference engine, and three routers (pull, push-sequential, push-concurrent), each
pinned to its own CPU when the machine has more than one. Then:

* latency: ``--requests`` sequential non-streaming requests per path. ``direct`` paths are this client doing
  the router's work itself (the same legs, with the same kv_transfer_params, straight to the engines); the
  router's added latency is the router path minus the matching direct path. ``co-located`` is one engine
  without P/D.
* throughput: ``--concurrency`` requests in flight for ``--duration`` seconds per router; ``req/s`` is what
  the whole loopback deployment sustained, ``req/s per router core`` divides completed requests by the CPU
  seconds the router process used (what one core could carry if the router were the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from pdconnector.protocol.params import (
    EngineRole,
    PrefillCoordinates,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)
from pdconnector.sim.cluster import Engine, LocalCluster, Process

MODEL = "tiny"
ROUTERS = {
    "pull": ("pull", []),
    "push-sequential": ("push", ["--dispatch", "push-sequential"]),
    "push-concurrent": ("push", []),
}
Call = Callable[[aiohttp.ClientSession, int], Awaitable[None]]


def body(
    index: int, prompt_tokens: int, max_tokens: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    # distinct per request: no shared prefixes
    prompt = [(index * 7919 + i) % 1000 for i in range(prompt_tokens)]
    out: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


async def post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url + "/v1/completions", json=payload) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {answer}")
        return answer


def coordinates(engine: Engine, cluster: LocalCluster) -> PrefillCoordinates:
    return PrefillCoordinates(engine.engine_id, engine.host, cluster.ports["prefill-side"], 1)


def direct_calls(cluster: LocalCluster, prompt_tokens: int, max_tokens: int) -> dict[str, Call]:
    """The router's work done by the client itself, alternating engines as a router would."""
    prefills = [e for e in cluster.engines.values() if e.role is EngineRole.PREFILL]
    decodes = [e for e in cluster.engines.values() if e.role is EngineRole.DECODE]

    async def colocated(session: aiohttp.ClientSession, index: int) -> None:
        await post(session, cluster.engines["colocated"].url, body(index, prompt_tokens, max_tokens))

    async def pull(session: aiohttp.ClientSession, index: int) -> None:
        prefill, decode, tid = prefills[index % 2], decodes[index % 2], mint_transfer_id()
        first = await post(
            session, prefill.url, body(index, prompt_tokens, 1, prefill_leg_params(TransferMode.PULL, tid))
        )
        await post(
            session,
            decode.url,
            body(index, prompt_tokens, max_tokens, pull_decode_leg_params(first["kv_transfer_params"], tid)),
        )

    async def push(session: aiohttp.ClientSession, index: int, concurrent: bool) -> None:
        prefill, decode, tid = prefills[index % 2], decodes[index % 2], mint_transfer_id()
        prefill_leg = post(
            session, prefill.url, body(index, prompt_tokens, 1, prefill_leg_params(TransferMode.PUSH, tid))
        )
        decode_leg = post(
            session,
            decode.url,
            body(
                index, prompt_tokens, max_tokens, push_decode_leg_params(tid, coordinates(prefill, cluster))
            ),
        )
        if concurrent:
            await asyncio.gather(prefill_leg, decode_leg)
        else:
            await prefill_leg
            await decode_leg

    return {
        "co-located": colocated,
        "pull": pull,
        "push-sequential": lambda s, i: push(s, i, concurrent=False),
        "push-concurrent": lambda s, i: push(s, i, concurrent=True),
    }


def router_call(router: Process, prompt_tokens: int, max_tokens: int) -> Call:
    async def call(session: aiohttp.ClientSession, index: int) -> None:
        await post(session, router.url, body(index, prompt_tokens, max_tokens))

    return call


async def latencies(call: Call, requests: int, offset: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        for warmup in range(5):
            await call(session, offset - 100 - warmup)
        samples = []
        for index in range(requests):
            start = time.perf_counter()
            await call(session, offset + index)
            samples.append(time.perf_counter() - start)
    return samples


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(
    call: Call, concurrency: int, duration_s: float, offset: int, router_pid: int
) -> tuple[float, float, int]:
    completed = failed = 0
    stop_at = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker(lane: int) -> None:
            nonlocal completed, failed
            index = offset + lane * 1_000_000
            while time.perf_counter() < stop_at:
                try:
                    await call(session, index)
                    completed += 1
                except (RuntimeError, aiohttp.ClientError):
                    failed += 1
                index += 1

        cpu_before, wall_before = cpu_seconds(router_pid), time.perf_counter()
        await asyncio.gather(*(worker(lane) for lane in range(concurrency)))
        cpu_used, wall = cpu_seconds(router_pid) - cpu_before, time.perf_counter() - wall_before
    return completed / wall, completed / max(cpu_used, 1e-9), failed


def percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if len(samples) > 1 else samples[0]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.2f}"


def pin(pid: int, cpu: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(pid, {cpus[cpu % len(cpus)]})


async def run(cluster: LocalCluster, args: argparse.Namespace) -> None:
    direct = direct_calls(cluster, args.prompt_tokens, args.max_tokens)
    print(
        f"latency: {args.requests} sequential requests per path, prompt {args.prompt_tokens} tokens, "
        f"{args.max_tokens} output tokens (ms)"
    )
    print(
        f"{'path':<18}{'direct p50':>12}{'direct p99':>12}{'router p50':>12}{'router p99':>12}"
        f"{'added p50':>12}{'added p99':>12}"
    )
    base = await latencies(direct["co-located"], args.requests, 10_000)
    print(f"{'co-located':<18}{ms(percentile(base, 50)):>12}{ms(percentile(base, 99)):>12}")
    for offset, name in enumerate(ROUTERS, start=1):
        own = await latencies(direct[name], args.requests, 10_000 * (offset * 2))
        routed = await latencies(
            router_call(cluster.routers[name], args.prompt_tokens, args.max_tokens),
            args.requests,
            10_000 * (offset * 2 + 1),
        )
        p50, p99 = percentile(routed, 50), percentile(routed, 99)
        print(
            f"{name:<18}{ms(percentile(own, 50)):>12}{ms(percentile(own, 99)):>12}{ms(p50):>12}{ms(p99):>12}",
            end="",
        )
        print(f"{ms(p50 - percentile(own, 50)):>12}{ms(p99 - percentile(own, 99)):>12}")
    print(f"\nthroughput: {args.concurrency} in flight for {args.duration:g} s per router")
    print(f"{'router':<18}{'req/s':>10}{'req/s per router core':>24}{'failed':>8}")
    for offset, name in enumerate(ROUTERS, start=1):
        router = cluster.routers[name]
        assert router.popen is not None
        rate, per_core, failed = await throughput(
            router_call(router, args.prompt_tokens, args.max_tokens),
            args.concurrency,
            args.duration,
            offset * 100_000_000,
            router.popen.pid,
        )
        print(f"{name:<18}{rate:>10.0f}{per_core:>24.0f}{failed:>8}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per path for latency")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of load per router")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefill-seconds-per-token", type=float, default=0.0)
    parser.add_argument("--decode-seconds-per-token", type=float, default=0.0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where logs and configs go (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    engine_args = [
        "--prefill-seconds-per-token",
        str(args.prefill_seconds_per_token),
        "--decode-seconds-per-token",
        str(args.decode_seconds_per_token),
    ]
    with tempfile.TemporaryDirectory(prefix="router-bench-") as scratch:
        cluster = LocalCluster(
            workdir=args.workdir or Path(scratch),
            subnet=180,
            engine_args=[*engine_args, "--log-format", "json"],
        )
        try:
            cluster.start()
            for index, (name, (mode, extra)) in enumerate(ROUTERS.items()):
                router = cluster.start_router(name, mode, extra_args=[*extra, "--log-format", "json"])
                assert router.popen is not None
                pin(router.popen.pid, index)
            print(
                "engines: 2 prefill + 2 decode (+1 co-located), transport mock (TCP), CPUs available: "
                f"{len(os.sched_getaffinity(0))}"
            )
            asyncio.run(run(cluster, args))
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
