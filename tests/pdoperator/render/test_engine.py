"""The engine pods: command line, KV connector selection, resources, EFA, hybrid models, probes."""

from __future__ import annotations

import json
from typing import Any

from pdoperator.api.model import PDService
from pdoperator.api.validation import EFA_RESERVED_ENV, RESERVED_ENV, managed_flags
from pdoperator.render import RenderDefaults, compatibility_hash, render_pdservice
from pdoperator.render.engine import CPU_THREAD_BINDING_ENV, CUDA_IPC_GET_ENV

EFA_ON = {
    "engine": {"transport": {"backend": "LIBFABRIC"}},
    "network": {"efa": {"enabled": True, "prefillDevices": 16, "decodeDevices": 8, "hugepages": "6Gi"}},
    "prefill": {"resources": {"memory": "64Gi"}},
    "decode": {"resources": {"memory": "64Gi"}},
}


def statefulset(pds: PDService, role: str, defaults: RenderDefaults | None = None) -> dict[str, Any]:
    objects = render_pdservice(pds, defaults or RenderDefaults())
    return next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"{pds.name}-{role}"
    )


def container(pds: PDService, role: str) -> dict[str, Any]:
    (engine,) = statefulset(pds, role)["spec"]["template"]["spec"]["containers"]
    return engine


def env(pds: PDService, role: str) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container(pds, role)["env"]}


def arg_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def kv_config(pds: PDService, role: str) -> dict[str, Any]:
    return json.loads(arg_value(container(pds, role)["args"], "--kv-transfer-config"))


# ---------------------------------------------------------------- command line


