"""The overlapped engine (`async_scheduling`, kvlib.engine.overlap): step n + 1 is planned and
launched before step n's tokens are back, placeholders are resolved on the device, stop checks
come one step late. Oracle: the synchronous engine, token for token, on a device whose results
arrive late (`WorkerThreadDevice`: the jobs run on another thread, in order, each after a sleep),
through chunked prefill, preemption, prefix caching, stop tokens, max_tokens, seeded sampling
with logprobs, parallel sampling and aborts; and the placeholders' bookkeeping in the block
manager. The last test runs the same comparison on a CUDA GPU with the kernel and CUDA graphs."""

import threading
import time

import pytest
import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.engine import LLMEngine, SamplingParams, StreamingEviction
from kvlib.engine.overlap import WorkerThreadDevice
from kvlib.loaders.course_model import load_course_model
from tests.test_engine import BATCHINGS, COURSE_PROMPTS

# the batchings whose schedules stress the overlap most (chunks, preemption, prefix hits)
OVERLAPPED = {
    name: BATCHINGS[name]
    for name in ("chunked prefill", "preemption", "prefix caching + preemption")
}


@pytest.fixture(scope="module")
def course():
    return load_course_model()


@pytest.fixture
def late_device():
    device = WorkerThreadDevice(delay_s=0.002)
    yield device
    device.close()


def serve(model, requests, *, device=None, abort_after=None, **options):
    """Run `requests` ({id: (prompt, SamplingParams)}) to completion, stepping by hand; abort the
    ids of `abort_after` ({call: [ids]}) after that many `step()` calls. Returns (streams {id: new
    tokens in order}, finals {id: final RequestOutput}, engine)."""
    engine = LLMEngine(model, **options)
    if device is not None:
        engine.runner.device_queue = device
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    streams, finals, calls = {r: [] for r in requests}, {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert len(output.new_token_ids) == 1
            streams[output.request_id] += output.new_token_ids
            assert list(output.output_token_ids) == streams[output.request_id]
            if output.finished:
                finals[output.request_id] = output
        calls += 1
        for request_id in (abort_after or {}).get(calls, []):
            engine.abort_request(request_id)
        engine.manager.check_invariants()
    assert engine.storage.num_blocks_in_use == 0
    assert all(block.ref_cnt == 0 for block in engine.manager.pool.blocks)
    return streams, finals, engine


def both(model, requests, late_device, **options):
    """The synchronous run and the overlapped one on the late device."""
    sync = serve(model, requests, **options)
    overlapped = serve(model, requests, device=late_device, async_scheduling=True, **options)
    return sync, overlapped


@pytest.mark.parametrize("name", OVERLAPPED)
def test_overlap_gives_the_synchronous_tokens(course, late_device, name):
    options, exercised = OVERLAPPED[name]
    params = SamplingParams(max_tokens=24)
    requests = {f"r{i}": (p, params) for i, p in enumerate(COURSE_PROMPTS)}
    (streams, _, _), (o_streams, _, o_engine) = both(course, requests, late_device, **options)
    assert o_streams == streams and all(len(s) == 24 for s in o_streams.values())
    summary = o_engine.summary()
    for key, least in exercised.items():
        assert summary[key] >= least, (key, summary[key])


def test_stop_tokens_and_max_tokens_end_the_same_streams(course, late_device):
    greedy = serve(course, {"g": (COURSE_PROMPTS[1], SamplingParams(max_tokens=12))}, num_blocks=20)
    greedy = greedy[0]["g"]
    requests = {
        "stop at 3": (
            COURSE_PROMPTS[1],
            SamplingParams(max_tokens=12, stop_token_ids=(greedy[2],)),
        ),
        "one token": (COURSE_PROMPTS[0], SamplingParams(max_tokens=1)),
        "two tokens": (COURSE_PROMPTS[2], SamplingParams(max_tokens=2)),
        "twenty": (COURSE_PROMPTS[3], SamplingParams(max_tokens=20)),
        "stop never seen": (COURSE_PROMPTS[4], SamplingParams(max_tokens=7, stop_token_ids=(999,))),
    }
    (streams, finals, _), (o_streams, o_finals, o_engine) = both(
        course, requests, late_device, num_blocks=100, max_num_batched_tokens=32
    )
    assert o_streams == streams
    assert {r: (f.finish_reason, list(f.output_token_ids)) for r, f in o_finals.items()} == {
        r: (f.finish_reason, list(f.output_token_ids)) for r, f in finals.items()
    }
    stop = greedy.index(greedy[2]) + 1
    assert (
        len(o_streams["stop at 3"]) == stop and o_finals["stop at 3"].finish_reason.value == "stop"
    )
    assert [len(o_streams[r]) for r in ("one token", "two tokens", "twenty")] == [1, 2, 20]
    first_step = {r.request_id: r.first_token_step for r in o_engine.requests.values()}
    assert first_step["one token"] <= first_step["twenty"]  # the smallest prompt first


def test_seeded_sampling_and_logprobs_are_the_synchronous_ones(course, late_device):
    requests = {
        f"s{i}": (
            p,
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=i, max_tokens=10, logprobs=3),
        )  # fmt: skip
        for i, p in enumerate(COURSE_PROMPTS[:6])
    }
    requests["greedy"] = (COURSE_PROMPTS[6], SamplingParams(max_tokens=10, logprobs=2))
    (streams, finals, _), (o_streams, o_finals, _) = both(
        course, requests, late_device, num_blocks=14, max_num_batched_tokens=32
    )
    assert o_streams == streams
    for request_id, final in finals.items():
        assert o_finals[request_id].output_token_ids == final.output_token_ids
    # logprobs arrive with each step's output: the same tokens and top ids, the same values up
    # to round-off (a step's batch differs, so its matmuls may round differently)
    sync_lp = _logprobs(course, requests)
    overlapped_lp = _logprobs(course, requests, device=late_device, async_scheduling=True)
    assert len(sync_lp["s0"]) == 10
    differences = []
    for request_id, entries in sync_lp.items():
        assert [ids for ids, _ in overlapped_lp[request_id]] == [ids for ids, _ in entries]
        differences += [
            abs(a - b)
            for (_, values), (_, o_values) in zip(entries, overlapped_lp[request_id])
            for a, b in zip(values, o_values)
        ]
    assert max(differences) < 1e-4, max(differences)


