"""The train state, created already sharded, and the train and eval steps jitted with explicit shardings.

State: {PARAMS: pure dict, OPT_STATE: optax state, STEP: int32, RNG: uint32 key data} (diffjax.state_layout).
With LoRA (diffjax.lora; `sharded_lora_init`) PARAMS holds only what trains ({"lora": adapters, "base": the
base params that train too}) and the state adds BASE_CHECKSUMS; the frozen base is not in the state (so neither
in the optimizer state nor in checkpoints): the steps take it as an extra argument and run the model with
lora.model_params(params, frozen).
A step's batch is [accum_steps, micro_batch, seq_len] per key (without "segment_ids": one document per row, and
the attention gets no segment ids); micro-batches are summed in a scan
and the loss is the token-weighted mean over all of them, so accumulation equals one big batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import lora, sharding
from diffjax.config import ModelConfig
from diffjax.losses import chunked_loss_sum_and_count, loss_sum_and_count, next_token_targets
from diffjax.model import TransformerLM, facets, layer_outputs
from diffjax.ops.context_parallel import context_size, to_context_order
from diffjax.state_layout import BASE_CHECKSUMS, OPT_STATE, PARAMS, RNG, STEP
from diffjax.train import guard
from diffjax.train.mesh import check_model_fits_mesh


def init_state(model, tx: optax.GradientTransformation, key: jax.Array) -> dict:
    return fresh_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)), tx, key)


def fresh_state(params: dict, tx: optax.GradientTransformation, key: jax.Array) -> dict:
    """The train state at step 0 (diffjax.state_layout) of `params` (with LoRA: what trains)."""
    return {PARAMS: params, OPT_STATE: tx.init(params), STEP: jnp.zeros((), jnp.int32), RNG: jax.random.key_data(key)}


# train.loss_chunk None ("auto"): the loss runs in chunks of this many tokens when the vocabulary has at least
# AUTO_LOSS_CHUNK_MIN_VOCAB entries. At the paper's 100,288 a chunk's float32 logits are 1.5 GiB, where a
# whole 8 x 4096 micro-batch's would be 12 GiB (and its gradient as much again).
AUTO_LOSS_CHUNK_TOKENS = 4096
AUTO_LOSS_CHUNK_MIN_VOCAB = 32768


def resolve_loss_chunk(loss_chunk: int | None, vocab_size: int) -> int:
    """Tokens per loss chunk (0: the whole [B, T, V] logits at once) for train.loss_chunk (None: auto)."""
    if loss_chunk is None:
        return AUTO_LOSS_CHUNK_TOKENS if vocab_size >= AUTO_LOSS_CHUNK_MIN_VOCAB else 0
    return loss_chunk


def _forward(graphdef, params, batch, loss_chunk: int, inputs=None, outputs=layer_outputs.NOTHING,
             step_facets=()):
    """(loss sum, target count, the layers' outputs `outputs` asks for (diffjax.model.layer_outputs), the facets'
    loss terms (None: none)): the forward with the named `inputs` and those the facets make of the batch, then the
    facets' losses (`step_facets`; their outputs kept past them: facets.added_losses). Targets and weights are stated
    per position first, so that under a context axis every [B, T] array can be put in the context layout
    (ops.context_parallel) together."""
    model = nnx.merge(graphdef, params)
    targets_BT, weights_BT = next_token_targets(batch["tokens"], batch.get("segment_ids"), batch.get("loss_mask"))
    context = context_size()
    tokens_BT, positions_BT, segment_ids_BT, targets_BT, weights_BT = (
        None if x is None else to_context_order(x, context)
        for x in (batch["tokens"], batch["positions"], batch.get("segment_ids"), targets_BT, weights_BT))
    inputs = {**(inputs or {}), **facets.batch_inputs(step_facets, batch)}
    hidden_BTD, _, emitted = model.hidden_states(tokens_BT, positions_BT, segment_ids_BT, outputs=outputs,
                                                 inputs=inputs)
    loss_sum, count = _loss(model, hidden_BTD, targets_BT, weights_BT, loss_chunk)
    added, emitted = facets.added_losses(step_facets, emitted, batch,
                                         lambda h_BTD, t_BT, w_BT: _loss(model, h_BTD, t_BT, w_BT, loss_chunk))
    return loss_sum, count, emitted, added


def _loss(model, hidden_BTD, targets_BT, weights_BT, loss_chunk: int):
    """(loss sum, target count) of the head's logits of final hidden states, in chunks of loss_chunk tokens (0: at
    once)."""
    if loss_chunk:
        return chunked_loss_sum_and_count(hidden_BTD, model.head(hidden_BTD.dtype), targets_BT, weights_BT, loss_chunk)
    return loss_sum_and_count(model.logits(hidden_BTD), targets_BT, weights_BT)


def _model_params(params, frozen, lora_config: lora.LoraConfig | None):
    """The params the model runs with: the state's own, or with LoRA the frozen base merged with them."""
    return params if lora_config is None else lora.model_params(params, frozen, lora_config)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, model_config: ModelConfig,
                    mesh: Mesh | None = None, on_nonfinite: str = "stop", loss_chunk: int | None = None, run=None,
                    lora_config: lora.LoraConfig | None = None):
    """step(state, batch) -> (state, metrics); jit it with the state donated. With a mesh, the model's
    activations are constrained by the logical-axis rules. metrics["ok"]: the step was finite; with
    on_nonfinite="skip" a step that was not leaves params and optimizer state unchanged (guard.py).
    loss_chunk: tokens per chunk of the loss (train.loss_chunk; None: resolve_loss_chunk's auto).
    run: the run's config (diffjax.train.config.RunConfig), for the facets that read their kind's run settings.
    lora_config: LoRA on (state["params"] the trainable part): step(state, batch, frozen), frozen the rest of the base.
    The facets of the model's rows (diffjax.model.facets) add to each step: their inputs of the forward (logged as
    metrics when they are the step's), their loss terms, and the layer outputs they ask for, collected over the
    micro-batches; then each facet's check, update after the optimizer's (not under LoRA) and metrics run."""
    loss_chunk = resolve_loss_chunk(loss_chunk, model_config.vocab_size)
    step_facets = facets.model_facets(model_config, run)
    request = layer_outputs.Request(facets.output_names(step_facets))

    def train_step(state, batch, frozen=None):
        with sharding.activation_sharding(mesh):
            return _train_step(state, batch, frozen)

    def _train_step(state, batch, frozen):
        params = state[PARAMS]
        inputs = facets.step_inputs(step_facets, state[STEP])

        def loss_and_aux(p, micro):
            loss_sum, count, outputs, added = _forward(graphdef, _model_params(p, frozen, lora_config), micro,
                                                       loss_chunk, inputs, request, step_facets)
            return loss_sum if added is None else loss_sum + added, (loss_sum, count, outputs)

        grad_fn = jax.value_and_grad(loss_and_aux, has_aux=True)

        def accumulate(carry, micro):
            grads_sum, loss_sum, count = carry
            (_, (micro_loss, micro_count, outputs)), grads = grad_fn(params, micro)
            grads_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_sum, grads)
            return (grads_sum, loss_sum + micro_loss, count + micro_count), outputs

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads_sum, loss_sum, count), outputs = jax.lax.scan(accumulate, (zeros, jnp.float32(0), jnp.float32(0)), batch)
        outputs = layer_outputs.combine(outputs)  # the step's micro-batches together
        denominator = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads_sum, params)
        updates, opt_state = tx.update(grads, state[OPT_STATE], params)
        new_params = optax.apply_updates(params, updates)
        if lora_config is None:  # (with LoRA the base is frozen)
            for facet in step_facets:
                new_params = facet.after_update(new_params, outputs)
        loss, grad_norm = loss_sum / denominator, optax.tree.norm(grads)
        ok = guard.step_ok(loss, grad_norm, optax.tree.norm(updates))
        for facet in step_facets:
            facet_ok = facet.step_ok(outputs)
            ok = ok if facet_ok is None else ok & facet_ok
        if on_nonfinite == "skip":
            new_params, opt_state = guard.keep_old_if_bad(ok, (new_params, opt_state), (params, state[OPT_STATE]))
        metrics = {"loss": loss, "grad_norm": grad_norm, "ok": ok, "lr": schedule(state[STEP]), "loss_tokens": count}
        for facet in step_facets:
            metrics.update(facet.metrics(outputs, lambda: nnx.merge(graphdef, _model_params(new_params, frozen,
                                                                                           lora_config))))
        metrics.update(inputs)
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state[RNG]))[0])
        new_state = {**state, PARAMS: new_params, OPT_STATE: opt_state, STEP: state[STEP] + 1, RNG: rng}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, mesh: Mesh | None = None, loss_chunk: int = 0, lora_config: lora.LoraConfig | None = None,
                   model_config: ModelConfig | None = None, run=None):
    """eval_step(params, batch[B, T], step=None, frozen=None) -> (loss sum, counted tokens) of the main loss; loss_chunk
    as resolve_loss_chunk gives; step: the optimizer step the model computes as (an int32 scalar: the facets' inputs
    at that step, diffjax.model.facets; None: none, the model as it is); frozen: with LoRA, the frozen base. The facets
    are model_config's with the run's settings (None: none)."""
    step_facets = () if model_config is None else facets.model_facets(model_config, run)

    def eval_step(params, batch, step=None, frozen=None):
        inputs = {} if step is None else facets.step_inputs(step_facets, step)
        with sharding.activation_sharding(mesh):
            return _forward(graphdef, _model_params(params, frozen, lora_config), batch, loss_chunk, inputs)[:2]

    return eval_step


