"""Query-aware sparse attention (chapter 15): the page bounds the paged cache keeps (recomputed
from the blocks after every step, reused and copied-on-write blocks included); Quest's bound is an
upper bound on every key's score (hypothesis); the page selection matches a brute-force oracle;
the compacted block table reads exactly the selected tokens, through chapter 11's kernel too; at a
budget of every page the sparse cache equals the dense one on both models; the bytes the
equation predicts are the bytes the cache counts."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import kernels  # noqa: F401  (first: sets TRITON_INTERPRET=1 without CUDA)
from kvlib.cache import PagedCache
from kvlib.cache.block_table import shuffled_block_tables
from kvlib.cache.paged_bounds import PageBoundsCache
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.memory import kv_cache_bytes, page_bounds_bytes, sparse_decode_read_bytes
from kvlib.metrics.quality import streamed_logits
from kvlib.sparse import SparsePagedCache
from kvlib.sparse.baselines import attention_mass_per_page
from kvlib.sparse.bounds import gather_page_bounds, page_upper_bounds
from kvlib.sparse.selection import compact_block_tables, select_pages
from kvlib.sparse.trace import (
    attention_inputs,
    captured_mass,
    heaviest_old_pages,
    page_overlap,
    page_selection,
)


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


def course_ids(batch=3, length=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=g)


# --- the page bounds kept by the cache ------------------------------------------------------------


def block_bounds_from_scratch(cache: PageBoundsCache, layer: int, seq: int):
    """(P, H_kv, D) minima and maxima of sequence `seq`'s keys, page by page, from its blocks."""
    table, length, size = cache.manager.block_tables[seq], cache.manager.num_tokens(seq), 16
    lows, highs = [], []
    for page, block in enumerate(table):
        fill = min(size, length - page * size)
        keys = cache.key_cache[layer][block, :fill]  # (fill, H_kv, D)
        lows.append(keys.amin(dim=0))
        highs.append(keys.amax(dim=0))
    return torch.stack(lows), torch.stack(highs)


def check_bounds(cache: PageBoundsCache) -> int:
    checked = 0
    for seq in cache.manager.block_tables:
        table = cache.manager.block_tables[seq]
        for layer in range(cache.num_layers):
            low, high = block_bounds_from_scratch(cache, layer, seq)
            assert torch.equal(cache.key_min[layer][table], low), (seq, layer)
            assert torch.equal(cache.key_max[layer][table], high), (seq, layer)
            checked += len(table)
    return checked


def test_bounds_follow_the_blocks_as_they_fill(course_model):
    """Prefill 21 tokens (a partial second page), then decode one token at a time: after every
    step each page's bounds are its keys' minima and maxima, the partial newest page's too."""
    ids = course_ids(2, 40)
    cache = PageBoundsCache.for_model(course_model, 2, 40)
    course_model(ids[:, :21], cache=cache)
    assert check_bounds(cache) == 2 * 4 * 2
    for t in range(21, 40):
        course_model(ids[:, t : t + 1], cache=cache)
        check_bounds(cache)


def test_reused_blocks_start_afresh_and_copies_carry_their_bounds(course_model):
    """A pool of 6 blocks: a first batch fills and frees its blocks, a second batch reuses them
    (a block's old keys must not widen its new bounds); beams fork the prompt's partial block and
    copy it on write (the copy keeps the bounds, then grows them on its own)."""
    cache = PageBoundsCache(4, 4, 32, num_blocks=6, block_size=16)
    course_model(course_ids(2, 30, seed=1), cache=cache)
    for seq in (0, 1):
        cache.manager.free(seq)
    cache.batch_size, cache.length = None, 0
    course_model(course_ids(1, 20, seed=2), cache=cache)  # into blocks the first batch used
    reused = set(cache.manager.block_tables[0])
    assert check_bounds(cache) == 4 * 2 and reused  # bounds of the new keys only
    beams = cache.repeat(2)
    course_model(torch.tensor([[3], [9]]), cache=beams)  # diverge: copy-on-write of block 2
    assert beams.manager.block_tables[0][1] != beams.manager.block_tables[1][1]
    check_bounds(beams)
    assert beams.nbytes == beams.num_blocks_in_use * 4 * (2 * 16 * 4 * 32 + 2 * 4 * 32) * 4


