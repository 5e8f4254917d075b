"""The engine's prefill rows through varlen paged attention (issue 36, part 3; issue 48, part 3).

`VarlenBatchKV` is the step's cache (`BatchKV`'s seam) that attends each prefilling sequence's new
queries over its own blocks only, instead of `BatchKV`'s padded batch that gathers every
sequence's K/V up to the longest one: through the fused Triton kernel
(`kvlib.ops.varlen_attention.varlen_paged_attention`, one launch per layer for all of them,
`prefill_kernel=True`) or its torch reference (`kvlib.ops.paged_prefill.paged_prefill_attention`,
a loop over the sequences). Decode rows go through chapter 11's kernel when `decode_kernel` is on
(as `KernelBatchKV` sends them), otherwise through the same varlen attention (a decode row is a
sequence with one query). For storage that `kernel_supports` (a `PagedCache`, or a
`QuantizedPagedCache` with one symmetric scale per token and KV head).
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.engine.batch import KernelBatchKV, ModelInput
from kvlib.engine.sampler import device_tensor
from kvlib.ops.paged_prefill import paged_prefill_attention

__all__ = ["VarlenBatchKV"]


class VarlenBatchKV(KernelBatchKV):
    """A step's cache whose prefill rows (and, without the decode kernel, decode rows too) attend
    through varlen attention: the Triton kernel with `prefill_kernel`, else the reference, with
    the lengths the scheduler knows on the host (no sync)."""

    def __init__(
        self,
        storage,
        batch: ModelInput,
        *,
        decode_kernel: bool = True,
        prefill_kernel: bool = False,
        **kernel,
    ):
        self.decode_kernel, self.prefill_kernel = decode_kernel, prefill_kernel
        super().__init__(storage, batch, **kernel)

    def _split(self, query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.decode_kernel:
            return super()._split(query_lens)
        return np.arange(0), np.arange(len(query_lens))

    def _make_prefill(self, batch: ModelInput, seqs):
        """The prefill sequences' block tables and lengths: host lists for the reference, and
        for the kernel int32 device tensors in the cu_seqlens convention."""
        seq_lens = batch.seq_lens_host
        if seq_lens is None:
            seq_lens = batch.seq_lens.tolist()
        query_lens = batch.query_lens
        if query_lens is None:
            query_lens = batch.query_start_loc.diff().tolist()
        device = batch.input_ids.device
        index = device_tensor(seqs, torch.int64, device)
        lens = [int(query_lens[i]) for i in seqs]
        held = [int(seq_lens[i]) for i in seqs]
        tables = batch.block_tables[index]
        if not self.prefill_kernel:
            return tables, lens, held
        cu_seqlens = device_tensor(np.concatenate([[0], np.cumsum(lens)]), torch.int32, device)
        return tables.to(torch.int32), cu_seqlens, device_tensor(held, torch.int32, device), lens

    def _attend_prefill(self, q, kv, mask):
        """q (1, H, N_prefill, D), the prefill rows in batch order -> (1, H, N_prefill, D)."""
        scales = {}
        if hasattr(kv, "key_scale"):  # a quantized cache: (num_blocks, block_size, H_kv, 1)
            scales = dict(k_scale=kv.key_scale.squeeze(-1), v_scale=kv.value_scale.squeeze(-1))
        rows = q[0].transpose(0, 1)  # (N_prefill, H, D)
        if self.prefill_kernel:
            from kvlib.ops.varlen_attention import varlen_paged_attention

            tables, cu_seqlens, seq_lens, lens = self.prefill
            out = varlen_paged_attention(
                rows.contiguous(),
                kv.key_cache,
                kv.value_cache,
                tables,
                cu_seqlens,
                seq_lens,
                max_query_len=max(lens),
                **scales,
            )
        else:
            tables, query_lens, seq_lens = self.prefill
            out = paged_prefill_attention(
                rows, kv.key_cache, kv.value_cache, tables, query_lens, seq_lens, **scales
            )
        return out.transpose(0, 1)[None]
