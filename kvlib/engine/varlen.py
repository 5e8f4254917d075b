"""The engine's prefill rows through varlen paged attention (issue 36, part 3).

`VarlenBatchKV` is the step's cache (`BatchKV`'s seam) that attends each prefilling sequence's new
queries over its own blocks only (`kvlib.ops.paged_prefill.paged_prefill_attention`), instead of
`BatchKV`'s padded batch that gathers every sequence's K/V up to the longest one. Decode rows go
through chapter 11's kernel when `decode_kernel` is on (as `KernelBatchKV` sends them), otherwise
through the same varlen function (a decode row is a sequence with one query). For storage that
`kernel_supports` (a `PagedCache`, or a `QuantizedPagedCache` with one symmetric scale per token
and KV head).
"""

from __future__ import annotations

import torch

from kvlib.engine.batch import KernelBatchKV, ModelInput
from kvlib.engine.sampler import device_tensor
from kvlib.ops.paged_prefill import paged_prefill_attention

__all__ = ["VarlenBatchKV"]


class VarlenBatchKV(KernelBatchKV):
    """A step's cache whose prefill rows (and, without the kernel, decode rows) attend through
    `paged_prefill_attention`, with the lengths the scheduler knows on the host (no sync)."""

    def __init__(self, storage, batch: ModelInput, *, decode_kernel: bool = True, **kernel):
        self.decode_kernel = decode_kernel
        super().__init__(storage, batch, **kernel)

    def _split(self, query_lens: list[int]) -> tuple[list[int], list[int]]:
        if self.decode_kernel:
            return super()._split(query_lens)
        return [], list(range(len(query_lens)))

    def _make_prefill(self, batch: ModelInput, seqs: list[int]):
        seq_lens = batch.seq_lens_host
        if seq_lens is None:
            seq_lens = batch.seq_lens.tolist()
        query_lens = batch.query_lens
        if query_lens is None:
            query_lens = batch.query_start_loc.diff().tolist()
        index = device_tensor(seqs, torch.int64, batch.input_ids.device)
        return (
            batch.block_tables[index],
            [query_lens[i] for i in seqs],
            [seq_lens[i] for i in seqs],
        )

    def _attend_prefill(self, q, kv, mask):
        """q (1, H, N_prefill, D), the prefill rows in batch order -> (1, H, N_prefill, D)."""
        tables, query_lens, seq_lens = self.prefill
        scales = {}
        if hasattr(kv, "key_scale"):  # a quantized cache: (num_blocks, block_size, H_kv, 1)
            scales = dict(k_scale=kv.key_scale.squeeze(-1), v_scale=kv.value_scale.squeeze(-1))
        out = paged_prefill_attention(
            q[0].transpose(0, 1),  # (N_prefill, H, D)
            kv.key_cache,
            kv.value_cache,
            tables,
            query_lens,
            seq_lens,
            **scales,
        )
        return out.transpose(0, 1)[None]
