"""The checks name a learner's numeric mistake (issue 54, item 10): each mistaken answer below
fails its question with the mistake's hint in the message, and the official solution still passes
(the verdicts are unchanged: a diagnostic only adds words to a failure). The answers run in this
process, through the sandbox's own request handler (as in tests/test_grading_draws.py)."""

from __future__ import annotations

import functools
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvlib.course.checks.mistakes import matching_mistake, naming_mistakes
from kvlib.course.grading import _QUESTIONS, chapter_questions, run_question
from tests.test_grading_draws import LocalSide, solution_namespace

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _solution(chapter: str) -> dict:
    """The solution notebook's definitions (check() and show() silent while it runs)."""
    (path,) = (ROOT / "solutions").glob(f"{chapter}_*.ipynb")

    class _Env:  # solution_namespace's monkeypatch, for a cached namespace
        def setenv(self, name, value):
            os.environ[name] = value

    previous = os.environ.get("KVLIB_GRADING")
    try:
        namespace = solution_namespace(path, _Env())
    finally:
        if previous is None:
            os.environ.pop("KVLIB_GRADING", None)
        else:
            os.environ["KVLIB_GRADING"] = previous
    chapter_questions(chapter)
    return namespace


def _grade(chapter: str, question: str, source: str | None, seed: int = 0) -> tuple[bool, str]:
    namespace = dict(_solution(chapter))
    if source is not None:
        exec(textwrap.dedent(source), namespace)
    return run_question(_QUESTIONS[question], LocalSide(namespace), [], seed)


