import pytest
import torch
from pdconnector.layout.regions import Region
from pdconnector.tier.store import RankTier, TierStore

# a layer-outer rank of three layer slots (one region each), 8 blocks of 64 bytes (16 float32 each)
REGIONS = [Region(index=i, num_blocks=8, block_stride=64) for i in range(3)]


def caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=generator) for _ in REGIONS]


def test_blocks_saved_and_loaded_into_other_blocks_are_the_same_bytes_in_every_region():
    source, target = caches(1), caches(2)
    store = TierStore(REGIONS, capacity_slots=4)
    store.save(source, block_ids=[5, 2], slots=[3, 0])
    store.load(target, slots=[0, 3], block_ids=[7, 1])
    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[7], before[2]) and torch.equal(after[1], before[5])


def test_a_load_touches_only_its_blocks():
    source, target = caches(1), caches(2)
    untouched = [c.clone() for c in target]
    store = TierStore(REGIONS, capacity_slots=2)
    store.save(source, block_ids=[4], slots=[1])
    store.load(target, slots=[1], block_ids=[6])
    for after, before in zip(target, untouched, strict=True):
        assert torch.equal(after[:6], before[:6]) and torch.equal(after[7:], before[7:])


def test_a_block_outer_rank_keeps_one_run_per_block():
    region = Region(index=0, num_blocks=4, block_stride=3 * 64)  # every layer slot's page of a block together
    cache = torch.arange(4 * 3 * 16, dtype=torch.float32).reshape(4, 3, 16)
    store = TierStore([region], capacity_slots=1)
    store.save([cache], [2], [0])
    copy = torch.zeros_like(cache)
    store.load([copy], [0], [0])
    assert torch.equal(copy[0], cache[2]) and store.slot_bytes == 192


def test_a_rank_tier_copies_between_its_own_caches_and_its_slots():
    tier = RankTier(TierStore(REGIONS, capacity_slots=2), caches(1))
    tier.save(block_ids=[3], slots=[1])
    tier.load([1], [0])
    assert all(torch.equal(cache[0], cache[3]) for cache in tier.caches)


@pytest.mark.parametrize(
    ("block_ids", "slots", "message"),
    [
        ([8], [0], "outside the cache"),
        ([0], [4], "outside the tier"),
        ([0, 1], [0], "2 blocks for 1 slots"),
        ([0, 0], [0, 1], "each block and each slot once"),
    ],
)
def test_copies_outside_the_cache_or_the_tier_are_refused(block_ids, slots, message):
    with pytest.raises(ValueError, match=message):
        TierStore(REGIONS, capacity_slots=4).save(caches(1), block_ids, slots)


def test_caches_that_do_not_match_the_regions_are_refused():
    store = TierStore(REGIONS, capacity_slots=1)
    with pytest.raises(ValueError, match="one per region"):
        store.save(caches(1)[:2], [0], [0])
    with pytest.raises(ValueError, match="region 1: expected a contiguous tensor of 512 bytes"):
        store.save([caches(1)[0], torch.zeros(8, 8), caches(1)[2]], [0], [0])
