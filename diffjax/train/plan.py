"""Does a run fit? Its memory per device on its mesh and a named device, before anything is allocated:
`diffjax-train --plan [--device h100] [--devices N] [--config ...] [key=value ...]` (diffjax/train/cli.py).

Per device, in bytes, from the abstract params (jax.eval_shape: nothing allocated) and diffjax's own sharding rules
(sharding.logical_spec: the spec a parameter really gets on that mesh, a dimension the axes do not divide staying
whole), so a plan for 512 devices needs none of them:
  params       each parameter's shard, in param_dtype (with LoRA: the frozen base, in param_dtype too)
  gradients    one shard-sized gradient per parameter, live through the optimizer update, and one more for the
               accumulator when the step accumulates micro-batches (LoRA: the adapters', left out: a few MB)
  optimizer    AdamW's two moments, in param_dtype as diffjax configures optax
  activations  an estimate for one micro-batch per device: what each layer (of every stack, with what its block
               kind adds: diffjax.block_kinds) keeps for the backward under
               model.remat (full: its input; attention: q, k, v, the attention output and the residual; minimal:
               also the MLP's gate and up; none: everything), one layer's working set while it runs (values and
               gradients), the attention's T x S scores where the route the trainer takes on that device
               (diffjax.ops.choose) materialises them (XLA, not blockwise), the loss's float32 logits and their
               gradient (train.loss_chunk tokens at a time), where the mesh splits the embedding table the table
               gathered whole and its float32 gradient (head_bytes), and over an expert axis the experts' dispatch
               buffers (dispatch_bytes); remat none's and these terms are read from steps compiled for TPUs
               (benchmarks/results/compile_plan.md)
A device's budget is what XLA may allocate on it: on a GPU XLA_PYTHON_CLIENT_MEM_FRACTION of its memory (JAX's
default 0.75: it preallocates that much); on a TPU all of the HBM libtpu gives a program (v5p 95.74 GiB: its compiler
refuses a program over it); on a CPU 90% of the host's memory, shared by its (simulated) devices. The
largest micro-batch that fits is where the estimate, linear in the micro-batch, meets the budget.

Where the running backend is the named device's (a CPU: the mesh's devices simulated, set before jax starts), the
real train step is compiled for the mesh and XLA's memory analysis reported: its arguments are the train state
(params + moments, as planned, to the step counter and the rng key: tested) and the batch; its temporaries what the
activations and gradients estimate stands for (XLA:CPU's buffer assignment, not a GPU's).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from diffjax import block_kinds, mlp_kinds, residual_kinds
from diffjax.config import ModelConfig
from diffjax.hardware import DEVICES, TABLE, GiB
from diffjax.kinds import layer_segments, param_stacks
from diffjax.mesh_axes import MESH_AXES, splitting
from diffjax.ops.choice import choose
from diffjax.sharding import logical_spec
from diffjax.train.batching import plan_batch
from diffjax.train.config import RunConfig
from diffjax.train.mesh import check_model_fits_mesh, mesh_shape
from diffjax.train.step import resolve_loss_chunk

DEVICE_MEMORY = {name: row.memory_bytes for name, row in TABLE.items()}  # None: the host's (a CPU)
DEFAULT_GPU_FRACTION = 0.75  # JAX's preallocation default (XLA_PYTHON_CLIENT_MEM_FRACTION)
TPU_FRACTION = 1.0  # libtpu's figure is already what a program may use: the compiler refuses one over it
CPU_FRACTION = 0.9  # a margin for the host's other work
MAX_MICRO_BATCH = 4096  # the search for the largest micro-batch stops here


class ShapeOnlyMesh:
    """What logical_spec reads of a mesh (its axis sizes)."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = dict(sizes)


def abstract_params(config: ModelConfig):
    """[(dotted path, logical axes, shape, dtype)] of the model's parameters, allocated nowhere."""
    from flax import nnx

    from diffjax.model import TransformerLM

    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    rows = []
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = param.get_metadata().get("logical_axes") or (None,) * len(param.shape)
        rows.append((".".join(map(str, path)), tuple(axes), tuple(param.shape), np.dtype(param.dtype)))
    return rows


def shard_elements(axes, shape, sizes: dict[str, int]) -> int:
    """Elements of one device's shard of a parameter under the rules on a mesh of `sizes`."""
    spec = logical_spec(axes, shape, ShapeOnlyMesh(sizes))
    count = 1
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        count *= dim // math.prod(sizes[name] for name in names)
    return count


