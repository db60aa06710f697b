"""Which device a rank's memory lives on, and which CUDA device its transfer thread works on.

The device-id transfers themselves (rank N's regions on device N, every descriptor naming it) run in
``test_transfers.py``; here the worker's own rules: one device per rank, and a VRAM rank's thread bound to
that device before its agent exists.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pdconnector.layout import RankLayout
from pdconnector.transport import Device, MemoryRegion, TransportError
from pdconnector.transport.base import Transport
from pdconnector.transport.mock import MockTransport
from pdconnector.worker import TransferWorker, WorkerConfig
from pdconnector.worker import transfer_worker as transfer_worker_module

from tests.pdconnector.worker.engines import MODELS


def _host_regions(
    layout: RankLayout, device: Device, device_id: int
) -> tuple[list[np.ndarray], list[MemoryRegion]]:
    pools = [np.zeros(region.nbytes, dtype=np.uint8) for region in layout.regions]
    return pools, [MemoryRegion(pool.ctypes.data, pool.nbytes, device, device_id) for pool in pools]


def test_a_rank_whose_regions_span_two_devices_is_refused() -> None:
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    _pools, regions = _host_regions(layout, Device.DRAM, 0)
    regions[1] = MemoryRegion(regions[1].addr, regions[1].nbytes, Device.DRAM, 1)
    with pytest.raises(ValueError, match=r"must live on one device, got \['DRAM:0', 'DRAM:1'\]"):
        TransferWorker(
            layout, regions, lambda: MockTransport("unused"), config=WorkerConfig(engine_id="prefill-0")
        )


def test_a_vram_rank_binds_its_thread_to_its_device_before_creating_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX takes the CUDA context of the thread that creates the agent and registers VRAM: it must be the
    rank's."""
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    _pools, regions = _host_regions(layout, Device.VRAM, 3)
    events: list[tuple[str, int | None, int]] = []
    monkeypatch.setattr(
        transfer_worker_module,
        "bind_cuda_device",
        lambda device_id: events.append(("bind", device_id, threading.get_ident())),
    )

    def factory() -> Transport:
        events.append(("create", None, threading.get_ident()))
        # host memory cannot pose as VRAM past this point
        raise RuntimeError("stop after the agent would be created")

    worker = TransferWorker(
        layout, regions, factory, config=WorkerConfig(engine_id="decode-0", start_timeout_s=5)
    )
    with pytest.raises(RuntimeError, match="stop after the agent would be created"):
        worker.start()
    worker.close()
    assert [(kind, device) for kind, device, _ in events] == [("bind", 3), ("create", None)]
    # both on the worker's thread, not the caller's
    assert events[0][2] == events[1][2] != threading.get_ident()


def test_a_host_memory_rank_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    _pools, regions = _host_regions(layout, Device.DRAM, 0)
    monkeypatch.setattr(
        transfer_worker_module, "bind_cuda_device", lambda device_id: pytest.fail(f"bound device {device_id}")
    )
    worker = TransferWorker(
        layout, regions, lambda: MockTransport("prefill-0-r0"), config=WorkerConfig(engine_id="prefill-0")
    )
    try:
        assert worker.start().device_id == 0
    finally:
        worker.close()


def test_vram_without_a_cuda_device_fails_at_start_with_the_reason() -> None:
    import torch  # noqa: PLC0415 (the engine extra installs it; only this test needs it)

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device; the GPU suite covers VRAM ranks")
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    _pools, regions = _host_regions(layout, Device.VRAM, 0)
    worker = TransferWorker(
        layout,
        regions,
        lambda: MockTransport("unused"),
        config=WorkerConfig(engine_id="decode-0", start_timeout_s=5),
    )
    with pytest.raises(
        RuntimeError, match="VRAM regions on device 0, but CUDA is not available in this process"
    ):
        worker.start()
    worker.close()


def test_a_transport_whose_registration_fails_is_closed_and_the_start_error_names_it() -> None:
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    _pools, regions = _host_regions(layout, Device.DRAM, 0)
    created: list[MockTransport] = []

    def factory() -> Transport:
        transport = MockTransport("prefill-0-r0")
        transport.register = lambda _regions: (_ for _ in ()).throw(
            TransportError("registration refused by the test")
        )  # type: ignore[method-assign]
        created.append(transport)
        return transport

    worker = TransferWorker(
        layout, regions, factory, config=WorkerConfig(engine_id="prefill-0", start_timeout_s=5)
    )
    with pytest.raises(RuntimeError, match="transport start failed: registration refused by the test"):
        worker.start()
    worker.close()
    created[0].bind_to_current_thread()  # the worker thread is gone; look at the agent from here
    with pytest.raises(TransportError, match="called after close"):
        created[0].metadata()
