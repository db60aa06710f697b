"""The GPU demo: `pdctl up` the tiny GPU example (mock engines with KV pools in VRAM, NIXL over UCX) and prove
KV moves; with ``--engine vllm``, the same with real vLLM engines on the GPU.

    python e2e/gpu/demo.py REPORT_DIR [--example examples/tiny-gpu.yaml] [--kv-device cuda] [--requests 4]
    python e2e/gpu/demo.py REPORT_DIR --engine vllm   # examples/tiny-gpu-vllm.yaml; needs vLLM with CUDA

With real engines (vLLM importable, e.g. after `. /tmp/pd-vllm/activate.sh`, scripts/gpu-vllm.sh): the tiny
dense model is written into REPORT_DIR, a co-located vLLM on the same GPU answers the prompts first (then
stops), and each answer through the router must carry the same token ids and top logprobs
(e2e/gpu/real_engines.py), come from one prefill and one decode engine, count as verified in the router's
/status, and grow the decode engines' ``vllm:pd_kv_transfers_total{direction=recv,outcome=received}`` by one
and their received bytes.

For push and then pull mode: `pdctl up --mode MODE` (run as ``python -m pdoperator.cli.main`` with this source
tree on PYTHONPATH, since the GPU machine has no console scripts), wait for the router, check that every
engine's pool is on the expected device, send completions through the router and check each: the answer equals
the mock model's reference (decode can only produce it from the prompt's KV), a prefill and a decode engine
served it (x-pd-prefill, x-pd-decode), the router counted it as verified by a transfer (/status), and the
decode engines' import counters grew by as many transfers and by some bytes (/metrics). Then `pdctl down`.
Writes REPORT_DIR/gpu-demo.json (per mode: requests, failures, bytes moved, engines seen, p50 latency,
problems) and exits 1 when any check failed. Every wait has a deadline and the whole run stays under three
minutes. ``--example examples/tiny-cpu.yaml --kv-device cpu`` runs the same flow on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SOURCE_PATHS = [str(REPO / "operator"), str(REPO / "connector")]
# The GPU machine runs this from a checkout that was never pip-installed: the packages come from the source
# tree.
sys.path[:0] = SOURCE_PATHS

import real_engines  # noqa: E402  (this script's folder is on sys.path)
from pdconnector.sim.cluster import metric_samples  # noqa: E402
from pdconnector.sim.model import reference_tokens, tokenize  # noqa: E402

TOTAL_BUDGET_S = 170.0
UP_TIMEOUT_S = 90.0
# Real engines: the co-located reference (~1 min), then per mode two engines starting side by side (~1 min).
VLLM_TOTAL_BUDGET_S = 420.0
VLLM_UP_TIMEOUT_S = 180.0
DOWN_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 30.0
MAX_TOKENS = 8
MODES = ("push", "pull")
IMPORT_BYTES = "pd_mock_transfer_bytes_total{direction=import}"
IMPORTS_OK = "pd_mock_transfers_total{direction=import,outcome=ok}"


class Budget:
    """What is left of the run's time: every wait takes the smaller of its own timeout and the rest."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def take(self, timeout_s: float) -> float:
        return max(1.0, min(timeout_s, self.deadline - time.monotonic()))


def http_json(
    url: str, body: dict[str, Any] | None = None, timeout_s: float = 5.0
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of a GET, or a POST when ``body`` is given; HTTP errors are answers, not
    exceptions."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                json.loads(response.read() or b"null"),
            )
    except urllib.error.HTTPError as error:
        return (
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            json.loads(error.read() or b"null"),
        )


def source_distribution(report_dir: Path) -> list[str]:
    """Where pdctl finds the pd-operator distribution's record, when this checkout was never installed.

    pdoperator renders image tags from its installed version (``importlib.metadata``); a bare checkout has no
    record, so the demo writes a minimal one (name and version from pyproject.toml) into the report directory.
    """
    try:
        importlib.metadata.version("pd-operator")
    except importlib.metadata.PackageNotFoundError:
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        record = report_dir / "source-dist" / f"pd_operator-{project['version']}.dist-info"
        record.mkdir(parents=True, exist_ok=True)
        (record / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        )
        return [str(record.parent)]
    return []


