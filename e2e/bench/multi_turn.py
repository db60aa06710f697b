"""Multi-turn conversations through the router, decode's KV tier off and on, side by side in one run.

    .venv/bin/python e2e/bench/multi_turn.py --out out/multi-turn

Many conversations share a system prompt; each turn resends the whole history (the system prompt, every
earlier turn's user tokens and answer) plus new user tokens, as chat clients and agents do. Both variants
are the tiny example on real vLLM engines with our connector (``pdctl up --engine vllm``; push by default;
``--spec examples/tiny-gpu-vllm.yaml`` on a GPU machine), both engines' prefix caches off so that the history
never survives in their caches (the case of histories larger than their GPU memory); ``tier-on`` adds
``spec.kvCache.offload`` for both roles. The conversations run turn by turn, one request at a time, so each
request's figures are read from the engines' counters around it: KV bytes decode received over the transfer
(``vllm:pd_kv_received_bytes``), decode's prompt tokens by source (``vllm:pd_kv_tokens``: prefix cache, tier,
prefill), the prompt tokens prefill loaded from its tier instead of computing them, and the time to the
first streamed token. Prints a table per turn and writes ``multi_turn.json``; the answers of both variants
are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
VARIANTS = ("tier-off", "tier-on")
DECODE_COUNTERS = {
    "received_bytes": ("vllm:pd_kv_received_bytes", None),
    "tier_tokens": ("vllm:pd_kv_tokens", {"source": "tier"}),
    "remote_tokens": ("vllm:pd_kv_tokens", {"source": "remote"}),
}
PREFILL_COUNTERS = {"prefill_tier_tokens": ("vllm:pd_kv_tokens", {"source": "tier"})}
REQUEST_TIMEOUT_S = 300.0


def tokens(count: int, seed: int) -> list[int]:
    """``count`` token ids of the tiny model's vocabulary, different per seed."""
    return [(13 * i + 101 * seed + 7) % 1000 + 3 for i in range(count)]


def variant_pds(variant: str, args: argparse.Namespace):  # noqa: ANN201 - PDService, imported lazily
    from pdoperator.api import API_VERSION, KIND, parse_pdservice  # noqa: PLC0415
    from pdoperator.local import local_variant  # noqa: PLC0415

    document = yaml.safe_load(args.spec.read_text())
    document["spec"]["model"]["maxModelLen"] = args.max_model_len
    for role in ("prefill", "decode"):  # the history lives in the tiers or nowhere
        document["spec"][role]["enablePrefixCaching"] = False
    pds = local_variant(parse_pdservice(document), mode=args.mode, runtime="vllm", connector="builtin")
    if variant == "tier-off":
        return pds
    spec = pds.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec["kvCache"] = {"offload": {role: {"hostMemory": args.tier_memory} for role in ("prefill", "decode")}}
    return parse_pdservice(
        {"apiVersion": API_VERSION, "kind": KIND, "metadata": document["metadata"], "spec": spec}
    )


