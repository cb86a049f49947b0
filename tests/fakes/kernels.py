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
