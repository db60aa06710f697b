"""Wire messages of the push protocol, carried as NIXL notifications.

Frame: ``MAGIC`` (4 bytes) + protocol version (1 byte) + a msgpack map tagged by
``type``. The version sits outside the map so a peer speaking another version is
told so plainly instead of failing on some field. ``decode`` refuses frames above
``MAX_MESSAGE_BYTES`` before parsing, and every field has a type and a bound, so a
malformed or hostile notification ends in a ``ProtocolError`` naming the field
and never in a crash or an oversized allocation.

Directions: decode sends ``RegistrationMessage``, ``AbortMessage`` and (pull, as its READ's notification)
``ReadDoneMessage`` to prefill; prefill sends ``CompletionMessage`` (as the notification of its WRITE, so it
lands after the data) and ``FailureMessage`` to decode.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Final, Literal

import msgspec

from pdconnector.protocol.params import ENGINE_ID_PATTERN, HOST_PATTERN, TRANSFER_ID_PATTERN, EngineRole

MAGIC: Final = b"PDKV"
PROTOCOL_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 1 << 20
MAX_KV_GROUPS: Final = 64
MAX_BLOCKS_PER_GROUP: Final = 1 << 18
MAX_BLOCK_ID: Final = (1 << 31) - 1
MAX_TP_SIZE: Final = 1024
MAX_REGIONS: Final = 8192
MAX_AGENT_METADATA_BYTES: Final = 256 << 10
MAX_DETAIL_CHARS: Final = 1024
MAX_DEVICE_ID: Final = 1023
MAX_LIFETIME_MS: Final = 24 * 3600 * 1000

_HEADER: Final = MAGIC + bytes([PROTOCOL_VERSION])

TransferId = Annotated[str, msgspec.Meta(pattern=TRANSFER_ID_PATTERN)]
EngineId = Annotated[str, msgspec.Meta(pattern=ENGINE_ID_PATTERN)]
Host = Annotated[str, msgspec.Meta(pattern=HOST_PATTERN)]
Attempt = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# 0: the rank has no doorbell (pdconnector.worker.doorbell)
DoorbellPort = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# Where a rank's block pages sit (pdconnector.layout.BlockPlacement's values; the protocol does not import the
# layout).
Placement = Literal["layer_outer", "block_outer", "head_outer"]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
TpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
BlockGroup = Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]
Address = Annotated[int, msgspec.Meta(ge=0)]  # msgpack caps ints at 64 bits
Detail = Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)]
DeviceId = Annotated[int, msgspec.Meta(ge=0, le=MAX_DEVICE_ID)]


class ProtocolError(ValueError):
    """An unusable protocol message; ``field`` names where it went wrong (``payload`` for the frame as a
    whole)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class FailureReason(StrEnum):
    LEASE_EXPIRED = "lease_expired"  # one side waited for the other past its lease
    WRITE_FAILED = "write_failed"
    WRITE_TIMEOUT = "write_timeout"
    INVALID_REGISTRATION = "invalid_registration"
    INCOMPATIBLE = "incompatible"  # TP sizes, KV groups or layout fingerprints do not fit together
    UNREACHABLE = "unreachable"  # the peer's side channel refused, timed out or broke off: gone or frozen
    CAPACITY = "capacity"  # the rendezvous table is full
    CANCELLED = "cancelled"  # the prefill request was aborted
    ALREADY_CLOSED = "already_closed"  # a registration arrived after the transfer ended
    TIMEOUT = "timeout"  # decode's own deadline passed


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    transfer_id: TransferId
    attempt: Attempt


class StagingOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Staging memory decode holds for one prefill rank's share of a transfer: that rank may WRITE its bytes
    here, gathered in the destination's address order (``pdconnector.layout.staging``), instead of into the
    blocks; decode scatters them before it counts the rank's completion."""

    prefill_rank: TpRank
    address: Address
    nbytes: Count


