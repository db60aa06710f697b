"""The LeaderWorkerSets the operator renders, accepted by a real API server (``tests/k8s/real_server.py``)
serving the pinned LeaderWorkerSet CRD (``tests/k8s/lws``): its own structural schema, defaulting and CEL
rules judge them, not a copy of them in Python. Accepted means created (201) without a warning (an unknown
field is a warning, then pruned) and nothing we sent is missing or changed in what the server stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pdoperator.render import RenderDefaults, render_pdservice

from tests.k8s.real_cluster import RealKubectl, install_crd, kubectl_for, served, warnings_of
from tests.k8s.real_server import RealApiServer
from tests.pdoperator.render.conftest import EXAMPLE_NAMES, VARIANTS, load_example, pds_from_spec

LWS_CRD = (
    Path(__file__).resolve().parents[2] / "k8s" / "lws" / "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
)
NAMESPACE = "lws-on-real-server"
PATH = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets"


def rendered_groups() -> list[tuple[str, dict[str, Any]]]:
    """(label, LeaderWorkerSet) of every example and variant that renders one."""
    services = [(f"example-{name}", load_example(name)) for name in EXAMPLE_NAMES]
    services += [
        (f"variant-{name}", pds_from_spec(spec, name=name)) for name, spec in sorted(VARIANTS.items())
    ]
    return [
        (f"{label}/{obj['metadata']['name']}", obj)
        for label, pds in services
        for obj in render_pdservice(pds, RenderDefaults())
        if obj["kind"] == "LeaderWorkerSet"
    ]


GROUPS = rendered_groups()


@pytest.fixture(scope="module")
def lws_crd(
    real_apiserver: RealApiServer, kubectl: Path, tmp_path_factory: pytest.TempPathFactory
) -> RealKubectl:
    real = kubectl_for(real_apiserver, kubectl, tmp_path_factory.mktemp("lws-real"), NAMESPACE)
    # Server-side, as LWS' own install instructions say: the CRD (~600 KB) is too large for client-side
    # apply's last-applied annotation ("metadata.annotations: Too long: may not be more than 262144 bytes").
    result = install_crd(real_apiserver, real, LWS_CRD, server_side=True)
    assert result.warnings == [], result.stderr
    served(real_apiserver, PATH)
    return real


def missing_or_changed(sent: Any, stored: Any, path: str = "") -> list[str]:
    """Paths of what we sent that the stored object lacks or holds otherwise (it may add defaults)."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        return [
            line
            for key, value in sent.items()
            for line in (
                missing_or_changed(value, stored[key], f"{path}.{key}")
                if key in stored
                else [f"{path}.{key}: pruned"]
            )
        ]
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        return [
            line
            for i, pair in enumerate(zip(sent, stored, strict=True))
            for line in missing_or_changed(*pair, f"{path}[{i}]")
        ]
    return [] if sent == stored else [f"{path}: sent {sent!r}, stored {stored!r}"]


def test_the_examples_and_variants_render_leader_worker_sets() -> None:
    """The checks below are not vacuous: multi-node roles of both an example and a variant are among them."""
    labels = [label for label, _ in GROUPS]
    assert any(label.startswith("example-deepseek-v3-multinode/") for label in labels), labels
    assert any(label.startswith("variant-spanning-nodes/") for label in labels), labels


@pytest.mark.parametrize(("label", "group"), GROUPS, ids=[label for label, _ in GROUPS])
def test_every_rendered_leader_worker_set_is_accepted(
    real_apiserver: RealApiServer, lws_crd: RealKubectl, label: str, group: dict[str, Any]
) -> None:
    sent = {**group, "metadata": {**group["metadata"], "namespace": NAMESPACE}}
    # Strict field validation would refuse an unknown field outright; the default (warn) shows what a user's
    # cluster does: accept with a warning and prune. Both must be silent.
    for validation in ("Strict", "Warn"):
        status, stored, headers = real_apiserver.request(
            "POST", PATH, sent, params={"dryRun": "All", "fieldValidation": validation}
        )
        assert status == 201, stored
        assert warnings_of(headers) == []
        assert missing_or_changed(sent["spec"], stored["spec"], "spec") == []


def test_one_is_really_created_and_read_back(real_apiserver: RealApiServer, lws_crd: RealKubectl) -> None:
    _, group = GROUPS[0]
    result = lws_crd.apply(group)
    assert result.returncode == 0, result.stderr
    assert result.warnings == []
    status, stored, _ = real_apiserver.request("GET", f"{PATH}/{group['metadata']['name']}")
    assert status == 200
    assert missing_or_changed(group["spec"], stored["spec"], "spec") == []


def test_the_server_would_refuse_a_broken_one(real_apiserver: RealApiServer, lws_crd: RealKubectl) -> None:
    """Control: the server does judge these objects (a wrong type is refused, an unknown field warned)."""
    _, group = GROUPS[0]
    broken = yaml.safe_load(yaml.safe_dump(group))
    broken["metadata"]["namespace"] = NAMESPACE
    broken["spec"]["leaderWorkerTemplate"]["size"] = "two"
    status, answer, _ = real_apiserver.request("POST", PATH, broken, params={"dryRun": "All"})
    assert status == 422, answer
    assert "spec.leaderWorkerTemplate.size" in answer["message"]

    unknown = yaml.safe_load(yaml.safe_dump(group))
    # Another name: the one above may exist by now, and a dry run still answers AlreadyExists.
    unknown["metadata"] = {**unknown["metadata"], "namespace": NAMESPACE, "name": "control-unknown-field"}
    unknown["spec"]["notAField"] = 1
    status, answer, headers = real_apiserver.request(
        "POST", PATH, unknown, params={"dryRun": "All", "fieldValidation": "Warn"}
    )
    assert status == 201
    assert any("notAField" in warning for warning in warnings_of(headers)), headers
