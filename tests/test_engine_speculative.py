"""kvlib.engine.speculative: speculative decoding inside the serving engine (issue 59). The oracle
is the same engine without speculation: greedy outputs token-identical across batch sizes, k,
prefix caching, stop tokens, max_tokens, a pool too small for the drafts, and beside sampled
requests; the block pool's invariants after every step, no block leaked, and no prefix-cache hash
on a block that holds a rejected token. Sampled requests (speculative sampling): the joint
distribution of their first tokens against the exact one of the engine's sampler, on a stub model
whose logits are a table (a chi-square fit, whose power three wrong rules injected into the engine
show), and a seeded request's tokens whatever its batch."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import kvlib.engine.speculative as speculative_module
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.engine import LLMEngine, SamplingParams, SpeculativeConfig, StreamingEviction, sampler
from kvlib.engine.request import FinishReason
from kvlib.engine.sampler import sampling_distribution
from kvlib.engine.speculative import verify_sampled
from kvlib.loaders.course_model import load_course_model
from kvlib.speculative.verify import speculative_accept


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def repetitive_prompts(batch_size, seed=0, vocab=120):
    """Prompts that repeat a short random phrase (so prompt lookup finds n-grams), of varied
    lengths, some with a noisy tail (so some drafts are rejected)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch_size):
        phrase = torch.randint(0, vocab, (4 + i % 4,), generator=g).tolist()
        noise = torch.randint(0, vocab, (i % 3,), generator=g).tolist()
        prompts.append((phrase * 8)[: 18 + 5 * i] + noise)
    return prompts


def chained_hashes(tokens, block_size):
    """The prefix-cache hashes of `tokens`' full blocks: what a correct sequence's blocks carry."""
    hashes = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block))
    return hashes


def run_checked(engine, prompts, params):
    """Serve `prompts` step by step, checking the block manager after every step: its
    invariants, and that every running request's hashes are those of its own tokens (never a
    draft's); returns the final outputs and checks the streamed tokens add up to them."""
    ids = [f"r{len(engine.requests) + i}" for i in range(len(prompts))]
    params = params if isinstance(params, list) else [params] * len(prompts)
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    streamed, final = {i: [] for i in ids}, {}
    manager = engine.manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.output_token_ids == streamed[out.request_id]
            if out.finished:
                final[out.request_id] = out
        manager.check_invariants()
        for request in engine.scheduler.running:
            request_id = request.request_id
            assert (
                manager.token_ids[request_id]
                == request.all_token_ids[: request.num_computed_tokens]
            )
            expected = chained_hashes(manager.token_ids[request_id], manager.block_size)
            hashes = manager.block_hashes[request_id]
            if engine.config.enable_prefix_caching:
                assert hashes == expected[: len(hashes)] and len(hashes) == len(expected)
    return [final[i] for i in ids]


