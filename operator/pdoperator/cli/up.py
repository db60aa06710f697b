"""pdctl up: run a PDService on this machine without a cluster.

The same rendering the operator applies, turned into local processes: the router and the
prefill/decode engines (mock engines, or real vLLM with ``--engine vllm``), each "pod" on its
own loopback address with the ports, engine ids and router config the operator would give it.
Prints the router's endpoint and returns; `pdctl down` stops everything `up` started.

``--engine vllm`` without ``--model-dir`` runs the tiny dense model (seeded weights, word-level
tokenizer), written once into the state directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdconnector.sim.tiny_model import TinyModel, write_tiny_model

from pdoperator.api import ConnectorImpl, PDService, Runtime, SpecError, TransferMode
from pdoperator.local import LocalRunError, default_state_dir, local_variant, plan_local_run, up
from pdoperator.render import RenderDefaults, render_pdservice

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


def run(args: argparse.Namespace) -> int:
    try:
        pds = load_single(args.filename)
        # --engine vllm alone runs the tiny model, in float32: bfloat16 tiny models crash vLLM's CPU worker on
        tiny = args.engine == Runtime.VLLM.value and args.model_dir is None
        pds = local_variant(
            pds,
            mode=args.mode,
            runtime=args.engine,
            connector=args.connector,
            dtype="float32" if tiny else None,
        )
    except InputError as error:
        print("\n".join(error.messages), file=sys.stderr)
        return error.exit_code
    except SpecError as error:
        print(
            "\n".join(
                f"{args.filename} (with the command line's overrides): {problem}" for problem in error.errors
            ),
            file=sys.stderr,
        )
        return EXIT_INVALID
    state_dir = args.state_dir or default_state_dir(pds.namespace, pds.name)
    try:
        model_dir = _tiny_model(state_dir) if tiny else args.model_dir
        plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir, model_dir=model_dir)
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
        f"{state_dir})"
    )
    return EXIT_OK
