"""The checks name a learner's numeric mistake (issue 54, item 10): each mistaken answer below
fails its question with the mistake's hint in the message, and the official solution still passes
(the verdicts are unchanged: a diagnostic only adds words to a failure). The answers run in this
process, through the sandbox's own request handler (as in tests/test_grading_draws.py)."""

from __future__ import annotations

import functools
import linecache
import os
import textwrap
import zlib
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


def _grade(chapter: str, question: str, source: str | None, seed: int = 0, *,
           draws_only: bool = False) -> tuple[bool, str]:  # fmt: skip
    namespace = dict(_solution(chapter))
    if source is not None:
        text = textwrap.dedent(source)
        filename = f"<mistaken {question} {zlib.crc32(text.encode())}>"  # Triton reads the source
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec"), namespace)
    side = LocalSide(namespace)
    return run_question(_QUESTIONS[question], side, [], seed, draws_only=draws_only)


# (chapter, question, a mistaken answer, the hint its failure must carry)
MISTAKES = [
    (
        "08",
        "streaming_keep",
        """
def streaming_keep(positions, budget, num_sinks):
    if len(positions) <= budget:
        return [True] * len(positions)
    keep = [i < num_sinks for i, p in enumerate(positions)]
    room = budget - sum(keep)
    newest_first = sorted(range(len(positions)), key=lambda i: positions[i], reverse=True)
    for i in newest_first:
        if room <= 0:
            break
        if not keep[i]:
            keep[i] = True
            room -= 1
    return keep
""",
        "the sinks taken as the first slots",
    ),
    (
        "08",
        "streaming_keep",
        """
def streaming_keep(positions, budget, num_sinks):
    if len(positions) <= budget:
        return [True] * len(positions)
    keep = [p < num_sinks for i, p in enumerate(positions)]
    room = budget - sum(keep)
    newest_first = sorted(range(len(positions)), key=lambda i: i, reverse=True)
    for i in newest_first:
        if room <= 0:
            break
        if not keep[i]:
            keep[i] = True
            room -= 1
    return keep
""",
        "the most recent tokens taken as the last slots",
    ),
    (
        "08",
        "streaming_keep",
        """
def streaming_keep(positions, budget, num_sinks):
    if len(positions) <= budget:
        return [True] * len(positions)
    keep = [p < num_sinks for i, p in enumerate(positions)]
    room = budget
    newest_first = sorted(range(len(positions)), key=lambda i: positions[i], reverse=True)
    for i in newest_first:
        if room <= 0:
            break
        if not keep[i]:
            keep[i] = True
            room -= 1
    return keep
""",
        "the window given the whole budget",
    ),
    (
        "10",
        "quantize_int4",
        """
def quantize_int4(x):
    zero = x.amin(dim=1, keepdim=True)
    scale = (x.amax(dim=1, keepdim=True) - zero) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - zero) / scale).round().clamp(0, 15).to(torch.uint8)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return packed, scale, zero
""",
        "packed high nibble first",
    ),
    (
        "10",
        "quantize_int4",
        """
def quantize_int4(x):
    zero = x.amin(dim=1, keepdim=True)
    scale = (x.amax(dim=1, keepdim=True) - zero) / 16
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - zero) / scale).round().clamp(0, 15).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, zero
""",
        "scale = (max - min) / 16",
    ),
    (
        "10",
        "quantize_int4",
        """
def quantize_int4(x):
    zero = x.amin(dim=1, keepdim=True)
    scale = (x.amax(dim=1, keepdim=True) - zero) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - zero) / scale).floor().clamp(0, 15).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, zero
""",
        "truncated (floor)",
    ),
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
        "02",
        "static_cache_insert",
        """
def static_cache_insert(buffer, length, k_new):
    end = length + k_new.shape[2]
    if end > buffer.shape[2]:
        raise ValueError("full")
    buffer[:, :, length:end] = k_new
    return buffer[:, :, length:end]
""",
        "the view of the new rows only",
    ),
    (
        "02",
        "static_cache_insert",
        """
def static_cache_insert(buffer, length, k_new):
    end = length + k_new.shape[2]
    if end > buffer.shape[2]:
        raise ValueError("full")
    buffer[:, :, length:end] = k_new
    return buffer
""",
        "the whole buffer returned",
    ),
    (
        "02",
        "static_cache_insert",
        """
def static_cache_insert(buffer, length, k_new):
    end = length + k_new.shape[2]
    if end > buffer.shape[2]:
        raise ValueError("full")
    buffer[:, :, : k_new.shape[2]] = k_new
    return buffer[:, :, :end]
""",
        "the new rows written at position 0",
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
        "07",
        "append_token",
        """
def append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size):
    if num_tokens % block_size == 0:
        new = free_blocks.pop(0)
        ref_cnt[new] = 1
        block_table.append(new)
    block = block_table[num_tokens // block_size]
    return block * block_size + num_tokens % block_size, None
""",
        "no copy-on-write",
    ),
    (
        "07",
        "append_token",
        """
def append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size):
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
        "the old block's reference kept",
    ),
    (
        "07",
        "append_token",
        """
def append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size):
    copy = None
    if num_tokens % block_size == 0:
        new = free_blocks.pop()
        ref_cnt[new] = 1
        block_table.append(new)
    elif ref_cnt[block_table[-1]] > 1:
        old, new = block_table[-1], free_blocks.pop()
        ref_cnt[old] -= 1
        ref_cnt[new] = 1
        block_table[-1] = new
        copy = (old, new)
    block = block_table[num_tokens // block_size]
    return block * block_size + num_tokens % block_size, copy
""",
        "the last free block taken",
    ),
    (
        "07",
        "prefix_hit_tokens",
        """
def prefix_hit_tokens(token_ids, cached, block_size):
    parent, hits = None, 0
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached:
            break
        hits += block_size
    return hits
""",
        "the whole prompt taken from the cache",
    ),
    (
        "07",
        "prefix_hit_tokens",
        """
def prefix_hit_tokens(token_ids, cached, block_size):
    hits = 0
    for i in range((len(token_ids) - 1) // block_size):
        if hash_block(None, token_ids[i * block_size : (i + 1) * block_size]) not in cached:
            break
        hits += block_size
    return hits
""",
        "each block hashed without its parent",
    ),
    (
        "07",
        "prefix_hit_tokens",
        """
def prefix_hit_tokens(token_ids, cached, block_size):
    parent, hits = None, 0
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached:
            break
        hits += 1
    return hits
""",
        "the cached blocks counted, not their tokens",
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
        "08",
        "snapkv_select",
        """
def snapkv_select(votes, budget, window, kernel_size):
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s).clone()
    scores = votes.clone()
    scores[:, s - window :] = float("inf")
    return scores.sort(dim=1, descending=True, stable=True).indices[:, :budget].sort(dim=1).values
""",
        "the votes not pooled",
    ),
    (
        "08",
        "snapkv_select",
        """
def snapkv_select(votes, budget, window, kernel_size):
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s).clone()
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel_size, 1, kernel_size // 2)[:, 0]
    return pooled.sort(dim=1, descending=True, stable=True).indices[:, :budget].sort(dim=1).values
