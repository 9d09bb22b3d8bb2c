"""How each attention call of a model runs, and why, on a device you may not have.

    python -m diffjax.ops --config paper/diff-1.4b --device h100 [--context N] [--window W] [key=value ...]

prints, for the training step (packed rows: segment ids; under the config's model.remat), a generation prefill and
a decode step, the op's shapes and `diffjax.ops.choose`'s route for the config's `model.attention_impl` (default
auto) in each pass, "fwd" (undifferentiated: generation, eval) and "fwd+bwd" (differentiated: training): the impl,
whether it runs per query chunk over the context axis, whether the XLA path runs blockwise, and why. The shapes
come from the attention module's own `project` (abstractly: nothing is computed); they are per micro-batch
row (B = 1) and unsharded. --context N: the train step's context axis (default: the config's parallel.context;
generation runs without one). --window W: model.attention_window=W (windowed and global layers call apart).
--device: a short name of diffjax.ops.DEVICES (h100, a100, v4, v5e, v5p, v6e, cpu, ...).

It lives in the train layer (it reads run configs and builds attention modules); `python -m diffjax.ops` hands over
to it.
"""

from __future__ import annotations

import argparse
import sys

from diffjax import command_line
from diffjax.model.sizes import attention_calls
from diffjax.ops.choice import choose
from diffjax.ops.target import DEVICES, current_device
from diffjax.train.config import load_run_config


def main(argv=None) -> int:
    parser = command_line.ArgumentParser(prog="python -m diffjax.ops", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a run config: a shipped one's name (paper/diff-1.4b) or a YAML file")
    parser.add_argument("--device", choices=sorted(DEVICES), default=None, help="default: this machine's first device")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="the train step's context axis size (default: the config's parallel.context, 1 for -1)")
    parser.add_argument("--window", type=int, default=None, metavar="W", help="model.attention_window=W")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as diffjax-train takes them")
    args = parser.parse_args(argv)
    if args.context is not None and args.context < 1:
        parser.error(f"--context must be a positive integer, got {args.context}")
    overrides = args.overrides + ([] if args.window is None else [f"model.attention_window={args.window}"])
    try:
        config = load_run_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = DEVICES[args.device] if args.device else current_device()
    model = config.model
    print(f"{model.attention} attention, attention_impl={model.attention_impl!r}, on {device.kind} ({device.platform})")
    context = max(config.parallel.context, 1) if args.context is None else args.context
    for what, call in attention_calls(model, config.data.seq_len, context):
        print(f"  {what}: {call.describe()}")
        try:
            route = choose(call, model.attention_impl, device)
        except ValueError as error:
            print(f"    -> refused: {error}")
            continue
        passes = route.by_pass()
        if passes["fwd"] == passes["fwd+bwd"]:
            print(f"    -> {route.describe()}: {route.reason}")
            continue
        for pass_, (impl, reason) in passes.items():
            print(f"    -> {pass_}: {impl}: {reason}")
    return 0


if __name__ == "__main__":
    command_line.run(main, "python -m diffjax.ops")
