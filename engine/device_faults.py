"""Errors after which this process's CUDA context is lost, and the engine with it.

Why: a device-side assert, an illegal memory access or a launch failure is sticky. Every later CUDA
call in the process fails the same way, so an engine that goes on after one fails every request.
Session 55's compile fast tier answered 500 to every candidate for six minutes and wrote a 1.2 GB
log, and the compile blamed each candidate for the engine's fault. Only a new process recovers.
So the engine calls itself dead and the server exits for its supervisor to restart: Kubernetes
restarts the pod, and `anneal compile` stops and names the engine's log.
"""

from __future__ import annotations

# CUDA's own messages for the errors that poison a context (cudaErrorAssert, cudaErrorIllegalAddress,
# cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, ECC), as torch
# and Triton quote them
_STICKY = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "uncorrectable ECC error",
)


def is_fatal(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the CUDA context is lost."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(s in str(e) for s in _STICKY):
            return True
        e = e.__cause__ or e.__context__
    return False
