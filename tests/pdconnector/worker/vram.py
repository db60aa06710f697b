"""Engine pools on a device, and the GPU suite's configuration (``test_vram_transfers.py``).

:class:`PoolMemory` is where an :class:`~tests.pdconnector.worker.engines.Engine` keeps its pools: numpy host
arrays (the default, what the CPU tests use) or torch tensors on a device, ``"cuda"`` registering VRAM and
``"cpu"`` the same code over DRAM. Tagging and checking run where the pools live (``layout.synthetic``), so
GBs of VRAM are never copied to the host.

:func:`gpu_suite` reads the environment: ``PD_GPU_SUITE_DEVICE`` (``cuda`` by default; ``cpu`` runs the suite
on host memory with smaller sizes, to debug it without a GPU) and ``PD_GPU_SUITE_LOG_DIR`` (where engine
processes write their stderr; a pytest temporary directory otherwise).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pdconnector.layout import KVModel, model_from_hf_config
from pdconnector.layout.known_models import NEMOTRON_NANO_9B_V2, QWEN3_32B
from pdconnector.transport.base import Device, MemoryRegion

DEVICE_ENV = "PD_GPU_SUITE_DEVICE"
LOG_DIR_ENV = "PD_GPU_SUITE_LOG_DIR"
_CUDA_SUCCESS = 0


@dataclass(frozen=True)
class PoolMemory:
    """Where pools live: ``device`` None is numpy host memory, otherwise a torch device (``"cpu"``,
    ``"cuda"``)."""

    device: str | None = None

    @cached_property
    def _torch(self) -> Any:
        import torch  # noqa: PLC0415 (host pools never need torch)

        return torch

    @property
    def is_vram(self) -> bool:
        return self.device is not None and self._torch.device(self.device).type == "cuda"

    def full(self, nbytes: int, fill: int) -> Any:
        """A flat uint8 buffer of ``nbytes`` set to ``fill``."""
        if self.device is None:
            return np.full(nbytes, fill, dtype=np.uint8)
        return self._torch.full((nbytes,), fill, dtype=self._torch.uint8, device=self.device)

    def count_different(self, a: Any, b: Any, row_bytes: int | None = None) -> Any:
        """Bytes where two equal-sized buffers differ, in all (an int) or per row of ``row_bytes`` (a
        list)."""
        if row_bytes is not None:
            differ = (a != b).reshape(-1, row_bytes)
            return (
                np.count_nonzero(differ, axis=1)
                if self.device is None
                else self._torch.count_nonzero(differ, dim=1)
            ).tolist()
        if self.device is None:
            return int(np.count_nonzero(a != b))
        # In 256 MiB slices: torch counts through an int64 copy of the mask.
        step = 1 << 28
        return sum(
            int(self._torch.count_nonzero(a[i : i + step] != b[i : i + step]))
            for i in range(0, a.numel(), step)
        )

    def region(self, pool: Any) -> MemoryRegion:
        """What the transport registers for ``pool``: VRAM of the tensor's CUDA device, or DRAM."""
        if self.device is None:
            return MemoryRegion(pool.ctypes.data, pool.nbytes)
        if self.is_vram:
            return MemoryRegion(pool.data_ptr(), pool.numel(), Device.VRAM, pool.device.index)
        return MemoryRegion(pool.data_ptr(), pool.numel())

    def release(self) -> None:
        """Return the cached memory of freed pools to the device."""
        if self.is_vram:
            self._torch.cuda.empty_cache()

    def synchronize(self) -> None:
        """Wait for the kernels that wrote the pools: NIXL reads and writes them outside torch's streams."""
        if self.is_vram:
            self._torch.cuda.synchronize(self.device)

    def current_device(self) -> int | None:
        """The device of the CUDA context current on the calling thread (what UCX registers VRAM against), or
        None when the thread has none; always None for host pools, which need none."""
        if not self.is_vram:
            return None
        driver = ctypes.CDLL("libcuda.so.1")
        context, device = ctypes.c_void_p(), ctypes.c_int()
        if driver.cuCtxGetCurrent(ctypes.byref(context)) != _CUDA_SUCCESS or not context.value:
            return None
        return device.value if driver.cuCtxGetDevice(ctypes.byref(device)) == _CUDA_SUCCESS else None


@dataclass(frozen=True)
class SuiteModel:
    """A model of the suite as its HF ``config.json`` (what the engine processes build it from) and its pool
    sizes."""

    name: str
    config: Mapping[str, Any]
    # prefill, decode: room for the largest request with free blocks scattered between
    num_blocks: tuple[int, int]

    @cached_property
    def spec(self) -> KVModel:
        return model_from_hf_config(self.config)


@dataclass(frozen=True)
class GpuSuite:
    device: str  # the torch device of every pool
    tokens: tuple[int, ...]  # request sizes
    models: tuple[SuiteModel, ...]
    skip_reason: str | None
    log_dir: Path | None  # where engine processes write their stderr

    def model(self, name: str) -> SuiteModel:
        return next(m for m in self.models if m.name == name)

    def devices(self, indices: tuple[int, ...]) -> list[str]:
        """The pool device of each rank placed on GPU ``indices[r]`` (``cpu`` stands in for every GPU)."""
        return [f"cuda:{i}" if self.device == "cuda" else self.device for i in indices]

    def gpus_missing_reason(self, count: int) -> str | None:
        """Why tests that place ranks on ``count`` GPUs cannot run (None: they can; on ``cpu`` they always
        run, every GPU standing in as host memory)."""
        if self.device != "cuda" or self.skip_reason is not None:
            return self.skip_reason
        import torch  # noqa: PLC0415 (only CUDA runs get here)

        seen = torch.cuda.device_count()
        return None if seen >= count else f"needs {count} CUDA devices, this machine has {seen}"


def gpu_suite(env: Mapping[str, str] = os.environ) -> GpuSuite:
    device = env.get(DEVICE_ENV, "cuda")
    log_dir = Path(env[LOG_DIR_ENV]) if env.get(LOG_DIR_ENV) else None
    if device == "cuda":
        # Nemotron-H: block size 1312 tokens (its 5.3 MB SSM state padded into 1312 tokens of attention), 4
        # regions.
        models = (
            SuiteModel("qwen3-32b", QWEN3_32B, (1280, 1536)),
            SuiteModel("nemotron-h", NEMOTRON_NANO_9B_V2, (40, 48)),
        )
        return GpuSuite(device, (1024, 16384), models, _cuda_unavailable_reason(), log_dir)
    if device != "cpu":
        raise ValueError(f"{DEVICE_ENV} must be 'cuda' (the default) or 'cpu', got {device!r}")
    # Host memory on a small machine: the same head sizes, fewer layers, 1k tokens.
    pattern = NEMOTRON_NANO_9B_V2["hybrid_override_pattern"]
    first_attention = pattern.index("*") + 1
    models = (
        SuiteModel("qwen3-32b", {**QWEN3_32B, "num_hidden_layers": 4}, (80, 96)),
        SuiteModel(
            "nemotron-h",
            {**NEMOTRON_NANO_9B_V2, "hybrid_override_pattern": pattern[:first_attention]},
            (12, 16),
        ),
    )
    return GpuSuite(device, (1024,), models, None, log_dir)


def _cuda_unavailable_reason() -> str | None:
    try:
        import torch  # noqa: PLC0415 (host-only runs never need torch)
    except ImportError as error:
        return f"needs a CUDA device (torch is not importable: {error})"
    return None if torch.cuda.is_available() else "needs a CUDA device"
