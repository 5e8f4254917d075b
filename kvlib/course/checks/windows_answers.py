"""Chapter 17's graded questions, their side: the expected answers written out (`ring_order`,
`freeable`, `sink_softmax`, `sink_merge`, `hybrid_bytes`, each from its definition) and the
plausible wrong answers each is checked against (`*_mistakes`: a red team's list, each named in
the feedback when a learner's answer equals it). The questions: `kvlib.course.checks.ch17`.

The oracles are self-contained (numpy and integers): the window's rule is Mistral's and
`kvlib.cache.ring`'s (the query at position p sees the keys p - W < j <= p), the sink's is
gpt-oss's (`kvlib.ref.attention`'s `sinks=`: one more logit in the softmax's denominator, with no
value), and the bytes are chapter 3's equation (`kvlib.memory`: a window caps the tokens held, a
fixed state does not grow); tests/test_check_diagnostics.py checks them against kvlib's own."""

from __future__ import annotations

import numpy as np

# --- question 1: the ring's read order ------------------------------------------------------------


def ring_order(num_positions: int, window: int, *, first=None, last=None) -> list[int]:
    """The slots of positions `first` .. `last` - 1 (default: the ring's, max(0, n - W) .. n - 1),
    oldest first: position p lives in slot p mod W."""
    first = max(0, num_positions - window) if first is None else max(0, first)
    last = num_positions if last is None else last
    return [position % window for position in range(first, last)]


def ring_mistakes(num_positions: int, window: int) -> dict:
    n, w = num_positions, window
    return {
        "newest first: a query reads the ring oldest position first (slot = position mod W)": (
            lambda: ring_order(n, w)[::-1]
        ),
        "the slots in buffer order: once the ring wraps, the oldest position is in slot n mod W, "
        "not slot 0": lambda: list(range(min(n, w))),
        "the positions themselves: position p lives in slot p mod W": lambda: list(
            range(max(0, n - w), n)
        ),
        "W - 1 positions: the ring holds the last W positions (the oldest is outside the next "
        "query's window, but its slot is only overwritten by the next write)": lambda: ring_order(
            n, w, first=n - w + 1
        ),
        "W + 1 positions: a ring of W slots holds W positions": lambda: ring_order(
            n, w, first=n - w - 1
        ),
        "the next position included: the ring holds the positions written, 0 .. n - 1": lambda: (
            ring_order(n, w, first=n - w + 1, last=n + 1)
        ),
        "the rotation applied before the ring has wrapped: with n < W positions the ring holds "
        "slots 0 .. n - 1": lambda: list(range(n % w, w)) + list(range(n % w)),
    }


# --- question 2: the blocks a window frees ------------------------------------------------------


