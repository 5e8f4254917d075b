"""kvlib.engine.streaming_draft: self-speculation in the serving engine (issue 59), the target
drafting over a StreamingLLM view of its own paged cache (sink blocks + a recent window),
verified over the full cache. The oracle is the engine without speculation: greedy outputs
token-identical across batch sizes, k, view sizes (one larger than every context, where a greedy
draft must be accepted whole), prefix caching, a pool that preempts and forked requests; the
block pool's invariants after every step, no block leaked, no hash on a draft slot; over an
int8 cache and through the decode graph runner (eager on a CPU). A draft forward's logits
against the model run densely over the same sinks and window (a key mask); the K/V slots read
against a count of the views by brute force; sampled requests: the joint distribution of their
first tokens against the exact one, on a stub model whose draft view has logits of its own
(q != p), the same test failing with a wrong q, and q as a point mass (prompt lookup's rule:
exact too) accepting less."""

import pytest
import torch

import kvlib.engine.speculative as speculative_module
from kvlib import data
from kvlib.cache import DynamicCache
from kvlib.engine import LLMEngine, SamplingParams, SpeculativeConfig
from kvlib.engine.sampler import sampling_distribution
from kvlib.engine.streaming_draft import StreamingDrafter, streaming_view
from kvlib.loaders.course_model import load_course_model
from tests.test_engine_speculative import (
    FIT_LEVEL,
    TableModel,
    chain_table,
    check_forked_requests_speculate,
    exact_joint,
    fit_test,
    plain_outputs,
    run_checked,
    served_chain_counts,
)


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def streaming(k=3, sinks=1, window=2, **fields):
    return SpeculativeConfig(
        method="streaming",
        num_speculative_tokens=k,
        num_sink_blocks=sinks,
        num_window_blocks=window,
        **fields,
    )


def document_prompts(batch_size, first=40, step=9):
    """Prompts of the course model's own kind of text (the recall documents it was trained on),
    `first`, `first + step`, ... tokens long: longer than the small views below."""
    docs = data.recall_documents(32, batch_size)
    return [doc.tokens[: first + step * i].tolist() for i, doc in enumerate(docs)]


