"""Fixtures shared by several test files; and, before any test can import Triton (torch.compile
does), Triton's CPU interpreter switched on where there is no CUDA, so any selection of test files
runs the kernels as `make unit` does."""

import pytest
import torch

import kvlib.ops.interpreter  # noqa: F401  sets TRITON_INTERPRET=1 without CUDA


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per test session (about 5 s)."""
    from kvlib.loaders.smollm2 import load_smollm2

    torch.set_num_threads(2)
    return load_smollm2()
