"""The autoscaler's closed loop on this machine: a load ramp through `pdctl up --autoscale` and what it did.

    .venv/bin/python e2e/bench/autoscale_ramp.py --out docs/bench-autoscale          # 2 -> 24 -> 2 QPS
    .venv/bin/python e2e/bench/autoscale_ramp.py --short --out /tmp/ramp              # 2 -> 12 -> 2, ~2 min

It starts the example (mock engines with a capacity: prefill a token throughput, decode a batch that slows
as it grows; see ``examples/tiny-autoscaled.yaml``) under the builtin autoscaler, then sends streaming
completions of ``--prompt-tokens`` token prompts at the QPS of each phase, open loop (Poisson arrivals, a
fixed seed). Every request's TTFT and TPOT are measured here, at the client; the replicas per role come
from the autoscaler's own record of each round (``autoscale.jsonl``). Out:

- ``ramp.json``: per window of ``--window`` seconds the offered QPS, TTFT and TPOT p90 and failures; every
  autoscaler round; the summary checks: failed requests, the ratio range at every round, and per load step
  how long TTFT p90 stayed above its target (``settle_s``: from the step to the end of the last window over
  target; 0 when none was);
- ``ramp.png``: QPS, replicas per role and TTFT/TPOT p90 over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from streamed import stream_completion  # e2e/bench, this script's directory

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-autoscaled.yaml"
LONG = ((2.0, 40.0), (24.0, 90.0), (2.0, 90.0))  # (QPS, seconds) per phase
SHORT = ((2.0, 15.0), (12.0, 50.0), (2.0, 45.0))
STARTUP_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Result:
    start: float  # seconds since the ramp began
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str = ""


def start_service(example: Path, state_dir: Path, interval_s: float) -> tuple[subprocess.Popen[str], str]:
    """`pdctl up --autoscale` in the background; returns it once it autoscales, and the router's URL."""
    pdctl = Path(sys.executable).parent / "pdctl"
    command = [str(pdctl), "up", "--autoscale", "-f", str(example), "--state-dir", str(state_dir)]
    command += ["--autoscale-interval", str(interval_s)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    endpoint, deadline = "", time.monotonic() + STARTUP_TIMEOUT_S
    for line in process.stdout:
        print(line, end="", flush=True)
        if " is up in " in line:
            endpoint = line.split(": ", 1)[1].split()[0].removesuffix("/v1")
        if line.startswith("autoscaling;"):
            return process, endpoint
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"pdctl up --autoscale did not start (exit {process.wait()})")


async def one_request(
    session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], began: float
) -> Result:
    streamed = await stream_completion(session, endpoint, body)
    if streamed.error is not None:
        return Result(streamed.started - began, ok=False, error=streamed.error)
    return Result(streamed.started - began, ok=True, ttft_s=streamed.ttft_s, tpot_s=streamed.tpot_s)


async def drive(
    endpoint: str, phases: tuple[tuple[float, float], ...], prompt_tokens: int, max_tokens: int, seed: int
) -> list[Result]:
    """Open-loop Poisson arrivals at each phase's QPS; waits for every request to end."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        began, tasks, index = time.monotonic(), [], 0
        phase_start = 0.0
        for qps, seconds in phases:
            at = phase_start
            while (at := at + rng.expovariate(qps)) < phase_start + seconds:
                await asyncio.sleep(max(0.0, began + at - time.monotonic()))
                prompt = [(index * 7919 + i) % 1000 for i in range(prompt_tokens)]
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                tasks.append(asyncio.create_task(one_request(session, endpoint, body, began)))
                index += 1
            phase_start += seconds
        return list(await asyncio.gather(*tasks))


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def windows(results: list[Result], total_s: float, window_s: float) -> list[dict[str, Any]]:
    """Per window of request starts: offered QPS, TTFT and TPOT p90 (seconds) of its requests, failures."""
    out = []
    for k in range(math.ceil(total_s / window_s)):
        lo, hi = k * window_s, (k + 1) * window_s
        inside = [r for r in results if lo <= r.start < hi]
        out.append(
            {
                "start_s": lo,
                "qps": len(inside) / window_s,
                "ttft_p90_s": p90([r.ttft_s for r in inside if r.ttft_s is not None]),
                "tpot_p90_s": p90([r.tpot_s for r in inside if r.tpot_s is not None]),
                "failed": sum(not r.ok for r in inside),
            }
        )
    return out


def settle_times(
    spans: list[dict[str, Any]], phases: tuple[tuple[float, float], ...], window_s: float, target_s: float
) -> list[dict[str, float]]:
    """Per phase: how long after its start TTFT p90 last stood above target (0: never)."""
    out, start = [], 0.0
    for qps, seconds in phases:
        over = [
            w["start_s"] + window_s - start
            for w in spans
            if start <= w["start_s"] < start + seconds and (w["ttft_p90_s"] or 0) > target_s
        ]
        out.append({"phase_start_s": start, "qps": qps, "settle_s": max(over, default=0.0)})
        start += seconds
    return out


def read_rounds(state_dir: Path, began_wall: float) -> list[dict[str, Any]]:
    rounds = []
    for line in (state_dir / "autoscale.jsonl").read_text().splitlines():
        entry = json.loads(line)
        rounds.append({**entry, "t_s": entry["at"] - began_wall})
    return rounds


def ratio_violations(rounds: list[dict[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Rounds whose serving engines break the prefill:decode range (or a role's bounds)."""
    scaling = spec["autoscaling"]
    ratio = scaling.get("prefillPerDecode") or {}
    low, high = ratio.get("minPercent", 0) / 100, ratio.get("maxPercent", math.inf) / 100
    bad = []
    for entry in rounds:
        prefill, decode = entry["prefill"]["serving"], entry["decode"]["serving"]
        in_bounds = all(
            scaling[role].get("minReplicas", 1) <= entry[role]["serving"] <= scaling[role]["maxReplicas"]
            for role in ("prefill", "decode")
        )
        if not in_bounds or decode == 0 or not low - 1e-9 <= prefill / decode <= high + 1e-9:
            bad.append(entry)
    return bad


