"""A short tour of a local run: requests through the router in each mode, and what served them.

Used by `pdctl demo`: for each mode, `up` the PDService, send a few completions (plain and
streaming) through the router, report which prefill and decode instance served each one
and how many KV bytes the decode engines received, then `down`.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdoperator.api import PDService, TransferMode
from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice

from .plan import LocalPlan, plan_local_run
from .runner import down, up

PROMPTS = ("t1 t2 t3 t4 t5 t6 t7 t8", "t42 " * 40, "t7 t8 t9")
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 60.0
RECEIVED_BYTES_METRIC = "pd_mock_transfer_bytes"


@dataclass(frozen=True)
class ServedRequest:
    prompt_tokens: int
    stream: bool
    prefill: str
    decode: str
    text: str
    kv_bytes: int | None


@dataclass(frozen=True)
class ModeReport:
    mode: TransferMode
    endpoint: str
    requests: tuple[ServedRequest, ...]
    kv_bytes_received: int
    verified: int
    unverified: int


def _post(url: str, body: dict[str, object]) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return {key.lower(): value for key, value in response.headers.items()}, response.read()


def _complete(endpoint: str, model: str, prompt: str, stream: bool) -> ServedRequest:
    headers, raw = _post(
        f"{endpoint}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream},
    )
    if stream:
        chunks = [
            json.loads(line[len(b"data: ") :]) for line in raw.splitlines() if line.startswith(b"data: {")
        ]
        text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
        params = next(
            (chunk["kv_transfer_params"] for chunk in chunks if chunk.get("kv_transfer_params")), {}
        )
    else:
        body = json.loads(raw)
        text = body["choices"][0]["text"]
        params = body.get("kv_transfer_params") or {}
    received = params.get("pd_received") or {}
    return ServedRequest(
        len(prompt.split()),
        stream,
        headers["x-pd-prefill"],
        headers["x-pd-decode"],
        text.strip(),
        received.get("bytes"),
    )


def _received_bytes(plan: LocalPlan) -> int:
    total = 0.0
    for process in plan.processes:
        if process.role is not ComponentRole.DECODE:
            continue
        with urllib.request.urlopen(f"{process.url}/metrics", timeout=REQUEST_TIMEOUT_S) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                if family.name == RECEIVED_BYTES_METRIC:
                    total += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return int(total)


def tour_mode(pds: PDService, mode: TransferMode, state_dir: Path) -> ModeReport:
    pds = pds.model_copy(update={"spec": pds.spec.model_copy(update={"mode": mode})})
    plan = plan_local_run(pds, render_pdservice(pds, RenderDefaults()), state_dir)
    up(plan, state_dir)
    try:
        model = pds.spec.model.served_name or pds.spec.model.name
        served = tuple(
            _complete(plan.endpoint, model, prompt, stream=index == len(PROMPTS) - 1)
            for index, prompt in enumerate(PROMPTS)
        )
        with urllib.request.urlopen(f"{plan.endpoint}/status", timeout=REQUEST_TIMEOUT_S) as response:
            transfers = json.loads(response.read())["transfers"]
        return ModeReport(
            mode, plan.endpoint, served, _received_bytes(plan), transfers["verified"], transfers["unverified"]
        )
    finally:
        down(state_dir)


def format_report(report: ModeReport) -> list[str]:
    lines = [f"  {report.mode.value} mode via {report.endpoint}/v1"]
    lines.append(f"    {'prompt':>6}  {'stream':<6}  {'prefill':<16}  {'decode':<16}  {'KV bytes':>8}  text")
    for served in report.requests:
        kv = "-" if served.kv_bytes is None else str(served.kv_bytes)
        stream = "yes" if served.stream else "no"
        lines.append(
            f"    {served.prompt_tokens:>6}  {stream:<6}  {served.prefill:<16}  {served.decode:<16}  "
            f"{kv:>8}  {served.text}"
        )
    lines.append(
        f"    KV bytes received by decode: {report.kv_bytes_received}; "
        f"router verified {report.verified} transfers, {report.unverified} served without one"
    )
    return lines
