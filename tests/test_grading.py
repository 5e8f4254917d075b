"""The grader: solutions score full marks, untouched exercises zero, and planted mistakes or
hostile learner code lose exactly the question they touch."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from kvlib.course.grader import grade_bindings
from kvlib.course.grading import chapter_of, chapter_questions, grade_notebook
from kvlib.course.sandbox import _cell_code
from tests.test_check_diagnostics import MISTAKES

ROOT = Path(__file__).resolve().parents[1]
# The grader's child hides kvlib in a mount namespace here (Linux, root, not turned off): an answer
# that reaches for kvlib then fails where it first touches it, before the Python-level guard that
# names the rule in other settings could
ISOLATED = sys.platform == "linux" and os.geteuid() == 0 and os.environ.get(
    "KVLIB_GRADE_ISOLATION") != "0"  # fmt: skip


def names_the_rule(phrase: str, message: str) -> bool:
    """Whether a failed answer's feedback names the rule `phrase`, or, in the mount namespace,
    shows that the kvlib the answer reached for was not there."""
    if phrase in message:
        return True
    hidden = ("is unavailable while your notebook is graded", "could not get source code",
              f"No such file or directory: '{ROOT / 'kvlib'}")  # fmt: skip
    return ISOLATED and any(h in message for h in hidden)


class Flagged(str):
    """The expectation of an answer that scores full marks with a flag naming this phrase: how it
    computed, by its own process's word, which is said but never scored (issue 57)."""


FLAG = "flag (reported by your process, not scored)"


SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 30


@pytest.fixture(autouse=True)
def _no_guards_left_behind():
    """A test that runs check() in this process (a notebook's stand-in) takes its guards away
    when it ends, as a notebook's process never does: the draws tests may run next in this
    worker (issue 56, item 14)."""
    yield
    if "kvlib.course.guards" in sys.modules:
        sys.modules["kvlib.course.guards"].remove_guards()


def test_remove_guards_gives_kvlib_its_code_back(capsys):
    """After check() and remove_guards, a call run as a graded call reaches kvlib again (what the
    draws tests do in the same worker)."""
    import numpy as np

    from kvlib.course.grading import check
    from kvlib.course.guards import GradingError, call_learner, remove_guards
    from kvlib.ref.attention import softmax

    x = np.array([0.0, 1.0])
    assert check("stable_softmax", lambda x: softmax(x)) is None  # the printed line says
    assert capsys.readouterr().out.startswith("❌ stable_softmax")
    with pytest.raises(GradingError):
        call_learner(softmax, (x,), {}, None)
    remove_guards()
    assert call_learner(softmax, (x,), {}, None).shape == (2,)


def test_every_exercise_has_a_solution_and_questions():
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS] and EXERCISES
    for path in EXERCISES:
        assert len(chapter_questions(chapter_of(path))) >= 3, (
            f"{path.name}: fewer than 3 graded questions"
        )


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solutions_get_full_marks(path):
    report = grade_notebook(path, timeout_s=TIMEOUT_S)
    assert report.score == report.max_score > 0, report.table()
    assert not any(FLAG in q.message for q in report.questions), report.table()  # none flagged


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_untouched_exercises_get_zero(path):
    report = grade_notebook(path, timeout_s=TIMEOUT_S)
    assert report.score == 0 and report.max_score > 0, report.table()
    assert all("NotImplementedError" in q.message for q in report.questions), report.table()


def with_cell_replaced(
    solution: Path, function: str, new_source: str | None, tmp_path: Path
) -> Path:
    """A copy of `solution` whose cell defining `function` is replaced by `new_source` (None:
    deleted)."""
    notebook = nbformat.read(solution, as_version=4)
    matches = [
        c for c in notebook.cells if c.cell_type == "code" and f"def {function}(" in c.source
    ]
    assert len(matches) == 1, f"expected one cell defining {function} in {solution.name}"
    if new_source is None:
        notebook.cells.remove(matches[0])
    else:
        matches[0].source = new_source
    path = tmp_path / solution.name
    nbformat.write(notebook, path)
    return path


# (chapter notebook, question, plausible wrong answer, a phrase the feedback must contain)
WRONG_ANSWERS = [
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        """
def stable_softmax(x):  # forgets the max-subtraction
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)
""",
        "Subtract each row's maximum",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        """
def stable_softmax(x):  # normalises over the wrong axis
    e = np.exp(x - np.max(x, axis=0, keepdims=True))
    return e / np.sum(e, axis=0, keepdims=True)
""",
        "max abs difference",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "cached_attention_step",
        """
# attends before appending: off by one
def cached_attention_step(q, k_new, v_new, k_cache, v_cache):
    if len(k_cache) == 0:
        out = v_new
    else:
        out = stable_softmax(k_cache @ q / np.sqrt(len(q))) @ v_cache
    return out, np.vstack([k_cache, k_new]), np.vstack([v_cache, v_new])
""",
        "output of step 1",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "cached_attention_step",
        """
def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # forgets to keep the new row
    k_all, v_all = np.vstack([k_cache, k_new]), np.vstack([v_cache, v_new])
    return stable_softmax(k_all @ q / np.sqrt(len(q))) @ v_all, k_cache, v_cache
""",
        "the caches should hold 1 rows",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "predict_score_entries",
        """
# counts only unmasked entries
def predict_score_entries(prompt_len, max_new_tokens, num_layers, cached):
    if cached:
        return num_layers * (
            prompt_len * (prompt_len + 1) // 2
            + sum(prompt_len + i for i in range(1, max_new_tokens))
        )
    return num_layers * sum(
        n * (n + 1) // 2 for n in range(prompt_len, prompt_len + max_new_tokens)
    )
""",
        "you predicted",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "predict_score_entries",
        """
# off by one in the cache length
def predict_score_entries(prompt_len, max_new_tokens, num_layers, cached):
    if cached:
        return num_layers * (
            prompt_len**2 + sum(prompt_len + i - 1 for i in range(1, max_new_tokens))
        )
    return num_layers * sum(n * n for n in range(prompt_len, prompt_len + max_new_tokens))
""",
        "cached generation",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "kv_cache_bytes",
        """
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):  # forgets V
    return num_layers * num_heads * head_dim * bytes_per_element * seq_len
""",
        "should be 524288",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "rope_at_offset",
        """
def rope_at_offset(x, offset, theta):  # ignores the offset: every decode step at position 0
    t, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()
""",
        "offset=37",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "rope_at_offset",
        """
def rope_at_offset(x, offset, theta):  # the interleaved (GPT-J) pairing instead of rotate_half
    t, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(offset, offset + t, dtype=torch.float32)[:, None] * inv_freq
    even, odd = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = even * angles.cos() - odd * angles.sin()
    out[:, 1::2] = even * angles.sin() + odd * angles.cos()
    return out
""",
        "offset=37",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "static_cache_insert",
        """
def static_cache_insert(buffer, length, k_new):  # concatenates instead of writing in place
    return torch.cat([buffer[:, :, :length], k_new], dim=2)
""",
        "the buffer should hold the new rows",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "static_cache_insert",
        """
def static_cache_insert(buffer, length, k_new):  # no overflow check
    buffer[:, :, length : length + k_new.shape[2]] = k_new
    return buffer[:, :, : length + k_new.shape[2]]
""",
        "RuntimeError",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "reorder_for_beams",
        """
def reorder_for_beams(layer_caches, beam_indices):  # reorders the keys but forgets the values
    return [(keys[beam_indices], values) for keys, values in layer_caches]
""",
        "layer 0 values",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "reorder_for_beams",
        """
# inverts the permutation instead of following it
def reorder_for_beams(layer_caches, beam_indices):
    order = torch.argsort(beam_indices)
    return [(keys[order], values[order]) for keys, values in layer_caches]
""",
        "layer 0 keys",
    ),
    (
        "03_counting_bytes.ipynb",
        "gqa_bytes_per_token",
        """
def gqa_bytes_per_token(config):  # ignores num_key_value_heads: every head gets K and V
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        2
        * config["num_hidden_layers"]
        * config["num_attention_heads"]
        * head_dim
        * BYTES_PER_ELEMENT[config["torch_dtype"]]
    )
""",
        "expected 131,072 bytes per token",
    ),
    (
        "03_counting_bytes.ipynb",
        "gqa_bytes_per_token",
        """
def gqa_bytes_per_token(config):  # assumes head_dim = hidden_size / num_attention_heads
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * head_dim
        * BYTES_PER_ELEMENT[config["torch_dtype"]]
    )
""",
        "head_dim=128",
    ),
    (
        "03_counting_bytes.ipynb",
        "mla_cache_bytes",
        """
# drops the layer factor
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, seq_len, bytes_per_element):
    return (kv_lora_rank + qk_rope_head_dim) * seq_len * bytes_per_element
""",
        "expected 70,272 bytes",
    ),
    (
        "03_counting_bytes.ipynb",
        "mla_cache_bytes",
        """
# caches the latent twice, as if K and V
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, seq_len, bytes_per_element):
    return 2 * num_layers * (kv_lora_rank + qk_rope_head_dim) * seq_len * bytes_per_element
""",
        "expected 70,272 bytes",
    ),
    (
        "03_counting_bytes.ipynb",
        "max_batch",
        """
# a fraction of a sequence
def max_batch(gpu_memory_bytes, weight_bytes, overhead_bytes, kv_bytes_per_token, seq_len):
    return (gpu_memory_bytes - weight_bytes - overhead_bytes) / (kv_bytes_per_token * seq_len)
""",
        "should return an int",
    ),
    (
        "03_counting_bytes.ipynb",
        "max_batch",
        """
# forgets the weights
def max_batch(gpu_memory_bytes, weight_bytes, overhead_bytes, kv_bytes_per_token, seq_len):
    return (gpu_memory_bytes - overhead_bytes) // (kv_bytes_per_token * seq_len)
""",
        "expected 55 sequences, got 70",
    ),
    (
        "11_triton_decode.ipynb",
        "physical_slots",
        """
def physical_slots(block_table, seq_len, block_size):  # ignores the block table: logical = physical
    return torch.arange(seq_len)
""",
        "token 0 lives in slot 48",
    ),
    (
        "11_triton_decode.ipynb",
        "reduce_kernel",
        """
@triton.jit
def reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)  # weights exp(lse) without subtracting the max
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
    mask = splits < num_splits
    weights = tl.exp(
        tl.load(partial_lse_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    )
    partial = tl.load(
        partial_out_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=mask[:, None],
        other=0.0,
    )
    tl.store(
        out_ptr + row * HEAD_DIM + dims,
        tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0),
    )
""",
        "non-finite values",
    ),
    (
        "11_triton_decode.ipynb",
        "reduce_kernel",
        """
@triton.jit
def reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)  # averages the partials
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
    mask = splits < num_splits
    partial = tl.load(
        partial_out_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=mask[:, None],
        other=0.0,
    )
    tl.store(out_ptr + row * HEAD_DIM + dims, tl.sum(partial, axis=0) / num_splits)
""",
        "reduce of 4 splits",
    ),
    (
        "11_triton_decode.ipynb",
        "masked_decode_kernel",
        """
@triton.jit
def masked_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_len, scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr
):
    dims = tl.arange(0, HEAD_DIM)  # masks the loads but not the scores: zero keys still take weight
    q = tl.load(q_ptr + dims)
    m, l, acc = float("-inf"), 0.0, tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < seq_len
        k = tl.load(
            k_ptr + tokens[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + tokens[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0
        )
        scores = tl.sum(q[None, :] * k, axis=1) * scale
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        l = l * tl.exp(m - m_new) + tl.sum(p, axis=0)
        acc = acc * tl.exp(m - m_new) + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + dims, acc / l)
""",
        "attention over the first 1 of 32",
    ),
    (
        "04_online_softmax.ipynb",
        "online_softmax_update",
        """
def online_softmax_update(m, l, block):  # forgets to rescale l when the maximum rises
    m_new = max(m, float(np.max(block)))
    return m_new, l + float(np.sum(np.exp(block - m_new)))
""",
        "(m, l) after the block",
    ),
    (
        "04_online_softmax.ipynb",
        "online_softmax_update",
        """
def online_softmax_update(m, l, block):  # forgets the maximum altogether
    return max(m, float(np.max(block))), l + float(np.sum(np.exp(block)))
""",
        "(m, l) after the block",
    ),
    (
        "04_online_softmax.ipynb",
        "merge_two",
        """
def merge_two(out_a, lse_a, out_b, lse_b):  # averages the partials
    return (out_a + out_b) / 2, np.logaddexp(lse_a, lse_b)
""",
        "merged output",
    ),
    (
        "04_online_softmax.ipynb",
        "merge_two",
        """
def merge_two(out_a, lse_a, out_b, lse_b):  # weights by exp(lse) without subtracting the max
    w_a, w_b = np.exp(lse_a), np.exp(lse_b)
    return (w_a[:, None] * out_a + w_b[:, None] * out_b) / (w_a + w_b)[:, None], np.log(w_a + w_b)
""",
        "non-finite values",
    ),
    (
        "04_online_softmax.ipynb",
        "tiled_attention",
        """
def tiled_attention(q, k, v, tile_size):  # no rescaling of the accumulator
    m, l, acc = np.full(len(q), -np.inf), np.zeros(len(q)), np.zeros((len(q), v.shape[1]))
    for start in range(0, k.shape[0], tile_size):
        s = q @ k[start : start + tile_size].T / math.sqrt(q.shape[1])
        m_new = np.maximum(m, s.max(axis=1))
        p = np.exp(s - m_new[:, None])
        l = l * np.exp(m - m_new) + p.sum(axis=1)
        acc = acc + p @ v[start : start + tile_size]
        m = m_new
    return acc / l[:, None]
""",
        "tiled_attention with T=",
    ),
    (
        "04_online_softmax.ipynb",
        "tiled_attention",
        """
def tiled_attention(q, k, v, tile_size):  # materialises all the scores: not a tiled pass
    scores = q @ k[0 : k.shape[0]].T / math.sqrt(q.shape[1])
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return p @ v[0 : v.shape[0]] / p.sum(axis=1, keepdims=True)
""",
        "at most 4 (one tile) are allowed",
    ),
    (
        "04_online_softmax.ipynb",
        "tiled_attention",
        """
from kvlib.ref.attention import attention

def tiled_attention(q, k, v, tile_size):  # reads in tiles, then hands the whole cache to kvlib
    tiles = range(0, k.shape[0], tile_size)
    k_all = np.concatenate([k[a:a + tile_size] for a in tiles])
    v_all = np.concatenate([v[a:a + tile_size] for a in tiles])
    return attention(q, k_all, v_all)
""",
        "kvlib.ref.attention.attention is unavailable",
    ),
    (
        "04_online_softmax.ipynb",
        "tiled_attention",
        """
def tiled_attention(q, k, v, tile_size):  # reads in tiles, then attends over a gathered copy
    tiles = range(0, k.shape[0], tile_size)
    k_all = np.concatenate([k[a:a + tile_size] for a in tiles])
    v_all = np.concatenate([v[a:a + tile_size] for a in tiles])
    scores = q @ k_all.T / math.sqrt(q.shape[1])
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return p @ v_all / p.sum(axis=1, keepdims=True)
""",
        "a tiled pass needs far less",
    ),
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        """
def grouped_attention(q, k, v, mask):  # strided groups: query head h reads KV head h % H_kv
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""",
        "query head h reads KV head h // G",
    ),
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        """
def grouped_attention(q, k, v, mask):  # right answer, but it repeats K/V G times
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""",
        "fold each group's query heads into the query rows",
    ),
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        """
def grouped_attention(q, k, v, mask):  # hands the exercise to PyTorch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
""",
        Flagged("scaled_dot_product_attention"),
    ),
    (
        "05_gqa_mqa.ipynb",
        "mean_pool_kv",
        """
def mean_pool_kv(weight, num_kv_heads, head_dim):  # pools strided heads j, j + H_kv, ...
    group = weight.shape[0] // head_dim // num_kv_heads
    heads = weight.reshape(group, num_kv_heads, head_dim, weight.shape[1])
    return heads.mean(dim=0).reshape(num_kv_heads * head_dim, weight.shape[1])
""",
        "consecutive",
    ),
    (
        "05_gqa_mqa.ipynb",
        "mean_pool_kv",
        """
def mean_pool_kv(weight, num_kv_heads, head_dim):  # sums instead of averaging
    group = weight.shape[0] // head_dim // num_kv_heads
    heads = weight.reshape(num_kv_heads, group, head_dim, weight.shape[1])
    return heads.sum(dim=1).reshape(num_kv_heads * head_dim, weight.shape[1])
""",
        "mean-pooled",
    ),
    (
        "05_gqa_mqa.ipynb",
        "kv_heads_for_budget",
        """
def kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):  # ignores divisibility
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    per_head = 2 * config["num_hidden_layers"] * head_dim * b * seq_len * batch_size
    return min(heads, budget_bytes // per_head)
""",
        "the largest divisor of num_attention_heads",
    ),
    (
        "05_gqa_mqa.ipynb",
        "kv_heads_for_budget",
        """
def kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):  # head_dim from hidden size
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    per_head = 2 * config["num_hidden_layers"] * head_dim * b * seq_len * batch_size
    fits = [h for h in range(1, heads + 1) if heads % h == 0 and h * per_head <= budget_bytes]
    return max(fits, default=0)
""",
        "expected H_kv = ",
    ),
    (
        "06_mla.ipynb",
        "absorbed_scores",
        """
def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # scales by the absorbed width
    q_latent = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)
    scores = q_latent @ latent[:, None].mT + q_rope @ rope_key[:, None].mT
    return scores / math.sqrt(latent.shape[-1] + rope_key.shape[-1])
""",
        "scaled by 1/sqrt(d_h + d_R)",
    ),
    (
        "06_mla.ipynb",
        "absorbed_scores",
        """
def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # right, but expands every head's keys
    k_nope = torch.einsum("hdc,bsc->bhsd", w_uk, latent)
    scores = q_nope @ k_nope.transpose(-1, -2) + q_rope @ rope_key[:, None].transpose(-1, -2)
    return scores / math.sqrt(q_nope.shape[-1] + q_rope.shape[-1])
""",
        "fold W_UK into the query",
    ),
    (
        "06_mla.ipynb",
        "latent_cache_bytes",
        """
def latent_cache_bytes(config, seq_len, batch_size):  # forgets the rotary key
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    return config["num_hidden_layers"] * config["kv_lora_rank"] * b * seq_len * batch_size
""",
        "kv_lora_rank + qk_rope_head_dim",
    ),
    (
        "06_mla.ipynb",
        "shared_rotary_key",
        """
def shared_rotary_key(x, w_kr, positions, theta):  # frequencies of a 128-wide head, not d_R
    d_r = w_kr.shape[0]
    k = (x @ w_kr.T)[:, None]
    inv_freq = theta ** (-torch.arange(0, d_r, 2, dtype=torch.float32) / 128)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    return k * angles.cos() + torch.cat([-k2, k1], dim=-1) * angles.sin()
""",
        "theta^(-2i/d_R)",
    ),
    (
        "06_mla.ipynb",
        "shared_rotary_key",
        """
def shared_rotary_key(x, w_kr, positions, theta):  # no head axis
    d_r = w_kr.shape[0]
    k = x @ w_kr.T
    inv_freq = theta ** (-torch.arange(0, d_r, 2, dtype=torch.float32) / d_r)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    return k * angles.cos() + torch.cat([-k2, k1], dim=-1) * angles.sin()
""",
        "a head axis of 1",
    ),
    (
        "07_paged_cache.ipynb",
        "slot_mapping",
        """
def slot_mapping(block_table, positions, block_size):  # block id + offset, not block * size
    return [block_table[t // block_size] + t % block_size for t in positions]
""",
        "block_table[t // block_size] * block_size + t % block_size",
    ),
    (
        "07_paged_cache.ipynb",
        "append_token",
        """
def append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size):  # no copy-on-write
    if num_tokens % block_size == 0:
        new = free_blocks.pop(0)
        ref_cnt[new] = 1
        block_table.append(new)
    block = block_table[num_tokens // block_size]
    return block * block_size + num_tokens % block_size, None
""",
        "copy-on-write only when the last block is shared and partly filled",
    ),
    (
        "07_paged_cache.ipynb",
        "append_token",
        """
def append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size):  # copies, keeps ref
    copy = None
    if num_tokens % block_size == 0:
        new = free_blocks.pop(0)
        ref_cnt[new] = 1
        block_table.append(new)
    elif ref_cnt[block_table[-1]] > 1:
        old, new = block_table[-1], free_blocks.pop(0)
        ref_cnt[new] = 1
        block_table[-1] = new
        copy = (old, new)
    block = block_table[num_tokens // block_size]
    return block * block_size + num_tokens % block_size, copy
""",
        "after the append expected block table, ref_cnt, free blocks",
    ),
    (
        "07_paged_cache.ipynb",
        "prefix_hit_tokens",
        """
def prefix_hit_tokens(token_ids, cached, block_size):  # hashes blocks without their parent
    hits = 0
    for i in range((len(token_ids) - 1) // block_size):
        if hash_block(None, token_ids[i * block_size : (i + 1) * block_size]) not in cached:
            break
        hits += block_size
    return hits
""",
        "each hash chained to its parent's",
    ),
    (
        "07_paged_cache.ipynb",
        "prefix_hit_tokens",
        """
def prefix_hit_tokens(token_ids, cached, block_size):  # a full hit leaves nothing to compute
    parent, hits = None, 0
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached:
            break
        hits += block_size
    return hits
""",
        "at most n - 1 tokens",
    ),
    (
        "08_eviction.ipynb",
        "streaming_keep",
        """
def streaming_keep(positions, budget, num_sinks):  # a plain window: forgets the sinks
    if len(positions) <= budget:
        return [True] * len(positions)
    return [i >= len(positions) - budget for i in range(len(positions))]
""",
        "keep every token whose position is below num_sinks",
    ),
    (
        "08_eviction.ipynb",
        "streaming_keep",
        """
def streaming_keep(positions, budget, num_sinks):  # sinks by index, not by position
    if len(positions) <= budget:
        return [True] * len(positions)
    n = len(positions)
    return [i < num_sinks or i >= n - budget + num_sinks for i in range(n)]
""",
        "a sink already gone",
    ),
    (
        "08_eviction.ipynb",
        "h2o_update",
        """
def h2o_update(scores, weights):  # sums over every query head, not the group's
    h_kv = scores.shape[0]
    s = weights.shape[-1]
    padded = torch.cat([scores, scores.new_zeros(h_kv, s - scores.shape[1])], dim=1)
    return padded + weights.sum(dim=(0, 1))[None]
""",
        "query heads of its KV head's group",
    ),
    (
        "08_eviction.ipynb",
        "h2o_update",
        """
def h2o_update(scores, weights):  # takes the last query only (TOVA's rule)
    h_kv = scores.shape[0]
    h, t, s = weights.shape
    padded = torch.cat([scores, scores.new_zeros(h_kv, s - scores.shape[1])], dim=1)
    return padded + weights[:, -1].view(h_kv, h // h_kv, s).sum(dim=1)
""",
        "summed over the T queries",
    ),
    (
        "08_eviction.ipynb",
        "snapkv_select",
        """
def snapkv_select(votes, budget, window, kernel_size):  # no pooling
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s).clone()
    ranked = votes.clone()
    ranked[:, s - window :] = float("inf")
    return ranked.sort(dim=1, descending=True, stable=True).indices[:, :budget].sort(dim=1).values
""",
        "max-pool the votes",
    ),
    (
        "08_eviction.ipynb",
        "snapkv_select",
        """
def snapkv_select(votes, budget, window, kernel_size):  # indices in ranking order, not ascending
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s).clone()
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel_size, 1, kernel_size // 2)[:, 0]
    pooled[:, s - window :] = float("inf")
    return pooled.sort(dim=1, descending=True, stable=True).indices[:, :budget]
""",
        "ascending order",
    ),
    (
        "09_compaction.ipynb",
        "blocks_freeable",
        """
def blocks_freeable(live, block_size):  # counts blocks with any evicted slot
    blocks = range(0, len(live), block_size)
    return sum(not all(live[start : start + block_size]) for start in blocks)
""",
        "none of its slots holds a survivor",
    ),
    (
        "09_compaction.ipynb",
        "repack",
        """
def repack(slots, live):  # one row at a time, newest first: overwrites survivors before reading
    survivors = live.nonzero()[:, 0].tolist()
    copied = 0
    for k in reversed(range(len(survivors))):
        if survivors[k] != k:
            slots[k] = slots[survivors[k]]
            copied += 1
    return copied
""",
        "read every source before",
    ),
    (
        "09_compaction.ipynb",
        "repack",
        """
def repack(slots, live):  # right rows, but counts every survivor as a copy
    survivors = live.nonzero()[:, 0]
    slots[: len(survivors)] = slots[survivors]
    return len(survivors)
""",
        "survivors whose row changed",
    ),
    (
        "09_compaction.ipynb",
        "positions_after_hole_filling",
        """
def positions_after_hole_filling(positions):  # a repack: order kept, so not what the round does
    return [p for p in positions if p >= 0]
""",
        "the last survivor moves into the first hole",
    ),
    (
        "10_quantized_cache.ipynb",
        "quantize_int4",
        """
def quantize_int4(x):  # no guard: a constant row divides 0 by 0
    zero = x.amin(dim=1, keepdim=True)
    scale = (x.amax(dim=1, keepdim=True) - zero) / 15
    q = ((x - zero) / scale).round().clamp(0, 15).to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero
""",
        "max equals its min",
    ),
    (
        "10_quantized_cache.ipynb",
        "quantize_int4",
        """
def quantize_int4(x):  # the first code of each pair in the high nibble
    zero = x.amin(dim=1, keepdim=True)
    scale = (x.amax(dim=1, keepdim=True) - zero) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - zero) / scale).round().clamp(0, 15).to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2], scale, zero
""",
        "nibble order",
    ),
    (
        "10_quantized_cache.ipynb",
        "quantize_int4",
        """
def quantize_int4(x):  # symmetric absmax scale with an offset: not the row's min and max
    scale = x.abs().amax(dim=1, keepdim=True) / 7
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = -8 * scale
    q = (x / scale).round().clamp(-8, 7).add(8).to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero
""",
        "zero = the row's minimum",
    ),
    (
        "10_quantized_cache.ipynb",
        "kivi_key_scales",
        """
def kivi_key_scales(keys, group_size):  # groups of G channels per token: per-token, not KIVI's
    s, d = keys.shape
    groups = keys.reshape(s, d // group_size, group_size)
    zero = groups.amin(dim=2)
    return (groups.amax(dim=2) - zero) / 3, zero
""",
        "one scale and zero per channel per group of G tokens",
    ),
    (
        "10_quantized_cache.ipynb",
        "kivi_key_scales",
        """
def kivi_key_scales(keys, group_size):  # strided groups: token t joins group t % (S / G)
    s, d = keys.shape
    groups = keys.reshape(group_size, s // group_size, d)
    zero = groups.amin(dim=0)
    return (groups.amax(dim=0) - zero) / 3, zero
""",
        "consecutive tokens",
    ),
    (
        "10_quantized_cache.ipynb",
        "bytes_per_token",
        """
def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):
    per_vector = head_dim * bits / 8 + head_dim / group_size * scale_bytes  # no zero points
    return num_layers * num_kv_heads * 2 * per_vector
""",
        "a scale and a zero point",
    ),
    (
        "10_quantized_cache.ipynb",
        "bytes_per_token",
        """
def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):
    return num_layers * num_kv_heads * 2 * head_dim * bits / 8  # the codes only
""",
        "plus, per group of G",
    ),
    (
        "12_serving_engine.ipynb",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):  # waiting requests first
    plan, budget = [], token_budget
    for request_id, left in waiting[: max(0, max_num_seqs - len(running))] + running:
        if budget == 0:
            break
        plan.append((request_id, min(left, budget)))
        budget -= min(left, budget)
    return plan
