"""diffjax loaded through load_hf against transformers' DiffLlamaForCausalLM / LlamaForCausalLM (eager)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import diffjax
from diffjax.convert.hf import config_from_hf, params_from_hf
from flax import nnx
from hf_models import LLAMA3_ROPE, make_hf_model, max_relative_error, random_tokens

FP32_TOL = 1e-5

DIFF_CASES = {
    "mha": dict(num_key_value_heads=8),
    "gqa_nrep2": dict(num_key_value_heads=4),
    "gqa_nrep4": dict(num_key_value_heads=2),
    "tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=4, rope_parameters=LLAMA3_ROPE, head_dim=16, num_attention_heads=4),
    "gelu_head_dim": dict(num_key_value_heads=2, hidden_act="gelu", head_dim=12),
}


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def saved(model, tmp_path):
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("llama3_rope", "gelu_head_dim")
                                  else c for c in DIFF_CASES])
def test_diffllama_logits_fp32(case, tmp_path, measured):
    hf = make_hf_model("diffllama", **DIFF_CASES[case])
    tokens = random_tokens(hf.config.vocab_size)
    model = diffjax.load_hf(saved(hf, tmp_path))
    assert model.config.attention == "diff"
    assert model.config.num_heads == hf.config.num_attention_heads // 2
    logits = np.asarray(model(jnp.asarray(tokens)))
    assert logits.dtype == np.float32 and logits.shape == (*tokens.shape, hf.config.vocab_size)
    err = measured("logits max rel err (fp32)", max_relative_error(logits, hf_logits(hf, tokens)), FP32_TOL)
    assert err <= FP32_TOL


def test_rotate_half_layout_matches_too(tmp_path, measured):
    """Loading without the channel permutation (rope_style='rotate_half') is the same function."""
    hf = make_hf_model("diffllama", num_key_value_heads=4)
    tokens = random_tokens(hf.config.vocab_size)
    model = diffjax.load_hf(saved(hf, tmp_path), rope_style="rotate_half")
    err = measured("logits max rel err (fp32)", max_relative_error(model(jnp.asarray(tokens)), hf_logits(hf, tokens)), FP32_TOL)
    assert err <= FP32_TOL


@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_llama_baseline_logits_fp32(num_kv_heads, tmp_path, measured):
    hf = make_hf_model("llama", num_key_value_heads=num_kv_heads)
    tokens = random_tokens(hf.config.vocab_size)
    model = diffjax.load_hf(saved(hf, tmp_path))
    assert model.config.attention == "standard" and model.config.num_heads == 8
    err = measured("logits max rel err (fp32)", max_relative_error(model(jnp.asarray(tokens)), hf_logits(hf, tokens)), FP32_TOL)
    assert err <= FP32_TOL


# bf16 has 8 mantissa bits; diffjax rounds where flash kernels do (fp32 scores and softmax), HF eager
# rounds the scores to bf16 first, so the two bf16 results differ about as much as each differs from fp32.
BF16_MAX_TOL = 6e-2  # max |diff| / max |logit|
BF16_MEAN_TOL = 1e-2  # mean |diff| / max |logit|


def mean_relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).mean() / np.abs(expected).max())


@pytest.mark.parametrize("kind", [pytest.param("diffllama", marks=pytest.mark.slow), "llama"])
def test_bf16_logits(kind, tmp_path, measured):
    """bf16 checkpoints load as bf16, agree with HF in bf16, and are no less accurate against fp32."""
    hf = make_hf_model(kind, num_key_value_heads=4)
    tokens = random_tokens(hf.config.vocab_size)
    exact = hf_logits(hf, tokens)
    hf_bf16 = hf.to(torch.bfloat16)
    model = diffjax.load_hf(saved(hf_bf16, tmp_path))
    assert model.config.dtype == "bfloat16" and model.config.param_dtype == "bfloat16"
    ours = np.asarray(model(jnp.asarray(tokens)))
    theirs = hf_logits(hf_bf16, tokens)
    assert measured("bf16 vs HF bf16, max rel", max_relative_error(ours, theirs), BF16_MAX_TOL) <= BF16_MAX_TOL
    assert measured("bf16 vs HF bf16, mean rel", mean_relative_error(ours, theirs), BF16_MEAN_TOL) <= BF16_MEAN_TOL
    hf_mean_error = mean_relative_error(theirs, exact)
    ours_mean_error = measured("bf16 vs fp32 truth, mean rel", mean_relative_error(ours, exact), 1.25 * hf_mean_error)
    measured("HF bf16 vs fp32 truth, mean rel", hf_mean_error, float("nan"))
    assert ours_mean_error <= 1.25 * hf_mean_error


@pytest.mark.parametrize("case", [pytest.param("gqa_nrep2", marks=pytest.mark.slow), "tied"])
def test_gradients_match_torch_autograd(case, tmp_path, measured):
    """jax.grad of the mean next-token loss against torch autograd, for every parameter."""
    hf = make_hf_model("diffllama", **DIFF_CASES[case])
    tokens = random_tokens(hf.config.vocab_size)
    logits = hf(torch.tensor(tokens, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)
    )
    loss.backward()
    torch_grads = {name: p.grad for name, p in hf.named_parameters()}
    model = diffjax.load_hf(saved(hf, tmp_path))

    def loss_fn(model):
        return diffjax.next_token_loss(model(jnp.asarray(tokens)), jnp.asarray(tokens))

    jax_loss, grads = nnx.value_and_grad(loss_fn)(model)
    assert abs(float(jax_loss) - loss.item()) <= 1e-5 * abs(loss.item())
    # The re-layout is linear (transposes, reshapes, permutations), so it maps gradients too.
    expected = params_from_hf(torch_grads, model.config)
    ours = dict(nnx.to_flat_state(grads))
    worst = 0.0
    for path, grad in expected.items():
        if path[-1] == "subln_scale":
            continue  # HF's per-head norm has no weight, so there is no torch gradient to compare
        err = max_relative_error(ours[path][...], grad)
        worst = max(worst, err)
        assert err <= 1e-4, f"gradient of {path}: max rel err {err:.2e}"
    lambda_paths = [p for p in expected if p[-1].startswith("lambda")]
    assert len(lambda_paths) == 4 and all(expected[p].shape[0] == model.config.num_layers for p in lambda_paths)
    measured("grad max rel err over params", worst, 1e-4)


def test_config_mapping_reads_both_rope_forms():
    v4 = {"model_type": "diffllama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5e5,
          "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16"}
    v5 = {**v4, "rope_parameters": {"rope_theta": 5e5, **{k: v for k, v in v4["rope_scaling"].items() if k != "type"},
                                    "rope_type": "llama3"}}
    del v5["rope_theta"], v5["rope_scaling"]
    for hf in (v4, v5):
        config = config_from_hf(hf)
        assert (config.rope_type, config.rope_theta, config.rope_factor) == ("llama3", 5e5, 8.0)
        assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 8)
        assert config.dtype == "bfloat16"
