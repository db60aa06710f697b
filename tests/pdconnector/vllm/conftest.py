"""Fixtures for real vLLM engine tests: tiny models written once per session, engines always stopped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdconnector.sim.tiny_model import TinyModel, write_tiny_model

from tests.pdconnector.vllm.harness import EngineLauncher, VllmServer, launch_server, stop_all


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def dense_model(tiny_models_root: Path) -> Path:
    """A tiny Llama (hidden 128, 2 layers, 4 heads / 2 KV heads, head_dim 32, vocab 1024) with seeded
    weights."""
    return write_tiny_model(tiny_models_root / "dense", TinyModel.DENSE)


@pytest.fixture(scope="session")
def hybrid_model(tiny_models_root: Path) -> Path:
    """A tiny NemotronH (pattern ``M-M*-``: two Mamba2 mixers, one attention layer) with seeded weights."""
    return write_tiny_model(tiny_models_root / "hybrid", TinyModel.HYBRID)


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture
def launch_engine(engine_log_dir: Path) -> Iterator[EngineLauncher]:
    """``launch_engine(name, model_dir, **launch_server kwargs)``: starts a server (not yet healthy); stopped
    after the test."""
    started: list[VllmServer] = []

    def launch(name: str, model_dir: Path, **kwargs: Any) -> VllmServer:
        server = launch_server(name, model_dir, engine_log_dir, **kwargs)
        started.append(server)
        return server

    try:
        yield launch
    finally:
        stop_all(started)
