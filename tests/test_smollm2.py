"""SmolLM2-135M-Instruct loaded by kvlib from its GGUF, against an independent oracle:
transformers' own GGUF loader and tokenizer (test-only dependencies, pinned in requirements.txt).
"""

import os
import time

import numpy as np
import pytest
import torch

from kvlib.cache import StaticCache
from kvlib.errors import UnsupportedConfigError
from kvlib.generation import generate
from kvlib.loaders import gguf_cache
from kvlib.loaders.gguf import load_gguf_checkpoint, undo_qk_permutation
from kvlib.loaders.smollm2 import load_smollm2, smollm2_gguf_path, smollm2_gguf_sha256
from kvlib.memory import kv_cache_bytes
from kvlib.testing import assert_close

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "Ünïcödé — 日本語のテキスト, emoji 🤖🚀 and accents: café, naïve",
    "def f(x):\n    return x**2 + 12345  # digits split one by one\n",
    "numbers 3.14159, 2026-11-22, 1e-5 and $1,000.00",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _oracle_gguf():
    """transformers, and the folder and file name of SmolLM2's GGUF for its loaders."""
    transformers = pytest.importorskip("transformers")
    return transformers, *os.path.split(smollm2_gguf_path())


@pytest.fixture(scope="module")
def oracle_tokenizer():
    """transformers' tokenizer read from the GGUF (a second or two)."""
    transformers, directory, name = _oracle_gguf()
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def oracle_model():
    """transformers' model dequantized from the GGUF (tens of seconds: only the test that
    compares logits asks for it, so the tokenizer tests do not wait for it)."""
    transformers, directory, name = _oracle_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


def oracle_chat_ids(tokenizer):
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_config_from_the_gguf_metadata(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.vocab_size, c.max_position_embeddings) == (100000.0, 49152, 8192)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(smollm2, oracle_tokenizer, text):
    _, tokenizer = smollm2
    expected = oracle_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == oracle_tokenizer.decode(expected)


def test_chat_template_matches_transformers(smollm2, oracle_tokenizer):
    _, tokenizer = smollm2
    assert tokenizer.apply_chat_template(CHAT) == oracle_chat_ids(oracle_tokenizer)


def test_logits_and_greedy_tokens_match_transformers(smollm2, oracle_model):
    model, tokenizer = smollm2
    prompt = torch.tensor([tokenizer.apply_chat_template(CHAT)])
    text = torch.tensor([tokenizer.encode(" ".join(TEXTS) * 4)])
    with torch.no_grad():
        for ids in (prompt, text):
            ours, theirs = model(ids), oracle_model(ids).logits
            # fp32 both ways, different operation order: measured max |diff| 6.6e-5 on logits of
            # magnitude up to 38
            assert_close(ours, theirs, name="logits vs transformers", rtol=0, atol=5e-4)
        expected = oracle_model.generate(prompt, max_new_tokens=24, do_sample=False)
    ours = generate(model, prompt, 24)[0, prompt.shape[1] :].tolist()
    theirs = expected[0, prompt.shape[1] :].tolist()
    # kvlib's generate never stops early; compare the answer, up to and including its first EOS
    end = ours.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ours else len(ours)
    assert end > 3 and ours[:end] == theirs[:end]
    assert "Paris" in tokenizer.decode(ours[:end])


def test_cached_equals_uncached_in_fp32(smollm2):
    model, tokenizer = smollm2
    prompt = torch.tensor([tokenizer.apply_chat_template(CHAT)])
    cached = generate(model, prompt, 12, cache="static")
    assert torch.equal(cached, generate(model, prompt, 12, use_cache=False))


def test_kv_cache_bytes_equals_what_kvlib_allocates(smollm2):
    model, _ = smollm2
    cache = StaticCache.for_model(model, batch_size=2, max_seq_len=300)
    assert cache.nbytes == kv_cache_bytes(model.config.to_hf(), 300, 2, "float32")
    assert cache.nbytes == 2 * 300 * (2 * 30 * 3 * 64 * 4)  # B * S * (2 * L * H_kv * D * b)