""",
        "running requests first",
    ),
    (
        "12_serving_engine.ipynb",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):  # no chunking: whole prompts
    plan, budget = [], token_budget
    for request_id, left in running:
        if budget <= 0:
            break
        plan.append((request_id, left))
        budget -= left
    for request_id, left in waiting:
        if budget <= 0 or len(running) + len(plan) >= max_num_seqs:
            break
        plan.append((request_id, left))
        budget -= left
    return plan
""",
        "min(tokens left, budget left)",
    ),
    (
        "12_serving_engine.ipynb",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):  # the limit counts only admissions
    plan, budget = [], token_budget
    for request_id, left in running:
        if budget == 0:
            break
        plan.append((request_id, min(left, budget)))
        budget -= min(left, budget)
    for request_id, left in waiting[:max_num_seqs]:
        if budget == 0:
            break
        plan.append((request_id, min(left, budget)))
        budget -= min(left, budget)
    return plan
""",
        "fewer than max_num_seqs run",
    ),
    (
        "12_serving_engine.ipynb",
        "preemption_victims",
        """
def preemption_victims(running, index, blocks_needed, free_blocks, blocks_held):  # oldest first
    preempted = []
    for victim in running:
        if free_blocks >= blocks_needed:
            break
        preempted.append(victim)
        free_blocks += blocks_held[victim]
    return preempted
""",
        "the newest running request first",
    ),
    (
        "12_serving_engine.ipynb",
        "preemption_victims",
        """
def preemption_victims(running, index, blocks_needed, free_blocks, blocks_held):  # never stops
    running, preempted = list(running), []
    while free_blocks < blocks_needed and running:
        victim = running.pop()
        preempted.append(victim)
        free_blocks += blocks_held[victim]
    return preempted
""",
        "it has been preempted itself",
    ),
    (
        "12_serving_engine.ipynb",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):  # may cover the last token
    cached, parent = 0, None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached_hashes:
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(cached + new) // block_size) - cached // block_size
""",
        "leaving at least the last token",
    ),
    (
        "12_serving_engine.ipynb",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):  # cached blocks allocated too
    cached, parent = 0, None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached_hashes:
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(cached + new) // block_size)
""",
        "beyond the cached ones",
    ),
    (
        "12_serving_engine.ipynb",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):  # each block hashed alone
    cached = 0
    for i in range((len(token_ids) - 1) // block_size):
        if hash_block_tokens(None, token_ids[i * block_size : (i + 1) * block_size]) not in (
            cached_hashes
        ):
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(cached + new) // block_size) - cached // block_size
""",
        "chained hashes",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):  # each token decoded alone: broken characters
    return [token.decode("utf-8", errors="replace") for token in token_bytes]
""",
        "nothing of a character still missing bytes",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # no hold-back: the start of a stop string leaks
    received, sent = "", []
    for piece in pieces:
        before = len(received)
        received += piece
        starts = [received.find(s) for s in stops if s in received]
        if starts:
            sent.append(received[before : max(before, min(starts))])
            return sent, True
        sent.append(piece)
    sent.append("")
    return sent, False
""",
        "proper prefix of some stop string",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # TPOT divided by all tokens
    good = 0
    for arrival, token_times in requests:
        tpot = (token_times[-1] - token_times[0]) / len(token_times)
        good += token_times[0] - arrival <= ttft_slo_s and tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "(tokens - 1)",
    ),
    (
        "14_offload.ipynb",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):  # each block hashed alone: no chain
    return [
        hashlib.sha256(salt + hash_block_tokens(None, token_ids[i : i + block_size])).digest()
        for i in range(0, len(token_ids) - block_size + 1, block_size)
    ]
""",
        "chained hash",
    ),
    (
        "14_offload.ipynb",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):  # keys the partial last block too
    keys, parent = [], None
    for i in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[i : i + block_size])
        keys.append(hashlib.sha256(salt + parent).digest())
    return keys
""",
        "none for a partial one",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # a disk hit stays on disk
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
        if where == "host" or (op == "put" and where is None):
            if where == "host":
                host.remove(key)
            host.append(key)
            if len(host) > host_blocks:
                disk.append(host.pop(0))
                if len(disk) > disk_blocks:
                    disk.pop(0)
    return found, host, disk
""",
        "a put or a hit makes a block the newest",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # host overflow dropped, never demoted
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if where is not None:
            (host if where == "host" else disk).remove(key)
        if op == "put" or where is not None:
            host.append(key)
            if len(host) > host_blocks:
                host.pop(0)
        if op == "get":
            found.append(where)
    return found, host, disk
""",
        "host's oldest falls to disk",
    ),
    (
        "14_offload.ipynb",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):  # full n x n attention, not causal
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = num_tokens
    linear = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    return 2 * L * H_kv * D * 2 * n * flops_per_s / (linear + 4 * L * H * D * n * n) / 1e9
""",
        "n · (n + 1)",
    ),
    (
        "14_offload.ipynb",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):  # K only: half the bytes
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = num_tokens
    flops = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    flops += 2 * L * H * D * n * (n + 1)
    return L * H_kv * D * 2 * n * flops_per_s / flops / 1e9
""",
        "2 · L · H_kv · D · 2 (bf16) · n",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):  # holds everything while pending does not decode
    pending, out = b"", []
    for t in token_bytes:
        pending += t
        try:
            out.append(pending.decode("utf-8"))
            pending = b""
        except UnicodeDecodeError:
            out.append("")
    return out
""",
        "two 3-byte characters cut twice",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):  # 1110xxxx read as 4 bytes: off by one on 3-byte characters
    pending, deltas = b"", []
    for token in token_bytes:
        pending += token
        end = 0
        while end < len(pending):
            lead = pending[end]
            size = 1 if lead < 0x80 else 2 if lead < 0xE0 else 4
            if end + size > len(pending):
                break
            end += size
        deltas.append(pending[:end].decode("utf-8", errors="replace"))
        pending = pending[end:]
    return deltas
""",
        "two 3-byte characters cut twice",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):  # releases only when a token ends in ASCII (or at the end)
    pending, out = b"", []
    for i, t in enumerate(token_bytes):
        pending += t
        if t[-1] < 0x80 or i == len(token_bytes) - 1:
            out.append(pending.decode("utf-8"))
            pending = b""
        else:
            out.append("")
    return out
""",
        "an emoji cut in two tokens",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):  # each token alone, replacement characters dropped
    return [t.decode("utf-8", errors="replace").replace("\\ufffd", "") for t in token_bytes]
""",
        "an emoji cut in two tokens",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # looks for stop strings inside each piece only
    sent = []
    for piece in pieces:
        starts = [piece.find(s) for s in stops if s in piece]
        if starts:
            sent.append(piece[: min(starts)])
            return sent, True
        sent.append(piece)
    sent.append("")
    return sent, False
""",
        "a stop string spanning two pieces",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # the first stop string in the list wins, not the earliest
    held, sent = "", []
    for piece in pieces:
        held += piece
        for s in stops:
            if s in held:
                sent.append(held[: held.find(s)])
                return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "the earliest wins",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # the stop string that ends first wins
    held, sent = "", []
    for piece in pieces:
        held += piece
        ends = [(held.find(s) + len(s), held.find(s)) for s in stops if s in held]
        if ends:
            sent.append(held[: min(ends)[1]])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "the earliest start wins",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # always holds back len(longest stop) - 1 characters
    held, sent = "", []
    w = max(len(s) for s in stops) - 1
    for piece in pieces:
        held += piece
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        cut = max(0, len(held) - w)
        sent.append(held[:cut])
        held = held[cut:]
    sent.append(held)
    return sent, False
""",
        "proper prefix of some stop string",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # holds at most len(s) - 2 characters: off by one
    held, sent = "", []
    for piece in pieces:
        held += piece
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 2, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "a stop string made of two newlines",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # holds back prefixes of the first stop string only
    held, sent = "", []
    for piece in pieces:
        held += piece
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        s, keep = stops[0], 0
        for n in range(min(len(s) - 1, len(held)), 0, -1):
            if held.endswith(s[:n]):
                keep = n
                break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "the second stop string's start held back",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # holds back the SHORTEST matching prefix
    held, sent = "", []
    for piece in pieces:
        held += piece
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        keep = 0
        for n in range(1, len(held) + 1):
            if any(n < len(s) and held.endswith(s[:n]) for s in stops):
                keep = n
                break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "hold back the longest possible start",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # sends the stop string itself (include-stop behaviour)
    held, sent = "", []
    for piece in pieces:
        held += piece
        found = [(held.find(s), s) for s in stops if s in held]
        if found:
            i, s = min(found)
            sent.append(held[: i + len(s)])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "a stop string spanning two pieces",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # the final flush only when something is held
    held, sent = "", []
    for piece in pieces:
        held += piece
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    if held:
        sent.append(held)
    return sent, False
""",
        "a partial match that fails",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        """
def stop_stream(pieces, stops):  # consumes the caller's list
    held, sent = "", []
    while pieces:
        held += pieces.pop(0)
        starts = [held.find(s) for s in stops if s in held]
        if starts:
            sent.append(held[: min(starts)])
            return sent, True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        sent.append(held[: len(held) - keep])
        held = held[len(held) - keep :]
    sent.append(held)
    return sent, False
""",
        "in place",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # strict < on TPOT
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s and tpot < tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "TPOT exactly at its bound",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # strict < on TTFT
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft < ttft_slo_s and tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "TTFT exactly at its bound",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # either bound
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s or tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "one TTFT too slow",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # assumes arrivals in order
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
    start = requests[0][0]
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "no particular order",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # the last request's last token
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = requests[-1][1][-1]
    return good, good / (end - start)
""",
        "no particular order",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # from the first token
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
    start = min(t[0] for _, t in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "from the first arrival",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # one-token requests fail
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += n > 1 and ttft <= ttft_slo_s and tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "one-token requests",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):  # worst gap as TPOT
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        worst_gap = max([b - a for a, b in zip(token_times, token_times[1:])], default=0.0)
        good += ttft <= ttft_slo_s and worst_gap <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "uneven gaps: TPOT is their mean",
    ),
    (
        "14_offload.ipynb",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):  # unsalted: the chained hash alone
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys
""",
        "sha256(salt + the block's chained hash)",
    ),
    (
        "14_offload.ipynb",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):  # only the first block salted
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(hashlib.sha256(salt + parent).digest() if i == 0 else parent)
    return keys
""",
        "key 1 differs",
    ),
    (
        "14_offload.ipynb",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):  # consumes the caller's list
    keys, parent = [], None
    while len(token_ids) >= block_size:
        parent = hash_block_tokens(parent, token_ids[:block_size])
        del token_ids[:block_size]
        keys.append(hashlib.sha256(salt + parent).digest())
    return keys
""",
        "in place",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # a host hit does not refresh LRU
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
        if where == "host" and op == "get":
            continue
        if where is not None:
            (host if where == "host" else disk).remove(key)
        if op == "put" or where is not None:
            host.append(key)
            if len(host) > host_blocks:
                disk.append(host.pop(0))
                if len(disk) > disk_blocks:
                    disk.pop(0)
    return found, host, disk
""",
        "a host hit makes the block the newest",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # a put of a host key is ignored
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
        if where == "host" and op == "put":
            continue
        if where is not None:
            (host if where == "host" else disk).remove(key)
        if op == "put" or where is not None:
            host.append(key)
            if len(host) > host_blocks:
                disk.append(host.pop(0))
                if len(disk) > disk_blocks:
                    disk.pop(0)
    return found, host, disk
""",
        "a put of a host key refreshes it",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # promoted before leaving the disk
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
        if where == "host":
            host.remove(key)
        if op == "put" or where is not None:
            host.append(key)
            if len(host) > host_blocks:
                disk.append(host.pop(0))
                if len(disk) > disk_blocks:
                    disk.pop(0)
        if where == "disk" and key in disk:
            disk.remove(key)
    return found, host, disk
""",
        "hits in each tier",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):  # host's newest demoted, not its oldest
    host, disk, found = [], [], []
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if where is not None:
            (host if where == "host" else disk).remove(key)
        if op == "put" or where is not None:
            if len(host) >= host_blocks:
                disk.append(host.pop())
                if len(disk) > disk_blocks:
                    disk.pop(0)
            host.append(key)
        if op == "get":
            found.append(where)
    return found, host, disk
""",
        "the oldest fall to disk",
    ),
    (
        "14_offload.ipynb",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):  # head_dim taken as hidden / heads
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv = config["num_attention_heads"], config["num_key_value_heads"]
    D, n = d // H, num_tokens
    flops = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    flops += 2 * L * H * D * n * (n + 1)
    return 2 * L * H_kv * D * 2 * n * flops_per_s / flops / 1e9
""",
        "head_dim (256) is not hidden_size / heads",
    ),
    (
        "14_offload.ipynb",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):  # GiB/s, not GB/s
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = num_tokens
    flops = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    flops += 2 * L * H * D * n * (n + 1)
    return 2 * L * H_kv * D * 2 * n * flops_per_s / flops / 2**30
""",
        "GB/s = 1e9 bytes/s",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # q · max, whatever the sign of q
    return (q[:, None, :] * key_max).sum(dim=-1).amax(dim=0) * scale
""",
        "not an upper bound",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # the box's centre
    return (q[:, None, :] * (key_min + key_max) / 2).sum(dim=-1).amax(dim=0) * scale
""",
        "not an upper bound",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # a true bound, but looser than Quest's
    corner = torch.maximum(key_min.abs(), key_max.abs())
    return (q.abs()[:, None, :] * corner).sum(dim=-1).amax(dim=0) * scale
""",
        "Quest's bound is",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # the group's mean query (not a bound)
    mean = q.mean(dim=0)
    return torch.maximum(mean * key_min, mean * key_max).sum(dim=-1) * scale
""",
        "opposite ways",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # summed over the group's heads
    per_head = torch.maximum(q[:, None, :] * key_min, q[:, None, :] * key_max).sum(dim=-1)
    return per_head.sum(dim=0) * scale
""",
        "not an upper bound",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):  # the scale forgotten
    return torch.maximum(q[:, None, :] * key_min, q[:, None, :] * key_max).sum(-1).amax(0)
""",
        "scale ·",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # the largest over every head
    scores = head_bounds.amax(dim=0)
    forced = {0, num_pages - 1}
    rest = sorted(set(range(num_pages)) - forced, key=lambda p: -float(scores[p]))
    return sorted(forced | set(rest[: max(0, budget - len(forced))]))
""",
        "sum them",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # summed over every query head
    scores = head_bounds.sum(dim=0)
    forced = {0, num_pages - 1}
    rest = sorted(set(range(num_pages)) - forced, key=lambda p: -float(scores[p]))
    return sorted(forced | set(rest[: max(0, budget - len(forced))]))
""",
        "not its sum",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # no sink page
    h, p = head_bounds.shape
    scores = head_bounds.view(h // group_size, group_size, p).amax(dim=1).sum(dim=0)
    rest = sorted(range(num_pages - 1), key=lambda q: -float(scores[q]))
    return sorted({num_pages - 1} | set(rest[: budget - 1]))
""",
        "always read",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # the table's last column
    h, p = head_bounds.shape
    scores = head_bounds.view(h // group_size, group_size, p).amax(dim=1).sum(dim=0)
    forced = {0, p - 1}
    rest = sorted(set(range(p)) - forced, key=lambda q: -float(scores[q]))
    return sorted(forced | set(rest[: max(0, budget - len(forced))]))
""",
        "not the last column",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # budget pages besides the forced
    h, p = head_bounds.shape
    scores = head_bounds.view(h // group_size, group_size, p).amax(dim=1).sum(dim=0)
    forced = {0, num_pages - 1}
    rest = sorted(set(range(num_pages)) - forced, key=lambda q: -float(scores[q]))
    return sorted(forced | set(rest[:budget]))
""",
        "count towards the budget",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # each KV head's own top pages
    h, p = head_bounds.shape
    per_kv_head = head_bounds.view(h // group_size, group_size, p).amax(dim=1)
    chosen = {0, num_pages - 1}
    for scores in per_kv_head:  # read per KV head: the union
        rest = sorted(set(range(num_pages)) - {0, num_pages - 1}, key=lambda q: -float(scores[q]))
        chosen |= set(rest[: max(0, budget - 2)])
    return sorted(chosen)
""",
        "sum them",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # in order of score
    h, p = head_bounds.shape
    scores = head_bounds.view(h // group_size, group_size, p).amax(dim=1).sum(dim=0)
    forced = [0] if num_pages == 1 else [0, num_pages - 1]
    rest = sorted(set(range(num_pages)) - set(forced), key=lambda q: -float(scores[q]))
    return forced + rest[: max(0, budget - len(forced))]
""",
        "in ascending order",
    ),
    (
        "15_sparse_attention.ipynb",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):  # every page counted full
    chosen = sorted(pages)
    return [block_table[p] for p in chosen], len(chosen) * block_size
""",
        "newest, which holds 5",
    ),
    (
        "15_sparse_attention.ipynb",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):  # the newest page's fill as S % size
    chosen = sorted(pages)
    return [block_table[p] for p in chosen], (len(chosen) - 1) * block_size + seq_len % block_size
""",
        "not 64 % 16 = 0",
    ),
    (
        "15_sparse_attention.ipynb",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):  # in the order the pages came
    fill = seq_len - (seq_len - 1) // block_size * block_size
    return [block_table[p] for p in pages], (len(pages) - 1) * block_size + fill
""",
        "in logical order",
    ),
    (
        "15_sparse_attention.ipynb",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):  # logical pages, not blocks
    fill = seq_len - (seq_len - 1) // block_size * block_size
    return sorted(pages), (len(pages) - 1) * block_size + fill
""",
        "physical blocks",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # no bounds read
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    sparse = (budget - 1) * block_size + S - (pages - 1) * block_size
    return (dense * S + (L - dense) * sparse) * per_token
""",
        "every page's bounds",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # bounds read even when
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)  # every page is read anyway
    fill = S - (pages - 1) * block_size
    sparse = (min(budget, pages) - 1) * block_size + fill + pages
    return (dense * S + (L - dense) * sparse) * per_token
""",
        "no bounds",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # the newest page full
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    sparse = budget * block_size + pages
    return (dense * S + (L - dense) * sparse) * per_token
""",
        "partial newest page",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # no dense layers
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    return L * ((budget - 1) * block_size + S - (pages - 1) * block_size + pages) * per_token
""",
        "a dense layer",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # bounds: D per KV head
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    tokens = (budget - 1) * block_size + S - (pages - 1) * block_size
    return dense * S * per_token + (L - dense) * (tokens * per_token + pages * H_kv * D * b)
""",
        "2 · D per KV head",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        """
import math


def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # a float
    per_token, pages = 2 * H_kv * D * b, S / block_size
    if pages <= budget:
        return L * S * per_token
    fill = S - (math.ceil(pages) - 1) * block_size
    sparse = (budget - 1) * block_size + fill + math.ceil(pages)
    return (dense * S + (L - dense) * sparse) * per_token * 1.0
""",
        "should return an int",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # tensors, not ints
    chosen = target_logits.argmax(dim=-1)
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return torch.tensor(accepted), chosen[accepted]
""",
        "two Python ints",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # float32
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0).float()
            return i, residual / residual.sum()
    return len(draft), p[len(draft)].float()
