"""The Triton decode kernel against its reference: on the CPU under Triton's interpreter, and
(marked `gpu`) compiled on a CUDA GPU with bf16 and large shapes."""

import math
import os
import subprocess
import sys

import pytest
import torch

from kvlib.cache.block_table import shuffled_block_tables
from kvlib.kernels import paged_decode_attention, paged_decode_attention_ref
from kvlib.testing import assert_close

TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def make_paged_cache(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    device="cpu",
    seed=0,
    spare_blocks=3,
):
    """Random q and a paged K/V cache with shuffled block tables (logical order != physical)."""
    generator = torch.Generator().manual_seed(seed)
    block_tables, num_blocks = shuffled_block_tables(
        seq_lens, block_size, spare_blocks=spare_blocks, generator=generator
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        dtype
    )
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        dtype
    )
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens)]


CPU_LENGTHS = [
    1,
    16,
    17,
    45,
    100,
]  # a single token, exactly one block, one past a block, mid-block endings


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_on_cpu(block_size, num_heads, num_kv_heads, num_splits, dtype):
    inputs = make_paged_cache(
        CPU_LENGTHS, num_heads, num_kv_heads, 32, block_size, dtype, seed=block_size + num_splits
    )
    out = paged_decode_attention(*inputs, num_splits=num_splits)
    expected = paged_decode_attention_ref(*inputs)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    assert_close(
        out,
        expected,
        name=f"kernel (block {block_size}, {num_heads}/{num_kv_heads} heads, "
        f"{num_splits} splits, {dtype})",
        rtol=rtol,
        atol=atol,
    )


def test_more_splits_than_tiles_and_odd_head_dim():
    inputs = make_paged_cache([3, 70], 6, 2, 24, 16, torch.float32)  # D = 24 is not a power of two
    assert_close(
        paged_decode_attention(*inputs, num_splits=16),
        paged_decode_attention_ref(*inputs),
        name="16 splits of a 3-token sequence",
        rtol=1e-5,
        atol=1e-5,
    )


def test_scale_and_block_n():
    inputs = make_paged_cache([50, 9], 4, 2, 16, 16, torch.float32)
    assert_close(
        paged_decode_attention(*inputs, scale=0.3, block_n=32),
        paged_decode_attention_ref(*inputs, scale=0.3),
        name="scale 0.3",
        rtol=1e-5,
        atol=1e-5,
    )


def test_head_dim_below_16_is_padded_for_tl_dot():
    # D = 8: BLOCK_D is padded to 16 and masked
    inputs = make_paged_cache([5, 40], 4, 1, 8, 16, torch.float32)
    assert_close(
        paged_decode_attention(*inputs, num_splits=2),
        paged_decode_attention_ref(*inputs),
        name="D = 8",
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("block_n", [8, 48, 24, "64"])
def test_block_n_must_be_a_power_of_two_of_at_least_16(block_n):
    inputs = make_paged_cache([5], 2, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="block_n: expected a power of two >= 16"):
        paged_decode_attention(*inputs, block_n=block_n)


def test_reference_matches_dense_attention():
    q, k_cache, v_cache, block_tables, seq_lens = make_paged_cache(
        [20], 4, 2, 8, 16, torch.float32, spare_blocks=0
    )
    order = block_tables[0, :2].long()
    k = k_cache[order].reshape(-1, 2, 8)[:20].transpose(0, 1)  # (H_kv, S, D)
    v = v_cache[order].reshape(-1, 2, 8)[:20].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None, :], k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    )[:, 0]
    assert_close(
        paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens)[0],
        dense,
        name="reference vs SDPA",
        rtol=1e-5,
        atol=1e-6,
    )


def test_validation_messages():
    q, k_cache, v_cache, block_tables, seq_lens = make_paged_cache(
        [5, 20], 4, 2, 16, 16, torch.float32
    )
    with pytest.raises(ValueError, match="H = 3 query heads must be a multiple of H_kv = 2"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(TypeError, match="expected one dtype"):
        paged_decode_attention(q.half(), k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(TypeError, match="block_tables, seq_lens: expected int32"):
        paged_decode_attention(q, k_cache, v_cache, block_tables.long(), seq_lens)
    with pytest.raises(ValueError, match=r"seq_lens: expected every length in \[1, 32\]"):
        paged_decode_attention(
            q, k_cache, v_cache, block_tables, torch.tensor([5, 33], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match=r"seq_lens: expected every length in \[1, 32\]"):
        paged_decode_attention(
            q, k_cache, v_cache, block_tables, torch.tensor([0, 3], dtype=torch.int32)
        )
    bad_tables = block_tables.clone()
    bad_tables[1, 1] = k_cache.shape[0]
    with pytest.raises(
        ValueError, match=r"block_tables: expected block ids in \[0, 6\), got min 0, max 6"
    ):
        paged_decode_attention(q, k_cache, v_cache, bad_tables, seq_lens)
    with pytest.raises(ValueError, match="k_cache: expected head dim D = 16"):
        paged_decode_attention(
            q, k_cache[..., :8].contiguous(), v_cache[..., :8].contiguous(), block_tables, seq_lens
        )
    with pytest.raises(ValueError, match="contiguous last dimension"):
        paged_decode_attention(
            q, k_cache.transpose(2, 3).contiguous().transpose(2, 3), v_cache, block_tables, seq_lens
        )
    with pytest.raises(ValueError, match="num_splits: expected an int >= 1, got 0"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=0)
    # K and V share one address computation in the kernel, so their strides must agree
    v_padded = torch.zeros(*v_cache.shape[:-1], 2 * v_cache.shape[-1])[..., : v_cache.shape[-1]]
    v_padded.copy_(v_cache)
    with pytest.raises(ValueError, match="k_cache, v_cache: expected the same strides"):
        paged_decode_attention(q, k_cache, v_padded, block_tables, seq_lens)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 32), (32, 4)])
