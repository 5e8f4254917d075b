"""Steps with prompt tokens through static, token-bucketed buffers (kvlib.engine.mixed_graph), on
the CPU: the eager path a CUDA graph replays, every row through the fused varlen kernel under
Triton's interpreter. Each prompt's tokens are those it generates alone; padding rows write only
the scratch block. The last test captures and replays the buckets on a CUDA GPU."""

import pytest
import torch

import kvlib.kernels  # noqa: F401  imported first: it sets TRITON_INTERPRET on the CPU
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.engine.cuda_graph import bucket_for
from kvlib.engine.mixed_graph import token_buckets
from kvlib.engine.runner import ModelRunner
from kvlib.loaders.course_model import load_course_model
from tests.test_engine import COURSE_PROMPTS, alone

pytest.importorskip("triton")


def test_token_buckets_double_up_to_the_budget():
    assert token_buckets(16) == (16,)
    assert token_buckets(17) == (16, 32)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    for n in range(1, 100):
        size = bucket_for(n, token_buckets(100))
        assert size >= n and size < 2 * max(n, 16)


def mixed_engine(model, *, cuda_graphs=False, **options):
    engine = LLMEngine(model, **options)
    config = engine.config
    engine.runner = ModelRunner(
        model,
        engine.storage,
        engine.manager,
        cuda_graphs=cuda_graphs,
        mixed_graphs=True,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
    )
    return engine


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def test_bucketed_mixed_steps_give_the_tokens_of_each_prompt_alone(course):
    prompts = COURSE_PROMPTS[:3]  # 5, 70 and 17 tokens: chunks of 20 beside decode rows
    engine = mixed_engine(course, num_blocks=60, max_num_seqs=4, max_num_batched_tokens=20)
    pad = engine.manager.pool.num_blocks
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3))
    before = [p.clone() for p in engine.storage._pools()]
    engine.step()  # 20 prompt tokens, padded to 32 rows
    engine.step()  # a chunk of the long prompt beside a decode row, padded to 32 rows
    held = {b for table in engine.manager.block_tables.values() for b in table}
    for old, new in zip(before, engine.storage._pools()):
        changed = {int(b) for b in (old != new).flatten(1).any(1).nonzero()}
        assert changed <= held | {pad} and pad in changed  # padding rows: the scratch block only
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    assert [outputs[str(i)] for i in range(3)] == alone(course, prompts, 3)
    runner = engine.runner.mixed_runner
    assert runner is not None and not runner.capture  # eager on the CPU
    mixed = sum(any(n > 1 for _, n in s.scheduled) and any(n == 1 for _, n in s.scheduled)
                for s in engine.stats)  # fmt: skip
    assert mixed >= 2 and sum(runner.steps_by_bucket.values()) == len(engine.stats)
    assert set(runner.steps_by_bucket) == {16, 32}  # padded: no step had exactly 16 or 32 rows


def _scratch_block_after_two_steps(course, fill: float) -> list[torch.Tensor]:
    """The scratch block of every pool after two padded steps, while every `torch.empty_like`
    hands back memory holding `fill` (what a reused allocation may hold)."""
    real_empty_like = torch.empty_like

    def reused(*args, **kwargs):
        out = real_empty_like(*args, **kwargs)
        return out.fill_(fill) if out.is_floating_point() else out

    engine = mixed_engine(course, num_blocks=60, max_num_seqs=4, max_num_batched_tokens=20)
    for i, prompt in enumerate(COURSE_PROMPTS[:3]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3))
    pad = engine.manager.pool.num_blocks
    torch.empty_like = reused
    try:
        engine.step()
        engine.step()
    finally:
        torch.empty_like = real_empty_like
    return [pool[pad].clone() for pool in engine.storage._pools()]


def test_padding_rows_write_the_same_scratch_values_whatever_memory_held(course):
    """Issue 56, item 12: the kernel skips padding rows, and their attention output was an
    uninitialized tensor. Reused memory holding ~1e30 overflowed the next RMSNorm to K = V = 0,
    so the scratch block looked unwritten (the flake of the test above, 1 run in 2 in a full
    suite). Padding rows now attend to zeros: their writes are the same whatever memory held."""
    clean = _scratch_block_after_two_steps(course, 0.0)
    for fill in (1e30, float("nan")):
        dirty = _scratch_block_after_two_steps(course, fill)
        for layer, (a, b) in enumerate(zip(clean, dirty)):
            assert torch.isfinite(b).all() and torch.equal(a, b), (fill, layer)
    assert all(bool(block.abs().sum() > 0) for block in clean)  # written: not the zeros it held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_steps_are_captured_and_replayed_on_a_gpu():
    """On CUDA: steps with prompt tokens replay captured graphs (one per token bucket), decode-only
    steps the decode graphs; greedy tokens equal the eager engine's, and the run's wall time,
    prefill included, is below the eager one's."""
    import time

    model = load_course_model(device="cuda")
    prompts = COURSE_PROMPTS * 6
    options = dict(num_blocks=600, max_num_seqs=64, max_num_batched_tokens=256)
    results, seconds = {}, {}
    for graphs in (False, True, False, True):  # interleaved; the second run of each is kept
        engine = mixed_engine(model, cuda_graphs=True, **options) if graphs else None
        if engine is None:
            engine = LLMEngine(model, **options)
            engine.runner.decode_kernel = True
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_tokens=32), use_tqdm=False)
        torch.cuda.synchronize()
        seconds[graphs] = time.perf_counter() - start
        results[graphs] = [o.output_token_ids for o in outputs]
        if graphs:
            runner = engine.runner.mixed_runner
            assert runner.capture and len(runner.graphs) >= 2, runner.steps_by_bucket
    assert results[True] == results[False]
    print(f"eager {seconds[False]:.3f} s, mixed and decode graphs {seconds[True]:.3f} s")
    assert seconds[True] < seconds[False], seconds
