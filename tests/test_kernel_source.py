"""Run-time kernels' source files: one folder per process, gone when the process exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_admin import SILU_CRASH, SILU_HANG

CHILD = r'''
import json, linecache
from anneal.engine.kernel_source import load_module, source_dir
from anneal.engine.plan import KernelSource

a = load_module(KernelSource(op="silu_and_mul", impl="agent-v1", source="def build():\n    return 1\n"))
b = load_module(KernelSource(op="silu_and_mul", impl="agent-v1", source="def build():\n    return 2\n"))
print(json.dumps({"dir": str(source_dir()), "files": sorted(p.name for p in source_dir().iterdir()),
                  "a": a.build(), "b": b.build(),
                  "a_line": linecache.getline(a.__file__, 2).strip()}))
'''


def test_kernel_sources_share_one_folder_that_goes_with_the_process():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert (seen["a"], seen["b"]) == (1, 2)
    # Two sources for one op and impl: two files, the first's traceback lines still its own.
    assert len(seen["files"]) == 2 and all(f.startswith("silu_and_mul_agent_v1_") for f in seen["files"])
    assert seen["a_line"] == "return 1"
    assert not Path(seen["dir"]).exists(), "the process left its kernel sources behind"


def test_a_checker_child_that_dies_or_hangs_leaves_no_source_behind(tmp_path, monkeypatch):
    """A crashing kernel (os._exit skips atexit) and a hanging one (killed at the time limit): the
    child writes under a folder the parent removes, so neither leaves its source in the temp dir."""
    import tempfile

    from anneal.engine.kernel_source import check_in_subprocess
    from anneal.engine.plan import KernelSource
    from anneal.engine.presets import preset_config

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    cfg = preset_config("tiny").model_dump(mode="json")
    crash = KernelSource(op="silu_and_mul", impl="crash", source=SILU_CRASH)
    hang = KernelSource(op="silu_and_mul", impl="hang", source=SILU_HANG)
    crashed = check_in_subprocess(crash, cfg, "cpu", "float32", timeout_s=60)
    assert crashed.stage == "crash" and "exited with 7" in crashed.error, crashed
    assert check_in_subprocess(hang, cfg, "cpu", "float32", timeout_s=8).stage == "timeout"
    assert list(tmp_path.iterdir()) == []
