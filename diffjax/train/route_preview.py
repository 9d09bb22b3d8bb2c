"""How each attention call of a run's model runs, and why, on a device you may not have:

    diffjax-train --routes --device h100 --config NAME [parallel.context=N] [model.attention_window=W] [key=value ...]

prints, for the training step (packed rows: segment ids; under the config's model.remat), a generation prefill and
a decode step, the op's shapes and `diffjax.ops.choose`'s route for the config's `model.attention_impl` (default
auto) in each pass, "fwd" (undifferentiated: generation, eval) and "fwd+bwd" (differentiated: training): the impl,
whether it runs per query chunk over the context axis, whether the XLA path runs blockwise, and why. The shapes
come from the attention module's own `project` (abstractly: nothing is computed); they are per micro-batch
row (B = 1) and unsharded. The train step runs over the config's context axis (parallel.context; 1 for -1);
generation without one. Windowed and global layers are called apart. The device: a short name of
diffjax.hardware.DEVICES (h100, a100, v4, v5e, v5p, v6e, cpu, ...), or this machine's.

It lives in the train layer: it reads run configs and builds attention modules, layers above ops.
"""

from __future__ import annotations

from diffjax.hardware import DEVICES
from diffjax.model.sizes import attention_calls
from diffjax.ops.choice import choose
from diffjax.ops.target import current_device


def describe_routes(config, device_name: str | None = None) -> str:
    """The preview of the module docstring for run config `config` on DEVICES[device_name] (None: this machine's)."""
    device = DEVICES[device_name] if device_name else current_device()
    model = config.model
    lines = [f"{model.attention} attention, attention_impl={model.attention_impl!r}, on {device.kind} ({device.platform})"]
    for what, call in attention_calls(model, config.data.seq_len, max(config.parallel.context, 1)):
        lines.append(f"  {what}: {call.describe()}")
        try:
            route = choose(call, model.attention_impl, device)
        except ValueError as error:
            lines.append(f"    -> refused: {error}")
            continue
        passes = route.by_pass()
        if passes["fwd"] == passes["fwd+bwd"]:
            lines.append(f"    -> {route.describe()}: {route.reason}")
            continue
        lines.extend(f"    -> {pass_}: {impl}: {reason}" for pass_, (impl, reason) in passes.items())
    return "\n".join(lines)
