"""Processes of one local cluster: started in their own process groups, found again through /proc.

Why a marker: every process a cluster starts (control-plane binaries, kwok, the runner, and the pod
processes the runner starts, with their children) inherits the environment variable
`ANNEAL_CLUSTER_ID=<id>`. Stopping a cluster kills its process groups politely, then sweeps /proc
for anything still carrying the marker, so nothing is left behind even if a pod process escaped
its group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

MARKER = "ANNEAL_CLUSTER_ID"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the thread that started it dies (Linux prctl), so a
    test run killed with SIGKILL does not leave a control plane behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (SIGTERM left kube-apiserver hanging)


def spawn(argv: list[str], log: Path, env: dict[str, str], cwd: Path | None = None,
          tie_to_parent: bool = True) -> subprocess.Popen:
    """Start `argv` in a new session (its own process group), output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=die_with_parent if tie_to_parent else None)


def kill_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM a process group, wait up to `grace` seconds, then SIGKILL what is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in group `pgid`."""
    for pid in _pids():
        stat = _stat(pid)
        if stat and stat[1] == pgid and stat[0] != "Z":
            return True
    return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, pgid) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def marked(cluster_id: str) -> list[int]:
    """Live (non-zombie) pids whose environment carries this cluster's marker."""
    needle = f"{MARKER}={cluster_id}".encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            stat = _stat(pid)
            if stat and stat[0] != "Z":
                found.append(pid)
    return found


def sweep(cluster_id: str, grace: float = 3.0) -> list[int]:
    """Kill every process still carrying the marker; returns the pids that had to be killed."""
    pids = marked(cluster_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and marked(cluster_id):
            time.sleep(0.05)
    return pids
