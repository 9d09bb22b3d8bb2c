"""The training side of an MoE router: the statistics each MoE layer's forward hands to the trainer, and the
auxiliary-loss-free selection-bias update (DeepSeek-V3's load balancing as torchtitan implements it).

Statistics leave the forward on the layer output channel (diffjax.model.layer_outputs) as "router": a forward not
asked for them computes none (its program is unchanged). Every statistic is a sum over the call's tokens, so
micro-batches and devices simply add (reduction "sum"). RouterTraining is the MoE row's facet
(diffjax.model.facets): what the trainer does with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.kinds import param_stacks
from diffjax.model.facets import Facet

OUTPUT = "router"  # the name of routing_stats on the layer output channel


TIE = 1e-6  # choice values (scores in [0, 1] plus the bias) this close are a tie: float32 rounding at 1 is 6e-8


def routing_stats(logits_NE, bias_E, experts_NK, num_experts: int, score_func: str) -> dict:
    """One call's routing, summed over its N tokens: "tokens" [E] int32, how many (token, choice) pairs chose each
    expert (torchtitan's tokens_per_expert: every token position counts, padding too); "entropy" float32, the sum
    over tokens of the router distribution's entropy in nats (softmax's probabilities; sigmoid scores divided by
    their sum; log E when uniform); "margin" float32, the sum over tokens of how far the last chosen expert's choice
    value (score + bias) is above the best unchosen one's (0 with top_k = num_experts); "ties" int32, the tokens whose
    margin is within TIE (the choice between them was top_k's tie-break: the lower index); "nonfinite" int32, the
    tokens with a non-finite router logit."""
    logits_NE = jax.lax.stop_gradient(logits_NE)
    if score_func == "sigmoid":
        scores_NE = jax.nn.sigmoid(logits_NE)
        probs_NE = scores_NE / jnp.sum(scores_NE, axis=-1, keepdims=True)
    else:
        probs_NE = scores_NE = jax.nn.softmax(logits_NE, axis=-1)
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
    top_k, N = experts_NK.shape[-1], choice_NE.shape[0]
    margin_N, tied_N = jnp.zeros(N), jnp.zeros(N, bool)  # top_k = num_experts: no expert is left out
    if top_k < num_experts:
        values_NK = jax.lax.top_k(choice_NE, top_k + 1)[0]
        margin_N = values_NK[:, top_k - 1] - values_NK[:, top_k]
        tied_N = margin_N <= TIE
    return {
        "tokens": jnp.bincount(experts_NK.reshape(-1), length=num_experts).astype(jnp.int32),
        "entropy": jnp.sum(jax.scipy.special.entr(probs_NE)),
        "margin": jnp.sum(margin_N),
        "ties": jnp.sum(tied_N).astype(jnp.int32),
        "nonfinite": jnp.sum(~jnp.all(jnp.isfinite(logits_NE), axis=-1)).astype(jnp.int32),
    }


def balanced_expert_bias(bias_LE, tokens_LE, coeff: float):
    """The selection bias after one step's update, per MoE layer (rows) from the tokens each expert got in the step
    (summed over the whole global batch and its micro-batches): torchtitan's auxiliary-loss-free load balancing
    (pytorch/torchtitan, torchtitan/components/optimizer.py, build_optimizers_with_moe_load_balancing's
    _update_expert_bias; Motif 3's config key load_balance_coeff is torchtitan's MoEArgs field):

        delta = coeff * sign(mean(tokens) - tokens);  bias += delta - mean(delta)

    DeepSeek-V3 (arXiv 2412.19437, section 2.1.2; Wang et al., arXiv 2408.15664) adds +-coeff by whether an expert
    is under- or overloaded; torchtitan also centres the step (the bias's mean does not move: only differences
    between experts change a top-k). The bias is stored in its parameter dtype; the update is computed in float32."""
    tokens_LE = tokens_LE.astype(jnp.float32)
    delta_LE = coeff * jnp.sign(jnp.mean(tokens_LE, axis=-1, keepdims=True) - tokens_LE)
    delta_LE = delta_LE - jnp.mean(delta_LE, axis=-1, keepdims=True)
    return (bias_LE.astype(jnp.float32) + delta_LE).astype(bias_LE.dtype)


def rebalance_expert_biases(params: dict, tokens_LE, config, layers: tuple[int, ...], coeff: float) -> dict:
    """params with the expert_bias of every MoE layer (`layers`, in order: tokens_LE's rows, the tokens each expert got
    in the step, summed over the global batch) moved by balanced_expert_bias; each stack of those layers (a segment of
    the layers or the MTP depths': diffjax.kinds.param_stacks) updated whole."""
    params, row = dict(params), 0
    for segment in param_stacks(config):
        if segment.start not in layers:
            continue
        block, tokens_le = params[segment.name], tokens_LE[row:row + segment.num_layers]
        bias_le = balanced_expert_bias(block["mlp"]["expert_bias"], tokens_le, coeff)
        params[segment.name] = {**block, "mlp": {**block["mlp"], "expert_bias": bias_le}}
        row += segment.num_layers
    return params


# ---- metrics["router"] (on device, per MoE layer): "load" [L_moe, E], each expert's share of the step's routed
# (token, choice) pairs over the mean share (1: balanced; DeepSeek's MaxVio is load max - 1), "entropy" [L_moe], the
# mean per-token entropy of the router's distribution in nats (log E: uniform; routing_stats), "margin" [L_moe], the
# mean per-token margin of the last chosen expert over the best unchosen one, "ties" [L_moe], the share of tokens
# whose choice was a tie-break (margin within TIE), and "nonfinite" [L_moe], the tokens with a non-finite router
# logit. metrics.jsonl keeps per layer d (the model's layer index) router/layer_d/load_max, load_min, load_cv (std /
# mean over experts), entropy and margin; TensorBoard also gets the whole load vector of each layer as a histogram.


def router_metrics(router_stats: dict, top_k: int) -> dict:
    """metrics["router"] (above) from a step's summed routing_stats."""
    tokens_LE = router_stats["tokens"].astype(jnp.float32)
    routed_L = jnp.sum(tokens_LE, axis=-1)  # tokens x top_k
    return {"load": tokens_LE * tokens_LE.shape[-1] / routed_L[:, None],
            "entropy": router_stats["entropy"] * top_k / routed_L,
            "margin": router_stats["margin"] * top_k / routed_L,
            "ties": router_stats["ties"] * top_k / routed_L,
            "nonfinite": router_stats["nonfinite"]}


def router_values(router: dict, layers: tuple[int, ...]) -> dict[str, float]:
    """The metrics file's router/layer_d/... values of a step's metrics["router"] (host arrays)."""
    values = {}
    for row, layer in enumerate(layers):
        load_E = np.asarray(router["load"][row], np.float64)
        values.update({f"router/layer_{layer}/load_max": load_E.max(), f"router/layer_{layer}/load_min": load_E.min(),
                       f"router/layer_{layer}/load_cv": load_E.std() / load_E.mean(),
                       f"router/layer_{layer}/entropy": float(router["entropy"][row]),
                       f"router/layer_{layer}/margin": float(router["margin"][row])})
    return values


class RouterTraining(Facet):
    """The MoE's training side: its layers' routing_stats collected each step; after the optimizer update the
    selection biases move toward balance (options.load_balance_coeff; rebalance_expert_biases); metrics["router"]
    and its values and histograms; a step with a non-finite router logit is not ok (the stop names the layer); a
    router that collapsed for options.collapse_steps steps stops the run; parallel.expert must divide num_experts.
    Its layers are every layer built with the MoE (an MoE MTP depth's too: layer num_layers + k - 1)."""

    outputs = (OUTPUT,)

    def __init__(self, config, layers, run=None):
        super().__init__(config, layers, run)
        self.options = self.layer_config.mlp_options
        self.collapsed_since: dict[int, tuple] = {}  # layer -> (first step, experts) of its collapsed stretch

    def step_ok(self, outputs):
        return jnp.all(outputs[OUTPUT].value["nonfinite"] == 0)

    def after_update(self, params, outputs):
        coeff = self.options.load_balance_coeff
        if coeff is None:
            return params
        return rebalance_expert_biases(params, outputs[OUTPUT].value["tokens"], self.config, self.layers, coeff)

    def metrics(self, outputs, model):
        return {"router": router_metrics(outputs[OUTPUT].value, self.options.top_k)}

    def values(self, metrics):
        return router_values(metrics["router"], self.layers)

    def histograms(self, metrics):
        return {f"router/layer_{layer}/load": load_E for layer, load_E in zip(self.layers, metrics["router"]["load"])}

    def nonfinite_reasons(self, metrics):
        """'; the router logits of layer 3 were not finite for 12 tokens' (each such layer), or ''."""
        return "".join(f"; the router logits of layer {layer} were not finite for {count} tokens"
                       for layer, count in zip(self.layers, np.asarray(metrics["router"]["nonfinite"])) if count)

    def stop(self, step, metrics):
        """A collapsed router: one that decided to send every token of the global batch to the same top_k experts (all
        others idle: the layer is a dense MLP of top_k experts) for options.collapse_steps steps in a row (None:
        never). Decided: most tokens' last chosen expert beat the best idle one by more than TIE. A router whose
        choice values tie (an untrained one: equal scores, no bias to part them) is not a collapse, whatever its load:
        top_k's tie-break, not the router, picked the lowest indices, and its first gradient steps part the scores.
        The state is not spoiled (no checkpoint is set aside); the message names the layer and what it saw."""
        o, router = self.options, metrics["router"]
        if o.collapse_steps is None or o.top_k >= o.num_experts:
            return None
        for row, layer in enumerate(self.layers):
            used = tuple(np.flatnonzero(np.asarray(router["load"][row]) > 0).tolist())
            if len(used) > o.top_k or float(router["ties"][row]) > 0.5:
                self.collapsed_since.pop(layer, None)
                continue
            since, experts = self.collapsed_since.get(layer, (step, used))
            if experts != used:  # other experts: a new stretch
                since = step
            self.collapsed_since[layer] = since, used
            if step - since + 1 >= o.collapse_steps:
                steps = f"step {step}" if since == step else f"steps {since}-{step}"
                return (f"the router of layer {layer} collapsed: in {steps} every token went to experts {list(used)} "
                        f"(the other {o.num_experts - len(used)} got none), chosen by a mean score margin of "
                        f"{float(router['margin'][row]):.3g} over the best idle expert (a decided choice, not a tie). "
                        "Set or raise model.mlp_options.load_balance_coeff (with expert_bias: true; the bias must move "
                        "about as fast as optim.lr moves the scores), or lower optim.lr; "
                        "model.mlp_options.collapse_steps=null turns this check off")
        return None

    def mesh_problems(self, mesh_shape):
        expert, experts = mesh_shape.get("expert", 1), self.options.num_experts
        if experts % expert:
            divisors = [n for n in range(1, experts + 1) if experts % n == 0]
            return [f"parallel.expert ({expert}) must divide model.mlp_options.num_experts ({experts}): expert "
                    f"parallelism places whole experts; use parallel.expert in {divisors}"]
        return []
