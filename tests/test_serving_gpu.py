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
