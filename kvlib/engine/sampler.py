"""Sampling a whole step on the device, with one transfer to the host (issue 36, part 3).

`kvlib.engine.runner.sample` picks one request's token at a time: `int(...)` after each, a host
sync per request, and on a GPU a sync inside `torch.multinomial` too (it checks its input with
`.item()`). `sample_step` does the same arithmetic for all the rows of a step at once and leaves
the result on the device; `to_host` brings the step's token ids (and the logprobs the requests
asked for) to the host in one `.tolist()`, the step's single sync.

The tokens are the per-request sampler's, seed for seed: every filter is elementwise or per row
(temperature, top-k, softmax, top-p), and the draw is the one `torch.multinomial(probs, 1)` makes
(Gumbel-max written with exponentials: argmax(p / q) with q ~ Exp(1), drawn from the request's own
generator over a vector the size of the vocabulary), so each request's random stream advances
exactly as before and does not depend on its batch. On the CPU this is tested to be token-equal
to `sample` (tests/test_sampler.py). The per-row work left is a launch per sampled row for its
generator's draw, and one for top-p's cumulative sum (a scan over a batch may round differently
from one over a single row on a GPU); none waits for the device.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.engine.request import SamplingParams, TokenLogprobs

__all__ = [
    "GREEDY_TEMPERATURE",
    "StepSample",
    "device_tensor",
    "is_greedy",
    "sample",
    "sample_step",
    "sampling_distribution",
    "to_host",
    "token_logprobs",
]

# Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): logits / 1e-38 overflow fp32
# to inf, softmax of inf - inf is NaN, and a row of NaN "samples" token 0 every step.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """Whether `params` picks the argmax: a temperature below `GREEDY_TEMPERATURE`, 0 included."""
    return params.temperature < GREEDY_TEMPERATURE


@dataclasses.dataclass
class StepSample:
    """A step's samples, still on the device: `token_ids (m,)` int64 (what the next step's
    placeholders read), and `packed`, what goes to the host in one transfer: the token ids
    themselves, or, when some rows asked for logprobs, one float64 vector holding the m token ids,
    then for those rows the sampled tokens' log-probabilities and the top-k ids and values."""

    token_ids: torch.Tensor
    packed: torch.Tensor
    num_rows: int
    logprob_rows: list[int]  # rows that asked for logprobs
    num_top: list[int]  # their k
    width: int  # the top-k width computed for all of them (max k)


