"""Real vLLM CPU engines for connector tests: tiny models, servers, requests, comparisons.

The engines are real ``vllm.entrypoints.openai.api_server`` processes on loopback
ports. Models are written by the tests: config, seeded random safetensors weights and
a word-level tokenizer (``t0`` .. ``t1023``). The same weights load in every process,
so a co-located engine and a prefill/decode pair compute the same function and
their outputs can be compared token for token and logprob for logprob.

Everything that starts a process also stops it: ``VllmServer`` terminates its whole
process group (API server, engine core, workers) on ``stop()`` and on ``__exit__``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.pdconnector.vllm.engine_device import ENGINE_DEVICE, device_engine_args, device_engine_env
from tests.ports import free_port

LOOPBACK = "127.0.0.1"
# Engines run from here, so a connector module under tests/ (a fault test's) imports whatever pytest's cwd is.
REPO = Path(__file__).resolve().parents[3]
# First start on a loaded 2-core machine can take minutes (testing-here.md saw up to 5).
DEFAULT_STARTUP_TIMEOUT_S = 420.0
DEFAULT_REQUEST_TIMEOUT_S = 120.0
TOP_LOGPROBS = 5


def base_engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM engine on this machine's test device (:mod:`engine_device`; on the CPU: a small
    KV space), no telemetry, offline."""
    env = dict(os.environ)
    env.update(
        {
            **device_engine_env(),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if extra:
        env.update(extra)
    return env


def engine_args(
    model_dir: Path,
    port: int,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    max_model_len: int = 2048,
    block_size: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line of a tiny-model OpenAI server (float32, dummy weights, prefix caching off, eager)."""
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--no-enable-prefix-caching",
        # No CUDA graphs here, and eager skips torch.compile's warm-up: a tiny engine starts in ~35 s instead
        # of ~60 s on 2 cores. Both sides of every comparison (P/D and its co-located reference) run the same
        # way.
        "--enforce-eager",
        "--seed",
        "0",
    ]
    args += device_engine_args()
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args + list(extra_args)


class EngineStartError(RuntimeError):
    """A vLLM server exited or did not become healthy in time; the message holds its log tail."""


@dataclass
class VllmServer:
    """A running vLLM OpenAI server subprocess in its own process group."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, max_chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-max_chars:]
        return ""

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200; returns seconds since start. Raises on exit or deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineStartError(
                    f"{self.name} exited with {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return self.ready_after_s
            time.sleep(1.0)
        raise EngineStartError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def is_running(self) -> bool:
        return self.process.poll() is None

    def _group_alive(self) -> bool:
        self.process.poll()  # reap the API server so a zombie does not keep the group "alive"
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group (API server, engine core, workers); SIGKILL what is left after
        ``grace_s``."""
        # A clean shutdown lets vLLM release its shared-memory segments; SIGKILL is the fallback.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# What the ``launch_engine`` fixture hands a test: ``launch(name, model_dir, **launch_server kwargs)``.
EngineLauncher = Callable[..., "VllmServer"]


def launch_server(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    max_model_len: int = 2048,
    block_size: int | None = None,
    extra_args: Sequence[str] = (),
) -> VllmServer:
    """Start a server without waiting for it (lets two engines boot side by side)."""
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    args = engine_args(
        model_dir,
        port,
        kv_transfer_config=kv_transfer_config,
        max_model_len=max_model_len,
        block_size=block_size,
        extra_args=extra_args,
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=base_engine_env(env),
            start_new_session=True,
            cwd=REPO,
        )
    return VllmServer(name=name, port=port, process=process, log_path=log_path, started_at=time.monotonic())


def start_server(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    **launch_kwargs: Any,
) -> VllmServer:
    """Start a server and wait until it is healthy; kills it if it does not come up."""
    server = launch_server(name, model_dir, log_dir, **launch_kwargs)
    try:
        server.wait_healthy(startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_servers(
    *servers: VllmServer, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> Iterator[tuple[VllmServer, ...]]:
    """Wait for already-launched servers to be healthy; stop all of them on exit, whatever happens."""
    try:
        for server in servers:
            server.wait_healthy(startup_timeout_s)
        yield servers
    finally:
        stop_all(servers)


# ---------------------------------------------------------------- requests


class CompletionError(RuntimeError):
    """An engine answered a completion with an error status, or not within the deadline."""

    def __init__(self, url: str, status: int | None, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:4000]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Completion:
    """The parts of a non-streaming ``/v1/completions`` answer the connector tests compare."""

    token_ids: list[int]
    prompt_token_ids: list[int]
    # Per generated token: token id -> logprob of the top-5 alternatives.
    top_logprobs: list[dict[int, float]]
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None
    elapsed_s: float
    raw: dict[str, Any] = field(repr=False)


def stream_token_ids(
    url: str, prompt: Sequence[int], *, max_tokens: int, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
) -> list[int]:
    """One greedy streamed completion: the token ids its events carry, in order (the stream must end with
    [DONE])."""
    body = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    body |= {"return_token_ids": True, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    token_ids: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data == "[DONE]":
                return token_ids
            if data:
                token_ids += json.loads(data)["choices"][0].get("token_ids") or []
    raise CompletionError(url, 200, f"stream ended without [DONE] after {len(token_ids)} tokens")


def _token_key_to_id(key: str) -> int:
    # With return_tokens_as_token_ids the logprob keys read "token_id:<n>".
    return int(key.rsplit(":", 1)[1])


def parse_completion(body: dict[str, Any], elapsed_s: float) -> Completion:
    choice = body["choices"][0]
    logprobs = choice.get("logprobs") or {}
    top = [
        {_token_key_to_id(k): float(v) for k, v in entry.items()}
        for entry in (logprobs.get("top_logprobs") or [])
    ]
    return Completion(
        token_ids=list(choice.get("token_ids") or []),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        top_logprobs=top,
        kv_transfer_params=body.get("kv_transfer_params"),
        finish_reason=choice.get("finish_reason"),
        elapsed_s=elapsed_s,
        raw=body,
    )


def complete(
    url: str,
    prompt: Sequence[int] | str,
    *,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> Completion:
    """One greedy non-streaming completion: token ids (list) or text prompt; returns ids and top-5
    logprobs."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": TOP_LOGPROBS,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise CompletionError(url, error.code, error.read().decode(errors="replace")) from error
    except TimeoutError as error:
        raise CompletionError(url, None, f"no answer within {timeout_s:.0f} s") from error
    except (urllib.error.URLError, ConnectionError) as error:
        raise CompletionError(url, None, f"cannot reach the engine: {error}") from error
    return parse_completion(payload, time.monotonic() - started)


# ---------------------------------------------------------------- prefill/decode


@dataclass(frozen=True)
class DisaggregatedResult:
    prefill: Completion
    decode: Completion
    elapsed_s: float


def pd_pull(
    prefill_url: str,
    decode_url: str,
    prompt: Sequence[int] | str,
    *,
    max_tokens: int,
    prefill_params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> DisaggregatedResult:
    """Pull-style P/D: prefill leg (``max_tokens=1``) first, then decode with the parameters prefill
    returned."""
    started = time.monotonic()
    params = {"do_remote_decode": True, "do_remote_prefill": False, **(prefill_params or {})}
    prefill = complete(
        prefill_url,
        prompt,
        max_tokens=1,
        kv_transfer_params=params,
        request_id=request_id,
        timeout_s=timeout_s,
    )
    if not prefill.kv_transfer_params:
        raise CompletionError(prefill_url, 200, "prefill leg returned no kv_transfer_params")
    decode = complete(
        decode_url,
        prompt,
        max_tokens=max_tokens,
        kv_transfer_params=prefill.kv_transfer_params,
        request_id=request_id,
        timeout_s=timeout_s,
    )
    return DisaggregatedResult(prefill=prefill, decode=decode, elapsed_s=time.monotonic() - started)


def pd_push(
    prefill_url: str,
    decode_url: str,
    prompt: Sequence[int] | str,
    *,
    max_tokens: int,
    prefill_params: Mapping[str, Any],
    decode_params: Mapping[str, Any],
    request_id: str | None = None,
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> DisaggregatedResult:
    """Push-style P/D: both legs sent at once (decode registers its blocks while prefill computes).

    Both legs carry the same ``X-Request-Id`` so engines that pair legs by request id can.
    A failure of either leg raises ``CompletionError`` after both legs have ended.
    """
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pd-push") as pool:
        prefill_future = pool.submit(
            complete,
            prefill_url,
            prompt,
            max_tokens=1,
            kv_transfer_params=prefill_params,
            request_id=request_id,
            timeout_s=timeout_s,
        )
        decode_future = pool.submit(
            complete,
            decode_url,
            prompt,
            max_tokens=max_tokens,
            kv_transfer_params=decode_params,
            request_id=request_id,
            timeout_s=timeout_s,
        )
        prefill_error = prefill_future.exception()
        decode_error = decode_future.exception()
    if prefill_error is not None:
        raise prefill_error
    if decode_error is not None:
        raise decode_error
    return DisaggregatedResult(
        prefill=prefill_future.result(), decode=decode_future.result(), elapsed_s=time.monotonic() - started
    )


# ---------------------------------------------------------------- comparison


def output_differences(expected: Completion, actual: Completion, *, logprob_atol: float = 1e-3) -> list[str]:
    """Why ``actual`` is not the same generation as ``expected`` (empty when equivalent).

    Token ids must be equal; at every position the top-5 sets must agree on the tokens whose
    logprob is clearly inside the top 5 and their logprobs must be within ``logprob_atol``.
    """
    differences: list[str] = []
    if actual.token_ids != expected.token_ids:
        differences.append(f"token ids differ: expected {expected.token_ids}, got {actual.token_ids}")
    if len(actual.top_logprobs) != len(expected.top_logprobs):
        differences.append(
            f"logprob positions differ: expected {len(expected.top_logprobs)}, got {len(actual.top_logprobs)}"
        )
    for position, (want, got) in enumerate(zip(expected.top_logprobs, actual.top_logprobs, strict=False)):
        # A near-tie at rank 5 may legitimately swap the 5th entry; compare the shared entries
        # and require every strong (not near the cut-off) expected entry to be present.
        cutoff = min(want.values()) if want else -math.inf
        for token_id, logprob in want.items():
            if token_id in got:
                if abs(got[token_id] - logprob) > logprob_atol:
                    differences.append(
                        f"position {position}: token {token_id} logprob {got[token_id]:.6f} vs expected "
                        f"{logprob:.6f}"
                    )
            elif logprob - cutoff > logprob_atol:
                differences.append(f"position {position}: token {token_id} missing from top-{TOP_LOGPROBS}")
    return differences


def run_concurrently(calls: Sequence[Callable[[], Any]], max_workers: int) -> list[Any]:
    """Run zero-argument callables on a thread pool; results in order, first exception re-raised."""
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="harness") as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def scrape_metrics(url: str, timeout_s: float = 10.0) -> str:
    """An engine's ``/metrics`` text: one snapshot to read several series from."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
        return response.read().decode()


def metric_sum(text: str, name: str, *, labels: dict[str, str] | None = None) -> float:
    """Sum of all samples of a Prometheus metric family (histograms: their ``_sum``) in ``text``,
    of those samples carrying ``labels`` if given."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if labels is not None and any(sample.labels.get(key) != value for key, value in labels.items()):
                continue
            if family.type != "histogram" or sample.name.endswith("_sum"):
                total += sample.value
    return total


def metric_total(url: str, name: str, timeout_s: float = 10.0) -> float:
    """:func:`metric_sum` of one family on an engine's ``/metrics``."""
    return metric_sum(scrape_metrics(url, timeout_s), name)


# ---------------------------------------------------------------- CPU accounting


def process_group_cpu_seconds(pgid: int) -> float:
    """User+system CPU seconds consumed so far by the live processes of a process group (from /proc)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # Fields after the parenthesised command: state is [0], pgrp [2], utime [11], stime [12].
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / ticks_per_s


def idle_cpu_fraction(servers: Sequence[VllmServer], window_s: float) -> dict[str, float]:
    """CPU cores used by each idle server over ``window_s`` (1.0 = one core busy the whole time)."""
    started = time.monotonic()
    before = {server.name: process_group_cpu_seconds(server.process.pid) for server in servers}
    time.sleep(window_s)
    after = {server.name: process_group_cpu_seconds(server.process.pid) for server in servers}
    # On a saturated machine the scans themselves take a while: divide by the time really elapsed.
    elapsed = time.monotonic() - started
    return {name: (after[name] - before[name]) / elapsed for name in before}


# ---------------------------------------------------------------- upstream connectors


class UpstreamConnector(StrEnum):
    PULL = "NixlConnector"
    PUSH = "NixlPushConnector"


def upstream_kv_transfer_config(connector: UpstreamConnector, role: str, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for upstream vLLM's NIXL connectors over host memory (UCX)."""
    return {
        "kv_connector": connector.value,
        "kv_role": role,
        "kv_buffer_device": ENGINE_DEVICE.value,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }


def nixl_side_channel_env(port: int) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


@dataclass(frozen=True)
class EnginePair:
    prefill: VllmServer
    decode: VllmServer
    prefill_engine_id: str
    prefill_side_channel_port: int


def launch_upstream_pair(
    connector: UpstreamConnector,
    model_dir: Path,
    log_dir: Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> EnginePair:
    """Launch (without waiting) a prefill and a decode engine using an upstream NIXL connector."""
    engines = {}
    side_channel_ports = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        side_channel_ports[role] = free_port()
        env = {**nixl_side_channel_env(side_channel_ports[role]), **(extra_env or {})}
        engines[role] = launch_server(
            f"upstream-{connector.value}-{role}",
            model_dir,
            log_dir,
            kv_transfer_config=upstream_kv_transfer_config(connector, kv_role, f"upstream-{role}"),
            env=env,
            extra_args=extra_args,
        )
    return EnginePair(
        prefill=engines["prefill"],
        decode=engines["decode"],
        prefill_engine_id="upstream-prefill",
        prefill_side_channel_port=side_channel_ports["prefill"],
    )


def upstream_push_params(pair: EnginePair, request_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill leg, decode leg) ``kv_transfer_params`` for upstream NixlPushConnector.

    Both legs must be sent with ``X-Request-Id: request_id``: upstream pairs them by the engine-internal id
    ``cmpl-<request_id>-<index>-<random>`` with its random suffix stripped. Without ``remote_request_id``
    upstream's decode engine core dies with a KeyError (seen on vLLM 0.32.0).
    """
    prefill = {"do_remote_decode": True, "do_remote_prefill": False}
    decode = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": f"cmpl-{request_id}-0",
        "remote_engine_id": pair.prefill_engine_id,
        "remote_host": LOOPBACK,
        "remote_port": pair.prefill_side_channel_port,
        "tp_size": 1,
    }
    return prefill, decode


def stop_all(servers: Sequence[VllmServer]) -> None:
    """Stop every server even if stopping one of them fails."""
    threads = [threading.Thread(target=server.stop) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
