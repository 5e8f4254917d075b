"""kvlib.engine.sampler: a step's sampling on the device gives the per-request sampler's tokens and
logprobs, seed for seed and step after step, and syncs with the host once per step."""

import dataclasses
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.engine import SamplingParams
from kvlib.engine.runner import sample, token_logprobs
from kvlib.engine.sampler import _probs, is_greedy, sample_step, to_host

PARAMS = [
    SamplingParams(),
    SamplingParams(logprobs=3),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.8, logprobs=0),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1.0, logprobs=5),
    SamplingParams(temperature=0.9, top_p=0.3, logprobs=1),
    SamplingParams(temperature=1.0, top_k=10_000),
]


def make_params(rng, n):
    return [dataclasses.replace(rng.choice(PARAMS), seed=rng.randrange(10_000)) for _ in range(n)]


@pytest.mark.parametrize("vocab,dtype", [(97, torch.float32), (4096, torch.float32)])
def test_a_step_samples_the_per_request_samplers_tokens_seed_for_seed(vocab, dtype):
    rng = random.Random(vocab)
    for trial in range(40):
        params = make_params(rng, rng.randint(1, 9))
        mine = [torch.Generator().manual_seed(p.seed) for p in params]
        theirs = [torch.Generator().manual_seed(p.seed) for p in params]
        for step in range(3):  # the generators advance as the per-request ones do
            g = torch.Generator().manual_seed(1000 * trial + step)
            logits = (torch.randn(len(params), vocab, generator=g) * 3).to(dtype)
            ids, logprobs = to_host(sample_step(logits, params, mine))
            expected = [sample(row, p, gen) for row, p, gen in zip(logits, params, theirs)]
            assert ids == expected, (trial, step, params)
            for i, p in enumerate(params):
                if p.logprobs is None:
                    assert i not in logprobs
                else:
                    assert logprobs[i] == token_logprobs(logits[i], ids[i], p.logprobs)


def test_rows_are_sampled_as_alone_whatever_the_batch():
    params = [SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=s) for s in range(6)]
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 2
    batched, _ = to_host(
        sample_step(logits, params, [torch.Generator().manual_seed(p.seed) for p in params])
    )
    for i, p in enumerate(params):
        alone, _ = to_host(
            sample_step(logits[i : i + 1], [p], [torch.Generator().manual_seed(p.seed)])
        )
        assert alone == [batched[i]]


SYNCS = ["item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"]


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts calls of the Tensor methods that bring a value to the host."""
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_a_step_syncs_with_the_host_once(sync_counter):
    params = [p for p, _ in zip(itertools.cycle(PARAMS), range(12))]
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(1))
    generators = [torch.Generator().manual_seed(i) for i in range(12)]
    step = sample_step(logits, params, generators)
    assert sync_counter == []
    to_host(step)
    assert sync_counter == ["tolist"]
    sync_counter.clear()
    for row, p, g in zip(logits[:3], params, generators):  # the counter sees the old sampler's
        sample(row, p, g)
    assert len(sync_counter) == 3


def test_the_engine_transfers_once_per_step_that_samples(monkeypatch):
    from kvlib.engine import LLMEngine, overlap
    from kvlib.loaders.course_model import load_course_model

    transfers = []
    original = overlap.to_host

    def counted(step):
        transfers.append(step.num_rows)
        return original(step)

    monkeypatch.setattr(overlap, "to_host", counted)
    engine = LLMEngine(load_course_model(), num_blocks=60, max_num_batched_tokens=16)
    for i, prompt in enumerate([list(range(5, 45)), [1, 2, 3], [7] * 9]):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=4, logprobs=2)
        engine.add_request(str(i), prompt, params)
    produced = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs:
            produced.append(len(outputs))
    assert transfers == produced and len(produced) < len(engine.stats)  # prefill-only steps: none


# --- extreme parameters (issue 56, item 2) -------------------------------------------------------

EXTREME_FLOATS = [1e-46, 1e-38, 1e-30, 1e-12, 9.99e-6, 1e-5, 2e-5, 1e-3]


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.one_of(st.sampled_from([0.0, *EXTREME_FLOATS, 2.0]), st.floats(0, 2)),
    top_p=st.one_of(st.none(), st.sampled_from([*EXTREME_FLOATS, 1.0]), st.floats(1e-300, 1)),
    top_k=st.one_of(st.none(), st.integers(1, 70)),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**31),
)
def test_no_parameter_in_range_gives_a_degenerate_distribution(
    temperature, top_p, top_k, scale, seed
):
    """Whatever the temperature in [0, 2], top_p in (0, 1] and top_k: the token drawn has positive
    probability under the filtered distribution, which is finite and not empty; below 1e-5 (vLLM's
    rule) and at a top_p the most likely token reaches alone, the token is the argmax. Before
    the fix, temperature 1e-38 or top_p 1e-46 drew token 0 every step."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 64, generator=g) * scale
    logits[:, 0] = logits.min(dim=-1).values - 1  # token 0 is never the argmax, nor likely
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)] * 3
    generators = [torch.Generator().manual_seed(seed + i) for i in range(3)]
    ids, _ = to_host(sample_step(logits, params, generators))
    reference = [sample(row, params[0], torch.Generator().manual_seed(seed)) for row in logits]
    argmax = logits.argmax(dim=-1).tolist()
    if is_greedy(params[0]):
        assert ids == argmax and reference == argmax
        return
    probs = _probs(logits, params)
    # finite and never empty (the nucleus is not renormalized: a draw needs no normalization)
    assert torch.isfinite(probs).all() and (probs >= 0).all() and (probs.sum(-1) > 0).all()
    for row, token in enumerate(ids + reference):
        assert probs[row % 3, token] > 0, (row, token, params[0])
    top = probs.max(dim=-1).values
    if top_p is not None and bool((top_p <= top).all()):  # the argmax alone reaches top_p
        assert ids == argmax


@pytest.mark.parametrize("temperature,top_p", [(1e-38, None), (1.0, 1e-46), (1e-38, 1e-46)])
def test_the_issues_tiny_values_sample_the_argmax_not_token_0(temperature, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=1)] * 4
    ids, _ = to_host(sample_step(logits, params, [torch.Generator() for _ in range(4)]))
    assert ids == logits.argmax(dim=-1).tolist()
