from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from pdconnector.transport import Transport, nixl_unavailable_reason

from tests.pdconnector.transport.harness import KINDS, Buffer, PeerProcess, new_agent

_names = itertools.count()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl" and (reason := nixl_unavailable_reason()):
        pytest.fail(f"NIXL must be importable here (make test installs it): {reason}")
    return request.param


@pytest.fixture
def make_agent(kind: str) -> Iterator[Callable[[str], Transport]]:
    agents: list[Transport] = []

    def make(role: str) -> Transport:
        agent = new_agent(kind, f"{role}-{next(_names)}")
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


@dataclass
class Pair:
    """Two agents in this process: ``a`` owns ``src`` (patterned), ``b`` owns ``dst`` (zeros); each knows the
    other."""

    a: Transport
    b: Transport
    src: Buffer
    dst: Buffer
    peer_b: str
    peer_a: str


@pytest.fixture
def pair(make_agent: Callable[[str], Transport]) -> Pair:
    a, b = make_agent("a"), make_agent("b")
    src, dst = Buffer(1 << 16, seed=1), Buffer(1 << 16)
    a.register([src.region])
    b.register([dst.region])
    peer_b = a.add_peer(b.metadata())
    peer_a = b.add_peer(a.metadata())
    return Pair(a, b, src, dst, peer_b, peer_a)


@pytest.fixture
def spawn_peer(kind: str) -> Iterator[Callable[[int, int], PeerProcess]]:
    peers: list[PeerProcess] = []

    def spawn(nbytes: int, seed: int) -> PeerProcess:
        peer = PeerProcess(kind, f"child-{next(_names)}", nbytes, seed)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.close()
