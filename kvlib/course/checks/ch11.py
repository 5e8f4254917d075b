"""Chapter 11's graded questions, run under Triton's interpreter on a CPU: the block-table address
arithmetic, the split-K (LSE) reduce kernel, and masking the last partial block."""

from __future__ import annotations

import numpy as np
import torch

# kvlib.kernels sets TRITON_INTERPRET=1 without a GPU: import it before triton.
import kvlib.kernels  # noqa: F401

# isort: split
try:
    import triton
except ImportError:  # macOS, native Windows: `check()` imports every chapter's questions
    triton = None  # so that chapters 1-10 and 12 grade without Triton; chapter 11's fail

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Remote, Submission, question
from kvlib.ref.attention import attention
from kvlib.ref.online_softmax import merge_partials
from kvlib.testing import assert_close


@question(function="physical_slots")
def test_physical_slots(submission: Submission) -> None:
    physical_slots = submission.function("physical_slots")
    drawn = submission.rng()
    cases = submission.fixed(
        [([3, 0, 7], 40, 16), ([5], 1, 16), ([2, 9, 4, 1], 128, 32), ([6, 2], 17, 16)]
    )
    for _ in range(2):  # drawn afresh on every run
        block_size = int(drawn.choice([1, 4, 16, 32]))
        table = [int(b) for b in drawn.permutation(64)[: int(drawn.integers(1, 9))]]
        seq_len = int(
            drawn.integers((len(table) - 1) * block_size + 1, len(table) * block_size + 1)
        )
        cases.append((table, seq_len, block_size))
    for table, seq_len, block_size in cases:
        block_table = torch.tensor(table, dtype=torch.int32)
        expected = [table[t // block_size] * block_size + t % block_size for t in range(seq_len)]
        got = physical_slots(block_table.clone(), seq_len, block_size)
        assert isinstance(got, torch.Tensor), (
            f"physical_slots should return a torch.Tensor, got {type(got).__name__}"
        )
        assert got.shape == (seq_len,), (
            f"expected {seq_len} slots (one per token), got shape {tuple(got.shape)}"
        )
        assert not got.is_floating_point() and got.dtype != torch.bool, (
            f"slots are indices: expected an integer dtype, got {got.dtype}"
        )
        wrong = [t for t in range(seq_len) if int(got[t]) != expected[t]]
        tokens = range(seq_len)
        mistakes = {
            "block id + offset: a block's first slot is block id × block_size": lambda: [
                table[t // block_size] + t % block_size for t in tokens
            ],
            "the logical position itself: look the block up in the block table": lambda: list(
                tokens
            ),
            "the block id alone: add the offset t % block_size": lambda: [
                table[t // block_size] * block_size for t in tokens
            ],
        }
        with naming_mistakes([int(s) for s in got.tolist()], mistakes):
            assert not wrong, (
                f"block_table={table}, block_size={block_size}: token {wrong[0]} lives in slot "
                f"{expected[wrong[0]]}, you gave {int(got[wrong[0]])}"
            )


def _launch(kernel, grid, args, kwargs, out: int) -> list:
    """`kernel[grid](*args, **kwargs)`; the arguments after the launch. A graded kernel (a
    `Remote`) runs in the learner's process, under Triton's interpreter, and must be a
    `triton.runtime.jit.JITFunction`; a notebook's own kernel runs here."""
    if isinstance(kernel, Remote):
        return kernel.launch(grid, *args, _mutates=(out,), **kwargs).args
    kernel[grid](*args, **kwargs)
    return list(args)


def launch_reduce(kernel, partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Launch a learner's reduce kernel: partial_out (R, splits, D), partial_lse (R, splits) -> out
    (R, D)."""
    rows, num_splits, head_dim = partial_out.shape
    out = torch.full((rows, head_dim), float("nan"))
    args = (partial_out, partial_lse, out, num_splits)
    return _launch(
        kernel,
        (rows,),
        args,
        {"HEAD_DIM": head_dim, "BLOCK_S": triton.next_power_of_2(num_splits)},
        out=2,
    )[2]


@question(function="reduce_kernel")
def test_reduce_kernel(submission: Submission) -> None:
    kernel = submission.function("reduce_kernel")
    rng, drawn = np.random.default_rng(11), submission.rng()
    cases = submission.fixed([(3, 4, 0.0, rng), (2, 5, 1000.0, rng), (4, 1, 0.0, rng)])
    cases.append(  # drawn afresh on every run: shapes, a shift and the values
        (*(int(n) for n in drawn.integers(1, (5, 9))), float(drawn.normal() * 300), drawn)
    )
    for rows, num_splits, shift, values in cases:
        partial_out = values.normal(size=(rows, num_splits, 16)).astype(np.float32)
        partial_lse = (values.normal(size=(rows, num_splits)) * 3 + shift).astype(np.float32)
        if num_splits > 1:
            partial_lse[0, -1] = -np.inf  # an empty split
            partial_out[0, -1] = 0.0
        expected, _ = merge_partials(list(partial_out.transpose(1, 0, 2)), list(partial_lse.T))
        got = launch_reduce(kernel, torch.from_numpy(partial_out), torch.from_numpy(partial_lse))
        assert torch.isfinite(got).all(), (
            f"with {num_splits} splits and lse around {shift:.4g} (one split empty, lse = -inf) "
            "your output has non-finite values: "
            "weight each split by exp(lse - max lse)"
        )
        mistakes = _reduce_mistakes(partial_out.astype(np.float64), partial_lse.astype(np.float64))
        with naming_mistakes(got, mistakes, rtol=1e-4, atol=1e-5):
            assert_close(
                got,
                expected,
                name=f"reduce of {num_splits} splits over {rows} rows (lse around {shift:.4g})",
                rtol=1e-4,
                atol=1e-5,
            )


def _reduce_mistakes(partial_out: np.ndarray, partial_lse: np.ndarray) -> dict:
    """reduce_kernel's common mistakes, the first from the chapter's pitfalls: partial_out
    (R, splits, D), partial_lse (R, splits)."""
    weights = np.exp(partial_lse - partial_lse.max(axis=1, keepdims=True))[:, :, None]
    return {
        "the splits' outputs averaged: weight each by exp(lse - max lse), its share of the "
        "softmax's denominator": lambda: partial_out.mean(axis=1),
        "the weighted sum not normalised: divide by the sum of the weights exp(lse - max "
        "lse)": lambda: (weights * partial_out).sum(axis=1),
    }


def launch_masked_decode(kernel, q, k_buffer, v_buffer, seq_len, block_n=16):
    """Launch a learner's masked decode kernel: q (D,), buffers (S_buf, D), the first seq_len rows
    valid -> out (D,)."""
    out = torch.full((q.shape[0],), float("nan"))
    args = (q, k_buffer, v_buffer, out, seq_len, q.shape[0] ** -0.5)
    return _launch(kernel, (1,), args, {"HEAD_DIM": q.shape[0], "BLOCK_N": block_n}, out=3)[3]


@question(function="masked_decode_kernel")
def test_masked_decode_kernel(submission: Submission) -> None:
    kernel = submission.function("masked_decode_kernel")
    rng, drawn = np.random.default_rng(12), submission.rng()
    cases = [
        *submission.fixed((n, rng) for n in (1, 5, 16, 37)),
        (int(drawn.integers(1, 49)), drawn),
    ]
    for seq_len, values in cases:  # the last drawn afresh on every run
        q, keys, values = (
            values.normal(size=32),
            values.normal(size=(seq_len, 32)),
            values.normal(size=(seq_len, 32)),
        )
        # the buffers run on past seq_len, holding garbage (another sequence's tokens)
        padded = 16 * (seq_len // 16 + 2)
        k_buffer, v_buffer = np.full((padded, 32), 30.0), np.full((padded, 32), -50.0)
        k_buffer[:seq_len], v_buffer[:seq_len] = keys, values
        expected = attention(q[None, :], keys, values)[0]
        as_torch = [torch.tensor(a, dtype=torch.float32) for a in (q, k_buffer, v_buffer)]
        got = launch_masked_decode(kernel, *as_torch, seq_len)
        name = f"attention over the first {seq_len} of {padded} buffered tokens (tiles of 16)"
        mistakes = _masked_decode_mistakes(q, k_buffer, v_buffer, seq_len, 16)
        with naming_mistakes(got, mistakes, rtol=1e-4, atol=1e-4):
            assert_close(got, expected, name=name, rtol=1e-4, atol=1e-4)


def _masked_decode_mistakes(q, k_buffer, v_buffer, seq_len: int, block_n: int) -> dict:
    """masked_decode_kernel's common mistakes, the first two from the chapter's pitfalls (the
    last partial tile): q (D,), buffers (S_buf, D), float64."""
    scale, read = q.shape[0] ** -0.5, -(-seq_len // block_n) * block_n  # whole tiles
    zeros = np.zeros((read - seq_len, q.shape[0]))

    def attend(k, v, scale=scale):
        scores = k @ q * scale
        weights = np.exp(scores - scores.max())
        return weights @ v / weights.sum()

    keys, values = k_buffer[:seq_len], v_buffer[:seq_len]
    return {
        "the loads masked, not the scores: a zeroed key still scores 0 and takes weight, set "
        "the scores past seq_len to -inf": lambda: attend(
            np.concatenate([keys, zeros]), np.concatenate([values, zeros])
        ),
        "the last tile not masked: the rows past seq_len (another sequence's) take weight": (
            lambda: attend(k_buffer[:read], v_buffer[:read])
        ),
        "the scores not multiplied by `scale`": lambda: attend(keys, values, scale=1.0),
    }
