"""Triton's CPU interpreter: without CUDA, `TRITON_INTERPRET=1` is set on import, before any
`@triton.jit` decorator runs (Triton reads it then), so the kernels run, slowly and exactly, on the
CPU. `kvlib.kernels` and `kvlib.ops.triton_decode` import it first; nothing here imports Triton."""

import os

import torch

if not torch.cuda.is_available():  # must happen before any @triton.jit decorator runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
