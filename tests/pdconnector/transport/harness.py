"""Test harness for the transport contract: registered numpy buffers, deadline-bound polling,
and a peer agent in a child process driven over stdin/stdout (see ``peer_agent``)."""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pdconnector.transport import MemoryRegion, TransferHandle, TransferStatus, Transport, create_transport

REPO = Path(__file__).resolve().parents[3]
KINDS = ("mock", "nixl")
_T = TypeVar("_T")


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Recognisable bytes: a different sequence per seed, computable in any process."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + seed * 31) % 251).astype(np.uint8)


class Buffer:
    """A numpy buffer registered as one region, with descriptor helpers by offset."""

    def __init__(self, nbytes: int, seed: int | None = None) -> None:
        self.array = pattern(nbytes, seed) if seed is not None else np.zeros(nbytes, dtype=np.uint8)
        self.addr = self.array.ctypes.data

    @property
    def region(self) -> MemoryRegion:
        return MemoryRegion(self.addr, self.array.nbytes)

    def descs(self, spans: Iterable[tuple[int, int]]) -> np.ndarray:
        rows = [(self.addr + offset, length, 0) for offset, length in spans]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)


def descs_at(addr: int, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    return np.array([(addr + offset, length, 0) for offset, length in spans], dtype=np.int64).reshape(-1, 3)


def wait_for(
    predicate: Callable[[], _T], *, timeout: float, pump: Sequence[Transport] = (), what: str = "condition"
) -> _T:
    """Poll ``predicate`` (driving ``pump`` agents) with back-off until it is truthy or the deadline
    passes."""
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while True:
        for agent in pump:
            agent.progress()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def finish(
    agent: Transport, handle: TransferHandle, *, pump: Sequence[Transport] = (), timeout: float = 10.0
) -> TransferStatus:
    return wait_for(
        lambda: (s := agent.state(handle)).finished and s,
        timeout=timeout,
        pump=pump,
        what=f"transfer {handle.id} finished",
    )


class PeerProcess:
    """An agent in a child process (``python -m tests.pdconnector.transport.peer_agent``) owning
    one registered buffer filled with ``pattern(nbytes, seed)``."""

    def __init__(self, kind: str, name: str, nbytes: int, seed: int, *, timeout: float = 30.0) -> None:
        self.kind = kind
        self._timeout = timeout
        command = [
            sys.executable,
            "-m",
            "tests.pdconnector.transport.peer_agent",
            kind,
            name,
            str(nbytes),
            str(seed),
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_replies, daemon=True)
        self._reader.start()
        self.pump: Transport | None = None
        hello = self.reply()
        self.name: str = hello["name"]
        self.addr: int = hello["addr"]
        self.metadata = base64.b64decode(hello["metadata"])

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            # NIXL logs to stdout; replies carry a prefix.
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
        self._replies.put(None)

    def reply(self) -> dict[str, Any]:
        """The next reply; meanwhile ``self.pump`` (a local agent, if set) keeps making progress,
        since a peer's transfers and notifications to or from it need both sides to progress."""
        deadline = time.monotonic() + self._timeout
        delay = 0.0005
        while True:
            if self.pump is not None:
                self.pump.progress()
            try:
                reply = self._replies.get(timeout=delay)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"peer process {self.kind} gave no reply within {self._timeout} s"
                    ) from None
                delay = min(delay * 2, 0.01)
        if reply is None:
            raise AssertionError(f"peer process exited (code {self.process.wait(5)})")
        if "error" in reply:
            raise AssertionError(f"peer process failed: {reply['error']}")
        return reply

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def add_peer(self, metadata: bytes) -> str:
        return self.call("add_peer", metadata=base64.b64encode(metadata).decode())["peer"]

    def post(
        self,
        op: str,
        peer: str,
        local: Sequence[tuple[int, int]],
        remote: np.ndarray,
        notification: bytes = b"",
    ) -> None:
        """Start a transfer in the child; its final state is the next :meth:`reply`."""
        self.send(
            op,
            peer=peer,
            local=list(local),
            remote=remote.tolist(),
            notification=base64.b64encode(notification).decode(),
        )

    def notify(self, peer: str, message: bytes) -> None:
        self.call("notify", peer=peer, message=base64.b64encode(message).decode())

    def notifications(self, count: int, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        reply = self.call("notifications", count=count, timeout=timeout)
        return [(peer, base64.b64decode(message)) for peer, message in reply["notifications"]]

    def dump(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.call("dump")["data"]), dtype=np.uint8)

    def idle_cpu_seconds(self, seconds: float) -> float:
        return self.call("idle", seconds=seconds)["cpu_seconds"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit")
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.stdout is not None:
            self.process.stdout.close()


def new_agent(kind: str, name: str) -> Transport:
    return create_transport(kind, name)  # type: ignore[arg-type]
