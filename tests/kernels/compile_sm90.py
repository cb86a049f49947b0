"""Compile every Triton kernel for sm_90 (H100/H200) without a GPU, to catch what the interpreter
lets through (type changes across branches, dot shape limits, unsupported ops).

Run as a script (it must run without TRITON_INTERPRET): ``python tests/kernels/compile_sm90.py``;
``test_compile.py`` runs it in a subprocess. To check against the GPU machine's Triton (3.6) from
here: ``pip install --no-deps --target /tmp/tri36 triton==3.6.0`` and run the script with
``PYTHONPATH=/tmp/tri36`` (done for every kernel in this folder: all compile). Each spec gives the pointer dtypes and the constexprs
of one representative specialisation; other scalar arguments default to i32 (``eps``/``scale`` fp32);
pointers, ``stride_*`` arguments and ``LAUNCH_DIVISIBLE_INTS`` are taken as divisible by 16, as a launch
specialises them. ``--loop-pipelining`` prints the software pipelines of the decode attention and GEMV loops.
"""

from __future__ import annotations

import os
import inspect
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

FLOAT_ARGS = {"eps", "scale", "scale_log2", "rms_eps"}
# int arguments whose values at the engine's launches are multiples of 16 (feature widths, a split's
# K range, head counts, the block table's token span): a launch specialises them as such, and without
# it the GEMV's dot loop is not software-pipelined at all (k_per_split's alignment: 228 registers and
# no async copies, against 64 registers and a pipelined loop as launched; session 25)
LAUNCH_DIVISIBLE_INTS = {"N", "K", "k_per_split", "H", "max_tokens", "hidden"}
# the decode split kernel's non-bf16 pointers (its rope_attention operands among them)
DECODE_SPLIT_PTRS = {"bt_ptr": "*i32", "lens_ptr": "*i32", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
                     "cnt_ptr": "*i32", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64"}
# the GEMV kernel's non-bf16 pointers (its split-K workspace, argmax, ticket and RoPE operands)
GEMV_PTRS = {"ws_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "cnt_ptr": "*i32", "pos_ptr": "*i64",
             "cs_ptr": "*fp32", "slot_ptr": "*i64"}
# the same over a bf12 copy: W's low bytes, its 4-bit codes and the rows' bases
BF12_GEMV_PTRS = {**GEMV_PTRS, "w_ptr": "*u8", "wexp_ptr": "*u8", "wscale_ptr": "*i32"}


def specs():
    from anneal.engine.kernels import activation, attention_decode, attention_prefill, gemv, norm, rope

    bf = "*bf16"
    yield norm._rmsnorm_kernel, {}, dict(HAS_RESIDUAL=True, BLOCK_H=4096), 8
    for rms in (False, True):  # True: folded_norm's 1/rms of the residual row
        yield activation._silu_and_mul_kernel, {}, dict(BLOCK=1024, RMS=rms, BLOCK_HID=4096 if rms else 16), 4
        yield rope._qk_rope_store_kernel, {"pos_ptr": "*i64", "slot_ptr": "*i64", "cs_ptr": "*fp32"}, dict(
            HAS_NORM=True, D=128, BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=64, RMS=rms, BLOCK_HID=4096 if rms else 16), 4
    # rope: the rope_attention fusion (0 off, 1 Llama, 2 Qwen3's q/k norm, 3 folded_norm's 1/rms)
    for split, pv32, ticket, prefetch, rope_ in (
            (1, False, False, False, 0), (8, False, False, False, 0), (8, True, True, False, 0),
            (1, True, False, False, 0), (8, False, False, True, 0), (1, False, True, True, 0),
            (4, False, False, False, 1), (1, False, False, False, 2), (8, False, True, False, 3)):
        yield attention_decode._decode_split_kernel, DECODE_SPLIT_PTRS, dict(
            G=4, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=64, BS=16, SPLIT_K=split, PREC="tf32", UPCAST=False,
            PV_F32=pv32, TICKET=ticket, PREFETCH=prefetch, ROPE=rope_ > 0, HAS_NORM=rope_ == 2, RMS=rope_ == 3,
            BLOCK_HID=4096 if rope_ == 3 else 16), 4
    yield attention_decode._decode_merge_kernel, {
        "lens_ptr": "*i32", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32"}, dict(
        D=128, BLOCK_D=128, BLOCK_N=64, SPLIT_K=16), 4
    yield attention_prefill._prefill_kernel, {"bt_ptr": "*i32", "cu_ptr": "*i32", "lens_ptr": "*i32"}, dict(
        G=4, D=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, BS=16, PREC="tf32", UPCAST=False, PV_F32=False,
        PACK_GQA=False), 4
    yield attention_prefill._prefill_kernel, {"bt_ptr": "*i32", "cu_ptr": "*i32", "lens_ptr": "*i32"}, dict(
        G=4, D=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, BS=16, PREC="tf32", UPCAST=False, PV_F32=True,
        PACK_GQA=False), 8
    yield attention_prefill._prefill_kernel, {"bt_ptr": "*i32", "cu_ptr": "*i32", "lens_ptr": "*i32"}, dict(
        G=7, D=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, BS=16, PREC="tf32", UPCAST=False, PV_F32=False,
        PACK_GQA=True), 4
    for bm, split, silu, norm, argmax, ticket in (
            (1, 4, False, 0, False, False), (16, 1, False, 0, False, False), (64, 2, True, 0, False, False),
            (1, 1, False, 0, True, False), (16, 1, False, 0, True, False), (1, 4, False, 2, False, False),
            (16, 2, False, 2, False, False), (1, 1, False, 1, False, False), (16, 4, False, 0, False, True),
            (1, 8, True, 0, False, True), (32, 2, False, 2, False, True), (16, 1, False, 2, True, False)):
        yield gemv._gemv_kernel, GEMV_PTRS, dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, SILU_MUL=silu,
                                          NORM=norm, ARGMAX=argmax, TICKET=ticket, PREC="tf32", UPCAST=False,
                                          ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False), 4
    for bm, split, ticket in ((1, 4, True), (1, 1, False), (16, 2, True)):  # o/down_proj + add_rmsnorm
        yield gemv._gemv_kernel, GEMV_PTRS, dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, SPLIT_K=split, SILU_MUL=False, NORM=0,
                                          ARGMAX=False, TICKET=ticket, PREC="tf32", UPCAST=False, ROPE=False,
                                          HEAD_D=1, ADD_NORM=True, BLOCK_NORM=4096, SILU_OUT=False), 4
    for bm, split, bn in ((1, 1, 32), (1, 4, 128), (16, 2, 64)):  # gate_up_proj + silu_and_mul
        yield gemv._gemv_kernel, GEMV_PTRS, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, SPLIT_K=split, SILU_MUL=False, NORM=0,
                                          ARGMAX=False, TICKET=True, PREC="tf32", UPCAST=False, ROPE=False,
                                          HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=True), 4
    for bm, split in ((1, 4), (1, 1), (16, 2)):  # qkv_proj + RoPE + cache store
        yield gemv._gemv_kernel, GEMV_PTRS, dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, SPLIT_K=split, SILU_MUL=False, NORM=0,
                                          ARGMAX=False, TICKET=True, PREC="tf32", UPCAST=False, ROPE=True, HEAD_D=64,
                                          ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False), 4
    for ahead, rope in ((2, False), (3, False), (2, True)):  # M == 1 with more W tiles in flight
        yield gemv._gemv_kernel, GEMV_PTRS, dict(BLOCK_M=1, BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, SILU_MUL=False, NORM=0,
                                          ARGMAX=False, TICKET=True, PREC="tf32", UPCAST=False, ROPE=rope,
                                          HEAD_D=64 if rope else 1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False,
                                          AHEAD=ahead), 4
    # bf12 weights (1: Triton's integer unpack, 2: the PTX one), plain and in the fusions that read them
    for unpack in (1, 2):
        for bm, bn, bk, split, rope, silu_out in ((16, 32, 256, 2, False, False), (16, 64, 128, 1, True, False),
                                                  (64, 32, 256, 4, False, True), (16, 64, 256, 1, False, True)):
            yield gemv._gemv_kernel, BF12_GEMV_PTRS, dict(
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SILU_MUL=False, NORM=0, ARGMAX=False, TICKET=True,
                PREC="tf32", UPCAST=False, ROPE=rope, HEAD_D=64 if rope else 1, ADD_NORM=False, BLOCK_NORM=1,
                SILU_OUT=silu_out, W_BF12=unpack), 4
        # folded_norm (session 49): o / down adding into the stream (with and without statistics), and
        # gate_up's SiLU scaled by the 1/rms from them, split and not
        for split, ss_out in ((2, False), (1, True)):
            yield gemv._gemv_kernel, BF12_GEMV_PTRS, dict(
                BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split, SILU_MUL=False, NORM=0, ARGMAX=False,
                TICKET=True, PREC="tf32", UPCAST=False, ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1,
                SILU_OUT=False, ADD_SS=True, SS_OUT=ss_out, BLOCK_SS=128, W_BF12=unpack), 4
        for split in (1, 2):
            yield gemv._gemv_kernel, BF12_GEMV_PTRS, dict(
                BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=split, SILU_MUL=False, NORM=4, ARGMAX=False,
                TICKET=True, PREC="tf32", UPCAST=False, ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1,
                SILU_OUT=True, BLOCK_SS=128, W_BF12=unpack), 8
        # lm_head + argmax over lm_head's bf12 copy (session 45)
        yield gemv._gemv_kernel, BF12_GEMV_PTRS, dict(
            BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, SILU_MUL=False, NORM=0, ARGMAX=True, TICKET=False,
            PREC="tf32", UPCAST=False, ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False,
            W_BF12=unpack), 4
    yield gemv._splitk_sum_kernel, {"ws_ptr": "*fp32"}, dict(SPLIT_K=4, BLOCK=1024), 4
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import persistent_chain  # bench/: the persistent GEMV chain experiment (session 18)

    for first, last, rows, block_k, warps in ((0, 4, 8, 1024, 8), (0, 1, 16, 512, 4), (2, 4, 32, 512, 16)):
        yield persistent_chain._gemv_chain_kernel, {"bar_ptr": "*i32"}, dict(
            FIRST=first, LAST=last, ROWS=rows, BLOCK_K=block_k, BARRIER=True), warps
    import attention_oproj  # bench/: decode attention + o_proj in one persistent launch (session 32)

    for parts, order, split in ((3, 0, 4), (3, 2, 1), (1, 1, 4)):
        yield attention_oproj._attn_o_kernel, {**DECODE_SPLIT_PTRS, "op_ptr": "*fp32"}, dict(
            HKV=8, G=4, BLOCK_G=16, D=128, BLOCK_N=64, BS=16, SPLIT_K=split, BLOCK_M=16, BLOCK_O=64, BLOCK_K=128,
            LAG=8, PARTS=parts, ORDER=order, RESET=16, PREC="tf32", UPCAST=False), 4
    from anneal.engine.kernels import argmax as am

    yield am.argmax_merge_kernel, {"val_ptr": "*fp32", "idx_ptr": "*i32", "tok_ptr": "*i64"}, dict(BLOCK_T=1024), 4
    yield am._argmax_tile_kernel, {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32"}, dict(BLOCK=4096), 4
    del bf


def all_specs():
    """Every spec with PDL off (kernels without the switch as given), and with PDL on too the first
    spec of each kernel and every spec that requests loads before the PDL wait; the kernels that can
    trigger their dependents late (``pdl_mode`` 2) or after their wait (3) also so."""
    from anneal.engine.kernels import attention_decode, gemv

    late = (gemv._gemv_kernel, attention_decode._decode_split_kernel)
    seen = set()
    for kernel, ptr_types, constexprs, warps in specs():
        if "PDL" not in kernel.arg_names:  # a kernel without PDL (bench/attention_oproj.py's): as given
            yield kernel, ptr_types, constexprs, warps
            continue
        yield kernel, ptr_types, dict(constexprs, PDL=False), warps
        if kernel not in seen or constexprs.get("PREFETCH") or constexprs.get("AHEAD", 1) > 1:
            seen.add(kernel)
            yield kernel, ptr_types, dict(constexprs, PDL=True), warps
            if kernel in late:
                yield kernel, ptr_types, dict(constexprs, PDL=2), warps
                yield kernel, ptr_types, dict(constexprs, PDL=3), warps


def launch_options(kernel) -> dict:
    """The compile options a kernel's launch passes beyond num_warps / num_stages."""
    from anneal.engine.kernels import rope

    return dict(rope.QK_ROPE_STORE_OPTIONS) if kernel is rope._qk_rope_store_kernel else {}


def compile_one(kernel, ptr_types, constexprs, num_warps, num_stages=2, options=None):
    # constexpr params the spec leaves out take their defaults, as a launch does (not an i32 arg)
    constexprs = {**{p.name: p.default for p in kernel.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name not in constexprs and (name.endswith("_ptr") or name.startswith("stride_")
                                       or name in LAUNCH_DIVISIBLE_INTS):
            # a launch specialises pointers and ints divisible by 16 (torch's allocations, model
            # strides): without it loads compile scalar, and registers and spills are not the launch's
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs, attrs)
    opts = launch_options(kernel) if options is None else options
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **opts})


