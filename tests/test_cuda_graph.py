"""Decode-only steps through static, bucketed buffers (kvlib.engine.cuda_graph), on the CPU: the
eager path a CUDA graph would replay. Padded buckets give each prompt's tokens generated alone;
padding rows write only the scratch block. Capture and replay on CUDA: tests/test_gpu.py."""

import pytest
import torch

import kvlib.kernels  # noqa: F401  imported first: it sets TRITON_INTERPRET on the CPU
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.engine.cuda_graph import bucket_for, bucket_sizes
from kvlib.engine.runner import ModelRunner
from kvlib.quant import QuantScheme
from tests.test_engine import COURSE_PROMPTS, alone


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(3) == (1, 2, 4)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 24)
    for n in range(1, 25):
        size = bucket_for(n, bucket_sizes(20))
        assert size >= n and all(s < n for s in bucket_sizes(20) if s < size)
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(25, bucket_sizes(20))


@pytest.fixture(scope="module")
def course():
    from kvlib.loaders.course_model import load_course_model

    return load_course_model()


def graph_engine(model, *, decode_kernel=False, max_graph_batch=8, **options):
    engine = LLMEngine(model, **options)
    engine.runner = ModelRunner(
        model,
        engine.storage,
        engine.manager,
        decode_kernel=decode_kernel,
        cuda_graphs=True,
        max_graph_batch=max_graph_batch,
    )
    return engine


GRAPH_BATCHINGS = {
    "chunked prefill": dict(num_blocks=300, max_num_batched_tokens=16),
    "preemption": dict(num_blocks=14, max_num_batched_tokens=48),
    "prefix caching": dict(num_blocks=300, max_num_batched_tokens=32, enable_prefix_caching=True),
}


@pytest.mark.parametrize("name", GRAPH_BATCHINGS)
def test_bucketed_decode_steps_give_the_tokens_of_each_prompt_alone(course, name):
    engine = graph_engine(course, **GRAPH_BATCHINGS[name])
    outputs = engine.generate(COURSE_PROMPTS, SamplingParams(max_tokens=24), use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == alone(course, COURSE_PROMPTS, 24)
    runner = engine.runner.graph_runner
    assert runner is not None and not runner.capture  # eager on the CPU
    # several buckets ran, padded ones among them (a step of n rows at a bucket above n)
    assert len(runner.steps_by_bucket) >= 3, runner.steps_by_bucket
    padded = {
        bucket_for(len(s.scheduled), runner.sizes)
        for s in engine.stats
        if s.scheduled and all(n == 1 for _, n in s.scheduled) and len(s.scheduled) <= 8
    }
    assert padded == set(runner.steps_by_bucket)
    assert any(
        len(s.scheduled) not in runner.sizes and all(n == 1 for _, n in s.scheduled)
        for s in engine.stats
    )
    assert engine.storage.num_blocks_in_use == 0


def test_padding_rows_write_only_the_scratch_block(course):
    engine = graph_engine(course, num_blocks=40, max_num_batched_tokens=512)
    pad = engine.manager.pool.num_blocks
    assert engine.storage.key_cache[0].shape[0] == pad + 1  # the scratch block past the pool
    for i, prompt in enumerate(COURSE_PROMPTS[:3]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=5))
    engine.step()  # the three prompts
    before = [p.clone() for p in engine.storage._pools()]
    engine.step()  # three decode rows at bucket 4: one padding row
    assert engine.runner.graph_runner.steps_by_bucket == {4: 1}
    held = {b for table in engine.manager.block_tables.values() for b in table}
    for old, new in zip(before, engine.storage._pools()):
        changed = {int(b) for b in (old != new).flatten(1).any(1).nonzero()}
        assert changed <= held | {pad} and pad in changed


def test_seeded_sampling_and_the_quantized_cache_through_buckets(course):
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=i, max_tokens=10)
        for i in range(len(COURSE_PROMPTS))
    ]
    options = dict(num_blocks=40, max_num_batched_tokens=32, kv_scheme=QuantScheme("int8"))
    graphs = graph_engine(course, **options).generate(COURSE_PROMPTS, params, use_tqdm=False)
    eager = LLMEngine(course, **options).generate(COURSE_PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in graphs] == [o.output_token_ids for o in eager]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the interpreter runs CPU tensors only where CUDA is absent; on a GPU, "
    "tests/test_gpu.py captures and replays the compiled kernel",
)
def test_the_kernel_decodes_bucketed_steps_under_the_interpreter(course):
    pytest.importorskip("triton")
    prompts = [[3, 14, 15, 92, 65], list(range(40, 60)), [7] * 9]
    engine = graph_engine(
        course, decode_kernel=True, max_graph_batch=4, num_blocks=60, max_num_batched_tokens=64
    )
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == alone(course, prompts, 4)
    runner = engine.runner.graph_runner
    assert runner.launch["num_splits"] == engine.runner._kernel_splits()
    assert runner.steps_by_bucket == {4: 3}  # three decode steps of three rows, padded to four
    assert torch.device(runner.device).type == "cpu" and not runner.capture
