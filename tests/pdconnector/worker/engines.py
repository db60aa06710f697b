"""Test engines: one engine's TP ranks (a :class:`EngineTransfers`) over synthetic, guarded, tagged KV pools.

The same :class:`Engine` runs inside the test process or inside an engine process
(``engine_process.py``, driven through :class:`EngineProcess` with the same methods), so the
in-process matrix and the cross-process runs share one implementation.

Pools: every region sits between two guard runs that are never registered; prefill regions
hold tagged content (``layout.synthetic``), decode regions start filled with ``DECODE_FILL``.
A check compares the decode pools with an independently computed expectation (the prefill
block ids as tags, written at decode's block ids into a copy filled the same way), so bytes
written wrongly, bytes not written and bytes written outside the request all show up.
The pools are numpy host arrays, or torch tensors on ``device`` (``vram.PoolMemory``: ``"cuda"``
registers VRAM); tagging and checks run on that device.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from pdconnector.layout import (
    AttentionSpec,
    BlockPlacement,
    KVModel,
    LayerKind,
    RankLayout,
    SsmSpec,
    model_from_hf_config,
    write_tagged_blocks,
)
from pdconnector.layout.staging import TransferPath
from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.protocol.rendezvous import RendezvousLimits
from pdconnector.transport.base import Transport
from pdconnector.transport.factory import create_transport
from pdconnector.worker import EngineTransfers, WorkerConfig
from pdconnector.worker.identity import EngineInfo, RankInfo, layout_summary
from pdconnector.worker.staging import StagingConfig

from tests.pdconnector.worker.nodes import NODE_HOSTS, EngineNode
from tests.pdconnector.worker.vram import PoolMemory

A, S = LayerKind.ATTENTION, LayerKind.SSM
GUARD_BYTES = 256
GUARD_FILL = 0x5A
DECODE_FILL = 0xA5
_ATTENTION = AttentionSpec(num_kv_heads=4, head_dim=8, dtype_bytes=2)
_SSM_COMMON = {"conv_kernel": 4, "conv_dtype_bytes": 2, "state_dtype_bytes": 4}

MODELS: dict[str, KVModel] = {
    "dense": KVModel((A, A, A), block_size=16, attention=_ATTENTION),
    # Hybrid Mamba2 (DS conv layout) with a kernel block half the logical block: attention moves physical
    # blocks.
    "mamba2": KVModel(
        (S, A, S, A),
        block_size=32,
        kernel_block_size=16,
        attention=_ATTENTION,
        ssm=SsmSpec.mamba2(num_heads=8, head_dim=4, n_groups=4, state_size=4, **_SSM_COMMON),
    ),
    "gdn": KVModel(
        (S, S, A, S),
        block_size=32,
        attention=_ATTENTION,
        ssm=SsmSpec.gdn(num_k_heads=4, num_v_heads=8, head_k_dim=4, head_v_dim=4, **_SSM_COMMON),
    ),
    # Two KV heads: at TP 4 each rank holds a replica of one, and of the prefill ranks writing into a decode
    # rank only the first holding a head sends it.
    "dense_two_heads": KVModel(
        (A, A, A), block_size=16, attention=AttentionSpec(num_kv_heads=2, head_dim=8, dtype_bytes=2)
    ),
    # The dense model with wider heads: a decode engine of a different model than its prefill engine.
    "dense_wide": KVModel(
        (A, A, A), block_size=16, attention=AttentionSpec(num_kv_heads=4, head_dim=16, dtype_bytes=2)
    ),
    # Mamba1 moves its state only between equal TP sizes; two SSM groups and one attention group.
    "mamba1": KVModel(
        (S, S, A),
        block_size=16,
        attention=_ATTENTION,
        ssm=SsmSpec.mamba1(intermediate_size=16, state_size=4, **_SSM_COMMON),
    ),
    # Real-sized attention pages (256 KiB per block): a request's WRITE outgrows every socket buffer on
    # loopback.
    "dense_large": KVModel(
        (A, A, A, A), block_size=16, attention=AttentionSpec(num_kv_heads=8, head_dim=128, dtype_bytes=2)
    ),
}


def request_blocks(model: KVModel, num_blocks: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Distinct block ids per KV group for one request: attention groups one per started logical block, SSM
    groups one."""
    groups = RankLayout(model, 1, 0, num_blocks).groups
    counts = [-(-num_tokens // model.block_size) if g.kind is A else 1 for g in groups]
    ids = np.random.default_rng(seed).permutation(num_blocks)[: sum(counts)].tolist()
    out, start = [], 0
    for count in counts:
        out.append(sorted(ids[start : start + count]) if seed % 2 else ids[start : start + count])
        start += count
    return out


def _staging_config(staging: StagingConfig | dict[str, Any] | None) -> StagingConfig:
    """A staging config as given, or from its JSON form (``nbytes``, ``slots``, ``path``) across processes."""
    if staging is None or isinstance(staging, StagingConfig):
        return staging or StagingConfig()
    path = staging.get("path")
    return StagingConfig(staging["nbytes"], staging.get("slots", 2), TransferPath(path) if path else None)


class Engine:
    """One engine: ``tp`` ranks, each with guarded pools and a transfer worker.

    ``model``: a name in :data:`MODELS` or an HF ``config.json`` (dict); ``device``: None for numpy host
    pools, else the torch device of every pool (all ranks share it), or a list: each hosted rank's own (a GPU
    engine's rank ``r`` on ``cuda:r``); ``first_device_id``: rank ``r`` registers
    its host pools as device ``first_device_id + r``, standing in for a GPU engine's ``cuda:r`` where no GPU
    is; ``placement``: where every rank's block pages sit (a :class:`~pdconnector.layout.BlockPlacement`
    value, as vLLM's KV cache layout decides); ``staging``: every rank's staging buffer and path
    (:class:`~pdconnector.worker.staging.StagingConfig` or its JSON form); ``ranks``: the ranks of the engine
    this process hosts, on the node at ``host`` (default all of them: a single-node engine with its own side
    channel; otherwise one node of an engine larger than a node, :mod:`tests.pdconnector.worker.nodes`, which
    :meth:`join` completes); ``side_channel_port``: the engine's side-channel port (0: a free one; the nodes
    of one engine are all given the port their first node serves on, as every pod of a vLLM engine is)."""

    def __init__(
        self,
        name: str,
        model: str | dict[str, Any],
        *,
        tp: int,
        num_blocks: int,
        transport: str,
        limits: dict[str, float] | None = None,
        fence_s: float = 60.0,
        transport_options: dict[str, Any] | None = None,
        device: str | list[str] | None = None,
        first_device_id: int = 0,
        worker_options: dict[str, float] | None = None,
        placement: str = BlockPlacement.LAYER_OUTER.value,
        staging: StagingConfig | dict[str, Any] | None = None,
        ranks: list[int] | None = None,
        host: str = NODE_HOSTS[0],
        side_channel_port: int = 0,
    ) -> None:
        self.model = MODELS[model] if isinstance(model, str) else model_from_hf_config(model)
        self.tp = tp
        hosted = list(range(tp)) if ranks is None else ranks
        devices = device if isinstance(device, list) else [device] * len(hosted)
        if len(devices) != len(hosted):
            raise ValueError(f"device: {len(devices)} devices for the {len(hosted)} ranks hosted here")
        self.layouts = [
            RankLayout(self.model, tp, rank, num_blocks, BlockPlacement(placement)) for rank in hosted
        ]
        self.memories = [PoolMemory(d) for d in devices]  # per hosted rank, as the layouts
        memory_of = dict(zip(hosted, self.memories, strict=True))
        self.buffers = [
            [memory.full(r.nbytes + 2 * GUARD_BYTES, GUARD_FILL) for r in lay.regions]
            for lay, memory in zip(self.layouts, self.memories, strict=True)
        ]
        self.pools = [[buf[GUARD_BYTES:-GUARD_BYTES] for buf in bufs] for bufs in self.buffers]
        self.reset()
        self._results: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._changed = threading.Condition()
        self._transport_threads: dict[int, dict[str, Any]] = {}
        suffix = uuid.uuid4().hex[:8]

        def factory(rank: int) -> Transport:
            # Called on the rank's worker thread: what that thread looks like when the agent comes to exist.
            self._transport_threads[rank] = {
                "thread": threading.current_thread().name,
                "cuda_device": memory_of[rank].current_device(),
            }
            return create_transport(transport, f"{name}-r{rank}-{suffix}", **(transport_options or {}))  # type: ignore[arg-type]

        regions = [
            [memory.region(p) for p in pools] for pools, memory in zip(self.pools, self.memories, strict=True)
        ]
        if first_device_id:
            regions = [
                [replace(r, device_id=first_device_id + local_rank) for r in rank_regions]
                for local_rank, rank_regions in enumerate(regions)
            ]
        limits = limits or {}
        config = WorkerConfig(
            engine_id=name,
            host=host,
            side_channel_port=side_channel_port,
            limits=RendezvousLimits(**limits),
            pull_lease_s=limits.get("registration_lease_s", 30.0),
            fence_s=fence_s,
            staging=_staging_config(staging),
            **(worker_options or {}),
        )
        plumbing = {
            "num_blocks": num_blocks,
            "regions": regions,
            "transport_factory": factory,
            "config": config,
            "on_result": self._wake,
            "placement": BlockPlacement(placement),
        }
        self.transfers: EngineTransfers | EngineNode = (
            EngineTransfers(self.model, tp_size=tp, **plumbing)
            if ranks is None
            else EngineNode(self.model, tp_size=tp, ranks=ranks, **plumbing)
        )

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> dict[str, Any] | list[dict[str, Any]]:
        """A whole engine: its coordinates. One node of an engine: its ranks' info, for :meth:`join`."""
        if isinstance(self.transfers, EngineNode):
            return [msgspec.to_builtins(rank) for rank in self.transfers.start()]
        self.transfers.start()
        return asdict(self.transfers.coordinates)

    def join(self, ranks: list[dict[str, Any]], serve: bool, incarnation: str) -> dict[str, Any] | None:
        """One node of an engine: every node's ranks are known (``ranks``, engine-wide, in rank order), and
        the engine's ``incarnation``; the first node (``serve``) runs the side channel and returns the
        engine's coordinates."""
        assert isinstance(self.transfers, EngineNode)
        info = EngineInfo(
            self.transfers.config.engine_id,
            self.tp,
            layout_summary(self.model),
            tuple(msgspec.convert(rank, RankInfo) for rank in ranks),
            incarnation=incarnation,
        )
        coordinates = self.transfers.join(info, serve=serve)
        return asdict(coordinates) if coordinates is not None else None

    def close(self) -> None:
        self.transfers.close()
        # An engine host process outlives its engines: give their pools back to the device, not to torch's
        # cache, where the next engine's differently sized pools could not use them.
        self.pools, self.buffers = [], []
        for memory in set(self.memories):
            memory.release()

    # --- pools ----------------------------------------------------------------------------------------------

    def fill(self, blocks: list[list[int]], num_tokens: int) -> None:
        """Write the tagged content of ``blocks`` (tags = the block ids) on every rank, as a prefill would
        compute it."""
        for layout, pools in zip(self.layouts, self.pools, strict=True):
            write_tagged_blocks(layout, pools, blocks, blocks, num_tokens=num_tokens)
        self._synchronize()

    def check(self, received: list[dict[str, Any]]) -> dict[str, int]:
        """Compare every rank's pools with the expectation after the transfers in ``received`` ({dst, src,
        num_tokens}).

        Returns the number of differing bytes inside the regions and outside them (guards)."""
        wrong = guards = 0
        for layout, pools, buffers, memory in zip(
            self.layouts, self.pools, self.buffers, self.memories, strict=True
        ):
            expected = self._expected(layout, memory, received)
            wrong += sum(memory.count_different(a, b) for a, b in zip(expected, pools, strict=True))
            guards += sum(
                int((buf[:GUARD_BYTES] != GUARD_FILL).sum()) + int((buf[-GUARD_BYTES:] != GUARD_FILL).sum())
                for buf in buffers
            )
        return {"wrong_bytes": wrong, "guard_bytes": guards}

    def differences(self, received: list[dict[str, Any]], limit: int = 12) -> list[dict[str, int]]:
        """The first ``limit`` pages that differ from the expectation of :meth:`check` (rank, region, block,
        bytes): where a failed check went wrong."""
        found = []
        for layout, pools, memory in zip(self.layouts, self.pools, self.memories, strict=True):
            rank = layout.tp_rank
            expected = self._expected(layout, memory, received)
            for region, (want, got) in enumerate(zip(expected, pools, strict=True)):
                per_block = memory.count_different(want, got, layout.block_stride)
                found += [
                    {"rank": rank, "region": region, "block": b, "bytes": int(n)}
                    for b, n in enumerate(per_block)
                    if n
                ]
                if len(found) >= limit:
                    return found[:limit]
        return found

    @staticmethod
    def _expected(layout: RankLayout, memory: PoolMemory, received: list[dict[str, Any]]) -> list[Any]:
        expected = [memory.full(r.nbytes, DECODE_FILL) for r in layout.regions]
        for transfer in received:
            write_tagged_blocks(
                layout, expected, transfer["dst"], transfer["src"], num_tokens=transfer["num_tokens"]
            )
        return expected

    def reset(self) -> None:
        for pools in self.pools:
            for pool in pools:
                pool[:] = DECODE_FILL
        self._synchronize()

    def _synchronize(self) -> None:
        for memory in set(self.memories):
            memory.synchronize()

    def transport_threads(self) -> list[dict[str, Any]]:
        """Per rank, the thread its transport was created on: its name and the device of its current CUDA
        context (:meth:`PoolMemory.current_device`)."""
        return [self._transport_threads[layout.tp_rank] for layout in self.layouts]

    # --- transfers (every rank) -----------------------------------------------------------------------------

    def prefill_finished(
        self, transfer_id: str, blocks: list[list[int]], num_tokens: int, pull: bool = False
    ) -> None:
        for worker in self.transfers.workers:
            worker.prefill_finished(transfer_id, blocks, num_tokens, pull=pull)

    def expect_push(
        self,
        transfer_id: str,
        *,
        prefill: dict[str, Any],
        blocks: list[list[int]],
        num_tokens: int,
        timeout_s: float,
        attempt: int = 0,
        cached_blocks: int = 0,
    ) -> None:
        coordinates = PrefillCoordinates(**prefill)
        for worker in self.transfers.workers:
            worker.expect_push(
                transfer_id,
                coordinates,
                blocks,
                num_tokens,
                timeout_s=timeout_s,
                attempt=attempt,
                cached_blocks=cached_blocks,
            )

    def read(
        self,
        transfer_id: str,
        *,
        prefill: dict[str, Any],
        remote_blocks: list[list[int]],
        blocks: list[list[int]],
        num_tokens: int,
        timeout_s: float,
    ) -> None:
        for worker in self.transfers.workers:
            worker.read(
                transfer_id,
                PrefillCoordinates(**prefill),
                remote_blocks,
                blocks,
                num_tokens,
                timeout_s=timeout_s,
            )

    def cancel(self, transfer_id: str) -> None:
        for worker in self.transfers.workers:
            worker.cancel(transfer_id, "cancelled by the test")

    def abandon(self, transfer_id: str, *, prefill: dict[str, Any]) -> None:
        for worker in self.transfers.workers:
            worker.abandon(transfer_id, PrefillCoordinates(**prefill), "abandoned by the test")

    def prewarm(self, prefill: dict[str, Any]) -> None:
        self.transfers.client.prewarm(PrefillCoordinates(**prefill)).result(timeout=10)

    def wait(self, transfer_id: str, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's result for ``transfer_id``, waiting up to ``timeout_s`` for all of them (fewer if they
        do not come)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._collect()
                results = self._results[transfer_id]
                remaining = deadline - time.monotonic()
                if len({r["rank"] for r in results}) >= len(self.layouts) or remaining <= 0:
                    return [dict(r) for r in results]
                self._changed.wait(min(remaining, 0.05))

    def stats(self) -> list[dict[str, int]]:
        return [worker.stats() for worker in self.transfers.workers]

    def wait_stat(self, name: str, value: int, timeout_s: float) -> bool:
        """Wait until every rank counted ``name`` at least ``value`` times."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.get(name, 0) >= value for s in self.stats()):
                return True
            time.sleep(0.005)
        return False

    def idle_cpu(self, seconds: float) -> float:
        """CPU seconds this process spends over ``seconds`` of wall time while the test waits."""
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start

    def _collect(self) -> None:
        for layout, worker in zip(self.layouts, self.transfers.workers, strict=True):
            for result in worker.results():
                entry = {
                    "rank": layout.tp_rank,
                    "kind": result.kind.value,
                    "outcome": result.outcome,
                    "detail": result.detail,
                    "nbytes": result.nbytes,
                    "stages": result.stages,
                }
                self._results[result.transfer_id].append(entry)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class EngineHost:
    """A process hosting :class:`Engine` s (one NIXL/UCX start-up per process, many engines); calls go as JSON
    lines over stdin/stdout."""

    PREFIX = "@@"

    def __init__(self, log: Path | None = None) -> None:
        """``log``: a file that receives the process's stderr (NIXL, UCX and worker logs); discarded without
        one."""
        repo = Path(__file__).resolve().parents[3]
        # Keep the caller's path: where packages live outside site-packages (the GPU machine's wheels) comes
        # through it.
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "connector"), *inherited])}
        with contextlib.ExitStack() as files:
            stderr = files.enter_context(log.open("ab")) if log is not None else subprocess.DEVNULL
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.pdconnector.worker.engine_process"],
                cwd=repo,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def create(self, name: str, model: str | dict[str, Any], *, tp: int, **options: Any) -> RemoteEngine:
        """An :class:`Engine` in the process; ``options`` are its keyword arguments (JSON-serialisable)."""
        self.call("", "init", rpc_timeout_s=90, name=name, model=model, tp=tp, **options)
        return RemoteEngine(self, name, tp)

    def warm_nixl(self) -> None:
        """Pay NIXL's one-off start-up (plugin loading, UCX set-up: seconds, far more on a loaded machine)
        before any test's clock runs."""
        self.call("", "warm_nixl", rpc_timeout_s=300)

    def call(self, engine: str, method: str, rpc_timeout_s: float = 120, **kwargs: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.poll() is not None:
            raise RuntimeError(
                f"engine process {self.pid} already exited (code {self.process.returncode}); cannot call "
                f"{method}"
            )
        self.process.stdin.write(json.dumps({"engine": engine, "method": method, "kwargs": kwargs}) + "\n")
        self.process.stdin.flush()
        timer = threading.Timer(rpc_timeout_s, self.kill)
        timer.start()
        try:
            for line in self.process.stdout:
                if line.startswith(self.PREFIX):
                    reply = json.loads(line[len(self.PREFIX) :])
                    if "error" in reply:
                        raise RuntimeError(f"engine process {method}: {reply['error']}")
                    return reply["result"]
        finally:
            timer.cancel()
        raise RuntimeError(f"engine process exited during {method} (exit code {self.process.poll()})")

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): its sockets stay open but nothing reads or writes them."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(RuntimeError, OSError):
                self.call("", "exit", rpc_timeout_s=30)
        self.kill()


@contextlib.contextmanager
def warm_hosts(logs: Path | None = None) -> Iterator[tuple[EngineHost, EngineHost]]:
    """A prefill and a decode engine process with NIXL started in both (``logs``: where their stderr goes)."""
    prefill = EngineHost(log=logs / "prefill.log" if logs else None)
    decode = EngineHost(log=logs / "decode.log" if logs else None)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(EngineHost.warm_nixl, (prefill, decode)))
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


class RemoteEngine:
    """An :class:`Engine` inside an :class:`EngineHost`: the same methods, keyword arguments only."""

    def __init__(self, host: EngineHost, name: str, tp: int) -> None:
        self.host = host
        self.name = name
        self.tp = tp

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda **kwargs: self.host.call(self.name, method, **kwargs)
