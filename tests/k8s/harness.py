"""Drive an emulated cluster the way users do: the real ``kubectl`` and the real ``pd-operator`` process.

- ``Kubectl``: runs the binary against the emulator's kubeconfig (``--validate=false``: the
  emulator serves no OpenAPI schemas).
- ``OperatorProcess``: ``python -m pdoperator.cli.operator_main`` as a subprocess, log to a file,
  stopped with SIGTERM (kopf's graceful stop) and killed if it does not stop.
- ``eventually``: poll a condition with a deadline; the failure names what was awaited.
- ``writes_by``/``rbac_violations``: which requests a client made, and which the RBAC rules deny.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kmock._internal import rendering

from .api_rules import parse_k8s_path

T = TypeVar("T")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
OPERATOR_AGENTS = ("kopf/", "pd-operator/")


class Kubectl:
    def __init__(self, binary: pathlib.Path, kubeconfig: pathlib.Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        command = [str(self.binary), "--kubeconfig", str(self.kubeconfig), *args]
        result = subprocess.run(
            command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def apply(self, manifest_yaml: str) -> str:
        return self.run("apply", "--validate=false", "-f", "-", stdin=manifest_yaml).stdout

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run("get", *args, "-o", "json").stdout)


class OperatorProcess:
    """The real operator, as its console script would run it (``pd-operator`` = ``operator_main:main``)."""

    def __init__(self, kubeconfig: pathlib.Path, log_path: pathlib.Path, args: Sequence[str]) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.args = list(args)
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake this for a pod
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "pdoperator.cli.operator_main", *self.args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )

    def stop(self, timeout: float = 20) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                return process.wait(timeout)
        return process.returncode

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def eventually(check: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns a truthy value (returned) or the deadline passes (AssertionError naming
    ``what``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except (AssertionError, KeyError, IndexError, TypeError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def is_operator_request(request: rendering.Request) -> bool:
    return request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS)


def writes_by_operator(requests: Sequence[rendering.Request]) -> list[str]:
    """``"PATCH /apis/..."`` lines of every write the operator (kopf or the reconciler) made."""
    return [
        f"{r.method.value} {r.url.path}"
        for r in requests
        if is_operator_request(r) and r.method.value in WRITE_METHODS
    ]


def rbac_verb(request: rendering.Request) -> str:
    method = request.method.value
    if method == "GET":
        return (
            "watch" if request.params.get("watch") in ("true", "1") else ("get" if request.name else "list")
        )
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(
        method, "delete" if request.name else "deletecollection"
    )


def rbac_attributes(request: rendering.Request) -> tuple[str, str, str] | None:
    """``(verb, apiGroup, resource[/subresource])`` of a resource request; None for discovery and other
    non-resource URLs."""
    resource, _, name, subresource = parse_k8s_path(request.url.path)
    if resource is None:
        return None
    plural = f"{resource.plural}/{subresource}" if subresource and name else str(resource.plural)
    return rbac_verb(request), str(resource.group), plural
