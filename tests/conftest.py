"""Fixtures shared by several test files; and, before any test can import Triton (torch.compile
does), Triton's CPU interpreter switched on where there is no CUDA, so any selection of test files
runs the kernels as `make unit` does."""

import os

import pytest
import torch

import kvlib.ops.interpreter  # noqa: F401  sets TRITON_INTERPRET=1 without CUDA

# `make unit` runs a worker per core (pytest-xdist): one torch thread each, so that two workers'
# thread pools do not fight over the cores (two threads each on 2 cores ran the suite 1.6x slower).
TORCH_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per test session (about 5 s)."""
    from kvlib.loaders.smollm2 import load_smollm2

    torch.set_num_threads(TORCH_THREADS)
    return load_smollm2()
