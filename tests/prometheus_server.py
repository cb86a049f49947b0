"""A real Prometheus server for tests (Debian package `prometheus`): its own loopback port, its own
storage, scraping the given targets (or a file_sd target list the caller keeps up to date) every
second; stopped (and killed if need be) on exit."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: list[str], *, honor_labels: bool = False,
                       file_sd: Path | None = None, job_name: str = "engines",
                       ready_timeout: float = 60) -> Iterator[str]:
    """Yields the server's base URL once it answers /-/ready.

    ``file_sd``: a JSON file_sd target list (re-read every 2 s) instead of the static ``targets``,
    for targets that come and go (what Kubernetes service discovery does in a cluster)."""
    assert PROMETHEUS, "the prometheus binary is not installed (apt-get install -y prometheus)"
    port = free_port()
    if file_sd is not None:
        sd = f"    file_sd_configs: [{{files: ['{file_sd}'], refresh_interval: 2s}}]\n"
    else:
        quoted = ", ".join(f"'{t}'" for t in targets)
        sd = f"    static_configs: [{{targets: [{quoted}]}}]\n"
    (workdir / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: {job_name}\n"
        + ("    honor_labels: true\n" if honor_labels else "")
        + sd
    )
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
