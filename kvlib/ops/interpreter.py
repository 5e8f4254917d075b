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
    patch_scalar_index()
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


FIXED_TRITON = (3, 7)  # the first Triton whose interpreter converts scalars NumPy 2.4's way


def patch_scalar_index() -> None:
    """Let Triton's interpreter turn a scalar into an int under NumPy >= 2.4.

    The interpreter holds a kernel's scalars (a runtime `seq_len`, a loop bound) as 1-element
    arrays, and before Triton 3.7 its `tensor.__index__` is `int(array)`, which NumPy 2.4 and later
    refuse ("only 0-dimensional arrays can be converted to Python scalars", triton-lang/triton
    #9171): every `for start in range(0, seq_len, BLOCK_N)` in an interpreted kernel raises. Where
    Triton's own conversion is the unfixed one, its tensor patch is wrapped so the conversion takes
    the array's one element. Idempotent, and nothing changes under a fixed Triton.
    """
    import re

    import numpy as np
    import triton
    from triton.runtime import interpreter

    major, minor = (int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    original = interpreter._patch_lang_tensor
    if (major, minor) >= FIXED_TRITON or getattr(original, "kvlib_scalar_index", False):
        return

    def scalar(tensor) -> int:
        return int(np.asarray(tensor.handle.data).reshape(-1)[0])

    def patched(tensor, *rest):
        original(tensor, *rest)
        if rest and hasattr(rest[0], "set_attr"):  # a scope, which restores it after the launch
            rest[0].set_attr(tensor, "__index__", scalar)
        else:
            tensor.__index__ = scalar

    patched.kvlib_scalar_index = True
    interpreter._patch_lang_tensor = patched
