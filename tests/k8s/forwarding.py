"""The emulator's link to the real CRD-serving API server: what kube-apiserver's aggregator does for an
extension server, for the groups the emulator leaves to it.

``Upstream.forward`` passes a request through unchanged (method, path, raw query string, body, content
type, accept, user agent) with the upstream's own credentials in place of the client's, and streams the
answer back as it arrives: status code, error bodies and headers such as ``Warning`` as the real server
wrote them, watch events line by line until either side ends the stream. When the real server cannot be
reached (it is restarting), the client gets the 503 ``ServiceUnavailable`` Status a kube-apiserver answers
while a backend is away, and retries as it would there.
"""

from __future__ import annotations

import contextlib
import pathlib
import ssl
from typing import Any

import aiohttp
import aiohttp.web
from multidict import CIMultiDict

from .api_rules import ApiError
from .resources import EMULATED_GROUPS

# Hop-by-hop headers and those that describe the body as it was sent on one connection: never copied.
_REQUEST_HEADERS_DROPPED = frozenset(
    {
        "host",
        "authorization",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "accept-encoding",
    }
)
_RESPONSE_HEADERS_DROPPED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}
)


class Upstream:
    """The real server at ``url``, authenticated with its bearer ``token`` and trusted by its ``certificate``.

    Used from the emulator's event loop only (its HTTP session is created there on first use)."""

    def __init__(self, url: str, token: str, certificate: pathlib.Path) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.certificate = certificate
        self._session: aiohttp.ClientSession | None = None
        self._groups: list[dict[str, Any]] = []  # the last /apis groups seen, for when the server is away

    @staticmethod
    def serves(path: str) -> bool:
        """``/apis/<group>...`` of any group the emulator does not serve itself."""
        parts = path.split("/")
        return len(parts) >= 3 and parts[1] == "apis" and parts[2] != "" and parts[2] not in EMULATED_GROUPS

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            context = ssl.create_default_context(cafile=str(self.certificate))
            context.check_hostname = False  # the certificate names localhost and 127.0.0.1
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context),
                # No total limit: watches stream for as long as their timeoutSeconds says.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                auto_decompress=False,  # bodies pass through as the server encoded them
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def groups(self) -> list[dict[str, Any]]:
        """The upstream's entries of ``/apis`` (the last ones seen while it restarts)."""
        with contextlib.suppress(aiohttp.ClientError, OSError):
            headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
            async with self._client().get(self.url + "/apis", headers=headers) as response:
                if response.status == 200:
                    self._groups = (await response.json()).get("groups") or []
        return list(self._groups)

    async def forward(self, raw_request: aiohttp.web.BaseRequest, body: bytes) -> aiohttp.web.StreamResponse:
        headers = CIMultiDict(
            (k, v) for k, v in raw_request.headers.items() if k.lower() not in _REQUEST_HEADERS_DROPPED
        )
        headers["Authorization"] = f"Bearer {self.token}"
        # The server compresses only for a client that asked; aiohttp would otherwise ask for it.
        headers["Accept-Encoding"] = raw_request.headers.get("Accept-Encoding", "identity")
        url = (
            self.url
            + raw_request.rel_url.raw_path
            + (f"?{raw_request.query_string}" if raw_request.query_string else "")
        )
        try:
            upstream = await self._client().request(
                raw_request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except (aiohttp.ClientConnectionError, OSError) as e:
            message = f"the server is currently unable to handle the request ({e.__class__.__name__})"
            return ApiError(503, "ServiceUnavailable", message).response()
        async with upstream:
            if upstream.status == 404 and upstream.content_type == "text/plain":
                # pd-apiserver ends its handler chain in Go's plain "404 page not found"; kube-apiserver ends
                # it in a NotFound Status, which clients (the operator's optional kinds) rely on.
                message = "the server could not find the requested resource"
                return ApiError(404, "NotFound", message, {}).response()
            answer_headers = CIMultiDict(
                (k, v) for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_HEADERS_DROPPED
            )
            if "Content-Encoding" in upstream.headers:  # passed through still encoded (auto_decompress off)
                answer_headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
            response = aiohttp.web.StreamResponse(
                status=upstream.status, reason=upstream.reason, headers=answer_headers
            )
            try:
                await response.prepare(raw_request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, ConnectionError):
                # Either side went away mid-stream (a watch cut by a restart, a client that stopped
                # reading): the answer ends where it is, as a dropped connection would end it.
                return response
            await response.write_eof()
        return response
