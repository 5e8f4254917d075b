"""The step's flattened batch (chapter 12): its attention metadata and its cache view.

A step mixes requests at different stages: one computes 64 tokens of its prompt, fifteen decode
one token each. `prepare_inputs` lays their new tokens end to end, `N` tokens in one `(1, N)` row,
so the projections and MLP compute exactly the tokens planned and no padding, and builds the
**attention metadata** vLLM's runner builds:

- `positions (N,)`: each token's RoPE position in its own sequence;
- `slot_mapping (N,)`: the pool slot each token's K/V is written to;
- `query_start_loc (n + 1,)`: where each of the n sequences' tokens start in the row
  (FlashAttention's `cu_seqlens_q`);
- `seq_lens (n,)` and `block_tables (n, max_blocks)`: the tokens each sequence holds after this
  step, and where.

`BatchKV` is the cache object the model sees for the step, through the same seam every cache of
the course uses. Its `update` writes the step's K/V through the slot mapping (into the pools of a
`PagedCache` or a `QuantizedPagedCache`, so the quantized cache of chapter 10 plugs in), and its
attention regroups the queries per sequence and attends with a mask built from the metadata:
query j of a sequence that held `c` tokens before the step sees its slots 0 .. c + j. Over a plain
`PagedCache` it gathers each sequence's K/V once per layer and calls PyTorch's fused
`scaled_dot_product_attention` (on a CPU its flash kernel: no score tensor, and faster there than
the grouped product it replaced at the engine's decode shapes); over other storage, that cache's
own paged attention. `KernelBatchKV` sends decode rows through chapter 11's kernel instead.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.paged import PagedCache, PagedKV, gather_kv, paged_attention, read_slots
from kvlib.engine.request import Request
from kvlib.engine.sampler import device_tensor
from kvlib.ops.attention import sdpa_attention

__all__ = ["BatchKV", "KernelBatchKV", "ModelInput", "kernel_supports", "prepare_inputs"]


@dataclasses.dataclass
class ModelInput:
    """One step's flattened batch (see the module docstring); `sample_indices` are the rows of the
    requests that produce a token this step (their last token; a request still prefilling
    produces none), `sample_requests` those requests."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    slot_mapping: torch.Tensor  # (N,) int64
    query_start_loc: torch.Tensor  # (n + 1,) int64
    seq_lens: torch.Tensor  # (n,) int64
    block_tables: torch.Tensor  # (n, max_blocks) int64; 0 past a sequence's last block
    sample_indices: torch.Tensor  # (m,) int64
    sample_requests: list[Request]
    query_lens: list[int] | np.ndarray | None = None  # (n,) on the host: new tokens per sequence
    seq_lens_host: list[int] | np.ndarray | None = None  # (n,) on the host: `seq_lens`
    max_query_len: int | None = None  # on the host: max(query_lens)
    max_seq_len: int | None = None  # on the host: max(seq_lens)


def prepare_inputs(
    scheduled: list[tuple[Request, int]], manager: BlockManager, device="cpu"
) -> ModelInput:
    """The flattened batch for `scheduled` (request, new tokens), after the scheduler allocated
    their slots: token t of a request that now holds `held` slots and computes `n` tokens this
    step is its token `num_computed_tokens + t`, at RoPE position `num_computed_tokens + t` and
    slot index `held - n + t` (they differ once a sequence has evicted tokens)."""
    ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
    sample_indices, sample_requests = [], []
    for request, num_new in scheduled:
        rid, start = request.request_id, request.num_computed_tokens
        held = manager.num_tokens(rid)
        ids += request.all_token_ids[start : start + num_new]
        positions += range(start, start + num_new)
        slots += [manager.slot(rid, held - num_new + t) for t in range(num_new)]
        starts.append(starts[-1] + num_new)
        seq_lens.append(held)
        tables.append(manager.block_tables[rid])
        if start + num_new == request.num_tokens:  # its last token: logits for the next one
            sample_indices.append(starts[-1] - 1)
            sample_requests.append(request)
    width = max(len(t) for t in tables)

    def tensor(values):
        return device_tensor(values, torch.int64, device)  # no wait for the device on CUDA

    return ModelInput(
        input_ids=tensor(ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        query_start_loc=tensor(starts),
        seq_lens=tensor(seq_lens),
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),
        sample_indices=tensor(sample_indices),
        sample_requests=sample_requests,
        query_lens=[num_new for _, num_new in scheduled],
        seq_lens_host=seq_lens,
        max_query_len=max(num_new for _, num_new in scheduled),
        max_seq_len=max(seq_lens),
    )