def counters(url: str, wanted: dict[str, tuple[str, dict[str, str] | None]]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        families = {
            family.name: family for family in text_string_to_metric_families(response.read().decode())
        }
    values = {}
    for key, (name, labels) in wanted.items():
        family = families.get(name)
        samples = family.samples if family is not None else []
        values[key] = sum(
            sample.value
            for sample in samples
            if sample.name.endswith("_total")
            and all(sample.labels.get(label) == value for label, value in (labels or {}).items())
        )
    return values


def stream(endpoint: str, model: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """The answer's token ids and the seconds to its first token."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{endpoint}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    started = time.monotonic()
    first: float | None = None
    answer: list[int] = []
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.monotonic() - started
            answer += ids
    if first is None or len(answer) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {len(answer)}")
    return answer, first


def after_request(url: str, before: dict[str, float], settle_s: float = 3.0) -> dict[str, float]:
    """The decode counters' change over one request (vLLM publishes a step's stats after the step: wait until
    the request's prompt tokens were counted)."""
    deadline = time.monotonic() + settle_s
    while True:
        now = counters(url, DECODE_COUNTERS)
        delta = {key: now[key] - before[key] for key in now}
        if delta["tier_tokens"] + delta["remote_tokens"] > 0 or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def converse(
    endpoint: str, urls: dict[str, str], model: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every conversation's turns, turn by turn across conversations: one record per request."""
    system = tokens(args.system_tokens, seed=0)
    histories = [list(system) for _ in range(args.conversations)]
    records = []
    for turn in range(args.turns):
        for conversation, history in enumerate(histories):
            prompt = history + tokens(args.user_tokens, seed=1 + conversation * args.turns + turn)
            before = counters(urls["decode"], DECODE_COUNTERS)
            prefill_before = counters(urls["prefill"], PREFILL_COUNTERS)
            answer, ttft_s = stream(endpoint, model, prompt, args.output_len)
            delta = after_request(urls["decode"], before)
            # prefill counts its tokens when it allocates, long before decode's answer ends
            prefill_after = counters(urls["prefill"], PREFILL_COUNTERS)
            delta |= {key: prefill_after[key] - prefill_before[key] for key in PREFILL_COUNTERS}
            records.append(
                {
                    "conversation": conversation,
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "ttft_ms": round(ttft_s * 1e3, 2),
                    **{key: int(value) for key, value in delta.items()},
                    "answer": answer,
                }
            )
            history[:] = prompt + answer
    return records


def run_variant(variant: str, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdoperator.local import down, plan_local_run, up  # noqa: PLC0415
    from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice  # noqa: PLC0415

    pds = variant_pds(variant, args)
    state_dir = args.out / "state" / variant
    plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir, model_dir=model_dir)
    urls = {
        role: next(process.url for process in plan.processes if process.role is ComponentRole(role))
        for role in ("prefill", "decode")
    }
    up(plan, state_dir)
    try:
        return converse(plan.endpoint, urls, pds.spec.model.name, args)
    finally:
        down(state_dir)


def per_turn(records: dict[str, list[dict[str, Any]]], turns: int) -> list[dict[str, Any]]:
    rows = []
    for turn in range(turns):
        row: dict[str, Any] = {"turn": turn}
        for variant, variant_records in records.items():
            of_turn = [r for r in variant_records if r["turn"] == turn]
            ttfts = sorted(r["ttft_ms"] for r in of_turn)
            row[variant] = {
                "received_bytes_mean": statistics.fmean(r["received_bytes"] for r in of_turn),
                "tier_tokens_mean": statistics.fmean(r["tier_tokens"] for r in of_turn),
                "prefill_tier_tokens_mean": statistics.fmean(r["prefill_tier_tokens"] for r in of_turn),
                "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in of_turn),
                "remote_tokens_mean": statistics.fmean(r["remote_tokens"] for r in of_turn),
                "ttft_p50_ms": statistics.median(ttfts),
                "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            }
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| turn | prompt tokens | KV bytes/request off | on | on/off | decode tier hits on "
        "| prefill tier hits on | TTFT p50 off (ms) | on | TTFT p99 off | on |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        off, on = row["tier-off"], row["tier-on"]
        ratio = on["received_bytes_mean"] / off["received_bytes_mean"] if off["received_bytes_mean"] else 0.0
        prompt = on["prompt_tokens_mean"]
        hits = on["tier_tokens_mean"] / prompt, on["prefill_tier_tokens_mean"] / prompt
        lines.append(
            f"| {row['turn']} | {prompt:.0f} | {off['received_bytes_mean']:.0f} "
            f"| {on['received_bytes_mean']:.0f} | {ratio:.3f} | {hits[0]:.1%} | {hits[1]:.1%} "
            f"| {off['ttft_p50_ms']:.1f} | {on['ttft_p50_ms']:.1f} "
            f"| {off['ttft_p99_ms']:.1f} | {on['ttft_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the model, state and results go")
    parser.add_argument("--spec", type=Path, default=TINY, help="the PDService both variants start from")
    parser.add_argument("--mode", choices=("push", "pull"), default="push")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt")
    parser.add_argument("--user-tokens", type=int, default=100, help="new tokens each turn")
    parser.add_argument("--output-len", type=int, default=32, help="tokens each answer generates")
    parser.add_argument("--tier-memory", default="256Mi", help="each role's spec.kvCache.offload hostMemory")
    parser.add_argument("--max-model-len", type=int, default=4096)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from pdconnector.sim.tiny_model import TinyModel, write_tiny_model  # noqa: PLC0415

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "tiny-model-dense"
    if not (model_dir / "config.json").exists():
        write_tiny_model(model_dir, TinyModel.DENSE)
    records = {variant: run_variant(variant, model_dir, args) for variant in VARIANTS}
    answers = {variant: [r["answer"] for r in records[variant]] for variant in VARIANTS}
    equal = sum(a == b for a, b in zip(answers["tier-off"], answers["tier-on"], strict=True))
    rows = per_turn(records, args.turns)
    later = [row for row in rows if row["turn"] > 0]
    moved = {v: sum(row[v]["received_bytes_mean"] for row in later) for v in VARIANTS}
    loaded = sum(row["tier-on"]["prefill_tier_tokens_mean"] for row in later)
    sent = sum(row["tier-on"]["prompt_tokens_mean"] for row in later)
    summary = {
        "mode": args.mode,
        "conversations": args.conversations,
        "turns": args.turns,
        "answers_equal": equal,
        "answers": len(answers["tier-off"]),
        # KV bytes moved per request after the first turn, tier on over off
        "bytes_ratio_after_first_turn": moved["tier-on"] / moved["tier-off"] if moved["tier-off"] else None,
        # prompt tokens prefill loaded from its tier after the first turn, of all it was sent
        "prefill_tier_share_after_first_turn": loaded / sent if sent else None,
        "per_turn": rows,
        "requests": records,
    }
    (args.out / "multi_turn.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(rows))
    print(
        f"answers equal: {equal} of {summary['answers']}; KV bytes moved after the first turn, tier on / "
        f"off: {summary['bytes_ratio_after_first_turn']:.3f}; prompt tokens prefill loaded from its tier "
        f"after the first turn: {loaded / sent if sent else 0:.1%}"
    )
    return 0 if equal == summary["answers"] else 1


if __name__ == "__main__":
    sys.exit(main())
