"""Where the connector tests' vLLM engines run: the CPU (the default, and CI's) or this machine's GPU.

``PD_VLLM_TEST_DEVICE=cuda`` runs the same tests with the engines' model and KV cache in GPU memory and our
connector moving KV from VRAM to VRAM (``kv_buffer_device: cuda``); scripts/gpu-suite.sh's ``connector`` step
sets it on the GPU machine, after scripts/gpu-vllm.sh installed vLLM there and wrote that machine's site
(``PDCTL_SITE``: the attention backend that loads there and the start-up workarounds, as ``pdctl up`` reads
them).

On the GPU each engine gets a fixed KV cache (``--kv-cache-memory-bytes``) instead of a share found by
profiling: vLLM's profiling counts a neighbour's memory as its own, so engines sharing one GPU had to start
one after the other; with the cache size given they start side by side, as on the CPU.
"""

from __future__ import annotations

import os
from enum import StrEnum

DEVICE_ENV = "PD_VLLM_TEST_DEVICE"
GPU_KV_CACHE_BYTES = 1 << 30  # tens of thousands of the tiny models' blocks: more than any test holds
# What vLLM checks against the free memory at start (weights, activations, the cache above): a few engines of
# these tiny models fit side by side on one GPU.
GPU_MEMORY_UTILIZATION = 0.05


class EngineDevice(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


def engine_device() -> EngineDevice:
    value = os.environ.get(DEVICE_ENV, EngineDevice.CPU.value)
    try:
        return EngineDevice(value)
    except ValueError:
        choices = [device.value for device in EngineDevice]
        raise ValueError(f"{DEVICE_ENV}={value!r}: expected one of {choices}") from None


ENGINE_DEVICE = engine_device()
ON_GPU = ENGINE_DEVICE is EngineDevice.CUDA
# vLLM's default block size on each device (the CPU backend's for dense models, CUDA's): the tests' prompts
# sit around it.
DEFAULT_BLOCK_SIZE = 16 if ON_GPU else 128


def device_engine_env() -> dict[str, str]:
    """What an engine on this device needs in its environment beyond vLLM's defaults."""
    if not ON_GPU:
        # nobind: vLLM's automatic binding pins every CPU engine's worker to core 0, so two engines and their
        # transfer threads share one core and transfers stall.
        return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    from pdoperator.local.gpu import load_site  # noqa: PLC0415 - only the GPU machine has a site

    # Triton's dot product rounds float32 inputs to TF32 unless told otherwise; the comparisons with
    # co-located output are made at float32 precision, and TF32 noise differs between a request computed
    # alone and one computed in a batch.
    return {**load_site().engine_env, "TRITON_F32_DEFAULT": "ieee"}


def device_engine_args() -> list[str]:
    """Engine flags for this device (after the harness's own, so the site's backend choice applies)."""
    if not ON_GPU:
        return []
    from pdoperator.local.gpu import load_site  # noqa: PLC0415

    return [
        *load_site().gpu_engine_args,
        "--gpu-memory-utilization",
        str(GPU_MEMORY_UTILIZATION),
        "--kv-cache-memory-bytes",
        str(GPU_KV_CACHE_BYTES),
    ]
