"""kvlib on a CUDA GPU, against the same code on the CPU (`make test-gpu`; skipped without CUDA).

Tolerances: the course model runs in fp32 on both devices, where matmul reduction orders differ
(and TF32 stays off: torch's default for fp32 matmuls), so last-step logits agree within 1e-3 and
greedy and beam tokens are equal. Sampling cannot be token-equal across devices (a CUDA generator
draws another stream than a CPU one with the same seed): on the GPU it must be reproducible per
seed, independent of batching, respect top-k and equal greedy at top_k=1. The quantized decode
kernel compiled on the GPU matches its reference on the CPU within 5e-3 (fp32 queries, int8/fp8
codes; fp32 dots may run as TF32 on tensor cores, as in tests/test_kernels.py).

`KVLIB_GPU_TEST_DEVICE=cpu` runs these tests with "cuda" replaced by the CPU: a dry run of the
tests themselves (the comparisons are then trivial), not a GPU result.
"""

import os

import pytest
import torch

import kvlib.kernels  # noqa: F401  imported first: without CUDA it sets TRITON_INTERPRET
from kvlib.cache import CompactingPagedCache, EvictingCache, PagedCache, QuantizedPagedCache
from kvlib.cache.eviction_policies import StreamingLLM
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.experiments.quant_sweep import quant_factory
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.quant import QuantScheme

