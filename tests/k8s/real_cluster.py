"""Helpers for tests against the real CRD-serving API server (``real_server.RealApiServer``): kubectl bound to
it, CRD installation that waits for the server's own verdict, and warnings read from its answers.

A warning is how the real server reports what it accepted but will not keep (an unknown field it pruned, a
deprecated API): the tests here treat one as a failure, so every helper hands them back instead of hiding
them.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .real_server import RealApiServer

CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@dataclass(frozen=True)
class KubectlResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def warnings(self) -> list[str]:
        """kubectl prints each warning header of the server's answers as a ``Warning: ...`` line."""
        return [line for line in self.stderr.splitlines() if line.startswith("Warning:")]


@dataclass(frozen=True)
class RealKubectl:
    """The real kubectl binary with a kubeconfig for the real server, in one namespace."""

    binary: Path
    kubeconfig: Path
    namespace: str

    def __call__(self, *args: str, stdin: str | None = None, namespaced: bool = True) -> KubectlResult:
        namespace = ["--namespace", self.namespace] if namespaced else []
        done = subprocess.run(
            [str(self.binary), "--kubeconfig", str(self.kubeconfig), *namespace, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return KubectlResult(done.returncode, done.stdout, done.stderr)

    def apply(self, *documents: dict[str, Any]) -> KubectlResult:
        """``kubectl apply --validate=strict`` of namespaced documents, each moved to this namespace."""
        placed = [{**doc, "metadata": {**doc["metadata"], "namespace": self.namespace}} for doc in documents]
        return self("apply", "--validate=strict", "-f", "-", stdin=yaml.safe_dump_all(placed))


def kubectl_for(server: RealApiServer, binary: Path, workdir: Path, namespace: str) -> RealKubectl:
    workdir.mkdir(parents=True, exist_ok=True)
    return RealKubectl(
        binary, server.write_kubeconfig(workdir / f"kubeconfig-{namespace}", namespace), namespace
    )


def warnings_of(headers: dict[str, str]) -> list[str]:
    """The Warning headers of a raw answer (``299 - "unknown field ..."``)."""
    return [value for key, value in headers.items() if key.lower() == "warning"]


def conditions(crd: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions", [])}


def wait_established(server: RealApiServer, name: str, timeout: float = 30.0) -> dict[str, Any]:
    """The CRD once the server says Established and NamesAccepted (its controllers decide, not us)."""
    deadline = time.monotonic() + timeout
    while True:
        status, crd, _ = server.request("GET", f"{CRD_API}/{name}")
        assert status == 200, crd
        seen = conditions(crd)
        if seen.get("Established") == "True" and seen.get("NamesAccepted") == "True":
            return crd
        assert time.monotonic() < deadline, f"{name} not established: {crd.get('status')}"
        time.sleep(0.1)


def served(server: RealApiServer, path: str, timeout: float = 30.0) -> None:
    """Wait until the server serves a CRD's resource path (discovery lags Established by a moment)."""
    deadline = time.monotonic() + timeout
    while server.request("GET", path)[0] == 404:
        assert time.monotonic() < deadline, f"{path} is not served"
        time.sleep(0.1)


def install_crd(
    server: RealApiServer, kubectl: RealKubectl, path: Path, *, server_side: bool = False
) -> KubectlResult:
    """``kubectl apply`` a CRD file and wait until the server establishes it; the apply's result (its
    warnings included) for the caller to judge. ``server_side`` for CRDs too large for client-side apply,
    whose last-applied annotation must fit in 256 KiB."""
    mode = ["--server-side", "--force-conflicts"] if server_side else []
    result = kubectl("apply", *mode, "--validate=strict", "-f", str(path), namespaced=False)
    assert result.returncode == 0, result.stderr
    wait_established(server, yaml.safe_load(path.read_text())["metadata"]["name"])
    return result
