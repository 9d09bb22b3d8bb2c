"""Motif 3's mixture of experts (mlp_kinds row "moe"): a float32 router, routed experts with their own PolyNorm
(GroupedPolyNorm) and a shared expert (tests/motif3_reference.py's MotifMoE, route, MotifExperts: its choices 6-8).

Dispatch: each token's top_k (token, expert) pairs are sorted by expert and run through jax.lax.ragged_dot (one
group of rows per expert: no capacity, no dropped tokens, the same program whatever the routing), then weighted and
summed back per token. On GPU and TPU jax lowers ragged_dot to XLA's ragged-dot instruction, whose work follows the
rows (N top_k x 3 D expert_inner multiply-adds; its speed there is not measured yet); on CPU jax's generic lowering
computes a masked dense product per expert, num_experts / top_k times that work: exact, for small models only.
With a mesh axis "expert" the experts are split over it and tokens reach them by all-to-all
(diffjax.ops.expert_parallel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.mlp_kinds import MoEOptions, PolyNormOptions
from diffjax.model import layer_outputs
from diffjax.model.layers import normal_param
from diffjax.model.mlp import router
from diffjax.model.mlp.base import MLPModule
from diffjax.model.mlp.polynorm import PolyNormMLP, clamp, coefficients, poly_norm
from diffjax.ops import expert_parallel
from diffjax.sharding import active_mesh, constrain


def route(logits_NE, expert_bias_E, top_k: int, score_func: str, route_norm: bool, route_scale: float):
    """(experts [N, K], weights [N, K] float32) from float32 router logits: top_k of the scores + expert_bias, weights
    from the unbiased scores (vLLM's fused_topk_bias; route_norm divides by their sum without an epsilon)."""
    scores_NE = jax.nn.sigmoid(logits_NE) if score_func == "sigmoid" else jax.nn.softmax(logits_NE, axis=-1)
    choice_NE = scores_NE if expert_bias_E is None else scores_NE + expert_bias_E
    _, experts_NK = jax.lax.top_k(choice_NE, top_k)
    weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=-1)
    if route_norm:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return experts_NK, weights_NK * route_scale


