"""pdctl render: the manifests the operator would apply for PDService files, as YAML.

Like ``helm template``: a multi-document stream on stdout, or one file per object with
``--output-dir``. Every document must be a PDService that passes ``pdctl validate``;
problems are reported the same way, one line each with the file, the document and the
field path. Exit status: 0 rendered, 1 invalid input, 2 a file could not be read or
written. No input ends in a traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdoperator.api import PDService, SpecError, load_documents, parse_pdservice
from pdoperator.render import RenderDefaults, render_pdservice
from pdoperator.render.manifest_yaml import dump_manifest, dump_manifests

from .validate import EXIT_INVALID, EXIT_OK, EXIT_UNREADABLE, STDIN


class InputError(Exception):
    """PDService input that cannot be rendered; ``messages`` name file, document and field, ``exit_code``
    follows pdctl validate."""

    def __init__(self, messages: list[str], exit_code: int = EXIT_INVALID) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages
        self.exit_code = exit_code


@dataclass(frozen=True)
class Source:
    """One validated PDService and the file (and document) it came from."""

    path: str
    pds: PDService


def load_pdservices(path: str) -> list[Source]:
    """Every PDService of a file (``-`` is stdin), validated; all problems of all documents at once.

    Every document must be a PDService: what would be rendered is never a guess.
    """
    shown = "<stdin>" if path == STDIN else path
    try:
        raw = sys.stdin.buffer.read() if path == STDIN else Path(path).read_bytes()
    except OSError as error:
        raise InputError([f"{shown}: cannot read: {error.strerror or error}"], EXIT_UNREADABLE) from error
    try:
        documents = load_documents(raw)
    except SpecError as error:
        raise InputError([f"{shown}: {problem}" for problem in error.errors]) from error
    if not documents:
        raise InputError([f"{shown}: no PDService documents"])
    sources: list[Source] = []
    messages: list[str] = []
    for index, document in enumerate(documents, start=1):
        where = shown if len(documents) == 1 else f"{shown}: document {index}"
        try:
            sources.append(Source(path=where, pds=parse_pdservice(document)))
        except SpecError as error:
            messages += [f"{where}: {problem}" for problem in error.errors]
    if messages:
        raise InputError(messages)
    return sources


def write_output_dir(directory: Path, objects: list[dict[str, Any]]) -> list[Path]:
    """One file per object, ``<kind>-<name>.yaml`` (unique within a namespace)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for obj in objects:
        target = directory / f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        target.write_text(f"---\n{dump_manifest(obj)}", encoding="utf-8")
        written.append(target)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="PDService manifest(s), YAML; - reads stdin"
    )
    parser.add_argument(
        "--output-dir", type=Path, metavar="DIR", help="write one file per object into DIR instead of stdout"
    )


def run(args: argparse.Namespace) -> int:
    try:
        sources = load_pdservices(args.filename)
    except InputError as error:
        for message in error.messages:
            print(message, file=sys.stderr)
        return error.exit_code
    defaults = RenderDefaults()
    objects = [obj for source in sources for obj in render_pdservice(source.pds, defaults)]
    if args.output_dir is None:
        sys.stdout.write(dump_manifests(objects))
        return EXIT_OK
    try:
        written = write_output_dir(args.output_dir, objects)
    except OSError as error:
        print(f"{args.output_dir}: cannot write: {error.strerror or error}", file=sys.stderr)
        return EXIT_UNREADABLE
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK
