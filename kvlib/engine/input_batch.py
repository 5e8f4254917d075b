"""The step's inputs built with array operations over all sequences (issue 48, part 2).

`kvlib.engine.batch.prepare_inputs` is the readable version: a Python loop that appends every
token's id, position and slot to lists, pads every block table to the widest and turns the lists
into tensors, about a dozen host operations per token and a fresh tensor per field per step.
`InputBatch.prepare` builds the same `ModelInput` (tested equal) the way vLLM v1's `InputBatch`
and `GPUModelRunner._prepare_inputs` do:

- **persistent rows**: each request keeps a row of a block table array `(rows, max_blocks)` for as
  long as the block manager holds it; a step writes only the entries that changed (a table only
  changes at its end: a new block, a copy-on-write of its last block, a truncation; a readmitted,
  forked or evicting sequence gets a new table list and its row is rewritten whole);
- **array arithmetic**: positions, slot indices, slots (`block_table[row, i // block_size] *
  block_size + i % block_size`), cumulative query starts and sample rows are numpy expressions
  over the step's tokens; the Python left is one short pass over the scheduled requests to read
  their counts;
- **one transfer**: every int64 field is packed into one host buffer (pinned on CUDA, two of them
  used in turn so that the next step can be written while this one's copy is queued) and sent
  with one copy; the fields are views of one device buffer;
- **placeholders resolved on the device**: with the overlapped engine, a decoding request's
  newest token may not be on the host yet; its input id is then taken on the device from the
  previous step's sampled ids (`resolve_placeholders`), as vLLM's async scheduling and SGLang's
  overlap scheduler do.

What it does not do: decide anything (the scheduler did), or hold K/V.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.engine.batch import ModelInput
from kvlib.engine.request import Request

__all__ = ["InputBatch", "StagedInput"]


@dataclasses.dataclass
class StagedInput:
    """A step's inputs on their way to the device: `packed` holds every int64 field end to end
    (host memory), `fields` where each lies in it; `placeholders` (rows of `input_ids`,
    rows of the previous step's sampled ids) the tokens to resolve there; the host-side counts
    the attention metadata reads without a sync."""

    packed: torch.Tensor  # (size,) int64 on the host
    fields: dict[str, tuple[int, int, tuple[int, ...]]]  # name -> (offset, size, shape)
    sample_requests: list[Request]
    query_lens: np.ndarray  # (n,) int64
    seq_lens: np.ndarray  # (n,) int64
    max_query_len: int
    max_seq_len: int
    num_placeholders: int


class InputBatch:
    """Persistent per-request rows and the step's vectorized input preparation (see the module
    docstring), for a block manager of `block_size` and a model on `device`."""

    def __init__(self, block_size: int, device, *, max_rows: int = 64, max_blocks: int = 8):
        self.block_size, self.device = block_size, torch.device(device)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.rows: dict[str, int] = {}  # request id -> its row
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.row_tables: list[list[int] | None] = [None] * max_rows  # the table list each mirrors
        self.row_lens = [0] * max_rows  # entries of that table copied into the row
        self.row_last = [-1] * max_rows  # the last of them
        # the previous step's sampling order: request id -> its row among the sampled ids
        self.previous_samples: dict[str, int] = {}
        pinned = self.device.type == "cuda"
        self._host = [_HostBuffer(pinned), _HostBuffer(pinned)]  # used in turn
        self._turn = 0
        self._device_buffer: torch.Tensor | None = None

    # --- rows ------------------------------------------------------------------------------------

    def _new_row(self, request_id: str, manager: BlockManager) -> int:
        if not self.free_rows:  # take back rows of sequences the manager no longer holds
            tables = manager.block_tables
            for old in [r for r in self.rows if r not in tables]:
                row = self.rows.pop(old)
                self.row_tables[row] = None
                self.free_rows.append(row)
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.rows[request_id] = row
        return row

    def _grow_rows(self) -> None:
        old = self.block_table.shape[0]
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.row_tables += [None] * old
        self.row_lens += [0] * old
        self.row_last += [-1] * old
        self.free_rows = list(range(2 * old - 1, old - 1, -1))

    def _sync_row(self, row: int, table: list[int]) -> None:
        """Copy what changed of `table` into the row: all of it when the row mirrored another
        list, else from the last entry it had (a copy-on-write may have replaced it); zero what
        the row held past the table's end."""
        n = len(table)
        if n > self.block_table.shape[1]:
            width = max(n, 2 * self.block_table.shape[1])
            wider = np.zeros((self.block_table.shape[0], width), dtype=np.int64)
            wider[:, : self.block_table.shape[1]] = self.block_table
            self.block_table = wider
        written = self.row_lens[row]
        first = 0 if self.row_tables[row] is not table else max(0, min(n, written) - 1)
        self.block_table[row, first:n] = table[first:]
        self.block_table[row, n:written] = 0  # what a longer table left: 0, as prepare_inputs pads
        self.row_tables[row], self.row_lens[row], self.row_last[row] = table, n, table[-1]

    # --- one step --------------------------------------------------------------------------------

    def stage(self, scheduled: list[tuple[Request, int]], manager: BlockManager) -> StagedInput:
        """The step's inputs for `scheduled` (request, new tokens), after the scheduler allocated
        their slots in `manager`, in host memory: `prepare_inputs`' fields, packed (see the
        module docstring). A token whose id is not on the host yet must be the newest token of a
        request sampled by the previous staged step."""
        tables, held_tokens = manager.block_tables, manager.token_ids
        rows, starts, held, query_lens, samples = [], [], [], [], []
        ids: list[int] = []
        placeholder_rows, placeholder_sources = [], []
        for request, num_new in scheduled:
            request_id = request.request_id
            row = self.rows.get(request_id)
            if row is None:
                row = self._new_row(request_id, manager)
            table = tables[request_id]
            if (
                table is not self.row_tables[row]
                or len(table) != self.row_lens[row]
                or table[-1] != self.row_last[row]
            ):
                self._sync_row(row, table)
            start = request.num_computed_tokens
            if num_new == 1:  # a decode row: its newest token, known or a placeholder
                token = request.token_id(start)
                if token is None:
                    placeholder_rows.append(len(ids))
                    placeholder_sources.append(self.previous_samples[request_id])
                    token = 0  # replaced on the device
                ids.append(token)
            else:
                chunk = request.token_ids(start, start + num_new)
                if None in chunk:
                    raise ValueError(
                        f"scheduled: request {request_id!r} computes {num_new} tokens, one of "
                        "them not sampled yet; a placeholder is only ever a single decode token"
                    )
                ids += chunk
            rows.append(row)
            starts.append(start)
            held.append(len(held_tokens[request_id]))
            query_lens.append(num_new)
            samples.append(start + num_new == request.num_tokens)
        return self._pack(
            scheduled, rows, starts, held, query_lens, samples, ids, placeholder_rows,
            placeholder_sources,
        )  # fmt: skip

    def _pack(
        self, scheduled, rows, starts, held, query_lens, samples, ids, placeholder_rows, sources
    ) -> StagedInput:
        """The numpy half of `stage`: every field from the per-request counts."""
        n = len(rows)
        rows, starts, held, query_lens = np.array([rows, starts, held, query_lens], dtype=np.int64)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == n:  # decode only: one token per sequence
            positions, slot_index, token_rows = starts, held - 1, rows
        else:
            sequence = np.repeat(np.arange(n), query_lens)  # (N,) each token's sequence
            offset = np.arange(num_tokens) - query_start_loc[:-1][sequence]  # (N,) within it
            positions = starts[sequence] + offset
            slot_index = (held - query_lens)[sequence] + offset
            token_rows = rows[sequence]
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, slot_index // bs] * bs + slot_index % bs
        max_seq_len = int(held.max())
        width = (max_seq_len + bs - 1) // bs  # the widest table's blocks
        sample_indices = query_start_loc[1:] - 1  # each sequence's last row
        if not all(samples):  # a prefill chunk samples nothing
            sample_indices = sample_indices[np.array(samples, dtype=bool)]
        parts = {
            "input_ids": np.array(ids, dtype=np.int64),
            "positions": positions,
            "slot_mapping": slot_mapping,
            "query_start_loc": query_start_loc,
            "seq_lens": held,
            "sample_indices": sample_indices,
            "block_tables": self.block_table[rows, :width],
        }
        if placeholder_rows:
            parts["placeholder_rows"] = np.array(placeholder_rows, dtype=np.int64)
            parts["placeholder_sources"] = np.array(sources, dtype=np.int64)
        host = self._host[self._turn]
        self._turn ^= 1
        packed, fields = host.pack(parts)
        sample_requests = [r for (r, _), s in zip(scheduled, samples) if s]
        self.previous_samples = {r.request_id: i for i, r in enumerate(sample_requests)}
        return StagedInput(
            packed,
            fields,
            sample_requests,
            query_lens,
            held,
            1 if num_tokens == n else int(query_lens.max()),
            max_seq_len,
            len(placeholder_rows),
        )

    def to_device(self, staged: StagedInput, previous_sampled: torch.Tensor | None) -> ModelInput:
        """The staged step as a `ModelInput` on the device: one copy of the packed buffer (none on
        a CPU: the fields are views of the host memory), then the placeholders' ids taken from
        `previous_sampled (m,)`, the previous step's sampled ids (device work, in order)."""
        host = staged.packed
        if self.device.type == "cpu":
            flat = host
        else:
            size = host.numel()
            if self._device_buffer is None or self._device_buffer.numel() < size:
                self._device_buffer = torch.empty(2 * size, dtype=torch.int64, device=self.device)
            flat = self._device_buffer[:size]
            flat.copy_(host, non_blocking=True)
        views = {
            name: flat[offset : offset + size] for name, (offset, size, _) in staged.fields.items()
        }
        views["block_tables"] = views["block_tables"].view(staged.fields["block_tables"][2])
        if staged.num_placeholders:
            views["input_ids"].index_copy_(
                0,
                views["placeholder_rows"],
                previous_sampled.index_select(0, views["placeholder_sources"]),
            )
        return ModelInput(
            input_ids=views["input_ids"],
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            sample_indices=views["sample_indices"],
            sample_requests=staged.sample_requests,
            query_lens=staged.query_lens,
            seq_lens_host=staged.seq_lens,
            max_query_len=staged.max_query_len,
            max_seq_len=staged.max_seq_len,
        )

    def prepare(self, scheduled: list[tuple[Request, int]], manager: BlockManager) -> ModelInput:
        """`stage` and `to_device` at once, for steps without placeholders: the same `ModelInput`
        as `prepare_inputs(scheduled, manager, device)`."""
        return self.to_device(self.stage(scheduled, manager), None)


class _HostBuffer:
    """A growable int64 host buffer (pinned memory for a CUDA device, so that the copy can be
    queued without waiting) into which a step's fields are packed end to end; `tensor` and
    `array` are the same memory."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.tensor = torch.empty(0, dtype=torch.int64)
        self.array = self.tensor.numpy()

    def pack(self, parts: dict[str, np.ndarray]) -> tuple[torch.Tensor, dict]:
        """Copy `parts` end to end; returns the used part of the buffer and each part's (offset,
        size, shape)."""
        fields, offset = {}, 0
        for name, part in parts.items():
            fields[name] = (offset, part.size, part.shape)
            offset += part.size
        if self.array.size < offset:
            self.tensor = torch.empty(2 * offset, dtype=torch.int64, pin_memory=self.pinned)
            self.array = self.tensor.numpy()
        for (start, size, _), part in zip(fields.values(), parts.values()):
            self.array[start : start + size] = part.ravel()
        return self.tensor[:offset], fields
