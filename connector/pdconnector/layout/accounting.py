"""Transfer volume of one request: naive whole-page transfer vs what the planner moves.

Naive moves every logical page the request holds: whole logical attention blocks (the last
one mostly empty when the block size is large, as it is for hybrids) and whole SSM pages
including the HMA padding. Optimal moves the kernel blocks that hold tokens and the real
conv + temporal bytes. SSM state is one block per SSM layer whatever the prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdconnector.layout.model import KVModel
from pdconnector.layout.regions import RankLayout

DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class TransferVolume:
    """Bytes one request moves from a whole prefill engine to a whole decode engine."""

    num_tokens: int
    attention_naive: int
    attention_optimal: int
    ssm_naive: int
    ssm_optimal: int

    @property
    def naive(self) -> int:
        return self.attention_naive + self.ssm_naive

    @property
    def optimal(self) -> int:
        return self.attention_optimal + self.ssm_optimal

    @property
    def saved(self) -> int:
        return self.naive - self.optimal

    @property
    def saved_fraction(self) -> float:
        return self.saved / self.naive if self.naive else 0.0


def transfer_volume(model: KVModel, num_tokens: int, *, tp_size: int = 1) -> TransferVolume:
    """Engine-wide bytes for a ``num_tokens`` prompt (all TP ranks of the receiving engine)."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    rank = RankLayout(model, tp_size, 0, num_blocks=1)
    logical_blocks = -(-num_tokens // model.block_size)
    kernel_blocks = -(-num_tokens // model.kernel_block_size)
    attention_layers, ssm_layers = model.num_attention_layers * tp_size, model.num_ssm_layers * tp_size
    return TransferVolume(
        num_tokens=num_tokens,
        attention_naive=attention_layers * logical_blocks * rank.attention_page_bytes,
        attention_optimal=attention_layers * kernel_blocks * rank.physical_page_bytes,
        ssm_naive=ssm_layers * rank.page_bytes if ssm_layers else 0,
        ssm_optimal=ssm_layers * rank.ssm_state_bytes,
    )


def transfer_volume_table(
    model: KVModel, lengths: Sequence[int] = DEFAULT_LENGTHS, *, tp_size: int = 1
) -> list[TransferVolume]:
    """The seed's analysis: transfer volume against prompt length, naive vs optimal."""
    return [transfer_volume(model, n, tp_size=tp_size) for n in lengths]


def format_volume_table(rows: Sequence[TransferVolume]) -> str:
    """A plain-text table of :func:`transfer_volume_table` rows, sizes in MiB."""
    mib = 1 << 20
    lines = [
        f"{'tokens':>7} {'attn naive':>11} {'attn opt':>9} {'ssm naive':>10} {'ssm opt':>8} {'naive':>9} "
        f"{'optimal':>9} {'saved':>7}"
    ]
    lines.extend(
        f"{r.num_tokens:>7} {r.attention_naive / mib:>11.2f} {r.attention_optimal / mib:>9.2f} "
        f"{r.ssm_naive / mib:>10.2f} "
        f"{r.ssm_optimal / mib:>8.2f} {r.naive / mib:>9.2f} {r.optimal / mib:>9.2f} "
        f"{100 * r.saved_fraction:>6.2f}%"
        for r in rows
    )
    return "\n".join(lines)
