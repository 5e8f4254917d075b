"""Chapter 12's engine serving a hybrid model (chapter 17): one block table per layer group over
one pool, as vLLM's hybrid KV cache manager serves Gemma 2/3 and gpt-oss, and a state slot per
request for each linear (recurrent) layer.

`LLMEngine` keeps one block table per request when every layer attends to every token. A model
whose `ModelConfig.layer_types` mixes "full" and "sliding" layers (Gemma 2/3; or one whose
`sliding_window` covers every layer, Mistral: the one-group case), with or without "linear"
(recurrent) layers (or full and linear ones only), is served here instead:

- **the allocator**: `HybridKVManager`, chapter 17's `kvlib.cache.hybrid_blocks.HybridBlockManager`
  (`group_layers`: vLLM's grouping; one `BlockManager` per group over one `BlockPool`; prefix
  hits by `longest_hit`), with the few methods the scheduler calls;
- **the K/V**: one `PagedCache` of G layers, G the group size: physical block b holds
  `block_size` tokens of G layers of the group whose table names it, the i-th layer of a group
  in the pool's layer i (vLLM's shared KV cache tensors). So every block has the same bytes
  (`LLMEngine.block_bytes`: G layers' worth), and a block a window group gives back can serve a
  full group at once;
- **the scheduler** (`HybridScheduler`): chapter 12's rules, a step's new blocks counted in every
  group, and after each step every running request's dead window blocks go back
  (`HybridBlockManager.free_dead`: their entries then name the null block); a request whose
  `peak_blocks` (an upper bound: a prefill chunk at its worst place) exceeds the pool is refused;
- **the runner** (`HybridModelRunner`): the step's metadata once per group (`prepare_inputs`
  over the group's tables: its own slot mapping and block tables; positions and lengths are
  every group's), and `HybridBatchKV`, the cache the model sees: layer l writes and reads
  through its group's metadata, a sliding layer under its window (`WindowBatchKV`: key j
  visible to the query at p when p - W < j <= p, `kvlib.ops.attention.visible`'s rule); reads
  of the null block are dead positions, masked;
- **the linear layers' states**: a **state slot** per request and linear layer
  (`HybridKVManager.states`, (1, H, D, D) each), read and replaced by
  `HybridBatchKV.update_state` (`chunked_form` for a chunk, `recurrent_form` for one token, as
  `RecurrentStateCache`), dropped when the request finishes or is preempted (it recomputes).
  Unlike vLLM's `MambaManager`, which gives a state a block of the pool, the slots sit outside
  the pool: the blocks counted are the attention layers' only.

`per_group_block_tables=False` (an `EngineConfig` field) serves the same model through one table
for every attention layer, the windows still masked but nothing freed: the engine chapter 17
measures against (a block then holds every attention layer's `block_size` tokens). A model with
neither windows nor linear layers takes chapter 12's path whatever this field says.

Refused, by name (`check_engine`): MLA; a model without attention layers; prefix caching with
linear layers (a hit would need their state at the hit's block boundary: state snapshots);
quantized K/V (`kv_scheme`), `async_scheduling`, `speculative_config`, `eviction` and
`policy="static"`. Parallel sampling (`n > 1`) queues the children as ordinary requests (no fork
across groups). Sinks: the model's window has none, so neither has the allocator (`sink_tokens`
0). Not done: attending over fewer blocks (every position up to the sequence's length is
gathered, the dead ones from the null block, and masked); chapter 11's kernel and CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.cache.block_pool import BlockPool
from kvlib.cache.hybrid_blocks import HybridBlockManager, LayerGroup, group_layers
from kvlib.cache.paged import PagedCache
from kvlib.cache.paged_window import live_block_range
from kvlib.engine.batch import BatchKV, ModelInput, prepare_inputs
from kvlib.engine.runner import ModelRunner
from kvlib.engine.scheduler import Scheduler
from kvlib.layers.hybrid import LINEAR_CHUNK_SIZE
from kvlib.layers.linear_attention import chunked_form, recurrent_form

__all__ = [
    "HybridBatchKV",
    "HybridKVManager",
    "HybridModelRunner",
    "HybridScheduler",
    "WindowBatchKV",
    "check_engine",
    "engine_parts",
    "layer_windows",
]

# EngineConfig fields this path refuses, and why
REFUSED_OPTIONS = {
    "kv_scheme": "it would need a quantized pool per layer group",
    "async_scheduling": "a window's dead blocks are freed once a step's tokens are back, and "
    "async scheduling plans the next step before they are",
    "speculative_config": "rejected draft tokens would need rolling back in every group, "
    "including window blocks already freed",
    "eviction": "eviction drops blocks by its own rule while the windows free theirs, and the "
    "two are not combined",
}


def layer_windows(config) -> dict[int, int | None] | None:
    """{attention layer: its sliding window (tokens) or None (full attention)} of a model this
    path serves (linear layers are not keys: their state is no K/V); None for a model with no
    window and no linear layer (no `layer_types`, or only "full" ones): chapter 12's engine
    serves it with one table, whatever `per_group_block_tables` says."""
    kinds = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) is None and set(kinds or ("full",)) == {"full"}:
        return None
    if kinds is None:
        return dict.fromkeys(range(config.num_hidden_layers), config.sliding_window)  # Mistral
    return {
        layer: config.sliding_window if kind == "sliding" else None
        for layer, kind in enumerate(config.layer_types)
        if kind != "linear"
    }


def check_engine(model, config) -> dict[int, int | None]:
    """`layer_windows` of `model.config`, after refusing (ValueError, naming the field) an MLA
    model, one without attention layers, one without windows or `layer_types`, prefix caching
    with linear layers, and an `EngineConfig` whose options this path does not implement
    (`REFUSED_OPTIONS`, static)."""
    if model.config.is_mla:
        raise ValueError("model: the engine serves K/V-head models; got an MLA model")
    windows = layer_windows(model.config)
    if windows is None:
        raise ValueError(
            "model: expected sliding-window or linear layers (this path's models); got none "
            "(LLMEngine serves such a model with one table, chapter 12's path)"
        )
    if not windows:
        raise ValueError(
            f"model: layer_types {model.config.layer_types} has no attention layer; the engine "
            "serves models with at least one"
        )
    if len(windows) < model.config.num_hidden_layers and config.enable_prefix_caching:
        raise ValueError(
            "enable_prefix_caching: not supported with linear (recurrent) layers: a hit would need "
            "their state at the hit's block boundary (state snapshots), which the engine does not "
            "keep; got True"
        )
    for name, why in REFUSED_OPTIONS.items():
        if getattr(config, name) not in (None, False):
            raise ValueError(
                f"{name}: not supported for a hybrid or windowed model: {why}; "
                f"got {getattr(config, name)!r}"
            )
    if config.policy != "continuous":
        raise ValueError(
            f"policy: a hybrid or windowed model is served with policy='continuous', "
            f"got {config.policy!r}"
        )
    return windows


class HybridKVManager(HybridBlockManager):
    """`HybridBlockManager` with what chapter 12's scheduler and engine call: `block_tables` and
    `token_ids` (the first group's, whose keys are the sequences held and whose lengths are every
    group's), `num_cached_prefix_blocks`, `copies` (always empty: no fork, no copy-on-write),
    `peak_blocks` and `check_fits`; and the linear layers' **state slots** (`states`), one per
    sequence and layer, outside the pool. `chunk`: the engine's token budget (a prefill chunk's
    most tokens)."""

    def __init__(self, pool: BlockPool, groups, *, chunk: int):
        super().__init__(pool, groups)
        self.chunk = chunk
        self.copies: list[tuple[int, int]] = []
        # linear layers' state slots: (seq_id, layer) -> (1, H, D, D), held until `free`
        self.states: dict[tuple, torch.Tensor] = {}

    def free(self, seq_id) -> None:
        """`HybridBlockManager.free`, and the sequence's linear-layer states dropped (a
        preempted request recomputes them from its first token)."""
        super().free(seq_id)
        for key in [key for key in self.states if key[0] == seq_id]:
            del self.states[key]

    @property
    def block_tables(self) -> dict:
        return self.managers[0].block_tables

    @property
    def token_ids(self) -> dict:
        return self.managers[0].token_ids

    def num_cached_prefix_blocks(self, token_ids) -> tuple[int, None]:
        """(tokens covered by the longest hit every group accepts, None)."""
        return self.longest_hit(token_ids), None

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence growing to `num_tokens` tokens may hold at once, every
        group together, the null block included: a full group ceil(num_tokens / block_size), a
        window group its live blocks plus a chunk of at most `chunk` new tokens, for the worst
        place the chunk can start (freeing happens between steps). An upper bound: a request's
        chunks may never start at the worst place, so one above the pool may still run."""
        bs, full = self.block_size, -(-num_tokens // self.block_size)
        total = 0 if self.null_block is None else 1
        for group in self.groups:
            if group.window is None:
                total += full
                continue
            # blocks held after a chunk from `start`: ceil(end / bs) - the first live block at
            # start; before W - 1 nothing is dead (it grows with start), after it repeats every
            # bs tokens (or shrinks once the chunk reaches num_tokens): bs starts suffice
            first_start = max(0, min(group.window, num_tokens) - 1)
            total += max(
                -(-min(start + self.chunk, num_tokens) // bs)
                - live_block_range(start, group.window, bs).window.start
                for start in range(first_start, min(num_tokens, first_start + bs))
            )
        return total

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Refuse (ValueError, naming `prompt_token_ids`) a request of `num_prompt` prompt tokens
        and `max_tokens` whose `peak_blocks` exceeds the pool: a conservative refusal (see
        `peak_blocks`)."""
        needed = self.peak_blocks(num_prompt + max_tokens - 1)  # the last token is never cached
        if needed > len(self.pool.blocks):
            raise ValueError(
                f"prompt_token_ids: {num_prompt} prompt tokens + max_tokens {max_tokens} may need "
                f"up to {needed} blocks at once (every group's, the null block and a prefill "
                f"chunk at its worst placement), more than the pool's {len(self.pool.blocks)}"
            )

    def live_blocks(self, seq_id) -> int:
        """Distinct blocks sequence `seq_id` holds across its groups (the null block not
        counted)."""
        return len({b for t in self.tables(seq_id) for b in t} - {self.null_block})


class HybridScheduler(Scheduler):
    """Chapter 12's `Scheduler` over a `HybridKVManager`: new blocks are counted in every group,
    a step's tokens are appended in one `extend`, children of parallel sampling queue as ordinary
    requests, and after each step the running requests' dead window blocks are freed.
    `scheduled_blocks`: {request id: `live_blocks` right after the latest `schedule`} for the
    requests it left running: a step's peak, before that step's `free_dead`."""

    def __init__(self, config, manager: HybridKVManager):
        super().__init__(config, manager)
        self.scheduled_blocks: dict[str, int] = {}

    def schedule(self):
        out = super().schedule()
        self.scheduled_blocks = {r.request_id: self.manager.live_blocks(r.request_id)
                                 for r in self.running}  # fmt: skip
        return out

    def add_parallel_requests(self, parent, children) -> None:
        for request in (parent, *children):
            self.add_request(request)

    def _blocks_needed(self, request, num_new: int) -> int:
        return len(self.manager.groups) * super()._blocks_needed(request, num_new)

    def _append_slots(self, request, num_new: int) -> None:
        start = request.num_computed_tokens
        self.manager.extend(request.request_id, request.token_ids(start, start + num_new))

    def record_sampled(self, out, sampled):
        """`Scheduler.record_sampled`, then `free_dead` for every running request: its next
        query is at its token count, so the keys no window reaches from there are dead."""
        appended = super().record_sampled(out, sampled)
        for request in self.running:
            self.manager.free_dead(request.request_id)
        return appended


class WindowBatchKV(BatchKV):
    """`BatchKV` (one group's metadata) whose mask also hides keys outside a window of `window`
    positions (None: none hidden). Slot index = position here (nothing is evicted), and each
    row's mask is causal, so the row's query position is its count of visible keys - 1."""

    def __init__(self, storage: PagedCache, batch: ModelInput, window: int | None):
        super().__init__(storage, batch)
        if window is not None:
            query = self.mask.sum(-1, keepdim=True) - 1  # (n, T, 1)
            key = torch.arange(self.mask.shape[-1], device=self.mask.device)  # (S,)
            self.mask = self.mask & (key > query - window)


@dataclasses.dataclass
class HybridModelInput(ModelInput):
    """The first group's `ModelInput` (ids, positions, lengths, sampling rows: every group's),
    with every group's own (`group_inputs[g]`: its slot mapping and block tables)."""

    group_inputs: list[ModelInput] = dataclasses.field(default_factory=list)
    request_ids: list[str] = dataclasses.field(default_factory=list)  # (n,) in row order


class HybridBatchKV:
    """The cache the model sees for one step (`kvlib.cache.base`'s seam): `update(l, k, v)`
    writes layer l's K/V into pool layer `layout[l][1]` through its group's slot mapping, and the
    `attention_backend` call that follows attends through that group's tables and its window.
    `layout[l]` = (group, pool layer, window)."""

    length = 0  # positions come from metadata, as `BatchKV`'s

    def __init__(self, storage: PagedCache, batch: HybridModelInput, layout, states=None):
        self.storage, self.batch, self.layout = storage, batch, layout
        self.states = states  # a HybridKVManager's state slots
        self.num_layers = len(layout)
        self.views: dict[tuple[int, int | None], WindowBatchKV] = {}
        self.view: WindowBatchKV | None = None  # the layer being computed

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        group, pool_layer, window = self.layout[layer_idx]
        self.view = self.views.get((group, window))
        if self.view is None:
            inputs = self.batch.group_inputs[group]
            self.view = self.views[group, window] = WindowBatchKV(self.storage, inputs, window)
        return self.view.update(pool_layer, k, v)

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        return self.view.attention_backend(q, kv, mask, weights_out=weights_out)

    def update_state(self, layer_idx: int, q, k, v, log_decay) -> torch.Tensor:
        """A linear layer's step (`kvlib.layers.hybrid.LinearAttention`): each sequence's rows
        from its state slot (zeros for its first tokens), one token by `recurrent_form`, a chunk
        by `chunked_form` (as `RecurrentStateCache.update`); the slot then holds the state after
        them. q, k, v (1, H, N, D), log_decay (1, H, N); returns (1, H, N, D)."""
        out, start = torch.empty_like(v), 0
        for request_id, n in zip(self.batch.request_ids, self.batch.query_lens):
            rows, key = slice(start, start + n), (request_id, layer_idx)
            args = (q[:, :, rows], k[:, :, rows], v[:, :, rows], log_decay[:, :, rows])
            if n == 1:
                out[:, :, rows], self.states[key] = recurrent_form(*args, self.states.get(key))
            else:
                out[:, :, rows], self.states[key] = chunked_form(
                    *args, LINEAR_CHUNK_SIZE, self.states.get(key)
                )
            start += n
        return out

    def advance(self, num_tokens: int) -> None:
        """Nothing to commit: the scheduler already counted the tokens."""


class _GroupInputs:
    """What `ModelRunner` calls `inputs`: a step's `HybridModelInput`, built with
    `prepare_inputs` over each group's `BlockManager` (the readable loop; no placeholders)."""

    def __init__(self, manager: HybridKVManager, device):
        self.manager, self.device = manager, device

    def stage(self, scheduled, manager=None) -> HybridModelInput:
        groups = [prepare_inputs(scheduled, m, self.device) for m in self.manager.managers]
        fields = {f.name: getattr(groups[0], f.name) for f in dataclasses.fields(ModelInput)}
        ids = [request.request_id for request, _ in scheduled]
        return HybridModelInput(**fields, group_inputs=groups, request_ids=ids)

    def to_device(self, staged: HybridModelInput, previous_sampled) -> HybridModelInput:
        return staged


class HybridModelRunner(ModelRunner):
    """`ModelRunner` whose steps go through `HybridBatchKV` (the torch path only: no kernel, no
    varlen, no graphs). `layout[l]` = (group, pool layer, window) of model layer l."""

    def __init__(self, model, storage, manager: HybridKVManager, layout, **limits):
        super().__init__(
            model,
            storage,
            manager,
            decode_kernel=False,
            prefill_varlen=False,
            prefill_kernel=False,
            cuda_graphs=False,
            **limits,
        )
        self.layout = layout
        self.inputs = _GroupInputs(manager, self.device)

    def _batch_kv(self, batch: HybridModelInput) -> HybridBatchKV:
        return HybridBatchKV(self.storage, batch, self.layout, self.manager.states)


def engine_parts(model, config):
    """(storage, manager, scheduler, runner) for `LLMEngine` serving `model` (with sliding
    windows) under `config` (an `EngineConfig`), per layer group or, with
    `per_group_block_tables=False`, one table for every layer. Raises ValueError as
    `check_engine`."""
    windows = check_engine(model, config)
    layers = sorted(windows)  # the attention layers
    if config.per_group_block_tables:
        groups = [  # group_layers numbers the layers it is given: the model's indices instead
            LayerGroup(tuple(layers[i] for i in g.layers), g.window, g.size)
            for g in group_layers([windows[layer] for layer in layers])
        ]
    else:
        groups = [LayerGroup(tuple(layers), None, len(layers))]
    layout: list = [None] * model.config.num_hidden_layers  # None: a linear layer
    for g, group in enumerate(groups):
        for i, layer in enumerate(group.layers):
            layout[layer] = (g, i, windows[layer])
    c, weight = model.config, model.lm_head.weight
    storage = PagedCache(
        groups[0].size,
        c.num_key_value_heads,
        c.head_dim,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        dtype=weight.dtype,
        device=weight.device,
    )
    pool = BlockPool(
        config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    manager = HybridKVManager(pool, groups, chunk=config.max_num_batched_tokens)
    storage.manager = manager  # its pool is what `num_blocks_in_use` counts
    runner = HybridModelRunner(
        model,
        storage,
        manager,
        layout,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
    )
    return storage, manager, HybridScheduler(config, manager), runner
