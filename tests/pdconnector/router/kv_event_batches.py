"""KV event batches exactly as vLLM publishes them (its own event classes, msgpack-encoded), and a publisher
socket on loopback: what the router's event tests feed it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

# vLLM's own event classes encode the batches, as its publisher does.
pytest.importorskip("vllm", reason="vLLM is the optional 'engine' extra")
from vllm.distributed import kv_events as vllm_events

ENCODER = msgspec.msgpack.Encoder()


def stored(*hashes: bytes, medium: str | None = "GPU") -> object:
    return vllm_events.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[1] * 16 * len(hashes),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(*hashes: bytes, medium: str | None = "GPU") -> object:
    return vllm_events.BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events: object) -> bytes:
    return ENCODER.encode(vllm_events.KVEventBatch(ts=time.time(), events=list(events)))


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def publisher_socket() -> tuple[zmq.Socket, str]:
    socket = zmq.Context.instance().socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return socket, f"tcp://127.0.0.1:{port}"


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (a subscriber applying what was published); fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the subscriber never applied the published batch"
        await asyncio.sleep(0.02)
