"""KV transfers between two engine processes on one GPU over real NIXL (UCX), the pools in VRAM: the data
plane as it runs in an engine, minus vLLM and the network.

Each process hosts the project's transfer plumbing (``EngineTransfers``: a ``TransferWorker`` per TP rank and
the side channel; the ranks of a TP-2 engine share the GPU) over pools laid out like vLLM's CUDA caches: one
tensor per layer slot (vLLM's layer-outer LBHNC) or one tensor whose blocks hold every layer (block-outer
BLHNC, the connector's default; head-outer BHLNC for the dense model), each between guard bytes that are never
registered. Models: a dense Qwen3-32B and the hybrid Nemotron-H (NVIDIA-Nemotron-Nano-9B-v2: Mamba2 and
attention layers, SSM pages padded to the attention page by vLLM's hybrid allocator). Requests of 1k and 16k
tokens on randomly permuted blocks, pushed and pulled, at TP 1->1, 1->2 and 2->1; layer-outer caches pushed
through the staged path too (gathered into a staging slot on the GPU, one WRITE, scattered on the GPU).
Engines larger than a node: a TP-2 engine whose ranks run in two processes standing in for two nodes (each
rank on its node's first device, reached through the first node's side channel), paired with a single-node
TP-1 engine, pushed and pulled both ways. Two GPUs (skipped with fewer): each rank's pools on its own GPU,
prefill and decode on separate GPUs (0 -> 1, 0 -> 0+1, 0+1 -> 1, 0+1 -> 1+0), every transport created with its
rank's GPU current.

Checked on the device, never by copying pools to the host: every byte of every decode region equals the
expectation (the prefill's tagged content at the request's blocks, the sentinel the pool was filled with
everywhere else, SSM padding included), the guards are intact, the bytes received are the bytes planned, and
every rank of both sides reports the transfer ended exactly once with no block left held.

``PD_GPU_SUITE_DEVICE=cpu`` runs the same tests on host memory with fewer layers and 1k tokens only; without
it they need CUDA and skip elsewhere. Select them with ``pytest -m gpu``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from pdconnector.layout import BlockPlacement, RankLayout, plan_transfer, tagged_shard, writers_for
from pdconnector.transport.nixl_transport import nixl_unavailable_reason

from tests.pdconnector.worker.engines import EngineHost, RemoteEngine, request_blocks, warm_hosts
from tests.pdconnector.worker.nodes import one_side_spanning
from tests.pdconnector.worker.scenarios import Pair, assert_received, assert_sent, started
from tests.pdconnector.worker.vram import SuiteModel, gpu_suite

SUITE = gpu_suite()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SUITE.skip_reason is not None, reason=SUITE.skip_reason or ""),
]

TIMEOUT_S = (
    60.0  # any single wait; a scattered 16k-token dense request posts 65,536 descriptors (~0.5 s on the H200)
)
TPS = ((1, 1), (1, 2), (2, 1))
LAYER, BLOCK, HEAD = BlockPlacement.LAYER_OUTER, BlockPlacement.BLOCK_OUTER, BlockPlacement.HEAD_OUTER
PAIRS = [
    (model, p_tp, d_tp, placement)
    for model in SUITE.models
    for p_tp, d_tp in TPS
    for placement in (LAYER, BLOCK, *((HEAD,) if model.spec.num_ssm_layers == 0 and p_tp != d_tp else ()))
]
PAIR_IDS = [f"{model.name}-P{p_tp}-D{d_tp}-{placement.value}" for model, p_tp, d_tp, placement in PAIRS]
# The staged path where descriptors cost most: layer-outer caches, one run per layer and block.
STAGED_PAIRS = [(model, p_tp, d_tp, LAYER, "staged") for model in SUITE.models for p_tp, d_tp in TPS]
STAGED_IDS = [f"{model.name}-P{p_tp}-D{d_tp}-staged" for model, p_tp, d_tp, _, _ in STAGED_PAIRS]
TOKEN_IDS = [f"{tokens // 1024}k" for tokens in SUITE.tokens]
# Two GPUs: each rank's pools on its own device (device ids carried end to end), prefill and decode on
# separate GPUs, and heterogeneous TP across them. Skipped with fewer than two CUDA devices.
GPU_PLACEMENTS = (((0,), (1,)), ((0,), (0, 1)), ((0, 1), (1,)), ((0, 1), (1, 0)))
TWO_GPU_PAIRS = [
    (model, p_gpus, d_gpus, BLOCK if model.spec.num_ssm_layers or len(p_gpus) == len(d_gpus) else HEAD)
    for model in SUITE.models
    for p_gpus, d_gpus in GPU_PLACEMENTS
]
TWO_GPU_IDS = [
    f"{model.name}-P{''.join(map(str, p))}-D{''.join(map(str, d))}-{placement.value}"
    for model, p, d, placement in TWO_GPU_PAIRS
]
# Engines larger than a node (tests/pdconnector/worker/nodes.py): one side's ranks in two processes, one per
# node, each rank on its node's first device, paired at heterogeneous TP with a single-node engine. Dense
# caches head-outer, one descriptor per block: a READ between processes here runs UCX's software emulation
# over tcp/lo (docs/benchmarks.md, "GPU memory"), and with both "nodes" reading at once a block-outer 16k pull
# (131,072 descriptors) overran the 60 s wait; head-outer (2,048) took 8.8 s, as a single-node pull does.
SPANNING_PAIRS = [
    (model, p_tp, d_tp, BLOCK if model.spec.num_ssm_layers else HEAD, spanning)
    for model in SUITE.models
    for p_tp, d_tp, spanning in ((1, 2, "decode"), (2, 1, "prefill"))
]
SPANNING_IDS = [
    f"{model.name}-P{p}-D{d}-{spanning}-on-2-nodes" for model, p, d, _, spanning in SPANNING_PAIRS
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineHost, EngineHost]]:
    if (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable for the GPU suite: {reason}")
    logs = SUITE.log_dir or tmp_path_factory.mktemp("engine-logs")
    logs.mkdir(parents=True, exist_ok=True)
    with warm_hosts(logs) as both:
        yield both


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, hosts: tuple[EngineHost, EngineHost]) -> Iterator[Pair]:
    """A started prefill and decode engine of one model and TP pair, serving every request of the tests using
    it."""
    model, p_tp, d_tp, placement, *path = request.param
    tag = f"{model.name}-p{p_tp}d{d_tp}-{placement.value}{'-staged' if path else ''}"
    config, (p_blocks, d_blocks) = dict(model.config), model.num_blocks
    options: dict[str, Any] = {"transport": "nixl", "device": SUITE.device, "placement": placement.value}
    if path:
        # two slots per rank (a TP-1 prefill writes two decode ranks at once), each holding the largest
        # request whole as one TP-1 rank holds it, its state blocks included
        largest = RankLayout(model.spec, 1, 0, 1)
        blocks = -(-max(SUITE.tokens) // model.spec.block_size) + len(largest.groups)
        slot = blocks * largest.num_slots * largest.page_bytes
        options["staging"] = {"nbytes": 2 * slot, "slots": 2, "path": "staged"}
    prefill = hosts[0].create(f"prefill-{tag}", config, tp=p_tp, num_blocks=p_blocks, **options)
    decode = hosts[1].create(f"decode-{tag}", config, tp=d_tp, num_blocks=d_blocks, **options)
    with started(prefill, decode, model.name, (p_tp, d_tp), model.num_blocks, placement=placement) as pair:
        yield pair


@pytest.fixture(scope="module")
def second_node(
    hosts: tuple[EngineHost, EngineHost], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineHost]:
    """A third engine process: the second node of an engine spanning two."""
    logs = SUITE.log_dir or tmp_path_factory.mktemp("second-node-logs")
    logs.mkdir(parents=True, exist_ok=True)
    process = EngineHost(log=logs / "second-node.log")
    try:
        process.warm_nixl()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def spanning_pair(
    request: pytest.FixtureRequest, hosts: tuple[EngineHost, EngineHost], second_node: EngineHost
) -> Iterator[Pair]:
    """A single-node engine and one spanning two nodes: the first node shares the process of its role's
    single-node engines, the second node has its own."""
    model, p_tp, d_tp, placement, spanning = request.param
    own = hosts[0] if spanning == "prefill" else hosts[1]
    single = hosts[1] if spanning == "prefill" else hosts[0]
    prefill, decode = one_side_spanning(
        single,
        (own, second_node),
        f"{model.name}-p{p_tp}d{d_tp}-{spanning}-spans",
        dict(model.config),
        tps=(p_tp, d_tp),
        blocks=model.num_blocks,
        spanning=spanning,
        transport="nixl",
        device=SUITE.device,
        placement=placement.value,
    )
    with started(prefill, decode, model.name, (p_tp, d_tp), model.num_blocks, placement=placement) as pair:
        yield pair


@pytest.fixture(scope="module")
def two_gpu_pair(request: pytest.FixtureRequest, hosts: tuple[EngineHost, EngineHost]) -> Iterator[Pair]:
    """A prefill and a decode engine whose rank ``r`` has its pools on GPU ``p_gpus[r]`` / ``d_gpus[r]``."""
    if (reason := SUITE.gpus_missing_reason(2)) is not None:
        pytest.skip(reason)
    model, p_gpus, d_gpus, placement = request.param
    tag = f"{model.name}-p{''.join(map(str, p_gpus))}d{''.join(map(str, d_gpus))}-{placement.value}"
    config, (p_blocks, d_blocks) = dict(model.config), model.num_blocks
    options: dict[str, Any] = {"transport": "nixl", "placement": placement.value}
    prefill = hosts[0].create(
        f"prefill-{tag}", config, tp=len(p_gpus), num_blocks=p_blocks, device=SUITE.devices(p_gpus), **options
    )
    decode = hosts[1].create(
        f"decode-{tag}", config, tp=len(d_gpus), num_blocks=d_blocks, device=SUITE.devices(d_gpus), **options
    )
    tps = (len(p_gpus), len(d_gpus))
    with started(prefill, decode, model.name, tps, model.num_blocks, placement=placement) as pair:
        yield pair


def _counts(engine: RemoteEngine, name: str) -> list[int]:
    return [stats.get(name, 0) for stats in engine.stats()]


def _move(pair: Pair, mode: str, tokens: int, record_property: Callable[[str, object], None]) -> None:
    """One request of ``tokens`` tokens from scattered prefill blocks into scattered decode blocks, pushed or
    pulled, then every check of the module docstring."""
    prefill, decode, (p_tp, d_tp) = pair.prefill, pair.decode, pair.tps
    spec, (p_blocks, d_blocks) = SUITE.model(pair.model).spec, pair.blocks
    seed = 2 * tokens + (0 if mode == "push" else 8)  # even seeds: block ids in permuted order, not sorted
    src, dst = (
        request_blocks(spec, p_blocks, tokens, seed=seed),
        request_blocks(spec, d_blocks, tokens, seed=seed + 2),
    )
    transfer_id = f"tx-{mode}-{pair.model}-P{p_tp}D{d_tp}-{pair.placement.value}-{tokens}"
    prefill.fill(blocks=src, num_tokens=tokens)
    decode.reset()
    sent_before, received_before = _counts(prefill, "finished_sending"), _counts(decode, "finished_recving")

    if mode == "push":
        # Decode registers first, as with the router's concurrent dispatch: the clock runs from the finished
        # prefill.
        registrations = _counts(prefill, "registrations_received")[0] + max(1, d_tp // p_tp)
        decode.expect_push(
            transfer_id=transfer_id, prefill=pair.coords, blocks=dst, num_tokens=tokens, timeout_s=TIMEOUT_S
        )
        assert prefill.wait_stat(name="registrations_received", value=registrations, timeout_s=TIMEOUT_S)
        start = time.monotonic()
        prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=tokens)
    else:
        prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=tokens, pull=True)
        start = time.monotonic()
        decode.read(
            transfer_id=transfer_id,
            prefill=pair.coords,
            remote_blocks=src,
            blocks=dst,
            num_tokens=tokens,
            timeout_s=TIMEOUT_S,
        )
    results = assert_received(decode, transfer_id, d_tp, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert_sent(prefill, transfer_id, p_tp, timeout_s=TIMEOUT_S)

    received = [{"dst": dst, "src": src, "num_tokens": tokens}]
    assert decode.check(received=received) == {"wrong_bytes": 0, "guard_bytes": 0}, decode.differences(
        received=received
    )
    plans = [
        plan_transfer(
            RankLayout(spec, p_tp, p, p_blocks, pair.placement),
            RankLayout(spec, d_tp, d, d_blocks, pair.placement),
            src,
            dst,
            num_tokens=tokens,
        )
        for d in range(d_tp)
        for p in writers_for(d, p_tp, d_tp)
    ]
    assert sum(r["nbytes"] for r in results) == sum(plan.nbytes for plan in plans)
    # Exactly one end per rank on both sides, and every prefill hold ever taken released: nothing is left
    # pinned.
    assert [a - b for a, b in zip(_counts(prefill, "finished_sending"), sent_before, strict=True)] == [
        1
    ] * p_tp
    assert [a - b for a, b in zip(_counts(decode, "finished_recving"), received_before, strict=True)] == [
        1
    ] * d_tp
    assert _counts(prefill, "finished_sending") == _counts(prefill, "prefills_finished")
    assert _counts(decode, "failed_recving") == [0] * d_tp
    record_property("transfer_s", round(elapsed, 3))
    record_property("descriptors", sum(len(plan) for plan in plans))
    record_property("bytes", sum(plan.nbytes for plan in plans))


@pytest.mark.parametrize("model", SUITE.models, ids=[m.name for m in SUITE.models])
def test_tagged_pages_computed_on_the_pool_device_equal_the_numpy_reference(model: SuiteModel) -> None:
    """Prefill tags and decode's expectation are computed where the pools live; their bits must be the
    host's."""
    import torch  # noqa: PLC0415 (the suite's pools are torch tensors; the CPU tests never import it)

    layout = RankLayout(model.spec, 2, 1, 8)  # rank 1 of 2: the shard of the second half of every segment
    tags = np.array([0, 1, 7, 4095, (1 << 40) + 3, (1 << 41) - 1], dtype=np.int64)
    for schema in (layout.attention_schema, layout.ssm_schema):
        on_device = tagged_shard(schema, 1, 3, torch.as_tensor(tags, device=SUITE.device))
        assert on_device.device.type == torch.device(SUITE.device).type
        assert np.array_equal(on_device.cpu().numpy(), tagged_shard(schema, 1, 3, tags))


