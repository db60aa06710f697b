"""The GPU demo's real-vLLM half: the co-located reference engine and the checks of real engines' answers.

Equality is judged against a co-located vLLM (no KV connector) on the same GPU with the same model, flags and
site settings, run before the disaggregated engines (so it never competes with them for memory): greedy token
ids must be identical, top logprobs within a tolerance. Transfers are judged on the engines' own /metrics:
decode's ``vllm:pd_kv_transfers_total{direction=recv,outcome=received}`` grows by one per request and its
received bytes grow (the counters behind the operator's KVTransferVerified condition, with the router's own
count beside them)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdconnector.sim.cluster import metric_samples
from pdoperator.local.gpu import load_site, place_engines
from pdoperator.local.plan import local_vllm_env

MAX_TOKENS = 8
TOP_LOGPROBS = 3
# Same GPU, same kernels, batch of one: logprobs agree closely; a wrong KV moves them by far more.
LOGPROB_TOLERANCE = 1e-2
BLOCK_SIZE = 16  # vLLM's default on CUDA
REFERENCE_STARTUP_S = 300.0
RECEIVED = ("vllm:pd_kv_transfers_total{", "direction=recv", "outcome=received")
RECEIVED_BYTES = "vllm:pd_kv_received_bytes_total"


def prompts(count: int) -> list[str]:
    """Word-tokenizer prompts around the block size: one token short of, at, and past block boundaries."""
    lengths = [
        BLOCK_SIZE - 1,
        BLOCK_SIZE,
        BLOCK_SIZE + 1,
        2 * BLOCK_SIZE + 1,
        3 * BLOCK_SIZE,
        5 * BLOCK_SIZE + 7,
    ]
    return [
        " ".join(f"t{(index * 37 + i) % 1000 + 2}" for i in range(lengths[index % len(lengths)]))
        for index in range(count)
    ]


def completion_body(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": TOP_LOGPROBS,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    top_logprobs: list[dict[str, float]]

    @classmethod
    def of(cls, body: dict[str, Any]) -> Answer:
        choice = body["choices"][0]
        return cls(
            list(choice.get("token_ids") or []),
            list((choice.get("logprobs") or {}).get("top_logprobs") or []),
        )


def differences(reference: Answer, answer: Answer) -> list[str]:
    """Why ``answer`` is not the co-located one (empty when it is)."""
    if answer.token_ids != reference.token_ids:
        return [f"token ids {answer.token_ids} differ from co-located {reference.token_ids}"]
    worst = 0.0
    for mine, theirs in zip(answer.top_logprobs, reference.top_logprobs, strict=False):
        for token in set(mine) & set(theirs):
            worst = max(worst, abs(mine[token] - theirs[token]))
        if set(mine) != set(theirs):
            return [f"top-{TOP_LOGPROBS} tokens {sorted(mine)} differ from co-located {sorted(theirs)}"]
    if worst > LOGPROB_TOLERANCE:
        return [f"top logprobs differ from co-located by {worst:.2e} (> {LOGPROB_TOLERANCE})"]
    return []


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as error:
        return (
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            error.read().decode(errors="replace"),
        )


def reference_answers(model_dir: Path, served_name: str, texts: list[str], log_dir: Path) -> list[Answer]:
    """The co-located answers: one vLLM engine on this machine's GPU with the site's flags and env, started,
    asked, and stopped (its process group, so the GPU memory is free before the P/D engines start)."""
    site = load_site()
    share = place_engines([1], site)[0].memory_share
    port = 18000 + os.getpid() % 1000
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", served_name, "--dtype", "float32", "--max-model-len", "2048",
        "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port),
        *site.gpu_engine_args, "--gpu-memory-utilization", f"{share:.2f}",
    ]  # fmt: skip
    env = {**os.environ, **local_vllm_env(log_dir, gpus=True), **site.engine_env}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / "colocated.log").open("ab")
    log.write(f"$ {shlex.join(argv)}\n".encode())
    log.flush()
    engine = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + REFERENCE_STARTUP_S
        while time.monotonic() < deadline:
            if engine.poll() is not None:
                raise RuntimeError(f"the co-located engine exited with {engine.returncode} (see {log.name})")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"the co-located engine was not up within {REFERENCE_STARTUP_S:.0f} s")
        answers = []
        for text in texts:
            status, _, body = post(url + "/v1/completions", completion_body(served_name, text), 60.0)
            if status != 200:
                raise RuntimeError(f"the co-located engine answered HTTP {status}: {str(body)[:300]}")
            answers.append(Answer.of(body))
        return answers
    finally:
        stop_group(engine)
        log.close()


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM to the engine's process group (API server, engine core), SIGKILL to what is left after
    ``timeout_s``."""
    for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def received(urls: list[str]) -> tuple[float, float]:
    """(transfers received, bytes received) summed over the decode engines' /metrics."""
    transfers = bytes_in = 0.0
    for url in urls:
        for key, value in metric_samples(url).items():
            if key.startswith(RECEIVED[0]) and all(label in key for label in RECEIVED[1:]):
                transfers += value
            elif key.startswith(RECEIVED_BYTES):
                bytes_in += value
    return transfers, bytes_in


def wait_received(
    urls: list[str], before: tuple[float, float], expected: int, timeout_s: float = 15.0
) -> tuple[float, float]:
    """The growth of decode's counters once it reaches ``expected`` transfers or ``timeout_s`` passes (vLLM
    ships the connector's stats to the API process after engine steps, so the last ones may lag)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = received(urls)
        grown = (now[0] - before[0], now[1] - before[1])
        if grown[0] >= expected or time.monotonic() > deadline:
            return grown
        time.sleep(0.5)


def gpu_memory_used_mib() -> list[int] | None:
    """Memory in use per GPU (nvidia-smi; None without it): what an engine left behind shows here."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(line) for line in done.stdout.split() if line.strip().isdigit()]
