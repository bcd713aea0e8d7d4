"""The JSON-over-HTTP plumbing the fake chat-completions servers of these tests share."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet handler that answers JSON bodies."""

    def log_message(self, *args) -> None:
        pass

    def read_json(self) -> dict:
        """The request's JSON body."""
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client has gone (a timed-out or hung request)
            pass


def chat_completion(model: str, message: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    """A chat.completion response body with one choice."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    usage["total_tokens"] = prompt_tokens + completion_tokens
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": model, "usage": usage, "choices": [choice]}


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve the handler on a free local port in a thread; yields the /v1 base url."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
