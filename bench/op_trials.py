#!/usr/bin/env python
"""Do the fast tier's op trials see what the whole model's replays saw? A check of
``agents/op_trials.py`` on one engine, without a whole compile.

Session 27 replayed session 26's tuned ops one at a time on the hand-set best plan (8B, chat, two
rounds, `bench/results/plans-s27-tuned-ops-*.json`): decode steps +2.1 / +2.7% with its decode
attention (ticket merge, 2 stages, prefetch 2), +0.9 / +2.1% with its Triton gate_up (up to 8 rows),
+0.1 / +0.4% with its qkv GEMV (1 row). The compiler now times each tuned op alone on a 2-layer
engine's decode step (B T B at the typical batch and in the drain below it) and on a prompt step
(session 56), and keeps it only when those steps, projected to the whole model and weighed by a
replay's share of each, are faster. This starts such an engine on ``--base``, puts
the ops where ``--tuned`` differs from it on a board as the kernel tuner would, runs the trials
``--repeats`` times on fresh seeds, and writes each reading.
Prediction: attention and gate_up dropped (x1.01-1.03 on the whole model), qkv within ±0.5%.

    python bench/op_trials.py                      # CUDA, the 8B on 2 layers; JSON to bench/results/
    python bench/op_trials.py --model random:tiny --device cpu --tuned P   # the mechanics only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from anneal.engine.plan import OP_NAMES, load_plan
from anneal.engine.traffic import load_traffic
from anneal.agents.board import Board
from anneal.agents.cost_model import CostModel
from anneal.agents.lab import Lab
from anneal.agents.ledger import Ledger
from anneal.agents.local_engines import LocalEngines
from anneal.agents.op_trials import OP_TRIAL_SEED, op_trials
from anneal.agents.setting import CPU_MAX_LEN, make_setting
from anneal.agents.types import Candidate

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2, help="the fast tier's layers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--base", default=str(HERE / "plans/triton-overlap-token-graphs-folded-ropeattn.json"))
    ap.add_argument("--tuned", default=str(HERE / "plans/chat-s26-composite-fusions-first.json"),
                    help="a plan whose op choices, where they differ from --base, are the tuned ops")
    ap.add_argument("--traffic", default="chat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    base, tuned = (load_plan(Path(p).read_text()) for p in (args.base, args.tuned))
    ops = [op for op in OP_NAMES if tuned.choice(op) != base.choice(op)]
    if not ops:
        print(f"{args.tuned} chooses every op as {args.base} does: nothing to try", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="op-trials-"))
    engines = LocalEngines(args.model, work, fast_layers=None, device=args.device, plan=args.base,
                           extra_args=["--layers", str(args.layers)])
    client = engines.start()["slow"]  # one engine, started as the only tier, on --layers
    ledger = Ledger(work / "ledger.sqlite")
    try:
        state = client.state()
        quick = args.device == "cpu"
        engine_max = int((state.model_extra or {}).get("max_model_len") or 1 << 30)
        setting, _ = make_setting(state, load_traffic(args.traffic), seed=0, quick=quick,
                                  max_len=min(CPU_MAX_LEN if quick else engine_max, engine_max))
        lab = Lab(ledger=ledger, engines={"fast": client}, cost_model=CostModel.from_state(state), base=setting.base)
        lab.warm_up(setting.decode_spec)
        # one per-op reading of the base: the once-a-step part the projection takes
        lab.measure(Candidate(plan=setting.base, agent="probe", note="the base, op by op"), setting.decode_spec)
        repeats = []
        for r in range(args.repeats):
            board = Board()
            for op in ops:
                board.offer_op(op, tuned.choice(op), 0.0)
            op_trials(lab, setting, board, seed=OP_TRIAL_SEED + 1000 * r)
            repeats.append({"notes": board.notes, "kept": sorted(board.best_ops)})
            for note in board.notes:
                print(f"repeat {r}: {note}", file=sys.stderr, flush=True)
        trials = [{"note": e.note, "batch": e.spec.batch_size, "seed": e.spec.seed,
                   "median_ms": e.measurement.median_ms if e.measurement else None}
                  for e in ledger.experiments() if e.note.startswith("op tria")]
    finally:
        engines.stop()
        client.close()
        ledger.close()
    data = {"model": args.model, "layers": args.layers, "device": args.device, "base": args.base,
            "tuned": args.tuned, "ops": ops, "typical_batch": setting.decode_spec.batch_size,
            "repeats": repeats, "trials": trials}
    if args.device == "cpu":  # the mechanics only: nothing worth keeping
        print(json.dumps({"ops": ops, "kept": [r["kept"] for r in repeats], "trials": len(trials)}))
        return 0
    from common import write_result

    print(json.dumps({"wrote": str(write_result("op-trials", data, Path(args.out) if args.out else None))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
