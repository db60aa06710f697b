import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdconnector.protocol.ranks import check_tp_sizes, decode_ranks_written_by, expected_writers, prefill_ranks_writing_to


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "writes"),
    [
        (1, 1, {0: (0,)}),
        (1, 4, {0: (0, 1, 2, 3)}),
        (2, 4, {0: (0, 1), 1: (2, 3)}),
        (4, 2, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}),
        (4, 1, {0: (0,), 1: (0,), 2: (0,), 3: (0,)}),
    ],
)
def test_each_prefill_rank_writes_the_decode_ranks_holding_its_heads(p_tp, d_tp, writes):
    assert {p_rank: decode_ranks_written_by(p_rank, p_tp, d_tp) for p_rank in range(p_tp)} == writes


@pytest.mark.parametrize(("p_tp", "d_tp", "writers"), [(1, 1, 1), (1, 8, 1), (8, 1, 8), (8, 2, 4), (2, 8, 1)])
def test_decode_waits_for_one_completion_per_writing_prefill_rank(p_tp, d_tp, writers):
    assert expected_writers(p_tp, d_tp) == writers


divisible_tp_pairs = st.tuples(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]))


@given(divisible_tp_pairs)
def test_the_two_directions_of_the_pairing_agree(pair):
    p_tp, d_tp = pair
    forward = {(p, d) for p in range(p_tp) for d in decode_ranks_written_by(p, p_tp, d_tp)}
    backward = {(p, d) for d in range(d_tp) for p in prefill_ranks_writing_to(d, p_tp, d_tp)}
    assert forward == backward
    assert {d for _, d in forward} == set(range(d_tp))  # every decode rank is written
    assert all(len(prefill_ranks_writing_to(d, p_tp, d_tp)) == expected_writers(p_tp, d_tp) for d in range(d_tp))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 3), (0, 1), (4, 6), (1, -1)])
def test_tp_sizes_that_do_not_divide_are_refused(p_tp, d_tp):
    with pytest.raises(ValueError, match="TP"):
        check_tp_sizes(p_tp, d_tp)


def test_ranks_outside_the_tp_size_are_refused():
    with pytest.raises(ValueError, match="decode rank 2"):
        prefill_ranks_writing_to(2, p_tp=2, d_tp=2)
    with pytest.raises(ValueError, match="prefill rank -1"):
        decode_ranks_written_by(-1, p_tp=2, d_tp=2)