def plain_outputs(course, prompts, params, **config):
    engine = LLMEngine(course, **config)
    return [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def plain_engine_summary(course, prompts, params, **config):
    engine = LLMEngine(course, **config)
    engine.generate(prompts, params, use_tqdm=False)
    return engine.summary()


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_outputs_equal_the_engine_without_speculation(course, batch_size, k, prefix_caching):
    prompts = repetitive_prompts(batch_size, seed=batch_size)
    params = SamplingParams(max_tokens=24)
    config = dict(num_blocks=120, block_size=8, enable_prefix_caching=prefix_caching)
    plain = LLMEngine(course, **config)
    expected = [o.output_token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    engine = LLMEngine(
        course, **config, speculative_config=SpeculativeConfig(num_speculative_tokens=k)
    )
    free = engine.manager.pool.num_free_blocks
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)
    spec = engine.stats.spec_decoding
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0  # drafts accepted ...
    assert spec.num_accepted_tokens < spec.num_draft_tokens  # ... and rejected
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    per_pos = spec.num_accepted_tokens_per_pos
    assert len(per_pos) == k and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert len(engine.stats) <= len(plain.stats)  # never more steps than the plain engine
    assert engine.manager.pool.num_free_blocks == free and not engine.manager.block_tables
    # tokens computed: the plain engine's decode tokens, plus the rejected drafts (computed and
    # given back); an accepted draft counts once, in the step that verified it
    plain = plain_engine_summary(course, prompts, params, **config)
    summary = engine.summary()
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert summary["decode_tokens"] == plain["decode_tokens"] + rejected
    assert summary["prefill_tokens"] == plain["prefill_tokens"]
    if prefix_caching:  # the same prompts again hit the blocks cached: their hashes are right
        again = run_checked(engine, prompts, params)
        assert [o.output_token_ids for o in again] == expected
        assert engine.summary()["prefix_hit_rate"] > 0.3


def test_stop_tokens_and_max_tokens_are_exact(course):
    prompts = repetitive_prompts(4, seed=7)
    greedy = plain_outputs(course, prompts, SamplingParams(max_tokens=30), num_blocks=100)
    spec = SpeculativeConfig(num_speculative_tokens=5)
    params = []
    for i, tokens in enumerate(greedy):  # a stop token from the repeating part of the output
        params.append(SamplingParams(max_tokens=30, stop_token_ids=(tokens[12 + i],)))
    expected = [
        tokens[: tokens.index(p.stop_token_ids[0]) + 1] for tokens, p in zip(greedy, params)
    ]
    engine = LLMEngine(course, num_blocks=100, speculative_config=spec)
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert all(o.finish_reason is FinishReason.STOP for o in outputs)
    for max_tokens in (1, 2, 3, 7, 13):
        engine = LLMEngine(course, num_blocks=100, speculative_config=spec)
        outputs = run_checked(engine, prompts, SamplingParams(max_tokens=max_tokens))
        assert [o.output_token_ids for o in outputs] == [t[:max_tokens] for t in greedy]
        assert engine.manager.pool.num_free_blocks == 100


def test_a_pool_too_small_for_the_drafts_gives_the_same_tokens(course):
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(max_tokens=24)
    config = dict(num_blocks=12, block_size=8, max_num_batched_tokens=32)
    expected = plain_outputs(course, prompts, params, **config)
    engine = LLMEngine(course, **config, speculative_config={"num_speculative_tokens": 5})
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.summary()["preemptions"] >= 1  # the pool was short
    assert engine.stats.spec_decoding.num_accepted_tokens > 0
    assert engine.manager.pool.num_free_blocks == 12


def test_greedy_and_sampled_requests_share_the_steps(course):
    prompts = repetitive_prompts(6, seed=5)
    params = [
        SamplingParams(max_tokens=20)
        if i % 2
        else SamplingParams(temperature=0.8, top_k=30, seed=i, max_tokens=20)
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(max_tokens=20, logprobs=2)  # asks for logprobs: decodes normally
    expected = plain_outputs(course, prompts, params, num_blocks=100)
    engine = LLMEngine(course, num_blocks=100, speculative_config=SpeculativeConfig())
    outputs = run_checked(engine, prompts, params)
    for i in (1, 3, 5):  # greedy: the same argmax (the sampled ones draw from another stream)
        assert outputs[i].output_token_ids == expected[i], i
    assert all(len(o.output_token_ids) == 20 for o in outputs)
    assert len(outputs[1].logprobs) == 1 and outputs[1].logprobs[0].token_id == expected[1][-1]
    assert engine.stats.spec_decoding.num_accepted_tokens > 0


def check_forked_requests_speculate(course, prompt, speculative_config):
    """Three children forked from `prompt` (greedy 20 and 12 tokens, one sampled), served with
    and without `speculative_config` over a prefix-cached pool: the greedy children's tokens
    equal, the sampled one as many tokens, invariants after every step, no block leaked."""
    ids = ["a", "b", "c"]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=12)]
    params.append(SamplingParams(temperature=0.7, seed=4, max_tokens=20))
    outputs = {}
    for spec in (None, speculative_config):
        engine = LLMEngine(
            course, num_blocks=60, block_size=8, enable_prefix_caching=True, speculative_config=spec
        )
        engine.add_parallel_requests(ids, prompt, params)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.output_token_ids
            engine.manager.check_invariants()
        assert engine.manager.pool.num_free_blocks == 60
        outputs[spec is None] = final
    for request_id in ("a", "b"):  # greedy: the same tokens
        assert outputs[False][request_id] == outputs[True][request_id], request_id
    assert len(outputs[False]["c"]) == 20  # sampled: another random stream, as many tokens
    assert engine.stats.spec_decoding.num_accepted_tokens > 0


