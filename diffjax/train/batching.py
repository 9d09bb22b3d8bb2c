"""How a global batch splits over processes, devices and gradient-accumulation micro-batches."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # sequences per optimizer step, over all devices
    num_devices: int
    num_processes: int
    accum_steps: int  # micro-batches per optimizer step

    @property
    def per_device_batch(self) -> int:
        return self.global_batch // self.num_devices

    @property
    def micro_batch_per_device(self) -> int:
        return self.per_device_batch // self.accum_steps

    @property
    def per_process_batch(self) -> int:
        """Rows of each step's batch that one process loads."""
        return self.global_batch // self.num_processes

    def describe(self, seq_len: int) -> str:
        return (
            f"{self.global_batch} sequences x {seq_len} tokens = {self.global_batch * seq_len:,} tokens per step: "
            f"{self.num_devices} device(s) x {self.micro_batch_per_device} sequences x {self.accum_steps} accumulation step(s)"
        )


def plan_batch(global_batch: int, *, num_devices: int, num_processes: int = 1, micro_batch_per_device: int | None = None) -> BatchPlan:
    """Split `global_batch` sequences; errors say which numbers do not divide and what would."""
    if global_batch % num_devices:
        raise ValueError(
            f"the global batch of {global_batch} sequences does not split evenly over {num_devices} devices; "
            f"use a multiple of {num_devices} (train.batch_size, or train.batch_tokens / data.seq_len)"
        )
    per_device = global_batch // num_devices
    if micro_batch_per_device is None or micro_batch_per_device >= per_device:
        accum = 1
    else:
        if per_device % micro_batch_per_device:
            divisors = [n for n in range(1, per_device + 1) if per_device % n == 0]
            raise ValueError(
                f"train.micro_batch_per_device ({micro_batch_per_device}) must divide the per-device batch "
                f"({per_device} = {global_batch} sequences / {num_devices} devices); divisors: {divisors}"
            )
        accum = per_device // micro_batch_per_device
    return BatchPlan(global_batch=global_batch, num_devices=num_devices, num_processes=num_processes, accum_steps=accum)
