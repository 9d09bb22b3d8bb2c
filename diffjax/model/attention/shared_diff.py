"""Shared DIFF attention (Cang et al., "Shared DIFF Transformer", arXiv:2501.17900).

Differential attention V1 (same lambda, lambda_init, per-head RMSNorm, (1 - lambda_init), values 2d wide)
whose two query and two key projections share a base matrix and differ by low-rank updates, eqs. (3)-(4):

    W_Q1 = W_Q + W_q11 W_q12^T,   W_Q2 = W_Q + W_q21 W_q22^T      (and the same for K)
    W_Q, W_K: (d_model, n);   W_qi1, W_ki1: (d_model, r);   W_qi2, W_ki2: (n, r)

Our reading of the multi-head form (Section 2.4; the paper has no code): n is a layer's whole query (key)
width, H d (Hkv d), so one base W_Q and one W_K per layer serve all heads, shared by the two maps, and each
map's update is one rank-r product whose (n, r) factor has a d-row slice per head: head h's update is
W_qi1 W_qi2[h]^T, its own, with the (d_model, r) factor shared. This is the reading under which the paper's
"r << d, d_model" holds for its Table 3 ranks (96 at d_model 1536 ... 448 at 5120; per-head factors of those
ranks would exceed d and give the 13.1B row 24B parameters). Kernels:
q_base (D, H, d), k_base (D, Hkv, d); q_down, k_down (D, 2, r); q_up (2, r, H, d), k_up (2, r, Hkv, d).
q = x W_Q + (x W_q_down) W_q_up: no (D, H d) update is ever formed.

Parameter count of the query and key projections: D (H + Hkv) d + 4 D r + 2 r (H + Hkv) d, i.e. with
n = H d = Hkv d: 2 D n + 4 D r + 4 n r. The paper's Section 2.3 count is 2 D n + 2 D r + 2 n r: it counts two
of the four low-rank pairs that eqs. (3)-(4) define (ModelConfig.param_counts follows the equations; tested).

Init (the paper gives none): the base and the down factors N(0, init_std / sqrt 2), the up factors
N(0, 1 / sqrt r), so each map's effective projection W_Q + W_down W_up^T starts with entries of std init_std
(V1's), half of their variance shared between the two maps.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention.diff import DiffAttention
from diffjax.model.layers import normal_param
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain


class SharedDiffAttention(DiffAttention):
    """Shared DIFF attention for the layer at 0-based `depth` (None: a layer of a stack, as DiffAttention).

    Inherits everything from DiffAttention (lambda, constants, the output path) except its parameters and
    the query and key projections (`project`).
    """

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, H, K, d, r = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.attention_options.rank
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.lambda_init = None if depth is None else config.lambda_init_at(depth)
        half = std / math.sqrt(2)
        self.q_base = normal_param(rngs, (D, H, d), half, pdt, ("embed", "heads", "head_dim"))
        self.k_base = normal_param(rngs, (D, K, d), half, pdt, ("embed", "kv_heads", "head_dim"))
        self.q_down = normal_param(rngs, (D, 2, r), half, pdt, ("embed", None, "rank"))
        self.q_up = normal_param(rngs, (2, r, H, d), r**-0.5, pdt, (None, "rank", "heads", "head_dim"))
        self.k_down = normal_param(rngs, (D, 2, r), half, pdt, ("embed", None, "rank"))
        self.k_up = normal_param(rngs, (2, r, K, d), r**-0.5, pdt, (None, "rank", "kv_heads", "head_dim"))
        self.init_values_and_lambda(config, rngs)

    def project(self, x_BTD, rope_cos_sin):
        """(q [B, T, H, 2, d], k [B, S, Hkv, 2, d], v [B, S, Hkv, 2d]) with q and k rotated."""
        dtype, (cos, sin) = x_BTD.dtype, rope_cos_sin

        def shared_plus_low_rank(base, down, up, axes):
            shared_BTNd = jnp.einsum("btD,Dnd->btnd", x_BTD, base[...].astype(dtype))
            low_BT2r = jnp.einsum("btD,DGr->btGr", x_BTD, down[...].astype(dtype))
            update_BTN2d = jnp.einsum("btGr,Grnd->btnGd", low_BT2r, up[...].astype(dtype))
            return constrain(shared_BTNd[:, :, :, None, :] + update_BTN2d, axes)

        q_BTH2d = shared_plus_low_rank(self.q_base, self.q_down, self.q_up, ("batch", "length", "act_heads", None, None))
        k_BSK2d = shared_plus_low_rank(self.k_base, self.k_down, self.k_up, ("batch", "length", "act_kv_heads", None, None))
        v_BSKv = jnp.einsum("bsD,Dkv->bskv", x_BTD, self.v_kernel[...].astype(dtype))
        v_BSKv = constrain(v_BSKv, ("batch", "length", "act_kv_heads", None))
        q_BTH2d = apply_rope(q_BTH2d, cos, sin, self.config.rope_style)
        k_BSK2d = apply_rope(k_BSK2d, cos, sin, self.config.rope_style)
        return q_BTH2d, k_BSK2d, v_BSKv
