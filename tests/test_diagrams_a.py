"""Chapters 1-7's diagrams (kvlib.course.diagrams): each draws without error, and what it draws
follows its arguments (boxes counted by their gid) or the kvlib object it is drawn from."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvlib.cache.block_manager import BlockManager  # noqa: E402
from kvlib.cache.block_pool import BlockPool  # noqa: E402
from kvlib.course.diagrams import (  # noqa: E402
    cache_bytes,
    cached_decode,
    head_sharing,
    mla,
    online_softmax,
    paging,
    prefill_decode,
)
from kvlib.course.diagrams._boxes import count  # noqa: E402
from kvlib.ref.online_softmax import split_k_attention  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _lines(fig, gid: str) -> int:
    return sum(1 for ax in fig.axes for line in ax.lines if line.get_gid() == gid)


@pytest.mark.parametrize("n", [1, 3, 7])
def test_layer_cache_per_token_keeps_k_and_v_rows_not_q(n):
    fig = cached_decode.layer_cache_per_token(n)
    assert count(fig, "q_row") == count(fig, "k_row") == count(fig, "v_row") == n
    assert count(fig, "cached") == 2 * n
    faded = [p for p in fig.axes[0].patches if p.get_gid() == "q_row" and p.get_alpha() < 1]
    assert len(faded) == n - 1  # only the newest query is used


@pytest.mark.parametrize("n", [1, 4, 9])
def test_decode_step_work_counts_the_scores_each_step_computes(n):
    fig = cached_decode.decode_step_work(n)
    naive, cached = fig.axes
    computed = [sum(p.get_gid() == "computed" for p in ax.patches) for ax in (naive, cached)]
    assert computed == [n * (n + 1) // 2, n]
    assert count(fig, "computed") + count(fig, "skipped") == 2 * n * n


@pytest.mark.parametrize("bad", [0, 25, 2.0])
def test_cached_decode_rejects_bad_sizes(bad):
    with pytest.raises((TypeError, ValueError), match="num_tokens"):
        cached_decode.decode_step_work(bad)


@pytest.mark.parametrize(("p", "g", "c"), [(6, 2, 3), (5, 1, 5), (7, 3, 2)])
def test_prefill_and_decode_draws_each_pass(p, g, c):
    fig = prefill_decode.prefill_and_decode(p, g, c)
    prefill, decode, chunked = fig.axes
    last_chunk = p - (p - 1) // c * c

    def tagged(ax, gid):
        return sum(patch.get_gid() == gid for patch in ax.patches)

    assert [tagged(ax, "query") for ax in fig.axes] == [p, 1, last_chunk]
    assert [tagged(ax, "written") for ax in fig.axes] == [p, 1, last_chunk]
    assert [tagged(ax, "read") for ax in fig.axes] == [0, p + g - 1, p - last_chunk]
    assert tagged(prefill, "allowed") == p * (p + 1) // 2  # causal within the prompt
    assert tagged(decode, "allowed") == p + g  # the one query sees the whole cache
    masked = last_chunk * (last_chunk - 1) // 2  # causal within the chunk, full over the prefix
    assert tagged(chunked, "masked") == masked


def test_prefill_and_decode_rejects_a_chunk_longer_than_the_prompt():
    with pytest.raises(ValueError, match="chunk_len"):
        prefill_decode.prefill_and_decode(4, 1, 5)


@pytest.mark.parametrize(("layers", "kv_heads"), [(2, 1), (6, 4), (32, 8)])
def test_token_cache_layout_draws_h_kv_keys_and_values_per_layer(layers, kv_heads):
    fig = cache_bytes.token_cache_layout(layers, kv_heads, 128, 2)
    drawn = min(layers, cache_bytes.MAX_DRAWN_LAYERS - 1 if layers > 6 else layers)
    assert count(fig, "key_vector") == count(fig, "value_vector") == drawn * kv_heads
    assert count(fig, "elided") == (1 if layers > cache_bytes.MAX_DRAWN_LAYERS else 0)
    assert f"{2 * layers * kv_heads * 128 * 2:,} bytes per token" in fig.axes[0].get_title()


@pytest.mark.parametrize("split", [1, 3, 7])
def test_merge_two_states_matches_the_softmax_over_all_scores(split):
    rng = np.random.default_rng(split)
    scores, values = rng.normal(size=8) * 3, rng.normal(size=8)
    fig = online_softmax.merge_two_states(scores, values, split)
    assert count(fig, "score") == 8 and count(fig, "state") == 3
    weights = np.exp(scores - scores.max())
    expected = f"{weights @ values / weights.sum():.4f}"
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("out")]
    assert texts and texts[0].count(expected) == 2  # the merge and the direct softmax agree


def test_merge_two_states_rejects_a_split_outside_the_scores():
    with pytest.raises(ValueError, match="split"):
        online_softmax.merge_two_states(np.zeros(4), np.zeros(4), 4)


@pytest.mark.parametrize(("s", "n"), [(1000, 4), (10, 3), (3, 5)])
def test_split_k_draws_one_chunk_and_program_per_split(s, n):
    fig = online_softmax.split_k(s, n)
    assert count(fig, "chunk") == count(fig, "program") == n
    assert "equals" in fig.axes[0].get_title()
    # the drawn chunks are split_k_attention's: same bounds, so the same result
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 8)), rng.normal(size=(s, 8)), rng.normal(size=(s, 8))
    out = split_k_attention(q, k, v, num_splits=n)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("counts", [(8, 2, 1), (4,), (12, 3)])
def test_head_sharing_joins_every_query_head_to_its_group(counts):
    h = counts[0]
    fig = head_sharing.head_sharing(h, counts)
    for ax, h_kv in zip(fig.axes, counts, strict=True):
        assert sum(p.get_gid() == "query_head" for p in ax.patches) == h
        assert sum(p.get_gid() == "kv_head" for p in ax.patches) == h_kv
        assert sum(line.get_gid() == "share" for line in ax.lines) == h
    owner = head_sharing.kv_head_of_query_head(8, 2)
    assert owner.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # repeat_interleave's grouping


def test_head_sharing_rejects_a_kv_head_count_that_does_not_divide():
    with pytest.raises(ValueError, match="num_kv_heads"):
        head_sharing.head_sharing(8, (3,))


@pytest.mark.parametrize(("h_kv", "d_c", "d_r"), [(8, 512, 64), (1, 128, 32)])
def test_mla_vs_gqa_draws_to_scale(h_kv, d_c, d_r):
    fig = mla.mla_vs_gqa(h_kv, 128, d_c, d_r, 16)
    assert count(fig, "gqa_vector") == 2 * h_kv
    assert count(fig, "latent") == count(fig, "rope") == 1
    patches = [p for p in fig.axes[0].patches if p.get_gid() in ("latent", "rope")]
    widths = {p.get_gid(): p.get_width() for p in patches}
    gqa_width = sum(p.get_width() for p in fig.axes[0].patches if p.get_gid() == "gqa_vector")
    assert widths["latent"] / widths["rope"] == pytest.approx(d_c / d_r)
    assert gqa_width / (widths["latent"] + widths["rope"]) == pytest.approx(
        2 * h_kv * 128 / (d_c + d_r)
    )


def test_block_table_diagram_draws_the_managers_tables():
    manager = BlockManager(BlockPool(num_blocks=8, block_size=4))
    manager.allocate("A", [1, 2, 3, 4, 5, 6])
    manager.fork("A", "A2")
    manager.allocate("C", [1, 2, 3, 4, 9])  # shares A's first, full block
    fig = paging.block_table_diagram(manager)
    entries = sum(len(t) for t in manager.block_tables.values())
    assert count(fig, "logical_block") == entries == 6
    assert _lines(fig, "table_entry") == entries
    assert count(fig, "physical_block") == 8
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "ref_cnt 3 (shared)" in texts  # A, A2 and C share block table[0]
    assert any(t.startswith(f"block table {manager.block_tables['C']}") for t in texts)


def test_block_table_diagram_rejects_other_objects():
    with pytest.raises(TypeError, match="manager"):
        paging.block_table_diagram(object())
