"""The op table: the callables a plan selects, bound as attributes the model calls.

Building a table validates every choice (unknown op, variant or parameter -> OpError) before
anything is swapped, so a bad plan never leaves the engine half-rebound.
"""

from __future__ import annotations

from typing import Callable

from anneal.engine.ops.registry import OpError, all_ops, build_op, get_variant
from anneal.engine.plan import Plan


def _fused(name: str) -> Callable:
    """The kernel behind a plan fusion (GPU only)."""
    from anneal.engine.kernels import gemv

    return {"lm_head_argmax": gemv.lm_head_argmax, "silu_mul_down": gemv.silu_mul_down_proj}[name]


class OpTable:
    # Fused entry points, None unless the plan enables them.
    lm_head_argmax: Callable | None = None
    silu_mul_down: Callable | None = None

    def __init__(self, fns: dict[str, Callable], choices: dict[str, tuple[str, dict]],
                 fusions: dict[str, Callable] | None = None):
        self._fns = fns
        self.choices = choices  # op -> (impl, resolved params)
        for name, fn in fns.items():
            setattr(self, name, fn)
        for name, fn in (fusions or {}).items():
            setattr(self, name, fn)

    @classmethod
    def from_plan(cls, plan: Plan, device: str = "cpu") -> "OpTable":
        fns: dict[str, Callable] = {}
        choices: dict[str, tuple[str, dict]] = {}
        for name in all_ops():
            c = plan.choice(name)
            v = get_variant(name, c.impl)
            if device not in v.devices:
                raise OpError(f"{name}/{c.impl} does not run on {device} (runs on {v.devices})")
            params = v.resolve_params(c.params)
            fns[name] = build_op(name, c.impl, params)
            choices[name] = (c.impl, params)
        fusions = {}
        for name in plan.fusions:
            if device != "cuda":  # (kernel tests call the fused kernels directly instead)
                raise OpError(f"fusion {name!r} needs a CUDA GPU")
            fusions[name] = _fused(name)
        return cls(fns, choices, fusions)

    @classmethod
    def reference(cls) -> "OpTable":
        return cls.from_plan(Plan())
