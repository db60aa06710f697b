"""The operator's status writes on a real API server (``tests/k8s/real_server.py``): statuses built by the
operator's own pure functions, sent as the reconciler sends them (an RFC 7386 merge patch of ``status_patch``
to the ``/status`` subresource), are stored exactly as computed, never bump ``metadata.generation``, and
``kubectl get pds -o wide`` shows them in the printer columns.

"Stored exactly" matters because a structural schema prunes what it does not declare, silently: a status
field the model writes but the CRD lacks would be lost on every write, and the next reconcile would see a
changed status and write again, forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pdoperator.api import (
    Condition,
    ConditionStatus,
    ConditionType,
    PDServiceStatus,
    parse_pdservice,
)
from pdoperator.api.model import GROUP, PLURAL, VERSION
from pdoperator.autoscale.scale import RoleScale, Scale
from pdoperator.reconcile.kube import MERGE_PATCH
from pdoperator.reconcile.scaling import autoscaling_status
from pdoperator.reconcile.status import (
    dump_status,
    healthy_status,
    invalid_status,
    parse_status,
    role_rollout,
    status_patch,
)
from pdoperator.render.names import ComponentRole

from tests.k8s.real_cluster import RealKubectl, install_crd, kubectl_for, served, warnings_of
from tests.k8s.real_server import RealApiServer

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = "status-on-real-server"
EXAMPLE = REPO / "examples" / "tiny-autoscaled.yaml"
PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
T1, T2, T3 = "2026-12-04T10:00:00Z", "2026-12-04T10:05:00Z", "2026-12-04T10:09:30Z"


@pytest.fixture(scope="module")
def real_kubectl(
    real_apiserver: RealApiServer, kubectl: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealKubectl]:
    real = kubectl_for(real_apiserver, kubectl, tmp_path_factory.mktemp("status-real"), NAMESPACE)
    install_crd(real_apiserver, real, REPO / "crds" / "pdservices.inference.pdoperator.dev.yaml")
    served(real_apiserver, PATH)
    yield real


@pytest.fixture
def stored_pds(real_apiserver: RealApiServer, real_kubectl: RealKubectl) -> Iterator[dict[str, Any]]:
    """A fresh PDService (the autoscaled tiny example) in this module's namespace, deleted afterwards."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["namespace"] = NAMESPACE
    status, body, _ = real_apiserver.request("POST", PATH, document)
    assert status == 201, body
    yield body
    real_apiserver.request("DELETE", f"{PATH}/{body['metadata']['name']}")


def write_status(server: RealApiServer, body: dict[str, Any], computed: PDServiceStatus) -> dict[str, Any]:
    """What ``Reconciler._write_status`` sends: the merge patch from the stored status to the computed one."""
    patch = status_patch(body.get("status"), computed)
    assert patch is not None, "the status did not change: this step tests nothing"
    status, answer, headers = server.request(
        "PATCH", f"{PATH}/{body['metadata']['name']}/status", patch, content_type=MERGE_PATCH
    )
    assert status == 200, answer
    assert warnings_of(headers) == []
    return answer


def read(server: RealApiServer, name: str) -> dict[str, Any]:
    status, body, _ = server.request("GET", f"{PATH}/{name}")
    assert status == 200, body
    return body


def progressing_status(body: dict[str, Any]) -> PDServiceStatus:
    """Prefill still rolling out, the autoscaler draining a decode engine."""
    pds = parse_pdservice(body)
    rollouts = [
        role_rollout(ComponentRole.PREFILL, 2, None),
        role_rollout(
            ComponentRole.DECODE,
            2,
            {
                "metadata": {"generation": 1},
                "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
            },
        ),
        role_rollout(ComponentRole.ROUTER, 1, None),
    ]
    scale = Scale(RoleScale(2, 2), RoleScale(3, 2))
    autoscaling = autoscaling_status(scale, "decode: 2 running per engine, target 8", None, T1)
    status = healthy_status(
        pds,
        rollouts,
        previous=parse_status(body.get("status")),
        kv_condition=None,
        cluster_domain="cluster.local",
        now=T1,
    )
    return status.model_copy(update={"autoscaling": autoscaling})


def ready_status(body: dict[str, Any]) -> PDServiceStatus:
    """Every role ready, KV transfer verified, the drain finished."""
    pds = parse_pdservice(body)
    previous = parse_status(body.get("status"))
    settled = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
    }
    router = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }
    rollouts = [
        role_rollout(ComponentRole.PREFILL, 2, settled),
        role_rollout(ComponentRole.DECODE, 2, settled),
        role_rollout(ComponentRole.ROUTER, 1, router),
    ]
    kv = Condition(
        type=ConditionType.KV_TRANSFER_VERIFIED,
        status=ConditionStatus.TRUE,
        reason="TransfersSucceeding",
        message="12 KV transfers since the last check, none failed",
        last_transition_time=T2,
        observed_generation=pds.generation,
    )
    scale = Scale(RoleScale(2, 2), RoleScale(2, 2))
    autoscaling = autoscaling_status(scale, "decode: drained engine 2", previous.autoscaling, T2)
    status = healthy_status(
        pds, rollouts, previous=previous, kv_condition=kv, cluster_domain="cluster.local", now=T2
    )
    return status.model_copy(update={"autoscaling": autoscaling})


