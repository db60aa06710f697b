"""A P/D deployment as real processes on loopback: mock engines and routers, for end-to-end tests and
benchmarks.

Each role's engines share one HTTP port and one side-channel port on distinct loopback addresses (127.0.0.x),
as pods of a StatefulSet share ports on distinct pod IPs, so the router config has the same shape as in a
cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdconnector.protocol.params import EngineRole
from pdconnector.router.config import RouterConfig, dump_router_config
from pdconnector.sim.engine import COLOCATED

STARTUP_TIMEOUT_S = 60.0  # NIXL agents take seconds to create on a busy machine


def common_free_port(hosts: list[str]) -> int:
    """A TCP port free on every host in ``hosts``."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass
class Process:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=1) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(
            f"{self.name} not healthy after {timeout_s} s: {self.log_path.read_text()[-2000:]}"
        )

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to close connections gracefully (a crash)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP the process group: a frozen process keeps its sockets open and answers nothing."""
        if self.alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, signal.SIGCONT)

    def terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if the process has not exited within ``timeout_s``."""
        self.terminate()
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Engine(Process):
    role: EngineRole | None = None  # None: co-located
    host: str = "127.0.0.1"
    engine_id: str = ""

    def metrics(self) -> dict[str, float]:
        """Current metric samples by name (labels folded into the name as ``name{k=v,...}``)."""
        return metric_samples(self.url)


def metric_samples(url: str) -> dict[str, float]:
    """The samples of ``url``'s ``/metrics`` by name, labels folded into the name as ``name{k=v,...}``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@dataclass
class LocalCluster:
    """Mock engines (and optionally a co-located reference engine) plus any number of routers in front of
    them."""

    workdir: Path
    model: str = "tiny"
    prefill_count: int = 2
    decode_count: int = 2
    engine_args: list[str] = field(default_factory=list)
    engine_env: dict[str, str] = field(default_factory=dict)  # e.g. the mock transport's injected faults
    transport: str = "mock"
    compat_hash: str = "c0ffee"
    engine_command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "pdconnector.sim.main"])
    subnet: int = 60  # engines live on 127.0.0.<subnet + i> (prefill) and 127.0.0.<subnet + 10 + i> (decode)
    engines: dict[str, Engine] = field(default_factory=dict)
    routers: dict[str, Process] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def _hosts(self, role: EngineRole) -> list[str]:
        offset = self.subnet if role is EngineRole.PREFILL else self.subnet + 10
        count = self.prefill_count if role is EngineRole.PREFILL else self.decode_count
        return [f"127.0.0.{offset + i}" for i in range(count)]

    def _engine(
        self, name: str, role: EngineRole | None, host: str, port: int, side_channel_port: int
    ) -> Engine:
        engine_id = f"{name}-{self.compat_hash}"
        argv = [
            *self.engine_command,
            "--role",
            role or COLOCATED,
            "--host",
            host,
            "--port",
            str(port),
            "--model",
            self.model,
        ]
        argv += [
            "--engine-id",
            engine_id,
            "--side-channel-host",
            host,
            "--side-channel-port",
            str(side_channel_port),
        ]
        argv += [
            "--transport",
            self.transport,
            "--compat-hash",
            self.compat_hash,
            "--log-format",
            "json",
            *self.engine_args,
        ]
        log_path = self.workdir / f"{name}.log"
        return Engine(
            name,
            argv,
            f"http://{host}:{port}",
            log_path,
            env=dict(self.engine_env),
            role=role,
            host=host,
            engine_id=engine_id,
        )

    def start(self, colocated: bool = True) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for role in EngineRole:
            hosts = self._hosts(role)
            self.ports[role] = common_free_port(hosts)
            self.ports[f"{role}-side"] = common_free_port(hosts)
            for index, host in enumerate(hosts):
                name = f"{role}-{index}"
                self.engines[name] = self._engine(
                    name, role, host, self.ports[role], self.ports[f"{role}-side"]
                )
        if colocated:
            self.engines["colocated"] = self._engine(
                "colocated", None, "127.0.0.1", common_free_port(["127.0.0.1"]), 1
            )
        self._launch(list(self.engines.values()))

    def _launch(self, processes: list[Process]) -> None:
        for process in processes:
            process.start()
        for process in processes:
            process.wait_healthy()

    def router_config(self, mode: str, **overrides: object) -> RouterConfig:
        def role(name: str) -> dict[str, object]:
            members = [e for e in self.engines.values() if e.role == name]
            backends = [{"name": e.name, "host": e.host, "engine_id": e.engine_id} for e in members]
            return {
                "service": f"{self.model}-{name}",
                "namespace": "default",
                "http_port": self.ports[name],
                "side_channel_port": self.ports[f"{name}-side"],
                "replicas": len(backends),
                "backends": backends,
            }

        data: dict[str, object] = {
            "name": self.model,
            "namespace": "default",
            "mode": mode,
            "served_model_name": self.model,
            "compat_hash": self.compat_hash,
            "prefill": role("prefill"),
            "decode": role("decode"),
        }
        data.update(overrides)
        return RouterConfig.model_validate(data)

    def start_router(
        self,
        name: str,
        mode: str,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        **overrides: object,
    ) -> Process:
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(dump_router_config(self.router_config(mode, **overrides)))
        port = common_free_port(["127.0.0.1"])
        argv = [
            sys.executable,
            "-m",
            "pdconnector.router.main",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        argv += ["--health-interval", "0.2", "--refresh-interval", "1", *(extra_args or [])]
        router = Process(name, argv, f"http://127.0.0.1:{port}", self.workdir / f"{name}.log", env=env or {})
        router.start()
        router.wait_healthy()
        self.routers[name] = router
        return router

    def restart(self, name: str) -> None:
        engine = self.engines[name]
        engine.kill()
        self._launch([engine])

    def restart_router(self, name: str) -> None:
        """SIGKILL a router and start it again on its port with its config."""
        router = self.routers[name]
        router.kill()
        self._launch([router])

    def heal(self) -> None:
        """After faults: every frozen process resumed, every dead one started again."""
        for process in [*self.engines.values(), *self.routers.values()]:
            process.resume()
        for name, engine in self.engines.items():
            if not engine.alive:
                self.restart(name)
        for name, router in self.routers.items():
            if not router.alive:
                self.restart_router(name)

    def stop(self) -> None:
        processes = [*self.routers.values(), *self.engines.values()]
        for process in processes:  # all at once: shutdowns overlap instead of adding up
            process.terminate()
        deadline = time.monotonic() + 5.0
        for process in processes:
            process.stop(timeout_s=max(0.1, deadline - time.monotonic()))