def _logprobs(model, requests, device=None, **options):
    """{request id: [((token, top ids), (logprob, top logprobs)) of each streamed output]}."""
    engine = LLMEngine(model, num_blocks=14, max_num_batched_tokens=32, **options)
    if device is not None:
        engine.runner.device_queue = device
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    seen = {r: [] for r in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            (entry,) = output.logprobs
            ids = (entry.token_id, *(t for t, _ in entry.top))
            seen[output.request_id].append((ids, (entry.logprob, *(v for _, v in entry.top))))
    return seen


def test_parallel_sampling_forks_the_same_children(course, late_device):
    def run(**options):
        device = options.pop("device", None)
        engine = LLMEngine(course, num_blocks=60, max_num_batched_tokens=32, **options)
        if device is not None:
            engine.runner.device_queue = device
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8) for s in range(3)]
        engine.add_parallel_requests(["p0", "p1", "p2"], COURSE_PROMPTS[4], params)
        engine.add_request("other", COURSE_PROMPTS[1], SamplingParams(max_tokens=8))
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        engine.manager.check_invariants()
        assert engine.storage.num_blocks_in_use == 0
        return final

    sync = run()
    assert run(device=late_device, async_scheduling=True) == sync
    assert len({tuple(sync[p]) for p in ("p0", "p1", "p2")}) > 1  # the children did sample apart


def test_an_aborted_request_frees_its_blocks_and_leaves_the_others_unchanged(course, late_device):
    params = SamplingParams(max_tokens=16)
    requests = {f"r{i}": (p, params) for i, p in enumerate(COURSE_PROMPTS[:6])}
    aborts = {4: ["r1"], 9: ["r3", "r5"]}
    (streams, _, _), (o_streams, _, o_engine) = both(
        course, requests, late_device, abort_after=aborts, num_blocks=40, max_num_batched_tokens=24
    )
    full = serve(course, requests, num_blocks=40, max_num_batched_tokens=24)[0]
    for request_id in requests:
        aborted = any(request_id in ids for ids in aborts.values())
        if aborted:  # a prefix of its full stream, cut where the abort fell
            assert o_streams[request_id] == full[request_id][: len(o_streams[request_id])]
            assert len(o_streams[request_id]) < len(full[request_id])
            assert request_id not in o_engine.requests
        else:
            assert o_streams[request_id] == streams[request_id] == full[request_id]
    assert not o_engine.abort_request("r0")  # finished already: nothing to do


