"""Prefill + decode vLLM engines running our connector, and P/D requests against them (shared by the connector
tests).

One engine pair serves both modes: the mode travels in each request's ``kv_transfer_params``
(the engine's configured mode is only the default). The decode engine doubles as the
co-located reference: a request without transfer parameters is computed locally there.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdconnector.protocol.params import (
    RECEIVED_KEY,
    PrefillCoordinates,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)

from tests.pdconnector.vllm.engine_device import DEFAULT_BLOCK_SIZE, ENGINE_DEVICE, ON_GPU
from tests.pdconnector.vllm.harness import (
    LOOPBACK,
    Completion,
    CompletionError,
    DisaggregatedResult,
    VllmServer,
    complete,
    launch_server,
    metric_total,
    output_differences,
    running_servers,
)
from tests.ports import LISTEN_PORTS

CONNECTOR_MODULE = "pdconnector.vllm.connector"
ENGINE_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # dense; the hybrid's attention block is larger
# What the connector tests compare: a few generated tokens, logprobs within float32 noise, prompts around a
# block.
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-4
# A request computed among many (16 in flight) against the same request computed alone: on the GPU, the
# hybrid model's Mamba kernels are not batch-invariant (their float32 sums run in another order), and one of
# 16 hybrid answers differed from its lone twin by 1.4e-4 in one logprob, same token (H100, 2026-12-06); a
# wrong block or state moves logprobs by whole units. On the CPU batched and lone answers agree within
# LOGPROB_ATOL.
BATCHED_LOGPROB_ATOL = 1e-3 if ON_GPU else LOGPROB_ATOL
PROMPT_LENGTHS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 1000)
CONCURRENT = 16
# The ways a pair can move KV (connector settings for both engines): the block-outer layout (a block's pages
# of every layer in one run, the default) written directly, and the per-layer layout with every push gathered
# into prefill's staging buffer, written as one run into decode's and scattered there.
CONNECTOR_PATHS: dict[str, dict[str, Any]] = {
    "block-outer-direct": {},
    "per-layer-staged": {"kv_cache_layout": "LBHNC", "staging_mib": 64, "transfer_path": "staged"},
}
# The dense tests run both on the GPU; on the CPU one (2 cores: every pair costs CI minutes), the staged path
# being run there by the TP tests.
DENSE_PATHS = tuple(CONNECTOR_PATHS) if ON_GPU else ("block-outer-direct",)


def reserve_ports(count: int) -> list[int]:
    """Distinct free loopback ports outside the ephemeral range (:data:`LISTEN_PORTS`: an engine binds its
    side channel long after the port is picked, and an ephemeral one can be taken meanwhile by an outgoing
    connection: EADDRINUSE in CI), all bound at once so no two of them collide."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in random.sample(LISTEN_PORTS, 16 * count):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports on {LOOPBACK} in {16 * count} tries of {LISTEN_PORTS}")