def test_padding_gets_no_bounds(course_model):
    """Left-padded prompts: only real tokens are stored and bounded."""
    ids = course_ids(2, 24)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :9] = 0
    cache = PageBoundsCache.for_model(course_model, 2, 32)
    course_model(ids, cache=cache, attention_mask=mask)
    assert cache.seq_lens.tolist() == [24, 15]
    check_bounds(cache)


# --- Quest's bound --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (9, 3), (8, 1)]),
    page_size=st.sampled_from([1, 2, 5, 16]),
    num_pages=st.integers(1, 6),
    head_dim=st.sampled_from([1, 3, 16]),
    spread=st.floats(0.01, 100.0),
)
def test_the_bound_is_an_upper_bound_on_every_keys_score(
    seed, heads, page_size, num_pages, head_dim, spread
):
    """For any queries and keys: every key's score, for every query head of the group, is at most
    its page's bound; and for a page of one key and one query per group the bound is the score."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, num_heads, head_dim, generator=g, dtype=torch.float64) * spread
    keys = torch.randn(2, num_pages, page_size, num_kv_heads, head_dim, generator=g) * spread
    keys = keys.double()
    bound = page_upper_bounds(q, keys.amin(dim=2), keys.amax(dim=2), scale=0.5)  # (2, H_kv, P)
    group = num_heads // num_kv_heads
    grouped = q.view(2, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bpthd->bhgpt", grouped, keys) * 0.5  # (2, H_kv, G, P, page)
    best = scores.amax(dim=(2, 4))  # (2, H_kv, P): the page's best score over the group
    assert (best <= bound + 1e-12 * (1 + bound.abs())).all(), float((best - bound).max())
    if page_size == 1 and group == 1:
        torch.testing.assert_close(bound, best, rtol=1e-12, atol=1e-12)


def test_the_bound_is_the_maximum_over_the_group_not_the_mean_query():
    """A group of two query heads pointing opposite ways: the mean query scores 0 everywhere, but
    each head scores a page's keys at 1; the bound must say 1."""
    q = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])  # (1, H=2, D=2), one KV head
    keys = torch.tensor([[[[1.0, 0.0]], [[-1.0, 0.0]]]])  # (1, P=2, H_kv=1, D=2): one key a page
    bound = page_upper_bounds(q, keys, keys, scale=1.0)
    assert bound.tolist() == [[[1.0, 1.0]]]


def test_bounds_reject_bad_shapes():
    with pytest.raises(ValueError, match="key_min"):
        page_upper_bounds(torch.zeros(1, 3, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="q, key_min, key_max"):
        page_upper_bounds(torch.zeros(1, 3), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))


# --- the selection and the compacted table -------------------------------------------------------


def brute_force_selection(scores, num_pages, budget, sink, recent):
    """Plain Python: forced pages first, then the rest by descending score, `budget` in all."""
    chosen = []
    for row, count in zip(scores.tolist(), num_pages.tolist()):
        forced = {p for p in range(count) if p < sink or p >= count - recent}
        rest = sorted((p for p in range(count) if p not in forced), key=lambda p: -row[p])
        chosen.append(sorted(forced | set(rest[: max(0, budget - len(forced))])))
    return chosen


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    width=st.integers(1, 40),
    batch=st.integers(1, 5),
    sink=st.integers(0, 2),
    recent=st.integers(0, 2),
    extra=st.integers(0, 10),
)
def test_selection_matches_a_brute_force_oracle(seed, width, batch, sink, recent, extra):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, width, generator=g)  # continuous: no ties
    num_pages = torch.randint(1, width + 1, (batch,), generator=g)
    budget = max(1, sink + recent + extra)
    selected = select_pages(scores, num_pages, budget, sink_pages=sink, recent_pages=recent)
    got = [row.nonzero()[:, 0].tolist() for row in selected]
    assert got == brute_force_selection(scores, num_pages, budget, sink, recent)