# (chapter, question, a mistaken answer, the hint its failure must carry)
MISTAKES = [
    (
        "01",
        "stable_softmax",
        """
def stable_softmax(x):
    e = np.exp(x - np.max(x, axis=0, keepdims=True))
    return e / np.sum(e, axis=0, keepdims=True)
""",
        "the softmax over the first axis instead of the last",
    ),
    (
        "01",
        "stable_softmax",
        """
def stable_softmax(x):
    return np.exp(x - np.max(x, axis=-1, keepdims=True))
""",
        "left undivided",
    ),
    (
        "01",
        "cached_attention_step",
        """
def cached_attention_step(q, k_new, v_new, k_cache, v_cache):
    k_cache = np.concatenate([k_cache, k_new[None]])
    v_cache = np.concatenate([v_cache, v_new[None]])
    s = k_cache @ q
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v_cache, k_cache, v_cache
""",
        "scores not scaled by 1/√D",
    ),
    (
        "01",
        "cached_attention_step",
        """
def cached_attention_step(q, k_new, v_new, k_cache, v_cache):
    s = k_cache @ q / np.sqrt(q.shape[0])
    out = np.zeros(v_new.shape)
    if len(s):
        w = np.exp(s - s.max())
        out = (w / w.sum()) @ v_cache
    k_cache = np.concatenate([k_cache, k_new[None]])
    v_cache = np.concatenate([v_cache, v_new[None]])
    return out, k_cache, v_cache
""",
        "the new token's own key and value are left out",
    ),
    (
        "01",
        "predict_score_entries",
        """
def predict_score_entries(prompt_len, max_new_tokens, num_layers, cached):
    if cached:
        return prompt_len**2 + sum(prompt_len + i for i in range(1, max_new_tokens))
    return sum((prompt_len + i) ** 2 for i in range(max_new_tokens))
""",
        "the count of one layer",
    ),
    (
        "01",
        "kv_cache_bytes",
        """
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
    return num_layers * num_heads * head_dim * bytes_per_element * seq_len
""",
        "K only",
    ),
    (
        "01",
        "kv_cache_bytes",
        """
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
    return 2 * num_layers * num_heads * head_dim * bytes_per_element * seq_len * 8
""",
        "bits, not bytes",
    ),
    (
        "01",
        "kv_cache_bytes",
        """
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
    return 2 * num_heads * head_dim * bytes_per_element * seq_len
""",
        "one layer's cache",
    ),
    (
        "02",
        "rope_at_offset",
        """
def rope_at_offset(x, offset, theta):
    t, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()
""",
        "the offset ignored",
    ),
    (
        "02",
        "rope_at_offset",
        """
def rope_at_offset(x, offset, theta):
    t, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(offset, offset + t, dtype=torch.float32)[:, None] * inv_freq
    angles = angles.repeat_interleave(2, dim=-1)
    rotated = torch.stack([-x[:, 1::2], x[:, 0::2]], dim=-1).flatten(-2)
    return x * angles.cos() + rotated * angles.sin()
""",
        "GPT-J's interleaved pairs",
    ),
    (
        "02",
        "reorder_for_beams",
        """
def reorder_for_beams(layer_caches, beam_indices):
    return [(keys[beam_indices], values) for keys, values in layer_caches]
""",
        "the values left as they were",
    ),
    (
        "03",
        "gqa_bytes_per_token",
        """
def gqa_bytes_per_token(config):
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    return 2 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim * b
""",
        "only num_key_value_heads are cached",
    ),
    (
        "03",
        "gqa_bytes_per_token",
        """
def gqa_bytes_per_token(config):
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * b
""",
        "use the config's head_dim",
    ),
    (
        "03",
        "mla_cache_bytes",
        """
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, seq_len, bytes_per_element):
    return num_layers * kv_lora_rank * seq_len * bytes_per_element
""",
        "the shared rotary key (qk_rope_head_dim) is cached too",
    ),
    (
        "03",
        "mla_cache_bytes",
        """
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, seq_len, bytes_per_element):
    return (kv_lora_rank + qk_rope_head_dim) * seq_len * bytes_per_element
""",
        "the latent is cached per layer",
    ),
    (
        "03",
        "max_batch",
        """
def max_batch(gpu_memory_bytes, weight_bytes, overhead_bytes, kv_bytes_per_token, seq_len):
    return max(0, (gpu_memory_bytes - weight_bytes) // (kv_bytes_per_token * seq_len))
""",
        "the overhead not subtracted",
    ),
    (
        "03",
        "max_batch",
        """
def max_batch(gpu_memory_bytes, weight_bytes, overhead_bytes, kv_bytes_per_token, seq_len):
    free = gpu_memory_bytes - weight_bytes - overhead_bytes
    return max(0, -(-free // (kv_bytes_per_token * seq_len)))
""",
        "rounded up",
    ),
    (
        "04",
        "online_softmax_update",
        """
def online_softmax_update(m, l, block):
    m_new = max(m, float(np.max(block)))
    return m_new, l + float(np.sum(np.exp(block - m_new)))
""",
        "l not rescaled when the maximum rises",
    ),
    (
        "04",
        "merge_two",
        """
def merge_two(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, np.logaddexp(lse_a, lse_b)
""",
        "the plain average of the two partial outputs",
    ),
    (
        "04",
        "merge_two",
        """
def merge_two(out_a, lse_a, out_b, lse_b):
    top = np.maximum(lse_a, lse_b)
    w_a, w_b = np.exp(lse_a - top), np.exp(lse_b - top)
    out = (w_a[:, None] * out_a + w_b[:, None] * out_b) / (w_a + w_b)[:, None]
    return out, top
""",
        "the larger lse",
    ),
    (
        "04",
        "tiled_attention",
        """
def tiled_attention(q, k, v, tile_size):
    t, s = q.shape[0], k.shape[0]
    m, l, acc = np.full(t, -np.inf), np.zeros(t), np.zeros((t, v.shape[1]))
    for start in range(0, s, tile_size):
        scores = q @ k[start : start + tile_size].T / math.sqrt(q.shape[1])
        m_new = np.maximum(m, scores.max(axis=1))
        p = np.exp(scores - m_new[:, None])
        l = l * np.exp(m - m_new) + p.sum(axis=1)
        acc = acc + p @ v[start : start + tile_size]
        m = m_new
    return acc / l[:, None]
""",
        "the accumulator not rescaled",
    ),
    (
        "04",
        "tiled_attention",
        """
def tiled_attention(q, k, v, tile_size):
    t, s = q.shape[0], k.shape[0]
    m, l, acc = np.full(t, -np.inf), np.zeros(t), np.zeros((t, v.shape[1]))
    for start in range(0, s, tile_size):
        scores = q @ k[start : start + tile_size].T
        m_new = np.maximum(m, scores.max(axis=1))
        p, c = np.exp(scores - m_new[:, None]), np.exp(m - m_new)
        l = l * c + p.sum(axis=1)
        acc = acc * c[:, None] + p @ v[start : start + tile_size]
        m = m_new
    return acc / l[:, None]
""",
        "scores not scaled by 1/√D",
    ),
    (
        "05",
        "grouped_attention",
        """
def grouped_attention(q, k, v, mask):
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)  # head h reads KV head h % H_kv
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""",
        "strided groups",
    ),
    (
        "05",
        "grouped_attention",
        """
def grouped_attention(q, k, v, mask):
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""",
        "scores not scaled by 1/√D",
    ),
    (
        "05",
        "mean_pool_kv",
        """
def mean_pool_kv(weight, num_kv_heads, head_dim):
    old = weight.shape[0] // head_dim
    heads = weight.reshape(old // num_kv_heads, num_kv_heads, head_dim, weight.shape[1])
    return heads.mean(dim=0).reshape(num_kv_heads * head_dim, weight.shape[1])
""",
        "strided heads pooled",
    ),
    (
        "05",
        "mean_pool_kv",
        """
def mean_pool_kv(weight, num_kv_heads, head_dim):
    old = weight.shape[0] // head_dim
    heads = weight.reshape(num_kv_heads, old // num_kv_heads, head_dim, weight.shape[1])
    return heads.sum(dim=1).reshape(num_kv_heads * head_dim, weight.shape[1])
""",
        "the group's sum, not its mean",
    ),
    (
        "05",
        "kv_heads_for_budget",
        """
def kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per = 2 * config["num_hidden_layers"] * head_dim * BYTES_PER_ELEMENT[config["torch_dtype"]]
    return min(heads, budget_bytes // (per * seq_len * batch_size))
""",
        "whether or not it divides num_attention_heads",
    ),
    (
        "06",
        "absorbed_scores",
        """
def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):
    q_latent = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)
    content = q_latent @ latent[:, None].transpose(-1, -2)
    rotary = q_rope @ rope_key[:, None].transpose(-1, -2)
    return (content + rotary) / math.sqrt(q_nope.shape[-1])
""",
        "scaled by 1/sqrt(d_h)",
    ),
    (
        "06",
        "absorbed_scores",
        """
def absorbed_scores(q_nope, q_rope, w_uk, latent, rope_key):
    q_latent = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)
    content = q_latent @ latent[:, None].transpose(-1, -2)
    return content / math.sqrt(q_nope.shape[-1] + q_rope.shape[-1])
""",
        "the rotary part q_R · k_R left out",
    ),
    (
        "06",
        "latent_cache_bytes",
        """
def latent_cache_bytes(config, seq_len, batch_size):
    b = BYTES_PER_ELEMENT[config["torch_dtype"]]
    return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b * seq_len * batch_size
""",
        "the latent is cached per layer",
    ),
    (
        "06",
        "shared_rotary_key",
        """
def shared_rotary_key(x, w_kr, positions, theta):
    d_r = w_kr.shape[0]
    k = (x @ w_kr.T)[:, None]
    inv_freq = theta ** (-torch.arange(0, d_r, 2, dtype=torch.float32) / 128)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    return k * angles.cos() + torch.cat([-k2, k1], dim=-1) * angles.sin()
""",
        "frequencies of a 128-wide head",
    ),
    (
        "07",
        "slot_mapping",
        """
def slot_mapping(block_table, positions, block_size):
    return [block_table[t // block_size] + t % block_size for t in positions]
""",
        "block id + offset",
    ),
    (
        "08",
        "h2o_update",
        """
def h2o_update(scores, weights):
    h_kv = scores.shape[0]
    s = weights.shape[-1]
    padded = torch.cat([scores, scores.new_zeros(h_kv, s - scores.shape[1])], dim=1)
    return padded + weights.sum(dim=(0, 1))[None]
""",
        "summed over every query head",
    ),
    (
        "08",
        "h2o_update",
        """
def h2o_update(scores, weights):
    h_kv = scores.shape[0]
    h, t, s = weights.shape
    padded = torch.cat([scores, scores.new_zeros(h_kv, s - scores.shape[1])], dim=1)
    return padded + weights[:, -1].view(h_kv, h // h_kv, s).sum(dim=1)
""",
        "TOVA's rule",
    ),
    (
        "10",
        "bytes_per_token",
        """
def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):
    per_vector = head_dim * bits / 8 + head_dim / group_size * scale_bytes
    return num_layers * num_kv_heads * 2 * per_vector
""",
        "no zero point",
    ),
    (
        "10",
        "bytes_per_token",
        """
def bytes_per_token(num_layers, num_kv_heads, head_dim, bits, group_size, scale_bytes):
    per_vector = head_dim * bits + head_dim / group_size * 2 * scale_bytes
    return num_layers * num_kv_heads * 2 * per_vector
""",
        "bits counted as bytes",
    ),
    (
        "14",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = num_tokens
    flops = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    flops += 2 * L * H * D * n * (n + 1)
    return 2 * L * H_kv * D * 2 * n * flops_per_s / flops / 2**30
""",
        "GiB/s",
    ),
    (
        "14",
        "break_even_gbps",
        """
def break_even_gbps(config, num_tokens, flops_per_s):
    L, d, I = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    H, H_kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = num_tokens
    flops = 2 * n * L * (d * H * D + 2 * d * H_kv * D + H * D * d + 3 * d * I)
    flops += 4 * L * H * D * n * n
    return 2 * L * H_kv * D * 2 * n * flops_per_s / flops / 1e9
""",
        "the full n x n attention",
    ),
    (
        "15",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):
    return (q[:, None, :] * key_max).sum(dim=-1).amax(dim=0) * scale
""",
        "q · max whatever the sign of q",
    ),
    (
        "15",
        "page_bound",
        """
def page_bound(q, key_min, key_max, scale):
    return torch.maximum(q[:, None, :] * key_min, q[:, None, :] * key_max).sum(-1).amax(0)
""",
        "the scale forgotten",
    ),
    (
        "15",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    sparse = (budget - 1) * block_size + S - (pages - 1) * block_size
    return (dense * S + (L - dense) * sparse) * per_token
""",
        "no bounds read",
    ),
    (
        "15",
        "decode_read_bytes",
        """
def decode_read_bytes(L, dense, H_kv, D, b, S, block_size, budget):
    per_token, pages = 2 * H_kv * D * b, -(-S // block_size)
    if pages <= budget:
        return L * S * per_token
    sparse = budget * block_size + pages
    return (dense * S + (L - dense) * sparse) * per_token
""",
        "the newest page counted full",
    ),
]


@pytest.mark.parametrize(
    "chapter, question, source, hint",
    MISTAKES,
    ids=[f"{c}-{q}-{i}" for i, (c, q, _, _) in enumerate(MISTAKES)],
)
def test_a_mistaken_answer_gets_its_hint(chapter, question, source, hint):
    passed, message = _grade(chapter, question, source)
    assert not passed, f"the mistaken {question} passed"
    assert "your answer matches a common mistake" in message and hint in message, message


@pytest.mark.parametrize("question", sorted({(c, q) for c, q, _, _ in MISTAKES}),
                         ids=lambda q: f"{q[0]}-{q[1]}")  # fmt: skip
def test_the_official_solution_still_passes(question):
    chapter, question_id = question
    for seed in range(3):
        passed, message = _grade(chapter, question_id, None, seed)
        assert passed, message


def test_a_diagnostic_only_extends_a_failure():
    """No failure: nothing computed; a failure matching no mistake: the message unchanged."""
    computed = []
    with naming_mistakes(1, {"never": lambda: computed.append(1)}):
        assert 1 == 1
    assert not computed
    with pytest.raises(AssertionError, match=r"^the check's own$"):
        with naming_mistakes(3, {"two": lambda: 2}):
            raise AssertionError("the check's own")
    with pytest.raises(AssertionError, match=r"^your answer matches a common mistake: two\. own"):
        with naming_mistakes(np.int64(2), {"two": lambda: 2}):
            raise AssertionError("own")
    # a mistake that cannot be computed for these inputs is skipped, not raised
    assert matching_mistake(np.ones(2), {"broken": lambda: 1 / 0, "ones": np.ones(2).copy}) == (
        "ones"
    )
    assert matching_mistake(np.ones(3), {"shape": lambda: np.ones(2)}) is None
    assert matching_mistake(True, {"one": lambda: 1}) is None  # a bool is not an int answer


# issue 57, item 4: chapter 15's fixed cases hold a group size > 1 with more than one KV head
_INTERLEAVED = """
def pages_to_read(head_bounds, group_size, num_pages, budget):  # KV head j: heads j, j + H_kv
    h, p = head_bounds.shape
    scores = head_bounds.view(group_size, h // group_size, p).amax(dim=0).sum(dim=0)
    forced = {0, num_pages - 1}
    rest = sorted(set(range(num_pages)) - forced, key=lambda q: -float(scores[q]))
    return sorted(forced | set(rest[: max(0, budget - len(forced))]))
"""


@pytest.mark.parametrize("seed", range(5))
def test_interleaved_gqa_grouping_fails_on_every_seed(seed):
    passed, message = _grade("15", "pages_to_read", _INTERLEAVED, seed)
    assert not passed and "interleaved groups" in message, message


# numpy integers count as ints wherever a question asks for one (expect_int, is_int)
NUMPY_INTS = [
    (
        "01",
        "kv_cache_bytes",
        """
def kv_cache_bytes(num_layers, num_heads, head_dim, bytes_per_element, seq_len):
    return np.int64(2 * num_layers * num_heads * head_dim * bytes_per_element * seq_len)
""",
    ),
    (
        "07",
        "slot_mapping",
        """
def slot_mapping(block_table, positions, block_size):
    table = np.array(block_table, dtype=np.int64)
    return [table[t // block_size] * block_size + np.int64(t % block_size) for t in positions]
""",
    ),
    (
        "09",
        "blocks_freeable",
        """
_solved_blocks_freeable = blocks_freeable
def blocks_freeable(live, block_size):
    return np.int64(_solved_blocks_freeable(live, block_size))
""",
    ),
    (
        "15",
        "pages_to_read",
        """
_solved_pages_to_read = pages_to_read
def pages_to_read(head_bounds, group_size, num_pages, budget):
    return [np.int64(p) for p in _solved_pages_to_read(head_bounds, group_size, num_pages, budget)]
""",
    ),
    (
        "15",
        "compact_table",
        """
_solved_compact_table = compact_table
def compact_table(block_table, seq_len, pages, block_size):
    blocks, length = _solved_compact_table(block_table, seq_len, pages, block_size)
    return [np.int64(b) for b in blocks], np.int64(length)
""",
    ),
    (
        "15",
        "decode_read_bytes",
        """
_solved_decode_read_bytes = decode_read_bytes
def decode_read_bytes(*args):
    return np.int64(_solved_decode_read_bytes(*args))
""",
    ),
]


@pytest.mark.parametrize("chapter, question, source", NUMPY_INTS,
                         ids=[f"{c}-{q}" for c, q, _ in NUMPY_INTS])  # fmt: skip
def test_numpy_integers_count_as_ints(chapter, question, source):
    passed, message = _grade(chapter, question, "import numpy as np\n" + source.strip() + "\n")
    assert passed, message


# issue 54, item 10: the prediction questions. Plausible wrong answers score zero (with the
# mistake named where a table has it); valid variants get full marks.
PREDICTIONS = [
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):
    return sum(prompt_len + i for i in range(max_new_tokens))
""",
        "every K row the naive loop computes",
    ),
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):
    return prompt_len * (max_new_tokens - 1)
""",
        "the generated tokens' forgotten",
    ),
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):  # counts the last token's step too
    n = max_new_tokens + 1
    return sum(prompt_len + i for i in range(n)) - (prompt_len + n - 1)
""",
        "common mistake",  # at (1, 1) it equals another mistake's answer: either is named
    ),
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):
    return (prompt_len + max_new_tokens) ** 2 // 2
""",
        "you predicted",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 32 * 32 * 128 * 2
""",
        "K only",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 2 * 32 * 32 * 128 * 16
""",
        "bits, not bytes",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 512
""",
        "KiB, not bytes",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 2 * 32 * 128 * 2
""",
        "one layer",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 524288.0
""",
        "should return an int",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    return 8 / 32
""",
        "GQA's cache over MHA's",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    return 8
""",
        "H_kv itself",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    return 16
""",
        "the group size squared",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    return "4"
""",
        "should return a number",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    return -(-sum(seq_lens) // block_size)
""",
        "pooled into shared blocks",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    return sum(n // block_size for n in seq_lens)
""",
        "rounded down",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    return len(seq_lens) * -(-max(seq_lens) // block_size)
""",
        "padded to the longest",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    return sum(n // block_size + 1 for n in seq_lens)
""",
        "one extra block per sequence",
    ),
]

VALID_PREDICTIONS = [
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):
    n = max_new_tokens
    return (n - 1) * prompt_len + (n - 1) * (n - 2) // 2
""",
    ),
    (
        "01",
        "predict_recomputed_k_rows",
        """
def predict_recomputed_k_rows(prompt_len, max_new_tokens):
    import numpy as np
    steps = np.arange(1, max_new_tokens)  # decode step i recomputes P + i - 1 rows
    return np.int64((prompt_len + steps - 1).sum())
""",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    return 512 * 1024
""",
    ),
    (
        "03",
        "predict_llama2_bytes_per_token",
        """
def predict_llama2_bytes_per_token():
    import numpy as np
    return np.int64(2**19)
""",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    return 32 / 8
""",
    ),
    (
        "05",
        "predict_mha_gqa_ratio",
        """
def predict_mha_gqa_ratio():
    import numpy as np
    return np.float64(4.0)
""",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    import math
    return sum(math.ceil(n / block_size) for n in seq_lens)
""",
    ),
    (
        "07",
        "predict_ragged_blocks",
        """
def predict_ragged_blocks(seq_lens, block_size):
    return sum((n + block_size - 1) // block_size for n in seq_lens)
""",
    ),
]


