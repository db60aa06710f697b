"""``pdctl crd``: print the PDService CustomResourceDefinition generated from ``pdoperator.api``.

``make crd`` writes this output to ``crds/pdservices.inference.pdoperator.dev.yaml``.
"""

from __future__ import annotations

import argparse
import sys

from pdoperator.api import crd_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the CRD has exactly one rendering."""


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0
