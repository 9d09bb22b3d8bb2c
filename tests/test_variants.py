"""The attention variants as models: Shared DIFF against a re-statement of the paper's equations and its
parameter count against the paper's, the sharding rules of the new parameters, and train.py runs that
checkpoint, resume and sample, for model.attention diff_v2, shared_diff and gda.
(V2 against unilm's module: tests/test_unilm_attention_v2.py; the kernels under a mesh with V2's per-token
lambda: tests/test_parallel.py.)"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from diffjax import ModelConfig, TransformerLM  # noqa: E402
from diffjax.convert.common import build_module  # noqa: E402
from diffjax.model import SharedDiffAttention  # noqa: E402
from diffjax.sharding import param_shardings  # noqa: E402
from diffjax.train import train  # noqa: E402
from diffjax.train.mesh import ParallelConfig, make_mesh  # noqa: E402
from test_trainer import _config  # noqa: E402
from test_unilm_attention import THETA, apply_rotary_interleaved, diffjax_forward, make_input, max_abs, unilm_rope_tables  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Shared DIFF: the paper's equations written out per head with explicit (D, d) matrices


def shared_diff_restated(params: dict[str, np.ndarray], x, depth: int, eps: float = 1e-5):
    """Section 2 of the paper, one head at a time in PyTorch (fp32): W_Qg of head h = W_Q[:, h] + W_qg1 W_qg2[h]^T
    formed explicitly (eq. 3; K likewise, eq. 4, with GQA kv head h // n_rep), A_g = softmax(Q_g K_g^T / sqrt d)
    causal, lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init, head = (1 - lambda_init) RMSNorm((A1 - lambda A2) V)
    with a (2d,) weight shared by heads, concat, W_O."""
    p = {name: torch.tensor(np.asarray(value, np.float32)) for name, value in params.items()}
    D, H, d = p["q_base"].shape
    n_rep = H // p["k_base"].shape[1]
    cos, sin = unilm_rope_tables(x.shape[1], d, THETA, x.dtype)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = torch.exp((p["lambda_q1"] * p["lambda_k1"]).sum()) - torch.exp((p["lambda_q2"] * p["lambda_k2"]).sum()) + lambda_init
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()

    def rotate(y):  # (B, T, d) through the V1 test's GPT-J rotation of (B, T, n, d)
        return apply_rotary_interleaved(y[:, :, None], cos, sin)[:, :, 0]

    heads = []
    for h in range(H):
        m = h // n_rep
        maps = []
        for g in range(2):
            W_Q = p["q_base"][:, h] + p["q_down"][:, g] @ p["q_up"][g, :, h]
            W_K = p["k_base"][:, m] + p["k_down"][:, g] @ p["k_up"][g, :, m]
            scores = rotate(x @ W_Q) @ rotate(x @ W_K).transpose(1, 2) / math.sqrt(d)
            maps.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
        head = (maps[0] - lam * maps[1]) @ (x @ p["v_kernel"][:, m])
        head = head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + eps) * p["subln_scale"]
        heads.append(head * (1 - lambda_init))
    return torch.cat(heads, dim=-1) @ p["o_kernel"].reshape(H * 2 * d, D)


def test_shared_diff_matches_the_papers_equations(measured):
    config = ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, attention="shared_diff", attention_options={"rank": 3})
    make = lambda: SharedDiffAttention(config, depth=1, rngs=nnx.Rngs(0))  # noqa: E731
    shapes = {name: v.shape for name, v in nnx.to_pure_dict(nnx.state(nnx.eval_shape(make))).items()}
    assert set(shapes) == {"q_base", "k_base", "q_down", "q_up", "k_down", "k_up", "v_kernel", "o_kernel",
                           "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln_scale"}
    rng = np.random.default_rng(3)  # random weights of the init's scales (an eager random init compiles slowly)
    params = {name: rng.normal(size=shape).astype(np.float32) * (0.1 if name.startswith("lambda") else shape[1] ** -0.5 if
              name.endswith("_up") else 0.15) for name, shape in shapes.items()}
    params["subln_scale"] = 1.0 + 0.5 * params["subln_scale"]
    layer = build_module(make, {(name,): value for name, value in params.items()}, np.float32)
    x = make_input(64)
    expected = shared_diff_restated(params, x, depth=1).numpy()
    # The two maps really differ (the low-rank updates are not negligible at init).
    q = np.einsum("btD,DGr,Grhd->bthGd", x.numpy(), params["q_down"], params["q_up"])
    base = np.einsum("btD,Dhd->bthd", x.numpy(), params["q_base"])
    assert np.abs(q[..., 0, :] - q[..., 1, :]).mean() > 0.5 * np.abs(base).mean()
    err = measured("fp32 shared_diff gqa2 depth 1: max abs diff", max_abs(diffjax_forward(layer, x.numpy()), expected))
    assert err <= 2e-5


def test_shared_diff_param_count_is_the_papers_formula_plus_the_key_updates():
    """Section 2.3: the query and key projections of one head take 2 D d + 2 D r + 2 d r parameters (d = the
    projection's width). Eqs. (3)-(4) define four low-rank pairs; that count has two, so our count (the
    equations') is the paper's plus 2 D r + 2 d r. Counted from the module's arrays."""
    D, d, r = 48, 12, 5
    for H, K in ((1, 1), (4, 4), (4, 2)):
        config = ModelConfig(d_model=D, num_layers=1, num_heads=H, num_kv_heads=K, head_dim=d, attention="shared_diff", attention_options={"rank": r})
        layer = nnx.eval_shape(lambda: SharedDiffAttention(config, depth=0, rngs=nnx.Rngs(0)))
        qk = sum(getattr(layer, name).size for name in ("q_base", "k_base", "q_down", "q_up", "k_down", "k_up"))
        if H == K:
            n = H * d  # the paper's d: one head's projection width = the layer's (module docstring)
            assert qk == (2 * D * n + 2 * D * r + 2 * n * r) + (2 * D * r + 2 * n * r)
        assert qk == D * (H + K) * d + 4 * D * r + 2 * r * (H + K) * d
        model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
        assert model.num_params() == config.param_count()


# ------------------------------------------------------------------------------------------------
# sharding and the train step


MODELS = {
    "diff_v2": ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32, attention="diff_v2"),
    "shared_diff": ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                               attention="shared_diff", attention_options={"rank": 4}),
    "gda": ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                       attention="gda", attention_options={"num_noise_heads": 2}),
}
# The new parameters' mesh axes by the rules (embed -> fsdp; heads, kv heads -> tensor; rank, head_dim and the
# stacked layers axis are never split), written out by hand.
EXPECTED_AXES = {
    "diff_v2": {"q_kernel": (None, "fsdp", "tensor", None, None), "k_kernel": (None, "fsdp", "tensor", None),
                "v_kernel": (None, "fsdp", "tensor", None), "o_kernel": (None, "tensor", None, "fsdp"),
                "lambda_kernel": (None, "fsdp", "tensor")},
    "shared_diff": {"q_base": (None, "fsdp", "tensor", None), "k_base": (None, "fsdp", "tensor", None),
                    "q_down": (None, "fsdp", None, None), "k_down": (None, "fsdp", None, None),
                    "q_up": (None, None, None, "tensor", None), "k_up": (None, None, None, "tensor", None),
                    "lambda_q1": (None, None)},
    "gda": {"q_kernel": (None, "fsdp", "tensor", None, None), "k_kernel": (None, "fsdp", "tensor", None, None),
            "o_kernel": (None, "tensor", None, "fsdp")},
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")
@pytest.mark.parametrize("attention", list(MODELS))
def test_new_params_are_sharded_by_the_rules(attention):
    abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(MODELS[attention], rngs=nnx.Rngs(0))), nnx.Param)
    shardings = param_shardings(abstract, make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2)))["blocks"]["attn"]
    for name, axes in EXPECTED_AXES[attention].items():
        assert shardings[name].spec == jax.sharding.PartitionSpec(*axes), name


