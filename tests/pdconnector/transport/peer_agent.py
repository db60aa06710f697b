"""Child-process side of ``harness.PeerProcess``: one agent, one registered buffer, commands as JSON
lines on stdin, replies as ``@@ {json}`` lines on stdout. Between commands it drives the agent's
progress with back-off, as the transfer worker does, so peers' transfers into it complete."""

from __future__ import annotations

import base64
import json
import select
import sys
import time
from typing import Any

import numpy as np
from pdconnector.transport import Transport, TransportError, create_transport

from tests.pdconnector.transport.harness import Buffer, finish, wait_for


def _reply(body: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(body) + "\n")
    sys.stdout.flush()


class PeerAgent:
    def __init__(self, kind: str, name: str, nbytes: int, seed: int) -> None:
        self.agent: Transport = create_transport(kind, name)  # type: ignore[arg-type]
        self.buffer = Buffer(nbytes, seed)
        self.agent.register([self.buffer.region])
        self.inbox: list[tuple[str, bytes]] = []

    def pump(self) -> bool:
        arrived = self.agent.take_notifications()
        self.inbox.extend(arrived)
        return bool(arrived)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "add_peer":
            return {"peer": self.agent.add_peer(base64.b64decode(command["metadata"]))}
        if op in ("write", "read"):
            post = self.agent.write if op == "write" else self.agent.read
            local = self.buffer.descs(command["local"])
            remote = np.array(command["remote"], dtype=np.int64).reshape(-1, 3)
            handle = post(command["peer"], local, remote, base64.b64decode(command["notification"]))
            status = finish(self.agent, handle)
            self.agent.release(handle)
            return {"state": status.state.value, "message": status.error}
        if op == "notify":
            self.agent.notify(command["peer"], base64.b64decode(command["message"]))
            return {}
        if op == "notifications":
            wait_for(
                lambda: (self.pump() or True) and len(self.inbox) >= command["count"],
                timeout=command["timeout"],
                what="notifications",
            )
            taken, self.inbox = self.inbox, []
            return {"notifications": [[peer, base64.b64encode(m).decode()] for peer, m in taken]}
        if op == "dump":
            return {"data": base64.b64encode(self.buffer.array.tobytes()).decode()}
        if op == "idle":
            # No agent calls at all: whatever CPU the process burns now is the agent's own threads.
            start = time.process_time()
            time.sleep(command["seconds"])
            return {"cpu_seconds": time.process_time() - start}
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    kind, name, nbytes, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    peer = PeerAgent(kind, name, nbytes, seed)
    _reply(
        {
            "name": peer.agent.name,
            "addr": peer.buffer.addr,
            "metadata": base64.b64encode(peer.agent.metadata()).decode(),
        }
    )
    poller = select.poll()
    poller.register(sys.stdin, select.POLLIN)
    idle_ms = 1
    while True:
        if not poller.poll(idle_ms):
            idle_ms = 1 if peer.pump() else min(idle_ms * 2, 20)
            continue
        line = sys.stdin.readline()
        if not line:
            break
        command = json.loads(line)
        if command["op"] == "exit":
            break
        try:
            _reply(peer.handle(command))
        except (TransportError, AssertionError, ValueError, KeyError) as error:
            _reply({"error": f"{type(error).__name__}: {error}"})
        idle_ms = 1
    peer.agent.close()
    _reply({})


if __name__ == "__main__":
    main()
