"""The KV tier on the scheduler side, with plain request objects: a finished request's blocks are saved,
readable once every rank copied them, and a later request's blocks after the prefix cache come from the tier
first and from prefill only after the tier's run."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from pdconnector.protocol.params import (
    RECEIVED_KEY,
    TRANSFER_ID_KEY,
    TransferMode,
    prefill_leg_params,
    push_decode_leg_params,
)
from pdconnector.vllm.metadata import LoadFromTier, SaveToTier, TierFailures
from pdconnector.vllm.scheduler import EngineCoordinates, SchedulerSide
from pdconnector.vllm.stats import PDTransferStats, TokenSource
from pdconnector.vllm.tier_plan import TierPlan
from pdconnector.worker.commands import AbandonTransfer, ExpectPush, PrefillDone, ReadBlocks
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from tests.pdconnector.vllm.test_scheduler_side import ABORTED, FINISHED, PREFILL, FakeRequest, blocks, config

BLOCK = 16


def scheduler(
    mode: str = "push", *, tier_slots: int = 8, hash_block_size: int = BLOCK, failure_policy: str = "fail"
) -> SchedulerSide:
    return SchedulerSide(
        config(mode, failure_policy),
        EngineCoordinates("engine-a", "10.0.0.2", 5601, 1),
        num_groups=1,
        ssm_groups=frozenset(),
        block_size=BLOCK,
        finished_statuses=frozenset({FINISHED}),
        hash_block_size=hash_block_size,
        tier_slots=tier_slots,
    )


def request(request_id: str, tokens: int, transfer_id: str, **params: Any) -> FakeRequest:
    """A decode request whose full blocks hash to h0, h1, ... (the same tokens, the same hashes)."""
    made = FakeRequest(request_id, push_decode_leg_params(transfer_id, PREFILL) | params, list(range(tokens)))
    made.block_hashes = [f"h{i}".encode() for i in range(tokens // BLOCK)]  # type: ignore[attr-defined]
    return made


def received_and_finished(side: SchedulerSide, finished: FakeRequest, block_ids: list[int]) -> SaveToTier:
    """``finished`` received its KV, ran, and ended normally: its save, staged, not yet copied."""
    side.update_state_after_alloc(finished, [blocks(*block_ids)], finished.num_prompt_tokens)
    side.build_meta()
    side.update_connector_output({finished.request_id}, set())
    delay, _ = side.request_finished(finished, [block_ids])
    assert delay is True  # the blocks stay until every rank copied them
    (save,) = side.build_meta().commands
    assert isinstance(save, SaveToTier)
    return save


def served(side: SchedulerSide, finished: FakeRequest, block_ids: list[int]) -> SaveToTier:
    """``finished`` received its KV, ran, and ended normally: its save, copied by every rank."""
    save = received_and_finished(side, finished, block_ids)
    side.finished_sending({finished.request_id})
    return save


def test_a_finished_request_saves_the_blocks_of_its_computed_tokens_once() -> None:
    side = scheduler()
    first = request("d1", 60, "tx-1")  # 3 full blocks and 12 tokens
    first.num_computed_tokens = 59  # the last sampled token has no KV yet
    save = served(side, first, [7, 8, 9, 10])
    assert save.block_ids == (7, 8, 9) and len(set(save.slots)) == 3
    again = request("d2", 60, "tx-2")
    again.num_computed_tokens = 59
    side.update_state_after_alloc(again, [blocks(4, 5, 6, 3)], 60)
    side.build_meta()
    side.update_connector_output({"d2"}, set())
    assert side.request_finished(again, [[4, 5, 6, 3]])[0] is False  # nothing new to save: freed at once


def test_the_next_turn_loads_the_history_from_the_tier_and_registers_only_the_rest() -> None:
    side = scheduler()
    history = request("d1", 48, "tx-1")
    history.num_computed_tokens = 48
    save = served(side, history, [7, 8, 9])
    turn = request("d2", 80, "tx-2")  # the history's 3 blocks, then 2 new ones
    side.update_state_after_alloc(turn, [blocks(20, 21, 22, 23, 24)], 80)
    (command,) = side.build_meta().commands
    assert command == LoadFromTier(
        "d2",
        save.slots,
        (20, 21, 22),
        then=ExpectPush("d2", "tx-2", PREFILL, ((23, 24),), 32, cached_blocks=3),
        otherwise=ExpectPush("d2", "tx-2", PREFILL, ((20, 21, 22, 23, 24),), 80),
    )
    side.update_connector_output({"d2"}, set())
    _, params = side.request_finished(turn, [[20, 21, 22, 23, 24]])
    assert params is not None
    assert (params[RECEIVED_KEY]["blocks"], params[RECEIVED_KEY]["tier_blocks"]) == (2, 3)


def turn_after_history(side: SchedulerSide) -> FakeRequest:
    """A 50-token turn whose first block vLLM's prefix cache holds and whose second the tier holds (a
    32-token history served before), allocated: 34 external tokens, 16 of them from the tier."""
    history = request("d1", 32, "tx-1")
    history.num_computed_tokens = 32
    served(side, history, [7, 8])
    side.take_stats()
    turn = request("d2", 50, "tx-2")
    side.update_state_after_alloc(turn, [blocks(1, 20, 21, 22, cached=1)], 34)
    side.build_meta()
    return turn


def finished_after_receiving(side: SchedulerSide, turn: FakeRequest, block_ids: list[int]) -> dict[str, Any]:
    side.update_connector_output({turn.request_id}, set())
    _, params = side.request_finished(turn, [block_ids])
    assert params is not None
    return params[RECEIVED_KEY]


def test_tokens_are_counted_by_source_when_the_request_finishes() -> None:
    side = scheduler()
    turn = turn_after_history(side)
    stats = side.take_stats()
    assert stats is not None and stats.data["tokens"] == {}  # not yet: a tier load may still fail
    finished_after_receiving(side, turn, [1, 20, 21, 22])
    stats = side.take_stats()
    assert isinstance(stats, PDTransferStats)
    assert stats.data["tokens"] == {"gpu": 16, "tier": 16, "remote": 18}


def test_with_log_timeline_each_finished_request_logs_its_prompt_tokens_by_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = scheduler()
    side.config = dataclasses.replace(side.config, log_timeline=True)
    turn = turn_after_history(side)
    finished_after_receiving(side, turn, [1, 20, 21, 22])
    with caplog.at_level(logging.INFO, logger="pdconnector.vllm.scheduler"):
        side.take_stats()
    assert "request d2 prompt tokens: gpu=16 tier=16 remote=18" in caplog.messages


def test_vllm_is_told_which_external_tokens_come_from_the_tier_and_which_from_prefill() -> None:
    side = scheduler()
    turn_after_history(side)
    assert side.external_tokens("d2") == {TokenSource.TIER: 16, TokenSource.REMOTE: 18}  # sums to the 34


def test_a_tier_load_that_failed_on_a_rank_counts_its_tokens_and_blocks_as_received_from_prefill() -> None:
    side = scheduler()
    turn = turn_after_history(side)
    side.tier_failed(TierFailures(loads={"d2"}))  # that rank took every block from prefill instead
    received = finished_after_receiving(side, turn, [1, 20, 21, 22])
    assert (received["blocks"], received["tier_blocks"]) == (3, 0)
    stats = side.take_stats()
    assert isinstance(stats, PDTransferStats) and stats.data["tokens"] == {"gpu": 16, "remote": 34}


def test_a_failed_receive_counts_its_tokens_as_recomputed_or_not_at_all() -> None:
    for policy, status, counted in (
        ("recompute", FINISHED, {"gpu": 16, "computed": 34}),  # vLLM computed the prompt, then served it
        ("fail", "finished_error", {}),
    ):
        side = scheduler(failure_policy=policy)
        turn = turn_after_history(side)
        side.update_connector_output({"d2"}, {"d2"})  # the transfer failed
        turn.status = status
        side.request_finished(turn, [[1, 20, 21, 22]])
        stats = side.take_stats()
        assert stats is not None and stats.data["tokens"] == counted, policy


def test_a_request_aborted_while_receiving_counts_nothing() -> None:
    side = scheduler()
    turn = turn_after_history(side)
    turn.status = ABORTED
    assert side.request_finished(turn, [[1, 20, 21, 22]]) == (True, None)  # held until no write can land
    stats = side.take_stats()
    assert stats is not None and stats.data["tokens"] == {}


def test_a_request_the_tier_holds_entirely_takes_nothing_from_prefill_and_releases_its_copy() -> None:
    side = scheduler()
    history = request("d1", 48, "tx-1")
    history.num_computed_tokens = 48
    served(side, history, [7, 8, 9])
    same = request("d2", 48, "tx-2")
    side.update_state_after_alloc(same, [blocks(30, 31, 32)], 48)
    (command,) = side.build_meta().commands
    assert isinstance(command, LoadFromTier) and command.block_ids == (30, 31, 32)
    assert isinstance(command.then, AbandonTransfer) and command.then.transfer_id == "tx-2"


def test_blocks_are_not_read_before_every_rank_copied_them() -> None:
    side = scheduler()
    history = request("d1", 32, "tx-1")
    history.num_computed_tokens = 32
    side.update_state_after_alloc(history, [blocks(7, 8)], 32)
    side.build_meta()
    side.update_connector_output({"d1"}, set())
    assert side.request_finished(history, [[7, 8]])[0] is True
    side.build_meta()  # the save is out, not yet reported copied
    turn = request("d2", 48, "tx-2")
    side.update_state_after_alloc(turn, [blocks(20, 21, 22)], 48)
    (command,) = side.build_meta().commands
    assert isinstance(command, ExpectPush) and command.cached_blocks == 0


def test_a_pull_reads_only_the_remote_blocks_after_the_tier_run() -> None:
    side = scheduler("pull")
    history = request("d1", 32, "tx-1", transfer_mode="pull", remote_block_ids=[[1, 2]], remote_num_tokens=32)
    history.num_computed_tokens = 32
    served(side, history, [7, 8])
    turn = request("d2", 64, "tx-2", transfer_mode="pull", remote_block_ids=[[11, 12, 13, 14]])
    turn.kv_transfer_params |= {"remote_num_tokens": 64, "remote_hold_ms": 20_000}
    side.update_state_after_alloc(turn, [blocks(20, 21, 22, 23)], 64)
    (command,) = side.build_meta().commands
    assert isinstance(command, LoadFromTier) and command.block_ids == (20, 21)
    assert isinstance(command.then, ReadBlocks) and command.then.remote_block_ids == ((13, 14),)
    assert command.then.block_ids == ((22, 23),) and command.then.num_tokens == 32
    assert isinstance(command.otherwise, ReadBlocks) and command.otherwise.remote_block_ids == (
        (11, 12, 13, 14),
    )
    assert command.otherwise.transfer_id == turn.kv_transfer_params[TRANSFER_ID_KEY]


def test_hashes_finer_than_the_block_name_each_block_by_its_last_hash() -> None:
    plan = TierPlan(4, block_size=32, hash_block_size=16)
    made = FakeRequest("r", None, list(range(70)))
    made.block_hashes = ["a", "b", "c", "d"]  # type: ignore[attr-defined]
    assert plan.block_hashes(made) == ["b", "d"]


def test_a_save_that_failed_on_a_rank_is_never_read() -> None:
    side = scheduler()
    history = request("d1", 48, "tx-1")
    history.num_computed_tokens = 48
    received_and_finished(side, history, [7, 8, 9])
    # one rank's copy failed; the others' finished_sending follows
    side.tier_failed(TierFailures(saves={"d1"}))
    side.finished_sending({"d1"})
    turn = request("d2", 80, "tx-2")
    side.update_state_after_alloc(turn, [blocks(20, 21, 22, 23, 24)], 80)
    (command,) = side.build_meta().commands
    assert isinstance(command, ExpectPush) and command.cached_blocks == 0
    assert side.tier is not None and len(side.tier.index) == 0  # the slots are free again


def prefill_request(request_id: str, tokens: int, transfer_id: str) -> FakeRequest:
    """A prefill request (push) whose full blocks hash to h0, h1, ..."""
    made = FakeRequest(request_id, prefill_leg_params(TransferMode.PUSH, transfer_id), list(range(tokens)))
    made.block_hashes = [f"h{i}".encode() for i in range(tokens // BLOCK)]  # type: ignore[attr-defined]
    return made


def prefilled(side: SchedulerSide, finished: FakeRequest, block_ids: list[int]) -> SaveToTier:
    """``finished`` computed its prompt and its KV left for decode: its save, copied by every rank."""
    finished.num_computed_tokens = finished.num_prompt_tokens
    delay, _ = side.request_finished(finished, [block_ids])
    assert delay is True
    save, done = side.build_meta().commands
    assert isinstance(save, SaveToTier) and isinstance(done, PrefillDone)
    side.finished_sending({finished.request_id})
    return save


def test_prefill_saves_its_prompt_once_the_kv_left_and_loads_it_for_the_next_turn() -> None:
    side = scheduler()
    save = prefilled(side, prefill_request("p1", 50, "tx-1"), [7, 8, 9, 10])
    assert (save.block_ids, save.after_send) == ((7, 8, 9), True)  # full blocks; copied after the transfer
    side.take_stats()
    turn = prefill_request("p2", 90, "tx-2")  # the first turn's 3 blocks, then 42 new tokens
    assert side.get_num_new_matched_tokens(turn, 0) == (48, False)  # a synchronous load
    side.update_state_after_alloc(turn, [blocks(20, 21, 22, 23, 24, 25)], 48)
    (load,) = side.build_meta().commands
    assert load == LoadFromTier("p2", save.slots, (20, 21, 22))
    prefilled(side, turn, [20, 21, 22, 23, 24, 25])
    stats = side.take_stats()
    assert stats is not None and stats.data["tokens"] == {"tier": 48, "computed": 42}


def prefill_turn_loading_from_the_tier(side: SchedulerSide) -> FakeRequest:
    """A 90-token prompt whose first 48 tokens a 50-token prompt prefilled before left in the tier, allocated
    and its load staged (blocks 20-25)."""
    prefilled(side, prefill_request("p1", 50, "tx-1"), [7, 8, 9, 10])
    side.take_stats()
    turn = prefill_request("p2", 90, "tx-2")
    assert side.get_num_new_matched_tokens(turn, 0) == (48, False)
    side.update_state_after_alloc(turn, [blocks(20, 21, 22, 23, 24, 25)], 48)
    return turn


def test_a_prefill_tier_load_that_failed_counts_its_tokens_as_computed() -> None:
    side = scheduler()
    turn = prefill_turn_loading_from_the_tier(side)
    side.build_meta()
    side.tier_failed(TierFailures(loads={"p2"}))  # vLLM recomputes the blocks it reported as load errors
    prefilled(side, turn, [20, 21, 22, 23, 24, 25])
    stats = side.take_stats()
    assert stats is not None and stats.data["tokens"] == {"computed": 90}


def test_a_prefill_the_fail_policy_ended_on_its_failed_tier_load_counts_nothing() -> None:
    side = scheduler()
    turn = prefill_turn_loading_from_the_tier(side)
    side.build_meta()
    # vLLM ends the request on its load errors, then hands over the step's worker reports
    turn.status = "finished_error"
    side.request_finished(turn, [[20, 21, 22, 23, 24, 25]])
    side.tier_failed(TierFailures(loads={"p2"}))
    assert side.take_stats() is None  # nothing to count


def test_a_prefills_external_tokens_all_came_from_its_tier() -> None:
    side = scheduler()
    prefill_turn_loading_from_the_tier(side)
    assert side.external_tokens("p2") == {TokenSource.TIER: 48}


def test_prefill_loads_the_tier_run_after_its_prefix_cache_hits_and_computes_at_least_one_token() -> None:
    side = scheduler()
    save = prefilled(side, prefill_request("p1", 64, "tx-1"), [7, 8, 9, 10])
    same = prefill_request("p2", 64, "tx-2")  # every block in the tier: the last one is computed
    assert side.get_num_new_matched_tokens(same, 16) == (32, False)  # after one prefix-cache block
    side.update_state_after_alloc(same, [blocks(7, 31, 32, 33, cached=1)], 32)
    (load,) = side.build_meta().commands
    assert load == LoadFromTier("p2", save.slots[1:3], (31, 32))


def test_a_preempted_prefill_loads_its_tier_run_again_but_counts_its_tokens_once() -> None:
    side = scheduler()
    save = prefilled(side, prefill_request("p1", 64, "tx-1"), [7, 8, 9, 10])
    side.take_stats()
    again = prefill_request("p2", 64, "tx-2")
    for preemptions, block_ids in ((0, (40, 41, 42, 43)), (1, (50, 51, 52, 53))):
        again.num_preemptions = preemptions  # type: ignore[attr-defined]
        assert side.get_num_new_matched_tokens(again, 0) == (48, False)
        side.update_state_after_alloc(again, [blocks(*block_ids)], 48)
        (load,) = side.build_meta().commands
        assert load == LoadFromTier("p2", save.slots[:3], block_ids[:3])  # its blocks were freed: reloaded
    again.num_computed_tokens = 64
    side.request_finished(again, [[50, 51, 52, 53]])  # the tier holds every full block: nothing to save
    stats = side.take_stats()
    assert isinstance(stats, PDTransferStats) and stats.data["tokens"] == {"tier": 48, "computed": 16}


def test_a_prefill_request_vllm_did_not_allocate_for_loads_nothing() -> None:
    side = scheduler()
    prefilled(side, prefill_request("p1", 48, "tx-1"), [7, 8, 9])
    waiting = prefill_request("p2", 64, "tx-2")
    assert side.get_num_new_matched_tokens(waiting, 0) == (48, False)
    waiting.status = "finished_aborted"
    assert side.request_finished(waiting, [[]]) == (False, None)
    assert not any(isinstance(command, LoadFromTier) for command in side.build_meta().commands)


def test_what_the_tier_holds_is_published_as_cpu_kv_events_once_readable_and_when_evicted() -> None:
    side = scheduler(tier_slots=3)
    history = request("d1", 48, "tx-1")
    history.num_computed_tokens = 48
    received_and_finished(side, history, [7, 8, 9])
    assert side.take_events() == []  # being copied: not yet readable
    side.finished_sending({"d1"})
    stored = side.take_events()
    assert [type(event) for event in stored] == [BlockStored] * 3
    assert all(isinstance(event, BlockStored) and event.medium == "CPU" for event in stored)
    assert [event.token_ids for event in stored] == [list(range(i, i + BLOCK)) for i in (0, 16, 32)]
    other = request("d2", 16, "tx-2")  # another prompt: its block evicts the least recently used
    other.block_hashes = [b"x0"]  # type: ignore[attr-defined]
    other.num_computed_tokens = 16
    received_and_finished(side, other, [11])
    (removed,) = side.take_events()  # the conversation's last block: its first two are still a prefix
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored[2].block_hashes
    side.tier_failed(TierFailures(saves={"d2"}))
    side.finished_sending({"d2"})
    assert side.take_events() == []  # a failed save is never published


def test_eviction_takes_a_conversations_last_blocks_first_and_a_new_turn_keeps_its_history_whole() -> None:
    plan = TierPlan(4, block_size=BLOCK, hash_block_size=BLOCK)

    def save(request_id: str, *hashes: str) -> None:
        made = FakeRequest(request_id, None, list(range(len(hashes) * BLOCK)))
        made.block_hashes = [h.encode() for h in hashes]  # type: ignore[attr-defined]
        made.num_computed_tokens = made.num_tokens
        plan.save(made, list(range(len(hashes))))
        plan.saved(request_id)

    def held(*hashes: str) -> int:
        return len(plan.index.longest_prefix([h.encode() for h in hashes]))

    save("a-turn-1", "a0", "a1")
    save("b", "b0")
    save("a-turn-2", "a0", "a1", "a2")  # the history is used again: the whole conversation is the newest
    save("c", "c0")  # evicts b0, the least recently used
    assert (held("b0"), held("a0", "a1", "a2")) == (0, 3)
    save("d", "d0")  # then the conversation's last block, not its first: the rest is still a prefix
    assert held("a0", "a1", "a2") == 2
