"""kvlib.cache.simulate: every slot of the pool is accounted for at every step, every request
finishes, and paging holds more token states per allocated slot than contiguous reservation."""

import numpy as np
import pytest

from kvlib.cache.simulate import simulate, synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(120, seed=3, max_len=512, prompt_median=64, output_median=48)


def token_steps(trace):
    """Sum over decode steps of the tokens held, if every request runs once, uninterrupted: at its
    k-th step (k = 1..output_len) a request holds prompt_len + k tokens."""
    return sum(r.output_len * r.prompt_len + r.output_len * (r.output_len + 1) // 2 for r in trace)


def test_contiguous_accounts_for_every_slot(trace):
    result = simulate(trace, capacity_tokens=4000, max_len=512)
    assert result.used.sum() == token_steps(trace)  # each request ran exactly its output
    allocated = result.used + result.reserved + result.internal
    assert (allocated + result.external <= result.capacity).all()
    assert (result.reserved >= 0).all() and (result.internal >= 0).all()
    assert (result.external > 0).any()  # requests waited while free space sat unusable
    assert sorted(result.finished_at) == [r.request_id for r in trace]
    assert result.running.max() <= 4000 // 512
    for r in trace:  # none finishes before it could have
        assert result.finished_at[r.request_id] >= r.arrival + r.output_len - 1


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_wastes_at_most_a_block_per_request(trace, block_size):
    result = simulate(trace, capacity_tokens=4000, max_len=512, block_size=block_size)
    assert (result.internal < block_size * np.maximum(result.running, 1)).all()
    # a preempted request resumes with its generated tokens (recomputed in one prefill), so it
    # still runs exactly output_len decode steps, holding prompt_len + k tokens at the k-th
    assert result.used.sum() == token_steps(trace)
    assert (result.used + result.internal <= result.capacity).all()
    assert sorted(result.finished_at) == [r.request_id for r in trace]
    if block_size == 1:
        assert (result.internal == 0).all()


def test_paging_holds_more_tokens_and_finishes_sooner(trace):
    contiguous = simulate(trace, capacity_tokens=4000, max_len=512)
    paged = simulate(trace, capacity_tokens=4000, max_len=512, block_size=16)
    assert paged.used_fraction > 0.9 > 0.6 > contiguous.used_fraction
    assert paged.running.mean() > contiguous.running.mean()
    assert paged.steps < contiguous.steps


def test_a_preempted_request_resumes_with_its_generated_tokens():
    """Two requests of 4 + 12 tokens in 6 blocks of 4: both need a fourth block at step 8, so
    the newer is preempted holding 12 tokens (8 generated) and waits until the older finishes at
    step 11. Readmitted at step 12 with prompt + generated tokens (recomputed in one prefill), it
    needs 4 more steps and finishes at step 15; readmitted with its prompt alone it would
    regenerate its 8 tokens one step at a time and finish at step 23."""
    from kvlib.cache.simulate import Request

    trace = [Request(0, 0, 4, 12), Request(1, 0, 4, 12)]
    result = simulate(trace, capacity_tokens=24, max_len=16, block_size=4)
    assert result.preemptions == 1 and result.finished_at == {0: 11, 1: 15}
    assert result.running.tolist() == [2] * 8 + [1] * 8
    assert result.used[12] == 13  # readmitted with its 12 tokens, and generated one more
    assert result.used.sum() == token_steps(trace)  # no token generated twice


def test_trace_and_simulation_validate():
    trace = synthetic_trace(5, seed=0, max_len=64)
    assert all(r.prompt_len + r.output_len <= 64 and r.output_len >= 1 for r in trace)
    with pytest.raises(ValueError, match="arrival_rate: expected > 0"):
        synthetic_trace(5, arrival_rate=0)
    with pytest.raises(ValueError, match="capacity_tokens: expected at least max_len=64"):
        simulate(trace, capacity_tokens=32, max_len=64)
    with pytest.raises(ValueError, match="capacity_tokens: expected room for one max_len=64"):
        simulate(trace, capacity_tokens=64, max_len=64, block_size=16)
    with pytest.raises(ValueError, match="longer than max_len=32"):
        simulate(trace, capacity_tokens=4096, max_len=32)
