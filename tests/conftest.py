"""Suite-wide set-up, loaded before any test module.

Triton decides between compiled and interpreted kernels when it is first imported, and any test
module may import it (through the engine's op registry). On a machine without a GPU the
interpreter is switched on here, first, so the kernel tests run rather than skip whatever order
pytest collects the files in.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
