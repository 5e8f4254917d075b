"""The GPU serving benchmark's CPU-checkable parts (`kvlib.experiments.serving_gpu`,
`kvlib.experiments.smollm2_steps`): its workload, its transformers twin of kvlib's model, how it
turns runs into rows, and its refusal to run without CUDA."""

import pytest
import torch

import kvlib.experiments.serving_gpu as S
from kvlib.model import LlamaModel, ModelConfig


def test_the_workload_is_seeded_and_within_its_ranges():
    prompts = S.workload_prompts(49152)
    assert prompts == S.workload_prompts(49152)  # the same on every machine
    assert len(prompts) == S.NUM_REQUESTS == 64
    assert all(S.PROMPT_LEN[0] <= len(p) <= S.PROMPT_LEN[1] for p in prompts)
    assert all(256 <= t < 49152 for p in prompts for t in p)  # no special tokens
    assert len({len(p) for p in prompts}) > 30  # lengths spread over the range


def test_the_transformers_twin_computes_kvlib_models_logits():
    transformers = pytest.importorskip("transformers")
    config = ModelConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaModel(config).eval()
    twin = S.hf_model(model)
    assert isinstance(twin, transformers.LlamaForCausalLM)
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        ours, theirs = model(ids), twin(ids).logits
    assert torch.allclose(ours, theirs.float(), rtol=1e-4, atol=1e-4)


def test_rows_count_tokens_and_agreement_with_kvlib_eager():
    reference = [[1, 2, 3] * 6, [4] * 18]
    results = {
        "kvlib_eager": {"runs": [{"scenario": "offline", "seconds": 2.0, "outputs": reference}]},
        "hf_generate_dynamic": {
            "runs": [{"scenario": "offline", "seconds": 1.0, "outputs": [reference[0], [5] * 18]}]
        },
        "kvlib_graphs": {
            "runs": [
                {
                    "scenario": "poisson_16_per_s",
                    "seconds": 4.0,
                    "tokens": 36,
                    "ttft": [0.1, 0.3],
                    "tpot": [0.01, 0.02],
                }
            ]
        },
    }
    rows = {r["contender"]: r for r in S.rows_of(results, {"device": "test"})}
    assert rows["kvlib_eager"]["output_tokens"] == 36 and rows["kvlib_eager"]["match16"] == 2
    assert rows["hf_generate_dynamic"]["match16"] == 1  # the second request differs
    assert rows["hf_generate_dynamic"]["output_tok_s"] == 36.0
    poisson = rows["kvlib_graphs"]
    assert poisson["output_tok_s"] == 9.0 and poisson["match16"] == ""
    assert poisson["ttft_p50_ms"] == 200.0 and poisson["tpot_p99_ms"] == pytest.approx(19.9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_gpu_experiments_say_so(capsys):
    from kvlib.experiments import smollm2_steps

    with pytest.raises(SystemExit) as exit_info:
        S.main(["--out", "unused.csv"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="measures on a CUDA GPU"):
        smollm2_steps.main(["--out", "unused.csv"])


def test_rows_carry_the_decode_steps_host_and_gpu_times_where_measured():
    run = {"scenario": "offline", "seconds": 1.0, "outputs": [[1] * 18]}
    results = {
        "kvlib_overlap": {"runs": [{**run, "decode_host_ms": 1.23456, "decode_gpu_ms": 0.9876}]},
        "hf_generate_dynamic": {"runs": [run]},
    }
    rows = {r["contender"]: r for r in S.rows_of(results, {"device": "test"})}
    assert (rows["kvlib_overlap"]["decode_host_ms"], rows["kvlib_overlap"]["decode_gpu_ms"]) == (
        1.235,
        0.988,
    )
    assert rows["hf_generate_dynamic"]["decode_host_ms"] == ""  # not measured per step
    assert rows["kvlib_overlap"]["match16"] == ""  # no kvlib_eager run to compare with


def test_decode_step_times_are_the_medians_of_the_decode_only_steps():
    from types import SimpleNamespace

    def step(seconds, prefill=0, recomputed=0):
        return SimpleNamespace(
            seconds=seconds, num_prefill_tokens=prefill, num_recomputed_tokens=recomputed
        )

    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    stats = [step(0.5, prefill=300), step(0.002), step(0.004), step(0.003), step(0.1, 0, 40)]
    events = [
        (False, Event(0), Event(40)),
        (True, Event(0), Event(1.5)),
        (True, Event(2), Event(3)),
    ]
    times = S.decode_step_times_ms(stats, events)
    assert times == {"decode_host_ms": pytest.approx(3.0), "decode_gpu_ms": pytest.approx(1.25)}
    assert (
        S.decode_step_times_ms([], [])["decode_gpu_ms"]
        != S.decode_step_times_ms([], [])["decode_gpu_ms"]
    )  # NaN where nothing was measured


def test_an_unavailable_or_failing_contender_is_left_out_and_named(tmp_path, monkeypatch):
    import json
    import subprocess
    import types

    import kvlib.experiments.timing as timing

    monkeypatch.setattr(timing, "device_facts", lambda: {"device": "test GPU"})
    monkeypatch.setattr(timing, "commit_label", lambda: "abc1234")
    ran = []

    def fake_run(command, capture_output, text, timeout):
        contender, path = command[command.index("--one") + 1], command[-1]
        ran.append(contender)
        if contender == "kvlib_eager":
            run = {"scenario": "offline", "seconds": 2.0, "outputs": [[7] * 18]}
            json.dump({"contender": contender, "runs": [run]}, open(path, "w"))
            return types.SimpleNamespace(returncode=0, stderr="")
        if contender == "hf_generate_batch":
            return types.SimpleNamespace(returncode=S.UNAVAILABLE_EXIT, stderr="no generate_batch")
        return types.SimpleNamespace(returncode=1, stderr="Traceback: out of memory")

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "serving_gpu.csv"
    contenders = ("kvlib_eager", "hf_generate_batch", "kvlib_mixed")
    summary = S.record(str(out), contenders=contenders)
    assert ran == list(contenders)
    assert summary.endswith("failed: ['hf_generate_batch', 'kvlib_mixed']")
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and "kvlib_eager" in lines[1]  # the header and the one that ran


def test_generate_batch_missing_from_transformers_is_named():
    pytest.importorskip("transformers")

    class NoContinuousBatching:
        pass

    with pytest.raises(S.ContenderUnavailable, match="has no generate_batch"):
        S.run_hf(NoContinuousBatching(), "hf_generate_batch", [[300, 301]])
