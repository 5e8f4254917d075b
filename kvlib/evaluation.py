"""Measuring what a cache technique costs in quality, on real text (chapters 5, 8, 10 and 12).

- `decode_logits`: teacher-forced decoding through any `kvlib.cache.KVCache`: prefill a prefix,
  then feed the text's true tokens one at a time, collecting each step's logits. Run it with the
  full cache and with a modified one (evicting, quantized, converted) on the same tokens.
- `agreement`: how far the modified run's next-token distributions are from the full cache's:
  top-1 agreement and the mean KL divergence KL(P_full || P_modified), in nats.
- `perplexity`: exp(mean next-token cross-entropy) of a model on a text, in one forward pass.
- `passkey_prompt`, `passkey_accuracy`: passkey retrieval, a needle in a haystack (Mohtashami &
  Jaggi, 2023, Landmark Attention; used by StreamingLLM, Xiao et al., 2024): a random number is
  hidden at a given depth of filler text and the model is asked for it, through the chat template.

Everything is deterministic: greedy decoding and seeded passkeys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvlib._validate import check_positive_int

__all__ = [
    "Agreement",
    "agreement",
    "course_text",
    "decode_logits",
    "passkey_accuracy",
    "passkey_prompt",
    "passkey_trial",
    "perplexity",
]

TEXTS_DIR = Path(__file__).with_name("texts")


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


FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def passkey_prompt(tokenizer, filler_tokens: int, depth: float, passkey: int) -> list[int]:
    """A chat prompt hiding `passkey` at relative `depth` (0 = start, 1 = end) of about
    `filler_tokens` tokens of repeated filler, then asking for it.

    Raises:
        ValueError: depth outside [0, 1], filler_tokens < 1, a passkey that is not a positive int.
    """
    check_positive_int("filler_tokens", filler_tokens)
    check_positive_int("passkey", passkey)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a number in [0, 1], got {depth!r}")
    sentence = tokenizer.encode(FILLER)
    filler = (sentence * (filler_tokens // len(sentence) + 1))[:filler_tokens]
    cut = int(round(depth * len(filler)))
    # cut at a sentence boundary, so the needle is its own sentence
    while 0 < cut < len(filler) and tokenizer.decode(filler[cut - 1 : cut]).strip() != ".":
        cut -= 1
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    text = tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:])
    question = "There is a pass key hidden in the text above. What is the pass key?"
    messages = [{"role": "user", "content": text + "\n\n" + question}]
    return tokenizer.apply_chat_template(messages)


@torch.no_grad()
def passkey_accuracy(
    model,
    tokenizer,
    filler_tokens: int,
    depths,
    *,
    trials_per_depth: int = 1,
    seed: int = 0,
    cache_factory=None,
    max_new_tokens: int = 10,
) -> float:
    """Fraction of passkey trials answered correctly (greedy; the 5-digit key appears in the
    answer), over `depths` x `trials_per_depth` seeded keys.

    Args:
        cache_factory: as `kvlib.generation.generate`'s `cache` (None: a dynamic cache), to test a
            modified cache.
    """

    rng = np.random.default_rng(seed)
    results = [
        passkey_trial(
            model,
            tokenizer,
            filler_tokens,
            depth,
            int(rng.integers(10_000, 100_000)),
            cache_factory=cache_factory,
            max_new_tokens=max_new_tokens,
        )
        for depth in depths
        for _ in range(check_positive_int("trials_per_depth", trials_per_depth))
    ]
    return sum(correct for correct, _ in results) / len(results)


@torch.no_grad()
def passkey_trial(
    model, tokenizer, filler_tokens, depth, passkey, *, cache_factory=None, max_new_tokens=10
) -> tuple[bool, int]:
    """One passkey trial: (whether the greedy answer contains the key, the prompt's length in
    tokens)."""
    from kvlib.generation import generate

    ids = torch.tensor([passkey_prompt(tokenizer, filler_tokens, depth, passkey)])
    out = generate(model, ids, max_new_tokens, cache=cache_factory or "dynamic")
    return str(passkey) in tokenizer.decode(out[0, ids.shape[1] :].tolist()), ids.shape[1]


PASSKEY_LENGTHS = (200, 320, 560, 1040)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def passkey_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Passkey retrieval of SmolLM2-135M-Instruct over `PASSKEY_LENGTHS` x `PASSKEY_DEPTHS`, one
    seeded key per cell; writes every trial to `out_csv` (the committed
    `results/passkey_smollm2.csv`, which a test spot-checks)."""
    import csv
    import datetime

    from tqdm import tqdm

    from kvlib.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    rng = np.random.default_rng(seed)
    rows = []
    cells = [(n, d) for n in PASSKEY_LENGTHS for d in PASSKEY_DEPTHS]
    for filler_tokens, depth in tqdm(cells, desc="passkey trials", unit="trial"):
        passkey = int(rng.integers(10_000, 100_000))
        correct, prompt_tokens = passkey_trial(model, tokenizer, filler_tokens, depth, passkey)
        rows.append(
            {
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
                "filler_tokens": filler_tokens,
                "depth": depth,
                "passkey": passkey,
                "prompt_tokens": prompt_tokens,
                "correct": correct,
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
            }
        )
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.evaluation", description="Quality sweeps on SmolLM2 (CPU)."
    )
    parser.add_argument("sweep", choices=["passkey"])
    parser.add_argument("--out", default="results/passkey_smollm2.csv")
    args = parser.parse_args()
    rows = passkey_sweep(args.out)
    print(f"wrote {len(rows)} trials to {args.out}: {sum(r['correct'] for r in rows)} correct")