def cubin_usage(compiled) -> tuple[int, int]:
    """(registers a thread, local-memory bytes: spills) of a compiled kernel, read from its cubin by
    the cuobjdump Triton bundles."""
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"LOCAL:(\d+)", out).group(1))


def ctas_per_sm(regs: int, num_warps: int) -> int:
    """CTAs an SM holds by registers alone (64K a SM, allocated per warp in units of 256)."""
    per_warp = -(-regs * 32 // 256) * 256
    return 65536 // (per_warp * num_warps)


def rope_attention_usage() -> dict[str, tuple[int, int, int]]:
    """Registers, local memory and CTAs per SM (by registers) of the decode split kernel at the chat
    shape's config, without and with the rope_attention prologue (Llama; folded_norm's 1/rms)."""
    from anneal.engine.kernels import attention_decode

    out = {}
    for name, rope_, rms in (("plain", False, False), ("rope", True, False), ("rope_rms", True, True)):
        ce = dict(G=4, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=64, BS=16, SPLIT_K=4, PREC="tf32", UPCAST=False,
                  PV_F32=False, TICKET=False, PREFETCH=False, ROPE=rope_, HAS_NORM=False, RMS=rms,
                  BLOCK_HID=4096 if rms else 16, PDL=False)
        regs, local = cubin_usage(compile_one(attention_decode._decode_split_kernel, DECODE_SPLIT_PTRS, ce, 4))
        out[name] = (regs, local, ctas_per_sm(regs, 4))
    return out


def loop_pipelining() -> dict[str, dict[int, tuple[int, int]]]:
    """The software pipeline Triton builds for the decode split kernel's K/V loop and the GEMV's
    dot loop (M padded to 16) at each ``num_stages``: (K tiles buffered in shared memory, copy
    groups the loop's wait leaves in flight). 0 in flight: every iteration waits for its own tile
    with nothing requested behind it, so a program's tiles are serial round trips (the decode loop
    up to 4 stages: its block-table indirection takes the stages first)."""
    import re

    from anneal.engine.kernels import attention_decode, gemv

    def shape(compiled, name):
        ir = compiled.asm["ttgir"]
        bufs = re.search(rf"%{name}_\d+ = ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x", ir)
        loop = ir[ir.index("scf.for"):]
        waits = [int(n) for n in re.findall(r"ttg.async_wait[^{]*\{num = (\d+)", loop.split("scf.yield")[0])]
        return (int(bufs.group(1)) if bufs else 0, max(waits, default=0))

    decode = dict(G=4, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=64, BS=16, SPLIT_K=4, PREC="tf32", UPCAST=False,
                  PV_F32=False, TICKET=False, PREFETCH=False, ROPE=False, HAS_NORM=False, RMS=False, BLOCK_HID=16,
                  PDL=False)
    dot = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, SILU_MUL=False, NORM=0, ARGMAX=False, TICKET=False,
               PREC="tf32", UPCAST=False, ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False, PDL=False)
    return {
        "attention_decode": {st: shape(compile_one(attention_decode._decode_split_kernel, DECODE_SPLIT_PTRS, decode, 4,
                                                   num_stages=st), "k") for st in (2, 4, 5, 7)},
        "gemv_dot": {st: shape(compile_one(gemv._gemv_kernel, GEMV_PTRS, dot, 4, num_stages=st), "w") for st in (2, 3)},
    }


