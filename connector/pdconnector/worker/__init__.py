"""The background transfer worker (one thread per engine rank owning its transport) and the engine-level side
channel.

``transfer_worker`` (:class:`TransferWorker`: the thread, its inbox and loop), ``commands`` (what an
engine asks of it), ``prefill_side`` / ``decode_side`` (the two roles on that thread), ``peers``
(the peer agents loaded), ``context`` (what the sides share: transport, results, counters),
``engine`` (:class:`EngineTransfers`: a worker per rank plus the side channel), ``side_channel``
(the handshake server and caching client), ``identity`` (what the side channel serves, layout
compatibility), ``pull`` (prefill's holds for pull-mode READs), ``doorbell`` (the UDP wake-up peers ring
after each notification), ``liveness`` (the heartbeat the engine's liveness probe reads).
"""

from pdconnector.worker.context import ResultKind, TransferResult
from pdconnector.worker.engine import EngineTransfers
from pdconnector.worker.identity import (
    EngineInfo,
    IncompatiblePeer,
    RankInfo,
    check_peer,
    layout_differences,
    layout_summary,
)
from pdconnector.worker.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    fetch_engine_info,
)
from pdconnector.worker.transfer_worker import TransferWorker, WorkerConfig

__all__ = [
    "EngineInfo",
    "EngineTransfers",
    "IncompatiblePeer",
    "RankInfo",
    "ResultKind",
    "SideChannelClient",
    "SideChannelError",
    "SideChannelServer",
    "TransferResult",
    "TransferWorker",
    "WorkerConfig",
    "check_peer",
    "fetch_engine_info",
    "layout_differences",
    "layout_summary",
]
