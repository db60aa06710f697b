"""A transfer's timeline: stages are taken between stamps of one rank, only when both ends were passed."""

from __future__ import annotations

from pdconnector.protocol.timeline import STAGES, Milestone, Stage, Timeline


def timeline(**marks: float) -> Timeline:
    line = Timeline()
    for name, now in marks.items():
        line.mark(Milestone(name), now)
    return line


def test_a_push_on_prefill_splits_into_waiting_for_decode_posting_writing_and_holding() -> None:
    line = timeline(prefilled=1.0, registered=1.5, posted=1.5002, written=1.52, released=1.52)
    stages = line.stages()
    assert stages.keys() == {"registration", "post", "write", "hold"}
    assert stages["registration"] == 0.5
    assert (
        abs(stages["post"] - 0.0002) < 1e-9
        and abs(stages["write"] - 0.0198) < 1e-9
        and abs(stages["hold"] - 0.52) < 1e-9
    )


def test_a_registration_that_came_before_the_prefill_finished_waited_for_nothing() -> None:
    stages = timeline(registered=1.0, prefilled=2.0, posted=2.001).stages()
    assert stages["registration"] == 0.0
    assert abs(stages["post"] - 0.001) < 1e-9  # counted from the later half


def test_a_stage_missing_an_end_is_left_out() -> None:
    assert timeline(requested=1.0, handshaken=1.001, asked=1.001).stages().keys() == {"handshake"}


def test_first_stamps_stay_except_for_the_per_rank_ones_where_the_last_counts() -> None:
    line = timeline(requested=1.0)
    line.mark(Milestone.REQUESTED, 5.0)
    line.mark(Milestone.REGISTERED, 2.0)
    line.mark(Milestone.REGISTERED, 3.0)
    assert line.marks == {Milestone.REQUESTED: 1.0, Milestone.REGISTERED: 3.0}


def test_every_stage_with_milestones_names_milestones_a_rank_passes() -> None:
    decode = {Milestone.REQUESTED, Milestone.HANDSHAKEN, Milestone.ASKED, Milestone.RECEIVED}
    for stage, (starts, end) in STAGES.items():
        side = {*starts, end}
        assert side <= decode or not side & decode, f"{stage} mixes the two sides' clocks"
    assert {Stage.ADMISSION, Stage.RESUME}.isdisjoint(STAGES)  # the scheduler's, timed by vLLM's steps
