"""What every API server the tests start has in common: an etcd and a server binary as processes on free
loopback ports, state under one work directory, stopped by PID, ready when ``/readyz`` answers 200 to the
test token, and a kubeconfig and a small HTTP client for it.

Subclasses say which binary, with which flags and credentials (``real_server.RealApiServer``: pd-apiserver,
the CRD-serving half built here; ``envtest.KubeApiServer``: a full kube-apiserver from
``KUBEBUILDER_ASSETS``).
"""

from __future__ import annotations

import abc
import contextlib
import json
import pathlib
import secrets
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, ClassVar, Self

import yaml

from tests.ports import free_port

START_TIMEOUT_S = 60.0


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    """SIGTERM (both servers shut down gracefully on it), SIGKILL if that takes longer than ``timeout``."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)


class ControlPlane(abc.ABC):
    """etcd plus ``server_name`` from ``binaries`` on 127.0.0.1, state under ``workdir`` (kept across
    ``restart()``)."""

    server_name: ClassVar[str]
    kubeconfig_name: ClassVar[str]
    etcd_extra_args: ClassVar[tuple[str, ...]] = ()
    # Only a server whose certificate the harness wrote itself is known to name 127.0.0.1.
    verify_hostname: ClassVar[bool] = False

    def __init__(self, workdir: pathlib.Path, binaries: pathlib.Path) -> None:
        self.workdir = workdir
        self.binaries = binaries
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self._etcd_ports = (free_port(), free_port())
        self._etcd: subprocess.Popen[bytes] | None = None
        self._server: subprocess.Popen[bytes] | None = None
        # Until the server is ready its certificate may not exist yet (a server that signs its own on first
        # start); readiness is polled without verification and every later request verifies.
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE

    # ---- what a subclass says

    @abc.abstractmethod
    def prepare(self) -> None:
        """Write credentials (and certificates) under ``workdir`` before the first start."""

    @abc.abstractmethod
    def server_args(self) -> list[str]:
        """The server binary's flags."""

    @property
    @abc.abstractmethod
    def certificate(self) -> pathlib.Path:
        """The PEM file a client trusts the server's serving certificate with."""

    # ---- lifecycle

    def __enter__(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.prepare()
            self._start_etcd()
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self._server)
        stop_process(self._etcd)

    def etcd_args(self) -> list[str]:
        client, peer = self._etcd_ports
        return [
            "--name=pd-tests",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=pd-tests=http://127.0.0.1:{peer}",
            "--log-level=warn",
            *self.etcd_extra_args,
        ]

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self._etcd_ports[0]}"

    def _start_etcd(self) -> None:
        self._etcd = self._spawn("etcd", self.etcd_args())

    def start(self) -> None:
        """Start the API server (again, after ``stop()``) on the same port and etcd, and wait until it is
        ready."""
        self._server = self._spawn(self.server_name, self.server_args())
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for name, process in (("etcd", self._etcd), (self.server_name, self._server)):
                assert process is not None
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/readyz")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.server_name} not ready in {START_TIMEOUT_S} s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.1)
        self._ssl = ssl.create_default_context(cafile=str(self.certificate))
        self._ssl.check_hostname = self.verify_hostname

    def stop(self) -> None:
        """Stop the API server only (etcd and the stored objects stay)."""
        stop_process(self._server)
        self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def pids(self) -> dict[str, int]:
        """PIDs of the processes running now, by name (what ``__exit__`` stops)."""
        running = {"etcd": self._etcd, self.server_name: self._server}
        return {name: p.pid for name, p in running.items() if p is not None and p.poll() is None}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        with log:
            return subprocess.Popen([str(self.binaries / name), *args], stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str | None = None) -> str:
        path = self.workdir / f"{name or self.server_name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ---- clients

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        name = self.kubeconfig_name
        cluster = {"server": self.url, "certificate-authority": str(self.certificate)}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": cluster}],
            "users": [{"name": "tester", "user": {"token": self.token}}],
            "contexts": [
                {"name": name, "context": {"cluster": name, "user": "tester", "namespace": namespace}}
            ],
            "current-context": name,
        }

    def write_kubeconfig(self, path: pathlib.Path, namespace: str = "default") -> pathlib.Path:
        path.write_text(yaml.safe_dump(self.kubeconfig(namespace)))
        return path

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> tuple[int, Any, dict[str, str]]:
        """One request: ``(status, decoded JSON body or None, headers)``; failures are answers, not raises."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._ssl) as response:
                status, raw, answer_headers = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as error:
            status, raw, answer_headers = error.code, error.read(), dict(error.headers)
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        return status, decoded, answer_headers
