"""Triton's interpreter (the CPU kernel tests, the device probes' CPU checks) without its repeated
language walk.

The interpreter (Triton 3.9) patches ``triton.language`` for itself at each kernel launch, and again
at every call of a ``@triton.jit`` helper inside the kernel, although the launch's patch is still in
force: each re-patch walks the language's members (``inspect.getmembers``) and finds nothing left to
patch. Our kernels call helpers in their inner loops (RoPE, norms, split-K merges), so the walk was
~40% of the CPU kernel suite's time (``cProfile`` of one fused-plan generation: 16,708 walks, 43 of
107 s). Here a helper's call skips it when the language its globals see is patched already; a launch
patches and restores as before. What the kernels compute does not change: the walk only ever set
again what was set. Left alone when Triton's internals differ (another version): slower, still
correct.
"""

from __future__ import annotations

import inspect


def patch_language_once_a_launch() -> bool:
    """Install the skip (idempotent); False when this Triton has no such internals."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope is None or not hasattr(tl.core, "is_builtin"):
        return False
    if getattr(original, "once_a_launch", False):
        return True

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope()  # inside a launch: the language is patched, nothing of this call to restore
        return original(fn)

    patch_lang.once_a_launch = True
    interpreter._patch_lang = patch_lang
    return True
