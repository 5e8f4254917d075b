"""Measuring what a cache technique costs in quality, on real text (chapters 5, 8, 10 and 12).

- `decode_logits`: teacher-forced decoding through any `kvlib.cache.KVCache`: prefill a prefix,
  then feed the text's true tokens one at a time, collecting each step's logits. Run it with the
  full cache and with a modified one (evicting, quantized, converted) on the same tokens.
- `streamed_logits`: the same for a batch, every position's logits, fed one token (or one chunk)
  at a time after a prefill; `recall_by_distance`: the course model's SET/GET recall per distance,
  streamed through any cache (chapter 8's eviction policies);
- `agreement`: how far the modified run's next-token distributions are from the full cache's:
  top-1 agreement and the mean KL divergence KL(P_full || P_modified), in nats.
- `perplexity`: exp(mean next-token cross-entropy) of a model on a text, in one forward pass.
- `wilson_interval`: the 95% interval of a success rate measured on few trials (5 passkeys, 98 to
  128 facts per recall distance, 424 positions of the essay), and `recall_fact_counts`, the number
  of facts behind each recall distance's rate.
- `passkey_prompt`, `passkey_accuracy`: passkey retrieval, a needle in a haystack (Mohtashami &
  Jaggi, 2023, Landmark Attention; used by StreamingLLM, Xiao et al., 2024): a random number is
  hidden at a given depth of filler text and the model is asked for it, through the chat template.

`python -m kvlib.evaluation passkey|eviction|quant` runs the long sweeps whose results are
committed in `results/` (`passkey_smollm2.csv`; chapter 8's `eviction_sweep.csv`; chapter 10's
`quant_sweep.csv`). Everything is deterministic:
greedy decoding and seeded passkeys.
"""

from __future__ import annotations

import dataclasses
import math
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
    "recall_by_distance",
    "recall_fact_counts",
    "streamed_logits",
    "streamed_text_metrics",
    "wilson_interval",
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


RECALL_DISTANCES = (8, 32, 64, 128, 192, 240)  # the course model's evaluation distances


@torch.no_grad()
def recall_by_distance(
    model,
    distances=RECALL_DISTANCES,
    *,
    num_documents: int = 32,
    cache_factory=None,
    prefill_len: int = 1,
    seed: int = 7,
) -> dict[int, float]:
    """The course model's recall accuracy (a GET's value predicted from its SET, `distance` tokens
    earlier) per distance, with every document streamed through a cache from `cache_factory`.

    Args:
        distances: SET-to-GET distances, each < `kvlib.data.DOC_LEN`.
        num_documents: documents per distance (`kvlib.data.recall_documents`, 4 facts each); all
            distances run as one batch.
        cache_factory: factory(model, batch_size, max_seq_len) -> cache, as `generate`'s `cache`
            (None: the full cache, one forward).
        prefill_len: tokens prefilled before streaming (see `streamed_logits`).
    Returns:
        {distance: fraction of facts recalled}.
    """
    from kvlib import data

    docs = {d: data.recall_documents(d, num_documents, seed) for d in distances}
    tokens = torch.from_numpy(np.stack([doc.tokens for d in distances for doc in docs[d]]))
    cache = None if cache_factory is None else cache_factory(model, *tokens.shape)
    predictions = streamed_logits(model, tokens, cache, prefill_len=prefill_len).argmax(-1)
    recall, row = {}, 0
    for d in distances:
        hits = []
        for doc in docs[d]:
            hits += [bool(predictions[row, p - 1] == tokens[row, p]) for p in doc.answer_positions]
            row += 1
        recall[d] = sum(hits) / len(hits)
    return recall


