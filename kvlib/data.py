"""The course model's corpus: synthetic, deterministic, generated offline from a seed.

Each document is `DOC_LEN` tokens that exercise what KV-cache chapters need to measure:

- **local structure**: filler "words" follow a fixed sparse Markov chain (each word has four
  likely successors), so the next token is predictable from the last one;
- **copying**: a span of filler reappears later in the document, so induction (find the earlier
  occurrence, copy what followed) pays;
- **long-range key/value recall**: `SET k v` facts stored early and `GET k` queries later, at
  controlled distances, whose answer `v` can only come from the cached keys/values of the SET:
  the needle-in-a-haystack test that eviction, quantization and GQA conversion are judged by.

Everything is drawn with numpy's PCG64 generator from explicit seeds; the numbers depend on the
pinned numpy version only. What it deliberately is not: natural language.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlib._validate import check_positive_int

PAD, BOS, SET, GET = 0, 1, 2, 3
KEYS = np.arange(8, 40)  # 32 key tokens
VALUES = np.arange(40, 72)  # 32 value tokens
WORDS = np.arange(72, 128)  # 56 filler words
VOCAB_SIZE = 128
DOC_LEN = 256
GRAMMAR_SEED = 1234
SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.15, 0.05])


def token_name(token: int) -> str:
    """A readable name: PAD, BOS, SET, GET, k12, v7, w30."""
    token = int(token)
    specials = {PAD: "PAD", BOS: "BOS", SET: "SET", GET: "GET"}
    if token in specials:
        return specials[token]
    if KEYS[0] <= token <= KEYS[-1]:
        return f"k{token - KEYS[0]}"
    if VALUES[0] <= token <= VALUES[-1]:
        return f"v{token - VALUES[0]}"
    if WORDS[0] <= token <= WORDS[-1]:
        return f"w{token - WORDS[0]}"
    return f"<{token}>"


def grammar() -> np.ndarray:
    """The filler's Markov chain: (len(WORDS), 4) successor word indices (fixed by GRAMMAR_SEED)."""
    rng = np.random.default_rng(GRAMMAR_SEED)
    return np.stack([rng.choice(len(WORDS), size=4, replace=False) for _ in WORDS])


_SUCCESSORS = grammar()


def filler(rng: np.random.Generator, length: int) -> np.ndarray:
    """`length` filler tokens following the Markov chain from a random first word."""
    words = np.empty(length, dtype=np.int64)
    words[0] = rng.integers(len(WORDS))
    choices = rng.choice(4, size=length, p=SUCCESSOR_PROBS)
    for i in range(1, length):
        words[i] = _SUCCESSORS[words[i - 1], choices[i]]
    return WORDS[words]


@dataclasses.dataclass
class Document:
    """tokens (DOC_LEN,); answer_positions: where a GET's value is predicted (the token at that
    index
    is the value, predicted from the logits at index - 1); distances: tokens from each SET's value
    to its GET's value; copy_positions: indices inside the repeated span (its second half)."""

    tokens: np.ndarray
    answer_positions: list[int]
    distances: list[int]
    copy_positions: list[int]


def make_document(
    rng: np.random.Generator,
    *,
    num_facts: int = 16,
    distance: int | None = None,
    copy_len: int = 16,
) -> Document:
    """One document: BOS, filler, a copied span, and `num_facts` SET/GET pairs.

    Args:
        num_facts: key/value facts (distinct keys).
        distance: if given, every GET is exactly this many tokens after its SET (else random).
        copy_len: length of the repeated span (0 for none).
    """
    tokens = np.concatenate([[BOS], filler(rng, DOC_LEN - 1)])
    used = np.zeros(DOC_LEN, dtype=bool)
    used[0] = True
    copy_positions = []
    if copy_len:
        source = int(rng.integers(1, DOC_LEN // 2 - copy_len))
        target = int(rng.integers(source + copy_len + 8, DOC_LEN - copy_len))
        tokens[target : target + copy_len] = tokens[source : source + copy_len]
        used[source : source + copy_len] = (
            True  # facts must overwrite neither the span nor its repeat
        )
        used[target : target + copy_len] = True
        copy_positions = list(range(target + copy_len // 2, target + copy_len))
    keys = rng.choice(KEYS, size=num_facts, replace=False)
    values = rng.choice(VALUES, size=num_facts)
    answers, distances = [], []
    for key, value in zip(keys, values):
        for _ in range(100):  # find free room for "SET k v" ... "GET k v"
            gap = distance if distance is not None else int(rng.integers(8, DOC_LEN - 8))
            start = int(rng.integers(1, DOC_LEN - gap - 2))
            spans = [(start, start + 3), (start + gap, start + gap + 3)]
            if spans[1][1] <= DOC_LEN and not any(used[a:b].any() for a, b in spans):
                break
        else:
            continue  # no room left: fewer facts in this document
        tokens[start : start + 3] = [SET, key, value]
        tokens[start + gap : start + gap + 3] = [GET, key, value]
        for a, b in spans:
            used[a:b] = True
        answers.append(start + gap + 2)
        distances.append(gap)
    return Document(tokens, answers, distances, copy_positions)


def make_drill(rng: np.random.Generator, *, num_facts: int = 10, length: int = 64) -> Document:
    """A short, dense recall drill: BOS, `num_facts` SETs, then their GETs in a shuffled order, then
    filler.

    The curriculum's first phase: recall is learned through a sudden phase change (the induction
    circuit forms), and short dense drills reach it in far fewer, cheaper steps than full documents.
    """
    keys = rng.choice(KEYS, size=num_facts, replace=False)
    values = rng.choice(VALUES, size=num_facts)
    order = rng.permutation(num_facts)
    head = (
        [BOS]
        + [t for k, v in zip(keys, values) for t in (SET, k, v)]
        + [t for i in order for t in (GET, keys[i], values[i])]
    )
    tokens = np.concatenate([head, filler(rng, length - len(head))])[:length].astype(np.int64)
    answers = [1 + 3 * num_facts + 3 * j + 2 for j in range(num_facts)]
    distances = [answers[j] - (1 + 3 * int(order[j]) + 2) for j in range(num_facts)]
    return Document(tokens, answers, distances, [])


def batches(seed: int, batch_size: int, num_batches: int | None = None, *, drill: bool = False):
    """Training batches (batch_size, length) int64 of documents (or drills) drawn with `seed`
    (endless if num_batches is None)."""
    rng = np.random.default_rng(check_positive_int("seed", seed, allow_zero=True))
    batch_size = check_positive_int("batch_size", batch_size)
    produced = 0
    while num_batches is None or produced < num_batches:
        yield np.stack(
            [(make_drill(rng) if drill else make_document(rng)).tokens for _ in range(batch_size)]
        )
        produced += 1


def recall_documents(distance: int, num_documents: int, seed: int = 7) -> list[Document]:
    """Documents whose facts are all exactly `distance` tokens apart (4 facts each), for recall-vs-
    distance."""
    rng = np.random.default_rng(seed + 1000 * distance)
    return [make_document(rng, num_facts=4, distance=distance) for _ in range(num_documents)]
