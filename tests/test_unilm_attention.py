"""diffjax DiffAttention vs an independent PyTorch re-statement of unilm V1 differential attention.

The PyTorch modules below are written from microsoft/unilm's source (`Diff-Transformer/`:
`multihead_flashdiff_1.py`, the recommended module, and `multihead_diffattn.py`, the naive one), not from the
diffjax code: interleaved q/k sub-heads, GPT-J interleaved RoPE from caller-built cos/sin tables, flash GQA
pairing (group g of q head h with group g of kv head h // n_rep), fp32 softmax with scale d^-0.5, value
width 2d, the exp re-parameterization of lambda, lambda_init = 0.8 - 0.6 exp(-0.3 depth), subln RMSNorm(2d)
cast to the input dtype before its weight, x (1 - lambda_init), out_proj. The bf16 path keeps the §2.10
rounding points.

Weights come from the PyTorch modules' own init (kaiming-uniform Linear, lambdas N(0, 0.1)) with a random
non-unit subln weight, and are loaded into diffjax through diffjax.convert.unilm.

Measured (2 CPU cores, torch 2.13 CPU, jax 0.10.2 CPU; B=2, T=24; printed with `pytest -s`): fp32 max abs
diff 2e-7 .. 6e-7 on outputs of max |out| 0.7 .. 2.6 (tolerance 2e-5); bf16 eager: bit-identical to the
PyTorch bf16 run (tolerance: max abs diff / max |out| <= 1e-2, |signed bias| <= 5e-4); bf16 under jit:
~5e-3 relative (1 bf16 ulp; XLA keeps excess precision across fused ops), bias ~1e-4.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from diffjax.convert.unilm import load_unilm_attention, unilm_attention_state_dict, unilm_window_size  # noqa: E402
from diffjax.model.rope import inv_frequencies, rope_tables  # noqa: E402

FP32_ATOL = 2e-5  # unilm flash vs naive: ~1e-5 absolute in fp32
BF16_RTOL = 1e-2  # ~1e-2 relative in bf16 (max abs diff / max |reference|)
BF16_MAX_BIAS = 5e-4  # |signed_bias| in bf16; measured 0 eager and ~1e-4 under jit
THETA = 10000.0
B, T = 2, 24


# ------------------------------------------------------------------------------------------------
# PyTorch re-statement of unilm V1 (from unilm's Diff-Transformer/ source)


class UnilmRMSNorm(nn.Module):
    """unilm rms_norm.RMSNorm: fp32 statistics, cast to the input dtype, then x weight (§2.9)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return y * self.weight if self.weight is not None else y


