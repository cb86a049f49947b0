"""The op registry: every op the models call, with a plain-PyTorch reference and any variants.

A *variant* is a named implementation of an op (``impl``) with tunable parameters declared as data.
A plan picks one variant and its parameters per op; ``build_op`` turns that choice into a callable
with exactly the reference's signature. The reference is always there, so verification can always
run the same weights through it.

Search spaces are data: agents read ``Variant.params`` to generate configurations and never edit
source (the LLM kernel writer excepted; its kernels are registered at run time through
``register_variant`` and go through the same gates).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

ParamValue = int | float | str | bool


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``): the "cuda" variants
    then run on CPU tensors (the CPU tests). Here, not beside the kernels, so the torch-free op
    table can ask too."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class OpError(ValueError):
    """An unknown op, unknown variant or invalid parameter in a plan."""


@dataclass(frozen=True)
class Param:
    """A tunable parameter: the values a plan may set, the default, and which of them the search
    proposes (``searched``; all of them unless given): a value whose cost the fast tier's decode
    steps cannot see stays for hand-set plans only."""

    name: str
    choices: tuple[ParamValue, ...]
    default: ParamValue
    searched: tuple[ParamValue, ...] | None = None

    def __post_init__(self) -> None:
        if self.default not in self.choices:
            raise OpError(f"param {self.name}: default {self.default!r} not in {self.choices}")
        if self.searched is not None and (self.default not in self.searched or set(self.searched) - set(self.choices)):
            raise OpError(f"param {self.name}: searched {self.searched} must hold the default and only choices")

    @property
    def search_values(self) -> tuple[ParamValue, ...]:
        return self.choices if self.searched is None else self.searched


@dataclass
class Variant:
    """One implementation of an op. ``build(**params)`` returns a function with the op's signature."""

    op: str
    impl: str
    build: Callable[..., Callable]
    params: tuple[Param, ...] = ()
    # "cuda" variants need a GPU (or TRITON_INTERPRET=1 on the CPU, for tests only).
    devices: tuple[str, ...] = ("cpu", "cuda")
    description: str = ""
    # Whether this variant promises bit-identical outputs to the reference.
    bit_exact: bool = False
    source: str | None = None  # for run-time registered (agent-written) kernels

    def defaults(self) -> dict[str, ParamValue]:
        return {p.name: p.default for p in self.params}

    def resolve_params(self, params: dict[str, Any] | None) -> dict[str, ParamValue]:
        """Defaults overlaid with ``params``; unknown names or values outside the choices are errors."""
        out = self.defaults()
        known = {p.name: p for p in self.params}
        for name, value in (params or {}).items():
            if name not in known:
                raise OpError(
                    f"{self.op}/{self.impl}: unknown param {name!r}; known: {sorted(known)}"
                )
            if value not in known[name].choices:
                raise OpError(
                    f"{self.op}/{self.impl}: param {name}={value!r} not in {known[name].choices}"
                )
            out[name] = value
        return out


@dataclass
class OpDef:
    """An op: its signature (documented), its reference and its registered variants."""

    name: str
    signature: str
    reference: Callable
    variants: dict[str, Variant] = field(default_factory=dict)


REFERENCE = "reference"
_REGISTRY: dict[str, OpDef] = {}


def define_op(name: str, signature: str) -> Callable[[Callable], Callable]:
    """Decorator: define op ``name`` with the decorated function as its reference."""

    def deco(fn: Callable) -> Callable:
        op = OpDef(name=name, signature=signature, reference=fn)
        op.variants[REFERENCE] = Variant(
            op=name, impl=REFERENCE, build=lambda: fn, bit_exact=True,
            description="plain PyTorch reference",
        )
        _REGISTRY[name] = op
        return fn

    return deco


def register_variant(variant: Variant, *, replace: bool = False) -> Variant:
    """Add a variant for an existing op. Agent-written kernels come in through here."""
    op = get_op(variant.op)
    if variant.impl == REFERENCE:
        raise OpError("the reference implementation cannot be replaced")
    if variant.impl in op.variants and not replace:
        raise OpError(f"{variant.op}/{variant.impl} already registered")
    op.variants[variant.impl] = variant
    return variant


def variant(op: str, impl: str, params: tuple[Param, ...] = (), **kw: Any) -> Callable:
    """Decorator form of ``register_variant`` for a builder function ``build(**params) -> fn``."""

    def deco(build: Callable) -> Callable:
        register_variant(Variant(op=op, impl=impl, build=build, params=params, **kw))
        return build

    return deco


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise OpError(f"unknown op {name!r}; known ops: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get_variant(op: str, impl: str) -> Variant:
    od = get_op(op)
    if impl not in od.variants:
        raise OpError(f"op {op!r} has no variant {impl!r}; known: {sorted(od.variants)}")
    return od.variants[impl]


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


def build_op(op: str, impl: str = REFERENCE, params: dict[str, Any] | None = None) -> Callable:
    """The callable for ``op`` implemented by ``impl`` with ``params`` (validated)."""
    v = get_variant(op, impl)
    return v.build(**v.resolve_params(params))


_loaded = False


def _ensure_loaded() -> None:
    """Import the modules that define ops and register variants (once, lazily)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from anneal.engine.ops import reference  # noqa: F401  (defines every op)

    try:
        from anneal.engine import kernels as _k

        load = getattr(_k, "register_all", None)
        if load is not None:
            load()
    except ImportError:  # triton missing: reference only
        pass