""",
        "the observation window left to its votes",
    ),
    (
        "08",
        "snapkv_select",
        """
def snapkv_select(votes, budget, window, kernel_size):
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s).clone()
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel_size, 1, kernel_size // 2)[:, 0]
    pooled[:, s - window :] = float("inf")
    return pooled.sort(dim=1, descending=True, stable=True).indices[:, :budget]
""",
        "the indices in the order of their pooled votes",
    ),
    (
        "09",
        "blocks_freeable",
        """
def blocks_freeable(live, block_size):
    n = len(live)
    return -(-n // block_size) - -(-sum(live) // block_size)
""",
        "the blocks a compaction would free",
    ),
    (
        "09",
        "blocks_freeable",
        """
def blocks_freeable(live, block_size):
    return sum(not any(live[i * block_size : (i + 1) * block_size])
               for i in range(len(live) // block_size))
""",
        "the partly filled last block left out",
    ),
    (
        "09",
        "blocks_freeable",
        """
def blocks_freeable(live, block_size):
    return sum(not all(live[s : s + block_size]) for s in range(0, len(live), block_size))
""",
        "every block with an evicted slot counted",
    ),
    (
        "09",
        "repack",
        """
def repack(slots, live):
    survivors = live.nonzero()[:, 0]
    slots = torch.cat([slots[survivors], slots[~live]])
    return int((survivors != torch.arange(len(survivors))).sum())
""",
        "the slots left as they were",
    ),
    (
        "09",
        "repack",
        """
def repack(slots, live):
    holes = (~live).nonzero()[:, 0].tolist()
    survivors = live.nonzero()[:, 0].tolist()
    copied = 0
    for hole, src in zip(holes, reversed(survivors)):
        if hole > src:
            break
        slots[hole] = slots[src]
        copied += 1
    return copied
""",
        "hole-filling's moves",
    ),
    (
        "09",
        "repack",
        """
def repack(slots, live):
    survivors = live.nonzero()[:, 0]
    slots[: len(survivors)] = slots[survivors].clone()
    return len(survivors)
""",
        "every survivor counted",
    ),
    (
        "09",
        "repack",
        """
def repack(slots, live):
    survivors = live.nonzero()[:, 0]
    slots[: len(survivors)] = slots[survivors].clone()
    return int((~live).sum())
""",
        "the evicted slots counted",
    ),
    (
        "09",
        "positions_after_hole_filling",
        """
def positions_after_hole_filling(positions):
    return [p for p in positions if p >= 0]
""",
        "the repack's map",
    ),
    (
        "09",
        "positions_after_hole_filling",
        """
def positions_after_hole_filling(positions):
    moved = list(positions)
    holes = [i for i, p in enumerate(positions) if p < 0]
    survivors = [i for i, p in enumerate(positions) if p >= 0]
    for hole, src in zip(holes, reversed(survivors)):
        if hole > src:
            break
        moved[hole] = positions[src]
    return moved
""",
        "the whole map returned",
    ),
    (
        "09",
        "positions_after_hole_filling",
        """
def positions_after_hole_filling(positions):
    moved = list(positions)
    holes = [i for i, p in enumerate(positions) if p < 0]
    survivors = [i for i, p in enumerate(positions) if p >= 0]
    for hole, src in zip(holes, reversed(survivors)):
        if hole > src:
            break
        moved[hole] = positions[src]
    return [p for p in moved if p >= 0]
""",
        "the -1 entries dropped",
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
        "10",
        "kivi_key_scales",
        """
def kivi_key_scales(keys, group_size):
    s, d = keys.shape
    groups = keys.reshape(s // group_size, group_size, d)
    zero = groups.amin(dim=2)
    return (groups.amax(dim=2) - zero) / 3, zero
""",
        "per-token scales",
    ),
    (
        "10",
        "kivi_key_scales",
        """
def kivi_key_scales(keys, group_size):
    s, d = keys.shape
    groups = keys.reshape(s // group_size, group_size, d)
    zero = groups.amin(dim=1)
    return (groups.amax(dim=1) - zero) / 4, zero
""",
        "scale = (max - min) / 4",
    ),
    (
        "10",
        "kivi_key_scales",
        """
def kivi_key_scales(keys, group_size):
    s, d = keys.shape
    groups = keys.reshape(group_size, s // group_size, d)
    zero = groups.amin(dim=0)
    return (groups.amax(dim=0) - zero) / 3, zero
""",
        "strided groups",
    ),
    (
        "12",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):
    plan, budget = [], token_budget
    for request_id, left in running:
        if left > budget:
            break
        plan.append((request_id, left))
        budget -= left
    num_running = len(running)
    for request_id, left in waiting:
        if left > budget or budget == 0 or num_running >= max_num_seqs:
            break
        plan.append((request_id, left))
        budget -= left
        num_running += 1
    return plan
""",
        "a prompt scheduled only whole",
    ),
    (
        "12",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):
    plan, budget = [], token_budget
    for request_id, left in running + waiting:
        if budget == 0:
            break
        plan.append((request_id, min(left, budget)))
        budget -= min(left, budget)
    return plan
""",
        "max_num_seqs not enforced",
    ),
    (
        "12",
        "schedule_step",
        """
def schedule_step(running, waiting, token_budget, max_num_seqs):
    plan = []
    for request_id, left in running:
        plan.append((request_id, min(left, token_budget)))
    num_running = len(running)
    for request_id, left in waiting:
        if num_running >= max_num_seqs:
            break
        plan.append((request_id, min(left, token_budget)))
        num_running += 1
    return plan
""",
        "the budget never spent",
    ),
    (
        "12",
        "preemption_victims",
        """
def preemption_victims(running, index, blocks_needed, free_blocks, blocks_held):
    running, preempted = list(running), []
    me = running[index]
    while free_blocks < blocks_needed:
        victim = running.pop(0)
        preempted.append(victim)
        free_blocks += blocks_held[victim]
        if victim == me:
            break
    return preempted
""",
        "the oldest running request preempted first",
    ),
    (
        "12",
        "preemption_victims",
        """
def preemption_victims(running, index, blocks_needed, free_blocks, blocks_held):
    running, preempted = list(running), []
    while running and free_blocks < blocks_needed:
        victim = running.pop()
        preempted.append(victim)
        free_blocks += blocks_held[victim]
    return preempted
""",
        "requests older than the one that needs blocks",
    ),
    (
        "12",
        "preemption_victims",
        """
def preemption_victims(running, index, blocks_needed, free_blocks, blocks_held):
    running, preempted = list(running), []
    while free_blocks <= blocks_needed:
        victim = running.pop()
        preempted.append(victim)
        free_blocks += blocks_held[victim]
        if len(running) == index:
            break
    return preempted
""",
        "a request preempted although the blocks already fit",
    ),
    (
        "12",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):
    cached, parent = 0, None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached_hashes:
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(cached + new) // block_size) - cached // block_size
""",
        "the last token's block taken from the cache",
    ),
    (
        "12",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):
    cached, parent = 0, None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached_hashes:
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(cached + new) // block_size)
""",
        "the cached blocks allocated too",
    ),
    (
        "12",
        "first_step",
        """
def first_step(token_ids, cached_hashes, block_size, token_budget):
    cached, parent = 0, None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        if parent not in cached_hashes:
            break
        cached += block_size
    new = min(len(token_ids) - cached, token_budget)
    return cached, new, -(-(len(token_ids) - cached) // block_size)
""",
        "blocks for the whole prompt",
    ),
    (
        "13",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):
    return [b.decode("utf-8", errors="replace") for b in token_bytes]
""",
        "errors='replace'",
    ),
    (
        "13",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):
    return [b.decode("utf-8", errors="ignore") for b in token_bytes]
""",
        "errors='ignore'",
    ),
    (
        "13",
        "utf8_deltas",
        """
def utf8_deltas(token_bytes):
    pending, deltas = b"", []
    for token in token_bytes:
        pending += token
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError:
            deltas.append("")
            continue
        deltas.append(text)
        pending = b""
    return deltas
""",
        "nothing released until every pending byte decodes",
    ),
    (
        "13",
        "stop_stream",
        """
def stop_stream(pieces, stops):
    sent = []
    for piece in pieces:
        hits = [piece.find(s) for s in stops if s in piece]
        if hits:
            sent.append(piece[: min(hits)])
            return sent, True
        sent.append(piece)
    sent.append("")
    return sent, False
""",
        "each piece searched on its own",
    ),
    (
        "13",
        "stop_stream",
        """
def stop_stream(pieces, stops):
    received, sent = "", []
    for piece in pieces:
        before = len(received)
        received += piece
        hits = [received.find(s) for s in stops if s in received]
        if hits:
            sent.append(received[before : min(hits)])
            return sent, True
        sent.append(piece)
    sent.append("")
    return sent, False
""",
        "each piece sent as it arrives",
    ),
    (
        "13",
        "stop_stream",
        """
def stop_stream(pieces, stops):
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
        "the first stop string of `stops` found",
    ),
    (
        "13",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        tpot = (token_times[-1] - token_times[0]) / len(token_times)
        good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "TPOT divided by the tokens",
    ),
    (
        "13",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft < ttft_slo_s and tpot < tpot_slo_s
    start = min(a for a, _ in requests)
    end = max(t[-1] for _, t in requests)
    return good, good / (end - start)
""",
        "a request exactly at a bound left out",
    ),
    (
        "13",
        "slo_goodput",
        """
def slo_goodput(requests, ttft_slo_s, tpot_slo_s):
    good = 0
    for arrival, token_times in requests:
        ttft = token_times[0] - arrival
        n = len(token_times)
        tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_slo_s and tpot <= tpot_slo_s
    return good, good / (requests[-1][1][-1] - requests[0][0])
""",
        "the run timed from the first listed request",
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
        "14",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(hashlib.sha256(parent).digest())
    return keys
""",
        "the salt left out",
    ),
    (
        "14",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):
    blocks = [token_ids[i : i + block_size] for i in range(0, len(token_ids), block_size)]
    return [
        hashlib.sha256(salt + hash_block_tokens(None, block)).digest()
        for block in blocks
        if len(block) == block_size
    ]
""",
        "each block hashed without its parent",
    ),
    (
        "14",
        "salted_block_keys",
        """
def salted_block_keys(salt, token_ids, block_size):
    keys, parent = [], None
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        keys.append(hashlib.sha256(salt + parent).digest())
    return keys
""",
        "a key for the partial last block",
    ),
    (
        "14",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):
    host, disk, found = [], [], []
    def insert(key):
        host.append(key)
        if len(host) > host_blocks:
            disk.append(host.pop(0))
            if len(disk) > disk_blocks:
                disk.pop(0)
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
            if where == "disk":
                disk.remove(key)
                insert(key)
        else:
            if where is not None:
                (host if where == "host" else disk).remove(key)
            insert(key)
    return found, host, disk
""",
        "a hit in host memory left where it was",
    ),
    (
        "14",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):
    host, disk, found = [], [], []
    def insert(key):
        host.append(key)
        if len(host) > host_blocks:
            disk.append(host.pop(0))
            if len(disk) > disk_blocks:
                disk.pop(0)
    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
            if where == "host":
                host.remove(key)
                insert(key)
        else:
            if where is not None:
                (host if where == "host" else disk).remove(key)
            insert(key)
    return found, host, disk
""",
        "a hit on disk left on disk",
    ),
    (
        "14",
        "two_tier_lru",
        """
def two_tier_lru(host_blocks, disk_blocks, operations):
    host, disk, found = [], [], []
    def insert(key):
        host.append(key)
        if len(host) > host_blocks:
            disk.append(host.pop(0))
            if len(disk) > disk_blocks:
                disk.pop(0)
    for op, key in operations:
        if op == "put":
            insert(key)
            continue
        where = "host" if key in host else "disk" if key in disk else None
        found.append(where)
        if where is not None:
            (host if where == "host" else disk).remove(key)
            insert(key)
    return found, host, disk
""",
        "a put of a stored key leaves the old copy",
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
    (
        "15",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):
    chosen = sorted(pages)
    return [block_table[p] for p in chosen], len(chosen) * block_size
""",
        "the newest page counted full",
    ),
    (
        "15",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):
    chosen = sorted(pages)
    return [block_table[p] for p in chosen], (len(chosen) - 1) * block_size + seq_len % block_size
""",
        "seq_len % block_size",
    ),
    (
        "15",
        "compact_table",
        """
def compact_table(block_table, seq_len, pages, block_size):
    fill = seq_len - (seq_len - 1) // block_size * block_size
    return [block_table[p] for p in pages], (len(pages) - 1) * block_size + fill
""",
        "the blocks in the order the pages were given",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # the bonus forgotten: row k never read
    chosen = target_logits.argmax(dim=-1).tolist()
    for i, token in enumerate(draft):
        if token != chosen[i]:
            return i, chosen[i]
    return len(draft), chosen[len(draft) - 1]
""",
        "the bonus forgotten",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # the correction read from the next row
    chosen = target_logits.argmax(dim=-1).tolist()
    for i, token in enumerate(draft):
        if token != chosen[i]:
            return i, chosen[i + 1]
    return len(draft), chosen[len(draft)]
""",
        "one row late",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # draft token i checked against row i + 1
    chosen = target_logits.argmax(dim=-1).tolist()
    for i, token in enumerate(draft):
        if token != chosen[i + 1]:
            return i, chosen[i + 1]
    return len(draft), chosen[len(draft)]
""",
        "the rows shifted by one",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # every match counted, not the leading ones
    chosen = target_logits.argmax(dim=-1).tolist()
    accepted = sum(d == c for d, c in zip(draft, chosen))
    return accepted, chosen[accepted]
""",
        "every matching draft token counted",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # the rejected draft token kept
    chosen = target_logits.argmax(dim=-1).tolist()
    for i, token in enumerate(draft):
        if token != chosen[i]:
            return i, token
    return len(draft), chosen[len(draft)]
""",
        "the rejected draft token returned",
    ),
    (
        "16",
        "greedy_accept",
        """
def greedy_accept(draft, target_logits):  # ties: the last maximum
    chosen = [int((row == row.max()).nonzero()[-1]) for row in target_logits]
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]
""",
        "ties broken towards the last maximum",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # the residual not normalised
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            return i, (p[i] - q[i]).clamp(min=0)
    return len(draft), p[len(draft)]
""",
        "the residual not normalised",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # p_i itself at a rejection
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            return i, p[i]
    return len(draft), p[len(draft)]
""",
        "p_i resampled at a rejection",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # max(0, q - p)
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = (q[i] - p[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "the residual the wrong way round",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # the bonus from the last draft row
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[max(len(draft) - 1, 0)]
""",
        "the bonus from row k - 1",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # accept when u <= q / p
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * p[i, token] > q[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "the ratio inverted",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # accept when u <= p(x)
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "q forgotten",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # a tie rejected
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u >= p[i, token] / q[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "a tie rejected",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # shared blocks freed too
    keep = -(-new_len // block_size)
    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], block_table[keep:][::-1], copy
""",
        "shared blocks freed",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # new_len // size + 1 blocks
    keep = min(new_len // block_size + 1, len(block_table))
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    copy = new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "an empty block kept",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # new_len // size blocks
    keep = new_len // block_size
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "the partly filled last block dropped",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # freed in table order
    keep = -(-new_len // block_size)
    freed = [b for b in block_table[keep:] if ref_cnt[b] == 1]
    copy = keep > 0 and new_len % block_size != 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "freed in table order",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # a shared last block copied
    keep = -(-new_len // block_size)
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    copy = keep > 0 and ref_cnt[block_table[keep - 1]] > 1
    return block_table[:keep], freed, copy
""",
        "a full shared last block copied",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # any partial block copied
    keep = -(-new_len // block_size)
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    return block_table[:keep], freed, new_len % block_size != 0
""",
        "a private partial block copied",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # no copy-on-write
    keep = -(-new_len // block_size)
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    return block_table[:keep], freed, False
""",
        "no copy-on-write",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # alpha^k
    tokens = k + 1.0 if alpha == 1 else (1 - alpha**k) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "alpha^k instead of alpha^(k + 1)",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # the accepted drafts only
    tokens = float(sum(alpha**i for i in range(1, k + 1)))
    return tokens, tokens / (c * k + 1)
""",
        "the target's own token left out",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # k tokens at alpha = 1
    tokens = float(k) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k + 1)
""",
        "k tokens at alpha = 1",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # a step costs the drafts only
    tokens = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * k) if c * k else tokens
""",
        "the target's pass left out",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # k + 1 draft steps
    tokens = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens / (c * (k + 1) + 1)
""",
        "k + 1 draft steps",
    ),
    (
        "16",
        "speculation_gain",
        """
def speculation_gain(alpha, k, c):  # the drafts' cost forgotten
    tokens = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens, tokens
""",
        "the speed-up as tokens per step",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # the uniforms in float32
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if torch.tensor(uniforms)[i] * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "a tie rejected",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # vectorised, the uniforms in float32
    k = len(draft)
    if k == 0:
        return 0, p[0]
    idx = torch.arange(k)
    d = torch.tensor(draft)
    ratio = p[idx, d] / q[idx, d]
    rej = torch.tensor(uniforms) > ratio
    if not rej.any():
        return k, p[k]
    i = int(rej.int().argmax())
    residual = (p[i] - q[i]).clamp(min=0)
    return i, residual / residual.sum()
""",
        "a tie rejected",
    ),
    (
        "16",
        "rejection_sample",
        """
def rejection_sample(draft, q, p, uniforms):  # the residual left as it is when its sum is near 1
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        if u * q[i, token] > p[i, token]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual if abs(residual.sum() - 1) < 1e-6 else residual / residual.sum()
    return len(draft), p[len(draft)]
""",
        "the residual not normalised",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # any kept block shared
    keep = -(-new_len // block_size)
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    copy = new_len % block_size != 0 and any(ref_cnt[b] > 1 for b in block_table[:keep])
    return block_table[:keep], freed, copy
""",
        "a private partial block copied",
    ),
    (
        "16",
        "rollback_blocks",
        """
def rollback_blocks(block_table, new_len, block_size, ref_cnt):  # all kept blocks shared
    keep = -(-new_len // block_size)
    freed = [b for b in reversed(block_table[keep:]) if ref_cnt[b] == 1]
    shared = min(ref_cnt[b] for b in block_table[:keep]) > 1 if keep else False
    copy = new_len % block_size != 0 and shared
    return block_table[:keep], freed, copy
""",
        "no copy-on-write",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # newest first
    first = max(0, num_positions - window)
    return [p % window for p in range(first, num_positions)][::-1]
""",
        "newest first",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # the slots in buffer order
    return list(range(min(num_positions, window)))
""",
        "the slots in buffer order",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # the positions, not their slots
    return list(range(max(0, num_positions - window), num_positions))
""",
        "the positions themselves",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # W - 1 positions
    return [p % window for p in range(max(0, num_positions - window + 1), num_positions)]
""",
        "W - 1 positions",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # W + 1 positions
    return [p % window for p in range(max(0, num_positions - window - 1), num_positions)]
""",
        "W + 1 positions",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # positions n - W + 1 .. n
    return [p % window for p in range(max(0, num_positions - window + 1), num_positions + 1)]
""",
        "the next position included",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):  # rotated even before the ring wraps
    start = num_positions % window
    return list(range(start, window)) + list(range(start))
""",
        "the rotation applied before the ring has wrapped",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # positions < n - W out
    first = -(-sink_tokens // block_size)
    return list(range(first, (num_positions - window) // block_size))
""",
        "a window of W + 1 keys",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # n - W + 1 out too
    first = -(-sink_tokens // block_size)
    return list(range(first, (num_positions - window + 2) // block_size))
""",
        "a window of W - 1 keys",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # any position out
    first = -(-sink_tokens // block_size)
    return list(range(first, -(-(num_positions - window + 1) // block_size)))
""",
        "a block freed while some of its positions are still in the window",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # the sinks forgotten
    return list(range((num_positions - window + 1) // block_size))
""",
        "the sinks forgotten",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # floor for the sinks
    first = sink_tokens // block_size
    return list(range(first, (num_positions - window + 1) // block_size))
""",
        "the sinks' last block freed",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # sinks as blocks
    return list(range(sink_tokens, (num_positions - window + 1) // block_size))
""",
        "sink_tokens counted in blocks",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # sinks in the window
    first = -(-sink_tokens // block_size)
    recent = window - sink_tokens
    return list(range(first, (num_positions - recent + 1) // block_size))
""",
        "the sinks counted inside the window",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # newest first
    first = -(-sink_tokens // block_size)
    return list(range(first, (num_positions - window + 1) // block_size))[::-1]
""",
        "newest first: list the blocks in ascending order",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):  # never frees
    return []
""",
        "nothing freed",
    ),
    (
        "17",
        "softmax_with_sink",
        """
def softmax_with_sink(scores, sink):  # the sink forgotten
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
""",
        "the sink forgotten",
    ),
    (
        "17",
        "softmax_with_sink",
        """
def softmax_with_sink(scores, sink):  # no maximum subtracted
    e = np.exp(scores)
    return e / (e.sum(axis=1, keepdims=True) + np.exp(sink)[:, None])
""",
        "no maximum subtracted",
    ),
    (
        "17",
        "softmax_with_sink",
        """
def softmax_with_sink(scores, sink):  # the scores shifted, the sink not
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return e / (e.sum(axis=1, keepdims=True) + np.exp(sink)[:, None])
""",
        "the sink not shifted",
    ),
    (
        "17",
        "softmax_with_sink",
        """
def softmax_with_sink(scores, sink):  # the sink once per key
    m = np.maximum(scores.max(axis=1, keepdims=True), sink[:, None])
    e = np.exp(scores - m)
    return e / (e.sum(axis=1, keepdims=True) + scores.shape[1] * np.exp(sink[:, None] - m))
""",
        "the sink counted once per key",
    ),
    (
        "17",
        "softmax_with_sink",
        """
def softmax_with_sink(scores, sink):  # the sink added as a weight
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return e / (e.sum(axis=1, keepdims=True) + sink[:, None])
""",
        "the sink added as a weight",
    ),
    (
        "17",
        "merge_with_sink",
        """
def merge_with_sink(partial_out, partial_lse, sink):  # the sink forgotten
    w = np.exp(partial_lse - partial_lse.max(axis=0))
    return np.einsum("ph,phd->hd", w, partial_out) / w.sum(axis=0)[:, None]
""",
        "the sink forgotten",
    ),
    (
        "17",
        "merge_with_sink",
        """
def merge_with_sink(partial_out, partial_lse, sink):  # the sink inside every split
    m = np.maximum(partial_lse.max(axis=0), sink)
    w = np.exp(partial_lse - m)
    denominator = w.sum(axis=0) + len(partial_lse) * np.exp(sink - m)
    return np.einsum("ph,phd->hd", w, partial_out) / denominator[:, None]
""",
        "the sink counted in every split",
    ),
    (
        "17",
        "merge_with_sink",
        """
def merge_with_sink(partial_out, partial_lse, sink):  # no maximum subtracted
    w = np.exp(partial_lse)
    denominator = w.sum(axis=0) + np.exp(sink)
    return np.einsum("ph,phd->hd", w, partial_out) / denominator[:, None]
""",
        "no maximum subtracted",
    ),
    (
        "17",
        "merge_with_sink",
        """
def merge_with_sink(partial_out, partial_lse, sink):  # the lse shifted, the sink not
    w = np.exp(partial_lse - partial_lse.max(axis=0))
    denominator = w.sum(axis=0) + np.exp(sink)
    return np.einsum("ph,phd->hd", w, partial_out) / denominator[:, None]
""",
        "the sink not shifted",
    ),
    (
        "17",
        "merge_with_sink",
        """
def merge_with_sink(partial_out, partial_lse, sink):  # the splits averaged
    return partial_out.mean(axis=0)
""",
        "the splits' outputs averaged",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # the window unbounded
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "the window counted as unbounded",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # always W
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else layer["window"]
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "the window always full",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # W + 1
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"] + 1)
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "a window of W + 1 tokens",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # W - 1
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"] - 1)
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "a window of W - 1 tokens",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # K only
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"])
            total += 1 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "K or V only",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # the state per token
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"] * seq_len
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"])
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "the state counted per token",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # the state as K and V
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += 2 * layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"])
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "the state counted twice",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # the state forgotten
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += 0
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"])
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * bytes_per_element
""",
        "the linear layers' state forgotten",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):  # elements
    total = 0
    for layer in layers:
        if layer["kind"] == "linear":
            total += layer["state_elements"]
        else:
            held = seq_len if layer["kind"] == "full" else min(seq_len, layer["window"])
            total += 2 * layer["num_kv_heads"] * layer["head_dim"] * held
    return total * 1
""",
        "elements, not bytes",
    ),
]


# chapter 11's kernels, run under Triton's interpreter as they are graded
_REDUCE = """
@triton.jit
def reduce_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
    split_mask = splits < num_splits
    lse = tl.load(partial_lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    partial = tl.load(
        partial_out_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None], other=0.0,
    )
    tl.store(out_ptr + row * HEAD_DIM + dims, OUT)
"""
_DECODE = """
@triton.jit
def masked_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, seq_len, scale, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + dims)
    m, l = float("-inf"), 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < seq_len
        k = tl.load(k_ptr + tokens[:, None] * HEAD_DIM + dims[None, :]MASK)
        v = tl.load(v_ptr + tokens[:, None] * HEAD_DIM + dims[None, :]MASK)
        scores = SCORES
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha, p = tl.exp(m - m_new), tl.exp(scores - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + dims, acc / l)
"""
_MASKED, _SCORES = ", mask=valid[:, None], other=0.0", "tl.sum(q[None, :] * k, axis=1) * scale"
TRITON_MISTAKES = [
    (
        "11",
        "reduce_kernel",
        _REDUCE.replace("OUT", "tl.sum(partial, axis=0) / num_splits"),
        "the splits' outputs averaged",
    ),
    (
        "11",
        "reduce_kernel",
        _REDUCE.replace("OUT", "tl.sum(weights[:, None] * partial, axis=0)"),
        "the weighted sum not normalised",
    ),
    (
        "11",
        "masked_decode_kernel",
        _DECODE.replace("MASK", _MASKED).replace("SCORES", _SCORES),
        "the loads masked, not the scores",
    ),
    (
        "11",
        "masked_decode_kernel",
        _DECODE.replace("MASK", "").replace("SCORES", _SCORES),
        "the last tile not masked",
    ),
    (
        "11",
        "masked_decode_kernel",
        _DECODE.replace("MASK", _MASKED).replace(
            "SCORES", 'tl.where(valid, tl.sum(q[None, :] * k, axis=1), float("-inf"))'
        ),
        "the scores not multiplied by `scale`",
    ),
]
ALL_MISTAKES = MISTAKES + TRITON_MISTAKES


def _skip_without_triton(chapter: str) -> None:
    if chapter == "11":
        from kvlib.kernels import triton_available  # sets TRITON_INTERPRET before Triton loads

        if not triton_available():
            pytest.skip("chapter 11's kernels need Triton")


@pytest.mark.parametrize(
    "chapter, question, source, hint",
    ALL_MISTAKES,
    ids=[f"{c}-{q}-{i}" for i, (c, q, _, _) in enumerate(ALL_MISTAKES)],
)
def test_a_mistaken_answer_gets_its_hint(chapter, question, source, hint):
    _skip_without_triton(chapter)
    passed, message = _grade(chapter, question, source)
    assert not passed, f"the mistaken {question} passed"
    assert "your answer matches a common mistake" in message and hint in message, message


MISTAKE_DRAWS = 30
# returns the values it was given: where a random case's keys come out right, it fails for
# returning its argument, before any value is compared
_NOT_ON_VALUES = {"reorder_for_beams"}


@pytest.mark.parametrize(
    "chapter, question, source, hint",
    [m for m in ALL_MISTAKES if m[1] not in _NOT_ON_VALUES],
    ids=[f"{c}-{q}-{i}" for i, (c, q, _, _) in enumerate(ALL_MISTAKES) if q not in _NOT_ON_VALUES],
)
def test_a_mistaken_answer_is_named_on_random_cases(chapter, question, source, hint):
    """The random cases alone, MISTAKE_DRAWS runs: wherever the mistaken answer fails, a mistake
    is named (its own, or one giving the same answer on that case): each table computes its
    mistakes as a learner's code does, on any input, not only on the fixed cases."""
    _skip_without_triton(chapter)
    for seed in range(MISTAKE_DRAWS):
        passed, message = _grade(chapter, question, source, seed, draws_only=True)
        assert passed or "your answer matches a common mistake" in message, message


@pytest.mark.parametrize("question", sorted({(c, q) for c, q, _, _ in ALL_MISTAKES}),
                         ids=lambda q: f"{q[0]}-{q[1]}")  # fmt: skip
def test_the_official_solution_still_passes(question):
    """3 runs with the fixed cases: the solution passes, so no mistake is ever named for it. Its
    random cases alone are tests/test_grading_draws.py's (`make solution-draws`, run by CI): the
    same call (`run_question(..., draws_only=True)` on the solution's namespace, in the test's
    process) for seeds 0-499 of every question, these questions' included, so they are not drawn
    again here (they were seeds 0-199, about 40 s of CPU)."""
    chapter, question_id = question
    _skip_without_triton(chapter)
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
    assert matching_mistake({"a": [1, 2]}, {"dict": lambda: {"a": (1, 2)}}) == "dict"
    assert matching_mistake({"a": 1}, {"keys": lambda: {"b": 1}}) is None
    # a mistake whose answer is the right one on these inputs is not named (here 2.0 fails an int
    # check, and equals 2 within the tolerance)
    assert matching_mistake(2.0, {"two": lambda: 2}, expected=2) is None
    assert matching_mistake(3, {"three": lambda: 3}, expected=2) == "three"


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
    (
        "16",
        "greedy_accept",
        """
_solved_greedy_accept = greedy_accept
def greedy_accept(draft, target_logits):
    accepted, token = _solved_greedy_accept(draft, target_logits)
    return np.int64(accepted), np.int64(token)
""",
    ),
    (
        "16",
        "rejection_sample",
        """
_solved_rejection_sample = rejection_sample
def rejection_sample(draft, q, p, uniforms):
    accepted, distribution = _solved_rejection_sample(draft, q, p, uniforms)
    return np.int64(accepted), distribution
""",
    ),
    (
        "16",
        "rollback_blocks",
        """
_solved_rollback_blocks = rollback_blocks
def rollback_blocks(block_table, new_len, block_size, ref_cnt):
    kept, freed, copy = _solved_rollback_blocks(block_table, new_len, block_size, ref_cnt)
    return [np.int64(b) for b in kept], [np.int64(b) for b in freed], np.bool_(copy)
""",
    ),
    (
        "17",
        "ring_slots",
        """
def ring_slots(num_positions, window):
    first = max(0, num_positions - window)
    return [np.int64(p) % window for p in range(first, num_positions)]
""",
    ),
    (
        "17",
        "freeable_blocks",
        """
def freeable_blocks(num_positions, window, block_size, sink_tokens=0):
    first = -(-sink_tokens // block_size)
    return np.arange(first, (num_positions - window + 1) // block_size, dtype=np.int32)
""",
    ),
    (
        "17",
        "hybrid_cache_bytes",
        """
_solved_hybrid_cache_bytes = hybrid_cache_bytes
def hybrid_cache_bytes(layers, seq_len, bytes_per_element):
    return np.int64(_solved_hybrid_cache_bytes(layers, seq_len, bytes_per_element))
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


def test_the_written_out_rules_match_kvlibs_oracles():
    """The mistakes of chapters 7, 12 and 14 switch parts of a rule written out in the check: with
    nothing switched, it is kvlib's own answer (its BlockManager, its TieredStore)."""
    from kvlib.course.checks import ch07, ch14

    rng = np.random.default_rng(0)
    for _ in range(300):
        block_size = int(rng.choice([1, 2, 3, 4]))
        earlier = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(0, 20)))]
        cached = set(ch07.chained_block_hashes(earlier, block_size))
        shared = earlier[: int(rng.integers(0, len(earlier) + 1))]
        tokens = shared + [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 9)))]
        assert ch07.prefix_hit(tokens, cached, block_size) == ch07.cached_prefix_tokens(
            tokens, cached, block_size
        ), (tokens, block_size)
    for _ in range(300):
        host, disk, operations, _ = ch14._random_lru_case(rng)
        assert ch14._lru_written(host, disk, operations) == ch14._lru(host, disk, operations)


def test_chapter_16s_written_out_rules_match_kvlibs_oracles():
    """Chapter 16's mistakes switch parts of a rule written out in the check: with nothing
    switched, it is kvlib's own answer (greedy_accept; BlockManager.truncate and free, through a
    pool set to the case's reference counts)."""
    from kvlib.course.checks import ch16, speculative_answers
    from kvlib.speculative.verify import greedy_accept

    rng = np.random.default_rng(0)
    for _ in range(300):
        draft, logits, _ = ch16._random_greedy_case(rng)
        chosen = logits.argmax(dim=-1).tolist()
        assert speculative_answers.greedy(draft, chosen) == greedy_accept(draft, logits), (
            draft,
            logits,
        )
        case = ch16._random_rollback_case(rng)[:4]
        assert speculative_answers.rollback_formula(*case) == ch16._rollback(*case), case


def test_chapter_16s_rejection_oracle_replays_kvlibs_speculative_accept():
    """rejection_sample's oracle, given the uniforms kvlib's `speculative_accept` draws, accepts
    as many tokens as kvlib does, and kvlib's next token is the one the same generator draws from
    the oracle's distribution: the question grades kvlib's rule, with its draws written out."""
    import torch

    from kvlib.course.checks import ch16, speculative_answers
    from kvlib.speculative.verify import speculative_accept

    rng = np.random.default_rng(16)
    for seed in range(300):
        draft, q, p, _, _ = ch16._random_rejection_case(rng)
        accepted, token = speculative_accept(draft, q, p, torch.Generator().manual_seed(seed))
        replay, uniforms = torch.Generator().manual_seed(seed), []
        for i, x in enumerate(draft):  # kvlib's draws, one a position until a rejection
            uniforms.append(float(torch.rand((), generator=replay, dtype=torch.float64)))
            if uniforms[-1] * q[i, x] > p[i, x]:
                break
        uniforms += [0.0] * (len(draft) - len(uniforms))  # unused after a rejection
        expected, distribution = speculative_answers.rejection(draft, q, p, uniforms)
        assert accepted == expected, (seed, draft, uniforms)
        assert token == int(torch.multinomial(distribution, 1, generator=replay)), seed


def test_chapter_17s_oracles_match_kvlibs():
    """Chapter 17's oracles, written out from their definitions, against kvlib's own code: the
    ring's read order against `RingCache`'s slots, the freeable blocks against the model's
    visibility rule (`kvlib.ops.attention.visible`), the sink softmax against
    `kvlib.ref.attention.attention_weights(sinks=)`, the merged split-K partials against attention
    over all the keys, and the hybrid bytes against `kvlib.memory.kv_cache_bytes` on shipped
    configs; with nothing switched, each mistake table's formula is the oracle."""
    import torch

    from kvlib.cache.ring import RingCache
    from kvlib.config import attention_geometry, load_config
    from kvlib.course.checks import ch17
    from kvlib.course.checks import windows_answers as answers
    from kvlib.memory import kv_cache_bytes
    from kvlib.memory.layers import layer_specs
    from kvlib.ops.attention import visible
    from kvlib.ref.attention import attention_weights

    rng = np.random.default_rng(17)
    for window in (1, 3, 4, 8):  # a ring whose keys are their positions
        ring = RingCache(1, window)
        for n in range(1, 3 * window + 2):
            position = torch.full((1, 1, 1, 1), float(n - 1))
            ring.update(0, position, position)
            ring.advance(1)
            held = ring.keys[0][0, 0, answers.ring_order(n, window), 0].tolist()
            assert held == [float(p) for p in range(max(0, n - window), n)], (n, window)
    for _ in range(300):
        n, window, block_size, sinks, _ = ch17._random_freeable_case(rng)
        later = torch.arange(n, n + window + block_size + 1)[:, None]  # the next queries
        freed = []
        for b in range(-(-n // block_size)):
            keys = torch.arange(b * block_size, (b + 1) * block_size)[None, :]
            if not visible(keys, later, window).any() and b * block_size >= sinks:
                freed.append(b)
        args = (n, window, block_size, sinks)
        assert answers.freeable(*args) == freed == answers.freeable_formula(*args), args
    for _ in range(200):
        heads, keys, dim = (int(x) for x in rng.integers(1, 7, size=3))
        q, k = rng.normal(size=(heads, 1, dim)) * 5, rng.normal(size=(heads, keys, dim)) * 5
        sink = rng.normal(size=heads) * 5
        scores = (q @ k.transpose(0, 2, 1))[:, 0] * dim**-0.5  # (H, S)
        reference = attention_weights(q, k, sinks=sink)[:, 0]
        np.testing.assert_allclose(answers.sink_softmax(scores, sink), reference, rtol=1e-12)
    for _ in range(200):
        partial_out, partial_lse, sink, _, exact = ch17._random_merge_case(rng)
        merged = answers.sink_merge(partial_out, partial_lse, sink)
        size = answers.sink_merge(np.abs(partial_out), partial_lse, sink)
        assert np.all(np.abs(merged - exact) <= 1e-12 * size + 1e-300)
    for name in ("gpt-oss-20b", "gemma-3-27b", "jamba-v0.1"):
        config = load_config(ROOT / "kvlib" / "configs" / f"{name}.json")
        kv_heads, head_dim, _ = attention_geometry(config, config["model_type"])
        layers = []
        for spec in layer_specs(config):
            if spec.state_elements:
                layers.append(ch17._linear(spec.state_elements))
            elif spec.kind == "sliding":
                layers.append(ch17._sliding(kv_heads, head_dim, spec.token_cap))
            else:
                layers.append(ch17._full(kv_heads, head_dim))
        written = {"gpt-oss-20b": ch17._gpt_oss, "gemma-3-27b": ch17._gemma3,
                   "jamba-v0.1": ch17._jamba}[name]()  # fmt: skip
        assert written == layers, name  # the fixed cases' layers are the configs'
        for seq_len in (1, 127, 128, 129, 1023, 1024, 1025, 131_072):
            expected = kv_cache_bytes(config, seq_len, cache_dtype="bfloat16")
            assert answers.hybrid_bytes(layers, seq_len, 2) == expected, (name, seq_len)
