"""Numpy references: the math every faster path in kvlib is checked against, and chapter 1's toy.

- `attention`: softmax, causal masks, scaled dot-product attention, one cached decode step;
- `online_softmax`: the online-softmax recurrence, tiled and split-K attention, merging partials
  (chapter 4);
- `toy_model`, `toy_cache`, `toy_generation`, `op_counts`: chapter 1's toy decoder, its cache,
  naive vs cached generation, and the instrumentation that counts their work.

Numpy only: `import kvlib.ref` never imports torch.
"""
