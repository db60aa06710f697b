"""Fixtures shared by every suite: the real kubectl and helm binaries."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
K8S_TOOLS = REPO / ".cache" / "k8s-tools" / "bin"


def _k8s_tool(name: str) -> Path:
    path = K8S_TOOLS / name
    if not path.exists():
        # `make test` fetches them first; this covers a bare `pytest` run.
        subprocess.run([str(REPO / "scripts" / "fetch-k8s-tools.sh")], check=True)
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    return _k8s_tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return _k8s_tool("kubectl")
