"""Both tier engines as local `anneal serve` processes, for `anneal compile` without `--engines`.

Why: on a laptop or a single GPU box the compile should just work — start a fast-tier engine
(first ``k`` layers) and a slow-tier engine (all layers) with a fresh admin token, wait until their
admin APIs answer, and stop them (and only them) at the end, even when the compile fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from anneal.agents.engine_client import EngineClient, EngineError

_LAUNCH = "import sys; from anneal.cli import main; sys.exit(main())"
FAST_TIER_GPU_SHARE = 0.2  # of the GPU's memory for the fast tier; the slow tier sizes from what is left
# Room beyond the slow tier's own weight copies: the 2 GiB the engine keeps beside them, the fast
# tier's copies (two layers and lm_head) and what the CUDA context and graph pools take.
COPY_MARGIN = 3 * 2**30
MIN_SLOW_SHARE = 0.5  # below it the KV cache would be too small to judge a traffic replay: keep the default


def slow_tier_share(copies: int, total: int, default: float) -> float | None:
    """The slow tier's ``--gpu-memory-utilization`` that leaves ``copies`` bytes of weight copies room
    beside its KV cache on a GPU of ``total`` bytes (the engine keeps ``total * (1 - share)`` + 2 GiB
    free when it sizes the cache), or None where ``default`` already does or the share would fall
    under MIN_SLOW_SHARE. Why: at the default 0.85 an H100 keeps ~14 GB free, and the folded bf12 plan
    of an 8B needs ~20 GB: every such candidate was refused (sessions 49-51 passed 0.6 by hand)."""
    share = int((1 - (copies + COPY_MARGIN) / total) * 100) / 100
    return share if MIN_SLOW_SHARE <= share < default else None


@contextlib.contextmanager
def exit_on_sigterm():
    """SIGTERM raises SystemExit in the main thread, so ``finally`` blocks stop the engines we
    started (they run in their own sessions and would not see the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A port nothing listens on now and not in ``taken``. The OS may hand a port it just gave out
    (and that is not bound yet) to the next caller: the README's demo once started both tier engines
    on the same public port, and the second died on "address already in use"."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


@dataclass
class LocalEngine:
    tier: str
    proc: subprocess.Popen
    admin_url: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class LocalEngines:
    """Starts, waits for and stops the two tier engines."""

    model: str
    out: Path
    fast_layers: int | None = 1  # None: the slow tier alone (bench/plans.py --served)
    device: str = "cpu"
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    engines: dict[str, LocalEngine] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    plan: str | None = None  # a plan file both tiers start with (their first capture uses it)
    # the slow tier's --gpu-memory-utilization on a GPU (None: ``slow_tier_share``'s, or the engine's
    # default where that leaves room): lower leaves room beside its KV cache for the second copies of
    # weights a candidate may need (folded_norm on bf12 copies: ~20 GB on an 8B, more than the
    # default's spare on an 80-GB card)
    slow_memory_share: float | None = None
    ports: set[int] = field(default_factory=set)  # handed to the engines started here: never twice

    def start(self, timeout_s: float = 600.0) -> dict[str, EngineClient]:
        """Start both tiers (the slow one alone without ``fast_layers``) and wait until their admin
        APIs answer.

        On a GPU the tiers start one after the other: each sizes its KV cache from the memory that
        is free when it starts, so the fast tier (a few layers) takes a small share first and the
        slow tier the rest — started together, whichever sized first would take it all.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        gpu = self.device.startswith("cuda")
        if gpu and self.slow_memory_share is None:
            self.slow_memory_share = self._room_for_copies()
        clients: dict[str, EngineClient] = {}
        try:
            tiers = ((("fast", self.fast_layers),) if self.fast_layers else ()) + (("slow", None),)
            for tier, layers in tiers:
                share = FAST_TIER_GPU_SHARE if layers else self.slow_memory_share
                self._launch(tier, layers, share if gpu else None)
                if gpu:
                    clients[tier] = self._wait(tier, timeout_s)
            for tier in self.engines:
                if tier not in clients:
                    clients[tier] = self._wait(tier, timeout_s)
        except BaseException:
            for c in clients.values():
                c.close()
            self.stop()
            raise
        return clients

    def _room_for_copies(self) -> float | None:
        """``slow_tier_share`` for this model on this GPU (None: the engine's default)."""
        import torch

        from anneal.agents.cost_model import second_copy_bytes, shape_from_config
        from anneal.engine.llm import EngineArgs
        from anneal.engine.weights import resolve_config

        try:
            shape = shape_from_config(resolve_config(self.model).model_dump())
        except ValueError:  # the engine's own start says what is wrong with the model
            return None
        _, total = torch.cuda.mem_get_info(torch.device(self.device))
        default = EngineArgs.model_fields["gpu_memory_utilization"].default
        return slow_tier_share(second_copy_bytes(shape), total, default)

    def _launch(self, tier: str, layers: int | None, memory_share: float | None) -> None:
        env = {**os.environ, "ANNEAL_ADMIN_TOKEN": self.token}
        port, admin = self._new_port(), self._new_port()
        cmd = [sys.executable, "-c", _LAUNCH, "serve", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(port), "--admin-port", str(admin), "--device", self.device,
               *self.extra_args]
        if layers is not None:
            cmd += ["--layers", str(layers)]
        if self.plan:
            cmd += ["--plan", self.plan]
        if memory_share is not None:
            cmd += ["--gpu-memory-utilization", str(memory_share)]
        log = self.out / f"engine-{tier}.log"
        fh = open(log, "ab")  # a restarted engine's log follows the one it replaces (why it died)
        fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting the {tier}-tier engine: "
                 f"anneal {' '.join(cmd[3:])}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
        self.engines[tier] = LocalEngine(tier, proc, f"http://127.0.0.1:{admin}", log)
        (self.out / "engines.json").write_text(json.dumps(
            {t: {"pid": e.proc.pid, "admin_url": e.admin_url, "log": str(e.log), "args": e.proc.args[3:]}
             for t, e in self.engines.items()},
            indent=2))

    def _new_port(self) -> int:
        port = free_port(self.ports)
        self.ports.add(port)
        return port

    def _wait(self, tier: str, timeout_s: float) -> EngineClient:
        eng = self.engines[tier]
        c = EngineClient(eng.admin_url, self.token, name=f"{tier}-tier engine")
        try:
            c.wait_ready(timeout_s, proc_alive=eng.alive)
        except EngineError as e:
            c.close()
            raise EngineError(f"{e}\n--- {eng.log} (last lines) ---\n{eng.log_tail()}") from None
        return c

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the engines this object started (their own process groups), politely first."""
        for eng in self.engines.values():
            if eng.alive():
                try:
                    os.killpg(eng.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for eng in self.engines.values():
            try:
                eng.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(eng.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                eng.proc.wait()