def test_kernel_on_gpu(dtype, num_heads, num_kv_heads):
    lengths = [1, 17, 1000, 4096, 16384 + 5]
    inputs = make_paged_cache(lengths, num_heads, num_kv_heads, 128, 16, dtype, device="cuda")
    expected = paged_decode_attention_ref(*inputs)
    # fp32 dots run as tf32 on tensor cores
    rtol, atol = TOLERANCES[dtype] if dtype != torch.float32 else (5e-3, 5e-3)
    for num_splits in (None, 1, 7, 32):
        out = paged_decode_attention(*inputs, num_splits=num_splits)
        assert_close(
            out,
            expected,
            name=f"GPU kernel ({dtype}, {num_heads}/{num_kv_heads}, splits {num_splits})",
            rtol=rtol,
            atol=atol,
        )


@pytest.mark.gpu
@gpu
def test_kernel_on_gpu_large_cache_offsets():
    """A cache of more than 2**31 elements: block offsets must not overflow int32."""
    num_blocks = (2**31) // (16 * 8 * 128) + 64
    k_cache = torch.randn(num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    block_tables = torch.tensor(
        [[num_blocks - 1, 0], [5, num_blocks - 2]], dtype=torch.int32, device="cuda"
    )
    seq_lens = torch.tensor([20, 32], dtype=torch.int32, device="cuda")
    assert_close(
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens),
        paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens),
        name="large cache",
        rtol=2e-2,
        atol=2e-2,
    )


def test_shuffled_block_tables_give_each_sequence_distinct_blocks_of_the_pool():
    lengths, block_size = [1, 16, 17, 45], 16
    tables, num_blocks = shuffled_block_tables(
        lengths, block_size, spare_blocks=2, generator=torch.Generator().manual_seed(0)
    )
    needed = [math.ceil(n / block_size) for n in lengths]
    assert (
        tables.shape == (4, max(needed))
        and tables.dtype == torch.int32
        and num_blocks == sum(needed) + 2
    )
    used = torch.cat([tables[b, :count] for b, count in enumerate(needed)])
    # no block shared, all in the pool
    assert len(set(used.tolist())) == sum(needed) and int(used.max()) < num_blocks
    assert used.tolist() != sorted(used.tolist())  # shuffled: logical order is not physical order
    with pytest.raises(ValueError, match="seq_lens"):
        shuffled_block_tables([4, 0], block_size)
    with pytest.raises(ValueError, match="block_size"):
        shuffled_block_tables([4], 0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_TRITON = """
import sys


class BlockTriton:  # what a machine without Triton (macOS, native Windows) looks like
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, BlockTriton())
"""


def test_without_triton_the_reference_works_and_the_kernel_says_what_to_use():
    code = BLOCK_TRITON + (
        "import torch\n"
        "import kvlib.cache, kvlib.engine, kvlib.quant, kvlib.course.bench\n"
        "import kvlib.kernels as K\n"
        "from kvlib import paged_decode_attention\n"
        "from tests.test_kernels import make_paged_cache\n"
        "assert not K.triton_available()\n"
        "inputs = make_paged_cache([5, 20], 4, 2, 16, 16, torch.float32)\n"
        "print('reference', tuple(K.paged_decode_attention_ref(*inputs).shape))\n"
        "try:\n"
        "    paged_decode_attention(*inputs)\n"
        "except K.TritonUnavailableError as error:\n"
        "    assert isinstance(error, ImportError)\n"
        "    print('kernel:', error)\n"
        "try:\n"
        "    K._decode_split_kernel\n"
        "except K.TritonUnavailableError:\n"
        "    print('kernel source: unavailable')\n"
        "assert 'triton' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "reference (2, 4, 16)"
    assert lines[1].startswith("kernel: paged_decode_attention launches a Triton kernel")
    for needed in ("No module named 'triton'", "Linux", "pip install triton", "_ref"):
        assert needed in lines[1], needed
    assert lines[2] == "kernel source: unavailable"


def test_with_triton_importing_kvlib_kernels_still_sets_the_interpreter_without_cuda():
    code = (
        "import os, sys, torch, kvlib.kernels as K\n"
        "assert 'triton' not in sys.modules\n"  # imported on first launch only
        "print(K.triton_available(), K.INTERPRETED, os.environ.get('TRITON_INTERPRET'))\n"
        "print(type(K._decode_split_kernel).__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    expected = "False None" if torch.cuda.is_available() else "True 1"
    kernel_type = "JITFunction" if torch.cuda.is_available() else "InterpretedFunction"
    assert result.stdout.splitlines() == [f"True {expected}", kernel_type]
