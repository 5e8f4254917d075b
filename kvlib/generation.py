"""Generation with a KV cache: greedy, temperature/top-k sampling, beam search; batches of prompts
of different lengths (left padding); chunked prefill; and the naive no-cache path to compare with.

`generate` prefills the prompts (in chunks if asked), then decodes one token per step per sequence,
feeding only the newest token and the attention mask. Beam search prefills each prompt once,
clones its cache into `num_beams` copies, and reorders the cache whenever beams are reordered or
pruned. No stopping criteria: every sequence gets exactly `max_new_tokens` (what the course's
comparisons need).
"""

from __future__ import annotations

import torch

from kvlib._validate import check_positive_int, same_device
from kvlib.cache import DynamicCache, PagedCache, StaticCache


def _new_cache(model, kind, batch_size: int, max_seq_len: int, num_copies: int, block_size: int):
    """A cache for `batch_size` prompts of up to `max_seq_len` tokens, each of which may be copied
    `num_copies` times (beams)."""
    if kind == "dynamic":
        return DynamicCache(model.config.num_hidden_layers)
    if kind == "static":
        return StaticCache.for_model(model, batch_size, max_seq_len)
    if kind == "paged":
        return PagedCache.for_model(
            model, batch_size * num_copies, max_seq_len, block_size=block_size
        )
    if callable(kind):
        return kind(model, batch_size, max_seq_len)
    raise ValueError(
        "cache: expected 'dynamic', 'static', 'paged' or a factory(model, batch_size, "
        f"max_seq_len), got {kind!r}"
    )


def _prefill(model, input_ids, attention_mask, cache, chunk_size):
    """Run the prompt through the model (in chunks of `chunk_size` tokens); return the last logits
    (B, V)."""
    if cache is None:
        return model(input_ids, attention_mask=attention_mask)[:, -1]
    t = input_ids.shape[1]
    chunk_size = t if chunk_size is None else chunk_size
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        logits = model(
            input_ids[:, start:end],
            cache=cache,
            attention_mask=attention_mask[:, :end],
            validate=False,  # the prompt was validated by `generate`
        )
    return logits[:, -1]


