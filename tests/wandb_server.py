"""A W&B server on localhost for the tests: it refuses every key, as a real one refuses a revoked key, and
records what it was sent (no test reaches the internet)."""

from __future__ import annotations

import http.server


class WandbStub(http.server.BaseHTTPRequestHandler):
    """A W&B server on localhost that refuses every key, recording what it was sent."""

    seen: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.path, dict(self.headers), body))
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"errors": [{"message": "unauthorized"}]}')

    do_GET = do_PUT = do_POST

    def log_message(self, *args) -> None:
        pass