def test_vllm_engines_run_the_openai_server_with_the_spec_settings(make_pds):
    pds = make_pds({"prefill": {"maxNumSeqs": 32}, "decode": {"tensorParallelSize": 4}})
    prefill, decode = container(pds, "prefill"), container(pds, "decode")
    assert prefill["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = prefill["args"]
    assert arg_value(args, "--model") == "Qwen/Qwen3-8B"
    assert arg_value(args, "--served-model-name") == "qwen3-8b"
    assert arg_value(args, "--port") == "8000"
    assert arg_value(args, "--tensor-parallel-size") == "2"
    assert arg_value(args, "--dtype") == "bfloat16"
    assert arg_value(args, "--max-model-len") == "8192"
    assert arg_value(args, "--max-num-seqs") == "32"
    assert arg_value(decode["args"], "--tensor-parallel-size") == "4"
    assert "--max-num-seqs" not in decode["args"]


def test_served_name_defaults_to_the_model_name(make_pds):
    pds = make_pds({"model": {"servedName": None}})
    assert arg_value(container(pds, "decode")["args"], "--served-model-name") == "Qwen/Qwen3-8B"


def test_extra_args_come_last_and_user_env_is_added(make_pds):
    pds = make_pds(
        {
            "decode": {
                "extraArgs": ["--block-size", "32"],
                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
            }
        }
    )
    assert container(pds, "decode")["args"][-2:] == ["--block-size", "32"]
    assert env(pds, "decode")["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "VLLM_LOGGING_LEVEL" not in env(pds, "prefill")


def test_the_engine_port_setting_moves_the_server_the_container_port_and_the_service(make_pds):
    pds = make_pds({"engine": {"port": 9000}})
    engine = container(pds, "prefill")
    assert arg_value(engine["args"], "--port") == "9000"
    assert {"name": "http", "containerPort": 9000, "protocol": "TCP"} in engine["ports"]
    service = next(
        o
        for o in render_pdservice(pds, RenderDefaults())
        if o["kind"] == "Service" and o["metadata"]["name"] == "svc-prefill"
    )
    assert service["spec"]["ports"][0]["port"] == 9000


def test_mock_runtime_runs_pd_mock_engine_with_the_engine_id_side_channel_and_compat_hash(example_pds):
    pds = example_pds("tiny-cpu")
    compat = compatibility_hash(pds.spec, RenderDefaults())
    for role in ("prefill", "decode"):
        engine = container(pds, role)
        assert engine["command"] == ["pd-mock-engine"]
        assert engine["args"] == [
            "--role", role, "--port", "8000", "--model", "tiny-llama",
            "--engine-id", f"$(POD_NAME)-{compat}",
            "--side-channel-host", "$(POD_IP)", "--side-channel-port", "5600",
            "--tp-size", "1", "--transport", "mock",
            "--compat-hash", compat, "--transfer-timeout", "60", "--max-model-len", "2048",
        ]  # fmt: skip
        # A mock engine loads no weights: no model volume, no Hugging Face settings.
        assert [m["mountPath"] for m in engine["volumeMounts"]] == ["/dev/shm"]
        assert "HF_HOME" not in env(pds, role)


def test_mock_runtime_over_a_nixl_backend_uses_the_nixl_transport(make_pds):
    pds = make_pds(
        {
            "engine": {"runtime": "mock", "transport": {"backend": "UCX"}},
            "prefill": {"resources": {"gpus": 0}},
        }
    )
    args = container(pds, "prefill")["args"]
    assert args[args.index("--transport") + 1] == "nixl"


def test_pd_mock_engine_accepts_the_rendered_command_line(example_pds):
    from pdconnector.sim.main import build_parser  # noqa: PLC0415

    for role in ("prefill", "decode"):
        args = build_parser().parse_args(container(example_pds("tiny-cpu"), role)["args"])
        assert args.role == role
        assert args.compat_hash == compatibility_hash(example_pds("tiny-cpu").spec, RenderDefaults())


def test_mock_engines_keep_their_kv_in_gpu_memory_when_their_pod_has_gpus(make_pds):
    pds = make_pds(
        {
            "engine": {"runtime": "mock", "transport": {"backend": "UCX"}},
            "prefill": {"resources": {"gpus": 1}},
            "decode": {"resources": {"gpus": 0}},
        }
    )
    assert arg_value(container(pds, "prefill")["args"], "--kv-device") == "cuda"
    assert "--kv-device" not in container(pds, "decode")["args"]


def test_mock_engines_on_the_mock_transport_keep_their_kv_in_host_memory_even_on_gpu_pods(make_pds):
    pds = make_pds(
        {
            "engine": {"runtime": "mock", "transport": {"backend": "mock"}},
            "prefill": {"resources": {"gpus": 1}},
        }
    )
    assert "--kv-device" not in container(pds, "prefill")["args"]


def test_pd_mock_engine_accepts_the_gpu_example_command_line(example_pds):
    from pdconnector.sim.main import build_parser  # noqa: PLC0415

    for role in ("prefill", "decode"):
        args = build_parser().parse_args(container(example_pds("tiny-gpu"), role)["args"])
        assert (args.kv_device, args.transport) == ("cuda", "nixl")


# ---------------------------------------------------------------- KV connector


def test_builtin_connector_is_loaded_from_our_module_with_producer_and_consumer_roles(make_pds):
    pds = make_pds(
        {
            "engine": {
                "sideChannelPort": 6100,
                "transferTimeoutSeconds": 30,
                "kvLoadFailurePolicy": "recompute",
            }
        }
    )
    compat = compatibility_hash(pds.spec, RenderDefaults())
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = kv_config(pds, role)
        assert config == {
            "kv_connector": "PDConnector",
            "kv_connector_module_path": "pdconnector.vllm.connector",
            "kv_role": kv_role,
            "kv_buffer_device": "cuda",
            "engine_id": f"$(POD_NAME)-{compat}",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "mode": "push",
                "backends": ["UCX"],
                "side_channel_port": 6100,
                "transfer_timeout_s": 30,
                # 1 s registration grace + 30 s write timeout + 2 x 30 s liveness kill bound + 5 s slack
                "fence_s": 96.0,
                "heartbeat_dir": "/tmp/pdconnector-heartbeat",
                "kv_cache_layout": "BLHNC",
                "staging_mib": 1024,
            },
        }


def test_push_engines_on_gpus_get_the_staging_buffer_the_spec_names_and_others_none(make_pds):
    def staging(pds: Any, role: str) -> int:
        return kv_config(pds, role)["kv_connector_extra_config"]["staging_mib"]

    assert staging(make_pds({"engine": {"transport": {"stagingMib": 256}}}), "decode") == 256
    assert staging(make_pds({"engine": {"transport": {"stagingMib": 0}}}), "prefill") == 0
    assert staging(make_pds({"mode": "pull"}), "prefill") == 0  # pull reads direct
    cpu = make_pds({"prefill": {"resources": {"gpus": 0}}})
    assert (staging(cpu, "prefill"), staging(cpu, "decode")) == (0, 1024)


def test_engines_ask_for_a_block_outermost_cache_and_head_outermost_across_dense_tp_sizes(make_pds):
    def layout(overrides: dict, role: str) -> str:
        return kv_config(make_pds(overrides), role)["kv_connector_extra_config"]["kv_cache_layout"]

    mixed_tp = {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}
    for role in ("prefill", "decode"):
        assert layout({}, role) == "BLHNC"
        assert layout(mixed_tp, role) == "BHLNC"


def test_gpu_engines_on_ucx_read_over_cuda_ipc_unless_the_user_says_otherwise(make_pds):
    def env(overrides: dict, role: str = "decode") -> dict[str, str]:
        return {var["name"]: var.get("value") for var in container(make_pds(overrides), role)["env"]}

    assert env({})["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in env({"engine": {"transport": {"backend": "LIBFABRIC"}}})
    user = {"decode": {"env": [{"name": "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "value": "n"}]}}
    assert env(user)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"


def test_builtin_connector_carries_the_mode(make_pds):
    assert kv_config(make_pds({"mode": "pull"}), "decode")["kv_connector_extra_config"]["mode"] == "pull"


def test_upstream_connector_is_nixl_connector_in_pull_and_nixl_push_connector_in_push(make_pds):
    pull = make_pds({"mode": "pull", "engine": {"connector": "vllm"}})
    push = make_pds({"mode": "push", "engine": {"connector": "vllm", "prefillEngineId": "p-fixed"}})
    for role in ("prefill", "decode"):
        assert kv_config(pull, role)["kv_connector"] == "NixlConnector"
        assert kv_config(push, role)["kv_connector"] == "NixlPushConnector"
        assert "kv_connector_module_path" not in kv_config(push, role)
        assert kv_config(push, role)["kv_connector_extra_config"] == {"backends": ["UCX"]}


def test_a_fixed_prefill_engine_id_replaces_the_prefill_ids_only(make_pds):
    pds = make_pds({"engine": {"connector": "vllm", "prefillEngineId": "p-fixed"}})
    compat = compatibility_hash(pds.spec, RenderDefaults())
    assert kv_config(pds, "prefill")["engine_id"] == "p-fixed"
    assert kv_config(pds, "decode")["engine_id"] == f"$(POD_NAME)-{compat}"


def test_engines_without_gpus_keep_kv_buffers_in_host_memory(make_pds):
    pds = make_pds({"prefill": {"resources": {"gpus": 0}}})
    assert kv_config(pds, "prefill")["kv_buffer_device"] == "cpu"
    assert kv_config(pds, "decode")["kv_buffer_device"] == "cuda"


def test_cpu_engines_are_not_pinned_to_the_first_cores_unless_the_user_says_so(make_pds):
    pds = make_pds(
        {
            "prefill": {"resources": {"gpus": 0}},
            "decode": {
                "resources": {"gpus": 0},
                "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}],
            },
        }
    )
    assert env(pds, "prefill")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert [
        var["value"] for var in container(pds, "decode")["env"] if var["name"] == "VLLM_CPU_OMP_THREADS_BIND"
    ] == ["0-3"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env(make_pds({}), "prefill"), "GPU engines keep vLLM's default"


# ---------------------------------------------------------------- prefix caching and hybrid models


def test_hybrid_models_get_the_conv_state_layout_and_both_roles_without_prefix_caching(example_pds):
    pds = example_pds("nemotron-nano-hybrid")
    for role in ("prefill", "decode"):
        assert env(pds, role)["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
        # On GPUs prefix caching would switch vLLM's Mamba cache to 'align' mode, which the connector does not
        # model.
        assert "--no-enable-prefix-caching" in container(pds, role)["args"]
        assert "--enable-prefix-caching" not in container(pds, role)["args"]


def test_the_sd_layout_is_passed_through(make_pds):
    pds = make_pds(
        {"model": {"architecture": "hybrid-ssm"}, "ssm": {"family": "mamba2", "convStateLayout": "SD"}}
    )
    assert env(pds, "decode")["VLLM_SSM_CONV_STATE_LAYOUT"] == "SD"


def test_dense_models_keep_vllms_prefix_caching_default_and_no_ssm_layout(make_pds):
    pds = make_pds()
    for role in ("prefill", "decode"):
        assert "VLLM_SSM_CONV_STATE_LAYOUT" not in env(pds, role)
        assert not {"--no-enable-prefix-caching", "--enable-prefix-caching"} & set(
            container(pds, role)["args"]
        )


def test_explicit_prefix_caching_settings_win(make_pds):
    pds = make_pds({"prefill": {"enablePrefixCaching": False}, "decode": {"enablePrefixCaching": True}})
    assert "--no-enable-prefix-caching" in container(pds, "prefill")["args"]
    assert "--enable-prefix-caching" in container(pds, "decode")["args"]


# ---------------------------------------------------------------- identity and environment


def test_pod_identity_comes_from_the_downward_api_and_the_side_channel_host_is_the_pod_ip(make_pds):
    pds = make_pds({"engine": {"sideChannelPort": 7000}})
    variables = container(pds, "prefill")["env"]
    names = [var["name"] for var in variables]
    values = env(pds, "prefill")
    assert values["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert values["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert values["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert values["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    assert values["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"
    # $(VAR) expands only variables defined earlier in the list.
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert {"name": "side-channel", "containerPort": 7000, "protocol": "TCP"} in container(pds, "prefill")[
        "ports"
    ]


def test_hugging_face_models_download_into_a_cache_volume_with_the_token_from_the_secret(example_pds):
    pds = example_pds("qwen3-32b-push-efa")
    engine = container(pds, "prefill")
    assert arg_value(engine["args"], "--model") == "Qwen/Qwen3-32B"
    values = env(pds, "prefill")
    assert values["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert {"name": "model-cache", "mountPath": values["HF_HOME"]} in engine["volumeMounts"]


def test_pvc_models_are_mounted_read_only_and_loaded_from_the_mount(make_pds):
    pds = make_pds({"model": {"source": {"pvc": {"claimName": "weights", "path": "qwen/8b"}}}})
    sts = statefulset(pds, "decode")
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert arg_value(engine["args"], "--model") == "/models/qwen/8b"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in sts[
        "spec"
    ]["template"]["spec"]["volumes"]
    assert "HF_TOKEN" not in env(pds, "decode")
    assert "HF_HOME" not in env(pds, "decode")


def test_dev_shm_is_memory_backed_and_sized_by_the_spec(make_pds):
    pds = make_pds({"decode": {"resources": {"shmSize": "32Gi"}}})
    pod = statefulset(pds, "decode")["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_probes_hit_health_and_startup_tolerates_a_long_model_load(make_pds):
    engine = container(make_pds(), "prefill")
    for probe in ("startupProbe", "readinessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # besides the transfer heartbeat
    assert "http://127.0.0.1:8000/health" in engine["livenessProbe"]["exec"]["command"]
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    budget = RenderDefaults(engine_startup_budget_seconds=600)
    startup = statefulset(make_pds(), "prefill", budget)["spec"]["template"]["spec"]["containers"][0][
        "startupProbe"
    ]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600


# ---------------------------------------------------------------- resources and EFA


def test_gpus_default_to_the_tensor_parallel_size_as_request_and_limit(make_pds):
    pds = make_pds({"prefill": {"tensorParallelSize": 4}, "decode": {"resources": {"gpus": 8}}})
    assert container(pds, "prefill")["resources"] == {
        "requests": {"nvidia.com/gpu": 4},
        "limits": {"nvidia.com/gpu": 4},
    }
    assert container(pds, "decode")["resources"]["limits"] == {"nvidia.com/gpu": 8}


def test_zero_gpus_request_no_gpu_and_cpu_memory_are_passed_through(make_pds):
    pds = make_pds({"prefill": {"resources": {"gpus": 0, "cpu": "2", "memory": "4Gi"}}})
    assert container(pds, "prefill")["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }


def test_efa_adds_devices_per_role_hugepages_libfabric_env_and_ipc_lock(make_pds):
    pds = make_pds(EFA_ON)
    for role, devices in (("prefill", 16), ("decode", 8)):
        engine = container(pds, role)
        for amounts in (engine["resources"]["requests"], engine["resources"]["limits"]):
            assert amounts["vpc.amazonaws.com/efa"] == devices
            assert amounts["hugepages-2Mi"] == "6Gi"
        values = env(pds, role)
        assert values["FI_PROVIDER"] == "efa"
        assert values["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert "/opt/amazon/efa/lib" in values["LD_LIBRARY_PATH"].split(":")
        assert engine["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert kv_config(pds, role)["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]


def test_efa_without_hugepages_requests_none(make_pds):
    for zero in ("0", "0Gi", "0.0"):
        pds = make_pds({**EFA_ON, "network": {"efa": {"enabled": True, "hugepages": zero}}})
        assert "hugepages-2Mi" not in container(pds, "prefill")["resources"]["limits"]
    pds = make_pds({**EFA_ON, "network": {"efa": {"enabled": True, "hugepages": "10Mi"}}})
    assert container(pds, "prefill")["resources"]["limits"]["hugepages-2Mi"] == "10Mi"


def test_efa_privileged_replaces_ipc_lock(make_pds):
    pds = make_pds({**EFA_ON, "network": {"efa": {"enabled": True, "privileged": True}}})
    assert container(pds, "prefill")["securityContext"] == {"privileged": True}


def test_without_efa_there_is_no_efa_resource_env_capability_or_hugepage(make_pds):
    pds = make_pds({"network": {"efa": {"enabled": False, "prefillDevices": 16}}})
    for role in ("prefill", "decode"):
        engine = container(pds, role)
        text = json.dumps(engine)
        for marker in (
            "vpc.amazonaws.com/efa",
            "hugepages",
            "FI_PROVIDER",
            "FI_EFA",
            "LD_LIBRARY_PATH",
            "IPC_LOCK",
            "privileged",
        ):
            assert marker not in text
        assert "securityContext" not in engine


def test_efa_puts_prefill_and_decode_on_different_hosts(make_pds):
    pds = make_pds(EFA_ON)
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        affinity = statefulset(pds, role)["spec"]["template"]["spec"]["affinity"]
        (term,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "pd-operator",
            "app.kubernetes.io/instance": "svc",
            "inference.pdoperator.dev/role": peer,
        }


def test_without_efa_the_user_affinity_is_used_unchanged_and_absent_stays_absent(make_pds):
    user = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": []}}
            ]
        }
    }
    pds = make_pds({"prefill": {"affinity": user}})
    assert statefulset(pds, "prefill")["spec"]["template"]["spec"]["affinity"] == user
    assert "affinity" not in statefulset(pds, "decode")["spec"]["template"]["spec"]


def test_user_affinity_is_merged_with_the_efa_anti_affinity_without_being_modified(make_pds):
    own_term = {"labelSelector": {"matchLabels": {"team": "x"}}, "topologyKey": "topology.kubernetes.io/zone"}
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchFields": []}]}
        },
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own_term]},
    }
    pds = make_pds({**EFA_ON, "prefill": {"affinity": user, "resources": {"memory": "1Gi"}}})
    affinity = statefulset(pds, "prefill")["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    terms = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == own_term
    assert terms[1]["labelSelector"]["matchLabels"]["inference.pdoperator.dev/role"] == "decode"
    # The spec itself is untouched, so rendering again gives the same result.
    assert pds.spec.prefill.affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        own_term
    ]
    assert statefulset(pds, "prefill")["spec"]["template"]["spec"]["affinity"] == affinity


def test_node_selector_and_tolerations_are_passed_through(example_pds):
    pod = statefulset(example_pds("qwen3-32b-push-efa"), "decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


# ---------------------------------------------------------------- the API's reserved names


def engine_containers(pds: PDService, role: str) -> list[dict[str, Any]]:
    """The engine containers of a role: its StatefulSet's, or its LeaderWorkerSet's leader and worker."""
    (workload,) = [
        o
        for o in render_pdservice(pds, RenderDefaults())
        if o["kind"] in ("StatefulSet", "LeaderWorkerSet") and o["metadata"]["name"] == f"{pds.name}-{role}"
    ]
    if workload["kind"] == "StatefulSet":
        templates = [workload["spec"]["template"]]
    else:
        group = workload["spec"]["leaderWorkerTemplate"]
        templates = [group["leaderTemplate"], group["workerTemplate"]]
    return [template["spec"]["containers"][0] for template in templates]


def test_every_flag_and_variable_the_operator_sets_is_reserved_by_validation(variant, example_pds):
    """extraArgs and env cannot override what rendering sets (but defaults meant to be overridden): validation
    rejects these names."""
    services = (variant[1], *map(example_pds, ("tiny-cpu", "qwen3-32b-push-efa", "deepseek-v3-multinode")))
    for pds in services:
        for role, engine in ((r, e) for r in ("prefill", "decode") for e in engine_containers(pds, r)):
            user_args = len(getattr(pds.spec, role).extra_args)
            own_args = engine["args"][: len(engine["args"]) - user_args]
            flags = {arg for arg in own_args if arg.startswith("--")}
            assert flags <= set(managed_flags(pds.spec)), flags - set(managed_flags(pds.spec))
            user_env = {var.name for var in getattr(pds.spec, role).env}
            own_env = (
                {var["name"] for var in engine["env"]} - user_env - {CPU_THREAD_BINDING_ENV, CUDA_IPC_GET_ENV}
            )
            assert own_env <= set(RESERVED_ENV) | set(EFA_RESERVED_ENV), (
                own_env - set(RESERVED_ENV) - set(EFA_RESERVED_ENV)
            )


def test_engines_with_our_connector_are_killed_by_a_stale_heartbeat_within_the_bound_decode_fences_for(
    make_pds, tmp_path
):
    """A frozen prefill must die (and its NIC context with it) before decode's fence frees the blocks it may
    write."""
    from pdconnector.protocol.liveness import LivenessProbe  # noqa: PLC0415
    from pdconnector.worker.liveness import main as liveness_check  # noqa: PLC0415

    pds = make_pds({"engine": {"transferTimeoutSeconds": 30}})
    for role in ("prefill", "decode"):
        probe = container(pds, role)["livenessProbe"]
        command = probe["exec"]["command"]
        assert command[:3] == ["python3", "-m", "pdconnector.worker.liveness"]
        assert command[3] == "/tmp/pdconnector-heartbeat"
        # the rendered arguments parse (no heartbeat yet: passes)
        assert liveness_check([str(tmp_path), *command[4:6]]) == 0
        kill_bound = LivenessProbe(
            heartbeat_max_age_s=int(command[5]),
            period_s=probe["periodSeconds"],
            timeout_s=probe["timeoutSeconds"],
            failure_threshold=probe["failureThreshold"],
            termination_grace_s=probe["terminationGracePeriodSeconds"],
        ).kill_bound_s()
        fence_s = kv_config(pds, role)["kv_connector_extra_config"]["fence_s"]
        assert fence_s >= 30 + 2 * kill_bound


def test_the_upstream_connector_keeps_the_plain_health_liveness_probe(make_pds):
    pds = make_pds({"engine": {"connector": "vllm"}})
    assert container(pds, "decode")["livenessProbe"]["httpGet"]["path"] == "/health"
