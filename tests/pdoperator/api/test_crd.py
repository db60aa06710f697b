"""The PDService CRD: names, subresources, printer columns, Kubernetes validity, and the committed copy."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from pdoperator.api import crd_manifest, crd_yaml
from pdoperator.api.crd import schema_path
from pdoperator.api.schema import node_at

COMMITTED = Path(__file__).resolve().parents[3] / "crds" / "pdservices.inference.pdoperator.dev.yaml"


def test_committed_crd_matches_the_source():
    assert COMMITTED.exists(), "crds/pdservices.inference.pdoperator.dev.yaml is missing: run `make crd`"
    assert COMMITTED.read_text() == crd_yaml(), (
        "the committed CRD drifted from pdoperator.api: run `make crd` and commit the result"
    )


def test_crd_yaml_is_the_manifest():
    assert yaml.safe_load(crd_yaml()) == crd_manifest()


def test_names_and_version():
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "pdservices.inference.pdoperator.dev"
    spec = crd["spec"]
    assert spec["group"] == "inference.pdoperator.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "PDService",
        "listKind": "PDServiceList",
        "plural": "pdservices",
        "singular": "pdservice",
        "shortNames": ["pds"],
        "categories": ["pdoperator"],
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns_in_order():
    (version,) = crd_manifest()["spec"]["versions"]
    default_columns = [
        (c["name"].upper(), c["jsonPath"])
        for c in version["additionalPrinterColumns"]
        if c.get("priority", 0) == 0
    ]
    assert default_columns == [
        ("MODE", ".spec.mode"),
        ("MODEL", ".spec.model.name"),
        ("PREFILL", ".status.prefill.summary"),
        ("DECODE", ".status.decode.summary"),
        ("P-TP", ".spec.prefill.tensorParallelSize"),
        ("D-TP", ".spec.decode.tensorParallelSize"),
        ("READY", '.status.conditions[?(@.type=="Ready")].status'),
        ("AGE", ".metadata.creationTimestamp"),
    ]


def test_every_column_reads_a_declared_field_of_the_right_type(openapi):
    (version,) = crd_manifest()["spec"]["versions"]
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata."):
            assert column["type"] == "date"
            continue
        node = node_at(openapi, schema_path(column["jsonPath"]))
        assert node is not None, column
        assert node["type"] == column["type"], column
    for field in version["selectableFields"]:
        assert node_at(openapi, field["jsonPath"])["type"] == "string"


def test_ready_column_reads_the_ready_condition(openapi):
    conditions = node_at(openapi, ".status.conditions")
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "Ready" in conditions["items"]["properties"]["type"]["enum"]


def test_crd_is_a_valid_kubernetes_1_35_object():
    kubernetes_validate.validate(crd_manifest(), "1.35.0", strict=True)


def test_the_kubernetes_check_would_notice_a_broken_crd():
    broken = copy.deepcopy(crd_manifest())
    broken["spec"]["versions"][0]["subresources"]["scale"] = {"specReplicasPath": 3}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.35.0", strict=True)
