"""The Kubernetes API as the reconciler sees it: a small async protocol, and its implementation on the
official ``kubernetes`` client (configuration, auth and TLS from kubeconfig or the service account).

The reconciler needs six calls on arbitrary resources with plain dicts in and out; the typed
client APIs would turn every object into generated models and back. So the implementation
builds REST paths from ``ResourceKind`` and lets the client do transport, auth and TLS; the
blocking client runs in worker threads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

import kubernetes

from .kinds import ResourceKind

MERGE_PATCH = "application/merge-patch+json"


class KubeApiError(Exception):
    """A failed API call: HTTP status, the Status reason and its message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeApi(Protocol):
    async def list(self, kind: ResourceKind, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""

    async def create(self, kind: ResourceKind, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...

    async def patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """RFC 7386 merge patch of the object or of its subresource."""

    async def delete(self, kind: ResourceKind, namespace: str, name: str) -> bool:
        """False when it was already gone."""


class KubernetesApi:
    """``KubeApi`` over ``kubernetes.client.ApiClient``; every request identifies itself as ``user_agent``."""

    def __init__(
        self, client: kubernetes.client.ApiClient, user_agent: str, timeout_seconds: float = 30.0
    ) -> None:
        self._client = client
        self._client.user_agent = user_agent
        self._timeout = timeout_seconds

    @classmethod
    def from_environment(cls, user_agent: str, timeout_seconds: float = 30.0) -> KubernetesApi:
        """In-cluster configuration inside a pod, else the current kubeconfig context."""
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = 32
        return cls(kubernetes.client.ApiClient(configuration), user_agent, timeout_seconds)

    async def list(self, kind: ResourceKind, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = await self._call("GET", kind.path(namespace), query=[("labelSelector", label_selector)])
        return list(result.get("items") or [])

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", kind.path(namespace, name))
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, kind: ResourceKind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", kind.path(namespace), body=body)

    async def patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self._call(
            "PATCH", kind.path(namespace, name, subresource), body=patch, content_type=MERGE_PATCH
        )

    async def delete(self, kind: ResourceKind, namespace: str, name: str) -> bool:
        try:
            await self._call("DELETE", kind.path(namespace, name), body={"propagationPolicy": "Background"})
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        return await asyncio.to_thread(self._call_blocking, method, path, query or [], body, content_type)

    def _call_blocking(
        self, method: str, path: str, query: list[tuple[str, str]], body: Any, content_type: str
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self._client.param_serialize(
            method, path, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self._client.call_api(*request, _request_timeout=self._timeout)
            data = response.read()
        except Exception as e:  # transport failures of urllib3 come in many types
            raise KubeApiError(0, "ConnectionFailed", f"{method} {path}: {e}") from e
        try:
            decoded: Any = json.loads(data) if data else {}
        except ValueError:
            decoded = data.decode(errors="replace")
        if not 200 <= response.status <= 299:
            message = decoded.get("message", "") if isinstance(decoded, dict) else str(decoded)
            reason = decoded.get("reason", "") if isinstance(decoded, dict) else ""
            raise KubeApiError(response.status, reason or str(response.reason), message or f"{method} {path}")
        return decoded if isinstance(decoded, dict) else {}
