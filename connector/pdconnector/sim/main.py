"""``pd-mock-engine``: a vLLM stand-in (OpenAI endpoints, kv_transfer_params, KV pools in host or GPU memory,
no model)."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from pdconnector.protocol.liveness import LivenessProbe, fence_seconds
from pdconnector.protocol.params import EngineRole
from pdconnector.router.logs import configure_logging
from pdconnector.sim.engine import (
    COLOCATED,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    EngineSettings,
    MockEngine,
)
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.movers import create_mover, mover_unavailable_reason
from pdconnector.sim.pool import KVDevice, KVPool, kv_device_unavailable_reason
from pdconnector.sim.scheduler import LatencyModel
from pdconnector.sim.server import create_engine_app

log = logging.getLogger("pdconnector.sim")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-mock-engine", description=__doc__)
    parser.add_argument("--role", choices=[*(r.value for r in EngineRole), COLOCATED], required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument(
        "--side-channel-host", default="127.0.0.1", help="address peers use for KV transfers (the pod IP)"
    )
    parser.add_argument("--side-channel-port", type=int, default=5600)
    parser.add_argument("--transport", choices=["mock", "nixl"], default="mock")
    parser.add_argument(
        "--kv-device",
        choices=[d.value for d in KVDevice],
        default=KVDevice.CPU.value,
        help="where the KV pools live: host memory, or GPU memory (rank r on cuda:r modulo the GPUs; needs "
        "--transport nixl)",
    )
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--compat-hash",
        default=None,
        help="advertised on /health so the router pairs only compatible engines",
    )
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help="most tokens one request spans, prompt plus output (vLLM's --max-model-len); longer requests "
        "get a 400",
    )
    parser.add_argument(
        "--prefill-seconds-per-token",
        type=float,
        default=0.0,
        help="prefill compute per prompt token; one prompt at a time (an engine's prefill throughput)",
    )
    parser.add_argument("--decode-seconds-per-token", type=float, default=0.0, help="one decode step alone")
    parser.add_argument(
        "--batch-slowdown",
        type=float,
        default=0.0,
        help="a decode step's extra time per other running request, as a fraction of one step",
    )
    parser.add_argument(
        "--kv-wait",
        type=float,
        default=0.0,
        help="seconds a request waits for KV blocks while the pool is full (vLLM keeps it waiting); 0: a 503 "
        "at once",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help="requests generating at once (vLLM's --max-num-seqs); more wait",
    )
    parser.add_argument(
        "--transfer-timeout", type=float, default=30.0, help="seconds a decode leg waits for its KV"
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=30.0,
        help="seconds a prefill holds exported blocks for a decode engine",
    )
    parser.add_argument(
        "--fence",
        type=float,
        default=None,
        help="seconds decode keeps a failed push's blocks for a prefill that never answers (default: from "
        "--transfer-timeout)",
    )
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    return parser


def _context_problem(max_model_len: int, num_blocks: int, block_size: int) -> str | None:
    """Like vLLM, refuse a context length that the KV pool could not hold for even one request."""
    if max_model_len < 2:
        return (
            f"--max-model-len {max_model_len}: a request needs room for at least one prompt and one "
            "output token"
        )
    if max_model_len > num_blocks * block_size:
        return (
            f"--max-model-len {max_model_len} is more than the KV pool holds (--num-blocks {num_blocks} x "
            f"--block-size {block_size} = "
            f"{num_blocks * block_size} tokens): one request could not fit"
        )
    return None


def _capacity_problem(args: argparse.Namespace) -> str | None:
    if args.max_num_seqs < 1:
        return f"--max-num-seqs {args.max_num_seqs}: must be at least 1"
    for flag in ("prefill_seconds_per_token", "decode_seconds_per_token", "batch_slowdown", "kv_wait"):
        if getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)}: must not be negative"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    role = None if args.role == COLOCATED else EngineRole(args.role)
    kv_device = KVDevice(args.kv_device)
    # Checked before any memory is allocated, so a bad combination fails the same way on every machine.
    problem = _context_problem(args.max_model_len, args.num_blocks, args.block_size)
    if problem is None:
        problem = _capacity_problem(args)
    if problem is None and role is not None:
        problem = mover_unavailable_reason(args.transport, kv_device)
    if problem is None and (reason := kv_device_unavailable_reason(kv_device)) is not None:
        problem = f"--kv-device {kv_device.value}: {reason}"
    if problem is not None:
        print(f"pd-mock-engine: {problem}", file=sys.stderr)
        return 2
    pool = KVPool(args.num_blocks, args.block_size, args.tp_size, kv_device)
    mover = None
    if role is not None:
        mover = create_mover(
            args.transport,
            pool=pool,
            engine_id=args.engine_id,
            host=args.side_channel_host,
            side_channel_port=args.side_channel_port,
            lease_s=args.lease,
            fence_s=args.fence
            if args.fence is not None
            else fence_seconds(args.transfer_timeout, LivenessProbe()),
        )
    settings = EngineSettings(
        role=role,
        engine_id=args.engine_id,
        latency=LatencyModel(
            args.prefill_seconds_per_token, args.decode_seconds_per_token, args.batch_slowdown
        ),
        transfer_timeout_s=args.transfer_timeout,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_wait_s=args.kv_wait,
    )
    engine = MockEngine(settings, pool, mover, EngineMetrics(pool, mover))
    log.info(
        "pd-mock-engine starting",
        extra={
            "role": args.role,
            "port": args.port,
            "engine_id": args.engine_id,
            "transport": args.transport,
            "kv_device": kv_device.value,
        },
    )
    web.run_app(
        create_engine_app(engine, args.model, args.compat_hash),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=None,
        access_log=None,
        shutdown_timeout=5.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