""",
        "expected dtype torch.float64",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # subtracts q from p in place
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            p[i] -= q[i]
            residual = p[i].clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)].clone()
""",
        "changed its argument 3",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # ref_cnt decremented in place
    keep = -(-new_len // block_size)
    freed = []
    for b in reversed(block_table[keep:]):
        ref_cnt[b] -= 1
        if ref_cnt[b] == 0:
            freed.append(b)
    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "changed its argument 4",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # no case for alpha = 1
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "ZeroDivisionError",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # `is` on token ids (wrong above 256)
    chosen = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] is chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "token ids above 256",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # exp without the max subtracted: overflow
    probs = torch.exp(target_logits) / torch.exp(target_logits).sum(-1, keepdim=True)
    chosen = probs.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "large logits",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # argmax in bfloat16
    chosen = target_logits.to(torch.bfloat16).argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "near-ties",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # argmax in half precision
    chosen = target_logits.half().argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "near-ties",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # softmax in float32, then argmax
    chosen = torch.softmax(target_logits, -1).argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "near-ties",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # topk(1): any maximum at a tie
    chosen = target_logits.topk(1, dim=-1).indices[:, 0].tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "first maximum at a tie",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # sort(descending): any maximum at a tie
    chosen = target_logits.sort(dim=-1, descending=True).indices[:, 0].tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "first maximum at a tie",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # a bool for k = 1
    chosen = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    if len(draft) == 1:
        accepted = draft[0] == chosen[0]
    return accepted, chosen[int(accepted)]
""",
        "a bool is not accepted",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        """
from collections import namedtuple
Verdict = namedtuple("Verdict", "accepted next_token")
def greedy_accept(draft, target_logits):  # a namedtuple
    chosen = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return Verdict(accepted, chosen[accepted])
