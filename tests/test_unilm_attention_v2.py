"""diffjax DiffAttentionV2 vs an independent PyTorch re-statement of unilm's V2 module.

The PyTorch module below is written from microsoft/unilm's `Diff-Transformer/Diff-Transformer-V2/
multihead_flashdiffv2.py` (MultiheadFlashDiffV2 with use_diff_v2=True), not from the diffjax code: q_proj to
2h query heads of d, k_proj / v_proj to h_kv heads of d, interleaved RoPE on q and k from caller tables, one
causal flash call over the 2h query heads (query head i uses kv head i // (2h / h_kv)), then
attn[:, :, 0::2] - sigmoid(lambda_proj(x)) * attn[:, :, 1::2] and o_proj. unilm wraps the last step in
torch.compile; this re-statement runs it eagerly (the same math; in bf16 eager PyTorch rounds after each op,
as diffjax's reference path does). RoPE, the flash core and the input helpers are the V1 test's.

Weights come from the PyTorch module's own init (kaiming-uniform Linear) and load into diffjax through
diffjax.convert.unilm.load_unilm_attention, which recognises the V2 keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
nn = torch.nn

from diffjax import ModelConfig  # noqa: E402
from diffjax.convert.unilm import load_unilm_attention, unilm_attention_state_dict  # noqa: E402
from diffjax.model import DiffAttentionV2  # noqa: E402
from diffjax.model.rope import inv_frequencies, rope_tables  # noqa: E402
from diffjax.ops import pallas_gpu  # noqa: E402
from test_unilm_attention import (  # noqa: E402
    BF16_RTOL, FP32_ATOL, THETA, B, T, apply_rotary_interleaved, diffjax_forward, flash_attention, make_input, max_abs,
    to_numpy, unilm_rope_tables,
)


class UnilmFlashDiffV2(nn.Module):
    """MultiheadFlashDiffV2(use_diff_v2=True, d_model, num_heads, num_kv_heads, head_dim)."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.num_q_heads = 2 * num_heads
        self.q_proj = nn.Linear(d_model, self.num_q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.lambda_proj = nn.Linear(d_model, num_heads, bias=False)

    def forward(self, x, cos, sin):
        bsz, tgt_len, _ = x.shape
        q = self.q_proj(x).view(bsz, tgt_len, self.num_q_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, tgt_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, tgt_len, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
        attn = flash_attention(q, k, v, self.num_q_heads // self.num_kv_heads, self.head_dim**-0.5)
        attn = attn[:, :, 0::2] - torch.sigmoid(self.lambda_proj(x)).unsqueeze(-1) * attn[:, :, 1::2]
        return self.o_proj(attn.reshape(bsz, tgt_len, self.num_heads * self.head_dim))


# E, h, h_kv, d: MHA, GQA with 2 and 4 output heads per kv head; d is explicit in V2 (here h d != E).
SHAPES = {"mha": (64, 4, 4, 16), "gqa2": (64, 4, 2, 16), "gqa4": (64, 4, 1, 24)}


def make_v2(shape, *, seed=0):
    torch.manual_seed(seed)
    return UnilmFlashDiffV2(*SHAPES[shape]).eval()


def torch_v2_forward(module, x):
    cos, sin = unilm_rope_tables(T, module.head_dim, THETA, x.dtype)
    with torch.no_grad():
        return module(x, cos, sin)


@pytest.mark.parametrize("shape", [s if s == "gqa2" else pytest.param(s, marks=pytest.mark.slow) for s in SHAPES])
def test_fp32_matches_unilm_v2(shape, measured):
    E, H, Hkv, d = SHAPES[shape]
    module = make_v2(shape, seed=len(shape))
    x = make_input(E)
    expected = torch_v2_forward(module, x).numpy()
    layer = load_unilm_attention(module.state_dict())
    assert isinstance(layer, DiffAttentionV2)
    assert (layer.config.num_heads, layer.config.num_kv_heads, layer.config.head_dim) == (H, Hkv, d)
    err = measured(f"fp32 V2 {shape}: max abs diff", max_abs(diffjax_forward(layer, x.numpy()), expected))
    assert err <= FP32_ATOL


def test_pairs_are_adjacent_heads_of_one_group():
    """The test can fail: pairing query heads across halves (j, j + h), which unilm's README calls wrong,
    gives a different output."""
    E, H, Hkv, d = SHAPES["gqa2"]
    module = make_v2("gqa2")
    x = make_input(E)
    expected = torch_v2_forward(module, x).numpy()
    state = module.state_dict()
    halves = state["q_proj.weight"].view(2, H, d, E).transpose(0, 1).reshape(2 * H * d, E)  # head 2j+g <- g*h + j
    layer = load_unilm_attention({**state, "q_proj.weight": halves})
    assert max_abs(diffjax_forward(layer, x.numpy()), expected) > 1e-2


def test_bf16_matches_unilm_v2(measured):
    E, H, Hkv, d = SHAPES["gqa2"]
    module = make_v2("gqa2", seed=3).to(torch.bfloat16)
    x16 = make_input(E).to(torch.bfloat16)
    expected = torch_v2_forward(module, x16).float().numpy()
    layer = load_unilm_attention(module.state_dict(), dtype="bfloat16")
    assert layer.config.param_dtype == "bfloat16"
    rel = max_abs(diffjax_forward(layer, to_numpy(x16)), expected) / float(np.max(np.abs(expected)))
    assert measured("bf16 V2 gqa2: max abs diff / max |out|", rel, BF16_RTOL) <= BF16_RTOL


@pytest.mark.slow
def test_gradients_match_torch_autograd(measured, shape="gqa2"):
    """d(sum(out * cotangent)) for every parameter (lambda_proj included) and the input, under GQA."""
    E = SHAPES[shape][0]
    module = make_v2(shape, seed=5)
    x = make_input(E).requires_grad_(True)
    cotangent = torch.randn(B, T, E, generator=torch.Generator().manual_seed(7))
    cos, sin = unilm_rope_tables(T, module.head_dim, THETA, x.dtype)
    (module(x, cos, sin) * cotangent).sum().backward()
    expected = {name: p.grad.numpy() for name, p in module.named_parameters()}

    layer = load_unilm_attention(module.state_dict())
    tables = rope_tables(jnp.broadcast_to(jnp.arange(T), (B, T)), inv_frequencies(layer.config), jnp.float32)
    grads, grad_x = nnx.grad(lambda layer, x: jnp.sum(layer(x, tables) * jnp.asarray(cotangent.numpy())), argnums=(0, 1))(
        layer, jnp.asarray(x.detach().numpy())
    )
    nnx.update(layer, grads)  # gradients laid out like the weights: the export gives them unilm's names
    ours = unilm_attention_state_dict(layer)
    assert set(ours) == set(expected)
    worst = max_abs(np.asarray(grad_x), x.grad.numpy()) / np.abs(x.grad.numpy()).max()
    for name, grad in expected.items():
        err = max_abs(ours[name], grad) / np.abs(grad).max()
        assert err <= 1e-4, f"gradient of {name}: max rel err {err:.2e}"
        worst = max(worst, err)
    measured(f"V2 {shape} grad max rel err (params and input)", worst, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_round_trip(dtype):
    module = make_v2("gqa4").to(dtype)
    layer = load_unilm_attention(module.state_dict(), prefix="")
    exported = unilm_attention_state_dict(layer, prefix="layers.2.attn.")
    reloaded = UnilmFlashDiffV2(*SHAPES["gqa4"]).to(dtype)
    reloaded.load_state_dict({k.removeprefix("layers.2.attn."): torch.from_numpy(v.astype(np.float32)).to(dtype)
                              for k, v in exported.items()}, strict=True)
    for key, value in module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


@pytest.mark.slow
def test_pallas_tpu_serves_v2(measured):
    """The fused kernels (Pallas interpret mode on CPU) take V2's call: shared keys (G = 1), dv = d, lambda
    [B, T, h]; output and every gradient equal the XLA reference's, with packed segments."""
    E = SHAPES["gqa2"][0]
    module = make_v2("gqa2", seed=9)
    x = jnp.asarray(make_input(E).numpy())
    segment_ids = jnp.asarray(np.stack([(np.arange(T) >= 10).astype(np.int32), np.zeros(T, np.int32)]))
    tables = rope_tables(jnp.broadcast_to(jnp.arange(T), (B, T)), 1.0 / THETA ** (np.arange(0, 16, 2) / 16), jnp.float32)
    results = {}
    for impl in ("xla", "pallas_tpu"):
        layer = load_unilm_attention(module.state_dict())
        layer.config = layer.config.replace(attention_impl=impl)
        results[impl] = nnx.value_and_grad(lambda layer: jnp.sum(jnp.sin(layer(x, tables, segment_ids))))(layer)
    (loss_x, grads_x), (loss_p, grads_p) = results["xla"], results["pallas_tpu"]
    assert abs(float(loss_p) - float(loss_x)) <= 1e-5 * abs(float(loss_x))
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))),
                                             nnx.to_pure_dict(grads_p), nnx.to_pure_dict(grads_x))))
    assert measured("V2 pallas_tpu vs xla: worst grad rel err", worst, 5e-5) <= 5e-5


