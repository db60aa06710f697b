import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdconnector.protocol.messages import (
    MAGIC,
    MAX_BLOCKS_PER_GROUP,
    MAX_KV_GROUPS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AbortMessage,
    CompletionMessage,
    FailureMessage,
    FailureReason,
    ProtocolError,
    ReadDoneMessage,
    RegistrationMessage,
    decode,
    encode,
    rejection_notice,
)
from pdconnector.protocol.params import EngineRole

HEADER = MAGIC + bytes([PROTOCOL_VERSION])


def frame(payload: object) -> bytes:
    """A well-framed message whose body is arbitrary msgpack (what a buggy or hostile peer could send)."""
    return HEADER + msgspec.msgpack.encode(payload)


def raw_registration(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "type": "register",
        "transfer_id": "tx-1",
        "attempt": 0,
        "decode_engine_id": "decode-0",
        "decode_host": "10.0.0.7",
        "decode_port": 5600,
        "decode_tp_rank": 0,
        "decode_tp_size": 2,
        "num_tokens": 48,
        "num_blocks": 100,
        "block_ids": [[1, 2, 3], [4, 5]],
    }
    body.update(overrides)
    return body


def assert_rejected(data: bytes, field: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decode(data)
    assert caught.value.field == field, str(caught.value)
    assert str(caught.value).startswith(f"{field}: ")
    return caught.value


# --- valid messages ---------------------------------------------------------------------------

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True)
attempts = st.integers(0, 2**31 - 1)
ranks_and_sizes = st.integers(1, 1024).flatmap(
    lambda size: st.tuples(st.integers(0, size - 1), st.just(size))
)


@st.composite
def registrations(draw: st.DrawFn) -> RegistrationMessage:
    num_blocks = draw(st.integers(1, 2**31))
    block = st.integers(0, num_blocks - 1)
    rank, size = draw(ranks_and_sizes)
    block_ids = draw(st.lists(st.lists(block, max_size=50).map(tuple), min_size=1, max_size=8).map(tuple))
    widest = max(len(set(group)) for group in block_ids)
    return RegistrationMessage(
        transfer_id=draw(ids),
        attempt=draw(attempts),
        decode_engine_id=draw(ids),
        decode_host=draw(
            st.sampled_from(["10.1.2.3", "[fd00::1]", "decode-0.decode.ns.svc", "fe80::1%eth0"])
        ),
        decode_port=draw(st.integers(1, 65535)),
        decode_tp_rank=rank,
        decode_tp_size=size,
        num_tokens=draw(st.integers(0, 2**40)),
        num_blocks=num_blocks,
        block_ids=block_ids,
        agent_name=draw(st.text(max_size=30)),
        agent_metadata=draw(st.binary(max_size=200)),
        region_base_addresses=tuple(draw(st.lists(st.integers(0, 2**64 - 1), max_size=10))),
        layout_fingerprint=draw(st.text(max_size=20)),
        cached_blocks=draw(st.integers(0, min(num_blocks - widest, MAX_BLOCKS_PER_GROUP))),
    )


@st.composite
def completions(draw: st.DrawFn) -> CompletionMessage:
    rank, size = draw(ranks_and_sizes)
    return CompletionMessage(
        transfer_id=draw(ids),
        attempt=draw(attempts),
        prefill_rank=rank,
        prefill_tp_size=size,
        bytes_written=draw(st.integers(0, 2**62)),
    )


failures = st.builds(
    FailureMessage,
    transfer_id=ids,
    attempt=attempts,
    side=st.sampled_from(EngineRole),
    rank=st.integers(0, 1023),
    reason=st.sampled_from(FailureReason),
    detail=st.text(max_size=100),
)
aborts = st.builds(
    AbortMessage,
    transfer_id=ids,
    attempt=attempts,
    decode_rank=st.integers(0, 1023),
    detail=st.text(max_size=100),
)
read_dones = st.integers(1, 1024).flatmap(
    lambda tp: st.builds(
        ReadDoneMessage,
        transfer_id=ids,
        attempt=attempts,
        decode_rank=st.integers(0, tp - 1),
        decode_tp_size=st.just(tp),
        bytes_read=st.integers(0, 2**40),
    )
)
messages = st.one_of(registrations(), completions(), failures, aborts, read_dones)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_valid_message_survives_encode_and_decode_unchanged(message):
    data = encode(message)
    assert data.startswith(HEADER)
    assert decode(data) == message


def test_decode_accepts_bytearray_and_memoryview(registration):
    data = encode(registration())
    assert decode(bytearray(data)) == decode(memoryview(data)) == registration()


def test_block_ids_are_encoded_compactly_as_binary_integers(registration):
    blocks = tuple(range(40_000, 40_000 + 16_384))  # 16k ids between 2**15 and 2**16
    data = encode(registration(block_ids=(blocks,), num_blocks=100_000))
    assert len(data) < 3 * len(blocks) + 512  # 3 bytes per id (msgpack uint16); JSON text would take 6


