import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pdconnector.tier.index import TierIndex


def saved(index: TierIndex, *hashes: str) -> list[int]:
    slots = index.reserve(hashes)
    index.commit(slots)
    return [slots[h] for h in hashes]


def test_a_prefix_is_read_up_to_the_first_block_the_tier_does_not_hold():
    index = TierIndex(8)
    a, b, _ = saved(index, "a", "b", "d")
    assert index.longest_prefix(["a", "b", "c", "d"]) == [a, b]
    assert index.longest_prefix(["x", "a"]) == []


def test_a_block_being_saved_is_not_readable_until_committed():
    index = TierIndex(4)
    index.reserve(["a"])
    assert index.longest_prefix(["a"]) == [] and "a" not in index
    with pytest.raises(KeyError):
        index.pin(["a"])
    index.commit(["a"])
    assert "a" in index


def test_a_block_is_saved_once():
    index = TierIndex(4)
    assert list(index.reserve(["a", "a", "b"])) == ["a", "b"]
    assert index.reserve(["a", "b", "c"]).keys() == {"c"}


def test_room_is_made_by_evicting_the_least_recently_used_block_nobody_reads():
    index = TierIndex(3)
    saved(index, "a", "b", "c")
    index.pin(["a"])  # read now: most recently used, and pinned
    index.unpin(["a"])
    index.pin(["b"])  # pinned while its load runs
    slot_of_c = index.longest_prefix(["c"])
    assert index.reserve(["d"]) == {"d": slot_of_c[0]}  # c: least recently used and not read
    assert "c" not in index and index.evictions == 1


def test_a_chain_is_evicted_from_its_tail_so_what_stays_is_still_a_prefix():
    index = TierIndex(4)
    a, b, _ = saved(index, "a", "b", "c")  # one prompt's blocks, head first
    saved(index, "x")
    assert index.reserve(["y"]).keys() == {"y"}  # evicts c, the chain's last block
    assert index.longest_prefix(["a", "b", "c"]) == [a, b]
    index.touch(["a", "b"])  # a later prompt used the chain: newer than x and y
    index.commit(["y"])
    assert index.reserve(["z"]).keys() == {"z"} and "x" not in index


def test_a_save_never_evicts_the_prefix_of_the_chain_it_saves():
    index = TierIndex(3)
    saved(index, "a", "b")
    saved(index, "x")
    index.pin(["x"])  # being read: only a and b could make room
    assert index.reserve(["a", "b", "c"]) == {}  # evicting a or b would strand c
    index.unpin(["x"])
    assert index.reserve(["a", "b", "c"]).keys() == {"c"} and "x" not in index


def test_blocks_being_read_or_written_are_never_evicted_so_a_full_tier_saves_nothing_more():
    index = TierIndex(2)
    saved(index, "a")
    index.pin(["a"])
    index.reserve(["b"])
    assert index.reserve(["c"]) == {}
    index.unpin(["a"])
    assert index.reserve(["c"]).keys() == {"c"}


def test_a_failed_save_gives_its_slot_back():
    index = TierIndex(1)
    index.reserve(["a"])
    index.abandon(["a"])
    assert len(index) == 0 and index.reserve(["b"]).keys() == {"b"}


def test_misuse_is_refused():
    index = TierIndex(2)
    with pytest.raises(ValueError, match="at least one slot"):
        TierIndex(0)
    saved(index, "a")
    with pytest.raises(ValueError, match="committed already"):
        index.commit(["a"])
    with pytest.raises(ValueError, match="only a save in flight"):
        index.abandon(["a"])
    with pytest.raises(ValueError, match="not being read"):
        index.unpin(["a"])


HASHES = st.sampled_from("abcdefgh")


class TierMachine(RuleBasedStateMachine):
    """Any sequence of saves, loads and failures: slots are never shared or lost, capacity holds, and what is
    read or written is never evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.index = TierIndex(4)
        self.writing: dict[str, int] = {}
        self.reading: list[str] = []

    @rule(hashes=st.lists(HASHES, max_size=4))
    def save(self, hashes):
        for block_hash, slot in self.index.reserve(hashes).items():
            self.writing[block_hash] = slot

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), failed=st.booleans())
    def save_ends(self, data, failed):
        block_hash = data.draw(st.sampled_from(sorted(self.writing)))
        del self.writing[block_hash]
        (self.index.abandon if failed else self.index.commit)([block_hash])

    @rule(hashes=st.lists(HASHES, max_size=4))
    def load(self, hashes):
        readable = hashes[: len(self.index.longest_prefix(hashes))]
        self.index.pin(readable)
        self.reading += readable

    @precondition(lambda self: self.reading)
    @rule(data=st.data())
    def load_ends(self, data):
        block_hash = self.reading.pop(data.draw(st.integers(0, len(self.reading) - 1)))
        self.index.unpin([block_hash])

    @invariant()
    def slots_are_distinct_and_within_capacity(self):
        slots = [entry.slot for entry in self.index._entries.values()]
        assert len(slots) == len(set(slots)) <= self.index.capacity_slots
        assert set(slots).isdisjoint(self.index._free)
        assert len(slots) + len(self.index._free) == self.index.capacity_slots

    @invariant()
    def what_is_read_or_written_is_still_there(self):
        assert all(block_hash in self.index for block_hash in self.reading)
        assert all(self.index._entries[h].slot == slot for h, slot in self.writing.items())


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
