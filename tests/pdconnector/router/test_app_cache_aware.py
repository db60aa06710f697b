"""The router under the cache-aware policy, end to end over fake engines that publish no events: two
conversations opened side by side land on different prefills (the prompt tokens queued at the first), and
every follow-up goes back to the prefill that holds its conversation's prefix."""

from __future__ import annotations

import asyncio

CACHE_AWARE = {"policy": "cache-aware", "cache_aware": {"block_size": 16}}


def completion(tokens: list[int]) -> dict[str, object]:
    return {"model": "tiny", "prompt": tokens, "max_tokens": 3}


async def test_each_conversation_stays_on_the_prefill_holding_its_prefix(cluster, make_router):
    client = await make_router(**CACHE_AWARE)
    first, second = cluster.prefill
    # Each prefill answers only once the other has a request: the two openings must be spread.
    first.wait_for, second.wait_for = second, first
    conversations = [list(range(100, 164)), list(range(500, 564))]
    answers = await asyncio.gather(
        *(client.post("/v1/completions", json=completion(c)) for c in conversations)
    )
    assert [a.status for a in answers] == [200, 200]
    print(
        [len(p.bodies) for p in cluster.prefill],
        [len(d.bodies) for d in cluster.decode],
        [await a.text() for a in answers],
    )
    first.wait_for = second.wait_for = None
    holder = {tuple(p.bodies[0]["prompt"]): p for p in cluster.prefill}
    for turn in range(3):
        for conversation in conversations:
            opening = tuple(conversation[:64])
            conversation += [7, 7, 7, turn]
            response = await client.post("/v1/completions", json=completion(conversation))
            assert response.status == 200, await response.text()
            assert holder[opening].bodies[-1]["prompt"] == conversation, f"turn {turn} left its prefill"
    assert [len(p.bodies) for p in cluster.prefill] == [4, 4]
    status = await (await client.get("/status")).json()
    assert status["policy"] == "cache-aware"
    assert all(b["prefix_blocks"] >= 4 for b in status["backends"] if b["role"] == "prefill")
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_router_prefix_tokens_total{kind="cached"} 384.0' in metrics  # 3 turns x 2 x 64 tokens
