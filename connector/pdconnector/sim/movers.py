"""Building a mock engine's KV mover: the connector core's transfer worker over a named transport.

The worker is imported only once an engine asks for a mover, so a co-located engine needs neither it nor NIXL;
``mover`` holds the interface and never imports an implementation.
"""

from __future__ import annotations

from pdconnector.sim.mover import KVMover
from pdconnector.sim.pool import KVDevice, KVPool


class MoverUnavailable(RuntimeError):
    pass


def create_mover(
    transport: str,
    *,
    pool: KVPool,
    engine_id: str,
    host: str,
    side_channel_port: int,
    lease_s: float,
    fence_s: float = 60.0,
) -> KVMover:
    """A mover over the connector core's transfer worker with the named transport (``mock``: TCP, ``nixl``:
    NIXL)."""
    reason = mover_unavailable_reason(transport, pool.device)
    if reason is not None:
        raise MoverUnavailable(reason)
    from pdconnector.sim.worker_mover import WorkerMover  # noqa: PLC0415 - checked importable above

    return WorkerMover(
        transport,
        pool=pool,
        engine_id=engine_id,
        host=host,
        side_channel_port=side_channel_port,
        lease_s=lease_s,
        fence_s=fence_s,
    )


def mover_unavailable_reason(transport: str, kv_device: KVDevice = KVDevice.CPU) -> str | None:
    """Why a mover over ``transport`` for pools on ``kv_device`` cannot be built here, or None when it can."""
    if kv_device is KVDevice.CUDA and transport != "nixl":
        # The mock transport copies registered memory through sockets with the CPU: it cannot read GPU memory.
        return f"--kv-device cuda needs --transport nixl (the {transport} transport moves host memory only)"
    try:
        import pdconnector.sim.worker_mover  # noqa: F401, PLC0415 - the connector core's worker and transports
    except ImportError as error:
        return f"the connector core's transfer worker or transports cannot be imported: {error}"
    if transport == "mock":
        return None
    if transport == "nixl":
        from pdconnector.transport import nixl_unavailable_reason  # noqa: PLC0415

        return nixl_unavailable_reason()
    return f"unknown transport {transport!r}; expected 'mock' or 'nixl'"
