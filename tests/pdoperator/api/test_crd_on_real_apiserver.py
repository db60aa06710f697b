"""The PDService CRD on a real API server (Kubernetes 1.36's apiextensions-apiserver,
``tests/k8s/real_server.py``): the committed CRD and the chart's copy install and update without a warning,
every example and valid render variant is accepted with kubectl's validation on, and the spec the server
stores after its own defaulting is, field for field, the spec ``pdoperator.api`` computes from the same
document.

The last point ties the two defaulting engines together: the operator renders from pydantic's defaults,
while ``kubectl get -o yaml`` (and every other client) sees the server's. A schema default that differs
from the model's, or a field the server prunes, shows up here as a mismatch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pdoperator.api import SpecError, parse_pdservice
from pdoperator.api.crd import CRD_NAME
from pdoperator.api.model import GROUP, PLURAL, VERSION
from pydantic import BaseModel

from tests.k8s.real_cluster import (
    CRD_API,
    RealKubectl,
    conditions,
    install_crd,
    kubectl_for,
    served,
    wait_established,
)
from tests.k8s.real_server import RealApiServer
from tests.pdoperator.render.conftest import VARIANTS

REPO = Path(__file__).resolve().parents[3]
CRD_FILE = REPO / "crds" / "pdservices.inference.pdoperator.dev.yaml"
CHART_CRD_FILE = REPO / "charts" / "pd-operator" / "crds" / "pdservices.inference.pdoperator.dev.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
NAMESPACE = "api-on-real-server"
# kubectl's own note (not the server's) when it applies over an object another client created; the session's
# server is shared, so another test may have installed the CRD first without kubectl.
LAST_APPLIED_NOTE = "kubectl.kubernetes.io/last-applied-configuration"


def server_warnings(stderr_warnings: list[str]) -> list[str]:
    return [warning for warning in stderr_warnings if LAST_APPLIED_NOTE not in warning]


@pytest.fixture(scope="module")
def real_kubectl(real_apiserver: RealApiServer, kubectl: Path, tmp_path_factory: pytest.TempPathFactory):
    return kubectl_for(real_apiserver, kubectl, tmp_path_factory.mktemp("api-real"), NAMESPACE)


@pytest.fixture(scope="module")
def pdservice_crd(real_apiserver: RealApiServer, real_kubectl: RealKubectl) -> Iterator[RealKubectl]:
    install_crd(real_apiserver, real_kubectl, CRD_FILE)
    served(real_apiserver, f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}")
    yield real_kubectl


# ---------------------------------------------------------------- the CRD itself


@pytest.mark.parametrize("crd_file", [CRD_FILE, CHART_CRD_FILE], ids=["crds", "chart"])
def test_the_crd_applies_without_warnings_and_is_established(
    real_apiserver: RealApiServer, real_kubectl: RealKubectl, crd_file: Path
) -> None:
    result = install_crd(real_apiserver, real_kubectl, crd_file)
    assert server_warnings(result.warnings) == [], result.stderr
    crd = wait_established(real_apiserver, CRD_NAME)
    assert conditions(crd)["Established"] == "True"
    assert conditions(crd)["NamesAccepted"] == "True"
    # The server accepted the names we asked for (a clash with another CRD would drop the short name).
    accepted = crd["status"]["acceptedNames"]
    assert accepted["kind"] == "PDService"
    assert accepted["shortNames"] == ["pds"]
    assert accepted["categories"] == ["pdoperator"]


def test_an_update_of_the_crd_is_accepted(real_apiserver: RealApiServer, pdservice_crd: RealKubectl) -> None:
    """Updates go through checks of their own (CEL cost and ratcheting against the stored CRD): an update that
    changes the schema is accepted, and so is going back to the committed file."""
    before = wait_established(real_apiserver, CRD_NAME)["metadata"]["generation"]
    changed = yaml.safe_load(CRD_FILE.read_text())
    schema = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["description"] += " (updated)"
    result = pdservice_crd(
        "apply", "--validate=strict", "-f", "-", stdin=yaml.safe_dump(changed), namespaced=False
    )
    assert result.returncode == 0, result.stderr
    assert server_warnings(result.warnings) == []
    updated = wait_established(real_apiserver, CRD_NAME)
    assert updated["metadata"]["generation"] == before + 1
    assert updated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "description"
    ].endswith("(updated)")

    restored = install_crd(real_apiserver, pdservice_crd, CRD_FILE)
    assert server_warnings(restored.warnings) == []
    assert wait_established(real_apiserver, CRD_NAME)["metadata"]["generation"] == before + 2


def test_the_server_keeps_the_schema_as_generated(real_apiserver: RealApiServer, pdservice_crd: RealKubectl):
    """Nothing of the CRD is dropped or rewritten on the way in (an unknown keyword would be)."""
    status, stored, _ = real_apiserver.request("GET", f"{CRD_API}/{CRD_NAME}")
    assert status == 200
    committed = yaml.safe_load(CRD_FILE.read_text())
    assert stored["spec"]["versions"] == committed["spec"]["versions"]
    assert stored["spec"]["names"] == {**committed["spec"]["names"]}


def test_kubectl_explain_reads_the_descriptions(pdservice_crd: RealKubectl) -> None:
    result = pdservice_crd("explain", "pdservice.spec", namespaced=False)
    assert result.returncode == 0, result.stderr
    assert "Desired state of a prefill/decode disaggregated vLLM service." in result.stdout
    for field in ("mode", "model", "prefill", "decode", "engine", "router", "autoscaling"):
        assert f"\n  {field}\t" in result.stdout, f"{field} missing from:\n{result.stdout}"


# ---------------------------------------------------------------- documents and the stored spec


def as_stored(model: BaseModel) -> dict[str, Any]:
    """The spec as the real server should store it: pydantic's dump by alias in JSON mode, except

    - unset optional fields (None) are absent: the API has no null for them (the server prunes nulls), and
      ``parse_pdservice`` drops them from the input likewise;
    - a list or map left at its empty default is absent: the CRD gives those fields no default on purpose
      (``pdoperator.api.schema``: absent and empty mean the same to the operator). A document that spells
      out ``[]`` or ``{}`` keeps it on the server, so the documents compared here never do.

    Everything else, objects defaulted whole included, must be there with the same value.
    """
    dumped = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = field.alias or name
        if key not in dumped:  # None
            continue
        if field.default_factory is not None and isinstance(value, list | dict) and not value:
            continue
        out[key] = as_stored(value) if isinstance(value, BaseModel) else dumped[key]
    return out


def differences(stored: Any, expected: Any, path: str = "spec") -> list[str]:
    """Field paths where the two trees differ, with both values: a readable failure, not one big diff."""
    if isinstance(stored, dict) and isinstance(expected, dict):
        return [
            line
            for key in sorted(stored.keys() | expected.keys())
            for line in differences(
                stored.get(key, "<absent>"), expected.get(key, "<absent>"), f"{path}.{key}"
            )
        ]
    if isinstance(stored, list) and isinstance(expected, list) and len(stored) == len(expected):
        return [
            line
            for i, pair in enumerate(zip(stored, expected, strict=True))
            for line in differences(*pair, f"{path}[{i}]")
        ]
    return (
        [] if stored == expected else [f"{path}: server stored {stored!r}, pdoperator.api has {expected!r}"]
    )


# Every object given, but empty: the server must fill each one's defaults as pydantic does.
SPARSE_OBJECTS: dict[str, Any] = {
    "model": {"name": "org/model", "source": {"huggingFace": {}}},
    "prefill": {"resources": {}},
    "decode": {},
    "engine": {"transport": {}},
    "network": {"efa": {}},
    "router": {"policy": "cache-aware", "cacheAware": {}, "retries": {}},
    "monitoring": {"scrapers": [{"namespaceLabels": {}}]},
    "autoscaling": {
        "prefill": {"maxReplicas": 2},
        "decode": {"maxReplicas": 3},
        "targets": {"ttftMilliseconds": 500, "tpotMilliseconds": 50},
        "prefillPerDecode": {"maxPercent": 100},
    },
}


def _document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PDService",
        "metadata": {"name": name[:44], "namespace": NAMESPACE},
        "spec": spec,
    }


def documents() -> list[tuple[str, dict[str, Any]]]:
    examples = [(f"example-{path.stem}", yaml.safe_load(path.read_text())) for path in EXAMPLES]
    variants = [(f"variant-{name}", _document(f"v-{name}", spec)) for name, spec in sorted(VARIANTS.items())]
    # Some render variants exercise branches with specs validation refuses (they are built past it); only
    # the ones a user could apply are compared. What the server and pdoperator disagree on is CEL's part.
    variants = [(label, doc) for label, doc in variants if _valid(doc)]
    variants.append(("sparse-objects", _document("sparse-objects", SPARSE_OBJECTS)))
    return examples + variants


def _valid(document: dict[str, Any]) -> bool:
    try:
        parse_pdservice(document)
    except SpecError:
        return False
    return True


DOCUMENTS = documents()


def test_the_documents_cover_every_example() -> None:
    assert len([name for name, _ in DOCUMENTS if name.startswith("example-")]) == len(EXAMPLES) >= 6


@pytest.mark.parametrize(("label", "document"), DOCUMENTS, ids=[label for label, _ in DOCUMENTS])
def test_the_stored_spec_is_the_spec_pdoperator_computes(
    real_apiserver: RealApiServer, pdservice_crd: RealKubectl, label: str, document: dict[str, Any]
) -> None:
    result = pdservice_crd.apply(copy.deepcopy(document))
    assert result.returncode == 0, result.stderr
    assert result.warnings == [], result.stderr

    name = document["metadata"]["name"]
    status, stored, _ = real_apiserver.request(
        "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{name}"
    )
    assert status == 200, stored
    expected = as_stored(parse_pdservice(document).spec)
    assert differences(stored["spec"], expected) == []
    # And the operator reads the stored object as the same service: nothing the server added changes it.
    assert parse_pdservice(stored).spec == parse_pdservice(document).spec


def test_the_comparison_sees_a_default_the_server_does_not_apply(
    real_apiserver: RealApiServer, pdservice_crd: RealKubectl
) -> None:
    """Control: were the model's default other than the schema's, the check above would report it."""
    _, document = DOCUMENTS[0]
    pdservice_crd.apply(copy.deepcopy(document))
    name = document["metadata"]["name"]
    _, stored, _ = real_apiserver.request(
        "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{name}"
    )
    expected = as_stored(parse_pdservice(document).spec)
    expected["engine"]["transferTimeoutSeconds"] += 1
    expected["router"].pop("replicas")
    timeout, replicas = (
        stored["spec"]["engine"]["transferTimeoutSeconds"],
        stored["spec"]["router"]["replicas"],
    )
    assert differences(stored["spec"], expected) == [
        f"spec.engine.transferTimeoutSeconds: server stored {timeout!r}, pdoperator.api has {timeout + 1!r}",
        f"spec.router.replicas: server stored {replicas!r}, pdoperator.api has '<absent>'",
    ]