def test_status_writes_are_stored_as_computed_and_leave_the_generation(
    real_apiserver: RealApiServer, stored_pds: dict[str, Any]
) -> None:
    name = stored_pds["metadata"]["name"]
    generation = stored_pds["metadata"]["generation"]

    first = progressing_status(stored_pds)
    assert first.autoscaling is not None and first.autoscaling.draining_since == T1  # the case is realistic
    answer = write_status(real_apiserver, stored_pds, first)
    assert answer["status"] == dump_status(first)
    stored = read(real_apiserver, name)
    assert stored["status"] == dump_status(first)
    assert stored["metadata"]["generation"] == generation

    # The next write drops drainingSince (a null in the merge patch) and replaces the conditions list.
    second = ready_status(stored)
    assert second.autoscaling is not None and second.autoscaling.draining_since is None
    write_status(real_apiserver, stored, second)
    stored = read(real_apiserver, name)
    assert stored["status"] == dump_status(second)
    assert "drainingSince" not in stored["status"]["autoscaling"]
    assert stored["metadata"]["generation"] == generation
    # What the operator reads back is what it wrote: the next reconcile has nothing to write.
    assert parse_status(stored["status"]) == second
    assert status_patch(stored["status"], second) is None


def test_a_spec_change_bumps_the_generation_and_the_status_follows(
    real_apiserver: RealApiServer, stored_pds: dict[str, Any]
) -> None:
    name = stored_pds["metadata"]["name"]
    write_status(real_apiserver, stored_pds, ready_status(stored_pds))
    status, changed, _ = real_apiserver.request(
        "PATCH", f"{PATH}/{name}", {"spec": {"router": {"replicas": 2}}}, content_type=MERGE_PATCH
    )
    assert status == 200, changed
    assert changed["metadata"]["generation"] == stored_pds["metadata"]["generation"] + 1
    # A spec write leaves the status alone (the subresource splits them both ways).
    assert changed["status"] == dump_status(ready_status(stored_pds))

    invalid = invalid_status(
        changed["metadata"]["generation"],
        parse_status(changed["status"]),
        "spec.router.replicas: too many",
        T3,
    )
    write_status(real_apiserver, changed, invalid)
    stored = read(real_apiserver, name)
    assert stored["status"] == dump_status(invalid)
    assert stored["status"]["observedGeneration"] == changed["metadata"]["generation"]
    assert stored["status"]["phase"] == "Invalid"
    assert stored["metadata"]["generation"] == changed["metadata"]["generation"]


def test_a_status_field_the_crd_lacks_would_be_seen_lost(
    real_apiserver: RealApiServer, stored_pds: dict[str, Any]
) -> None:
    """Control: the server really prunes undeclared status fields, so the equality above is a real check."""
    name = stored_pds["metadata"]["name"]
    status, answer, _ = real_apiserver.request(
        "PATCH",
        f"{PATH}/{name}/status",
        {"status": {"phase": "Ready", "notDeclared": 1, "prefill": {"alsoNot": "x"}}},
        content_type=MERGE_PATCH,
    )
    assert status == 200, answer
    assert answer["status"]["phase"] == "Ready"
    assert "notDeclared" not in answer["status"]
    assert "alsoNot" not in answer["status"]["prefill"]


def test_kubectl_get_wide_shows_the_printer_columns(
    real_apiserver: RealApiServer, real_kubectl: RealKubectl, stored_pds: dict[str, Any]
) -> None:
    name = stored_pds["metadata"]["name"]
    write_status(real_apiserver, stored_pds, progressing_status(stored_pds))
    stored = read(real_apiserver, name)
    ready = ready_status(stored)
    write_status(real_apiserver, stored, ready)

    result = real_kubectl("get", "pds", name, "-o", "wide")
    assert result.returncode == 0, result.stderr
    assert result.warnings == []
    header, row = result.stdout.splitlines()
    columns = header.split()
    assert columns == [
        "NAME", "MODE", "MODEL", "PREFILL", "DECODE", "P-TP", "D-TP", "READY", "PHASE", "SCALING", "ENDPOINT",
        "AGE",
    ]  # fmt: skip
    # Every column starts where its header does (values may contain spaces: the scaling reason does).
    starts = [header.index(column) for column in columns]
    cells = [row[start:end].strip() for start, end in zip(starts, [*starts[1:], None], strict=True)]
    assert dict(zip(columns, cells, strict=True)) | {"AGE": "-"} == {
        "NAME": name,
        "MODE": "push",
        "MODEL": "tiny-llama",
        "PREFILL": "2/2",
        "DECODE": "2/2",
        "P-TP": "1",
        "D-TP": "1",
        "READY": "True",
        "PHASE": "Ready",
        "SCALING": ready.autoscaling.reason if ready.autoscaling else "",
        "ENDPOINT": f"http://{name}-router.{NAMESPACE}.svc.cluster.local:8000",
        "AGE": "-",
    }
    assert cells[-1].endswith("s"), f"AGE should be a duration, got {cells[-1]!r}"