def pdctl(args: list[str], python_path: list[str], timeout_s: float) -> tuple[int, str]:
    """Exit code and output of a pdctl command (124 when it ran past ``timeout_s``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*python_path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pdoperator.cli.main", *args],
            check=False,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as error:
        return 124, f"timed out after {timeout_s:.0f} s: {error.stdout or ''}{error.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def prompt(index: int) -> str:
    """Prompts of different lengths, crossing block boundaries (the mock engines' blocks hold 16 tokens)."""
    return " ".join(f"t{(index * 37 + i) % 1000}" for i in range(33 + 9 * index))


@dataclass
class ModeReport:
    mode: str
    requests: int = 0
    failures: int = 0
    bytes_moved: float = 0.0
    transfers_verified: int = 0
    engines: dict[str, list[str]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    kv_devices: dict[str, str] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    logs: str = ""

    def summary(self) -> dict[str, Any]:
        p50 = round(statistics.median(self.latencies_s), 4) if self.latencies_s else None
        return {
            "requests": self.requests,
            "failures": self.failures,
            "bytes_moved": int(self.bytes_moved),
            "transfers_verified": self.transfers_verified,
            "engines": {role: sorted(names) for role, names in self.engines.items()},
            "kv_devices": self.kv_devices,
            "latency_p50_s": p50,
            "problems": self.problems,
            "logs": self.logs,
        }


def wait_ready(router: str, budget: Budget) -> bool:
    deadline = time.monotonic() + budget.take(READY_TIMEOUT_S)
    while time.monotonic() < deadline:
        try:
            if http_json(router + "/ready")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def send(
    report: ModeReport, *, router: str, model: str, index: int, names: dict[str, set[str]], budget: Budget
) -> None:
    """One completion through the router, checked against the mock model and the engines that served it."""
    text = prompt(index)
    started = time.monotonic()
    try:
        status, headers, body = http_json(
            router + "/v1/completions",
            {"model": model, "prompt": text, "max_tokens": MAX_TOKENS},
            budget.take(REQUEST_TIMEOUT_S),
        )
    except OSError as error:
        report.failures += 1
        report.problems.append(f"request {index}: {type(error).__name__}: {error}")
        return
    elapsed = time.monotonic() - started
    problems = []
    if status != 200:
        problems.append(f"HTTP {status}: {json.dumps(body)[:300]}")
    elif tokenize(body["choices"][0]["text"]) != reference_tokens(tokenize(text), MAX_TOKENS):
        problems.append(
            "the answer differs from the mock model's reference: decode did not get the prompt's KV"
        )
    record(report, index=index, elapsed=elapsed, headers=headers, names=names, problems=problems)


def record(
    report: ModeReport,
    *,
    index: int,
    elapsed: float,
    headers: dict[str, str],
    names: dict[str, set[str]],
    problems: list[str],
) -> None:
    """One answer's outcome: the engines that served it (one prefill and one decode of this run, or a
    problem), and its latency when nothing was wrong."""
    prefill, decode = headers.get("x-pd-prefill"), headers.get("x-pd-decode")
    if prefill not in names["prefill"] or decode not in names["decode"]:
        problems.append(
            f"served by x-pd-prefill={prefill} x-pd-decode={decode}, not by one prefill and one decode engine"
        )
    for role, engine in (("prefill", prefill), ("decode", decode)):
        if engine is not None:
            report.engines[role] = sorted({*report.engines[role], engine})
    if problems:
        report.failures += 1
        report.problems += [f"request {index}: {problem}" for problem in problems]
    else:
        report.latencies_s.append(elapsed)


def decode_counters(urls: list[str]) -> tuple[float, float]:
    """(import bytes, successful imports) summed over the decode engines."""
    samples = [metric_samples(url) for url in urls]
    return sum(s.get(IMPORT_BYTES, 0.0) for s in samples), sum(s.get(IMPORTS_OK, 0.0) for s in samples)


@dataclass(frozen=True)
class RealEngines:
    """What the real-engine checks need: the co-located answers to the prompts, in order."""

    texts: list[str]
    reference: list[real_engines.Answer]


def send_real(
    report: ModeReport,
    *,
    router: str,
    model: str,
    index: int,
    names: dict[str, set[str]],
    real: RealEngines,
    budget: Budget,
) -> None:
    """One completion through the router, checked against the co-located engine's answer."""
    started = time.monotonic()
    try:
        status, headers, body = real_engines.post(
            router + "/v1/completions",
            real_engines.completion_body(model, real.texts[index]),
            budget.take(REQUEST_TIMEOUT_S),
        )
    except OSError as error:
        report.failures += 1
        report.problems.append(f"request {index}: {type(error).__name__}: {error}")
        return
    elapsed = time.monotonic() - started
    problems = (
        [f"HTTP {status}: {str(body)[:300]}"]
        if status != 200
        else real_engines.differences(real.reference[index], real_engines.Answer.of(body))
    )
    record(report, index=index, elapsed=elapsed, headers=headers, names=names, problems=problems)


def exercise_real(report: ModeReport, state_dir: Path, real: RealEngines, budget: Budget) -> None:
    """Between `pdctl up` and `pdctl down` with real engines: answers equal to co-located, transfers on the
    engines' /metrics and in the router's /status."""
    processes = {
        process["name"]: process["url"]
        for process in json.loads((state_dir / "state.json").read_text())["processes"]
    }
    router = next(url for name, url in processes.items() if name.endswith("-router"))
    names: dict[str, set[str]] = {
        role: {name for name in processes if f"-{role}-" in name} for role in ("prefill", "decode")
    }
    if not wait_ready(router, budget):
        report.problems.append(f"router {router} not ready within {READY_TIMEOUT_S:.0f} s")
        return
    model = http_json(router + "/v1/models")[2]["data"][0]["id"]
    decode_urls = [processes[name] for name in sorted(names["decode"])]
    before = real_engines.received(decode_urls)
    verified_before = http_json(router + "/status")[2]["transfers"]["verified"]
    for index in range(len(real.texts)):
        report.requests += 1
        send_real(report, router=router, model=model, index=index, names=names, real=real, budget=budget)
    served = report.requests - report.failures
    transfers, report.bytes_moved = real_engines.wait_received(decode_urls, before, served)
    report.transfers_verified = http_json(router + "/status")[2]["transfers"]["verified"] - verified_before
    if report.transfers_verified != served:
        report.problems.append(
            f"the router verified {report.transfers_verified} transfers for {served} served requests"
        )
    if transfers != served or (served and report.bytes_moved <= 0):
        report.problems.append(
            f"decode's /metrics counted {transfers:.0f} received transfers ({report.bytes_moved:.0f} B) for "
            f"{served} served requests"
        )


def exercise(report: ModeReport, state_dir: Path, kv_device: str, requests: int, budget: Budget) -> None:
    """Everything between `pdctl up` and `pdctl down` of one mode."""
    # What `pdctl up` started, as its state file records it (pdoperator.local.runner).
    processes = {
        process["name"]: process["url"]
        for process in json.loads((state_dir / "state.json").read_text())["processes"]
    }
    router = next(url for name, url in processes.items() if name.endswith("-router"))
    names: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for name, url in processes.items():
        if url == router:
            continue
        health = http_json(url + "/health")[2]
        names[health["role"]].add(name)
        report.kv_devices[name] = health.get("kv_device", "unknown")
        if report.kv_devices[name] != kv_device:
            report.problems.append(f"{name}: KV pool on {report.kv_devices[name]}, expected {kv_device}")
    if not wait_ready(router, budget):
        report.problems.append(f"router {router} not ready within {READY_TIMEOUT_S:.0f} s")
        return
    model = http_json(router + "/v1/models")[2]["data"][0]["id"]
    decode_urls = [processes[name] for name in sorted(names["decode"])]
    bytes_before, imports_before = decode_counters(decode_urls)
    verified_before = http_json(router + "/status")[2]["transfers"]["verified"]
    for index in range(requests):
        report.requests += 1
        send(report, router=router, model=model, index=index, names=names, budget=budget)
    bytes_after, imports_after = decode_counters(decode_urls)
    report.bytes_moved = bytes_after - bytes_before
    report.transfers_verified = http_json(router + "/status")[2]["transfers"]["verified"] - verified_before
    served = requests - report.failures
    if report.transfers_verified != served:
        report.problems.append(
            f"the router verified {report.transfers_verified} transfers for {served} served requests"
        )
    if imports_after - imports_before != served or (served and report.bytes_moved <= 0):
        report.problems.append(
            f"decode imported {imports_after - imports_before:.0f} times ({report.bytes_moved:.0f} B) for "
            f"{served} requests"
        )


def run_mode(
    mode: str,
    *,
    example: Path,
    report_dir: Path,
    kv_device: str,
    requests: int,
    budget: Budget,
    real: RealEngines | None = None,
    model_dir: Path | None = None,
) -> ModeReport:
    report = ModeReport(mode)
    state_dir = report_dir / f"state-{mode}"
    report.logs = str(state_dir)
    python_path = [*SOURCE_PATHS, *source_distribution(report_dir)]
    engine = [] if real is None else ["--engine", "vllm", "--model-dir", str(model_dir)]
    code, output = pdctl(
        ["up", "-f", str(example), "--mode", mode, "--state-dir", str(state_dir), *engine],
        python_path,
        budget.take(UP_TIMEOUT_S if real is None else VLLM_UP_TIMEOUT_S),
    )
    try:
        if code != 0:
            report.problems.append(f"pdctl up exited with {code}: {output[-3000:]}")
        elif real is not None:
            exercise_real(report, state_dir, real, budget)
        else:
            exercise(report, state_dir, kv_device, requests, budget)
    except (OSError, KeyError, StopIteration, ValueError) as error:
        report.problems.append(f"{type(error).__name__}: {error}")
    finally:
        code, output = pdctl(
            ["down", "-f", str(example), "--state-dir", str(state_dir)],
            python_path,
            budget.take(DOWN_TIMEOUT_S),
        )
        if code != 0:
            report.problems.append(f"pdctl down exited with {code}: {output[-1000:]}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("report_dir", type=Path, help="where gpu-demo.json and the processes' logs go")
    parser.add_argument(
        "--example",
        type=Path,
        help="the PDService to run (default examples/tiny-gpu.yaml, with --engine vllm tiny-gpu-vllm.yaml)",
    )
    parser.add_argument(
        "--engine", choices=["mock", "vllm"], default="mock", help="mock engines, or real vLLM on the GPU"
    )
    parser.add_argument(
        "--kv-device", choices=["cuda", "cpu"], default="cuda", help="where every engine's KV pool must be"
    )
    parser.add_argument("--requests", type=int, default=4, help="completions per mode")
    args = parser.parse_args(argv)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    report_dir = args.report_dir.resolve()
    vllm = args.engine == "vllm"
    example = args.example or REPO / "examples" / ("tiny-gpu-vllm.yaml" if vllm else "tiny-gpu.yaml")
    budget = Budget(VLLM_TOTAL_BUDGET_S if vllm else TOTAL_BUDGET_S)
    started = time.monotonic()
    real, model_dir, extra = None, None, {}
    if vllm:
        try:
            real, model_dir, extra = reference_run(report_dir, args.requests)
        except (OSError, RuntimeError, TimeoutError) as error:
            return finish(report_dir, {"ok": False, "engine": "vllm", "problems": [f"co-located: {error}"]})
    modes = {
        mode: run_mode(
            mode,
            example=example.resolve(),
            report_dir=report_dir,
            kv_device=args.kv_device,
            requests=args.requests,
            budget=budget,
            real=real,
            model_dir=model_dir,
        )
        for mode in MODES
    }
    ok = all(
        not report.problems and report.failures == 0 and report.requests == args.requests
        for report in modes.values()
    )
    result = {
        "ok": ok,
        "engine": args.engine,
        "example": str(example),
        "kv_device": args.kv_device,
        "elapsed_s": round(time.monotonic() - started, 1),
        "modes": {mode: report.summary() for mode, report in modes.items()},
        **extra,
    }
    if vllm:
        result["gpu_memory_used_mib_after"] = real_engines.gpu_memory_used_mib()
    return finish(report_dir, result)


def reference_run(report_dir: Path, requests: int) -> tuple[RealEngines, Path, dict[str, Any]]:
    """The tiny model written into the report directory and the co-located engine's answers to the prompts."""
    from pdconnector.sim.tiny_model import TinyModel, write_tiny_model  # noqa: PLC0415 (needs torch)

    model_dir = report_dir / "tiny-model"
    if not (model_dir / "config.json").exists():
        write_tiny_model(model_dir, TinyModel.DENSE)
    texts = real_engines.prompts(requests)
    memory_before = real_engines.gpu_memory_used_mib()
    reference = real_engines.reference_answers(model_dir, "tiny-llama", texts, report_dir / "colocated")
    extra = {"gpu_memory_used_mib_before": memory_before, "prompt_words": [len(t.split()) for t in texts]}
    return RealEngines(texts, reference), model_dir, extra


def finish(report_dir: Path, result: dict[str, Any]) -> int:
    path = report_dir / "gpu-demo.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"{'ok' if result['ok'] else 'FAILED'}: report in {path}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
