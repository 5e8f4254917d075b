"""Decode-only steps through static buffers, ready for CUDA graphs (issue 36, part 3).

A decode step is small (one token per sequence) and its GPU time is mostly the host launching a
few hundred kernels. A CUDA graph records those launches once and replays them with one call,
but a graph replays the same kernels on the same memory: every input must live at a fixed
address, in a fixed shape. So, as vLLM's `CUDAGraphRunner` does:

- **buckets**: a step of n sequences runs at the smallest batch size of `bucket_sizes` that holds
  it, padded; one graph per bucket;
- **static buffers** (`DecodeBuffers`): input ids, positions, slot mapping, block tables and
  lengths, allocated once for the largest bucket and written in place each step;
- **padding rows** attend over one token of a scratch block that no request is ever given (the
  runner grows the pools by that one block), and write their K/V there, so they touch no
  sequence's memory; their logits are dropped.

`DecodeGraphRunner` runs a decode-only step through those buffers: on CUDA it captures the
model's forward per bucket on first use and replays it; elsewhere (or with `capture=False`) it
runs the same forward eagerly on the same buffers, the path the CPU tests check. Each padded
row's arithmetic is its own (the kernel runs one program per sequence), so a sequence's tokens
do not depend on the bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvlib.cache.paged import PagedCache, PagedKV

__all__ = ["DecodeBuffers", "DecodeGraphKV", "DecodeGraphRunner", "bucket_for", "bucket_sizes"]


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: 1, 2, 4, then multiples of 8 (vLLM's choice), up
    to the first that holds `max_batch`."""
    standard = [1, 2, 4, *range(8, max_batch + 8, 8)]
    return tuple(s for s in standard if s < max_batch) + (
        next(s for s in standard if s >= max_batch),
    )


def bucket_for(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket holding n sequences (ValueError above the largest)."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"n: {n} sequences exceed the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class DecodeBuffers:
    """The step's metadata at fixed addresses, for `max_batch` rows: a bucket of size b reads
    rows [:b]."""

    input_ids: torch.Tensor  # (max_batch,) int64
    positions: torch.Tensor  # (max_batch,) int64
    slot_mapping: torch.Tensor  # (max_batch,) int64
    block_tables: torch.Tensor  # (max_batch, max_blocks) int32: the kernel's
    seq_lens: torch.Tensor  # (max_batch,) int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device) -> DecodeBuffers:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            zeros(max_batch),
            zeros(max_batch),
            zeros(max_batch),
            zeros(max_batch, max_blocks, dtype=torch.int32),
            zeros(max_batch, dtype=torch.int32),
        )


class DecodeGraphKV:
    """The cache the model sees in a bucketed decode step (`kvlib.cache.base`'s seam), reading
    only the static buffers' rows [:size]: writes through their slot mapping, attention through
    `attend` (`paged_decode_attention`, or its torch reference off the GPU) with their block
    tables and lengths. No host sync, no tensor created from host data: capturable."""

    length = 0

    def __init__(self, storage: PagedCache, buffers: DecodeBuffers, size: int, attend, **launch):
        self.storage, self.num_layers = storage, storage.num_layers
        self.slot_mapping = buffers.slot_mapping[:size]
        self.block_tables, self.seq_lens = buffers.block_tables[:size], buffers.seq_lens[:size]
        self.handle = PagedKV(None, None, self.block_tables, self.seq_lens, None)
        self.attend, self.launch = attend, launch

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        new_k, new_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (size, H_kv, D)
        return self.storage.write_slots(layer_idx, self.slot_mapping, new_k, new_v, self.handle)

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        """q (1, H, size, D) -> (1, H, size, D): one decode query per row."""
        if weights_out is not None:
            raise ValueError("weights_out: the decode kernel never forms attention weights")
        scales = {}
        if hasattr(kv, "key_scale"):  # a quantized cache: (num_blocks, block_size, H_kv, 1)
            scales = dict(k_scale=kv.key_scale.squeeze(-1), v_scale=kv.value_scale.squeeze(-1))
        out = self.attend(
            q[0].transpose(0, 1),
            kv.key_cache,
            kv.value_cache,
            self.block_tables,
            self.seq_lens,
            validate=False,
            **scales,
            **self.launch,
        )
        return out.transpose(0, 1)[None]

    def advance(self, num_tokens: int) -> None:
        """Nothing to commit: the scheduler counted the tokens."""


