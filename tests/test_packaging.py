"""The distribution's promises: three import packages under `anneal`, the stdlib `operator` never
shadowed, and the torch-free modules (plan, traffic, config, presets, metric names, the CLI's
operator side) importable where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "transformers", "safetensors"):
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def _run(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_stdlib_operator_is_not_shadowed_even_from_the_repo_root():
    out = _run("import anneal.operator, operator, sys\n"
               "print(operator.__file__)\nprint(anneal.operator.__file__)\n"
               "print(operator.itemgetter(1)([0, 7]))")
    assert out.returncode == 0, out.stderr
    stdlib_file, ours, seven = out.stdout.split()
    assert Path(stdlib_file).parent == Path(subprocess.__file__).parent
    assert Path(ours).parent == REPO / "operator"
    assert seven == "7"


def test_the_three_import_packages_map_to_their_folders():
    out = _run("import anneal.engine, anneal.agents, anneal.operator\n"
               "for m in (anneal.engine, anneal.agents, anneal.operator): print(m.__file__)")
    assert out.returncode == 0, out.stderr
    assert [Path(p).parent.name for p in out.stdout.split()] == ["engine", "agents", "operator"]


def test_torch_free_modules_import_without_torch():
    modules = ["anneal.engine.plan", "anneal.engine.config", "anneal.engine.presets",
               "anneal.engine.traffic", "anneal.engine.workload", "anneal.engine.metric_names",
               "anneal.operator.traffic_reader", "anneal.operator.drift"]
    out = _run(NO_TORCH + "\n".join(f"import {m}" for m in modules) +
               "\nfrom anneal.engine.presets import preset_config\n"
               "print(preset_config('llama-3.1-8b').num_params() > 7e9, 'torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_the_blocker_blocks():
    out = _run(NO_TORCH + "import torch")
    assert out.returncode != 0 and "not installed here" in out.stderr


def test_cli_operator_side_works_without_torch():
    out = _run(NO_TORCH + "import sys\nfrom anneal.cli import main\nsys.argv = ['anneal', 'crds']\n"
               "sys.exit(main())")
    assert out.returncode == 0, out.stderr
    assert "kind: CustomResourceDefinition" in out.stdout
    out = _run(NO_TORCH + "import sys\nfrom anneal.cli import main\n"
               "sys.exit(main(['serve', '--model', 'random:tiny']))")
    assert out.returncode == 2 and "unavailable in this installation" in out.stderr