def bf12_loop_instructions() -> dict[str, dict[str, int]]:
    """Instructions in the GEMV's dot loop (one K tile: 64 weights a thread at block_n 32, block_k 256,
    4 warps) on bf16 W and on its bf12 copy unpacked in Triton's integer ops and in PTX: ``ptx`` as
    Triton emits it, ``sass`` as ptxas compiles it (the loop's own body, from its label to its
    backward branch). Session 46, Triton 3.6: PTX 124 / 660 / 298, SASS 127 / 731 / 316 (session
    45's first PTX unpack: 292 PTX, 357 SASS; 385 / 450 with Triton 3.9, against 298 / 318 now)."""
    import re

    from anneal.engine.kernels import gemv

    base = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, SILU_MUL=False, NORM=0, ARGMAX=False, TICKET=True,
                PREC="tf32", UPCAST=False, ROPE=False, HEAD_D=1, ADD_NORM=False, BLOCK_NORM=1, SILU_OUT=False, PDL=False)
    out: dict[str, dict[str, int]] = {"ptx": {}, "sass": {}}
    for name, ptrs, mode in (("bf16", GEMV_PTRS, 0), ("bf12_int", BF12_GEMV_PTRS, 1),
                             ("bf12_asm", BF12_GEMV_PTRS, 2)):
        compiled = compile_one(gemv._gemv_kernel, ptrs, dict(base, W_BF12=mode), 4, num_stages=3)
        ptx = compiled.asm["ptx"]
        loop = ptx[ptx.index("Inner Loop Header"):]
        loop = loop[:loop.index("bra.uni")]
        out["ptx"][name] = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?[a-z][a-z0-9_.]*(?:\s|;)", loop, re.M))
        out["sass"][name] = sass_loop_length(compiled.asm["cubin"])
    return out