# --- frame-level rejections -------------------------------------------------------------------

msgpack_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
)


def assert_decodes_or_protocol_error(data: bytes) -> None:
    """The only acceptable outcomes: a valid message (which re-encodes to itself) or a ProtocolError."""
    try:
        message = decode(data)
    except ProtocolError as error:
        assert error.field
        notice = rejection_notice(data, error, rank=0)
        assert notice is None or decode(encode(notice)) == notice
        return
    assert decode(encode(message)) == message


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_error(data):
    assert_decodes_or_protocol_error(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_bodies_behind_a_valid_header_only_ever_raise_protocol_error(body):
    assert_decodes_or_protocol_error(HEADER + body)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(msgpack_scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(max_size=8), inner))
)
def test_arbitrary_msgpack_documents_only_ever_raise_protocol_error(document):
    assert_decodes_or_protocol_error(frame(document))


def test_every_truncation_of_a_valid_frame_is_rejected(registration):
    data = encode(registration())
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


def test_frames_without_the_magic_are_rejected():
    assert_rejected(b"", "magic")
    assert_rejected(b"PDK", "magic")
    assert_rejected(b"HTTP/1.1 200 OK", "magic")


def test_other_protocol_versions_are_rejected_naming_both_versions(registration):
    data = bytearray(encode(registration()))
    data[len(MAGIC)] = PROTOCOL_VERSION + 1
    error = assert_rejected(bytes(data), "version")
    assert str(PROTOCOL_VERSION + 1) in error.problem
    assert str(PROTOCOL_VERSION) in error.problem


def test_oversized_frames_are_rejected_before_parsing():
    # A valid header followed by a body that would take long to parse if it were parsed.
    error = assert_rejected(HEADER + b"\x91" * MAX_MESSAGE_BYTES, "payload")
    assert "limit" in error.problem


def test_encode_refuses_a_frame_the_receiver_would_refuse(registration):
    huge = registration(
        block_ids=(tuple(range(100_000, 100_000 + MAX_BLOCKS_PER_GROUP)),), num_blocks=1_000_000
    )
    with pytest.raises(ProtocolError) as caught:
        encode(huge)
    assert caught.value.field == "payload"


def test_garbage_msgpack_is_rejected_as_payload():
    assert_rejected(HEADER + b"\xc1", "payload")
    assert_rejected(frame([1, 2, 3]), "payload")


# --- field-level rejections -------------------------------------------------------------------


def test_unknown_message_type_is_rejected_naming_type():
    assert_rejected(frame(raw_registration(type="hello")), "type")


def test_missing_fields_are_named():
    body = raw_registration()
    del body["decode_port"]
    assert_rejected(frame(body), "decode_port")


def test_unknown_fields_are_rejected_by_name():
    assert_rejected(frame(raw_registration(surprise=1)), "surprise")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attempt": "0"}, "attempt"),
        ({"attempt": True}, "attempt"),
        ({"attempt": -1}, "attempt"),
        ({"attempt": 1.0}, "attempt"),
        ({"transfer_id": "tx 1"}, "transfer_id"),
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": "t" * 129}, "transfer_id"),
        ({"transfer_id": "-leading-dash"}, "transfer_id"),
        ({"decode_engine_id": "a/b"}, "decode_engine_id"),
        ({"decode_host": "10.0.0.1; rm -rf"}, "decode_host"),
        ({"decode_port": 0}, "decode_port"),
        ({"decode_port": 65536}, "decode_port"),
        ({"decode_tp_size": 0}, "decode_tp_size"),
        ({"decode_tp_rank": 2}, "decode_tp_rank"),  # not below decode_tp_size 2
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_tokens": -5}, "num_tokens"),
        ({"block_ids": []}, "block_ids"),
        ({"block_ids": [[0]] * (MAX_KV_GROUPS + 1)}, "block_ids"),
        ({"block_ids": [[1, 2], [3, -4]]}, "block_ids[1][1]"),
        ({"block_ids": [[1, 2], [3, "4"]]}, "block_ids[1][1]"),
        ({"block_ids": [[1, 2], [3, 100]]}, "block_ids[1][1]"),  # not below num_blocks 100
        ({"block_ids": [[2**31]]}, "block_ids[0][0]"),
        ({"block_ids": [1, 2]}, "block_ids[0]"),
        ({"region_base_addresses": [-1]}, "region_base_addresses[0]"),
        ({"agent_metadata": "text"}, "agent_metadata"),
        ({"agent_metadata": b"x" * (256 * 1024 + 1)}, "agent_metadata"),
        ({"cached_blocks": -1}, "cached_blocks"),
        ({"cached_blocks": "2"}, "cached_blocks"),
        ({"cached_blocks": MAX_BLOCKS_PER_GROUP + 1}, "cached_blocks"),
        ({"cached_blocks": 98}, "cached_blocks"),  # 98 cached + 3 registered blocks do not fit a pool of 100
    ],
)
def test_out_of_bounds_registration_fields_are_named(overrides, field):
    assert_rejected(frame(raw_registration(**overrides)), field)


