"""Converting a trained multi-head model: to GQA/MQA by mean-pooling KV heads (`gqa`), to MLA by a
low-rank latent with decoupled RoPE (`mla`)."""