class RegistrationMessage(_Message, tag="register", omit_defaults=True):
    """Decode rank -> prefill ranks: where to WRITE this transfer's KV.

    Carries what prefill needs to post the WRITE without a round trip: the decode
    agent's name and (optionally) its NIXL metadata, the base address of each
    registered region in the layout's order, the pool size that bounds block ids,
    and a layout fingerprint prefill compares with its own.

    ``cached_blocks``: how many leading blocks of every attention KV group decode already holds (its prefix
    cache); ``block_ids`` list only the blocks after them, so prefill skips as many of its own. SSM groups
    always move their one state block. ``device_id``: the device the decode rank's regions live on
    (``cuda:device_id``), named in every remote descriptor. ``lifetime_ms``: how long after prefill receives
    it the registration may still be written (0: prefill's default); decode keeps the blocks at least that
    long plus its fence, so a WRITE posted within the lifetime lands in them. ``doorbell_port``: the decode
    rank's doorbell on ``decode_host``, rung after every notification sent to it. ``placement``: where the
    decode rank's block pages sit in its regions (``pdconnector.layout.BlockPlacement``). ``staging``: at most
    one :class:`StagingOffer` per prefill rank, held for the registration's lifetime. Fields at their
    default are left out of the frame: a registration without a prefix hit reads the same to a peer that
    predates ``cached_blocks``, and one with a hit is refused by such a peer (unknown field) instead of
    written at the wrong offset.
    """

    decode_engine_id: EngineId
    decode_host: Host
    decode_port: Port
    decode_tp_rank: TpRank
    decode_tp_size: TpSize
    num_tokens: Count
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_ID + 1)]
    block_ids: Annotated[tuple[BlockGroup, ...], msgspec.Meta(min_length=1, max_length=MAX_KV_GROUPS)]
    agent_name: Annotated[str, msgspec.Meta(max_length=256)] = ""
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)] = b""
    region_base_addresses: Annotated[tuple[Address, ...], msgspec.Meta(max_length=MAX_REGIONS)] = ()
    layout_fingerprint: Annotated[str, msgspec.Meta(max_length=128)] = ""
    cached_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS_PER_GROUP)] = 0
    device_id: DeviceId = 0
    lifetime_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_LIFETIME_MS)] = 0
    doorbell_port: DoorbellPort = 0
    placement: Placement = "layer_outer"
    staging: Annotated[tuple[StagingOffer, ...], msgspec.Meta(max_length=MAX_TP_SIZE)] = ()

    def __post_init__(self) -> None:
        if self.decode_tp_rank >= self.decode_tp_size:
            raise ProtocolError(
                "decode_tp_rank", f"{self.decode_tp_rank} is not below decode_tp_size {self.decode_tp_size}"
            )
        offered = [offer.prefill_rank for offer in self.staging]
        if len(set(offered)) != len(offered):
            raise ProtocolError("staging", f"more than one offer for a prefill rank: {sorted(offered)}")
        for group_index, group in enumerate(self.block_ids):
            if group and max(group) >= self.num_blocks:
                position = next(i for i, block in enumerate(group) if block >= self.num_blocks)
                raise ProtocolError(
                    f"block_ids[{group_index}][{position}]",
                    f"block {group[position]} is not below num_blocks {self.num_blocks}",
                )
        if self.cached_blocks:
            # A group's cached blocks are pool blocks besides the ones it registers.
            registered = [len(set(group)) for group in self.block_ids]
            widest = registered.index(max(registered))
            if self.cached_blocks + registered[widest] > self.num_blocks:
                raise ProtocolError(
                    "cached_blocks",
                    f"{self.cached_blocks} cached plus {registered[widest]} registered blocks of KV group "
                    f"{widest} "
                    f"exceed the decode pool of num_blocks {self.num_blocks}",
                )


class CompletionMessage(_Message, tag="complete", omit_defaults=True):
    """Prefill rank -> decode rank, as the WRITE's notification: this rank's share has landed, in the blocks
    or (``staged``) in the staging memory decode offered it."""

    prefill_rank: TpRank
    prefill_tp_size: TpSize
    bytes_written: Count
    staged: bool = False

    def __post_init__(self) -> None:
        if self.prefill_rank >= self.prefill_tp_size:
            raise ProtocolError(
                "prefill_rank", f"{self.prefill_rank} is not below prefill_tp_size {self.prefill_tp_size}"
            )


class FailureMessage(_Message, tag="fail"):
    """Either side -> the other: this transfer attempt will not complete; fail it now.

    From prefill it also says this rank has no WRITE in flight for the attempt and will post none, so decode
    may free the blocks it registered (it is sent only once the rank's writes drained, and answers every
    abort)."""

    side: EngineRole
    rank: TpRank
    reason: FailureReason
    detail: Detail = ""


