"""The training side of a kind: its row's facet (diffjax.kinds.Training.facet), the code the trainer runs for it.

The trainer builds one facet per row the model's layers are built from (`model_facets`) and calls every one; it
names no kind. Each method's default does nothing, so a facet states only what its kind needs:

  outputs                      the layer outputs (diffjax.model.layer_outputs) the train step collects for it
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
  When the mesh is made:
    mesh_problems(mesh_shape)  [one line per problem] with this mesh ({axis: size})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from diffjax import kinds
from diffjax.config import ModelConfig, block_rows
from diffjax.model.layer_outputs import Emitted


class Facet:
    """A kind's training side (module docstring), built with the model's config and the layers built with the kind."""

    outputs: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, layers: tuple[int, ...]):
        self.config, self.layers = config, layers

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

    def mesh_problems(self, mesh_shape: Mapping[str, int]) -> list[str]:
        return []


def model_facets(config: ModelConfig) -> list[Facet]:
    """The facets of the rows `config`'s layers are built from (block_rows' order), each built for its layers."""
    return [kinds.named_class(block.row.name, block.row.training.facet, Facet)(config, block.layers)
            for block in block_rows(config) if block.row.training.facet is not None]


def output_names(facets: list[Facet]) -> frozenset[str]:
    """What the train step asks the layers for."""
    return frozenset(name for facet in facets for name in facet.outputs)
