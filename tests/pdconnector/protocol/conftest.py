from collections.abc import Callable
from typing import Any

import pytest
from pdconnector.protocol.messages import RegistrationMessage

RegistrationFactory = Callable[..., RegistrationMessage]


def build_registration(
    transfer_id: str = "tx-1",
    attempt: int = 0,
    *,
    decode_rank: int = 0,
    decode_tp: int = 1,
    block_ids: tuple[tuple[int, ...], ...] = ((10, 11, 12),),
    **overrides: Any,
) -> RegistrationMessage:
    fields: dict[str, Any] = {
        "transfer_id": transfer_id,
        "attempt": attempt,
        "decode_engine_id": "decode-0",
        "decode_host": "10.0.0.7",
        "decode_port": 5600,
        "decode_tp_rank": decode_rank,
        "decode_tp_size": decode_tp,
        "num_tokens": 48,
        "num_blocks": 1024,
        "block_ids": block_ids,
        "agent_name": f"decode-0-rank{decode_rank}",
    }
    fields.update(overrides)
    return RegistrationMessage(**fields)


@pytest.fixture
def registration() -> RegistrationFactory:
    """A factory of valid registrations; keyword arguments override fields."""
    return build_registration