class MoEMLP(MLPModule):
    """Parameters (Motif 3's names, which the HF converter maps by transposes and one split): router_kernel [D, E]
    (router.gate.weight^T), expert_bias [E] (expert_bias; only with options.expert_bias; it only chooses experts, so
    its gradient is zero and optim's default no_decay lists it: with options.load_balance_coeff the trainer moves it
    after each step, router.balanced_expert_bias), expert_gate_kernel and expert_up_kernel [E, D, I] (the two halves
    of experts.gate_up_proj [E, 2I, D], gate first, transposed), expert_down_kernel [E, I, D] (experts.down_proj^T),
    expert_polynorm_weight [E, 3] and expert_polynorm_bias [E, 1] (experts.act_fn.*), and shared_expert, a
    PolyNormMLP (shared_experts.*). The expert matrices' leading axis is the logical "expert"."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        o = self.options = config.mlp_options
        D, E, inner, std, pdt = config.d_model, o.num_experts, o.expert_inner, config.init_std, config.param_dtype
        self.router_kernel = normal_param(rngs, (D, E), std, pdt, ("embed", None))
        if o.expert_bias:
            self.expert_bias = nnx.Param(jnp.zeros((E,), pdt), logical_axes=(None,))
        self.expert_gate_kernel = normal_param(rngs, (E, D, inner), std, pdt, ("expert", "embed", "mlp"))
        self.expert_up_kernel = normal_param(rngs, (E, D, inner), std, pdt, ("expert", "embed", "mlp"))
        self.expert_down_kernel = normal_param(rngs, (E, inner, D), std, pdt, ("expert", "mlp", "embed"))
        self.expert_polynorm_weight = nnx.Param(jnp.full((E, 3), 1 / 3, pdt), logical_axes=("expert", None))
        self.expert_polynorm_bias = nnx.Param(jnp.zeros((E, 1), pdt), logical_axes=("expert", None))
        if o.num_shared_experts:
            shared = PolyNormOptions(o.output_scale, o.sigmoid_weight, o.hidden_clamp)
            self.shared_expert = PolyNormMLP(config, rngs=rngs, inner=o.shared_inner, options=shared)

    def __call__(self, x_BTD):
        o, (B, T, D) = self.options, x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        logits_NE = x_ND.astype(jnp.float32) @ self.router_kernel[...].astype(jnp.float32)
        bias_E = self.expert_bias[...].astype(jnp.float32) if o.expert_bias else None
        experts_NK, weights_NK = route(logits_NE, bias_E, o.top_k, o.score_func, o.route_norm, o.route_scale)
        layer_outputs.emit(router.OUTPUT, lambda: router.routing_stats(logits_NE, bias_E, experts_NK, o.num_experts,
                                                                       o.score_func), "sum")
        out_BTD = self.routed(x_ND, experts_NK, weights_NK).reshape(B, T, D)
        if o.num_shared_experts:
            out_BTD = out_BTD + self.shared_expert(x_BTD)
        return constrain(out_BTD, ("batch", "length", "act_embed"))

    def routed(self, x_ND, experts_NK, weights_NK):
        """sum_k weights[n, k] expert_{experts[n, k]}(x[n]) [N, D]: diffjax.ops.expert_parallel's dispatch, over the
        mesh's expert axis where the active mesh has one."""
        params = {name: getattr(self, name)[...] for name in EXPERT_PARAMS}
        run = functools.partial(run_experts, self.options)
        mesh = active_mesh()
        if expert_parallel.row_axes(mesh, x_ND.shape[0]) is not None:
            return expert_parallel.routed_expert_parallel(run, x_ND, experts_NK, weights_NK, params, mesh)
        return expert_parallel.routed_on_one_device(run, x_ND, experts_NK, weights_NK, params, self.options.num_experts)


EXPERT_PARAMS = ("expert_gate_kernel", "expert_up_kernel", "expert_down_kernel", "expert_polynorm_weight",
                 "expert_polynorm_bias")  # the routed experts' arrays, leading axis "expert"


def run_experts(o: MoEOptions, params: dict, x_RD, expert_R, group_sizes_E):
    """The routed experts on rows sorted by expert [R, D], expert_R each row's expert; each expert's rows one group of
    ragged_dot (rows past sum(group_sizes) come out zero)."""
    dtype = x_RD.dtype
    gate_RI = jax.lax.ragged_dot(x_RD, params["expert_gate_kernel"].astype(dtype), group_sizes_E)
    up_RI = jax.lax.ragged_dot(x_RD, params["expert_up_kernel"].astype(dtype), group_sizes_E)
    hidden_RI = activation(o, params, gate_RI, up_RI, expert_R)
    return jax.lax.ragged_dot(hidden_RI, params["expert_down_kernel"].astype(dtype), group_sizes_E)


def activation(o: MoEOptions, params: dict, gate_RI, up_RI, expert_R):
    """GroupedPolyNorm as Motif 3's CUDA kernel computes it: gate and up clamped, each row's expert's coefficients
    and clamped bias, poly * up in float32, the product clamped, then the output scale."""
    dtype = gate_RI.dtype
    weight_R3 = coefficients(params["expert_polynorm_weight"], o.sigmoid_weight)[expert_R]
    bias_R1 = clamp(params["expert_polynorm_bias"].astype(jnp.float32), o.bias_clamp)[expert_R]
    gate_RI, up_RI = clamp(gate_RI, o.hidden_clamp), clamp(up_RI, o.hidden_clamp)
    poly_RI = poly_norm(gate_RI.astype(jnp.float32), weight_R3, bias_R1)
    hidden_RI = (poly_RI * up_RI.astype(jnp.float32)).astype(dtype)
    return clamp(hidden_RI, o.hidden_clamp) * o.output_scale