def connector_config(
    engine_id: str,
    kv_role: str,
    side_channel_port: int,
    *,
    mode: str = "push",
    timeout_s: float = 30.0,
    policy: str = "fail",
    extra: dict[str, Any] | None = None,
    module: str = CONNECTOR_MODULE,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` the operator renders for our connector (``pdoperator.render.engine``),
    with ``extra`` keys added to its ``kv_connector_extra_config``; ``module``: where vLLM finds the
    connector class (a fault test's wrapper of ours)."""
    return {
        "kv_connector": "PDConnector",
        "kv_connector_module_path": module,
        "kv_role": kv_role,
        "kv_buffer_device": ENGINE_DEVICE.value,
        "engine_id": engine_id,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "mode": mode,
            "backends": ["UCX"],
            "side_channel_port": side_channel_port,
            "transfer_timeout_s": timeout_s,
            **(extra or {}),
        },
    }


@dataclass
class PDPair:
    prefill: VllmServer
    decode: VllmServer
    prefill_engine_id: str
    prefill_side_channel_port: int
    prefill_tp_size: int = 1
    connector_extra: dict[str, Any] = field(default_factory=dict)  # the pair's CONNECTOR_PATHS entry

    @property
    def stages_pushes(self) -> bool:
        return self.connector_extra.get("transfer_path") == "staged"

    @property
    def coordinates(self) -> PrefillCoordinates:
        return PrefillCoordinates(
            self.prefill_engine_id, LOOPBACK, self.prefill_side_channel_port, self.prefill_tp_size
        )

    def colocated(self, prompt: list[int], max_tokens: int) -> Completion:
        return complete(self.decode.url, prompt, max_tokens=max_tokens)

    def push(self, prompt: list[int], max_tokens: int, *, timeout_s: float = 120.0) -> DisaggregatedResult:
        transfer_id = mint_transfer_id()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            prefill = pool.submit(
                complete,
                self.prefill.url,
                prompt,
                max_tokens=1,
                kv_transfer_params=prefill_leg_params(TransferMode.PUSH, transfer_id),
                timeout_s=timeout_s,
            )
            decode = pool.submit(
                complete,
                self.decode.url,
                prompt,
                max_tokens=max_tokens,
                kv_transfer_params=push_decode_leg_params(transfer_id, self.coordinates),
                timeout_s=timeout_s,
            )
            errors = [f.exception() for f in (prefill, decode)]
        for error in errors:
            if error is not None:
                raise error
        return DisaggregatedResult(prefill.result(), decode.result(), time.monotonic() - started)

    def pull(self, prompt: list[int], max_tokens: int, *, timeout_s: float = 120.0) -> DisaggregatedResult:
        transfer_id = mint_transfer_id()
        started = time.monotonic()
        prefill = complete(
            self.prefill.url,
            prompt,
            max_tokens=1,
            kv_transfer_params=prefill_leg_params(TransferMode.PULL, transfer_id),
            timeout_s=timeout_s,
        )
        if not prefill.kv_transfer_params:
            raise CompletionError(self.prefill.url, 200, "prefill leg returned no kv_transfer_params")
        params = pull_decode_leg_params(prefill.kv_transfer_params, transfer_id)
        decode = complete(
            self.decode.url, prompt, max_tokens=max_tokens, kv_transfer_params=params, timeout_s=timeout_s
        )
        return DisaggregatedResult(prefill, decode, time.monotonic() - started)

    def run(
        self, mode: TransferMode, prompt: list[int], max_tokens: int, *, timeout_s: float = 120.0
    ) -> DisaggregatedResult:
        move = self.push if mode is TransferMode.PUSH else self.pull
        try:
            return move(prompt, max_tokens, timeout_s=timeout_s)
        except CompletionError as error:
            # What the engines logged says why (a CI log shows only the test's output).
            logged = "\n".join(
                f"{server.name}: {line}"
                for server in (self.prefill, self.decode)
                for line in _errors_logged(server)
            )
            raise CompletionError(
                error.url, error.status, f"{error.body}\nengine errors:\n{logged or '(none)'}"
            ) from error


def _errors_logged(server: VllmServer, limit: int = 6) -> list[str]:
    return [line for line in server.log_tail(40_000).splitlines() if " ERROR " in line][-limit:]


@contextlib.contextmanager
def pd_pair(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    policy: str = "fail",
    timeout_s: float = 30.0,
    decode_prefix_caching: bool = False,
    decode_args: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
    prefill_extra: dict[str, Any] | None = None,
    decode_extra: dict[str, Any] | None = None,
    module: str = CONNECTOR_MODULE,
) -> Iterator[PDPair]:
    """Start a prefill and a decode engine with our connector side by side; both are stopped on exit.

    ``decode_prefix_caching``: the decode engine keeps vLLM's prefix cache on (the harness turns it off
    everywhere else), so a P/D request there receives only the blocks after its local prefix hit.
    ``decode_args``: more engine arguments for decode. ``extra``: connector settings for both
    (:data:`CONNECTOR_PATHS`); ``prefill_extra``, ``decode_extra``: for one of them only; ``module``: the
    connector's module for both (:func:`connector_config`)."""
    prefill_sc, decode_sc, prefill_http, decode_http = reserve_ports(4)
    prefill_id = f"{name}-prefill"

    def launch(
        engine_id: str, kv_role: str, ports: tuple[int, int], role_extra: dict[str, Any] | None, **kwargs: Any
    ) -> VllmServer:
        side_channel_port, http_port = ports
        config = connector_config(
            engine_id,
            kv_role,
            side_channel_port,
            timeout_s=timeout_s,
            policy=policy,
            extra={**(extra or {}), **(role_extra or {})},
            module=module,
        )
        return launch_server(
            engine_id, model_dir, log_dir, kv_transfer_config=config, env=ENGINE_ENV, port=http_port, **kwargs
        )

    prefill = launch(prefill_id, "kv_producer", (prefill_sc, prefill_http), prefill_extra)
    decode = launch(
        f"{name}-decode",
        "kv_consumer",
        (decode_sc, decode_http),
        decode_extra,
        # the last of the two prefix-caching flags wins
        extra_args=(*decode_args, *(("--enable-prefix-caching",) if decode_prefix_caching else ())),
    )
    with running_servers(prefill, decode):
        warm_up(prefill, decode)
        yield PDPair(prefill, decode, prefill_id, prefill_sc, connector_extra=dict(extra or {}))


WARM_UP_LENGTHS = (1, 600)  # the shortest and longest prompts the tests send


def warm_up(*servers: VllmServer, lengths: Sequence[int] = WARM_UP_LENGTHS) -> None:
    """One co-located completion per prompt length on each engine. Eager engines skip vLLM's warm-up, so the
    first prompt of a length pays for its kernels: seconds on a loaded CI machine, which a transfer test would
    then count against decode's deadline (a first push on a fresh TP-2 hybrid engine missed its 30 s that
    way)."""
    for server in servers:
        for length in lengths:
            complete(server.url, prompt_of(length, seed=99), max_tokens=2)


def kv_cache_usage(server: VllmServer) -> float:
    return metric_total(server.url, "vllm:kv_cache_usage_perc")


def wait_for_free_blocks(pair: PDPair, timeout_s: float = 45.0) -> dict[str, float]:
    """KV cache usage of both engines once it drops to zero (or as it is at the deadline): 0 means no block is
    held.

    The default outlasts prefill's 30 s lease: a hold whose release notice went missing must still end by
    then."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {"prefill": kv_cache_usage(pair.prefill), "decode": kv_cache_usage(pair.decode)}
        if not any(usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(11 * i + 7 * seed + 5) % 1024 for i in range(length)]


def assert_disaggregated_equals_colocated(
    pair: PDPair, mode: TransferMode, lengths: Sequence[int], *, first_seed: int = 0
) -> dict[int, Any]:
    """One P/D request in ``mode`` per prompt length: its output must equal the decode engine's co-located
    output (ids and top-5 logprobs) and decode must report it received the prompt by a transfer in that mode.
    Returns those reports by length."""
    received_by_length = {}
    for seed, length in enumerate(lengths, start=first_seed):
        prompt = prompt_of(length, seed)
        colocated = pair.colocated(prompt, MAX_TOKENS)
        result = pair.run(mode, prompt, MAX_TOKENS)
        assert output_differences(colocated, result.decode, logprob_atol=LOGPROB_ATOL) == [], (
            f"{mode} prompt of {length} tokens"
        )
        assert result.decode.prompt_token_ids == prompt
        received = (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY)
        assert received and received["mode"] == mode.value, (
            f"{mode}: decode did not receive the KV of the {length}-token prompt: "
            f"{result.decode.kv_transfer_params}"
        )
        received_by_length[length] = received
    return received_by_length
