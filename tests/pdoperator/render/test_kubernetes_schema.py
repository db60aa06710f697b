"""Every rendered object passes kubernetes-validate --strict for Kubernetes 1.35, offline; KEDA's
ScaledObjects and LeaderWorkerSets, which Kubernetes does not define, pass their own schemas (a
LeaderWorkerSet's pod templates Kubernetes' too)."""

from __future__ import annotations

import copy
from itertools import chain

import kubernetes_validate
import pytest
from pdoperator.render import render_pdservice
from pdoperator.render.engine_group import leader_worker_set_pod_templates

from tests.k8s.keda_schema import scaled_object_errors
from tests.k8s.lws_schema import leader_worker_set_errors
from tests.pdoperator.render.conftest import VARIANTS

KUBERNETES_VERSION = "1.35.0"


def assert_valid(objects):
    keda = [obj for obj in objects if obj["apiVersion"].startswith("keda.sh/")]
    for obj, errors in zip(keda, scaled_object_errors(keda) if keda else [], strict=True):
        assert errors == [], f"ScaledObject {obj['metadata']['name']}: {errors}"
    groups = [obj for obj in objects if obj["kind"] == "LeaderWorkerSet"]
    for obj in groups:
        assert leader_worker_set_errors(obj) == [], f"LeaderWorkerSet {obj['metadata']['name']}"
    for obj in [
        *(obj for obj in objects if obj not in keda + groups),
        *chain(*map(leader_worker_set_pod_templates, groups)),
    ]:
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


def test_the_check_covers_every_kind_we_render(example_pds, make_pds, defaults):
    """Control: a misplaced field makes each kind fail, so the passes above mean something."""
    objects = render_pdservice(example_pds("qwen3-32b-push-efa"), defaults)
    objects += [
        obj
        for obj in render_pdservice(make_pds(VARIANTS["autoscaled-hpa"]), defaults)
        if obj["kind"] == "HorizontalPodAutoscaler"
    ]
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
        "HorizontalPodAutoscaler",
    }


def test_the_keda_check_rejects_a_wrongly_typed_or_missing_field(make_pds, defaults):
    """Control for ScaledObjects (KEDA's compiled schema reports wrong types and missing required fields; it
    does not report unknown ones, which the API server would prune)."""
    (scaled_object, *_) = [
        obj
        for obj in render_pdservice(make_pds(VARIANTS["autoscaled-keda"]), defaults)
        if obj["kind"] == "ScaledObject"
    ]
    wrong_type = copy.deepcopy(scaled_object)
    wrong_type["spec"]["maxReplicaCount"] = "8"
    missing = copy.deepcopy(scaled_object)
    del missing["spec"]["scaleTargetRef"]
    untyped_trigger = copy.deepcopy(scaled_object)
    untyped_trigger["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8
    errors = scaled_object_errors([scaled_object, wrong_type, missing, untyped_trigger])
    assert errors[0] == []
    assert errors[1] == ["/spec/maxReplicaCount: must be integer"]
    assert any("scaleTargetRef" in e for e in errors[2])
    assert errors[3] and "threshold" in errors[3][0]


def test_the_check_rejects_a_wrongly_typed_resource_quantity(example_pds, defaults):
    (sts,) = [
        o
        for o in render_pdservice(example_pds("tiny-cpu"), defaults)
        if o["metadata"]["name"] == "tiny-decode" and o["kind"] == "StatefulSet"
    ]
    sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = {"gi": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)


def test_the_leader_worker_set_check_refuses_unknown_and_wrongly_typed_fields(example_pds, defaults):
    """Control for LeaderWorkerSets: the pinned CRD's schema, unknown fields refused as strict validation
    would, down into the pod templates."""
    (group, *_) = [
        obj
        for obj in render_pdservice(example_pds("deepseek-v3-multinode"), defaults)
        if obj["kind"] == "LeaderWorkerSet"
    ]
    assert leader_worker_set_errors(group) == []
    broken = copy.deepcopy(group)
    broken["spec"]["leaderWorkerTemplate"]["size"] = "2"
    broken["spec"]["notAField"] = 1
    broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    broken["spec"]["startupPolicy"] = "WhenReady"
    assert leader_worker_set_errors(broken) == [
        "/spec: Additional properties are not allowed ('notAField' was unexpected)",
        "/spec/leaderWorkerTemplate/size: '2' is not of type 'integer'",
        "/spec/leaderWorkerTemplate/workerTemplate/spec/containers/0: Additional properties are not allowed "
        "('argz' was unexpected)",
        "/spec/startupPolicy: 'WhenReady' is not one of ['LeaderCreated', 'LeaderReady']",
    ]