DEVICE = os.environ.get("KVLIB_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[3, 17, 42, 5, 99, 8, 64, 1, 23], [7, 7, 120, 31], [55] * 20, list(range(40, 73))]
CACHES = {
    "dynamic": "dynamic",
    "static": "static",
    "paged": "paged",
    "paged, blocks of 4": PagedCache.factory(block_size=4),
    "int8 per token": quant_factory("int8 per-token"),
    "int8 paged": QuantizedPagedCache.factory(key_scheme=QuantScheme("int8")),
    "StreamingLLM, no eviction": EvictingCache.factory(StreamingLLM(), None),
    "StreamingLLM, 12 tokens": EvictingCache.factory(StreamingLLM(), 12),
    "compacting paged": CompactingPagedCache.factory(),
}


@pytest.fixture(scope="module")
def models():
    return load_course_model(), load_course_model(device=DEVICE)


def padded(prompts, device):
    """Left-padded (B, T) ids and mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def test_forward_logits_match_the_cpu(models):
    cpu, gpu = models
    ids, mask = padded(PROMPTS, "cpu")
    expected = cpu(ids, attention_mask=mask)
    got = gpu(ids.to(DEVICE), attention_mask=mask.to(DEVICE)).cpu()
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", CACHES)
def test_greedy_generate_matches_the_cpu_with_every_cache(models, name):
    cpu, gpu = models
    ids, mask = padded(PROMPTS, "cpu")
    if name.startswith(("StreamingLLM", "compacting", "int8 per token")):
        ids, mask = ids[3:], mask[3:]  # caches that refuse padding: the longest prompt, unpadded
    expected = generate(cpu, ids, 16, attention_mask=mask, cache=CACHES[name])
    got = generate(gpu, ids.to(DEVICE), 16, attention_mask=mask.to(DEVICE), cache=CACHES[name])
    assert got.device.type == torch.device(DEVICE).type
    assert got.cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("cache", ["dynamic", "paged"])
def test_beam_search_matches_the_cpu(models, cache):
    cpu, gpu = models
    ids, mask = padded(PROMPTS[:2], "cpu")
    expected = generate(cpu, ids, 10, attention_mask=mask, num_beams=3, cache=cache)
    got = generate(
        gpu, ids.to(DEVICE), 10, attention_mask=mask.to(DEVICE), num_beams=3, cache=cache
    )
    assert got.cpu().tolist() == expected.tolist()


def test_sampling_on_the_gpu_is_seeded_and_respects_top_k(models):
    cpu, gpu = models
    ids, mask = padded(PROMPTS, DEVICE)

    def run(seed, **options):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        return generate(gpu, ids, 12, attention_mask=mask, temperature=0.9, generator=g, **options)

    assert torch.equal(run(0, top_k=20), run(0, top_k=20))
    assert not torch.equal(run(0), run(1))
    greedy = generate(gpu, ids, 12, attention_mask=mask)
    assert torch.equal(run(3, top_k=1), greedy)
    samples = run(5, num_samples=3, cache="paged")
    assert samples.shape == (3 * len(PROMPTS), ids.shape[1] + 12)
    if DEVICE != "cpu":
        with pytest.raises(ValueError, match="generator: expected a torch.Generator on the model"):
            generate(gpu, ids, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))


ENGINES = {
    "greedy": (dict(num_blocks=300), SamplingParams(max_tokens=16)),
    "prefix caching": (
        dict(num_blocks=300, max_num_batched_tokens=32, enable_prefix_caching=True),
        SamplingParams(max_tokens=16),
    ),
    "preemption": (dict(num_blocks=10, max_num_batched_tokens=24), SamplingParams(max_tokens=16)),
    "int8 cache": (
        dict(num_blocks=20, max_num_batched_tokens=16, kv_scheme=QuantScheme("int8")),
        SamplingParams(max_tokens=16),
    ),
}
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]
ENGINE_PROMPTS = PROMPTS + [SHARED + [1, 2], SHARED + [3], SHARED]


@pytest.mark.parametrize("name", ENGINES)
def test_engine_greedy_matches_the_cpu(models, name):
    cpu, gpu = models
    options, params = ENGINES[name]
    expected = LLMEngine(cpu, **options).generate(ENGINE_PROMPTS, params, use_tqdm=False)
    engine = LLMEngine(gpu, **options)
    got = engine.generate(ENGINE_PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    if name == "preemption":
        assert engine.summary()["preemptions"] >= 1
    if name == "prefix caching":
        assert engine.summary()["prefix_hit_rate"] > 0


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8),
        dict(temperature=0.9, top_k=20),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=1.0, top_k=1),
    ],
    ids=["temperature", "top-k", "top-p", "top-k=1"],
)
def test_engine_sampling_on_the_gpu_is_seeded_and_independent_of_batching(models, params):
    _, gpu = models
    each = [SamplingParams(seed=i, max_tokens=12, **params) for i in range(len(ENGINE_PROMPTS))]
    engine = LLMEngine(gpu, num_blocks=12, max_num_batched_tokens=24)
    batched = engine.generate(ENGINE_PROMPTS, each, use_tqdm=False)
    for prompt, p, output in zip(ENGINE_PROMPTS, each, batched):
        (alone,) = LLMEngine(gpu, num_blocks=60).generate([prompt], p, use_tqdm=False)
        assert output.output_token_ids == alone.output_token_ids
    if params.get("top_k") == 1:
        greedy = LLMEngine(gpu, num_blocks=60).generate(
            ENGINE_PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False
        )
        assert [o.output_token_ids for o in batched] == [o.output_token_ids for o in greedy]


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3fn"])
def test_quantized_decode_kernel_on_the_gpu_matches_the_cpu_reference(fmt):
    from kvlib.cache.block_table import shuffled_block_tables
    from kvlib.kernels import paged_decode_attention, paged_decode_attention_ref
    from kvlib.quant import quantize

    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([1, 40, 777, 4100], dtype=torch.int32)
    block_tables, num_blocks = shuffled_block_tables(seq_lens, 16, generator=g)
    k = torch.randn(num_blocks, 16, 8, 128, generator=g)
    v = torch.randn(num_blocks, 16, 8, 128, generator=g)
    q = torch.randn(4, 32, 128, generator=g)
    qk, qv = quantize(k, QuantScheme(fmt)), quantize(v, QuantScheme(fmt))
    args = (q, qk.codes, qv.codes, block_tables, seq_lens)
    scales = {"k_scale": qk.scale[..., 0].contiguous(), "v_scale": qv.scale[..., 0].contiguous()}
    expected = paged_decode_attention_ref(*args, **scales)
    for num_splits in (None, 1, 8):
        got = paged_decode_attention(
            *(a.to(DEVICE) for a in args),
            num_splits=num_splits,
            **{name: s.to(DEVICE) for name, s in scales.items()},
        )
        torch.testing.assert_close(got.cpu(), expected, rtol=5e-3, atol=5e-3)


# --- issue 36 part 3: the engine's GPU code paths ------------------------------------------------


def test_a_sampled_step_waits_for_the_gpu_once(models):
    """`sample_step` queues its work without a sync (CUDA's sync debug mode raises on one);
    `to_host` is the step's single transfer."""
    from kvlib.engine.sampler import sample_step, to_host

    if DEVICE != "cuda":
        pytest.skip("sync debug mode needs CUDA")
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=20, seed=1, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
    ]
    logits = torch.randn(3, 1000, device=DEVICE)
    generators = [torch.Generator(device=DEVICE).manual_seed(p.seed or 0) for p in params]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = sample_step(logits, params, generators)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids, logprobs = to_host(step)
    assert ids[0] == int(logits[0].argmax()) and set(logprobs) == {1}


def test_engine_cuda_graphs_capture_replay_and_match_eager(models):
    """Decode-only steps captured per bucket and replayed give the eager kernel engine's tokens
    (greedy and seeded sampling)."""
    from kvlib.engine.runner import ModelRunner

    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    _, gpu = models
    options = dict(num_blocks=40, max_num_batched_tokens=32)
    for params in (
        SamplingParams(max_tokens=12),
        SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12),
    ):
        eager = LLMEngine(gpu, **options).generate(ENGINE_PROMPTS, params, use_tqdm=False)
        engine = LLMEngine(gpu, **options)
        engine.runner = ModelRunner(
            gpu, engine.storage, engine.manager, cuda_graphs=True, max_graph_batch=8
        )
        got = engine.generate(ENGINE_PROMPTS, params, use_tqdm=False)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in eager]
        runner = engine.runner.graph_runner
        assert runner.capture and len(runner.graphs) >= 2, runner.steps_by_bucket


def test_an_engine_decode_step_waits_for_the_gpu_once(models):
    """After warm-up (kernels compiled, graphs captured), a decode step of the kernel
    engine, eager or replayed from a CUDA graph, syncs once: `to_host`'s transfer (CUDA's sync
    debug mode warns on every synchronizing call, blocking host-to-device copies included)."""
    import warnings

    from kvlib.engine.runner import ModelRunner

    if DEVICE != "cuda":
        pytest.skip("sync debug mode needs CUDA")
    _, gpu = models
    for graphs in (False, True):
        engine = LLMEngine(gpu, num_blocks=40)
        engine.runner = ModelRunner(gpu, engine.storage, engine.manager, cuda_graphs=graphs)
        for i, prompt in enumerate(ENGINE_PROMPTS[:3]):
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=8)
            engine.add_request(str(i), prompt, params)
        for _ in range(3):  # the prompts, then two decode steps (compile, capture)
            engine.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert len(outputs) == 3
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, (graphs, syncs)
