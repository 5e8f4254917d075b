"""`python -m kvlib.experiments.hybrid_course_model`: train the hybrid course model (chapter 17)
and measure what its fixed-size layers forget against the full-attention course model; writes
`kvlib/weights/course-model-hybrid/` and `results/hybrid_recall.csv` (CPU, 2 threads; a training
step costs about what the course model's does, so about a quarter of an hour on an idle 2-core
machine, most of it training; the shipped weights took 28 minutes on a shared one).

The hybrid (`kvlib.loaders.course_model.HYBRID_CONFIG`) has the course model's sizes (4 layers,
d_model 128, 4 heads of 32, the same MLPs) with layers of three kinds: sliding window (W = 16),
full attention, gated linear attention, full attention (`kvlib.layers.hybrid`). It is trained
from scratch exactly as the course model was: `train_course_model.train` with the same corpus,
curriculum, optimizer, learning rate, warm-up, seed and thread count; only the config differs.
Two full layers, not one: a first layout with one full layer in four (sliding, linear, sliding,
full) trained this way recalled about 1 fact in 10 at every distance, 8 tokens apart (inside the
window) too, so its failure was not one of memory; probes of the first 1,600 steps found one full
layer, at 1 or at 3, with or without the linear layer, equally at chance, where this layout's
two full layers (1 and 3) had begun to recall. At this size and training budget one global
layer in four did not learn to recall at all; two did.

Rows of `results/hybrid_recall.csv` (`measure` column):

- `recall`: chapter 8's harness (`kvlib.metrics.recall.recall_hits`): the same
  `DOCUMENTS` documents per SET-to-GET distance for every model (`documents`: those with room
  for at least one fact at that distance), streamed one token at a time
  through each model's cache (the course model's `DynamicCache`, the hybrid's `HybridCache`).
  Per model and distance: facts recalled of facts asked, the rate with its 95% cluster bootstrap
  interval over documents (a document's facts are not independent: `cluster_bootstrap`), and the
  paired differences, with their intervals, from the course model (`minus_course`), from the
  hybrid (`minus_hybrid`) and from the control below (`minus_control`) on the same documents
  (`paired_cluster_bootstrap`).
  Four models: the course model, the hybrid, and two variants of the hybrid with its weights,
  never trained so: an ablation, its full layers windowed to W like layer 0, whose cache then
  stops growing (what the window and the recurrent state carry beyond W tokens), and its
  control, the same with the linear layer's state also erased every W tokens (its gate set to
  +inf at positions 0, W, 2W, ...: log_decay = -inf), so that no layer sees further back than W
  tokens (the stack reaches at most about 4W back); run in one forward without a cache, as its
  resets count positions from the forward's start.
- `cache_bytes`: bytes a model's cache holds for one sequence after `context` tokens, measured
  on the cache objects (`nbytes`, float32) after a forward over random tokens, beside chapter 3's
  equation on the model's `config.json` (`kvlib.memory.kv_cache_bytes`); the hybrid's split by
  layer kind. Below W tokens the two differ: the equation counts the min(S, W) tokens a sliding
  layer holds, the ring allocates its W slots at the first token.

Every row also names the model's parameter count and layout, the training steps and seconds of
its shipped log, the recording's device, threads, versions, commit and date.

On a busy machine, set `OMP_WAIT_POLICY=PASSIVE` in the environment: torch's two threads then
sleep instead of spinning while they wait for each other, several times faster when other
processes share the cores, and the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlib.experiments.options import run_training

DOCUMENTS = 64  # recall documents per distance (up to 4 facts each), the same for every model
CONTEXTS = (1, 16, 64, 256, 1024, 4096)  # tokens per sequence for the cache-bytes rows
PREFILL_CHUNK = 256  # tokens per forward when filling a cache for the bytes rows
BOOTSTRAP = {"draws": 2000, "level": 0.95, "seed": 0}
HYBRID = "hybrid"
WINDOWED = "hybrid, full layers windowed (ablation)"
WINDOWS_ONLY = "hybrid, full layers windowed, state reset every 16 tokens (control)"

PROVENANCE_SOURCES = (
    "kvlib/cache/dense.py",
    "kvlib/cache/hybrid.py",
    "kvlib/cache/ring.py",
    "kvlib/data.py",
    "kvlib/experiments/hybrid_course_model.py",
    "kvlib/experiments/train_course_model.py",
    "kvlib/layers/hybrid.py",
    "kvlib/layers/linear_attention.py",
    "kvlib/layers/llama.py",
    "kvlib/loaders/course_model.py",
    "kvlib/memory/layers.py",
    "kvlib/metrics/bootstrap.py",
    "kvlib/metrics/recall.py",
    "kvlib/model.py",
    "kvlib/training.py",
)


def cache_factory(model):
    """The cache each model of the comparison streams through: `HybridCache` for a config with
    layer types, else the full `DynamicCache` (chapter 8's full-cache baseline); None (one
    forward, no cache) for the control, whose resets count positions within a forward."""
    from kvlib.cache import DynamicCache, HybridCache

    if getattr(model, "counts_positions_per_forward", False):
        return None
    if model.config.layer_types is not None:
        return HybridCache.factory
    return lambda m, batch_size, max_seq_len: DynamicCache(m.config.num_hidden_layers)


def windowed(model):
    """One ablation: `model` (the hybrid) with its full layers windowed like its sliding ones,
    the same weights."""
    import dataclasses

    from kvlib.model import LlamaModel

    config = model.config
    kinds = tuple("sliding" if kind == "full" else kind for kind in config.layer_types)
    ablated = LlamaModel(dataclasses.replace(config, layer_types=kinds)).eval()
    ablated.load_state_dict(model.state_dict())
    return ablated


def reset_every(model, period: int):
    """The control: a copy of `model` whose linear layers' state is erased at positions 0,
    period, 2 · period, ... (their gates output +inf there: log_decay = -softplus(+inf) = -inf,
    a = 0), so it holds at most the last `period` tokens. Positions are counted from the first
    token of a forward: use it for one forward over whole sequences, no cache."""
    import copy

    from kvlib.layers.hybrid import LinearAttention

    def erase(module, inputs, output):  # output (B, T, H): the gate's pre-activation
        output = output.clone()
        output[:, ::period] = float("inf")
        return output

    ablated = copy.deepcopy(model)
    for layer in ablated.model.layers:
        if isinstance(layer.self_attn, LinearAttention):
            layer.self_attn.gate_proj.register_forward_hook(erase)
    ablated.counts_positions_per_forward = True  # `cache_factory`: one forward, no cache
    return ablated


def recall_rows(
    models: dict, *, num_documents: int = DOCUMENTS, distances=None, references=None
) -> list[dict]:
    """`recall` rows for `models` ({name: model}), each streamed through its `cache_factory`,
    with paired differences from each model of `references` ({column prefix: name}; default:
    "minus_course" from the first model, "minus_hybrid" from `HYBRID` and "minus_control" from
    `WINDOWS_ONLY` when present)."""
    from kvlib.metrics.bootstrap import cluster_bootstrap, paired_cluster_bootstrap
    from kvlib.metrics.recall import RECALL_DISTANCES, recall_hits

    distances = RECALL_DISTANCES if distances is None else distances
    hits = {
        name: recall_hits(
            model, distances, num_documents=num_documents, cache_factory=cache_factory(model)
        )
        for name, model in models.items()
    }
    if references is None:
        references = {"minus_course": next(iter(models))}
        for prefix, reference in (("minus_hybrid", HYBRID), ("minus_control", WINDOWS_ONLY)):
            if reference in models:
                references[prefix] = reference
    rows = []
    for name in models:
        for d in distances:
            # documents with a fact at this distance (a 256-token one may have room for none)
            kept = [i for i, (_, n) in enumerate(hits[name][d]) if n]
            recalled = [hits[name][d][i][0] for i in kept]
            asked = [hits[name][d][i][1] for i in kept]
            rate, low, high = cluster_bootstrap(recalled, asked, **BOOTSTRAP)
            paired = {}
            for prefix, reference in references.items():
                base = [hits[reference][d][i][0] for i in kept]
                diff, low_d, high_d = paired_cluster_bootstrap(recalled, base, asked, **BOOTSTRAP)
                paired |= {prefix: diff, f"{prefix}_low": low_d, f"{prefix}_high": high_d}
            rows.append(
                dict(
                    measure="recall",
                    model=name,
                    distance=d,
                    documents=len(asked),
                    facts=sum(asked),
                    recalled=sum(recalled),
                    recall=round(rate, 5),
                    recall_low=round(low, 5),
                    recall_high=round(high, 5),
                    **{column: round(value, 5) for column, value in paired.items()},
                )
            )
    return rows


@torch.no_grad()
def cache_bytes_row(model, name: str, context: int) -> dict:
    """One `cache_bytes` row: `model`'s cache after a forward over `context` random tokens (in
    chunks of `PREFILL_CHUNK`), its bytes by layer kind, and chapter 3's equation."""
    from kvlib.memory import kv_cache_bytes

    cache = cache_factory(model)(model, 1, context)
    generator = torch.Generator().manual_seed(context)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=generator)
    for start in range(0, context, PREFILL_CHUNK):
        model(ids[:, start : start + PREFILL_CHUNK], cache=cache)
    kinds = cache.nbytes_by_kind() if hasattr(cache, "nbytes_by_kind") else {"full": cache.nbytes}
    return dict(
        measure="cache_bytes",
        model=name,
        context=context,
        cache_bytes=cache.nbytes,
        equation_bytes=kv_cache_bytes(model.config.to_hf(), context),
        **{f"{kind}_bytes": kinds.get(kind, 0) for kind in ("full", "sliding", "linear")},
    )


