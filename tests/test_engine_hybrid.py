"""Chapter 12's engine serving hybrid models through a block table per layer group and a state
slot per request for each linear layer (`kvlib.engine.hybrid_kv`, chapter 17).

Oracle: each request's greedy tokens from the model's own forward without a cache over the whole
sequence (the window mask of `kvlib.model`), token for token, across batchings: one step per
prompt, chunked prefill, preemption in a small pool, prefix caching (with and without
preemption), two requests at a time, one table for every layer; prompts shorter and longer than
the window, 40 tokens decoded (2.5 windows). Models: randomly initialised from a seed, the course
model's vocabulary and depth at half its width (an equality test needs no training): Gemma 2's
alternation (sliding, full, sliding, full), Gemma 3's five sliding layers per full one (six
groups of one layer), Mistral's window on every layer (one group), the hybrid course model's
(sliding, full, linear, full) at random and with its shipped weights. Then the allocator's
state after every step (pool invariants across groups, window tables holding only live blocks,
the null block before them, nothing leaked), the admission count against one table for the same
bytes, every refusal, and free and null blocks poisoned after every step (never read unmasked).
"""

import dataclasses

import pytest
import torch

from kvlib.cache.paged_window import live_block_range
from kvlib.engine import LLMEngine, SamplingParams, SpeculativeConfig, StreamingEviction
from kvlib.engine.hybrid_kv import HybridKVManager
from kvlib.loaders.course_model import COURSE_CONFIG, HYBRID_CONFIG
from kvlib.model import LlamaModel
from kvlib.quant import QuantScheme

W = 16  # the window: a block size of 16 puts it on one block boundary, 8 on two
MAX_TOKENS = 40
GEMMA2 = dict(layer_types=("sliding", "full", "sliding", "full"), sliding_window=W)
GEMMA3 = dict(
    num_hidden_layers=6, layer_types=("sliding",) * 5 + ("full",), sliding_window=W
)  # fmt: skip
MISTRAL = dict(sliding_window=W)  # no layer_types: every layer slides