class AbortMessage(_Message, tag="abort"):
    """Decode -> prefill: decode gave up on this attempt (cancelled, timed out); stop and free."""

    decode_rank: TpRank
    detail: Detail = ""


class ReadDoneMessage(_Message, tag="read_done"):
    """Decode rank -> prefill rank, as a pull READ's notification: this rank has its share; prefill may free
    once every decode rank reading from it (which it derives from ``decode_tp_size``) said so."""

    decode_rank: TpRank
    decode_tp_size: TpSize
    bytes_read: Count

    def __post_init__(self) -> None:
        if self.decode_rank >= self.decode_tp_size:
            raise ProtocolError(
                "decode_rank", f"{self.decode_rank} is not below decode_tp_size {self.decode_tp_size}"
            )


Message = RegistrationMessage | CompletionMessage | FailureMessage | AbortMessage | ReadDoneMessage


class _Identity(msgspec.Struct):
    """The two fields needed to answer a message, read leniently (other fields are not looked at)."""

    type: str
    transfer_id: TransferId
    attempt: Attempt


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_identity_decoder = msgspec.msgpack.Decoder(_Identity)
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_NAMED_FIELD = re.compile(r"(?:missing required|unknown) field `([^`]*)`")


def encode(message: Message) -> bytes:
    """Frame a message for ``send_notif`` / a WRITE notification; refuses frames above the size limit."""
    data = _HEADER + _encoder.encode(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("payload", f"{len(data)} bytes exceed the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def _field_of(error: msgspec.ValidationError) -> str:
    text = str(error)
    path = _PATH.search(text)
    named = _NAMED_FIELD.search(text)
    if named:
        prefix = path.group(1) + "." if path and path.group(1) else ""
        return prefix + named.group(1)
    if path and path.group(1):
        return path.group(1)
    return "payload"


def decode(data: bytes) -> Message:
    """Parse one frame; any problem raises ``ProtocolError`` naming the field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError("payload", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("payload", f"{len(data)} bytes exceed the {MAX_MESSAGE_BYTES}-byte limit")
    view = memoryview(data)
    if len(view) < len(_HEADER) or view[: len(MAGIC)] != MAGIC:
        raise ProtocolError("magic", "not a pdconnector protocol frame")
    version = view[len(MAGIC)]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        return _decoder.decode(view[len(_HEADER) :])
    except msgspec.ValidationError as error:
        if isinstance(error.__cause__, ProtocolError):
            raise error.__cause__ from None
        raise ProtocolError(_field_of(error), str(error)) from None
    except msgspec.DecodeError as error:
        raise ProtocolError("payload", str(error)) from None


def rejection_notice(data: bytes, error: ProtocolError, *, rank: int) -> FailureMessage | None:
    """The failure to send back for a registration ``decode`` refused, so its sender fails now instead of at
    its deadline.

    NIXL tells the receiver which agent a notification came from; this reads the transfer id
    and attempt the refused frame claims. None when the frame is not a registration of this
    protocol version or those two fields are themselves unreadable.
    """
    if len(data) > MAX_MESSAGE_BYTES or bytes(data[: len(_HEADER)]) != _HEADER:
        return None
    try:
        identity = _identity_decoder.decode(memoryview(data)[len(_HEADER) :])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if identity.type != RegistrationMessage.__struct_config__.tag:
        return None
    return FailureMessage(
        transfer_id=identity.transfer_id,
        attempt=identity.attempt,
        side=EngineRole.PREFILL,
        rank=rank,
        reason=FailureReason.INVALID_REGISTRATION,
        detail=str(error)[:MAX_DETAIL_CHARS],
    )


def registration_frame(message: RegistrationMessage, limit: int) -> tuple[bytes, bool]:
    """The registration's frame within a transport's notification limit (LIBFABRIC's is a few KiB), and
    whether it had to leave out the inline agent metadata (prefill has it from the engine's side-channel
    announce); a registration too large even without it is a :class:`ProtocolError` naming its blocks."""
    frame = encode(message)
    trimmed = len(frame) > limit and bool(message.agent_metadata)
    if trimmed:
        frame = encode(msgspec.structs.replace(message, agent_metadata=b""))
    if len(frame) > limit:
        blocks = sum(len(group) for group in message.block_ids)
        raise ProtocolError(
            "block_ids",
            f"a registration of {blocks} blocks takes {len(frame)} bytes, over the transport's "
            f"{limit}-byte notification limit",
        )
    return frame, trimmed
