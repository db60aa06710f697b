"""The mock model: deterministic, prefix-consistent KV; output tokens that depend on every KV byte of the
prompt."""

from __future__ import annotations

from pdconnector.sim.model import (
    VOCAB_SIZE,
    block_tags,
    chat_prompt,
    detokenize,
    generate,
    prefill,
    reference_tokens,
    tokenize,
)
from pdconnector.sim.pool import KVPool


def test_generated_text_round_trips_through_the_tokenizer():
    ids = [5, 1023, 0, 77]
    assert tokenize("".join(detokenize(t) for t in ids)) == ids


def test_other_words_map_to_stable_ids_in_the_vocabulary():
    assert tokenize("hello world") == tokenize("hello   world")
    assert all(0 <= t < VOCAB_SIZE for t in tokenize("hello world t99999"))


def test_block_tags_depend_on_the_whole_prefix():
    tokens = list(range(40))
    assert block_tags(tokens[:32], 16) == block_tags(tokens, 16)[:2]
    assert block_tags([99, *tokens[1:]], 16)[2] != block_tags(tokens, 16)[2]


def test_output_depends_on_every_prompt_token():
    tokens = list(range(20))
    assert reference_tokens(tokens, 6) == reference_tokens(list(tokens), 6)
    assert reference_tokens(tokens, 6) != reference_tokens([*tokens[:-1], 999], 6)


def test_a_single_flipped_kv_byte_changes_the_output():
    pool = KVPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(20)
    prefill(pool, blocks, list(range(20)))
    before = generate(pool.token_bytes(blocks, 20), 8)
    page = pool.read_pages(0, 1, [blocks[1]])  # the second block, layer 1
    page[0, 0] ^= 1
    pool.write_pages(0, 1, [blocks[1]], page)
    assert generate(pool.token_bytes(blocks, 20), 8) != before


def test_chat_template_is_fixed():
    assert chat_prompt(
        [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        ]
    ) == ("user: hi\nsystem: be brief\nassistant:")