def params_bytes(params, sizes: dict[str, int]) -> int:
    """One device's share of the parameters, in bytes (each in its own dtype)."""
    return sum(shard_elements(axes, shape, sizes) * dtype.itemsize for _, axes, shape, dtype in params)


def split_of(logical: str, sizes: dict[str, int]) -> int:
    """How many ways the rules split an activation's logical axis on this mesh (batch, length, act_heads, ...)."""
    return math.prod(sizes.get(axis, 1) for axis in splitting(logical))


@dataclasses.dataclass(frozen=True)
class Budget:
    device: str  # a diffjax.hardware name
    memory_bytes: float  # one device's memory
    fraction: float  # the share a run may allocate
    why: str

    @property
    def bytes(self) -> float:
        return self.memory_bytes * self.fraction


def device_budget(device: str, num_devices: int) -> Budget:
    """What one device of `device` may allocate (a CPU's devices share the host's memory)."""
    if device not in DEVICE_MEMORY:
        from diffjax.config_values import one_of

        raise ValueError(one_of("--device", device, tuple(DEVICE_MEMORY)))
    if device == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Budget(device, host / num_devices, CPU_FRACTION,
                      f"90% of the host's {host / GiB:.1f} GiB shared by {num_devices} device(s)")
    if DEVICES[device].platform == "gpu":
        given = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        fraction = float(given or DEFAULT_GPU_FRACTION)
        return Budget(device, DEVICE_MEMORY[device], fraction, f"{fraction:.0%} of {DEVICE_MEMORY[device] / GiB:.1f} "
                      f"GiB: XLA_PYTHON_CLIENT_MEM_FRACTION{'' if given else ', JAX default'}")
    return Budget(device, DEVICE_MEMORY[device], TPU_FRACTION,
                  f"the {DEVICE_MEMORY[device] / GiB:.2f} GiB of HBM libtpu gives a program")


@dataclasses.dataclass(frozen=True)
class Widths:
    """Per token and layer, in values: the attention projections' (q, k, v after RoPE) and output's widths, the MLP's
    hidden units one token computes, the residual stream; and the train step's attention route."""

    q: int
    k: int
    v: int
    o: int
    mlp: int
    stream: int
    maps_x_heads: int  # T x S score matrices per sequence and layer
    scores: bool  # the route materialises them (XLA, not blockwise)
    route: str
    # the stacks that follow the layers (diffjax.kinds.param_stacks): (layers, their MLP's and stream's widths, what
    # their block kind adds per layer)
    following: tuple[tuple[int, int, int, int], ...] = ()


def widths(config: ModelConfig, seq_len: int, device: str, context: int) -> Widths:
    from diffjax.model.sizes import attention_calls

    _, call = attention_calls(config, seq_len, context)[0]  # the train step's (global layers' where windows mix)
    route = choose(call, config.attention_impl, DEVICES[device])
    q, k, v = call.q_shape, call.k_shape, call.v_shape
    mlp, stream = part_widths(config)
    following = tuple((segment.num_layers, *part_widths(segment.config),
                       block_kinds.get(segment.block).activation_width(config))
                      for segment in param_stacks(config)[len(layer_segments(config)):])
    return Widths(q=math.prod(q[2:]), k=math.prod(k[2:]), v=math.prod(v[2:]), o=q[2] * v[-1], mlp=mlp, stream=stream,
                  maps_x_heads=math.prod(q[2:-1]), scores=route.impl == "xla" and not route.blockwise,
                  route=route.describe(), following=following)


def part_widths(config: ModelConfig) -> tuple[int, int]:
    """(the MLP's, the residual stream's) values per token in a layer of `config`, as their kinds' rows say
    (PartKind.activation_width)."""
    mlp, residual = mlp_kinds.get(config.mlp), residual_kinds.get(config.residual)
    return (mlp.activation_width(config) if mlp.activation_width else config.mlp_dim,
            residual.activation_width(config) if residual.activation_width else config.d_model)