# the course model's vocabulary and depth, narrower (the engine's Python, not its arithmetic, is
# what these tests exercise), with grouped K/V heads
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def model_of(changes: dict, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    return LlamaModel(dataclasses.replace(COURSE_CONFIG, **SMALL, **changes)).eval()


@pytest.fixture(scope="module")
def gemma2():
    return model_of(GEMMA2)


def make_prompts(lengths, shared: int = 0, seed: int = 1) -> list[list[int]]:
    """Prompts of `lengths` random tokens; with `shared`, every other one starts with the same
    `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (shared,), generator=g).tolist()
    own = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
    return [system + p if i % 2 else p for i, p in enumerate(own)]


PROMPTS = make_prompts([5, 40, 17, 70, 9, 33], shared=36)  # 5 to 106 tokens: W = 16


def uncached_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the full forward over the whole sequence at every step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


_ORACLE: dict = {}


def oracle(model, name: str, prompts) -> list[list[int]]:
    key = (name, tuple(map(tuple, prompts)))
    if key not in _ORACLE:
        _ORACLE[key] = [uncached_greedy(model, p, MAX_TOKENS) for p in prompts]
    return _ORACLE[key]


def run_checked(engine: LLMEngine, prompts, after_step=None) -> list[list[int]]:
    """Serve `prompts` greedily, checking the allocator after every step (`check_tables`), then
    calling `after_step(engine)` if given; returns each request's tokens, in prompt order."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    while engine.has_unfinished_requests():
        engine.step()
        check_tables(engine)
        if after_step is not None:
            after_step(engine)
    return [engine.requests[i].output_token_ids for i in ids]


def check_tables(engine: LLMEngine) -> None:
    """Between steps: the pool's invariants across groups; each running request's window tables
    name the null block exactly before the window's first live block (nothing dead held,
    nothing live lost), its full tables no null block; and what it holds within `peak_blocks`,
    between steps and right after the step's scheduling (`scheduled_blocks`: the step's peak,
    its new blocks allocated and its dead ones not yet freed)."""
    manager = engine.manager
    manager.check_invariants()
    for request in engine.scheduler.running:
        n = manager.num_tokens(request.request_id)
        assert n == request.num_computed_tokens  # the next query is at position n
        for group, table in zip(manager.groups, manager.tables(request.request_id)):
            if group.window is None:
                assert manager.null_block not in table
                continue
            first = live_block_range(n, group.window, manager.block_size).window.start
            assert table[:first] == [manager.null_block] * first, (table, first)
            assert manager.null_block not in table[first:], (table, first)
        null = manager.null_block is not None
        held = manager.live_blocks(request.request_id) + null
        in_step = engine.scheduler.scheduled_blocks[request.request_id] + null
        assert held <= in_step <= manager.peak_blocks(n), (held, in_step, n)
    running = {r.request_id for r in engine.scheduler.running}
    assert {seq_id for seq_id, _ in manager.states} <= running  # state slots: running only


def check_nothing_leaked(engine: LLMEngine) -> None:
    manager = engine.manager
    reserved = 0 if manager.null_block is None else 1
    assert not engine.has_unfinished_requests()
    assert manager.pool.num_free_blocks == engine.config.num_blocks - reserved
    assert engine.storage.num_blocks_in_use == reserved
    for block in manager.pool.blocks:
        assert block.ref_cnt == (block.block_id == manager.null_block), block
    assert not any(m.block_tables for m in manager.managers) and not manager.states


# options -> what the run must have exercised
BATCHINGS = {
    "one step per prompt": (dict(num_blocks=200, max_num_batched_tokens=512), {}),
    "chunked prefill": (dict(num_blocks=200, max_num_batched_tokens=13), {}),
    "preemption": (
        dict(num_blocks=32, max_num_batched_tokens=32, block_size=8),
        {"preemptions": 1},
    ),
    "prefix caching": (
        dict(num_blocks=200, max_num_batched_tokens=24, enable_prefix_caching=True),
        {"prefix_hit_rate": 0.05},
    ),
    "prefix caching + preemption": (
        dict(num_blocks=32, max_num_batched_tokens=24, block_size=8, enable_prefix_caching=True),
        {"preemptions": 1, "prefix_hit_rate": 0.05},
    ),
    "two at a time": (dict(num_blocks=200, max_num_seqs=2), {}),
    "one table for every layer": (dict(num_blocks=200, per_group_block_tables=False), {}),
}


@pytest.mark.parametrize("name", BATCHINGS)
def test_greedy_tokens_equal_the_uncached_forward(gemma2, name):
    options, exercised = BATCHINGS[name]
    engine = LLMEngine(gemma2, **options)
    assert run_checked(engine, PROMPTS) == oracle(gemma2, "gemma2", PROMPTS)
    summary = engine.summary()
    for key, least in exercised.items():
        assert summary[key] >= least, (key, summary[key])
    check_nothing_leaked(engine)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "all sliding layer_types"])
def test_other_layouts_token_identical(name):
    changes = {
        "gemma3": GEMMA3,
        "mistral": MISTRAL,
        "all sliding layer_types": dict(layer_types=("sliding",) * 4, sliding_window=W),
    }[name]
    model = model_of(changes)
    options = dict(max_num_batched_tokens=20, block_size=8)
    manager = LLMEngine(model, num_blocks=100, **options).manager
    expected_groups = {"gemma3": 6, "mistral": 1, "all sliding layer_types": 1}[name]
    assert len(manager.groups) == expected_groups
    # a pool just big enough for the longest request alone: the four do not all fit
    need = max(manager.peak_blocks(len(p) + MAX_TOKENS - 1) for p in PROMPTS[:4])
    engine = LLMEngine(model, num_blocks=need + 2, **options)
    assert run_checked(engine, PROMPTS[:4]) == oracle(model, name, PROMPTS[:4])
    assert engine.summary()["preemptions"] >= 1
    check_nothing_leaked(engine)


