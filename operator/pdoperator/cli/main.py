"""pdctl: the command line of pd-operator.

Each subcommand lives in its own module and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them together, so no command can
crash with a traceback on bad input (``run`` turns errors into messages and exit codes).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module under pdoperator.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": (
        "validate",
        "validate PDService manifests; errors name the field (exit 1 on an invalid spec)",
    ),
    "render": ("render", "print the manifests the operator would apply, as YAML"),
    "crd": ("crd", "print the PDService CRD generated from pdoperator.api"),
    "up": ("up", "run a PDService on this machine as local processes (mock engines), print its endpoint"),
    "down": ("down", "stop what pdctl up started"),
    "demo": ("demo", "the main job on the embedded default: validate and render every example and summarise"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdctl", description="pd-operator command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"pdoperator.cli.{module_name}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
