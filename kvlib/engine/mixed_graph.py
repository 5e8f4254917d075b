"""Steps that carry prompt tokens, through static buffers ready for CUDA graphs (issue 48, part 3).

`kvlib.engine.cuda_graph` replays decode-only steps; a step with a prefill chunk in it runs
eagerly, launching every kernel of the model from Python, so a request's first token (TTFT) pays
the host cost that graphs removed from the others. vLLM captures such steps too: piecewise, the
model's pieces between attention layers as graphs and attention eagerly, or whole when the
attention kernel can read its metadata from fixed buffers. Here the whole forward is captured,
because `kvlib.ops.varlen_attention.varlen_paged_attention` attends prefill and decode rows alike
in one launch that reads everything it needs from device buffers:

- **buckets by token count** (16, 32, 64, ... up to the step's token budget): a step of N tokens
  runs at the smallest bucket that holds N, its rows padded;
- **static buffers** (`MixedBuffers`): token ids, positions and slot mapping for the largest
  bucket; `cu_seqlens_q`, lengths and block tables for `max_seqs` sequences;
- **padding**: padding tokens belong to no sequence (`cu_seqlens_q` ends at N, sequences past
  the step's have no queries), write their K/V into the scratch block no request is ever given,
  and their rows are dropped; the attention grid covers the bucket (programs past a sequence's
  queries return at once), so every replay of a bucket launches the same kernels.

`MixedGraphRunner` captures one graph per bucket on CUDA (`capture`), and elsewhere runs the same
forward eagerly through the same buffers: on a CPU the kernel runs under Triton's interpreter,
which is what the CPU tests check. Each row's arithmetic is its own (one program per sequence,
query tile and head), so tokens do not depend on the bucket. The engine opts in with
`ModelRunner(mixed_graphs=True)`; decode-only steps still go through `DecodeGraphRunner`.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.cache.paged import PagedCache, PagedKV
from kvlib.engine.cuda_graph import DecodeGraphRunner

__all__ = ["MixedBuffers", "MixedGraphKV", "MixedGraphRunner", "token_buckets"]


def token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Token counts graphs are captured at: powers of two from `smallest` to the first that
    holds `max_tokens`."""
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


@dataclasses.dataclass
class MixedBuffers:
    """A step's metadata at fixed addresses: token rows for the largest bucket (a bucket of size
    b reads rows [:b]) and sequence rows for `max_seqs` sequences."""

    input_ids: torch.Tensor  # (max_tokens,) int64
    positions: torch.Tensor  # (max_tokens,) int64
    slot_mapping: torch.Tensor  # (max_tokens,) int64
    cu_seqlens_q: torch.Tensor  # (max_seqs + 1,) int32
    seq_lens: torch.Tensor  # (max_seqs,) int32
    block_tables: torch.Tensor  # (max_seqs, max_blocks) int32

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device) -> MixedBuffers:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            zeros(max_tokens),
            zeros(max_tokens),
            zeros(max_tokens),
            zeros(max_seqs + 1, dtype=torch.int32),
            zeros(max_seqs, dtype=torch.int32),
            zeros(max_seqs, max_blocks, dtype=torch.int32),
        )


class MixedGraphKV:
    """The cache the model sees in a bucketed step (`kvlib.cache.base`'s seam): writes through
    the buffers' slot mapping, every row's attention through `varlen_paged_attention` over the
    buffers' sequences. No host sync, no tensor made from host data: capturable."""

    length = 0

    def __init__(self, storage: PagedCache, buffers: MixedBuffers, size: int):
        from kvlib.ops.varlen_attention import varlen_paged_attention

        self.storage, self.num_layers, self.buffers, self.size = (
            storage,
            storage.num_layers,
            buffers,
            size,
        )
        self.slot_mapping = buffers.slot_mapping[:size]
        self.handle = PagedKV(None, None, buffers.block_tables, buffers.seq_lens, None)
        self.attend = varlen_paged_attention

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        new_k, new_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (size, H_kv, D)
        return self.storage.write_slots(layer_idx, self.slot_mapping, new_k, new_v, self.handle)

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        """q (1, H, size, D) -> (1, H, size, D); padding rows come back as zeros. The kernel
        skips them, so an uninitialized output would hand them whatever the allocator's reused
        memory held: values near 1e30 overflow the next RMSNorm's mean square to inf and write
        K = V = 0 into the scratch block, other values write other K/V. Zeros make what padding
        rows compute (and write) the same on every run."""
        if weights_out is not None:
            raise ValueError("weights_out: the varlen kernel never forms attention weights")
        scales = {}
        if hasattr(kv, "key_scale"):  # a quantized cache: (num_blocks, block_size, H_kv, 1)
            scales = dict(k_scale=kv.key_scale.squeeze(-1), v_scale=kv.value_scale.squeeze(-1))
        b = self.buffers
        queries = q[0].transpose(0, 1).contiguous()  # (size, H, D)
        out = self.attend(
            queries,
            kv.key_cache,
            kv.value_cache,
            b.block_tables,
            b.cu_seqlens_q,
            b.seq_lens,
            max_query_len=self.size,  # an upper bound: the same grid for every step of the bucket
            out=torch.zeros_like(queries),  # padding rows: zeros, never reused memory (below)
            **scales,
        )
        return out.transpose(0, 1)[None]

    def advance(self, num_tokens: int) -> None:
        """Nothing to commit: the scheduler counted the tokens."""


