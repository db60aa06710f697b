"""Push vs pull under load: a QPS x input-length sweep through the router with `vllm bench serve`, and its two
figures.

    # local run of examples/tiny-cpu.yaml, push and pull
    .venv/bin/python e2e/bench/pd_bench.py
    # the same with real vLLM engines: ours and upstream's
    .venv/bin/python e2e/bench/pd_bench.py --engine vllm
    # on a GPU machine (scripts/gpu-suite.sh's step "serving"): the Qwen3-32B KV twin, within a time budget
    python e2e/bench/pd_bench.py --engine vllm --spec examples/tiny-gpu-vllm.yaml \\
        --model-kind qwen3-32b-kv-twin --input-lens 1024,4096,16384 --qps 1,2,4,8 --output-len 128 \\
        --budget-s 400
    # any running router (local, port-forwarded)
    .venv/bin/python e2e/bench/pd_bench.py --router URL --label NAME
    # redraw the figures from saved runs
    .venv/bin/python e2e/bench/pd_bench.py --plot-only out/bench

The local run starts the tiny example as `pdctl up` does, once per variant: mock engines moving
real KV bytes over the mock transport with a latency model (``--engine mock``), or vLLM CPU
engines running the tiny dense model with our connector or upstream vLLM's NIXL connectors, in
push and pull (``--engine vllm``). Before each sweep one request warms the variant up; its
latency is kept (a P/D pair's first request pays for any handshake not done at start-up).
Each run of `vllm bench serve` (random token prompts through a word-level tokenizer, so input
lengths are exact) writes one JSON file; the sweep then draws TTFT vs QPS and TPOT vs QPS (one
line per label and input length) as PNG and prints a markdown table (also written to summary.md).
Next to each run's TTFT it prints where the time went: the mean of every stage the router
(``pd_router_leg_seconds``: each leg to its answer) and the engines (``vllm:pd_kv_stage_seconds``,
:mod:`pdconnector.protocol.timeline`) observed during the run, from their ``/metrics``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
RESULT_KEYS = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "request_throughput",
    "completed",
    "failed",
)
# The histograms whose per-run means say where a request's time went: (family, the label naming the stage).
STAGE_FAMILIES = (("pd_router_leg_seconds", "role"), ("vllm:pd_kv_stage_seconds", "stage"))


@dataclass(frozen=True)
class Run:
    label: str
    input_len: int
    qps: float
    result: dict[str, float]

    @property
    def filename(self) -> str:
        return f"{self.label}-in{self.input_len}-qps{self.qps:g}.json"


def bench_serve(
    base_url: str, model: str, tokenizer: Path, *, input_len: int, output_len: int, qps: float, prompts: int
) -> dict[str, float]:
    """One `vllm bench serve` run (its own client, in-process) against ``base_url``."""
    from vllm.benchmarks.serve import add_cli_args, main  # noqa: PLC0415 - importing vLLM takes seconds

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            *(
                "--backend",
                "openai",
                "--endpoint",
                "/v1/completions",
                "--base-url",
                base_url,
                "--model",
                model,
            ),
            *(
                "--tokenizer",
                str(tokenizer),
                "--dataset-name",
                "random",
                "--random-input-len",
                str(input_len),
            ),
            *(
                "--random-output-len",
                str(output_len),
                "--num-prompts",
                str(prompts),
                "--request-rate",
                str(qps),
            ),
            *(
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--metric-percentiles",
                "50,99",
                "--disable-tqdm",
                "--seed",
                "0",
            ),
            # every request generates exactly --output-len tokens, whatever the tiny model samples
            "--ignore-eos",
        ]
    )
    result = main(args)
    return {key: float(result[key]) for key in RESULT_KEYS}


MOCK_VARIANTS = ("mock-push", "mock-pull")
VLLM_VARIANTS = ("colocated", "ours-push", "ours-pull", "upstream-push", "upstream-pull")
WARMUP_TIMEOUT_S = 600.0
# A run lasting this many times as long as its prompts took to arrive (plus --drain-s) saturated its engines.
SATURATION_FACTOR = 2.0


def tiny_with(mode: str, prefill_s_per_token: float, decode_s_per_token: float) -> dict[str, object]:
    document = yaml.safe_load(TINY.read_text())
    document["spec"]["mode"] = mode
    document["spec"]["prefill"]["extraArgs"] = ["--prefill-seconds-per-token", str(prefill_s_per_token)]
    document["spec"]["decode"]["extraArgs"] = ["--decode-seconds-per-token", str(decode_s_per_token)]
    return document


def variant_pds(variant: str, args: argparse.Namespace):  # noqa: ANN201 - PDService, imported lazily
    """The example as one benchmark variant: ``mock-<mode>``, ``ours-<mode>`` or ``upstream-<mode>``; real
    engines serve the tiny model of ``--model-kind`` in its own dtype, with room for the longest run."""
    from pdconnector.sim.tiny_model import MODEL_CONFIGS, TinyModel  # noqa: PLC0415
    from pdoperator.api import parse_pdservice  # noqa: PLC0415
    from pdoperator.local import local_variant  # noqa: PLC0415

    # colocated: ours-push minus the connector
    engine, mode = variant.split("-") if "-" in variant else ("ours", "push")
    if engine == "mock":
        return parse_pdservice(tiny_with(mode, args.prefill_s_per_token, args.decode_s_per_token))
    document = yaml.safe_load(args.spec.read_text())
    model = document["spec"]["model"]
    model["maxModelLen"] = max(model.get("maxModelLen", 0), max(args.input_lens) + args.output_len)
    return local_variant(
        parse_pdservice(document),
        mode=mode,
        runtime="vllm",
        connector="builtin" if engine == "ours" else "vllm",
        dtype=MODEL_CONFIGS[TinyModel(args.model_kind)]["torch_dtype"],
    )


def colocated(plan):  # noqa: ANN001, ANN201 - LocalPlan, imported lazily
    """The reference: the plan's decode engine alone, without a KV connector, serving clients directly."""
    from pdoperator.local import LocalPlan  # noqa: PLC0415
    from pdoperator.render import ComponentRole  # noqa: PLC0415

    decode = next(process for process in plan.processes if process.role is ComponentRole.DECODE)
    argv = list(decode.argv)
    flag = argv.index("--kv-transfer-config")
    del argv[flag : flag + 2]  # the flag and its JSON value
    engine = dataclasses.replace(decode, name="colocated", argv=tuple(argv))
    return LocalPlan(plan.name, plan.namespace, (engine,), plan.router_config), engine.url