def test_a_block_group_longer_than_the_bound_is_rejected():
    assert_rejected(
        frame(raw_registration(block_ids=[[0] * (MAX_BLOCKS_PER_GROUP + 1)], num_blocks=1)), "block_ids[0]"
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {
                "type": "complete",
                "transfer_id": "tx-1",
                "attempt": 0,
                "prefill_rank": 2,
                "prefill_tp_size": 2,
                "bytes_written": 1,
            },
            "prefill_rank",
        ),
        (
            {
                "type": "complete",
                "transfer_id": "tx-1",
                "attempt": 0,
                "prefill_rank": 0,
                "prefill_tp_size": 2,
                "bytes_written": -1,
            },
            "bytes_written",
        ),
        (
            {
                "type": "fail",
                "transfer_id": "tx-1",
                "attempt": 0,
                "side": "middle",
                "rank": 0,
                "reason": "timeout",
            },
            "side",
        ),
        (
            {
                "type": "fail",
                "transfer_id": "tx-1",
                "attempt": 0,
                "side": "decode",
                "rank": 0,
                "reason": "bored",
            },
            "reason",
        ),
        (
            {
                "type": "fail",
                "transfer_id": "tx-1",
                "attempt": 0,
                "side": "decode",
                "rank": 0,
                "reason": "timeout",
                "detail": "x" * 1025,
            },
            "detail",
        ),
        ({"type": "abort", "transfer_id": "tx-1", "attempt": 0, "decode_rank": 1024}, "decode_rank"),
    ],
)
def test_out_of_bounds_fields_of_other_messages_are_named(body, field):
    assert_rejected(frame(body), field)


def test_constructing_an_inconsistent_message_fails_at_once_naming_the_field(registration):
    with pytest.raises(ProtocolError) as caught:
        registration(decode_rank=3, decode_tp=2)
    assert caught.value.field == "decode_tp_rank"
    with pytest.raises(ProtocolError) as caught:
        registration(block_ids=((1,), (5, 2000)), num_blocks=1024)
    assert caught.value.field == "block_ids[1][1]"


# --- the prefix-cache offset (cached_blocks) --------------------------------------------------


def test_a_registration_with_a_prefix_hit_carries_its_cached_block_count_across_the_wire(registration):
    message = registration(block_ids=((12, 13, 14),), cached_blocks=2)
    assert decode(encode(message)).cached_blocks == 2


def test_a_registration_without_a_prefix_hit_is_framed_as_before_the_field_existed(registration):
    """Peers that predate ``cached_blocks`` (and refuse unknown fields) still read registrations without a
    hit."""
    body = msgspec.msgpack.decode(encode(registration())[len(HEADER) :])
    assert "cached_blocks" not in body
    assert decode(frame(body)).cached_blocks == 0


def test_cached_blocks_that_leave_no_room_for_the_registered_blocks_are_refused_at_once(registration):
    registration(block_ids=((1, 2, 3),), num_blocks=10, cached_blocks=7)  # 7 + 3 blocks: exactly the pool
    with pytest.raises(ProtocolError) as caught:
        registration(block_ids=((1, 2, 3),), num_blocks=10, cached_blocks=8)
    assert caught.value.field == "cached_blocks"
    assert "num_blocks 10" in caught.value.problem


# --- answering refused registrations ----------------------------------------------------------


def refusal_of(data: bytes) -> FailureMessage | None:
    with pytest.raises(ProtocolError) as caught:
        decode(data)
    return rejection_notice(data, caught.value, rank=3)


def test_a_refused_registration_with_a_readable_id_gets_a_failure_notice_naming_the_field():
    notice = refusal_of(frame(raw_registration(transfer_id="tx-7", attempt=2, block_ids=[[1, 500]])))
    assert notice is not None
    assert (notice.transfer_id, notice.attempt, notice.rank) == ("tx-7", 2, 3)
    assert (notice.side, notice.reason) == (EngineRole.PREFILL, FailureReason.INVALID_REGISTRATION)
    assert notice.detail.startswith("block_ids[0][1]: ")


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        HEADER + b"\xc1",
        frame(raw_registration(transfer_id="bad id", block_ids=[[-1]])),  # nobody to address
        frame(
            {
                "type": "complete",
                "transfer_id": "tx-1",
                "attempt": 0,
                "prefill_rank": 9,
                "prefill_tp_size": 2,
                "bytes_written": 0,
            }
        ),
        MAGIC
        + bytes([PROTOCOL_VERSION + 1])
        + msgspec.msgpack.encode(raw_registration(block_ids=[[-1]])),  # the sender would not read our answer
    ],
)
def test_frames_that_are_not_answerable_registrations_get_no_notice(data):
    assert refusal_of(data) is None
