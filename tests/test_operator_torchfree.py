"""The operator image has no torch: every operator module must import with torch refused."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name in ("triton", "transformers"):
            raise ImportError(f"{name} is not available in the operator image")
        return None
sys.meta_path.insert(0, _NoTorch())
"""

MODULES = [
    "anneal.operator",
    "anneal.operator.api",
    "anneal.operator.crdgen",
    "anneal.operator.main",
    "anneal.operator.progress",
    "anneal.operator.deployment_handlers",
    "anneal.operator.compilation_handlers",
]


def test_operator_imports_without_torch():
    code = BLOCKER + "\n".join(f"import {m}" for m in MODULES) + "\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_blocker_really_blocks():
    out = subprocess.run([sys.executable, "-c", BLOCKER + "import torch"], capture_output=True, text=True)
    assert out.returncode != 0 and "not available in the operator image" in out.stderr


def test_operator_registry_builds_without_a_cluster():
    code = BLOCKER + (
        "from anneal.operator.main import build_registry\n"
        "from anneal.operator.context import Context\n"
        "from anneal.operator.settings import OperatorSettings\n"
        "r = build_registry(Context(OperatorSettings()))\n"
        "print(sorted({h.id for h in r._changing.get_all_handlers()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "apply_inference_deployment" in out.stdout and "start_compilation_job" in out.stdout
