"""The model's layers: the Llama family's (`llama`: RMSNorm, RoPE, attention, SwiGLU MLP),
DeepSeek-V2's multi-head latent attention beside them (`mla`), and gated linear attention, the
layer of a hybrid model whose cache is a fixed-size recurrent state (`linear_attention`), and the
hybrid's per-layer kinds as modules (`hybrid`: the linear layer, a full layer among windowed
ones)."""
