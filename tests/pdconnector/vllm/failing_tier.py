"""Our connector with every KV tier load failing, on every rank of the engine that loads it
(``kv_connector_module_path: tests.pdconnector.vllm.failing_tier``): a real engine's fallbacks, with no fault
hook in the connector itself. Importing the module is the fault: it replaces the rank tier's load in that
process only."""

from collections.abc import Sequence

from pdconnector.tier.store import RankTier
from pdconnector.vllm.connector import PDConnector

FAULT = "injected: the host copy failed"


def _failing_load(self: RankTier, slots: Sequence[int], block_ids: Sequence[int]) -> None:
    raise RuntimeError(FAULT)


RankTier.load = _failing_load  # type: ignore[method-assign]

__all__ = ["PDConnector"]
