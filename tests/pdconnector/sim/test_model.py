"""The mock model: deterministic, prefix-consistent KV; output tokens that depend on every KV byte."""

from __future__ import annotations

from pdconnector.sim.model import VOCAB_SIZE, chat_prompt, detokenize, generate, prompt_kv, tokenize


def test_generated_text_round_trips_through_the_tokenizer():
    ids = [5, 1023, 0, 77]
    assert tokenize("".join(detokenize(t) for t in ids)) == ids


def test_other_words_map_to_stable_ids_in_the_vocabulary():
    assert tokenize("hello world") == tokenize("hello   world")
    assert all(0 <= t < VOCAB_SIZE for t in tokenize("hello world t99999"))


def test_kv_of_a_prefix_is_the_prefix_of_the_kv():
    tokens = [3, 1, 4, 1, 5, 9]
    assert (prompt_kv(tokens[:4], 32) == prompt_kv(tokens, 32)[:4]).all()
    assert not (prompt_kv([2, *tokens[1:]], 32)[1:] == prompt_kv(tokens, 32)[1:]).all()


def test_generation_is_deterministic_and_changes_with_a_single_flipped_kv_byte():
    kv = prompt_kv([10, 20, 30], 64)
    assert generate(kv, 8) == generate(kv.copy(), 8)
    corrupted = kv.copy()
    corrupted[2, 63] ^= 1
    assert generate(corrupted, 8) != generate(kv, 8)


def test_chat_template_is_fixed():
    assert chat_prompt([{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "be brief"}]}]) == (
        "user: hi\nsystem: be brief\nassistant:"
    )
