"""Compile a run's real train step ahead of time for hardware this machine does not have, and set what XLA assigns
beside the formula plan: `diffjax-train --plan --compile --topology v5p-128 --config ...` (diffjax/train/cli.py).

The step is the trainer's own (diffjax.train.plan.abstract_train_step: the config's mesh, micro-batch and accumulation,
LoRA or full), its state and batch abstract (nothing is allocated), compiled for the topology's devices (TPU: libtpu's
topology, no TPU needed; GPU: XLA's deviceless CUDA target, with JAX's CUDA plugin) with the kernels `auto` picks on
that chip (diffjax.ops.aot). Per device it reports XLA's memory analysis (arguments, outputs, temporaries, generated
code) against the plan and the device's budget (plan.device_budget), the collective bytes of one step by kind
(hlo_collectives), XLA's FLOP count against the plan's (train.metrics, which does not count remat's recompute), the
compile time and the kernels' custom calls. A step that does not fit (libtpu refuses one over its HBM) gets
proposals: smaller micro-batches, a stronger remat, a smaller loss chunk, more devices, each predicted by scaling the
compiled figures with the plan, and the first predicted to fit is compiled to check it.

What a compile proves: the program builds for that chip and how much memory XLA assigns per device. What it does
not: speed (only a timing on the hardware says that).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

from diffjax.config import REMAT_POLICIES
from diffjax.mesh_axes import MESH_AXES
from diffjax.train import plan as planning
from diffjax.train.batching import plan_batch
from diffjax.train.config import RunConfig
from diffjax.train.hlo_collectives import KINDS, collective_bytes
from diffjax.train.plan import format_size
from diffjax.train.topologies import TPU_GENERATIONS, Topology, parse_topology

_KERNEL_CALL = {"tpu": "Mosaic TPU custom calls", "gpu": "Mosaic GPU custom calls"}


@dataclasses.dataclass
class CompiledStep:
    """One compile of a run's train step for a topology (per device; memory None where the compiler refused it)."""

    run: RunConfig
    topology: Topology
    sizes: dict[str, int]
    memory: dict[str, int] | None  # plan.memory_figures
    refused: str | None  # the compiler's out-of-memory line
    required: float | None  # bytes the refusal says the program needs
    flops: float | None  # XLA's cost analysis
    collectives: dict[str, float]
    notes: list[str]
    kernels: dict[str, int]  # the Pallas kernels in the program: calls (diffjax.ops.aot.kernel_calls)
    seconds: float
    hlo: str = ""  # the compiled program's text

    @property
    def total(self) -> float:
        """Bytes per device: arguments, temporaries, outputs that do not reuse an argument's buffer, code."""
        if self.memory is None:
            return self.required or math.inf
        m = self.memory
        return m["arguments"] + m["temporaries"] + m["outputs"] - m["aliased"] + m["code"]


def target(topology: Topology):
    """The diffjax.ops.aot Target of a topology (its devices compile, never run)."""
    from diffjax.ops import aot

    if topology.platform == "tpu":
        return aot.tpu_target(topology.chip, topology.grid_name, topology.num_slices)
    return aot.gpu_target(topology.devices, topology.chip)