def _choose(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens: argmax at temperature 0, else sampled from the top k."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = True,
    cache: str = "dynamic",
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    num_beams: int = 1,
    num_samples: int = 1,
    prefill_chunk_size: int | None = None,
    block_size: int = 16,
) -> torch.Tensor:
    """Generate `max_new_tokens` tokens after each prompt.

    Args:
        model: a `kvlib.model.LlamaModel`.
        input_ids: (B, T) prompts, left-padded to one length.
        max_new_tokens: N >= 1.
        attention_mask: (B, T) 1 for prompt tokens, 0 for padding; default all 1.
        use_cache: False re-encodes the whole sequence every step (the naive path).
        cache: "dynamic" (torch.cat per step), "static" (preallocated, B x (T + N)), "paged"
            (`kvlib.cache.PagedCache`: blocks of `block_size` tokens, beams sharing blocks), or a
            callable `factory(model, batch_size, max_seq_len)` returning any
            `kvlib.cache.KVCache`.
        temperature: 0 for greedy; > 0 samples from softmax(logits / temperature).
        top_k: sample among the k most likely tokens only.
        generator: a torch.Generator, for reproducible sampling.
        num_beams: > 1 for beam search (greedy scoring by total log-probability).
        num_samples: > 1 for parallel sampling (vLLM's `n`): each prompt is prefilled once and
            decoded `num_samples` times; the samples start from copies of its cache (with
            `cache="paged"`, shared blocks, copied on write).
        prefill_chunk_size: prefill the prompt in chunks of this many tokens.
        block_size: token slots per block of the paged cache.
    Returns:
        (B * num_samples, T + N) int64: the prompts followed by the generated tokens; a prompt's
        samples are consecutive rows.
    Raises:
        ValueError, TypeError: bad sizes, ids outside the vocabulary, masks or options. The prompts
            are validated here, once; decode steps call the model with `validate=False`, so the
            loop pays no host sync for validation.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise TypeError(
            f"input_ids: expected a (B, T) tensor, got {type(input_ids).__name__} "
            f"{tuple(getattr(input_ids, 'shape', ()))}"
        )
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    num_beams = check_positive_int("num_beams", num_beams)
    num_samples = check_positive_int("num_samples", num_samples)
    if prefill_chunk_size is not None:
        check_positive_int("prefill_chunk_size", prefill_chunk_size)
    check_positive_int("block_size", block_size)
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    device = next(model.parameters()).device
    if generator is not None and not same_device(generator.device, device):  # multinomial refuses
        raise ValueError(
            f"generator: expected a torch.Generator on the model's device {device}, got one on "
            f"{generator.device}"
        )
    b, t = input_ids.shape
    vocab_size = model.config.vocab_size
    if t == 0 or input_ids.min() < 0 or input_ids.max() >= vocab_size:  # once, not per step
        raise ValueError(
            f"input_ids: expected 1+ ids in [0, {vocab_size}) per row, got shape {(b, t)}"
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != (b, t):
        raise ValueError(
            f"attention_mask: expected shape {(b, t)}, got {tuple(attention_mask.shape)}"
        )
    elif (attention_mask.sum(dim=1) == 0).any():
        raise ValueError("attention_mask: every prompt needs at least one real token")
    if num_beams > 1:
        if num_samples > 1:
            raise ValueError(
                f"num_samples: beam search returns one sequence per prompt; expected 1 with "
                f"num_beams={num_beams}, got {num_samples}"
            )
        if temperature != 0:
            raise ValueError(
                "temperature: beam search here is deterministic; use temperature=0 with num_beams "
                "> 1"
            )
        return _beam_search(
            model,
            input_ids,
            attention_mask,
            max_new_tokens,
            num_beams,
            use_cache,
            cache,
            prefill_chunk_size,
            block_size,
        )

    kv = (
        _new_cache(model, cache, b, t + max_new_tokens, num_samples, block_size)
        if use_cache
        else None
    )
    logits = _prefill(model, input_ids, attention_mask, kv, prefill_chunk_size)  # once per prompt
    tokens, mask = input_ids, attention_mask
    if num_samples > 1:  # (B * num_samples) sequences start from copies of each prompt's prefill
        if kv is not None:
            kv = kv.repeat(num_samples)
        logits = logits.repeat_interleave(num_samples, dim=0)
        tokens = tokens.repeat_interleave(num_samples, dim=0)
        mask = mask.repeat_interleave(num_samples, dim=0)
    for step in range(max_new_tokens):
        next_tokens = _choose(logits, temperature, top_k, generator)  # (B,)
        tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(next_tokens)[:, None]], dim=1)
        if step < max_new_tokens - 1:
            if kv is None:
                logits = model(tokens, attention_mask=mask, validate=False)[
                    :, -1
                ]  # naive: the whole sequence again
            else:
                logits = model(next_tokens[:, None], cache=kv, attention_mask=mask, validate=False)[
                    :, -1
                ]  # decode: the new token only
    return tokens


def _beam_search(
    model,
    input_ids,
    attention_mask,
    max_new_tokens,
    num_beams,
    use_cache,
    cache_kind,
    chunk_size,
    block_size,
):
    """Beam search by total log-probability; returns the best beam of each prompt (B, T + N)."""
    b, t = input_ids.shape
    kv = (
        _new_cache(model, cache_kind, b, t + max_new_tokens, num_beams, block_size)
        if use_cache
        else None
    )
    # (B, V): one prefill per prompt
    logits = _prefill(model, input_ids, attention_mask, kv, chunk_size)
    if kv is not None:
        kv = kv.repeat(num_beams)  # (B * beams) sequences share each prompt's prefill
    logprobs = logits.log_softmax(dim=-1).repeat_interleave(num_beams, dim=0)  # (B * beams, V)
    tokens = input_ids.repeat_interleave(num_beams, dim=0)
    mask = attention_mask.repeat_interleave(num_beams, dim=0)
    scores = torch.full((b, num_beams), float("-inf"), device=input_ids.device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    vocab = logits.shape[-1]
    for step in range(max_new_tokens):
        total = scores[:, :, None] + logprobs.view(b, num_beams, vocab)  # (B, beams, V)
        scores, flat = total.view(b, -1).topk(num_beams, dim=-1)  # (B, beams)
        origin = flat // vocab  # which beam each survivor extends
        # rows of the batch
        chosen = (torch.arange(b, device=flat.device)[:, None] * num_beams + origin).view(-1)
        next_tokens = (flat % vocab).view(-1)
        tokens = torch.cat([tokens[chosen], next_tokens[:, None]], dim=1)
        mask = torch.cat([mask[chosen], torch.ones_like(next_tokens)[:, None]], dim=1)
        if step < max_new_tokens - 1:
            if kv is None:
                logits = model(tokens, attention_mask=mask, validate=False)[:, -1]
            else:
                kv.reorder(chosen)  # the cache follows its beams
                logits = model(next_tokens[:, None], cache=kv, attention_mask=mask, validate=False)[
                    :, -1
                ]
            logprobs = logits.log_softmax(dim=-1)
    best = scores.argmax(dim=-1)  # (B,)
    return tokens.view(b, num_beams, -1)[torch.arange(b), best]
