"""kvlib.engine.sampler: a step's sampling on the device gives the per-request sampler's tokens and
logprobs, seed for seed and step after step, and syncs with the host once per step."""

import dataclasses
import itertools
import random

import pytest
import torch

from kvlib.engine import SamplingParams
from kvlib.engine.runner import sample, token_logprobs
from kvlib.engine.sampler import sample_step, to_host

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
