"""The real CRD-serving API server (``pd-apiserver``, built by ``scripts/build-apiserver.sh``) and its etcd,
as processes on free loopback ports with their own data directory, stopped by PID.

    with RealApiServer(workdir) as server:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        server.request("GET", "/apis")

It serves what kube-apiserver serves for ``apiextensions.k8s.io`` and every CRD group (structural schemas,
defaulting, pruning, CEL validation, status subresources, watches, server-side apply), from Kubernetes' own
code, and nothing of the core API (``tests/k8s/apiserver/main.go`` says what its main replaces).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Self

import yaml

from .harness import REPO_ROOT

BINARIES = pathlib.Path(os.environ.get("PD_APISERVER_BIN", REPO_ROOT / ".cache" / "apiserver" / "bin"))
START_TIMEOUT_S = 60.0


class ApiServerMissing(RuntimeError):
    """``scripts/build-apiserver.sh`` has not been run."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)


class RealApiServer:
    """etcd plus ``pd-apiserver`` on 127.0.0.1, state under ``workdir`` (kept across ``restart()``)."""

    def __init__(self, workdir: pathlib.Path) -> None:
        for binary in ("pd-apiserver", "etcd"):
            if not (BINARIES / binary).exists():
                raise ApiServerMissing(f"{BINARIES / binary} is missing: run scripts/build-apiserver.sh")
        self.workdir = workdir
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self._etcd_ports = (free_port(), free_port())
        self._etcd: subprocess.Popen[bytes] | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE  # replaced by the server's own certificate once it exists

    # ---- lifecycle

    def __enter__(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "token").write_text(self.token)
        try:
            self._start_etcd()
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _stop(self._server)
        _stop(self._etcd)

    def _start_etcd(self) -> None:
        client, peer = self._etcd_ports
        self._etcd = self._spawn(
            "etcd",
            [
                "--name=pd-tests",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=pd-tests=http://127.0.0.1:{peer}",
                "--log-level=warn",
            ],
        )

    def start(self) -> None:
        """Start the API server (again, after ``stop()``) on the same port and etcd, and wait until it is
        ready."""
        client, _ = self._etcd_ports
        self._server = self._spawn(
            "pd-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{client}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--token-file={self.workdir / 'token'}",
            ],
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for name, process in (("etcd", self._etcd), ("pd-apiserver", self._server)):
                assert process is not None
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/readyz")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"pd-apiserver not ready in {START_TIMEOUT_S} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        self._ssl = ssl.create_default_context(cafile=str(self.certificate))
        self._ssl.check_hostname = False  # the certificate names localhost and 127.0.0.1; keep both usable

    def stop(self) -> None:
        """Stop the API server only (etcd and the stored objects stay)."""
        _stop(self._server)
        self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        with log:
            return subprocess.Popen([str(BINARIES / name), *args], stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str = "pd-apiserver") -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def certificate(self) -> pathlib.Path:
        return self.workdir / "certs" / "apiserver.crt"

    # ---- clients

    def write_kubeconfig(self, path: pathlib.Path, namespace: str = "default") -> pathlib.Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "real",
                    "cluster": {"server": self.url, "certificate-authority": str(self.certificate)},
                }
            ],
            "users": [{"name": "tester", "user": {"token": self.token}}],
            "contexts": [
                {"name": "real", "context": {"cluster": "real", "user": "tester", "namespace": namespace}}
            ],
            "current-context": "real",
        }
        path.write_text(yaml.safe_dump(config))
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
