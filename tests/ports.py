"""Where the servers tests start listen: ports on loopback addresses, and ipc sockets.

They are picked below the range outgoing connections draw their ports from (Linux: 32768-60999): a server
binds its port a moment (or seconds) after the pick, and an ephemeral one can be taken meanwhile by an
outgoing connection, such as the API server's own connection to etcd or an engine's to its peer (EADDRINUSE
in CI).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator

LISTEN_PORTS = range(20000, 32000)
LOOPBACK = "127.0.0.1"


def free_port(*hosts: str) -> int:
    """A TCP port free right now on every one of ``hosts`` (loopback by default), outside the ephemeral
    range."""
    hosts = hosts or (LOOPBACK,)
    for port in random.sample(LISTEN_PORTS, 64):
        with contextlib.ExitStack() as stack:
            try:
                for host in hosts:
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port of {LISTEN_PORTS} free on {', '.join(hosts)} in 64 tries")


@contextlib.contextmanager
def ipc_endpoint(name: str = "events") -> Iterator[str]:
    """A ZMQ ipc endpoint in a fresh directory, removed afterwards: vLLM binds ipc and wildcard endpoints (it
    would connect to a host:port), and nothing listens beyond this machine."""
    directory = tempfile.mkdtemp(prefix="kv-")  # short: ipc paths are limited to ~100 characters
    try:
        yield f"ipc://{directory}/{name}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)
