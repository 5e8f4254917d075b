"""Verification: which of the k drafted tokens the target model accepts, from the target's
distributions at the k + 1 positions one forward over `[last token, *draft]` scores.

Position i of that forward predicts the token after draft token i - 1 (position 0: after the last
accepted token), so its row checks draft token i; row k, reached only when every draft token is
accepted, gives a **bonus** token for free. A step therefore emits between 1 and k + 1 tokens.

- `greedy_accept`: keep draft token i while it equals the target's argmax at position i; then the
  target's argmax at the first mismatch (or the bonus). Greedy output is token-identical to plain
  greedy decoding.
- `speculative_accept`: the rejection rule of Leviathan et al. (ICML 2023, Algorithm 1) and Chen et
  al. (2023): accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection, sample from `residual_distribution(p_i, q_i)`, the normalised max(0, p_i - q_i); if
  all are accepted, sample the bonus from p_k. Every emitted token is then distributed exactly as
  the target p alone would sample it, whatever the draft distribution q.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["greedy_accept", "residual_distribution", "speculative_accept"]


def _check_rows(name: str, rows: torch.Tensor, num_rows: int) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != num_rows:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"{name}: expected a ({num_rows}, V) tensor, got {shape}")


def greedy_accept(draft: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of `draft` (k token ids) against `target_logits` (k + 1, V), the target's
    logits at the positions of `[last token, *draft]`.

    Returns:
        (accepted, next_token): how many leading draft tokens equal the target's argmax (0..k), and
        the target's argmax after them: at the first mismatch, or the bonus token at row k.

    Raises:
        ValueError: `target_logits` is not (len(draft) + 1, V).
    """
    draft = [int(t) for t in draft]
    _check_rows("target_logits", target_logits, len(draft) + 1)
    chosen = target_logits.argmax(dim=-1).tolist()  # (k + 1,)
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejected position resamples from: max(0, p - q), normalised (V,) float.

    Where p <= q everywhere (p == q: a rejection has probability 0), it returns p.

    Raises:
        ValueError: `p` and `q` are not 1-D of one length.
    """
    if p.dim() != 1 or p.shape != q.shape:
        raise ValueError(
            f"p, q: expected two (V,) distributions, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def speculative_accept(
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling's verification (see the module docstring).

    Args:
        draft: the k drafted token ids, token i sampled from `draft_probs[i]`.
        draft_probs: (k, V) float, the drafter's distributions q_i (after its temperature); a
            deterministic drafter's (prompt lookup) are one-hot rows, a point mass on x_i:
            x_i is then accepted with probability p_i(x_i), and the residual is p_i with x_i
            zeroed, renormalised.
        target_probs: (k + 1, V) float, the target's distributions p_i at the positions of
            `[last token, *draft]`, after the target's temperature: the draft must have been
            sampled at the same temperature rule the target uses, or the output is not p's.
        generator: the request's own generator (one per request keeps a request's draws
            independent of the batch it runs in); the draws run on its device (the CPU for
            None), the rows are moved there.

    Returns:
        (accepted, next_token): the number of leading draft tokens accepted (0..k) and the token
        after them: resampled from the residual at the first rejection, else the bonus from row k.

    Raises:
        ValueError: shapes other than (k, V) and (k + 1, V) with one V; a draft token outside
            [0, V) or of probability 0 under its row of `draft_probs`.
    """
    draft = [int(t) for t in draft]
    _check_rows("target_probs", target_probs, len(draft) + 1)
    _check_rows("draft_probs", draft_probs, len(draft))
    if draft and draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"draft_probs: expected V = {target_probs.shape[1]} columns (the target's), got "
            f"{draft_probs.shape[1]}"
        )
    # a few rows of V, drawn where the generator draws: on the CPU for a CPU generator (or none),
    # whatever the model's device; on a GPU for the engine's requests there (`generator_for`)
    device = torch.device("cpu") if generator is None else generator.device
    target_probs, draft_probs = target_probs.double().to(device), draft_probs.double().to(device)
    if any(
        not 0 <= t < target_probs.shape[1] or draft_probs[i, t] <= 0 for i, t in enumerate(draft)
    ):
        raise ValueError(
            f"draft: expected token ids that their draft_probs rows give a probability above 0 "
            f"(a token q could not draw means q is not the draft's distribution), got {draft}"
        )
    for i, token in enumerate(draft):
        p, q = target_probs[i, token], draft_probs[i, token]
        r = torch.rand((), generator=generator, dtype=torch.float64, device=device)
        if r * q > p:  # rejected: r >= p / q, written without dividing (q > 0 for a sampled token)
            residual = residual_distribution(target_probs[i], draft_probs[i])
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(draft), int(torch.multinomial(target_probs[len(draft)], 1, generator=generator))
