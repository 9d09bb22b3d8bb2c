"""The PyTorch re-statement of Motif 3 (tests/motif3_reference.py) and its published configuration
(tests/motif3_published.py): parameter counts at the published size, the checkpoint's tensor names, causality, the
remote-code round trip, every feature switch, and properties checked independently of the re-statement (Sinkhorn's
doubly stochastic h_res, the window's sliding_window + 1 keys, the noise-head pairing, the routed experts' clamps as
vLLM's CUDA kernel states them, YaRN frequencies against transformers')."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from motif3_published import (  # noqa: E402
    PUBLISHED, PUBLISHED_ACTIVE_PARAMS, PUBLISHED_TOTAL_PARAMS, VARIANTS, checkpoint_shapes, is_sliding_layer,
    parameter_counts, small_config,
)
from motif3_reference import (  # noqa: E402
    Motif3Config, Motif3ForCausalLM, MotifMHC, attention_mask, differential_combine, gqa_attention,
    greedy_generate, make_motif3_model, rope_inv_freq, route, save_with_remote_code, sinkhorn,
)

TOKENS = torch.tensor(np.random.RandomState(0).randint(0, 97, (2, 24)), dtype=torch.long)


def logits_of(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def all_on():
    return make_motif3_model(small_config())


def test_published_size_parameter_counts():
    """The re-statement built on the meta device at the published config: its tensors are the checkpoint's names
    and shapes, 314B total; 13.2B active is reached counting the multi-token-prediction block the checkpoint ships."""
    with torch.device("meta"):
        model = Motif3ForCausalLM(Motif3Config(**PUBLISHED))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == checkpoint_shapes(PUBLISHED, include_mtp=True)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = total - round(routed * (1 - PUBLISHED["experts_top_k"] / PUBLISHED["num_experts"]))
    assert (total, active) == parameter_counts(PUBLISHED, include_mtp=True)
    without_mtp_total, without_mtp_active = parameter_counts(PUBLISHED)
    print(f"\nMotif 3 published config: {total / 1e9:.3f}B total, {active / 1e9:.3f}B active with the checkpoint's MTP "
          f"block; {without_mtp_total / 1e9:.3f}B total, {without_mtp_active / 1e9:.3f}B active without it")
    assert abs(total / PUBLISHED_TOTAL_PARAMS - 1) <= 0.01
    assert abs(active / PUBLISHED_ACTIVE_PARAMS - 1) <= 0.01
    mtp = model.model.mtp_layers[0].block[0]
    assert not mtp.moe_enabled and not mtp.mhc_enabled and mtp.self_attn.window == 128
    assert mtp.self_attn.rope_theta == 10000.0 and mtp.self_attn.yarn is None and mtp.self_attn.scale == 192 ** -0.5
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if not layer.moe_enabled] == [0, 1]
    assert [i for i, layer in enumerate(layers) if layer.self_attn.window is None] == list(range(0, 53, 4))
    assert all(layer.self_attn.window == 128 for layer in layers if layer.self_attn.window is not None)
    plain = 192 ** -0.5
    assert math.isclose(layers[0].self_attn.scale, plain * (0.1 * math.log(64) + 1) ** 2, rel_tol=1e-12)
    assert layers[1].self_attn.scale == plain


def test_published_schedules_agree_with_the_plain_python_helpers():
    model_free = [is_sliding_layer(PUBLISHED, i) for i in range(53)]
    assert model_free.count(False) == 14 and not model_free[0] and model_free[1]


def test_small_forward_is_causal(all_on):
    """In float64: the experts' matmuls see other token counts when a later token routes elsewhere, which moves
    float32 results by an ulp."""
    assert logits_of(all_on).shape == (2, 24, 97) and torch.isfinite(logits_of(all_on)).all()
    model = make_motif3_model(small_config(), dtype=torch.float64)
    logits = logits_of(model)
    changed = TOKENS.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    after = logits_of(model, changed)
    torch.testing.assert_close(after[:, :10], logits[:, :10], rtol=0, atol=1e-12)
    assert (after[:, 10:] - logits[:, 10:]).abs().amax(-1).min() > 1e-4


def test_save_pretrained_from_pretrained_trust_remote_code_offline(all_on, tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_with_remote_code(all_on, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "Motif"
    assert written["auto_map"]["AutoModelForCausalLM"] == "modeling_motif.Motif3ForCausalLM"
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == checkpoint_shapes(small_config())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "Motif3ForCausalLM" and type(loaded) is not Motif3ForCausalLM
    assert torch.equal(logits_of(loaded), logits_of(all_on))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "all_on"])
def test_each_switch_changes_the_logits(variant, all_on):
    """The variant with all_on's weights wherever the names agree: the logits move, and only the expected
    tensors are missing or extra."""
    model = make_motif3_model(small_config(variant), seed=1)
    result = model.load_state_dict(all_on.state_dict(), strict=False)
    ours, theirs = checkpoint_shapes(small_config(variant)), checkpoint_shapes(small_config())
    assert set(result.missing_keys) == set(ours) - set(theirs)
    assert set(result.unexpected_keys) == set(theirs) - set(ours)
    base, logits = logits_of(all_on), logits_of(model)
    assert (logits - base).abs().max() > 1e-3


def test_sinkhorn_rows_then_columns_twenty_times():
    """Columns are normalized last, so they sum to 1 exactly; rows converge (not yet exactly after 20 rounds for
    these spread logits); a transposed order would swap the two."""
    logits = 3 * torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(0))
    m = sinkhorn(logits, 20)
    col_err, row_err = (m.sum(-2) - 1).abs().max(), (m.sum(-1) - 1).abs().max()
    assert col_err <= 1e-6 < row_err <= 0.1
    converged = sinkhorn(0.1 * logits, 20)  # mild logits: rows and columns both sum to 1
    assert (converged.sum(-1) - 1).abs().max() <= 2e-6 and (converged.sum(-2) - 1).abs().max() <= 1e-6
    assert torch.equal(sinkhorn(logits, 20), sinkhorn(logits.clamp(-20, 20), 20))
    twenty_one = sinkhorn(logits, 21)
    assert not torch.equal(twenty_one, m)


def test_h_res_inside_the_model_is_doubly_stochastic_and_far_from_uniform(all_on):
    seen = []
    handle = all_on.model.layers[2].mhc_ffn.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        logits_of(all_on)
    finally:
        handle.remove()
    h_pre, h_post, h_res = seen[0]
    assert h_res.shape == (2, 24, 4, 4) and h_pre.shape == h_post.shape == (2, 24, 4)
    assert (h_res.sum(-2) - 1).abs().max() <= 1e-5 and (h_res.sum(-1) - 1).abs().max() <= 0.1
    assert h_res.std() > 0.05 and 0 < h_post.min() and h_post.max() < 1  # coefficient 1.0, not 2


def test_window_reads_exactly_sliding_window_plus_one_keys(all_on):
    mask = attention_mask(12, window=3)
    assert mask.sum(-1).tolist() == [min(i + 1, 4) for i in range(12)]
    assert attention_mask(12).sum(-1).tolist() == list(range(1, 13))
    x = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)
    for layer, reach in ((1, 3), (0, 8)):  # layer 1 windowed (3 keys back), layer 0 global
        attn = all_on.model.layers[layer].self_attn
        with torch.no_grad():
            base = attn(x, positions)[0, 8]
            for j in range(9):
                moved = x.clone()
                moved[0, j] += 1.0
                changed = (attn(moved, positions)[0, 8] - base).abs().max() > 1e-6
                assert changed == (8 - j <= reach), (layer, j)


def test_noise_head_is_the_last_of_each_group_and_kv_heads_serve_consecutive_queries():
    B, T, H, N, dv = 1, 1, 10, 2, 3
    attn = torch.arange(H, dtype=torch.float64).reshape(1, 1, H, 1).expand(B, T, H, dv)
    lam = torch.zeros(B, T, 8, dtype=torch.float64)  # sigmoid(0) = 1/2
    out = differential_combine(attn, lam, N)[0, 0, :, 0].tolist()
    assert out == [0 - 2, 1 - 2, 2 - 2, 3 - 2, 5 - 4.5, 6 - 4.5, 7 - 4.5, 8 - 4.5]  # noise heads 4 and 9
    q = torch.zeros(1, 2, H, 4)  # uniform attention: each query head returns its KV head's mean value
    v = torch.tensor([[[[1.0], [10.0]], [[3.0], [30.0]]]])  # [B, T=2, Hkv=2, 1]
    got = gqa_attention(q, torch.zeros(1, 2, 2, 4), v, 1.0, attention_mask(2))[0, 1, :, 0].tolist()
    assert got == [2.0] * 5 + [20.0] * 5


def kernel_activation(gate, up, w, b, output_scale, hidden_clamp=None, bias_clamp=None, product_clamp=False):
    """vLLM's grouped_poly_norm_topk_kernel per-row math (its header comment) and the caller's output clamp and
    scale, element by element in float64 numpy; without clamps it is PolyNorm.forward_native's formula."""
    w = 1 / (1 + np.exp(-w))
    b = float(np.clip(b, -bias_clamp, bias_clamp)) if bias_clamp is not None else float(b)
    x, m = (np.clip(gate, -hidden_clamp, hidden_clamp), np.clip(up, -hidden_clamp, hidden_clamp)) \
        if hidden_clamp is not None else (gate, up)
    D = x.shape[-1]
    rms = [1 / math.sqrt(sum(float(v) ** p for v in x) / D + 1e-6) for p in (2, 4, 6)]
    out = np.array([w[0] * v ** 3 * rms[2] + w[1] * v * v * rms[1] + w[2] * v * rms[0] + b for v in x]) * m
    return (np.clip(out, -hidden_clamp, hidden_clamp) if product_clamp else out) * output_scale