def model_columns(model, log_path: Path | None) -> dict:
    """What every row of a model names: its layout, parameters and (from its shipped training
    log) training steps and seconds."""
    config = model.config
    log = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path else []
    return dict(
        layer_types="/".join(config.layer_types or ("full",) * config.num_hidden_layers),
        sliding_window=config.sliding_window or "",
        parameters=model.num_parameters,
        train_steps=log[-1]["step"] if log else "",
        train_seconds=log[-1]["elapsed_s"] if log else "",
    )


def measure(models: dict, logs: dict, *, contexts=CONTEXTS) -> list[dict]:
    """Every row for `models` ({name: model}; the course model first), with `logs` ({name:
    training log path or None}) for the training columns and the recording's facts."""
    from tqdm.auto import tqdm

    from kvlib.experiments.timing import cpu_facts

    rows = recall_rows(models)
    for name, model in tqdm(models.items(), desc="cache bytes", unit="model"):
        if name != WINDOWS_ONLY:  # the ablation's cache exactly
            rows += [cache_bytes_row(model, name, s) for s in contexts]
    columns = {name: model_columns(model, logs[name]) for name, model in models.items()}
    facts = cpu_facts()
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every column, first-seen order
    return [{**{k: row.get(k, "") for k in keys}, **columns[row["model"]], **facts} for row in rows]