def view_slots_brute_force(num_tokens, block_size, sinks, window):
    """The slots a view holds, counted token by token: those whose block is one of the first
    `sinks` or one of the last `window` blocks of the first `num_tokens` slots."""
    used = -(-num_tokens // block_size)
    return sum(
        j // block_size < sinks or j // block_size >= used - window for j in range(num_tokens)
    )


def spy_on_drafts(engine, record):
    """Wrap the engine's drafter's `draft_input`: `record(live, i, held, drafts, batch)` sees
    every draft forward's batch before it runs."""
    drafter = engine.speculator.drafter
    draft_input = drafter.draft_input

    def spy(live, i, held, drafts):
        batch = draft_input(live, i, held, drafts)
        record(live, i, held, drafts, batch)
        return batch

    drafter.draft_input = spy


def test_the_view_holds_the_sink_and_window_blocks():
    table = [17, 3, 9, 12, 5, 30, 8, 2]
    for block_size in (1, 4, 8):
        for num_tokens in range(1, len(table) * block_size + 1):
            for sinks in (0, 1, 2):
                for window in (1, 2, 5):
                    blocks, length = streaming_view(table, num_tokens, block_size, sinks, window)
                    used = -(-num_tokens // block_size)
                    kept = [b for b in range(used) if b < sinks or b >= used - window]
                    assert blocks == [table[b] for b in kept]
                    assert length == view_slots_brute_force(num_tokens, block_size, sinks, window)
    for bad in (0, 33):
        with pytest.raises(ValueError, match="num_tokens: expected 1 .. 32"):
            streaming_view(table, bad, 4, 1, 1)


VIEWS = {"1 sink + 1 block": (1, 1), "no sink + 3 blocks": (0, 3), "larger than all": (1, 64)}


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_outputs_equal_the_engine_without_speculation(
    course, batch_size, k, view, prefix_caching
):
    sinks, window = VIEWS[view]
    prompts = document_prompts(batch_size)
    params = SamplingParams(max_tokens=24)
    config = dict(num_blocks=200, block_size=8, enable_prefix_caching=prefix_caching)
    expected = plain_outputs(course, prompts, params, **config)
    engine = LLMEngine(course, **config, speculative_config=streaming(k, sinks, window))
    views = []  # (slots the view holds, the request's slots through this forward's token)

    def record(live, i, held, drafts, batch):
        manager = engine.manager
        for request, length in zip(live, batch.seq_lens_host):
            request_id = request.request_id
            views.append((length, held[request_id] + i))
            assert batch.max_query_len == 1 and length <= held[request_id] + i
            # the draft slots: ids unknown, their blocks never hashed for the prefix cache
            assert manager.token_ids[request_id][held[request_id] :] == [None] * len(
                drafts[request_id]
            )
            assert len(manager.block_hashes[request_id]) <= held[request_id] // 8

    spy_on_drafts(engine, record)
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.manager.pool.num_free_blocks == 200 and not engine.manager.block_tables
    spec, reads = engine.stats.spec_decoding, engine.speculator.drafter.kv_reads
    assert spec.num_drafts > 0
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    per_pos = spec.num_accepted_tokens_per_pos
    assert len(per_pos) == k and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert reads.draft_forwards == spec.num_draft_tokens == len(views)
    assert reads.draft_slots == sum(length for length, _ in views)
    if view == "larger than all":  # the view is the cache: drafts are the target's own guesses
        assert all(length == held for length, held in views)
        assert spec.num_accepted_tokens == spec.num_draft_tokens
        # k + 1 reads of growing contexts for k + 1 tokens: plain decoding's reads exactly
        assert reads.draft_slots + reads.verify_slots == reads.plain_slots
    else:
        assert max(length for length, _ in views) <= (sinks + window) * 8
        assert any(length < held for length, held in views)  # compressed views
        spent, plain = reads.per_token()
        if sinks:  # on the course model, guesses good enough to read fewer slots per token
            assert spec.num_accepted_tokens > 0 and spent < plain
        else:  # no sink block: on these prompts most guesses fail (why was not isolated)
            assert spec.num_accepted_tokens < 0.25 * spec.num_draft_tokens


def test_the_slots_read_match_the_views_and_the_block_tables(course):
    """`KVReads` against its definition, recomputed here from each draft forward's held slots
    (brute force over tokens) and each verification's block table."""
    prompts = document_prompts(3, first=50)
    engine = LLMEngine(course, num_blocks=120, block_size=4, speculative_config=streaming(3, 2, 3))
    expected_draft = []

    def record(live, i, held, drafts, batch):
        for request in live:
            slots = held[request.request_id] + i
            expected_draft.append(view_slots_brute_force(slots, 4, 2, 3))

    spy_on_drafts(engine, record)
    verified, record_step = [], engine.speculator.record

    def record_spy(out, sampled):
        for request_id, (draft, accepted, _) in engine.speculator.verified.items():
            held = engine.manager.num_tokens(request_id)  # the draft's slots included
            verified.append((held - len(draft), held, len(draft), accepted))
        appended = record_step(out, sampled)
        return appended

    engine.speculator.record = record_spy
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20), use_tqdm=False)
    reads = engine.speculator.drafter.kv_reads
    assert reads.draft_slots == sum(expected_draft) > 0
    assert reads.verify_slots == sum(held for _, held, _, _ in verified)
    emitted = sum(accepted + 1 for *_, accepted in verified)  # no stop token: all emitted
    assert reads.emitted_tokens == emitted
    assert reads.plain_slots == sum(
        sum(through + j for j in range(accepted + 1)) for through, _, _, accepted in verified
    )
    assert sum(len(o.output_token_ids) for o in outputs) == 60


