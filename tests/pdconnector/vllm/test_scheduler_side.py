"""The connector's scheduler-side state machine with plain request objects (no engine)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from pdconnector.protocol.params import (
    ERROR_KEY,
    RECEIVED_KEY,
    TRANSFER_ID_KEY,
    PrefillCoordinates,
    TransferMode,
    prefill_leg_params,
    push_decode_leg_params,
)
from pdconnector.vllm.config import ConnectorConfigError, parse_connector_config
from pdconnector.vllm.connector import PDConnector
from pdconnector.vllm.metadata import FailRequest, ReleaseBlocks
from pdconnector.vllm.scheduler import EngineCoordinates, SchedulerSide
from pdconnector.worker.commands import AbandonTransfer, CancelTransfer, ExpectPush, PrefillDone, ReadBlocks

FINISHED = "finished_stopped"
ABORTED = "finished_aborted"
PREFILL = PrefillCoordinates("prefill-0", "10.0.0.1", 5600, 1)


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: str = FINISHED
    max_tokens: int = 16
    _all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    arrival_time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids


@dataclass
class FakeBlock:
    block_id: int
    block_hash: Any = None
    is_null: bool = False


def config(mode: str = "push", failure_policy: str = "fail") -> Any:
    return parse_connector_config(
        engine_id="engine-a",
        extra={"mode": mode, "side_channel_port": 5601},
        buffer_device="cpu",
        failure_policy=failure_policy,
        env={},
    )


def scheduler(
    mode: str = "push",
    ssm_groups: frozenset[int] = frozenset(),
    num_groups: int = 1,
    failure_policy: str = "fail",
) -> SchedulerSide:
    return SchedulerSide(
        config(mode, failure_policy),
        EngineCoordinates("engine-a", "10.0.0.2", 5601, 1),
        num_groups=num_groups,
        ssm_groups=ssm_groups,
        block_size=16,
        finished_statuses=frozenset({FINISHED}),
    )


def blocks(*ids: int, cached: int = 0) -> list[FakeBlock]:
    return [FakeBlock(b, block_hash=f"h{b}" if i < cached else None) for i, b in enumerate(ids)]


def test_push_decode_claims_the_prompt_as_async_external_tokens_without_side_effects() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    assert side.get_num_new_matched_tokens(request, 0) == (40, True)
    assert side.get_num_new_matched_tokens(request, 0) == (40, True)
    assert side.build_meta().commands == []


def test_push_decode_stages_its_registration_in_the_allocation_step() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    assert side.build_meta().commands == [ExpectPush("d1", "tx-1", PREFILL, ((7, 8, 9),), 40)]
    # A second allocation call (after the load) stages nothing and claims nothing.
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 0)
    assert side.get_num_new_matched_tokens(request, 40) == (0, False)
    assert side.build_meta().commands == []


def test_decode_reports_what_it_received_and_frees_immediately_once_received() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.update_connector_output({"d1"}, set())
    delay, params = side.request_finished(request, [[7, 8, 9]])
    assert delay is False
    received = {"transfer_id": "tx-1", "mode": "push", "blocks": 3, "tier_blocks": 0}
    assert params is not None and params[RECEIVED_KEY] == received


def test_decode_failure_is_not_reported_as_received() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.update_connector_output({"d1"}, {"d1"})
    assert side.request_finished(request, [[7, 8, 9]]) == (False, None)


def test_a_failed_receive_ends_the_request_now_and_keeps_its_blocks_until_every_rank_releases_them() -> None:
    """vLLM's order in one step: the failed receive ends the request (request_finished), then the connector
    sees the output whose finished_recving would free its blocks: it keeps them out of it and asks every rank
    to give them back once no prefill can write into them."""
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)), status=ABORTED)
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.build_meta()
    assert side.request_finished(request, [[7, 8, 9]]) == (True, None)
    assert side.update_connector_output({"d1"}, {"d1"}) == {"d1"}
    assert ReleaseBlocks("d1") in side.build_meta().commands


def test_under_the_recompute_policy_a_failed_receive_keeps_nothing_back() -> None:
    """The request computes its prompt itself, in its own blocks: it must wait for the fence, which the
    workers do before they report the failure."""
    side = scheduler(failure_policy="recompute")
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.build_meta()
    assert side.update_connector_output({"d1"}, {"d1"}) == set()
    assert side.build_meta().commands == []


def test_decode_aborted_while_receiving_cancels_and_keeps_its_blocks_until_the_workers_confirm() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)), status=ABORTED)
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.build_meta()
    assert side.request_finished(request, [[7, 8, 9]]) == (True, None)
    assert side.build_meta().commands == [
        CancelTransfer("d1", "tx-1", "decode request d1 ended before its KV arrived")
    ]


def test_decode_with_unusable_parameters_fails_the_request_naming_the_key() -> None:
    side = scheduler()
    params = push_decode_leg_params("tx-1", PREFILL)
    del params["remote_host"]
    request = FakeRequest("d1", params, list(range(40)))
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    (command,) = side.build_meta().commands
    assert isinstance(command, FailRequest) and command.request_id == "d1" and "remote_host" in command.detail


def test_push_decode_with_a_local_prefix_hit_registers_only_the_blocks_it_lacks_after_the_cached_ones() -> (
    None
):
    """vLLM asks with the block-aligned local hit (2 blocks of 16 here) and allocates the hit blocks first."""
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(70)))
    assert side.get_num_new_matched_tokens(request, 32) == (38, True)
    side.update_state_after_alloc(request, [blocks(3, 4, 8, 9, 10, cached=2)], 38)
    assert side.build_meta().commands == [
        ExpectPush("d1", "tx-1", PREFILL, ((8, 9, 10),), 38, cached_blocks=2)
    ]
    side.update_connector_output({"d1"}, set())
    _, params = side.request_finished(request, [[3, 4, 8, 9, 10]])
    assert params is not None and params[RECEIVED_KEY]["blocks"] == 3


def test_hybrid_push_decode_with_a_prefix_hit_skips_cached_attention_but_takes_the_state_block() -> None:
    side = scheduler(ssm_groups=frozenset({1}), num_groups=2)
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    assert side.get_num_new_matched_tokens(request, 16) == (23, True)
    side.update_state_after_alloc(
        request,
        [blocks(3, 8, 9, cached=1), [FakeBlock(0, is_null=True), FakeBlock(5, "h5"), FakeBlock(21)]],
        23,
    )
    assert side.build_meta().commands == [
        ExpectPush("d1", "tx-1", PREFILL, ((8, 9), (21,)), 23, cached_blocks=1)
    ]


def test_hybrid_push_decode_holding_every_token_prefill_computed_registers_nothing_and_releases_prefill() -> (
    None
):
    """33 prompt tokens: prefill computes 32 (decode recomputes the last), and decode's cache holds those 2
    blocks."""
    side = scheduler(ssm_groups=frozenset({1}), num_groups=2)
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(33)))
    assert side.get_num_new_matched_tokens(request, 32) == (0, False)
    side.update_state_after_alloc(
        request,
        [blocks(3, 8, 9, cached=2), [FakeBlock(0, is_null=True), FakeBlock(5, "h5"), FakeBlock(21)]],
        0,
    )
    assert side.build_meta().commands == [
        AbandonTransfer("d1", "tx-1", PREFILL, "decode request d1 holds every prompt token already")
    ]
    assert side.request_finished(request, [[3, 8, 9], [21]]) == (False, None)
    assert side.build_meta().commands == []


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_decode_request_aborted_before_it_allocated_releases_prefill_at_once(mode: str) -> None:
    side = scheduler(mode)
    params = push_decode_leg_params("tx-1", PREFILL)
    if mode == "pull":
        params |= {"transfer_mode": "pull", "remote_block_ids": [[4, 5, 6]], "remote_num_tokens": 40}
    request = FakeRequest("d1", params, list(range(40)), status=ABORTED)
    assert side.get_num_new_matched_tokens(request, 0) == (40, True)
    assert side.request_finished(request, []) == (False, None)
    assert side.build_meta().commands == [
        AbandonTransfer("d1", "tx-1", PREFILL, "decode request d1 ended before it allocated blocks")
    ]


def test_a_decode_request_without_usable_prefill_coordinates_abandons_nothing() -> None:
    side = scheduler()
    params = push_decode_leg_params("tx-1", PREFILL)
    del params["remote_host"]
    assert side.request_finished(FakeRequest("d1", params, list(range(40)), status=ABORTED), []) == (
        False,
        None,
    )
    assert side.build_meta().commands == []


def test_pull_decode_reads_only_the_blocks_it_lacks() -> None:
    side = scheduler("pull")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        TRANSFER_ID_KEY: "tx-2",
        "transfer_mode": "pull",
        "remote_block_ids": [[11, 12, 13]],
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 40,
        "remote_hold_ms": 20_000,
    }
    request = FakeRequest("d2", params, list(range(40)))
    assert side.get_num_new_matched_tokens(request, 16) == (24, True)
    side.update_state_after_alloc(request, [blocks(3, 8, 9, cached=1)], 24)
    (command,) = side.build_meta().commands
    assert command == ReadBlocks("d2", "tx-2", PREFILL, ((12, 13),), ((8, 9),), 24, command.valid_for_s)
    # prefill's hold, less the slack and the time queued here
    assert 20.0 - 2.0 - 1.0 < command.valid_for_s <= 20.0 - 2.0


def test_a_pull_decode_that_waited_past_prefills_hold_reads_nothing_and_fails_naming_why() -> None:
    side = scheduler("pull")
    params = {
        **prefill_leg_params(TransferMode.PULL, "tx-late"),
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[11, 12]],
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_hold_ms": 10_000,
    }
    request = FakeRequest("d9", params, list(range(32)), arrival_time=time.time() - 9.0)
    side.update_state_after_alloc(request, [blocks(8, 9)], 32)
    (command,) = side.build_meta().commands
    assert isinstance(command, FailRequest)
    assert "remote_hold_ms" in command.detail and "waited 9." in command.detail


@pytest.mark.parametrize("first_received", [False, True])
def test_a_decode_request_reusing_a_live_transfer_id_is_refused_and_the_first_is_untouched(
    first_received: bool,
) -> None:
    side = scheduler()
    first = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(first, [blocks(7, 8, 9)], 40)
    if first_received:
        side.update_connector_output({"d1"}, set())
    side.build_meta()
    second = FakeRequest("d2", push_decode_leg_params("tx-1", PREFILL), list(range(40)), status=ABORTED)
    side.update_state_after_alloc(second, [blocks(1, 2, 3)], 40)
    (command,) = side.build_meta().commands
    assert isinstance(command, FailRequest) and command.request_id == "d2"
    assert (
        command.detail
        == "request d2: kv_transfer_params['transfer_id']: tx-1 is already in use by request d1 on this "
        "engine"
    )
    side.update_connector_output({"d2"}, {"d2"})
    assert side.request_finished(second, [[1, 2, 3]]) == (False, None)
    assert side.build_meta().commands == []  # no cancel of tx-1, which is d1's
    if not first_received:
        side.update_connector_output({"d1"}, set())
    assert side.request_finished(first, [[7, 8, 9]])[1][RECEIVED_KEY]["transfer_id"] == "tx-1"


def test_a_transfer_id_is_free_again_once_its_request_finished() -> None:
    side = scheduler()
    first = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(first, [blocks(7, 8, 9)], 40)
    side.update_connector_output({"d1"}, set())
    side.request_finished(first, [[7, 8, 9]])
    side.build_meta()
    retry = FakeRequest("d2", push_decode_leg_params("tx-1", PREFILL), list(range(40)))
    side.update_state_after_alloc(retry, [blocks(1, 2, 3)], 40)
    assert side.build_meta().commands == [ExpectPush("d2", "tx-1", PREFILL, ((1, 2, 3),), 40)]


@pytest.mark.parametrize("status", [FINISHED, ABORTED])
def test_a_prefill_request_reusing_a_held_transfer_id_keeps_nothing_and_leaves_the_holder_alone(
    status: str,
) -> None:
    side = scheduler()
    holder = FakeRequest(
        "p1", prefill_leg_params(TransferMode.PUSH, "tx-5"), list(range(40)), num_computed_tokens=40
    )
    assert side.request_finished(holder, [[4, 5, 6]])[0] is True
    side.build_meta()
    reuse = FakeRequest(
        "p2",
        prefill_leg_params(TransferMode.PUSH, "tx-5"),
        list(range(40)),
        num_computed_tokens=40,
        status=status,
    )
    delay, params = side.request_finished(reuse, [[7, 8, 9]])
    assert delay is False and params == {
        ERROR_KEY: "kv_transfer_params['transfer_id']: tx-5 is already held for request p1 on this engine"
    }
    assert side.build_meta().commands == [] and side.holds("p1")


def test_prefill_holds_its_blocks_and_returns_what_a_pull_decode_needs() -> None:
    side = scheduler("pull")
    request = FakeRequest(
        "p1", prefill_leg_params(TransferMode.PULL, "tx-3"), list(range(40)), num_computed_tokens=40
    )
    delay, params = side.request_finished(request, [[4, 5, 6]])
    assert delay is True and side.holds("p1")
    assert params is not None
    assert (
        params["remote_block_ids"] == [[4, 5, 6]]
        and params["remote_engine_id"] == "engine-a"
        and params["remote_port"] == 5601
    )
    assert params[TRANSFER_ID_KEY] == "tx-3" and params["remote_num_tokens"] == 40
    assert params["remote_hold_ms"] == int(config("pull").lease_s * 1000)  # decode reads only within it
    assert side.build_meta().commands == [PrefillDone("p1", "tx-3", ((4, 5, 6),), 40, pull=True)]
    side.finished_sending({"p1"})
    assert not side.holds("p1")


def test_aborted_prefill_frees_at_once_and_cancels_the_transfer() -> None:
    side = scheduler()
    request = FakeRequest(
        "p1", prefill_leg_params(TransferMode.PUSH, "tx-4"), list(range(40)), status=ABORTED
    )
    assert side.request_finished(request, [[4, 5, 6]]) == (False, None)
    (command,) = side.build_meta().commands
    assert isinstance(command, CancelTransfer) and command.transfer_id == "tx-4"


def test_prefill_without_a_transfer_id_keeps_nothing_and_says_why() -> None:
    side = scheduler()
    request = FakeRequest("p1", {"do_remote_decode": True}, list(range(40)), num_computed_tokens=40)
    delay, params = side.request_finished(request, [[4, 5, 6]])
    assert delay is False and params is not None and "transfer_id" in params[ERROR_KEY]
    assert side.build_meta().commands == []


def test_hybrid_prefill_stops_one_token_short_and_decode_claims_one_token_less() -> None:
    side = scheduler(ssm_groups=frozenset({1}), num_groups=2)
    prefill = FakeRequest("p1", prefill_leg_params(TransferMode.PUSH, "tx-5"), list(range(40)))
    side.on_new_request(prefill)
    side.on_new_request(prefill)  # idempotent
    assert prefill.num_prompt_tokens == 39 and len(prefill._all_token_ids) == 39 and prefill.max_tokens == 1
    decode = FakeRequest("d1", push_decode_leg_params("tx-5", PREFILL), list(range(40)))
    assert side.get_num_new_matched_tokens(decode, 0) == (39, True)
    one_token = FakeRequest("d2", push_decode_leg_params("tx-6", PREFILL), [5])
    assert side.get_num_new_matched_tokens(one_token, 0) == (1, True)


def test_hybrid_moves_only_the_state_block_of_each_ssm_group() -> None:
    side = scheduler(ssm_groups=frozenset({1}), num_groups=2)
    decode = FakeRequest("d1", push_decode_leg_params("tx-5", PREFILL), list(range(40)))
    side.update_state_after_alloc(
        decode, [blocks(7, 8, 9), [FakeBlock(0, is_null=True), FakeBlock(0, is_null=True), FakeBlock(21)]], 39
    )
    assert side.build_meta().commands == [ExpectPush("d1", "tx-5", PREFILL, ((7, 8, 9), (21,)), 39)]
    prefill = FakeRequest(
        "p1", prefill_leg_params(TransferMode.PUSH, "tx-5"), list(range(39)), num_computed_tokens=39
    )
    delay, _ = side.request_finished(prefill, [[1, 2, 3], [0, 0, 14]])
    assert delay is True
    assert side.build_meta().commands == [PrefillDone("p1", "tx-5", ((1, 2, 3), (14,)), 39, pull=False)]


def test_requests_without_transfer_parameters_are_left_alone() -> None:
    side = scheduler()
    request = FakeRequest("x", None, list(range(10)))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, [blocks(1)], 0)
    assert side.request_finished(request, [[1]]) == (False, None)
    assert side.build_meta().commands == []


def test_engine_description_is_shipped_once_and_announced_peers_each_time() -> None:
    side = scheduler()
    side.set_engine_info(b"me")
    side.peer_announced(b"peer")
    first = side.build_meta()
    assert (first.engine, first.peers) == (b"me", [b"peer"])
    second = side.build_meta()
    assert (second.engine, second.peers) == (None, [])
    assert not side.has_pending_work()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"mode": "both"}, "mode"),
        ({"backends": []}, "backends"),
        ({"side_channel_port": 0}, "side_channel_port"),
        ({"transfer_timeout_s": -1}, "transfer_timeout_s"),
        ({"sidechannel_port": 1}, "sidechannel_port"),
        ({"backends": ["mock", "UCX"]}, "backends"),
        ({"log_timeline": "yes"}, "log_timeline"),
        ({"kv_cache_layout": "LHBNC"}, "kv_cache_layout"),
        ({"idle_step_wait_s": 0.5}, "idle_step_wait_s"),
        ({"idle_step_wait_s": -0.001}, "idle_step_wait_s"),
        ({"idle_step_wait_s": True}, "idle_step_wait_s"),
    ],
)
def test_bad_connector_configuration_names_the_field(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConnectorConfigError, match=key):
        parse_connector_config(engine_id="e", extra=extra, buffer_device="cpu", failure_policy="fail", env={})


def test_configuration_defaults_and_side_channel_host_from_the_operator_env() -> None:
    parsed = parse_connector_config(
        engine_id="e",
        extra=None,
        buffer_device=None,
        failure_policy=None,
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"},
    )
    assert (parsed.mode, parsed.backends, parsed.side_channel_host, parsed.side_channel_port) == (
        TransferMode.PUSH,
        ("UCX",),
        "10.1.2.3",
        5600,
    )
    assert parsed.recompute_on_failure is False
    # block-outermost: a request's scattered blocks cost one descriptor each
    assert parsed.kv_cache_layout == "BLHNC"
    assert parsed.idle_step_wait_s == 0.002


def test_only_a_step_that_runs_no_request_lets_the_workers_wait_for_a_transfer() -> None:
    side = scheduler()
    assert side.build_meta(scheduled=["d1"]).idle_wait_s == 0.0
    assert side.build_meta(scheduled=[]).idle_wait_s == 0.002
    off = SchedulerSide(
        parse_connector_config(
            engine_id="e", extra={"idle_step_wait_s": 0}, buffer_device="cpu", failure_policy="fail", env={}
        ),
        EngineCoordinates("engine-a", "10.0.0.2", 5601, 1),
        num_groups=1,
        ssm_groups=frozenset(),
        block_size=16,
        finished_statuses=frozenset({FINISHED}),
    )
    assert off.build_meta(scheduled=[]).idle_wait_s == 0.0


def test_the_connector_asks_vllm_for_the_configured_kv_cache_layout() -> None:
    def asked(extra: dict[str, Any] | None) -> str | None:
        transfer = SimpleNamespace(kv_connector_extra_config=extra)
        return PDConnector.get_required_kvcache_layout(SimpleNamespace(kv_transfer_config=transfer))  # type: ignore[arg-type]

    assert asked(None) == "BLHNC"
    assert asked({"kv_cache_layout": "BHLNC"}) == "BHLNC"
    with pytest.raises(ConnectorConfigError, match="kv_cache_layout"):
        asked({"kv_cache_layout": "HND"})


def test_the_scheduler_times_a_decode_legs_admission_and_its_resume_after_the_kv_arrived() -> None:
    side = scheduler()
    request = FakeRequest(
        "d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)), arrival_time=time.time() - 0.25
    )
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.build_meta(["d1"])  # scheduled for its load, before any KV: no resume yet
    side.update_connector_output({"d1"}, set())
    time.sleep(0.01)
    side.build_meta(["d2"])  # a step that does not run it
    side.build_meta(["d1"])
    taken = side.take_stats()
    assert taken is not None
    stages = taken.data["stages"]
    assert stages["admission"][0] == pytest.approx(0.25, abs=0.1)
    assert len(stages["resume"]) == 1 and 0.01 <= stages["resume"][0] < 1.0
    assert side.take_stats() is None


def test_a_received_request_aborted_before_it_resumed_leaves_no_resume_behind() -> None:
    side = scheduler()
    request = FakeRequest("d1", push_decode_leg_params("tx-1", PREFILL), list(range(40)), status=ABORTED)
    side.update_state_after_alloc(request, [blocks(7, 8, 9)], 40)
    side.update_connector_output({"d1"}, set())
    side.request_finished(request, [[7, 8, 9]])
    side.take_stats()
    side.build_meta(["d1"])  # a recycled request id must not count the old one's wait
    assert side.take_stats() is None
