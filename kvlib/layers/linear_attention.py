"""Gated linear attention with a scalar decay per head and token: the layer whose "cache" is a
fixed-size recurrent state (chapter 17's hybrids).

Per head, with a decay a_t = exp(log_decay_t) in (0, 1] and a state S of (D_k, D_v):

    S_t = a_t · S_{t-1} + k_t v_tᵀ        o_t = S_tᵀ q_t

so o_i = Σ_{j<=i} Γ_ij (q_i · k_j) v_j with Γ_ij = a_{j+1} · ... · a_i. With a = 1 this is the
causal linear attention of Katharopoulos et al. (2020, "Transformers are RNNs"), which showed that
attention without a softmax is an RNN whose state replaces the KV cache; the scalar gate is the
recurrence of RetNet (Sun et al., 2023: a fixed decay per head) and of Mamba-2 (Dao & Gu, 2024,
"Transformers are SSMs": SSD, with q, k, v, log_decay = C, B, x·dt, A·dt). Three forms compute the
same outputs:

- `parallel_form`: O = ((Q Kᵀ) ⊙ Γ) V, quadratic in T, like attention with a decay mask;
- `recurrent_form`: token by token, O(1) per token: decode, the state as the cache;
- `chunked_form`: the parallel form inside chunks of C tokens, the state carried across them:
  O(T · C) instead of O(T²), what prefill uses (Dao & Gu, 2024, sec. 6, the chunked SSD).

Γ is built from sums of log_decay over the tokens between j and i (`decay_matrix`), never as a
difference of cumulative sums: exp(c_i - c_j) loses digits once |c| is large, and gives NaN for
-inf - (-inf). Every exponent is a sum of values <= 0, so exp never sees a positive number.
`log_decay = -inf` is allowed too: a = 0 erases the state (a reset, e.g. at a document boundary).

`RecurrentStateCache` holds one state (B, H, D_k, D_v) per layer: 4 · H · D_k · D_v bytes per
float32 sequence and layer, whatever the number of tokens seen (chapter 3's SSM row). Its
`snapshot`/`restore` are how engines cache prefixes of hybrids and roll back speculation. A KV
cache after 20 tokens holds the cache after 16 (its first 16 rows), so a prefix hit at a block
boundary is a truncation. A state does not: S_20 = a_17···a_20 · S_16 + four rank-one terms, and
getting S_16 back would need those tokens' k, v and a division by decays that may be 0. A
snapshot is therefore valid only at the position it was taken: engines prefill in chunks that
end on block boundaries and keep a state per boundary (vLLM's prefix caching of hybrid models
resumes only on its block grid), snapshot before verifying draft tokens and recompute the
accepted ones, and `restore` checks the position the caller resumes at.

What it deliberately does not do: the feature map and normaliser of Katharopoulos et al. (apply φ to
q, k before calling; GLA, RetNet and Mamba-2 drop the normaliser for an output norm), a scale (o_t
is S_tᵀ q_t unscaled: pass q · D_k**-0.5 for the 1/sqrt(D_k) some libraries default to), grouped
heads (Mamba-2's shared B, C), the short convolution of Mamba and Qwen3-Next (a second, also
constant, state), GLA's vector gate (one decay per key channel: Yang et al., 2024, "Gated Linear
Attention Transformers"), and the delta rule. Qwen3-Next's linear layers are Gated DeltaNet (Yang,
Kautz & Hatamizadeh, 2024, "Gated Delta Networks"): S_t = a_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t
v_tᵀ, a rank-one correction that first erases what the state stores under k_t; the state, and so the
cache, keeps the same shape. One dtype for everything; fused kernels keep a bf16 model's state in
float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int

__all__ = [
    "RecurrentStateCache",
    "StateSnapshot",
    "chunked_form",
    "decay_matrix",
    "parallel_form",
    "recurrent_form",
]


def _check_inputs(q, k, v, log_decay, state=None) -> None:
    """Raise TypeError/ValueError naming the argument unless q, k (B, H, T, D_k), v (B, H, T, D_v),
    log_decay (B, H, T) with values <= 0 and state (B, H, D_k, D_v) or None agree."""
    named = {"q": q, "k": k, "v": v, "log_decay": log_decay, "state": state}
    for name, value in named.items():
        if value is None and name == "state":
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = getattr(value, "dtype", type(value).__name__)
            raise TypeError(f"{name}: expected a floating-point torch.Tensor, got {kind}")
        if value.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {value.dtype}")
        if value.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {value.device}")
    if q.dim() != 4 or q.shape[2] == 0:
        raise ValueError(f"q: expected (B, H, T, D_k) with T >= 1, got {tuple(q.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v: expected (B, H, T, D_v), got {tuple(v.shape)}")
    (b, h, t, d_k), d_v = q.shape, v.shape[-1]
    expected = {
        "k": ((b, h, t, d_k), "(B, H, T, D_k) as q's"),
        "v": ((b, h, t, d_v), "(B, H, T, D_v) with q's B, H, T"),
        "log_decay": ((b, h, t), "(B, H, T) with q's B, H, T"),
        "state": ((b, h, d_k, d_v), "(B, H, D_k, D_v) with q's B, H, D_k and v's D_v"),
    }
    for name, (shape, words) in expected.items():
        value = named[name]
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name}: expected {words} = {shape}, got {tuple(value.shape)}")
    bad = ~(log_decay <= 0)  # catches NaN too; one host sync per call
    if bad.any():
        raise ValueError(
            "log_decay: expected values <= 0 (a decay exp(log_decay) in [0, 1]), got "
            f"{log_decay[bad][0].item()}"
        )


def decay_matrix(log_decay: torch.Tensor) -> torch.Tensor:
    """Γ (..., T, T): Γ_ij = exp(Σ_{j<l<=i} log_decay_l) for j <= i (1 on the diagonal), else 0.

    `log_decay` (..., T), values <= 0 (not checked here). Each entry is the exp of a sum of the
    entries between j and i, accumulated down the rows (the "segment sum" of Mamba-2's minimal
    SSD), so large sums and -inf stay exact. O(T²) memory. Returns log_decay's dtype and device.
    """
    t = log_decay.shape[-1]
    index = torch.arange(t, device=log_decay.device)
    row, col = index[:, None], index[None, :]  # (T, 1), (1, T)
    terms = log_decay[..., :, None].expand(*log_decay.shape, t)  # (..., T, T): [l, j] = g_l
    terms = terms.masked_fill(row <= col, 0.0)  # keep g_l only for l > j
    segment = terms.cumsum(dim=-2)  # (..., T, T): [i, j] = Σ_{j<l<=i} g_l
    return segment.masked_fill(row < col, float("-inf")).exp()  # (..., T, T), 0 above diagonal


def parallel_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor
) -> torch.Tensor:
    """O = ((Q Kᵀ) ⊙ Γ) V, every token at once from a zero state (the training form).

    q, k: (B, H, T, D_k); v: (B, H, T, D_v); log_decay: (B, H, T), values <= 0 (the decay a_t =
    exp(log_decay_t) per token and head; -inf resets). One floating dtype and device for all.
    Returns out (B, H, T, D_v). O(T²) time and memory (Katharopoulos et al., 2020; Dao & Gu, 2024).

    Raises:
        TypeError: a non-tensor, a non-floating dtype, or a dtype other than q's.
        ValueError: a device other than q's, shapes that disagree, T = 0, or a log_decay value
            > 0 or NaN.
    """
    _check_inputs(q, k, v, log_decay)
    scores = q @ k.transpose(-1, -2)  # (B, H, T, T)
    return (scores * decay_matrix(log_decay)) @ v  # (B, H, T, D_v)


def recurrent_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = a_t · S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t, one token at a time (decode).

    Arguments as `parallel_form`'s, plus `state` (B, H, D_k, D_v), the state after the tokens
    before these (None: zeros). Returns (out (B, H, T, D_v), new_state (B, H, D_k, D_v)): the
    state is all a decode step reads and writes, the same size at every position.

    Raises:
        As `parallel_form`; ValueError also for a state of the wrong shape.
    """
    _check_inputs(q, k, v, log_decay, state)
    b, h, t, d_k = q.shape
    if state is None:
        state = q.new_zeros(b, h, d_k, v.shape[-1])
    decay = log_decay.exp()  # (B, H, T)
    outputs = []
    for i in range(t):
        write = k[:, :, i, :, None] * v[:, :, i, None, :]  # (B, H, D_k, D_v): k_t v_tᵀ
        state = decay[:, :, i, None, None] * state + write  # (B, H, D_k, D_v)
        outputs.append((q[:, :, i, None, :] @ state)[:, :, 0])  # (B, H, D_v): S_tᵀ q_t
    return torch.stack(outputs, dim=2), state  # (B, H, T, D_v), (B, H, D_k, D_v)


