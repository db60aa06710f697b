"""Random interleavings of everything that can reach a prefill rank's rendezvous table.

The machine plays the caller: it hands prefill blocks to the table, delivers
registrations and aborts (duplicated, stale, misrouted), completes or fails the
writes it was told to start (a cancelled write may end either way, or much later),
and lets time pass. Whatever happens: every entry ends exactly once; blocks are
released exactly once and never while a write still reads them; writes only start
on held blocks and within their registration's lifetime; failures go only to decode
agents that registered or aborted, and only once no write of the transfer is in
flight (decode frees its blocks on them); the table stays within its bound; and
once every write has ended and every deadline passed, nothing is left held or open.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pdconnector.protocol.messages import AbortMessage, RegistrationMessage
from pdconnector.protocol.pairing import PrefillBlocks, paired_blocks
from pdconnector.protocol.rendezvous import (
    AbandonWrite,
    Closed,
    Event,
    NotifyDecode,
    RendezvousLimits,
    RendezvousTable,
    StartWrite,
    WriteKey,
)

TRANSFER_IDS = [f"tx-{index}" for index in range(6)]
LIMITS = RendezvousLimits(
    max_entries=4,
    registration_lease_s=3.0,
    prefill_lease_s=5.0,
    write_timeout_s=2.0,
    tombstone_ttl_s=4.0,
    max_tombstones=3,
)
PREFILL_RANK, PREFILL_TP = 0, 2  # writes decode rank 0 of TP 1 or 2, ranks 0 and 1 of TP 4
BLOCK_SIZE = 16
ABORTING_AGENT = "decode-0-rank0"  # aborts come from the agent of decode rank 0


class RendezvousMachine(RuleBasedStateMachine):
    build_registration = None  # set by the test from the fixture

    def __init__(self) -> None:
        super().__init__()
        self.table = RendezvousTable(
            prefill_rank=PREFILL_RANK, prefill_tp_size=PREFILL_TP, block_size=BLOCK_SIZE, limits=LIMITS
        )
        self.now = 0.0
        self.prefill_reported: set[str] = set()
        self.held: dict[str, PrefillBlocks] = {}
        self.released: set[str] = set()
        self.in_flight: dict[WriteKey, StartWrite] = {}
        self.cancelling: set[WriteKey] = set()
        self.ended: set[WriteKey] = set()
        self.sent: set[RegistrationMessage] = set()
        self.received_at: dict[RegistrationMessage, float] = {}
        self.agents = {ABORTING_AGENT}
        self.open: set[str] = set()

    # --- the caller's side of each event ------------------------------------------------------

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, StartWrite):
                assert event.key not in self.in_flight and event.key not in self.ended, (
                    "a write started twice"
                )
                lifetime = event.registration.lifetime_ms / 1000 or LIMITS.registration_lifetime_s
                assert self.now < self.received_at[event.registration] + lifetime, (
                    "a write started after its registration's lifetime"
                )
                held = self.held.get(event.key.transfer_id)
                assert held is not None, "a write started on blocks the table does not hold"
                assert event.prefill == paired_blocks(
                    held, event.registration, block_size=BLOCK_SIZE, ssm_groups=frozenset()
                )
                assert event.registration in self.sent
                assert (
                    event.registration.attempt == event.key.attempt
                    and event.registration.decode_tp_rank == event.key.decode_rank
                )
                self.in_flight[event.key] = event
            elif isinstance(event, AbandonWrite):
                assert event.key in self.in_flight and event.key not in self.cancelling, (
                    "cancelled a write that was not in flight, or twice"
                )
                self.cancelling.add(event.key)
            elif isinstance(event, NotifyDecode):
                assert event.agent in self.agents, "notified an agent that never registered or aborted"
                transfer_id = event.message.transfer_id
                assert not any(key.transfer_id == transfer_id for key in self.in_flight), (
                    "told decode to free while a write is in flight"
                )
            else:
                self.close(event)

    def close(self, event: Closed) -> None:
        transfer_id = event.transfer_id
        if transfer_id in self.open:
            self.open.remove(transfer_id)
        else:
            assert event.blocks is not None, "closed an entry that was not open and freed nothing"
        if event.blocks is not None:
            assert transfer_id not in self.released, "blocks released twice"
            assert self.held.pop(transfer_id, None) == event.blocks, "released blocks the table did not hold"
            self.released.add(transfer_id)
            assert not any(key.transfer_id == transfer_id for key in self.in_flight), (
                "blocks released while a write reads them"
            )

    def call(self, transfer_id: str, events: list[Event]) -> None:
        was_open = transfer_id in self.open
        self.apply(events)
        if transfer_id in self.table and not was_open:
            self.open.add(transfer_id)

    # --- rules --------------------------------------------------------------------------------

    @rule(
        transfer_id=st.sampled_from(TRANSFER_IDS), blocks=st.lists(st.integers(0, 99), min_size=1, max_size=3)
    )
    def prefill_finishes(self, transfer_id: str, blocks: list[int]) -> None:
        if transfer_id in self.prefill_reported:
            return  # transfer ids are minted once per request: a prefill never finishes twice
        self.prefill_reported.add(transfer_id)
        self.held[transfer_id] = PrefillBlocks(transfer_id, (tuple(blocks),), len(blocks) * BLOCK_SIZE)
        self.call(
            transfer_id,
            self.table.prefill_finished(transfer_id, (tuple(blocks),), len(blocks) * BLOCK_SIZE, self.now),
        )

    @rule(
        transfer_id=st.sampled_from(TRANSFER_IDS),
        attempt=st.integers(0, 3),
        layout=st.sampled_from([(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 3), (3, 0)]),
        groups=st.integers(1, 2),
        registered=st.integers(0, 3),
        cached=st.integers(0, 2),
        lifetime_ms=st.sampled_from([0, 1000, 4000]),
    )
    def decode_registers(
        self,
        *,
        transfer_id: str,
        attempt: int,
        layout: tuple[int, int],
        groups: int,
        registered: int,
        cached: int,
        lifetime_ms: int,
    ) -> None:
        """Registered and cached block counts that fit the prefill's blocks or do not (then the transfer
        fails)."""
        decode_tp, decode_rank = layout
        blocks = (tuple(range(50, 50 + registered)),) * groups
        message = self.build_registration(
            transfer_id,
            attempt,
            decode_rank=decode_rank,
            decode_tp=decode_tp,
            block_ids=blocks,
            cached_blocks=cached,
            lifetime_ms=lifetime_ms,
        )
        self.sent.add(message)
        self.agents.add(message.agent_name)
        if transfer_id not in self.table:
            self.received_at[message] = self.now  # opens a new entry: its lifetime starts now
        self.received_at.setdefault(message, self.now)
        self.call(transfer_id, self.table.registration_received(message, self.now))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), succeeded=st.booleans())
    def a_write_ends(self, data: st.DataObject, succeeded: bool) -> None:
        """Done, failed, or (for a cancelled one) the cancel confirmed, reported as failed."""
        key = data.draw(st.sampled_from(sorted(self.in_flight, key=repr)))
        self.end_write(key, succeeded)

    def end_write(self, key: WriteKey, succeeded: bool) -> None:
        del self.in_flight[key]
        self.cancelling.discard(key)
        self.ended.add(key)
        events = (
            self.table.write_done(key, self.now)
            if succeeded
            else self.table.write_failed(key, "transport error", self.now)
        )
        self.call(key.transfer_id, events)

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def an_ended_write_reports_again(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.ended, key=repr)))
        assert self.table.write_done(key, self.now) == []
        assert self.table.write_failed(key, "late", self.now) == []

    @rule(transfer_id=st.sampled_from(TRANSFER_IDS), attempt=st.integers(0, 3))
    def decode_aborts(self, transfer_id: str, attempt: int) -> None:
        message = AbortMessage(transfer_id=transfer_id, attempt=attempt, decode_rank=0)
        self.call(transfer_id, self.table.abort_received(message, self.now, sender=ABORTING_AGENT))

    @rule(transfer_id=st.sampled_from(TRANSFER_IDS))
    def prefill_cancels(self, transfer_id: str) -> None:
        self.call(transfer_id, self.table.cancel(transfer_id, "request aborted", self.now))

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 3.0, 6.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.apply(self.table.expire(self.now))

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def open_entries_are_exactly_the_tables(self) -> None:
        assert {transfer_id for transfer_id in TRANSFER_IDS if transfer_id in self.table} == self.open
        assert len(self.table) == len(self.open) <= LIMITS.max_entries

    @invariant()
    def held_blocks_and_writes_belong_to_open_entries(self) -> None:
        assert set(self.held) <= self.open
        assert {key.transfer_id for key in self.in_flight} <= set(self.held)

    @invariant()
    def next_deadline_is_never_late(self) -> None:
        """Whatever can still time out has a deadline. A write past its deadline was cancelled and now
        waits for the transport alone (it never ends on the clock: the liveness probe bounds it), so a
        transfer held open only by such writes has none."""
        deadline = self.table.next_deadline()
        waiting_on_transport = {key.transfer_id for key in self.cancelling}
        if set(self.in_flight) - self.cancelling or self.open - waiting_on_transport:
            assert deadline is not None

    def teardown(self) -> None:
        self.now += LIMITS.prefill_lease_s + LIMITS.registration_lease_s + LIMITS.write_timeout_s + 1
        self.apply(self.table.expire(self.now))
        assert set(self.cancelling) == set(self.in_flight), (
            "a write outlived its deadline without being cancelled"
        )
        for key in sorted(self.in_flight, key=repr):  # the transport ends every write, if only much later
            self.end_write(key, False)
        self.apply(self.table.expire(self.now))
        assert len(self.table) == 0 and not self.open, "entries outlived every deadline"
        assert not self.held, "blocks leaked"


def test_rendezvous_table_invariants_hold_under_any_interleaving(registration):
    machine = type(
        "BoundRendezvousMachine", (RendezvousMachine,), {"build_registration": staticmethod(registration)}
    )
    run_state_machine_as_test(
        machine, settings=settings(max_examples=300, stateful_step_count=40, deadline=None)
    )


def test_a_write_cancelled_past_its_deadline_waits_for_the_transport_not_the_clock(registration):
    """Found by the machine: a registration outlives the write's deadline; the write is cancelled and the
    transfer stays open with no deadline until the transport ends the write, then closes."""
    machine = type("Replay", (RendezvousMachine,), {"build_registration": staticmethod(registration)})()
    machine.decode_registers(
        transfer_id="tx-0", attempt=0, layout=(1, 0), groups=1, registered=2, cached=0, lifetime_ms=4000
    )
    machine.time_passes(2.0)
    machine.prefill_finishes("tx-0", [0, 0])
    (key,) = machine.in_flight
    machine.time_passes(3.0)  # past the write's deadline (2 s after its start)
    assert machine.cancelling == {key} and machine.table.next_deadline() is None
    assert "tx-0" in machine.table and machine.held  # blocks stay pinned while the write may still read
    machine.next_deadline_is_never_late()
    machine.end_write(key, succeeded=False)  # the transport confirms the cancel
    machine.time_passes(0.5)
    assert not machine.held
