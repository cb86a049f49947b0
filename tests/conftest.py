"""Suite-wide set-up, loaded before any test module.

Triton decides between compiled and interpreted kernels when it is first imported, and any test
module may import it (through the engine's op registry). On a machine without a GPU the
interpreter is switched on here, first, so the kernel tests run rather than skip whatever order
pytest collects the files in.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small to split; threads only fight on a loaded CI box. A test
    module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