def chunked_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    chunk_size: int,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parallel form inside chunks of `chunk_size` tokens (the last may be shorter), the
    state carried from chunk to chunk (prefill; Dao & Gu, 2024, sec. 6).

    Per chunk, with decays g, S0 the state before it and cum_i = Σ_{l<=i} g_l over the chunk:
    out = ((Q Kᵀ) ⊙ Γ) V + exp(cum) ⊙ (Q S0), and S = exp(cum_last) S0 + Kᵀ (Γ_last ⊙ V), where
    Γ_last (the last row of Γ) decays each token's write to the chunk's end.

    Arguments and result as `recurrent_form`'s; `chunk_size` an int >= 1.

    Raises:
        As `recurrent_form`; TypeError/ValueError for a `chunk_size` not an int >= 1.
    """
    chunk_size = check_positive_int("chunk_size", chunk_size)
    _check_inputs(q, k, v, log_decay, state)
    b, h, t, d_k = q.shape
    if state is None:
        state = q.new_zeros(b, h, d_k, v.shape[-1])
    outputs = []
    for start in range(0, t, chunk_size):
        part = slice(start, start + chunk_size)
        q_c, k_c, v_c, g = q[:, :, part], k[:, :, part], v[:, :, part], log_decay[:, :, part]
        gamma = decay_matrix(g)  # (B, H, C, C)
        from_start = g.cumsum(dim=-1).exp()[..., None]  # (B, H, C, 1): S0's decay up to i
        intra = ((q_c @ k_c.transpose(-1, -2)) * gamma) @ v_c  # (B, H, C, D_v)
        outputs.append(intra + from_start * (q_c @ state))  # (B, H, C, D_v)
        to_end = gamma[:, :, -1, :, None]  # (B, H, C, 1): token j's decay to the chunk's end
        state = from_start[:, :, -1, :, None] * state + k_c.transpose(-1, -2) @ (to_end * v_c)
    return torch.cat(outputs, dim=2), state  # (B, H, T, D_v), (B, H, D_k, D_v)


class StateSnapshot(NamedTuple):
    """A copy of a `RecurrentStateCache`'s states, valid at one position only.

    position: the tokens the cache had seen when it was taken; states: per layer a cloned
    (B, H, D_k, D_v) tensor, or None for a layer not yet written.
    """

    position: int
    states: tuple[torch.Tensor | None, ...]


class RecurrentStateCache:
    """The per-layer recurrent states of a batch: what a hybrid model's linear layers cache.

    Layout: `states[l]` (B, H, D_k, D_v) for layer l, None before its first `update`. `length`:
    the tokens every sequence has seen (all sequences advance together; no padding, no ragged
    batch). `update` runs the chunked form for a prompt and the recurrent form for one token;
    `advance(T)` commits a forward after its last layer, as kvlib's KV caches do.

    Args:
        num_layers: L, the layers with a state.
        chunk_size: C for `chunked_form` in `update`.
    """

    def __init__(self, num_layers: int, chunk_size: int = 64):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.states: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def update(self, layer_idx: int, q, k, v, log_decay) -> torch.Tensor:
        """Attend with layer `layer_idx`'s state and replace it by the state after these T
        tokens. Arguments as `chunked_form`'s; returns out (B, H, T, D_v).

        Raises:
            ValueError: `layer_idx` not an int in [0, L); else as `chunked_form`.
        """
        is_int = isinstance(layer_idx, int) and not isinstance(layer_idx, bool)
        if not is_int or not 0 <= layer_idx < self.num_layers:
            raise ValueError(
                f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}"
            )
        state = self.states[layer_idx]
        if q.dim() == 4 and q.shape[2] == 1:  # decode
            out, self.states[layer_idx] = recurrent_form(q, k, v, log_decay, state)
        else:  # prefill
            out, self.states[layer_idx] = chunked_form(q, k, v, log_decay, self.chunk_size, state)
        return out

    def advance(self, num_tokens: int) -> None:
        """Commit `num_tokens` tokens that every layer has processed."""
        self.length += check_positive_int("num_tokens", num_tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of the states: L · B · H · D_k · D_v · b once every layer has written, whatever
        `length` is."""
        return sum(s.numel() * s.element_size() for s in self.states if s is not None)

    def snapshot(self) -> StateSnapshot:
        """A copy of every layer's state at `length` (it owns its tensors: later updates leave it
        alone). Take it where a restore will resume: at a block boundary for prefix caching,
        before the draft tokens for speculative decoding."""
        states = tuple(None if s is None else s.clone() for s in self.states)
        return StateSnapshot(self.length, states)

    def restore(self, snapshot: StateSnapshot, position: int) -> None:
        """Put `snapshot`'s states back, to resume at `position` (the caller's: the prefix hit's
        length, the last accepted token's).

        A state is valid only where it was taken (see the module docstring): a snapshot taken at
        20 cannot serve a prefix hit at 16, nor a rollback to 18. Resume from the snapshot at or
        before the position wanted, then recompute the tokens between.

        Raises:
            TypeError: `snapshot` not a `StateSnapshot`.
            ValueError: `position` is not `snapshot.position`, or the snapshot has another
                number of layers.
        """
        if not isinstance(snapshot, StateSnapshot):
            raise TypeError(f"snapshot: expected a StateSnapshot, got {type(snapshot).__name__}")
        if len(snapshot.states) != self.num_layers:
            raise ValueError(
                f"snapshot: expected {self.num_layers} layers' states, got {len(snapshot.states)}"
            )
        if position != snapshot.position:
            raise ValueError(
                f"position: expected {snapshot.position}, the position the snapshot was taken at "
                f"(a recurrent state holds no earlier position), got {position}"
            )
        self.states = [None if s is None else s.clone() for s in snapshot.states]
        self.length = snapshot.position
