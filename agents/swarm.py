"""Runs the proposer agents concurrently against the fast tier until the search budget is spent.

Why threads: agents spend their time waiting on the engine's HTTP answers; the lab queues their
measurements per engine, so concurrency buys overlap of thinking (LLM calls, cost model) with
measuring, never two timings at once on one engine. An agent that crashes is reported and the
others go on: one broken proposer must not lose the compile. Interrupted (SIGTERM, Ctrl-C), the
search stops at once: the lab records nothing more, and the agents' threads are daemons, so a
measurement still in flight neither delays the exit nor lands in the ledger half-judged.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable, Protocol

from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab


class Agent(Protocol):
    name: str

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None: ...


def run_swarm(
    agents: list[Agent], lab: Lab, setting: SearchSetting, board: Board,
    tick: Callable[[], None] | None = None, tick_s: float = 0.5,
) -> dict[str, str]:
    """Run every agent to completion or budget; returns agent name -> "done" | "budget" | error."""
    results: dict[str, str] = {}
    lock = threading.Lock()

    def one(agent: Agent) -> None:
        try:
            agent.run(lab, setting, board)
            outcome = "done" if lab.time_left() > 0 else "budget"
        except BudgetExhausted:
            outcome = "budget"
        except Exception as e:  # noqa: BLE001 - reported, the other agents continue
            outcome = f"error: {type(e).__name__}: {e}"
            board.note(f"{agent.name} crashed: {e}\n{traceback.format_exc(limit=3)}")
        with lock:
            results[agent.name] = outcome

    threads = [threading.Thread(target=one, args=(a,), name=f"agent-{a.name}", daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            if tick:
                tick()
            time.sleep(tick_s)
    except BaseException:
        lab.stop()  # interrupted: nothing more is measured or recorded
        raise
    if tick:
        tick()
    return results


def summary(results: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(results.items()))
