"""`kvlib.course.devices`: where the kernel runs, which dtype it runs in (bf16, or fp16 on a GPU
without bf16 tensor cores such as Colab's T4), when a notebook takes its GPU-only branches; and the
kernel wrapper's refusal of CPU tensors where it is compiled."""

import pytest
import torch

import kvlib.ops.decode_plan as P
from kvlib.cache.block_table import shuffled_block_tables
from kvlib.course import devices
from kvlib.kernels import paged_decode_attention


@pytest.mark.parametrize(
    ("capability", "dtype"),
    [
        ((7, 5), torch.float16),
        ((7, 0), torch.float16),
        ((8, 0), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_kernel_dtype_is_bf16_from_ampere_and_fp16_before_it(capability, dtype):
    assert devices.kernel_dtype("cuda", capability=capability) == dtype
    reason = devices.kernel_dtype_reason("cuda", capability=capability)
    assert reason.startswith(str(dtype).removeprefix("torch.")) and f"{capability[0]}." in reason


def test_kernel_dtype_reads_the_device_capability(monkeypatch):
    # a stub for a T4 (7.5) and an H100 (9.0): the choice follows what the device reports
    for capability, dtype in (((7, 5), torch.float16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert devices.kernel_dtype("cuda") == dtype
        assert "T4" in devices.kernel_dtype_reason("cuda") or dtype == torch.bfloat16


def test_kernel_dtype_on_the_cpu_is_float32():
    assert devices.kernel_dtype("cpu") == torch.float32
    assert "interpreter" in devices.kernel_dtype_reason("cpu")


def test_gpu_branches_follow_cuda_or_the_environment(monkeypatch):
    monkeypatch.delenv(devices.GPU_BRANCHES_ENV, raising=False)
    assert devices.gpu_branches() == torch.cuda.is_available()
    assert not devices.tiny_shapes()
    monkeypatch.setenv(devices.GPU_BRANCHES_ENV, "cpu")
    assert devices.gpu_branches()
    assert devices.tiny_shapes() == (not torch.cuda.is_available())
    monkeypatch.setenv(devices.GPU_BRANCHES_ENV, "yes")
    with pytest.raises(
        ValueError, match=r"KVLIB_GPU_BRANCHES: expected \"cpu\" or unset, got 'yes'"
    ):
        devices.gpu_branches()


def test_describe_says_where_the_kernel_and_the_models_run(monkeypatch):
    monkeypatch.delenv(devices.GPU_BRANCHES_ENV, raising=False)
    line = devices.describe()
    assert "models run on the CPU" in line
    if not torch.cuda.is_available():
        assert devices.kernel_device() == torch.device("cpu") and "interpreter" in line


def test_the_compiled_kernel_refuses_cpu_tensors_naming_the_device(monkeypatch):
    # force the compiled path's check on a CPU machine: what a CUDA machine without the
    # interpreter sees when a notebook builds its tensors on the CPU
    monkeypatch.setattr(P, "INTERPRETED", False)
    P._PLANS.clear()
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([5, 20], dtype=torch.int32)
    block_tables, num_blocks = shuffled_block_tables(seq_lens, 16, generator=g)
    k = torch.randn(num_blocks, 16, 2, 16, generator=g)
    with pytest.raises(ValueError, match=r"compiled for CUDA here .* got cpu.*\.to\('cuda'\)"):
        paged_decode_attention(torch.randn(2, 4, 16), k, k.clone(), block_tables, seq_lens)
    P._PLANS.clear()
