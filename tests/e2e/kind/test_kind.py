"""The GPU-free end-to-end suite on a real cluster (kind): operator, router and mock engines moving KV bytes.

Run it with `e2e/kind/run.sh` on a machine with Docker and kind. It needs the operator installed by the
chart (run.sh does that) and runs against the current kubeconfig, which must point at a local kind
cluster (API server on loopback). Everywhere else it skips, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
READY_TIMEOUT_S = 300.0
pytestmark = pytest.mark.kind


def _local_kind_cluster() -> str | None:
    """Why the suite cannot run here, or None when a local kind cluster is reachable."""
    if os.environ.get("PD_E2E_KIND") != "1":
        return (
            "kind suite disabled: no Docker engine or kind cluster on this machine; run e2e/kind/run.sh "
            "where Docker and kind exist"
        )
    try:
        from kubernetes import config  # noqa: PLC0415 - only where the suite runs

        _, context = config.list_kube_config_contexts()
        config.load_kube_config()
        from kubernetes.client import Configuration  # noqa: PLC0415

        host = urlparse(Configuration.get_default_copy().host).hostname or ""
    except Exception as error:  # any kubeconfig problem means "no cluster here"
        return f"no usable kubeconfig: {error}"
    if not context["name"].startswith("kind-"):
        return f"current context {context['name']!r} is not a kind cluster"
    if host != "localhost" and not ip_address(host).is_loopback:
        return f"API server {host} is not on loopback"
    return None


_skip_reason = _local_kind_cluster()
if _skip_reason:
    pytestmark = [pytest.mark.kind, pytest.mark.skip(reason=_skip_reason)]


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def pdservice(namespace: str, name: str) -> dict[str, Any]:
    return json.loads(kubectl("get", "pdservice", name, "-n", namespace, "-o", "json"))


def is_ready(namespace: str, name: str, decode_replicas: int = 1) -> bool:
    obj = pdservice(namespace, name)
    status = obj.get("status", {})
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
    return (
        ready
        and status.get("observedGeneration") == obj["metadata"]["generation"]
        and status.get("decode", {}).get("readyReplicas") == decode_replicas
    )


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"pd-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def tiny(namespace: str) -> str:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["namespace"] = namespace
    if image := os.environ.get("PD_E2E_IMAGE"):
        manifest["spec"]["engine"]["image"] = image
        manifest["spec"]["router"]["image"] = image
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    name = manifest["metadata"]["name"]
    wait_for(f"PDService {namespace}/{name} Ready", lambda: is_ready(namespace, name))
    return name


@contextlib.contextmanager
def port_forward(namespace: str, service: str, remote_port: int) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local_port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            "kubectl",
            "port-forward",
            "-n",
            namespace,
            f"svc/{service}",
            f"{local_port}:{remote_port}",
            "--address",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{local_port}"
    try:
        wait_for("port-forward", lambda: _responds(f"{base}/health"), timeout_s=30)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


def _responds(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def complete(base: str, prompt: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read()), {key.lower(): value for key, value in response.headers.items()}


def router_status(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/status", timeout=10) as response:
        return json.loads(response.read())


def test_requests_are_served_by_distinct_prefill_and_decode_pods_with_kv_moved(
    namespace: str, tiny: str
) -> None:
    with port_forward(namespace, f"{tiny}-router", 8000) as base:
        for i in range(4):
            body, headers = complete(base, f"t{i} t1 t2 t3")
            assert body["choices"][0]["text"]
            assert headers["x-pd-prefill"].startswith(f"{tiny}-prefill-")
            assert headers["x-pd-decode"].startswith(f"{tiny}-decode-")
        assert router_status(base)["transfers"]["verified"] >= 4
    wait_for(
        "KVTransferVerified=True",
        lambda: any(
            c["type"] == "KVTransferVerified" and c["status"] == "True"
            for c in pdservice(namespace, tiny)["status"]["conditions"]
        ),
        timeout_s=120,
    )


def test_scaling_decode_to_two_serves_from_both(namespace: str, tiny: str) -> None:
    kubectl(
        "patch",
        "pdservice",
        tiny,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"decode":{"replicas":2}}}',
    )
    wait_for("two ready decode replicas", lambda: is_ready(namespace, tiny, decode_replicas=2))
    with port_forward(namespace, f"{tiny}-router", 8000) as base:
        decoders = {complete(base, f"t{i} t9")[1]["x-pd-decode"] for i in range(16)}
    assert len(decoders) == 2


def test_switching_push_to_pull_keeps_serving(namespace: str, tiny: str) -> None:
    kubectl("patch", "pdservice", tiny, "-n", namespace, "--type=merge", "-p", '{"spec":{"mode":"pull"}}')
    wait_for("pull rollout Ready", lambda: is_ready(namespace, tiny))
    with port_forward(namespace, f"{tiny}-router", 8000) as base:
        body, headers = complete(base, "t5 t6 t7")
        assert body["choices"][0]["text"]
        assert headers["x-pd-prefill"] != headers["x-pd-decode"]


def test_deleting_the_pdservice_removes_its_children(namespace: str, tiny: str) -> None:
    kubectl("delete", "pdservice", tiny, "-n", namespace, "--wait=true", "--timeout=120s")
    selector = f"app.kubernetes.io/instance={tiny}"
    wait_for(
        "children garbage-collected",
        lambda: (
            not kubectl(
                "get",
                "statefulsets,deployments,services,configmaps",
                "-n",
                namespace,
                "-l",
                selector,
                "-o",
                "name",
            ).strip()
        ),
        timeout_s=120,
    )
