"""pdctl up: run a PDService on this machine without a cluster.

The same rendering the operator applies, turned into local processes: the router and the
prefill/decode mock engines, each "pod" on its own loopback address with the ports,
engine ids and router config the operator would give it. Prints the router's endpoint
and returns; `pdctl down` stops everything `up` started.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdoperator.api import Mode, PDService
from pdoperator.local import LocalRunError, default_state_dir, plan_local_run, up
from pdoperator.render import RenderDefaults, render_pdservice

from .render import InputError, load_pdservices
from .validate import EXIT_INVALID, EXIT_OK, EXIT_UNREADABLE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, metavar="FILE", help="a file with one PDService (runtime mock)")
    parser.add_argument("--mode", choices=[mode.value for mode in Mode], help="override spec.mode")
    parser.add_argument("--state-dir", type=Path, metavar="DIR", help="where logs and the state file go (default .pdctl/<ns>.<name>)")


def load_single(path: str) -> PDService:
    sources = load_pdservices(path)
    if len(sources) != 1:
        raise InputError([f"{path}: holds {len(sources)} PDServices; pdctl up runs one at a time"])
    return sources[0].pds


def with_mode(pds: PDService, mode: str | None) -> PDService:
    if mode is None:
        return pds
    return pds.model_copy(update={"spec": pds.spec.model_copy(update={"mode": Mode(mode)})})


def run(args: argparse.Namespace) -> int:
    try:
        pds = with_mode(load_single(args.filename), args.mode)
    except InputError as error:
        print("\n".join(error.messages), file=sys.stderr)
        return error.exit_code
    state_dir = args.state_dir or default_state_dir(pds.namespace, pds.name)
    try:
        plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir)
        processes = up(plan, state_dir)
    except LocalRunError as error:
        print(f"{args.filename}: {error}", file=sys.stderr)
        return EXIT_INVALID
    except (OSError, RuntimeError, TimeoutError) as error:
        print(f"{pds.namespace}/{pds.name}: could not start: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    for process in processes:
        print(f"{process.name:<24} pid {process.pid:<8} {process.url}")
    print(f"{pds.namespace}/{pds.name} is up in {pds.spec.mode.value} mode: {plan.endpoint}/v1  (logs in {state_dir})")
    return EXIT_OK
