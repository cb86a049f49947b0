"""Where Triton keeps the kernels it compiles, and a check at start that it can write there.

Why: Triton creates its cache folder and writes every kernel it compiles into it. A folder it cannot
write (a read-only kernel-cache volume, one mounted without the pod's group, a path under a file)
fails the warm-up's first kernel compile with a traceback, and a pod restarts into the same failure.
Checked once before the engine is built, such a folder costs only the cache: the engine compiles
into a folder of its own and says why.
"""

from __future__ import annotations

import logging
import os
import tempfile

log = logging.getLogger("anneal.kernel_cache")


def cache_dir() -> str:
    """Triton's cache folder for this process: TRITON_CACHE_DIR, else Triton's default."""
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


def ensure_writable() -> str:
    """The cache folder this process will compile into: Triton's own when it can be written, else a
    fresh temporary one (TRITON_CACHE_DIR is set to it, so child processes compile there too)."""
    folder = cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".anneal-write-check-"):
            pass
        return folder
    except OSError as e:
        fallback = tempfile.mkdtemp(prefix="anneal-triton-")
        os.environ["TRITON_CACHE_DIR"] = fallback
        log.warning(
            "Triton kernel cache %s cannot be written (%s: %s); compiling into %s instead, which "
            "this process's next start will not find", folder, type(e).__name__, e, fallback,
        )
        return fallback