def test_parallel_requests_forked_from_one_prompt_speculate(course):
    prompt = repetitive_prompts(3, seed=2)[2]
    check_forked_requests_speculate(course, prompt, SpeculativeConfig(num_speculative_tokens=4))


def test_draft_slots_never_leave_a_hash_on_a_rejected_token():
    pool = BlockPool(12, 4, enable_prefix_caching=True)
    manager = BlockManager(pool)
    manager.allocate("s", [1, 2, 3, 4, 5, 6])  # one full block, hashed
    manager.append_slot("s", 7)  # the token the step computes
    for _ in range(5):  # its draft, ids unknown: blocks 1 and 2 are never hashed
        manager.append_slot("s", None)
    assert len(manager.block_hashes["s"]) == 1
    manager.truncate("s", 9)  # 2 draft tokens accepted, 3 rejected
    manager.set_token("s", 7, 8)
    manager.set_token("s", 8, 9)
    manager.check_invariants()
    assert manager.block_hashes["s"] == chained_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert set(pool.cached_blocks.values()) == set(manager.block_tables["s"][:2])
    # drafts appended with their ids (what the engine avoids): truncate still drops the hashes
    manager.append_slot("s", 10)
    manager.append_slot("s", 11)
    manager.append_slot("s", 12)  # blocks 2 and 3 full: hashed with draft tokens 10, 11, 12
    for token in (13, 14, 15, 16):
        manager.append_slot("s", token)
    assert len(manager.block_hashes["s"]) == 4
    manager.truncate("s", 10)  # keeps 9 and 10: block 2 partly filled, block 3 dropped
    manager.check_invariants()
    assert set(pool.cached_blocks.values()) == set(manager.block_tables["s"][:2])
    manager.free("s")
    assert pool.num_free_blocks == 12


def test_no_drafts_while_a_step_schedules_more_requests_than_disable_by_batch_size(course):
    """Requests of different lengths finish one by one: no step drafts while more than 2 are
    scheduled, every step with at most 2 drafts when it can, and the tokens stay the plain
    engine's."""
    prompts = repetitive_prompts(5, seed=3)
    params = [SamplingParams(max_tokens=8 + 6 * i) for i in range(5)]
    config = dict(num_blocks=120, block_size=8)
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    engine = LLMEngine(course, **config, speculative_config=spec)
    drafted_at = []  # (requests scheduled, drafts) of every step
    propose = engine.speculator.propose

    def spy(scheduled):
        drafts = propose(scheduled)
        drafted_at.append((len(scheduled), len(drafts)))
        return drafts

    engine.speculator.propose = spy
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == plain_outputs(course, prompts, params, **config)
    assert all(drafts == 0 for n, drafts in drafted_at if n > 2)
    assert any(n > 2 for n, _ in drafted_at)  # the limit was reached
    assert sum(drafts for n, drafts in drafted_at if n <= 2) > 0  # and drafts came below it
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)