def test_the_hybrid_model_pads_its_ssm_pages_so_the_byte_checks_cover_padding() -> None:
    spec = SUITE.model("nemotron-h").spec
    # the smallest multiple of 16 tokens whose attention page holds the SSM state
    assert spec.is_hybrid and spec.block_size == 1312
    for tp in (1, 2):
        layout = RankLayout(spec, tp, 0, 8)
        assert 0 < layout.ssm_padding_bytes < layout.page_bytes, "nothing to check in the SSM padding"


@pytest.mark.parametrize("pair", PAIRS, indirect=True, ids=PAIR_IDS)
def test_every_rank_creates_its_transport_on_its_worker_thread_with_the_pool_device_current(
    pair: Pair,
) -> None:
    """UCX registers VRAM against the creating thread's CUDA context: it must be the rank's device (host
    pools: none)."""
    expected_device = 0 if SUITE.device == "cuda" else None
    for engine in (pair.prefill, pair.decode):
        threads: list[dict[str, Any]] = engine.transport_threads()
        assert [t["thread"] for t in threads] == [
            f"transfer-worker-{engine.name}-{rank}" for rank in range(engine.tp)
        ]
        assert [t["cuda_device"] for t in threads] == [expected_device] * engine.tp, (
            "a rank's transport was created on a thread without its device's CUDA context (bind_cuda_device "
            "missing?)"
        )


