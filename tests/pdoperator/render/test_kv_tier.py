"""spec.kvCache.offload in the rendered engines: each rank's connector of a role with a tier gets its share
of it, that role's pods' memory grows by it, and nothing else changes."""

from __future__ import annotations

from pdoperator.render import RenderDefaults, render_pdservice

from tests.pdoperator.render.test_engine import container, kv_config

TIER = {"kvCache": {"offload": {"decode": {"hostMemory": "64Gi"}}}}


def test_each_decode_rank_gets_its_share_of_the_tier_and_prefill_none(make_pds):
    pds = make_pds({**TIER, "decode": {"tensorParallelSize": 4, "resources": {"memory": "96Gi"}}})
    assert kv_config(pds, "decode")["kv_connector_extra_config"]["tier_bytes"] == 16 * 2**30
    assert "tier_bytes" not in kv_config(pds, "prefill")["kv_connector_extra_config"]


def test_the_decode_pods_memory_request_and_limit_cover_the_engine_and_its_tier(make_pds):
    pds = make_pds(
        {**TIER, "decode": {"resources": {"memory": "96Gi"}}, "prefill": {"resources": {"memory": "8Gi"}}}
    )
    resources = container(pds, "decode")["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "160Gi"
    assert container(pds, "prefill")["resources"]["limits"]["memory"] == "8Gi"


def test_a_sum_no_binary_unit_states_exactly_is_written_in_bytes(make_pds):
    pds = make_pds(
        {"kvCache": {"offload": {"decode": {"hostMemory": "1G"}}}, "decode": {"resources": {"memory": "1Gi"}}}
    )
    assert container(pds, "decode")["resources"]["limits"]["memory"] == str(2**30 + 10**9)


def test_without_a_tier_the_manifests_are_those_of_a_spec_without_the_field(make_pds):
    plain = make_pds({"decode": {"resources": {"memory": "96Gi"}}})
    empty = make_pds({"kvCache": {"offload": {}}, "decode": {"resources": {"memory": "96Gi"}}})
    assert render_pdservice(empty, RenderDefaults()) == render_pdservice(plain, RenderDefaults())


def test_prefill_and_decode_tiers_are_each_their_own_roles(make_pds):
    pds = make_pds(
        {
            "kvCache": {"offload": {"prefill": {"hostMemory": "8Gi"}, "decode": {"hostMemory": "64Gi"}}},
            "prefill": {"tensorParallelSize": 2, "resources": {"memory": "16Gi"}},
            "decode": {"tensorParallelSize": 2, "resources": {"memory": "96Gi"}},
        }
    )
    assert kv_config(pds, "prefill")["kv_connector_extra_config"]["tier_bytes"] == 4 * 2**30
    assert kv_config(pds, "decode")["kv_connector_extra_config"]["tier_bytes"] == 32 * 2**30
    assert container(pds, "prefill")["resources"]["limits"]["memory"] == "24Gi"
    assert container(pds, "decode")["resources"]["limits"]["memory"] == "160Gi"


def test_a_prefill_with_a_tier_recomputes_what_a_tier_load_could_not_fill_whatever_decode_does(make_pds):
    spec = {"engine": {"kvLoadFailurePolicy": "fail"}, "prefill": {"resources": {"memory": "16Gi"}}}
    with_tier = make_pds({**spec, "kvCache": {"offload": {"prefill": {"hostMemory": "8Gi"}}}})
    assert kv_config(with_tier, "prefill")["kv_load_failure_policy"] == "recompute"
    assert kv_config(with_tier, "decode")["kv_load_failure_policy"] == "fail"  # decode's KV is prefill's
    assert kv_config(make_pds(spec), "prefill")["kv_load_failure_policy"] == "fail"  # as rendered before
