"""Triton's CPU interpreter: without CUDA, `TRITON_INTERPRET=1` is set on import, before any
`@triton.jit` decorator runs (Triton reads it then), so the kernels run, slowly and exactly, on the
CPU. `kvlib.kernels` and `kvlib.ops.triton_decode` import it first; only
`require_interpretable_triton` imports Triton."""

import os

import torch

if not torch.cuda.is_available():  # must happen before any @triton.jit decorator runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def require_interpretable_triton() -> None:
    """Check that Triton's own `@triton.jit` helpers (`tl.cdiv`, `tl.max`, `tl.sum`, ...) were
    decorated for the interpreter, as kvlib's kernels are when `INTERPRETED`.

    Triton decorates them when it is first imported. If something imported it before
    `TRITON_INTERPRET=1` was set (`torch._dynamo`, which `torch.compile` and some libraries
    import, does), they were compiled for a GPU and the first launch fails deep inside Triton
    with "Cannot call @triton.jit'd outside of the scope of a kernel".

    Raises:
        RuntimeError: Triton was imported too early; the message says how to start over.
    """
    if not INTERPRETED:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.cdiv, InterpretedFunction):
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET=1 was set (torch.compile and "
            "torch._dynamo import it), so its library functions were compiled for a GPU and "
            "cannot run under the CPU interpreter. Restart Python (in Jupyter: restart the "
            "kernel) and import kvlib.kernels before anything that imports Triton, or start "
            "Python with TRITON_INTERPRET=1 in the environment."
        )
