"""The router: its config (the operator's view of the engines), ConfigMap and Deployment."""

from __future__ import annotations

from typing import Any

from pdconnector.router.config import (
    DEFAULT_API_KEY_ENV,
    ROUTER_CONFIG_FILENAME,
    EngineBackend,
    Retries,
    RoleBackends,
    RouterConfig,
    Timeouts,
    dump_router_config,
)

from pdoperator.api.model import PDService
from pdoperator.api.routing import RetriesSpec

from .cache_routing import KV_EVENTS_PORT, publishes_kv_events, router_cache_aware
from .defaults import RenderDefaults
from .engine import served_model_name
from .identity import compatibility_hash, engine_id, role_spec
from .monitoring import scrape_annotations
from .names import (
    ENGINE_ROLES,
    ROUTER_HTTP_PORT,
    ComponentRole,
    child_name,
    object_labels,
    object_meta,
    pod_dns_name,
    pod_name,
    selector_labels,
    service_dns_name,
)

CONFIG_DIR = "/etc/pd-router"
CONTAINER_NAME = "router"


def _role_backends(
    pds: PDService, role: ComponentRole, compat: str, defaults: RenderDefaults
) -> RoleBackends:
    spec = pds.spec
    rs = role_spec(spec, role)
    serving = pds.serving_replicas(role.value, rs.replicas)
    return RoleBackends(
        service=service_dns_name(pds, role, defaults.cluster_domain),
        namespace=pds.namespace,
        http_port=spec.engine.port,
        side_channel_port=spec.engine.side_channel_port,
        tp_size=rs.tensor_parallel_size,
        kv_events_port=KV_EVENTS_PORT if publishes_kv_events(spec) else None,
        replicas=rs.replicas,
        backends=[
            EngineBackend(
                name=pod_name(pds, role, ordinal),
                host=pod_dns_name(pds, role, ordinal, defaults.cluster_domain),
                engine_id=engine_id(spec, role, pod_name(pds, role, ordinal), compat),
                draining=ordinal >= serving,
            )
            for ordinal in range(rs.replicas)
        ],
    )


def build_router_config(pds: PDService, defaults: RenderDefaults) -> RouterConfig:
    spec = pds.spec
    compat = compatibility_hash(spec, defaults)
    prefill, decode = (_role_backends(pds, role, compat, defaults) for role in ENGINE_ROLES)
    return RouterConfig(
        name=pds.name,
        namespace=pds.namespace,
        mode=spec.mode.value,
        served_model_name=served_model_name(spec),
        max_model_len=spec.model.max_model_len,
        policy=spec.router.policy.value,
        cache_aware=router_cache_aware(spec),
        connector=spec.engine.connector.value,
        compat_hash=compat,
        kv_load_failure_policy=spec.engine.kv_load_failure_policy.value,
        listen_port=ROUTER_HTTP_PORT,
        prefill=prefill,
        decode=decode,
        timeouts=Timeouts(
            connect_s=defaults.router_connect_timeout_seconds,
            prefill_s=defaults.router_prefill_timeout_seconds,
            transfer_s=float(spec.engine.transfer_timeout_seconds),
            decode_first_token_s=defaults.router_decode_first_token_timeout_seconds,
        ),
        retries=router_retries(spec.router.retries),
        max_request_body_bytes=defaults.router_max_request_body_bytes,
        api_key_env=DEFAULT_API_KEY_ENV if spec.router.api_key_secret_ref else None,
    )


def router_retries(retries: RetriesSpec | None) -> Retries:
    """spec.router.retries as the router reads it (the router's defaults when unset)."""
    if retries is None:
        return Retries()
    return Retries(attempts=retries.attempts, budget_s=float(retries.budget_seconds))


def render_router_configmap(pds: PDService, defaults: RenderDefaults) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(pds, ComponentRole.ROUTER),
        "data": {ROUTER_CONFIG_FILENAME: dump_router_config(build_router_config(pds, defaults))},
    }


def _router_container(pds: PDService, defaults: RenderDefaults) -> dict[str, Any]:
    health = {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 10,
        "timeoutSeconds": 3,
        "failureThreshold": 3,
    }
    ready = {
        "httpGet": {"path": "/ready", "port": "http"},
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 2,
    }
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": pds.spec.router.image or defaults.router_image,
        "command": ["pd-router", "--config", f"{CONFIG_DIR}/{ROUTER_CONFIG_FILENAME}"],
        "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": defaults.router_cpu_request, "memory": defaults.router_memory_request},
            "limits": {"memory": defaults.router_memory_limit},
        },
        "livenessProbe": health,
        "readinessProbe": ready,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The directory, not the file, is mounted: a subPath mount would never see ConfigMap updates.
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    if (ref := pds.spec.router.api_key_secret_ref) is not None:
        container["env"] = [
            {"name": DEFAULT_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        ]
    return container


def _router_pod_metadata(pds: PDService) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": object_labels(pds, ComponentRole.ROUTER)}
    if annotations := scrape_annotations(pds, ROUTER_HTTP_PORT):
        metadata["annotations"] = annotations
    return metadata


def render_router_deployment(pds: PDService, defaults: RenderDefaults) -> dict[str, Any]:
    """The router pods; they reload ``router.yaml`` when the ConfigMap changes, so its content is not hashed
    into the template."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pds, ComponentRole.ROUTER),
        "spec": {
            "replicas": pds.spec.router.replicas,
            "selector": {"matchLabels": selector_labels(pds, ComponentRole.ROUTER)},
            "template": {
                "metadata": _router_pod_metadata(pds),
                "spec": {
                    # The router finds engines through DNS and its config file, never the Kubernetes API.
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [_router_container(pds, defaults)],
                    "volumes": [
                        {"name": "config", "configMap": {"name": child_name(pds, ComponentRole.ROUTER)}}
                    ],
                },
            },
        },
    }