def activation_bytes(config: ModelConfig, w: Widths, sizes: dict[str, int], micro_batch: int, seq_len: int,
                     loss_chunk: int, frozen_head: bool = False) -> dict[str, float]:
    """The activations estimate of one micro-batch per device (the module docstring): {saved, working, scores,
    logits, head, dispatch} in bytes; frozen_head: LoRA's (no gradient for the vocabulary table)."""
    act = np.dtype(config.dtype).itemsize
    tokens = micro_batch * seq_len / split_of("length", sizes)
    heads, mlp, D = split_of("act_heads", sizes), split_of("act_mlp", sizes), config.d_model
    attention = (w.q + w.k + w.v + w.o) / heads

    def working(stream, mlp_width):  # norms, attention out, residual, MLP out; its hidden
        return stream + 4 * D + attention + 3 * mlp_width / mlp

    def saved(stream, mlp_width):  # remat none: what XLA keeps (the 1.4B DIFF's layer scan compiled for TPUs,
        # compile_plan.md): six MLP-hidden arrays, the stream and three more D-wide arrays in bf16 and four in float32,
        # q, k, v, the output and three float32 head-output-wide kernel residuals (DIFF's O_2 and its products)
        return {"full": stream, "attention": stream + attention + D, "minimal": stream + attention + 2 * D
                + 2 * mlp_width / mlp, "none": stream + 11 * D + (w.q + w.k + w.v + 7 * w.o) / heads
                + 6 * mlp_width / mlp}[config.remat]

    # the layers, then the stacks that follow them (their layers' widths and what their block kind adds)
    saved_values = config.num_layers * saved(w.stream, w.mlp) + sum(
        layers * (saved(stream, mlp_width) + added) for layers, mlp_width, stream, added in w.following)
    layers = config.num_layers + sum(following[0] for following in w.following)
    score_bytes = (micro_batch * w.maps_x_heads / heads * seq_len / split_of("length", sizes) * seq_len * 4 * 2
                   if w.scores else 0.0)  # float32 scores and probabilities, per layer
    chunk = tokens if not loss_chunk else min(loss_chunk, tokens)
    return {"saved": tokens * saved_values * act,
            "working": 2 * tokens * working(w.stream, w.mlp) * act,
            "scores": score_bytes * (layers if config.remat == "none" else 2),
            "logits": 2 * chunk * config.vocab_size / split_of("act_vocab", sizes) * 4,
            "head": head_bytes(config, sizes, frozen_head),
            "dispatch": dispatch_bytes(config, sizes, micro_batch, seq_len)}


def head_bytes(config: ModelConfig, sizes: dict[str, int], frozen: bool = False) -> float:
    """The vocabulary-sized arrays a step holds whole where the embedding table is split at rest (fsdp, context,
    expert): the table gathered in the compute dtype and, unless frozen, its float32 gradient, all-reduced whole (two
    float32 copies: the 1.4B DIFF's and Motif 3's steps compiled for TPUs, compile_plan.md)."""
    if split_of("embed", sizes) == 1:
        return 0.0
    per_entry = np.dtype(config.dtype).itemsize + (0 if frozen else 8)
    return config.vocab_size * config.d_model / split_of("vocab", sizes) * per_entry


# Expert parallelism's dense dropless all-to-all (ops/expert_parallel.py) moves [S, C, D] buffers, C = n min(top_k,
# E / S) rows for a device's n tokens: S times the rows it sends on average. While a MoE layer's backward runs, XLA
# holds about DISPATCH_BUFFERS arrays of that size (the send, received, sorted and combined rows and their
# cotangents in bf16, and the scatters' and gathers' uint32 index arrays of the same shape, twice the bytes): fitted
# to Motif 3's step compiled for v5p x 64 at seq 4096 (70.10 GiB of temporaries, benchmarks/results/compile_plan.md).
DISPATCH_BUFFERS = 8.8


def dispatch_bytes(config: ModelConfig, sizes: dict[str, int], micro_batch: int, seq_len: int) -> float:
    """The expert-parallel dispatch buffers (PartKind.dispatch_rows) of one layer per device, every such layer's under
    remat none; 0 without an expert axis."""
    shards = sizes.get("expert", 1)
    tokens = micro_batch * seq_len * split_of("batch", sizes) / math.prod(sizes.values())  # the rows split every axis
    held = []
    for segment in layer_segments(config) if shards > 1 else ():
        rows = mlp_kinds.get(segment.config.mlp).dispatch_rows
        if rows is not None:
            one = DISPATCH_BUFFERS * tokens * rows(segment.config, shards) * config.d_model
            held += [one] * (segment.num_layers if config.remat == "none" else 1)
    per_value = np.dtype(config.dtype).itemsize
    return (sum(held) if config.remat == "none" else max(held, default=0.0)) * per_value


