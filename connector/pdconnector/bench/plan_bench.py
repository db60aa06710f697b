"""Plan-building cost and descriptor counts for realistic requests, and the seed's volume table.

Run: ``python -m pdconnector.bench.plan_bench [--repeat N] [--quick]``.

Models: a Qwen3-32B-like dense model (64 attention layers, 8 KV heads x 128, bf16) and a
Nemotron-H-like hybrid with 64 attention + 64 Mamba2 layers (128 heads x 80, 8 groups,
state 128, float32 SSM cache). For each prompt length, kernel block size and TP pair it
times :func:`plan_transfer` for every decode rank one prefill rank writes into (merged and
unmerged) and the prepared-list alternative (:func:`descriptor_ids`), with block ids either
contiguous (a fresh pool) or shuffled (a fragmented one).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdconnector.layout import (
    AttentionSpec,
    KVModel,
    LayerKind,
    RankLayout,
    SsmSpec,
    descriptor_ids,
    format_volume_table,
    hybrid_block_size,
    model_from_hf_config,
    plan_transfer,
    targets_for,
    transfer_volume_table,
)
from pdconnector.layout.known_models import NEMOTRON_NANO_9B_V2

ATTENTION = AttentionSpec(num_kv_heads=8, head_dim=128, dtype_bytes=2)
MAMBA2 = SsmSpec.mamba2(
    num_heads=128,
    head_dim=80,
    n_groups=8,
    state_size=128,
    conv_kernel=4,
    conv_dtype_bytes=2,
    state_dtype_bytes=4,
)


def dense(block_size: int) -> KVModel:
    return KVModel((LayerKind.ATTENTION,) * 64, block_size, ATTENTION)


def hybrid(kernel_block_size: int) -> KVModel:
    # vLLM aligns the hybrid's logical block to the kernel alignment (128 here, so 16/64/128 kernels all
    # divide it).
    block = hybrid_block_size(ATTENTION, MAMBA2, kernel_alignment=128)
    return KVModel((LayerKind.SSM, LayerKind.ATTENTION) * 64, block, ATTENTION, MAMBA2, kernel_block_size)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: KVModel
    tokens: int
    p_tp: int = 1
    d_tp: int = 1
    shuffled: bool = False


@dataclass(frozen=True)
class Row:
    model: str
    tokens: int
    block: str
    tp: str
    ids: str
    descs_unmerged: int
    descs_merged: int
    mib: float
    ms_merged: float
    ms_unmerged: float
    ms_prepared_ids: float


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def _request_blocks(
    layout: RankLayout, tokens: int, shuffled: bool, rng: np.random.Generator
) -> list[list[int]]:
    """Block ids per KV group for one request: enough attention blocks for ``tokens``, one SSM block per
    group."""
    counts = [
        -(-tokens // layout.model.block_size) if g.kind is LayerKind.ATTENTION else 1 for g in layout.groups
    ]
    pool = rng.permutation(layout.num_blocks) if shuffled else np.arange(layout.num_blocks)
    bounds = np.cumsum([0, *counts])
    return [pool[a:b].tolist() for a, b in itertools.pairwise(bounds.tolist())]


def measure(scenario: Scenario, repeat: int) -> Row:
    model, tokens, p_tp, d_tp, shuffled = (
        scenario.model,
        scenario.tokens,
        scenario.p_tp,
        scenario.d_tp,
        scenario.shuffled,
    )
    rng = np.random.default_rng(tokens)
    num_blocks = 4 * -(-tokens // model.block_size) + 64
    src = RankLayout(model, p_tp, 0, num_blocks)
    dsts = [RankLayout(model, d_tp, d, num_blocks) for d in targets_for(0, p_tp, d_tp)]
    src_blocks, dst_blocks = (
        _request_blocks(src, tokens, shuffled, rng),
        _request_blocks(src, tokens, shuffled, rng),
    )

    def plans(merge: bool) -> list:
        return [
            plan_transfer(src, dst, src_blocks, dst_blocks, num_tokens=tokens, merge=merge) for dst in dsts
        ]

    def prepared() -> list:
        return [descriptor_ids(src, dst, src_blocks, dst_blocks, num_tokens=tokens) for dst in dsts]

    merged, unmerged = plans(True), plans(False)
    block = f"{model.block_size}/{model.kernel_block_size}"
    return Row(
        model=scenario.name,
        tokens=tokens,
        block=block,
        tp=f"{p_tp}->{d_tp}",
        ids="shuffled" if shuffled else "contig",
        descs_unmerged=sum(len(p) for p in unmerged),
        descs_merged=sum(len(p) for p in merged),
        mib=sum(p.nbytes for p in merged) / (1 << 20),
        ms_merged=_median_ms(lambda: plans(True), repeat),
        ms_unmerged=_median_ms(lambda: plans(False), repeat),
        ms_prepared_ids=_median_ms(prepared, repeat),
    )


def format_rows(rows: Sequence[Row]) -> str:
    head = (
        f"{'model':<7} {'tokens':>6} {'blk/kern':>9} {'TP P->D':>7} {'ids':>8} {'descs':>8} {'merged':>7} "
        f"{'MiB':>8} "
        f"{'plan ms':>8} {'unmerged ms':>11} {'prep-ids ms':>11}"
    )
    lines = [head, "-" * len(head)]
    lines.extend(
        f"{r.model:<7} {r.tokens:>6} {r.block:>9} {r.tp:>7} {r.ids:>8} {r.descs_unmerged:>8} "
        f"{r.descs_merged:>7} {r.mib:>8.1f} "
        f"{r.ms_merged:>8.2f} {r.ms_unmerged:>11.2f} {r.ms_prepared_ids:>11.2f}"
        for r in rows
    )
    return "\n".join(lines)


def scenarios(quick: bool) -> list[Scenario]:
    lengths = (1024, 16384) if quick else (1024, 4096, 16384)
    out = []
    for tokens in lengths:
        for block in (16, 64, 128):
            out.extend(
                Scenario("dense", dense(block), tokens, shuffled=shuffled) for shuffled in (False, True)
            )
            out.append(Scenario("hybrid", hybrid(block), tokens))
        for p_tp, d_tp in ((2, 4), (4, 2)):
            out.append(Scenario("dense", dense(16), tokens, p_tp, d_tp))
            out.append(Scenario("hybrid", hybrid(16), tokens, p_tp, d_tp))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per row (median reported)")
    parser.add_argument("--quick", action="store_true", help="fewer prompt lengths")
    args = parser.parse_args(argv)
    rows = [measure(scenario, args.repeat) for scenario in scenarios(args.quick)]
    print(
        "Plan building per request for one prefill rank (all decode ranks it writes into); block ids per "
        "group as vLLM allocates them"
    )
    print(format_rows(rows))
    nemotron = model_from_hf_config(NEMOTRON_NANO_9B_V2, kernel_block_size=32)
    print()
    print(
        f"Transfer volume per request, Nemotron-Nano-9B-v2 (block {nemotron.block_size}, kernel block 32), "
        "MiB, engine-wide"
    )
    print(format_volume_table(transfer_volume_table(nemotron)))


if __name__ == "__main__":
    main()
