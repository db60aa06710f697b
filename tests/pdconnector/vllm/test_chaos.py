"""No late byte lands in a reused block: chaos on real vLLM CPU engines running our connector.

Two ways a prefill can still write into decode's blocks after decode's deadline, each followed by traffic that
needs every block decode frees:

* **A late WRITE** (MockTransport with an injected wire delay, so the timing is exact): prefill posts its
  WRITE at once, the bytes arrive ``WRITE_DELAY_S`` later, long after decode's deadline. Decode's KV cache is
  so small that requests computed locally meanwhile must reuse the victim's blocks if decode frees them at its
  deadline; the late bytes would then overwrite their KV mid-generation.
* **A frozen prefill** (real NIXL over UCX, its process group SIGSTOPped right after it took decode's
  registration): decode's deadline passes, decode computes other requests, then prefill resumes and gets the
  victim's prefill leg.

Corruption detector: every completion the clients receive equals the decode engine's own co-located output
(token ids and top-5 logprobs), the victim gets its error at its deadline (well before the late bytes)
although its blocks stay held until the late bytes can no longer land (the fence holds blocks, not clients),
afterwards both engines serve P/D traffic with co-located outputs, and neither holds a block.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pdconnector.protocol.params import (
    RECEIVED_KEY,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    push_decode_leg_params,
)
from pdconnector.transport.mock_faults import FAULTS_ENV

from tests.pdconnector.vllm.harness import (
    Completion,
    CompletionError,
    complete,
    launch_server,
    output_differences,
    running_servers,
)
from tests.pdconnector.vllm.pd_engines import (
    BLOCK_SIZE,
    ENGINE_ENV,
    LOGPROB_ATOL,
    PDPair,
    connector_config,
    prompt_of,
    reserve_ports,
    wait_for_free_blocks,
    warm_up,
)

pytestmark = pytest.mark.slow

DEADLINE_S = 3.0  # decode's transfer timeout
WRITE_DELAY_S = 9.0  # how much later than posted the late WRITE's bytes arrive (within the 10 s lease)
FREEZE_S = DEADLINE_S + 3.0  # how long the frozen prefill stays stopped
# The victim's client hears its error at decode's deadline, not when the fence lets its blocks go
# (no sooner than the late bytes land, WRITE_DELAY_S after prefill posted them): the bound lies midway,
# 3 s clear of each, as decode's deadline starts when its worker took the registration and the error
# leaves on an engine step that the fillers slow (4.45 s after asking on a loaded 2-core CI machine,
# 3.0-3.2 s here).
VICTIM_ANSWER_S = (DEADLINE_S + WRITE_DELAY_S) / 2
DECODE_BLOCKS = 17  # the victim takes 8 and so does each filler: two fillers at once need the victim's blocks
PROMPT_TOKENS = 8 * BLOCK_SIZE - 40  # eight blocks, with room for the generated tokens
FILLER_TOKENS = 32
FILLERS = 2  # concurrent local requests on decode while the victim's transfer is late
LEASE_S = 10.0
SLACK_S = 15.0


def _config(engine_id: str, kv_role: str, side_channel_port: int, backend: str) -> dict[str, Any]:
    # prefill's WRITE deadline outlasts the injected delay
    timeout_s = DEADLINE_S if kv_role == "kv_consumer" else 30.0
    config = connector_config(engine_id, kv_role, side_channel_port, timeout_s=timeout_s)
    extra = config["kv_connector_extra_config"]
    extra["backends"] = [backend]
    extra["fence_s"] = (
        120.0  # longer than any wait here: blocks come back on prefill's answer, not by the fence
    )
    extra["lease_s"] = LEASE_S
    return config


@contextlib.contextmanager
def _pair(
    name: str, model: Path, log_dir: Path, *, backend: str, prefill_env: dict[str, str] | None = None
) -> Iterator[PDPair]:
    prefill_sc, decode_sc, prefill_http, decode_http = reserve_ports(4)
    prefill_id, decode_id = f"{name}-prefill", f"{name}-decode"
    prefill = launch_server(
        prefill_id,
        model,
        log_dir,
        kv_transfer_config=_config(prefill_id, "kv_producer", prefill_sc, backend),
        env={**ENGINE_ENV, **(prefill_env or {})},
        port=prefill_http,
    )
    decode = launch_server(
        decode_id,
        model,
        log_dir,
        kv_transfer_config=_config(decode_id, "kv_consumer", decode_sc, backend),
        env=ENGINE_ENV,
        port=decode_http,
        extra_args=("--num-gpu-blocks-override", str(DECODE_BLOCKS)),
    )
    with running_servers(prefill, decode):
        # The scenarios time prefill against decode's 3 s deadline: first-prompt kernel costs are paid here.
        warm_up(prefill, decode, lengths=(PROMPT_TOKENS,))
        yield PDPair(prefill, decode, prefill_id, prefill_sc)


@dataclass
class Fillers:
    """Requests computed locally on decode, in a loop, each checked against its co-located reference."""

    pair: PDPair
    prompts: list[list[int]]
    references: list[Completion] = field(default_factory=list)
    checked: int = 0
    wrong: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def prepare(self) -> None:
        self.references = [
            complete(self.pair.decode.url, prompt, max_tokens=FILLER_TOKENS) for prompt in self.prompts
        ]

    def run(self, lane: int) -> None:
        index = lane
        while not self.stop.is_set():
            slot = index % len(self.prompts)
            actual = complete(
                self.pair.decode.url, self.prompts[slot], max_tokens=FILLER_TOKENS, timeout_s=60
            )
            problems = output_differences(self.references[slot], actual, logprob_atol=LOGPROB_ATOL)
            if problems:
                self.wrong.append(f"filler {slot}: {problems[:3]}")
            self.checked += 1
            index += FILLERS


@contextlib.contextmanager
def _filling(fillers: Fillers) -> Iterator[None]:
    with ThreadPoolExecutor(FILLERS) as pool:
        lanes = [pool.submit(fillers.run, lane) for lane in range(FILLERS)]
        try:
            yield
        finally:
            fillers.stop.set()
            for lane in lanes:
                lane.result()


Answered = tuple[Completion | CompletionError, float]  # the answer, and when it came (monotonic)


def _send_decode_leg(
    pool: ThreadPoolExecutor, pair: PDPair, prompt: list[int], transfer_id: str, *, timeout_s: float
) -> Future[Answered]:
    params = push_decode_leg_params(transfer_id, pair.coordinates)

    def leg() -> Answered:
        try:
            answer: Completion | CompletionError = complete(
                pair.decode.url,
                prompt,
                max_tokens=FILLER_TOKENS,
                kv_transfer_params=params,
                timeout_s=timeout_s,
            )
        except CompletionError as error:
            answer = error
        return answer, time.monotonic()

    return pool.submit(leg)


def _victim_error(decode_leg: Future[Answered], asked: float) -> tuple[CompletionError, float]:
    """The victim's error and how long after ``asked`` it came."""
    answer, answered_at = decode_leg.result(timeout=VICTIM_ANSWER_S + SLACK_S)
    assert isinstance(answer, CompletionError), (
        f"the victim was served although its KV never arrived: {answer}"
    )
    return answer, answered_at - asked


