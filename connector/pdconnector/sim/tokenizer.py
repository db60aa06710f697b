"""A word-level tokenizer over ``t0 .. t{vocab-1}``: the mock model's words, and a real tokenizer for tiny
vLLM models.

Real clients (``vllm bench serve``, the OpenAI SDK) need a Hugging Face tokenizer directory. With one word per
token id, random token prompts round-trip exactly through text, so a benchmark's input lengths are exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DEFAULT_VOCAB_SIZE = 1024


def word(token_id: int) -> str:
    """The word of a token id (``t<id>``)."""
    return f"t{token_id}"


def words(token_ids: Sequence[int]) -> str:
    """A text prompt the word-level tokenizer encodes to exactly ``token_ids``."""
    return " ".join(word(i) for i in token_ids)


def write_word_tokenizer(
    directory: Path, vocab_size: int = DEFAULT_VOCAB_SIZE, model_max_length: int = 4096
) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415 - a dev/engine dependency, not the router's

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab={word(i): i for i in range(vocab_size)}, unk_token=word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    # No special tokens: an added token such as "t1" would also match inside "t10" and split it.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
