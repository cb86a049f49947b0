"""An LLM agent that writes a new kernel for an op, from its reference, past failures and timings.

Why: the registry's variants cover what people wrote by hand; an LLM can try fusions and tilings
nobody declared. Its output is untrusted: each source goes through ``POST /admin/kernels`` (compiled
and checked against the reference in isolation), then is timed like any candidate and must pass the
same verification before it is served. A rejection's reason goes back into the next prompt.

Enabled only when an API key is set: ``ANTHROPIC_API_KEY``, or a file named by
``ANTHROPIC_API_KEY_FILE`` (a mounted Secret). ``ANTHROPIC_BASE_URL`` is honoured by the SDK.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anneal.engine.plan import KernelSource, OpChoice
from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate

DEFAULT_MODEL = os.environ.get("ANNEAL_LLM_MODEL", "claude-sonnet-5-5")
# Where a Kubernetes Secret with the key is mounted when ANTHROPIC_API_KEY_FILE is not given.
DEFAULT_KEY_FILE = "/var/run/secrets/anneal/anthropic/api-key"

SYSTEM = """You write GPU kernels for an LLM inference engine. Reply with exactly one Python code
block. The module must define `build(**params)` returning a function with exactly the reference
op's signature and semantics (same output shapes, dtypes and values within floating-point
tolerance), for any valid input shape. Prefer Triton (`import triton`, `import triton.language as
tl`) with a small Python wrapper: check shapes, allocate outputs, launch. Do not cache outputs
between calls, do not launch work on other streams, do not read uninitialised memory."""


def api_key(env: dict[str, str] | None = None) -> str | None:
    """The Anthropic API key from the environment or a mounted Secret file; None when absent."""
    env = os.environ if env is None else env
    key = env.get("ANTHROPIC_API_KEY", "").strip()
    if key:
        return key
    path = env.get("ANTHROPIC_API_KEY_FILE") or DEFAULT_KEY_FILE
    try:
        key = Path(path).read_text().strip()
    except OSError:
        return None
    return key or None


def reference_source(op: str) -> tuple[str, str]:
    """(signature, source) of the op's reference implementation (needs the engine package)."""
    import inspect

    from anneal.engine.ops.registry import get_op

    od = get_op(op)
    return od.signature, inspect.getsource(od.reference)


_CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str | None:
    """The first fenced code block (or the whole reply when it already looks like a module)."""
    m = _CODE.search(text)
    if m:
        return m.group(1).strip() + "\n"
    return text.strip() + "\n" if "def build" in text else None


@dataclass
class Attempt:
    op: str
    impl: str
    ok: bool
    stage: str
    error: str | None
    ms: float | None = None


