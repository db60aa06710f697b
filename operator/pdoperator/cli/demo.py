"""pdctl demo: the main job on the embedded default.

Validates and renders every example PDService of the repository and prints, per
example, what the operator would run: mode, model, replicas x TP per role, GPUs and EFA
devices per pod, connector, transport and the objects rendered, by kind. When the
``kubernetes-validate`` tool is installed (the dev extra), every rendered object is also
checked against the Kubernetes 1.35 schemas, offline. Then it runs the tiny example
locally (`pdctl up`) in push and in pull mode, sends requests through the router, shows
which prefill and decode instance served each and how many KV bytes moved, and stops it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdoperator.api.model import ConnectorImpl, PDService, Runtime, TransferMode
from pdoperator.local import LocalRunError
from pdoperator.local.tour import format_report, tour_mode
from pdoperator.render import RenderDefaults, compatibility_hash, render_pdservice
from pdoperator.render.engine import (
    BUILTIN_CONNECTOR_CLASS,
    BUILTIN_CONNECTOR_MODULE,
    UPSTREAM_CONNECTOR_CLASS,
    efa_devices,
    engine_gpus,
    served_model_name,
)
from pdoperator.render.engine_group import LWS_KIND, leader_worker_set_pod_templates
from pdoperator.render.identity import engine_image, role_spec
from pdoperator.render.names import ENGINE_ROLES

from .render import InputError, load_pdservices

LOCAL_RUN_EXAMPLE = "tiny-cpu.yaml"

KUBERNETES_VERSION = "1.35.0"
# The repository checkout this package runs from: operator/pdoperator/cli/demo.py -> repo root.
REPO_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

Validator = Callable[[dict[str, Any]], None]


def _kubernetes_validator() -> Validator | None:
    """Strict offline schema validation of built-in kinds, if the dev tool is installed."""
    try:
        import kubernetes_validate  # noqa: PLC0415 (a dev dependency, optional here)
    except ImportError:
        return None

    def validate(obj: dict[str, Any]) -> None:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)

    return validate


def _connector_text(pds: PDService) -> str:
    engine = pds.spec.engine
    if engine.runtime is Runtime.MOCK:
        return "pdconnector core inside pd-mock-engine"
    if engine.connector is ConnectorImpl.VLLM:
        return f"upstream vLLM {UPSTREAM_CONNECTOR_CLASS[pds.spec.mode]}"
    return f"builtin {BUILTIN_CONNECTOR_MODULE}.{BUILTIN_CONNECTOR_CLASS}"


def _transport_text(pds: PDService) -> str:
    efa = pds.spec.network.efa
    backend = pds.spec.engine.transport.backend.value
    if not efa.enabled:
        return f"{backend}, side channel :{pds.spec.engine.side_channel_port}"
    access = "privileged" if efa.privileged else "IPC_LOCK"
    return (
        f"{backend} over EFA ({access}, hugepages {efa.hugepages}), side channel "
        f":{pds.spec.engine.side_channel_port}"
    )


def _model_text(pds: PDService) -> str:
    model = pds.spec.model
    details = [model.architecture.value]
    if pds.spec.ssm is not None:
        details.append(f"{pds.spec.ssm.family.value} conv layout {pds.spec.ssm.conv_state_layout.value}")
    details.append(model.dtype.value)
    if model.max_model_len is not None:
        details.append(f"max {model.max_model_len} tokens")
    if pds.spec.engine.runtime is Runtime.MOCK:
        source = "no weights, mock engines"
    elif model.source.pvc is not None:
        source = f"from pvc {model.source.pvc.claim_name}/{model.source.pvc.path}"
    else:
        source = "from Hugging Face"
    return f"{model.name} as {served_model_name(pds.spec)!r} ({', '.join(details)}; {source})"


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def summarize(
    pds: PDService, objects: list[dict[str, Any]], defaults: RenderDefaults, schema_line: str
) -> list[str]:
    spec = pds.spec
    roles = [["role", "replicas x TP", "GPUs/pod", "EFA/pod", "image"]]
    for role in ENGINE_ROLES:
        rs = role_spec(spec, role)
        roles.append(
            [
                role.value,
                f"{rs.replicas} x TP{rs.tensor_parallel_size}"
                + (f" PP{rs.pipeline_parallel_size}" if rs.pipeline_parallel_size > 1 else "")
                + (f" on {rs.nodes} nodes" if rs.spans_nodes else ""),
                str(engine_gpus(spec, role)),
                str(efa_devices(spec, role)),
                engine_image(spec, role, defaults),
            ]
        )
    roles.append(["router", str(spec.router.replicas), "-", "-", spec.router.image or defaults.router_image])
    kinds = Counter(obj["kind"] for obj in objects)
    lines = [
        f"  mode       {spec.mode.value}, engine runtime {spec.engine.runtime.value}",
        f"  model      {_model_text(pds)}",
        f"  connector  {_connector_text(pds)}",
        f"  transport  {_transport_text(pds)}",
        f"  compat     {compatibility_hash(spec, defaults)} (engine ids <pod>-<compat>)",
        *_table(roles, "  "),
        f"  objects    {len(objects)}: " + ", ".join(f"{kind} {count}" for kind, count in kinds.items()),
        f"  schema     {schema_line}",
    ]
    return lines


def _schema_check(objects: list[dict[str, Any]], validator: Validator | None) -> tuple[bool, str]:
    if validator is None:
        return True, "not checked (kubernetes-validate not installed)"
    failures = []
    groups = [obj for obj in objects if obj["kind"] == LWS_KIND]
    # Kubernetes does not define LeaderWorkerSets: their pod templates are checked (the tests check the rest
    # against the LeaderWorkerSet CRD).
    checked = [obj for obj in objects if obj not in groups] + [
        template for group in groups for template in leader_worker_set_pod_templates(group)
    ]
    for obj in checked:
        try:
            validator(obj)
        except Exception as error:
            failures.append(f"{obj['kind']} {obj['metadata']['name']}: {getattr(error, 'message', error)}")
    if failures:
        return False, "INVALID: " + "; ".join(failures)
    scope = f", {LWS_KIND}s by their pod templates" if groups else ""
    return (
        True,
        f"{len(objects)}/{len(objects)} valid for Kubernetes {KUBERNETES_VERSION} (kubernetes-validate, "
        f"strict{scope})",
    )


def demo_example(path: Path, defaults: RenderDefaults, validator: Validator | None) -> tuple[bool, list[str]]:
    """(ok, report lines) for one example file."""
    try:
        sources = load_pdservices(str(path))
    except InputError as error:
        return False, [f"{path}: INVALID", *(f"  {message}" for message in error.messages)]
    ok = True
    lines: list[str] = []
    for source in sources:
        objects = render_pdservice(source.pds, defaults)
        schema_ok, schema_line = _schema_check(objects, validator)
        ok &= schema_ok
        status = "ok" if schema_ok else "FAILED"
        lines += [
            f"{source.path}: PDService {source.pds.namespace}/{source.pds.name}: {status}",
            *summarize(source.pds, objects, defaults, schema_line),
        ]
    return ok, lines


def _display_path(path: Path) -> Path:
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--examples",
        type=Path,
        default=REPO_EXAMPLES,
        metavar="DIR",
        help=f"directory of PDService examples (default: {REPO_EXAMPLES})",
    )
    parser.add_argument(
        "--local-run",
        metavar="NAME",
        default=LOCAL_RUN_EXAMPLE,
        help="example file in DIR to run locally in push and pull mode after rendering ('' skips it; "
        f"default {LOCAL_RUN_EXAMPLE})",
    )


def local_run(path: Path) -> tuple[bool, list[str]]:
    """`pdctl up` the example in each mode, send requests through the router, report who served them, `pdctl
    down`."""
    try:
        (source,) = load_pdservices(str(path))
    except (InputError, ValueError) as error:
        return False, [f"{path}: cannot run locally: {error}"]
    lines = [
        f"Local run of {source.pds.namespace}/{source.pds.name} ({_display_path(path)}): router and mock "
        "engines on loopback"
    ]
    with tempfile.TemporaryDirectory(prefix="pdctl-demo-") as state_root:
        for mode in TransferMode:
            try:
                report = tour_mode(source.pds, mode, Path(state_root) / mode.value)
            except (LocalRunError, OSError, RuntimeError, TimeoutError, KeyError, ValueError) as error:
                return False, [*lines, f"  {mode.value} mode failed: {error}"]
            lines += format_report(report)
    return True, lines


def run(args: argparse.Namespace) -> int:
    directory: Path = args.examples
    if not directory.is_dir():
        print(f"error: {directory}: no such directory (pass --examples DIR)", file=sys.stderr)
        return 1
    files = sorted(p for p in directory.iterdir() if p.suffix in {".yaml", ".yml"} and p.is_file())
    if not files:
        print(f"error: {directory}: no *.yaml examples", file=sys.stderr)
        return 1
    defaults = RenderDefaults()
    validator = _kubernetes_validator()
    failed = 0
    for path in files:
        ok, lines = demo_example(_display_path(path), defaults, validator)
        failed += not ok
        print("\n".join(lines), end="\n\n")
    print(f"{len(files)} examples: {len(files) - failed} ok, {failed} failed")
    if args.local_run:
        ok, lines = local_run(directory / args.local_run)
        failed += not ok
        print("", *lines, sep="\n")
    return 0 if failed == 0 else 1
