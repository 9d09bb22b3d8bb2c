"""Train a Differential Transformer (or its baseline twin) from a config and key=value overrides: `diffjax-train`
(the console script) or `python train.py` in the repository.

    diffjax-train                                     # tiny: a tiny DIFF model, stdlib source, CPU
    diffjax-train --config tiny model.attention=standard model.num_heads=8
    diffjax-train --config paper/diff-1.4b train.run_dir=runs/exp1   # a shipped config by name, or a YAML path
    diffjax-train train.run_dir=runs/exp1 optim.lr=1e-3 train.steps=2000

Rerunning a command on the same train.run_dir resumes from its newest checkpoint. SIGTERM or
Ctrl-C saves a checkpoint of the current step before exiting. Keys: `diffjax-train --help-keys`.

    diffjax-train --plan --device h100 --config paper/diff-1.4b parallel.fsdp=8   # does it fit? (trains nothing)

--plan prints the run's memory per device on its mesh and a device (params, gradients, optimizer state, an
activations estimate), tokens per step, whether it fits and the largest micro-batch that does, and on this machine's
own kind of device (a CPU: the mesh's devices simulated) the compiled train step's memory; exit 0 fits, 1 does not.

    diffjax-train --plan --compile --topology v5p-8 --config paper/diff-1.4b   # compiled for a TPU, here

--plan --compile --topology compiles the real train step for that hardware on this machine (libtpu for TPUs, JAX's
CUDA plugin for GPUs: nothing runs, nothing is allocated) and prints XLA's memory per device beside the plan, the
collectives and FLOPs of a step, and where it does not fit, a change that does, checked by compiling it.

    diffjax-train --routes --device h100 --config paper/diff-1.4b parallel.context=2   # which kernel runs each call

--routes prints how each attention call of the model (the train step's, a generation prefill's and decode step's)
runs on a device and why: the impl `auto` picks in each pass, per query chunk over the context axis or not.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from diffjax import command_line
from diffjax.hardware import TABLE
from diffjax.train.config_files import DEFAULT

DEVICE_NAMES = tuple(TABLE)  # --plan's and --routes' devices (diffjax.hardware: no jax for --help)
DEVICE_GB = {name: row.sold_gb for name, row in TABLE.items() if row.sold_gb}  # their memory as sold


def run(argv=None):
    """`diffjax-train` and `python train.py`: main(), then the process ends without Python's teardown
    (diffjax.command_line.end: a finished run could abort in it); Ctrl-C outside training, a closed output pipe and a
    full disk under the output end it with one line (diffjax.command_line.run). Everything a run opens is closed by
    then (checkpoint saves waited for, metrics files and W&B finished). An unexpected error still raises, with its
    traceback, through the normal exit."""
    command_line.run(main, "diffjax-train", argv, end_process=True)


def main(argv=None) -> int:
    parser = command_line.ArgumentParser(prog="diffjax-train", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT, metavar="NAME_OR_PATH",
                        help=f"a shipped config's name (paper/diff-1.4b, ...) or a YAML file (default: {DEFAULT})")
    parser.add_argument("--help-keys", action="store_true",
                        help="list every config key with the value this run would use, its type, default, "
                             "allowed values and meaning, then exit")
    parser.add_argument("--plan", action="store_true",
                        help="print the run's memory per device and whether it fits --device, then exit (trains nothing)")
    parser.add_argument("--routes", action="store_true",
                        help="print how each attention call of the model runs on --device and why (the impl auto "
                             "picks per pass), then exit")
    parser.add_argument("--device", choices=DEVICE_NAMES,
                        help="with --plan or --routes: the device to plan or route for, one memory size each ("
                             + ", ".join(f"{name} {gb} GB" for name, gb in DEVICE_GB.items())
                             + "; default cpu: this machine's memory)")
    parser.add_argument("--devices", type=command_line.positive_int, metavar="N",
                        help="with --plan: devices in all, for a mesh axis of -1 (default: the other axes' product)")
    parser.add_argument("--compile", action="store_true",
                        help="with --plan --topology: compile the real train step for that hardware on this machine "
                             "and print XLA's memory, collectives and FLOPs per device beside the plan")
    parser.add_argument("--topology", metavar="NAME",
                        help="with --plan --compile: the hardware, as its vendor names it: v5e-8, v5p-128, v6e-256, "
                             "v4-32, 2xv5p-256 (2 slices), h100x8, h100x64, h200x8")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    args = parser.parse_intermixed_args(argv)  # --config may come after the overrides
    _check_together(parser, args)

    from diffjax.train.config import load_run_config  # (no jax: --help-keys loads none)

    try:
        config = load_run_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.help_keys:
        from diffjax.train.keys import describe_keys

        print(describe_keys(config))
        return 0
    if args.routes:
        from diffjax.train.route_preview import describe_routes

        print(describe_routes(config, args.device))
        return 0
    if args.plan and args.topology:
        return _plan_compiled(args, config)
    if args.plan:
        return _plan(config, args.device or "cpu", args.devices)
    from diffjax.log_lines import print_package_logs
    from diffjax.train import train
    from diffjax.train.guard import DivergedError
    from diffjax.train.loop import Interrupted
    from diffjax.train.metrics import MetricsWriteError
    from diffjax.train.state_checkpoints import SaveError

    print_package_logs()  # (train.init_from's reader warns through logging)
    try:
        result = train(config)
    except Interrupted as stopped:
        print(f"{stopped.signal}: stopped (the checkpoints saved so far are intact)", file=sys.stderr)
        return 128 + signal.Signals[stopped.signal].value
    except DivergedError as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except (SaveError, MetricsWriteError) as error:  # a full disk, most often
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        if not getattr(error, "during_setup", False):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.interrupted:
        return 128 + signal.Signals[result.interrupted].value
    return 0


def _plan_compiled(args, config) -> int:
    """--plan --compile --topology: diffjax.train.aot_plan; exit 0 fits, 1 not, 2 bad input."""
    from diffjax.train.config import load_run_config
    from diffjax.train.topologies import parse_topology

    try:
        topology = parse_topology(args.topology)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (before jax starts: a compile for a topology runs nothing)
    from diffjax.train.aot_plan import plan_compiled

    return plan_compiled(config, topology, lambda more: load_run_config(args.config, args.overrides + more))


def _check_together(parser, args) -> None:
    """The options that go only with others (a one-line usage error otherwise)."""
    if args.plan and args.routes:
        parser.error("--plan and --routes are two commands: give one")
    if args.device is not None and not (args.plan or args.routes):
        parser.error("--device goes with --plan or --routes")
    if args.devices is not None and not args.plan:
        parser.error("--devices goes with --plan")
    if (args.compile or args.topology) and not (args.plan and args.compile and args.topology):
        parser.error("--compile and --topology go together, with --plan")
    if args.topology and (args.device or args.devices):
        parser.error("--topology names the device and the device count: drop --device / --devices")


def _plan(config, device: str, devices: int | None) -> int:
    """--plan: the plan, and the compiled step's figures where this machine can compile it; exit 0 fits, 1 not."""
    import math

    from diffjax.train import plan

    try:
        memory = plan.plan_memory(config, device, devices)
    except ValueError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    count = math.prod(memory.sizes.values())
    if device == "cpu" and count > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # simulated CPU devices for the mesh: read when jax starts its backend, which nothing has done yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    compiled = plan.can_compile(memory)
    if compiled is None:
        compiled = plan.compiled_memory(config, memory.sizes, memory.micro_batch)
    print(plan.describe(memory, compiled))
    return 0 if memory.fits else 1