class BatchKV:
    """The cache the model sees for one step (`kvlib.cache.base`'s seam): writes go through the
    slot mapping into `storage`'s pools, attention reads through the block tables (PyTorch's
    fused attention over a plain `PagedCache`'s gathered K/V, else `storage`'s own paged
    attention). `storage` is a `PagedCache` (or a subclass storing another
    layout, such as `QuantizedPagedCache`) used for its pools only; the engine's `BlockManager`
    decides the slots."""

    length = 0  # the model's inputs carry no padding and no past: positions come from metadata

    def __init__(self, storage: PagedCache, batch: ModelInput):
        self.storage, self.batch = storage, batch
        self.num_layers = storage.num_layers
        n, device = len(batch.seq_lens), batch.input_ids.device
        if batch.max_query_len is not None and batch.max_seq_len is not None:  # no host sync
            self.max_query_len, max_len = batch.max_query_len, batch.max_seq_len
        else:
            query_lens = batch.query_start_loc.diff()
            self.max_query_len, max_len = int(query_lens.max()), int(batch.seq_lens.max())
        key = torch.arange(max_len, device=device)  # (S,)
        if self.max_query_len == 1:  # decode only: row i is sequence i's one query
            self.row_seq = torch.arange(n, device=device)
            self.row_token = torch.zeros(n, dtype=torch.int64, device=device)
            self.mask = key[None, None, :] < batch.seq_lens[:, None, None]  # (n, 1, S)
        else:
            query_lens = batch.query_start_loc.diff()  # (n,)
            # each flattened row's sequence and its index among that sequence's new tokens
            self.row_seq = torch.repeat_interleave(torch.arange(n, device=device), query_lens)
            self.row_token = (
                torch.arange(len(batch.input_ids), device=device)
                - (batch.query_start_loc[:-1][self.row_seq])
            )
            past = (batch.seq_lens - query_lens)[:, None]  # (n, 1): slots held before the step
            query = torch.arange(self.max_query_len, device=device)[None]  # (1, T)
            last = past + torch.minimum(query, query_lens[:, None] - 1)  # padding rows: the last
            self.mask = key[None, None, :] <= last[:, :, None]  # (n, T, S)
        positions = torch.minimum(key[None], batch.seq_lens[:, None] - 1)  # (n, S)
        self.handle = PagedKV(None, None, batch.block_tables, batch.seq_lens, positions)
        self.slots = None  # (n, S): the pool slots every layer reads (`attention_backend`)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: (1, H_kv, N, D), the step's new keys and values: written at the slot mapping."""
        new_k, new_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, H_kv, D)
        return self.storage.write_slots(
            layer_idx, self.batch.slot_mapping, new_k, new_v, self.handle
        )

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        """q (1, H, N, D) -> (1, H, N, D): regroup the rows per sequence (n, H, T, D), attend with
        the storage's paged attention and this step's mask (the model's own `mask`, for an
        unbatched causal row, does not apply), and flatten back."""
        n, h, d = len(self.batch.seq_lens), q.shape[1], q.shape[-1]
        if self.max_query_len == 1:  # decode only: row i is sequence i's query
            # (n, H, 1, D), copied so that every batch size runs the same operations (at n = 1
            # the transpose alone is already contiguous)
            grouped = q[0].transpose(0, 1)[:, :, None].clone()
        else:
            grouped = q.new_zeros(n, h, self.max_query_len, d)
            grouped[self.row_seq, :, self.row_token] = q[0].transpose(0, 1)
        backend = self.storage.attention_backend
        if backend is paged_attention and weights_out is None:  # a plain paged cache
            # PyTorch's fused attention (on a CPU its flash kernel: no score tensor in memory,
            # GQA's groups read from the shared K/V, not repeated), straight over the gathered
            # K/V as they lie (B, H_kv, S, D views, no copy); the slots every layer reads are
            # worked out at the first layer
            if self.slots is None:
                self.slots = read_slots(kv)
            out = sdpa_attention(grouped, gather_kv(kv, self.slots), self.mask)
        else:
            out = backend(grouped, kv, self.mask, weights_out=weights_out)
        if self.max_query_len == 1:
            return out[:, :, 0].transpose(0, 1)[None]  # (1, H, n, D_v)
        return out[self.row_seq, :, self.row_token].transpose(0, 1)[None]

    def advance(self, num_tokens: int) -> None:
        """Nothing to commit: the scheduler already counted the tokens."""


