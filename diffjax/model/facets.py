"""The training side of a kind: its row's facet (diffjax.kinds.Training.facet), the code the trainer runs for it.

The trainer builds one facet per row the model's stacks are built from (`model_facets`: the parts' rows and the block
kinds', diffjax.block_kinds) and calls every one; it names no kind and no block. Each method's default does nothing,
so a facet states only what its kind needs:

  outputs                      the layer outputs (diffjax.model.layer_outputs) the train step collects for it
  loss_outputs                 the layer outputs its loss reads (asked for too; not kept past the loss)
  run                          the run's config (diffjax.train.config.RunConfig) when a trainer built it, else None:
                               where a facet reads its kind's run settings (DIFF: optim.lambda_warmup_steps)
  In the jitted train and eval steps:
    step_inputs(step)          {name: array}: named inputs of the model's forward (TransformerLM.hidden_states) at
                               optimizer step `step` (an int32 scalar), the same for every micro-batch and for an
                               eval at that step; each is also one of the step's metrics (DIFF's "lambda_scale")
  In the jitted train step, per micro-batch:
    batch_inputs(batch)        {name: array}: inputs of the forward made from a micro-batch ({key: [B, T]} in the
                               data's order; the facet puts them in the forward's layout,
                               diffjax.ops.context_parallel) (the MTP depths' next tokens)
    loss(outputs, batch, score) -> (a float32 loss sum over the micro-batch that joins the main one, {name: Emitted}
                               joining the outputs), or None: nothing added. score(hidden_BTD, targets_BT, weights_BT)
                               -> (loss sum, target count) is the main loss of final hidden states through the LM head
                               (chunked as the trainer's). Every sum is divided by the main loss's target count.
  In the jitted train step (outputs: {name: Emitted}, combined over the step's micro-batches by their reductions):
    step_ok(outputs)           a bool array, ANDed into the step's "ok" (a False step is non-finite), or None
    after_update(params, outputs) -> params, after the optimizer's update (not under LoRA: the base is frozen)
    metrics(outputs, model)    {key: arrays} added to the step's metrics; model() builds the model with the
                               step's new params
  On the host, as each step's metrics are written (host arrays; metrics: the step's whole metrics):
    values(metrics)            {name: float} for metrics.jsonl and TensorBoard's scalars (the step's scalar metrics
                               are written already; its other entries only as facets say)
    histograms(metrics)        {name: array} for TensorBoard
    stop(step, metrics)        why the run must stop now (one line), or None: a guard. Facets are built once per
                               run, so a guard may count steps
    nonfinite_reasons(metrics) what is added to the message of a non-finite stop ("; ...")
    shown(values)              {label: text} the progress display shows beside the loss (values: the step's
                               floats as metrics.jsonl has them)
  When the mesh is made:
    mesh_problems(mesh_shape)  [one line per problem] with this mesh ({axis: size})

A facet serves every layer built with its row (`layers`: the MTP depths' numbered on from num_layers); those layers
share the row's options (ModelConfig refuses an MTP layer that would not), `layer_config` gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from diffjax import kinds
from diffjax.config import ModelConfig, block_rows, stack_config
from diffjax.model.layer_outputs import Emitted


class Facet:
    """A kind's training side (module docstring), built with the model's config and the layers built with the kind
    (and the run's config when a trainer builds it)."""

    outputs: tuple[str, ...] = ()
    loss_outputs: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, layers: tuple[int, ...], run=None):
        self.config, self.layers, self.run = config, layers, run

    @property
    def layer_config(self) -> ModelConfig:
        """The config the facet's layers are built with (their kind's options are this config's)."""
        return stack_config(self.config, self.layers[0])

    def step_inputs(self, step: jax.Array) -> dict:
        return {}

    def batch_inputs(self, batch: Mapping) -> dict:
        return {}

    def loss(self, outputs: Mapping[str, Emitted], batch: Mapping, score: Callable) -> tuple | None:
        return None

    def step_ok(self, outputs: Mapping[str, Emitted]) -> jax.Array | None:
        return None

    def after_update(self, params: dict, outputs: Mapping[str, Emitted]) -> dict:
        return params

    def metrics(self, outputs: Mapping[str, Emitted], model: Callable) -> dict:
        return {}

    def values(self, metrics: Mapping) -> dict[str, float]:
        return {}

    def histograms(self, metrics: Mapping) -> dict:
        return {}

    def stop(self, step: int, metrics: Mapping) -> str | None:
        return None

    def nonfinite_reasons(self, metrics: Mapping) -> str:
        return ""

    def shown(self, values: Mapping[str, float]) -> dict[str, str]:
        return {}

    def mesh_problems(self, mesh_shape: Mapping[str, int]) -> list[str]:
        return []


def model_facets(config: ModelConfig, run=None) -> list[Facet]:
    """The facets of the rows `config`'s stacks are built from (block_rows' order), each built for its layers; run:
    the run's config, for the facets that read their kind's run settings (None outside a trainer)."""
    return [kinds.named_class(block.row.name, block.row.training.facet, Facet)(config, block.layers, run=run)
            for block in block_rows(config) if block.row.training.facet is not None]


def output_names(facets: list[Facet]) -> frozenset[str]:
    """What the train step asks the layers for."""
    return frozenset(name for facet in facets for name in facet.outputs + facet.loss_outputs)


def step_inputs(facets: list[Facet], step) -> dict:
    """The forward's inputs at optimizer step `step` (an int32 scalar) from every facet (they are also metrics)."""
    return {name: value for facet in facets for name, value in facet.step_inputs(step).items()}


def batch_inputs(facets: list[Facet], batch: Mapping) -> dict:
    """The forward's inputs made from a micro-batch by every facet."""
    return {name: value for facet in facets for name, value in facet.batch_inputs(batch).items()}


def added_losses(facets: list[Facet], outputs: Mapping[str, Emitted], batch: Mapping, score: Callable):
    """(the facets' loss terms summed, None when none adds one; the outputs the step keeps: those the facets ask for
    past the loss and those their losses hand back)."""
    total, added = None, {}
    for facet in facets:
        term = facet.loss(outputs, batch, score)
        if term is not None:
            total = term[0] if total is None else total + term[0]
            added.update(term[1])
    kept = {name for facet in facets for name in facet.outputs}
    return total, {**{name: out for name, out in outputs.items() if name in kept}, **added}
