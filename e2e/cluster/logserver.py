"""The slice of the kubelet API that `kubectl logs` uses: GET /containerLogs/<ns>/<pod>/<container>.

Why: people debugging an e2e run reach for `kubectl logs`. The API server proxies that call to the
node's InternalIP (127.0.0.1) and kubelet port, presenting the admin client certificate, and
checks our serving certificate against the cluster CA. Supported query parameters: tailLines,
limitBytes, follow (polls the file until the client goes away or the container's pod is gone).
"""

from __future__ import annotations

import http.server
import re
import ssl
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse


def tail(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:]) if lines else b""


class LogServer:
    def __init__(self, pods_dir: Path, cert: str, key: str, ca: str, alive: Callable[[str, str], bool]) -> None:
        self.pods_dir, self.alive = pods_dir, alive
        handler = self._handler()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED  # only the API server (admin client cert) may read logs
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="logserver", daemon=True).start()

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the runner's log stays readable
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                m = re.fullmatch(r"/containerLogs/([^/]+)/([^/]+)/([^/]+)", url.path)
                if not m:
                    self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served")
                    return
                ns, pod, container = m.groups()
                path = server.pods_dir / f"{ns}_{pod}" / f"{container}.log"
                if not path.exists():
                    self.send_error(404, f"no log for container {container!r} of pod {ns}/{pod} on this node")
                    return
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                data = tail(path.read_bytes(), int(q.get("tailLines", -1)))
                if "limitBytes" in q:
                    data = data[: int(q["limitBytes"])]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(data)
                if q.get("follow") not in ("true", "1"):
                    return
                offset = path.stat().st_size
                try:
                    while server.alive(ns, pod):
                        size = path.stat().st_size
                        if size > offset:
                            with open(path, "rb") as f:
                                f.seek(offset)
                                self.wfile.write(f.read(size - offset))
                                self.wfile.flush()
                            offset = size
                        time.sleep(0.3)
                except (OSError, ValueError):
                    return  # the client went away

        return Handler
