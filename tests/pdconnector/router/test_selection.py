"""Selection policies per role."""

from __future__ import annotations

import pytest
from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import Backend, BackendPool, BackendSpec
from pdconnector.router.selection import NoBackend, Policy, Selector, candidates, pick_backend


def backends(*names: str) -> list[Backend]:
    return [
        Backend(BackendSpec(name=n, role=EngineRole.DECODE, host="127.0.0.1", http_port=8000, engine_id=n))
        for n in names
    ]


def test_least_outstanding_picks_the_idlest_backend():
    a, b, c = backends("a", "b", "c")
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert Selector(Policy.LEAST_OUTSTANDING, EngineRole.PREFILL).pick([a, b, c]) is b


def test_least_outstanding_spreads_equal_load_by_requests_served():
    a, b = backends("a", "b")
    a.served = 5
    assert Selector(Policy.LEAST_OUTSTANDING, EngineRole.PREFILL).pick([a, b]) is b


def test_round_robin_cycles_in_a_stable_order_regardless_of_load():
    a, b, c = backends("a", "b", "c")
    a.outstanding = 10
    selector = Selector(Policy.ROUND_ROBIN, EngineRole.PREFILL)
    assert [selector.pick([c, a, b]).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_no_candidates_gives_none():
    assert Selector(Policy.ROUND_ROBIN, EngineRole.PREFILL).pick([]) is None
    assert Selector(Policy.LEAST_OUTSTANDING, EngineRole.PREFILL).pick([]) is None


def test_compatibility_requires_equal_hashes_only_when_both_advertise_one():
    a, b, c = backends("a", "b", "c")
    a.advertised_compat, b.advertised_compat = "x", "y"
    assert not a.compatible_with(b)
    assert a.compatible_with(c) and c.compatible_with(b)


def pool_of(prefills: list[tuple[str, str | None]], decodes: list[tuple[str, str | None]]) -> BackendPool:
    """Backends by (name, compat hash); every one healthy."""
    pool = BackendPool()
    specs = [
        BackendSpec(
            name=name, role=role, host="127.0.0.1", http_port=8000, engine_id=name, compat_hash=compat
        )
        for role, members in ((EngineRole.PREFILL, prefills), (EngineRole.DECODE, decodes))
        for name, compat in members
    ]
    pool.replace(specs)
    return pool


SELECTORS = {role: Selector(Policy.ROUND_ROBIN, role) for role in EngineRole}


def test_a_backend_without_a_compatible_partner_is_not_picked_to_start_a_request():
    pool = pool_of([("p-old", "v1"), ("p-new", "v2")], [("d-new", "v2")])
    assert {pick_backend(pool, SELECTORS, EngineRole.PREFILL, refused=()).name for _ in range(4)} == {"p-new"}


def test_the_partner_decides_which_backends_are_candidates():
    pool = pool_of([("p-old", "v1"), ("p-new", "v2")], [("d-old", "v1")])
    decode = pick_backend(pool, SELECTORS, EngineRole.DECODE, refused=())
    assert [b.name for b in candidates(pool, EngineRole.PREFILL, (), partner=decode)] == ["p-old"]


def test_backends_that_refused_the_request_are_skipped_and_named_when_none_is_left():
    pool = pool_of([("p0", None)], [("d0", None), ("d1", None)])
    assert pick_backend(pool, SELECTORS, EngineRole.DECODE, refused={"d0"}).name == "d1"
    with pytest.raises(NoBackend) as none:
        pick_backend(pool, SELECTORS, EngineRole.DECODE, refused={"d0", "d1"})
    assert none.value.role is EngineRole.DECODE
    assert none.value.reasons == [
        "d0: refused this request's connection",
        "d1: refused this request's connection",
    ]


def test_no_partner_for_any_backend_names_the_partner_role_and_why():
    pool = pool_of([("p0", None)], [("d0", None)])
    [decode] = pool.by_role(EngineRole.DECODE)
    decode.healthy, decode.consecutive_failures, decode.last_error = False, 3, "/health answered 500"
    with pytest.raises(NoBackend) as none:
        pick_backend(pool, SELECTORS, EngineRole.PREFILL, refused=())
    assert none.value.role is EngineRole.DECODE
    assert none.value.reasons == ["d0: ejected (3 failure(s) in a row, last: /health answered 500)"]


def test_an_incompatible_generation_is_named_against_the_partner():
    pool = pool_of([("p0", "v1")], [("d0", "v2")])
    [decode] = pool.by_role(EngineRole.DECODE)
    with pytest.raises(NoBackend) as none:
        pick_backend(pool, SELECTORS, EngineRole.PREFILL, refused=(), partner=decode)
    assert none.value.reasons == ["p0: engine generation v1 cannot pair with d0's v2"]
