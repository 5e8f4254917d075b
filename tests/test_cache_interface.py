"""The attention seam: a cache defined here, outside kvlib, plugs into the model unchanged.

`CountingCache` implements `kvlib.cache.KVCache` from scratch (a list of tensors per layer) and
counts its reads; `RecordingBackendCache` also brings its own attention backend, as a paged or
quantized cache does. Neither needs an edit to `kvlib.model`.
"""

import subprocess
import sys

import pytest
import torch

from kvlib.cache import DynamicCache, KVCache, StaticCache
from kvlib.generation import generate
from kvlib.model import LlamaModel
from kvlib.ops.attention import ATTENTION_BACKENDS, get_backend, sdpa_attention
from kvlib.testing import assert_close
from tests.test_model import TINY  # 3 layers, 4 query heads, 2 KV heads, vocabulary 48


def tiny_model(**kwargs) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(TINY, **kwargs).eval()


class CountingCache:
    """The smallest `KVCache`: per layer, the keys and values so far; counts `update` calls."""

    def __init__(self, num_layers: int):
        self.num_layers, self.length, self.reads = num_layers, 0, 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def seq_lens(self) -> torch.Tensor:
        batch_size = 0 if self.keys[0] is None else self.keys[0].shape[0]
        return torch.full((batch_size,), self.length)

    def update(self, layer_idx, k, v):
        self.reads += 1
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def advance(self, num_tokens):
        self.length += num_tokens

    def reorder(self, indices):
        self.keys = [k.index_select(0, indices) for k in self.keys]
        self.values = [v.index_select(0, indices) for v in self.values]

    def repeat(self, num_copies):
        copy = CountingCache(self.num_layers)
        copy.length = self.length
        copy.keys = [k.repeat_interleave(num_copies, 0) for k in self.keys]
        copy.values = [v.repeat_interleave(num_copies, 0) for v in self.values]
        return copy


class RecordingBackendCache(CountingCache):
    """A cache that chooses how attention reads it: here SDPA, recording the key lengths seen."""

    def __init__(self, num_layers):
        super().__init__(num_layers)
        self.key_lengths = []

    def attention_backend(self, q, kv, mask, *, weights_out=None):
        self.key_lengths.append(kv[0].shape[2])
        return sdpa_attention(q, kv, mask, weights_out=weights_out)


def test_a_cache_defined_outside_kvlib_generates_unchanged():
    model, prompt = (
        tiny_model(),
        torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1)),
    )
    assert isinstance(CountingCache(1), KVCache)  # the protocol, structurally
    made = []

    def factory(model, batch_size, max_seq_len):
        made.append(CountingCache(model.config.num_hidden_layers))
        return made[-1]

    expected = generate(model, prompt, 6, cache="dynamic")
    assert torch.equal(generate(model, prompt, 6, cache=factory), expected)
    # one prefill and 5 decode steps, each calling update once per layer
    assert made[0].reads == 6 * TINY.num_hidden_layers
    assert made[0].length == 5 + 5
    assert made[0].seq_lens.tolist() == [10, 10]
    # beam search exercises reorder and repeat through the same interface
    beams = generate(model, prompt, 4, cache=factory, num_beams=3)
    assert torch.equal(beams, generate(model, prompt, 4, cache="dynamic", num_beams=3))


def test_a_cache_can_bring_its_own_attention_backend():
    model = tiny_model()
    prompt = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(2))
    cache = RecordingBackendCache(TINY.num_hidden_layers)
    logits = model(prompt, cache=cache)
    logits = torch.cat([logits, model(prompt[:, :1], cache=cache)], dim=1)
    assert cache.key_lengths == [5] * 3 + [6] * 3  # the cache's backend did every layer's attention
    full = model(torch.cat([prompt, prompt[:, :1]], dim=1))
    assert_close(logits, full, name="own backend vs reference", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["grouped", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "none"])
def test_backends_match_reference(cache_kind, backend):
    reference, fused = tiny_model(), tiny_model(attention_backend=backend)
    tokens = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding
    caches = {
        "dynamic": lambda m: DynamicCache(3),
        "static": lambda m: StaticCache.for_model(m, 2, 9),
        "none": lambda m: None,
    }
    outs = [
        model(tokens, cache=caches[cache_kind](model), attention_mask=mask)
        for model in (reference, fused)
    ]
    assert_close(outs[1][1], outs[0][1], name=f"{backend} vs reference", rtol=1e-5, atol=1e-5)
    assert_close(outs[1][0, 3:], outs[0][0, 3:], name="padded row", rtol=1e-5, atol=1e-5)


def test_backend_errors_name_the_choices():
    assert sorted(ATTENTION_BACKENDS) == ["grouped", "reference", "sdpa"]
    with pytest.raises(
        ValueError,
        match=r"attention_backend: expected one of \['grouped', 'reference', 'sdpa'\], got 'flash'",
    ):
        get_backend("flash")
    with pytest.raises(ValueError, match="attention_backend"):
        tiny_model(attention_backend="flash")
    with pytest.raises(ValueError, match="weights_out: the 'sdpa' backend never forms"):
        tiny_model(attention_backend="sdpa")(
            torch.zeros(1, 3, dtype=torch.int64), attention_weights=[]
        )


def test_generate_validates_ids_once_and_decode_steps_do_not():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids: expected 1\+ ids in \[0, 48\)"):
        generate(model, torch.tensor([[1, 48]]), 2)
    # the model itself still validates by default, and can be told not to
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[-1]]))
    calls = []
    original = LlamaModel.forward

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("validate", True))
        return original(self, *args, **kwargs)

    LlamaModel.forward = spy
    try:
        generate(model, torch.tensor([[1, 2, 3]]), 4)
    finally:
        LlamaModel.forward = original
    assert calls == [False] * 4  # prefill and 3 decode steps: validated once, in generate


def test_import_kvlib_is_numpy_only_and_the_top_level_api_resolves_lazily():
    code = (
        "import sys, kvlib; assert 'torch' not in sys.modules, 'torch imported'; "
        "from kvlib import generate, load_course_model, kv_cache_bytes, load_hf_checkpoint; "
        "import kvlib.generation, kvlib.memory; "
        "assert generate is kvlib.generation.generate; "
        "assert kv_cache_bytes is kvlib.memory.kv_cache_bytes; "
        "print(sorted(n for n in dir(kvlib) if not n.startswith('_')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "paged_decode_attention" in result.stdout
    with pytest.raises(AttributeError, match="module 'kvlib' has no attribute 'nope'"):
        import kvlib

        kvlib.nope  # noqa: B018
