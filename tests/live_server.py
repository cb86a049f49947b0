"""A live `anneal serve` process for the serving tests (random:tiny on the CPU, a free port)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(
        self, *args: str, model: str = "random:tiny", env: dict[str, str] | None = None, cli: bool = False
    ):
        """``cli=True`` starts the user's entry point, ``anneal serve``; else the server module."""
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="anneal-serve-", suffix=".log", delete=False)
        entry = [str(Path(sys.executable).with_name("anneal")), "serve"] if cli else [
            sys.executable, "-m", "anneal.engine.server"]
        cmd = [
            *entry, "--model", model, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(self.port), "--admin-port", str(self.admin_port), "--log-level", "warning", *args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_ready(self, timeout: float = 120.0) -> "LiveServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become ready:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5.0).json()

    def wait_idle(self, timeout: float = 15.0) -> dict:
        """/health once no request is in flight (aborts land at the engine thread's next turn)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            idle = h["num_inflight"] == 0 and h["num_running"] == 0 and h["num_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def assert_no_leaked_blocks(self) -> None:
        h = self.wait_idle()
        assert h["num_inflight"] == h["num_running"] == h["num_waiting"] == 0, h
        assert h["kv"]["free_blocks"] == h["kv"]["num_blocks"], h

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5.0).text

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code; the log file is kept only when the server exited non-zero."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0:
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def metric_value(text: str, series: str) -> float:
    """The value of one exposed series (exact name with labels), 0 when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