class MixedGraphRunner(DecodeGraphRunner):
    """Runs steps of up to the largest bucket's tokens and `max_seqs` sequences through
    `MixedBuffers`, bucketed by token count; captures one CUDA graph per bucket when `capture`.

    Args:
        model: the engine's model. storage: its pools, with the scratch block `pad_block`.
        max_tokens, max_seqs, max_blocks: the largest bucket's tokens, the sequences of a step,
            a block table's width.
        capture: record and replay CUDA graphs (a CUDA device only); False runs eagerly.
    """

    def __init__(self, model, storage, *, pad_block, max_tokens, max_seqs, max_blocks, capture):
        self.model, self.storage, self.pad_block = model, storage, pad_block
        self.device = model.lm_head.weight.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, got {self.device}")
        self.capture = capture
        self.sizes = token_buckets(max_tokens)
        self.buffers = MixedBuffers.allocate(self.sizes[-1], max_seqs, max_blocks, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.steps_by_bucket: dict[int, int] = {}

    @classmethod
    def for_runner(cls, runner) -> MixedGraphRunner:
        """The mixed-step runner of a `ModelRunner` built with `mixed_graphs=True`: as many
        sequences as the engine runs at once, tokens up to its budget."""
        num_blocks = runner.manager.pool.num_blocks
        return cls(
            runner.model,
            runner.storage,
            pad_block=num_blocks,
            max_tokens=runner.max_num_batched_tokens,
            max_seqs=runner.max_num_seqs,
            max_blocks=num_blocks,
            capture=cls.captures(runner),
        )

    @staticmethod
    def captures(runner) -> bool:
        """Whether a `ModelRunner`'s mixed steps can be captured: a CUDA device over a plain
        `PagedCache` (a quantized cache's writes sync with the host)."""
        return runner.device.type == "cuda" and type(runner.storage) is PagedCache

    @staticmethod
    def supports(runner) -> bool:
        """Whether the varlen kernel can read the runner's storage here (Triton installed)."""
        from kvlib.engine.batch import kernel_supports
        from kvlib.kernels import triton_available

        dtype = runner.model.lm_head.weight.dtype
        return kernel_supports(runner.storage, dtype) and triton_available()

    def can_run(self, batch) -> bool:
        """Whether a step fits: its tokens, sequences and tables."""
        b = self.buffers
        return (
            0 < len(batch.input_ids) <= self.sizes[-1]
            and len(batch.seq_lens) <= b.seq_lens.shape[0]
            and batch.block_tables.shape[1] <= b.block_tables.shape[1]
        )

    def _fill(self, batch, n: int, size: int) -> None:
        """Write the step's n token rows and its sequences, padding the rest, in place."""
        b, seqs = self.buffers, len(batch.seq_lens)
        b.input_ids[:n].copy_(batch.input_ids)
        b.positions[:n].copy_(batch.positions)
        b.slot_mapping[:n].copy_(batch.slot_mapping)
        b.input_ids[n:size] = 0
        b.positions[n:size] = 0
        b.slot_mapping[n:size] = self.pad_block * self.storage.block_size
        b.cu_seqlens_q[: seqs + 1].copy_(batch.query_start_loc)
        b.cu_seqlens_q[seqs + 1 :] = n  # sequences past the step's: no queries
        b.seq_lens[:seqs].copy_(batch.seq_lens)
        b.seq_lens[seqs:] = 0
        width = batch.block_tables.shape[1]
        b.block_tables[:seqs, :width].copy_(batch.block_tables)
        b.block_tables[:seqs, width:] = 0

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the buffers' rows [:size] -> logits (size, V)."""
        return self.model(
            self.buffers.input_ids[:size][None],
            cache=MixedGraphKV(self.storage, self.buffers, size),
            position_ids=self.buffers.positions[:size][None],
            validate=False,
        )[0]