def test_window_groups_free_blocks_as_sequences_advance(gemma2):
    """One 70-token request, block size 8: at every step the sliding group holds at most the
    window's blocks plus the newest (live_block_range), while the full group holds them all."""
    engine = LLMEngine(gemma2, num_blocks=60, block_size=8, max_num_batched_tokens=16)
    engine.add_request("long", PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        check_tables(engine)
        if engine.scheduler.running:
            sliding, full = engine.manager.tables("long")
            n = engine.manager.num_tokens("long")
            live = [b for b in sliding if b != engine.manager.null_block]
            assert len(live) <= -(-(W - 1) // 8) + 1 and len(full) == -(-n // 8)
            held.append(len(live) + len(full))
    tokens = len(PROMPTS[3]) + MAX_TOKENS - 1
    assert held[-1] < 2 * -(-tokens // 8)  # one table would hold every block in both groups
    check_nothing_leaked(engine)


def test_a_prefix_hit_reads_the_window_through_null_entries(gemma2):
    """A second turn after the first finished: a 40-token hit (blocks of 8), of which the sliding
    group needs only its last blocks (the entries before them name the null block); the tokens
    still equal the uncached forward's."""
    engine = LLMEngine(gemma2, num_blocks=100, block_size=8, enable_prefix_caching=True)
    first = PROMPTS[3][:45]
    second = first[:40] + PROMPTS[1][:7]
    assert run_checked(engine, [first]) == [uncached_greedy(gemma2, first, MAX_TOKENS)]
    engine.add_request("turn 2", second, SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    sliding, full = engine.manager.tables("turn 2")
    null = engine.manager.null_block
    assert engine.requests["turn 2"].num_cached_tokens == 40
    assert sliding[0] == null and null not in full  # the hit's dead window entries: null
    while engine.has_unfinished_requests():
        engine.step()
        check_tables(engine)
    assert engine.requests["turn 2"].output_token_ids == uncached_greedy(gemma2, second, MAX_TOKENS)
    check_nothing_leaked(engine)


def test_parallel_sampling_and_abort(gemma2):
    engine = LLMEngine(gemma2, num_blocks=100, max_num_batched_tokens=32)
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * 2
    engine.add_parallel_requests(["a", "b"], PROMPTS[1], params)  # queued, not forked
    engine.add_request("gone", PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    assert engine.abort_request("gone") and "gone" not in engine.manager.block_tables
    while engine.has_unfinished_requests():
        engine.step()
        check_tables(engine)
    want = oracle(gemma2, "gemma2", PROMPTS)[1]
    assert engine.requests["a"].output_token_ids == engine.requests["b"].output_token_ids == want
    check_nothing_leaked(engine)


def max_running(engine: LLMEngine, prompts, max_tokens: int) -> int:
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return max(step.num_running for step in engine.stats)


def test_per_group_tables_admit_more_for_the_same_bytes(gemma2):
    """The same pool bytes: per-group blocks hold 2 of the 4 layers, one table's all 4, so the
    per-group pool has twice the blocks. 200-token requests: one table runs fewer at once."""
    prompts = make_prompts([200] * 12, seed=3)
    per_group = LLMEngine(gemma2, num_blocks=120, max_num_batched_tokens=256)
    one_table = LLMEngine(gemma2, num_blocks=60, max_num_batched_tokens=256,
                          per_group_block_tables=False)  # fmt: skip
    assert per_group.block_bytes * 120 == one_table.block_bytes * 60
    assert isinstance(per_group.manager, HybridKVManager)
    grouped, single = max_running(per_group, prompts, 8), max_running(one_table, prompts, 8)
    assert grouped > single >= 1, (grouped, single)


def test_a_request_beyond_the_pool_is_refused(gemma2):
    engine = LLMEngine(gemma2, num_blocks=20, block_size=8, max_num_batched_tokens=16)
    tokens = len(PROMPTS[3]) + MAX_TOKENS - 1
    need = engine.manager.peak_blocks(tokens)
    assert need < 2 * -(-tokens // 8) + 1  # the window group's share is bounded
    small = LLMEngine(gemma2, num_blocks=need - 1, block_size=8, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=f"may need up to {need} blocks at once"):
        small.add_request("big", PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    exact = LLMEngine(gemma2, num_blocks=need, block_size=8, max_num_batched_tokens=16)
    assert run_checked(exact, [PROMPTS[3]]) == [oracle(gemma2, "gemma2", PROMPTS)[3]]


REFUSALS = {
    "kv_scheme": dict(kv_scheme=QuantScheme("int8")),
    "async_scheduling": dict(async_scheduling=True),
    "speculative_config": dict(speculative_config=SpeculativeConfig(num_speculative_tokens=2)),
    "eviction": dict(eviction=StreamingEviction()),
    "policy": dict(policy="static", max_model_len=128),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_unsupported_options_are_refused_by_name(gemma2, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        LLMEngine(gemma2, num_blocks=50, **REFUSALS[name])


def test_peak_blocks_window_term_is_the_worst_chunk_start():
    """`peak_blocks` tries block_size chunk starts; by brute force, over every start, it is
    the worst (small grid of lengths, windows, block sizes, chunks)."""
    for window in (1, 5, 16, 23):
        for block_size in (1, 4, 8):
            for chunk in (1, 3, 8, 50):
                manager = LLMEngine(
                    model_of(dict(sliding_window=window)),
                    num_blocks=8,
                    block_size=block_size,
                    max_num_batched_tokens=chunk,
                ).manager
                for n in range(1, 70, 3):
                    brute = max(
                        -(-min(s + chunk, n) // block_size)
                        - live_block_range(s, window, block_size).window.start
                        for s in range(n)
                    )
                    assert manager.peak_blocks(n) == brute + 1, (window, block_size, chunk, n)


LINEAR = dict(layer_types=("sliding", "full", "linear", "full"), sliding_window=W)
LINEAR_BATCHINGS = {
    "chunked prefill": dict(num_blocks=200, max_num_batched_tokens=13),
    "preemption": dict(num_blocks=48, max_num_batched_tokens=32, block_size=8),
    "two at a time": dict(num_blocks=200, max_num_seqs=2),
    "one table for every layer": dict(num_blocks=200, per_group_block_tables=False),
}


@pytest.mark.parametrize("name", LINEAR_BATCHINGS)
def test_linear_layers_keep_a_state_slot_per_request(name):
    """HYBRID_CONFIG's layout (sliding, full, linear, full): the linear layer's state lives in a
    slot per request and layer (chunked_form for a chunk, recurrent_form for one token), dropped
    when the request finishes or is preempted; tokens equal the uncached forward's."""
    model = model_of(LINEAR)
    engine = LLMEngine(model, **LINEAR_BATCHINGS[name])
    assert all(2 not in group.layers for group in engine.manager.groups)  # no K/V for it
    assert run_checked(engine, PROMPTS) == oracle(model, "linear", PROMPTS)
    if name == "preemption":
        assert engine.summary()["preemptions"] >= 1
    check_nothing_leaked(engine)


def test_the_shipped_hybrid_course_model_is_served():
    from kvlib.loaders.course_model import load_course_hybrid_model

    model = load_course_hybrid_model()
    engine = LLMEngine(model, num_blocks=40, max_num_batched_tokens=16, block_size=8)
    assert run_checked(engine, PROMPTS[:3]) == oracle(model, "shipped", PROMPTS[:3])
    assert engine.summary()["preemptions"] >= 1
    check_nothing_leaked(engine)


def test_unsupported_models_are_refused_by_name():
    linear = LlamaModel(HYBRID_CONFIG)  # sliding, full, linear, full
    with pytest.raises(ValueError, match="^enable_prefix_caching: .*state"):
        LLMEngine(linear, num_blocks=50, enable_prefix_caching=True)
    all_linear = model_of(dict(layer_types=("linear",) * 4))
    with pytest.raises(ValueError, match="^model: .*no attention layer"):
        LLMEngine(all_linear, num_blocks=50)


def test_models_without_windows_or_linear_layers_take_the_plain_path():
    """No window and no linear layer (no `layer_types`, or "full" ones only): chapter 12's one
    table, and `per_group_block_tables=False` changes nothing."""
    for changes in ({}, dict(layer_types=("full",) * 4)):
        for per_group in (True, False):
            engine = LLMEngine(model_of(changes), num_blocks=50, per_group_block_tables=per_group)
            assert not isinstance(engine.manager, HybridKVManager), (changes, per_group)


POISONS = (1e4, -1e4)


@pytest.mark.parametrize("value", POISONS)
def test_free_and_null_blocks_are_never_read_unmasked(gemma2, value):
    """After every step, every free block and the null block are filled with a large finite
    value: a read of them that the mask did not hide would change the tokens (chunked prefill,
    preemption, no prefix caching: a free block's contents are never reused)."""
    options, _ = BATCHINGS["preemption"]
    engine = LLMEngine(gemma2, **options)
    poisoned = []

    def poison(engine):
        manager = engine.manager
        free = [b.block_id for b in manager.pool.blocks if b.ref_cnt == 0]
        for pool in engine.storage.block_tensors():
            pool[free + [manager.null_block]] = value
        poisoned.append(len(free))

    assert run_checked(engine, PROMPTS, after_step=poison) == oracle(gemma2, "gemma2", PROMPTS)
    assert engine.summary()["preemptions"] >= 1 and min(poisoned) < max(poisoned)
