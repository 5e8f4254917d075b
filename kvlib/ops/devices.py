"""Where the paged decode kernel runs and in which dtype: `kernel_device()` (the CUDA device where
Triton compiles it, the CPU where it runs under Triton's interpreter) and `kernel_dtype()` (bfloat16
from compute capability 8.0, float16 on older GPUs such as Colab's T4, float32 in the interpreter).
The engine, the benchmarks and the notebooks ask here rather than deciding each on its own."""

from __future__ import annotations

import torch

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: bf16 tensor-core instructions, which Triton's tl.dot needs


def kernel_device() -> torch.device:
    """The device chapter 11's kernel runs on here, so the device its inputs must be on.

    CUDA where the kernel is compiled (CUDA present and `TRITON_INTERPRET` not set to 1); the CPU
    where it runs under Triton's interpreter (no CUDA: importing `kvlib.kernels` sets
    `TRITON_INTERPRET=1`). Imports `kvlib.kernels` (not Triton), so call it before `import
    triton`.
    """
    from kvlib.ops.interpreter import INTERPRETED

    return torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")


def kernel_dtype(device=None, *, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The dtype the kernel and the engine run in on `device` (default `kernel_device()`).

    bfloat16 on a CUDA device of compute capability >= 8.0; float16 below it (a T4 is 7.5, a
    V100 7.0: no bfloat16 `tl.dot`); float32 on the CPU. `capability` overrides the device's
    (for tests, and to see what a T4 learner gets). `kernel_dtype_reason` says why, in words.
    """
    device = kernel_device() if device is None else torch.device(device)
    if device.type != "cuda" and capability is None:
        return torch.float32
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if tuple(capability) >= BF16_MIN_CAPABILITY else torch.float16


def kernel_dtype_reason(device=None, *, capability: tuple[int, int] | None = None) -> str:
    """Why `kernel_dtype` chose what it chose, in one clause."""
    dtype = kernel_dtype(device, capability=capability)
    if dtype == torch.float32:
        return "float32: the CPU interpreter computes in fp32"
    if capability is None:
        device = kernel_device() if device is None else torch.device(device)
        capability = torch.cuda.get_device_capability(device)
    major, minor = capability
    if dtype == torch.bfloat16:
        return f"bfloat16: compute capability {major}.{minor} >= 8.0 has bf16 tensor cores"
    return (
        f"float16: compute capability {major}.{minor} < 8.0 has no bf16 tensor-core dot "
        "(a T4 is 7.5), so Triton's tl.dot needs fp16"
    )
