"""bench/train_small.py and bench/trained_checks.py: a checkpoint trained here loads like any Hugging Face
folder, its training resumes where it stopped, and the checks run on it (CPU, a micro model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"
pytestmark = pytest.mark.slow


def _run(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("stdlib")
    for name in ("bisect.py", "colorsys.py", "keyword.py", "heapq.py", "fnmatch.py", "textwrap.py", "shlex.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, corpus / name)
    out = tmp_path_factory.mktemp("ckpt")
    common = ["--out", str(out), "--stdlib", str(corpus), "--vocab", "400", "--hidden", "128", "--layers", "1",
              "--seq-len", "64", "--batch", "8", "--lr", "1e-2", "--prompts", "4", "--prompt-len", "24"]
    _run(str(BENCH / "train_small.py"), *common, "--steps", "40", "--save-every", "20")
    first = json.loads((out / "training.json").read_text())
    _run(str(BENCH / "train_small.py"), *common, "--steps", "50", "--save-every", "20")
    return out, first


def test_training_lowers_the_loss_and_resumes_where_it_stopped(checkpoint):
    out, first = checkpoint
    t = json.loads((out / "training.json").read_text())
    assert first["step"] == 40 and t["step"] == 50
    assert t["losses"][:40] == first["losses"]  # the second run went on from step 40, not from scratch
    assert sum(t["losses"][-5:]) / 5 < t["losses"][0] - 1.0  # it learned something
    held = json.loads((out / "heldout.json").read_text())["prompts"]
    assert len(held) == 4 and all(len(p) == 24 for p in held)


def test_the_engine_loads_the_checkpoint_and_decodes_as_transformers_does(checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.sampling_params import SamplingParams

    out, _ = checkpoint
    prompts = json.loads((out / "heldout.json").read_text())["prompts"][:2]
    engine = Engine(EngineArgs(model=str(out), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16))
    ours = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # as ignore_eos: an EOS argmax is taken, not stopped at
    for p, got in zip(prompts, ours):
        want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):]
        assert got == want.tolist()


def test_trained_checks_report_identity_margins_and_the_drafter(checkpoint, tmp_path):
    out, _ = checkpoint
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps({"name": "overlap", "scheduler": {"overlap": True}}))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "spec", "scheduler": {"speculative_tokens": 4}}))
    _run(str(BENCH / "trained_checks.py"), "--models", str(out), "--plans", f"reference,{overlap},{spec}", "--steps", "10",
         "--num-prompts", "3", "--device", "cpu", "--dtype", "float32", "--name", "t", "--out", str(tmp_path))
    (model,) = json.loads(next(tmp_path.glob("t-*.json")).read_text())["models"]
    ov = model["plans"]["overlap"]
    assert ov["identical"] == 3 and ov["first_divergence"] == [None] * 3  # a scheduler knob: the same tokens
    assert ov["steps"] > 0 and ov["tokens_per_s"] > 0 and ov["speculative_steps"] == 0
    sp = model["plans"]["spec"]  # the knob reached the engine: it looked for drafts and counted them
    assert sp["hash"] != ov["hash"] and sp["accepted_tokens"] <= sp["drafted_tokens"]
    assert model["training"]["step"] == 50
    assert 0 < model["reference_margin"]["median"]
    assert model["drafter"]["k4"]["verify_steps"] > 0
