"""The faults chaos tests inject into the mock transport: read from the environment, refused when
malformed."""

import json

import pytest
from pdconnector.transport.mock_faults import FAULTS_ENV, MockFaults


def test_no_variable_means_no_faults() -> None:
    assert MockFaults.from_env({}) is None
    assert MockFaults.from_env({FAULTS_ENV: ""}) is None


def test_faults_are_read_from_json() -> None:
    faults = MockFaults.from_env(
        {
            FAULTS_ENV: json.dumps(
                {"write_delay_s": 7, "delayed_writes": 1, "notification_drop_rate": 0.25, "seed": 3}
            )
        }
    )
    assert faults == MockFaults(write_delay_s=7, delayed_writes=1, notification_drop_rate=0.25, seed=3)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"write_delay": 1}), "expected an object with keys"),
        (json.dumps([1]), "expected an object with keys"),
        (json.dumps({"write_delay_s": -1}), "write_delay_s"),
        (json.dumps({"notification_drop_rate": 2}), "notification_drop_rate"),
        (json.dumps({"delayed_writes": -2}), "delayed_writes"),
    ],
)
def test_malformed_faults_are_refused_naming_the_key(raw: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        MockFaults.from_env({FAULTS_ENV: raw})


def test_the_drop_draw_is_seeded() -> None:
    first, second = MockFaults(seed=5).dropper(), MockFaults(seed=5).dropper()
    assert [first.random() for _ in range(5)] == [second.random() for _ in range(5)]
