"""The course model (`kvlib/weights/course-model/`: 4 layers, 4 heads, d_model 128, trained by
`python -m kvlib.experiments.train_course_model`; its card is `book/model_card.md`), its MLA
variant (`kvlib/weights/course-model-mla/`, written by `python -m
kvlib.experiments.mla_uptraining`) and the hybrid course model (`kvlib/weights/
course-model-hybrid/`: the same size, layers of three kinds, trained the same way by `python -m
kvlib.experiments.hybrid_course_model`), all loaded as Hugging Face-format checkpoints.
"""

from __future__ import annotations

import dataclasses
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


HYBRID_MODEL_DIR = Path(__file__).parents[1] / "weights" / "course-model-hybrid"
# Chapter 17's hybrid: the course model's sizes, its layers of three kinds (kvlib.layers.hybrid),
# alternating a constant-size layer with a full-attention one (Gemma 2 alternates local and
# global layers; Jamba and Qwen3-Next interleave recurrent layers with attention): a window of 16
# for layer 0 (local work: the filler's successor statistics, the previous token that induction
# needs), full attention in layers 1 and 3, gated linear attention in layer 2. Half the course
# model's growing cache. With one full layer in four (at layer 1 or 3), the recall circuit did not
# form within the course model's training steps (see kvlib.experiments.hybrid_course_model).
HYBRID_LAYER_TYPES = ("sliding", "full", "linear", "full")
HYBRID_WINDOW = 16
HYBRID_CONFIG = dataclasses.replace(
    COURSE_CONFIG, layer_types=HYBRID_LAYER_TYPES, sliding_window=HYBRID_WINDOW
)


def load_course_hybrid_model() -> LlamaModel:
    """The hybrid course model trained by `python -m kvlib.experiments.hybrid_course_model` and
    shipped in `kvlib/weights/course-model-hybrid` (`HYBRID_CONFIG`: sliding, full, linear,
    full; window 16), in eval mode, float32 on the CPU. Its cache is `kvlib.cache.HybridCache`
    (`generate(model, ids, n, cache=HybridCache.factory)`). The checkpoint is in Hugging Face's
    layout with transformers' `layer_types` names, but transformers has no model with these
    linear layers: load it with kvlib.

    Raises:
        FileNotFoundError: the weights are missing (re-train with `python -m
            kvlib.experiments.hybrid_course_model`).
    """
    return load_hf_checkpoint(HYBRID_MODEL_DIR)
