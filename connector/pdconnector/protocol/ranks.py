"""Which prefill TP rank writes into which decode TP rank.

One of the two TP sizes must divide the other. When decode has more ranks,
each prefill rank serves ``d_tp // p_tp`` consecutive decode ranks (each takes
its slice of the heads); when prefill has more, each decode rank is filled by
``p_tp // d_tp`` consecutive prefill ranks (each writes its chunk). Both sides
derive the pairing from these functions, so a registration reaches exactly
the prefill ranks that will write it and decode counts exactly their
completions. Pipeline parallelism is not modelled (PP = 1 on both sides).
"""

from __future__ import annotations


def check_tp_sizes(p_tp: int, d_tp: int) -> None:
    """Raise ``ValueError`` unless both sizes are positive and one divides the other."""
    if p_tp < 1 or d_tp < 1:
        raise ValueError(f"TP sizes must be positive, got prefill {p_tp} and decode {d_tp}")
    if p_tp % d_tp and d_tp % p_tp:
        raise ValueError(f"prefill TP {p_tp} and decode TP {d_tp}: one must divide the other")


def _check_rank(rank: int, size: int, side: str) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"{side} rank {rank} outside TP size {size}")


def expected_writers(p_tp: int, d_tp: int) -> int:
    """How many prefill ranks write into each decode rank (= completions a decode rank waits for)."""
    check_tp_sizes(p_tp, d_tp)
    return max(1, p_tp // d_tp)


def prefill_ranks_writing_to(d_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """The prefill ranks whose completions decode rank ``d_rank`` waits for (and sends its registration to)."""
    check_tp_sizes(p_tp, d_tp)
    _check_rank(d_rank, d_tp, "decode")
    if p_tp >= d_tp:
        fan_in = p_tp // d_tp
        return tuple(range(d_rank * fan_in, (d_rank + 1) * fan_in))
    return (d_rank // (d_tp // p_tp),)


def decode_ranks_written_by(p_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """The decode ranks prefill rank ``p_rank`` writes (and so expects registrations from)."""
    check_tp_sizes(p_tp, d_tp)
    _check_rank(p_rank, p_tp, "prefill")
    if d_tp >= p_tp:
        fan_out = d_tp // p_tp
        return tuple(range(p_rank * fan_out, (p_rank + 1) * fan_out))
    return (p_rank // (p_tp // d_tp),)
