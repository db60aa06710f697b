"""The transfer thread's heartbeat and the liveness check the operator renders into engine pods."""

import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdconnector.worker.liveness import BEAT_INTERVAL_S, Heartbeat, main, stale_heartbeats


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_heartbeat_stamps_its_rank_file_at_most_once_per_interval(tmp_path: Path) -> None:
    heartbeat = Heartbeat(str(tmp_path / "beats"), tp_rank=3)
    heartbeat.beat(100.0, healthy=True)
    path = tmp_path / "beats" / "rank-3"
    assert path.exists()
    _age(path, 50)
    heartbeat.beat(100.0 + BEAT_INTERVAL_S / 2, healthy=True)
    assert stale_heartbeats(tmp_path / "beats", 30, time.time())  # not stamped again yet
    heartbeat.beat(100.0 + BEAT_INTERVAL_S, healthy=True)
    assert stale_heartbeats(tmp_path / "beats", 30, time.time()) == []


def test_a_stuck_transfer_stops_the_heartbeat(tmp_path: Path) -> None:
    heartbeat = Heartbeat(str(tmp_path), tp_rank=0)
    heartbeat.beat(0.0, healthy=True)
    _age(tmp_path / "rank-0", 50)
    heartbeat.beat(10.0, healthy=False)
    assert len(stale_heartbeats(tmp_path, 30, time.time())) == 1  # not stamped while stuck
    heartbeat.beat(20.0, healthy=True)  # unstuck: beats again
    assert stale_heartbeats(tmp_path, 30, time.time()) == []


def test_without_a_directory_nothing_is_written(tmp_path: Path) -> None:
    Heartbeat(None, tp_rank=0).beat(0.0, healthy=True)
    assert list(tmp_path.iterdir()) == []


def test_the_check_passes_before_any_heartbeat_and_names_a_stale_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "none-yet"), "--max-age", "10"]) == 0
    Heartbeat(str(tmp_path), tp_rank=0).beat(0.0, healthy=True)
    Heartbeat(str(tmp_path), tp_rank=1).beat(0.0, healthy=True)
    assert main([str(tmp_path), "--max-age", "10"]) == 0
    _age(tmp_path / "rank-1", 60)
    assert main([str(tmp_path), "--max-age", "10"]) == 1
    assert "rank-1: last beat" in capsys.readouterr().err


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_url() -> Iterator[tuple[str, type[_Health]]]:
    handler = type("Health", (_Health,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/health", handler
    server.shutdown()


def test_the_check_also_requires_the_health_endpoint(
    tmp_path: Path, health_url: tuple[str, type[_Health]]
) -> None:
    url, handler = health_url
    assert main([str(tmp_path), "--max-age", "10", "--url", url]) == 0
    handler.status = 503
    assert main([str(tmp_path), "--max-age", "10", "--url", url]) == 1
    assert (
        main([str(tmp_path), "--max-age", "10", "--url", "http://127.0.0.1:1/health", "--timeout", "1"]) == 1
    )
