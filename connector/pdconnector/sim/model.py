"""The mock model: deterministic KV from a prompt, and output tokens computed from the KV bytes an engine
holds.

Prefill writes each block's pages as content tagged by a hash of the prompt up to the end of that block (so
blocks of a shared prefix are identical, as real KV is); the connector core's layout decides where every byte
goes. Output tokens are a hash of the K/V bytes of the prompt's tokens as read back from the engine's own
pools, so a transfer that delivers wrong or missing bytes changes the text, and a correct one gives exactly
the tokens of a co-located run.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator, Sequence

import numpy as np

from pdconnector.layout import write_tagged_blocks
from pdconnector.sim.pool import KVPool

VOCAB_SIZE = 1024
_WORD = re.compile(r"\S+")
_TOKEN_WORD = re.compile(r"^t(\d+)$")
# Prefill computes and stores this many blocks at a time, so an engine can serve other requests between
# chunks.
PREFILL_CHUNK_BLOCKS = 16


def tokenize(text: str, limit: int | None = None) -> list[int]:
    """Words to ids: ``t<N>`` words map to N (so generated text round-trips), other words to a stable hash.

    With ``limit``, stops after that many tokens: enough to refuse an over-long prompt without tokenizing all
    of it.
    """
    ids = []
    for found in itertools.islice(_WORD.finditer(text), limit):
        word = found.group()
        match = _TOKEN_WORD.match(word)
        if match and int(match.group(1)) < VOCAB_SIZE:
            ids.append(int(match.group(1)))
        else:
            ids.append(
                int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % VOCAB_SIZE
            )
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
        # 40 bits: what the layout's tagging expects
        tags.append(int.from_bytes(digest.copy().digest(), "little") >> 24)
    return tags


def prefill_chunks(pool: KVPool, blocks: Sequence[int], tokens: Sequence[int]) -> Iterator[None]:
    """Compute the prompt's KV into ``blocks`` on every TP rank, :data:`PREFILL_CHUNK_BLOCKS` blocks per step.

    The pages are computed on the host, as if each chunk were blocks 0..n-1 of a pool of their own, then
    stored wherever the pool lives (host or GPU); the mock model's pages are written whole, so nothing else is
    lost. A block's content depends only on its tag, so chunks write exactly the bytes one pass would.
    """
    tags = block_tags(tokens, pool.block_size)
    for start in range(0, len(blocks), PREFILL_CHUNK_BLOCKS):
        chunk = blocks[start : start + PREFILL_CHUNK_BLOCKS]
        staged = list(range(len(chunk)))
        chunk_tokens = min(len(tokens) - start * pool.block_size, len(chunk) * pool.block_size)
        for rank, layout in enumerate(pool.layouts):
            pages = [np.zeros((len(chunk), layout.page_bytes), dtype=np.uint8) for _ in layout.regions]
            write_tagged_blocks(
                layout, pages, [staged], [tags[start : start + len(chunk)]], num_tokens=chunk_tokens
            )
            for region, region_pages in enumerate(pages):
                pool.write_pages(rank, region, chunk, region_pages)
        yield


def prefill(pool: KVPool, blocks: Sequence[int], tokens: Sequence[int]) -> None:
    """Compute the prompt's KV into ``blocks`` in one go (see :func:`prefill_chunks`)."""
    for _ in prefill_chunks(pool, blocks, tokens):
        pass


def output_tokens(kv: bytes) -> Iterator[int]:
    """The output token ids determined by the prompt's KV bytes, one per step (2**32 of them): callers take
    what they need."""
    digest = kv_digest(kv)
    for step in range(1 << 32):
        yield token_at(digest, step)


def kv_digest(kv: bytes) -> bytes:
    return hashlib.blake2b(kv, digest_size=32).digest()


def token_at(digest: bytes, step: int) -> int:
    """Output token ``step`` of a prompt whose KV bytes hash to ``digest`` (:func:`kv_digest`)."""
    return (
        int.from_bytes(hashlib.blake2b(digest + step.to_bytes(4, "little"), digest_size=4).digest(), "little")
        % VOCAB_SIZE
    )


def generate(kv: bytes, count: int) -> list[int]:
    """The first ``count`` output token ids determined by the prompt's KV bytes."""
    return list(itertools.islice(output_tokens(kv), count))


def reference_tokens(tokens: Sequence[int], count: int, block_size: int = 16) -> list[int]:
    """What any correct engine answers for this prompt (computed in a scratch pool, as a co-located engine
    would)."""
    pool = KVPool(num_blocks=-(-len(tokens) // block_size), block_size=block_size)
    blocks = pool.allocate(len(tokens))
    prefill(pool, blocks, tokens)
    return generate(pool.token_bytes(blocks, len(tokens)), count)