def recall_fact_counts(
    distances=RECALL_DISTANCES, *, num_documents: int = 32, seed: int = 7
) -> dict[int, int]:
    """How many facts `recall_by_distance` scores at each distance (same documents): a 256-token
    document holds fewer than 4 facts whose SET and GET are far apart, so the longest distances
    rest on fewer facts. {distance: number of facts}."""
    from kvlib import data

    return {
        d: sum(len(doc.answer_positions) for doc in data.recall_documents(d, num_documents, seed))
        for d in distances
    }


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
    prefill_chunk_size: int | None = None,
) -> float:
    """Fraction of passkey trials answered correctly (greedy; the 5-digit key appears in the
    answer), over `depths` x `trials_per_depth` seeded keys.

    Args:
        cache_factory: as `kvlib.generation.generate`'s `cache` (None: a dynamic cache), to test a
            modified cache.
        prefill_chunk_size: prefill the prompt in chunks of this many tokens (an evicting cache
            then evicts while it reads the haystack, not only after it).
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
            prefill_chunk_size=prefill_chunk_size,
        )
        for depth in depths
        for _ in range(check_positive_int("trials_per_depth", trials_per_depth))
    ]
    return sum(correct for correct, _ in results) / len(results)


@torch.no_grad()
def passkey_trial(
    model,
    tokenizer,
    filler_tokens,
    depth,
    passkey,
    *,
    cache_factory=None,
    max_new_tokens=10,
    prefill_chunk_size=None,
) -> tuple[bool, int]:
    """One passkey trial: (whether the greedy answer contains the key, the prompt's length in
    tokens)."""
    from kvlib.generation import generate

    ids = torch.tensor([passkey_prompt(tokenizer, filler_tokens, depth, passkey)])
    out = generate(
        model,
        ids,
        max_new_tokens,
        cache=cache_factory or "dynamic",
        prefill_chunk_size=prefill_chunk_size,
    )
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


def _policies(snapkv_window: int) -> dict:
    """The sweep's policies, by label: fresh instances (a policy may hold state such as a seed)."""
    from kvlib.cache import evicting as ev

    return {
        "StreamingLLM": lambda: (ev.StreamingLLM(4), "original"),
        "StreamingLLM, cache positions": lambda: (ev.StreamingLLM(4), "cache"),
        "window only": lambda: (ev.StreamingLLM(0), "original"),
        "H2O": lambda: (ev.H2O(), "original"),
        "H2O, normalized": lambda: (ev.H2O(normalize=True), "original"),
        "TOVA": lambda: (ev.TOVA(), "original"),
        "SnapKV": lambda: (ev.SnapKV(snapkv_window, 7), "original"),
        "random": lambda: (ev.RandomEviction(0), "original"),
    }


EVICTION_RECALL_BUDGETS = (32, 64, 128)  # of the course model's 256-token documents
EVICTION_PASSKEY_BUDGETS = (64, 128, 256)  # of SmolLM2's 613-token passkey prompts
EVICTION_TEXT_BUDGETS = (48, 64, 128, 256)  # of the 440-token essay (SnapKV needs > 32)
EVICTION_PASSKEY_FILLER = 560
EVICTION_CHUNK = 32  # passkey prompts are prefilled in chunks of this many tokens
TEXT_CHUNK = 16  # the essay is streamed in chunks of this many tokens after a 16-token prefill


def eviction_factory(label: str, budget: int | None, *, snapkv_window: int = 32):
    """The `cache=` factory for sweep policy `label` (see `_policies`) at `budget` (None or
    "full": no eviction)."""
    from kvlib.cache.evicting import EvictingCache, StreamingLLM

    if label == "full" or budget is None:
        return EvictingCache.factory(StreamingLLM(), None)
    policy, positions = _policies(snapkv_window)[label]()
    return EvictingCache.factory(policy, budget, positions=positions)


def streamed_text_metrics(model, ids, cache, *, reference=None) -> dict:
    """A (1, T) text streamed through `cache` (prefill `TEXT_CHUNK` tokens, then chunks of
    `TEXT_CHUNK`): its perplexity, and the top-1 agreement and mean KL (nats) of its next-token
    distributions after the prefill against the full cache's.

    Args:
        cache: an empty cache (an evicting one, say).
        reference: the full cache's (1, T, V) logits, if already computed (else one forward).
    """
    reference = streamed_logits(model, ids, None) if reference is None else reference
    logits = streamed_logits(model, ids, cache, prefill_len=TEXT_CHUNK, chunk_size=TEXT_CHUNK)
    ppl = float(torch.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:])))
    a = agreement(reference[0, TEXT_CHUNK:], logits[0, TEXT_CHUNK:])
    return {"perplexity": ppl, "top1_agreement": a.top1, "mean_kl": a.mean_kl}


