"""The model runner (chapter 12): one batched forward for whatever the scheduler planned.

The runner builds the step's flattened batch and its attention metadata (`kvlib.engine.batch`:
`ModelInput`, `BatchKV`; built with array operations over all sequences by
`kvlib.engine.input_batch.InputBatch`), runs the course's `LlamaModel`, unchanged, over it
through the cache seam every cache of the course uses, and samples. On a GPU it sends decode rows
through chapter 11's kernel (`KernelBatchKV`) and replays decode-only steps as CUDA graphs
(`kvlib.engine.cuda_graph`); prefill rows go through `BatchKV`'s padded batch, or on request
through varlen paged attention (`kvlib.engine.varlen`).

A step is launched (`submit`) and its tokens collected later (`StepHandle.result`): the device
work is one job run by a device queue (`kvlib.engine.overlap`), so that the overlapped engine can
plan step n + 1 while step n runs. `execute` does both at once.

Sampling is per request, with the request's own generator, so a request's tokens do not depend on
which others share its steps: `sample` is the readable one-request sampler, and the runner samples
a whole step on the device with the same arithmetic (`kvlib.engine.sampler.sample_step`), bringing
the tokens to the host in one transfer.
"""

from __future__ import annotations

import functools

import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.paged import PagedCache
from kvlib.engine.batch import BatchKV, KernelBatchKV, ModelInput, kernel_supports
from kvlib.engine.input_batch import InputBatch, StagedInput
from kvlib.engine.overlap import InlineDevice, StepHandle, start_transfer
from kvlib.engine.request import Request, TokenLogprobs
from kvlib.engine.sampler import sample, sample_step, token_logprobs

__all__ = ["ModelRunner", "sample", "token_logprobs"]