@pytest.mark.parametrize("sinks, window", [(1, 2), (0, 3)])
def test_a_draft_forward_is_the_model_over_the_sinks_and_the_window(course, sinks, window):
    """Draft forward 0 of a request at position p: its logits equal the course model's at p over
    a plain cache of the whole prefix with every key outside the view masked (keys rotated at
    their true positions, the query at p): a reference built without the engine's block
    tables."""
    prompts = document_prompts(2, first=45, step=13)
    block_size = 4
    engine = LLMEngine(
        course,
        num_blocks=80,
        block_size=block_size,
        speculative_config=streaming(2, sinks, window),
    )
    captured, runs = [], {}

    def record(live, i, held, drafts, batch):
        if i == 0:
            runs[id(batch)] = [
                request.all_token_ids[: held[request.request_id]] for request in live
            ]

    spy_on_drafts(engine, record)
    forward = engine.runner.forward

    def forward_spy(batch, **kwargs):
        logits = forward(batch, **kwargs)
        if id(batch) in runs:
            captured.extend(zip(runs.pop(id(batch)), logits))
        return logits

    engine.runner.forward = forward_spy
    engine.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    assert len(captured) >= 4
    compressed = 0
    for tokens, logits in captured[:8]:
        p = len(tokens) - 1  # the newest token's position
        used = -(-(p + 1) // block_size)
        visible = torch.tensor(
            [j // block_size < sinks or j // block_size >= used - window for j in range(p + 1)]
        )
        compressed += not bool(visible.all())
        cache = DynamicCache(course.config.num_hidden_layers)
        with torch.no_grad():
            course(torch.tensor([tokens[:p]]), cache=cache)
            reference = course(
                torch.tensor([[tokens[p]]]),
                cache=cache,
                attention_mask=visible[None].long(),
                position_ids=torch.tensor([[p]]),
            )[0, -1]
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        assert int(logits.argmax()) == int(reference.argmax())
    assert compressed >= 4  # the views hid keys


def test_a_pool_too_small_preempts_and_greedy_requests_keep_their_tokens(course, monkeypatch):
    """Greedy, sampled (temperature, top-p) and logprobs requests share the steps of a pool that
    preempts: invariants and hashes after every step, no block leaked, the greedy and logprobs
    requests' tokens are the plain engine's, and the sampled ones' drafts (drawn from the
    drafter's own q, rows that sum to 1) were verified, accepted and rejected."""
    calls, verify = [], speculative_module.verify_sampled

    def spy(draft, logits, params, generator, draft_probs=None):
        assert draft_probs is not None and draft_probs.shape == (len(draft), logits.shape[-1])
        torch.testing.assert_close(draft_probs.sum(-1), torch.ones(len(draft)))
        accepted, token = verify(draft, logits, params, generator, draft_probs)
        calls.append((len(draft), accepted))
        return accepted, token

    monkeypatch.setattr(speculative_module, "verify_sampled", spy)
    prompts = document_prompts(6, first=30, step=5)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24)
        if i % 2
        else SamplingParams(max_tokens=24)
        for i in range(len(prompts))
    ]
    params[2] = SamplingParams(max_tokens=24, logprobs=2)  # decodes normally
    config = dict(num_blocks=24, block_size=8, max_num_batched_tokens=48)
    expected = plain_outputs(course, prompts, params, **config)
    engine = LLMEngine(course, **config, speculative_config=streaming(4, 1, 1))
    outputs = run_checked(engine, prompts, params)
    assert engine.summary()["preemptions"] >= 1  # the pool was short
    for i, output in enumerate(outputs):
        assert len(output.output_token_ids) == 24
        if i % 2 == 0:
            assert output.output_token_ids == expected[i], i
    assert engine.manager.pool.num_free_blocks == 24 and not engine.manager.block_tables
    assert sum(accepted for _, accepted in calls) > 0
    assert sum(num - accepted for num, accepted in calls) > 0
    assert engine.stats.spec_decoding.num_accepted_tokens > 0


def test_parallel_requests_forked_from_one_prompt_self_speculate(course):
    """Children forked from a prompt's blocks share its partial block: copy-on-write's copies
    must land before a draft forward writes into the copy."""
    prompt = document_prompts(1, first=43)[0]
    check_forked_requests_speculate(course, prompt, streaming(3, 1, 2))


def test_self_speculation_over_a_quantized_cache(course):
    """Over chapter 10's int8 cache the draft forwards write quantized K/V into the real slots,
    and the verification overwrites them: the tokens are the plain quantized engine's."""
    from kvlib.quant import QuantScheme

    prompts = document_prompts(3, first=60)
    params = SamplingParams(max_tokens=16)
    config = dict(num_blocks=100, block_size=8, kv_scheme=QuantScheme("int8"))
    expected = plain_outputs(course, prompts, params, **config)
    engine = LLMEngine(course, **config, speculative_config=streaming(3, 1, 1))
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.stats.spec_decoding.num_accepted_tokens > 0
    assert engine.manager.pool.num_free_blocks == 100


def test_draft_forwards_run_through_the_decode_graph_runner(course):
    """A draft forward is a decode-only batch: with `cuda_graphs` (static buffers, eager on a
    CPU) the graph runner takes it, narrower block tables and all, and the tokens stay the plain
    engine's."""
    from kvlib.engine.cuda_graph import DecodeGraphRunner
    from kvlib.engine.runner import ModelRunner

    prompts = document_prompts(3)
    params = SamplingParams(max_tokens=16)
    expected = plain_outputs(course, prompts, params, num_blocks=100, block_size=8)
    engine = LLMEngine(course, num_blocks=100, block_size=8, speculative_config=streaming(3, 1, 2))
    runner = ModelRunner(course, engine.storage, engine.manager, cuda_graphs=True)
    engine.runner = engine.speculator.runner = engine.speculator.drafter.runner = runner
    draft_batches, through_graphs = [], []
    spy_on_drafts(engine, lambda *args: draft_batches.append(args[-1]))
    runner.graph_runner = DecodeGraphRunner.for_runner(runner)
    run = runner.graph_runner.run

    def graph_spy(batch):
        through_graphs.append(batch)
        return run(batch)

    runner.graph_runner.run = graph_spy
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert draft_batches and all(any(b is g for g in through_graphs) for b in draft_batches)
    assert engine.stats.spec_decoding.num_accepted_tokens > 0