def sass_loop_length(cubin: bytes) -> int:
    """Instructions of the longest loop in ``cubin``'s SASS (nvdisasm, shipped with Triton): from a
    label to the last branch back to it."""
    import re
    import subprocess
    import tempfile

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for line in sass.splitlines():
        if m := re.match(r"^\s*\.(L_x_\d+):", line):
            labels[m.group(1)] = len(instrs)
        elif m := re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?);", line):
            instrs.append(m.group(1))
    back = [i - labels[m.group(1)] + 1 for i, ins in enumerate(instrs)
            if (m := re.search(r"BRA\s+`?\(?\.(L_x_\d+)", ins)) and labels.get(m.group(1), i + 1) <= i]
    if not back:
        raise RuntimeError("no loop found in the SASS")
    return max(back)


def rope_store_arithmetic() -> dict[str, dict[str, int]]:
    """The bf16 arithmetic instructions in the qk_rope_store kernel's PTX (Llama, bf16), as launched
    and with FMA contraction on: contracted, a rotation is one rounding short (session 21)."""
    import collections
    import re

    from anneal.engine.kernels import rope

    ce = dict(HAS_NORM=False, D=128, BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=64, RMS=False, BLOCK_HID=16, PDL=False)
    ptrs = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cs_ptr": "*fp32"}
    out = {}
    for name, opts in (("launched", None), ("fp_fusion", {"enable_fp_fusion": True})):
        ptx = compile_one(rope._qk_rope_store_kernel, ptrs, ce, 4, options=opts).asm["ptx"]
        ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*\.bf16)\b", ptx, re.M))
        out[name] = dict(ops)
    return out


def main() -> int:
    if "--rope-store-arithmetic" in sys.argv:
        import json

        print(json.dumps(rope_store_arithmetic()))
        return 0
    if "--loop-pipelining" in sys.argv:
        import json

        print(json.dumps(loop_pipelining()))
        return 0
    if "--bf12-loop-instructions" in sys.argv:
        import json

        print(json.dumps(bf12_loop_instructions()))
        return 0
    if "--rope-attention-usage" in sys.argv:
        import json

        print(json.dumps(rope_attention_usage()))
        return 0
    failed = 0
    for kernel, ptr_types, constexprs, warps in all_specs():
        t0 = time.perf_counter()
        try:
            compiled = compile_one(kernel, ptr_types, constexprs, warps)  # with its launch's options
            print(f"ok   {kernel.__name__} {constexprs} ({time.perf_counter() - t0:.1f}s, "
                  f"{compiled.metadata.shared} B shared)")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {kernel.__name__} {constexprs}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
