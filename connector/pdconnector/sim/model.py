"""The mock model: deterministic KV from a prompt, and output tokens computed from the KV bytes.

KV of token i depends on every token up to i (a hash chain), like real attention state. Output tokens are a function
of the KV bytes the decoding engine actually holds, so a transfer that delivers wrong or missing bytes changes the
text, while a correct transfer gives exactly the tokens of a co-located run.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

VOCAB_SIZE = 1024
_WORD = re.compile(r"\S+")
_TOKEN_WORD = re.compile(r"^t(\d+)$")


def tokenize(text: str) -> list[int]:
    """Words to ids: ``t<N>`` words map to N (so generated text round-trips), other words to a stable hash."""
    ids = []
    for word in _WORD.findall(text):
        match = _TOKEN_WORD.match(word)
        if match and int(match.group(1)) < VOCAB_SIZE:
            ids.append(int(match.group(1)))
        else:
            ids.append(int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % VOCAB_SIZE)
    return ids


def detokenize(token_id: int) -> str:
    return f" t{token_id}"


def chat_prompt(messages: list[dict[str, object]]) -> str:
    """A fixed chat template: one ``role: content`` line per message, then the assistant's turn."""
    lines = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        lines.append(f"{message.get('role')}: {content}")
    return "\n".join([*lines, "assistant:"])


def prompt_kv(token_ids: list[int], bytes_per_token: int) -> np.ndarray:
    """KV rows, one per prompt token, ``bytes_per_token`` bytes each."""
    kv = np.empty((len(token_ids), bytes_per_token), dtype=np.uint8)
    state = b"pd-mock"
    for position, token in enumerate(token_ids):
        state = hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=32).digest()
        row = hashlib.shake_256(state).digest(bytes_per_token)
        kv[position] = np.frombuffer(row, dtype=np.uint8)
    return kv


def generate(kv: np.ndarray, count: int) -> list[int]:
    """``count`` output token ids determined by the prompt's KV bytes."""
    digest = hashlib.blake2b(np.ascontiguousarray(kv).tobytes(), digest_size=32).digest()
    return [
        int.from_bytes(hashlib.blake2b(digest + step.to_bytes(4, "little"), digest_size=4).digest(), "little") % VOCAB_SIZE for step in range(count)
    ]