class ModelRunner:
    """Runs a step: `prepare_inputs`, one forward of the model over a `BatchKV`, then
    `sample_step` for the requests that produce a token (`sample`'s tokens, one host transfer).
    Returns {request id: token}.

    `decode_kernel`: attend decode rows through chapter 11's Triton kernel (`KernelBatchKV`).
    None (the default) uses it on a CUDA device where Triton is installed and the storage's
    layout suits it (`kernel_supports`); True asks for it anywhere it is supported (on a CPU it
    runs under Triton's interpreter: exact and slow, for tests), False never uses it.
    `prefill_varlen`: attend prefill rows (and decode rows the kernel does not take) through
    `kvlib.engine.varlen.VarlenBatchKV`, each sequence over its own blocks, where the storage's
    layout suits it: with the fused Triton kernel (`prefill_kernel`: None, the default, uses it
    where the decode kernel runs; True anywhere Triton is, under the interpreter on a CPU; False
    never) or else the torch reference, which loops over the sequences (a few dozen launches per
    sequence and layer). Off by default (`BatchKV`'s one padded batch, measured faster on an H100
    than the reference at the course's sizes, `results/serving_gpu.csv`).
    `cuda_graphs`: run decode-only steps of up to `max_graph_batch` sequences through
    `kvlib.engine.cuda_graph.DecodeGraphRunner` (bucketed, static buffers): captured as CUDA
    graphs on a CUDA device with the kernel, eagerly through the same buffers elsewhere. It
    grows the storage's pools by one scratch block for padding rows, so it is chosen here, before
    anything is stored. None (the default): on where the kernel runs on a CUDA device over a plain
    `PagedCache` (measured on an H100 serving SmolLM2: `results/serving_gpu.csv`).
    `mixed_graphs`: run steps that carry prompt tokens through `kvlib.engine.mixed_graph`'s
    static buffers, every row attending through the fused varlen kernel, bucketed by token count
    (up to `max_num_batched_tokens` tokens of up to `max_num_seqs` sequences): captured as CUDA
    graphs on a CUDA device over a plain `PagedCache`, eagerly elsewhere (on a CPU under Triton's
    interpreter). Off by default; it needs Triton.
    `max_model_len`: the longest sequence a request may reach (the engine's `max_model_len`); it
    sizes the kernel's split count (`kernel_splits`). None: the pool's capacity.
    `device_queue`: what runs a step's device work (`kvlib.engine.overlap`): `InlineDevice` by
    default; a `WorkerThreadDevice` makes a CPU behave as an asynchronous device.
    """

    def __init__(
        self,
        model,
        storage: PagedCache,
        manager: BlockManager,
        *,
        decode_kernel: bool | None = None,
        prefill_varlen: bool = False,
        prefill_kernel: bool | None = None,
        cuda_graphs: bool | None = None,
        max_graph_batch: int = 64,
        mixed_graphs: bool = False,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        device_queue=None,
    ):
        self.model, self.storage, self.manager = model, storage, manager
        self.device = model.lm_head.weight.device
        self.decode_kernel, self.prefill_varlen = decode_kernel, prefill_varlen
        self.prefill_kernel = prefill_kernel
        if cuda_graphs is None:
            from kvlib.engine.cuda_graph import DecodeGraphRunner

            cuda_graphs = DecodeGraphRunner.captures(self)
        self.cuda_graphs, self.max_graph_batch, self.graph_runner = (
            cuda_graphs,
            max_graph_batch,
            None,
        )
        self.mixed_graphs, self.mixed_runner = mixed_graphs, None
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        if cuda_graphs or mixed_graphs:  # a scratch block past the pool's last, for padding rows
            storage.reallocate(manager.pool.num_blocks + 1, self.device)
        self.max_model_len = max_model_len
        self.num_splits = 1
        self._workspace = None
        self.last_logprobs: dict[str, TokenLogprobs] = {}  # `execute`'s last step's
        self.inputs = InputBatch(manager.block_size, self.device)
        self.device_queue = InlineDevice() if device_queue is None else device_queue
        self._previous_sampled: torch.Tensor | None = None  # device side: only jobs touch it
        self._paths = None  # `_attention_paths`' cache
        # a list to record (decode only, start, end) CUDA events around each step's device work
        # (a benchmark's GPU time per step); None: nothing recorded
        self.gpu_events: list | None = None

    def use_kernel(self) -> bool:
        """Whether decode steps launch the paged Triton decode kernel (`kvlib.kernels`): asked
        for (`decode_kernel`), or by default on CUDA, where the cache's layout and the model's
        dtype allow it and Triton imports."""
        from kvlib.kernels import triton_available

        dtype = self.model.lm_head.weight.dtype
        if self.decode_kernel is False or not kernel_supports(self.storage, dtype):
            return False
        if self.decode_kernel is None and self.device.type != "cuda":
            return False
        return triton_available()

    def _use_varlen(self) -> bool:
        if not self.prefill_varlen:
            return False
        return kernel_supports(self.storage, self.model.lm_head.weight.dtype)

    def _use_prefill_kernel(self) -> bool:
        """Varlen rows through the fused Triton kernel: on a CUDA device with Triton
        (`prefill_kernel` None), anywhere Triton is (True), never (False)."""
        from kvlib.kernels import triton_available

        if self.prefill_kernel is False or not self._use_varlen():
            return False
        if self.prefill_kernel is None and self.device.type != "cuda":
            return False
        return triton_available()

    def _attention_paths(self) -> tuple[bool, bool, bool]:
        """(`use_kernel()`, `_use_varlen()`, `_use_prefill_kernel()`), worked out again only
        when `decode_kernel`, `prefill_varlen` or `prefill_kernel` changed."""
        key = (self.decode_kernel, self.prefill_varlen, self.prefill_kernel)
        if self._paths is None or self._paths[0] != key:
            paths = self.use_kernel(), self._use_varlen(), self._use_prefill_kernel()
            self._paths = key, paths
        return self._paths[1]

    def _batch_kv(self, batch: ModelInput) -> BatchKV:
        use_kernel, varlen, prefill_kernel = self._attention_paths()
        if varlen and not use_kernel:
            from kvlib.engine.varlen import VarlenBatchKV

            return VarlenBatchKV(
                self.storage, batch, decode_kernel=False, prefill_kernel=prefill_kernel
            )
        if not use_kernel:
            return BatchKV(self.storage, batch)
        from kvlib.ops.decode_plan import DecodeWorkspace

        config = self.model.config
        n = len(batch.seq_lens)
        if self._workspace is None or self._workspace.partial_out.shape[0] < n:
            self.num_splits = self.kernel_splits()
            self._workspace = DecodeWorkspace.allocate(
                max(
                    n, 2 * (0 if self._workspace is None else self._workspace.partial_out.shape[0])
                ),
                config.num_attention_heads,
                config.head_dim,
                max_splits=self.num_splits,
                device=self.device,
            )
        kernel = dict(num_splits=self.num_splits, workspace=self._workspace)
        if varlen:
            from kvlib.engine.varlen import VarlenBatchKV

            return VarlenBatchKV(
                self.storage, batch, decode_kernel=True, prefill_kernel=prefill_kernel, **kernel
            )
        return KernelBatchKV(self.storage, batch, **kernel)

    def kernel_splits(self) -> int:
        """One split count for the runner's lifetime, for the longest sequence a request can
        reach (`max_model_len`, at most the pool's capacity): a sequence's arithmetic must not
        depend on its batch. Sized from the capacity instead, a short-context engine with a big
        pool launches dozens of splits that find no tokens."""
        from kvlib.ops.decode_plan import default_num_splits

        longest = self.manager.pool.num_blocks * self.storage.block_size
        if self.max_model_len is not None:
            longest = min(longest, self.max_model_len)
        heads = self.model.config.num_key_value_heads
        return default_num_splits(1, heads, longest, self.device)

    _use_kernel, _kernel_splits = use_kernel, kernel_splits  # the names before they were public

    def _graph_logits(self, batch: ModelInput):
        """A step's logits `(N, V)` through static buffers: a decode-only step through the
        decode graph runner (`cuda_graphs`), another through the mixed-step runner
        (`mixed_graphs`); None when they are off or the step does not fit."""
        if self.cuda_graphs:
            if self.graph_runner is None:
                from kvlib.engine.cuda_graph import DecodeGraphRunner

                self.graph_runner = DecodeGraphRunner.for_runner(self)
            if self.graph_runner.can_run(batch):
                return self.graph_runner.run(batch)
        if self.mixed_graphs:
            from kvlib.engine.mixed_graph import MixedGraphRunner

            if self.mixed_runner is None and MixedGraphRunner.supports(self):
                self.mixed_runner = MixedGraphRunner.for_runner(self)
            if self.mixed_runner is not None and self.mixed_runner.can_run(batch):
                return self.mixed_runner.run(batch)
        return None

    def submit(
        self,
        scheduled: list[tuple[Request, int]],
        block_copies: list[tuple[int, int]] = (),
        *,
        non_blocking: bool = False,
    ) -> StepHandle:
        """Launch a step: stage its inputs on the host (`InputBatch.stage`), then queue its device
        work (`_run_step`: the block copies copy-on-write owes, the forward, the sampling).
        Returns the handle of its tokens. A token not sampled yet (a placeholder) is fed from the
        previous submitted step's sampled ids. `non_blocking`: queue the tokens' copy to pinned
        host memory behind the step, with an event (the overlapped engine collects them a step
        later); otherwise `result()` copies them, the step's one blocking transfer."""
        if not scheduled and not block_copies:
            return StepHandle(None, [])
        staged = self.inputs.stage(scheduled, self.manager) if scheduled else None
        requests = staged.sample_requests if scheduled else []
        params = [request.sampling_params for request in requests]
        generators = [  # a greedy row draws nothing
            request.generator_for(self.device) if p.temperature else None
            for request, p in zip(requests, params)
        ]
        job = functools.partial(
            self._run_step, staged, params, generators, list(block_copies), non_blocking
        )
        return StepHandle(self.device_queue.submit(job), [r.request_id for r in requests])

    def _run_step(
        self, staged: StagedInput | None, params, generators, block_copies, non_blocking=False
    ):
        """A step's device work, run by the device queue in submission order."""
        events = self.gpu_events is not None and self.device.type == "cuda" and staged is not None
        if events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        with torch.no_grad():
            for src, dst in block_copies:  # copy-on-write, every layer, before anything writes
                for pool in self.storage.block_tensors():
                    pool[dst] = pool[src]
            if staged is None:
                return None
            batch = self.inputs.to_device(staged, self._previous_sampled)
            logits = self.forward(batch, sample_only=len(params) != len(batch.input_ids))
            result = None
            if params:  # (a step of prefill chunks only samples nothing)
                if len(params) != logits.shape[0]:  # a graph runner's logits: every row
                    logits = logits.index_select(0, batch.sample_indices)  # (m, V)
                step = sample_step(logits, params, generators)
                self._previous_sampled = step.token_ids
                result = start_transfer(step) if non_blocking else (step, None)
        if events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.gpu_events.append((staged.max_query_len == 1, start, end))
        return result

    def forward(self, batch: ModelInput, *, sample_only: bool = False) -> torch.Tensor:
        """The step's logits `(N, V)`: through the graph runner if it takes the step, else one
        forward of the model over the flattened batch. `sample_only`: that forward computes
        the logits of the sampling rows only (`batch.sample_indices`: (m, V)), sparing the
        vocabulary projection of every other prompt token (a graph runner's are (N, V))."""
        logits = self._graph_logits(batch)
        if logits is None:
            logits = self.model(
                batch.input_ids[None],
                cache=self._batch_kv(batch),
                position_ids=batch.positions[None],
                validate=False,  # the engine checked every prompt when it was added
                logits_indices=batch.sample_indices if sample_only else None,
            )[0]
        return logits

    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Run a step now (`submit`, then wait): {request id: token}; `last_logprobs` holds the
        logprobs the requests asked for."""
        sampled, self.last_logprobs = self.submit(scheduled).result()
        return sampled