def warm_up(base_url: str, model: str) -> float:
    """Seconds one small request takes through a fresh variant (raises if it fails)."""
    body = json.dumps({"model": model, "prompt": "t1 t2 t3 t4", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=WARMUP_TIMEOUT_S) as response:
        response.read()
    return time.monotonic() - started


class SweepPlan:
    """The run's time (``--budget-s``, None: unbounded) and its record of points: a variant starts only while
    its engines' start-up (as long as the last variant's took) and one run fit, a run only while it fits, and
    no higher rate follows a run its engines could not keep up with (it would only queue longer). points.json
    says after every change what ran, what runs and what was left out and why, so a run stopped from outside
    still tells."""

    def __init__(self, seconds: float | None, shortest_run_s: float, record: Path) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.shortest_run_s = shortest_run_s
        self.start_up_s = 0.0
        self.record = record
        self.ran: list[dict[str, object]] = []
        self.running: dict[str, object] | None = None
        self.skipped: list[dict[str, object]] = []

    def allows(self, seconds: float) -> bool:
        return self.deadline is None or time.monotonic() + seconds <= self.deadline

    def allows_variant(self) -> bool:
        return self.allows(self.start_up_s + self.shortest_run_s)

    def skip(self, label: str, input_lens: Sequence[int], qps: Sequence[float], why: str) -> None:
        self.skipped += [
            {"label": label, "input_len": n, "qps": q, "why": why} for n in input_lens for q in qps
        ]
        self._write()

    def start(self, label: str, input_len: int, qps: float) -> None:
        self.running = {"label": label, "input_len": input_len, "qps": qps}
        self._write()

    def finish(self, seconds: float, saturated: bool) -> None:
        assert self.running is not None
        self.ran.append({**self.running, "seconds": round(seconds, 1), "saturated": saturated})
        self.running = None
        self._write()

    def _write(self) -> None:
        points = {"ran": self.ran, "running": self.running, "left_out": self.skipped}
        self.record.write_text(json.dumps(points, indent=2) + "\n")


def sweep_local(args: argparse.Namespace, tokenizer: Path, budget: SweepPlan) -> list[Run]:
    from pdoperator.local import down, plan_local_run, up  # noqa: PLC0415
    from pdoperator.render import RenderDefaults, render_pdservice  # noqa: PLC0415

    runs = []
    first_requests: dict[str, float | str] = {}
    for variant in args.variants:
        if not budget.allows_variant():
            budget.skip(
                variant, args.input_lens, args.qps, "time budget: the engines would not start in time"
            )
            continue
        pds = variant_pds(variant, args)
        state_dir = args.out / "state" / variant
        model_dir = tokenizer if not variant.startswith("mock") else None
        plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir, model_dir=model_dir)
        endpoint = plan.endpoint
        if variant == "colocated":
            plan, endpoint = colocated(plan)
        starting = time.monotonic()
        up(plan, state_dir)
        budget.start_up_s = time.monotonic() - starting
        try:
            try:
                first_requests[variant] = round(warm_up(endpoint, pds.spec.model.name), 3)
            except OSError as error:
                first_requests[variant] = f"failed: {error}"
                print(f"{variant}: the warm-up request failed ({error}); sweeping anyway", file=sys.stderr)
            print(f"{variant}: first request {first_requests[variant]} s")
            processes = [(process.role.value, process.url) for process in plan.processes]
            runs += sweep(
                variant, endpoint, pds.spec.model.name, tokenizer, args, budget=budget, processes=processes
            )
        finally:
            down(state_dir)
    (args.out / "first_request_s.json").write_text(json.dumps(first_requests, indent=2))
    return runs


