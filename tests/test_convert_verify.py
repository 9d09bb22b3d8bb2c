"""verify: transformers and diffjax on the same prompts; passes on faithful conversions, fails on a corrupted weight."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from diffjax.convert import load_hf, verify  # noqa: E402
from diffjax.convert.verify import TOLERANCES  # noqa: E402
from hf_models import LLAMA3_ROPE, make_hf_model  # noqa: E402

CASES = {
    "diffllama_mha": ("diffllama", dict(num_key_value_heads=8)),
    "diffllama_gqa_tied": ("diffllama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "diffllama_llama3_rope": ("diffllama", dict(num_key_value_heads=4, rope_parameters=LLAMA3_ROPE, head_dim=16, num_attention_heads=4)),
    "llama_gqa_tied_llama3": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directories = {}

    def get(case):
        if case not in directories:
            kind, overrides = CASES[case]
            directories[case] = tmp_path_factory.mktemp(case)
            make_hf_model(kind, **overrides).save_pretrained(directories[case])
        return directories[case]

    return get


@pytest.mark.parametrize("case", [c if c == "diffllama_gqa_tied" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_verify_passes_on_converted_models(case, saved, measured):
    result = verify(saved(case), prompts=2, seq_len=32)
    assert result.passed, result.report()
    tol = TOLERANCES["float32"]
    measured("verify fp32 logits max rel", result.logits_rel, tol.logits_rel)
    measured("verify fp32 max KL (nats)", result.kl_max, tol.kl_max)
    assert [name for name, *_ in result.stages] == ["embeddings", "layer 0", "layer 1", "layer 2", "final norm"]
    assert result.top1 == 1.0


@pytest.mark.slow
def test_verify_bfloat16(saved, measured):
    result = verify(saved("diffllama_gqa_tied"), dtype="bfloat16", prompts=2, seq_len=32)
    assert result.passed, result.report()
    measured("verify bf16 logits max rel", result.logits_rel, TOLERANCES["bfloat16"].logits_rel)
    measured("verify bf16 max KL (nats)", result.kl_max, TOLERANCES["bfloat16"].kl_max)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_fails_on_one_corrupted_weight_and_shows_where(dtype, saved):
    """A layout bug in one tensor (layer 1's v channels reversed) fails, and the table points at layer 1."""
    model = load_hf(saved("diffllama_gqa_tied"), dtype=dtype)
    v = model.blocks.attn.v_kernel
    v[...] = v[...].at[1].set(jnp.flip(v[1], axis=-1))
    result = verify(saved("diffllama_gqa_tied"), model=model, dtype=dtype, prompts=2, seq_len=32)
    assert not result.passed
    report = result.report()
    assert "FAIL: logits max rel diff" in report
    stages = dict((name, rel) for name, _, rel in result.stages)
    tol = TOLERANCES[dtype].logits_rel
    assert stages["layer 0"] <= tol < stages["layer 1"], report