# ------------------------------------------------------------------------------------------------
# train.py: train, checkpoint, resume, sample


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diff_v2", "shared_diff", "gda"])
def test_variant_trains_resumes_and_samples(attention, tmp_path):
    """Two steps and a checkpoint, then resumed for a third step and the end-of-run sample (~35 s of CPU each,
    mostly compiling init, step, eval and sampling; a mesh is left to the sharding tests: +40 s)."""
    run_dir = tmp_path / attention
    overrides = [f"model.attention={attention}", "model.num_layers=1", "checkpoint.every=2"]
    first = train(_config(run_dir, "train.steps=2", *overrides), log=lambda _: None)
    lines = []
    second = train(_config(run_dir, "train.steps=3", *overrides), log=lines.append)
    assert any(line.startswith("resumed from") and "(step 2)" in line for line in lines), lines
    losses = {**first.losses, **second.losses}
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
    assert second.sample  # the end-of-run sample (generation re-runs the window: no KV cache yet)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    assert ("lambda/layer_0" in train_records[-1]) == (attention != "diff_v2")  # V2's lambda is per token


def test_variants_are_refused_by_the_hf_export():
    from diffjax.convert.common import ConversionError
    from diffjax.convert.export import check_exportable

    for config in (c for c in MODELS.values() if c.attention != "gda"):  # GDA exports to Motif's format (test_motif.py)
        with pytest.raises(ConversionError, match=f"attention={config.attention!r}: Hugging Face has DiffLlama"):
            check_exportable(config)