def stage_totals(processes: Sequence[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """``<process>.<stage>`` -> (sum of seconds, count) of the stage histograms on each (name, URL)'s
    ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    totals: dict[str, tuple[float, float]] = {}
    for name, url in processes:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                text = response.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            label = dict(STAGE_FAMILIES).get(family.name)
            if label is None:
                continue
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")) and label in sample.labels:
                    key = f"{name}.{sample.labels[label]}"
                    total, count = totals.get(key, (0.0, 0.0))
                    totals[key] = (
                        (total + sample.value, count)
                        if sample.name.endswith("_sum")
                        else (total, count + sample.value)
                    )
    return totals


def stage_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean milliseconds per stage over what happened between two :func:`stage_totals`."""
    means = {}
    for key, (total, count) in sorted(after.items()):
        earlier_total, earlier_count = before.get(key, (0.0, 0.0))
        if count > earlier_count:
            means[key] = round((total - earlier_total) / (count - earlier_count) * 1e3, 3)
    return means


def sweep(
    label: str,
    base_url: str,
    model: str,
    tokenizer: Path,
    args: argparse.Namespace,
    *,
    budget: SweepPlan,
    processes: Sequence[tuple[str, str]] = (),
) -> list[Run]:
    """Every (input length, QPS) run against ``base_url`` the budget allows; ``processes`` (name, URL) are
    scraped for stage timings."""
    runs = []
    for input_len in args.input_lens:
        saturated_at = None
        for qps in args.qps:
            prompts = max(args.min_prompts, round(qps * args.seconds))
            arrivals_s = prompts / qps
            if saturated_at is not None and qps > saturated_at:
                why = f"saturated: the engines could not keep up with {saturated_at:g} QPS at this length"
                budget.skip(label, [input_len], [qps], why)
                continue
            # a warm-up burst takes about what the answers of a run take after its last prompt
            if not budget.allows(arrivals_s + args.drain_s * (2 if args.warmup_requests else 1)):
                budget.skip(label, [input_len], [qps], "time budget: the run would not end in time")
                continue
            budget.start(label, input_len, qps)
            if args.warmup_requests:
                # A burst at this length first, neither timed nor in the stage means: on a GPU, Triton
                # compiles its kernels for the batch shapes the first requests of a new length meet, and that
                # once-only cost fell on whichever variant ran first (first request 2.8 s, ours-push, H100).
                bench_serve(
                    base_url,
                    model,
                    tokenizer,
                    input_len=input_len,
                    output_len=args.output_len,
                    qps=math.inf,
                    prompts=args.warmup_requests,
                )
            started = time.monotonic()
            before = stage_totals(processes)
            result = bench_serve(
                base_url,
                model,
                tokenizer,
                input_len=input_len,
                output_len=args.output_len,
                qps=qps,
                prompts=prompts,
            )
            stages = stage_means_ms(before, stage_totals(processes))
            seconds = time.monotonic() - started
            # the answers took far longer than the prompts took to arrive: requests queued
            if seconds > SATURATION_FACTOR * arrivals_s + args.drain_s:
                saturated_at = qps
            budget.finish(seconds, saturated=saturated_at == qps)
            run = Run(label, input_len, qps, result)
            runs.append(run)
            record = {
                "label": label,
                "input_len": input_len,
                "qps": qps,
                **run.result,
                "stages_mean_ms": stages,
            }
            (args.out / run.filename).write_text(json.dumps(record, indent=2))
            print(
                f"{label:<16} in={input_len:<5} qps={qps:<5g} TTFT p50 {run.result['p50_ttft_ms']:8.1f} ms  "
                "TPOT p50 "
                f"{run.result['p50_tpot_ms']:7.2f} ms  done {run.result['completed']:.0f} failed "
                f"{run.result['failed']:.0f}"
            )
            if stages:
                print("    stages, mean ms: " + "  ".join(f"{key} {ms:.2f}" for key, ms in stages.items()))
    return runs


def load_runs(directory: Path) -> list[Run]:
    runs = []
    for path in sorted(directory.glob("*-in*-qps*.json")):
        data = json.loads(path.read_text())
        runs.append(
            Run(
                data["label"],
                int(data["input_len"]),
                float(data["qps"]),
                {key: data[key] for key in RESULT_KEYS},
            )
        )
    return runs


def plot(runs: Sequence[Run], out: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        figure, axes = plt.subplots(figsize=(10, 5))
        # a run where every request failed has no latency
        served = [run for run in runs if run.result["completed"] > 0]
        for label, input_len in sorted({(run.label, run.input_len) for run in served}):
            series = sorted(
                (run.qps, run.result[f"p50_{metric}_ms"], run.result[f"p99_{metric}_ms"])
                for run in served
                if (run.label, run.input_len) == (label, input_len)
            )
            qps, p50, p99 = zip(*series, strict=True)
            line = axes.plot(qps, p50, marker="o", label=f"{label}, {input_len} in (p50)")[0]
            axes.plot(
                qps,
                p99,
                marker="x",
                linestyle="--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{label}, {input_len} in (p99)",
            )
        # Variants differ by orders of magnitude (a hung upstream request vs a 10 ms co-located one).
        axes.set(
            xlabel="request rate (QPS)",
            ylabel=f"{metric.upper()} (ms, log scale)",
            title=f"{title} vs QPS",
            yscale="log",
        )
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        figure.tight_layout()
        path = out / f"{metric}_vs_qps.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def table(runs: Sequence[Run]) -> str:
    lines = [
        "| label | input tokens | QPS | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | "
        "req/s | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r.input_len, r.qps, r.label)):
        r = run.result
        if r["completed"] == 0:
            lines.append(
                f"| {run.label} | {run.input_len} | {run.qps:g} | - | - | - | - | 0 | {r['failed']:.0f} |"
            )
            continue
        lines.append(
            f"| {run.label} | {run.input_len} | {run.qps:g} | {r['p50_ttft_ms']:.1f} | "
            f"{r['p99_ttft_ms']:.1f} | "
            f"{r['p50_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {r['request_throughput']:.2f} | "
            f"{r['failed']:.0f} |"
        )
    return "\n".join(lines)


def numbers(text: str) -> list[float]:
    return [float(item) for item in text.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "out" / "bench", help="directory of results and figures"
    )
    parser.add_argument(
        "--router", help="benchmark this running router instead of starting the tiny example locally"
    )
    parser.add_argument("--label", default="router", help="label of --router runs in files and figures")
    parser.add_argument("--model", default="tiny-llama", help="served model name (with --router)")
    parser.add_argument(
        "--engine",
        choices=["mock", "vllm"],
        default="mock",
        help="local run: mock engines or real vLLM CPU engines",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        help="local run: comma-separated subset of the engine's variants",
    )
    parser.add_argument("--qps", type=numbers, default=[2, 8, 32], help="request rates, comma-separated")
    parser.add_argument(
        "--input-lens",
        type=lambda text: [int(n) for n in numbers(text)],
        default=[128, 1024],
        help="prompt lengths",
    )
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument(
        "--spec",
        type=Path,
        default=TINY,
        help="real engines: the example each variant is made from (on a GPU machine: "
        "examples/tiny-gpu-vllm.yaml)",
    )
    parser.add_argument(
        "--model-kind",
        default="dense",
        help="real engines: the tiny model they serve (pdconnector.sim.tiny_model.TinyModel, e.g. "
        "qwen3-32b-kv-twin: Qwen3-32B's KV bytes per token)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="start no variant or run that would not end within this many seconds; points.json lists the "
        "points that ran and those left out",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=15.0,
        help="what one run takes beyond its prompts' arrival (their answers), for --budget-s",
    )
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="target duration of one run (prompts = QPS x seconds)"
    )
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="before each run, this many requests of its input length at once, not counted (GPU: Triton "
        "compiles kernels for new shapes on first use)",
    )
    parser.add_argument(
        "--prefill-s-per-token", type=float, default=0.0001, help="local run: mock prefill latency model"
    )
    parser.add_argument(
        "--decode-s-per-token", type=float, default=0.004, help="local run: mock decode latency model"
    )
    parser.add_argument(
        "--plot-only",
        type=Path,
        metavar="DIR",
        help="only redraw figures and the table from DIR's JSON files",
    )
    return parser.parse_args(argv)


def model_with_tokenizer(args: argparse.Namespace) -> Path:
    """The tokenizer the client uses; with vLLM engines, the tiny model's directory (they share the
    tokenizer)."""
    if args.engine == "vllm":
        from pdconnector.sim.tiny_model import TinyModel, write_tiny_model  # noqa: PLC0415

        model_dir = args.out / f"tiny-model-{args.model_kind}"
        return (
            model_dir
            if (model_dir / "config.json").exists()
            else write_tiny_model(model_dir, TinyModel(args.model_kind))
        )
    from pdconnector.sim.tokenizer import write_word_tokenizer  # noqa: PLC0415

    return write_word_tokenizer(args.out / "tokenizer")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    known = MOCK_VARIANTS if args.engine == "mock" else VLLM_VARIANTS
    args.variants = args.variants or list(known)
    if unknown := [variant for variant in args.variants if variant not in known]:
        print(
            f"--variants: {unknown} are not among {list(known)} for --engine {args.engine}", file=sys.stderr
        )
        return 2
    if args.plot_only:
        args.out = args.plot_only
        runs = load_runs(args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        shortest = min(max(args.min_prompts / qps, args.seconds) for qps in args.qps) + args.drain_s
        budget = SweepPlan(args.budget_s, shortest, args.out / "points.json")  # writing the model counts
        tokenizer = model_with_tokenizer(args)
        runs = (
            sweep(args.label, args.router, args.model, tokenizer, args, budget=budget)
            if args.router
            else sweep_local(args, tokenizer, budget)
        )
        if budget.skipped:
            print(f"{len(budget.skipped)} points left out: see {budget.record}")
    if not runs:
        print(f"no runs in {args.out}", file=sys.stderr)
        return 1
    figures = plot(runs, args.out)
    summary = table(runs)
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    print("figures: " + ", ".join(str(path) for path in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