@dataclasses.dataclass
class ShardedTraining:
    """What the loop needs to step a model on a mesh."""

    mesh: Mesh
    graphdef: Any
    state_shardings: dict  # like the state: a NamedSharding per leaf
    step_batch_sharding: NamedSharding  # [accum, batch, T]
    eval_batch_sharding: NamedSharding  # [batch, T]
    unsharded: list  # parameter dims the mesh axes do not divide (kept whole)
    lora: lora.LoraConfig | None = None  # LoRA on: the steps take the frozen base as their last argument
    frozen_shardings: Any = None  # with LoRA: the frozen base's (like the base model's params)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def jit_train_step(self, tx, schedule, model_config: ModelConfig, on_nonfinite: str = "stop",
                       loss_chunk: int | None = None, run=None):
        """Jitted (state, batch) -> (state, metrics), donating the state; with LoRA (state, batch, frozen). run: the
        run's config (make_train_step)."""
        step = make_train_step(self.graphdef, tx, schedule, model_config, self.mesh, on_nonfinite, loss_chunk, run,
                               self.lora)
        frozen = (self.frozen_shardings,) if self.lora is not None else ()
        return jax.jit(step, in_shardings=(self.state_shardings, self.step_batch_sharding, *frozen),
                       out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)

    def jit_eval_step(self, model_config: ModelConfig, loss_chunk: int | None = None, run=None):
        """Jitted (params, batch, step) -> (loss sum, counted tokens); step an int32 scalar (make_eval_step); with
        LoRA (params, batch, step, frozen)."""
        loss_chunk = resolve_loss_chunk(loss_chunk, model_config.vocab_size)
        frozen = (self.frozen_shardings,) if self.lora is not None else ()
        return jax.jit(make_eval_step(self.graphdef, self.mesh, loss_chunk, self.lora, model_config, run),
                       in_shardings=(self.state_shardings[PARAMS], self.eval_batch_sharding, self.replicated, *frozen),
                       out_shardings=self.replicated)


