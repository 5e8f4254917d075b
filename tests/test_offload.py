"""kvlib.offload (chapter 14): salted block keys; the tiered store's LRU cascade and byte
accounting, checked by a hypothesis state machine over put/get/evict/promote/crash; the disk
tier's atomic writes, checked by killing a writer process; the engine with tiers producing the
tokens it produces without them; KV transfer between a prefill and a decode process."""

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvlib.cache.block_pool import hash_block_tokens
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.loaders.course_model import load_course_model
from kvlib.offload import (
    DiskTier,
    MemoryTier,
    TieredStore,
    block_key,
    engine_salt,
    kv_salt,
    payload_nbytes,
    salted_block_keys,
)
from kvlib.offload.disk import write_block_file
from kvlib.offload.engine import OffloadEngine
from kvlib.quant import QuantScheme
from tests.test_engine import COURSE_PROMPTS, alone

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The course model's matrices are tiny: on busy cores, two threads mostly wait on each other
    (this file took minutes instead of seconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def payload(i: int, num_floats: int = 8) -> dict[str, torch.Tensor]:
    """A block's stand-in: two tensors whose values name `i`."""
    return {
        "key_cache.0": torch.full((num_floats,), float(i)),
        "value_cache.0": torch.arange(num_floats, dtype=torch.float32) + i,
    }


def same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


# --- keys -----------------------------------------------------------------------------------------


def test_salt_separates_everything_that_changes_the_kv():
    base = dict(model_id="m", dtype="float32", kv_scheme=None, rope="default", block_size=16)
    salts = {kv_salt(**base)}
    for field, other in (
        ("model_id", "m2"),
        ("dtype", "bfloat16"),
        ("kv_scheme", "int8"),
        ("rope", "llama3"),
        ("block_size", 32),
    ):
        salts.add(kv_salt(**{**base, field: other}))
    assert len(salts) == 6
    assert kv_salt(**base) == kv_salt(**dict(reversed(base.items())))  # order-free


def test_block_keys_chain_the_prefix_and_skip_a_partial_block(course):
    salt = engine_salt(course)
    tokens = list(range(40))
    keys = salted_block_keys(salt, tokens, 16)
    assert len(keys) == 2  # 40 tokens: two full blocks, the partial third is never keyed
    assert keys[0] == block_key(salt, hash_block_tokens(None, tokens[:16]))
    # the same 16 tokens after another block (another offset, another prefix): another key
    moved = salted_block_keys(salt, tokens[16:32] + tokens[:16], 16)
    assert moved[1] != keys[0]
    assert salted_block_keys(engine_salt(course, kv_scheme=QuantScheme("int8")), tokens, 16) != keys
    assert salted_block_keys(engine_salt(course, block_size=8), tokens, 16) != keys
    altered = load_course_model()
    with torch.no_grad():
        altered.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    assert engine_salt(altered) != salt  # another checkpoint of the same architecture


# --- the store ------------------------------------------------------------------------------------


def test_lru_blocks_cascade_down_the_tiers_and_off_the_last(tmp_path):
    nbytes = payload_nbytes(payload(0))  # 64
    store = TieredStore([MemoryTier("host", 2 * nbytes, 1e9), DiskTier(tmp_path, 3 * nbytes, 1e8)])
    keys = [bytes([i]) * 32 for i in range(6)]
    for i, key in enumerate(keys):
        store.put(key, payload(i))
        store.check_invariants()
    assert store.tiers[0].keys() == keys[4:]  # the two most recent in host memory
    assert store.tiers[1].keys() == keys[1:4]  # the next three on disk
    assert keys[0] not in store and store.stats.dropped == 1
    assert store.used_bytes == [2 * nbytes, 3 * nbytes]
    where, got = store.get(keys[1])  # a disk hit: promoted to host, host's LRU demoted
    assert where == 1 and same(got, payload(1))
    assert store.tiers[0].keys() == [keys[5], keys[1]] and keys[4] in store.tiers[1]
    assert store.stats.transfer_s == pytest.approx(nbytes / 1e8)
    assert store.get(bytes(32)) is None and store.stats.misses == 1
    store.check_invariants()


def test_a_block_larger_than_a_tier_passes_it_by(tmp_path):
    store = TieredStore([MemoryTier("host", 10, 1e9), DiskTier(tmp_path, 1000, 1e8)])
    store.put(b"k" * 32, payload(3))
    assert store.tier_of(b"k" * 32) == 1 and store.used_bytes == [0, 64]
    with pytest.raises(TypeError, match="key"):
        store.put("not bytes", payload(0))


def test_a_crash_keeps_the_disk_and_loses_host_memory(tmp_path):
    nbytes = payload_nbytes(payload(0))
    store = TieredStore([MemoryTier("host", nbytes, 1e9), DiskTier(tmp_path, 4 * nbytes, 1e8)])
    for i in range(3):
        store.put(bytes([i]) * 32, payload(i))
    store.crash()
    assert store.used_bytes == [0, 2 * nbytes]
    assert store.tiers[1].keys() == [bytes([0]) * 32, bytes([1]) * 32]  # LRU order kept
    assert same(store.get(bytes([1]) * 32)[1], payload(1))


# --- the disk tier under a killed writer ----------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from kvlib.offload.disk import DiskTier
    tier = DiskTier(sys.argv[1], 10**12, 1e9)
    kill_before_rename = int(sys.argv[2])
    replace = os.replace
    for i in range(10**6):
        if i == kill_before_rename:  # the file is written and flushed, not yet renamed: die
            os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        tier.put(i.to_bytes(32, "big"), {"x": torch.full((1 << 20,), float(i))})  # 4 MiB
        print(i, flush=True)
    """
)


@pytest.mark.parametrize("kill", ["between write and rename", "at a random moment"])
def test_a_killed_writer_never_leaves_a_half_written_block(tmp_path, kill):
    before = 3 if kill == "between write and rename" else 10**9
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(before)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        written = [int(child.stdout.readline()) for _ in range(3)]
        if kill == "at a random moment":
            child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert written == [0, 1, 2]
    assert (
        any(p.name.count(".tmp.") for p in tmp_path.iterdir()) or kill != "between write and rename"
    )
    tier = DiskTier(tmp_path, 10**12, 1e9)  # what the next process sees
    assert not any(".tmp." in p.name for p in tmp_path.iterdir())  # the torn temp file is gone
    assert {0, 1, 2} <= {int.from_bytes(k, "big") for k in tier.keys()}
    for key in tier.keys():  # every visible block is whole
        i = int.from_bytes(key, "big")
        assert torch.equal(tier.get(key)["x"], torch.full((1 << 20,), float(i)))
    if kill == "between write and rename":
        assert len(tier) == 3


@pytest.mark.parametrize("cut", ["in the header", "halfway", "one byte short"])
def test_a_torn_block_file_is_skipped_and_reported_and_the_tier_stays_usable(tmp_path, cut):
    """The pitfall the rename avoids: written in place, a crash leaves a prefix of the file under
    a block's name. The next process's tier skips it (deleted, listed in `skipped`, a warning),
    opens with every whole block, and serves and stores blocks as before."""
    whole = DiskTier(tmp_path, 10**6, 1e9)
    whole.put(bytes([1]) * 32, payload(1))
    path = tmp_path / ((bytes([7]) * 32).hex() + ".safetensors")
    write_block_file(path, payload(7), atomic=False)
    data = path.read_bytes()
    size = {"in the header": 20, "halfway": len(data) // 2, "one byte short": len(data) - 1}[cut]
    path.write_bytes(data[:size])  # what a writer killed mid-write leaves
    with pytest.warns(RuntimeWarning, match="skipped 1 unreadable block file"):
        tier = DiskTier(tmp_path, 10**6, 1e9)  # the next process opens the folder
    assert [name for name, _ in tier.skipped] == [path.name]
    assert "SafetensorError" in tier.skipped[0][1] and not path.exists()
    assert tier.keys() == [bytes([1]) * 32] and tier.used_bytes == payload_nbytes(payload(1))
    assert same(tier.get(bytes([1]) * 32), payload(1))  # the whole block reads back
    store = TieredStore([tier])
    assert store.get(bytes([7]) * 32) is None  # the torn block is a miss, recomputed upstream
    store.put(bytes([7]) * 32, payload(7))  # and can be stored again
    assert same(store.get(bytes([7]) * 32)[1], payload(7))
    store.check_invariants()
    assert DiskTier(tmp_path, 10**6, 1e9).skipped == []  # nothing left to skip


def test_a_file_without_the_tiers_metadata_is_skipped(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, tmp_path / ((bytes([3]) * 32).hex() + ".safetensors"))
    with pytest.warns(RuntimeWarning):
        tier = DiskTier(tmp_path, 10**6, 1e9)
    assert len(tier) == 0 and tier.skipped[0][1].startswith("KeyError")


# --- the store's state machine --------------------------------------------------------------------

KEYS = [bytes([i]) * 32 for i in range(6)]
SIZES = [4, 8, 12, 4, 16, 8]  # floats per tensor, per key: equal keys, equal bytes


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/evict/promote/crash sequences over a host + disk store. Invariants: no key in
    two tiers, exact byte counts within capacity, and a hit returns exactly the bytes put."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.store = TieredStore(
            [MemoryTier("host", 160, 1e9), DiskTier(Path(self.dir.name), 400, 1e8)]
        )

    def teardown(self):
        self.dir.cleanup()

    @rule(i=st.integers(0, 5))
    def put(self, i):
        self.store.put(KEYS[i], payload(i, SIZES[i]))
        assert self.store.tier_of(KEYS[i]) is not None  # no block is larger than the disk

    @rule(i=st.integers(0, 5), promote=st.booleans())
    def get(self, i, promote):
        where = self.store.tier_of(KEYS[i])
        found = self.store.get(KEYS[i], promote=promote)
        assert (found is None) == (where is None)
        if found is not None:
            assert found[0] == where and same(found[1], payload(i, SIZES[i]))
            if promote:
                assert self.store.tier_of(KEYS[i]) == 0  # every block fits in host memory

    @rule(i=st.integers(0, 5))
    def evict(self, i):
        present = KEYS[i] in self.store
        assert self.store.evict(KEYS[i]) == present and KEYS[i] not in self.store

    @rule(torn=st.sampled_from([None, "temporary file", "block file"]))
    def crash(self, torn):
        on_disk = set(self.store.tiers[1].keys())
        folder = Path(self.dir.name)
        if torn == "temporary file":  # an atomic writer died mid-write
            (folder / (bytes(32).hex() + ".safetensors.tmp.999")).write_bytes(b"\x08\x00\x00")
        elif torn == "block file":  # a non-atomic writer died mid-write, under a block's name
            (folder / ((bytes([200]) * 32).hex() + ".safetensors")).write_bytes(b"\x08\x00\x00")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.store.crash()
        assert len(self.store.tiers[0]) == 0 and set(self.store.tiers[1].keys()) == on_disk
        assert len(self.store.tiers[1].skipped) == len(caught) == (torn == "block file")

    @invariant()
    def consistent(self):
        self.store.check_invariants()
        for tier in self.store.tiers:
            for key in tier.keys():
                i = KEYS.index(key)
                assert tier.sizes[key] == payload_nbytes(payload(i, SIZES[i]))


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# --- the engine with tiers ------------------------------------------------------------------------

TIERED = {  # engine options, host blocks, disk blocks: small pools so that blocks leave the device
    "chunked prefill, host + disk": (dict(num_blocks=24, max_num_batched_tokens=16), 4, 64),
    "preemption, host + disk": (dict(num_blocks=16, max_num_batched_tokens=24), 4, 64),
    "host only": (dict(num_blocks=20, max_num_batched_tokens=48), 64, 0),
    "static": (dict(num_blocks=60, policy="static", max_model_len=160), 8, 64),
    "int8 cache": (dict(num_blocks=20, kv_scheme=QuantScheme("int8")), 4, 64),
}


@pytest.fixture(scope="module")
def references(course):
    return alone(course, COURSE_PROMPTS, 10)


@pytest.mark.parametrize("name", TIERED)
def test_tiers_change_no_token(course, references, tmp_path, name):
    options, host_blocks, disk_blocks = TIERED[name]
    plain = LLMEngine(course, enable_prefix_caching=True, **options)
    tiers = [MemoryTier("host", host_blocks * plain.block_bytes, 25e9)]
    if disk_blocks:
        tiers.append(DiskTier(tmp_path, disk_blocks * plain.block_bytes, 5e9))
    store = TieredStore(tiers)
    engine = OffloadEngine(course, store=store, **options)
    params = SamplingParams(max_tokens=10)
    if options.get("kv_scheme") is None:
        expected = references
    else:  # a quantized cache: the reference is the plain engine's (chapter 12's test)
        expected = [
            o.output_token_ids for o in plain.generate(COURSE_PROMPTS, params, use_tqdm=False)
        ]
    for _ in range(2):  # the second round's prefixes come back from the tiers
        outputs = engine.generate(COURSE_PROMPTS, params, use_tqdm=False)
        assert [o.output_token_ids for o in outputs] == expected
        store.check_invariants()
        engine.manager.check_invariants()
    assert engine.num_demoted > 0 and sum(engine.manager.promoted.values()) > 0
    assert engine.manager.transfer_s > 0
    if name.startswith("preemption"):  # the case tests what its name says
        assert sum(s.num_preemptions for s in engine.stats) > 0
    assert engine.storage.num_blocks_in_use == 0


def test_promotions_are_charged_to_the_clock_and_the_first_token(course):
    """A slow host tier (1 kB/s: minutes per block, beyond any step's wall time): the step that
    promotes a prefix is charged its bytes' time, so the clock and the request's TTFT include it."""
    store = TieredStore([MemoryTier("host", 10**8, 1e3)])
    engine = OffloadEngine(course, store=store, num_blocks=7)
    prompt, params = COURSE_PROMPTS[4][:64], SamplingParams(max_tokens=2)
    engine.generate([prompt], params, use_tqdm=False)
    engine.generate(
        [[1] * 100], params, use_tqdm=False
    )  # evicts the prompt's blocks to host memory
    assert engine.manager.transfer_s == 0
    clock_before = engine.clock
    engine.generate([prompt], params, use_tqdm=False)
    charged = 3 * engine.block_bytes / 1e3  # (64 - 1) // 16 blocks: never the last token's
    assert engine.manager.promoted == {"host": 3}
    assert engine.manager.transfer_s == pytest.approx(charged)
    assert engine.clock - clock_before >= charged
    assert engine.request_metrics()[-1]["ttft_s"] >= charged


def test_an_unsalted_store_shared_by_two_models_gives_wrong_tokens(course, tmp_path):
    """The pitfall the salt avoids: another checkpoint of the same architecture reads the first
    one's K/V for the same tokens."""
    other = load_course_model()
    with torch.no_grad():
        for layer in other.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.0)
            layer.self_attn.v_proj.weight.mul_(0.5)
    prompt = COURSE_PROMPTS[4][:64]
    params = SamplingParams(max_tokens=10)
    (own,) = LLMEngine(other, num_blocks=20).generate([prompt], params, use_tqdm=False)
    for salted in (True, False):
        store = TieredStore([MemoryTier("host", 10**8, 25e9)])
        first = OffloadEngine(course, store=store, num_blocks=7)
        first.generate([prompt], params, use_tqdm=False)
        first.generate([[1] * 90], params, use_tqdm=False)  # evicts the prompt's blocks to host
        second = OffloadEngine(other, store=store, num_blocks=20)
        if not salted:
            second.salt = second.manager.salt = first.salt
        (got,) = second.generate([prompt], params, use_tqdm=False)
        assert (got.output_token_ids == own.output_token_ids) == salted
        assert (sum(second.manager.promoted.values()) > 0) == (not salted)


# --- ship or recompute ----------------------------------------------------------------------------


def test_prefill_flops_match_torchs_count_and_bytes_match_the_engines_blocks(course):
    """Oracles: torch's FlopCounterMode over the model's forward (which computes the full n × n
    scores and the LM head: both taken out), and the engine's own block bytes."""
    import dataclasses

    from torch.utils.flop_counter import FlopCounterMode

    from kvlib.offload.breakeven import (
        break_even_bandwidth,
        kv_transfer_bytes,
        linear_weight_count,
        prefill_flops,
    )

    config = dataclasses.asdict(course.config)
    linear = [m for name, m in course.model.layers.named_modules() if name.endswith("_proj")]
    assert len(linear) == 7 * course.config.num_hidden_layers  # q, k, v, o, gate, up, down
    assert linear_weight_count(config) == sum(m.weight.numel() for m in linear)
    n, c = 40, course.config
    with FlopCounterMode(display=False) as counter:
        course(torch.arange(n)[None])
    attention = c.num_hidden_layers * c.num_attention_heads * c.head_dim
    expected = counter.get_total_flops() - 2 * n * c.hidden_size * c.vocab_size
    expected -= 4 * attention * n * n - 2 * attention * n * (n + 1)  # full scores -> causal half
    assert prefill_flops(config, n) == expected
    engine = LLMEngine(course, num_blocks=4, block_size=16)
    assert kv_transfer_bytes(config, 16) == engine.block_bytes
    speed = 1e12
    bandwidth = break_even_bandwidth(config, n, speed)
    assert kv_transfer_bytes(config, n) / bandwidth == pytest.approx(
        prefill_flops(config, n) / speed
    )


# --- KV transfer between two processes ------------------------------------------------------------


def test_a_decode_engine_continues_from_shipped_blocks_token_identically(course):
    """A prefill process ships each prompt's full blocks over ZeroMQ (loopback); the decode engine
    in this process admits the prompt as a prefix hit on them and generates exactly what one
    engine doing both generates; full precision and int8 blocks (with their scales)."""
    import zmq

    from kvlib.offload.transfer import import_blocks, request_prefill

    server = subprocess.Popen(
        [sys.executable, "-m", "kvlib.offload.transfer", "--model", "course", "--threads", "1"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.RCVTIMEO, 60_000)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://127.0.0.1:{int(server.stdout.readline())}")
        params = SamplingParams(max_tokens=8)
        for scheme in (None, "int8"):
            kv_scheme = None if scheme is None else QuantScheme(scheme)
            prompts = COURSE_PROMPTS[1:5] + [COURSE_PROMPTS[9]]  # 70, 17, 33, 90, 64 tokens
            one = LLMEngine(course, num_blocks=64, kv_scheme=kv_scheme)
            expected = [o.output_token_ids for o in one.generate(prompts, params, use_tqdm=False)]
            store = TieredStore([MemoryTier("received", 10**8, 25e9)])
            decode = OffloadEngine(course, store=store, num_blocks=64, kv_scheme=kv_scheme)
            for prompt, tokens in zip(prompts, expected):
                header = import_blocks(request_prefill(socket, prompt, scheme), store, decode.salt)
                num_full = (len(prompt) - 1) // 16
                assert len(header["keys"]) == num_full and header["first_token"] == tokens[0]
                assert header["nbytes"] >= num_full * decode.block_bytes  # + headers
                computed_before = decode.summary()["prefill_tokens"] if decode.stats else 0
                (output,) = decode.generate([prompt], params, use_tqdm=False)
                assert output.output_token_ids == tokens
                computed = decode.summary()["prefill_tokens"] - computed_before
                # the tokens after the last block it used: 1 to 16 (16 for the 64-token prompt)
                assert computed == len(prompt) - 16 * num_full and 1 <= computed <= 16
                assert computed == 16 or len(prompt) % 16
            # every full block came over the wire (prompts 1 and 3 share two: the second time,
            # those are device hits)
            assert (
                0 < decode.manager.promoted["received"] <= sum((len(p) - 1) // 16 for p in prompts)
            )
        other = OffloadEngine(course, store=store, num_blocks=64)  # float blocks, int8 sent
        frames = request_prefill(socket, COURSE_PROMPTS[1], "int8")
        with pytest.raises(ValueError, match="salt"):
            import_blocks(frames, store, other.salt)
        socket.send_json({"stop": True})
        socket.recv_multipart()
        assert server.wait(timeout=30) == 0
    finally:
        socket.close()
        context.term()
        server.kill()
        server.wait()
        server.stdout.close()
