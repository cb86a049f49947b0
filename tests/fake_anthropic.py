"""A local fake of the Anthropic Messages API (POST /v1/messages), over real HTTP.

The real ``anthropic`` SDK talks to it through ``base_url``; it answers each request with the
next canned reply and records the requests, so a test can check what the agent sent (the
reference source, the previous failure) and what it did with each reply.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeAnthropic:
    def __init__(self, replies: list[str], key: str = "sk-test"):
        self.replies = list(replies)
        self.key = key
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if self.path.rstrip("/") != "/v1/messages":
                    return self._send(404, {"type": "error", "error": {"type": "not_found_error", "message": self.path}})
                # The SDK sends the key as x-api-key (older) or as a bearer token (2.x).
                sent = self.headers.get("x-api-key") or (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if sent != fake.key:
                    return self._send(401, {"type": "error", "error": {"type": "authentication_error",
                                                                       "message": "invalid x-api-key"}})
                with fake._lock:
                    fake.requests.append(body)
                    n = len(fake.requests)
                    text = fake.replies.pop(0) if fake.replies else "I have no more kernels."
                return self._send(200, {
                    "id": f"msg_fake_{n}", "type": "message", "role": "assistant", "model": body["model"],
                    "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": {"input_tokens": 100, "output_tokens": 200},
                })

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
