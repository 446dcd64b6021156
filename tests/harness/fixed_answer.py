"""A web server that gives every request one fixed answer: what a proxy, a wrong port or another program says."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def answering(status: int, body: bytes, content_type: str | None = "application/json") -> Iterator[str]:
    """A server on 127.0.0.1 answering every GET and POST with `status`, `body` (and `content_type`, when given);
    yields its base URL, and stops it on exit."""

    class Fixed(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(status)
            if content_type is not None:
                self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
