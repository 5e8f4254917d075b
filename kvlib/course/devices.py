"""Where a notebook runs what: one answer for every chapter, so a GPU learner and a CPU learner run
the same cells.

- `kernel_device()`: where chapter 11's Triton kernel runs, so where its inputs must live: the
  CUDA device where Triton compiles it, the CPU where it runs under Triton's interpreter.
- `gpu_branches()`: whether a notebook takes its GPU-only branches (a live benchmark instead of the
  recorded one). On a CUDA machine, and on the CPU when `KVLIB_GPU_BRANCHES=cpu` is set: CI's extra
  pass runs those branches there, the kernel under the interpreter and the shapes tiny
  (`tiny_shapes()`), so that no branch of a notebook goes unexercised without a GPU.
- `kernel_dtype()`: the 16-bit dtype the kernel and the engine use on a device: bfloat16 where the
  GPU's tensor cores take it (compute capability 8.0 and later: A100, H100, RTX 30xx), float16 on
  older GPUs (Colab's free T4 is 7.5: Triton's `tl.dot` rejects bfloat16 there), float32 on the CPU
  (the interpreter computes in fp32 anyway).
- `describe()`: the line a notebook's first cell prints: what runs on the GPU, what stays on the
  CPU, and why.

The models of chapters 1-10 stay on the CPU on every machine: their stored outputs (checked by
nbval) are CPU numbers, and a 836k- or 135M-parameter model gains nothing a learner would notice
from a GPU. What a GPU changes is chapter 11's kernel (compiled), its benchmark (live) and the
kernel cells of chapter 10.
"""

from __future__ import annotations

import os

import torch

from kvlib.ops.devices import kernel_device, kernel_dtype, kernel_dtype_reason

__all__ = [
    "describe",
    "gpu_branches",
    "kernel_device",
    "kernel_dtype",
    "kernel_dtype_reason",
    "tiny_shapes",
]

GPU_BRANCHES_ENV = "KVLIB_GPU_BRANCHES"  # "cpu": take the GPU-only branches on the CPU (CI)


def gpu_branches() -> bool:
    """Whether a notebook's GPU-only branches run: on a CUDA machine, or on the CPU when the
    environment sets `KVLIB_GPU_BRANCHES=cpu` (CI's pass over those branches, with the kernel
    under the interpreter and `tiny_shapes()`).

    Raises:
        ValueError: `KVLIB_GPU_BRANCHES` is set to something other than "cpu" or "".
    """
    value = os.environ.get(GPU_BRANCHES_ENV, "")
    if value not in ("", "cpu"):
        raise ValueError(f'{GPU_BRANCHES_ENV}: expected "cpu" or unset, got {value!r}')
    return torch.cuda.is_available() or value == "cpu"


def tiny_shapes() -> bool:
    """Whether the GPU-only branches run on the CPU (`KVLIB_GPU_BRANCHES=cpu` without CUDA), so a
    live benchmark must shrink to a few small cases the interpreter finishes in seconds."""
    return gpu_branches() and not torch.cuda.is_available()


def describe() -> str:
    """One line for a notebook's first cell: where the kernel runs and where the models stay."""
    device = kernel_device()
    if device.type == "cuda":
        kernel = (
            f"the Triton kernel is compiled for {torch.cuda.get_device_name(device)} "
            f"({kernel_dtype_reason(device)})"
        )
    else:
        kernel = "no CUDA GPU: the Triton kernel runs under its CPU interpreter"
        if tiny_shapes():
            kernel += f" ({GPU_BRANCHES_ENV}=cpu: GPU-only cells run here with tiny shapes)"
    return f"{kernel}; the models run on the CPU (the stored outputs are CPU numbers)"
