"""pdctl down: stop what `pdctl up` started for a PDService."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdoperator.local import default_state_dir, down

from .render import InputError
from .up import load_single
from .validate import EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="the PDService file given to pdctl up"
    )
    parser.add_argument("--state-dir", type=Path, metavar="DIR", help="the state directory given to pdctl up")


def run(args: argparse.Namespace) -> int:
    try:
        pds = load_single(args.filename)
    except InputError as error:
        print("\n".join(error.messages), file=sys.stderr)
        return error.exit_code
    stopped = down(args.state_dir or default_state_dir(pds.namespace, pds.name))
    print(
        f"{pds.namespace}/{pds.name}: stopped {len(stopped)} processes"
        + (f" ({', '.join(stopped)})" if stopped else "")
    )
    return EXIT_OK
