"""A vLLM engine that Kubernetes stops, with the flags the operator renders (real vLLM CPU engine): SIGTERM to
the API server (the container's first process) drains the answer in flight instead of aborting it, and the
engine exits once drained, long before its grace period ends."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from pdoperator.api import parse_pdservice
from pdoperator.render import ComponentRole, RenderDefaults
from pdoperator.render.engine import engine_command

REPO = Path(__file__).resolve().parents[3]
LONG_ANSWER = 1800  # tokens: seconds of streaming on a CPU engine


def rendered_drain_flags() -> list[str]:
    pds = parse_pdservice(yaml.safe_load((REPO / "examples" / "tiny-gpu-vllm.yaml").read_text()))
    _, args = engine_command(pds, ComponentRole.DECODE, RenderDefaults())
    flag = args.index("--shutdown-timeout")
    assert int(args[flag + 1]) == pds.spec.engine.termination_grace_period_seconds - 10
    return args[flag : flag + 2]


class Stream(threading.Thread):
    """One greedy streamed completion: its token ids, whether it ended with [DONE], and an event set at its
    first token."""

    def __init__(self, url: str) -> None:
        super().__init__(name="long answer", daemon=True)
        self.url = url
        self.token_ids: list[int] = []
        self.done = False
        self.error: BaseException | None = None
        self.streaming = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": LONG_ANSWER, "temperature": 0.0}
        body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    data = line.decode().strip().removeprefix("data: ")
                    if data == "[DONE]":
                        self.done = True
                    elif data:
                        self.token_ids += json.loads(data)["choices"][0].get("token_ids") or []
                        self.streaming.set()
        except (OSError, ValueError, KeyError) as error:
            self.error = error


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_drains_the_answer_in_flight_and_the_engine_exits_once_drained(
    launch_engine, dense_model: Path
):
    engine = launch_engine("drain", dense_model, extra_args=rendered_drain_flags())
    engine.wait_healthy(240)
    stream = Stream(engine.url)
    stream.start()
    assert stream.streaming.wait(timeout=60), stream.error
    stopped_at = time.monotonic()
    engine.process.send_signal(signal.SIGTERM)
    streamed_before = len(stream.token_ids)
    stream.join(timeout=120)
    assert 0 < streamed_before < LONG_ANSWER  # stopped mid-answer
    assert stream.error is None and stream.done, stream.error
    assert len(stream.token_ids) == LONG_ANSWER  # every token: nothing aborted
    engine.process.wait(timeout=60)
    assert time.monotonic() - stopped_at < 60, "drained, it exits long before the rendered grace period"
