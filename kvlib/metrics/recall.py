"""The course model's recall by distance (chapters 5, 6 and 8): a GET's value predicted from its
SET `distance` tokens earlier, every document streamed through any cache
(`kvlib.metrics.quality.streamed_logits`), and how many facts stand behind each distance's rate.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.metrics.quality import streamed_logits

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
