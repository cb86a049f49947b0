"""The experiment ledger: one SQLite row per finished experiment, so a crashed compile resumes.

Rows are committed as each experiment finishes (WAL journal, so a reader — the report, a second
agent thread — never blocks the writer and a killed process loses at most the experiment in
flight). ``lookup(key)`` answers "was this already measured?": a resumed run takes the old result
instead of spending engine time again. Thread-safe: agents run concurrently and share one ledger.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator

from anneal.engine.plan import Plan
from anneal.agents.types import (
    BenchSpec, Experiment, Measurement, Prediction, Verdict,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    key TEXT NOT NULL,
    plan_hash TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    tier TEXT NOT NULL,
    kind TEXT NOT NULL,
    agent TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT '',
    spec_json TEXT,
    predicted_ms REAL,
    prediction_json TEXT,
    median_ms REAL,
    spread REAL,
    measurement_json TEXT,
    verdict TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    detail_json TEXT NOT NULL DEFAULT '{}',
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS experiments_key ON experiments(key);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Ledger:
    """An append-only experiment log in SQLite."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writing -------------------------------------------------------------------------------

    def record(self, exp: Experiment) -> Experiment:
        """Commit one finished experiment; returns it with its row id."""
        m = exp.measurement
        row = (
            exp.run_id, exp.key, exp.plan_hash, exp.plan.model_dump_json(), exp.tier, exp.kind,
            exp.agent, exp.note, exp.spec.model_dump_json() if exp.spec else None,
            exp.prediction.ms if exp.prediction else None,
            exp.prediction.model_dump_json() if exp.prediction else None,
            m.median_ms if m else None, m.spread if m else None,
            m.model_dump_json() if m else None,
            exp.verdict.status, exp.verdict.reason, json.dumps(exp.detail, default=str),
            exp.started_at or time.time(), exp.finished_at or time.time(),
        )
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO experiments (run_id, key, plan_hash, plan_json, tier, kind, agent, note,"
                " spec_json, predicted_ms, prediction_json, median_ms, spread, measurement_json,"
                " verdict, reason, detail_json, started_at, finished_at)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                row,
            )
            rid = cur.lastrowid
        return exp.model_copy(update={"id": rid})

    def set_meta(self, name: str, value: object) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", (name, json.dumps(value))
            )

    def get_meta(self, name: str, default: object = None) -> object:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return json.loads(row[0]) if row else default

    # ---- copies --------------------------------------------------------------------------------

    def snapshot(self, max_bytes: int | None = None, keep: str = "") -> tuple[bytes, int]:
        """The whole ledger as one gzipped SQLite file, consistent at one moment (what a restarted
        process resumes from), and how many rows were left out of it. Over ``max_bytes`` the oldest
        rows go first, never those whose reason starts with ``keep`` nor a run's last one (its
        budget spent is read from it)."""
        with self._lock:
            raw = bytearray(self._db.serialize())
        raw[18:20] = b"\x01\x01"  # a rollback-journal image: SQLite opens a WAL one only from a file
        raw = bytes(raw)
        data = gzip.compress(raw, 6)
        if max_bytes is None or len(data) <= max_bytes:
            return data, 0
        copy = sqlite3.connect(":memory:")
        copy.deserialize(raw)
        spare = ("SELECT id FROM experiments WHERE NOT (? != '' AND reason LIKE ? || '%')"
                 " AND id NOT IN (SELECT MAX(id) FROM experiments GROUP BY run_id) ORDER BY id")
        dropped = 0
        while len(data) > max_bytes:
            ids = [r[0] for r in copy.execute(spare, (keep, keep)).fetchall()]
            if not ids:
                break
            cut = ids[: max(1, len(ids) // 2)]
            copy.executemany("DELETE FROM experiments WHERE id = ?", [(i,) for i in cut])
            copy.commit()
            copy.execute("VACUUM")
            dropped += len(cut)
            data = gzip.compress(copy.serialize(), 6)
        copy.close()
        return data, dropped

    # ---- reading -------------------------------------------------------------------------------

    def lookup(self, key: str) -> Experiment | None:
        """The latest finished experiment with this key, if any (what a resumed run reuses)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLS} FROM experiments WHERE key = ? ORDER BY id DESC LIMIT 1", (key,)
            ).fetchone()
        return _from_row(row) if row else None

    def last_finished(self) -> dict[str, float]:
        """Each run's latest ``finished_at``, by run id (how far a run got: what resuming counts)."""
        with self._lock:
            rows = self._db.execute("SELECT run_id, MAX(finished_at) FROM experiments GROUP BY run_id").fetchall()
        return {run: finished for run, finished in rows}

    def experiments(self, *, kind: str | None = None, tier: str | None = None) -> list[Experiment]:
        q, args = f"SELECT {_COLS} FROM experiments", []
        where = []
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if tier:
            where.append("tier = ?")
            args.append(tier)
        if where:
            q += " WHERE " + " AND ".join(where)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        return [_from_row(r) for r in rows]

    def __iter__(self) -> Iterator[Experiment]:
        return iter(self.experiments())

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]


_COLS = (
    "id, run_id, key, plan_hash, plan_json, tier, kind, agent, note, spec_json, prediction_json,"
    " measurement_json, verdict, reason, detail_json, started_at, finished_at"
)


def _from_row(r: tuple) -> Experiment:
    (rid, run_id, key, plan_hash, plan_json, tier, kind, agent, note, spec_json, pred_json,
     meas_json, verdict, reason, detail_json, started, finished) = r
    return Experiment(
        id=rid, run_id=run_id, key=key, plan=Plan.model_validate_json(plan_json),
        plan_hash=plan_hash, tier=tier, kind=kind, agent=agent, note=note,
        spec=BenchSpec.model_validate_json(spec_json) if spec_json else None,
        prediction=Prediction.model_validate_json(pred_json) if pred_json else None,
        measurement=Measurement.model_validate_json(meas_json) if meas_json else None,
        verdict=Verdict(status=verdict, reason=reason), detail=json.loads(detail_json),
        started_at=started, finished_at=finished,
    )


def experiment_key(plan_hash: str, tier: str, kind: str, spec: BenchSpec | None = None) -> str:
    """The identity of an experiment: the same plan measured the same way on the same tier."""
    return f"{kind}|{tier}|{plan_hash}|{spec.key() if spec else '-'}"


def restore(path: str | Path, snapshot: bytes) -> None:
    """Write a :meth:`Ledger.snapshot` to ``path`` (a ledger not opened yet), replacing what is there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for extra in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        extra.unlink(missing_ok=True)
    tmp = path.with_name(path.name + ".restoring")
    tmp.write_bytes(gzip.decompress(snapshot))
    tmp.replace(path)
