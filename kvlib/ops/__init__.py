"""Operators over stored keys and values: the attention backends the model's layers call.

- `attention`: dense backends (`reference`, `sdpa`) over `(B, H_kv, S, D)` keys and values;
- `kvlib.kernels`: the Triton paged decode kernel of chapter 11, with its reference.
"""
