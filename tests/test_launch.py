"""The split-K launch rule (`kvlib.ops.launch`)."""

import pytest

from kvlib.ops.launch import choose_num_splits


def test_choose_num_splits():
    # 512 programs are already 3.9 per SM on 132 SMs: doubling to 1024 would pass four
    assert choose_num_splits(128, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(8, 8, 32768, num_sms=132) == 8  # 64 pairs x 8 = 512 programs
    # one long sequence: split while the programs stay within four per SM
    assert choose_num_splits(1, 8, 131072, num_sms=132) == 64
    assert choose_num_splits(1, 4, 131072, num_sms=132) == 128  # the cap
    # too short to split into 256-token chunks
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 16  # 16 splits of 256 tokens
    for batch in (1, 2, 4, 8, 16, 64):
        n = choose_num_splits(batch, 8, 65536, num_sms=132)
        assert n & (n - 1) == 0  # a power of two
        assert n == 1 or batch * 8 * n <= 4 * 132  # never more than four programs per SM
        assert n == 128 or batch * 8 * 2 * n > 4 * 132  # and as many as that allows
    with pytest.raises(ValueError, match="num_sms: expected an int >= 1, got 0"):
        choose_num_splits(1, 1, 1, num_sms=0)
