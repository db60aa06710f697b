"""A real deployment on loopback: 2 prefill + 2 decode mock engines, a co-located reference engine, routers
per mode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pdconnector.sim.cluster import LocalCluster
from pdconnector.sim.movers import mover_unavailable_reason


def require_mover(transport: str) -> None:
    reason = mover_unavailable_reason(transport)
    if reason is not None:
        pytest.fail(
            f"mock engines must be able to move KV over {transport} here (make test installs it): {reason}"
        )


def start_cluster(
    workdir,
    subnet: int,
    engine_args: list[str],
    *,
    transport: str = "mock",
    colocated: bool = True,
    engine_env: dict[str, str] | None = None,
    **router_overrides: object,
) -> LocalCluster:
    require_mover(transport)
    cluster = LocalCluster(
        workdir=workdir,
        subnet=subnet,
        engine_args=engine_args,
        transport=transport,
        engine_env=engine_env or {},
    )
    try:
        cluster.start(colocated=colocated)
        cluster.start_router("push", "push", **router_overrides)
        cluster.start_router("pull", "pull", **router_overrides)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def fast_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """Zero-latency engines: correctness and load."""
    cluster = start_cluster(tmp_path_factory.mktemp("fast"), 60, ["--transfer-timeout", "5", "--lease", "5"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def slow_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """Engines with a latency model, so faults can strike mid-request."""
    args = [
        "--prefill-seconds-per-token",
        "0.002",
        "--decode-seconds-per-token",
        "0.02",
        "--transfer-timeout",
        "2",
        "--lease",
        "2",
    ]
    cluster = start_cluster(tmp_path_factory.mktemp("slow"), 100, args)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def nixl_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """The same deployment moving KV with NIXL (UCX over host memory) instead of the TCP mock transport."""
    cluster = start_cluster(
        tmp_path_factory.mktemp("nixl"),
        140,
        ["--transfer-timeout", "10", "--lease", "10"],
        transport="nixl",
        colocated=False,
    )
    yield cluster
    cluster.stop()
