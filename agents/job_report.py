"""Progress, ledger and result hand-over to the CompilationJob (`--report-to NAMESPACE/NAME`).

Why separate: the operator package is optional for a local compile; these are the only calls
into it, and a status or ledger write that fails must never end a search (the result hand-over
must).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from anneal.agents import ledger as ledger_file
from anneal.agents.lab import DIED
from anneal.engine.plan import CompiledPlan


def publish_result(target: str | None, compiled: CompiledPlan) -> None:
    """Hand the CompiledPlan to the CompilationJob's result ConfigMap (raises: the job needs it)."""
    if not target:
        return
    from anneal.operator import progress  # noqa: PLC0415

    ns, name = progress.parse_report_to(target)
    progress.publish_result(ns, name, compiled)


def report_progress(target: str | None, **fields: Any) -> None:
    """Progress into the CompilationJob's status, when asked and the operator package provides it."""
    if not target:
        return
    try:
        from anneal.operator import progress  # noqa: PLC0415
    except ImportError:
        return
    ns, _, name = target.partition("/")
    fn = getattr(progress, "report", None)
    if fn is None or not name:
        return
    try:
        fn(ns, name, **fields)
    except Exception as e:  # noqa: BLE001 - a status write must not end the compile
        print(f"anneal compile: progress report to {target} failed: {e}", file=sys.stderr)


def restore_ledger(target: str | None, path: Path) -> int | None:
    """Before a ledger is opened at ``path``: the one an earlier coordinator of this job saved, so a
    restarted search resumes. Returns its size in bytes, or None when there was none to take (or a
    ledger is already here: a local rerun with the same --out resumes from that)."""
    if not target or path.exists():
        return None
    from anneal.operator import progress  # noqa: PLC0415

    ns, name = progress.parse_report_to(target)
    try:
        saved = progress.load_ledger(ns, name)
        if saved:
            ledger_file.restore(path, saved)
    except Exception as e:  # noqa: BLE001 - a fresh search beats no search
        path.unlink(missing_ok=True)
        print(f"anneal compile: no ledger from {target} ({type(e).__name__}: {e}); starting a fresh one", file=sys.stderr)
        return None
    return len(saved) if saved else None


class LedgerCheckpoints:
    """Saves the ledger into the CompilationJob's ledger ConfigMap every ``every_s`` while rows come
    in, and once more on ``close`` (also after a failure: what the next coordinator resumes from)."""

    def __init__(self, target: str, ledger: ledger_file.Ledger, every_s: float = 30.0):
        from anneal.operator import progress  # noqa: PLC0415

        self.ns, self.name = progress.parse_report_to(target)
        self.target, self.ledger, self.every_s = target, ledger, every_s
        self._saved_rows = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-checkpoints", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.save()

    def save(self) -> bool:
        """One checkpoint, if rows were added since the last; False when it could not be written."""
        from anneal.operator import progress  # noqa: PLC0415

        rows = len(self.ledger)
        if rows == self._saved_rows:
            return True
        try:
            # the rows that killed an engine are the last to go: a resumed search must not run them again
            data, dropped = self.ledger.snapshot(progress.LEDGER_MAX_BYTES, keep=DIED)
            progress.save_ledger(self.ns, self.name, data)
        except Exception as e:  # noqa: BLE001 - a checkpoint that fails must not end the search
            print(f"anneal compile: ledger checkpoint to {self.target} failed: {e}", file=sys.stderr)
            return False
        if dropped:
            print(f"anneal compile: the ledger checkpoint left out its {dropped} oldest rows (a ConfigMap holds "
                  f"{progress.LEDGER_MAX_BYTES} bytes)", file=sys.stderr)
        self._saved_rows = rows
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.save()
