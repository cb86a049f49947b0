"""Where the control-plane binaries are: built (once) by `e2e/cluster/build` into a version-keyed cache."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "build"
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm", "kwok")


def ensure_binaries(quiet: bool = False) -> Path:
    """Run the build script (seconds when cached) and return the directory holding the binaries.

    Set ANNEAL_K8S_BIN to a directory that already holds them to skip the build script entirely.
    """
    preset = os.environ.get("ANNEAL_K8S_BIN")
    if preset and all((Path(preset) / n).is_file() for n in NAMES):
        return Path(preset)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL if quiet else None, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}); run it by hand to see why")
    bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    missing = [n for n in NAMES if not (bin_dir / n).is_file()]
    if missing:
        raise RuntimeError(f"{BUILD_SCRIPT} finished but {bin_dir} lacks {missing}")
    if not quiet and time.monotonic() - t0 > 5:
        print(f"control-plane binaries ready in {time.monotonic() - t0:.0f} s: {bin_dir}")
    return bin_dir