def sharded_init(model_config: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh):
    """(ShardedTraining, init): init(key) is the jitted train-state initializer, writing straight into the
    state's shardings (no device ever holds a full copy of a sharded parameter or optimizer moment).

    The key is an argument, not a constant, so XLA cannot constant-fold the random init (a 1.4B model's
    folded init did not finish compiling in minutes); the layers' init is one vmapped layer, so the program
    does not grow with depth. threefry is partitionable: the same key gives the same params on any mesh.
    """
    check_model_fits_mesh(model_config, mesh)

    def make_state(key):
        return init_state(TransformerLM(model_config, rngs=nnx.Rngs(key)), tx, key)

    abstract_model = nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
    abstract_params = nnx.state(abstract_model, nnx.Param)
    params_shardings = sharding.param_shardings(abstract_params, mesh)
    training = _sharded_training(mesh, abstract_model, jax.eval_shape(make_state, jax.random.key(0)), params_shardings)
    return training, jax.jit(make_state, out_shardings=training.state_shardings)


def _sharded_training(mesh: Mesh, abstract_model, abstract_state: dict, params_shardings, **lora_fields) -> ShardedTraining:
    """The ShardedTraining of a train state: its params as `params_shardings`, the optimizer moments like them, the
    rest (step, rng, LoRA's base checksums) replicated."""
    replicated = NamedSharding(mesh, P())
    state_shardings = {key: jax.tree.map(lambda _: replicated, value) for key, value in abstract_state.items()}
    state_shardings[PARAMS] = params_shardings
    state_shardings[OPT_STATE] = sharding.shardings_like(abstract_state[OPT_STATE], abstract_state[PARAMS],
                                                           params_shardings, mesh)
    return ShardedTraining(
        mesh=mesh,
        graphdef=nnx.graphdef(abstract_model),
        state_shardings=state_shardings,
        step_batch_sharding=sharding.batch_sharding(mesh, 3, batch_axis=1),
        eval_batch_sharding=sharding.batch_sharding(mesh, 2),
        unsharded=sharding.unsharded_dims(nnx.state(abstract_model, nnx.Param), mesh),
        **lora_fields,
    )