def unilm_rope_tables(seq_len: int, d: int, theta: float, dtype):
    """The caller's table (standard variant, §2.11): inv_freq_i = theta^(-2i/d), d = sub-head width."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, d/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)  # the rotary kernel wants x.dtype == cos.dtype


def apply_rotary_interleaved(x, cos, sin):
    """GPT-J RoPE on x (B, T, n, hd): channel pair (2i, 2i+1) is the complex number x[2i] + j x[2i+1],
    multiplied by exp(j angle_i). Rotation in fp32, result stored in x's dtype (§2.10.1, §2.11)."""
    assert x.dtype == cos.dtype == sin.dtype
    Bx, Tx, n, hd = x.shape
    pairs = torch.view_as_complex(x.float().reshape(Bx, Tx, n, hd // 2, 2).contiguous())
    rot = torch.complex(cos.float(), sin.float())[None, :Tx, None, :]
    return torch.view_as_real(pairs * rot).reshape(Bx, Tx, n, hd).to(x.dtype)


def flash_attention(q, k, v, n_rep: int, scale: float, window_size=(-1, -1)):
    """What a flash kernel computes with causal=True and GQA: q (B,T,Hq,dq), k (B,S,Hk,dq), v (B,S,Hk,dv).

    window_size: flash-attn's (left, right) (unilm `flashdiff.FlashDiffAttention` passes it through): query i
    (at key position i + S - T) sees keys i + S - T - left .. i + S - T + right, -1 for no bound; right is
    moot under causal.

    q head h uses kv head h // n_rep (repeat_interleave). Scores from fp32 products of the stored
    values, scaled in fp32, softmax in fp32, P rounded to v's dtype, P V accumulated in fp32, output
    in v's dtype (§2.5, §2.7, §2.10.2).
    """
    k = k.repeat_interleave(n_rep, dim=2)
    v = v.repeat_interleave(n_rep, dim=2)
    Tq, S = q.shape[1], k.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    allowed = torch.ones(Tq, S, dtype=torch.bool).tril(S - Tq)
    left = window_size[0]
    if left >= 0:
        allowed &= torch.ones(Tq, S, dtype=torch.bool).triu(S - Tq - left)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhts,bshv->bthv", p.float(), v.float()).to(v.dtype)


def repeat_kv(x, n_rep: int):
    """unilm's repeat_kv on (B, n, S, hd): each head repeated n_rep times consecutively."""
    b, n, s, hd = x.shape
    return x[:, :, None].expand(b, n, n_rep, s, hd).reshape(b, n * n_rep, s, hd)


class UnilmDiffAttnBase(nn.Module):
    """Parameters and constructor shared by unilm's three V1 classes (§2.2, §2.3)."""

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads=None, subln_affine=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.n_rep = self.num_heads // self.num_kv_heads
        self.head_dim = embed_dim // num_heads // 2
        self.scaling = self.head_dim**-0.5
        d = self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.subln = UnilmRMSNorm(2 * d, eps=1e-5, elementwise_affine=subln_affine)

    def project_and_rotate(self, x, cos, sin):
        bsz, tgt_len, _ = x.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(bsz, tgt_len, 2 * H, d)
        k = self.k_proj(x).view(bsz, tgt_len, 2 * K, d)
        v = self.v_proj(x).view(bsz, tgt_len, K, 2 * d)
        return apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin), v

    def lambda_full(self, like):
        # §2.10.3: product and sum in the parameter dtype, .float(), exp in fp32, cast to the activation dtype.
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float()).type_as(like)
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float()).type_as(like)
        return lambda_1 - lambda_2 + self.lambda_init


class UnilmFlashDiff1(UnilmDiffAttnBase):
    """multihead_flashdiff_1.MultiheadFlashDiff1 (recommended; the canonical semantics, §2.5). window_size: as
    flashdiff.FlashDiffAttention takes it (flash-attn's (left, right); (-1, -1) none)."""

    window_size = (-1, -1)

    def forward(self, x, cos, sin):
        bsz, tgt_len, _ = x.shape
        H, K, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.project_and_rotate(x, cos, sin)
        q = q.reshape(bsz, tgt_len, H, 2, d)
        k = k.reshape(bsz, tgt_len, K, 2, d)
        q1, q2 = q[:, :, :, 0], q[:, :, :, 1]
        k1, k2 = k[:, :, :, 0], k[:, :, :, 1]
        attn1 = flash_attention(q1, k1, v, self.n_rep, self.scaling, self.window_size)
        attn2 = flash_attention(q2, k2, v, self.n_rep, self.scaling, self.window_size)
        attn = attn1 - self.lambda_full(q) * attn2  # (B, T, H, 2d), activation dtype
        attn = self.subln(attn)
        attn = attn * (1 - self.lambda_init)
        return self.out_proj(attn.reshape(bsz, tgt_len, H * 2 * d))


