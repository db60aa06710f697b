"""The mock model: deterministic KV from a prompt, and output tokens computed from the KV bytes an engine holds.

Prefill writes each block's pages as content tagged by a hash of the prompt up to the end of that block (so blocks of
a shared prefix are identical, as real KV is); the connector core's layout decides where every byte goes. Output
tokens are a hash of the K/V bytes of the prompt's tokens as read back from the engine's own pools, so a transfer
that delivers wrong or missing bytes changes the text, and a correct one gives exactly the tokens of a co-located run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from pdconnector.layout import write_tagged_blocks
from pdconnector.sim.pool import KVPool

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


def block_tags(tokens: Sequence[int], block_size: int) -> list[int]:
    """One tag per block: a hash of the prompt up to the end of that block."""
    tags = []
    digest = hashlib.blake2b(digest_size=8)
    for start in range(0, len(tokens), block_size):
        for token in tokens[start : start + block_size]:
            digest.update(token.to_bytes(4, "little"))
        tags.append(int.from_bytes(digest.copy().digest(), "little") >> 24)  # 40 bits: what the layout's tagging expects
    return tags


def prefill(pool: KVPool, blocks: Sequence[int], tokens: Sequence[int]) -> None:
    """Compute the prompt's KV into ``blocks`` on every TP rank.

    The pages are computed on the host, as if ``blocks`` were blocks 0..n-1 of a pool of their own, then stored
    wherever the pool lives (host or GPU); the mock model's pages are written whole, so nothing else is lost.
    """
    tags = block_tags(tokens, pool.block_size)
    staged = list(range(len(blocks)))
    for rank, layout in enumerate(pool.layouts):
        pages = [np.zeros((len(blocks), layout.page_bytes), dtype=np.uint8) for _ in layout.regions]
        write_tagged_blocks(layout, pages, [staged], [tags], num_tokens=len(tokens))
        for region, region_pages in enumerate(pages):
            pool.write_pages(rank, region, blocks, region_pages)


def generate(kv: bytes, count: int) -> list[int]:
    """``count`` output token ids determined by the prompt's KV bytes."""
    digest = hashlib.blake2b(kv, digest_size=32).digest()
    return [
        int.from_bytes(hashlib.blake2b(digest + step.to_bytes(4, "little"), digest_size=4).digest(), "little") % VOCAB_SIZE for step in range(count)
    ]


def reference_tokens(tokens: Sequence[int], count: int, block_size: int = 16) -> list[int]:
    """What any correct engine answers for this prompt (computed in a scratch pool, as a co-located engine would)."""
    pool = KVPool(num_blocks=-(-len(tokens) // block_size), block_size=block_size)
    blocks = pool.allocate(len(tokens))
    prefill(pool, blocks, tokens)
    return generate(pool.token_bytes(blocks, len(tokens)), count)
