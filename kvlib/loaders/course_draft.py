"""The draft course model (`kvlib/weights/course-model-draft/`: 2 layers, d_model 64), chapter 16's
drafter for the course model, trained from scratch on the course model's corpus by `python -m
kvlib.experiments.draft_model` and loaded as a Hugging Face-format checkpoint. Its own module, so
that the course model's loader, which other recordings name as a source, stays as it was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvlib.loaders.course_model import COURSE_CONFIG
from kvlib.loaders.hf import load_hf_checkpoint
from kvlib.model import LlamaModel

__all__ = ["DRAFT_CONFIG", "DRAFT_MODEL_DIR", "load_course_draft_model"]

DRAFT_MODEL_DIR = Path(__file__).parents[1] / "weights" / "course-model-draft"
# The course model's vocabulary, RoPE and head dimension (32), half its width (d_model 64, 2
# heads, an MLP of 176: the course model's ratio) and half its depth. Two layers, not one:
# copying and recalling a fact (an induction head) needs one layer to note each token's
# predecessor and a later one to look it up.
DRAFT_CONFIG = dataclasses.replace(
    COURSE_CONFIG,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
)


def load_course_draft_model() -> LlamaModel:
    """The draft course model trained by `python -m kvlib.experiments.draft_model` and shipped in
    `kvlib/weights/course-model-draft` (`DRAFT_CONFIG`: 2 layers, 2 heads of 32, d_model 64;
    117,056 parameters, about 1/7 of the course model's), in eval mode, float32 on the CPU. It
    drafts for the course model in `kvlib.speculative.DraftModelDrafter`.

    Raises:
        FileNotFoundError: the weights are missing (re-train with `python -m
            kvlib.experiments.draft_model`).
    """
    return load_hf_checkpoint(DRAFT_MODEL_DIR)
