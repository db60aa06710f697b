"""KV/SSM memory model and descriptor planning, independent of vLLM and NIXL (numpy only).

``model`` describes what a model stores, ``regions`` how one TP rank lays it out under vLLM's hybrid
allocator, ``plan`` which byte runs a prefill rank writes into a decode rank (``descriptors``: the same as
prepared descriptor lists and ids), ``accounting`` how many bytes that is compared with whole-page transfers,
``staging`` the same runs as the rows a staging slot gathers and scatters, and the cost model that picks a
path, ``synthetic`` tagged pools for byte-exact transfer tests.
"""

from pdconnector.layout.accounting import (
    TransferVolume,
    format_volume_table,
    transfer_volume,
    transfer_volume_table,
)
from pdconnector.layout.descriptors import DescriptorTable, descriptor_ids, descriptor_tables
from pdconnector.layout.model import (
    AttentionLayout,
    AttentionSpec,
    ConvLayout,
    ConvProjection,
    KVModel,
    LayerKind,
    Segment,
    SsmFamily,
    SsmSpec,
    hybrid_block_size,
    model_from_hf_config,
)
from pdconnector.layout.plan import (
    GroupTransfer,
    TransferPlan,
    check_compatible,
    expected_notifications,
    group_transfers,
    plan_transfer,
    shard_pieces,
    targets_for,
    writers_for,
)
from pdconnector.layout.regions import BlockPlacement, KVGroup, PageSchema, RankLayout, Region, group_layers
from pdconnector.layout.synthetic import allocate_pools, apply_plan, tagged_shard, write_tagged_blocks

__all__ = [
    "AttentionLayout",
    "AttentionSpec",
    "BlockPlacement",
    "ConvLayout",
    "ConvProjection",
    "DescriptorTable",
    "GroupTransfer",
    "KVGroup",
    "KVModel",
    "LayerKind",
    "PageSchema",
    "RankLayout",
    "Region",
    "Segment",
    "SsmFamily",
    "SsmSpec",
    "TransferPlan",
    "TransferVolume",
    "allocate_pools",
    "apply_plan",
    "check_compatible",
    "descriptor_ids",
    "descriptor_tables",
    "expected_notifications",
    "format_volume_table",
    "group_layers",
    "group_transfers",
    "hybrid_block_size",
    "model_from_hf_config",
    "plan_transfer",
    "shard_pieces",
    "tagged_shard",
    "targets_for",
    "transfer_volume",
    "transfer_volume_table",
    "write_tagged_blocks",
    "writers_for",
]
