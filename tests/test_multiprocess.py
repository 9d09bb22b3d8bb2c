"""Two processes on localhost train together through jax.distributed (CPU collectives, 2 devices each):
one process logs and writes metrics, each reads its own data shard, Orbax checkpoints are saved and
restored by both, and a run resumed from a checkpoint equals one that went straight through."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from diffjax.train.mesh import ParallelConfig
from diffjax.data import make_train_dataset, open_documents
from diffjax.parallel import make_mesh
from diffjax.tokenizers import make_tokenizer
from diffjax.train import load_run_config
from diffjax.train.optimizer import make_optimizer
from diffjax.train.step import make_eval_step, setup_sharded_state

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64",
    "data.seq_len=32", "data.builtin_bytes=200000", "data.eval_batches=2", "data.eval_fraction=0.2",
    "data.shuffle_window_tokens=4096",  # the default window packs the corpus 5 times over before the first batch
    "train.batch_size=8", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=8",
    "train.progress=lines", "train.tensorboard=false", "optim.warmup_steps=1", "optim.decay_steps=8",
    "checkpoint.every=2",
    "parallel.fsdp=2",  # x data=-1: 2 x 2 over the 4 devices of the two processes
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train_two_processes(run_dir: Path, steps: int) -> list[str]:
    """`python train.py ...` as processes 0 and 1 of one job; returns their outputs."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    address = f"127.0.0.1:{_free_port()}"
    processes = [
        subprocess.Popen(
            [sys.executable, "train.py", *SMALL, f"train.run_dir={run_dir}", f"train.steps={steps}",
             "parallel.distributed=on", f"parallel.coordinator_address={address}", "parallel.num_processes=2",
             f"parallel.process_id={index}"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for index in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300)[0])
    finally:
        for process in processes:
            process.kill()
    for index, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"process {index} exited with {process.returncode}:\n{output}"
    return outputs


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    steps = [r["step"] for r in train_records]
    assert len(steps) == len(set(steps)), f"a step was written twice (two writers?): {steps}"
    return {r["step"]: r["loss"] for r in train_records}


@pytest.mark.slow
@pytest.mark.both_legs
def test_two_processes_train_save_and_resume_together(tmp_path):
    straight = _train_two_processes(tmp_path / "straight", 4)
    assert "mesh: data=2 x fsdp=2 x context=1 x tensor=1 x expert=1 (4 devices) over 2 process(es)" in straight[0], straight[0]
    assert "step 4/4" in straight[0] and "sample (temperature" in straight[0]
    assert "step 1/4" not in straight[1], "only process 0 reports progress"

    # The straight run's step-2 checkpoint, as if it had been killed after saving it (and before step 4's).
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = _train_two_processes(tmp_path / "resumed", 4)
    assert "resumed from" in resumed[0] and "(step 2)" in resumed[0], resumed[0]
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # exact, step by step

    # Process p fed the rows of data shard p: step 1's loss is the initial model's loss on shard 0's first
    # rows followed by shard 1's (recomputed here on one device; both processes on shard 0 would differ).
    config = load_run_config(REPO_ROOT / "configs" / "tiny.yaml", SMALL + [f"train.run_dir={tmp_path / 'straight'}"])
    tokenizer, documents = make_tokenizer(config.data.tokenizer), open_documents(config.data)

    def first_rows(shard_index):
        dataset = make_train_dataset(config.data, tokenizer, batch_size=4, seed=config.train.seed,
                                     shard_index=shard_index, shard_count=2, source=documents)
        return next(iter(dataset))

    tx, _ = make_optimizer(config.optim, config.train.steps)
    training, state = setup_sharded_state(config.model, tx, config.train.seed, make_mesh(ParallelConfig(data=1)))
    eval_step = jax.jit(make_eval_step(training.graphdef))

    def initial_loss(shards):
        rows = [first_rows(i) for i in shards]
        batch = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
        loss_sum, count = eval_step(state["params"], batch)
        return float(loss_sum) / float(count)

    step_1 = _losses(tmp_path / "straight")[1]
    # (Near initialization every batch's loss is close to log 257; float32 noise is ~5e-7, other rows ~2e-4.)
    assert abs(initial_loss([0, 1]) - step_1) < 3e-6
    assert abs(initial_loss([0, 0]) - step_1) > 5e-5 and abs(initial_loss([1, 1]) - step_1) > 5e-5