def eviction_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Chapter 8's sweep (about 13 minutes on a 2-core laptop CPU): every policy at every budget, on

    - the course model's recall by distance (`recall_by_distance`, 32 documents per distance,
      streamed one token at a time; SnapKV's window is 8 here, since 32 would fill the smallest
      budget);
    - SmolLM2's passkey retrieval (filler `EVICTION_PASSKEY_FILLER`, five depths, one seeded key
      per depth, prefill in chunks of `EVICTION_CHUNK`);
    - SmolLM2 on the course essay: perplexity, agreement and KL with the full cache.

    Writes one row per measurement to `out_csv` (the committed `results/eviction_sweep.csv`,
    which a test spot-checks)."""
    labels = list(_policies(32))
    jobs = [("recall", "full", None)] + [
        ("recall", label, b) for b in EVICTION_RECALL_BUDGETS for label in labels
    ]
    jobs += [("passkey", "full", None)] + [
        ("passkey", label, b)
        for b in EVICTION_PASSKEY_BUDGETS
        for label in labels
        if label not in ("StreamingLLM, cache positions", "H2O, normalized")
    ]
    jobs += [("text", label, b) for b in EVICTION_TEXT_BUDGETS for label in labels]

    def factory(task, label, budget):
        return eviction_factory(label, budget, snapkv_window=8 if task == "recall" else 32)

    return _run_sweep(out_csv, jobs, "eviction sweep", factory, seed)


SWEEP_FIELDS = ["model", "task", "policy", "budget", "x", "metric", "value", "torch", "date"]


KIVI_GROUP = 32  # G: KIVI's group size (Liu et al., 2024), tokens per key scale, channels per value
KIVI_RESIDUAL = 128  # R: KIVI's residual length in its experiments
QUANT_RESIDUALS = (0, 16, 32, 64, KIVI_RESIDUAL)  # the R sweep, for 2-bit KIVI


def quant_schemes() -> dict:
    """Chapter 10's schemes, by label: (key scheme, value scheme) for `QuantizedCache`."""
    from kvlib.quant import QuantScheme as Q

    g = KIVI_GROUP

    def per_token(fmt, symmetric=True):
        return Q(fmt, symmetric, "channels")

    return {
        "int8 per-token": (per_token("int8"), per_token("int8")),
        "fp8 e4m3 per-token": (per_token("fp8_e4m3fn"), per_token("fp8_e4m3fn")),
        "fp8 e5m2 per-token": (per_token("fp8_e5m2"), per_token("fp8_e5m2")),
        "int4 per-token": (per_token("int4", False), per_token("int4", False)),
        "int4 KIVI": (Q("int4", False, "tokens", g), Q("int4", False, "channels", g)),
        "int2 per-token": (per_token("int2", False), per_token("int2", False)),
        "int2 KIVI": (Q("int2", False, "tokens", g), Q("int2", False, "channels", g)),
    }


def quant_factory(label: str, residual_length: int = 0):
    """The `cache=` factory for chapter 10's scheme `label` (see `quant_schemes`; "full": the
    dynamic cache) with a full-precision residual of `residual_length` tokens."""
    from kvlib.cache.quantized import QuantizedCache

    if label == "full":
        return "dynamic"
    key, value = quant_schemes()[label]
    return QuantizedCache.factory(key, value, residual_length=residual_length)