class LLMKernelWriter:
    """Writes kernels for the ops with the largest share of step time, a few attempts each."""

    name = "llm-writer"

    def __init__(
        self, key: str, model: str = DEFAULT_MODEL, ops: list[str] | None = None,
        attempts_per_op: int = 3, max_ops: int = 2, base_url: str | None = None,
        max_tokens: int = 4096, verify_first: bool = True,
    ):
        import anthropic

        self.client = anthropic.Anthropic(api_key=key, base_url=base_url, max_retries=1, timeout=300)
        self.model = model
        self.ops = ops
        self.attempts_per_op = attempts_per_op
        self.max_ops = max_ops
        self.max_tokens = max_tokens
        self.verify_first = verify_first
        self.target = ""  # device, dtype and shapes, filled in from the engine at run time
        self.attempts: list[Attempt] = []

    def pick_ops(self, lab: Lab, setting: SearchSetting) -> list[str]:
        """Explicit ops, else the ones with the largest predicted share of the decode step."""
        if self.ops:
            return list(self.ops)
        if lab.cost_model is None:
            return ["silu_and_mul"]
        pred = lab.cost_model.predict(setting.base, setting.decode_spec)
        ranked = sorted(pred.per_op_ms, key=pred.per_op_ms.get, reverse=True)
        return [op for op in ranked if op in setting.space.ops][: self.max_ops]

    def prompt(self, op: str, history: list[Attempt], timing: str, target: str = "") -> str:
        signature, source = reference_source(op)
        parts = [
            f"Op `{op}`; signature: {signature}",
            *([f"Target: {target}"] if target else []),
            f"Reference implementation (plain PyTorch; yours must compute the same):\n```python\n{source}```",
            f"Timing: {timing}",
        ]
        if history:
            lines = [f"- {a.impl}: {'passed' if a.ok else 'REJECTED at ' + a.stage}: "
                     f"{a.error or ''} {f'({a.ms:.3f} ms)' if a.ms else ''}" for a in history]
            parts.append("Your previous attempts and what the engine's checks said:\n" + "\n".join(lines))
        parts.append("Write a faster implementation. Reply with one ```python block defining build(**params).")
        return "\n\n".join(parts)

    def ask(self, prompt: str) -> str:
        msg = self.client.messages.create(
            model=self.model, max_tokens=self.max_tokens, system=SYSTEM,
            messages=[{"role": "user", "content": prompt}],
        )
        return "".join(getattr(b, "text", "") for b in msg.content)

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        if not self.target:
            try:
                st = lab.engines["fast"].state()
                cfg = st.config or {}
                self.target = (f"{st.gpu_name or st.device}, dtype {st.dtype}, model {st.model} (hidden "
                               f"{cfg.get('hidden_size')}, heads {cfg.get('num_attention_heads')}/"
                               f"{cfg.get('num_key_value_heads')} q/kv, head_dim {cfg.get('head_dim')}); "
                               f"decode batch ~{setting.decode_spec.batch_size}, context "
                               f"~{setting.decode_spec.context_len}")
            except Exception:  # noqa: BLE001 - the prompt is still useful without it
                self.target = ""
        try:
            for op in self.pick_ops(lab, setting):
                self.write_for(op, lab, setting, board)
        except BudgetExhausted:
            return

    def write_for(self, op: str, lab: Lab, setting: SearchSetting, board: Board) -> None:
        history: list[Attempt] = []
        base_ms, _ = lab.best(setting.decode_spec)
        timing = (f"the current plan's decode step takes {base_ms:.3f} ms at batch "
                  f"{setting.decode_spec.batch_size}" if base_ms < float("inf") else "not measured yet")
        for i in range(self.attempts_per_op):
            lab.check_budget()
            impl = f"llm_{op}_{i}"
            try:
                reply = self.ask(self.prompt(op, history, timing, self.target))
            except Exception as e:  # network/API errors end this agent, not the compile
                board.note(f"llm-writer: API call failed for {op}: {e}")
                return
            source = extract_code(reply)
            if source is None:
                history.append(Attempt(op, impl, False, "parse", "the reply had no code block"))
                continue
            res, _ = lab.register_kernel(self.name, op, impl, source, {}, note=f"attempt {i}")
            if not res.ok:
                history.append(Attempt(op, impl, False, res.stage, res.error))
                continue
            kernel = KernelSource(op=op, impl=impl, source=source)
            plan = setting.base.with_ops(**{op: OpChoice(impl=impl)})
            plan = plan.model_copy(update={"kernels": [*plan.kernels, kernel], "name": None})
            if self.verify_first:
                # The full gates on the fast tier before any timing: a kernel that is only right in
                # isolation (stale cache blocks, batch-dependent, nondeterministic) goes back to the
                # model with the failing checks, instead of winning a race it should not be in.
                rep, _ = lab.verify(Candidate(plan=plan, agent=self.name, note=f"{op}={impl}"), "fast")
                if not rep.passed:
                    history.append(Attempt(op, impl, False, "verify", rep.reason()))
                    continue
            exp = lab.measure(Candidate(plan=plan, agent=self.name, note=f"{op}={impl}"), setting.decode_spec)
            ms = exp.measurement.median_ms if exp.measurement else None
            history.append(Attempt(op, impl, exp.verdict.status == "measured", exp.verdict.status,
                                   exp.verdict.reason or None, ms))
            if ms is not None and exp.verdict.status == "measured":
                board.offer_plan(ms, plan, self.name)
                op_ms = (exp.measurement.per_op_ms or {}).get(op, ms)
                board.offer_op(op, OpChoice(impl=impl), op_ms, kernel)
                board.note(f"llm-writer: {impl} registered, {ms:.3f} ms per decode step")
        self.attempts.extend(history)


def maybe_writer(**kw: Any) -> LLMKernelWriter | None:
    """The writer when a key is configured, else None (the compile runs without it)."""
    key = api_key()
    return LLMKernelWriter(key, **kw) if key else None
