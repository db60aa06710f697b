"""The real CRD-serving API server (``pd-apiserver``, built by ``scripts/build-apiserver.sh``) and its etcd,
as processes on free loopback ports with their own data directory, stopped by PID.

    with RealApiServer(workdir) as server:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        server.request("GET", "/apis")

It serves what kube-apiserver serves for ``apiextensions.k8s.io`` and every CRD group (structural schemas,
defaulting, pruning, CEL validation, status subresources, watches, server-side apply), from Kubernetes' own
code, and nothing of the core API (``tests/k8s/apiserver/main.go`` says what its main replaces). The process
handling is ``control_plane.ControlPlane``'s, shared with the full kube-apiserver of ``envtest.py``.
"""

from __future__ import annotations

import os
import pathlib

from tests.ports import free_port

from .control_plane import START_TIMEOUT_S, ControlPlane
from .harness import REPO_ROOT

__all__ = ["BINARIES", "START_TIMEOUT_S", "ApiServerMissing", "RealApiServer", "free_port"]

BINARIES = pathlib.Path(os.environ.get("PD_APISERVER_BIN", REPO_ROOT / ".cache" / "apiserver" / "bin"))


class ApiServerMissing(RuntimeError):
    """``scripts/build-apiserver.sh`` has not been run."""


class RealApiServer(ControlPlane):
    """etcd plus ``pd-apiserver`` on 127.0.0.1, state under ``workdir`` (kept across ``restart()``)."""

    server_name = "pd-apiserver"
    kubeconfig_name = "real"

    def __init__(self, workdir: pathlib.Path) -> None:
        for binary in ("pd-apiserver", "etcd"):
            if not (BINARIES / binary).exists():
                raise ApiServerMissing(f"{BINARIES / binary} is missing: run scripts/build-apiserver.sh")
        super().__init__(workdir, BINARIES)

    def prepare(self) -> None:
        (self.workdir / "token").write_text(self.token)

    def server_args(self) -> list[str]:
        return [
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--token-file={self.workdir / 'token'}",
            # On SIGTERM the server ends open watches within this grace period; without it, it waits for
            # them and stop() falls back to SIGKILL after 10 s (every restart with a watching operator).
            "--shutdown-watch-termination-grace-period=1s",
        ]

    @property
    def certificate(self) -> pathlib.Path:
        # pd-apiserver signs its own on first start; it names localhost and 127.0.0.1, and hostname checks
        # stay off so that clients may use either
        return self.workdir / "certs" / "apiserver.crt"
