"""KV transfers of real model layouts between two processes on one GPU over NIXL, against torch's device copy.

Run (on a GPU): ``python -m pdconnector.bench.gpu_transfer_bench REPORT_DIR [--tokens 1024,4096,16384]
[--repeat 5]``; writes ``REPORT_DIR/gpu-transfer-bench.json`` and prints one line per case.

Each case is one request of one TP rank of a model (Qwen3-32B and Llama-3.3-70B at TP 8,
NVIDIA-Nemotron-Nano-9B-v2 at TP 1, Nemotron-3-Super-120B at TP 4), its blocks contiguous or scattered over
the pools as in a long-running
engine, in vLLM's layer-outer cache (LBHNC, one descriptor per layer per block) and the connector's
block-outer one (BLHNC, one per block). The descriptors are the planner's (``plan_transfer``), posted through
the project's ``NixlTransport`` from this process into a target process's VRAM pool (push: WRITE) or read from
it (pull: READ). Figures, all medians over ``--repeat`` runs:

- ``post_to_done_ms``: from the post to the initiator seeing DONE; for WRITE also ``post_to_notified_ms``,
  until the target's transfer thread holds the notification (one monotonic clock for both processes).
- ``copy_ms``: ``torch`` copying the same number of bytes device to device, in the same run; ``vs_copy`` is
  the copy's time over the transfer's (1.0 = the transfer moves bytes as fast as a device copy).
- ``plan_cpu_ms``, ``post_cpu_ms``: the initiating thread's CPU time to plan the request and build its
  descriptors, and to post them; the transfer times start at the post.
- ``staged``: the scattered request on the connector's staged path (``pdconnector.worker.staging``): gathered
  on the GPU into a registered staging buffer (``gather_copy``), one WRITE of one descriptor into the
  target's staging buffer, scattered there by the target (``scatter_copy`` of the ``received_plan`` a decode
  rank computes from its own blocks) before it answers. ``post_to_scattered_ms`` runs from the gather's launch
  to the end of the target's scatter; ``prepare_cpu_ms`` is the thread's CPU time to plan the request and
  derive its copy, ``post_cpu_ms`` to launch the gather and post the WRITE (waits left out).
- ``volume``: for the hybrid models, the bytes one request moves engine-wide, naive (whole HMA-padded pages,
  whole logical blocks) against optimal (what the planner moves; one rank's share is each case's ``nbytes``).
- ``efa_model_ms``: the same descriptors and bytes on EFA, modelled as ``descriptors * --efa-descriptor-us +
  bytes / --efa-gbps`` (defaults: 2.44 us per descriptor, from a published 18,880-descriptor post taking 46
  ms, and 50 GB/s, one H200's share of a p5en's 3,200 Gb/s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from pdconnector.layout import (
    BlockPlacement,
    KVModel,
    LayerKind,
    RankLayout,
    model_from_hf_config,
    plan_transfer,
)
from pdconnector.layout.accounting import transfer_volume_table
from pdconnector.layout.known_models import (
    LLAMA_3_3_70B,
    NEMOTRON_3_SUPER_120B,
    NEMOTRON_NANO_9B_V2,
    QWEN3_32B,
)
from pdconnector.layout.staging import PathCosts, SlotCopy, gather_copy, received_plan, scatter_copy
from pdconnector.transport import Device, MemoryRegion, TransferState, Transport, create_transport
from pdconnector.worker.staging import RegionRows

POOL_SLACK = 2  # pools hold twice the largest request, so scattered blocks have free blocks between them
WARMUP = 2


@dataclass(frozen=True)
class BenchModel:
    """A published model as one TP rank of a deployment holds it."""

    config: Mapping[str, Any]  # HF config.json
    tp_size: int  # of the engine whose rank 0 is moved
    cache: Mapping[str, Any] = field(default_factory=dict)  # model_from_hf_config keywords: the KV cache's

    def kv_model(self) -> KVModel:
        return model_from_hf_config(self.config, tp_size=self.tp_size, **self.cache)


MODELS: dict[str, BenchModel] = {
    "qwen3-32b-tp8": BenchModel(QWEN3_32B, 8),
    "llama-3.3-70b-tp8": BenchModel(LLAMA_3_3_70B, 8),
    "nemotron-nano-9b-v2-tp1": BenchModel(NEMOTRON_NANO_9B_V2, 1),
    # Served as NVIDIA publishes it for Hopper (NVFP4 weights, FP8 KV cache), conv state in bf16, temporal
    # state fp32, blocks a multiple of 128 tokens: vLLM's hybrid rule then gives 4224-token blocks at TP 4,
    # one replicated KV head per rank.
    "nemotron-3-super-120b-tp4": BenchModel(
        NEMOTRON_3_SUPER_120B, 4, {"dtype_bytes": 1, "ssm_conv_dtype_bytes": 2, "kernel_alignment": 128}
    ),
}
PLACEMENTS = (BlockPlacement.LAYER_OUTER, BlockPlacement.BLOCK_OUTER)


@dataclass(frozen=True)
class Pools:
    """One process's pool for one (model, placement): every region carved from one registered VRAM buffer."""

    layout: RankLayout
    base: int  # address of region 0; region i follows region i - 1

    @cached_property
    def region_addrs(self) -> list[int]:
        starts = np.cumsum([0, *self.layout.region_nbytes[:-1]])
        return [self.base + int(s) for s in starts]

    def regions(self, memory: Memory) -> list[MemoryRegion]:
        return [
            memory.region_at(a, n) for a, n in zip(self.region_addrs, self.layout.region_nbytes, strict=True)
        ]


