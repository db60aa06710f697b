"""The transfer thread's heartbeat, and the check an engine's liveness probe runs on it.

The worker thread stamps ``<dir>/rank-<N>`` (its modification time) at most once a second while its loop
turns, and stops stamping while a transfer it could not cancel is past its deadline: a frozen thread or a
stuck transfer both leave a stale file, the probe fails, the kubelet kills the container, and its NIC
context goes with it. That bounds how long a silent prefill can still touch decode's memory
(:mod:`pdconnector.protocol.liveness`). The check passes while no heartbeat exists yet (the model is loading;
the startup probe covers that) and, given ``--url``, also asks the engine's HTTP health endpoint.

    python -m pdconnector.worker.liveness DIR --max-age 10 --url http://127.0.0.1:8000/health

where ``DIR`` is the heartbeat directory (``/tmp/pdconnector-heartbeat`` in the rendered probe).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

BEAT_INTERVAL_S = 1.0


class Heartbeat:
    """Stamps ``directory/rank-<tp_rank>``; no directory: does nothing (tests, and engines without the
    probe)."""

    def __init__(self, directory: str | None, tp_rank: int) -> None:
        self.path = Path(directory) / f"rank-{tp_rank}" if directory else None
        self._last = float("-inf")
        self._stopped = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self, now: float, *, healthy: bool) -> None:
        """Called every loop turn with the worker's monotonic clock; ``healthy``: no transfer is stuck."""
        if self.path is None:
            return
        if not healthy:
            if not self._stopped:
                log.error(
                    "heartbeat %s stopped: a transfer is stuck past its deadline; the liveness probe will "
                    "restart the engine",
                    self.path,
                )
            self._stopped = True
            return
        self._stopped = False
        if now - self._last >= BEAT_INTERVAL_S:
            self.path.touch()
            self._last = now


def stale_heartbeats(directory: Path, max_age_s: float, now: float) -> list[str]:
    """The heartbeat files under ``directory`` older than ``max_age_s`` (wall clock ``now``), described."""
    if not directory.is_dir():
        return []
    stale = []
    for path in sorted(directory.glob("rank-*")):
        age = now - path.stat().st_mtime
        if age > max_age_s:
            stale.append(f"{path.name}: last beat {age:.1f}s ago (limit {max_age_s}s)")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdconnector.worker.liveness",
        description="Liveness check of an engine's transfer threads.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--max-age", type=float, required=True, help="seconds a heartbeat may be old")
    parser.add_argument("--url", help="also require this health endpoint to answer 200")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    stale = stale_heartbeats(args.directory, args.max_age, time.time())
    if stale:
        print("transfer thread not alive: " + "; ".join(stale), file=sys.stderr)
        return 1
    if args.url:
        try:
            with urllib.request.urlopen(args.url, timeout=args.timeout) as response:
                if response.status != 200:
                    print(f"{args.url} answered {response.status}", file=sys.stderr)
                    return 1
        except (urllib.error.URLError, OSError) as error:
            print(f"{args.url}: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