class UnilmNaiveDiffAttn(UnilmDiffAttnBase):
    """multihead_diffattn.MultiheadDiffAttn: q scaled before q k^T, repeat_kv on the interleaved k (§2.6, §2.7)."""

    def forward(self, x, cos, sin):
        bsz, tgt_len, _ = x.shape
        src_len = tgt_len
        H, d = self.num_heads, self.head_dim
        q, k, v = self.project_and_rotate(x, cos, sin)
        offset = src_len - tgt_len
        q = q.transpose(1, 2)  # (B, 2H, T, d)
        k = repeat_kv(k.transpose(1, 2), self.n_rep)  # (B, 2H, S, d): sub-head j meets k sub-head j // n_rep
        v = repeat_kv(v.transpose(1, 2), self.n_rep)  # (B, H, S, 2d)
        q = q * self.scaling
        w = torch.matmul(q, k.transpose(-1, -2))
        mask = torch.triu(torch.zeros(tgt_len, src_len).float().fill_(float("-inf")).type_as(w), 1 + offset)
        w = torch.nan_to_num(w)
        w = w + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        w = w.view(bsz, H, 2, tgt_len, src_len)
        w = w[:, :, 0] - self.lambda_full(q) * w[:, :, 1]
        attn = torch.matmul(w, v)  # (B, H, T, 2d)
        attn = self.subln(attn)
        attn = attn * (1 - self.lambda_init)
        attn = attn.transpose(1, 2).reshape(bsz, tgt_len, H * 2 * d)
        return self.out_proj(attn)


# ------------------------------------------------------------------------------------------------
# helpers


def make_module(cls, E, H, Hkv, depth, *, seed=0, subln_affine=True):
    torch.manual_seed(seed)
    module = cls(E, depth, H, Hkv, subln_affine=subln_affine)
    if subln_affine:
        with torch.no_grad():
            module.subln.weight.copy_(1.0 + 0.5 * torch.randn(module.subln.weight.shape))
    return module.eval()


def make_input(E, *, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, E, generator=g)


def torch_forward(module, x):
    cos, sin = unilm_rope_tables(T, module.head_dim, THETA, x.dtype)
    with torch.no_grad():
        return module(x, cos, sin)


def to_numpy(t):
    """Exact: bf16 goes through fp32 (exact) to ml_dtypes.bfloat16."""
    t = t.detach()
    return t.float().numpy().astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def diffjax_forward(layer, x_np):
    dtype = jnp.asarray(x_np).dtype
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    tables = rope_tables(positions, inv_frequencies(layer.config), dtype)
    return np.asarray(layer(jnp.asarray(x_np), tables)).astype(np.float64)


def max_abs(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def signed_bias(got, expected):
    """Mean error along the sign of the reference, relative to mean |reference|: a systematic scale error."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.sum((got - expected) * np.sign(expected)) / np.sum(np.abs(expected)))


# E, H, Hkv: MHA, GQA n_rep 2 and 4 (d = 16), and MHA with d = 32.
SHAPES = {"mha": (128, 4, 4), "gqa2": (128, 4, 2), "gqa4": (128, 4, 1), "mha_d32": (128, 2, 2)}


# ------------------------------------------------------------------------------------------------
# numerics


def test_flash_restatement_matches_torch_sdpa():
    """Sanity check of the re-statement's attention core against PyTorch's own SDPA (fp32)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, T, 4, 16, generator=g), torch.randn(B, T, 2, 16, generator=g), torch.randn(B, T, 2, 32, generator=g)
    ours = flash_attention(q, k, v, 2, 16**-0.5)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, dim=2).transpose(1, 2), v.repeat_interleave(2, dim=2).transpose(1, 2),
        is_causal=True, scale=16**-0.5,
    ).transpose(1, 2)
    assert max_abs(ours, sdpa) < 1e-5


@pytest.mark.parametrize("depth", [0, 1, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_matches_flashdiff1(shape, depth, measured):
    E, H, Hkv = SHAPES[shape]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, depth, seed=depth)
    x = make_input(E)
    expected = torch_forward(module, x).numpy()
    layer = load_unilm_attention(module.state_dict(), depth=depth)
    assert layer.config.num_heads == H and layer.config.num_kv_heads == Hkv and layer.config.head_dim == E // (2 * H)
    assert layer.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth))
    got = diffjax_forward(layer, x.numpy())
    err = max_abs(got, expected)
    measured(f"fp32 {shape} depth {depth}: max abs diff", err)
    measured(f"fp32 {shape} depth {depth}: max |out|", float(np.max(np.abs(expected))))
    assert err <= FP32_ATOL