@dataclasses.dataclass
class MemoryPlan:
    """A run's memory per device (bytes) on `budget.device`; see the module docstring."""

    run: RunConfig
    sizes: dict[str, int]  # the mesh
    budget: Budget
    micro_batch: int  # sequences per device per micro-batch
    accum_steps: int
    params: float
    gradients: float
    optimizer: float
    activations: dict[str, float]
    largest_micro_batch: int  # the most sequences per device per micro-batch whose estimate fits (0: none)
    route: str  # the train step's attention route on the device

    @property
    def total(self) -> float:
        return self.params + self.gradients + self.optimizer + sum(self.activations.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget.bytes



def plan_memory(run: RunConfig, device: str, num_devices: int | None = None) -> MemoryPlan:
    """The plan of `run` on its mesh (parallel.*; an axis of -1 fills `num_devices`, default the other axes' product)
    of `device` (a diffjax.hardware name)."""
    fixed = math.prod(size for axis in MESH_AXES if (size := getattr(run.parallel, axis)) != -1)
    sizes = mesh_shape(run.parallel, num_devices or fixed)
    check_model_fits_mesh(run.model, ShapeOnlyMesh(sizes))
    count = math.prod(sizes.values())
    batch = plan_batch(run.global_batch_size, batch_shards=split_of("batch", sizes),
                       micro_batch_per_device=run.train.micro_batch_per_device)
    config, seq_len = run.model, run.data.seq_len
    shard = params_bytes(abstract_params(config), sizes)
    trained = 0 if run.lora.enabled else shard  # LoRA: the adapters' few MB left out
    w = widths(config, seq_len, device, sizes["context"])
    loss_chunk = resolve_loss_chunk(run.train.loss_chunk, config.vocab_size)
    budget, gradients = device_budget(device, count), trained * (2 if batch.accum_steps > 1 else 1)

    def total(micro_batch: int) -> float:
        return shard + gradients + 2 * trained + sum(activation_bytes(config, w, sizes, micro_batch, seq_len,
                                                                      loss_chunk, run.lora.enabled).values())

    largest = 0
    while largest < MAX_MICRO_BATCH and total(largest + 1) <= budget.bytes:
        largest += 1
    mb = batch.micro_batch_per_device
    return MemoryPlan(run, sizes, budget, mb, batch.accum_steps, shard, gradients, 2 * trained,
                      activation_bytes(config, w, sizes, mb, seq_len, loss_chunk, run.lora.enabled), largest, w.route)


def abstract_train_step(run: RunConfig, sizes: dict[str, int], micro_batch: int, devices=None, accum_steps: int = 1):
    """(the jitted real train step, its arguments) for the mesh `sizes` of `devices` (default this machine's), the
    arguments abstract (nothing allocated): the state, `accum_steps` micro-batches of `micro_batch` sequences per batch
    shard, LoRA's frozen base. `step.lower(*arguments).compile()` compiles it."""
    import jax

    from diffjax.train.mesh import ParallelConfig, make_mesh
    from diffjax.train.optimizer import make_optimizer
    from diffjax.train.step import sharded_init, sharded_lora_init

    count = math.prod(sizes.values())
    mesh = make_mesh(ParallelConfig(**sizes), list(jax.devices() if devices is None else devices)[:count])
    tx, schedule = make_optimizer(run.optim, run.train.steps)
    key = jax.random.key(0)  # (eager, on this machine's default device: a target's devices run nothing)
    if run.lora.enabled:
        from diffjax import lora

        training, base, init = sharded_lora_init(run.model, run.lora, tx, mesh)
        chosen, frozen = lora.split_base(base, run.lora)
        abstract = jax.eval_shape(init, key, chosen, jax.eval_shape(lora.checksums, base))
        extra = (frozen,)
    else:
        training, init = sharded_init(run.model, tx, mesh)
        abstract, extra = jax.eval_shape(init, key), ()
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                         training.state_shardings)
    shape = (accum_steps, micro_batch * split_of("batch", sizes), run.data.seq_len)
    tokens = jax.ShapeDtypeStruct(shape, np.int32, sharding=training.step_batch_sharding)
    step = training.jit_train_step(tx, schedule, run.model, loss_chunk=run.train.loss_chunk)
    return step, (state, {"tokens": tokens, "segment_ids": tokens, "positions": tokens}, *extra)


def memory_figures(compiled, batch_bytes: int) -> dict[str, int]:
    """XLA's memory analysis of a compiled step: {arguments, batch, outputs, aliased, temporaries, code} in bytes per
    device (batch: the arguments' token arrays, `batch_bytes`)."""
    memory = compiled.memory_analysis()
    return {"arguments": memory.argument_size_in_bytes, "batch": batch_bytes, "outputs": memory.output_size_in_bytes,
            "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
            "code": memory.generated_code_size_in_bytes}