def test_polynorm_clamps_per_ffn_kind_as_vllm_applies_them():
    """Routed experts clamp gate, up, the bias and the product; the shared expert clamps gate and up only; the dense
    MLP clamps nothing (tight clamps so that each one bites)."""
    model = make_motif3_model(small_config("tight_clamps"), dtype=torch.float64)
    rng = np.random.RandomState(2)
    gate, up = rng.normal(size=(5, 16)), rng.normal(size=(5, 16))
    experts = model.model.layers[1].moe.experts
    for e in range(6):
        got = experts.expert_activation(e, torch.tensor(gate), torch.tensor(up), 0.5).detach().numpy()
        w, b = experts.act_fn.weight[e].detach().numpy(), experts.act_fn.bias[e, 0].item()
        want = np.stack([kernel_activation(g, u, w, b, 0.5, 0.3, 0.05, True) for g, u in zip(gate, up)])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert (experts.act_fn.bias.abs() > 0.05).any()  # the bias clamp bites on these weights
    for mlp, hidden_clamp in ((model.model.layers[1].moe.shared_experts, 0.3), (model.model.layers[0].mlp, None)):
        act = mlp.act_fn
        got = act.forward_mul(*(torch.tensor(a).clamp(-0.3, 0.3) if hidden_clamp else torch.tensor(a)
                                for a in (gate, up))).detach().numpy() * 0.5
        w, b = act.weight.detach().numpy(), act.bias.item()
        want = np.stack([kernel_activation(g, u, w, b, 0.5, hidden_clamp) for g, u in zip(gate, up)])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        x = torch.tensor(3 * rng.normal(size=(5, 32)))  # the module clamps (or not) by itself
        expected = mlp.down_proj(act.forward_mul(*(p(x).clamp(-0.3, 0.3) if hidden_clamp else p(x)
                                                   for p in (mlp.gate_proj, mlp.up_proj))) * 0.5)
        torch.testing.assert_close(mlp(x), expected, rtol=0, atol=0)