def _subset(batch: ModelInput, seqs) -> ModelInput:
    """The rows and metadata of sequences `seqs` of `batch` (no sampling), from the lengths known
    on the host when the batch has them (no sync)."""
    device = batch.input_ids.device
    query_lens = batch.query_lens
    if query_lens is None:
        query_lens = batch.query_start_loc.diff().tolist()
    seq_lens = batch.seq_lens_host
    if seq_lens is None:
        seq_lens = batch.seq_lens.tolist()
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    rows = device_tensor(
        np.concatenate([np.arange(starts[i], starts[i + 1]) for i in seqs]), torch.int64, device
    )
    lens = [int(query_lens[i]) for i in seqs]
    held = [int(seq_lens[i]) for i in seqs]
    index = device_tensor(seqs, torch.int64, device)
    return ModelInput(
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        slot_mapping=batch.slot_mapping[rows],
        query_start_loc=device_tensor([0, *itertools.accumulate(lens)], torch.int64, device),
        seq_lens=batch.seq_lens[index],
        block_tables=batch.block_tables[index],
        sample_indices=rows[:0],
        sample_requests=[],
        query_lens=lens,
        seq_lens_host=held,
        max_query_len=max(lens),
        max_seq_len=max(held),
    )


def kernel_supports(storage: PagedCache, dtype: torch.dtype) -> bool:
    """Whether `paged_decode_attention` can read `storage`'s pools for queries of `dtype`: a
    `PagedCache` of that dtype, or a `QuantizedPagedCache` of int8/fp8 codes with one symmetric
    float16/float32 scale per token and KV head (no channel groups, no zero points)."""
    from kvlib.cache.quantized import QuantizedPagedCache
    from kvlib.ops.decode_checks import QUANTIZED_DTYPES, SUPPORTED_DTYPES

    if dtype not in SUPPORTED_DTYPES:
        return False
    if type(storage) is PagedCache:
        return storage.key_cache[0].dtype == dtype
    if type(storage) is QuantizedPagedCache:
        return (
            storage.key_zero is None
            and storage.value_zero is None
            and all(
                codes[0].dtype in QUANTIZED_DTYPES
                and codes[0].shape[-1] == storage.head_dim
                and scale[0].shape[-1] == 1
                and scale[0].dtype in (torch.float16, torch.float32)
                for codes, scale in (
                    (storage.key_cache, storage.key_scale),
                    (storage.value_cache, storage.value_scale),
                )
            )
            and storage.key_scale[0].dtype == storage.value_scale[0].dtype
            and storage.key_cache[0].dtype == storage.value_cache[0].dtype
        )
    return False


