"""Run a command under a time limit, then end every process it left behind.

    usage: python3 scripts/run_reaped.py SECONDS COMMAND [ARG...]

Exits with the command's status, or 124 when the limit ended it (as coreutils' ``timeout`` does).

Why not ``timeout``: it ends the command, not what the command started. The connector's real-engine tests
start vLLM engines in sessions of their own (so a test can stop one with its process group); when a step's
limit ended pytest, its engines lived on and held GPU memory and compute through the next step: on the GPU
machine a serving run beside two leftover engines measured TPOT 76 ms instead of 49. This process makes itself
the subreaper of everything the command starts (Linux ``PR_SET_CHILD_SUBREAPER``): an orphan is re-parented
here, not to init, so it is found among this process's children and ended, by PID, once the command is over.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
# What the command gets to end cleanly once its limit passed, and what a leftover gets after SIGTERM (a vLLM
# engine stops its engine core and frees the GPU within seconds).
GRACE_S = 15.0
TIMED_OUT = 124


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def children() -> list[int]:
    """This process's living children (orphans of the command included), from /proc."""
    me = os.getpid()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the field after the parenthesised name: state, then the parent's PID
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(parent) == me and state != "Z":
            found.append(int(stat.parent.name))
    return found


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_leftovers() -> list[int]:
    """SIGTERM every child, SIGKILL those alive after the grace; again for what their deaths orphaned."""
    ended = []
    while pids := children():
        ended += pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and set(pids) & set(children()):
            reap_zombies()
            time.sleep(0.2)
        for pid in set(pids) & set(children()):
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        reap_zombies()
    return ended


def run(seconds: float, command: list[str]) -> int:
    become_subreaper()
    process = subprocess.Popen(command)
    try:
        status = process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        print(f"run_reaped: {command[0]} ran past {seconds:g} s; ending it", file=sys.stderr)
        process.terminate()
        try:
            process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        status = TIMED_OUT
    if ended := end_leftovers():
        print(f"run_reaped: ended {len(ended)} processes left behind: {sorted(ended)}", file=sys.stderr)
    return status


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python3 scripts/run_reaped.py SECONDS COMMAND [ARG...]", file=sys.stderr)
        return 2
    return run(float(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