def sharded_lora_init(model_config: ModelConfig, lora_config: lora.LoraConfig, tx: optax.GradientTransformation,
                      mesh: Mesh):
    """LoRA's sharded_init: (ShardedTraining, base_target, init). base_target: ShapeDtypeStructs (with the base
    model's shardings) to load the base params onto; init(key, chosen, checksums) the jitted train state of the
    adapters (drawn from `key`) and `chosen` (lora.split_base's trainable base params), with the base's
    lora.checksums, written straight into its shardings. The frozen base is sharded as the base model's params,
    the adapters by lora.adapter_shardings, their optimizer moments like them."""
    check_model_fits_mesh(model_config, mesh)
    abstract_model = nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
    abstract_params = nnx.state(abstract_model, nnx.Param)
    base_shardings = sharding.param_shardings(abstract_params, mesh)
    base_target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               nnx.to_pure_dict(abstract_params), base_shardings)
    specs = lora.kernel_specs(model_config, lora_config)
    lora.check_trainable(base_target, lora_config)
    chosen_shardings, frozen_shardings = lora.split_base(base_shardings, lora_config)
    chosen_target, _ = lora.split_base(base_target, lora_config)
    params_shardings = lora.trainable_params(lora.adapter_shardings(specs, lora_config, mesh), chosen_shardings)

    def make_state(key, chosen, checksums):
        trainable = lora.trainable_params(lora.init_adapters(specs, lora_config, jax.random.fold_in(key, 1)), chosen)
        return {**fresh_state(trainable, tx, key), BASE_CHECKSUMS: checksums}

    abstract_state = jax.eval_shape(make_state, jax.random.key(0), chosen_target, jax.eval_shape(lora.checksums, base_target))
    training = _sharded_training(mesh, abstract_model, abstract_state, params_shardings, lora=lora_config,
                                 frozen_shardings=frozen_shardings)
    return training, base_target, jax.jit(make_state, out_shardings=training.state_shardings)


def setup_sharded_state(model_config: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh: Mesh):
    """(ShardedTraining, state): the train state of `seed`, initialized under jit straight into its shardings."""
    training, init = sharded_init(model_config, tx, mesh)
    return training, init(jax.random.key(seed))