@pytest.mark.parametrize(
    "chapter, question, source, phrase",
    PREDICTIONS,
    ids=[f"{c}-{q}-{i}" for i, (c, q, _, _) in enumerate(PREDICTIONS)],
)
def test_a_wrong_prediction_scores_zero(chapter, question, source, phrase):
    for seed in range(3):
        passed, message = _grade(chapter, question, source, seed)
        assert not passed and phrase in message, message


@pytest.mark.parametrize(
    "chapter, question, source",
    VALID_PREDICTIONS,
    ids=[f"{c}-{q}-{i}" for i, (c, q, _) in enumerate(VALID_PREDICTIONS)],
)
def test_a_valid_prediction_gets_full_marks(chapter, question, source):
    for seed in range(3):
        passed, message = _grade(chapter, question, source, seed)
        assert passed, message


def test_the_written_out_formulas_match_kvlibs_oracles():
    """The mistakes of chapters 14 and 15 switch parts of a formula written out in the check:
    with nothing switched, it is kvlib's own answer."""
    from kvlib.course.checks import ch14, ch15
    from kvlib.offload.breakeven import break_even_bandwidth

    rng = np.random.default_rng(0)
    for _ in range(200):
        layers, block_size = int(rng.integers(1, 40)), int(rng.choice([4, 16, 32]))
        args = (layers, int(rng.integers(0, layers + 1)), int(rng.choice([1, 2, 8])),
                int(rng.choice([64, 128])), int(rng.choice([1, 2, 4])),
                int(rng.integers(1, 20_000)), block_size, int(rng.integers(2, 40)))  # fmt: skip
        assert ch15._read_formula(args) == ch15._read_bytes(*args), args
    for values, _ in ch14._CONFIGS:
        config = dict(zip(ch14._FIELDS, values))
        for n in (1, 777, 4096):
            oracle = dict(config, model_type="llama", torch_dtype="bfloat16")
            expected = break_even_bandwidth(oracle, n, 400e12) / 1e9
            assert abs(ch14._gbps(config, n, 400e12) - expected) <= 1e-9 * expected
