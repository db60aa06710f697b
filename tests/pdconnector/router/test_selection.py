"""Selection policies per role."""

from __future__ import annotations

from pdconnector.router.backends import Backend, BackendSpec, Role
from pdconnector.router.selection import Policy, Selector


def backends(*names: str) -> list[Backend]:
    return [Backend(BackendSpec(name=n, role=Role.DECODE, host="127.0.0.1", http_port=8000, engine_id=n)) for n in names]


def test_least_outstanding_picks_the_idlest_backend():
    a, b, c = backends("a", "b", "c")
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert Selector(Policy.LEAST_OUTSTANDING).pick([a, b, c]) is b


def test_least_outstanding_spreads_equal_load_by_requests_served():
    a, b = backends("a", "b")
    a.served = 5
    assert Selector(Policy.LEAST_OUTSTANDING).pick([a, b]) is b


def test_round_robin_cycles_in_a_stable_order_regardless_of_load():
    a, b, c = backends("a", "b", "c")
    a.outstanding = 10
    selector = Selector(Policy.ROUND_ROBIN)
    assert [selector.pick([c, a, b]).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_no_candidates_gives_none():
    assert Selector(Policy.ROUND_ROBIN).pick([]) is None
    assert Selector(Policy.LEAST_OUTSTANDING).pick([]) is None


def test_compatibility_requires_equal_hashes_only_when_both_advertise_one():
    a, b, c = backends("a", "b", "c")
    a.advertised_compat, b.advertised_compat = "x", "y"
    assert not a.compatible_with(b)
    assert a.compatible_with(c) and c.compatible_with(b)
