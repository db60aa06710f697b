"""Each served request's prompt tokens by source: planned at allocation, moved by what failed, counted once
after it finished."""

from pdconnector.vllm.prompt_tokens import PromptTokens
from pdconnector.vllm.stats import TokenSource

GPU, TIER, REMOTE, COMPUTED = TokenSource.GPU, TokenSource.TIER, TokenSource.REMOTE, TokenSource.COMPUTED


def test_a_finished_request_is_counted_once_with_its_plan() -> None:
    tokens = PromptTokens()
    tokens.plan("r", {GPU: 16, TIER: 32, REMOTE: 20})
    assert tokens.take() == {}  # still running
    tokens.finished("r", served=True)
    assert tokens.take() == {"r": {GPU: 16, TIER: 32, REMOTE: 20}}
    assert tokens.take() == {}


def test_vllm_hears_only_the_external_sources_of_the_plan() -> None:
    tokens = PromptTokens()
    tokens.plan("r", {GPU: 16, TIER: 32, REMOTE: 0})
    assert tokens.external("r") == {TIER: 32}
    assert tokens.external("unknown") == {}


def test_a_request_planned_again_after_preemption_counts_its_last_plan_only() -> None:
    tokens = PromptTokens()
    tokens.plan("r", {TIER: 48, COMPUTED: 16})
    tokens.plan("r", {GPU: 16, TIER: 32, COMPUTED: 16})
    tokens.finished("r", served=True)
    assert tokens.take() == {"r": {GPU: 16, TIER: 32, COMPUTED: 16}}


def test_a_failure_reported_after_the_request_finished_still_moves_its_tokens() -> None:
    tokens = PromptTokens()
    tokens.plan("r", {TIER: 48, COMPUTED: 42})
    # vLLM frees a step's finished requests before the step's worker reports reach the connector
    tokens.finished("r", served=True)
    tokens.moved("r", (TIER,), COMPUTED)
    assert tokens.take() == {"r": {COMPUTED: 90}}


def test_a_request_that_was_not_served_counts_nothing() -> None:
    tokens = PromptTokens()
    tokens.plan("r", {GPU: 16, REMOTE: 34})
    tokens.finished("r", served=False)  # aborted, or failed
    assert tokens.take() == {}
    assert tokens.external("r") == {}


def test_a_move_for_a_request_never_planned_is_ignored() -> None:
    tokens = PromptTokens()
    tokens.moved("gone", (TIER,), REMOTE)
    tokens.finished("gone", served=True)
    assert tokens.take() == {}
