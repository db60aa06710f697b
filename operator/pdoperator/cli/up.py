"""pdctl up: run a PDService on this machine without a cluster.

The same rendering the operator applies, turned into local processes: the router and the
prefill/decode engines (mock engines, or real vLLM with ``--engine vllm``), each "pod" on its
own loopback address with the ports, engine ids and router config the operator would give it.
Prints the router's endpoint and returns; `pdctl down` stops everything `up` started.

``--autoscale`` (a PDService with spec.autoscaling) stays in the foreground running the operator's
autoscaler: engine processes start and stop as it decides, until Ctrl-C or SIGTERM, which stop everything.

``--engine vllm`` without ``--model-dir`` runs the tiny dense model (seeded weights, word-level
tokenizer), written once into the state directory.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from pdconnector.sim.tiny_model import TinyModel, write_tiny_model

from pdoperator.api import ConnectorImpl, PDService, Runtime, SpecError, TransferMode
from pdoperator.api.autoscaling import AutoscalingEngine
from pdoperator.local import LocalRunError, default_state_dir, down, local_variant, up
from pdoperator.local.autoscaler import ROUNDS_FILE, LocalAutoscaler, local_plan, starting_scale

from .render import InputError, load_pdservices
from .validate import EXIT_INVALID, EXIT_OK, EXIT_UNREADABLE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, metavar="FILE", help="a file with one PDService")
    parser.add_argument("--mode", choices=[mode.value for mode in TransferMode], help="override spec.mode")
    parser.add_argument(
        "--engine",
        choices=[runtime.value for runtime in Runtime],
        help="override spec.engine.runtime (vllm: real vLLM engines)",
    )
    parser.add_argument(
        "--connector",
        choices=[impl.value for impl in ConnectorImpl],
        help="override spec.engine.connector (vllm: upstream's NIXL connectors)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        metavar="DIR",
        help="the model vLLM engines load (default: the tiny dense model)",
    )
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="stay in the foreground and scale the engines as spec.autoscaling says (Ctrl-C stops all)",
    )
    parser.add_argument(
        "--autoscale-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between autoscaler rounds (default 2)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="where logs and the state file go (default .pdctl/<ns>.<name>)",
    )


def load_single(path: str) -> PDService:
    sources = load_pdservices(path)
    if len(sources) != 1:
        raise InputError([f"{path}: holds {len(sources)} PDServices; pdctl up runs one at a time"])
    return sources[0].pds


def _tiny_model(state_dir: Path) -> Path:
    model_dir = state_dir / "tiny-model"
    if not (model_dir / "config.json").exists():
        print(f"writing the tiny dense model into {model_dir}")
        write_tiny_model(model_dir, TinyModel.DENSE)
    return model_dir


def _load(args: argparse.Namespace) -> tuple[PDService, bool]:
    """The PDService with the command line's overrides, and whether it runs the tiny vLLM model."""
    pds = load_single(args.filename)
    # --engine vllm alone runs the tiny model, in float32: bfloat16 tiny models crash vLLM's CPU worker on
    tiny = args.engine == Runtime.VLLM.value and args.model_dir is None
    try:
        pds = local_variant(
            pds,
            mode=args.mode,
            runtime=args.engine,
            connector=args.connector,
            dtype="float32" if tiny else None,
        )
    except SpecError as error:
        raise InputError(
            [f"{args.filename} (with the command line's overrides): {problem}" for problem in error.errors],
            EXIT_INVALID,
        ) from error
    if problem := _autoscale_problem(args, pds):
        raise InputError([f"{args.filename}: {problem}"], EXIT_INVALID)
    return pds, tiny


def _autoscale_problem(args: argparse.Namespace, pds: PDService) -> str | None:
    if not args.autoscale:
        return None
    if pds.spec.autoscaling is None:
        return "--autoscale needs spec.autoscaling"
    if pds.spec.autoscaling.engine is not AutoscalingEngine.BUILTIN:
        engine = pds.spec.autoscaling.engine
        return f"--autoscale runs the builtin autoscaler, not spec.autoscaling.engine {engine}"
    if args.autoscale_interval <= 0:
        return f"--autoscale-interval {args.autoscale_interval}: must be positive"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        pds, tiny = _load(args)
    except InputError as error:
        print("\n".join(error.messages), file=sys.stderr)
        return error.exit_code
    state_dir = args.state_dir or default_state_dir(pds.namespace, pds.name)
    scale = starting_scale(pds) if args.autoscale else None
    try:
        model_dir = _tiny_model(state_dir) if tiny else args.model_dir
        plan = local_plan(pds, scale, state_dir, model_dir)
        processes = up(plan, state_dir)
    except LocalRunError as error:
        print(f"{args.filename}: {error}", file=sys.stderr)
        return EXIT_INVALID
    except (OSError, RuntimeError, TimeoutError) as error:
        print(f"{pds.namespace}/{pds.name}: could not start: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    for process in processes:
        print(f"{process.name:<24} pid {process.pid:<8} {process.url}")
    print(
        f"{pds.namespace}/{pds.name} is up in {pds.spec.mode.value} mode: {plan.endpoint}/v1  (logs in "
        f"{state_dir})",
        flush=True,
    )
    if scale is not None:
        autoscaler = LocalAutoscaler(pds, state_dir, scale, model_dir, args.autoscale_interval)
        print(f"autoscaling; each round in {state_dir / ROUNDS_FILE}; Ctrl-C stops everything", flush=True)
        try:
            asyncio.run(_autoscale(autoscaler))
        finally:
            down(state_dir)
    return EXIT_OK


async def _autoscale(autoscaler: LocalAutoscaler) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    await autoscaler.run(stopping)
