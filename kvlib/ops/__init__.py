"""Operators over stored keys and values: the attention backends the model's layers call.

- `attention`: dense backends (`reference`, `sdpa`) over `(B, H_kv, S, D)` keys and values;
- `paged_prefill`: varlen attention of a step's new tokens over their own blocks of a paged
  cache, the torch reference (the engine's prefill rows, issue 36);
- `kvlib.kernels`: the Triton paged decode kernel of chapter 11, with its reference.
"""
