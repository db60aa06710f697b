"""The PDService a local run starts: the user's, with `pdctl up`'s overrides applied and validated again.

A local run may swap what the engines are (mock or vLLM), which KV connector vLLM loads (ours or
upstream's) and the mode, without editing the file. The result passes the same validation as any
PDService, so an override that makes the spec invalid is reported like a bad file.
"""

from __future__ import annotations

from typing import Any

from pdoperator.api import PDService, parse_pdservice
from pdoperator.api.model import API_VERSION, KIND


def local_variant(
    pds: PDService,
    *,
    mode: str | None = None,
    runtime: str | None = None,
    connector: str | None = None,
    dtype: str | None = None,
) -> PDService:
    """``pds`` with the overrides that are not None; raises ``SpecError`` if the result is invalid."""
    spec: dict[str, Any] = pds.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    engine = spec["engine"]
    if mode is not None:
        spec["mode"] = mode
    if dtype is not None:
        spec["model"]["dtype"] = dtype
    if runtime is not None:
        engine["runtime"] = runtime
        transport = engine["transport"]
        if runtime == "mock":
            transport["backend"] = "mock"
        elif transport["backend"] == "mock":
            # vLLM engines move KV with NIXL: its UCX backend works over host memory on any machine.
            transport["backend"] = "UCX"
    if connector is not None:
        engine["connector"] = connector
    if engine.get("connector") == "vllm" and spec["mode"] == "push":
        # Upstream's push connector addresses prefill by a fixed engine id.
        engine.setdefault("prefillEngineId", f"{pds.name}-prefill")
    metadata = {"name": pds.name, "namespace": pds.namespace}
    return parse_pdservice({"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec})