def compile_step(run: RunConfig, topology: Topology) -> CompiledStep:
    """The run's train step compiled for `topology` (its mesh: parallel.*, an axis of -1 filling the topology)."""
    from diffjax.ops import aot

    memory = planning.plan_memory(run, topology.chip, topology.devices)
    sizes, batch = memory.sizes, _batch(run, memory.sizes)
    hardware = target(topology)
    step, arguments = planning.abstract_train_step(run, sizes, batch.micro_batch_per_device, hardware.devices,
                                                   batch.accum_steps)
    start = time.perf_counter()
    try:
        with aot.compile_for(hardware):
            compiled = step.lower(*arguments).compile()
    except Exception as error:  # (XlaRuntimeError: its type is jaxlib's, its message the compiler's)
        refusal = _out_of_memory(str(error))
        if refusal is None:
            raise
        return CompiledStep(run, topology, sizes, None, refusal[0], refusal[1], None, dict.fromkeys(KINDS, 0.0), [],
                            {}, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    collectives, notes = collective_bytes(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    kernels = dict(aot.kernel_calls(text))
    batch_bytes = 3 * batch.accum_steps * batch.micro_batch_per_device * run.data.seq_len * 4
    return CompiledStep(run, topology, sizes, planning.memory_figures(compiled, batch_bytes), None, None,
                        (cost or {}).get("flops"), collectives, notes, kernels, seconds, text)


def _batch(run: RunConfig, sizes: dict[str, int]):
    return plan_batch(run.global_batch_size, batch_shards=planning.split_of("batch", sizes),
                      micro_batch_per_device=run.train.micro_batch_per_device)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _out_of_memory(message: str) -> tuple[str, float | None] | None:
    """(the compiler's out-of-memory line, the bytes it says the program needs) of a refusal, None for other
    errors. libtpu: "... HLO temporaries (2.15T) exceeds available HBM (95.74G)" (G: 2^30 bytes, measured)."""
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
        return None
    lines = message.splitlines()
    line = next((text for text in lines if "exceeds available" in text),
                next((text for text in lines if "memory" in text.lower()), lines[0]))
    needed = re.search(r"\(([\d.]+)([KMGT]?)\) exceeds", message)
    return line.strip(), float(needed[1]) * _UNITS[needed[2]] if needed else None


def planned_flops(run: RunConfig, sizes: dict[str, int]) -> float:
    """The plan's FLOPs per device per step (train.metrics: forward + backward, no recompute)."""
    from diffjax.train.metrics import training_flops_per_token

    tokens = run.global_batch_size * run.data.seq_len
    return training_flops_per_token(run.model, run.data.seq_len) * tokens / math.prod(sizes.values())


def loop_turns(run: RunConfig, sizes: dict[str, int]) -> int:
    """Turns of the step's nested loops, micro-batches x layers: what XLA's cost analysis, counting a loop's body
    once, divides the step's FLOPs by."""
    return _batch(run, sizes).accum_steps * run.model.num_layers


def describe(step: CompiledStep, plan: planning.MemoryPlan) -> str:
    """The compiled figures beside the plan's, as lines (what --plan --compile prints after the plan)."""
    budget = plan.budget
    lines = [f"compiled for {step.topology.describe()} in {step.seconds:.0f} s:"]
    if step.memory is None:
        lines.append(f"  DOES NOT FIT: the compiler refused it: {step.refused}")
        return "\n".join(lines)
    m, a = step.memory, plan.activations
    state, planned_state = m["arguments"] - m["batch"], plan.params + plan.optimizer
    lines += [
        "  memory per device   compiled      plan",
        f"  arguments        {format_size(m['arguments']):>11} {format_size(planned_state + m['batch']):>11}"
        f"  the state {format_size(state)} (planned params + moments {format_size(planned_state)}) and the batch",
        f"  temporaries      {format_size(m['temporaries']):>11} {format_size(plan.gradients + sum(a.values())):>11}"
        "  planned: gradients + activations",
        f"  outputs          {format_size(m['outputs'] - m['aliased']):>11}            not written over an argument",
        f"  generated code   {format_size(m['code']):>11}",
        f"  total            {format_size(step.total):>11} {format_size(plan.total):>11}  of "
        f"{format_size(budget.bytes)} ({budget.why}): {'fits' if step.total <= budget.bytes else 'DOES NOT FIT'}",
        "collectives per step and device: "
        + ", ".join(f"{kind} {format_size(step.collectives[kind])}" for kind in KINDS)
        + (f" ({'; '.join(step.notes)})" if step.notes else ""),
    ]
    if step.flops:
        planned, body = planned_flops(step.run, step.sizes), loop_turns(step.run, step.sizes)
        lines.append(f"FLOPs per device: XLA {step.flops:.3g}, counting each loop's body once and nothing inside "
                     f"the Pallas kernels; the plan {planned:.3g} per step, {planned / body:.3g} per layer and "
                     f"micro-batch ({body} turns; it counts no recompute)")
    kernels = ", ".join(f"{name} x {n}" for name, n in step.kernels.items()) or "none"
    lines.append(f"Pallas kernels in the program ({_KERNEL_CALL[step.topology.platform]}): {kernels}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ proposals


@dataclasses.dataclass(frozen=True)
class Proposal:
    overrides: tuple[str, ...]  # key=value over the run's
    topology: Topology
    predicted: float  # bytes per device

    def describe(self) -> str:
        return " ".join(self.overrides + (f"--topology {self.topology.name}",))


def _plan_parts(run: RunConfig, topology: Topology) -> tuple[float, float]:
    plan = planning.plan_memory(run, topology.chip, topology.devices)
    return plan.params + plan.optimizer, plan.gradients + sum(plan.activations.values())


def predict(step: CompiledStep, run: RunConfig, topology: Topology) -> float:
    """Bytes per device of `run` on `topology`, from the compiled step scaled part by part by the plan: the state
    like the plan's params + moments, the rest like its gradients + activations."""
    state, rest = _plan_parts(step.run, step.topology)
    new_state, new_rest = _plan_parts(run, topology)
    if step.memory is None:
        return step.total * (new_state + new_rest) / (state + rest)
    other = step.total - (step.memory["arguments"] - step.memory["batch"])
    return (step.memory["arguments"] - step.memory["batch"]) * new_state / state + other * new_rest / rest


def bigger(topology: Topology) -> Topology | None:
    """The same hardware with twice the devices, as parse_topology builds it (None where it names no slice or GPU
    count it takes)."""
    if topology.platform == "gpu":
        name = f"{topology.chip}x{2 * topology.devices}"
    else:
        slices = f"{topology.num_slices}x" if topology.num_slices > 1 else ""
        name = f"{slices}{topology.chip}-{TPU_GENERATIONS[topology.chip].named_count(2 * topology.devices_per_slice)}"
    try:
        return parse_topology(name)
    except ValueError:
        return None


def proposals(step: CompiledStep, budget: float, load):
    """Changes that make the run fit, each on top of the ones before, ending with the first predicted to fit: halve
    the micro-batch (more accumulation steps), remat one step stronger, halve the loss chunk, double the devices (the
    -1 mesh axis fills them, else fsdp doubles). `load(overrides)`: the run with key=value overrides over its own."""
    run, topology = step.run, step.topology
    levers = []
    micro = _batch(run, step.sizes).micro_batch_per_device
    while micro > 1:
        micro //= 2
        levers.append(f"train.micro_batch_per_device={micro}")
    # (REMAT_POLICIES: each keeps less for the backward than the one before)
    levers += [f"model.remat={name}" for name in REMAT_POLICIES[REMAT_POLICIES.index(run.model.remat) + 1:]]
    if (chunk := planning.resolve_loss_chunk(run.train.loss_chunk, run.model.vocab_size)) > 512:
        levers.append(f"train.loss_chunk={chunk // 2}")
    fills = any(getattr(run.parallel, axis) == -1 for axis in MESH_AXES)
    fsdp, overrides = run.parallel.fsdp, {}
    for lever in levers + [None] * 4:
        if lever is None:  # more devices
            topology = bigger(topology)
            if topology is None:
                return
            if not fills:
                fsdp *= 2
                overrides["parallel.fsdp"] = str(fsdp)
        else:
            key, value = lever.split("=")
            overrides[key] = value
        try:
            changed = load([f"{k}={v}" for k, v in overrides.items()])
            made = Proposal(tuple(f"{k}={v}" for k, v in overrides.items()), topology, predict(step, changed, topology))
        except ValueError:  # (a mesh the model does not divide, a batch the shards do not)
            continue
        yield made, changed
        if made.predicted <= budget:
            return


def missing_compiler(topology: Topology) -> str | None:
    """What to install to compile for `topology` here, in one line (diffjax.ops.aot.missing); None: nothing."""
    from diffjax.ops import aot

    return aot.missing(topology.platform)


def plan_compiled(run: RunConfig, topology: Topology, load, checks: int = 1) -> int:
    """--plan --compile --topology NAME: the plan, the compiled step beside it, and where it does not fit the
    proposals, the first predicted to fit compiled to check it (at most `checks` compiles). `load(overrides)`: the
    run with more key=value overrides. Exit status 0 fits, 1 does not, 2 bad input."""
    import sys

    try:
        plan = planning.plan_memory(run, topology.chip, topology.devices)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(planning.describe(plan))
    if why := missing_compiler(topology):
        print(f"not compiled: {why}")
        return 0 if plan.fits else 1
    step = compile_step(run, topology)
    print(describe(step, plan))
    if step.total <= plan.budget.bytes:
        return 0
    for proposal, changed in proposals(step, plan.budget.bytes, load):
        print(f"proposal: {proposal.describe()}: predicted {format_size(proposal.predicted)} per device")
        if proposal.predicted > plan.budget.bytes or checks == 0:
            continue
        checks -= 1
        checked = compile_step(changed, proposal.topology)
        fits = checked.total <= planning.device_budget(proposal.topology.chip, proposal.topology.devices).bytes
        print(f"  compiled for {proposal.topology.name} in {checked.seconds:.0f} s: {format_size(checked.total)} per "
              "device: " + ("fits" if fits else "does not fit either"))
    return 1