@pytest.mark.parametrize("tokens", SUITE.tokens, ids=TOKEN_IDS)
@pytest.mark.parametrize("pair", PAIRS, indirect=True, ids=PAIR_IDS)
def test_push_writes_every_byte_of_a_scattered_request_and_nothing_else(
    pair: Pair, tokens: int, record_property: Any
) -> None:
    _move(pair, "push", tokens, record_property)


@pytest.mark.parametrize("tokens", SUITE.tokens, ids=TOKEN_IDS)
@pytest.mark.parametrize("pair", STAGED_PAIRS, indirect=True, ids=STAGED_IDS)
def test_a_staged_push_gathers_moves_and_scatters_every_byte_of_a_scattered_request_and_nothing_else(
    pair: Pair, tokens: int, record_property: Any
) -> None:
    """Prefill gathers into its staging slot on the GPU, one WRITE per rank pair crosses into decode's slot,
    decode scatters on the GPU before it reports: the direct push's checks, one descriptor per WRITE."""
    staged_before = _counts(pair.prefill, "writes_staged")
    _move(pair, "push", tokens, record_property)
    writes = [a - b for a, b in zip(_counts(pair.prefill, "writes_staged"), staged_before, strict=True)]
    assert writes == [max(1, pair.tps[1] // pair.tps[0])] * pair.tps[0]
    assert all(free == 2 for free in _counts(pair.decode, "staging_slots_free"))


@pytest.mark.parametrize("tokens", SUITE.tokens, ids=TOKEN_IDS)
@pytest.mark.parametrize("pair", PAIRS, indirect=True, ids=PAIR_IDS)
def test_pull_reads_every_byte_of_a_scattered_request_and_nothing_else(
    pair: Pair, tokens: int, record_property: Any
) -> None:
    _move(pair, "pull", tokens, record_property)


@pytest.mark.parametrize("tokens", SUITE.tokens, ids=TOKEN_IDS)
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("spanning_pair", SPANNING_PAIRS, indirect=True, ids=SPANNING_IDS)
def test_an_engine_spanning_two_nodes_and_a_single_node_peer_move_every_byte_and_nothing_else(
    spanning_pair: Pair, mode: str, tokens: int, record_property: Any
) -> None:
    """The checks of a single-node pair, the spanning engine's ranks reached through its first node's side
    channel, each at its own node's address."""
    _move(spanning_pair, mode, tokens, record_property)


@pytest.mark.parametrize("tokens", SUITE.tokens, ids=TOKEN_IDS)
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("two_gpu_pair", TWO_GPU_PAIRS, indirect=True, ids=TWO_GPU_IDS)
def test_ranks_on_their_own_gpus_move_every_byte_and_nothing_else(
    two_gpu_pair: Pair, mode: str, tokens: int, record_property: Any, request: pytest.FixtureRequest
) -> None:
    """Every rank created its transport with its own GPU current; the single-GPU checks hold across GPUs."""
    _, p_gpus, d_gpus, _ = request.node.callspec.params["two_gpu_pair"]
    for engine, gpus in ((two_gpu_pair.prefill, p_gpus), (two_gpu_pair.decode, d_gpus)):
        current = [t["cuda_device"] for t in engine.transport_threads()]
        assert current == (list(gpus) if SUITE.device == "cuda" else [None] * len(gpus))
    _move(two_gpu_pair, mode, tokens, record_property)