def test_bad_options_are_refused_naming_the_argument(course):
    for kwargs, name in [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="eagle"), "method"),
        (dict(prompt_lookup_max=0), "prompt_lookup_max"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    ]:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig(**kwargs)
    with pytest.raises(TypeError, match="num_speculative_tokens: expected an int"):
        SpeculativeConfig(num_speculative_tokens=2.5)
    with pytest.raises(TypeError, match="speculative_config"):
        LLMEngine(course, num_blocks=10, speculative_config=3)
    with pytest.raises(ValueError, match="speculative_config and async_scheduling"):
        LLMEngine(course, num_blocks=10, speculative_config={}, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config: expected policy='continuous'"):
        LLMEngine(course, num_blocks=40, speculative_config={}, policy="static", max_model_len=64)
    with pytest.raises(ValueError, match="speculative_config"):
        LLMEngine(course, num_blocks=10, speculative_config={}, eviction=StreamingEviction())
    with pytest.raises(ValueError, match=r"speculative_config: expected fields among .*'num_sp"):
        LLMEngine(course, num_blocks=10, speculative_config={"num_speculative_token": 3})


@pytest.mark.parametrize(
    "value", ["{num: 3}", "[3]", '{"num_speculative_token": 3}', '{"num_speculative_tokens": 0}']
)
def test_the_servers_flag_refuses_a_bad_config_before_loading(value, capsys):
    from kvlib.serve.__main__ import parser

    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["--speculative-config", value])
    assert stop.value.code == 2
    assert (
        "--speculative-config: expected a JSON object with fields among" in capsys.readouterr().err
    )


