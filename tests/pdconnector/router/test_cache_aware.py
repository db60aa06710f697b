"""The cache-aware policy: prefill by work ahead less the prefix held (in its cache, then in its KV tier),
within an imbalance bound; decode by load and KV headroom, the prefix held (cache or tier) breaking ties."""

from __future__ import annotations

from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import Backend, BackendSpec
from pdconnector.router.cache_aware import CacheAwareWeights, PromptBlocks
from pdconnector.router.engine_load import parse_load
from pdconnector.router.prefix import BlockHasher, PrefixIndex
from pdconnector.router.selection import Policy, Selector

HASHER = BlockHasher(16)
PROMPT_TOKENS = list(range(160))  # ten full blocks
PROMPT = PromptBlocks(160, 16, tuple(HASHER.block_hashes(PROMPT_TOKENS)))


def engine(
    name: str, role: EngineRole, *, cached_blocks: int = 0, tier_blocks: int = 0, outstanding: int = 0
) -> Backend:
    """An engine holding the prompt's first ``cached_blocks`` in its GPU cache and the next ``tier_blocks`` in
    its KV tier."""
    backend = Backend(BackendSpec(name=name, role=role, host="127.0.0.1", http_port=8000, engine_id=name))
    backend.prefix_index = PrefixIndex(1000)
    backend.prefix_index.store(PROMPT.hashes[:cached_blocks])
    backend.tier_index = PrefixIndex(1000)
    backend.tier_index.store(PROMPT.hashes[cached_blocks : cached_blocks + tier_blocks])
    backend.outstanding = outstanding
    return backend


def pick(role: EngineRole, candidates: list[Backend], prompt: PromptBlocks | None = PROMPT, **weights) -> str:
    chosen = Selector(Policy.CACHE_AWARE, role, CacheAwareWeights(**weights)).pick(candidates, prompt)
    assert chosen is not None
    return chosen.name


def test_prefill_goes_where_the_prompts_prefix_is_cached():
    cold, warm = engine("a", EngineRole.PREFILL), engine("b", EngineRole.PREFILL, cached_blocks=6)
    assert pick(EngineRole.PREFILL, [cold, warm]) == "b"


def test_a_longer_cached_prefix_beats_a_shorter_one():
    short, long = (
        engine("a", EngineRole.PREFILL, cached_blocks=2),
        engine("b", EngineRole.PREFILL, cached_blocks=9),
    )
    assert pick(EngineRole.PREFILL, [short, long]) == "b"


def test_a_cached_prefix_is_worth_only_what_it_saves_against_queued_work():
    cold = engine("a", EngineRole.PREFILL)
    warm = engine("b", EngineRole.PREFILL, cached_blocks=6, outstanding=1)
    warm.queued_prompt_tokens = 96  # exactly what the prefix saves, so the idle engine wins the tie
    assert pick(EngineRole.PREFILL, [cold, warm]) == "a"
    warm.queued_prompt_tokens = 40
    assert pick(EngineRole.PREFILL, [cold, warm]) == "b"
    assert pick(EngineRole.PREFILL, [cold, warm], load_weight=3.0) == "a"


def test_a_prefix_in_a_prefills_tier_counts_after_its_cache_and_a_little_less():
    tiered = engine("a", EngineRole.PREFILL, cached_blocks=2, tier_blocks=6)  # saves 2 + 0.8 x 6 blocks
    assert (PROMPT.tier_tokens(tiered), PROMPT.tokens_to_compute(tiered)) == (96, 32)
    assert pick(EngineRole.PREFILL, [tiered, engine("b", EngineRole.PREFILL, cached_blocks=6)]) == "a"
    assert pick(EngineRole.PREFILL, [tiered, engine("b", EngineRole.PREFILL, cached_blocks=7)]) == "b"


def test_a_tier_run_counts_only_from_where_the_cache_ends():
    gap = engine("a", EngineRole.PREFILL, cached_blocks=0)
    assert gap.tier_index is not None
    gap.tier_index.store(PROMPT.hashes[3:9])  # blocks the engine could not load: the run starts at block 0
    assert PROMPT.tier_tokens(gap) == 0


def test_an_engine_past_the_imbalance_bound_is_not_chosen_whatever_it_holds():
    cold = engine("a", EngineRole.PREFILL)
    hot = engine("b", EngineRole.PREFILL, cached_blocks=10, outstanding=5)
    assert pick(EngineRole.PREFILL, [cold, hot], max_imbalance=4) == "a"
    assert pick(EngineRole.PREFILL, [cold, hot], max_imbalance=5) == "b"


def test_without_the_prompts_blocks_prefill_falls_back_to_the_least_work_ahead():
    busy = engine("a", EngineRole.PREFILL, cached_blocks=10)
    busy.queued_prompt_tokens = 500
    idle = engine("b", EngineRole.PREFILL)
    assert pick(EngineRole.PREFILL, [busy, idle], prompt=None) == "b"


def test_decode_goes_to_the_engine_with_fewer_sequences_then_more_kv_headroom():
    a, b = engine("a", EngineRole.DECODE), engine("b", EngineRole.DECODE)
    a.engine_sequences, b.engine_sequences = 3, 1  # other routers' requests count too
    assert pick(EngineRole.DECODE, [a, b]) == "b"
    a.engine_sequences = b.engine_sequences = 2
    a.kv_usage, b.kv_usage = 0.2, 0.7
    assert pick(EngineRole.DECODE, [a, b]) == "a"


def test_a_nearly_full_decode_is_left_out_while_another_has_room():
    full, roomy = engine("a", EngineRole.DECODE), engine("b", EngineRole.DECODE, outstanding=6)
    full.kv_usage, roomy.kv_usage = 0.97, 0.1
    assert pick(EngineRole.DECODE, [full, roomy]) == "b"
    roomy.kv_usage = 0.99
    assert pick(EngineRole.DECODE, [full, roomy]) == "a"  # all full: the least loaded


def test_between_equal_decodes_the_one_holding_the_prefix_wins():
    cold, warm = engine("a", EngineRole.DECODE), engine("b", EngineRole.DECODE, cached_blocks=8)
    assert pick(EngineRole.DECODE, [cold, warm]) == "b"
    cold.engine_sequences = 0
    warm.engine_sequences = 1  # one more sequence outweighs any prefix
    assert pick(EngineRole.DECODE, [cold, warm]) == "a"


def test_between_equal_decodes_the_one_whose_tier_holds_the_history_wins():
    cold, tiered = engine("a", EngineRole.DECODE), engine("b", EngineRole.DECODE, tier_blocks=8)
    assert pick(EngineRole.DECODE, [cold, tiered]) == "b"


def test_decode_load_is_read_from_vllms_metrics():
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0\n'
    )
    assert parse_load(text) == (0.25, 5)
    assert parse_load("") == (None, None)