class DecodeGraphRunner:
    """Runs decode-only steps (one new token per sequence) of up to `max_batch` sequences
    through `DecodeBuffers`, bucketed; captures one CUDA graph per bucket when `capture`.

    Args:
        model: the engine's model. storage: its pools, holding a scratch block at index
            `pad_block` that no request is given (padding rows write there).
        max_batch, max_blocks: the largest bucket's rows, a block table's width.
        attend: `paged_decode_attention` (what a graph captures) or `paged_decode_attention_ref`.
        capture: record and replay CUDA graphs (a CUDA device only); False runs eagerly.
        **launch: the kernel's fixed launch arguments (`num_splits`, `workspace`).
    """

    def __init__(
        self, model, storage, *, pad_block, max_batch, max_blocks, attend, capture, **launch
    ):
        self.model, self.storage, self.attend, self.launch = model, storage, attend, launch
        self.device = model.lm_head.weight.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, got {self.device}")
        self.capture, self.pad_block = capture, pad_block
        self.sizes = bucket_sizes(max_batch)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # the graphs' shared memory pool
        self.steps_by_bucket: dict[int, int] = {}  # bucket -> steps run at it (for tests)

    @staticmethod
    def captures(runner) -> bool:
        """Whether a `ModelRunner`'s decode steps can be captured as CUDA graphs: the kernel on a
        CUDA device over a plain `PagedCache` (a quantized cache quantizes on write with a
        host-side finiteness check, which a capture cannot hold: its buckets run eagerly)."""
        return (
            runner.device.type == "cuda"
            and runner.use_kernel()
            and type(runner.storage) is PagedCache
        )

    @classmethod
    def for_runner(cls, runner) -> DecodeGraphRunner:
        """The graph runner of a `ModelRunner` built with `cuda_graphs=True`: the kernel (and
        capture, on CUDA over a plain `PagedCache`) where the runner uses it, with the runner's
        split count and a workspace of its own; the torch reference, eagerly, otherwise."""
        from kvlib.kernels import paged_decode_attention, paged_decode_attention_ref
        from kvlib.ops.decode_plan import DecodeWorkspace

        config, kernel, launch = runner.model.config, runner.use_kernel(), {}
        if kernel:
            splits = runner.kernel_splits()
            workspace = DecodeWorkspace.allocate(
                bucket_sizes(runner.max_graph_batch)[-1],
                config.num_attention_heads,
                config.head_dim,
                max_splits=splits,
                device=runner.device,
            )
            launch = dict(num_splits=splits, workspace=workspace)
        num_blocks = runner.manager.pool.num_blocks
        return cls(
            runner.model,
            runner.storage,
            pad_block=num_blocks,  # the scratch block the runner added past the pool's last
            max_batch=runner.max_graph_batch,
            max_blocks=num_blocks,
            attend=paged_decode_attention if kernel else paged_decode_attention_ref,
            capture=cls.captures(runner),
            **launch,
        )

    def can_run(self, batch) -> bool:
        """Whether a step (a `ModelInput`) fits: every sequence computes one token, and its
        tables fit."""
        query_lens = batch.query_lens
        return (
            0 < len(query_lens) <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.buffers.block_tables.shape[1]
            and int(np.max(query_lens)) == 1
        )

    def _fill(self, batch, n: int, size: int) -> None:
        """Write the step's metadata into rows [:n] and padding into rows [n:size], in place."""
        b, block_size = self.buffers, self.storage.block_size
        b.input_ids[:n].copy_(batch.input_ids)
        b.positions[:n].copy_(batch.positions)
        b.slot_mapping[:n].copy_(batch.slot_mapping)
        b.seq_lens[:n].copy_(batch.seq_lens)
        width = batch.block_tables.shape[1]
        b.block_tables[:n, :width].copy_(batch.block_tables)
        b.block_tables[:n, width:] = 0
        b.input_ids[n:size] = 0
        b.positions[n:size] = 0
        b.slot_mapping[n:size] = self.pad_block * block_size
        b.seq_lens[n:size] = 1
        b.block_tables[n:size] = 0
        b.block_tables[n:size, 0] = self.pad_block

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the buffers' rows [:size] -> logits (size, V)."""
        kv = DecodeGraphKV(self.storage, self.buffers, size, self.attend, **self.launch)
        return self.model(
            self.buffers.input_ids[:size][None],
            cache=kv,
            position_ids=self.buffers.positions[:size][None],
            validate=False,
        )[0]

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compile the kernels) on a side stream, then record the bucket's forward. The
        warm-up and the recording write this step's K/V, the values the replay writes again."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size)
        self.pool = graph.pool()
        return graph, logits

    def run(self, batch) -> torch.Tensor:
        """Logits `(N, V)` of a step that fits (`can_run`), one row per token, in batch order (a
        decode-only step's N tokens are its N sequences)."""
        n = len(batch.input_ids)
        size = bucket_for(n, self.sizes)
        self._fill(batch, n, size)
        self.steps_by_bucket[size] = self.steps_by_bucket.get(size, 0) + 1
        if not self.capture:
            return self._forward(size)[:n]
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