def _serves_pd_traffic_and_holds_nothing(pair: PDPair) -> None:
    prompt = prompt_of(PROMPT_TOKENS, seed=90)
    result = pair.push(prompt, FILLER_TOKENS)
    assert (
        output_differences(pair.colocated(prompt, FILLER_TOKENS), result.decode, logprob_atol=LOGPROB_ATOL)
        == []
    )
    assert (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY), result.decode.kv_transfer_params
    assert wait_for_free_blocks(pair, timeout_s=LEASE_S + SLACK_S) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.timeout(600)
def test_a_write_that_lands_after_decodes_deadline_never_reaches_a_block_another_request_uses(
    dense_model: Path, engine_log_dir: Path
) -> None:
    faults = {FAULTS_ENV: json.dumps({"write_delay_s": WRITE_DELAY_S, "delayed_writes": 1})}  # the victim's
    with _pair("chaos-late", dense_model, engine_log_dir, backend="mock", prefill_env=faults) as pair:
        fillers = Fillers(pair, [prompt_of(PROMPT_TOKENS, seed=60 + i) for i in range(4)])
        fillers.prepare()
        victim = prompt_of(PROMPT_TOKENS, seed=50)
        transfer_id = mint_transfer_id()
        with ThreadPoolExecutor(2) as pool:
            asked = time.monotonic()
            decode_leg = _send_decode_leg(
                pool, pair, victim, transfer_id, timeout_s=VICTIM_ANSWER_S + SLACK_S
            )
            prefill_leg = complete(
                pair.prefill.url,
                victim,
                max_tokens=1,
                kv_transfer_params=prefill_leg_params(TransferMode.PUSH, transfer_id),
            )
            assert prefill_leg.token_ids, "prefill computed the victim and posted its (late) WRITE"
            prefilled_after = time.monotonic() - asked
            assert prefilled_after < DEADLINE_S, (
                f"prefill took {prefilled_after:.1f}s, past decode's deadline: no late WRITE to catch"
            )
            time.sleep(max(0.0, asked + DEADLINE_S - time.monotonic()))
            with _filling(fillers):  # from decode's deadline until well after the late bytes landed
                error, answered_after = _victim_error(decode_leg, asked)
                time.sleep(max(2.0, asked + WRITE_DELAY_S + 3.0 - time.monotonic()))
        assert fillers.wrong == [], (
            f"{len(fillers.wrong)} of {fillers.checked} local requests were corrupted: {fillers.wrong}"
        )
        assert fillers.checked >= 2 * FILLERS, fillers.checked
        assert error.status is not None and error.status >= 500, error
        assert answered_after <= VICTIM_ANSWER_S, answered_after
        _serves_pd_traffic_and_holds_nothing(pair)
        print(
            f"late write: victim answered {error.status} after {answered_after:.1f}s, {fillers.checked} "
            "local requests all right"
        )


