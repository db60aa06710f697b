"""A role whose engines span nodes becomes a LeaderWorkerSet of one pod group per engine: the leader runs
vLLM's API server as node 0, the workers join it headless, every pod names the engine after its leader,
and the rest of the service (router backends, Services, the other role) is as for one-pod engines."""

from __future__ import annotations

import yaml
from pdoperator.render import render_pdservice
from pdoperator.render.engine import MASTER_PORT

from tests.pdoperator.render.conftest import VARIANTS, pds_from_spec


def by_kind(objects, kind):
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def container(template):
    (engine,) = template["spec"]["containers"]
    return engine


def env(template):
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container(template)["env"]}


def flag(args, name):
    return args[args.index(name) + 1]


def test_only_the_role_that_spans_nodes_becomes_a_leader_worker_set(defaults):
    objects = render_pdservice(pds_from_spec(VARIANTS["spanning-nodes"]), defaults)
    assert set(by_kind(objects, "StatefulSet")) == {"svc-prefill"}
    (group,) = by_kind(objects, "LeaderWorkerSet").values()
    assert group["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert group["metadata"]["name"] == "svc-decode"
    spec = group["spec"]
    assert spec["replicas"] == 3  # engines, one group each
    assert spec["leaderWorkerTemplate"]["size"] == 2  # TP 4 over nodes of 2 GPUs
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"
    for template in (
        spec["leaderWorkerTemplate"]["leaderTemplate"],
        spec["leaderWorkerTemplate"]["workerTemplate"],
    ):
        assert container(template)["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_the_leader_is_node_zero_and_the_workers_join_it_headless_under_its_engine_id(defaults):
    objects = render_pdservice(pds_from_spec(VARIANTS["spanning-nodes"]), defaults)
    group = by_kind(objects, "LeaderWorkerSet")["svc-decode"]["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    leader_args, worker_args = container(leader)["args"], container(worker)["args"]
    assert container(leader)["command"] == container(worker)["command"] == ["vllm", "serve"]
    for args in (leader_args, worker_args):
        assert flag(args, "--tensor-parallel-size") == "4"
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(args, "--master-port") == str(MASTER_PORT)
        assert '"engine_id":"$(ENGINE_NAME)-' in flag(args, "--kv-transfer-config")
    assert flag(leader_args, "--node-rank") == "0" and "--headless" not in leader_args
    assert flag(worker_args, "--node-rank") == "$(LWS_WORKER_INDEX)" and "--headless" in worker_args
    assert env(leader)["ENGINE_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env(worker)["ENGINE_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['leaderworkerset.sigs.k8s.io/leader-name']"}
    }
    assert env(leader)["VLLM_HOST_IP"] == env(worker)["VLLM_HOST_IP"] == "$(POD_IP)"


def test_a_worker_serves_nothing_and_only_its_transfer_heartbeat_is_probed(defaults):
    objects = render_pdservice(pds_from_spec(VARIANTS["spanning-nodes"]), defaults)
    group = by_kind(objects, "LeaderWorkerSet")["svc-decode"]["spec"]["leaderWorkerTemplate"]
    leader, worker = container(group["leaderTemplate"]), container(group["workerTemplate"])
    assert {port["name"] for port in leader["ports"]} == {"http", "side-channel"}
    assert "ports" not in worker
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert "readinessProbe" not in worker and "startupProbe" not in worker
    heartbeat = worker["livenessProbe"]["exec"]["command"]
    assert "pdconnector.worker.liveness" in heartbeat and "--url" not in heartbeat
    assert "--url" in leader["livenessProbe"]["exec"]["command"]
    assert "prometheus.io/scrape" not in group["workerTemplate"]["metadata"]["annotations"]


def test_the_router_addresses_leaders_as_it_would_one_pod_engines_and_their_dns_is_published_early(defaults):
    spanning = render_pdservice(pds_from_spec(VARIANTS["spanning-nodes"]), defaults)
    single = render_pdservice(pds_from_spec(VARIANTS["gpu-push-ucx"]), defaults)

    def backends(objects):
        config = yaml.safe_load(by_kind(objects, "ConfigMap")["svc-router"]["data"]["router.yaml"])
        return [(backend["name"], backend["host"]) for backend in config["decode"]["backends"]]

    assert backends(spanning) == backends(single)
    assert [name for name, _ in backends(spanning)] == ["svc-decode-0", "svc-decode-1", "svc-decode-2"]
    services = by_kind(spanning, "Service")
    # a group's workers resolve their leader before it can be ready
    assert services["svc-decode"]["spec"]["publishNotReadyAddresses"] is True
    assert services["svc-prefill"]["spec"]["publishNotReadyAddresses"] is False


def test_pipeline_parallel_and_expert_parallel_reach_vllm_and_only_pipeline_parallel_the_compat_hash(
    defaults,
):
    base = {**VARIANTS["upstream-pull"]}
    plain = render_pdservice(pds_from_spec(base), defaults)
    staged = render_pdservice(
        pds_from_spec(
            {**base, "prefill": {"replicas": 2, "tensorParallelSize": 2, "pipelineParallelSize": 2}}
        ),
        defaults,
    )
    experts = render_pdservice(
        pds_from_spec(
            {**base, "prefill": {"replicas": 2, "tensorParallelSize": 2, "enableExpertParallel": True}}
        ),
        defaults,
    )

    def prefill(objects):
        template = by_kind(objects, "StatefulSet")["svc-prefill"]["spec"]["template"]
        return container(template)["args"], template["metadata"]["labels"]["inference.pdoperator.dev/compat"]

    (plain_args, plain_hash), (staged_args, staged_hash) = prefill(plain), prefill(staged)
    (expert_args, expert_hash) = prefill(experts)
    assert (
        "--pipeline-parallel-size" not in plain_args and flag(staged_args, "--pipeline-parallel-size") == "2"
    )
    assert "--enable-expert-parallel" in expert_args and "--enable-expert-parallel" not in plain_args
    assert staged_hash != plain_hash  # which layers a rank holds changes the KV it exchanges
    assert expert_hash == plain_hash  # experts are not KV
    staged_pod = by_kind(staged, "StatefulSet")["svc-prefill"]["spec"]["template"]
    assert container(staged_pod)["resources"]["limits"]["nvidia.com/gpu"] == 4  # TP x PP on one node
