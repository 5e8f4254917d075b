"""GPU launch heuristics for the decode kernels: how many split-K programs to launch.

Pure Python (no torch, no triton), so chapter 4 can discuss the rule on a laptop and
`kvlib.kernels` can apply it on a GPU.
"""

from __future__ import annotations

from kvlib._validate import check_positive_int

__all__ = ["choose_num_splits"]


def choose_num_splits(
    batch_size: int,
    num_kv_heads: int,
    seq_len: int,
    *,
    num_sms: int,
    programs_per_sm: int = 4,
    min_tokens_per_split: int = 256,
    max_splits: int = 128,
) -> int:
    """How many split-K chunks per (sequence, KV head) keep a GPU's memory system busy in decode.

    Without splitting, decode launches `B · H_kv` programs, each streaming one sequence's K/V for
    one KV head. A memory-bound kernel needs several programs resident on every SM, each with
    loads in flight, to reach the bandwidth limit; one program per SM is not enough. Splitting
    multiplies the programs by `num_splits`, at the cost of a reduce. We double the split count
    while the doubled count still launches at most `programs_per_sm` programs per SM, never giving
    a split fewer than `min_tokens_per_split` tokens and never passing `max_splits`: the most
    splits that stay within four programs per SM (between two and four, unless a cap stops it).

    The constants are measured, not guessed: on an H100 SXM (132 SMs), the sweep in
    `results/decode_tuning.csv` (`python -m kvlib.experiments.decode_tuning`, the best launch
    settings at each split count, 12 shapes) found one program per SM 5-10% slower than the best
    wherever the sequences were long enough to split, from about two per SM within 2%, and more
    than four per SM slower again, slowly (13% more time at 62 per SM for 8 sequences of 4k
    tokens, 26% at 500 for 64 of them): extra programs find less to do each and the reduce merges
    more partials.
    The split-K idea is Flash-Decoding's (Dao et al., 2023).

    Args:
        batch_size, num_kv_heads, seq_len: the decode batch's shape (S = longest sequence).
        num_sms: streaming multiprocessors (e.g. 132 on an H100 SXM).
        programs_per_sm, min_tokens_per_split, max_splits: the rule's constants (ints >= 1).
    Returns:
        num_splits: a power of two >= 1.
    Raises:
        ValueError: an argument is not an int >= 1 (the message names it).
    """
    programs = check_positive_int("batch_size", batch_size) * check_positive_int(
        "num_kv_heads", num_kv_heads
    )
    seq_len = check_positive_int("seq_len", seq_len)
    target = check_positive_int("num_sms", num_sms) * check_positive_int(
        "programs_per_sm", programs_per_sm
    )
    min_tokens = check_positive_int("min_tokens_per_split", min_tokens_per_split)
    max_splits = check_positive_int("max_splits", max_splits)
    num_splits = 1
    while (
        programs * 2 * num_splits <= target
        and 2 * num_splits <= max_splits
        and seq_len // (2 * num_splits) >= min_tokens
    ):
        num_splits *= 2
    return num_splits
