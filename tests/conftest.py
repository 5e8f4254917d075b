"""Fixtures shared by several test files."""

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, loaded once per test session (about 5 s)."""
    from kvlib.loaders.smollm2 import load_smollm2

    torch.set_num_threads(2)
    return load_smollm2()