def test_selection_rejects_a_budget_below_the_forced_pages():
    with pytest.raises(ValueError, match="budget: expected at least"):
        select_pages(torch.zeros(1, 4), torch.tensor([4]), 2, sink_pages=2, recent_pages=1)


def test_compaction_reads_exactly_the_selected_tokens():
    """Ragged sequences over shuffled blocks: the compacted table and length read, through the
    kernel's reference, what attention over the gathered selected tokens computes; and the
    kernel reads the same table without touching the unselected blocks (filled with NaN)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 37, 100, 64], dtype=torch.int32)
    tables, num_blocks = shuffled_block_tables(lens, 16, generator=g)
    k_pool = torch.randn(num_blocks, 16, 2, 8, generator=g)
    v_pool = torch.randn(num_blocks, 16, 2, 8, generator=g)
    q = torch.randn(4, 4, 8, generator=g)
    num_pages = (lens + 15) // 16
    selected = select_pages(torch.randn(4, tables.shape[1], generator=g), num_pages, 3)
    compact, compact_lens = compact_block_tables(tables, lens, selected, 16, 3)
    assert compact.dtype == compact_lens.dtype == torch.int32
    expected = torch.empty_like(q)
    for b in range(4):
        tokens = [
            tables[b, p] * 16 + slot
            for p in selected[b].nonzero()[:, 0].tolist()
            for slot in range(min(16, int(lens[b]) - 16 * p))
        ]
        assert int(compact_lens[b]) == len(tokens)
        k = k_pool.flatten(0, 1)[torch.tensor(tokens)].repeat_interleave(2, dim=1)  # (n, H, D)
        v = v_pool.flatten(0, 1)[torch.tensor(tokens)].repeat_interleave(2, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[b], k) * 8**-0.5).softmax(dim=-1)
        expected[b] = torch.einsum("hn,nhd->hd", weights, v)
    ref = kernels.paged_decode_attention_ref(q, k_pool, v_pool, compact, compact_lens)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    if kernels.triton_available():
        unread = torch.ones(num_blocks, dtype=torch.bool)
        for b in range(4):
            unread[compact[b, : int(selected[b].sum())].long()] = False
        k_pool[unread], v_pool[unread] = float("nan"), float("nan")
        out = kernels.paged_decode_attention(q, k_pool, v_pool, compact, compact_lens)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_compaction_refuses_a_selection_without_its_newest_page():
    selected = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="newest page"):
        compact_block_tables(torch.tensor([[4, 5, 6]]), torch.tensor([40]), selected, 16, 3)


# --- the sparse cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("selector", ["quest", "oracle", "random"])
def test_a_budget_of_every_page_is_dense_attention(course_model, selector):
    """Every page selected: the same logits as the paged cache, through the compacted tables."""
    ids = course_ids(3, 70)
    dense = streamed_logits(course_model, ids, PagedCache.for_model(course_model, 3, 70))
    cache = SparsePagedCache.for_model(
        course_model, 3, 70, budget_pages=5, dense_layers=0, selector=selector,
        decode_attention="torch",
    )  # fmt: skip
    sparse = streamed_logits(course_model, ids, cache)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    counts = cache.read_counts()
    assert counts["kv_tokens_read"] == counts["kv_tokens_held"] > 0


def test_a_budget_of_every_page_is_dense_on_smollm2(smollm2):
    model, tokenizer = smollm2
    chat = torch.tensor(
        [tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}])]
    )
    expected = generate(model, chat, 6, cache="dynamic")
    factory = SparsePagedCache.factory(budget_pages=64, dense_layers=0, decode_attention="torch")
    assert torch.equal(generate(model, chat, 6, cache=factory), expected)


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
def test_the_kernel_path_equals_the_torch_path(course_model):
    """A few decode steps through chapter 11's kernel (the interpreter on a CPU) against the same
    compacted tables read by the torch reference, at a sparse budget."""
    ids = course_ids(2, 40)
    logits = {}
    for path in ("kernel", "torch"):
        cache = SparsePagedCache.for_model(
            course_model, 2, 40, budget_pages=2, dense_layers=2, decode_attention=path
        )
        logits[path] = streamed_logits(course_model, ids, cache, prefill_len=36)
    torch.testing.assert_close(logits["kernel"], logits["torch"], rtol=1e-4, atol=1e-4)


def test_a_small_budget_reads_what_the_equation_says(course_model):
    """Streamed one token at a time (the first forward is one token too), the cache's counts of
    K/V tokens and bounds read equal the sum over steps of `sparse_decode_read_bytes` (float32:
    4 bytes)."""
    ids = course_ids(2, 90)
    cache = SparsePagedCache.for_model(course_model, 2, 90, budget_pages=3, dense_layers=1)
    cache.decode_attention = "torch"
    streamed_logits(course_model, ids, cache)
    counts = cache.read_counts()
    config = {**course_model.config.__dict__, "model_type": "llama", "torch_dtype": "float32"}
    per_token = 2 * 4 * 32 * 4  # one layer's K and V of one token, bytes
    expected = sum(
        sparse_decode_read_bytes(config, t, 3, dense_layers=1, batch_size=2) for t in range(1, 91)
    )
    read = counts["kv_tokens_read"] + counts["bound_pages_read"]
    assert read * per_token == expected
    dense = sum(kv_cache_bytes(config, t, 2) for t in range(1, 91))
    assert counts["kv_tokens_held"] * per_token == dense


def test_the_equation_on_a_real_config():
    """Llama 3 8B at 128k tokens: the bounds are 1/16 of the cache; reading 512 pages of 16 in 30
    of 32 layers reads 2 · 128k + 30 · (8,192 + 8,192 pages) token-equivalents of 32."""
    from kvlib.config import CONFIG_DIR

    config = str(CONFIG_DIR / "llama-3-8b.json")
    assert kv_cache_bytes(config, 131072) == 16 * page_bounds_bytes(config, 131072)
    read = sparse_decode_read_bytes(config, 131072, 512)
    assert read * 32 == kv_cache_bytes(config, 131072) * (2 + 30 * (8192 + 8192) / 131072)
    assert sparse_decode_read_bytes(config, 100, 512) == kv_cache_bytes(config, 100)


def test_sparse_cache_rejects_bad_options(course_model):
    with pytest.raises(ValueError, match="selector"):
        SparsePagedCache(4, 4, 32, num_blocks=4, selector="best")
    with pytest.raises(ValueError, match="budget_pages: expected at least"):
        SparsePagedCache(4, 4, 32, num_blocks=4, budget_pages=1)
    with pytest.raises(ValueError, match="power of two"):
        SparsePagedCache(4, 4, 32, num_blocks=4, block_size=12)
    with pytest.raises(ValueError, match="decode_attention"):
        SparsePagedCache(4, 4, 32, num_blocks=4, decode_attention="fast")


# --- the offline trace ----------------------------------------------------------------------------


def test_the_oracle_captures_most_and_quest_beats_random(course_model):
    """On a recall document, per layer: oracle >= Quest and oracle >= random on every query (the
    oracle's pages hold the most mass of any selection), and the masses are shares in [0, 1]."""
    from kvlib import data

    doc = torch.from_numpy(data.recall_documents(128, 1)[0].tokens)[None]
    layers = attention_inputs(course_model, doc)
    assert len(layers) == 4 and layers[0].queries.shape == (4, 256, 32)
    for layer in layers:
        shares = {
            s: captured_mass(layer.queries, layer.keys, 16, 4, selector=s, first_query=64)
            for s in ("quest", "oracle", "random")
        }
        assert ((shares["oracle"] >= shares["quest"] - 1e-6) & (shares["quest"] <= 1 + 1e-6)).all()
        assert (shares["oracle"] >= shares["random"] - 1e-6).all()


def test_heaviest_old_pages_never_count_an_excluded_page():
    """A query with fewer than k old pages gets no picks (a top-k over fewer candidates returns
    excluded pages: the sink, its own page or the skipped ones), and picks are the heaviest
    candidates; the overlap counts only pairs with picks."""
    mass = torch.rand(60, 8, generator=torch.Generator().manual_seed(0))  # queries 64..123
    for skip in (0, 2):
        picks = heaviest_old_pages(mass, 64, 16, 2, skip=skip)
        for i, chosen in enumerate(picks):
            end = (64 + i) // 16 - skip  # candidates: pages 1 .. end - 1
            if end - 1 < 2:
                assert chosen is None
            else:
                best = set((torch.argsort(mass[i, 1:end], descending=True)[:2] + 1).tolist())
                assert chosen == best and all(1 <= j < end for j in chosen)
    picks = heaviest_old_pages(mass, 64, 16, 2, skip=2)  # queries 64..79 have one candidate
    assert picks[0] is None and picks[16] is not None
    assert page_overlap([{1, 2}, None, {2, 3}, {2, 3}], 1) == 1.0  # only the (2, 3) pair
    assert page_overlap([{1, 2}, {2, 3}, {4, 5}], 2) == 0.0
    with pytest.raises(ValueError, match="no pair"):
        page_overlap([None, {1, 2}], 1)
    with pytest.raises(ValueError, match="k, skip"):
        heaviest_old_pages(mass, 64, 16, 0)


def test_page_selection_is_what_captured_mass_counts(course_model):
    from kvlib import data

    doc = torch.from_numpy(data.recall_documents(128, 1)[0].tokens)[None]
    layer = attention_inputs(course_model, doc)[2]
    mass, chosen = page_selection(layer.queries, layer.keys, 16, 4, first_query=64, recent_pages=0)
    assert chosen.shape == mass.shape and (chosen.sum(dim=1) <= 4).all()
    share = captured_mass(layer.queries, layer.keys, 16, 4, first_query=64, recent_pages=0)
    torch.testing.assert_close(share, (mass * chosen).sum(dim=1) / mass.sum(dim=1))
    with pytest.raises(ValueError, match="selector"):
        page_selection(layer.queries, layer.keys, 16, 4, selector="best")


def test_attention_mass_per_page_sums_to_the_group_size():
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 50], dtype=torch.int32)
    tables, num_blocks = shuffled_block_tables(lens, 16, generator=g)
    mass = attention_mass_per_page(
        torch.randn(2, 6, 8, generator=g), torch.randn(num_blocks, 16, 2, 8, generator=g),
        tables, lens,
    )  # fmt: skip
    torch.testing.assert_close(mass.sum(dim=-1), torch.full((2, 2), 3.0))
    assert mass[0, :, 1:].abs().max() == 0 and math.isclose(float(mass[1, 0, 3] >= 0), 1.0)


