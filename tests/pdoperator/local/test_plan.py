"""A local plan runs each rendered pod as a process, wired as the operator wires pods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pdconnector.router.config import parse_router_config
from pdoperator.api import parse_pdservice
from pdoperator.local import LocalRunError, local_variant, plan_local_run
from pdoperator.local.plan import core_bindings, expand, loopback_subnet
from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice

REPO = Path(__file__).resolve().parents[3]


def tiny(**spec_patch):
    document = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    for role, replicas in spec_patch.items():
        document["spec"][role]["replicas"] = replicas
    return parse_pdservice(document)


def plan_for(pds, tmp_path):
    return plan_local_run(pds, render_pdservice(pds, RenderDefaults()), tmp_path)


def test_expansion_follows_kubernetes_rules():
    variables = {"POD_NAME": "p-0", "POD_IP": "127.1.2.3"}
    assert expand("$(POD_NAME)-abc", variables) == "p-0-abc"
    assert expand("$(UNDEFINED)/$(POD_IP)", variables) == "$(UNDEFINED)/127.1.2.3"
    assert expand("$$(POD_NAME)", variables) == "$(POD_NAME)"


def test_every_pod_becomes_a_process_on_its_own_loopback_address_with_the_rendered_ports(tmp_path):
    plan = plan_for(tiny(prefill=2, decode=3), tmp_path)
    engines = [p for p in plan.processes if p.role is not ComponentRole.ROUTER]
    assert [p.name for p in engines] == [
        "tiny-prefill-0",
        "tiny-prefill-1",
        "tiny-decode-0",
        "tiny-decode-1",
        "tiny-decode-2",
    ]
    assert len({p.host for p in plan.processes}) == len(plan.processes)
    assert {p.http_port for p in engines} == {8000}
    assert all(p.host.startswith(loopback_subnet("default", "tiny") + ".") for p in plan.processes)
    assert plan.processes[-1].role is ComponentRole.ROUTER, "the router starts after the engines"


def test_downward_api_variables_are_expanded_into_engine_ids_and_side_channel_hosts(tmp_path):
    plan = plan_for(tiny(), tmp_path)
    decode = next(p for p in plan.processes if p.name == "tiny-decode-0")
    argv = list(decode.argv)
    assert argv[argv.index("--engine-id") + 1].startswith("tiny-decode-0-")
    assert argv[argv.index("--side-channel-host") + 1] == decode.host
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == decode.host
    assert decode.env["POD_NAME"] == "tiny-decode-0"
    assert not any("$(" in arg for arg in argv)


def test_the_router_config_is_the_rendered_one_with_pod_names_resolved_to_process_addresses(tmp_path):
    pds = tiny(decode=2)
    manifests = render_pdservice(pds, RenderDefaults())
    rendered = parse_router_config(
        next(m for m in manifests if m["kind"] == "ConfigMap")["data"]["router.yaml"]
    )
    plan = plan_local_run(pds, manifests, tmp_path)
    local = parse_router_config(plan.router_config)
    hosts = {p.name: p.host for p in plan.processes}
    assert [b.host for b in local.decode.backends] == [hosts["tiny-decode-0"], hosts["tiny-decode-1"]]
    assert local.model_copy(update={"prefill": rendered.prefill, "decode": rendered.decode}) == rendered
    assert [b.engine_id for b in local.decode.backends] == [b.engine_id for b in rendered.decode.backends]
    router = plan.processes[-1]
    assert str(tmp_path / "router.yaml") in router.argv
    assert plan.endpoint == f"http://{router.host}:8000"


def test_a_vllm_runtime_without_a_local_model_is_refused_with_a_reason_naming_the_field(tmp_path):
    with pytest.raises(LocalRunError, match=r"spec\.engine\.runtime is vllm: .*--model-dir"):
        plan_for(local_variant(tiny(), runtime="vllm"), tmp_path)


def test_gpu_engines_cannot_run_locally(tmp_path):
    pds = parse_pdservice(yaml.safe_load((REPO / "examples" / "qwen3-32b-push-efa.yaml").read_text()))
    with pytest.raises(LocalRunError, match=r"spec\.prefill: 8 GPUs per engine"):
        plan_local_run(pds, render_pdservice(pds, RenderDefaults()), tmp_path, model_dir=tmp_path / "model")


def test_vllm_engines_load_the_local_model_offline_with_the_rendered_connector_and_identity(tmp_path):
    pds = local_variant(tiny(), runtime="vllm")
    plan = plan_local_run(
        pds, render_pdservice(pds, RenderDefaults()), tmp_path, model_dir=tmp_path / "model"
    )
    prefill = next(p for p in plan.processes if p.name == "tiny-prefill-0")
    argv = list(prefill.argv)
    assert argv[argv.index("--model") + 1] == str(tmp_path / "model")
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    kv_config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv_config["engine_id"].startswith("tiny-prefill-0-") and kv_config["kv_connector_extra_config"][
        "backends"
    ] == ["UCX"]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == prefill.host
    assert prefill.env["HF_HUB_OFFLINE"] == "1" and prefill.env["HF_HOME"].startswith(str(tmp_path))
    decode = next(p for p in plan.processes if p.name == "tiny-decode-0")
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] != decode.env["VLLM_CPU_OMP_THREADS_BIND"], (
        "each engine on cores of its own"
    )
    assert (
        prefill.startup_timeout_s
        > next(p for p in plan.processes if p.role is ComponentRole.ROUTER).startup_timeout_s
    )


def test_distinct_pdservices_get_distinct_subnets():
    assert loopback_subnet("default", "tiny") != loopback_subnet("default", "tiny2")
    assert loopback_subnet("a", "tiny") != loopback_subnet("b", "tiny")


@pytest.mark.parametrize(
    ("ranks", "cores", "expected"),
    [
        ([1, 1], [0, 1], ["0", "1"]),
        ([1, 1], [0, 1, 2, 3], ["0,1", "2,3"]),
        ([1, 2], [0, 1, 2, 3, 4, 5], ["0,1", "2,3|4,5"]),
        ([1, 1, 1], [0, 1], ["0", "1", "0"]),
        ([2], [4, 7], ["4|7"]),
    ],
)
def test_local_vllm_engines_get_cores_of_their_own_while_there_are_enough(ranks, cores, expected):
    assert core_bindings(ranks, cores) == expected


def test_a_binding_in_the_spec_env_is_kept(tmp_path):
    document = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    document["spec"]["decode"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    pds = local_variant(parse_pdservice(document), runtime="vllm")
    plan = plan_local_run(
        pds, render_pdservice(pds, RenderDefaults()), tmp_path, model_dir=tmp_path / "model"
    )
    assert (
        next(p for p in plan.processes if p.name == "tiny-decode-0").env["VLLM_CPU_OMP_THREADS_BIND"]
        == "nobind"
    )


def test_cache_aware_vllm_engines_each_publish_on_an_ipc_socket_of_their_own_that_the_router_follows(
    tmp_path,
):
    document = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    document["spec"]["prefill"]["replicas"] = 2
    document["spec"]["router"]["policy"] = "cache-aware"
    pds = local_variant(parse_pdservice(document), runtime="vllm")
    plan = plan_local_run(
        pds, render_pdservice(pds, RenderDefaults()), tmp_path, model_dir=tmp_path / "model"
    )
    engines = [p for p in plan.processes if p.role is not ComponentRole.ROUTER]
    endpoints = []
    for engine in engines:
        argv = list(engine.argv)
        events = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert events["endpoint"] == engine.kv_events_endpoint
        assert events["replay_endpoint"] == f"{engine.kv_events_endpoint}-replay"
        endpoints.append(events["endpoint"])
    assert len(set(endpoints)) == 3 and all(e.startswith("ipc://") and len(e) < 100 for e in endpoints)
    config = parse_router_config(plan.router_config)
    assert [b.kv_events_endpoint for b in (*config.prefill.backends, *config.decode.backends)] == endpoints