def compiled_memory(run: RunConfig, sizes: dict[str, int], micro_batch: int) -> dict[str, int]:
    """XLA's memory analysis (memory_figures) of the real train step compiled for the mesh `sizes` of this machine's
    devices, one micro-batch of `micro_batch` sequences per batch shard."""
    step, arguments = abstract_train_step(run, sizes, micro_batch)
    compiled = step.lower(*arguments).compile()
    return memory_figures(compiled, 3 * micro_batch * run.data.seq_len * 4)


def can_compile(plan: MemoryPlan) -> str | None:
    """Why the plan's train step cannot be compiled here, for its device and mesh (None: it can)."""
    import jax

    platform, count = DEVICES[plan.budget.device].platform, math.prod(plan.sizes.values())
    if jax.default_backend() != platform:
        return f"this machine runs {jax.default_backend()}, not {platform}"
    if jax.device_count() < count:
        return f"the mesh needs {count} devices, this machine has {jax.device_count()}"
    return None


def format_size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB" if num_bytes >= GiB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def describe(plan: MemoryPlan, compiled: dict[str, int] | str | None = None) -> str:
    """The plan as lines; `compiled`: compiled_memory's figures, or why there are none."""
    run, sizes, budget = plan.run, plan.sizes, plan.budget
    from diffjax.model.sizes import parameter_counts

    batch = plan_batch(run.global_batch_size, batch_shards=split_of("batch", sizes),
                       micro_batch_per_device=run.train.micro_batch_per_device)
    a, dtype = plan.activations, np.dtype(run.model.param_dtype).name
    total, active = parameter_counts(run.model)
    lines = [f"plan: {run.model.attention} attention, {total:,} parameters" + (f" ({active:,} active per token)"
                                                                                 if active != total else ""),
             f"mesh: {' x '.join(f'{k}={v}' for k, v in sizes.items())} ({math.prod(sizes.values())} {budget.device} "
             f"device(s): {DEVICES[budget.device].kind}, {format_size(budget.memory_bytes)} each)",
             f"batch: {batch.describe(run.data.seq_len)}",
             f"attention in the train step: {plan.route}" + (" (materialises T x S scores)" if a["scores"] else ""),
             "memory per device:",
             f"  params           {format_size(plan.params):>11}  {dtype}"
             + (", the frozen LoRA base" if run.lora.enabled else ", the one copy AdamW updates (no fp32 master "
                "weights: diffjax keeps none)"),
             f"  gradients        {format_size(plan.gradients):>11}"
             + (", and their accumulator" if plan.accum_steps > 1 else ""),
             f"  optimizer state  {format_size(plan.optimizer):>11}  AdamW's two moments, {dtype}",
             f"  activations      {format_size(sum(a.values())):>11}  estimate, remat {run.model.remat}, micro-batch "
             f"{plan.micro_batch}: kept for the backward {format_size(a['saved'])}, one layer's working set "
             f"{format_size(a['working'])}, attention scores {format_size(a['scores'])}, logits "
             f"{format_size(a['logits'])}, the gathered vocabulary table and its gradient {format_size(a['head'])}"
             + (f", expert dispatch buffers {format_size(a['dispatch'])}" if a["dispatch"] else ""),
             f"  total            {format_size(plan.total):>11}  of {format_size(budget.bytes)} ({budget.why}): "
             + ("fits" if plan.fits else "DOES NOT FIT"),
             f"largest micro-batch that fits: {plan.largest_micro_batch} sequences per device "
             f"(train.micro_batch_per_device; this run: {plan.micro_batch})"]
    if isinstance(compiled, dict):
        peak = compiled["arguments"] + compiled["temporaries"] + compiled["outputs"] - compiled["aliased"]
        lines.append(f"compiled train step (XLA:{DEVICES[budget.device].platform}, this machine's devices): arguments "
                     f"{format_size(compiled['arguments'])} (the state "
                     f"{format_size(compiled['arguments'] - compiled['batch'])}, planned "
                     f"{format_size(plan.params + plan.optimizer)}), temporaries "
                     f"{format_size(compiled['temporaries'])} "
                     f"(planned gradients + activations {format_size(plan.gradients + sum(a.values()))}), outputs not "
                     f"aliased {format_size(compiled['outputs'] - compiled['aliased'])}: {format_size(peak)} in all")
    elif compiled:
        lines.append(f"compiled train step: not compiled ({compiled})")
    return "\n".join(lines)
