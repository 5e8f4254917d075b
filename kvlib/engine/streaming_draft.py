"""Self-speculation in the serving engine (chapter 16, `SpeculativeConfig(method="streaming")`):
the target model drafts for itself over a **StreamingLLM view** of each request's own paged cache,
and `kvlib.engine.speculative` verifies the draft over the full cache, as MagicDec does
(Sadhukhan et al., 2025, "MagicDec: Breaking the Latency-Throughput Tradeoff for Long Context
Generation with Speculative Decoding", ICLR: at long context and large batch a decode step's bytes
are mostly the cache's, so a draft that reads a small fixed view of it is cheap, and, being the
target, it guesses well). The view is StreamingLLM's cache (Xiao et al., 2024, "Efficient
Streaming Language Models with Attention Sinks", ICLR): attention sinks plus a recent window.

**The view** (`streaming_view`): a request whose first `n` token slots lie in blocks
`table[0 .. b-1]` is read through `table[:S] + table[b - W:]` (S = `num_sink_blocks`,
W = `num_window_blocks`), a subset of its own block table, holding `S * block_size` tokens plus
those of its last W blocks (the last one partial). Keys are stored already rotated (RoPE at their
true positions), so only the block table and the length change; the query keeps its true
position. A request whose blocks all fit (b <= S + W) has nothing to compress: it **drafts over
its full cache**, so its draft is the target itself (a greedy draft is accepted whole, floating
point aside: a one-token step and a verification chunk may round differently) and it saves
steps, not bytes (it reads its cache k + 1 times for up to k + 1 tokens).

**A step** (`StreamingDrafter.draft`), after `Speculator.propose` appended each speculating
request's k' draft slots (ids unknown, never hashed) and copy-on-write's copies ran: draft
forward i = 0 .. max k' - 1 is one decode-only batch of the requests with k' > i. A request feeds
its newest token (i = 0) or its draft token i - 1, at its true position
`num_computed_tokens + i`, written into the real slot of that position (the verification forward
recomputes and overwrites it; rejected slots are truncated as for any draft), and attends over
the view of its first `held + i` slots (`held`: its slots through the newest token). Draft token i
is the argmax of the view's logits `(V,)` for a greedy request; for a sampled one it is drawn,
with the request's own generator, from q_i = `sampling_distribution` of those logits (the
request's temperature, top-k and top-p), and the rows q `(k', V)` float32 are what speculative
sampling divides by (`verify_sampled(..., draft_probs=q)`): the drafter's own distribution, not
a point mass.

**Counting the cache read** (`KVReads`, from block tables and lengths, not from time): a draft
forward reads its view's slots; a verification reads the request's whole cache once, `held + k'`
slots (a chunk's queries read each key once, as a fused kernel streams it); plain decoding of the
same emitted tokens would have read `held`, `held + 1`, ... slots, one forward per token. A slot
is one token's K and V in every layer: bytes = slots * `LLMEngine.block_bytes / block_size`.

What it does not do: MagicDec's choice of when self-speculation pays and of k (batch size and
context; here a request drafts whenever `Speculator.propose` leaves it room, as prompt lookup); a
draft cache of its own (the draft K/V go into the target's slots: k' tokens are computed twice,
by the draft forwards and the verification, and the engine's `StepStats` count the
verification's only); TriForce's hierarchy (a small model drafting for the self-drafter); a view
chosen by content (chapter 15's Quest pages: `kvlib.speculative.SparseSelfDrafter`, one
sequence outside the engine); logprobs (such a request decodes normally).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib._validate import check_positive_int
from kvlib.engine.batch import ModelInput
from kvlib.engine.sampler import device_tensor, is_greedy, sampling_distribution

__all__ = ["KVReads", "StreamingDrafter", "check_streaming_fields", "streaming_view"]

DEFAULT_SINK_BLOCKS = 1
DEFAULT_WINDOW_BLOCKS = 4


def check_streaming_fields(method: str, num_sink_blocks, num_window_blocks) -> tuple[int, int]:
    """The view's (sink blocks, window blocks) for `SpeculativeConfig`: for method "streaming",
    `num_sink_blocks` an int >= 0 (None: `DEFAULT_SINK_BLOCKS`), `num_window_blocks` an int >= 1
    (None: `DEFAULT_WINDOW_BLOCKS`); for another method both must be None (returned as they are).

    Raises:
        TypeError: a value that is not an int.
        ValueError: a value out of range, or given with another method (naming the field).
    """
    if method != "streaming":
        given = {"num_sink_blocks": num_sink_blocks, "num_window_blocks": num_window_blocks}
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: only for method='streaming' (the self-drafter's view), got "
                    f"{value!r} with method={method!r}"
                )
        return num_sink_blocks, num_window_blocks
    sinks = DEFAULT_SINK_BLOCKS if num_sink_blocks is None else num_sink_blocks
    window = DEFAULT_WINDOW_BLOCKS if num_window_blocks is None else num_window_blocks
    return (
        check_positive_int("num_sink_blocks", sinks, allow_zero=True),
        check_positive_int("num_window_blocks", window),
    )


def streaming_view(
    table: list[int], num_tokens: int, block_size: int, num_sink_blocks: int, num_window_blocks: int
) -> tuple[list[int], int]:
    """The StreamingLLM view of a sequence's first `num_tokens` slots, held in block `table` (which
    may hold more blocks, past them): (the view's block table, the tokens it holds). Its first
    `num_sink_blocks` blocks and its last `num_window_blocks`, the last one partial; the whole
    prefix when those cover it.

    Raises:
        ValueError: `num_tokens` outside 1 .. len(table) * block_size.
    """
    if not 1 <= num_tokens <= len(table) * block_size:
        raise ValueError(
            f"num_tokens: expected 1 .. {len(table) * block_size} (the table's slots), got "
            f"{num_tokens}"
        )
    used = -(-num_tokens // block_size)  # blocks the prefix occupies
    if used <= num_sink_blocks + num_window_blocks:
        return table[:used], num_tokens
    first_window = used - num_window_blocks
    blocks = table[:num_sink_blocks] + table[first_window:used]
    return blocks, num_sink_blocks * block_size + num_tokens - first_window * block_size


@dataclasses.dataclass
class KVReads:
    """The K/V slots self-speculation read over a run (see the module docstring; a slot is one
    token's K and V in every layer), and what plain decoding of the same tokens would have read.

    Attributes:
        draft_forwards: draft rows computed (one per request and draft forward).
        draft_slots: slots the draft forwards read (their views').
        verify_slots: slots the verifications read (each request's whole cache once).
        plain_slots: slots plain decoding would have read for the same emitted tokens.
        emitted_tokens: tokens the speculating requests emitted (accepted drafts and the
            target's own), in the steps that verified a draft.
    """

    draft_forwards: int = 0
    draft_slots: int = 0
    verify_slots: int = 0
    plain_slots: int = 0
    emitted_tokens: int = 0

    def observe_verification(self, held: int, num_draft: int, num_emitted: int) -> None:
        """Count one verification of a `num_draft`-token draft by a request holding `held` slots
        through its newest token, which emitted `num_emitted` tokens."""
        self.verify_slots += held + num_draft
        self.plain_slots += sum(held + j for j in range(num_emitted))
        self.emitted_tokens += num_emitted

    def per_token(self, slot_bytes: float = 1.0) -> tuple[float, float]:
        """(self-speculation's, plain decoding's) slots read per emitted token, times `slot_bytes`
        (`LLMEngine.block_bytes / block_size` for bytes); (0, 0) before any verification."""
        if not self.emitted_tokens:
            return 0.0, 0.0
        spent = (self.draft_slots + self.verify_slots) * slot_bytes / self.emitted_tokens
        return spent, self.plain_slots * slot_bytes / self.emitted_tokens


class StreamingDrafter:
    """Drafts a step's tokens by the target over each request's StreamingLLM view (see the module
    docstring): `Speculator` calls `draft` after the draft slots were appended and before the
    verification forward.

    Args:
        runner: the engine's `ModelRunner` (its `forward` runs the draft batches).
        manager: the engine's `BlockManager` (block tables, slots).
        num_sink_blocks, num_window_blocks: the view (`streaming_view`), as checked by
            `check_streaming_fields`.
    """

    def __init__(self, runner, manager, num_sink_blocks: int, num_window_blocks: int):
        self.runner, self.manager = runner, manager
        self.num_sink_blocks, self.num_window_blocks = num_sink_blocks, num_window_blocks
        self.kv_reads = KVReads()

    def draft(self, scheduled, drafts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Fill each request's draft (`drafts[request id]`, k' placeholder ids, its slots already
        appended) with the tokens the target proposes over its view, in place. Returns
        {request id: q `(k', V)` float32} for the sampled requests (their draft distributions)."""
        requests = [request for request, _ in scheduled if request.request_id in drafts]
        held = {  # slots through the newest token, the one the step computes
            r.request_id: self.manager.num_tokens(r.request_id) - len(drafts[r.request_id])
            for r in requests
        }
        rows: dict[str, list[torch.Tensor]] = {}
        for i in range(max(len(draft) for draft in drafts.values())):
            live = [r for r in requests if len(drafts[r.request_id]) > i]
            batch = self.draft_input(live, i, held, drafts)
            with torch.no_grad():
                logits = self.runner.forward(batch, sample_only=True)
                if logits.shape[0] != len(live):  # a graph runner's: every row
                    logits = logits.index_select(0, batch.sample_indices)  # (n, V)
                tokens = logits.argmax(dim=-1).tolist()  # greedy rows' drafts
                for row, request in enumerate(live):
                    params = request.sampling_params
                    if not is_greedy(params):
                        q = sampling_distribution(logits[row : row + 1], [params])[0]  # (V,)
                        generator = request.generator_for(self.runner.device)
                        tokens[row] = int(torch.multinomial(q, 1, generator=generator))
                        rows.setdefault(request.request_id, []).append(q)
            for token, request in zip(tokens, live):
                drafts[request.request_id][i] = token
            self.kv_reads.draft_forwards += len(live)
            self.kv_reads.draft_slots += sum(batch.seq_lens_host)
        return {request_id: torch.stack(q) for request_id, q in rows.items()}

    def draft_input(self, live, i: int, held: dict[str, int], drafts) -> ModelInput:
        """Draft forward `i`'s decode-only batch: row r is request `live[r]`'s token at position
        `num_computed_tokens + i` (its newest token for i = 0, else its draft token i - 1),
        written at that position's real slot, attending over the view of its first
        `held + i` slots (`streaming_view`)."""
        manager, device = self.manager, self.runner.device
        ids, positions, slots, lens, tables = [], [], [], [], []
        for request in live:
            request_id, start = request.request_id, request.num_computed_tokens
            ids.append(request.all_token_ids[start] if i == 0 else drafts[request_id][i - 1])
            positions.append(start + i)
            slots.append(manager.slot(request_id, held[request_id] - 1 + i))
            table, length = streaming_view(
                manager.block_tables[request_id],
                held[request_id] + i,
                manager.block_size,
                self.num_sink_blocks,
                self.num_window_blocks,
            )
            tables.append(table)
            lens.append(length)
        width, n = max(len(t) for t in tables), len(live)

        def tensor(values):
            return device_tensor(values, torch.int64, device)

        return ModelInput(
            input_ids=tensor(ids),  # (n,)
            positions=tensor(positions),  # (n,)
            slot_mapping=tensor(slots),  # (n,)
            query_start_loc=tensor(list(range(n + 1))),  # (n + 1,)
            seq_lens=tensor(lens),  # (n,): the views' tokens
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),  # (n, width)
            sample_indices=tensor(list(range(n))),  # (n,)
            sample_requests=[],
            query_lens=[1] * n,
            seq_lens_host=lens,
            max_query_len=1,
            max_seq_len=max(lens),
        )
