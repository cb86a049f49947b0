"""The other ranks of a tensor-parallel engine: processes that mirror rank 0's runner.

Rank 0 keeps the scheduler, the block manager and the servers. Each worker process builds the same
engine on its own device (its shard of the weights and the KV cache, the same plan) and then only
replays rank 0's runner calls: every ``ModelRunner`` method marked ``@mirrored`` is sent to the
workers (method name and arguments, each ``Sequence`` as the ``StepSequence`` a step reads) before
rank 0 runs it, so all ranks launch the same steps in the same order and meet in the same collectives. The
workers' results are dropped: every rank computes the same tokens (the logits are gathered).

A worker that fails to start says why (``TensorParallelError``); one that dies while serving is
found at the next mirrored call, which raises instead of waiting in a collective nobody joins.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
from array import array
from multiprocessing.connection import Client, Listener
from typing import NamedTuple

from anneal.engine.sequence import Sequence

log = logging.getLogger("anneal.tp")


class TokensFrom:
    """A sequence's tokens from position ``start`` on, indexed by absolute position: what a step
    reads of them (its chunk, or the last token), not the whole history."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            if i.step is not None or i.start is None or i.start < self.start:
                raise IndexError(f"tokens before position {self.start} were not sent: {i}")
            stop = None if i.stop is None else i.stop - self.start
            return self.tokens[i.start - self.start:stop]
        if i < 0:
            return self.tokens[i]
        if i < self.start:
            raise IndexError(f"token {i} was not sent (from {self.start} on)")
        return self.tokens[i - self.start]

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __reduce__(self):
        return TokensFrom, (self.start, self.tokens)


class StepParams(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    logprobs: int | None


class StepSequence:
    """What a worker's runner reads of a ``Sequence`` (its blocks, how far it is computed, its
    sampling), sent in its place: pickling whole sequences cost 7 ms to send and 15 ms to read at
    batch 64, context 8192, against a 5-ms step."""

    __slots__ = ("token_ids", "params", "seed", "block_table", "num_computed_tokens")

    def __init__(self, seq):
        start = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        self.token_ids = TokensFrom(start, seq.token_ids[start:])
        p = seq.params
        self.params = StepParams(p.temperature, p.top_p, p.top_k, p.logprobs)
        self.seed = seq.seed
        self.block_table = array("i", seq.block_table)
        self.num_computed_tokens = seq.num_computed_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state) -> None:
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)


def for_workers(obj):
    """``obj`` (a mirrored call's argument) with every ``Sequence`` in it as a ``StepSequence``."""
    if isinstance(obj, Sequence):
        return StepSequence(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(for_workers(x) for x in obj)
    return obj


class TensorParallelError(RuntimeError):
    """A worker rank of a tensor-parallel engine failed to start, or died."""


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Workers:
    """Rank 0's handle on ranks 1..N-1, each a ``python -m anneal.engine.tp_workers`` process (not
    multiprocessing's spawn, which re-imports the caller's main module: a script without a
    ``__main__`` guard would start engines recursively). They connect back over a local socket with
    a one-off key and get the engine's arguments from it."""

    COMMAND = [sys.executable, "-m", "anneal.engine.tp_workers"]  # + the rank

    def __init__(self, args, size: int, init_method: str, connect_timeout_s: float = 120.0):
        key = secrets.token_bytes(16)
        self.conns, self.procs = [], []
        self._closing = False
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            env = {**os.environ, "ANNEAL_TP_ADDRESS": f"{listener.address[0]}:{listener.address[1]}",
                   "ANNEAL_TP_KEY": key.hex()}
            for rank in range(1, size):
                self.procs.append(subprocess.Popen([*self.COMMAND, str(rank)], env=env))
            # accept() in 1-s slices (the Listener's socket: multiprocessing has no public timeout), so
            # a worker that exits before it connects (a broken environment) is named at once
            listener._listener._socket.settimeout(1.0)
            by_rank: dict[int, object] = {}
            deadline = time.monotonic() + connect_timeout_s
            while len(by_rank) < size - 1:
                try:
                    conn = listener.accept()
                    by_rank[conn.recv()] = conn
                    continue
                except TimeoutError:
                    pass
                gone = next((f"rank {r} exited with code {p.returncode} before it connected"
                             for r, p in enumerate(self.procs, start=1) if p.poll() is not None and r not in by_rank),
                            None)
                if gone or time.monotonic() > deadline:
                    self.conns = list(by_rank.values())
                    self.close()
                    raise TensorParallelError(f"tensor-parallel workers did not connect: "
                                              f"{gone or f'none in {connect_timeout_s:.0f} s'}")
        self.conns = [by_rank[r] for r in range(1, size)]
        for conn in self.conns:
            conn.send((args, size, init_method))

    def watch(self, busy, grace_s: float = 10.0) -> None:
        """Exit the process when a worker dies while rank 0 is ``busy()`` (starting, or inside a
        mirrored call) and stays so for ``grace_s``: it is waiting in a collective the dead rank will
        never join, which NCCL gives up on only after ``tensor_parallel.TIMEOUT``. Gloo raises at
        once instead, and a death while idle is the next call's ``TensorParallelError``."""
        def run() -> None:
            while self.procs and not self._closing:
                dead = next(((r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None), None)
                if dead is None:
                    time.sleep(0.25)
                    continue
                rank, p = dead
                log.error("tensor-parallel rank %d exited with code %s", rank, p.returncode)
                deadline = time.monotonic() + grace_s
                while self.procs and not self._closing and busy():
                    if time.monotonic() > deadline:
                        log.critical("rank 0 waits in a collective that rank %d will never join: exiting", rank)
                        os._exit(70)
                    time.sleep(0.1)
                return

        threading.Thread(target=run, name="anneal-tp-watch", daemon=True).start()

    def wait_ready(self) -> None:
        """Each worker's word that its engine is up (or why it is not)."""
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                kind, detail = conn.recv()
            except EOFError:
                kind, detail = "error", f"exited with code {p.wait()} before its engine was up"
            if kind != "ready":
                self.close()
                raise TensorParallelError(f"tensor-parallel rank {rank}: {detail}")

    def send(self, name: str, args: tuple, kwargs: dict) -> None:
        message = (name, for_workers(args), {k: for_workers(v) for k, v in kwargs.items()})
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            if p.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {p.returncode}); "
                                          "the engine cannot step without it: restart it")
            conn.send(message)

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def worker_main(rank: int) -> None:
    """A worker rank: connect to rank 0, build the engine, say so, then run rank 0's runner calls
    until told to stop (or until rank 0's end of the connection closes)."""
    parent = os.getppid()

    def orphaned() -> None:  # rank 0 gone (killed mid-step): nobody will stop this rank or join its collectives
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(71)

    threading.Thread(target=orphaned, name="anneal-tp-orphan", daemon=True).start()
    host, port = os.environ["ANNEAL_TP_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["ANNEAL_TP_KEY"]))
    conn.send(rank)
    args, size, init_method = conn.recv()
    from anneal.engine.llm import Engine  # the engine imports torch: after the connection

    try:
        engine = Engine(args, tp_rank=rank, tp_init=init_method)
    except BaseException as e:  # noqa: BLE001 - said to rank 0, which raises it
        log.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            name, a, kw = msg
            try:
                getattr(engine.runner, name)(*a, **kw)
            except Exception:  # rank 0 made the same call and raised the same error to its caller
                log.warning("rank %d: %s failed:\n%s", rank, name, traceback.format_exc())
    finally:
        engine.close()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("ANNEAL_LOG_LEVEL", "WARNING"))
    worker_main(int(sys.argv[1]))