def test_pallas_gpu_takes_v2_shapes():
    """The Mosaic GPU kernel's shape check accepts V2's call (G = 1, dv = d, bf16, d 64 or 128); its
    numerics are tested on a GPU (tests/test_ops_pallas_gpu.py covers G = 1 and dv = d)."""
    for d in (64, 128):
        q = jax.ShapeDtypeStruct((2, 256, 4, 2, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, 256, 2, 1, d), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, 256, 2, d), jnp.bfloat16)
        assert pallas_gpu.unsupported(q, k, v) is None


# ------------------------------------------------------------------------------------------------
# variant recognition and bad input


def test_v2_keys_missing_or_unexpected_are_named_for_v2():
    state = make_v2("gqa2").state_dict()
    missing = {k: v for k, v in state.items() if k != "o_proj.weight"}
    with pytest.raises(ValueError, match=r"unilm V2 attention.*missing key 'o_proj\.weight'.*expected shape \(64, 64\)"):
        load_unilm_attention(missing)
    with pytest.raises(ValueError, match=r"unilm V2 attention.*unexpected key 'subln\.weight'"):
        load_unilm_attention({**state, "subln.weight": torch.ones(32)})
    with pytest.raises(ValueError, match=r"unilm V2.*lambda_proj\.weight.*\(num_heads, embed_dim\)"):
        load_unilm_attention({k: v for k, v in state.items() if k != "lambda_proj.weight"})
    with pytest.raises(ValueError, match=r"key 'v_proj\.weight' has shape \(30, 64\); expected shape \(32, 64\)"):
        load_unilm_attention({**state, "v_proj.weight": torch.zeros(30, 64)})
    with pytest.raises(ValueError, match="lambda_init"):
        load_unilm_attention(state, lambda_init=0.5)


def test_v1_keys_still_read_as_v1():
    """A V1 state_dict missing its lambda vectors is still V1 (its out_proj says so) and names them."""
    from test_unilm_attention import UnilmFlashDiff1, make_module

    state = {k: v for k, v in make_module(UnilmFlashDiff1, 64, 2, 2, 0).state_dict().items() if not k.startswith("lambda")}
    with pytest.raises(ValueError, match=r"unilm V1 attention.*missing key 'lambda_q1'"):
        load_unilm_attention(state, depth=0)


def test_heads_must_be_a_multiple_of_kv_heads():
    """h = 3, h_kv = 2: flash-attn would run it (2h % h_kv == 0), but pair 1 = query heads 2 and 3 would use
    kv heads 0 and 1. Refused by the converter and by ModelConfig, with the numbers."""
    torch.manual_seed(0)
    state = UnilmFlashDiffV2(48, 3, 2, 8).state_dict()
    with pytest.raises(ValueError, match=r"num_heads = 3 .* multiple of num_kv_heads = 2"):
        load_unilm_attention(state)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be divisible by num_kv_heads \(2\).*diff_v2"):
        ModelConfig(d_model=48, num_heads=3, num_kv_heads=2, attention="diff_v2")
