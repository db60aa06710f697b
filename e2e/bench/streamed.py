"""One streamed completion through the router, as a benchmark client sees it: when each text delta arrived,
the text, or why it failed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Streamed:
    started: float  # time.monotonic() when the request was sent
    token_times: list[float] = field(default_factory=list)  # one per non-empty text delta
    text: str = ""
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


async def stream_completion(session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any]) -> Streamed:
    """POST ``body`` (with ``stream: true``) to ``endpoint``'s /v1/completions and read the whole stream."""
    result = Streamed(time.monotonic())
    try:
        async with session.post(f"{endpoint}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = f"stream error: {event['error']}"
                    return result
                text = event["choices"][0].get("text") if event.get("choices") else None
                if text:
                    result.token_times.append(time.monotonic())
                    result.text += text
    except (aiohttp.ClientError, TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    if not result.token_times:
        result.error = "no token"
    return result
