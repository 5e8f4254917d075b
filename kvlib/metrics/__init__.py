"""What a cache technique costs in quality: teacher-forced logits, agreement, KL and perplexity
(`quality`), the course model's recall by distance (`recall`), passkey retrieval (`passkey`),
bootstrap intervals for dependent samples (`bootstrap`)."""