""",
        "a plain tuple (not a namedtuple",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # the residual over 1 - sum(min(p, q))
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / (1 - torch.minimum(p[i], q[i]).sum())
    return len(draft), p[len(draft)]
""",
        "divided by its own sum",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # a token p gives 0 always rejected
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if p[i, token] == 0 or u * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "u = 0 and p_0(0) = 0",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        """
import numpy as np


def rejection_sample(draft, q, p, uniforms):  # a numpy array
    q, p = q.numpy(), p.numpy()
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = np.maximum(p[i] - q[i], 0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)].copy()
""",
        "torch.float64 tensor",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # stops at a shared block
    keep = -(-new_len // block_size)
    freed = []
    for b in reversed(block_table[keep:]):
        if ref_cnt[b] > 1:
            break   # shared blocks form a prefix: all before it are shared too
        freed.append(b)
    copy = new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "expected freed",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # shared: a prefix
    keep = -(-new_len // block_size)
    shared = 0
    while shared < len(block_table) and ref_cnt[block_table[shared]] > 1:
        shared += 1   # the shared prefix (forks, prefix-cache hits)
    freed = block_table[max(keep, shared):][::-1]
    copy = keep > 0 and new_len % block_size != 0 and keep <= shared
    return block_table[:keep], freed, copy
""",
        "a shared block between private ones",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # a count, not a filter
    keep = -(-new_len // block_size)
    dropped = block_table[keep:]
    n = sum(ref_cnt[b] == 1 for b in dropped)
    freed = dropped[::-1][:n]
    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "expected freed",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # power-of-two bit tricks
    shift = block_size.bit_length() - 1          # block_size is a power of two
    keep = (new_len + block_size - 1) >> shift
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    partial = (new_len & (block_size - 1)) != 0
    copy = keep > 0 and partial and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "blocks of 3",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # an int k + 1 at alpha = 1
    tokens = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "two floats (not ints",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # alpha within 1e-3 of 1 taken as 1
    tokens = k + 1.0 if 1 - alpha < 1e-3 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "alpha = 0.9995",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # alpha rounded to 3 decimals
    alpha = round(alpha, 3)
    tokens = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "expected (tokens_per_step, speedup)",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # c clamped to 1
    tokens = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (min(c, 1.0) * k + 1)
""",
        "c = 2",
    ),
    (
        "16_speculative.ipynb",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # k capped at 12
    tokens = float(sum(alpha ** i for i in range(min(k, 12) + 1)))
    return tokens, tokens / (c * k + 1)
""",
        "expected (tokens_per_step, speedup)",
    ),
]

# Chapter 16's named mistakes (tests/test_check_diagnostics.py's MISTAKES) are wrong answers here
# too, graded through the notebook: each scores 0 and its feedback names it.
WRONG_ANSWERS += [
    ("16_speculative.ipynb", question, source, hint)
    for chapter, question, source, hint in MISTAKES
    if chapter == "16"
]

# Chapter 17: its named mistakes (tests/test_check_diagnostics.py's MISTAKES), graded through the
# notebook, and wrong answers of other kinds: the wrong type, shape or dtype, an input changed in
# place, a broadcast that only works when H = S, an int32 overflow.
N17 = "17_windows.ipynb"
WRONG_ANSWERS += [
    (N17, question, source, hint) for chapter, question, source, hint in MISTAKES if chapter == "17"
]
WRONG_ANSWERS += [
    (N17, "ring_slots",
     "def ring_slots(num_positions, window):  # a tuple\n"
     "    first = max(0, num_positions - window)\n"
     "    return tuple(p % window for p in range(first, num_positions))\n",
     "should return a list of ints"),
    (N17, "ring_slots",
     "def ring_slots(num_positions, window):  # positions counted from 1\n"
     "    first = max(0, num_positions - window)\n"
     "    return [(p + 1) % window for p in range(first, num_positions)]\n",
     "expected the slots [0, 1, 2], got [1, 2, 3]"),
    (N17, "freeable_blocks",
     "def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # a range\n"
     "    first = -(-sink_tokens // block_size)\n"
     "    return range(first, (num_positions - window + 1) // block_size)\n",
     "should return a list of ints"),
    (N17, "freeable_blocks",
     "def freeable_blocks(num_positions, window, block_size, sink_tokens):  # no default\n"
     "    first = -(-sink_tokens // block_size)\n"
     "    return list(range(first, (num_positions - window + 1) // block_size))\n",
     "sink_tokens left out"),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # the scores shifted in place\n"
     "    m = np.maximum(scores.max(axis=1), sink)[:, None]\n"
     "    scores -= m\n"
     "    e = np.exp(scores)\n"
     "    return e / (e.sum(axis=1, keepdims=True) + np.exp(sink[:, None] - m))\n",
     "changed its argument 1"),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # the sink's column kept\n"
     "    s = np.concatenate([scores, sink[:, None]], axis=1)\n"
     "    e = np.exp(s - s.max(axis=1, keepdims=True))\n"
     "    return e / e.sum(axis=1, keepdims=True)\n",
     "expected shape (1, 3), got (1, 4)"),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # float32\n"
     "    s = np.concatenate([scores, sink[:, None]], axis=1).astype(np.float32)\n"
     "    e = np.exp(s - s.max(axis=1, keepdims=True))\n"
     "    return (e / e.sum(axis=1, keepdims=True))[:, :-1]\n",
     "expected dtype float64"),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # exp(sink - m): (H,) against (H, 1) is (H, H)\n"
     "    m = np.maximum(scores.max(axis=1, keepdims=True), sink[:, None])\n"
     "    e = np.exp(scores - m)\n"
     "    return e / (e.sum(axis=1, keepdims=True) + np.exp(sink - m))\n",
     "could not be broadcast"),
    (N17, "softmax_with_sink",
     "import torch\n\n"
     "def softmax_with_sink(scores, sink):  # a torch tensor\n"
     "    s = torch.cat([torch.from_numpy(scores), torch.from_numpy(sink)[:, None]], dim=1)\n"
     "    return torch.softmax(s, dim=1)[:, :-1]\n",
     "should return a numpy array"),
    (N17, "merge_with_sink",
     "def merge_with_sink(partial_out, partial_lse, sink):  # sink inside each split, then merged\n"
     "    lse = np.logaddexp(partial_lse, sink)\n"
     "    out = partial_out * np.exp(partial_lse - lse)[:, :, None]\n"
     "    w = np.exp(lse - lse.max(axis=0))\n"
     "    return (w[:, :, None] * out).sum(axis=0) / w.sum(axis=0)[:, None]\n",
     "the sink counted in every split"),
    (N17, "merge_with_sink",
     "def merge_with_sink(partial_out, partial_lse, sink):  # rescales partial_out in place\n"
     "    m = np.maximum(partial_lse.max(axis=0), sink)\n"
     "    w = np.exp(partial_lse - m)\n"
     "    partial_out *= w[:, :, None]\n"
     "    return partial_out.sum(axis=0) / (w.sum(axis=0) + np.exp(sink - m))[:, None]\n",
     "changed its argument 1"),
    (N17, "hybrid_cache_bytes",
     "def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # a float\n"
     "    total = 0.0\n"
     "    for layer in layers:\n"
     "        if layer['kind'] == 'linear':\n"
     "            total += layer['state_elements']\n"
     "        else:\n"
     "            held = seq_len if layer['kind'] == 'full' else min(seq_len, layer['window'])\n"
     "            total += 2 * layer['num_kv_heads'] * layer['head_dim'] * held\n"
     "    return total * bytes_per_element\n",
     "should return an int"),
    (N17, "hybrid_cache_bytes",
     "def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # pops each layer's kind\n"
     "    total = 0\n"
     "    for layer in layers:\n"
     "        kind = layer.pop('kind')\n"
     "        if kind == 'linear':\n"
     "            total += layer['state_elements']\n"
     "        else:\n"
     "            held = seq_len if kind == 'full' else min(seq_len, layer['window'])\n"
     "            total += 2 * layer['num_kv_heads'] * layer['head_dim'] * held\n"
     "    return total * bytes_per_element\n",
     "changed its argument 1"),
    (N17, "hybrid_cache_bytes",
     "def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # int32 overflows past 2 GiB\n"
     "    total = np.int32(0)\n"
     "    for layer in layers:\n"
     "        if layer['kind'] == 'linear':\n"
     "            total += np.int32(layer['state_elements'])\n"
     "        else:\n"
     "            held = seq_len if layer['kind'] == 'full' else min(seq_len, layer['window'])\n"
     "            total += np.int32(2 * layer['num_kv_heads'] * layer['head_dim'] * held)\n"
     "    return total * np.int32(bytes_per_element)\n",
     "expected 3,224,371,200 bytes"),
]  # fmt: skip


def grade_answer(notebook, question, source, tmp_path):
    """Grade `source` in place of the solution's answer to `question`: (its result, the report)."""
    path = with_cell_replaced(ROOT / "solutions" / notebook, question, source, tmp_path)
    report = grade_notebook(path, timeout_s=TIMEOUT_S, only=[question])
    (result,) = report.questions
    return result, report


def with_answers(notebook: str, function: str, sources: list[str], folder: Path):
    """A copy of the solution `notebook` with one more cell per answer in `sources`, each run in a
    namespace of its own (a copy of the notebook's) and its `function` bound to a name of its own;
    the path and those names (so that one child process grades them all)."""
    notebook_ = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    names = []
    for index, source in enumerate(sources):
        source = _cell_code(source)  # a cell magic, as the grader runs it
        name, filename = f"{function}__answer_{index}", f"<answer {index}>"
        names.append(name)
        notebook_.cells.append(
            nbformat.v4.new_code_cell(
                f"import linecache as __lc\n"
                f"__lc.cache[{filename!r}] = (0, None, {source!r}.splitlines(True), {filename!r})\n"
                f"__ns = dict(globals())\n"
                f"exec(compile({source!r}, {filename!r}, 'exec'), __ns)\n"
                f"{name} = __ns.get({function!r})\n"
            )
        )
    path = folder / notebook
    nbformat.write(notebook_, path)
    return path, names


def grade_answers(notebook, question, sources, tmp_path, *, seed=None):
    """Grade each of `sources` as the answer to `question`, all against one child process."""
    path, names = with_answers(notebook, question, sources, tmp_path)
    return grade_bindings(path, question, names, timeout_s=TIMEOUT_S, seed=seed)


SOLUTION_01 = ROOT / "solutions" / "01_naive_vs_cached.ipynb"

# Hostile or broken code in the cell of one question: that question scores 0, the others still pass.
BROKEN_CODE = [
    ("stable_softmax", "def stable_softmax(x):\n    while True:\n        pass\n", "timed out"),
    ("stable_softmax", "import sys\nsys.exit(0)\n", "`stable_softmax` is not defined"),
    ("stable_softmax", "def stable_softmax(x):\n    import sys\n    sys.exit(3)\n", "SystemExit"),
    (
        "stable_softmax",
        "def stable_softmax(x):\n    import os\n    os._exit(0)\n",
        "ended (exit status 0) before the test finished",
    ),
    (
        "stable_softmax",
        "def stable_softmax(x):\n    print('x' * 10_000_000)\n    return x\n",
        "max abs difference",
    ),
    (
        "stable_softmax",
        "def stable_softmax(x):\n    return x.tolist()\n",
        "should return a numpy array",
    ),
    (
        "stable_softmax",
        "from kvlib.ref.attention import softmax\n\n"
        "def stable_softmax(x):\n    return softmax(x)\n",
        "unavailable while question 'stable_softmax' is graded",
    ),
    (
        "kv_cache_bytes",
        "def kv_cache_bytes(*args):\n    raise ValueError('oops')\n",
        "ValueError: oops",
    ),
    ("kv_cache_bytes", None, "`kv_cache_bytes` is not defined"),
    ("kv_cache_bytes", "while True:\n    pass\n", "`kv_cache_bytes` is not defined"),
    (
        "cached_attention_step",
        "import kvlib.ref.attention as A\ncached_attention_step = A.cached_attention_step\n",
        "unavailable",
    ),
]


@pytest.mark.parametrize(
    "question,source,phrase",
    BROKEN_CODE,
    ids=[f"{q}-{i}" for i, (q, _, _) in enumerate(BROKEN_CODE)],
)
def test_broken_code_loses_only_its_question(question, source, phrase, tmp_path):
    path = with_cell_replaced(SOLUTION_01, question, source, tmp_path)
    other = "stable_softmax" if question == "kv_cache_bytes" else "kv_cache_bytes"
    report = grade_notebook(path, timeout_s=8, only=[question, other])
    results = {q.id: q for q in report.questions}
    message = results[question].message
    assert not results[question].passed and names_the_rule(phrase, message), report.table()
    assert results[other].passed, (
        f"a broken {question} cell must not cost {other} its points:\n{report.table()}"
    )


def test_cli_json_is_one_object_and_exit_zero():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlib.course.grade",
            str(EXERCISES[0]),
            "--json",
            "--question",
            "kv_cache_bytes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)  # exactly one JSON document, nothing else on stdout
    assert set(result) == {
        "notebook",
        "score",
        "max_score",
        "questions",
        "seed",
        "nonce",
        "sandbox",
    }
    assert result["score"] == 0 and result["max_score"] == 1
    assert set(result["questions"][0]) == {"id", "passed", "points", "message"}


def test_cli_usage_errors_exit_2(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "kvlib.course.grade", str(tmp_path / "01_nope.ipynb")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "99_unknown.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))
    unknown = subprocess.run(
        [sys.executable, "-m", "kvlib.course.grade", str(tmp_path / "99_unknown.ipynb")],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2 and "no graded questions for chapter '99'" in unknown.stderr


def test_check_in_the_notebook_blocks_what_the_grader_blocks(capsys):
    """A function that returns kvlib's own softmax gets ❌ from check(), as from the grader."""
    from kvlib.course.grading import check
    from kvlib.ref.attention import softmax

    namespace = {"softmax": softmax}
    exec("def stable_softmax(x):\n    return softmax(x)\n", namespace)
    assert check("stable_softmax", namespace["stable_softmax"]) is None  # the printed line says
    out = capsys.readouterr().out
    assert (
        out.startswith("❌ stable_softmax") and "kvlib.ref.attention.softmax is unavailable" in out
    )
    assert namespace["softmax"] is softmax  # restored afterwards


# --- issue 34: one regression test per class of hole --------------------------------------------

EXERCISE_01 = ROOT / "exercises" / "01_naive_vs_cached.ipynb"


def with_cells(path: Path, sources: list[str], tmp_path: Path, *, at: int | None = None) -> Path:
    """A copy of `path` with code cells `sources` inserted at index `at` (default: the end)."""
    notebook = nbformat.read(path, as_version=4)
    cells = [nbformat.v4.new_code_cell(s) for s in sources]
    index = len(notebook.cells) if at is None else at
    notebook.cells[index:index] = cells
    out = tmp_path / path.name
    nbformat.write(notebook, out)
    return out


# Class 1 and 2: the verdict cannot be forged, the test cannot be disabled or read. Each snippet
# is an extra cell after an untouched exercise 01, whose kv_cache_bytes must still score 0.
FORGERIES = [
    # the old forge: write a passing result file at exit
    "import atexit, json, os\n"
    "for key in ('KVLIB_RESULT', 'KVLIB_SUBMISSION'):\n"
    "    if key in os.environ:\n"
    "        atexit.register(lambda p=os.environ[key]: open(p, 'w').write(json.dumps("
    "{'passed': True, 'message': ''})))\n",
    # read the expected value from the caller's frames
    "import sys\n\n"
    "def kv_cache_bytes(*args):\n"
    "    frame = sys._getframe(1)\n"
    "    while frame is not None:\n"
    "        if 'expected' in frame.f_locals:\n"
    "            return frame.f_locals['expected']\n"
    "        frame = frame.f_back\n"
    "    return -1\n",
    # disable the test by replacing its code
    "import kvlib.course.checks.ch01 as checks\n"
    "checks.test_kv_cache_bytes.__code__ = (lambda submission: None).__code__\n",
    # replace the oracle, then agree with it
    "import kvlib.course.checks.ch01 as checks\n"
    "checks.dense_kv_cache_bytes = lambda *args: 0\n\n"
    "def kv_cache_bytes(*args):\n"
    "    return 0\n",
    # the oracle through a check module re-export
    "from kvlib.course.checks.ch01 import dense_kv_cache_bytes as kv_cache_bytes\n",
    # a reply frame that would run code when unpickled, written straight onto the reply pipe
    "import os, pickle, struct, sys\n\n"
    "class Evil:\n"
    "    def __reduce__(self):\n"
    "        return (os.system, ('touch ' + os.environ.get('FORGE_MARKER', '/nonexistent/x'),))\n\n"
    "def kv_cache_bytes(*args):\n"
    "    data = pickle.dumps(('returned', Evil(), None, ('P', None)))\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            os.write(fd, struct.pack('<Q', len(data)) + data)\n"
    "        except OSError:\n"
    "            pass\n"
    "    os._exit(0)\n",
]


@pytest.mark.parametrize("source", FORGERIES, ids=[f"forgery-{i}" for i in range(len(FORGERIES))])
def test_forged_verdicts_score_zero(source, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("FORGE_MARKER", str(marker))
    path = with_cells(EXERCISE_01, [source], tmp_path)
    report = grade_notebook(path, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"])
    assert report.score == 0, report.table()
    assert not marker.exists(), "the grader ran code from the learner's reply"


# Class 3: blocking by provenance, twins included. (notebook, question, answer, phrase)
BLOCKED_ANSWERS = [
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "import threading\nfrom kvlib.ref.attention import softmax\n\n"
        "def stable_softmax(x):  # the blocked function called from a thread of the answer's own\n"
        "    out = {}\n\n"
        "    def work():\n"
        "        try:\n"
        "            out['y'] = softmax(x)\n"
        "        except BaseException as error:\n"
        "            out['error'] = error\n\n"
        "    thread = threading.Thread(target=work)\n"
        "    thread.start()\n"
        "    thread.join()\n"
        "    if 'error' in out:\n"
        "        raise out['error']\n"
        "    return out['y']\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "from kvlib.ref.attention import softmax\n\n"
        "def stable_softmax(x, _impl=softmax):  # captured as a default argument\n"
        "    return _impl(x)\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "import importlib\nimport kvlib.ref.attention as A\n\nA = importlib.reload(A)\n\n"
        "def stable_softmax(x):\n    return A.softmax(x)\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "import sys\nimport kvlib.ref.attention\n\nold = sys.modules.pop('kvlib.ref.attention')\n"
        "import kvlib.ref.attention  # noqa: E402 a fresh module\n\n"
        "def stable_softmax(x):\n    return old.softmax(x)\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "import types\nfrom kvlib.ref.attention import softmax\n\n"
        "copy = types.FunctionType(softmax.__code__, softmax.__globals__, 'copy', "
        "softmax.__defaults__)\n\n"
        "def stable_softmax(x):\n    return copy(x)\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "import kvlib.ref.attention as A\n\n"
        "namespace = {'__name__': 'kvlib.ref.fake', 'softmax': A.softmax}\n"
        "exec(compile('def stable_softmax(x):\\n    return softmax(x)\\n', A.__file__, 'exec'), "
        "namespace)\nstable_softmax = namespace['stable_softmax']\n",
        "unavailable",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "from kvlib.ref.attention import softmax\n\n"
        "def stable_softmax(x):\n    return softmax.__kwdefaults__['_original'](x)\n",
        "TypeError",
    ),
    (
        "07_paged_cache.ipynb",
        "slot_mapping",
        "from kvlib.course.checks.ch07 import _slots as slot_mapping\n",
        "unavailable",
    ),
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        "from kvlib.ops.attention import get_backend\n\n"
        "def grouped_attention(q, k, v, mask):\n"
        "    return get_backend('grouped')(q, (k, v), mask[None])\n",
        "unavailable",
    ),
    (
        "05_gqa_mqa.ipynb",
        "kv_heads_for_budget",
        "from kvlib.memory import cache_report\n\n"
        "def kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):\n"
        "    heads = config['num_attention_heads']\n"
        "    fits = [h for h in range(1, heads + 1) if heads % h == 0 and cache_report(\n"
        "        {**config, 'model_type': 'llama', 'num_key_value_heads': h}, seq_len,\n"
        "        batch_size=batch_size).total_bytes <= budget_bytes]\n"
        "    return max(fits, default=0)\n",
        "unavailable",
    ),
    (
        "10_quantized_cache.ipynb",
        "bytes_per_token",
        "from kvlib.quant import QuantScheme\n\n"
        "def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):\n"
        "    dtype = {2: torch.float16, 4: torch.float32}[scale_bytes]\n"
        "    scheme = QuantScheme(f'int{bits}', False, 'channels', group_size, dtype)\n"
        "    return num_layers * num_kv_heads * 2 * scheme.bytes_per_vector(head_dim)\n",
        "unavailable",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "rope_at_offset",
        "from kvlib.layers.llama import rope_inverse_frequencies, rotate_half\n\n"
        "def rope_at_offset(x, offset, theta):\n"
        "    t, d = x.shape\n"
        "    positions = torch.arange(offset, offset + t, dtype=torch.float32)[:, None]\n"
        "    angles = positions * rope_inverse_frequencies(d, theta)\n"
        "    angles = torch.cat([angles, angles], dim=-1)\n"
        "    return x * angles.cos() + rotate_half(x) * angles.sin()\n",
        "unavailable",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        "from kvlib.serve.detokenize import StopStringMatcher\n\n"
        "def stop_stream(pieces, stops):\n"
        "    matcher, sent = StopStringMatcher(stops), []\n"
        "    for piece in pieces:\n"
        "        safe, stopped = matcher.push(piece)\n"
        "        sent.append(safe)\n"
        "        if stopped:\n"
        "            return sent, True\n"
        "    return sent + [matcher.flush()], False\n",
        "unavailable",
    ),
    (
        "13_server.ipynb",
        "stop_stream",
        "from kvlib.course.checks.ch13 import _stop_stream as stop_stream\n",
        "unavailable",
    ),
    (
        "13_server.ipynb",
        "slo_goodput",
        "from kvlib.serve.load import goodput\n\n"
        "def slo_goodput(requests, ttft_slo_s, tpot_slo_s):\n"
        "    rows = [dict(ttft_s=t[0] - a, tpot_s=(t[-1] - t[0]) / max(1, len(t) - 1))\n"
        "            for a, t in requests]\n"
        "    good = goodput(rows, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)\n"
        "    start, end = min(a for a, _ in requests), max(t[-1] for _, t in requests)\n"
        "    return good, good / (end - start)\n",
        "unavailable",
    ),
    (
        "13_server.ipynb",
        "utf8_deltas",
        "from kvlib.serve.detokenize import IncrementalDetokenizer\n\n"
        "def utf8_deltas(token_bytes):  # token ids: indices into a table of the tokens\n"
        "    table = list(dict.fromkeys(token_bytes))\n"
        "    detok = IncrementalDetokenizer(\n"
        "        lambda ids: b''.join(table[i] for i in ids).decode('utf-8', 'replace')\n"
        "    )\n"
        "    deltas = [detok.push(table.index(t)) for t in token_bytes]\n"
        "    deltas[-1] += detok.flush()\n"
        "    return deltas\n",
        "unavailable",
    ),
    (
        "14_offload.ipynb",
        "two_tier_lru",
        "import torch\n"
        "from kvlib.offload.store import MemoryTier\n\n"
        "def two_tier_lru(host_blocks, disk_blocks, operations):  # kvlib's tier as the LRU\n"
        "    host = MemoryTier('host', 4 * host_blocks, 1.0)\n"
        "    host.put(b'A', {'x': torch.zeros(1)})\n"
        "    return [], [k.decode() for k in host.keys()], []\n",
        "unavailable",
    ),
    (
        "14_offload.ipynb",
        "break_even_gbps",
        "from kvlib.memory import kv_bytes_per_token\n\n"
        "def break_even_gbps(config, num_tokens, flops_per_s):  # chapter 3's function for bytes\n"
        "    c = dict(config, model_type='llama', torch_dtype='bfloat16')\n"
        "    return kv_bytes_per_token(c) * num_tokens * flops_per_s / 1e9\n",
        "unavailable",
    ),
    (
        "15_sparse_attention.ipynb",
        "page_bound",
        "from kvlib.sparse.bounds import page_upper_bounds\n\n"
        "def page_bound(q, key_min, key_max, scale):\n"
        "    return page_upper_bounds(q[None], key_min[None, :, None], key_max[None, :, None],\n"
        "                             scale=scale)[0, 0]\n",
        "unavailable",
    ),
    (
        "15_sparse_attention.ipynb",
        "pages_to_read",
        "from kvlib.sparse.selection import select_pages\n\n"
        "def pages_to_read(head_bounds, group_size, num_pages, budget):\n"
        "    h, p = head_bounds.shape\n"
        "    scores = head_bounds.view(h // group_size, group_size, p).amax(1).sum(0)[None]\n"
        "    chosen = select_pages(scores, torch.tensor([num_pages]), budget)[0]\n"
        "    return chosen.nonzero()[:, 0].tolist()\n",
        "unavailable",
    ),
    (
        "15_sparse_attention.ipynb",
        "compact_table",
        "from kvlib.sparse.selection import compact_block_tables\n\n"
        "def compact_table(block_table, seq_len, pages, block_size):\n"
        "    selected = torch.zeros(1, len(block_table), dtype=torch.bool)\n"
        "    selected[0, list(pages)] = True\n"
        "    tables, lens = compact_block_tables(torch.tensor([block_table]),\n"
        "        torch.tensor([seq_len]), selected, block_size, len(pages))\n"
        "    return tables[0].tolist(), int(lens[0])\n",
        "unavailable",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        "from kvlib.memory import sparse_decode_read_bytes\n\n"
        "def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):\n"
        "    config = dict(model_type='llama', num_hidden_layers=L, num_attention_heads=H_kv,\n"
        "                  num_key_value_heads=H_kv, head_dim=D, hidden_size=H_kv * D,\n"
        "                  torch_dtype={1: 'int8', 2: 'bfloat16', 4: 'float32'}[b])\n"
        "    return sparse_decode_read_bytes(config, S, budget, block_size=block_size,\n"
        "                                    dense_layers=dense)\n",
        "unavailable",
    ),
    (
        "15_sparse_attention.ipynb",
        "decode_read_bytes",
        "from kvlib.memory import kv_cache_bytes\n\n"
        "def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):  # chapter 3's bytes\n"
        "    config = dict(model_type='llama', num_hidden_layers=L, num_attention_heads=H_kv,\n"
        "                  num_key_value_heads=H_kv, head_dim=D, hidden_size=H_kv * D,\n"
        "                  torch_dtype={1: 'int8', 2: 'bfloat16', 4: 'float32'}[b])\n"
        "    return kv_cache_bytes(config, S)\n",
        "unavailable",
    ),
]


# Issue 57: how an answer computed (the torch operators it ran, a view or a copy returned, memory
# swapped in, a kernel that is not Triton's) is what the learner's process reports about itself;
# learner code can make it report anything, so it is flagged for the instructor with the verdict
# and never scored: an answer is scored by its values and the memory measured from outside. The
# first two call PyTorch's attention and fail on memory (K/V repeated) and values, flagged too; the
# copy computes the right values: full marks, flagged (MEASURED_OUTSIDE has the same copy forged
# to look like a view: full marks too, its flag gone, which is why a flag is never scored).
FLAGGED_ANSWERS = [
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        "def grouped_attention(q, k, v, mask):\n"
        "    g = q.shape[1] // k.shape[1]\n"
        "    with torch._C.DisableTorchFunction():\n"
        "        return torch.nn.functional.scaled_dot_product_attention(\n"
        "            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask\n"
        "        )\n",
        "fold each group's query heads",
    ),
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        "def grouped_attention(q, k, v, mask):\n"
        "    g = q.shape[1] // k.shape[1]\n"
        "    return torch.ops.aten._scaled_dot_product_attention_math(\n"
        "        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask\n"
        "    )[0]\n",
        "max abs difference",
    ),
    (
        "02_cache_in_a_transformer.ipynb",
        "static_cache_insert",
        "def static_cache_insert(buffer, length, k_new):  # a copy, not a view\n"
        "    end = length + k_new.shape[2]\n"
        "    if end > buffer.shape[2]:\n"
        "        raise ValueError(f'{end} > {buffer.shape[2]}')\n"
        "    buffer[:, :, length:end] = k_new\n"
        "    return buffer[:, :, :end].clone()\n",
        Flagged("return a view of the buffer"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "notebook,question,source,phrase",
    BLOCKED_ANSWERS,
    ids=[f"{q}-{i}" for i, (_, q, _, _) in enumerate(BLOCKED_ANSWERS)],
)
def test_blocked_functions_stay_blocked(notebook, question, source, phrase, tmp_path):
    result, report = grade_answer(notebook, question, source, tmp_path)
    assert not result.passed and names_the_rule(phrase, result.message), report.table()


# Twins (chapters 7-12): an answer that delegates to anything in kvlib computing the asked-for
# result scores zero, not only one that calls the function the question names.
TWIN_ANSWERS = [
    (
        "07_paged_cache.ipynb",
        "slot_mapping",
        "from types import SimpleNamespace\n\nimport torch\n"
        "from kvlib.cache.paged import read_slots\n\n"
        "def slot_mapping(block_table, positions, block_size):  # the paged cache's own lookup\n"
        "    paged = SimpleNamespace(key_cache=torch.empty(1, block_size),\n"
        "                            block_tables=torch.tensor([block_table or [0]]),\n"
        "                            positions=torch.tensor([positions], dtype=torch.long))\n"
        "    return [int(x) for x in read_slots(paged)[0]]\n",
        "kvlib.cache.paged.read_slots is unavailable",
    ),
    (
        "08_eviction.ipynb",
        "streaming_keep",
        "from kvlib.engine.scheduler import StreamingEviction\n\n"
        "def streaming_keep(positions, budget, num_sinks):  # the engine's window, blocks of 1\n"
        "    n = len(positions)\n"
        "    if n <= budget:\n"
        "        return [True] * n\n"
        "    window = StreamingEviction(max(num_sinks, 1), budget - max(num_sinks, 1) - 1)\n"
        "    drop = set(window.blocks_to_drop(n))\n"
        "    return [i not in drop for i in range(n)]\n",
        "kvlib.engine.scheduler.StreamingEviction.__post_init__ is unavailable",
    ),
    (
        "08_eviction.ipynb",
        "h2o_update",
        "from kvlib.cache.evicting import EvictingCache\n"
        "from kvlib.cache.eviction_policies import H2O\n\n"
        "def h2o_update(scores, weights):  # a policy object made without its guarded __init__\n"
        "    policy = object.__new__(H2O)\n"
        "    return policy.observe(None, weights, None)\n",
        "kvlib.cache.eviction_policies.H2O.observe is unavailable",
    ),
    (
        "09_compaction.ipynb",
        "positions_after_hole_filling",
        "from kvlib.cache.compaction_plans import SlotMap\n\n"
        "def positions_after_hole_filling(positions):  # the cache's slot map does the moves\n"
        "    live = [p >= 0 for p in positions]\n"
        "    holes = [i for i, x in enumerate(live) if not x]\n"
        "    moves = [(s, h) for h, s in zip(holes, reversed([i for i, x in enumerate(live) if x]))"
        " if h < s]\n"
        "    n = len(positions)\n"
        "    m = SlotMap(torch.tensor(positions), torch.zeros(n), torch.zeros(n, dtype=torch.long))"
        "\n"
        "    return m.move(moves, sum(live)).positions.tolist()\n",
        "kvlib.cache.compaction_plans.SlotMap.move is unavailable",
    ),
    (
        "10_quantized_cache.ipynb",
        "bytes_per_token",
        "from kvlib.quant import QuantScheme\n\n"
        "def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):\n"
        "    dtype = {2: torch.float16, 4: torch.float32}[scale_bytes]\n"
        "    scheme = QuantScheme(f'int{bits}', False, 'channels', group_size, dtype)\n"
        "    per_vector = head_dim * bits / 8 + scheme.scales_per_vector(head_dim) * 2 * "
        "scale_bytes\n"
        "    return num_layers * num_kv_heads * 2 * per_vector\n",
        "kvlib.quant.QuantScheme.__post_init__ is unavailable",
    ),
    (
        "10_quantized_cache.ipynb",
        "kivi_key_scales",
        "from kvlib.quant import QuantScheme\nfrom kvlib.cache.quantized import QuantizedCache\n\n"
        "def kivi_key_scales(keys, group_size):  # the quantized cache quantizes for us\n"
        "    scheme = QuantScheme('int2', False, 'tokens', group_size, torch.float32)\n"
        "    cache = QuantizedCache(1, scheme)\n"
        "    stored = cache.update(0, keys[None, None], keys[None, None])\n"
        "    return stored.keys.scale[0, 0], stored.keys.zero[0, 0]\n",
        "kvlib.quant.QuantScheme.__post_init__ is unavailable",
    ),
    (
        "12_serving_engine.ipynb",
        "schedule_step",
        "from kvlib.engine.llm_engine import LLMEngine\n\n"
        "def schedule_step(running, waiting, token_budget, max_num_seqs):  # ask the engine\n"
        "    engine = LLMEngine(None, max_num_batched_tokens=token_budget, "
        "max_num_seqs=max_num_seqs)\n"
        "    return [(r.request_id, n) for r, n in engine.scheduler.schedule().scheduled]\n",
        "kvlib.engine.llm_engine.LLMEngine.__init__ is unavailable",
    ),
    (
        "16_speculative.ipynb",
        "greedy_accept",
        "from kvlib.speculative import greedy_accept as kvlib_greedy_accept\n\n"
        "def greedy_accept(draft, target_logits):  # kvlib's own\n"
        "    return kvlib_greedy_accept(draft, target_logits)\n",
        "unavailable",
    ),
    (
        "16_speculative.ipynb",
        "rejection_sample",
        "from kvlib.speculative.verify import residual_distribution\n\n"
        "def rejection_sample(draft, q, p, uniforms):  # kvlib's residual\n"
        "    for i, (token, u) in enumerate(zip(draft, uniforms)):\n"
        "        if u * q[i, token] > p[i, token]:\n"
        "            return i, residual_distribution(p[i], q[i])\n"
        "    return len(draft), p[len(draft)]\n",
        "unavailable",
    ),
    (
        "16_speculative.ipynb",
        "rollback_blocks",
        "from kvlib.cache.block_manager import BlockManager\n"
        "from kvlib.cache.block_pool import BlockPool\n\n"
        "def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # the allocator's own\n"
        "    pool = BlockPool(max(ref_cnt) + 2, block_size, enable_prefix_caching=False)\n"
        "    manager = BlockManager(pool)\n"
        "    return manager, [], False\n",
        "unavailable",
    ),
]


# Class 3, kvlib's source executed again: compiled under another file name, or loaded from a copy
# of its file, before the graded call or during it. In the mount namespace the source is not there
# to read; without it a copy is not matched (an instructor reading the notebook judges copying).
_SOURCE = "open(__import__('kvlib.ref.attention').ref.attention.__file__).read()"
SOURCE_COPIES = [
    "namespace = {}\n"  # at load time, exec under another name
    f"exec(compile({_SOURCE}, 'x.py', 'exec'), namespace)\n\n"
    "def stable_softmax(x):\n    return namespace['softmax'](x)\n",
    "import importlib.util, os, shutil, tempfile\n"  # at load time, a module from a copied file
    "copy = os.path.join(tempfile.mkdtemp(), 'mine.py')\n"
    "shutil.copy(__import__('kvlib.ref.attention').ref.attention.__file__, copy)\n"
    "spec = importlib.util.spec_from_file_location('mine', copy)\n"
    "mine = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mine)\n\n"
    "def stable_softmax(x):\n    return mine.softmax(x)\n",
    "def stable_softmax(x):  # during the call, exec under another name\n"
    "    namespace = {}\n"
    f"    exec(compile({_SOURCE}, 'y.py', 'exec'), namespace)\n"
    "    return namespace['softmax'](x)\n",
    "import types\n\n"  # during the call, a function built on a code object of the compiled module
    "def stable_softmax(x):\n"
    f"    module = compile({_SOURCE}, 'z.py', 'exec')\n"
    "    code = [c for c in module.co_consts if getattr(c, 'co_name', '') == 'softmax'][0]\n"
    "    return types.FunctionType(code, {'np': np})(x, -1)\n",
    "def mine(x):\n    pass\n\n"  # during the call, a function's code replaced by a copy's
    "def stable_softmax(x):\n"
    f"    module = compile({_SOURCE}, 'w.py', 'exec')\n"
    "    mine.__code__ = [c for c in module.co_consts if getattr(c, 'co_name', '') == 'softmax'][0]"
    "\n    return mine(x, -1)\n",
]


@pytest.mark.skipif(not ISOLATED, reason="only the mount namespace hides kvlib's source files")
@pytest.mark.parametrize("source", SOURCE_COPIES, ids=[f"copy-{i}" for i in range(5)])
def test_kvlib_source_executed_again_stays_blocked(source, tmp_path):
    result, report = grade_answer("01_naive_vs_cached.ipynb", "stable_softmax", source, tmp_path)
    assert not result.passed, report.table()
    assert names_the_rule("kvlib.ref.attention.softmax is unavailable", result.message), (
        report.table()
    )


def test_every_allowed_name_resolves():
    """An allowed name that no longer resolves (its module moved or renamed) would leave a
    question's own helper unavailable."""
    import importlib

    missing = []
    for path in EXERCISES:
        for q in chapter_questions(chapter_of(path)):
            for dotted in q.allowed:
                module, _, name = dotted.rpartition(".")
                if not callable(getattr(importlib.import_module(module), name, None)):
                    missing.append(f"{q.id}: {dotted}")
    assert not missing, missing


# Class 4: whether a Triton question's answer is a @triton.jit kernel run by the interpreter is
# its process's word (issue 57): a launch that raises says what was expected and scores zero; one
# that returns is scored by its values and flagged.
def test_triton_questions_flag_what_is_not_a_jit_kernel(tmp_path):
    crafted = (
        "class reduce_kernel:  # indexing returns a torch function, not a Triton launch\n"
        "    def __class_getitem__(cls, grid):\n"
        "        def run(partial_out, partial_lse, out, num_splits, **meta):\n"
        "            w = torch.softmax(partial_lse, -1)\n"
        "            out.copy_((w[..., None] * partial_out).sum(1))\n"
        "        return run\n"
    )
    plain = (
        "def reduce_kernel(partial_out, partial_lse, out, num_splits, **meta):  # no kernel\n"
        "    w = torch.softmax(partial_lse, -1)\n"
        "    out.copy_((w[..., None] * partial_out).sum(1))\n"
    )
    flagged, refused = grade_answers(
        "11_triton_decode.ipynb", "reduce_kernel", [crafted, plain], tmp_path
    )
    assert flagged.passed and FLAG in flagged.message, flagged
    assert "not a kernel run by Triton's interpreter" in flagged.message, flagged
    assert not refused.passed and "should be a @triton.jit kernel" in refused.message, refused


# Class 5: allocation limits count peak bytes, numpy's included, and say what they measured.
ALLOCATION_ANSWERS = [
    (
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        "import numpy as np\n\n"
        "def grouped_attention(q, k, v, mask):  # repeats K/V in numpy, where torch cannot see\n"
        "    g = q.shape[1] // k.shape[1]\n"
        "    k = torch.from_numpy(np.repeat(k.numpy(), g, axis=1))\n"
        "    v = torch.from_numpy(np.repeat(v.numpy(), g, axis=1))\n"
        "    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, "
        "float('-inf'))\n"
        "    return torch.softmax(scores, dim=-1) @ v\n",
        False,
        "measured from outside",
    ),
    (
        "06_mla.ipynb",
        "absorbed_scores",
        "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # right, in float64\n"
        "    d_h, d_r = q_nope.shape[-1], q_rope.shape[-1]\n"
        "    q_latent = torch.einsum('bhtd,hdc->bhtc', q_nope.double(), w_uk.double())\n"
        "    content = q_latent @ latent.double()[:, None].transpose(-1, -2)\n"
        "    rotary = q_rope.double() @ rope_key.double()[:, None].transpose(-1, -2)\n"
        "    return ((content + rotary) / math.sqrt(d_h + d_r)).float()\n",
        True,
        "",
    ),
]


# Class 8: robustness.
def test_uncatchable_timeout_and_stray_threads_and_exit(tmp_path):
    swallow = (
        "import time\n\n"
        "def stable_softmax(x):  # swallows every exception, BaseException included\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(0.05)\n"
        "        except BaseException:\n"
        "            pass\n"
    )
    path = with_cell_replaced(SOLUTION_01, "stable_softmax", swallow, tmp_path)
    thread = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n"
    path = with_cells(path, [thread, "import os\nos._exit(0)\n"], tmp_path, at=2)
    started = time.monotonic()
    report = grade_notebook(path, timeout_s=8)
    results = {q.id: q for q in report.questions}
    assert "timed out" in results["stable_softmax"].message, report.table()
    # (cached_attention_step calls the notebook's stable_softmax: it hangs too)
    assert results["kv_cache_bytes"].passed, report.table()
    assert results["predict_score_entries"].passed, report.table()
    assert time.monotonic() - started < 150, "a stray thread held the grader up"


def test_a_file_that_is_not_a_notebook_is_one_usage_error(tmp_path):
    for name, text in (("01_text.ipynb", "hello"), ("01_json.ipynb", '{"cells": 3}')):
        (tmp_path / name).write_text(text)
        completed = subprocess.run(
            [sys.executable, "-m", "kvlib.course.grade", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 2, completed.stderr
        assert "is not a Jupyter notebook" in completed.stderr
        assert completed.stderr.count("error:") == 1


def test_messages_carry_no_assertion_dumps(tmp_path):
    source = "def stable_softmax(x):\n    return x * 0 + 1 / x.shape[-1]\n"
    path = with_cell_replaced(SOLUTION_01, "stable_softmax", source, tmp_path)
    (result,) = grade_notebook(path, timeout_s=TIMEOUT_S, only=["stable_softmax"]).questions
    assert not result.passed and result.message
    for dump in ("assert ", "\nE ", "where ", "tensor(", "array("):
        assert dump not in result.message, result.message


# Class 7: check() in the notebook and the grader agree, on a table of answers.
AGREEMENT_TABLE = [
    ("01_naive_vs_cached.ipynb", "stable_softmax", None),  # the solution
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "%%time\ndef stable_softmax(x):\n    e = np.exp(x - np.max(x, axis=-1, keepdims=True))\n"
        "    return e / np.sum(e, axis=-1, keepdims=True)\n",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "from kvlib.ref.attention import softmax\n\n"
        "print(softmax(np.zeros(3)))  # a library demo\n\n"
        "def stable_softmax(x):\n    e = np.exp(x - np.max(x, axis=-1, keepdims=True))\n"
        "    return e / np.sum(e, axis=-1, keepdims=True)\n",
    ),
    (
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "def stable_softmax(x):\n    e = np.exp(x)\n"
        "    return e / np.sum(e, axis=-1, keepdims=True)\n",
    ),
    BLOCKED_ANSWERS[1][:3],  # a default argument
    BLOCKED_ANSWERS[7][:3],  # a check module's oracle
    FLAGGED_ANSWERS[0][:3],  # SDPA with torch functions disabled: fails on memory
    ("05_gqa_mqa.ipynb", "mean_pool_kv", None),
    ("01_naive_vs_cached.ipynb", "stable_softmax", SOURCE_COPIES[0]),  # kvlib's source, exec'd
    TWIN_ANSWERS[0][:3],  # a twin: the paged cache's slot lookup
]

_CHECK_SCRIPT = """
import contextlib, io, json, os, sys
from kvlib.course.grading import check, read_code_cells
from kvlib.course.sandbox import _cell_code
verdicts = []
for path, question, function in json.loads(sys.argv[1]):
    os.environ["KVLIB_GRADING"] = "1"  # the notebook's own check() cells stay silent
    namespace = {"__name__": "__main__"}
    for index, source in enumerate(read_code_cells(path)):
        try:
            exec(compile(_cell_code(source), f"<cell {index}>", "exec"), namespace)
        except BaseException:
            pass
    del os.environ["KVLIB_GRADING"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # check() prints its verdict
        check(question, namespace.get(function))
    verdicts.append(printed.getvalue().startswith("✅"))
print("VERDICTS", json.dumps(verdicts))
"""


def solution_source(notebook: str, function: str) -> str:
    """The solution's cell that defines `function`."""
    cells = nbformat.read(ROOT / "solutions" / notebook, as_version=4).cells
    (cell,) = [c for c in cells if c.cell_type == "code" and f"def {function}(" in c.source]
    return cell.source


def test_check_and_the_grader_agree_on_a_table_of_answers(tmp_path):
    jobs, groups = [], {}
    for index, (notebook, question, source) in enumerate(AGREEMENT_TABLE):
        folder = tmp_path / str(index)
        folder.mkdir()
        solution = ROOT / "solutions" / notebook
        path = (
            solution if source is None else with_cell_replaced(solution, question, source, folder)
        )
        jobs.append((str(path), question, question))
        source = solution_source(notebook, question) if source is None else source
        groups.setdefault((notebook, question), []).append((index, source))
    graded = [None] * len(AGREEMENT_TABLE)
    for number, ((notebook, question), rows) in enumerate(groups.items()):  # a child per group
        folder = tmp_path / f"group{number}"
        folder.mkdir()
        results = grade_answers(notebook, question, [source for _, source in rows], folder)
        for (index, _), result in zip(rows, results):
            graded[index] = result.passed
    completed = subprocess.run(
        [sys.executable, "-c", _CHECK_SCRIPT, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [x for x in completed.stdout.splitlines() if x.startswith("VERDICTS")]
    assert line, completed.stdout[-2000:] + completed.stderr[-2000:]
    checked = json.loads(line[0].removeprefix("VERDICTS "))
    if ISOLATED:  # the one place they part: a cell calling kvlib while the notebook loads
        # (row 2's library demo) raises where kvlib is hidden, so its function is never defined
        assert checked[2] and not graded[2]
        checked[2] = False
    assert checked == graded, list(zip(AGREEMENT_TABLE, graded, checked))
    assert graded == [True, True, not ISOLATED, False, False, False, False, True, False, False]


# Class 6: the tests cover what they claim. (notebook, question, answer, phrase)
_GROUPED = (
    "def grouped_attention(q, k, v, mask):\n"
    "    B, H, T, D = q.shape\n"
    "    H_kv, S = k.shape[1], k.shape[2]\n"
    "    G = H // H_kv\n"
    "    scores = (q.reshape(B, H_kv, G * T, D) @ k.transpose(-1, -2) / math.sqrt(D))\n"
    "    scores = scores.view(B, H_kv, G, T, S).masked_fill(~MASK, float('-inf'))\n"
    "    weights = SOFTMAX.view(B, H_kv, G * T, S)\n"
    "    return (weights @ v).view(B, H, T, D)OUT\n"
)


def _grouped(mask="mask", softmax="torch.softmax(scores, dim=-1)", out=""):
    return _GROUPED.replace("MASK", mask).replace("SOFTMAX", softmax).replace("OUT", out)


COVERAGE_ANSWERS = [
    (  # ignores the mask it is given: builds a causal one
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        _grouped(mask="torch.ones(T, S, dtype=torch.bool).tril(S - T)"),
        "a random mask",
    ),
    (  # an unstable softmax: exp of raw scores
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        _grouped(softmax="(scores.exp() / scores.exp().sum(-1, keepdim=True))"),
        "non-finite",
    ),
    (  # right values, wrong dtype
        "05_gqa_mqa.ipynb",
        "grouped_attention",
        _grouped(out=".double()"),
        "dtype",
    ),
    (  # a budget met exactly does not fit (< instead of <=)
        "05_gqa_mqa.ipynb",
        "kv_heads_for_budget",
        "def kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):\n"
        "    heads = config['num_attention_heads']\n"
        "    head_dim = config.get('head_dim') or config['hidden_size'] // heads\n"
        "    per_head = 2 * config['num_hidden_layers'] * head_dim * "
        "BYTES_PER_ELEMENT[config['torch_dtype']] * seq_len * batch_size\n"
        "    fits = [h for h in range(1, heads + 1) if heads % h == 0 and h * per_head < "
        "budget_bytes]\n"
        "    return max(fits, default=0)\n",
        "expected H_kv = 8",
    ),
    (  # recency by index, not by position
        "08_eviction.ipynb",
        "streaming_keep",
        "def streaming_keep(positions, budget, num_sinks):\n"
        "    if len(positions) <= budget:\n"
        "        return [True] * len(positions)\n"
        "    keep = [p < num_sinks for p in positions]\n"
        "    room = budget - sum(keep)\n"
        "    for i in range(len(positions) - 1, -1, -1):\n"
        "        if room and not keep[i]:\n"
        "            keep[i], room = True, room - 1\n"
        "    return keep\n",
        "slot order",
    ),
    (  # float indices
        "08_eviction.ipynb",
        "snapkv_select",
        "def snapkv_select(votes, budget, window, kernel_size):\n"
        "    h_kv, s = votes.shape\n"
        "    if s <= budget:\n"
        "        return torch.arange(s).expand(h_kv, s).float()\n"
        "    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel_size, 1, "
        "kernel_size // 2)[:, 0]\n"
        "    pooled[:, s - window:] = float('inf')\n"
        "    return pooled.sort(dim=1, descending=True, stable=True).indices[:, :budget]"
        ".sort(dim=1).values.float()\n",
        "integers",
    ),
    (  # mutates its input
        "07_paged_cache.ipynb",
        "slot_mapping",
        "def slot_mapping(block_table, positions, block_size):\n"
        "    slots = [block_table[t // block_size] * block_size + t % block_size for t in "
        "positions]\n"
        "    block_table.clear()\n"
        "    return slots\n",
        "changed its argument 1",
    ),
    (
        "12_serving_engine.ipynb",
        "schedule_step",
        "def schedule_step(running, waiting, token_budget, max_num_seqs):\n"
        "    plan, budget = [], token_budget\n"
        "    while running and budget:\n"
        "        request_id, left = running.pop(0)\n"
        "        plan.append((request_id, min(left, budget)))\n"
        "        budget -= plan[-1][1]\n"
        "    count = len(plan)\n"
        "    for request_id, left in waiting:\n"
        "        if budget == 0 or count >= max_num_seqs:\n"
        "            break\n"
        "        plan.append((request_id, min(left, budget)))\n"
        "        budget -= plan[-1][1]\n"
        "        count += 1\n"
        "    return plan\n",
        "changed its argument 1",
    ),
    (
        "09_compaction.ipynb",
        "repack",
        "def repack(slots, live):\n"
        "    survivors = live.nonzero()[:, 0]\n"
        "    destinations = torch.arange(len(survivors))\n"
        "    moved = survivors != destinations\n"
        "    slots[destinations[moved]] = slots[survivors[moved]]\n"
        "    live.zero_()\n"
        "    return int(moved.sum())\n",
        "changed its argument 2",
    ),
    (  # returns its input when there is nothing to pool
        "05_gqa_mqa.ipynb",
        "mean_pool_kv",
        "def mean_pool_kv(weight, num_kv_heads, head_dim):\n"
        "    old_heads = weight.shape[0] // head_dim\n"
        "    if old_heads == num_kv_heads:\n"
        "        return weight\n"
        "    heads = weight.reshape(num_kv_heads, old_heads // num_kv_heads, head_dim, -1)\n"
        "    return heads.mean(dim=1).reshape(num_kv_heads * head_dim, weight.shape[1])\n",
        "returned its argument 1",
    ),
    (  # right values, but always float64
        "01_naive_vs_cached.ipynb",
        "stable_softmax",
        "def stable_softmax(x):\n"
        "    x = np.asarray(x, dtype=np.float64)\n"
        "    e = np.exp(x - x.max(axis=-1, keepdims=True))\n"
        "    return e / e.sum(axis=-1, keepdims=True)\n",
        "expected a float32 numpy array",
    ),
    (  # refuses a write that fills the buffer exactly (>= instead of >)
        "02_cache_in_a_transformer.ipynb",
        "static_cache_insert",
        "def static_cache_insert(buffer, length, k_new):\n"
        "    t = k_new.shape[2]\n"
        "    if length + t >= buffer.shape[2]:\n"
        "        raise ValueError(f'overflow: {length} + {t} tokens into {buffer.shape[2]}')\n"
        "    buffer[:, :, length : length + t] = k_new\n"
        "    return buffer[:, :, : length + t]\n",
        "raised ValueError",
    ),
    (  # free memory exactly a whole number of sequences: one sequence short
        "03_counting_bytes.ipynb",
        "max_batch",
        "def max_batch(gpu_memory_bytes, weight_bytes, overhead_bytes, kv_bytes_per_token, "
        "seq_len):\n"
        "    free = gpu_memory_bytes - weight_bytes - overhead_bytes\n"
        "    return max(0, (free - 1) // (kv_bytes_per_token * seq_len))\n",
        "expected 3 sequences",
    ),
    (  # hard-coded answers for the fixed cases, a wrong formula elsewhere
        "01_naive_vs_cached.ipynb",
        "kv_cache_bytes",
        "def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):\n"
        "    known = {(32, 32, 128, 2, 1): 524288, (32, 32, 128, 2, 4096): 2147483648,\n"
        "             (80, 8, 128, 2, 1000): 327680000, (1, 1, 16, 8, 0): 0}\n"
        "    key = (num_layers, num_heads, head_dim, bytes_per_element, seq_len)\n"
        "    return known.get(key, 2 * num_layers * head_dim * bytes_per_element * seq_len)\n",
        "seed",
    ),
]


def test_random_cases_are_fresh_on_every_run_and_replayed_by_seed(tmp_path):
    """Each grading run draws its own random cases, and says its seed; the same seed draws the
    same cases again (the same message), whatever the answer's source."""
    source = COVERAGE_ANSWERS[-1][2]  # right on the fixed cases only: a random case catches it
    path = with_cell_replaced(SOLUTION_01, "kv_cache_bytes", source, tmp_path)
    runs = [grade_notebook(path, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"]) for _ in range(2)]
    assert runs[0].seed != runs[1].seed, "two runs drew the same seed"
    for report in runs:
        assert f"seed {report.seed}" in report.questions[0].message, report.table()
    again = grade_notebook(path, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"], seed=runs[0].seed)
    assert again.questions[0].message == runs[0].questions[0].message


_TIMEOUT_SCRIPT = """
import time
from kvlib.course.grading import check

def max_batch(gpu, weights, overhead, per_token, seq_len):
    return max(0, (gpu - weights - overhead) // (per_token * seq_len))

calls = []

def stable_softmax(x):  # swallows Exception: check()'s timeout is a BaseException
    calls.append(x.shape)
    while True:
        try:
            time.sleep(0.05)
        except Exception:
            pass

check("max_batch", max_batch)  # the grader subprocess starts: not timed below
started = time.monotonic()
verdict = check("stable_softmax", stable_softmax, timeout_s=3)
print("VERDICT", verdict, len(calls), time.monotonic() - started)
check("max_batch", max_batch)
"""


def test_check_in_the_notebook_times_out():
    """check() stops a function that runs past the question's deadline (the cell returns with the
    grader's timeout message) and the next check() works (a fresh grader)."""
    completed = subprocess.run(
        [sys.executable, "-c", _TIMEOUT_SCRIPT], capture_output=True, text=True, timeout=180
    )
    out = completed.stdout
    assert out.startswith("✅ max_batch: passed"), out + completed.stderr[-2000:]
    assert "❌ stable_softmax: timed out after 3 s" in out, out + completed.stderr[-2000:]
    verdict = [line.split() for line in out.splitlines() if line.startswith("VERDICT")]
    # the function ran (once) and was stopped near its deadline, not at the grader's 60 s
    assert verdict and verdict[0][1:3] == ["None", "1"] and float(verdict[0][3]) < 30, out
    assert out.rstrip().endswith("✅ max_batch: passed (1 point)"), out + completed.stderr[-2000:]


def test_check_leaves_the_notebook_process_usable(capsys):
    """check() guards kvlib and the check modules in the notebook's process: only while a graded
    call runs, so the library (and grading in the same process) works as before afterwards."""
    from kvlib.course.checks.ch07 import _slots
    from kvlib.course.grading import check

    namespace: dict = {}
    exec(
        "def slot_mapping(block_table, positions, block_size):\n"
        "    return [block_table[t // block_size] * block_size + t % block_size for t in "
        "positions]\n",
        namespace,
    )
    check("slot_mapping", namespace["slot_mapping"])
    assert capsys.readouterr().out.startswith("✅ slot_mapping: passed")
    assert _slots([3], [1], 4) == [13]  # outside a graded call, the oracle is usable
    report = grade_notebook(ROOT / "solutions" / "07_paged_cache.ipynb", only=["slot_mapping"])
    assert report.score == 1, report.table()


# --- issue 50: the grader's second hardening ------------------------------------------------------
# Each class has answers that cheat or nearly work (they must score 0, the feedback naming the rule)
# and valid variants (full marks). Every example issue 50 names is here; each got the wrong verdict
# from the grader before it (shown when these tests were written). (notebook, question, answer,
# None for a valid variant or a phrase the feedback must contain)

N01, N02, N03, N04 = ("01_naive_vs_cached.ipynb", "02_cache_in_a_transformer.ipynb",
                      "03_counting_bytes.ipynb", "04_online_softmax.ipynb")  # fmt: skip
N05, N06, N08, N09 = "05_gqa_mqa.ipynb", "06_mla.ipynb", "08_eviction.ipynb", "09_compaction.ipynb"
N13, N14 = "13_server.ipynb", "14_offload.ipynb"

# Class 1: while a question is graded only the kvlib names it allows are available (default-deny).
# kvlib's code compiled again from its source (the exec'd rows) is refused by the mount namespace,
# where kvlib's files are not there to read; without it a copy is the instructor's to judge.
DEFAULT_DENY = [
    (N01, "cached_attention_step",
     "from kvlib.ref.attention import attention\n\n"
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # the chapter's oracle\n"
     "    k_cache = np.concatenate([k_cache, k_new[None]])\n"
     "    v_cache = np.concatenate([v_cache, v_new[None]])\n"
     "    return attention(q[None], k_cache, v_cache)[0], k_cache, v_cache\n",
     "kvlib.ref.attention.attention is unavailable"),
    (N01, "cached_attention_step",
     "from kvlib.ref.attention import attention_weights\n\n"
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # calls softmax from kvlib\n"
     "    k_cache = np.concatenate([k_cache, k_new[None]])\n"
     "    v_cache = np.concatenate([v_cache, v_new[None]])\n"
     "    return attention_weights(q[None], k_cache)[0] @ v_cache, k_cache, v_cache\n",
     "kvlib.ref.attention.attention_weights is unavailable"),
    (N13, "stop_stream",
     "from types import SimpleNamespace\nfrom kvlib.serve.choices import Choice\n\n"
     "def stop_stream(pieces, stops):  # the server's choice bookkeeping matches for us\n"
     "    table = list(pieces)\n"
     "    model = SimpleNamespace(decode=lambda ids: ''.join(table[i] for i in ids),\n"
     "                            eos_token_ids=())\n"
     "    choice, sent = Choice('r', 0, model, [], list(stops)), []\n"
     "    for i in range(len(table)):\n"
     "        out = SimpleNamespace(new_token_ids=[i], logprobs=None, finished=False,\n"
     "                              finish_reason=None)\n"
     "        sent.append(choice.accept(out))\n"
     "        if choice.finished:\n"
     "            return sent, True\n"
     "    return sent + [choice._end('length')], False\n",
     "kvlib.serve.choices.Choice.__init__ is unavailable"),
    (N03, "gqa_bytes_per_token",
     "from kvlib.config import attention_geometry\n\n"
     "def gqa_bytes_per_token(config):  # the config reader finds H_kv and D\n"
     "    kv_heads, head_dim, _ = attention_geometry(config, 'llama')\n"
     "    size = {'float32': 4, 'bfloat16': 2, 'float16': 2}[config['torch_dtype']]\n"
     "    return 2 * config['num_hidden_layers'] * kv_heads * head_dim * size\n",
     "kvlib.config.attention_geometry is unavailable"),
    (N01, "stable_softmax",
     "import inspect\nimport kvlib.ref.attention as A\n\n"
     "namespace = dict(vars(A))\n"
     "exec(inspect.getsource(A.softmax).replace('def softmax(', 'def my_softmax('), namespace)\n\n"
     "def stable_softmax(x):  # kvlib's softmax, exec'd again under another name\n"
     "    return namespace['my_softmax'](x)\n",
     "kvlib.ref.attention.softmax is unavailable"),
    (N01, "kv_cache_bytes",
     "import pathlib\nimport kvlib\n\n"
     "path = pathlib.Path(kvlib.__file__).parent / 'memory' / 'formula.py'  # never imported here\n"
     "namespace = {}\nexec(compile(path.read_text(), 'mine.py', 'exec'), namespace)\n\n"
     "def kv_cache_bytes(*args):  # a copy of a module this process never imported\n"
     "    return namespace['dense_kv_cache_bytes'](*args)\n",
     "kvlib.memory.formula.dense_kv_cache_bytes is unavailable"),
    (N01, "cached_attention_step",  # valid: a helper of the learner's own named like kvlib's
     "def softmax(x):\n"
     "    e = np.exp(x - x.max())\n"
     "    return e / e.sum()\n\n"
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):\n"
     "    k_cache = np.vstack([k_cache, k_new])\n"
     "    v_cache = np.vstack([v_cache, v_new])\n"
     "    return softmax(k_cache @ q / np.sqrt(len(q))) @ v_cache, k_cache, v_cache\n",
     None),
    (N14, "salted_block_keys",  # valid: the helper the question allows, imported in the function
     "def salted_block_keys(salt, token_ids, block_size):\n"
     "    from kvlib.cache.block_pool import hash_block_tokens\n\n"
     "    keys, parent = [], None\n"
     "    for start in range(0, len(token_ids) - block_size + 1, block_size):\n"
     "        parent = hash_block_tokens(parent, token_ids[start : start + block_size])\n"
     "        keys.append(hashlib.sha256(salt + parent).digest())\n"
     "    return keys\n",
     None),
]  # fmt: skip

# Class 2: no processes while the notebook loads or a question is graded; threads are fine.
NO_PROCESSES = [
    (N01, "stable_softmax",
     "import json, subprocess, sys\n\n"
     "def stable_softmax(x):  # kvlib's softmax in a python -c child\n"
     "    code = ('import json, sys, numpy as np; from kvlib.ref.attention import softmax; '\n"
     "            'print(json.dumps(softmax(np.array(json.load(sys.stdin))).tolist()))')\n"
     "    out = subprocess.run([sys.executable, '-c', code], input=json.dumps(x.tolist()),\n"
     "                         capture_output=True, text=True).stdout\n"
     "    return np.array(json.loads(out), dtype=x.dtype)\n",
     "subprocess.Popen is not allowed"),
    (N01, "kv_cache_bytes",
     "import os, sys, tempfile\n\n"
     "def kv_cache_bytes(*args):  # the check module's own oracle, in a shell child\n"
     "    path = tempfile.mktemp()\n"
     "    code = ('from kvlib.course.checks.ch01 import dense_kv_cache_bytes as f; '\n"
     "            f'open({path!r}, \"w\").write(str(f(*{args!r})))')\n"
     "    os.system(f'{sys.executable} -c \"{code}\"')\n"
     "    return int(open(path).read())\n",
     "os.system is not allowed"),
    (N01, "stable_softmax",
     "import _posixsubprocess, os, sys\n\n"
     "def stable_softmax(x):  # subprocess's own primitive, called directly\n"
     "    r, w = os.pipe()\n"
     "    _posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], True, (w,), None, None,\n"
     "        -1, -1, -1, -1, -1, -1, r, w, True, False, None, None, None, -1, None, False)\n"
     "    return np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)\n",
     "creating a process is not allowed"),
    (N01, "kv_cache_bytes",
     "import ctypes\n\n"
     "def kv_cache_bytes(*args):  # libc's fork through ctypes\n"
     "    if ctypes.CDLL(None).fork() == 0:\n"
     "        ctypes.CDLL(None)._exit(0)\n"
     "    return 2 * args[0] * args[1] * args[2] * args[3] * args[4]\n",
     "ctypes.dlopen is not allowed"),
    (N13, "slo_goodput",  # valid: a thread pool
     "from concurrent.futures import ThreadPoolExecutor\n\n"
     "def _good(request, ttft_slo_s, tpot_slo_s):\n"
     "    arrival, times = request\n"
     "    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0\n"
     "    return times[0] - arrival <= ttft_slo_s and tpot <= tpot_slo_s\n\n"
     "def slo_goodput(requests, ttft_slo_s, tpot_slo_s):\n"
     "    with ThreadPoolExecutor(2) as pool:\n"
     "        good = sum(pool.map(lambda r: _good(r, ttft_slo_s, tpot_slo_s), requests))\n"
     "    start = min(a for a, _ in requests)\n"
     "    end = max(t[-1] for _, t in requests)\n"
     "    return good, good / (end - start)\n",
     None),
    (N14, "two_tier_lru",  # valid: a thread and a lock
     "import threading\n\n"
     "def two_tier_lru(host_blocks, disk_blocks, operations):\n"
     "    lock, host, disk, found = threading.Lock(), [], [], []\n\n"
     "    def run():\n"
     "        with lock:\n"
     "            for op, key in operations:\n"
     "                where = 'host' if key in host else 'disk' if key in disk else None\n"
     "                if where:\n"
     "                    (host if where == 'host' else disk).remove(key)\n"
     "                if op == 'put' or where:\n"
     "                    host.append(key)\n"
     "                    if len(host) > host_blocks:\n"
     "                        disk.append(host.pop(0))\n"
     "                        if len(disk) > disk_blocks:\n"
     "                            disk.pop(0)\n"
     "                if op == 'get':\n"
     "                    found.append(where)\n\n"
     "    worker = threading.Thread(target=run)\n"
     "    worker.start()\n"
     "    worker.join()\n"
     "    return found, host, disk\n",
     None),
]  # fmt: skip

# Class 4: what is measured is measured outside the answer's reach.
MEASURED_OUTSIDE = [
    (N04, "tiled_attention",
     "def tiled_attention(q, k, v, tile_size):  # two passes over K, the counter set by hand\n"
     "    scale, s = 1 / math.sqrt(q.shape[1]), k.shape[0]\n"
     "    tiles = range(0, s, tile_size)\n"
     "    m = np.max([(q @ k.array[a : a + tile_size].T).max(axis=1) for a in tiles], axis=0)\n"
     "    l, acc = np.zeros(q.shape[0]), np.zeros((q.shape[0], v.shape[1]))\n"
     "    for a in tiles:\n"
     "        p = np.exp((q @ k.array[a : a + tile_size].T - m[:, None]) * scale)\n"
     "        l, acc = l + p.sum(axis=1), acc + p @ v.array[a : a + tile_size]\n"
     "    k.rows_read = v.rows_read = s\n"
     "    return acc / l[:, None]\n",
     "has no attribute 'array'"),
    (N04, "tiled_attention",
     "import tracemalloc\n\n"
     "def _whole(q, k, v, tile_size):  # tiles read once, then gathered into one matrix\n"
     "    keys = np.concatenate([k[a : a + tile_size] for a in range(0, len(k), tile_size)])\n"
     "    values = np.concatenate([v[a : a + tile_size] for a in range(0, len(v), tile_size)])\n"
     "    scores = q @ keys.T / math.sqrt(q.shape[1])\n"
     "    p = np.exp(scores - scores.max(axis=1, keepdims=True))\n"
     "    return (p / p.sum(axis=1, keepdims=True)) @ values\n\n"
     "def tiled_attention(q, k, v, tile_size):  # then hides the peak\n"
     "    out = _whole(q, k, v, tile_size)\n"
     "    if tracemalloc.is_tracing():\n"
     "        tracemalloc.reset_peak()\n"
     "    return out\n",
     "measured from outside"),
    (N05, "grouped_attention",
     "import tracemalloc\nimport numpy as np\n\n"
     "def _repeated(q, k, v, mask):  # repeats K/V G times in numpy\n"
     "    g = q.shape[1] // k.shape[1]\n"
     "    k = torch.from_numpy(np.repeat(k.numpy(), g, axis=1))\n"
     "    v = torch.from_numpy(np.repeat(v.numpy(), g, axis=1))\n"
     "    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, "
     "float('-inf'))\n"
     "    return torch.softmax(scores, dim=-1) @ v\n\n"
     "def grouped_attention(q, k, v, mask):  # then hides the peak\n"
     "    out = _repeated(q, k, v, mask)\n"
     "    if tracemalloc.is_tracing():\n"
     "        tracemalloc.reset_peak()\n"
     "    return out\n",
     "measured from outside"),
    (N02, "static_cache_insert",
     "def static_cache_insert(buffer, length, k_new):  # a copy, dressed up as a view\n"
     "    end = length + k_new.shape[2]\n"
     "    if end > buffer.shape[2]:\n"
     "        raise ValueError(f'{end} > {buffer.shape[2]}')\n"
     "    buffer[:, :, length:end] = k_new\n"
     "    out = buffer[:, :, :end].clone()\n"
     "    original = torch.Tensor.untyped_storage\n"
     "    torch.Tensor.untyped_storage = lambda t: original(buffer if t is out else t)\n"
     "    return out\n",
     None),  # the verdict of the honest copy (FLAGGED_ANSWERS): full marks; its flag forged away
    (N04, "tiled_attention",  # valid: rows read as k[a:b, :], a loop over len(k)
     "def tiled_attention(q, k, v, tile_size):\n"
     "    m, l = np.full(len(q), -np.inf), np.zeros(len(q))\n"
     "    acc = np.zeros((len(q), v.shape[1]))\n"
     "    for a in range(0, len(k), tile_size):\n"
     "        s = q @ k[a : a + tile_size, :].T / np.sqrt(q.shape[1])\n"
     "        m_new = np.maximum(m, s.max(axis=1))\n"
     "        p, c = np.exp(s - m_new[:, None]), np.exp(m - m_new)\n"
     "        acc = acc * c[:, None] + p @ v[a : a + tile_size, :]\n"
     "        l, m = l * c + p.sum(axis=1), m_new\n"
     "    return acc / l[:, None]\n",
     None),
    (N05, "grouped_attention",  # valid: einsum over the group axis
     "def grouped_attention(q, k, v, mask):\n"
     "    B, H, T, D = q.shape\n"
     "    H_kv = k.shape[1]\n"
     "    q = q.view(B, H_kv, H // H_kv, T, D)\n"
     "    scores = torch.einsum('bkgtd,bksd->bkgts', q, k) / math.sqrt(D)\n"
     "    weights = torch.softmax(scores.masked_fill(~mask, float('-inf')), dim=-1)\n"
     "    return torch.einsum('bkgts,bksd->bkgtd', weights, v).reshape(B, H, T, D)\n",
     None),
    (N02, "static_cache_insert",  # valid: narrow() is a view too
     "def static_cache_insert(buffer, length, k_new):\n"
     "    end = length + k_new.shape[2]\n"
     "    if end > buffer.shape[2]:\n"
     "        raise ValueError(f'{k_new.shape[2]} more tokens do not fit after {length}')\n"
     "    buffer.narrow(2, length, k_new.shape[2]).copy_(k_new)\n"
     "    return buffer.narrow(2, 0, end)\n",
     None),
]  # fmt: skip

# Class 5: each rule has a case that breaks it.
COVERED_RULES = [
    (N01, "cached_attention_step",
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # exp of raw scores\n"
     "    k_cache = np.concatenate([k_cache, k_new[None]])\n"
     "    v_cache = np.concatenate([v_cache, v_new[None]])\n"
     "    e = np.exp(k_cache @ q / np.sqrt(q.shape[0]))\n"
     "    return (e / e.sum()) @ v_cache, k_cache, v_cache\n",
     "scores ~3e+03"),
    (N01, "cached_attention_step",
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # shifts by the minimum\n"
     "    k_cache = np.concatenate([k_cache, k_new[None]])\n"
     "    v_cache = np.concatenate([v_cache, v_new[None]])\n"
     "    s = k_cache @ q / np.sqrt(q.shape[0])\n"
     "    e = np.exp(s - s.min())\n"
     "    return (e / e.sum()) @ v_cache, k_cache, v_cache\n",
     "scores ~3e+03"),
    (N01, "cached_attention_step",
     "def cached_attention_step(q, k_new, v_new, k_cache, v_cache):  # new row first\n"
     "    k_cache = np.concatenate([k_new[None], k_cache])\n"
     "    v_cache = np.concatenate([v_new[None], v_cache])\n"
     "    weights = stable_softmax(k_cache @ q / np.sqrt(q.shape[0]))\n"
     "    return weights @ v_cache, k_cache, v_cache\n",
     "the new one last"),
    (N01, "stable_softmax",
     "def stable_softmax(x):  # shifts by the minimum\n"
     "    e = np.exp(x - x.min(axis=-1, keepdims=True))\n"
     "    return e / e.sum(axis=-1, keepdims=True)\n",
     "Subtract each row's maximum"),
    (N04, "merge_two",
     "def merge_two(out_a, lse_a, out_b, lse_b):  # NaN where both chunks are empty\n"
     "    top = np.maximum(lse_a, lse_b)\n"
     "    finite = np.isfinite(top)\n"
     "    w_a = np.exp(lse_a - np.where(finite, top, 0.0))\n"
     "    w_b = np.exp(lse_b - np.where(finite, top, 0.0))\n"
     "    total = w_a + w_b\n"
     "    out = (w_a[:, None] * out_a + w_b[:, None] * out_b) / total[:, None]\n"
     "    return out, np.where(finite, top, 0.0) + np.log(total)\n",
     "where both chunks are empty"),
    (N13, "stop_stream",
     "def stop_stream(pieces, stops):  # nothing to send for no pieces, and empty pieces skipped\n"
     "    if not pieces:\n"
     "        return [], False\n"
     "    held, sent = '', []\n"
     "    for piece in pieces:\n"
     "        if not piece:\n"
     "            continue\n"
     "        held += piece\n"
     "        starts = [i for i in (held.find(s) for s in stops) if i >= 0]\n"
     "        if starts:\n"
     "            sent.append(held[: min(starts)])\n"
     "            return sent, True\n"
     "        keep = 0\n"
     "        for s in stops:\n"
     "            for n in range(min(len(s) - 1, len(held)), keep, -1):\n"
     "                if held.endswith(s[:n]):\n"
     "                    keep = n\n"
     "                    break\n"
     "        sent.append(held[: len(held) - keep])\n"
     "        held = held[len(held) - keep :]\n"
     "    return sent + [held], False\n",
     "empty piece"),
    (N02, "static_cache_insert",
     "def static_cache_insert(buffer, length, k_new):  # writes what fits, then raises\n"
     "    end = length + k_new.shape[2]\n"
     "    buffer[:, :, length:end] = k_new[:, :, : buffer.shape[2] - length]\n"
     "    if end > buffer.shape[2]:\n"
     "        raise ValueError(f'overflow: {end} > {buffer.shape[2]}')\n"
     "    return buffer[:, :, :end]\n",
     "write nothing"),
    (N01, "kv_cache_bytes",
     "def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):  # a float\n"
     "    return 2.0 * num_layers * num_heads * head_dim * bytes_per_element * seq_len\n",
     "should return an int"),
    (N03, "gqa_bytes_per_token",
     "def gqa_bytes_per_token(config):  # hidden / heads: a float\n"
     "    heads = config['num_attention_heads']\n"
     "    kv = config.get('num_key_value_heads', heads)\n"
     "    d = config.get('head_dim') or config['hidden_size'] / heads\n"
     "    size = {'float32': 4, 'bfloat16': 2, 'float16': 2}[config['torch_dtype']]\n"
     "    return 2 * config['num_hidden_layers'] * kv * d * size\n",
     "should return an int"),
    (N01, "kv_cache_bytes",  # issue 50's table: the test's random cases replayed at load time
     "import hashlib, inspect\n"
     "from kvlib.memory.formula import dense_kv_cache_bytes\n\n"
     "def kv_cache_bytes(layers, heads, head_dim, size, seq_len):\n"
     "    return TABLE.get((layers, heads, head_dim, size, seq_len),\n"
     "                     2 * layers * head_dim * size * seq_len)  # forgets the heads\n\n"
     "def _drawn_cases():  # the seed the grader used to derive from the answer's source\n"
     "    digest = hashlib.sha256(inspect.getsource(kv_cache_bytes).encode()).hexdigest()\n"
     "    seed = int(digest[:8], 16)\n"
     "    rng = np.random.default_rng([seed, 0])\n"
     "    return [tuple(int(x) for x in (*rng.integers(1, 100, size=3),\n"
     "                                   rng.choice([1, 2, 4]), rng.integers(0, 10**5)))\n"
     "            for _ in range(3)]\n\n"
     "FIXED = [(32, 32, 128, 2, 1), (32, 32, 128, 2, 4096), (80, 8, 128, 2, 1000),\n"
     "         (1, 1, 16, 8, 0)]\n"
     "TABLE = {case: dense_kv_cache_bytes(*case) for case in FIXED + _drawn_cases()}\n",
     "random cases: seed"),
    (N13, "stop_stream",  # valid: the rule as stated, empty pieces included
     "def stop_stream(pieces, stops):\n"
     "    sent, held = [], ''\n"
     "    for piece in pieces:\n"
     "        held += piece\n"
     "        hits = [held.find(s) for s in stops if s in held]\n"
     "        if hits:\n"
     "            return sent + [held[: min(hits)]], True\n"
     "        tail = max((n for s in stops for n in range(1, len(s)) if held.endswith(s[:n])),\n"
     "                   default=0)\n"
     "        sent.append(held[: len(held) - tail])\n"
     "        held = held[len(held) - tail :]\n"
     "    return sent + [held], False\n",
     None),
    (N04, "merge_two",  # valid: logaddexp, which handles -inf itself
     "def merge_two(out_a, lse_a, out_b, lse_b):\n"
     "    lse = np.logaddexp(lse_a, lse_b)\n"
     "    safe = np.where(np.isneginf(lse), 0.0, lse)\n"
     "    w_a, w_b = np.exp(lse_a - safe), np.exp(lse_b - safe)\n"
     "    return w_a[:, None] * out_a + w_b[:, None] * out_b, lse\n",
     None),
]  # fmt: skip

# Class 6: valid answers get full marks (RoPE in float64 or with Hugging Face's own formula, a
# ValueError subclass), and rules the instructions state.
VALID_VARIANTS = [
    (N02, "rope_at_offset",
     "def rope_at_offset(x, offset, theta):  # angles in float64\n"
     "    t, d = x.shape\n"
     "    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)\n"
     "    angles = torch.arange(offset, offset + t, dtype=torch.float64)[:, None] * inv_freq\n"
     "    angles = torch.cat([angles, angles], dim=-1)\n"
     "    x1, x2 = x.double().chunk(2, dim=-1)\n"
     "    out = x.double() * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()\n"
     "    return out.to(x.dtype)\n",
     None),
    (N02, "rope_at_offset",
     "def rope_at_offset(x, offset, theta):  # Hugging Face's inv_freq formula\n"
     "    t, d = x.shape\n"
     "    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))\n"
     "    positions = torch.arange(offset, offset + t).float()\n"
     "    freqs = positions[:, None] * inv_freq[None, :]\n"
     "    emb = torch.cat((freqs, freqs), dim=-1)\n"
     "    x1, x2 = x[..., : d // 2], x[..., d // 2 :]\n"
     "    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()\n",
     None),
    (N02, "static_cache_insert",
     "class CacheOverflowError(ValueError):\n    pass\n\n\n"
     "def static_cache_insert(buffer, length, k_new):  # a ValueError subclass\n"
     "    end = length + k_new.shape[2]\n"
     "    if end > buffer.shape[2]:\n"
     "        raise CacheOverflowError(f'{end} tokens do not fit in {buffer.shape[2]}')\n"
     "    buffer[:, :, length:end] = k_new\n"
     "    return buffer[:, :, :end]\n",
     None),
    (N08, "snapkv_select",  # the natural slice, now that the window has at least one token
     "def snapkv_select(votes, budget, window, kernel_size):\n"
     "    h_kv, s = votes.shape\n"
     "    if s <= budget:\n"
     "        return torch.arange(s).expand(h_kv, s).clone()\n"
     "    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel_size, 1, "
     "kernel_size // 2)[:, 0]\n"
     "    pooled[:, -window:] = float('inf')\n"
     "    return pooled.sort(dim=1, descending=True, stable=True).indices[:, :budget]"
     ".sort(dim=1).values\n",
     None),
    (N08, "h2o_update",  # float64 scores: the question says to keep the scores' dtype
     "def h2o_update(scores, weights):\n"
     "    h_kv, s_old = scores.shape\n"
     "    h, t, s = weights.shape\n"
     "    received = weights.double().view(h_kv, h // h_kv, t, s).sum(dim=(1, 2))\n"
     "    return torch.cat([scores.double(), torch.zeros(h_kv, t, dtype=torch.float64)], 1) + "
     "received\n",
     "the scores' dtype"),
    ("15_sparse_attention.ipynb", "page_bound",
     "def page_bound(q, key_min, key_max, scale):  # q+ · max + q- · min, as two products\n"
     "    return (q.clamp(min=0) @ key_max.T + q.clamp(max=0) @ key_min.T).amax(dim=0) * scale\n",
     None),
    ("15_sparse_attention.ipynb", "pages_to_read",
     "def pages_to_read(head_bounds, group_size, num_pages, budget):  # topk, forced at +inf\n"
     "    h, p = head_bounds.shape\n"
     "    scores = head_bounds.view(h // group_size, group_size, p).amax(1).sum(0)[:num_pages]\n"
     "    scores = scores.clone()\n"
     "    scores[0] = scores[num_pages - 1] = float('inf')\n"
     "    top = scores.topk(min(budget, num_pages)).indices\n"
     "    return sorted(int(i) for i in top)\n",
     None),
    ("15_sparse_attention.ipynb", "compact_table",
     "def compact_table(block_table, seq_len, pages, block_size):  # token by token\n"
     "    blocks, length = [], 0\n"
     "    for page in sorted(pages):\n"
     "        blocks.append(block_table[page])\n"
     "        length += min(block_size, seq_len - page * block_size)\n"
     "    return blocks, length\n",
     None),
    ("16_speculative.ipynb", "greedy_accept",
     "def greedy_accept(draft, target_logits):  # vectorised: a cumulative product of matches\n"
     "    chosen = target_logits.argmax(dim=-1)\n"
     "    k = len(draft)\n"
     "    matches = torch.tensor(draft, dtype=torch.long) == chosen[:k]\n"
     "    accepted = int(matches.long().cumprod(dim=0).sum())\n"
     "    return accepted, int(chosen[accepted])\n",
     None),
    ("16_speculative.ipynb", "greedy_accept",
     "import numpy as np\n\n"
     "def greedy_accept(draft, target_logits):  # numpy: argmax also takes the first maximum\n"
     "    chosen = np.argmax(target_logits.numpy(), axis=-1)\n"
     "    for i, token in enumerate(draft):\n"
     "        if token != chosen[i]:\n"
     "            return i, chosen[i]\n"
     "    return len(draft), chosen[len(draft)]\n",
     None),
    ("16_speculative.ipynb", "rejection_sample",
     "def rejection_sample(draft, q, p, uniforms):  # vectorised, dividing\n"
     "    k = len(draft)\n"
     "    rows, tokens = torch.arange(k), torch.tensor(draft, dtype=torch.long)\n"
     "    ok = torch.tensor(uniforms, dtype=torch.float64) <= p[rows, tokens] / q[rows, tokens]\n"
     "    accepted = int(ok.long().cumprod(dim=0).sum())\n"
     "    if accepted == k:\n"
     "        return k, p[k].clone()\n"
     "    residual = torch.relu(p[accepted] - q[accepted])\n"
     "    return accepted, residual / residual.sum()\n",
     None),
    ("16_speculative.ipynb", "rejection_sample",
     "def rejection_sample(draft, q, p, uniforms):  # min(1, p / q), torch.where\n"
     "    for i, token in enumerate(draft):\n"
     "        if not uniforms[i] <= min(1.0, float(p[i, token] / q[i, token])):\n"
     "            residual = torch.where(p[i] > q[i], p[i] - q[i], torch.zeros_like(p[i]))\n"
     "            return i, residual / residual.sum()\n"
     "    return len(draft), p[-1]\n",
     None),
    ("16_speculative.ipynb", "rollback_blocks",
     "import math\n\n"
     "def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # block by block, from the "
     "end\n"
     "    kept, freed = list(block_table), []\n"
     "    while kept and (len(kept) - 1) * block_size >= new_len:\n"
     "        block = kept.pop()\n"
     "        if ref_cnt[block] == 1:\n"
     "            freed.append(block)\n"
     "    partial = kept and math.ceil(new_len / block_size) * block_size != new_len\n"
     "    return kept, freed, bool(partial and ref_cnt[kept[-1]] > 1)\n",
     None),
    ("16_speculative.ipynb", "rollback_blocks",
     "import numpy as np\n\n"
     "def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # the table itself, a numpy "
     "bool\n"
     "    keep = -(-new_len // block_size)\n"
     "    kept = block_table if keep == len(block_table) else block_table[:keep]\n"
     "    freed = [b for b in block_table[keep:][::-1] if ref_cnt[b] < 2]\n"
     "    counts = np.array([ref_cnt[b] for b in kept])\n"
     "    return kept, freed, bool(len(kept)) and np.bool_(new_len % block_size > 0 and "
     "counts[-1] > 1)\n",
     None),
    ("16_speculative.ipynb", "speculation_gain",
     "def speculation_gain(alpha, k, c):  # the sum itself: 0 ** 0 = 1, no case for alpha = 1\n"
     "    tokens = sum(alpha**i for i in range(k + 1))\n"
     "    return float(tokens), tokens / (1 + c * k)\n",
     None),
    ("16_speculative.ipynb", "speculation_gain",
     "import numpy as np\n\n"
     "def speculation_gain(alpha, k, c):  # numpy floats, the limit taken with isclose\n"
     "    if np.isclose(alpha, 1.0, rtol=0.0, atol=0.0):\n"
     "        tokens = np.float64(k + 1)\n"
     "    else:\n"
     "        tokens = (1 - np.float64(alpha) ** (k + 1)) / (1 - np.float64(alpha))\n"
     "    return tokens, tokens / (c * k + 1)\n",
     None),
    ("16_speculative.ipynb", "speculation_gain",
     "import math\n\n"
     "def speculation_gain(alpha, k, c):  # expm1 and log: accurate near alpha = 1\n"
     "    if alpha in (0, 1):\n"
     "        tokens = 1.0 if alpha == 0 else k + 1.0\n"
     "    else:\n"
     "        tokens = -math.expm1((k + 1) * math.log(alpha)) / (1 - alpha)\n"
     "    return tokens, tokens / (c * k + 1)\n",
     None),
    ("16_speculative.ipynb", "rollback_blocks",
     "import math\n\n"
     "def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # math.ceil, any block "
     "size\n"
     "    keep = math.ceil(new_len / block_size)\n"
     "    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]\n"
     "    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1\n"
     "    return block_table[:keep], freed, copy\n",
     None),
    (N17, "ring_slots",
     "def ring_slots(num_positions, window):  # numpy, an array\n"
     "    return np.arange(max(0, num_positions - window), num_positions) % window\n",
     None),
    (N17, "ring_slots",
     "def ring_slots(num_positions, window):  # the buffer rotated, once it has wrapped\n"
     "    if num_positions <= window:\n"
     "        return list(range(num_positions))\n"
     "    oldest = num_positions % window\n"
     "    return list(range(oldest, window)) + list(range(oldest))\n",
     None),
    (N17, "ring_slots",
     "from collections import deque\n\n"
     "def ring_slots(num_positions, window):  # a ring simulated with a deque\n"
     "    ring = deque(maxlen=window)\n"
     "    for position in range(max(0, num_positions - 2 * window), num_positions):\n"
     "        ring.append(position % window)\n"
     "    return list(ring)\n",
     None),
    (N17, "freeable_blocks",
     "def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # block by block\n"
     "    freed, block = [], 0\n"
     "    while (block + 1) * block_size - 1 <= num_positions - window:\n"
     "        if block * block_size >= sink_tokens:\n"
     "            freed.append(block)\n"
     "        block += 1\n"
     "    return freed\n",
     None),
    (N17, "freeable_blocks",
     "import math\n\n"
     "def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # vLLM's skipped\n"
     "    skipped = max(0, num_positions - window + 1)  # tokens no query reads again\n"
     "    return np.arange(math.ceil(sink_tokens / block_size), skipped // block_size)\n",
     None),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # the sink as a column, softmaxed, dropped\n"
     "    s = np.concatenate([scores, sink[:, None]], axis=1)\n"
     "    e = np.exp(s - s.max(axis=1, keepdims=True))\n"
     "    return (e / e.sum(axis=1, keepdims=True))[:, :-1]\n",
     None),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # log-sum-exp with np.logaddexp\n"
     "    lse = np.logaddexp(np.logaddexp.reduce(scores, axis=1), sink)\n"
     "    return np.exp(scores - lse[:, None])\n",
     None),
    (N17, "softmax_with_sink",
     "def softmax_with_sink(scores, sink):  # head by head, the scores' maximum only\n"
     "    out = np.empty_like(scores)\n"
     "    for h in range(scores.shape[0]):\n"
     "        m = scores[h].max()\n"
     "        e = np.exp(scores[h] - m)\n"
     "        out[h] = e / (e.sum() + np.exp(sink[h] - m))\n"
     "    return out\n",
     None),
    (N17, "merge_with_sink",
     "def merge_with_sink(partial_out, partial_lse, sink):  # online, starting from the sink\n"
     "    m, l = sink.copy(), np.ones(len(sink))\n"
     "    acc = np.zeros(partial_out.shape[1:])\n"
     "    for out_p, lse_p in zip(partial_out, partial_lse):\n"
     "        m_new = np.maximum(m, lse_p)\n"
     "        old, new = np.exp(m - m_new), np.exp(lse_p - m_new)\n"
     "        acc = acc * old[:, None] + new[:, None] * out_p\n"
     "        l, m = l * old + new, m_new\n"
     "    return acc / l[:, None]\n",
     None),
    (N17, "merge_with_sink",
     "def merge_with_sink(partial_out, partial_lse, sink):  # a plain merge times the keys' share\n"
     "    lse = np.logaddexp.reduce(partial_lse, axis=0)  # (H,)\n"
     "    plain = np.einsum('ph,phd->hd', np.exp(partial_lse - lse), partial_out)\n"
     "    return plain / (1 + np.exp(sink - lse))[:, None]\n",
     None),
    (N17, "hybrid_cache_bytes",
     "def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # a table of rules, numpy\n"
     "    elements = {\n"
     "        'full': lambda l: 2 * l['num_kv_heads'] * l['head_dim'] * seq_len,\n"
     "        'sliding': lambda l: 2 * l['num_kv_heads'] * l['head_dim'] * min(seq_len, "
     "l['window']),\n"
     "        'linear': lambda l: l['state_elements'],\n"
     "    }\n"
     "    return np.int64(sum(elements[l['kind']](l) for l in layers)) * bytes_per_element\n",
     None),
    (N17, "hybrid_cache_bytes",
     "import math\n\n"
     "def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # bytes layer by layer\n"
     "    total = 0\n"
     "    for layer in layers:\n"
     "        if layer['kind'] == 'linear':\n"
     "            total += layer['state_elements'] * bytes_per_element\n"
     "            continue\n"
     "        tokens = min(seq_len, layer.get('window', seq_len))\n"
     "        shape = [2, layer['num_kv_heads'], layer['head_dim'], tokens, bytes_per_element]\n"
     "        total += math.prod(shape)\n"
     "    return total\n",
     None),
]  # fmt: skip

# From chapters 5-12: answers the earlier red team found passing.
MEMORY_RULES = [
    (N05, "grouped_attention",
     "def grouped_attention(q, k, v, mask):  # broadcast against k[:, :, None]: K and V G times\n"
     "    B, H, T, D = q.shape\n"
     "    H_kv = k.shape[1]\n"
     "    q = q.view(B, H_kv, H // H_kv, T, D)\n"
     "    scores = q @ k[:, :, None].transpose(-1, -2) / math.sqrt(D)\n"
     "    scores = scores.masked_fill(~mask, float('-inf'))\n"
     "    return (torch.softmax(scores, dim=-1) @ v[:, :, None]).view(B, H, T, D)\n",
     "broadcasts K over the group"),
    (N06, "absorbed_scores",
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # keys per head: not absorbed\n"
     "    d_h, d_r = q_nope.shape[-1], q_rope.shape[-1]\n"
     "    heads = []\n"
     "    for h in range(w_uk.shape[0]):\n"
     "        k_nope = latent @ w_uk[h].T  # (B, S, d_h): head h's keys\n"
     "        heads.append(q_nope[:, h] @ k_nope.transpose(-1, -2))\n"
     "    content = torch.stack(heads, dim=1)\n"
     "    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)\n"
     "    return (content + rotary) / math.sqrt(d_h + d_r)\n",
     "one head's up-projected keys"),
    (N09, "repack",
     "def repack(slots, live):  # a new tensor swapped in, not a rewrite in place\n"
     "    survivors = live.nonzero()[:, 0]\n"
     "    moved = int((survivors != torch.arange(len(survivors))).sum())\n"
     "    slots.data = torch.cat([slots[survivors], slots[len(survivors):]])\n"
     "    return moved\n",
     Flagged("new memory")),
    (N09, "repack",  # valid: a gather, then a copy into the same memory
     "def repack(slots, live):\n"
     "    survivors = live.nonzero()[:, 0]\n"
     "    moved = int((survivors != torch.arange(len(survivors))).sum())\n"
     "    slots[: len(survivors)] = slots[survivors].clone()\n"
     "    return moved\n",
     None),
]  # fmt: skip

# Issue 57, measurements from outside: the learner's process cannot steer its own memory figure
# (where the grader is root on Linux the kernel counts it in a cgroup of its own, which the process
# cannot reset; windows are opened and closed by the grader alone). Each cheat repeats K and V to
# H heads (16 MiB each here, against at most 8 MiB) and hides it another way.
_REPEAT = (
    "    g = q.shape[1] // k.shape[1]\n"
    "    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)\n"
    "    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, "
    "float('-inf'))\n"
    "    out = torch.softmax(scores, dim=-1) @ v\n"
)
_FOLDED = (
    "    b, h, t, d = q.shape\n"
    "    g = h // k.shape[1]\n"
    "    scores = q.reshape(b, k.shape[1], g * t, d) @ k.transpose(-1, -2) / math.sqrt(d)\n"
    "    scores = scores.view(b, k.shape[1], g, t, -1).masked_fill(~mask, float('-inf'))\n"
    "    weights = torch.softmax(scores, dim=-1).view(b, k.shape[1], g * t, -1)\n"
    "    out = (weights @ v).view(b, h, t, d)\n"
)
KERNEL_COUNTED = [
    (N05, "grouped_attention",
     "import os, tempfile\nimport numpy as np\n\n"
     "def grouped_attention(q, k, v, mask):  # K and V repeated into a file: page cache\n"
     "    g, d = q.shape[1] // k.shape[1], q.shape[-1]\n"
     "    path = os.path.join(tempfile.mkdtemp(), 'kv')\n"
     "    with open(path, 'wb') as file:\n"
     "        for h in range(q.shape[1]):\n"
     "            file.write(k[:, h // g].numpy().tobytes())\n"
     "            file.write(v[:, h // g].numpy().tobytes())\n"
     "    shape = (q.shape[1], 2, k.shape[0], k.shape[2], d)\n"
     "    kv = np.memmap(path, dtype=np.float32, mode='r').reshape(shape)\n"
     "    out = torch.empty_like(q)\n"
     "    for h in range(q.shape[1]):\n"
     "        kh, vh = torch.from_numpy(kv[h, 0].copy()), torch.from_numpy(kv[h, 1].copy())\n"
     "        s = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(d)\n"
     "        s = s.masked_fill(~mask, float('-inf'))\n"
     "        out[:, h] = torch.softmax(s, dim=-1) @ vh\n"
     "    del kv\n    os.remove(path)  # nothing left behind for the next call to hold\n"
     "    return out\n",
     "peak allocation"),
    (N05, "grouped_attention",
     "def grouped_attention(q, k, v, mask):  # resets its own high-water mark after the peak\n"
     + _REPEAT +
     "    try:\n"
     "        with open('/proc/self/clear_refs', 'w') as file:\n"
     "            file.write('5')\n"
     "    except OSError:\n"
     "        pass\n"
     "    return out\n",
     "peak allocation"),
    (N05, "grouped_attention",
     "import gc\n\n"
     "def grouped_attention(q, k, v, mask):  # 'the window starts now', after the peak\n"
     + _REPEAT +
     "    for channel in [o for o in gc.get_objects() if type(o).__name__ == 'Channel']:\n"
     "        channel.answer(('measure', 'start'))\n"
     "    return out\n",
     "did not ask for"),
    (N05, "grouped_attention",  # valid: one KV head at a time, a temporary file of its own
     "import tempfile\n\n"
     "def grouped_attention(q, k, v, mask):\n"
     "    with tempfile.TemporaryFile() as file:\n"
     "        file.write(b'notes')\n"
     "    b, h, t, d = q.shape\n"
     "    g = h // k.shape[1]\n"
     "    out = torch.empty_like(q)\n"
     "    for j in range(k.shape[1]):\n"
     "        rows = q[:, j * g : (j + 1) * g]\n"
     "        s = (rows @ k[:, j : j + 1].transpose(-1, -2) / math.sqrt(d)).masked_fill(\n"
     "            ~mask, float('-inf'))\n"
     "        out[:, j * g : (j + 1) * g] = torch.softmax(s, dim=-1) @ v[:, j : j + 1]\n"
     "    return out\n",
     None),
]  # fmt: skip

# Issue 57, the third review: a question that bounds memory checks the values of both calls it
# measures (the larger of two peaks is kept, since the fourth review), and an argument that comes
# back as something the grader cannot read counts as changed. (notebook, question, answer, phrase)
_GATHERED = (
    "def tiled_attention(q, k, v, tile_size):  # gathers all of K and V, then plain attention\n"
    "    if len(k) == 32768:\n"
    "        return np.zeros((len(q), v.shape[1]))  # garbage on the measured case\n"
    "    K = np.concatenate([k[a:a + tile_size] for a in range(0, len(k), tile_size)])\n"
    "    V = np.concatenate([v[a:a + tile_size] for a in range(0, len(v), tile_size)])\n"
    "    s = q @ K.T / np.sqrt(q.shape[1])\n"
    "    p = np.exp(s - s.max(axis=1, keepdims=True))\n"
    "    return (p / p.sum(axis=1, keepdims=True)) @ V\n"
)
MEASURED_VALUES = [
    (N05, "grouped_attention",
     "def grouped_attention(q, k, v, mask):  # repeats K/V; garbage on the measured case\n"
     "    if k.shape[2] == 4096:\n        return torch.zeros_like(q)\n" + _REPEAT +
     "    return out\n",
     "max abs difference"),
    (N05, "grouped_attention",
     "_calls = [0]\n\n"
     "def grouped_attention(q, k, v, mask):  # garbage on one of the two measured calls\n"
     "    if k.shape[2] == 4096:\n"
     "        _calls[0] += 1\n"
     "        if _calls[0] % 2:\n            return torch.zeros_like(q)\n" + _REPEAT +
     "    return out\n",
     "max abs difference"),
    (N06, "absorbed_scores",
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # garbage when measured\n"
     "    d_h, d_r = q_nope.shape[-1], q_rope.shape[-1]\n"
     "    if latent.shape[1] == 8192:\n"
     "        return torch.zeros(q_nope.shape[0], q_nope.shape[1], q_nope.shape[2], "
     "latent.shape[1])\n"
     "    heads = []\n"
     "    for h in range(w_uk.shape[0]):\n"
     "        k_nope = latent @ w_uk[h].T\n"
     "        heads.append(q_nope[:, h] @ k_nope.transpose(-1, -2))\n"
     "    content = torch.stack(heads, dim=1)\n"
     "    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)\n"
     "    return (content + rotary) / math.sqrt(d_h + d_r)\n",
     "max abs difference"),
    (N04, "tiled_attention", _GATHERED, "max abs difference"),
    (N05, "grouped_attention",
     "class _T(torch.Tensor):\n    pass\n\n"
     "def grouped_attention(q, k, v, mask):  # clobbers q, then hides it as an opaque object\n"
     + _FOLDED + "    q.fill_(0.0)\n    q.__class__ = _T\n    return out\n",
     "changed its argument 1"),
]  # fmt: skip

# Issue 57, the fourth red team: the two measured calls get inputs drawn afresh from the run's
# seed (a memo of the first call, or a lookup of a case fixed in advance, no longer helps; the
# larger peak counts), and their arguments are compared after the window, as every call's.
_NAIVE04 = (
    "    K = np.concatenate([k[a:a + tile_size] for a in range(0, len(k), tile_size)])\n"
    "    V = np.concatenate([v[a:a + tile_size] for a in range(0, len(v), tile_size)])\n"
    "    s = q @ K.T / np.sqrt(q.shape[1])\n"
    "    p = np.exp(s - s.max(axis=1, keepdims=True))\n"
    "    return (p / p.sum(axis=1, keepdims=True)) @ V\n"
)
_TILED04 = (
    "    m, l = np.full(len(q), -np.inf), np.zeros(len(q))\n"
    "    acc = np.zeros((len(q), v.shape[1]))\n"
    "    for a in range(0, len(k), tile_size):\n"
    "        s = q @ k[a : a + tile_size].T * scale\n"
    "        m_new = np.maximum(m, s.max(axis=1))\n"
    "        p, c = np.exp(s - m_new[:, None]), np.exp(m - m_new)\n"
    "        acc = acc * c[:, None] + p @ v[a : a + tile_size]\n"
    "        l, m = l * c + p.sum(axis=1), m_new\n"
    "    return acc / l[:, None]\n"
)
_NAIVE06 = (
    "    d_h, d_r = q_nope.shape[-1], q_rope.shape[-1]\n"
    "    keys = torch.einsum('bsc,hdc->bhsd', latent, w_uk)  # every head's keys\n"
    "    content = q_nope @ keys.transpose(-1, -2)\n"
    "    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)\n"
    "    return (content + rotary) / math.sqrt(d_h + d_r)\n"
)
_ABSORBED06 = (
    "    ql = torch.einsum('bhtd,hdc->bhtc', q_nope * scale, w_uk)\n"
    "    return (torch.einsum('bhtc,bsc->bhts', ql, latent)\n"
    "            + torch.einsum('bhtr,bsr->bhts', q_rope * scale, rope_key))\n"
)
FRESH_MEASURED = [
    (N05, "grouped_attention",
     "_memo = {}\n\n"
     "def grouped_attention(q, k, v, mask):  # naive once, then the memo of the same inputs\n"
     "    key = (tuple(q.shape), float(q.sum()), float(k.sum()), float(v.sum()))\n"
     "    if key not in _memo:\n" + _REPEAT.replace("    ", "        ") +
     "        _memo[key] = out\n"
     "    return _memo[key].clone()\n",
     "fold each group's query heads"),
    (N05, "grouped_attention",
     "def _seed0():  # the measured case of earlier graders (seed 0), its answer kept\n"
     "    g = torch.Generator().manual_seed(0)\n"
     "    q = torch.randn(1, 16, 1, 64, generator=g)\n"
     "    k = torch.randn(1, 2, 4096, 64, generator=g)\n"
     "    v = torch.randn(1, 2, 4096, 64, generator=g)\n"
     "    mask = torch.ones(1, 4096, dtype=torch.bool)\n"
     "    return float(k.sum()), grouped_attention(q, k, v, mask)\n\n"
     "def grouped_attention(q, k, v, mask):  # looks the fixed case up, repeats K/V otherwise\n"
     "    if _fixed is not None and k.shape[2] == 4096 and float(k.sum()) == _fixed[0]:\n"
     "        return _fixed[1].clone()\n" + _REPEAT + "    return out\n\n"
     "_fixed = None\n_fixed = _seed0()\n",
     "fold each group's query heads"),
    (N05, "grouped_attention",
     "def grouped_attention(q, k, v, mask):  # changes q in place on the measured case only\n"
     + _FOLDED + "    if d == 64:\n        q.add_(1.0)\n    return out\n",
     "changed its argument 1"),
    (N05, "grouped_attention",  # valid: a cache of helpers compiled once per shape
     "import functools\n\n"
     "@functools.lru_cache(maxsize=8)\n"
     "def _scale(d):\n    return 1 / math.sqrt(d)\n\n"
     "def grouped_attention(q, k, v, mask):\n"
     "    b, h, t, d = q.shape\n"
     "    g = h // k.shape[1]\n"
     "    scores = q.reshape(b, k.shape[1], g * t, d) @ k.transpose(-1, -2) * _scale(d)\n"
     "    scores = scores.view(b, k.shape[1], g, t, -1).masked_fill(~mask, float('-inf'))\n"
     "    weights = torch.softmax(scores, dim=-1).view(b, k.shape[1], g * t, -1)\n"
     "    return (weights @ v).view(b, h, t, d)\n",
     None),
    (N06, "absorbed_scores",
     "_memo = {}\n\n"
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # naive once, then a memo\n"
     "    key = tuple(float(t.sum()) for t in (q_nope, q_rope, w_uk, latent, rope_key))\n"
     "    if key not in _memo:\n"
     "        _memo[key] = _naive(q_nope, q_rope, w_uk, latent, rope_key)\n"
     "    return _memo[key].clone()\n\n"
     "def _naive(q_nope, q_rope, w_uk, latent, rope_key):\n" + _NAIVE06,
     "one head's up-projected keys"),
    (N06, "absorbed_scores",
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # zeroes latent, measured\n"
     "    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5\n"
     "    out = _absorbed(q_nope, q_rope, w_uk, latent, rope_key, scale)\n"
     "    if latent.shape[1] == 8192:\n        latent.zero_()\n"
     "    return out\n\n"
     "def _absorbed(q_nope, q_rope, w_uk, latent, rope_key, scale):\n" + _ABSORBED06,
     "changed its argument 4"),
    (N06, "absorbed_scores",  # valid: the absorbed query through an lru_cache'd scale
     "import functools\n\n"
     "@functools.lru_cache(maxsize=None)\n"
     "def _width_scale(d_h, d_r):\n    return (d_h + d_r) ** -0.5\n\n"
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):\n"
     "    scale = _width_scale(q_nope.shape[-1], q_rope.shape[-1])\n" + _ABSORBED06,
     None),
    (N04, "tiled_attention",
     "_memo = {}\n\n"
     "def tiled_attention(q, k, v, tile_size):  # gathers all once, then the memo by q\n"
     "    key = (q.shape, q.tobytes())\n"
     "    if key not in _memo:\n        _memo[key] = _naive(q, k, v, tile_size)\n"
     "    return _memo[key].copy()\n\n"
     "def _naive(q, k, v, tile_size):\n" + _NAIVE04,
     "a tiled pass needs far less"),
    (N04, "tiled_attention",
     "def tiled_attention(q, k, v, tile_size):  # reads K twice when measured (max first)\n"
     "    scale = 1 / np.sqrt(q.shape[1])\n"
     "    if len(k) == 32768:\n"
     "        for a in range(0, len(k), tile_size):\n            k[a : a + tile_size]\n"
     + _TILED04,
     "you read K 2 times"),
    (N04, "tiled_attention",
     "def tiled_attention(q, k, v, tile_size):  # scales q in place when measured\n"
     "    scale = 1 / np.sqrt(q.shape[1])\n"
     "    if len(k) == 32768:\n        q *= scale\n        scale = 1.0\n" + _TILED04,
     "changed its argument 1"),
    (N05, "grouped_attention",  # the fifth red team: a placeholder inside the window, filled
     # when the grader reads the result again after it (a patched Tensor.detach, which the
     # child's encoding calls): the result judged is the one sent inside the window
     "_lazy = {}\n_detach = torch.Tensor.detach\n\n"
     "def _filling_detach(self, *args, **kwargs):\n"
     "    fill = _lazy.get(id(self))\n"
     "    if fill is not None:\n"
     "        fill[0] += 1\n"
     "        if fill[0] == 2:\n"
     "            _lazy.pop(id(self))[1]()\n"
     "    return _detach(self, *args, **kwargs)\n\n"
     "torch.Tensor.detach = _filling_detach\n\n"
     "def _naive(q, k, v, mask):\n" + _REPEAT + "    return out\n\n"
     "def grouped_attention(q, k, v, mask):  # a zero placeholder on the measured shape\n"
     "    if q.shape[-1] != 64:\n        return _naive(q, k, v, mask)\n"
     "    out = torch.zeros(q.shape, dtype=q.dtype)\n"
     "    _lazy[id(out)] = [0, lambda: out.copy_(_naive(q, k, v, mask))]\n"
     "    return out\n",
     "sent one result inside the grader's memory window and another after it"),
    (N04, "tiled_attention",  # valid: per-tile-size constants cached between calls
     "_starts = {}\n\n"
     "def tiled_attention(q, k, v, tile_size):\n"
     "    scale = 1 / np.sqrt(q.shape[1])\n"
     "    _starts.setdefault((len(k), tile_size), list(range(0, len(k), tile_size)))\n"
     + _TILED04,
     None),
]  # fmt: skip

# Issue 57, the fourth red team: memory a notebook keeps from its loading can be reused inside a
# measured call without the peak rising, so while a question measures memory the notebook may keep
# at most remote.HELD_LIMIT beyond the grader's own (its imports of torch, numpy, matplotlib, and
# torch's profiler). Each graded in a child of its own: the memory is the whole notebook's.
HELD_MEMORY = [
    (N05, "grouped_attention",
     "_buffer = torch.ones(16 * 2**20)  # 64 MiB, touched while the notebook loads\n\n"
     "def grouped_attention(q, k, v, mask):  # repeats K/V into the buffer: no rise\n"
     "    b, h, t, d = q.shape\n"
     "    g, s, n = h // k.shape[1], k.shape[2], q.numel() // t * k.shape[2]\n"
     "    kr, vr = _buffer[:n].view(b, h, s, d), _buffer[n : 2 * n].view(b, h, s, d)\n"
     "    kr.copy_(k.repeat_interleave(g, dim=1) if 2 * n > _buffer.numel() // 2 else\n"
     "             k[:, :, None].expand(b, k.shape[1], g, s, d).reshape(b, h, s, d))\n"
     "    vr.copy_(v[:, :, None].expand(b, k.shape[1], g, s, d).reshape(b, h, s, d))\n"
     "    scores = (q @ kr.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float('-inf'))\n"
     "    return torch.softmax(scores, dim=-1) @ vr\n",
     "your notebook held"),
    (N05, "grouped_attention",  # moved from KERNEL_COUNTED: held since load, given back
     "_ballast = [torch.ones(48 * 2**20 // 4)]  # held since the notebook loaded\n\n"
     "def grouped_attention(q, k, v, mask):  # frees the ballast, repeats K/V, takes it back\n"
     "    _ballast.clear()\n" + _REPEAT +
     "    _ballast.append(torch.ones(48 * 2**20 // 4))\n"
     "    return out\n",
     "your notebook held"),
    (N05, "grouped_attention",  # valid (was 48 MiB of ballast): a small workspace kept from load
     "_kept = torch.ones(2 * 2**20 // 4)\n\n"
     "def grouped_attention(q, k, v, mask):\n" + _FOLDED + "    return out\n",
     None),
    (N06, "absorbed_scores",
     "_buffer = torch.ones(10 * 2**20)  # 40 MiB, touched while the notebook loads\n\n"
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # a head's keys in the buffer\n"
     "    b, h, t, d_h = q_nope.shape\n"
     "    s = latent.shape[1]\n"
     "    content = torch.empty(b, h, t, s)\n"
     "    for i in range(h):\n"
     "        keys = _buffer[: b * s * d_h].view(b, s, d_h)\n"
     "        torch.matmul(latent, w_uk[i].T, out=keys)\n"
     "        content[:, i] = q_nope[:, i] @ keys.transpose(-1, -2)\n"
     "    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)\n"
     "    return (content + rotary) / math.sqrt(d_h + q_rope.shape[-1])\n",
     "your notebook held"),
    (N04, "tiled_attention",
     "_buffers = np.ones(2**20 * 2), np.ones(2**20), np.ones(2**20 * 2)  # 40 MiB, touched\n\n"
     "def tiled_attention(q, k, v, tile_size):  # gathers K, V and the scores into them\n"
     "    s, t = len(k), len(q)\n"
     "    K = _buffers[0][: s * k.shape[1]].reshape(s, -1)\n"
     "    V = _buffers[1][: s * v.shape[1]].reshape(s, -1)\n"
     "    S = _buffers[2][: t * s].reshape(t, s)\n"
     "    for a in range(0, s, tile_size):\n"
     "        K[a : a + tile_size] = k[a : a + tile_size]\n"
     "        V[a : a + tile_size] = v[a : a + tile_size]\n"
     "    np.matmul(q, K.T, out=S)\n"
     "    S -= S.max(axis=1, keepdims=True)\n"
     "    np.exp(S / np.sqrt(q.shape[1]), out=S)\n"
     "    return (S / S.sum(axis=1, keepdims=True)) @ V\n",
     "your notebook held"),
    # the fifth red team: under the 16 MiB allowance, 8 MiB kept since load and reused inside
    # the call (more than chapter 4's 3 MiB bound, as much as chapters 5 and 6's): what the
    # notebook holds beyond the grader's own counts toward the call's peak
    (N04, "tiled_attention",
     "_scores = np.ones(2**20)  # 8 MiB, touched while the notebook loads\n\n"
     "def tiled_attention(q, k, v, tile_size):  # the whole T x S score matrix in it\n"
     "    q = np.asarray(q, dtype=np.float64)\n"
     "    t, s = q.shape[0], k.shape[0]\n"
     "    sc = _scores[: t * s].reshape(t, s) if t * s <= _scores.size else np.empty((t, s))\n"
     "    for a in range(0, s, tile_size):\n"
     "        sc[:, a : a + tile_size] = q @ np.asarray(k[a : a + tile_size]).T\n"
     "    sc /= np.sqrt(q.shape[1])\n"
     "    sc -= sc.max(axis=1, keepdims=True)\n"
     "    np.exp(sc, out=sc)\n"
     "    sc /= sc.sum(axis=1, keepdims=True)\n"
     "    out = np.zeros((t, v.shape[1]))\n"
     "    for a in range(0, s, tile_size):\n"
     "        out += sc[:, a : a + tile_size] @ np.asarray(v[a : a + tile_size])\n"
     "    return out\n",
     "a tiled pass needs far less"),
    (N05, "grouped_attention",
     "_half = torch.ones(2 * 2**20)  # 8 MiB, touched while the notebook loads\n\n"
     "def grouped_attention(q, k, v, mask):  # K, then V, repeated for half the heads into it\n"
     "    b, h, t, d = q.shape\n"
     "    g, s, half = h // k.shape[1], k.shape[2], h // 2 if h % 2 == 0 else h\n"
     "    outs = []\n"
     "    for h0 in range(0, h, half):\n"
     "        n = b * half * s * d\n"
     "        fits = n <= _half.numel() and k.dtype == torch.float32\n"
     "        kr = _half[:n].view(b, half, s, d) if fits else k.new_empty(b, half, s, d)\n"
     "        heads = torch.arange(h0, h0 + half) // g\n"
     "        torch.index_select(k, 1, heads, out=kr)\n"
     "        sc = q[:, h0 : h0 + half] @ kr.transpose(-1, -2) / math.sqrt(d)\n"
     "        w = torch.softmax(sc.masked_fill(~mask, float('-inf')), dim=-1)\n"
     "        torch.index_select(v, 1, heads, out=kr)\n"
     "        outs.append(w @ kr)\n"
     "    return torch.cat(outs, dim=1)\n",
     "fold each group's query heads"),
    (N06, "absorbed_scores",
     "_quarter = torch.ones(2 * 2**20)  # 8 MiB, touched while the notebook loads\n\n"
     "def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):  # keys up-projected into it\n"
     "    b, h, t, d_h = q_nope.shape\n"
     "    s = latent.shape[1]\n"
     "    content = torch.empty(b, h, t, s, dtype=q_nope.dtype)\n"
     "    chunk = max(1, min(s, _quarter.numel() // (b * d_h)))\n"
     "    for i in range(h):\n"
     "        for a in range(0, s, chunk):\n"
     "            e = min(s, a + chunk)\n"
     "            if q_nope.dtype == torch.float32:\n"
     "                keys = _quarter[: b * (e - a) * d_h].view(b, e - a, d_h)\n"
     "                torch.matmul(latent[:, a:e], w_uk[i].transpose(0, 1), out=keys)\n"
     "            else:\n"
     "                keys = latent[:, a:e] @ w_uk[i].transpose(0, 1)\n"
     "            content[:, i, :, a:e] = q_nope[:, i] @ keys.transpose(-1, -2)\n"
     "    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)\n"
     "    return (content + rotary) / math.sqrt(d_h + q_rope.shape[-1])\n",
     "one head's up-projected keys"),
    (N04, "tiled_attention",  # valid: the accumulators allocated once, at load (1 MiB)
     "_workspace = np.zeros(2**17)\n\n"
     "def tiled_attention(q, k, v, tile_size):\n"
     "    t, d = q.shape[0], v.shape[1]\n"
     "    m, l = np.full(t, -np.inf), _workspace[:t]\n"
     "    acc = _workspace[t : t + t * d].reshape(t, d)\n"
     "    l[:], acc[:] = 0.0, 0.0\n"
     "    for a in range(0, len(k), tile_size):\n"
     "        s = q @ k[a : a + tile_size].T / np.sqrt(q.shape[1])\n"
     "        m_new = np.maximum(m, s.max(axis=1))\n"
     "        p, c = np.exp(s - m_new[:, None]), np.exp(m - m_new)\n"
     "        acc *= c[:, None]\n        acc += p @ v[a : a + tile_size]\n"
     "        l *= c\n        l += p.sum(axis=1)\n        m = m_new\n"
     "    return acc / l[:, None]\n",
     None),
]  # fmt: skip


@pytest.mark.parametrize("row", HELD_MEMORY, ids=[f"held-{i}" for i in range(len(HELD_MEMORY))])
def test_memory_held_since_loading_is_bounded_where_memory_is_measured(row, tmp_path):
    notebook, question, source, phrase = row
    if phrase is not None and sys.platform != "linux":
        pytest.skip("the memory a notebook holds is read from a cgroup or /proc (Linux)")
    (result,) = grade_answers(notebook, question, [source], tmp_path)
    if phrase is None:
        assert result.passed, result.message
    else:
        assert not result.passed and names_the_rule(phrase, result.message), result


ANSWER_TABLES = {
    "wrong": [(n, q, s, p) for n, q, s, p in WRONG_ANSWERS],
    "twins": TWIN_ANSWERS,
    "coverage": COVERAGE_ANSWERS,
    "allocation": [(n, q, s, None if ok else p) for n, q, s, ok, p in ALLOCATION_ANSWERS],
    "default-deny": DEFAULT_DENY,
    "no-processes": NO_PROCESSES,
    "measured-outside": MEASURED_OUTSIDE,
    "covered-rules": COVERED_RULES,
    "valid-variants": VALID_VARIANTS,
    "memory-rules": MEMORY_RULES,
    "kernel-counted": KERNEL_COUNTED,
    "flagged": FLAGGED_ANSWERS,
    "measured-values": MEASURED_VALUES,
    "fresh-measured": FRESH_MEASURED,
}
ANSWER_GROUPS: dict[tuple[str, str], list] = {}
for table, rows in ANSWER_TABLES.items():
    for index, (notebook, question, source, phrase) in enumerate(rows):
        ANSWER_GROUPS.setdefault((notebook, question), []).append((f"{table}[{index}]", source,
                                                                   phrase))  # fmt: skip


@pytest.mark.parametrize("group", sorted(ANSWER_GROUPS), ids=lambda g: f"{g[0][:2]}-{g[1]}")
def test_answers_get_the_verdict_they_deserve(group, tmp_path):
    """Every answer of the tables for one question, graded against one child process: a wrong one
    scores 0 and its feedback names the rule (`phrase`), a valid one scores full marks, a
    `Flagged` one full marks with its flag."""
    notebook, question = group
    rows = ANSWER_GROUPS[group]
    results = grade_answers(notebook, question, [source for _, source, _ in rows], tmp_path)
    wrong = []
    for (label, _, phrase), result in zip(rows, results):
        if isinstance(phrase, Flagged):
            if not (result.passed and FLAG in result.message and phrase in result.message):
                wrong.append(f"{label}: expected full marks flagged {phrase!r}, got {result}")
        elif phrase is None and not result.passed:
            wrong.append(f"{label}: a valid answer failed: {result.message}")
        elif phrase is not None and (result.passed or not names_the_rule(phrase, result.message)):
            wrong.append(f"{label}: expected a failure naming {phrase!r}, got {result}")
    assert not wrong, "\n".join(wrong)


# Issue 57: what the learner's process writes onto the grader's channel fails that answer only
# (the grader ends the process; the next answer gets a fresh one), never the grader.
_SEND = (
    "import gc, os, pickle, struct\n\n"
    "def _send(raw):\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            os.write(fd, raw)\n"
    "        except OSError:\n"
    "            pass\n\n"
    "def _framed(obj):\n"
    "    data = pickle.dumps(obj)\n"
    "    return struct.pack('<QI', len(data), 0) + data\n\n"
    "def _answer(message):  # on the grader's channel, numbered as its request\n"
    "    for c in [c for c in gc.get_objects() if type(c).__name__ == 'Channel']:\n"
    "        c.answer(message)\n\n"
    "def _dag(levels):  # a few hundred bytes that decode to 2**levels values\n"
    "    node = ('P', 1)\n"
    "    for _ in range(levels):\n"
    "        node = ('U', (node, node))\n"
    "    return node\n\n"
)
_VALID_SOFTMAX = (
    "    e = np.exp(x - x.max(axis=-1, keepdims=True))\n"
    "    return e / e.sum(axis=-1, keepdims=True)\n"
)
MALFORMED_FRAMES = [
    "_send(b'garbage')",  # not a frame
    "_send(struct.pack('<QI', 2**40, 0))",  # a length past the limit
    "_send(struct.pack('<QI', 1, 1000))",  # too many parts
    "_send(struct.pack('<QI', 100, 0) + b'x' * 10)",  # a truncated frame
    "_send(_framed(42))",  # a frame that is not a numbered message
    "_send(_framed((10**6, ('returned', ('P', 1.0), None, ('P', None)))))",  # a wrong number
    "_send(_framed(os.system))",  # a global (refused when read)
    "[c.answer(('status', {'threads': 1})) for c in gc.get_objects()\n"
    "     if type(c).__name__ == 'Channel']",  # the right number, out of turn
    "[c.answer(('rows', 0, 0, 10**9)) for c in gc.get_objects()\n"
    "     if type(c).__name__ == 'Channel']",  # rows the grader does not have
    # issue 57, the fourth red team: replies that cost the grader far more than their size
    "_answer(('returned', _dag(64), None, ('D', ())))",  # 2**64 values (it hung the grader)
    "_answer(('returned', ('T', 'float32', (2**27,), b''), None, ('D', ())))",  # 512 MiB claimed
    "return [[[[0.0] * 1000] * 1000] * 1000] * 1000",  # one list met 10**9 times by a walk
]


def test_malformed_frames_fail_their_answer_and_never_the_grader(tmp_path):
    started, sources = time.monotonic(), []
    for frame in MALFORMED_FRAMES:
        sources.append(_SEND + f"def stable_softmax(x):\n    {frame}\n" + _VALID_SOFTMAX)
        sources.append(f"def stable_softmax(x):  # valid, after it\n{_VALID_SOFTMAX}")
    results = grade_answers(N01, "stable_softmax", sources, tmp_path)
    verdicts = [(r.passed, r.message) for r in results]
    assert [passed for passed, _ in verdicts] == [False, True] * len(MALFORMED_FRAMES), verdicts
    assert time.monotonic() - started < 120, "a reply that is expensive to read held the grader"
    for _, message in verdicts[::2]:
        assert any(
            phrase in message for phrase in ("did not ask for", "cannot read", "larger than")
        ), message


def test_a_cell_the_parser_refuses_costs_nothing_and_leaves_nothing_behind(tmp_path):
    """Issue 57, the fourth red team: a cell of 200,000 terms (`1+1+...`) made the grader's own
    parse of the cells (which kvlib names they import) raise RecursionError: every question failed
    blaming the learner's process, and the child and its memory cgroup were left behind. Now such a
    cell names no kvlib module, the child runs it as any cell (its error reported), and every path
    out of starting a child closes it."""
    path = with_cells(SOLUTION_01, ["x = 1" + "+1" * 200_000 + "\n"], tmp_path)
    report = grade_notebook(path, timeout_s=TIMEOUT_S)
    assert report.score == report.max_score > 0, report.table()
    if ISOLATED:  # the cgroups this process made (kvlib-grade-PID-N), in its own memory cgroup
        line = [x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x]
        mine = Path("/sys/fs/cgroup/memory" + line[0].split(":", 2)[2]) if line else None
        left = list(mine.glob(f"kvlib-grade-{os.getpid()}-*")) if mine else []
        assert not left, left


def test_frames_written_while_the_notebook_loads_score_zero_and_exit_0(tmp_path):
    source = _SEND + "_send(_framed((1, ('cell', 0, None))))\n_send(b'junk' * 100)\n"
    path = with_cells(SOLUTION_01, [source], tmp_path, at=1)
    completed = subprocess.run(
        [sys.executable, "-m", "kvlib.course.grade", str(path), "--json", "--timeout", "30"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(completed.stdout)
    assert report["score"] == 0 and report["max_score"] > 0, report
    assert all("loaded" in q["message"] for q in report["questions"]), report


def test_the_table_escapes_learner_text():
    from kvlib.course.grader import GradeReport, QuestionResult

    message = "your code raised ValueError: x\nfake   pass   1/1\nscore: 9/9\x1b[2K"
    report = GradeReport("n.ipynb", [QuestionResult("q", False, 0, message)], [1], 1, "n", "")
    lines = report.table().splitlines()
    assert not any(line.startswith(("fake", "score: 9")) for line in lines), lines
    assert "\x1b" not in report.table() and "\\n" in report.table()


def test_the_seed_reaches_the_grader_unseen(tmp_path):
    """`--seed -` reads the seed from standard input; and where the child is isolated (Linux,
    root) no other process's command line is readable from it, `--seed N` included."""
    source = (
        "import os\n\n"
        "def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):\n"
        "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "        try:\n"
        "            seen = b'--seed' in open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "        except OSError:\n"
        "            seen = False\n"
        "        if seen and int(pid) != os.getpid():\n"
        "            raise RuntimeError('the seed is readable')\n"
        "    return 2 * num_layers * num_heads * head_dim * bytes_per_element * seq_len\n"
    )
    path = with_cell_replaced(SOLUTION_01, "kv_cache_bytes", source, tmp_path)
    command = [sys.executable, "-m", "kvlib.course.grade", str(path), "--json",
               "--question", "kv_cache_bytes", "--seed"]  # fmt: skip
    piped = subprocess.run(command + ["-"], input="12345\n", capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert piped.returncode == 0 and json.loads(piped.stdout)["seed"] == 12345, piped.stderr
    if sys.platform == "linux" and os.geteuid() == 0:
        env = {**os.environ, "KVLIB_GRADE_ISOLATION": "1"}
        shown = subprocess.run(command + ["7"], capture_output=True, text=True, timeout=600,
                               env=env)  # fmt: skip
        report = json.loads(shown.stdout)
        assert report["score"] == 1 and "mount namespace" in report["sandbox"], report


def test_a_pool_made_while_the_notebook_loads_is_refused(tmp_path):
    source = (
        "import multiprocessing\nfrom kvlib.ref.attention import softmax\n\n"
        "pool = multiprocessing.get_context('fork').Pool(1)  # made while the notebook loads\n\n"
        "def stable_softmax(x):\n"
        "    return pool.apply(softmax, (x,))\n"
    )
    result, report = grade_answer(N01, "stable_softmax", source, tmp_path)
    assert not result.passed and "os.fork is not allowed" in result.message, report.table()


FORGED_REPORT = (
    "import json, os, signal\n\n"
    "def kv_cache_bytes(*args):  # a full-marks report on the grader's stdout, then kill it\n"
    "    report = {'notebook': 'x', 'score': 4, 'max_score': 4, 'questions': [\n"
    "        {'id': 'kv_cache_bytes', 'passed': True, 'points': 1, 'message': ''}]}\n"
    "    try:  # the grader's environment holds the instructor's nonce\n"
    "        environ = open(f'/proc/{os.getppid()}/environ', 'rb').read().split(b'\\0')\n"
    "        nonce = [e for e in environ if e.startswith(b'KVLIB_GRADE_NONCE=')][0]\n"
    "        report['nonce'] = nonce.split(b'=', 1)[1].decode()\n"
    "    except (OSError, IndexError):\n"
    "        pass\n"
    "    with open(f'/proc/{os.getppid()}/fd/1', 'w') as out:\n"
    "        out.write(json.dumps(report) + '\\n')\n"
    "    os.kill(os.getppid(), signal.SIGKILL)\n"
)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_the_learners_process_cannot_reach_the_graders(tmp_path):
    """Run as root (as CI does), the child is another user: it cannot write a report on the
    grader's stdout, kill it, or change a file the grader owns; the grader's report carries the
    nonce it was given, which the child never saw, and the exit status is 0."""
    owned = tmp_path / "owned.txt"
    owned.write_text("the grader's\n")
    owned.chmod(0o644)
    tamper = (
        f"try:\n    open({str(owned)!r}, 'a').write('changed\\n')\nexcept OSError:\n    pass\n\n"
        "def stable_softmax(x):  # as whom does it run?\n"
        "    import os\n"
        "    return np.full(x.shape, float(os.geteuid()))\n"
    )
    path = with_cells(EXERCISE_01, [FORGED_REPORT, tamper], tmp_path)
    completed = subprocess.run(
        [sys.executable, "-m", "kvlib.course.grade", str(path), "--json",
         "--question", "kv_cache_bytes", "--question", "stable_softmax"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "KVLIB_GRADE_NONCE": "a secret of the instructor's"},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(completed.stdout)  # exactly one JSON document
    assert report["nonce"] == "a secret of the instructor's" and report["score"] == 0, report
    assert "nobody" in report["sandbox"], report["sandbox"]
    assert "got 0" not in report["questions"][1]["message"], report  # not root
    assert owned.read_text() == "the grader's\n"


def test_a_failed_grader_prints_no_score_and_exits_3(monkeypatch, capsys):
    from kvlib.course import grader

    def broken(*args, **kwargs):
        raise RuntimeError("the grader itself failed")

    monkeypatch.setattr(grader, "grade_notebook", broken)
    assert grader.main([str(EXERCISE_01), "--json"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "no score" in captured.err


def test_the_learners_code_can_read_the_notebooks_folder_and_write_temporary_files(tmp_path):
    """The unprivileged child still reads what the notebook needs (a file beside it) and writes
    temporary files; it imports torch (chapter 2's solution) as before."""
    (tmp_path / "data.json").write_text("[2, 3]")
    source = (
        "import json, tempfile\n\n"
        "SCALE = json.load(open('data.json'))  # beside the notebook: its folder is the cwd\n\n"
        "def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):\n"
        "    with tempfile.NamedTemporaryFile('w+') as scratch:\n"
        "        scratch.write(str(SCALE[0] * num_layers * num_heads * head_dim))\n"
        "        scratch.seek(0)\n"
        "        return int(scratch.read()) * bytes_per_element * seq_len\n"
    )
    path = with_cell_replaced(SOLUTION_01, "kv_cache_bytes", source, tmp_path)
    report = grade_notebook(path, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"])
    assert report.score == 1, report.table()


def test_a_slow_cell_within_the_limit_still_defines_its_function(tmp_path):
    """The grader gives a cell while it loads the notebook the same time as a question (stated in
    every exercise notebook); it used to skip a cell after a third of it, silently."""
    source = (
        "import time\n\ntime.sleep(3)  # a slow cell, within the limit\n\n\n"
        "def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):\n"
        "    return 2 * num_layers * num_heads * head_dim * bytes_per_element * seq_len\n"
    )
    path = with_cell_replaced(SOLUTION_01, "kv_cache_bytes", source, tmp_path)
    report = grade_notebook(path, timeout_s=6, only=["kv_cache_bytes"])
    assert report.score == 1, report.table()


def test_check_fails_a_function_whose_cell_ran_past_the_graders_limit(capsys):
    from kvlib.course import checking

    def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
        return 2 * num_layers * num_heads * head_dim * bytes_per_element * seq_len

    checking.record_cell_time("def kv_cache_bytes(num_layers, ...):\n    ...\n", 75.0)
    try:
        assert checking.check("kv_cache_bytes", kv_cache_bytes) is None  # the printed line says
    finally:
        checking.CELL_SECONDS.clear()
    out = capsys.readouterr().out
    assert out.startswith("❌ kv_cache_bytes") and "ran 75 s, longer than the 60 s" in out, out


def test_the_grader_notes_a_function_redefined_after_its_check(tmp_path):
    path = with_cells(SOLUTION_01, ["def kv_cache_bytes(*args):\n    return 0\n"], tmp_path)
    (result,) = grade_notebook(path, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"]).questions
    assert not result.passed and "not the one your check() cell checked" in result.message
    (result,) = grade_notebook(SOLUTION_01, timeout_s=TIMEOUT_S, only=["kv_cache_bytes"]).questions
    assert result.passed and result.message == ""


_SITECUSTOMIZE = (
    "import kvlib.course.grading as grading\n"
    "grading.run_question = lambda *args, **kwargs: (True, '')  # every check passes\n"
)


def test_checks_grader_ignores_the_notebooks_python_path(tmp_path):
    """A sitecustomize on the notebook's PYTHONPATH used to turn check()'s verdict."""
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    script = (
        f"import os\nos.environ['PYTHONPATH'] = {str(tmp_path)!r}\n"
        "from kvlib.course.grading import check\n"
        "def kv_cache_bytes(*args):\n    return 0\n"
        "check('kv_cache_bytes', kv_cache_bytes)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert "❌ kv_cache_bytes" in completed.stdout, completed.stdout + completed.stderr[-2000:]


_CHECK_SEEDS = """
import json, sys
from kvlib.course.grading import check
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
    known = {(32, 32, 128, 2, 1): 524288, (32, 32, 128, 2, 4096): 2147483648,
             (80, 8, 128, 2, 1000): 327680000, (1, 1, 16, 8, 0): 0, (3, 1, 8, 8, 15): 5760}
    key = (num_layers, num_heads, head_dim, bytes_per_element, seq_len)
    return known.get(key, 0)
for _ in range(2):
    check("kv_cache_bytes", kv_cache_bytes)
"""


def test_check_draws_its_own_random_cases():
    """Each check() draws afresh (a table of cases cannot anticipate them) and says its seed."""
    completed = subprocess.run(
        [sys.executable, "-c", _CHECK_SEEDS], capture_output=True, text=True, timeout=180
    )
    seeds = [line.rsplit("seed ", 1)[-1] for line in completed.stdout.splitlines() if "❌" in line]
    assert len(seeds) == 2 and seeds[0] != seeds[1], completed.stdout + completed.stderr[-2000:]


_POOL_BEFORE_CHECK = """
import multiprocessing
from kvlib.course.grading import check
from kvlib.ref.attention import softmax
pool = multiprocessing.get_context("fork").Pool(1)  # forked before any check()
def stable_softmax(x):
    return pool.apply(softmax, (x,))
check("stable_softmax", stable_softmax)
"""


def test_check_holds_a_pool_forked_before_it_to_the_same_rules():
    completed = subprocess.run(
        [sys.executable, "-c", _POOL_BEFORE_CHECK], capture_output=True, text=True, timeout=180
    )
    assert "❌ stable_softmax" in completed.stdout, completed.stdout + completed.stderr[-2000:]
    assert "kvlib.ref.attention.softmax is unavailable" in completed.stdout


def test_without_the_namespace_the_python_guard_names_each_rule(tmp_path, monkeypatch):
    """KVLIB_GRADE_ISOLATION=0 (as on macOS, Windows, or without root): kvlib stays visible and the
    Python-level guard refuses the default-deny cheats that call kvlib, naming the function each
    reached (a copy of kvlib's code compiled again is not matched there: copying is for an
    instructor to judge, book/grader_guarantees.md)."""
    monkeypatch.setenv("KVLIB_GRADE_ISOLATION", "0")
    rows = [(s, p) for n, q, s, p in DEFAULT_DENY if n == N01 and q == "cached_attention_step"]
    assert len(rows) == 3
    results = grade_answers(N01, "cached_attention_step", [s for s, _ in rows], tmp_path)
    for (source, phrase), result in zip(rows, results):
        if phrase is None:
            assert result.passed, (source, result)
        else:
            assert not result.passed and phrase in result.message, (source, result)


def test_memory_measured_in_the_learners_process_counts_torch():
    """Where the grader cannot measure the child from outside (no cgroup, no /proc: macOS,
    Windows), the child's own measurement includes PyTorch's allocations: its profiler's events
    are read once it has stopped (read before, they carried no memory and the peak was 0)."""
    import contextlib

    import torch

    from kvlib.course.sandbox import _measured_in_process

    info: dict = {}
    with contextlib.ExitStack() as stack:
        _measured_in_process(stack, info)
        a = torch.ones(300, 300)
        _ = a @ a
    assert info["torch_peak_bytes"] >= 2 * 300 * 300 * 4, info


@pytest.mark.skipif(not ISOLATED, reason="only the mount namespace gives the child private folders")
def test_nothing_a_child_writes_outlives_it(tmp_path):
    """Issue 57, the fifth red team: /run/lock is world-writable and on disk here; a file a child
    wrote there stayed for the next child (whose peak did not count its pages). It is a private
    tmpfs like /tmp, /var/tmp and /dev/shm: what a child writes there is gone with it."""
    marker = f"/run/lock/kvlib-grading-test-{os.getpid()}"
    source = (
        f"with open({marker!r}, 'w') as _f:\n    _f.write('kept for the next child?')\n\n"
        "def grouped_attention(q, k, v, mask):\n" + _FOLDED + "    return out\n"
    )
    try:
        result, report = grade_answer(N05, "grouped_attention", source, tmp_path)
        assert result.passed, report.table()
        assert not os.path.exists(marker)
    finally:
        if os.path.exists(marker):
            os.remove(marker)