def freeable(num_positions: int, window: int, block_size: int, sink_tokens: int) -> list[int]:
    """The definition, position by position: block b (positions b · size .. (b + 1) · size - 1,
    future ones included) is freeable when none of them is a sink and none is in the window of
    the next query (at n) or a later one, which see the keys j > n - W."""
    n = num_positions
    blocks = range(-(-n // block_size))  # the blocks written so far
    return [
        b
        for b in blocks
        if all(sink_tokens <= p <= n - window for p in range(b * block_size, (b + 1) * block_size))
    ]


def freeable_formula(num_positions, window, block_size, sink_tokens, *, reach=1, whole=True,
                     sinks="ceil", sinks_in_window=False) -> list[int]:  # fmt: skip
    """The rule written out, its common mistakes switchable: positions 0 .. n - W + reach - 1 are
    out (reach 1; 0 keeps W + 1 keys, 2 keeps W - 1); `whole=False` frees a block with any
    position out; `sinks` "ceil" (the first block free of sinks), "floor" (the sinks' last block
    freed), "blocks" (sink_tokens counted in blocks), "none" (forgotten); `sinks_in_window` takes
    the sinks out of the window's W."""
    recent = window - sink_tokens if sinks_in_window else window
    out = num_positions - recent + reach  # positions 0 .. out - 1 are outside every window
    end = out // block_size if whole else -(-out // block_size)
    first = {
        "ceil": -(-sink_tokens // block_size),
        "floor": sink_tokens // block_size,
        "blocks": sink_tokens,
        "none": 0,
    }[sinks]
    return list(range(first, end))


def freeable_mistakes(num_positions, window, block_size, sink_tokens) -> dict:
    args = (num_positions, window, block_size, sink_tokens)
    return {
        "a window of W + 1 keys: the query at n sees n - W < j <= n, so position n - W is "
        "already out (or the window measured from the last position written, n - 1, not the "
        "next query's n)": lambda: freeable_formula(*args, reach=0),
        "a window of W - 1 keys: position n - W + 1 is still in the next query's window": (
            lambda: freeable_formula(*args, reach=2)
        ),
        "a block freed while some of its positions are still in the window: every position of "
        "a block must be out": lambda: freeable_formula(*args, whole=False),
        "the sinks forgotten: positions 0 .. sink_tokens - 1 stay visible, so their blocks stay": (
            lambda: freeable_formula(*args, sinks="none")
        ),
        "the sinks' last block freed: a block holding any sink token stays (round the first "
        "freeable block up, ceil(sink_tokens / block_size))": lambda: freeable_formula(
            *args, sinks="floor"
        ),
        "sink_tokens counted in blocks: it counts tokens": lambda: freeable_formula(
            *args, sinks="blocks"
        ),
        "the sinks counted inside the window: the window's W recent keys come besides the sinks": (
            lambda: freeable_formula(*args, sinks_in_window=True)
        ),
        "newest first: list the blocks in ascending order": lambda: freeable(*args)[::-1],
        "nothing freed: a sliding window's old blocks can go back to the pool": lambda: [],
    }


# --- question 3: a softmax with a learned sink ------------------------------------------------


def sink_softmax(scores: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """gpt-oss's rule: the sink as one more column of each head's scores, softmaxed (the maximum
    subtracted), the column dropped. scores (H, S), sink (H,) -> (H, S)."""
    extended = np.concatenate([scores, sink[:, None]], axis=1)  # (H, S + 1)
    shifted = np.exp(extended - extended.max(axis=1, keepdims=True))  # (H, S + 1)
    return (shifted / shifted.sum(axis=1, keepdims=True))[:, :-1]  # (H, S)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def sink_softmax_mistakes(scores: np.ndarray, sink: np.ndarray) -> dict:
    num_keys = scores.shape[1]
    top = scores.max(axis=1, keepdims=True)  # (H, 1): the scores' own maximum

    def unshifted():
        e = np.exp(scores)
        return e / (e.sum(axis=1, keepdims=True) + np.exp(sink)[:, None])

    def unshifted_sink():
        e = np.exp(scores - top)
        return e / (e.sum(axis=1, keepdims=True) + np.exp(sink)[:, None])

    def per_key():
        m = np.maximum(top, sink[:, None])
        e = np.exp(scores - m)
        return e / (e.sum(axis=1, keepdims=True) + num_keys * np.exp(sink[:, None] - m))

    def as_weight():
        e = np.exp(scores - top)
        return e / (e.sum(axis=1, keepdims=True) + sink[:, None])

    def over_keys():  # the sink broadcast along the keys (a square (H, H) case)
        m = np.maximum(top, sink[:, None])
        e = np.exp(scores - m)
        return e / (e.sum(axis=1, keepdims=True) + np.exp(sink[None, :] - m))

    return {
        "the sink forgotten: it joins each row's denominator, so rows sum to below 1": lambda: (
            _softmax(scores)
        ),
        "no maximum subtracted: exp overflows (scores near 1000) or underflows (near -1000); "
        "subtract each row's largest logit, the sink included, before exp": unshifted,
        "the sink not shifted: the scores' maximum subtracted from the scores but not from the "
        "sink (use exp(sink - m) with the same m)": unshifted_sink,
        "the sink counted once per key: it is one logit per head, added once to the "
        "denominator": per_key,
        "the sink added as a weight: it is a logit, exp(sink - m) in the denominator": as_weight,
        "the sink broadcast along the keys: sink[h] belongs to row h (sink[:, None])": over_keys,
    }


# --- question 4: split-K partials merged with a sink ------------------------------------------


def sink_merge(partial_out: np.ndarray, partial_lse: np.ndarray, sink: np.ndarray, *,
               copies: int = 1, with_sink: bool = True) -> np.ndarray:  # fmt: skip
    """The log-sum-exp merge with the sink in the denominator: `copies` times (1: right; P: added
    in every split), or not at all. (P, H, D), (P, H), (H,) -> (H, D)."""
    top = partial_lse.max(axis=0)  # (H,), finite: every head has a split with keys
    if with_sink:
        top = np.maximum(top, sink)
    weights = np.exp(partial_lse - top)  # (P, H); 0 for an empty split
    denominator = weights.sum(axis=0)  # (H,)
    if with_sink:
        denominator = denominator + copies * np.exp(sink - top)
    return np.einsum("ph,phd->hd", weights, partial_out) / denominator[:, None]  # (H, D)


def sink_merge_mistakes(partial_out, partial_lse, sink) -> dict:
    num_splits = partial_lse.shape[0]

    def unshifted():
        weights = np.exp(partial_lse)  # (P, H)
        denominator = weights.sum(axis=0) + np.exp(sink)
        return np.einsum("ph,phd->hd", weights, partial_out) / denominator[:, None]

    def unshifted_sink():
        top = partial_lse.max(axis=0)  # (H,): the splits' maximum alone
        weights = np.exp(partial_lse - top)
        denominator = weights.sum(axis=0) + np.exp(sink)
        return np.einsum("ph,phd->hd", weights, partial_out) / denominator[:, None]

    return {
        "the sink forgotten: the merged weights sum to 1, the sink's share is missing": lambda: (
            sink_merge(partial_out, partial_lse, sink, with_sink=False)
        ),
        "the sink counted in every split: added to each split's log-sum-exp, it enters the "
        "denominator P times; add it once, at the merge": lambda: sink_merge(
            partial_out, partial_lse, sink, copies=num_splits
        ),
        "no maximum subtracted: exp(lse) overflows near 1000; subtract the largest of the "
        "splits' lse and the sink first": unshifted,
        "the sink not shifted: the largest lse subtracted from the splits' lse but not from the "
        "sink (exp(sink - m) with the same m)": unshifted_sink,
        "the splits' outputs averaged: weight each by its share, exp(lse_p - L)": lambda: (
            partial_out.mean(axis=0)
        ),
    }


# --- question 5: a hybrid model's cache bytes --------------------------------------------------


def layer_elements(layer: dict, seq_len: int, *, cap="min", kv=2, state="fixed") -> int:
    """One layer's cached elements after `seq_len` tokens, its common mistakes switchable: `cap`
    "min" (min(seq_len, W)), "none" (the window unbounded), "window" (always W), or an int offset
    to W; `kv` K/V tensors; `state` "fixed", "per token", "twice" or "none"."""
    if layer["kind"] == "linear":
        elements = layer["state_elements"]
        return {"fixed": elements, "per token": elements * seq_len, "twice": 2 * elements,
                "none": 0}[state]  # fmt: skip
    held = seq_len
    if layer["kind"] == "sliding":
        window = layer["window"]
        if cap == "min":
            held = min(seq_len, window)
        elif cap == "window":
            held = window
        elif cap != "none":
            held = min(seq_len, window + cap)
    return kv * layer["num_kv_heads"] * layer["head_dim"] * held


def hybrid_bytes(layers, seq_len: int, bytes_per_element: int, **mistake) -> int:
    """Chapter 3's equation over a hybrid's layers (per sequence), a mistake switchable (see
    `layer_elements`; `bytes_per_element=1` counts elements)."""
    return sum(layer_elements(layer, seq_len, **mistake) for layer in layers) * bytes_per_element


def bytes_by_kind(layers, seq_len: int, bytes_per_element: int) -> dict[str, int]:
    """The expected bytes per layer kind, for messages."""
    totals: dict[str, int] = {}
    for layer in layers:
        totals[layer["kind"]] = totals.get(layer["kind"], 0) + (
            layer_elements(layer, seq_len) * bytes_per_element
        )
    return totals


def hybrid_mistakes(layers, seq_len: int, bytes_per_element: int) -> dict:
    args = (layers, seq_len, bytes_per_element)
    return {
        "the window counted as unbounded: a sliding-window layer holds min(seq_len, W) tokens": (
            lambda: hybrid_bytes(*args, cap="none")
        ),
        "the window always full: below W a sliding layer holds seq_len tokens, not W": lambda: (
            hybrid_bytes(*args, cap="window")
        ),
        "a window of W + 1 tokens: a sliding layer holds at most W": lambda: hybrid_bytes(
            *args, cap=1
        ),
        "a window of W - 1 tokens: a sliding layer holds the last W, the newest included": (
            lambda: hybrid_bytes(*args, cap=-1)
        ),
        "K or V only: an attention layer caches both (the 2 in 2 · H_kv · D)": lambda: hybrid_bytes(
            *args, kv=1
        ),
        "the state counted per token: a linear layer's state has a fixed size, whatever the "
        "length": lambda: hybrid_bytes(*args, state="per token"),
        "the state counted twice, as if K and V: state_elements is the whole state": lambda: (
            hybrid_bytes(*args, state="twice")
        ),
        "the linear layers' state forgotten: a fixed state is still cached, per sequence": (
            lambda: hybrid_bytes(*args, state="none")
        ),
        "elements, not bytes: multiply by bytes_per_element": lambda: hybrid_bytes(
            layers, seq_len, 1
        ),
    }