def record(
    out_csv: str,
    *,
    weights: Path | None = None,
    train_model: bool = True,
    threads: int = 2,
    scale: float = 1.0,
) -> list[dict]:
    """Train the hybrid into `weights` (None: `HYBRID_MODEL_DIR`, the shipped checkpoint; unless
    `train_model` is False: measure what is there), then write every row to `out_csv`. Prints
    both models' parameter counts."""
    from kvlib.experiments.cli import write_rows
    from kvlib.experiments.train_course_model import train
    from kvlib.loaders.course_model import (
        COURSE_MODEL_DIR,
        HYBRID_CONFIG,
        HYBRID_MODEL_DIR,
        load_course_model,
    )
    from kvlib.loaders.hf import load_hf_checkpoint
    from kvlib.training import scaled_curriculum

    weights = Path(HYBRID_MODEL_DIR if weights is None else weights)
    if train_model:
        curriculum = scaled_curriculum(scale)
        train(config=HYBRID_CONFIG, curriculum=curriculum, out_dir=weights, threads=threads)
    torch.set_num_threads(threads)
    course, hybrid = load_course_model(), load_hf_checkpoint(weights)
    for name, model in (("course model", course), ("hybrid", hybrid)):
        print(f"{name}: {model.num_parameters:,} parameters, layers {model.config.layer_types}")
    models = {
        "course model": course,
        HYBRID: hybrid,
        WINDOWED: windowed(hybrid),
        WINDOWS_ONLY: reset_every(windowed(hybrid), HYBRID_CONFIG.sliding_window),
    }
    course_log, hybrid_log = (d / "training_log.jsonl" for d in (COURSE_MODEL_DIR, weights))
    logs = {name: hybrid_log for name in models} | {"course model": course_log}
    return write_rows(out_csv, measure(models, logs))


def main(argv: list[str] | None = None) -> int:
    return run_training(
        "hybrid_course_model",
        "Train the hybrid course model and record its recall and cache bytes against the course "
        "model's (defaults reproduce the committed weights and results/hybrid_recall.csv).",
        "results/hybrid_recall.csv",
        "kvlib/weights/course-model-hybrid",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
