"""How a global batch splits over the mesh's batch shards and gradient-accumulation micro-batches."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # sequences per optimizer step
    batch_shards: int  # devices the batch splits over: parallel.data x parallel.fsdp x parallel.expert
    accum_steps: int  # micro-batches per optimizer step

    @property
    def per_shard_batch(self) -> int:
        return self.global_batch // self.batch_shards

    @property
    def micro_batch_per_device(self) -> int:
        return self.per_shard_batch // self.accum_steps

    def describe(self, seq_len: int) -> str:
        return (
            f"{self.global_batch} sequences x {seq_len} tokens = {self.global_batch * seq_len:,} tokens per step: "
            f"{self.batch_shards} batch shard(s) x {self.micro_batch_per_device} sequences x {self.accum_steps} "
            "accumulation step(s)"
        )


def plan_batch(global_batch: int, *, batch_shards: int, micro_batch_per_device: int | None = None) -> BatchPlan:
    """Split `global_batch` sequences; errors say which numbers do not divide and what would."""
    if global_batch % batch_shards:
        raise ValueError(
            f"the global batch of {global_batch} sequences does not split evenly over {batch_shards} batch shards "
            f"(parallel.data x parallel.fsdp x parallel.expert); use a multiple of {batch_shards} (train.batch_size, or "
            "train.batch_tokens / data.seq_len)"
        )
    per_shard = global_batch // batch_shards
    if micro_batch_per_device is None or micro_batch_per_device >= per_shard:
        accum = 1
    else:
        if per_shard % micro_batch_per_device:
            divisors = [n for n in range(1, per_shard + 1) if per_shard % n == 0]
            raise ValueError(
                f"train.micro_batch_per_device ({micro_batch_per_device}) must divide the per-device batch "
                f"({per_shard} = {global_batch} sequences / {batch_shards} batch shards); divisors: {divisors}"
            )
        accum = per_shard // micro_batch_per_device
    return BatchPlan(global_batch=global_batch, batch_shards=batch_shards, accum_steps=accum)
