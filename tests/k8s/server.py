"""Run the API server emulator on a loopback port in a background thread, so synchronous tests and
benchmarks can drive it with real clients (kubectl, the kubernetes client, an operator subprocess).

    with EmulatedCluster() as cluster:
        cluster.write_kubeconfig(path)
        subprocess.run(["kubectl", "--kubeconfig", path, "get", "pods"])
        cluster.objects("apps/v1/statefulsets")

``EmulatedCluster(upstream=real_server)`` is the one world: the emulator serves the built-in groups and
forwards CustomResourceDefinitions and every CRD group to the real server (``forwarding.py``); ``objects``
and ``get`` read each resource from whichever server holds it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pathlib
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Self, TypeVar

import kmock
import yaml
from kmock._internal import rendering

from .emulator import ApiServerEmulator
from .forwarding import Upstream
from .real_server import RealApiServer
from .resources import EMULATED_GROUPS

T = TypeVar("T")


class EmulatedCluster:
    """An ``ApiServerEmulator`` served on ``127.0.0.1:<free port>`` from its own event loop thread."""

    def __init__(self, upstream: RealApiServer | None = None) -> None:
        self.upstream = upstream
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k8s-emulator", daemon=True)
        self._stack: Any = None
        self.emulator: ApiServerEmulator | None = None
        self.url = ""

    def __enter__(self) -> Self:
        self._thread.start()
        self.call_async(self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        self.call_async(self._stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        real = self.upstream
        forward = None if real is None else Upstream(real.url, real.token, real.certificate)
        self.emulator = ApiServerEmulator(upstream=forward)
        server = kmock.Server(self.emulator)
        await self.emulator.__aenter__()
        await server.__aenter__()
        self._stack = server
        self.url = str(server.url).rstrip("/")

    async def _stop(self) -> None:
        # Watch streams never end by themselves: cancel every other task of this loop first.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stack.__aexit__(None, None, None)
        assert self.emulator is not None
        if self.emulator.upstream is not None:
            await self.emulator.upstream.close()
        await self.emulator.__aexit__(None, None, None)

    def call_async(self, fn: Callable[[], Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 30) -> T:
        """Run ``fn`` on the emulator's loop thread (consistent reads of its state)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed over to the calling thread
                future.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout)

    # ---- test conveniences

    def objects(self, resource: str) -> list[dict[str, Any]]:
        """Current objects of a resource such as ``"apps/v1/statefulsets"``, from the server that holds it."""
        if self._upstream_holds(resource):
            assert self.upstream is not None
            code, listing, _ = self.upstream.request("GET", f"/apis/{resource}")
            assert code == 200, f"listing {resource} on the real server: {code} {listing}"
            return list(listing["items"])
        assert self.emulator is not None
        emulator = self.emulator
        return self.call(lambda: emulator.live_objects(resource))

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        if self._upstream_holds(resource):
            assert self.upstream is not None
            group_version, plural = resource.rsplit("/", 1)
            scope = f"/namespaces/{namespace}" if namespace is not None else ""
            code, obj, _ = self.upstream.request("GET", f"/apis/{group_version}{scope}/{plural}/{name}")
            assert code in (200, 404), (
                f"reading {resource} {namespace}/{name} on the real server: {code} {obj}"
            )
            return obj if code == 200 else None
        for obj in self.objects(resource):
            meta = obj["metadata"]
            if meta["name"] == name and meta.get("namespace") == namespace:
                return obj
        return None

    def _upstream_holds(self, resource: str) -> bool:
        return self.upstream is not None and kmock.resource(resource).group not in EMULATED_GROUPS

    def requests(self) -> list[rendering.Request]:
        assert self.emulator is not None
        emulator = self.emulator
        return self.call(lambda: list(emulator))

    def write_kubeconfig(self, path: pathlib.Path, namespace: str = "default") -> pathlib.Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulated"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path


def call(
    cluster: EmulatedCluster, method: str, path: str, body: Any = None, content_type: str = "application/json"
) -> tuple[int, Any]:
    """One JSON request to the cluster's front, without credentials: ``(status, decoded body)``."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        cluster.url + path, data=data, method=method, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
