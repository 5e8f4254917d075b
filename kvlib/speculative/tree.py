"""Tree speculation: several candidates per position, verified in one forward (SpecInfer, Miao et
al., ASPLOS 2024; Medusa, Cai et al., ICML 2024).

A draft **tree** has the last emitted token (not yet in the cache) as its root and candidate
tokens as its other nodes, each with a parent. Its nodes are fed as one chunk in breadth-first
order (a parent before its children) with a **tree attention mask**: a node sees the cached
context, its ancestors and itself, never a sibling's branch; its RoPE position is the context's
length plus its depth. So the forward gives, at every node, the target's logits as if that node's
branch alone had been verified, and all branches cost one forward.

Greedy acceptance walks down from the root: at each node, the target's argmax is the next token;
if a child carries it, the walk moves there, else it stops and that argmax is the next token. The
accepted nodes' K/V sit at scattered positions of the chunk: `cache.move_tokens` moves them into
place behind the context, in order, and `cache.truncate` drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["accept_tree", "tree_attention_mask", "tree_depths", "verify_tree"]


def _check_parents(parents: Sequence[int]) -> list[int]:
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1:
        raise ValueError(f"parents: expected the root first, with parent -1, got {parents[:1]}")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(
                f"parents: expected node {i}'s parent among nodes 0..{i - 1} (breadth-first "
                f"order), got {p}"
            )
    return parents


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (the root's is 0), for `parents` (node i's parent index, -1 for the root
    at index 0, every parent before its children).

    Raises:
        ValueError: a first node that is not the root, or a parent at or after its child.
    """
    parents = _check_parents(parents)
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return depths


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:
    """(N, N) bool: entry [i, j] is True when node j is node i or one of its ancestors.

    Raises:
        ValueError: as `tree_depths`.
    """
    parents = _check_parents(parents)
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]  # a parent's row is complete before its children's
    return mask


def accept_tree(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor):
    """Greedy acceptance over a verified tree (see the module docstring).

    Args:
        tokens: the N nodes' token ids (node 0: the root, the last emitted token).
        parents: as `tree_depths`.
        logits: (N, V), the target's logits at every node.
    Returns:
        (path, next_token): the accepted nodes from the root down (node 0 first), and the target's
        argmax at the last of them.
    Raises:
        ValueError: lengths that disagree, or `parents` as `tree_depths` rejects.
    """
    parents = _check_parents(parents)
    if len(tokens) != len(parents) or logits.shape[0] != len(parents):
        raise ValueError(
            f"tokens, parents, logits: expected {len(parents)} nodes each, got {len(tokens)}, "
            f"{len(parents)} and {logits.shape[0]}"
        )
    children = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    chosen = logits.argmax(dim=-1).tolist()
    path = [0]
    while True:
        nxt = [c for c in children[path[-1]] if int(tokens[c]) == chosen[path[-1]]]
        if not nxt:
            return path, chosen[path[-1]]
        path.append(nxt[0])


def verify_tree(model, cache, tokens: Sequence[int], parents: Sequence[int]):
    """Verify a draft tree with one forward of `model` over `cache` (batch of one, the root not yet
    in the cache), keep the accepted branch's K/V behind the context and drop the rest.

    Returns:
        (accepted, next_token): the accepted draft tokens (the root excluded), and the target's
        next token after them.
    Raises:
        ValueError: as `accept_tree`; NotImplementedError: a cache that cannot roll back.
    """
    depths = tree_depths(parents)
    past, device = cache.length, model.lm_head.weight.device
    ids = torch.tensor([[int(t) for t in tokens]], device=device)
    positions = torch.tensor([[past + d for d in depths]], device=device)
    with torch.no_grad():
        logits = model(
            ids, cache=cache, position_ids=positions, tree_mask=tree_attention_mask(parents)
        )[0]
    path, next_token = accept_tree(tokens, parents, logits)
    cache.move_tokens([past + i for i in path], [past + j for j in range(len(path))])
    cache.truncate(past + len(path))
    return [int(tokens[i]) for i in path[1:]], next_token