@pytest.mark.parametrize("window_size", [(4, 0), (0, 0), (9, 9)])
def test_fp32_matches_flashdiff_with_a_window(window_size, measured):
    """A module run with flashdiff's window_size=(left, right) loads as a layer with attention_window left + 1 that
    computes what it computes (right is moot: causal); without the window the layer computes something else."""
    module = make_module(UnilmFlashDiff1, 128, 4, 2, 1, seed=3)
    module.window_size = window_size
    x = make_input(128)
    expected = torch_forward(module, x).numpy()
    layer = load_unilm_attention(module.state_dict(), depth=1, window_size=window_size)
    assert layer.config.attention_window == window_size[0] + 1
    assert unilm_window_size(layer.config) == (window_size[0], 0)
    err = measured(f"fp32 window_size={window_size}: max abs diff", max_abs(diffjax_forward(layer, x.numpy()), expected))
    assert err <= FP32_ATOL
    assert max_abs(diffjax_forward(load_unilm_attention(module.state_dict(), depth=1), x.numpy()), expected) > 1e-2


def test_fp32_without_subln_weight(measured):
    """A pre-2024-10-25 checkpoint: no subln.weight, so the norm has no weight (diffjax: ones)."""
    E, H, Hkv = SHAPES["gqa2"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 1, subln_affine=False)
    state_dict = module.state_dict()
    assert "subln.weight" not in state_dict
    layer = load_unilm_attention(state_dict, depth=1)
    np.testing.assert_array_equal(np.asarray(layer.subln_scale[...]), np.ones(E // H))
    x = make_input(E)
    err = max_abs(diffjax_forward(layer, x.numpy()), torch_forward(module, x).numpy())
    measured("fp32 gqa2 depth 1 no subln.weight: max abs diff", err)
    assert err <= FP32_ATOL


def test_non_unit_subln_weight_matters():
    """The subln weight really is non-unit and really is used (guards against a test that cannot fail)."""
    E, H, Hkv = SHAPES["mha"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 0)
    state_dict = module.state_dict()
    assert not torch.allclose(state_dict["subln.weight"], torch.ones(E // H))
    x = make_input(E)
    with_weight = diffjax_forward(load_unilm_attention(state_dict, depth=0), x.numpy())
    without = diffjax_forward(load_unilm_attention({k: v for k, v in state_dict.items() if k != "subln.weight"}, depth=0), x.numpy())
    assert max_abs(with_weight, without) > 1e-2


@pytest.mark.parametrize("shape,depth", [("mha", 0), ("gqa2", 1), ("gqa4", 5), ("mha_d32", 1)])
def test_bf16_matches_flashdiff1(shape, depth, measured):
    """Module and inputs cast to bf16 (so lambdas and subln weight are bf16 too)."""
    E, H, Hkv = SHAPES[shape]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, depth, seed=10 + depth)
    x = make_input(E)
    exact = torch_forward(module, x).numpy().astype(np.float64)  # fp32 module, for context
    module = module.to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    expected = torch_forward(module, x16).float().numpy()
    layer = load_unilm_attention(module.state_dict(), depth=depth, dtype="bfloat16")
    assert layer.config.param_dtype == "bfloat16"
    got = diffjax_forward(layer, to_numpy(x16))
    scale = float(np.max(np.abs(expected)))
    rel = max_abs(got, expected) / scale
    torch_vs_fp32 = max_abs(expected, exact) / scale
    jax_vs_fp32 = max_abs(got, exact) / scale
    measured(f"bf16 {shape} depth {depth}: max abs diff / max |out| (diffjax vs torch bf16)", rel)
    measured(f"bf16 {shape} depth {depth}: same, torch bf16 vs torch fp32", torch_vs_fp32)
    measured(f"bf16 {shape} depth {depth}: same, diffjax bf16 vs torch fp32", jax_vs_fp32)
    bias = signed_bias(got, expected)
    measured(f"bf16 {shape} depth {depth}: signed bias (diffjax vs torch bf16)", bias)
    measured(f"bf16 {shape} depth {depth}: fraction of outputs not bit-identical", float(np.mean(got != expected)))
    assert rel <= BF16_RTOL
    # Rounding noise averages out; a systematic scale error does not (rounding the Python float
    # (1 - lambda_init) to bf16 before the multiply gave a bias of 1.3e-3 at depth 0).
    assert abs(bias) <= BF16_MAX_BIAS
    # diffjax in bf16 is no further from the fp32 result than PyTorch's own bf16 run (with slack).
    assert jax_vs_fp32 <= 2 * torch_vs_fp32 + 2e-3


def test_bf16_activations_fp32_params(measured):
    """bf16 checkpoint loaded with float32 parameters (exact widening) and bf16 compute."""
    E, H, Hkv = SHAPES["gqa2"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 1, seed=3).to(torch.bfloat16)
    x16 = make_input(E).to(torch.bfloat16)
    expected = torch_forward(module, x16).float().numpy()
    layer = load_unilm_attention(module.state_dict(), depth=1, dtype="bfloat16", param_dtype="float32")
    assert layer.q_kernel[...].dtype == jnp.float32
    rel = max_abs(diffjax_forward(layer, to_numpy(x16)), expected) / float(np.max(np.abs(expected)))
    measured("bf16 gqa2 depth 1 fp32 params: max abs diff / max |out|", rel)
    assert rel <= BF16_RTOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jit_matches_flashdiff1(dtype, measured):
    """Under jit XLA may keep excess precision between fused bf16 ops (xla_allow_excess_precision), so
    bf16 results differ from eager by rounding noise only."""
    E, H, Hkv = SHAPES["gqa2"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 0, seed=7)
    x = make_input(E)
    if dtype == "bfloat16":
        module, x = module.to(torch.bfloat16), x.to(torch.bfloat16)
    expected = torch_forward(module, x).float().numpy()
    layer = load_unilm_attention(module.state_dict(), depth=0, dtype=dtype)

    @nnx.jit
    def forward(layer, x_BTD):
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        return layer(x_BTD, rope_tables(positions, inv_frequencies(layer.config), x_BTD.dtype))

    got = np.asarray(forward(layer, jnp.asarray(to_numpy(x)))).astype(np.float64)
    err = max_abs(got, expected)
    if dtype == "float32":
        measured("fp32 gqa2 depth 0 jit: max abs diff", err)
        assert err <= FP32_ATOL
    else:
        rel, bias = err / float(np.max(np.abs(expected))), signed_bias(got, expected)
        measured("bf16 gqa2 depth 0 jit: max abs diff / max |out|", rel)
        measured("bf16 gqa2 depth 0 jit: signed bias", bias)
        assert rel <= BF16_RTOL and abs(bias) <= BF16_MAX_BIAS


# ------------------------------------------------------------------------------------------------
# the naive module (§2.6)


def test_naive_module_agrees_for_mha(measured):
    E, H, Hkv = SHAPES["mha"]
    flash = make_module(UnilmFlashDiff1, E, H, Hkv, 1)
    naive = UnilmNaiveDiffAttn(E, 1, H, Hkv)
    naive.load_state_dict(flash.state_dict())  # one state_dict loads into every V1 class
    x = make_input(E)
    got = diffjax_forward(load_unilm_attention(naive.state_dict(), depth=1), x.numpy())
    err_naive = max_abs(got, torch_forward(naive, x).numpy())
    err_torch = max_abs(torch_forward(flash, x).numpy(), torch_forward(naive, x).numpy())
    measured("fp32 naive n_rep 1: max abs diff diffjax vs naive", err_naive)
    measured("fp32 naive n_rep 1: max abs diff flash vs naive (torch)", err_torch)
    assert err_naive <= FP32_ATOL


@pytest.mark.parametrize("shape", ["gqa2", "gqa4"])
def test_naive_module_differs_under_gqa(shape, measured):
    """Known divergence: the naive module's repeat_kv on interleaved k pairs q1 and q2 with other k
    sub-heads when n_rep > 1. diffjax follows the flash pairing."""
    E, H, Hkv = SHAPES[shape]
    flash = make_module(UnilmFlashDiff1, E, H, Hkv, 1)
    naive = UnilmNaiveDiffAttn(E, 1, H, Hkv)
    naive.load_state_dict(flash.state_dict())
    x = make_input(E)
    got = diffjax_forward(load_unilm_attention(flash.state_dict(), depth=1), x.numpy())
    err_flash = max_abs(got, torch_forward(flash, x).numpy())
    err_naive = max_abs(got, torch_forward(naive, x).numpy())
    measured(f"fp32 {shape}: max abs diff diffjax vs flash", err_flash)
    measured(f"fp32 {shape}: max abs diff diffjax vs naive (expected large)", err_naive)
    assert err_flash <= FP32_ATOL
    assert err_naive > 0.05


# ------------------------------------------------------------------------------------------------
# export and round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_round_trip(dtype):
    E, H, Hkv = SHAPES["gqa4"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 2).to(dtype)
    original = {k: to_numpy(v) for k, v in module.state_dict().items()}
    layer = load_unilm_attention(module.state_dict(), depth=2)
    exported = unilm_attention_state_dict(layer)
    assert set(exported) == set(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype, key
        assert exported[key].shape == value.shape, key
        np.testing.assert_array_equal(exported[key].view(np.uint8), value.view(np.uint8), err_msg=key)
    again = unilm_attention_state_dict(load_unilm_attention(exported, depth=2))
    for key, value in exported.items():
        np.testing.assert_array_equal(again[key].view(np.uint8), value.view(np.uint8), err_msg=key)
    # The export loads back into the PyTorch module and reproduces its state exactly.
    reloaded = UnilmFlashDiff1(E, 2, H, Hkv).to(dtype)
    reloaded.load_state_dict({k: torch.from_numpy(v.astype(np.float32)).to(dtype) for k, v in exported.items()})
    for key, value in module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_export_without_subln_gives_ones_and_prefix():
    E, H, Hkv = SHAPES["gqa2"]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 0, subln_affine=False)
    layer = load_unilm_attention(module.state_dict(), depth=0)
    exported = unilm_attention_state_dict(layer, prefix="layers.0.attn.")
    np.testing.assert_array_equal(exported["layers.0.attn.subln.weight"], np.ones(E // H, np.float32))
    assert all(k.startswith("layers.0.attn.") for k in exported)


def test_prefix_picks_one_module(measured):
    E, H, Hkv = SHAPES["gqa2"]
    modules = [make_module(UnilmFlashDiff1, E, H, Hkv, depth, seed=depth) for depth in range(3)]
    big = {"embed_tokens.weight": torch.zeros(10, E), "layers.3.self_attn.q_proj.weight": torch.zeros(E, E)}
    for depth, m in enumerate(modules):
        big.update({f"layers.{depth}.self_attn.{k}": v for k, v in m.state_dict().items()})
        big[f"layers.{depth}.mlp.w1.weight"] = torch.zeros(4, E)
    layer = load_unilm_attention(big, depth=1, prefix="layers.1.self_attn.")
    x = make_input(E)
    err = max_abs(diffjax_forward(layer, x.numpy()), torch_forward(modules[1], x).numpy())
    measured("fp32 gqa2 depth 1 via prefix: max abs diff", err)
    assert err <= FP32_ATOL


# ------------------------------------------------------------------------------------------------
# bad input


def _state_dict():
    E, H, Hkv = SHAPES["gqa2"]  # d = 16, k/v rows 64
    return make_module(UnilmFlashDiff1, E, H, Hkv, 0).state_dict()


@pytest.mark.parametrize("key", ["lambda_k2", "out_proj.weight", "v_proj.weight"])
def test_missing_key(key):
    state_dict = _state_dict()
    expected_shape = tuple(state_dict.pop(key).shape)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        load_unilm_attention(state_dict, depth=0)
    assert "missing" in str(info.value) and str(expected_shape) in str(info.value)


@pytest.mark.parametrize(
    "key,bad_shape",
    [("lambda_q1", (17,)), ("k_proj.weight", (66, 128)), ("out_proj.weight", (128, 126)), ("subln.weight", (16,)),
     ("q_proj.weight", (128, 128, 1))],
)
def test_misshaped_key(key, bad_shape):
    state_dict = _state_dict()
    expected_shape = tuple(state_dict[key].shape)
    state_dict[key] = torch.zeros(bad_shape)
    with pytest.raises(ValueError) as info:
        load_unilm_attention(state_dict, depth=0)
    message = str(info.value)
    assert key in message and str(bad_shape) in message and str(expected_shape) in message, message


@pytest.mark.parametrize("key", ["subln.bias", "rotary.inv_freq", "q_proj.bias"])
def test_unexpected_key(key):
    state_dict = _state_dict()
    state_dict[key] = torch.zeros(32)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        load_unilm_attention(state_dict, depth=0)
    assert "unexpected" in str(info.value)


def test_unexpected_key_under_prefix_only():
    """Keys outside the prefix are ignored; keys inside it that are not unilm's are an error."""
    state_dict = {f"blk.{k}": v for k, v in _state_dict().items()}
    state_dict["other.thing"] = torch.zeros(3)
    load_unilm_attention(state_dict, depth=0, prefix="blk.")
    state_dict["blk.extra"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"blk\.extra"):
        load_unilm_attention(state_dict, depth=0, prefix="blk.")


@pytest.mark.parametrize("shape", ["mha", "gqa2"])
def test_gradients_match_torch_autograd(shape, measured):
    """d(sum(out * cotangent)) for every parameter (subln.weight and the four lambdas included) and the input."""
    E, H, Hkv = SHAPES[shape]
    module = make_module(UnilmFlashDiff1, E, H, Hkv, 2)
    x = make_input(E).requires_grad_(True)
    cotangent = torch.randn(B, T, E, generator=torch.Generator().manual_seed(7))
    cos, sin = unilm_rope_tables(T, module.head_dim, THETA, x.dtype)
    (module(x, cos, sin) * cotangent).sum().backward()
    expected = {name: p.grad.numpy() for name, p in module.named_parameters()}

    layer = load_unilm_attention(module.state_dict(), depth=2)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    tables = rope_tables(positions, inv_frequencies(layer.config), jnp.float32)

    def objective(layer, x_BTD):
        return jnp.sum(layer(x_BTD, tables) * jnp.asarray(cotangent.numpy()))

    grads, grad_x = nnx.grad(objective, argnums=(0, 1))(layer, jnp.asarray(x.detach().numpy()))
    # Gradients re-laid-out exactly like the weights (the export is transposes and reshapes).
    grad_layer = load_unilm_attention(module.state_dict(), depth=2)
    nnx.update(grad_layer, grads)
    ours = unilm_attention_state_dict(grad_layer)
    worst = max_abs(np.asarray(grad_x), x.grad.numpy()) / np.abs(x.grad.numpy()).max()
    for name, grad in expected.items():
        err = max_abs(ours[name], grad) / np.abs(grad).max()
        assert err <= 1e-4, f"gradient of {name}: max rel err {err:.2e}"
        worst = max(worst, err)
    assert set(expected) == set(ours)
    measured("grad max rel err (params and input)", worst, 1e-4)