def test_smollm2_greedy_outputs_equal_the_engine_without_speculation(smollm2):
    model, tokenizer = smollm2
    text = (
        "The cache stores one key row and one value row per token, per layer and per head. "
        "Reading it back at every step is what makes decoding long contexts slow: "
    )
    prompts = [tokenizer.encode(text * 2), tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9,")]
    params = SamplingParams(max_tokens=12)
    config = dict(num_blocks=40, block_size=8)
    expected = plain_outputs(model, prompts, params, **config)
    engine = LLMEngine(model, **config, speculative_config=streaming(3, 1, 2))
    outputs = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    spec = engine.stats.spec_decoding
    assert 0 < spec.num_accepted_tokens
    assert len(prompts[0]) > 3 * 8  # its view was compressed


def test_bad_options_are_refused_naming_the_argument(course):
    for kwargs, name in [
        (dict(method="self"), "method"),
        (dict(method="streaming", num_sink_blocks=-1), "num_sink_blocks"),
        (dict(method="streaming", num_window_blocks=0), "num_window_blocks"),
        (dict(num_sink_blocks=1), "num_sink_blocks: only for method='streaming'"),
        (dict(method="ngram", num_window_blocks=2), "num_window_blocks: only for"),
        (dict(method="streaming", prompt_lookup_max=7), "prompt_lookup_max: only for"),
        (dict(method="streaming", prompt_lookup_min=2), "prompt_lookup_min: only for"),
        (dict(method="streaming", num_speculative_tokens=0), "num_speculative_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig(**kwargs)
    with pytest.raises(TypeError, match="num_window_blocks: expected an int"):
        SpeculativeConfig(method="streaming", num_window_blocks=1.5)
    spec = SpeculativeConfig(method="streaming")  # the defaults: 1 sink block, 4 window blocks
    assert (spec.num_sink_blocks, spec.num_window_blocks) == (1, 4)
    assert SpeculativeConfig().num_sink_blocks is None  # prompt lookup: no view
    # the lookup fields at their defaults are accepted (they are the dataclass's own)
    at_defaults = SpeculativeConfig(method="streaming", prompt_lookup_max=3, prompt_lookup_min=1)
    assert at_defaults == SpeculativeConfig(method="streaming")
    assert SpeculativeConfig(prompt_lookup_max=7).prompt_lookup_max == 7
    with pytest.raises(ValueError, match="num_sink_blocks"):
        LLMEngine(course, num_blocks=10, speculative_config={"num_sink_blocks": 2})


def test_the_servers_flag_takes_the_method(capsys):
    from kvlib.serve.__main__ import parser

    value = '{"method": "streaming", "num_speculative_tokens": 2, "num_window_blocks": 3}'
    args = parser().parse_args(["--speculative-config", value])
    assert args.speculative_config == streaming(2, 1, 3)
    bad = '{"method": "streaming", "num_window_blocks": 0}'
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["--speculative-config", bad])
    assert stop.value.code == 2
    assert "num_window_blocks: expected an int >= 1" in capsys.readouterr().err


# --- sampled requests: q is the drafter's own distribution ---------------------------------------


class ViewTableModel(TableModel):
    """`TableModel` whose logits over a compressed view (a decode-only batch whose sequences see
    fewer slots than their position + 1: a draft forward) come from another table, so that the
    drafter's q differs from the target's p."""

    def __init__(self, table, draft_table):
        super().__init__(table)
        self.draft_table = draft_table

    def forward(self, input_ids, *, cache=None, position_ids=None, logits_indices=None, **_):
        logits = self.table[input_ids[0]]  # (N, V)
        batch = cache.batch
        if batch.max_query_len == 1:
            compressed = batch.seq_lens < position_ids[0] + 1  # (N,): a row per sequence
            logits = torch.where(compressed[:, None], self.draft_table[input_ids[0]], logits)
        if logits_indices is not None:
            logits = logits.index_select(0, logits_indices)
        return logits[None]


def view_chain_counts(params, num_requests=3_000, batch=1_000):
    """`num_requests` requests of `CHAIN_PROMPT` (16 tokens, blocks of 4: a view of 1 sink and 1
    window block is compressed) through self-speculation on `ViewTableModel`: the counts
    `(V, V, V)` of their first 3 tokens, and the engine's `SpecDecodingStats`."""
    draft_table = chain_table(seed=1) * 0.7
    engine = LLMEngine(
        ViewTableModel(chain_table(), draft_table),
        num_blocks=8 * batch + 8,
        block_size=4,
        max_num_seqs=batch,
        max_num_batched_tokens=64 * batch,
        speculative_config=streaming(3, 1, 1),
    )
    return served_chain_counts(engine, params, num_requests), engine.stats.spec_decoding


VIEW_PARAMS = {
    "temperature": SamplingParams(temperature=0.9, max_tokens=4),
    "top-k and top-p": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=4),
}


@pytest.mark.parametrize("name", list(VIEW_PARAMS))
def test_sampled_self_speculation_keeps_the_engines_distribution(name):
    """3,000 requests (max_tokens = 4: a draft of 2 after the first token, drawn from the view's
    q): their first 3 tokens fit the exact chain of the target's sampling distribution
    (chi-square p-value above `FIT_LEVEL`), drafts accepted at both positions and rejected."""
    params = VIEW_PARAMS[name]
    counts, spec = view_chain_counts(params)
    stat, dof, p_value = fit_test(counts, exact_joint(chain_table(), params))
    assert p_value > FIT_LEVEL, (stat, dof, p_value)
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert spec.num_drafts >= 3_000 and spec.num_accepted_tokens_per_pos[1] > 300
    assert rejected > 1_000, spec


def point_mass(verify):
    """The rule prompt lookup's drafts get: q a point mass on the guess, whatever q really was.
    Still exact (a guess x stands with probability p(x), a rejection draws from p without x:
    p's distribution whatever drew x), but it accepts less than min(1, p(x) / q(x))."""
    return lambda draft, logits, params, generator, draft_probs=None: verify(
        draft, logits, params, generator
    )


def q_is_p(verify):
    """A wrong rule: "the draft is the target itself, so q = p": every guess stands, and the
    tokens follow the view's distribution."""

    def rule(draft, logits, params, generator, draft_probs=None):
        p = sampling_distribution(logits[:-1], [params] * len(draft))
        return verify(draft, logits, params, generator, p)

    return rule


def q_one_row_late(verify):
    """A wrong rule: guess i divided by the q of another position (rows rolled by one)."""
    return lambda draft, logits, params, generator, draft_probs=None: verify(
        draft, logits, params, generator, torch.roll(draft_probs, 1, dims=0)
    )


def test_q_as_a_point_mass_keeps_the_distribution_and_accepts_less(monkeypatch):
    """Why the drafter hands its q to the rule: the point-mass rule is exact too (the fit
    holds) but accepts fewer guesses than min(1, p / q) on the same requests."""
    params = VIEW_PARAMS["temperature"]
    _, with_q = view_chain_counts(params)
    monkeypatch.setattr(
        speculative_module, "verify_sampled", point_mass(speculative_module.verify_sampled)
    )
    counts, without_q = view_chain_counts(params)
    stat, dof, p_value = fit_test(counts, exact_joint(chain_table(), params))
    assert p_value > FIT_LEVEL, (stat, dof, p_value)
    assert without_q.num_accepted_tokens < 0.9 * with_q.num_accepted_tokens, (with_q, without_q)


@pytest.mark.parametrize("wrong", [q_is_p, q_one_row_late], ids=["q = p", "q one row late"])
def test_the_fit_test_rejects_a_wrong_q_inside_the_engine(monkeypatch, wrong):
    """The power of the fit test: the same 3,000 requests verified with a wrong q give a p-value
    below `FIT_LEVEL`."""
    params = VIEW_PARAMS["temperature"]
    monkeypatch.setattr(
        speculative_module, "verify_sampled", wrong(speculative_module.verify_sampled)
    )
    counts, _ = view_chain_counts(params)
    stat, dof, p_value = fit_test(counts, exact_joint(chain_table(), params))
    assert p_value < FIT_LEVEL, (wrong.__name__, stat, dof, p_value)


def test_the_drafter_is_only_built_for_the_streaming_method(course):
    assert LLMEngine(course, num_blocks=10, speculative_config={}).speculator.drafter is None
    engine = LLMEngine(course, num_blocks=10, speculative_config=streaming(2, 0, 1))
    drafter = engine.speculator.drafter
    assert isinstance(drafter, StreamingDrafter)
    assert (drafter.num_sink_blocks, drafter.num_window_blocks) == (0, 1)