def plot(
    path: Path, spans: list[dict[str, Any]], rounds: list[dict[str, Any]], targets: dict[str, Any]
) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (load, replicas, latency) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    t = [w["start_s"] for w in spans]
    load.step(t, [w["qps"] for w in spans], where="post")
    load.set_ylabel("offered QPS")
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        times = [r["t_s"] for r in rounds]
        replicas.step(
            times, [r[role]["serving"] for r in rounds], where="post", color=color, label=f"{role} serving"
        )
        replicas.step(
            times,
            [r[role]["replicas"] for r in rounds],
            where="post",
            color=color,
            linestyle=":",
            label=f"{role} running",
        )
    replicas.set_ylabel("engines")
    replicas.legend(loc="upper right")
    for key, label, target in (
        ("ttft_p90_s", "TTFT p90", targets.get("ttftMilliseconds")),
        ("tpot_p90_s", "TPOT p90", targets.get("tpotMilliseconds")),
    ):
        line = latency.plot(t, [(w[key] or math.nan) * 1000 for w in spans], label=label)[0]
        if target:
            latency.axhline(target, color=line.get_color(), linestyle="--", linewidth=0.8)
    latency.set_yscale("log")
    latency.set_ylabel("ms (dashed: targets)")
    latency.set_xlabel("seconds")
    latency.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument("--out", type=Path, required=True, help="directory for ramp.json and ramp.png")
    parser.add_argument("--short", action="store_true", help="2 -> 12 -> 2 QPS in under two minutes (CI)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between autoscaler rounds")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per reported window")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    phases = SHORT if args.short else LONG
    spec = yaml.safe_load(args.example.read_text())["spec"]
    targets = spec["autoscaling"]["targets"]
    args.out.mkdir(parents=True, exist_ok=True)
    state_dir = args.out / "state"
    service, endpoint = start_service(args.example, state_dir, args.interval)
    try:
        began_wall = time.time()
        results = asyncio.run(drive(endpoint, phases, args.prompt_tokens, args.max_tokens, args.seed))
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
    total_s = sum(seconds for _, seconds in phases)
    spans = windows(results, total_s, args.window)
    rounds = read_rounds(state_dir, began_wall)
    settle = settle_times(spans, phases, args.window, targets["ttftMilliseconds"] / 1000)
    failures = [asdict(r) for r in results if not r.ok]
    report = {
        "phases": [{"qps": qps, "seconds": seconds} for qps, seconds in phases],
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": len(results),
        "failed": len(failures),
        "failures": failures[:20],
        "settle": settle,
        "ratio_violations": ratio_violations(rounds, spec),
        "max_serving": {role: max(r[role]["serving"] for r in rounds) for role in ("prefill", "decode")},
        "windows": spans,
        "rounds": rounds,
    }
    (args.out / "ramp.json").write_text(json.dumps(report, indent=1))
    plot(args.out / "ramp.png", spans, rounds, targets)
    print(f"{len(results)} requests, {len(failures)} failed; max serving {report['max_serving']}")
    print(f"ratio or bounds broken at {len(report['ratio_violations'])} of {len(rounds)} rounds")
    for step in settle:
        print(
            f"  from {step['phase_start_s']:5.0f} s at {step['qps']:4.0f} QPS: TTFT p90 over target for "
            f"{step['settle_s']:.0f} s"
        )
    print(f"{'t (s)':>6}{'QPS':>6}{'TTFT p90 ms':>13}{'TPOT p90 ms':>13}{'failed':>8}")
    for w in spans:
        ttft = f"{w['ttft_p90_s'] * 1000:.0f}" if w["ttft_p90_s"] is not None else "-"
        tpot = f"{w['tpot_p90_s'] * 1000:.1f}" if w["tpot_p90_s"] is not None else "-"
        print(f"{w['start_s']:6.0f}{w['qps']:6.1f}{ttft:>13}{tpot:>13}{w['failed']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
