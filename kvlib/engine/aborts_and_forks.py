"""What a server needs of the engine (chapter 13, `kvlib.serve`), mixed into `LLMEngine`:
`abort_request` drops a request whose client left and frees its blocks; `add_parallel_requests`
serves one prompt n times (OpenAI's `n`), forking the children from the first request's blocks
once its prefill is done (copy-on-write, chapter 7, as vLLM's parallel sampling shares the
prompt's blocks).

The mixin uses the engine's `requests`, `scheduler`, `manager`, `storage`, `runner`, `config`,
`_pending_forks` and `_computed_before` (set by `LLMEngine.__init__`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlib.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvlib.errors import OutOfBlocksError

__all__ = ["AbortsAndForks"]


class AbortsAndForks:
    """Aborts, parallel sampling (n > 1) and logprob lookup for `LLMEngine` (see the module)."""

    def abort_request(self, request_id: str) -> bool:
        """Stop an unfinished request (its client went away): it leaves the queues, its blocks
        are freed at once (shared ones lose one reference) and it is forgotten. Returns False if
        it is unknown or already finished (nothing to do). Children still waiting to be forked
        from it are queued as ordinary requests."""
        request = self.requests.get(request_id)
        if request is None or (request.is_finished and request not in self.scheduler.running):
            return False
        del self.requests[request_id]
        self._computed_before.pop(request_id, None)
        for children in self._pending_forks.values():
            if request in children:
                children.remove(request)
                return True
        for child in self._pending_forks.pop(request_id, []):
            self.requests[child.request_id] = child
            self.scheduler.add_request(child)
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        elif request in self.scheduler.running:
            self.scheduler.running.remove(request)
            reserved = self.scheduler.reserved.pop(request_id, None)  # static batching
            if reserved:
                self.manager.pool.free(reserved)
            if request_id in self.manager.block_tables:
                self.manager.free(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        return True

    def add_parallel_requests(
        self,
        request_ids: Sequence[str],
        prompt_token_ids: Sequence[int],
        sampling_params: Sequence[SamplingParams],
    ) -> None:
        """Serve one prompt `len(request_ids)` times (OpenAI's `n`, parallel sampling; give each
        its own seed). The first request computes the prompt; in the step that finishes its
        prefill the others are **forked** from it (`BlockManager.fork`: they share its blocks,
        chapter 7's copy-on-write), each keeping all but the prompt's last token, which it
        recomputes next step (one token) to sample its own first token. Under static batching,
        with eviction, or if a fork finds no free block for its copy, a child is queued as an
        ordinary request instead (with prefix caching it then hits the parent's full blocks).

        Raises:
            ValueError: as `add_request`, or ids and params of different lengths.
        """
        if len(request_ids) != len(sampling_params) or not request_ids:
            raise ValueError(
                f"sampling_params: expected one per request id ({len(request_ids)}), got "
                f"{len(sampling_params)}"
            )
        if len(set(request_ids)) != len(request_ids) or set(request_ids) & set(self.requests):
            raise ValueError(f"request_ids: expected new, distinct ids, got {list(request_ids)}")
        self.add_request(request_ids[0], prompt_token_ids, sampling_params[0])
        parent = self.requests[request_ids[0]]
        children = []
        for request_id, params in zip(request_ids[1:], sampling_params[1:]):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params: expected SamplingParams, got {params!r}")
            children.append(
                Request(
                    str(request_id),
                    list(parent.prompt_token_ids),
                    params,
                    arrival_step=parent.arrival_step,
                    arrival_time=parent.arrival_time,
                )
            )
        # A one-token prompt has no computed prompt to share (the child would keep 0 tokens).
        forkable = (
            self.config.policy == "continuous"
            and self.config.eviction is None
            and len(parent.prompt_token_ids) > 1
        )
        if forkable:
            self._pending_forks[parent.request_id] = children
        else:
            for child in children:
                self.requests[child.request_id] = child
                self.scheduler.add_request(child)

    def _fork_children(self, scheduled) -> None:
        """After the forward: fork the children of each parent whose prompt this step finished
        (the manager then holds exactly the prompt's tokens)."""
        for request, num_new in scheduled:
            children = self._pending_forks.get(request.request_id)
            prompt_len = len(request.prompt_token_ids)
            if children is None or request.num_computed_tokens + num_new < prompt_len:
                continue
            del self._pending_forks[request.request_id]
            for child in children:
                self.requests[child.request_id] = child
                self.manager.fork(request.request_id, child.request_id)
                try:
                    self.manager.truncate(child.request_id, prompt_len - 1)
                except OutOfBlocksError:
                    self.manager.free(child.request_id)
                    self.scheduler.add_request(child)
                    continue
                child.num_computed_tokens = prompt_len - 1
                child.num_cached_tokens = prompt_len - 1
                child.status = RequestStatus.RUNNING
                self.scheduler.running.append(child)
                self._computed_before[child.request_id] = prompt_len - 1
