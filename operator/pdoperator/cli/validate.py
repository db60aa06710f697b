"""``pdctl validate -f FILE``: check PDService manifests the way the API server and the operator will.

Prints ``OK <namespace>/<name>`` for each valid PDService on stdout and one line per
problem on stderr (``<file>: <namespace>/<name>: <field path>: <message>``).
Documents of other kinds (a Secret next to the PDService) are listed as SKIP.
Exit status: 0 all valid, 1 something invalid, 2 a file could not be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from pdoperator.api import GROUP, KIND, SpecError, load_documents, parse_pdservice
from pdoperator.api.errors import path_key

STDIN = "-"
EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML file with one or more PDService documents ('-' reads stdin); repeatable",
    )


def _label(document: dict[str, Any], index: int) -> str:
    """``<namespace>/<name>`` of a document, or ``document N`` when it has no usable name."""
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    namespace = (metadata.get("namespace") if isinstance(metadata, dict) else None) or "default"
    if not isinstance(name, str) or not name:
        return f"document {index}"
    return f"{path_key(str(namespace))}/{path_key(name)}"


def _is_other_kind(document: dict[str, Any]) -> bool:
    """A document that does not even claim to be a PDService (neither our kind nor our API group)."""
    api_version = document.get("apiVersion")
    group = api_version.split("/")[0] if isinstance(api_version, str) and "/" in api_version else None
    return document.get("kind") != KIND and group != GROUP


def _read(filename: str) -> bytes:
    return sys.stdin.buffer.read() if filename == STDIN else Path(filename).read_bytes()


def validate_file(filename: str, out: TextIO, err: TextIO) -> int:
    """Validate every document of one file, printing results; returns the file's exit status."""
    shown = "<stdin>" if filename == STDIN else filename
    try:
        raw = _read(filename)
    except OSError as error:
        print(f"{shown}: cannot read: {error.strerror or error}", file=err)
        return EXIT_UNREADABLE
    try:
        documents = load_documents(raw)
    except SpecError as error:
        for problem in error.errors:
            print(f"{shown}: {problem}", file=err)
        return EXIT_INVALID

    status, pdservices = EXIT_OK, 0
    for index, document in enumerate(documents, start=1):
        label = _label(document, index)
        if _is_other_kind(document):
            kind = f"{document.get('apiVersion')} {document.get('kind')}"
            print(f"SKIP {shown}: {label}: {path_key(kind)} is not a PDService", file=out)
            continue
        pdservices += 1
        try:
            parsed = parse_pdservice(document)
        except SpecError as error:
            for problem in error.errors:
                print(f"{shown}: {label}: {problem}", file=err)
            status = EXIT_INVALID
        else:
            print(f"OK {parsed.namespace}/{parsed.name}", file=out)
    if pdservices == 0:
        print(f"{shown}: no PDService documents ({KIND}, apiVersion {GROUP}/...)", file=err)
        status = EXIT_INVALID
    return status


def run(args: argparse.Namespace) -> int:
    return max(validate_file(filename, sys.stdout, sys.stderr) for filename in args.files)
