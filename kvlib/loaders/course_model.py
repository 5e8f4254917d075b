"""The course model (`kvlib/weights/course-model/`: 4 layers, 4 heads, d_model 128, trained by
`python -m kvlib.experiments.train_course_model`; its card is `book/model_card.md`) and its MLA
variant (`kvlib/weights/course-model-mla/`, written by `python -m
kvlib.experiments.mla_uptraining`), both loaded as Hugging Face checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlib import data
from kvlib.layers.mla import set_absorb
from kvlib.loaders.hf import load_hf_checkpoint
from kvlib.model import LlamaModel, ModelConfig
from kvlib.ops.attention import get_backend

COURSE_MODEL_DIR = Path(__file__).parents[1] / "weights" / "course-model"
COURSE_CONFIG = ModelConfig(
    vocab_size=data.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    torch_dtype="float32",
)


def load_course_model(
    *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaModel:
    """The course model trained by `python -m kvlib.experiments.train_course_model` and shipped in
    `kvlib/weights` (4 layers, 4 heads, d_model 128; its model card is `book/model_card.md`), in
    eval mode.

    Raises:
        FileNotFoundError: the weights are missing (re-train with `python -m
    kvlib.experiments.train_course_model`).
    """
    return load_hf_checkpoint(COURSE_MODEL_DIR, dtype=dtype, device=device)


MLA_MODEL_DIR = Path(__file__).parents[1] / "weights" / "course-model-mla"


def load_course_mla_model(*, absorb: bool = True, attention_backend: str = "reference"):
    """The course model converted to MLA (d_c = 112, d_R = 16: GQA-2's cache bytes) and uptrained
    for alpha = 0.25, as `python -m kvlib.experiments.mla_uptraining` saved it (`SAVED_POINT`), in
    eval mode.

    `attention_backend` names the model's backend (`kvlib.ops.ATTENTION_BACKENDS`). The absorbed
    form is MQA over the latent rows, so "reference" repeats that one KV head H times per call
    (chapter 5's repeat-K/V pitfall, 128x the latent for DeepSeek-V3); "grouped" reads it once.

    Raises:
        FileNotFoundError: the weights are missing (rerun the sweep).
        ValueError: an unknown attention_backend.
    """
    from kvlib.loaders.hf import load_hf_checkpoint

    get_backend(attention_backend)  # fails early on an unknown name
    model = load_hf_checkpoint(MLA_MODEL_DIR)
    model.attention_backend = attention_backend
    set_absorb(model, absorb)
    return model
