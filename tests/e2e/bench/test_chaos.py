"""Chaos through the router on real vLLM CPU engines, short form (``e2e/bench/chaos.py --short``, as its own
process): 2 prefill + 2 decode engines behind the router, requests with mixed prompt lengths, a decode engine
SIGKILLed and restarted and a prefill engine frozen (SIGSTOP, SIGCONT) meanwhile.

What must hold: no answer the router served differs from the decode engine's co-located answer; every request
is answered (served, or refused with a named error) within the hang bound; most are served; once all is quiet
no engine holds a KV block.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_faults_on_real_engines_behind_the_router_never_change_an_answer_hang_a_client_or_leak_a_block(
    tmp_path: Path,
) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "e2e" / "bench" / "chaos.py"), "--short", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "chaos-push.json").read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "mismatches"}, indent=1))  # shown on failure

    assert [fault["kind"] for fault in report["faults"]] == ["kill", "freeze"]
    assert report["wrong"] == 0, report["mismatches"]
    assert report["hangs"] == 0 and report["slowest_s"] <= report["hang_bound_s"]
    assert report["served"] >= report["requests"] // 2, report["error_examples"]
    assert set(report["kv_cache_usage_after"].values()) == {0.0}