def test_smollm2_greedy_outputs_equal_the_engine_without_speculation(smollm2):
    model, tokenizer = smollm2
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    prompts = [tokenizer.encode(text), tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9,")]
    params = SamplingParams(max_tokens=16)
    expected = plain_outputs(model, prompts, params, num_blocks=40)
    spec = SpeculativeConfig(num_speculative_tokens=4)
    engine = LLMEngine(model, num_blocks=40, speculative_config=spec)
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.stats.spec_decoding.num_accepted_tokens > 0


def test_the_server_exports_the_counters_with_vllms_names(course):
    from types import SimpleNamespace

    from kvlib.serve.__main__ import build_engine, parse_options
    from kvlib.serve.engine_loop import EngineLoop, EngineSnapshot
    from kvlib.serve.metrics import ServerMetrics, metric_value, parse_metrics

    options = ["--num-blocks", "60", "--speculative-config", '{"num_speculative_tokens": 2}']
    served = SimpleNamespace(model=course, max_model_len=1024)
    engine = build_engine(served, parse_options(options, environ={}))
    assert engine.config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    engine.generate(repetitive_prompts(3), SamplingParams(max_tokens=16), use_tqdm=False)
    spec = engine.stats.spec_decoding
    loop = EngineLoop(engine).start()
    try:
        loop.call(lambda _: None)
        loop.call(lambda _: None)  # the snapshot after the first call's commands is published
        samples = parse_metrics(
            ServerMetrics("course", lambda: loop.snapshot).exposition().decode()
        )
    finally:
        loop.stop()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        value = metric_value(samples, f"vllm:spec_decode_{name}_total", model_name="course")
        assert value == getattr(spec, name) > 0, name
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        value = metric_value(
            samples,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            model_name="course",
            position=str(position),
        )
        assert value == count
    plain = build_engine(served, parse_options(["--num-blocks", "60"], environ={}))
    assert plain.stats.spec_decoding is None
    assert b"spec_decode" not in ServerMetrics("course", EngineSnapshot).exposition()  # off


# --- sampled requests: speculative sampling ------------------------------------------------------


class TableModel(torch.nn.Module):
    """A stub model the engine serves (as `kvlib.experiments.engine_overhead.LogitsStub`): the
    logits at a position are row `input id` of a fixed `table (V, V)`, so the next token depends
    on the last one only and the exact distribution of a request's tokens is a Markov chain's.
    Nothing is computed and no K/V written: the engine's blocks are bookkeeping only."""

    def __init__(self, table):
        super().__init__()
        vocab = table.shape[0]
        self.config = SimpleNamespace(
            is_mla=False,
            sliding_window=None,
            num_hidden_layers=1,
            num_key_value_heads=1,
            num_attention_heads=1,
            head_dim=4,
            vocab_size=vocab,
        )
        self.lm_head = torch.nn.Linear(4, vocab, bias=False)
        self.table = table

    def forward(self, input_ids, *, logits_indices=None, **_):
        logits = self.table[input_ids[0]]  # (N, V)
        if logits_indices is not None:
            logits = logits.index_select(0, logits_indices)  # (m, V)
        return logits[None]  # (1, N or m, V)


VOCAB = 8
CHAIN_PROMPT = list(range(VOCAB)) * 2  # each token once a cycle: prompt lookup drafts successors
FIT_LEVEL = 1e-3  # a fit test fails below this p-value


def chain_table(seed=0):
    """Random logits `(V, V)` that favour each token's successor (what prompt lookup drafts on
    `CHAIN_PROMPT`), so that drafts are both accepted and rejected often."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    table[torch.arange(VOCAB), (torch.arange(VOCAB) + 1) % VOCAB] += 1.5
    return table


def exact_joint(table, params, length=3):
    """P(a request's first `length` tokens) after `CHAIN_PROMPT`, `(V,) * length` float64: the
    chain of the engine's own sampling distributions (`sampling_distribution`, what
    `sample_step` draws from)."""
    step = sampling_distribution(table, [params] * VOCAB).double()  # (V, V): P(next | last)
    joint = step[CHAIN_PROMPT[-1]]  # (V,)
    for _ in range(length - 1):
        joint = joint[..., None] * step  # (..., V, 1) * (V, V) -> (..., V, V)
    return joint


def fit_test(counts, probs, min_expected=5.0):
    """Pearson's chi-square of `counts` against `probs` (any shape, flattened), the cells
    expected fewer than `min_expected` times pooled into one: (statistic, degrees of freedom,
    p-value). A count in a cell of probability 0 gives p-value 0."""
    observed, expected = counts.flatten().double(), probs.flatten() * counts.sum()
    if observed[expected == 0].sum() > 0:
        return float("inf"), 0, 0.0
    small = expected < min_expected
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:  # nothing pooled
        observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    return stat, dof, p_value


def chain_counts(params, num_requests=3_000, batch=1_000):
    """Serve `num_requests` requests of `CHAIN_PROMPT` with `params` (seeds 0, 1, ...), up to
    `batch` at once, with speculation on `TableModel(chain_table())`: the counts `(V, V, V)` of
    their first 3 tokens, and the engine's `SpecDecodingStats`."""
    engine = LLMEngine(
        TableModel(chain_table()),
        num_blocks=batch + 8,
        block_size=32,
        max_num_seqs=batch,
        max_num_batched_tokens=64 * batch,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    counts = served_chain_counts(engine, params, num_requests)
    assert engine.manager.pool.num_free_blocks == batch + 8
    return counts, engine.stats.spec_decoding


def served_chain_counts(engine, params, num_requests):
    """Serve `num_requests` requests of `CHAIN_PROMPT` with `params` (seeds 0, 1, ...) on
    `engine`: the counts `(V, V, V)` of their first 3 tokens; every request done, none left."""
    requests = [dataclasses.replace(params, seed=i) for i in range(num_requests)]
    outputs = engine.generate([CHAIN_PROMPT] * num_requests, requests, use_tqdm=False)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    for output in outputs:
        assert len(output.output_token_ids) == params.max_tokens
        counts[tuple(output.output_token_ids[:3])] += 1
    assert not engine.manager.block_tables
    return counts


CHAIN_PARAMS = {
    "temperature": SamplingParams(temperature=1.0, max_tokens=4),
    "top-k and top-p": SamplingParams(temperature=0.8, top_k=6, top_p=0.85, max_tokens=4),
    # max_tokens = 3: a draft of 1 after the first token, so the third token counted is the
    # verification's bonus whenever the guess stands
    "bonus token": SamplingParams(temperature=1.0, max_tokens=3),
}


@pytest.mark.parametrize("name", list(CHAIN_PARAMS))
def test_sampled_speculation_keeps_the_engines_distribution(name):
    """3,000 requests (max_tokens = 4: a draft of 2 after the first token; 3: a draft of 1 and
    its bonus token) through speculative sampling: the joint counts of their first 3 tokens fit
    the exact chain distribution of the engine's sampler (chi-square p-value above `FIT_LEVEL`;
    never a token of probability 0), with drafts accepted at every position and rejected in the
    same runs."""
    params = CHAIN_PARAMS[name]
    counts, spec = chain_counts(params)
    stat, dof, p_value = fit_test(counts, exact_joint(chain_table(), params))
    assert p_value > FIT_LEVEL, (name, stat, dof, p_value)
    assert spec.num_drafts >= 3_000  # every request drafted (after its first token) ...
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    last = params.max_tokens - 3  # the last draft position
    assert spec.num_accepted_tokens_per_pos[last] > 300 and rejected > 1_000, spec  # both ways


def always_accept(draft, draft_probs, target_probs, generator):
    """A wrong rule: every draft token stands, then the bonus from p."""
    bonus = torch.multinomial(target_probs[len(draft)].double(), 1, generator=generator)
    return len(draft), int(bonus)


def resample_from_p(draft, draft_probs, target_probs, generator):
    """A wrong rule: the right acceptance, then the token at a rejection drawn from p, not from
    the residual (the drafted token comes out too often)."""
    accepted, _ = speculative_accept(draft, draft_probs, target_probs, generator)
    return accepted, int(torch.multinomial(target_probs[accepted].double(), 1, generator=generator))


def bonus_from_the_wrong_row(draft, draft_probs, target_probs, generator):
    """A wrong rule: the right acceptance, but the bonus token (every guess accepted) drawn from
    the last guess's row of p instead of the row after it."""
    accepted, token = speculative_accept(draft, draft_probs, target_probs, generator)
    if accepted == len(draft):
        row = target_probs[len(draft) - 1].double()
        token = int(torch.multinomial(row, 1, generator=generator))
    return accepted, token


def unnormalised(logits, params):
    """A wrong p: `sample_step`'s filtered rows before normalisation (top-p's nucleus sums below
    1), so a draft token is accepted too rarely."""
    return sampler._probs(logits, params)


@pytest.mark.parametrize(
    "wrong",
    [
        ("speculative_accept", always_accept, "top-k and top-p"),
        ("speculative_accept", resample_from_p, "top-k and top-p"),
        ("sampling_distribution", unnormalised, "top-k and top-p"),
        ("speculative_accept", bonus_from_the_wrong_row, "bonus token"),
    ],
    ids=["always accept", "resample from p", "unnormalised p", "bonus from the wrong row"],
)
def test_the_fit_test_rejects_a_wrong_rule_inside_the_engine(monkeypatch, wrong):
    """The power of the test above: the same 3,000 requests with a wrong rule injected into the
    engine's verification give a p-value below `FIT_LEVEL`."""
    name, rule, params_name = wrong
    monkeypatch.setattr(speculative_module, name, rule)
    params = CHAIN_PARAMS[params_name]
    counts, _ = chain_counts(params)
    stat, dof, p_value = fit_test(counts, exact_joint(chain_table(), params))
    assert p_value < FIT_LEVEL, (rule.__name__, stat, dof, p_value)


def test_verify_sampled_accepts_with_p_and_rejects_into_the_residual():
    """Per seed: a token after a rejection is never the rejected draft token and never one that
    top-k or top-p removed; over 4,000 seeds, the first draft token is accepted with frequency
    p_0(x_0) (normalised after top-p) within 4 standard deviations."""
    logits = chain_table()[[2, 3, 4]]  # (3, V): the rows after [2, 3]
    draft = [3, 4]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    probs = sampling_distribution(logits, [params] * 3)  # (3, V)
    num_seeds, first = 4_000, 0
    for seed in range(num_seeds):
        generator = torch.Generator().manual_seed(seed)
        accepted, token = verify_sampled(draft, logits, params, generator)
        first += accepted >= 1
        assert probs[accepted, token] > 0
        if accepted < len(draft):
            assert token != draft[accepted]
    p = float(probs[0, draft[0]])
    assert 0.2 < p < 0.9 and float(sampler._probs(logits, [params])[0].sum()) < 0.95
    assert abs(first / num_seeds - p) < 4 * (p * (1 - p) / num_seeds) ** 0.5, (first, p)


def spy_on_sampled_verification(monkeypatch):
    """Wrap the engine's `verify_sampled`: returns the list of (draft length, accepted) each call
    appends."""
    calls = []

    def spy(draft, logits, params, generator):
        accepted, token = verify_sampled(draft, logits, params, generator)
        calls.append((len(draft), accepted))
        return accepted, token

    monkeypatch.setattr(speculative_module, "verify_sampled", spy)
    return calls


def test_sampled_and_greedy_requests_speculate_in_a_pool_too_small(course, monkeypatch):
    """Greedy and sampled requests (temperature, top-p) share the steps of a pool that preempts:
    invariants and hashes hold after every step, no block is leaked, the greedy requests' tokens
    are the plain engine's, and the sampled requests' drafts were verified, accepted and
    rejected."""
    calls = spy_on_sampled_verification(monkeypatch)
    prompts = repetitive_prompts(6, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24)
        if i % 2
        else SamplingParams(max_tokens=24)
        for i in range(len(prompts))
    ]
    config = dict(num_blocks=12, block_size=8, max_num_batched_tokens=32)
    expected = plain_outputs(course, prompts, params, **config)
    engine = LLMEngine(course, **config, speculative_config={"num_speculative_tokens": 4})
    outputs = run_checked(engine, prompts, params)
    assert engine.summary()["preemptions"] >= 1  # the pool was short
    for i, output in enumerate(outputs):
        if i % 2:
            assert len(output.output_token_ids) == 24
        else:
            assert output.output_token_ids == expected[i], i
    assert engine.manager.pool.num_free_blocks == 12 and not engine.manager.block_tables
    assert sum(accepted for _, accepted in calls) > 0
    assert sum(num - accepted for num, accepted in calls) > 0


def test_a_seeded_sampled_request_gives_the_same_tokens_in_any_batch(monkeypatch):
    """With speculation on and room for every draft, a sampled request's tokens depend on its
    seed, not on the batch: alone, or among 30 greedy and sampled requests of other prompts, it
    emits the same 40 tokens (its drafts verified with its own generator); another seed gives
    others."""
    calls = spy_on_sampled_verification(monkeypatch)
    params = SamplingParams(temperature=0.9, top_k=7, seed=11, max_tokens=40)
    g = torch.Generator().manual_seed(1)
    others = [torch.randint(0, VOCAB, (5 + i,), generator=g).tolist() for i in range(30)]
    other_params = [
        SamplingParams(temperature=0.7, seed=100 + i, max_tokens=30 + i % 7)
        if i % 3
        else SamplingParams(max_tokens=25)
        for i in range(len(others))
    ]
    outputs = []
    for prompts, batch_params in [
        ([CHAIN_PROMPT], [params]),
        (
            [*others[:15], CHAIN_PROMPT, *others[15:]],
            [*other_params[:15], params, *other_params[15:]],
        ),
        ([CHAIN_PROMPT], [dataclasses.replace(params, seed=12)]),
    ]:
        engine = LLMEngine(
            TableModel(chain_table()),
            num_blocks=256,
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=2048,  # every draft fits the budget
            speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        )
        results = run_checked(engine, prompts, batch_params)
        outputs.append(results[prompts.index(CHAIN_PROMPT)].output_token_ids)
        assert engine.summary()["preemptions"] == 0
        assert engine.manager.pool.num_free_blocks == 256
    alone, in_batch, other_seed = outputs
    assert alone == in_batch and alone != other_seed
    assert sum(accepted for _, accepted in calls) > 0 and len(calls) > 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_requests_speculate_on_a_gpu(monkeypatch):
    """On CUDA the requests' generators are CUDA generators: sampled drafts are verified with
    them (accepted and rejected), every block comes back, and each request emits its tokens."""
    calls = spy_on_sampled_verification(monkeypatch)
    model = load_course_model(device="cuda")
    prompts = repetitive_prompts(6, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=i, max_tokens=24)
        for i in range(len(prompts))
    ]
    engine = LLMEngine(model, num_blocks=100, speculative_config=SpeculativeConfig())
    outputs = run_checked(engine, prompts, params)
    assert all(len(o.output_token_ids) == 24 for o in outputs)
    assert engine.manager.pool.num_free_blocks == 100 and not engine.manager.block_tables
    assert sum(accepted for _, accepted in calls) > 0
    assert sum(num - accepted for num, accepted in calls) > 0
