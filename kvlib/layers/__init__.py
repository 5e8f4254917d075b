"""The model's layers: the Llama family's (`llama`: RMSNorm, RoPE, attention, SwiGLU MLP) and
DeepSeek-V2's multi-head latent attention beside them (`mla`)."""
