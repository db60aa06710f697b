"""Upstream vLLM P/D baselines on real CPU engines: prints figures, writes a JSON report.

Runs the tiny dense model three ways and compares them:
  1. co-located: one engine without a KV connector (the reference outputs and local latency);
  2. upstream ``NixlConnector`` pull: prefill leg (``max_tokens=1``) then decode leg;
  3. upstream ``NixlPushConnector`` push: both legs at once, each bounded by a timeout.

At most two engines run at a time (this machine has 2 cores shared with other work).

    .venv/bin/python e2e/vllm/baseline.py --out /tmp/baseline.json [--skip-push] [--model dense|hybrid]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The harness lives with the tests (namespace package ``tests``) so both share one engine launcher.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdconnector.sim.tiny_model import VOCAB_SIZE, TinyModel, write_tiny_model

from tests.pdconnector.vllm import harness

BLOCK_SIZE = 128  # vLLM's CPU default; prompt lengths straddle it
PROMPT_LENGTHS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 1000)
MAX_TOKENS = 8
IDLE_WINDOW_S = 10.0


def prompt_of(length: int, salt: int = 0) -> list[int]:
    """Deterministic, distinct prompts (distinct first token per salt so no two requests share KV)."""
    return [(7 * salt + 13 * i + length) % VOCAB_SIZE for i in range(length)]


def measure_colocated(
    model_dir: Path, log_dir: Path, env: dict[str, str], startup_timeout_s: float
) -> tuple[dict[int, harness.Completion], dict[str, Any]]:
    with harness.start_server(
        "colocated", model_dir, log_dir, env=env, startup_timeout_s=startup_timeout_s
    ) as server:
        figures: dict[str, Any] = {"engine_start_s": server.ready_after_s}
        references = {
            n: harness.complete(server.url, prompt_of(n), max_tokens=MAX_TOKENS) for n in PROMPT_LENGTHS
        }
        figures["local_request_s"] = {n: references[n].elapsed_s for n in PROMPT_LENGTHS}
        figures["idle_cores"] = harness.idle_cpu_fraction([server], IDLE_WINDOW_S)
    return references, figures


def compare(
    references: dict[int, harness.Completion], outputs: dict[int, harness.Completion]
) -> dict[int, list[str]]:
    return {n: harness.output_differences(references[n], outputs[n]) for n in outputs}


def measure_pull(
    model_dir: Path,
    log_dir: Path,
    env: dict[str, str],
    references: dict[int, harness.Completion],
    rounds: int,
    *,
    startup_timeout_s: float,
) -> dict[str, Any]:
    pair = harness.launch_upstream_pair(harness.UpstreamConnector.PULL, model_dir, log_dir, extra_env=env)
    figures: dict[str, Any] = {}
    with harness.running_servers(pair.prefill, pair.decode, startup_timeout_s=startup_timeout_s):
        figures["engine_start_s"] = {
            "prefill": pair.prefill.ready_after_s,
            "decode": pair.decode.ready_after_s,
        }
        figures["idle_cores"] = harness.idle_cpu_fraction([pair.prefill, pair.decode], IDLE_WINDOW_S)

        requests: list[dict[str, Any]] = []
        outputs: dict[int, harness.Completion] = {}
        for round_index in range(rounds):
            for n in PROMPT_LENGTHS:
                # Round 0 uses the reference prompts; later rounds use fresh prompts (no reuse of any cache).
                prompt = prompt_of(n) if round_index == 0 else prompt_of(n, salt=round_index)
                result = harness.pd_pull(
                    pair.prefill.url, pair.decode.url, prompt, max_tokens=MAX_TOKENS, timeout_s=600
                )
                local = harness.complete(pair.decode.url, prompt, max_tokens=MAX_TOKENS)
                if round_index == 0:
                    outputs[n] = result.decode
                requests.append(
                    {
                        "round": round_index,
                        "prompt_tokens": n,
                        "total_s": result.elapsed_s,
                        "prefill_leg_s": result.prefill.elapsed_s,
                        "decode_leg_s": result.decode.elapsed_s,
                        "local_on_decode_s": local.elapsed_s,
                        "same_as_local_on_decode": not harness.output_differences(local, result.decode),
                    }
                )
                print(f"  pull round {round_index} n={n}: {requests[-1]}", flush=True)
        figures["requests"] = requests
        figures["first_request_total_s"] = requests[0]["total_s"]
        steady = [r for r in requests if r["round"] > 0] or requests[1:]
        figures["steady_median"] = {
            key: statistics.median(r[key] for r in steady)
            for key in ("total_s", "prefill_leg_s", "decode_leg_s", "local_on_decode_s")
        }
        figures["differences_vs_colocated"] = compare(references, outputs)
        figures["idle_cores_after_requests"] = harness.idle_cpu_fraction(
            [pair.prefill, pair.decode], IDLE_WINDOW_S
        )
    return figures


def measure_push(
    model_dir: Path,
    log_dir: Path,
    env: dict[str, str],
    references: dict[int, harness.Completion],
    timeout_s: float,
    *,
    startup_timeout_s: float,
) -> dict[str, Any]:
    pair = harness.launch_upstream_pair(harness.UpstreamConnector.PUSH, model_dir, log_dir, extra_env=env)
    figures: dict[str, Any] = {}
    with harness.running_servers(pair.prefill, pair.decode, startup_timeout_s=startup_timeout_s):
        figures["engine_start_s"] = {
            "prefill": pair.prefill.ready_after_s,
            "decode": pair.decode.ready_after_s,
        }
        attempts = []
        for index, n in enumerate((BLOCK_SIZE + 1, BLOCK_SIZE + 1, 1)):
            request_id = f"push-baseline-{index}"
            prefill_params, decode_params = harness.upstream_push_params(pair, request_id)
            started = time.monotonic()
            attempt: dict[str, Any] = {"prompt_tokens": n}
            try:
                result = harness.pd_push(
                    pair.prefill.url,
                    pair.decode.url,
                    prompt_of(n),
                    max_tokens=MAX_TOKENS,
                    prefill_params=prefill_params,
                    decode_params=decode_params,
                    request_id=request_id,
                    timeout_s=timeout_s,
                )
                attempt.update(
                    ok=True,
                    differences=harness.output_differences(references[n], result.decode),
                    decode_leg_s=result.decode.elapsed_s,
                )
            except harness.CompletionError as error:
                attempt.update(ok=False, status=error.status, error=error.body[:300])
            attempt["total_s"] = time.monotonic() - started
            attempt["engines_alive"] = {
                "prefill": pair.prefill.is_running(),
                "decode": pair.decode.is_running(),
            }
            attempts.append(attempt)
            print(f"  push attempt {index}: {attempt}", flush=True)
        figures["attempts"] = attempts
        figures["idle_cores"] = harness.idle_cpu_fraction([pair.prefill, pair.decode], IDLE_WINDOW_S)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--model", choices=[m.value for m in TinyModel], default=TinyModel.DENSE.value)
    parser.add_argument("--skip-pull", action="store_true")
    parser.add_argument("--skip-push", action="store_true")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=harness.DEFAULT_STARTUP_TIMEOUT_S,
        help="per engine start, seconds",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="pull rounds over all prompt lengths (round 0 = reference prompts)",
    )
    parser.add_argument(
        "--push-timeout", type=float, default=120.0, help="per push request (both legs), seconds"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="model and engine logs (default: a temp dir)"
    )
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-baseline-"))
    kind = TinyModel(args.model)
    model_dir = write_tiny_model(workdir / kind.value, kind)
    log_dir = workdir / "logs"
    env = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"} if kind is TinyModel.HYBRID else {}
    print(f"workdir {workdir}", flush=True)

    report: dict[str, Any] = {"model": kind.value, "prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS}
    references, report["colocated"] = measure_colocated(model_dir, log_dir, env, args.startup_timeout)
    print(f"colocated: {report['colocated']}", flush=True)
    if not args.skip_pull:
        report["upstream_pull"] = measure_pull(
            model_dir, log_dir, env, references, args.rounds, startup_timeout_s=args.startup_timeout
        )
        pull = report["upstream_pull"]
        print(f"upstream pull: start {pull['engine_start_s']}, idle cores {pull['idle_cores']}", flush=True)
        print(
            f"  first P/D request {pull['first_request_total_s']:.2f} s, steady medians "
            f"{pull['steady_median']}",
            flush=True,
        )
        print(f"  differences vs co-located: {pull['differences_vs_colocated']}", flush=True)
    if not args.skip_push:
        report["upstream_push"] = measure_push(
            model_dir, log_dir, env, references, args.push_timeout, startup_timeout_s=args.startup_timeout
        )
        push = report["upstream_push"]
        print(
            f"upstream push: start {push['engine_start_s']}, "
            f"{sum(a['ok'] for a in push['attempts'])}/{len(push['attempts'])} ok",
            flush=True,
        )
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