def device_tensor(values, dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the device: on CUDA
    a plain copy from pageable host memory blocks until the stream has run everything queued
    before it; a copy from pinned memory with `non_blocking` only queues (the caching host
    allocator keeps the pinned buffer alive until the copy has run). `values`: a list or a numpy
    array (`torch.tensor(array, pin_memory=True)` is refused: "Can't pin tensor constructed from
    numpy", so the host tensor is made first and then pinned)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.as_tensor(values, dtype=dtype).pin_memory()  # a pinned copy: safe to reuse values
    return host.to(device, non_blocking=True)


def _index(rows: list[int], device) -> torch.Tensor:
    return device_tensor(rows, torch.int64, device)


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(logits / temperature) restricted to each row's top k and top-p nucleus, `(r, V)`
    fp32, as `sample` computes it row by row."""
    device, vocab = logits.device, logits.shape[-1]
    scaled = torch.empty(logits.shape, dtype=torch.float32, device=device)
    for t in sorted({p.temperature for p in params}):  # one division per distinct temperature
        rows = _index([i for i, p in enumerate(params) if p.temperature == t], device)
        # a Python scalar divisor, as `sample` divides
        scaled.index_copy_(0, rows, logits.index_select(0, rows).float() / t)
    if any(p.top_k is not None for p in params):
        ks = [vocab if p.top_k is None else min(p.top_k, vocab) for p in params]
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, _index(ks, device)[:, None] - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # k = V: nothing below the min
    probs = scaled.softmax(dim=-1)
    if any(p.top_p is not None and p.top_p < 1 for p in params):
        top_p = [p.top_p if p.top_p is not None and p.top_p < 1 else float("inf") for p in params]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # probability of the tokens ranked higher; a scan per row, as `sample` runs it (a
        # batched scan may round differently on a GPU)
        before = torch.stack([row.cumsum(0) for row in sorted_probs]) - sorted_probs
        threshold = device_tensor(top_p, torch.float32, device)[:, None]
        outside = before >= threshold
        outside[:, 0] = False  # the most likely token always stays (top_p = 1e-46 is 0 in fp32)
        sorted_probs = sorted_probs.masked_fill(outside, 0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    return probs


def sampling_distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution `sample_step` draws row i of `logits (r, V)` from with `params[i]` (a
    temperature above `GREEDY_TEMPERATURE`): softmax(logits / temperature) restricted to the top k
    and the top-p nucleus, normalised, `(r, V)` fp32 rows summing to 1. `sample_step` draws from
    the same rows unnormalised (a draw needs no normalisation); a rule that compares a
    probability with a uniform (speculative sampling's acceptance) needs it."""
    probs = _probs(logits, params)  # (r, V), the nucleus not renormalised
    return probs / probs.sum(dim=-1, keepdim=True)  # (r, V)


def sample_step(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> StepSample:
    """Sample a token for each row of `logits (m, V)` with `params[i]` and `generators[i]` (the
    request's own, on the logits' device), without a host sync; also each requested logprob
    (`SamplingParams.logprobs`: under the model's distribution, as `token_logprobs` computes).
    Returns a `StepSample` for `to_host`."""
    m, device = len(params), logits.device
    greedy = [i for i, p in enumerate(params) if is_greedy(p)]
    drawn = [i for i, p in enumerate(params) if not is_greedy(p)]
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if len(greedy) == m:  # every row greedy: one argmax
        ids = logits.argmax(dim=-1)
    else:
        ids = torch.empty(m, dtype=torch.int64, device=device)
    if greedy and drawn:
        rows = _index(greedy, device)
        ids.index_copy_(0, rows, logits.index_select(0, rows).argmax(dim=-1))
    if drawn:
        rows = _index(drawn, device)
        probs = _probs(logits.index_select(0, rows), [params[i] for i in drawn])
        # torch.multinomial(p, 1, generator=g)'s draw, one request's generator per row
        noise = torch.stack(
            [torch.empty_like(probs[0]).exponential_(1, generator=generators[i]) for i in drawn]
        )
        ids.index_copy_(0, rows, (probs / noise).argmax(dim=-1))
    if not asked:
        return StepSample(ids, ids, m, [], [], 0)
    pieces = [ids.double()]
    num_top = [params[i].logprobs for i in asked]
    width = min(max(num_top, default=0), logits.shape[-1])
    rows = _index(asked, device)
    logprobs = logits.index_select(0, rows).float().log_softmax(dim=-1)  # (r, V)
    pieces.append(logprobs.gather(1, ids.index_select(0, rows)[:, None])[:, 0].double())
    if width:
        top = logprobs.topk(width, dim=-1)
        pieces += [top.indices.double().flatten(), top.values.double().flatten()]
    return StepSample(ids, torch.cat(pieces), m, asked, num_top, width)


def to_host(step: StepSample) -> tuple[list[int], dict[int, TokenLogprobs]]:
    """The step's one device-to-host transfer: (token ids, {row: TokenLogprobs} for the rows
    that asked for logprobs)."""
    values = step.packed.tolist()  # the single sync
    if not step.logprob_rows:
        return values, {}
    m, r, w = step.num_rows, len(step.logprob_rows), step.width
    ids = [int(v) for v in values[:m]]
    chosen = values[m : m + r]
    top_ids, top_values = values[m + r : m + r + r * w], values[m + r + r * w :]
    logprobs = {}
    for j, (row, k) in enumerate(zip(step.logprob_rows, step.num_top)):
        k = min(k, w)
        pairs = tuple((int(top_ids[j * w + t]), top_values[j * w + t]) for t in range(k))
        logprobs[row] = TokenLogprobs(ids[row], chosen[j], pairs)
    return ids, logprobs


# --- the per-request reference sampler (chapter 12) ----------------------------------------------


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logits (V,)`: argmax at a temperature below `GREEDY_TEMPERATURE`; else
    softmax(logits / temperature) restricted to the top k and to the top-p nucleus (never empty:
    the most likely token stays), sampled with `generator`."""
    if is_greedy(params):
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p is not None and params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the tokens ranked higher
        outside = before >= params.top_p  # the smallest set reaching top_p stays,
        outside[0] = False  # and never less than the most likely token
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """`token_id`'s log-probability under softmax(`logits (V,)`) and the `num_top` most likely
    tokens' (chapter 13's `logprobs`): the model's distribution, before any sampling filter."""
    logprobs = logits.float().log_softmax(dim=-1)  # (V,)
    top = logprobs.topk(min(num_top, logprobs.numel())) if num_top else None
    pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprobs(int(token_id), float(logprobs[token_id]), pairs)
