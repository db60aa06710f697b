"""Local vLLM engines on this machine's GPUs: which GPUs each engine gets and what share of their memory.

A cluster gives every engine pod GPUs of its own; a local run may have to put several engines on one GPU. vLLM
sizes its KV cache from ``--gpu-memory-utilization`` (the fraction of the GPU's memory the engine may take),
so engines sharing a GPU must split it: each takes the site's fraction of the GPU divided by the engines on
it.

What a machine needs beyond the product (workarounds for how vLLM was carried there, the attention backend
that loads there) is the local *site*, never the rendered manifests: a ``KEY=VALUE`` file named by
``PDCTL_SITE`` (scripts/gpu-vllm.sh writes one). ``PDCTL_*`` keys are pdctl's settings; every other key is an
environment variable for the engines, which pdctl hands them itself."""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SITE_ENV = "PDCTL_SITE"
# The fraction of each GPU local engines take together, unless the site says: vLLM's own default for one
# engine.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
_DEVICE_NODE = re.compile(r"nvidia(\d+)")


class SiteError(ValueError):
    """The site file cannot be used; the message says why."""


@dataclass(frozen=True)
class LocalSite:
    """What this machine offers local engines and needs for them."""

    gpus: int = 0
    engine_env: Mapping[str, str] = field(default_factory=dict)
    gpu_engine_args: tuple[str, ...] = ()
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION
    source: str = "this machine"


def visible_gpus(dev: Path = Path("/dev"), environ: Mapping[str, str] = os.environ) -> int:
    """The GPUs this process may use: the driver's device nodes, narrowed by ``CUDA_VISIBLE_DEVICES`` when set
    (no CUDA library is loaded: pdctl must not hold GPU memory the engines need)."""
    nodes = sum(1 for path in dev.glob("nvidia*") if _DEVICE_NODE.fullmatch(path.name))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nodes
    return min(nodes, len([item for item in visible.split(",") if item.strip()]))


def parse_site(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (values shell-quoted, ``#`` comments), as a shell sourcing the file reads them."""
    values = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        key, sep, value = words[0].partition("=")
        if len(words) != 1 or not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SiteError(f"{source}:{number}: expected KEY=VALUE, got {line!r}")
        values[key] = value
    return values


def load_site(environ: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> LocalSite:
    """The site ``PDCTL_SITE`` names, or this machine's defaults without one."""
    gpus = visible_gpus(dev, environ)
    path = environ.get(SITE_ENV)
    if not path:
        return LocalSite(gpus=gpus)
    try:
        values = parse_site(Path(path).read_text(), path)
    except OSError as error:
        raise SiteError(f"{SITE_ENV}={path}: {error.strerror}") from error
    settings = {key: value for key, value in values.items() if key.startswith("PDCTL_")}
    try:
        fraction = float(settings.pop("PDCTL_GPU_MEMORY_FRACTION", DEFAULT_GPU_MEMORY_FRACTION))
        gpus = int(settings.pop("PDCTL_GPUS", gpus))
    except ValueError as error:
        raise SiteError(f"{path}: {error}") from error
    if not 0 < fraction <= 1:
        raise SiteError(f"{path}: PDCTL_GPU_MEMORY_FRACTION={fraction} must be in (0, 1]")
    args = tuple(shlex.split(settings.pop("PDCTL_VLLM_GPU_ARGS", "")))
    if settings:
        raise SiteError(f"{path}: unknown pdctl settings {sorted(settings)}")
    engine_env = {key: value for key, value in values.items() if not key.startswith("PDCTL_")}
    return LocalSite(gpus, engine_env, args, fraction, path)


@dataclass(frozen=True)
class Placement:
    """One engine's GPUs (indices on this machine) and its share of each GPU's memory."""

    gpus: tuple[int, ...]
    memory_share: float

    @property
    def visible_devices(self) -> str:
        return ",".join(str(gpu) for gpu in self.gpus)


def place_engines(gpus_per_engine: Sequence[int], site: LocalSite) -> list[Placement]:
    """GPUs for each engine, round-robin over the machine's so engines spread before they share, and each
    engine's memory share: the site's fraction split among the engines on its most crowded GPU, rounded down
    (vLLM checks the shares of one GPU against its free memory)."""
    if site.gpus <= 0:
        raise SiteError("this machine has no GPU")
    if (largest := max(gpus_per_engine, default=0)) > site.gpus:
        raise SiteError(f"an engine needs {largest} GPUs and this machine has {site.gpus}")
    assigned: list[tuple[int, ...]] = []
    engines_on = [0] * site.gpus
    next_gpu = 0
    for count in gpus_per_engine:
        # an engine's ranks on distinct GPUs (vLLM gives rank N the N-th visible device)
        gpus = tuple((next_gpu + i) % site.gpus for i in range(count))
        next_gpu = (next_gpu + count) % site.gpus
        for gpu in gpus:
            engines_on[gpu] += 1
        assigned.append(gpus)
    # rounded to 1e-6 first: 0.3 / 2 * 100 must floor to 15, not 14
    return [
        Placement(
            gpus,
            math.floor(round(site.gpu_memory_fraction / max(engines_on[g] for g in gpus) * 100, 6)) / 100,
        )
        for gpus in assigned
    ]


def with_site_args(argv: Sequence[str], site: LocalSite, placement: Placement) -> list[str]:
    """The engine's command line with the site's flags and the memory share, except flags the spec's own
    extraArgs already set (the user's choice wins)."""
    present = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    extra: list[str] = []
    args = list(site.gpu_engine_args)
    for index, arg in enumerate(args):
        if not arg.startswith("--") or arg.split("=", 1)[0] in present:
            continue
        value = args[index + 1 : index + 2]
        extra += [arg, *(value if value and not value[0].startswith("--") and "=" not in arg else [])]
    if "--gpu-memory-utilization" not in present:
        extra += ["--gpu-memory-utilization", f"{placement.memory_share:.2f}"]
    return [*argv, *extra]
