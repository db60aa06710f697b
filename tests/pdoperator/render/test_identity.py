"""Generation-safe rollouts: the compatibility hash, engine ids, and what scaling leaves alone."""

from __future__ import annotations

import re

import pytest
from pdoperator.render import (
    LABEL_COMPAT,
    RenderDefaults,
    build_router_config,
    compatibility_hash,
    render_pdservice,
)

INCOMPATIBLE_CHANGES = {
    "model name": {"model": {"name": "Qwen/Qwen3-14B"}},
    "dtype": {"model": {"dtype": "float16"}},
    "max model len": {"model": {"maxModelLen": 4096}},
    "architecture": {"model": {"architecture": "hybrid-ssm"}, "ssm": {"family": "mamba2"}},
    "weights on a pvc": {"model": {"source": {"pvc": {"claimName": "w", "path": "m"}}}},
    "engine image": {"engine": {"image": "ghcr.io/pd-operator/pd-engine:0.2.0"}},
    "one role's image": {"decode": {"image": "ghcr.io/pd-operator/pd-engine:0.2.0"}},
    "mode": {"mode": "pull"},
    "prefill tp": {"prefill": {"tensorParallelSize": 1}},
    "decode tp": {"decode": {"tensorParallelSize": 4}},
    "connector": {"engine": {"connector": "vllm"}},
    "transport": {"engine": {"transport": {"backend": "LIBFABRIC"}}},
    "runtime": {"engine": {"runtime": "mock"}},
    "extra args": {"decode": {"extraArgs": ["--block-size", "32"]}},
    "engine env": {"prefill": {"env": [{"name": "VLLM_ATTENTION_BACKEND", "value": "FLASHINFER"}]}},
}

COMPATIBLE_CHANGES = {
    "prefill replicas": {"prefill": {"replicas": 7}},
    "decode replicas": {"decode": {"replicas": 0}},
    "router": {"router": {"replicas": 4, "port": 80, "policy": "round-robin"}},
    "resources": {"decode": {"resources": {"cpu": "8", "memory": "64Gi", "shmSize": "1Gi"}}},
    "scheduling": {"prefill": {"nodeSelector": {"a": "b"}, "tolerations": [{"operator": "Exists"}]}},
    "served name": {"model": {"servedName": "other"}},
    "max num seqs": {"decode": {"maxNumSeqs": 8}},
    "side channel port": {"engine": {"sideChannelPort": 6000}},
    "transfer timeout": {"engine": {"transferTimeoutSeconds": 5}},
}


def test_the_hash_is_a_short_lowercase_hex_label_value(make_pds):
    compat = compatibility_hash(make_pds().spec, RenderDefaults())
    assert re.fullmatch(r"[0-9a-f]{10}", compat)


def test_the_hash_is_stable_across_calls_and_equal_specs(make_pds):
    assert compatibility_hash(make_pds().spec, RenderDefaults()) == compatibility_hash(
        make_pds(name="other").spec, RenderDefaults()
    )


@pytest.mark.parametrize("change", sorted(INCOMPATIBLE_CHANGES))
def test_the_hash_changes_with_settings_that_break_kv_compatibility(make_pds, change):
    before = compatibility_hash(make_pds().spec, RenderDefaults())
    assert compatibility_hash(make_pds(INCOMPATIBLE_CHANGES[change]).spec, RenderDefaults()) != before


@pytest.mark.parametrize("change", sorted(COMPATIBLE_CHANGES))
def test_the_hash_ignores_settings_that_keep_engines_compatible(make_pds, change):
    before = compatibility_hash(make_pds().spec, RenderDefaults())
    assert compatibility_hash(make_pds(COMPATIBLE_CHANGES[change]).spec, RenderDefaults()) == before


def test_the_hash_covers_the_default_engine_image_a_role_falls_back_to(make_pds):
    # Only the image a role really runs matters: an explicit image hides the default.
    pds = make_pds()
    assert compatibility_hash(pds.spec, RenderDefaults(engine_image="a")) == compatibility_hash(
        pds.spec, RenderDefaults(engine_image="b")
    )


def test_pod_templates_engine_ids_and_router_config_carry_the_hash(make_pds):
    pds = make_pds()
    defaults = RenderDefaults()
    compat = compatibility_hash(pds.spec, defaults)
    for sts in (o for o in render_pdservice(pds, defaults) if o["kind"] == "StatefulSet"):
        template = sts["spec"]["template"]
        assert template["metadata"]["labels"][LABEL_COMPAT] == compat
        assert f'"engine_id":"$(POD_NAME)-{compat}"' in " ".join(template["spec"]["containers"][0]["args"])
        # The selector is immutable and must match old and new pods alike.
        assert LABEL_COMPAT not in sts["spec"]["selector"]["matchLabels"]
    config = build_router_config(pds, defaults)
    assert config.compat_hash == compat
    assert [b.engine_id for b in config.prefill.backends] == [
        f"svc-prefill-0-{compat}",
        f"svc-prefill-1-{compat}",
    ]
    assert all(b.engine_id == f"{b.name}-{compat}" for b in config.decode.backends)


def test_an_incompatible_change_changes_both_roles_pod_templates(make_pds):
    def templates(pds):
        return {
            o["metadata"]["name"]: o["spec"]["template"]
            for o in render_pdservice(pds, RenderDefaults())
            if o["kind"] == "StatefulSet"
        }

    before, after = templates(make_pds()), templates(make_pds({"decode": {"tensorParallelSize": 4}}))
    # Prefill's own settings did not change, yet its pods roll: their engine ids name the new generation.
    assert before["svc-prefill"] != after["svc-prefill"]
    assert before["svc-decode"] != after["svc-decode"]


def test_scaling_changes_only_replica_counts_and_the_router_config(make_pds):
    small = render_pdservice(
        make_pds({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}), RenderDefaults()
    )
    large = render_pdservice(
        make_pds({"prefill": {"replicas": 4}, "decode": {"replicas": 6}}), RenderDefaults()
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in small] == [
        (o["kind"], o["metadata"]["name"]) for o in large
    ]
    changed = set()
    for before, after in zip(small, large, strict=True):
        if before != after:
            changed.add((before["kind"], before["metadata"]["name"]))
            if before["kind"] == "StatefulSet":
                assert before["spec"]["template"] == after["spec"]["template"]
                assert {k: v for k, v in before["spec"].items() if k != "replicas"} == {
                    k: v for k, v in after["spec"].items() if k != "replicas"
                }
    assert changed == {
        ("StatefulSet", "svc-prefill"),
        ("StatefulSet", "svc-decode"),
        ("ConfigMap", "svc-router"),
    }
