"""Compile-ahead's child processes: they compile what the engine's thread recorded into Triton's
disk cache, where the engine process then finds it; what they cannot build comes back as an error."""

from __future__ import annotations

import json
import textwrap
import threading
import time
import types

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from anneal.engine import compile_children  # noqa: E402
from anneal.engine.compile_ahead import CompileAhead  # noqa: E402
from anneal.engine.compile_children import CompileChildren, KernelSpec, recording_launches  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)

SOURCE = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def scale(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i, mask=m)
        if PRECISION == "bf16":  # a string constexpr that is also a dtype's name
            x = x.to(tl.bfloat16).to(tl.float32)
        tl.store(y_ptr + i, x * alpha, mask=m)
''')


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A run-time kernel module (as an agent's kernel is: a file no import finds) and a fresh cache;
    compiled, not interpreted (the children inherit the environment)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tmp_path / "scale_kernel.py"
    path.write_text(SOURCE)
    mod = types.ModuleType("anneal_test_scale_kernel")
    mod.__file__ = str(path)
    exec(compile(SOURCE, str(path), "exec"), mod.__dict__)
    return mod.scale, str(path)


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr",
             "PRECISION": "constexpr"}
ATTRS = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}


def _source(fn, block: int) -> ASTSource:
    return ASTSource(fn, SIGNATURE, {(4,): block, (5,): "bf16"}, ATTRS)


def _spec(fn, path, block: int, source_key: str | None = None) -> KernelSpec:
    """As the engine's hook records it: Triton's JSON (identity and options) and its own objects."""
    data = {"name": "scale", "signature": SIGNATURE, "constant_keys": [[4], [5]], "constant_vals": [block, "bf16"],
            "attrs_keys": [[0], [1]], "attrs_vals": list(ATTRS.values()), "options": {"num_warps": 4},
            "key": "test"}
    return KernelSpec(module="anneal_test_scale_kernel", qualname="scale", module_file=path,
                      source_key=source_key or fn.cache_key, specialization=json.dumps(data),
                      signature=SIGNATURE, constants={(4,): block, (5,): "bf16"}, attrs=ATTRS)


@pytest.fixture
def children():
    pool = CompileChildren(1)
    pool.start()
    assert pool.wait_ready(120), pool.start_error
    yield pool
    pool.close()


def test_a_child_compiles_what_the_engine_process_then_finds_on_disk(kernel, children):
    fn, path = kernel
    report = children.collect(children.submit([_spec(fn, path, 128), _spec(fn, path, 128), _spec(fn, path, 256)],
                                               HOPPER))
    assert report["kernels"] == 2 and not report["errors"]  # duplicates compile once
    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        for block in (128, 256):  # as the engine's JIT would: a string constant stays a string
            triton.compile(_source(fn, block), target=HOPPER, options={"num_warps": 4})
    finally:
        triton.knobs.compilation.listener = None
    assert hits == [True, True], "the engine process compiled again what a child had compiled"


def test_a_kernel_the_child_cannot_build_comes_back_as_an_error(kernel, children):
    fn, path = kernel
    stale = _spec(fn, path, 128, source_key="not-this-source")
    missing = KernelSpec(module="anneal_no_such_module", qualname="k", module_file=None, source_key="x",
                         specialization="{}")
    report = children.collect(children.submit([stale, missing, _spec(fn, path, 64)], HOPPER))
    assert report["kernels"] == 1
    assert len(report["errors"]) == 2
    assert "source differs" in report["errors"][0] and "ModuleNotFoundError" in report["errors"][1]


def test_each_child_warms_its_compiler_for_the_target_at_start(tmp_path, monkeypatch):
    """A process's first Triton compile is the slow one: each child pays it before it is ready."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = CompileChildren(1, target=HOPPER)
    pool.start()
    try:
        assert pool.wait_ready(120), pool.start_error
    finally:
        pool.close()
    assert list(tmp_path.glob("*/fill.json")), "the child compiled no warm-up kernel into the cache"


def test_only_the_recording_thread_records():
    """The hook records (and skips Triton's compile) for the thread inside ``recording_launches``;
    another thread's compile goes on, through a hook installed before ours; ours leaves after."""
    before = []
    triton.knobs.runtime.jit_cache_hook = lambda **kw: before.append(kw["key"])
    jf = types.SimpleNamespace(module=__name__, fn=types.SimpleNamespace(__qualname__="k"), cache_key="src")

    def call(key):
        return triton.knobs.runtime.jit_cache_hook(
            key=key, repr="k", fn=types.SimpleNamespace(jit_function=jf),
            compile={"key": key, "specialization_data": json.dumps({"key": key}), "signature": {"x": "i32"},
                     "constants": {(1,): "bf16"}, "configs": [{}]},
            is_manual_warmup=True, already_compiled=False)

    other: list = []
    try:
        with recording_launches() as specs:
            assert call("mine") is True
            t = threading.Thread(target=lambda: other.append(call("theirs")))
            t.start()
            t.join()
        assert [json.loads(s.specialization)["key"] for s in specs] == ["mine"]
        assert specs[0].module == __name__ and specs[0].source_key == "src"
        assert specs[0].constants == {(1,): "bf16"} and specs[0].signature == {"x": "i32"}
        assert other == [None] and before == ["theirs"]
        assert call("after") is None and before == ["theirs", "after"]  # the earlier hook is back
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def test_a_failing_child_path_leaves_the_plan_to_the_in_process_pass(monkeypatch):
    """The children cannot be used (here: the target look-up fails), and the in-process pass
    still runs every bucket; the failure is in the plan's report."""
    from test_compile_ahead import _plan, _Runner

    def no_target():
        raise RuntimeError("no GPU driver")

    monkeypatch.setattr(compile_children, "current_target", no_target)
    runner = _Runner()
    ahead = CompileAhead(runner, processes=1)
    assert ahead.start_children(wait_s=120), ahead.status()["processes"]
    assert ahead.submit([_plan(2)]) == 1
    assert ahead.wait(60)
    ahead.close()
    done = ahead.status()["done"][_plan(2).hash]
    assert "no GPU driver" in done["child_error"] and "error" not in done
    assert "in_process" not in done
    assert sorted(runner.ran) == [(2, 1), (2, 2)]


def _sleep(s: float) -> float:
    time.sleep(s)
    return s


def _ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie not yet reaped). Not ``Process.is_alive()``: the
    pool's manager thread reaps its workers too, and a waitpid that loses that race reads alive."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, /proc was read
        return True


def test_a_hung_compile_times_out_and_the_children_restart():
    """A batch never waits without bound: a child that does not answer is reported and replaced
    (terminated, not left compiling), and the next batch gets a working pool."""
    pool = CompileChildren(1)
    pool.start()
    assert pool.wait_ready(120), pool.start_error
    try:
        pid = list(pool._pool._processes.values())[0].pid
        spec = KernelSpec(module="m", qualname="k", module_file=None, source_key="x", specialization="{}")
        report = pool.collect({spec: pool._pool.submit(_sleep, 60)}, timeout_s=1)
        assert report["kernels"] == 0 and "not compiled within 1 s" in report["errors"][0]
        end = time.monotonic() + 20
        while not _ended(pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert _ended(pid), "the hung child was left running"
        assert pool.wait_ready(120), pool.start_error
        assert pool._pool.submit(_sleep, 0.01).result(30) == 0.01
    finally:
        pool.close()
