"""What a model keeps per token (attention) and per request (SSM state), independent of TP.

Every per-block state is described as an ordered list of *segments*: contiguous byte runs
of one page, each sharded by tensor parallelism along its outermost axis. A segment is
``(units, unit_bytes)``: ``units`` things (KV heads, Mamba heads, B/C groups, conv
channels) of ``unit_bytes`` each; a rank of a TP-``t`` engine holds ``units / t`` of them.
Each layout vLLM uses (packed or split K/V, head- or token-major pages, conv state DS or
SD) reduces to such a list, so one planner serves all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


class AttentionLayout(StrEnum):
    """Byte order inside one attention page of ``tokens`` tokens.

    ``PACKED_HND`` is what vLLM 0.32 allocates (``KVCacheLayout.LBHNC``, the only layout of
    the CPU backend and the default elsewhere): ``[heads, tokens, K||V]``, K and V packed in
    the innermost axis, so a head slice of a block is one contiguous run.
    The others are the older layouts, kept because prefill and decode may run different
    builds: ``PACKED_NHD`` is ``LBNHC`` (``[tokens, heads, K||V]``), ``SPLIT_NHD`` the legacy
    FlashAttention ``[num_blocks, 2, block_size, heads, head_dim]``, ``SPLIT_HND`` the legacy
    head-major ``[num_blocks, 2, heads, block_size, head_dim]``. Layouts that keep K and V in
    two separate tensors (``[2, num_blocks, ...]``) are not modelled: they register two regions
    per layer.
    """

    PACKED_HND = "packed_hnd"
    PACKED_NHD = "packed_nhd"
    SPLIT_NHD = "split_nhd"
    SPLIT_HND = "split_hnd"


class SsmFamily(StrEnum):
    MAMBA2 = "mamba2"
    MAMBA1 = "mamba1"
    GDN = "gdn"


class ConvLayout(StrEnum):
    """Conv state order per block: ``DS`` = ``(dim, kernel-1)`` (each sub-projection's TP shard
    contiguous; what ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` selects), ``SD`` = ``(kernel-1, dim)``."""

    DS = "DS"
    SD = "SD"


class LayerKind(StrEnum):
    ATTENTION = "attention"
    SSM = "ssm"


@dataclass(frozen=True)
class Segment:
    """``units`` TP-shardable things of ``unit_bytes`` bytes each, stored contiguously."""

    units: int
    unit_bytes: int

    @property
    def nbytes(self) -> int:
        return self.units * self.unit_bytes


@dataclass(frozen=True)
class AttentionSpec:
    """Full attention, identical for every attention layer (GQA: ``num_kv_heads`` is the total)."""

    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    layout: AttentionLayout = AttentionLayout.PACKED_HND

    def __post_init__(self) -> None:
        _require_positive(self, "num_kv_heads", "head_dim", "dtype_bytes")

    @property
    def bytes_per_token(self) -> int:
        """K and V of all heads for one token (whole engine, before TP)."""
        return self.num_kv_heads * 2 * self.head_dim * self.dtype_bytes

    def segments(self, tokens: int) -> tuple[Segment, ...]:
        """The segments of one page holding ``tokens`` tokens; units are KV heads."""
        heads, dim, size = self.num_kv_heads, self.head_dim, self.dtype_bytes
        match self.layout:
            case AttentionLayout.PACKED_HND:
                return (Segment(heads, tokens * 2 * dim * size),)
            case AttentionLayout.PACKED_NHD:
                return tuple(Segment(heads, 2 * dim * size) for _ in range(tokens))
            case AttentionLayout.SPLIT_NHD:
                return tuple(Segment(heads, dim * size) for _ in range(2 * tokens))
            case AttentionLayout.SPLIT_HND:
                return (Segment(heads, tokens * dim * size), Segment(heads, tokens * dim * size))


@dataclass(frozen=True)
class ConvProjection:
    """One conv sub-projection (x, B, C / Q, K, V): ``units`` shardable groups of ``unit_dim`` channels."""

    name: str
    units: int
    unit_dim: int

    @property
    def dim(self) -> int:
        return self.units * self.unit_dim


@dataclass(frozen=True)
class SsmSpec:
    """The recurrent state of one SSM layer: conv state (sub-projections) then temporal state.

    ``state_shape`` is the global temporal state shape; its first axis is the TP-sharded one
    (Mamba2: heads x head_dim x state; GDN: v_heads x v_dim x k_dim; Mamba1: channels x state).
    """

    family: SsmFamily
    projections: tuple[ConvProjection, ...]
    conv_kernel: int
    state_shape: tuple[int, ...]
    conv_dtype_bytes: int
    state_dtype_bytes: int
    conv_layout: ConvLayout = ConvLayout.DS

    def __post_init__(self) -> None:
        _require_positive(self, "conv_dtype_bytes", "state_dtype_bytes")
        if self.conv_kernel < 2:
            raise ValueError(f"SsmSpec.conv_kernel must be >= 2, got {self.conv_kernel}")
        if not self.projections or any(p.units <= 0 or p.unit_dim <= 0 for p in self.projections):
            raise ValueError(
                f"SsmSpec.projections must be non-empty with positive sizes, got {self.projections}"
            )
        if not self.state_shape or any(d <= 0 for d in self.state_shape):
            raise ValueError(f"SsmSpec.state_shape must be non-empty and positive, got {self.state_shape}")

    @classmethod
    def mamba2(
        cls,
        *,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        conv_dtype_bytes: int,
        state_dtype_bytes: int,
        conv_layout: ConvLayout = ConvLayout.DS,
    ) -> SsmSpec:
        projections = (
            ConvProjection("x", num_heads, head_dim),
            ConvProjection("B", n_groups, state_size),
            ConvProjection("C", n_groups, state_size),
        )
        return cls(
            SsmFamily.MAMBA2,
            projections,
            conv_kernel,
            (num_heads, head_dim, state_size),
            conv_dtype_bytes,
            state_dtype_bytes,
            conv_layout,
        )

    @classmethod
    def mamba1(
        cls,
        *,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        conv_dtype_bytes: int,
        state_dtype_bytes: int,
        conv_layout: ConvLayout = ConvLayout.DS,
    ) -> SsmSpec:
        projections = (ConvProjection("x", intermediate_size, 1),)
        return cls(
            SsmFamily.MAMBA1,
            projections,
            conv_kernel,
            (intermediate_size, state_size),
            conv_dtype_bytes,
            state_dtype_bytes,
            conv_layout,
        )

    @classmethod
    def gdn(
        cls,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        conv_dtype_bytes: int,
        state_dtype_bytes: int,
        conv_layout: ConvLayout = ConvLayout.DS,
    ) -> SsmSpec:
        projections = (
            ConvProjection("Q", num_k_heads, head_k_dim),
            ConvProjection("K", num_k_heads, head_k_dim),
            ConvProjection("V", num_v_heads, head_v_dim),
        )
        return cls(
            SsmFamily.GDN,
            projections,
            conv_kernel,
            (num_v_heads, head_v_dim, head_k_dim),
            conv_dtype_bytes,
            state_dtype_bytes,
            conv_layout,
        )

    @property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1

    @property
    def conv_segments(self) -> tuple[Segment, ...]:
        rows, size = self.conv_rows, self.conv_dtype_bytes
        if self.conv_layout is ConvLayout.DS:
            return tuple(Segment(p.units, p.unit_dim * rows * size) for p in self.projections)
        # SD interleaves the sub-projections in every row, so a TP shard is one run per row per
        # sub-projection.
        return tuple(Segment(p.units, p.unit_dim * size) for _ in range(rows) for p in self.projections)

    @property
    def temporal_segment(self) -> Segment:
        inner = 1
        for d in self.state_shape[1:]:
            inner *= d
        return Segment(self.state_shape[0], inner * self.state_dtype_bytes)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return (*self.conv_segments, self.temporal_segment)

    @property
    def shard_units(self) -> dict[str, int]:
        """Every count TP must divide, by name (for error messages)."""
        units = {f"conv projection {p.name} units": p.units for p in self.projections}
        units["temporal state axis 0"] = self.state_shape[0]
        return units


@dataclass(frozen=True)
class KVModel:
    """The KV-holding layers of a model in order, their specs and vLLM's block sizes.

    ``block_size`` is vLLM's (logical) ``cache_config.block_size`` in tokens: the unit the block
    manager allocates, one page per layer. ``kernel_block_size`` is the attention kernel's
    (physical) block; a logical block holds ``block_size // kernel_block_size`` physical ones.
    """

    layers: tuple[LayerKind, ...]
    block_size: int
    attention: AttentionSpec | None = None
    ssm: SsmSpec | None = None
    kernel_block_size: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("KVModel.layers must name at least one KV-holding layer")
        if self.kernel_block_size == 0:
            object.__setattr__(self, "kernel_block_size", self.block_size)
        _require_positive(self, "block_size", "kernel_block_size")
        if self.block_size % self.kernel_block_size:
            raise ValueError(
                f"KVModel.kernel_block_size {self.kernel_block_size} must divide block_size {self.block_size}"
            )
        if self.num_attention_layers and self.attention is None:
            raise ValueError("KVModel.attention is required: the model has attention layers")
        if self.num_ssm_layers and self.ssm is None:
            raise ValueError("KVModel.ssm is required: the model has SSM layers")

    @cached_property
    def num_attention_layers(self) -> int:
        return sum(kind is LayerKind.ATTENTION for kind in self.layers)

    @cached_property
    def num_ssm_layers(self) -> int:
        return sum(kind is LayerKind.SSM for kind in self.layers)

    @property
    def physical_blocks_per_logical(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def is_hybrid(self) -> bool:
        return bool(self.num_attention_layers and self.num_ssm_layers)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank of a TP-``tp_size`` engine holds (vLLM's rule): its share, or one replicated head
    once TP exceeds the head count."""
    return max(1, num_kv_heads // tp_size)


def hybrid_block_size(
    attention: AttentionSpec,
    ssm: SsmSpec,
    *,
    kernel_alignment: int,
    min_block_size: int = 16,
    tp_size: int = 1,
) -> int:
    """vLLM's logical block size for a hybrid model on a TP-``tp_size`` engine: the smallest multiple of the
    kernel alignment whose attention page is at least the SSM page of one rank (vLLM then pads the SSM page).

    Both pages shrink by the same factor under TP while KV heads split; once ranks replicate KV heads (TP
    above the KV head count) the attention page stops shrinking and the block size falls with TP.
    """
    alignment = max(kernel_alignment, min_block_size)
    ssm_bytes = sum(s.units // tp_size * s.unit_bytes for s in ssm.segments)
    heads = attention.num_kv_heads
    attention_bytes = attention.bytes_per_token // heads * kv_heads_per_rank(heads, tp_size)
    return alignment * -(-ssm_bytes // (alignment * attention_bytes))


def model_from_hf_config(
    config: Mapping[str, Any],
    *,
    dtype_bytes: int | None = None,
    ssm_conv_dtype_bytes: int | None = None,
    ssm_state_dtype_bytes: int | None = None,
    block_size: int | None = None,
    kernel_block_size: int | None = None,
    kernel_alignment: int = 16,
    attention_layout: AttentionLayout = AttentionLayout.PACKED_HND,
    conv_layout: ConvLayout = ConvLayout.DS,
    tp_size: int = 1,
) -> KVModel:
    """Build a :class:`KVModel` from an HF ``config.json`` dict.

    Understands NemotronH (``hybrid_override_pattern``: ``M`` Mamba2, ``*`` attention),
    Qwen3-Next style GDN hybrids (``layer_types`` with ``linear_attention``) and dense
    Llama-like models. ``dtype_bytes`` is the KV cache's (attention) element size; the conv state follows
    ``ssm_conv_dtype_bytes`` (vLLM keeps it in the model dtype when the KV cache is fp8), the temporal state
    ``ssm_state_dtype_bytes``; they default to ``torch_dtype`` and ``mamba_ssm_cache_dtype``.
    ``block_size`` defaults to vLLM's choice (16 for dense, :func:`hybrid_block_size` for hybrids on a
    TP-``tp_size`` engine).
    """
    kv_bytes = dtype_bytes or _dtype_bytes(config, "torch_dtype", default="bfloat16")
    conv_bytes = ssm_conv_dtype_bytes or kv_bytes
    layers, ssm = _ssm_layers(config, conv_bytes, ssm_state_dtype_bytes, conv_layout)
    attention = None
    if LayerKind.ATTENTION in layers:
        heads = _field(config, "num_attention_heads")
        head_dim = (
            config.get("head_dim")
            or config.get("attention_head_dim")
            or _field(config, "hidden_size") // heads
        )
        attention = AttentionSpec(
            int(config.get("num_key_value_heads") or heads), int(head_dim), kv_bytes, attention_layout
        )
    if block_size is None:
        block_size = (
            hybrid_block_size(attention, ssm, kernel_alignment=kernel_alignment, tp_size=tp_size)
            if attention and ssm
            else max(16, kernel_alignment)
        )
    return KVModel(layers, block_size, attention, ssm, kernel_block_size or block_size)


def _ssm_layers(
    config: Mapping[str, Any], conv_bytes: int, state_bytes: int | None, conv_layout: ConvLayout
) -> tuple[tuple[LayerKind, ...], SsmSpec | None]:
    state_bytes = state_bytes or _dtype_bytes(config, "mamba_ssm_cache_dtype", default=None) or conv_bytes
    if "hybrid_override_pattern" in config:
        pattern: str = config["hybrid_override_pattern"]
        layers = tuple(LayerKind.SSM if c == "M" else LayerKind.ATTENTION for c in pattern if c in "M*")
        ssm = SsmSpec.mamba2(
            num_heads=_field(config, "mamba_num_heads"),
            head_dim=_field(config, "mamba_head_dim"),
            n_groups=_field(config, "n_groups"),
            state_size=_field(config, "ssm_state_size"),
            conv_kernel=_field(config, "conv_kernel"),
            conv_dtype_bytes=conv_bytes,
            state_dtype_bytes=state_bytes,
            conv_layout=conv_layout,
        )
        return layers, ssm
    layer_types: Sequence[str] | None = config.get("layer_types")
    if layer_types and "linear_attention" in layer_types:
        layers = tuple(LayerKind.SSM if t == "linear_attention" else LayerKind.ATTENTION for t in layer_types)
        ssm = SsmSpec.gdn(
            num_k_heads=_field(config, "linear_num_key_heads"),
            num_v_heads=_field(config, "linear_num_value_heads"),
            head_k_dim=_field(config, "linear_key_head_dim"),
            head_v_dim=_field(config, "linear_value_head_dim"),
            conv_kernel=_field(config, "linear_conv_kernel_dim"),
            conv_dtype_bytes=conv_bytes,
            state_dtype_bytes=state_bytes,
            conv_layout=conv_layout,
        )
        return layers, ssm
    return (LayerKind.ATTENTION,) * _field(config, "num_hidden_layers"), None


def _field(config: Mapping[str, Any], name: str) -> int:
    value = config.get(name)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"HF config field {name!r} must be a positive integer, got {value!r}")
    return value


def _dtype_bytes(config: Mapping[str, Any], name: str, default: str | None) -> int | None:
    dtype = config.get(name) or default
    if dtype is None:
        return None
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"HF config field {name!r}: unknown dtype {dtype!r} (known: {sorted(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


def _require_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")
