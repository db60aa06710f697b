"""Descriptor validation and the registered-region containment check both transports rely on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdconnector.transport import Device, MemoryRegion, RegionTable, TransportError, pair_descriptors


def _brute_force_inside(regions: list[MemoryRegion], addr: int, nbytes: int, device_id: int) -> bool:
    return any(
        r.device_id == device_id and r.addr <= addr and addr + nbytes <= r.addr + r.nbytes for r in regions
    )


@st.composite
def _regions_and_descriptors(draw: st.DrawFn) -> tuple[list[MemoryRegion], np.ndarray]:
    regions, cursor = [], 4096
    for _ in range(draw(st.integers(1, 5))):
        cursor += draw(st.integers(0, 64))
        size = draw(st.integers(1, 256))
        regions.append(MemoryRegion(cursor, size, Device.DRAM, draw(st.integers(0, 1))))
        cursor += size
    rows = draw(
        st.lists(
            st.tuples(st.integers(4000, cursor + 64), st.integers(0, 300), st.integers(0, 1)), max_size=40
        )
    )
    return regions, np.array(rows, dtype=np.int64).reshape(-1, 3)


@given(_regions_and_descriptors())
def test_first_outside_agrees_with_a_brute_force_check(case: tuple[list[MemoryRegion], np.ndarray]) -> None:
    regions, descriptors = case
    expected = next(
        (i for i, (a, n, d) in enumerate(descriptors.tolist()) if not _brute_force_inside(regions, a, n, d)),
        None,
    )
    assert RegionTable(regions).first_outside(descriptors) == expected


def test_rank_five_descriptors_match_only_device_five_registrations() -> None:
    """TP rank 5 of a GPU engine registers cuda:5 memory; rows naming device 0 at the same address lie outside
    it."""
    table = RegionTable(
        [
            MemoryRegion(1 << 40, 1 << 20, Device.VRAM, device_id=5),
            MemoryRegion(1 << 41, 1 << 20, Device.VRAM, device_id=5),
        ]
    )
    inside = np.array([[1 << 40, 4096, 5], [(1 << 41) + 4096, 1 << 19, 5]])
    assert table.first_outside(inside) is None
    assert table.first_outside(np.array([[1 << 40, 4096, 5], [1 << 40, 4096, 0]])) == 1
    with pytest.raises(
        TransportError, match=r"descriptor 0 .*dev 0\] lies outside the memory registered by 'decode-tp5'"
    ):
        table.check(np.array([[1 << 40, 4096, 0]]), "local", "decode-tp5")


def test_a_region_ends_exactly_at_its_last_byte() -> None:
    table = RegionTable([MemoryRegion(1000, 100)])
    assert table.first_outside(np.array([[1000, 100, 0], [1099, 1, 0]])) is None
    assert table.first_outside(np.array([[1000, 100, 0], [1099, 2, 0]])) == 1
    assert table.first_outside(np.array([[1100, 1, 0]])) == 0
    assert table.first_outside(np.array([[1000, 1, 1]])) == 0  # same address on another device


def test_hostile_lengths_do_not_overflow_into_a_pass() -> None:
    table = RegionTable([MemoryRegion(1000, 100)])
    assert table.first_outside(np.array([[1050, np.iinfo(np.int64).max, 0]])) == 0


def test_an_agent_cannot_mix_device_kinds_or_register_twice() -> None:
    table = RegionTable([MemoryRegion(1000, 100)])
    with pytest.raises(TransportError, match="one device kind"):
        table.add([MemoryRegion(5000, 100, Device.VRAM)])
    with pytest.raises(TransportError, match="overlaps"):
        table.add([MemoryRegion(1000, 100)])
    table.add([MemoryRegion(1000, 100, Device.DRAM, device_id=1)])
    assert len(table.regions) == 2


@pytest.mark.parametrize(
    ("addr", "nbytes", "device_id", "field"),
    [(0, 1, 0, "addr"), (8, 0, 0, "nbytes"), (8, 1, -1, "device_id")],
)
def test_a_region_names_its_bad_field(addr: int, nbytes: int, device_id: int, field: str) -> None:
    with pytest.raises(TransportError, match=f"MemoryRegion.{field}"):
        MemoryRegion(addr, nbytes, Device.DRAM, device_id)


def test_pairing_drops_zero_length_rows_on_both_sides() -> None:
    local, remote = pair_descriptors(np.array([[10, 0, 0], [20, 4, 0]]), np.array([[30, 0, 0], [40, 4, 0]]))
    assert local.tolist() == [[20, 4, 0]] and remote.tolist() == [[40, 4, 0]]
    assert local.dtype == np.int64 and local.flags.c_contiguous
