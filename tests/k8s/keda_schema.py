"""KEDA ScaledObjects checked against KEDA's own schema (its CRD compiled to validators by
@kubernetes-models/keda), run by Node.js from ``.cache/keda-schema`` (``scripts/fetch-keda-schema.sh``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO / ".cache" / "keda-schema"


def scaled_object_errors(objects: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Per object, its schema errors (``/spec/minReplicaCount: must be integer``); empty lists when valid."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed: the KEDA schema check needs Node.js")
    # `make test` fetches it first; this covers a bare `pytest` run (and copies a changed check.mjs).
    subprocess.run([str(REPO / "scripts" / "fetch-keda-schema.sh")], check=True, capture_output=True)
    result = subprocess.run(
        [node, str(SCHEMA_DIR / "check.mjs")],
        input=json.dumps(list(objects)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)
