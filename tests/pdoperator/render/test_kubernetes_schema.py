"""Every rendered object passes kubernetes-validate --strict for Kubernetes 1.35, offline."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from pdoperator.render import render_pdservice

KUBERNETES_VERSION = "1.35.0"


def assert_valid(objects):
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(
                f"{obj['kind']} {obj['metadata']['name']}: {error.message} at {list(error.absolute_path)}"
            )


def test_every_object_of_every_example_is_valid(example, defaults):
    assert_valid(render_pdservice(example[1], defaults))


def test_every_object_of_every_variant_is_valid(variant, defaults):
    assert_valid(render_pdservice(variant[1], defaults))


def test_the_check_covers_every_kind_we_render(example_pds, defaults):
    """Control: a misplaced field makes each kind fail, so the passes above mean something."""
    objects = render_pdservice(example_pds("qwen3-32b-push-efa"), defaults)
    kinds = set()
    for obj in objects:
        broken = copy.deepcopy(obj)
        broken.get("spec", broken)["notAField"] = 1
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
        kinds.add(obj["kind"])
    assert kinds == {
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ConfigMap",
        "Service",
        "Deployment",
        "StatefulSet",
    }


def test_the_check_rejects_a_wrongly_typed_resource_quantity(example_pds, defaults):
    (sts,) = [
        o
        for o in render_pdservice(example_pds("tiny-cpu"), defaults)
        if o["metadata"]["name"] == "tiny-decode" and o["kind"] == "StatefulSet"
    ]
    sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = {"gi": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)
