"""Both modes with KV moved by NIXL between the mock engines' host-memory pools."""

from __future__ import annotations

import openai
import pytest
from pdconnector.sim.model import reference_tokens, tokenize

MODEL = "tiny"


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("stream", [False, True])
def test_nixl_transfers_give_the_colocated_output(nixl_cluster, mode, stream):
    client = openai.OpenAI(
        base_url=nixl_cluster.routers[mode].url + "/v1", api_key="unused", max_retries=0, timeout=60
    )
    for index in range(3):
        prompt = " ".join(f"t{(index * 37 + i) % 1000}" for i in range(40))
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=stream
        )
        answer = raw.parse()
        text = (
            "".join(chunk.choices[0].text for chunk in answer if chunk.choices)
            if stream
            else answer.choices[0].text
        )
        assert tokenize(text) == reference_tokens(tokenize(prompt), 6)
        assert raw.headers["x-pd-prefill"].startswith("prefill-") and raw.headers["x-pd-decode"].startswith(
            "decode-"
        )