def _signal_group(pair: PDPair, sig: signal.Signals) -> None:
    os.killpg(os.getpgid(pair.prefill.process.pid), sig)


@pytest.mark.timeout(600)
def test_a_prefill_frozen_after_it_took_the_registration_never_writes_into_blocks_decode_reused(
    dense_model: Path, engine_log_dir: Path
) -> None:
    with _pair("chaos-frozen", dense_model, engine_log_dir, backend="UCX") as pair:
        fillers = Fillers(pair, [prompt_of(PROMPT_TOKENS, seed=70 + i) for i in range(4)])
        fillers.prepare()
        victim = prompt_of(PROMPT_TOKENS, seed=51)
        transfer_id = mint_transfer_id()

        def resume() -> None:
            _signal_group(pair, signal.SIGCONT)

        with ThreadPoolExecutor(1) as pool:
            asked = time.monotonic()
            decode_leg = _send_decode_leg(
                pool, pair, victim, transfer_id, timeout_s=VICTIM_ANSWER_S + SLACK_S
            )
            # decode allocated and registered; prefill's transfer thread took the registration
            time.sleep(1.0)
            _signal_group(pair, signal.SIGSTOP)
            try:
                time.sleep(DEADLINE_S)
                # decode's deadline has passed: local requests want the victim's blocks, which a frozen
                # prefill may still write into when it wakes
                with _filling(fillers):
                    error, answered_after = _victim_error(decode_leg, asked)
                    time.sleep(FREEZE_S - DEADLINE_S)
                    resume()
                    prefill_leg = complete(
                        pair.prefill.url,
                        victim,
                        max_tokens=1,
                        kv_transfer_params=prefill_leg_params(TransferMode.PUSH, transfer_id),
                    )
                    time.sleep(2.0)
            finally:
                resume()
        assert prefill_leg.token_ids
        assert fillers.wrong == [], (
            f"{len(fillers.wrong)} of {fillers.checked} local requests were corrupted: {fillers.wrong}"
        )
        assert fillers.checked >= 2 * FILLERS, fillers.checked
        assert error.status is not None and error.status >= 500, error
        assert answered_after <= VICTIM_ANSWER_S, answered_after  # while prefill was still frozen
        _serves_pd_traffic_and_holds_nothing(pair)
        print(
            f"frozen prefill: victim answered {error.status} after {answered_after:.1f}s (prefill frozen), "
            f"{fillers.checked} local requests right"
        )
