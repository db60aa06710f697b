"""A loopback HTTP server for the fakes the operator reads (the router's /status, /metrics texts)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from typing import Any

# path -> (content type, body), or None for a 404
Answer = Callable[[str], tuple[str, str] | None]


class FakeHttpServer:
    """Answers every GET with ``answer(path)``, from a thread of its own; ``with`` starts and stops it."""

    def __init__(self, answer: Answer) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = answer(self.path)
                if found is None:
                    self.send_error(404)
                    return
                content_type, text = found
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHttpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
