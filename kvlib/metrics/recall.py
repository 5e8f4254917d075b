"""The course model's recall by distance (chapters 5, 6, 8 and 15): a GET's value predicted from
its SET `distance` tokens earlier, every document streamed through any cache
(`kvlib.metrics.quality.streamed_logits`), per document (`recall_hits`) or pooled per distance,
and how many facts stand behind each distance's rate.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.metrics.quality import streamed_logits

RECALL_DISTANCES = (8, 32, 64, 128, 192, 240)  # the course model's evaluation distances


@torch.no_grad()
def recall_hits(
    model,
    distances=RECALL_DISTANCES,
    *,
    num_documents: int = 32,
    cache_factory=None,
    prefill_len: int = 1,
    seed: int = 7,
) -> dict[int, list[tuple[int, int]]]:
    """Per document, the facts the course model recalls (a GET's value predicted from its SET,
    `distance` tokens earlier) with every document streamed through a cache from `cache_factory`:
    what a bootstrap over documents needs (`kvlib.metrics.bootstrap.paired_cluster_bootstrap`).

    Args:
        distances: SET-to-GET distances, each < `kvlib.data.DOC_LEN`.
        num_documents: documents per distance (`kvlib.data.recall_documents`, up to 4 facts
            each); all distances run as one batch.
        cache_factory: factory(model, batch_size, max_seq_len) -> cache, as `generate`'s `cache`
            (None: the full cache, one forward).
        prefill_len: tokens prefilled before streaming (see `streamed_logits`).
    Returns:
        {distance: [(facts recalled, facts asked) for each document, in order]}.
    """
    from kvlib import data

    docs = {d: data.recall_documents(d, num_documents, seed) for d in distances}
    tokens = torch.from_numpy(np.stack([doc.tokens for d in distances for doc in docs[d]]))
    cache = None if cache_factory is None else cache_factory(model, *tokens.shape)
    predictions = streamed_logits(model, tokens, cache, prefill_len=prefill_len).argmax(-1)
    hits, row = {}, 0
    for d in distances:
        hits[d] = []
        for doc in docs[d]:
            recalled = [
                bool(predictions[row, p - 1] == tokens[row, p]) for p in doc.answer_positions
            ]
            hits[d].append((sum(recalled), len(recalled)))
            row += 1
    return hits


def recall_by_distance(model, distances=RECALL_DISTANCES, **options) -> dict[int, float]:
    """The course model's recall accuracy per distance: `recall_hits` (same arguments) pooled over
    each distance's documents. {distance: fraction of facts recalled}."""
    return {
        d: sum(h for h, _ in docs) / sum(n for _, n in docs)
        for d, docs in recall_hits(model, distances, **options).items()
    }


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
