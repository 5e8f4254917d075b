"""Instrumentation for chapter 1: the work a forward pass really does, counted as it runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OpCounts:
    """Work done by a forward pass, counted by instrumentation (not by formula).

    projected_rows: token rows pushed through a layer's projections (W_q, W_k, W_v, W_o), summed
        over layers: one per token per layer.
    score_entries: query-key dot products computed (entries of the score matrices), summed over
        layers.
    """

    projected_rows: int = 0
    score_entries: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(
            self.projected_rows + other.projected_rows, self.score_entries + other.score_entries
        )