class KernelBatchKV(BatchKV):
    """`BatchKV` whose decode rows, the sequences computing one new token this step, attend
    through chapter 11's Triton kernel (`kvlib.kernels.paged_decode_attention`) straight from the
    pools, with no gathered K/V and no mask; a quantized cache's codes and per-token scales are
    read by the kernel's int8/fp8 path. The rows of sequences still prefilling (several new
    tokens) take `BatchKV`'s path, restricted to those sequences. Only for storage that
    `kernel_supports`.

    Each decode row's result depends on its own sequence only: the kernel runs one program per
    (sequence, KV head, split), and the split count is the runner's, fixed for its lifetime (not
    chosen per batch), so a sequence's partial sums do not change with its batch.
    """

    def __init__(
        self, storage: PagedCache, batch: ModelInput, *, num_splits: int = 1, workspace=None
    ):
        self.storage, self.batch = storage, batch
        self.num_layers = storage.num_layers
        self.num_splits, self.workspace = num_splits, workspace
        query_lens = batch.query_lens
        if query_lens is None:
            query_lens = batch.query_start_loc.diff().tolist()
        query_lens = np.asarray(query_lens, dtype=np.int64)
        device = batch.input_ids.device
        decode, prefill = self._split(query_lens)
        # what update hands the storage: it only writes through the slot mapping and returns the
        # layer's pools with these fields
        self.handle = PagedKV(None, None, batch.block_tables, batch.seq_lens, None)
        self.prefill = self._make_prefill(batch, prefill) if len(prefill) else None
        if not len(prefill):  # decode only: every row, in order (no index to build)
            self.decode_rows = self.prefill_rows = None
            self.decode_tables = batch.block_tables.to(torch.int32)  # the kernel's int32
            self.decode_lens = batch.seq_lens.to(torch.int32)
            return
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        self.decode_rows = device_tensor(starts[decode], torch.int64, device)
        index = device_tensor(decode, torch.int64, device)
        self.decode_tables = batch.block_tables.index_select(0, index).to(torch.int32)
        self.decode_lens = batch.seq_lens.index_select(0, index).to(torch.int32)
        rows = [np.arange(starts[i], starts[i + 1]) for i in prefill]
        self.prefill_rows = device_tensor(np.concatenate(rows), torch.int64, device)

    def _split(self, query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequences whose rows the kernel decodes, and the others (prefilling)."""
        return np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)

    def _make_prefill(self, batch: ModelInput, seqs: list[int]):
        """What attends the rows of sequences `seqs` (`_attend_prefill` uses it)."""
        return BatchKV(self.storage, _subset(batch, seqs))

    def _attend_prefill(self, q, kv, mask):
        """q (1, H, N_prefill, D): the prefill rows, attended as `BatchKV` attends them."""
        handle = self.prefill.handle
        prefill_kv = kv._replace(
            block_tables=handle.block_tables, seq_lens=handle.seq_lens, positions=handle.positions
        )
        return self.prefill.attention_backend(q, prefill_kv, mask)

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        """q (1, H, N, D) -> (1, H, N, D): decode rows through the kernel, prefill rows as
        `_attend_prefill` attends them (`BatchKV`'s way here)."""
        from kvlib.kernels import paged_decode_attention

        if weights_out is not None:
            raise ValueError("weights_out: the decode kernel never forms attention weights")
        scales = {}
        if hasattr(kv, "key_scale"):  # a quantized cache: (num_blocks, block_size, H_kv, 1)
            scales = dict(k_scale=kv.key_scale.squeeze(-1), v_scale=kv.value_scale.squeeze(-1))
        if self.decode_rows is None:  # decode only: every row through the kernel
            decoded = paged_decode_attention(
                q[0].transpose(0, 1),  # (n, H, D)
                kv.key_cache,
                kv.value_cache,
                self.decode_tables,
                self.decode_lens,
                num_splits=self.num_splits,
                validate=False,  # the scheduler's block tables and lengths
                workspace=self.workspace,
                **scales,
            )
            return decoded.transpose(0, 1)[None]
        out = torch.empty_like(q)
        if len(self.decode_rows):
            decoded = paged_decode_attention(
                q[0].index_select(1, self.decode_rows).transpose(0, 1),  # (n_decode, H, D)
                kv.key_cache,
                kv.value_cache,
                self.decode_tables,
                self.decode_lens,
                num_splits=self.num_splits,
                validate=False,
                workspace=self.workspace,
                **scales,
            )
            out[0].index_copy_(1, self.decode_rows, decoded.transpose(0, 1))
        if self.prefill is not None:
            out[0].index_copy_(
                1,
                self.prefill_rows,
                self._attend_prefill(q[:, :, self.prefill_rows], kv, mask)[0],
            )
        return out
