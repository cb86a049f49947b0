"""Kernel sources the tests hand to the engine: one correct, one broken, and planted faulty ones.

Each defines ``build(**params)`` returning a function with the op's reference signature, as an
agent-written kernel would. On the CPU they are plain torch code that misbehaves in the planted way.
"""

SILU_MUL_OK = '''
import torch

def build():
    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return silu_and_mul
'''

# Forgets the activation: compiles and runs, wrong values.
SILU_MUL_BROKEN = '''
import torch

def build():
    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return gate * up
    return silu_and_mul
'''

SYNTAX_ERROR = '''
def build(:
    pass
'''

# ---- planted faulty kernels: each must be rejected with its reason ------------------------------

# Caches each physical KV block the first time it sees it, assuming a block never changes once
# written: when a freed block is recycled for another request, it reads the stale copy.
STALE_KV_BLOCK = '''
import torch
from anneal.engine.ops import reference as R

def build():
    seen = {}  # (layer cache, physical block) -> its K/V when first seen full
    def attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        bs = k_cache.shape[1]
        ids = block_tables.long()
        B, NB = ids.shape
        kc, vc = k_cache[ids], v_cache[ids]  # copies of just the blocks in use: [B, NB, bs, H, D]
        for b in range(B):
            for i in range(int(context_lens[b]) // bs):  # full blocks only: "they never change"
                key = (k_cache.data_ptr(), int(ids[b, i]))
                if key in seen:
                    kc[b, i], vc[b, i] = seen[key]
                else:
                    seen[key] = (kc[b, i].clone(), vc[b, i].clone())
        tables = torch.arange(B * NB, dtype=block_tables.dtype, device=q.device).reshape(B, NB)
        return R.attention_decode(q, kc.flatten(0, 1), vc.flatten(0, 1), tables, context_lens, scale)
    return attention_decode
'''

# Uses the first sequence's context length for the whole batch: exact at batch 1, wrong beyond.
WRONG_AT_BATCH = '''
from anneal.engine.ops import reference as R

def build():
    def attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        lens = context_lens[:1].expand(context_lens.shape[0]).contiguous()
        return R.attention_decode(q, k_cache, v_cache, block_tables, lens, scale)
    return attention_decode
'''

# Correct on short contexts, NaN once a sequence passes 40 tokens.
NAN_PAST_CONTEXT = '''
import torch
from anneal.engine.ops import reference as R

def build():
    def attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        out = R.attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        long = (context_lens > 40)[:, None, None]
        return torch.where(long, torch.full_like(out, float("nan")), out)
    return attention_decode
'''

# Returns at once and finishes the work elsewhere (another CUDA stream on a GPU, a thread on the
# CPU), so a timer that does not wait for all work sees it as fast; whoever reads the output
# early reads garbage.
SIDE_STREAM = '''
import threading
import time
import torch
import torch.nn.functional as F

def build():
    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        out = torch.full_like(gate, float("nan"))
        if x.is_cuda:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(1_000_000)
                out.copy_(F.silu(gate) * up)
        else:
            def later():
                time.sleep(0.05)
                out.copy_(F.silu(gate) * up)
            threading.Thread(target=later, daemon=True).start()
        return out
    return silu_and_mul
'''

# Right values up to rounding, but different bits on every call (noise, like a racy reduction).
NONDETERMINISTIC = '''
import torch
import torch.nn.functional as F

def build():
    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out * (1 + 1e-6 * torch.randn_like(out))
    return silu_and_mul
'''

FAULTY = {
    "stale_kv_block": ("attention_decode", STALE_KV_BLOCK),
    "wrong_at_batch": ("attention_decode", WRONG_AT_BATCH),
    "nan_past_context": ("attention_decode", NAN_PAST_CONTEXT),
    "side_stream": ("silu_and_mul", SIDE_STREAM),
    "nondeterministic": ("silu_and_mul", NONDETERMINISTIC),
}


def evasive(op: str, source: str, honest_calls: int = 3) -> str:
    """The same fault, hidden from a short isolated check: the reference for the first
    ``honest_calls`` calls, the faulty kernel after. Only checks inside the engine, over many
    steps, requests and recycled blocks, can catch these."""
    return source.replace("def build(", "def _faulty_build(") + f'''

def build(**params):
    from anneal.engine.ops import reference as _R
    honest, faulty, calls = getattr(_R, "{op}"), _faulty_build(**params), [0]
    def fn(*args):
        calls[0] += 1
        return honest(*args) if calls[0] <= {honest_calls} else faulty(*args)
    return fn
'''


EVASIVE = {name: (op, evasive(op, src)) for name, (op, src) in FAULTY.items()}

# What an out-of-bounds index in a GPU kernel does to its process: CUDA's sticky error, raised here by
# hand (the CPU has no such error), after three honest calls so the isolated check passes it.
LOSES_THE_DEVICE = evasive("silu_and_mul", '''
def build():
    def silu_and_mul(x):
        raise RuntimeError("CUDA error: device-side assert triggered")
    return silu_and_mul
''')
