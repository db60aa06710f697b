"""The CUDA device a thread works on, for the transports that register and move VRAM.

UCX (under NIXL) takes the CUDA context current on the thread that creates the agent and registers memory; on
a thread with none it falls back to host-staged copies or registers against device 0's context, so rank N's
``cuda:N`` memory would move slowly or not at all. The transfer worker therefore binds its thread to the
rank's device before it creates the transport. torch is imported here only when VRAM is in use: host-memory
engines (and CI) never need it.
"""

from __future__ import annotations

from pdconnector.transport.base import TransportError


def bind_cuda_device(device_id: int) -> None:
    """Make ``cuda:device_id`` the calling thread's current device (and create its primary context)."""
    try:
        import torch  # noqa: PLC0415 (only VRAM users need torch)
    except ImportError as error:
        raise TransportError(
            f"VRAM regions on device {device_id} need torch to set the thread's CUDA device: {error}"
        ) from None
    if not torch.cuda.is_available():
        raise TransportError(f"VRAM regions on device {device_id}, but CUDA is not available in this process")
    if not 0 <= device_id < torch.cuda.device_count():
        raise TransportError(
            f"VRAM regions on device {device_id}, but this process sees {torch.cuda.device_count()} CUDA "
            "device(s)"
        )
    torch.cuda.set_device(device_id)
    # set_device is lazy in recent torch; touching the device creates the context UCX looks for.
    torch.cuda.current_stream(device_id).synchronize()