def test_the_host_plans_the_next_step_while_the_device_runs(course):
    """With the overlapped engine, step n + 1 is submitted before step n's job ends; with the
    synchronous one, never."""

    class LoggingDevice(WorkerThreadDevice):
        def __init__(self):
            super().__init__(delay_s=0.005)
            self.events, self.lock = [], threading.Lock()

        def log(self, event):
            with self.lock:
                self.events.append(event)

        def submit(self, job):
            index = sum(e[0] == "submit" for e in self.events)
            self.log(("submit", index))

            def logged():
                result = job()
                self.log(("done", index))
                return result

            return super().submit(logged)

    overlaps = {}
    for async_scheduling in (False, True):
        device = LoggingDevice()
        serve(
            course,
            {f"r{i}": (p, SamplingParams(max_tokens=6)) for i, p in enumerate(COURSE_PROMPTS[:4])},
            device=device,
            async_scheduling=async_scheduling,
            num_blocks=100,
            max_num_batched_tokens=512,
        )
        device.close()
        order = {event: i for i, event in enumerate(device.events)}
        steps = sum(e[0] == "submit" for e in device.events)
        overlaps[async_scheduling] = sum(
            order["submit", k + 1] < order["done", k] for k in range(steps - 1)
        )
        assert steps >= 6
    assert overlaps[False] == 0
    assert overlaps[True] >= 5, overlaps  # every step but the last ones planned ahead


def test_placeholders_are_hashed_for_the_prefix_cache_once_known():
    manager = BlockManager(BlockPool(8, 4, enable_prefix_caching=True))
    manager.allocate("a", [1, 2, 3])
    manager.append_slot("a", None)  # the 4th token: its id is still on the device
    assert manager.block_hashes["a"] == []  # a full block with an unknown token is not cached
    manager.append_slot("a", None)  # (a second placeholder, in a new block)
    manager.check_invariants()
    with pytest.raises(ValueError, match="not known yet"):
        manager.set_token("a", 2, 9)  # token 2 is known
    manager.set_token("a", 3, 4)
    assert len(manager.block_hashes["a"]) == 1
    other = BlockManager(BlockPool(8, 4, enable_prefix_caching=True))
    other.allocate("b", [1, 2, 3, 4, 5])
    assert manager.block_hashes["a"] == other.block_hashes["b"]  # the hash of the known tokens
    assert manager.num_cached_prefix_blocks([1, 2, 3, 4, 7])[0] == 4  # a hit for another prompt
    manager.check_invariants()


def test_overlap_refuses_policies_that_decide_from_the_last_tokens(course):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLMEngine(course, num_blocks=20, policy="static", async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLMEngine(course, num_blocks=20, eviction=StreamingEviction(), async_scheduling=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_a_gpu_gives_the_synchronous_tokens_and_waits_less():
    """On CUDA, with chapter 11's kernel and CUDA graphs: the same tokens as the synchronous
    engine, seeded sampling included, and the host no longer waits for each step: over a
    decode-heavy run the overlapped engine's wall time is not above the synchronous one's."""
    from kvlib.engine.runner import ModelRunner

    model = load_course_model(device="cuda")
    prompts = COURSE_PROMPTS * 4
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=48) for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=48) if i % 2 else p for i, p in enumerate(sampled)]
    results, seconds = {}, {}
    for async_scheduling in (False, True, False, True):  # interleaved, the second run of each kept
        engine = LLMEngine(model, num_blocks=400, max_num_seqs=64, max_num_batched_tokens=1024,
                           async_scheduling=async_scheduling)  # fmt: skip
        engine.runner = ModelRunner(model, engine.storage, engine.manager, decode_kernel=True,
                                    cuda_graphs=True, max_graph_batch=64)  # fmt: skip
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds[async_scheduling] = time.perf_counter() - start
        results[async_scheduling] = [o.output_token_ids for o in outputs]
    assert results[True] == results[False]
    assert seconds[True] <= 1.05 * seconds[False], seconds
