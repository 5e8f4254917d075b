"""The split-K launch rule (`kvlib.ops.launch`)."""

import pytest

from kvlib.ops.launch import choose_num_splits


def test_choose_num_splits():
    # 1024 programs already give 132 SMs four each; 512 are just short of 4 x 132
    assert choose_num_splits(128, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 2
    # one long sequence: split up to the cap
    assert choose_num_splits(1, 8, 131072, num_sms=132) == 64
    # too short to split into 256-token chunks
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 16  # 16 splits of 256 tokens
    for batch in (1, 2, 4, 8, 16):
        n = choose_num_splits(batch, 8, 65536, num_sms=132)
        assert n & (n - 1) == 0  # a power of two
        assert batch * 8 * n >= 4 * 132 or n == 64  # four programs per SM, or capped
        assert n == 1 or batch * 8 * (n // 2) < 4 * 132  # and no more splits than that needs
    with pytest.raises(ValueError, match="num_sms: expected an int >= 1, got 0"):
        choose_num_splits(1, 1, 1, num_sms=0)
