"""Fixtures shared by every suite: the real kubectl and helm binaries, and the real CRD-serving API server;
Hypothesis's settings for the whole suite."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from tests.k8s.real_server import RealApiServer

# No per-example deadline: on CI's loaded 2-core machine one example stalled by a neighbour's process would
# fail a property that holds (what is checked is the property, never its speed).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

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


@pytest.fixture(scope="session")
def real_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApiServer]:
    """One real CRD-serving API server for the session (``tests/k8s/real_server.py``); tests keep to their own
    namespaces and objects. Never skipped: `make test` builds it, and a bare run says how."""
    # Imported here: the GPU machine runs this conftest without the Kubernetes test tools (kmock).
    from tests.k8s.real_server import RealApiServer  # noqa: PLC0415

    with RealApiServer(tmp_path_factory.mktemp("real-apiserver")) as server:
        yield server
