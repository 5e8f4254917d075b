"""Measuring what a cache technique costs in quality, on real text (chapters 5, 8, 10 and 12).

- `decode_logits`: teacher-forced decoding through any `kvlib.cache.KVCache`: prefill a prefix,
  then feed the text's true tokens one at a time, collecting each step's logits. Run it with the
  full cache and with a modified one (evicting, quantized, converted) on the same tokens.
- `streamed_logits`: the same for a batch, every position's logits, fed one token (or one chunk)
  at a time after a prefill;
- `agreement`: how far the modified run's next-token distributions are from the full cache's:
  top-1 agreement and the mean KL divergence KL(P_full || P_modified), in nats.
- `perplexity`: exp(mean next-token cross-entropy) of a model on a text, in one forward pass.
- `wilson_interval`: the 95% interval of a success rate measured on few trials (5 passkeys, 98 to
  128 facts per recall distance, 424 positions of the essay).
- `course_text`: the texts shipped with kvlib (`kvlib/texts/`).

The course model's recall is `kvlib.metrics.recall`, passkey retrieval `kvlib.metrics.passkey`;
the sweeps that use them are in `kvlib.experiments`. Everything is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlib._validate import check_positive_int

TEXTS_DIR = Path(__file__).parents[1] / "texts"


def course_text(name: str = "kv_cache_essay") -> str:
    """A text shipped with kvlib (`kvlib/texts/NAME.txt`): prose written for this course, the same
    on every machine and downloaded at no run time.

    Raises:
        FileNotFoundError: no such text (the message lists the shipped ones).
    """
    path = TEXTS_DIR / f"{name}.txt"
    if not path.is_file():
        shipped = sorted(p.stem for p in TEXTS_DIR.glob("*.txt"))
        raise FileNotFoundError(f"name: no text {name!r}; shipped: {shipped}")
    return path.read_text()


def _check_ids(ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"ids: expected a (1, T) tensor of token ids, got {tuple(getattr(ids, 'shape', ()))}"
        )
    return ids


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, prefill_len: int, cache) -> torch.Tensor:
    """Teacher-forced decoding: prefill `ids[:, :prefill_len]` into `cache`, then feed each later
    token of `ids` one step at a time.

    Args:
        model: a `kvlib.model.LlamaModel`.
        ids: (1, T) int64 token ids.
        prefill_len: tokens prefilled at once, 1 <= prefill_len < T.
        cache: an empty `kvlib.cache.KVCache` (the full cache, or a modified one).
    Returns:
        (T - prefill_len + 1, V) float32: the logits that predict tokens prefill_len .. T (the
        last row predicts the token after the text).
    Raises:
        ValueError: bad shapes or a prefill length outside [1, T).
    """
    ids = _check_ids(ids)
    if not isinstance(prefill_len, int) or not 1 <= prefill_len < ids.shape[1]:
        raise ValueError(
            f"prefill_len: expected an int in [1, {ids.shape[1]}), got {prefill_len!r}"
        )
    rows = [model(ids[:, :prefill_len], cache=cache)[0, -1]]
    for t in range(prefill_len, ids.shape[1]):
        rows.append(model(ids[:, t : t + 1], cache=cache, validate=False)[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def streamed_logits(
    model, ids: torch.Tensor, cache, *, prefill_len: int = 1, chunk_size: int = 1
) -> torch.Tensor:
    """Teacher-forced logits for every position of a batch, streamed through `cache`: prefill
    `ids[:, :prefill_len]` in one forward, then feed the later tokens `chunk_size` at a time (1:
    one decode step per token), so that an evicting cache is in force after the prefill.

    Args:
        model: a `kvlib.model.LlamaModel`.
        ids: (B, T) int64 token ids, unpadded.
        cache: an empty `kvlib.cache.KVCache` (or None: one full forward, the reference).
        prefill_len: tokens prefilled at once, 1 <= prefill_len <= T.
        chunk_size: tokens per later forward (each chunk attends to the cache and causally to
            itself; an evicting cache evicts after each).
    Returns:
        (B, T, V) float32: row t predicts token t + 1.
    Raises:
        ValueError: ids that are not (B, T), a prefill length outside [1, T].
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"ids: expected a (B, T) tensor, got {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(prefill_len, int) or not 1 <= prefill_len <= ids.shape[1]:
        raise ValueError(
            f"prefill_len: expected an int in [1, {ids.shape[1]}], got {prefill_len!r}"
        )
    if cache is None:
        return model(ids)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    rows = [model(ids[:, :prefill_len], cache=cache)]
    for t in range(prefill_len, ids.shape[1], chunk_size):
        rows.append(model(ids[:, t : t + chunk_size], cache=cache, validate=False))
    return torch.cat(rows, dim=1)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (Wilson, 1927) of a success rate observed as `successes` of
    `trials` independent trials; z = 1.96 gives 95%. Unlike p ± z·sqrt(p(1 - p)/n), it stays
    inside [0, 1] and is not a single point at 0 or n successes (5 of 5: 0.57 to 1).

    Raises:
        ValueError: trials not a positive int, or successes not an int in [0, trials].
    """
    trials = check_positive_int("trials", trials)
    if (
        isinstance(successes, bool)
        or not isinstance(successes, int)
        or not 0 <= successes <= trials
    ):
        raise ValueError(f"successes: expected an int in [0, {trials}], got {successes!r}")
    p = successes / trials
    denominator = 1 + z**2 / trials
    center = (p + z**2 / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z**2 / (4 * trials**2)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """top1: fraction of positions whose argmax agrees; mean_kl: mean KL(P_ref || P) in nats;
    max_kl: the largest per-position KL; positions: how many were compared."""

    top1: float
    mean_kl: float
    max_kl: float
    positions: int


def agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Compare two (N, V) sets of next-token logits position by position.

    Raises:
        ValueError: shapes that differ or are not 2-D.
    """
    if reference_logits.dim() != 2 or reference_logits.shape != logits.shape:
        raise ValueError(
            "reference_logits, logits: expected two (N, V) tensors of one shape, got "
            f"{tuple(reference_logits.shape)} and {tuple(logits.shape)}"
        )
    reference = F.log_softmax(reference_logits.float(), dim=-1)
    other = F.log_softmax(logits.float(), dim=-1)
    kl = (reference.exp() * (reference - other)).sum(dim=-1).clamp(min=0)  # (N,)
    top1 = (reference.argmax(dim=-1) == other.argmax(dim=-1)).float().mean()
    return Agreement(float(top1), float(kl.mean()), float(kl.max()), reference.shape[0])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean cross-entropy of each token given those before it), over a (1, T) text."""
    ids = _check_ids(ids)
    if ids.shape[1] < 2:
        raise ValueError("ids: perplexity needs at least 2 tokens")
    logits = model(ids)[0, :-1]
    return float(torch.exp(F.cross_entropy(logits.float(), ids[0, 1:])))