def test_routing_selects_with_the_bias_and_weighs_without_it():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    experts, weights = route(logits, bias, 2, "sigmoid", True, 2.0)
    assert sorted(experts[0].tolist()) == [0, 3]
    s = torch.sigmoid(logits[0])
    expected = {0: 2 * s[0] / (s[0] + s[3]), 3: 2 * s[3] / (s[0] + s[3])}
    for e, w in zip(experts[0].tolist(), weights[0].tolist()):
        assert math.isclose(w, expected[e].item(), rel_tol=1e-12)


@pytest.mark.parametrize("config", [PUBLISHED, small_config()], ids=["published", "small"])
def test_yarn_frequencies_equal_transformers(config):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = config["rope_scaling"]
    hf = LlamaConfig(head_dim=config["qk_rope_head_dim"], hidden_size=64, num_attention_heads=4,
                     max_position_embeddings=config["max_position_embeddings"],
                     rope_parameters={**rope, "rope_theta": config["rope_theta"]})
    expected, _ = _compute_yarn_parameters(hf)
    ours = rope_inv_freq(config["qk_rope_head_dim"], config["rope_theta"], rope)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(config["qk_rope_head_dim"], config["rope_theta"])
    assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / rope["factor"])


def test_greedy_generation_and_float64(all_on):
    generated = greedy_generate(all_on, TOKENS[:, :8], 4)
    assert generated.shape == (2, 12) and torch.equal(generated[:, :8], TOKENS[:, :8])
    full = logits_of(all_on, generated)
    assert torch.equal(full[:, 7:-1].argmax(-1), generated[:, 8:])
    as_f64 = make_motif3_model(small_config(), dtype=torch.float64)
    torch.testing.assert_close(logits_of(as_f64).float(), logits_of(all_on), rtol=1e-4, atol=1e-4)


def test_mhc_collapse_and_combine_are_the_stated_sums():
    x = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    h_pre, h_post = torch.rand(1, 2, 4, dtype=torch.float64), torch.rand(1, 2, 4, dtype=torch.float64)
    h_res, out = torch.rand(1, 2, 4, 4, dtype=torch.float64), torch.randn(1, 2, 3, dtype=torch.float64)
    collapsed = MotifMHC.collapse(x, h_pre)
    combined = MotifMHC.combine(x, h_res, h_post, out)
    for t in range(2):
        torch.testing.assert_close(collapsed[0, t], sum(h_pre[0, t, e] * x[0, t, e] for e in range(4)))
        for i in range(4):
            want = sum(h_res[0, t, i, j] * x[0, t, j] for j in range(4)) + h_post[0, t, i] * out[0, t]
            torch.testing.assert_close(combined[0, t, i], want)


def test_every_trained_parameter_gets_a_gradient(all_on):
    """The re-statement is differentiable end to end (the gradient checks of the JAX port read these)."""
    all_on.zero_grad()
    logits = all_on(TOKENS).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), TOKENS[:, 1:].reshape(-1)).backward()
    try:
        for name, param in all_on.named_parameters():
            if name.endswith("moe.expert_bias"):  # selection only: no gradient, as in training (a load-balance bias)
                assert not param.requires_grad and param.grad is None, name
            else:
                assert param.grad is not None and torch.isfinite(param.grad).all(), name
                assert param.grad.abs().max() > 0, name
    finally:
        all_on.zero_grad()
