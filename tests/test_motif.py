"""Motif's checkpoints (Motif-2.6B: DIFF V1 + PolyNorm; Motif-2-12.7B: Grouped Differential Attention) in diffjax,
against a PyTorch re-statement of the code that serves them (tests/motif_reference.py): logits, gradients and
greedy generation in float32, HF -> diffjax -> HF bit-exact, verify through the directory's own remote code."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import diffjax  # noqa: E402
from diffjax.config import ModelConfig  # noqa: E402
from diffjax.convert.common import ConversionError  # noqa: E402
from diffjax.convert.hf import config_from_hf, params_from_hf  # noqa: E402
from diffjax.model.layers import polynorm  # noqa: E402
from hf_models import max_relative_error, random_tokens  # noqa: E402
from motif_reference import MotifForCausalLM, PolyNorm, make_motif_model, save_with_remote_code  # noqa: E402

FP32_TOL = 1e-5  # as DiffLlama's (tests/test_hf_equivalence.py)
CASES = {
    # Motif-2.6B's form: no num_noise_heads (half the 8 query heads are noise heads), 4 kv half-heads
    "motif_2.6b": dict(num_attention_heads=8, num_key_value_heads=4),
    # GDA 3:1 (6 signal, 2 noise heads), 2 kv heads
    "gda_3to1": dict(num_attention_heads=8, num_noise_heads=2, head_dim=8, num_key_value_heads=4),
    # GDA 4:1 with one kv head, tied embeddings (the 12.7B's ratio)
    "gda_4to1_tied": dict(num_attention_heads=10, num_noise_heads=2, head_dim=8, num_key_value_heads=2,
                          tie_word_embeddings=True),
}
EXPECTED_KIND = {"motif_2.6b": ("diff", None), "gda_3to1": ("gda", 2), "gda_4to1_tied": ("gda", 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (the PyTorch model, its HF directory with the re-statement as remote code)."""
    made = {}

    def get(case):
        if case not in made:
            model = make_motif_model(**CASES[case])
            directory = tmp_path_factory.mktemp(case)
            save_with_remote_code(model, directory)
            made[case] = model, directory
        return made[case]

    return get


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_polynorm_equals_vllms():
    """The values of PolyNorm(w=[0.2, 0.3, 0.5], b=0.125) at [0.5, 1, 2] (by hand from vLLM's formula), and diffjax
    against the re-statement on random rows in float32 and bfloat16."""
    w, b = jnp.array([0.2, 0.3, 0.5]), jnp.array([0.125])
    np.testing.assert_allclose(polynorm(jnp.array([0.5, 1.0, 2.0]), w, b), [0.35080094, 0.67172026, 1.72779923], rtol=1e-6)
    reference = PolyNorm()
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([0.2, 0.3, 0.5]))
        reference.bias.fill_(0.125)
    x = np.random.default_rng(0).normal(size=(3, 5, 24)).astype(np.float32)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            expected = reference(torch.tensor(x).to(dtype)).float().numpy()
        ours = polynorm(jnp.asarray(x).astype(jnp.dtype(str(dtype).removeprefix("torch."))), w, b)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # sums in another order; terms cancel near 0
        np.testing.assert_allclose(np.asarray(ours.astype(jnp.float32)), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", [c if c == "gda_3to1" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_logits_fp32(case, saved, measured):
    reference, directory = saved(case)
    model = diffjax.load_hf(directory)
    assert (model.config.attention, getattr(model.config.attention_options, "num_noise_heads", None)) == EXPECTED_KIND[case]
    assert (model.config.activation, model.config.lambda_init_depth_offset) == ("polynorm", -1)
    assert model.num_params() == sum(p.numel() for p in reference.parameters())
    tokens = random_tokens(reference.config.vocab_size)
    err = measured(f"Motif logits max rel err (fp32, {case})",
                   max_relative_error(model(jnp.asarray(tokens)), torch_logits(reference, tokens)), FP32_TOL)
    assert err <= FP32_TOL


@pytest.mark.parametrize("case", ["gda_4to1_tied"])  # Motif-2.6B's V1 runs the same code with N = H
@pytest.mark.slow
def test_gradients_match_torch_autograd(case, saved, measured):
    """jax.grad of the mean next-token loss against torch autograd for every parameter, PolyNorm's and subln's too."""
    reference, directory = saved(case)
    tokens = random_tokens(reference.config.vocab_size)
    reference.zero_grad()
    logits = reference(torch.tensor(tokens, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1))
    loss.backward()
    torch_grads = {name: p.grad for name, p in reference.named_parameters()}
    model = diffjax.load_hf(directory)
    loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m, t: diffjax.next_token_loss(m(t), t)))
    jax_loss, grads = loss_and_grads(model, jnp.asarray(tokens))
    assert abs(float(jax_loss) - loss.item()) <= 1e-5 * abs(loss.item())
    expected = params_from_hf(torch_grads, model.config)  # the re-layout is linear: it maps gradients too
    ours = dict(nnx.to_flat_state(grads))
    assert set(expected) == set(ours)
    worst = 0.0
    for path, grad in expected.items():
        err = max_relative_error(ours[path][...], grad)
        worst = max(worst, err)
        assert err <= 1e-4, f"gradient of {path}: max rel err {err:.2e}"
    measured(f"Motif grad max rel err over params ({case})", worst, 1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_diffjax_to_hf_is_bit_exact(case, saved, tmp_path):
    reference, directory = saved(case)
    base = json.loads((directory / "config.json").read_text())
    out = diffjax.save_hf(diffjax.load_hf(directory), tmp_path / "out", base_config=base)
    original = safetensors_torch.load_file(directory / "model.safetensors")
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    written = json.loads((out / "config.json").read_text())
    for key in ("model_type", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                "attn_rms_norm_eps", "auto_map", "tie_word_embeddings"):
        assert written[key] == base[key], key
    assert written.get("num_noise_heads", base["num_attention_heads"] // 2) == base.get("num_noise_heads", base["num_attention_heads"] // 2)


@pytest.mark.slow
def test_a_gda_model_trained_in_diffjax_exports_to_what_motifs_code_computes(tmp_path, measured):
    """diffjax -> HF: a random diffjax GDA model (2:1, GQA) saved as a Motif directory, run by the re-statement."""
    config = ModelConfig(vocab_size=97, d_model=64, num_layers=2, num_heads=4, num_kv_heads=1, attention_options={"num_noise_heads": 2},
                         attention="gda", activation="polynorm", lambda_init_depth_offset=-1, subln_eps=1e-5,
                         init_std=0.15, lambda_std=0.3, attention_impl="xla")
    model = diffjax.TransformerLM(config, rngs=nnx.Rngs(3))
    out = diffjax.save_hf(model, tmp_path / "hf")
    reference = MotifForCausalLM.from_pretrained(out).eval()
    tokens = random_tokens(config.vocab_size)
    err = measured("diffjax GDA -> Motif logits max rel err (fp32)",
                   max_relative_error(model(jnp.asarray(tokens)), torch_logits(reference, tokens)), FP32_TOL)
    assert err <= FP32_TOL
    with pytest.raises(ConversionError, match=r"lambda_init_depth_offset=0: Motif's code always uses"):
        diffjax.save_hf(diffjax.TransformerLM(config.replace(lambda_init_depth_offset=0), rngs=nnx.Rngs(0)), tmp_path / "x")


@pytest.mark.parametrize("case", ["gda_3to1"])
@pytest.mark.slow
def test_greedy_generation_equals_the_reference_token_for_token(case, saved):
    reference, directory = saved(case)
    model = diffjax.load_hf(directory)
    prompt = random_tokens(reference.config.vocab_size, shape=(1, 7), seed=1)
    sequence = torch.tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        for _ in range(12):
            next_token = reference(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    generated = np.asarray(diffjax.generate(model, prompt, 12))[0]
    assert generated.tolist() == sequence[0, 7:].tolist()


BASE = {"model_type": "motif", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_act": "poly_norm"}


@pytest.mark.parametrize("changes,message", [
    ({"k_ratio": 2}, r"k_ratio=2 is not supported"),
    ({"num_noise_heads": 3, "head_dim": 4}, r"num_noise_heads \(3\) must divide the signal heads .* = 5\)"),
    ({"num_noise_heads": 2}, r"num_noise_heads needs head_dim"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads must be even"),
    ({"use_bias": True}, r"use_bias=true is not supported"),
    ({"model_type": "Motif", "mhc_enabled": True, "num_experts": 384},  # Motif 3's keys: read as Motif 3
     r"q_lora_rank=None is not supported for Motif 3: GDLA needs a q latent"),
    ({"hidden_act": "relu"}, r"hidden_act 'relu' is not supported; supported: .*'poly_norm'"),
    ({"num_attention_heads": 10, "num_noise_heads": 2, "num_key_value_heads": 8, "head_dim": 4},
     r"num_noise_heads \(2\) must divide num_heads \(8\) and be a multiple of num_kv_heads \(4\)"),
])
def test_configs_diffjax_cannot_build_are_named(changes, message):
    with pytest.raises(ConversionError, match=message):
        config_from_hf({**BASE, **changes})


def test_config_mapping():
    config = config_from_hf({**BASE, "num_attention_heads": 10, "num_noise_heads": 2, "head_dim": 4, "rms_norm_eps": 1e-6,
                             "attn_rms_norm_eps": 1e-5, "num_key_value_heads": 4})
    assert (config.attention, config.num_heads, config.attention_options.num_noise_heads, config.num_kv_heads) == ("gda", 8, 2, 2)
    assert (config.norm_eps, config.subln_norm_eps, config.lambda_init_at(0)) == (1e-6, 1e-5, pytest.approx(0.8 - 0.6 * 1.3498588, rel=1e-6))  # exp(0.3)
    v1 = config_from_hf(BASE)
    assert (v1.attention, v1.num_heads, v1.num_kv_heads, v1.head_dim, v1.subln_norm_eps) == ("diff", 4, 2, 4, 1e-6)


@pytest.mark.slow
def test_the_convert_cli_reads_and_writes_motif_directories(saved, tmp_path, capsys):
    """hf-to-diffjax, verify --trust-remote-code on the run directory, diffjax-to-hf: the tensors come back bit-exact
    and the directory keeps its remote code's auto_map (a user's real Motif directory would keep its own)."""
    from diffjax.convert.__main__ import main

    _, directory = saved("gda_4to1_tied")
    assert main(["hf-to-diffjax", str(directory), str(tmp_path / "run")]) == 0
    assert main(["verify", str(directory), "--diffjax", str(tmp_path / "run"), "--prompts", "1", "--seq-len", "16",
                 "--trust-remote-code"]) == 0
    report = capsys.readouterr().out
    assert "PASS" in report and "layer 2" in report and "top-1 agreement: 100.00%" in report
    assert main(["verify", str(directory), "--prompts", "1", "--seq-len", "16"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    assert main(["diffjax-to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    original = safetensors_torch.load_file(directory / "model.safetensors")
    exported = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["auto_map"] == json.loads(
        (directory / "config.json").read_text())["auto_map"]
    assert (tmp_path / "hf" / "modeling_motif.py").read_text() == (directory / "modeling_motif.py").read_text()


def as_published(directory, tmp_path, spelling: str):
    """A copy of `directory` whose config.json spells model_type `spelling` (Motif's checkpoints and vLLM: "Motif")."""
    copy = tmp_path / f"spelled_{spelling}"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": spelling}, indent=2))
    return copy


@pytest.mark.parametrize("spelling", ["Motif", "motif"])
def test_the_published_spelling_reads_exactly_and_exports_as_spelled(spelling, saved, tmp_path, measured):
    reference, directory = saved("gda_3to1")
    source = as_published(directory, tmp_path, spelling)
    model = diffjax.load_hf(source)
    tokens = random_tokens(reference.config.vocab_size)
    logits = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_array_equal(logits, np.asarray(diffjax.load_hf(directory)(jnp.asarray(tokens))))
    assert measured(f"Motif logits max rel err (fp32, model_type {spelling!r})",
                    max_relative_error(logits, torch_logits(reference, tokens)), FP32_TOL) <= FP32_TOL
    base = json.loads((source / "config.json").read_text())
    exported = diffjax.save_hf(model, tmp_path / "out", base_config=base)
    assert json.loads((exported / "config.json").read_text())["model_type"] == spelling
    original = safetensors_torch.load_file(directory / "model.safetensors")
    written = safetensors_torch.load_file(exported / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in original.items())
    without_source = diffjax.save_hf(model, tmp_path / "bare")  # no source config: the publisher's spelling
    assert json.loads((without_source / "config.json").read_text())["model_type"] == "Motif"


@pytest.mark.slow
def test_a_converted_run_remembers_the_sources_spelling(saved, tmp_path):
    """hf-to-diffjax of a "Motif" and of a "motif" directory, diffjax-to-hf of each run: the source's spelling; verify
    (its remote code) reads the published spelling too."""
    from diffjax.convert import diffjax_to_hf, hf_to_diffjax, verify

    _, directory = saved("gda_3to1")
    for spelling in ("Motif", "motif"):
        source = as_published(directory, tmp_path, spelling)
        hf_to_diffjax(source, tmp_path / f"run_{spelling}")
        out = diffjax_to_hf(tmp_path / f"run_{spelling}", tmp_path / f"hf_{spelling}")
        assert json.loads((out / "config.json").read_text())["model_type"] == spelling
    published = tmp_path / "spelled_Motif"
    with pytest.raises(ConversionError, match=r"transformers has no Motif model built in.*--trust-remote-code"):
        verify(published, prompts=1, seq_len=8)
    assert verify(published, diffjax_path=tmp_path / "run_Motif", prompts=1, seq_len=8, trust_remote_code=True).passed
