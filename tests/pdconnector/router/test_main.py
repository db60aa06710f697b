"""The pd-router command line: refuses to start on a broken config or a missing API key, logs as JSON."""

from __future__ import annotations

import json
import logging

from pdconnector.router.config import dump_router_config
from pdconnector.router.logs import JsonFormatter
from pdconnector.router.main import main


def test_unreadable_or_invalid_config_exits_2_naming_the_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("mode: sideways\n")
    assert main(["--config", str(broken)]) == 2
    assert "broken.yaml" in capsys.readouterr().err


def test_configured_api_key_env_must_be_set(cluster, tmp_path, capsys, monkeypatch):
    path = tmp_path / "router.yaml"
    path.write_text(dump_router_config(cluster.config(api_key_env="PD_TEST_KEY")))
    monkeypatch.delenv("PD_TEST_KEY", raising=False)
    assert main(["--config", str(path)]) == 2
    assert "PD_TEST_KEY" in capsys.readouterr().err


def test_json_logs_carry_extra_fields():
    record = logging.makeLogRecord(
        {"name": "x", "levelname": "INFO", "msg": "request finished", "request_id": "r1", "outcome": "ok"}
    )
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "request finished" and entry["request_id"] == "r1" and entry["outcome"] == "ok"