def quant_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Chapter 10's sweep (about 12 minutes on a 2-core laptop CPU): every scheme of
    `quant_schemes` with no residual, and 2-bit KIVI at every residual length of
    `QUANT_RESIDUALS`, on the course model's recall by distance (32 documents per distance,
    streamed a token at a time), SmolLM2's passkey (as chapter 8's sweep) and SmolLM2 on the
    course essay (perplexity, agreement and KL with the full cache). Rows as `eviction_sweep`'s,
    `policy` holding the scheme and `budget` the residual length; written to `out_csv` (the
    committed `results/quant_sweep.csv`, which a test spot-checks)."""
    runs = [("full", 0)] + [(label, 0) for label in quant_schemes()]
    runs += [("int2 KIVI", r) for r in QUANT_RESIDUALS if r]
    jobs = [(task, label, r) for label, r in runs for task in ("recall", "text", "passkey")]
    return _run_sweep(
        out_csv, jobs, "quantization sweep", lambda task, label, r: quant_factory(label, r), seed
    )


def _run_sweep(out_csv, jobs, desc, factory_for, seed) -> list[dict]:
    """Run each (task, label, parameter) of `jobs` through the cache factory
    `factory_for(task, label, parameter)` (see `_task_rows`) and write one row per measurement
    to `out_csv` as it goes (a crash keeps the rows so far). `parameter` fills the CSV's `budget`
    column (None: empty)."""
    import csv
    import datetime

    from tqdm import tqdm

    from kvlib.smollm2 import load_smollm2
    from kvlib.train import load_course_model

    course, (smol, tokenizer) = load_course_model(), load_smollm2()
    essay = torch.tensor([tokenizer.encode(course_text())])
    essay_reference = streamed_logits(smol, essay, None)  # the full cache's logits, once
    rng = np.random.default_rng(seed)
    passkeys = {d: int(rng.integers(10_000, 100_000)) for d in PASSKEY_DEPTHS}
    models = (course, smol, tokenizer, (essay, essay_reference), passkeys)
    rows = []
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SWEEP_FIELDS)
        writer.writeheader()
        for task, label, parameter in tqdm(jobs, desc=desc, unit="run"):
            factory = factory_for(task, label, parameter)
            for x, metric, value in _task_rows(models, task, factory):
                rows.append(
                    {
                        "model": "course model" if task == "recall" else "SmolLM2-135M-Instruct",
                        "task": task,
                        "policy": label,
                        "budget": "" if parameter is None else parameter,
                        "x": x,
                        "metric": metric,
                        "value": value,
                        "torch": torch.__version__,
                        "date": datetime.date.today().isoformat(),
                    }
                )
                writer.writerow(rows[-1])
            f.flush()
    return rows


def _task_rows(models, task, factory) -> list[tuple]:
    """One sweep run: (x, metric, value) rows of `task` ("recall", "passkey" or "text") with
    caches from `factory` (a `generate` `cache=` factory, or "dynamic": the full cache).
    `models`: (course model, SmolLM2, its tokenizer, (essay ids, the full cache's logits),
    {depth: passkey})."""
    course, smol, tokenizer, (ids, reference), passkeys = models
    if task == "recall":
        cache_factory = None if factory == "dynamic" else factory
        return [
            (d, "recall", value)
            for d, value in recall_by_distance(course, cache_factory=cache_factory).items()
        ]
    if task == "passkey":
        rows = []
        for depth, key in passkeys.items():
            correct, _ = passkey_trial(
                smol,
                tokenizer,
                EVICTION_PASSKEY_FILLER,
                depth,
                key,
                cache_factory=factory,
                prefill_chunk_size=EVICTION_CHUNK,
            )
            rows.append((depth, "correct", int(correct)))
        return rows
    if factory == "dynamic":
        from kvlib.cache import DynamicCache

        cache = DynamicCache(smol.config.num_hidden_layers)
    else:
        cache = factory(smol, *ids.shape)
    metrics = streamed_text_metrics(smol, ids, cache, reference=reference)
    return [("", m, v) for m, v in metrics.items()]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.evaluation", description="Quality sweeps on SmolLM2 (CPU)."
    )
    parser.add_argument("sweep", choices=["passkey", "eviction", "quant"])
    parser.add_argument("--out", help="the CSV to write (default: the committed one)")
    args = parser.parse_args()
    if args.sweep == "passkey":
        out = args.out or "results/passkey_smollm2.csv"
        rows = passkey_sweep(out)
        print(f"wrote {len(rows)} trials to {out}: {sum(r['correct'] for r in rows)} correct")
    elif args.sweep == "eviction":
        out = args.out or "results/eviction_sweep.csv"
        rows = eviction_sweep(out)
        print(f"wrote {len(rows)} measurements to {out}")
    else:
        out = args.out or "results/quant_sweep.csv"
        rows = quant_sweep(out)
        print(f"wrote {len(rows)} measurements to {out}")