def pool_blocks(model: KVModel, tp_size: int, max_tokens: int) -> int:
    return POOL_SLACK * (-(-max_tokens // model.block_size) + len(RankLayout(model, tp_size, 0, 1).groups))


def request_blocks(layout: RankLayout, num_tokens: int, *, scattered: bool, seed: int) -> list[list[int]]:
    """Block ids per KV group: consecutive from 0, or a random draw from the whole pool (no id shared by two
    groups)."""
    counts = [
        -(-num_tokens // layout.model.block_size) if g.kind is LayerKind.ATTENTION else 1
        for g in layout.groups
    ]
    pool = (
        np.random.default_rng(seed).permutation(layout.num_blocks)
        if scattered
        else np.arange(layout.num_blocks)
    )
    bounds = np.cumsum([0, *counts])
    return [pool[a:b].tolist() for a, b in itertools.pairwise(bounds.tolist())]


# --------------------------------------------------------------------------------------------- target process


class Memory:
    """Where both processes keep their pools: VRAM of ``cuda:0``, or host memory (``cpu``: the same code, to
    try it where no GPU is)."""

    def __init__(self, device: str) -> None:
        import torch  # noqa: PLC0415 (the bench's processes need it; importing the module does not)

        self.torch, self.device = torch, device
        if device == "cuda":
            torch.cuda.set_device(0)

    def zeros(self, nbytes: int) -> Any:
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)

    def region(self, tensor: Any) -> MemoryRegion:
        return self.region_at(tensor.data_ptr(), tensor.numel())

    def region_at(self, addr: int, nbytes: int) -> MemoryRegion:
        return MemoryRegion(addr, nbytes, Device.VRAM if self.device == "cuda" else Device.DRAM, 0)

    def synchronize(self) -> None:
        """NIXL reads and writes the buffers outside torch's streams: this stream's kernels must have finished
        first. Only this stream: a device-wide synchronise would also wait for the copies UCX runs for WRITEs
        this process posted, so a gather could never overlap the previous chunk's WRITE."""
        if self.device == "cuda":
            self.torch.cuda.current_stream().synchronize()


def checksum(torch: Any, data: Any) -> int:
    """A position-weighted sum of ``data``'s bytes: equal for two buffers only if (nearly surely) every byte
    is the same at the same place."""
    weights = torch.arange(data.numel(), device=data.device) % 65521 + 1
    return int((data.to(torch.int64) * weights).sum())


def _target(conn: Connection, device: str, pool_bytes: int, staging_bytes: int) -> None:
    """The decode side: a pool and a staging buffer, registered; notifications timed as they arrive; a staged
    request scattered from the staging buffer into the pool when its notification arrives."""
    memory = Memory(device)
    torch = memory.torch
    pool, staging = memory.zeros(pool_bytes), memory.zeros(staging_bytes)
    agent = create_transport("nixl", f"bench-target-{time.monotonic_ns()}")
    agent.register([memory.region(pool), memory.region(staging)])
    conn.send((agent.metadata(), pool.data_ptr(), staging.data_ptr()))
    scatter: tuple[RegionRows, SlotCopy] | None = None
    while True:
        if conn.poll():
            command, payload = conn.recv()
            if command == "stop":
                break
            if command == "scatter":  # the request's regions (in this pool) and copy, before it is timed
                regions, copy = payload
                scatter = RegionRows(regions), copy
                conn.send("ready")
            elif command == "zero":
                pool.zero_()
                memory.synchronize()
                conn.send("ready")
            elif command == "checksum":  # the pool's bytes of a copy, gathered in the slot's order
                regions, copy = payload
                RegionRows(regions).gather(copy, staging)
                conn.send(checksum(torch, staging[: copy.nbytes]))
            continue
        for _peer, message in agent.take_notifications():
            arrived = time.monotonic()
            if message.startswith(b"staged-") and scatter is not None:
                rows, copy = scatter
                rows.scatter(copy, staging)
                memory.synchronize()
                conn.send((message.decode(), time.monotonic()))
            else:
                conn.send((message.decode(), arrived))
    agent.close()


# ----------------------------------------------------------------------------------------------- measurements


@dataclass
class Case:
    model: str
    placement: str
    tokens: int
    blocks: str  # contiguous | scattered
    operation: str  # write | read
    descriptors: int
    nbytes: int
    post_to_done_ms: float
    post_to_notified_ms: float | None
    copy_ms: float
    vs_copy: float
    plan_cpu_ms: float  # planning the request and building its descriptors
    post_cpu_ms: float  # the post call alone
    efa_model_ms: float
    verified: bool | None  # WRITE: the target's pool holds the planned bytes at the planned places
    staged: dict[str, Any] | None = None  # the scattered WRITE on the staged path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.memory, self.args = Memory(args.device), args
        self.efa = PathCosts(descriptor_us=args.efa_descriptor_us, link_gbps=args.efa_gbps)
        self.torch = torch = self.memory.torch
        self.max_tokens = max(args.tokens)
        self.pool_bytes = max(
            sum(RankLayout(spec, tp, 0, pool_blocks(spec, tp, self.max_tokens), p).region_nbytes)
            for spec, tp in self.models().values()
            for p in PLACEMENTS
        )
        # one request whole: pools hold POOL_SLACK times the largest
        self.staging_bytes = self.pool_bytes // POOL_SLACK + 2**20
        self.local = torch.randint(0, 256, (self.pool_bytes,), dtype=torch.uint8, device=args.device)
        self.local_staging = self.memory.zeros(self.staging_bytes)
        self.copy_dst = self.memory.zeros(self.pool_bytes)
        # What the operator renders for GPU engines on UCX: without it UCX emulates a READ between two
        # processes' VRAM over TCP where it sees no NVLink, as on a one-GPU machine (the target inherits it).
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        self.agent: Transport = create_transport("nixl", f"bench-initiator-{time.monotonic_ns()}")
        self.agent.register([self.memory.region(self.local), self.memory.region(self.local_staging)])
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.child = context.Process(
            target=_target, args=(child_end, args.device, self.pool_bytes, self.staging_bytes), daemon=True
        )
        self.child.start()
        if not self.conn.poll(120):
            raise RuntimeError("target process did not start within 120 s")
        metadata, self.remote_base, self.remote_staging = self.conn.recv()
        self.peer = self.agent.add_peer(metadata)
        self._arrivals: dict[str, float] = {}

    def models(self) -> dict[str, tuple[KVModel, int]]:
        return {
            name: (model.kv_model(), model.tp_size)
            for name, model in MODELS.items()
            if name in self.args.models
        }

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.child.join(20)
        if self.child.is_alive():
            self.child.kill()
        self.agent.close()

    # -- one posted transfer ---------------------------------------------------------------------------------

    def _wait(self, handle: Any) -> None:
        while (status := self.agent.state(handle)).state is TransferState.IN_PROGRESS:
            pass
        self.agent.release(handle)
        if status.state is not TransferState.DONE:
            raise RuntimeError(f"transfer failed: {status.error}")

    def _notified(self, expected: str) -> float:
        """When the target held notification ``expected`` (chunks in flight together may arrive in either
        order)."""
        deadline = time.monotonic() + 60
        while expected not in self._arrivals:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"target never saw notification {expected!r}")
            message, at = self.conn.recv()
            self._arrivals[message] = at
        return self._arrivals.pop(expected)

    def direct(
        self, operation: str, plan_of: Callable[[], Any], src: Pools, dst: Pools
    ) -> tuple[float, float | None, float, float, int, int]:
        """Median post-to-done and post-to-notified ms, plan and post CPU ms, descriptors and bytes."""
        done, notified, plan_cpu, post_cpu = [], [], [], []
        for i in range(WARMUP + self.args.repeat):
            tag = f"{operation}-{i}-{time.monotonic_ns()}"
            planned = time.thread_time()
            plan = plan_of()
            local, remote = plan.to_descriptors(src.region_addrs, dst.region_addrs)
            post = self.agent.write if operation == "write" else self.agent.read
            posting, start = time.thread_time(), time.monotonic()
            handle = post(self.peer, local, remote, tag.encode() if operation == "write" else b"")
            posted = time.thread_time()
            self._wait(handle)
            finished = time.monotonic()
            arrived = self._notified(tag) if operation == "write" else None
            if i >= WARMUP:
                done.append(finished - start)
                plan_cpu.append(posting - planned)
                post_cpu.append(posted - posting)
                if arrived is not None:
                    notified.append(arrived - start)
        median_notified = statistics.median(notified) * 1e3 if notified else None
        return (
            statistics.median(done) * 1e3,
            median_notified,
            statistics.median(plan_cpu) * 1e3,
            statistics.median(post_cpu) * 1e3,
            len(plan),
            plan.nbytes,
        )

    def staged(
        self, plan_of: Callable[[], Any], received_of: Callable[[], Any], src: Pools, dst: Pools
    ) -> dict[str, Any]:
        """Gather on this GPU into the staging buffer, one WRITE into the target's, scatter there."""
        rows = RegionRows(src.regions(self.memory))
        self._command("zero")
        scatter = (dst.regions(self.memory), scatter_copy(received_of()))
        if self._command("scatter", scatter) != "ready":
            raise RuntimeError("target did not take the scatter copy")
        times, prepare_cpu, post_cpu = [], [], []
        for i in range(WARMUP + self.args.repeat):
            tag = f"staged-{i}-{time.monotonic_ns()}"
            planning = time.thread_time()
            plan = plan_of()
            copy = gather_copy(plan)
            launching, start = time.thread_time(), time.monotonic()
            rows.gather(copy, self.local_staging)
            launched = time.thread_time()
            self.memory.synchronize()
            posting = time.thread_time()
            local = np.array([[self.local_staging.data_ptr(), plan.nbytes, 0]], dtype=np.int64)
            remote = np.array([[self.remote_staging, plan.nbytes, 0]], dtype=np.int64)
            handle = self.agent.write(self.peer, local, remote, tag.encode())
            posted = time.thread_time()
            self._wait(handle)
            scattered = self._notified(tag)
            if i >= WARMUP:
                times.append(scattered - start)
                prepare_cpu.append(launching - planning)
                post_cpu.append(launched - launching + posted - posting)
        return {
            "post_to_scattered_ms": round(statistics.median(times) * 1e3, 3),
            "verified": self.verified(plan_of(), src, dst),
            # What the cost model (fitted to an earlier H200 run) expects, next to what this run measured.
            "model_ms": round(PathCosts().staged_ms(plan.nbytes), 3),
            "row_bytes": copy.row_bytes,
            "prepare_cpu_ms": round(statistics.median(prepare_cpu) * 1e3, 3),
            "post_cpu_ms": round(statistics.median(post_cpu) * 1e3, 3),
            "staging_bytes_per_side": self.staging_bytes,
        }

    def _command(self, command: str, payload: Any = None) -> Any:
        self.conn.send((command, payload))
        if not self.conn.poll(120):
            raise RuntimeError(f"target did not answer {command!r}")
        return self.conn.recv()

    def verified(self, plan: Any, src: Pools, dst: Pools) -> bool:
        """Whether the target's pool holds, at the plan's destination, the bytes of its source here: both
        sides gathered in the destination's order and summed."""
        gather = gather_copy(plan)
        RegionRows(src.regions(self.memory)).gather(gather, self.local_staging)
        mine = checksum(self.torch, self.local_staging[: gather.nbytes])
        return mine == self._command("checksum", (dst.regions(self.memory), scatter_copy(plan)))

    def copy_ms(self, nbytes: int) -> float:
        times = []
        src, dst = self.local[:nbytes], self.copy_dst[:nbytes]
        for i in range(WARMUP + self.args.repeat):
            self.memory.synchronize()
            start = time.monotonic()
            dst.copy_(src)
            self.memory.synchronize()
            if i >= WARMUP:
                times.append(time.monotonic() - start)
        return statistics.median(times) * 1e3

    # -- the sweep -------------------------------------------------------------------------------------------

    def run(self) -> list[Case]:
        cases = []
        for name, (spec, tp) in self.models().items():
            for placement in PLACEMENTS:
                blocks = pool_blocks(spec, tp, self.max_tokens)
                src = Pools(RankLayout(spec, tp, 0, blocks, placement), self.local.data_ptr())
                dst = Pools(RankLayout(spec, tp, 0, blocks, placement), self.remote_base)
                for tokens in self.args.tokens:
                    for scattered in (False, True):
                        s_blocks = request_blocks(src.layout, tokens, scattered=scattered, seed=tokens)
                        d_blocks = request_blocks(dst.layout, tokens, scattered=scattered, seed=tokens + 1)

                        def plan_of(
                            s: Pools = src,
                            d: Pools = dst,
                            sb: Any = s_blocks,
                            db: Any = d_blocks,
                            n: int = tokens,
                        ) -> Any:
                            return plan_transfer(s.layout, d.layout, sb, db, num_tokens=n)

                        for operation in ("write", "read"):
                            if operation == "write":
                                self._command("zero")
                            done, notified, plan_cpu, post_cpu, descriptors, nbytes = self.direct(
                                operation, plan_of, src, dst
                            )
                            verified = self.verified(plan_of(), src, dst) if operation == "write" else None
                            copy = self.copy_ms(nbytes)
                            staged = None
                            if scattered and operation == "write" and self.args.staged:

                                def received_of(
                                    d: Pools = dst, db: Any = d_blocks, n: int = tokens, p_tp: int = tp
                                ) -> Any:
                                    return received_plan(d.layout, p_tp, 0, db, num_tokens=n)

                                staged = self.staged(plan_of, received_of, src, dst)
                            efa = self.efa.direct_ms(descriptors, nbytes)
                            case = Case(
                                name,
                                placement.value,
                                tokens,
                                "scattered" if scattered else "contiguous",
                                operation,
                                descriptors,
                                nbytes,
                                round(done, 3),
                                None if notified is None else round(notified, 3),
                                round(copy, 3),
                                round(copy / (notified or done), 3),
                                round(plan_cpu, 3),
                                round(post_cpu, 3),
                                round(efa, 3),
                                verified,
                                staged,
                            )
                            print(_line(case), flush=True)
                            cases.append(case)
        return cases


def volume_report(models: Sequence[str], tokens: Sequence[int]) -> dict[str, list[dict[str, Any]]]:
    """Per hybrid model, engine-wide bytes per request: naive (whole HMA-padded pages) against optimal (what
    the planner moves), as :mod:`pdconnector.layout.accounting` computes them for the model's deployment."""
    out = {}
    for name in models:
        model = MODELS[name]
        kv_model = model.kv_model()
        if kv_model.num_ssm_layers:
            rows = transfer_volume_table(kv_model, tokens, tp_size=model.tp_size)
            out[name] = [
                {**asdict(row), "naive": row.naive, "optimal": row.optimal, "saved": row.saved}
                for row in rows
            ]
            for row in rows:
                print(
                    f"{name}: {row.num_tokens} tokens, block {kv_model.block_size}: naive "
                    f"{row.naive / 2**20:.1f} MiB, optimal {row.optimal / 2**20:.1f} MiB, saved "
                    f"{row.saved / 2**20:.1f} MiB (engine-wide, TP {model.tp_size})",
                    flush=True,
                )
    return out


HEADER = (
    f"{'model':<28}{'cache':<12}{'tokens':>7}  "
    f"{'blocks':<11}{'op':<6}{'descs':>7}{'MiB':>8}{'ms':>9}{'notif ms':>9}{'copy ms':>8}"
    f"{'vs copy':>8}{'plan ms':>8}{'post ms':>8}{'staged':>10}{'EFA ms':>8}"
)


def _line(c: Case) -> str:
    notified = f"{c.post_to_notified_ms:>9.3f}" if c.post_to_notified_ms is not None else f"{'-':>9}"
    staged = f"{c.staged['post_to_scattered_ms']:>10.3f}" if c.staged else f"{'-':>10}"
    return (
        f"{c.model:<28}{c.placement:<12}{c.tokens:>7}  "
        f"{c.blocks:<11}{c.operation:<6}{c.descriptors:>7}{c.nbytes / 2**20:>8.1f}"
        f"{c.post_to_done_ms:>9.3f}{notified}{c.copy_ms:>8.3f}{c.vs_copy:>8.3f}{c.plan_cpu_ms:>8.2f}{c.post_cpu_ms:>8.2f}{staged}{c.efa_model_ms:>8.2f}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: host memory, to try the bench without a GPU",
    )
    parser.add_argument(
        "--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[1024, 4096, 16384]
    )
    parser.add_argument("--models", type=lambda v: v.split(","), default=list(MODELS))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-staged", dest="staged", action="store_false")
    parser.add_argument("--efa-descriptor-us", type=float, default=2.44)
    parser.add_argument("--efa-gbps", type=float, default=50.0, help="GB/s of EFA per GPU")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown} (known: {sorted(MODELS)})")
    bench = Bench(args)
    try:
        print(HEADER, flush=True)
        cases = bench.run()
    finally:
        bench.close()
    args.report_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "report_dir"},
        "cases": [asdict(c) for c in cases],
        "volume": volume_report(args.models, args.tokens),
    }
    (args.report_dir / "gpu-transfer-bench.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