def test_undo_qk_permutation_inverts_llama_cpps_converter():
    rng = np.random.default_rng(0)
    heads, head_dim, d_model = 3, 8, 5
    weight = rng.normal(size=(heads * head_dim, d_model))
    # llama.cpp's convert_hf_to_gguf.py `permute` (rows of each head: halves -> interleaved pairs)
    permuted = weight.reshape(heads, 2, head_dim // 2, d_model).swapaxes(1, 2).reshape(weight.shape)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(undo_qk_permutation(permuted, heads), weight)


def test_loading_without_undoing_the_permutation_runs_and_is_wrong(smollm2):
    model, tokenizer = smollm2
    wrong = load_gguf_checkpoint(smollm2_gguf_path(), undo_permutation=False)
    ids = torch.tensor([tokenizer.encode(" ".join(TEXTS))])
    with torch.no_grad():
        right_logits, wrong_logits = model(ids), wrong(ids)
    assert torch.isfinite(wrong_logits).all()  # no error, no NaN: only wrong
    loss = [
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
        for logits in (right_logits, wrong_logits)
    ]
    assert loss[1] > loss[0] + 1.0


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf_checkpoint(tmp_path / "missing.gguf")
    not_llama = tmp_path / "tiny.gguf"
    import gguf

    writer = gguf.GGUFWriter(str(not_llama), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedConfigError, match="general.architecture 'gpt2'"):
        load_gguf_checkpoint(not_llama)


# --- the conversion (kvlib.loaders.gguf_cache): equal to the GGUF, and faster -------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh cache directory for this module's tests (not the user's)."""
    directory = tmp_path_factory.mktemp("kvlib-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gguf_cache.ENV, str(directory))
        yield directory


def assert_same_model_and_tokenizer(a, b):
    (model_a, tok_a), (model_b, tok_b) = a, b
    assert model_a.config == model_b.config
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:  # bitwise: same dtype, same bytes
        assert state_a[name].dtype == state_b[name].dtype, name
        assert torch.equal(state_a[name], state_b[name]), name
    for text in TEXTS:
        ids = tok_a.encode(text)
        assert tok_b.encode(text) == ids and tok_b.decode(ids) == tok_a.decode(ids)
    assert tok_a.chat_template == tok_b.chat_template and tok_a.chat_template
    assert tok_a.apply_chat_template(CHAT) == tok_b.apply_chat_template(CHAT)
    assert (tok_a.bos_token_id, tok_a.eos_token_id) == (tok_b.bos_token_id, tok_b.eos_token_id)


def test_a_second_load_reads_the_conversion_equal_and_5x_faster(cache_dir):
    start = time.perf_counter()
    from_gguf = load_smollm2(converted=False)
    gguf_s = time.perf_counter() - start
    load_smollm2()  # the first converted load converts
    assert len(list((cache_dir / "gguf").iterdir())) == 1
    start = time.perf_counter()
    converted = load_smollm2()
    second_s = time.perf_counter() - start
    ratio = second_s / gguf_s
    print(f"SmolLM2 load: GGUF {gguf_s:.2f} s, converted {second_s:.2f} s, ratio {ratio:.3f}")
    assert_same_model_and_tokenizer(from_gguf, converted)
    assert ratio < 0.2


def test_a_corrupt_or_partial_conversion_is_detected_and_rebuilt(cache_dir):
    path, key = smollm2_gguf_path(), smollm2_gguf_sha256()
    load_smollm2()  # present (converted by the test above, or now)
    target = gguf_cache.converted_dir(path.name, key)
    weights, tokenizer = target / "model.safetensors", target / "tokenizer.json"
    good = weights.stat().st_size
    with open(weights, "r+b") as file:  # one byte of one weight flipped
        file.seek(good // 2)
        byte = file.read(1)
        file.seek(good // 2)
        file.write(bytes([byte[0] ^ 0xFF]))
    assert gguf_cache._load_manifest(target) is None  # detected: the hash differs
    with open(tokenizer, "r+b") as file:  # and a partial file
        file.truncate(tokenizer.stat().st_size // 2)
    assert gguf_cache._load_manifest(target) is None
    rebuilt = load_smollm2()
    assert gguf_cache._load_manifest(target) is not None and weights.stat().st_size == good
    assert_same_model_and_tokenizer(load_smollm2(converted=False), rebuilt)


def test_the_conversion_names_a_bad_key():
    with pytest.raises(ValueError, match="key: expected 8\\+ lowercase hexadecimal"):
        gguf_cache.converted_dir("model.gguf", "../etc")
