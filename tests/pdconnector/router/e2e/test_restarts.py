"""Restarts under load: each side restarted 20 times (SIGKILL, same name and address, a new incarnation) while
requests flow through both routers. No answer is wrong (no byte meant for an earlier life lands in a later
one), no block is left held, and the survivor keeps one agent per live peer rank instead of one per
incarnation it has seen. Over real NIXL (UCX), a decode that saw 20 prefill incarnations holds no more memory
than after the first few: each old incarnation's agent, its metadata and its mapped regions were dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from pdconnector.sim.cluster import LocalCluster

from tests.pdconnector.router.e2e.checks import blocks_all_free, wait_until
from tests.pdconnector.router.e2e.conftest import require_mover

MODEL = "tiny"
RESTARTS = 20
LOAD_LANES = 4


def prompt_of(index: int) -> str:
    return " ".join(f"w{(index * 31 + i) % 997}" for i in range(40 + index % 200))


def complete(url: str, prompt: str) -> tuple[int, str]:
    response = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8}, timeout=30
    )
    return response.status_code, response.json()["choices"][0][
        "text"
    ] if response.status_code == 200 else response.text


def start_pair(workdir: Path, subnet: int, transport: str) -> LocalCluster:
    args = ["--decode-seconds-per-token", "0.002", "--transfer-timeout", "2", "--lease", "4", "--fence", "4"]
    cluster = LocalCluster(
        workdir=workdir,
        subnet=subnet,
        prefill_count=1,
        decode_count=1,
        engine_args=args,
        transport=transport,
    )
    try:
        cluster.start()
        cluster.start_router("push", "push")
        cluster.start_router("pull", "pull")
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def pair_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_pair(tmp_path_factory.mktemp("restarts"), 220, "mock")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def nixl_pair_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_mover("nixl")
    cluster = start_pair(tmp_path_factory.mktemp("restarts-nixl"), 224, "nixl")
    yield cluster
    cluster.stop()


def rss_mib(cluster: LocalCluster, name: str) -> float:
    """Resident memory of an engine process (VmRSS), MiB."""
    popen = cluster.engines[name].popen
    assert popen is not None
    for line in Path(f"/proc/{popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {name}")


class Load:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.references: dict[int, str] = {}
        self.served = 0
        self.failed = 0
        self.wrong: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def lane(self, lane: int) -> None:
        index = lane
        while not self.stop.is_set():
            slot = index % 50
            prompt = prompt_of(slot)
            with self.lock:
                reference = self.references.get(slot)
            if reference is None:
                reference = complete(self.cluster.engines["colocated"].url, prompt)[1]
                with self.lock:
                    self.references[slot] = reference
            router = self.cluster.routers["push" if index % 2 else "pull"]
            try:
                status, text = complete(router.url, prompt)
            except httpx.HTTPError:
                status, text = -1, ""
            with self.lock:
                if status == 200:
                    self.served += 1
                    if text != reference:
                        self.wrong.append(f"prompt {slot} via {router.name}: {text!r} != {reference!r}")
                else:
                    self.failed += 1
            if status != 200:
                time.sleep(0.05)  # the peer is restarting: do not spin
            index += LOAD_LANES


def restarts_under_load(
    cluster: LocalCluster, names: list[str], between: Callable[[int], None] = lambda _: None
) -> Load:
    """Restart each of ``names`` RESTARTS times, in turn, while the load runs, each time after traffic reached
    the incarnation before; ``between(i)`` runs before restart ``i``."""
    load = Load(cluster)
    lanes = [threading.Thread(target=load.lane, args=(lane,), daemon=True) for lane in range(LOAD_LANES)]
    for lane in lanes:
        lane.start()
    try:
        for restart in range(len(names) * RESTARTS):
            served_before = load.served
            # traffic reached this incarnation
            wait_until(lambda before=served_before: load.served > before + 2, timeout_s=30)
            between(restart)
            cluster.restart(names[restart % len(names)])
        wait_until(lambda: load.served > served_before + 10, timeout_s=30)
    finally:
        load.stop.set()
        for lane in lanes:
            lane.join(timeout=60)
    return load


@pytest.mark.timeout(900)
def test_each_side_restarted_twenty_times_under_load_serves_right_and_leaks_neither_blocks_nor_agents(
    pair_cluster: LocalCluster,
) -> None:
    cluster = pair_cluster
    load = restarts_under_load(cluster, ["prefill-0", "decode-0"])
    assert load.wrong == [], load.wrong[:3]
    assert load.served > 4 * RESTARTS, (load.served, load.failed)
    wait_until(lambda: blocks_all_free(cluster), timeout_s=20)
    for name in ("prefill-0", "decode-0"):
        # One agent per live peer rank: the peer's 20 earlier incarnations were dropped, not kept.
        assert cluster.engines[name].metrics()["pd_mock_peer_agents"] <= 1, name
    print(
        f"restarts: {2 * RESTARTS}, served {load.served}, failed {load.failed} (requests caught by a restart)"
    )


SETTLED_AFTER = 3  # restarts before decode's memory is taken as its baseline (allocator and UCX warm-up)
RSS_GROWTH_BOUND_MIB = 48.0


@pytest.mark.timeout(900)
def test_a_decode_that_saw_twenty_prefill_incarnations_over_nixl_holds_no_more_memory_or_agents(
    nixl_pair_cluster: LocalCluster,
) -> None:
    cluster = nixl_pair_cluster
    rss: dict[int, float] = {}

    def measure(restart: int) -> None:
        rss[restart] = rss_mib(cluster, "decode-0")

    load = restarts_under_load(cluster, ["prefill-0"], between=measure)
    wait_until(lambda: blocks_all_free(cluster), timeout_s=20)
    measure(RESTARTS)
    assert load.wrong == [], load.wrong[:3]
    assert cluster.engines["decode-0"].metrics()["pd_mock_peer_agents"] <= 1
    growth = rss[RESTARTS] - rss[SETTLED_AFTER]
    print(
        f"decode RSS over {RESTARTS} prefill restarts (NIXL): {rss[0]:.0f} MiB at the first, "
        f"{rss[SETTLED_AFTER]:.0f} after {SETTLED_AFTER}, {rss[RESTARTS]:.0f} at the end "
        f"({growth:+.1f} MiB); served {load.served}, failed {load.failed}"
    )
    assert growth < RSS_GROWTH_BOUND_MIB, rss