def test_gathered_bounds_follow_the_block_table():
    key_min = torch.arange(5.0)[:, None, None].expand(5, 1, 2)
    low, high = gather_page_bounds(key_min, key_min + 1, torch.tensor([[3, 1]]))
    assert low[0, :, 0, 0].tolist() == [3.0, 1.0] and high[0, :, 0, 0].tolist() == [4.0, 2.0]
    assert np.isclose(float(high.sum() - low.sum()), 4.0)


# --- the GPU benchmark's code path, on the CPU ----------------------------------------------------


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
def test_the_sparse_benchmark_runs_its_code_path_on_tiny_shapes(tmp_path):
    """`python -m kvlib.experiments.sparse_bench --tiny`: every case checks its sparse output
    against the kernel's reference before timing; the rows say what ran and what was read."""
    import csv

    from kvlib.experiments.sparse_bench import main

    out = tmp_path / "sparse_bench.csv"
    assert main(["--tiny", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [float(r["fraction"]) for r in rows] == [0.125, 0.5, 1.0]
    for row in rows:
        budget, pages = int(row["budget"]), int(row["pages"])
        assert int(row["compact_tokens"]) == budget * 16  # every page of 512 tokens is full
        per_token = 2 * int(row["heads_kv"]) * int(row["head_dim"]) * 4
        read = (budget * 16 + (pages if budget < pages else 0)) * per_token
        assert int(row["sparse_bytes"]) == read and int(row["dense_bytes"]) == 512 * per_token
        assert all(float(row[f"{t}_us"]) > 0 for t in ("dense", "select", "attend", "sparse"))
    assert row["device"] == "CPU (Triton interpreter)" and row["commit"] and row["date"]


def test_the_sweeps_eviction_baseline_is_chapter_8s_best_per_task():
    """BEST_EVICTION names, for each task, the policy of results/eviction_sweep.csv with the
    highest mean recall, the most passkeys, the lowest mean KL on the essay."""
    import csv
    from collections import defaultdict

    from kvlib.course.recorded import recorded_file
    from kvlib.experiments.sparse_sweep import BEST_EVICTION

    totals = defaultdict(list)
    for row in csv.DictReader(recorded_file("eviction_sweep.csv").open()):
        if row["policy"] != "full" and row["metric"] in ("recall", "correct", "mean_kl"):
            totals[row["task"], row["policy"]].append(float(row["value"]))
    best = {
        task: pick((np.mean(v), policy) for (t, policy), v in totals.items() if t == task)[1]
        for task, pick in (("recall", max), ("passkey", max), ("text", min))
    }
    assert best == BEST_EVICTION


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_reads_the_compacted_tables_on_a_gpu(course_model):
    """On a GPU the kernel is compiled: the course model decoding through it at a sparse budget
    matches the same tables read by the torch path, and a budget of every page matches dense."""
    model = load_course_model().to("cuda")
    ids = course_ids(3, 80).to("cuda")
    dense = streamed_logits(model, ids, PagedCache.for_model(model, 3, 80))
    logits = {}
    for path, budget in (("kernel", 3), ("torch", 3), ("kernel", 5)):
        cache = SparsePagedCache.for_model(
            model, 3, 80, budget_pages=budget, dense_layers=1, decode_attention=path
        )
        logits[path, budget] = streamed_logits(model, ids, cache)
    torch.testing.assert_close(logits["kernel", 3], logits["torch", 3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits["kernel", 5], dense, rtol=1e-4, atol=1e-4)


def test_the_traces_page_mass_is_the_oracles_through_a_block_table():
    """`trace.page_mass` (keys in order) == `baselines.attention_mass_per_page` (keys through a
    PageBoundsCache's block table), summed over KV heads, for every 3rd query from 10."""
    from kvlib.sparse.trace import page_mass

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 100, 64, generator=g), torch.randn(3, 100, 64, generator=g)
    cache = PageBoundsCache(1, 3, 64, num_blocks=7, block_size=16)
    cache.update(0, k[None], k[None])
    rows = torch.arange(10, 100, 3)
    table = torch.tensor(cache.manager.block_tables[0]).expand(len(rows), -1)
    oracle = attention_mass_per_page(
        q[:, rows].transpose(0, 1), cache.key_cache[0], table, rows + 1
    )
    torch.testing.assert_close(page_mass(q, k, 16, 10, 3), oracle.sum(dim=1))


# --- the recorded sweep, spot-checked ------------------------------------------------------------

SWEEP = "sparse_sweep.csv"


def sweep_rows(task, policy, budget, dense_layers, metric) -> dict:
    """{x: value} of one run's rows in results/sparse_sweep.csv."""
    import csv

    from kvlib.course.recorded import recorded_file

    return {
        row["x"]: float(row["value"])
        for row in csv.DictReader(recorded_file(SWEEP).open())
        if (row["task"], row["policy"], row["budget"], row["dense_layers"], row["metric"])
        == (task, policy, str(budget), str(dense_layers), metric)
    }


def test_recorded_sparse_sweep_documents_pool_to_each_distance_rate():
    """Every recall run's per-document hits (chapter 15's paired bootstrap) sum, per distance, to
    the recorded rate and fact count: the two views of one run agree."""
    import collections
    import csv

    from kvlib.course.recorded import recorded_file

    rows = [r for r in csv.DictReader(recorded_file(SWEEP).open()) if r["task"] == "recall"]
    runs = collections.defaultdict(dict)
    for r in rows:
        runs[r["policy"], r["budget"], r["dense_layers"]][r["metric"], r["x"]] = float(r["value"])
    assert len(runs) >= 16
    for run, values in runs.items():
        hits, asked = collections.Counter(), collections.Counter()
        for (metric, x), value in values.items():
            if metric.startswith("document_"):
                distance = x.split(":")[0]
                (hits if metric == "document_hits" else asked)[distance] += value
        assert set(asked) == {x for metric, x in values if metric == "recall"}, run
        for distance, n in asked.items():
            assert n == values["facts", distance], (run, distance)
            assert hits[distance] / n == pytest.approx(values["recall", distance]), (run, distance)


@pytest.mark.recorded
def test_recorded_sparse_sweep_spot_check_recall(course_model):
    """Quest at 4 pages on the course model's recall at the shortest and longest distances, and
    the matched eviction budgets, as recorded (a flipped argmax moves a cell by 1/128)."""
    from kvlib.experiments import sparse_sweep as S
    from kvlib.metrics.recall import recall_by_distance

    recorded = sweep_rows("recall", "quest", 4, 1, "recall")
    got = recall_by_distance(course_model, (8, 240), cache_factory=S.sparse_factory("quest", 4, 1))
    for distance, value in got.items():
        assert abs(value - recorded[str(distance)]) <= 0.02, (distance, value, recorded)
    config, lengths = S.hf_config(course_model), list(range(1, 257))
    for pages in S.SPARSE_BUDGETS["recall"]:
        budget = S.matched_eviction_budget(config, lengths, pages, 1)
        assert sweep_rows("recall", S.BEST_EVICTION["recall"], budget, 0, "recall"), budget


@pytest.mark.recorded
@pytest.mark.slow
def test_recorded_sparse_sweep_spot_check_smollm2(smollm2):
    """SmolLM2: Quest at 8 pages on the essay (streamed a token at a time) within 5% of the
    recorded metrics, and the recorded passkey trial at depth 0.5, answered alike."""
    from kvlib.experiments import sparse_sweep as S
    from kvlib.experiments.sweep import EVICTION_CHUNK, EVICTION_PASSKEY_FILLER
    from kvlib.metrics.passkey import passkey_trial
    from kvlib.metrics.quality import course_text

    model, tokenizer = smollm2
    essay = torch.tensor([tokenizer.encode(course_text())])
    with torch.no_grad():
        reference = model(essay)
    factory = S.sparse_factory("quest", 8, 2)
    got = S.streamed_essay_metrics(model, essay, factory, reference)
    for metric in ("perplexity", "top1_agreement", "mean_kl"):
        (value,) = sweep_rows("text", "quest", 8, 2, metric).values()
        assert abs(got[metric] - value) <= 0.05 * abs(value) + 0.01, (metric, got, value)
    key = dict(
        zip((0.1, 0.3, 0.5, 0.7, 0.9), np.random.default_rng(0).integers(10_000, 100_000, 5))
    )
    correct, _ = passkey_trial(
        model,
        tokenizer,
        EVICTION_PASSKEY_FILLER,
        0.5,
        int(key[0.5]),
        cache_factory=factory,
        max_new_tokens=S.PASSKEY_NEW_TOKENS,
        prefill_chunk_size=EVICTION_CHUNK,
    )
    assert int(correct) == sweep_rows("passkey", "quest", 8, 2, "correct")["0.5"]


def test_captured_mass_is_causal():
    """The trace's selection for query t uses no key after t (issue 55): keys after the query,
    changed at will, change nothing, even with the query's own page left to its score."""
    from kvlib.sparse.trace import captured_mass

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 70, 16, generator=g), torch.randn(2, 70, 16, generator=g)
    for t in (37, 40, 47, 50):  # queries early, mid and late in their pages
        changed = k.clone()
        changed[:, t + 1 :] = 10 * torch.randn(2, 70 - t - 1, 16, generator=g)
        for recent in (0, 1):
            full, future, cut = (
                captured_mass(qq, kk, 16, 2, first_query=t, every=100, recent_pages=recent)
                for qq, kk in ((q, k), (q, changed), (q[:, : t + 1], k[:, : t + 1]))
            )
            torch.testing.assert_close(full, future)
            torch.testing.assert_close(full, cut)


def test_bounds_dtype_in_the_equation():
    """The bounds' dtype is the equation's argument (issue 55): float32 bounds over a 16-bit
    cache are 2 / block_size of it; the default keeps the cache's dtype, as before."""
    from kvlib.config import CONFIG_DIR
    from kvlib.memory import kv_cache_bytes, page_bounds_bytes, sparse_decode_read_bytes

    config = str(CONFIG_DIR / "llama-2-7b.json")
    cache = kv_cache_bytes(config, 32768, cache_dtype="float16")
    assert page_bounds_bytes(config, 32768, cache_dtype="float16") * 16 == cache
    assert (
        page_bounds_bytes(config, 32768, cache_dtype="float16", bounds_dtype="float32") * 8 == cache
    )
    same = sparse_decode_read_bytes(config, 32768, 128, cache_dtype="float16")
    wide = sparse_decode_read_bytes(
        config, 32768, 128, cache_dtype="float16", bounds_dtype="float32"
    )
    bounds_read = page_bounds_bytes(config, 32768, cache_dtype="float16") * 30 // 32  # 30 sparse
    assert wide - same == bounds_read


def test_sparse_long_shares_one_prefill(smollm2):
    """kvlib.experiments.sparse_long: every selector decodes from a copy of one dense prefill, so
    the copies start equal and the base cache is left as it was; the book's prose is long
    enough for the recording."""
    from kvlib.experiments.sparse_long import (
        TEXT_TOKENS,
        _with_selection,
        long_text,
        sparse_policies,
    )
    from kvlib.experiments.sparse_sweep import sparse_factory

    model, tokenizer = smollm2
    assert long_text(tokenizer).shape == (1, TEXT_TOKENS)
    assert ("full", None, 0) in sparse_policies() and ("quest", 8, 0) in sparse_policies()
    ids = long_text(tokenizer)[:, :40]
    base = sparse_factory("quest", None, 0)(model, 1, 64)
    with torch.no_grad():
        model(ids, cache=base)
    copy = _with_selection(base, "oracle", 2, 2)
    assert (copy.selector, copy.budget_pages, base.selector, base.budget_pages) == (
        "oracle",
        2,
        "quest",
        None,
    )
    with torch.no_grad():
        model(ids[:, -1:], cache=copy, validate=False)
    assert int(base.seq_lens[0]) == 40 and int(copy.seq_lens[0]) == 41


@pytest.mark.recorded
def test_recorded_sparse_long_spot_check_passkey_length(smollm2):
    """results/sparse_long.csv: the full cache's passkey at the shortest recorded length (1,000
    tokens of filler) recomputed: the same prompt length and the same answer (found or not)."""
    import csv

    from kvlib.course.recorded import recorded_file
    from kvlib.experiments import sparse_long as L

    model, tokenizer = smollm2
    filler = min(L.PASSKEY_LENGTH_FILLERS)
    length, found = L.full_cache_passkey(model, tokenizer, filler, L.passkey_key())
    rows = [
        r
        for r in csv.DictReader(recorded_file("sparse_long.csv").open())
        if r["task"] == "passkey_length"
    ]
    assert len(rows) == len(L.PASSKEY_LENGTH_FILLERS), rows
    recorded = {int(r["x"]): int(r["value"]) for r in rows}
    assert recorded.get(length) == found, (length, found, recorded)
