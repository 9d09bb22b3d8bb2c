"""The MLP kinds: the second half of a decoder block, one row each (jax-free; diffjax.kinds says what the tables
share). A kind is a row here plus one module (a subclass of `diffjax.model.mlp.MLPModule`: `__init__(config,
depth=None, *, rngs)` makes its parameters, `__call__(x_BTD) -> y_BTD`). To add one:

    mlp_kinds.register(MLPKind(name="my_mlp", label="My MLP", module="my_package.my_module:MyMLP",
                               params=lambda config: ..., matmul_params=lambda config: ...))

then `ModelConfig(mlp="my_mlp")` trains, resumes, saves and generates like the built-in kind. What the row's
formulas count is checked against the built model (tests/test_block_kinds.py).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from diffjax import kinds

MLPKind = kinds.PartKind  # a row: name, label, module, params, matmul_params, options, training

TABLE: kinds.Table[MLPKind] = kinds.Table("mlp")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names


def _polynorm_params(c) -> int:
    return 4 if c.activation == "polynorm" else 0  # PolyNorm's 3 weights and bias (vectors: in no matmul)


_GATE_UP_DOWN = tuple(kinds.LoraTarget(name, (f"{name}_kernel",)) for name in ("gate", "up", "down"))

register(MLPKind(
    # down(act(x gate) * (x up)): SwiGLU with activation "silu"; Llama's, DiffLlama's and Motif's MLP
    name="gated", label="gated MLP", module="diffjax.model.mlp.gated:GatedMLP",
    params=lambda c: 3 * c.d_model * c.mlp_dim + _polynorm_params(c), matmul_params=lambda c: 3 * c.d_model * c.mlp_dim,
    training=kinds.Training(lora_targets=_GATE_UP_DOWN),
))


# ---- Motif 3's MLPs (tests/motif3_reference.py, its choices 6-8): PolyNorm activations with sigmoid-weighted
# coefficients and an output scale; the dense layers' MLP and the mixture of experts after them.

SCORE_FUNCS = ("sigmoid", "softmax")


def _clamp_problems(options, *names: str) -> list[str]:
    return [f"{name} must be None (off) or > 0, got {getattr(options, name)!r}" for name in names
            if getattr(options, name) is not None and not getattr(options, name) > 0]


@dataclasses.dataclass(frozen=True)
class PolyNormOptions(kinds.Options):
    """Motif 3's dense MLP and shared expert: down(PolyNorm(clamp(x gate)) * clamp(x up) * output_scale), of width
    ModelConfig.mlp_dim. The PolyNorm coefficients pass through a sigmoid when sigmoid_weight (Motif 3's
    polynorm_sigmoid_weight); poly * up in float32; hidden_clamp None (the dense MLP as Motif 3 builds it): no clamp."""

    output_scale: float = 1.0
    """The MLP's output is multiplied by this (Motif 3's polynorm_output_scale)."""
    sigmoid_weight: bool = True
    """The PolyNorm coefficients pass through a sigmoid (Motif 3's polynorm_sigmoid_weight)."""
    hidden_clamp: float | None = None
    """Clamp gate and up to [-c, c]; None: no clamp."""

    def problems(self, config) -> list[str]:
        problems = _clamp_problems(self, "hidden_clamp")
        if not isinstance(self.sigmoid_weight, bool):
            problems.append(f"sigmoid_weight must be true or false, got {self.sigmoid_weight!r}")
        return problems

    def describe(self) -> str:
        clamp = "" if self.hidden_clamp is None else f", clamp {self.hidden_clamp}"
        return f"output scale {self.output_scale}{clamp}"


@dataclasses.dataclass(frozen=True)
class MoEOptions(kinds.Options):
    """Motif 3's mixture of experts: a float32 router scores num_experts routed experts (sigmoid or softmax), each
    token goes to the top_k of score + expert_bias (the bias only chooses: the weights are the unbiased scores,
    divided by their sum if route_norm, times route_scale), each a PolyNorm MLP of width expert_inner with its own
    coefficients (GroupedPolyNorm: gate, up, their product clamped to hidden_clamp, the bias to bias_clamp); plus
    num_shared_experts always-on experts as one PolyNorm MLP of width shared_inner (gate and up clamped, unscaled by
    route_scale). The first dense_first_layers layers use the "polynorm" MLP instead (width mlp_dim, these
    output_scale and sigmoid_weight, no clamp): Motif 3's n_dense_first_layers; the later ones are MoE layers (one in
    moe_layer_step of them: Motif 3's interleave_moe_layer_step, 1 as published)."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Routed experts each token goes to (Motif 3's experts_top_k)."""
    expert_inner: int | None = None
    """Hidden width of one routed expert (moe_intermediate_size); None: mlp_dim."""
    num_shared_experts: int = 0
    """Always-on experts, run as one PolyNorm MLP of width shared_inner."""
    shared_inner: int | None = None
    """Hidden width of the shared experts together; None: expert_inner * num_shared_experts."""
    score_func: str = "softmax"
    """The router's scores: "sigmoid" or "softmax" (computed in float32)."""
    route_norm: bool = False
    """Divide the chosen experts' weights by their sum."""
    route_scale: float = 1.0
    """The routed experts' weights are multiplied by this."""
    expert_bias: bool = False
    """A selection bias added to the scores to choose experts only (load_balance_coeff set); never trained."""
    output_scale: float = 1.0
    """polynorm_output_scale, of the routed and shared experts and the dense layers."""
    sigmoid_weight: bool = True
    """The PolyNorm coefficients pass through a sigmoid (polynorm_sigmoid_weight)."""
    bias_clamp: float | None = None
    """Clamp of the routed experts' PolyNorm bias (polynorm_bias_clamp); None: no clamp."""
    hidden_clamp: float | None = 1000.0
    """Clamp of gate, up and their product; None: no clamps (Motif 3's default when its config omits it: 1000)."""
    dense_first_layers: int = 0
    """The first layers use the dense "polynorm" MLP (Motif 3's n_dense_first_layers)."""
    moe_layer_step: int = 1
    """After the dense first layers, layer i (0-based) is an MoE layer when (i + 1) % step == 0, else dense (Motif 3's
    interleave_moe_layer_step; steps > 1 make many short stacks)."""
    load_balance_coeff: float | None = None
    """The selection bias's step per training step (Motif 3's and torchtitan's load_balance_coeff; needs expert_bias):
    after each step every MoE layer's expert_bias moves by +-coeff toward balanced loads, centred
    (diffjax.model.mlp.router.balanced_expert_bias); None: the bias stays as it is. The step must keep pace with how
    fast training moves the router's scores (Adam: about optim.lr a step): DeepSeek-V3 moves it 1e-3 at lr 2.2e-4,
    motif3/small 1e-2 at 3e-3; too small, and a layer's load can settle on top_k experts (collapse_steps)."""
    collapse_steps: int | None = 10
    """The trainer stops, naming the layer, when an MoE layer's router has chosen the same top_k experts for every
    token of the global batch (the others idle) this many steps in a row, by a margin (equal scores, as an untrained
    router's, are a tie-break, not a collapse); None: never."""

    choices = {"score_func": SCORE_FUNCS}
    # The MLP kind of the layers that are not MoE layers (dense_first_layers, moe_layer_step) and its options
    # (`dense_options`): a mixture of other experts says its own.
    dense_mlp: ClassVar[str] = "polynorm"

    def dense_options(self) -> kinds.Options | None:
        """The dense layers' MLP options: Motif 3's PolyNorm with these output_scale and sigmoid_weight, unclamped."""
        return PolyNormOptions(self.output_scale, self.sigmoid_weight, None)

    def defaults(self, config) -> dict:
        inner = self.expert_inner or config.mlp_dim
        return {"expert_inner": inner, "shared_inner": inner * self.num_shared_experts}

    def problems(self, config) -> list[str]:
        problems = kinds.positive_int_problems(self, "num_experts", "top_k", "expert_inner", "moe_layer_step")
        for name in ("num_shared_experts", "shared_inner", "dense_first_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be an integer >= 0, got {value!r}")
        if not problems and self.top_k > self.num_experts:
            problems.append(f"top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        if not problems and (self.shared_inner > 0) != (self.num_shared_experts > 0):
            problems.append(f"shared_inner ({self.shared_inner}) must be > 0 exactly when num_shared_experts "
                            f"({self.num_shared_experts}) is")
        if not problems and self.dense_first_layers > config.num_layers:
            problems.append(f"dense_first_layers ({self.dense_first_layers}) must be at most num_layers "
                            f"({config.num_layers})")
        problems += [f"{name} must be true or false, got {getattr(self, name)!r}"
                     for name in ("route_norm", "expert_bias", "sigmoid_weight")
                     if not isinstance(getattr(self, name), bool)]
        coeff = self.load_balance_coeff
        if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 < coeff < 1e30):
            problems.append(f"load_balance_coeff must be None (off) or > 0, got {coeff!r}")
        elif coeff is not None and self.expert_bias is not True:
            problems.append(f"load_balance_coeff ({coeff}) needs expert_bias: true (the selection bias it moves)")
        problems += kinds.positive_int_problems(self, "collapse_steps")  # (None: off)
        if not self.route_scale > 0:
            problems.append(f"route_scale must be > 0, got {self.route_scale!r}")
        return problems + _clamp_problems(self, "bias_clamp", "hidden_clamp")

    def describe(self) -> str:
        shared = f" + {self.num_shared_experts} shared" if self.num_shared_experts else ""
        dense = f", {self.dense_first_layers} dense first" if self.dense_first_layers else ""
        return f"top {self.top_k} of {self.num_experts} experts{shared}{dense}"

    def layer_changes(self, config, depth: int) -> dict:
        if depth >= self.dense_first_layers and (depth + 1) % self.moe_layer_step == 0:
            return {}
        return {"mlp": self.dense_mlp, "mlp_options": self.dense_options()}


def _polynorm_mlp_params(c, inner: int) -> int:
    return 3 * c.d_model * inner + 4  # gate, up, down; PolyNorm's 3 coefficients and bias


def _routed_expert_params(c) -> int:
    return _polynorm_mlp_params(c, c.mlp_options.expert_inner)  # one expert's matrices and its own PolyNorm


def _moe_params(c, experts: int) -> int:
    o = c.mlp_options
    shared = _polynorm_mlp_params(c, o.shared_inner) if o.num_shared_experts else 0
    return c.d_model * o.num_experts + o.num_experts * o.expert_bias + experts * _routed_expert_params(c) + shared


def _active_inner(o: MoEOptions) -> int:
    """The hidden width a token's matmuls go through: its top_k routed experts' and the shared experts'."""
    return o.top_k * o.expert_inner + o.shared_inner


register(MLPKind(
    name="polynorm", label="PolyNorm MLP (Motif 3)", module="diffjax.model.mlp.polynorm:PolyNormMLP",
    params=lambda c: _polynorm_mlp_params(c, c.mlp_dim), matmul_params=lambda c: 3 * c.d_model * c.mlp_dim,
    options=PolyNormOptions, training=kinds.Training(lora_targets=_GATE_UP_DOWN),
))
register(MLPKind(
    # params: every expert; matmul_params and active_params: the router, the top_k routed experts and the shared one
    name="moe", label="mixture of PolyNorm experts (Motif 3)", module="diffjax.model.mlp.moe:MoEMLP",
    params=lambda c: _moe_params(c, c.mlp_options.num_experts),
    matmul_params=lambda c: c.d_model * (c.mlp_options.num_experts + 3 * _active_inner(c.mlp_options)),
    active_params=lambda c: _moe_params(c, c.mlp_options.top_k),
    activation_width=lambda c: _active_inner(c.mlp_options),
    expert_share=lambda c: (c.mlp_options.top_k, c.mlp_options.num_experts),
    dispatch_rows=lambda c, shards: shards * min(c.mlp_options.top_k, c.mlp_options.num_experts // shards),
    options=MoEOptions,
    # gate / up / down: the shared expert's; "experts" (only when named): per-expert adapters of the routed experts.
    # expert_bias only selects (no gradient): never decayed; the facet moves it after each step (load_balance_coeff),
    # logs the routers' load and entropy, fails a step on non-finite router logits and stops a collapsed router.
    training=kinds.Training(
        no_decay=(r"expert_bias",), mesh_axes=("expert",), facet="diffjax.model.mlp.router:RouterTraining",
        lora_targets=_GATE_UP_DOWN + (kinds.LoraTarget(
            "experts", ("expert_gate_kernel", "expert_up_kernel", "expert_down_kernel"), grouped=False),)),
))
