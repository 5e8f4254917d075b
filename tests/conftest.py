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


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test leaves torch's thread count as it found it: a test that runs an experiment's or
    the training's entry point (which set the recording's thread count, 2) would otherwise leave
    its worker with two threads beside the other worker's one on 2 cores, and every later test in
    that worker 10-60x slower (test_engine's batching tests: 20-97 s instead of 1-2 s)."""
    yield
    if torch.get_num_threads() != TORCH_THREADS:
        torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per test session (about 5 s)."""
    from kvlib.loaders.smollm2 import load_smollm2

    torch.set_num_threads(TORCH_THREADS)
    return load_smollm2()
