"""`train(config)`: the whole run, from data to checkpoints, metrics and a generated sample.

Rerunning with the same run directory resumes from its newest checkpoint: params, optimizer state,
step, RNG and the data iterator's position, so the continued run equals an uninterrupted one.
SIGTERM / SIGINT finish the current step, save a checkpoint of it and exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from diffjax import parallel
from diffjax.config import RUNTIME_FIELDS
from diffjax.data import make_eval_batches, make_train_dataset, open_documents
from diffjax.generate import sample
from diffjax.tokenizers import make_tokenizer
from diffjax.train.batching import BatchPlan, plan_batch
from diffjax.train.checkpoint import Checkpointer, abstract_like, load_params, restore_params
from diffjax.train.config import SECTIONS, RunConfig, read_yaml, save_run_config
from diffjax.train.guard import NonFiniteWatch
from diffjax.train.metrics import METRICS_FILE, MetricsWriter, peak_flops_per_device, read_records, training_flops_per_token
from diffjax.train.optimizer import make_optimizer
from diffjax.train.progress import Progress
from diffjax.train.step import setup_sharded_state

CONFIG_FILE = "config.yaml"


@dataclasses.dataclass
class TrainResult:
    step: int  # the step the run ended at
    losses: dict[int, float]  # train loss per step run in this call
    eval_losses: dict[int, float]
    tokens_per_second: float | None
    sample: str | None
    interrupted: str | None = None  # the signal's name when stopped by SIGTERM / SIGINT


class StopSignals:
    """Turns SIGTERM / SIGINT into a flag the loop checks after each step (a second signal exits at once)."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def check_resumable(run_dir: Path, config: RunConfig, log) -> None:
    """A run directory belongs to one model: refuse to resume with a different model section (fields
    that only change how it computes, such as remat or the attention kernel, may change)."""
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.exists():
        return
    saved = read_yaml(saved_path)
    current = config.to_dict()
    saved_model, current_model = saved.get("model", {}), current["model"]
    keys = set(saved_model) | set(current_model)
    differing = sorted(k for k in keys - set(RUNTIME_FIELDS) if saved_model.get(k) != current_model.get(k))
    if differing:
        raise ValueError(
            f"run directory {run_dir} holds a run of a different model (model.{', model.'.join(differing)} differ "
            f"from {saved_path}); choose another train.run_dir or restore those values"
        )
    changed = [f"model.{k}" for k in sorted(keys) if saved_model.get(k) != current_model.get(k)]
    for section in SECTIONS[1:]:
        changed += [f"{section}.{k}" for k in current[section] if saved.get(section, {}).get(k) != current[section][k]]
    if changed:
        log(f"note: resuming with changed {', '.join(changed)}")


def _global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, global_rows: int, batch_axis: int = 0) -> dict[str, jax.Array]:
    """This process's rows -> one global array per key, split over the mesh's batch axes."""
    def make(value):
        shape = list(value.shape)
        shape[batch_axis] = global_rows
        return jax.make_array_from_process_local_data(sharding, value, tuple(shape))

    return {key: make(value) for key, value in local.items()}


def _stack_micro_batches(batch: dict[str, np.ndarray], plan: BatchPlan) -> dict[str, np.ndarray]:
    """[rows, T] -> [accum, rows / accum, T]: the micro-batches a step accumulates over."""
    return {key: value.reshape(plan.accum_steps, -1, value.shape[-1]) for key, value in batch.items()}


def _sample_text(graphdef, state, tokenizer, config: RunConfig) -> str:
    model = nnx.merge(graphdef, state["params"])
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), 0)
    prompt = tokenizer.encode(config.train.sample_prompt)
    # The prompt and the sample share the model's context (max_seq_len): a longer sample is cut there.
    num_tokens = min(config.train.sample_tokens, config.model.max_seq_len - len(prompt))
    ids = sample(model, prompt, num_tokens, key=key, temperature=config.train.sample_temperature)
    return config.train.sample_prompt + tokenizer.decode(ids)


def _finished_run(run_dir: Path, config: RunConfig, latest_step: int | None) -> TrainResult | None:
    """The result of a run already complete, its final record in metrics.jsonl (the final eval, or the last
    train step without held-out data): rerunning it redoes nothing. None when there is anything left to do."""
    if latest_step is None or latest_step < config.train.steps or jax.process_count() > 1:
        return None
    final_kind = "eval" if config.data.eval_fraction > 0 else "train"
    final = [r for r in read_records(run_dir / METRICS_FILE) if r["step"] == latest_step and r["kind"] == final_kind]
    if not final:
        return None
    eval_losses = {latest_step: final[-1]["loss"]} if final_kind == "eval" else {}
    return TrainResult(step=latest_step, losses={}, eval_losses=eval_losses, tokens_per_second=None, sample=None)


def _check_not_empty(documents, config: RunConfig, sample: int = 64) -> None:
    """An empty corpus packs into rows with nothing to predict (and takes ages to pack): refuse it rather than
    'train' at loss 0. The first `sample` documents tell, without reading a large corpus."""
    n = min(len(documents), sample)
    if not any(documents[i] for i in range(n)):
        where = f"data.paths {list(config.data.paths)}" if config.data.paths else f"data.source {config.data.source!r}"
        what = "all empty" if n == len(documents) else f"empty (the first {n})"
        raise ValueError(f"the training data has no text to learn from ({where}: its documents are {what})")


@contextlib.contextmanager
def _setup_errors():
    """Marks the errors raised while a run is set up (a setting that does not fit the devices, data,
    tokenizer or checkpoints), so train.py can print them as one line instead of a traceback."""
    try:
        yield
    except (ValueError, OSError) as error:
        error.during_setup = True
        raise


def train(config: RunConfig, *, log: Callable[[str], None] = print) -> TrainResult:
    parallel.initialize_distributed(config.parallel)
    is_main_process = jax.process_index() == 0
    if not is_main_process:  # one process speaks and writes metrics for all
        log = lambda _: None  # noqa: E731
    with _setup_errors():
        run_dir = Path(config.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        check_resumable(run_dir, config, log)
        checkpointer = Checkpointer(run_dir, config.checkpoint)
        latest_step, start_step = checkpointer.newest_intact(log), 0
        if (finished := _finished_run(run_dir, config, latest_step)) is not None:
            checkpointer.close()
            log(f"the run in {run_dir} is complete (step {latest_step} of train.steps = {config.train.steps}); nothing to do")
            return finished

        tokenizer = make_tokenizer(config.data.tokenizer)
        if tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({tokenizer.vocab_size}, {tokenizer.name}); leave model.vocab_size out to use the tokenizer's"
            )
        mesh = parallel.make_mesh(config.parallel)
        plan = plan_batch(config.global_batch_size, batch_shards=mesh.shape["data"] * mesh.shape["fsdp"],
                          micro_batch_per_device=config.train.micro_batch_per_device)
        tx, schedule = make_optimizer(config.optim, config.train.steps)
        training, state = setup_sharded_state(config.model, tx, config.train.seed, mesh)
        graphdef = training.graphdef
        seq_len = config.data.seq_len
        micro_rows = plan.global_batch // plan.accum_steps
        # Each process loads only the batch rows its devices hold.
        shard_index, shard_count = parallel.process_batch_shard(
            training.step_batch_sharding, (plan.accum_steps, micro_rows, seq_len), batch_axis=1
        )
        documents = open_documents(config.data)
        _check_not_empty(documents, config)
        shard = {"shard_index": shard_index, "shard_count": shard_count, "source": documents}
        train_ds = make_train_dataset(config.data, tokenizer, batch_size=plan.global_batch // shard_count,
                                      seed=config.train.seed, **shard)
        data_iter = iter(train_ds)
        eval_rows = plan.micro_batch_per_device * plan.batch_shards
        eval_batches = [  # fixed: on the devices once
            _global_batch(batch, training.eval_batch_sharding, eval_rows)
            for batch in make_eval_batches(config.data, tokenizer, batch_size=eval_rows // shard_count, **shard)
        ]

        if latest_step is not None:
            step_dir = checkpointer.directory / str(latest_step)
            if checkpointer.state_keys(latest_step) == {"params"}:  # a converted / exported model: train on from its params
                state["params"] = load_params(step_dir, abstract_like(state["params"]))
                log(f"initialized the params from the params-only checkpoint {step_dir}; training starts at step 0")
            else:
                start_step = latest_step
                state, data_state = checkpointer.restore(start_step, abstract_like(state))
                if data_state is None:
                    log("note: the checkpoint's data position was saved by a different number of processes; "
                        "this run's data order starts afresh")
                else:
                    data_iter.set_state(data_state)
                log(f"resumed from {step_dir} (step {start_step})")
        elif config.train.init_from:
            state["params"] = restore_params(config.train.init_from, abstract_like(state))
            log(f"initialized the params from {config.train.init_from}")
    if is_main_process:
        save_run_config(config, run_dir / CONFIG_FILE)

    train_step = training.jit_train_step(tx, schedule, config.model, config.train.on_nonfinite, config.train.loss_chunk)
    eval_step = training.jit_eval_step(config.model, config.train.loss_chunk)
    params_count = config.model.param_count()
    flops_per_token = training_flops_per_token(config.model, seq_len)
    peak = peak_flops_per_device(jax.devices()[0].device_kind, config.train.peak_tflops_per_device)
    tokens_per_step = plan.global_batch * seq_len
    log(
        f"model: {config.model.attention} attention, d_model {config.model.d_model}, {config.model.num_layers} layers, "
        f"{config.model.num_heads} heads of dim {config.model.head_dim}, {params_count:,} params; "
        f"{flops_per_token / 1e6:,.1f} MFLOP per trained token"
    )
    log(f"mesh: {parallel.describe(mesh)} over {jax.process_count()} process(es)")
    if training.unsharded:
        log(f"note: kept whole because the mesh axes do not divide them: {'; '.join(training.unsharded)}")
    log(f"data: {config.data.source}, tokenizer {tokenizer.name}; batch {plan.describe(seq_len)}")
    log(f"run directory: {run_dir}")
    if not eval_batches:
        log(f"note: no held-out documents (data.eval_fraction = {config.data.eval_fraction}): no eval loss")

    def evaluate() -> float | None:
        if not eval_batches:
            return None
        total, count = 0.0, 0.0
        for batch in eval_batches:
            loss_sum, tokens = eval_step(state["params"], batch)
            total, count = total + float(loss_sum), count + float(tokens)
        return total / max(count, 1.0)

    metrics_writer = MetricsWriter(run_dir, tensorboard=config.train.tensorboard, resume_step=start_step,
                                   enabled=is_main_process)
    result = TrainResult(step=start_step, losses={}, eval_losses={}, tokens_per_second=None, sample=None)
    if start_step >= config.train.steps:
        log(f"the run in {run_dir} is complete (step {start_step} of train.steps = {config.train.steps}); recording its final eval")
    progress = Progress(config.train.progress if is_main_process else "lines", start_step, config.train.steps,
                        tokens_per_step, log)
    pending = []  # (step, device metrics) not yet written: converting to floats would stall the device
    # Throughput over the steps since the last flush (the first step compiles and is not timed).
    timer = {"since": None, "steps": 0, "paused": 0.0}
    watch = NonFiniteWatch(config.train.on_nonfinite, checkpointer.directory, latest_step)

    def flush(report: bool = True):
        """Writes the pending steps' metrics (checking each step was finite) and, if `report`, a progress line."""
        if not pending:
            return
        rate = None
        if timer["steps"]:
            jax.block_until_ready(pending[-1][1])
            rate = timer["steps"] * tokens_per_step / (time.perf_counter() - timer["since"] - timer["paused"])
            result.tokens_per_second = rate
        host_metrics = jax.device_get([metrics for _, metrics in pending])  # one transfer for the window
        for (step_done, _), metrics in zip(pending, host_metrics):
            values = {key: float(value) for key, value in metrics.items() if key not in ("lambda", "ok")}
            if not watch.check(step_done, {**values, "ok": bool(metrics["ok"])}):
                values["skipped"] = 1.0
                progress.note(f"step {step_done}: loss {values['loss']}, gradient norm {values['grad_norm']}: skipped")
            if "lambda" in metrics:
                values.update({f"lambda/layer_{i}": float(x) for i, x in enumerate(np.asarray(metrics["lambda"]))})
            if rate is not None:
                values["tokens_per_second"] = rate
                values["tflops_per_device"] = rate * flops_per_token / mesh.size / 1e12
                if peak:
                    values["mfu"] = rate * flops_per_token / mesh.size / peak
            result.losses[step_done] = values["loss"]
            metrics_writer.write(step_done, "train", values)
        if report:
            progress.update(pending[-1][0], values)
        pending.clear()
        timer.update(since=time.perf_counter(), steps=0, paused=0.0)

    step = start_step
    try:
        with StopSignals() as stop:
            while step < config.train.steps:
                with _setup_errors():  # a malformed record is the user's to fix
                    local = next(data_iter)
                batch = _global_batch(_stack_micro_batches(local, plan), training.step_batch_sharding,
                                      micro_rows, batch_axis=1)
                state, metrics = train_step(state, batch)
                step += 1
                pending.append((step, metrics))
                if step == start_step + 1:  # compiled: time from here
                    flush()
                else:
                    timer["steps"] += 1
                if step % config.train.log_every == 0 or step == config.train.steps:
                    flush()
                pause = time.perf_counter()
                if config.train.eval_every and step % config.train.eval_every == 0 and step < config.train.steps:
                    flush()
                    result.eval_losses[step] = evaluate()
                    metrics_writer.write(step, "eval", {"loss": result.eval_losses[step]})
                    progress.note(f"step {step}: eval loss {result.eval_losses[step]:.4f}")
                if step % config.checkpoint.every == 0 or step == config.train.steps or stop.received:
                    # Every step up to this one is checked finite and in metrics.jsonl before its checkpoint exists.
                    flush(report=False)
                    checkpointer.save(step, state, data_iter.get_state())
                    watch.saved(step)
                timer["paused"] += time.perf_counter() - pause
                if stop.received:
                    flush()
                    checkpointer.wait()
                    log(f"{stop.received}: saved a checkpoint of step {step} in {checkpointer.directory}; exiting")
                    result.interrupted = stop.received
                    break
        flush()
        result.step = step
        if result.interrupted is None and step >= config.train.steps:
            final_eval = evaluate()
            if final_eval is not None:
                result.eval_losses[step] = final_eval
                if step > start_step or not any(r["step"] == step and r["kind"] == "eval"  # a kill lost it
                                                for r in read_records(run_dir / METRICS_FILE)):
                    metrics_writer.write(step, "eval", {"loss": final_eval})
                progress.note(f"step {step}: eval loss {final_eval:.4f}")
            if config.train.sample_tokens:
                result.sample = _sample_text(graphdef, state, tokenizer, config)
                progress.note(f"sample (temperature {config.train.sample_temperature}):\n{result.sample}")
    finally:
        progress.close()
        checkpointer.close()
        metrics_writer.close()
    if result.tokens_per_second:
        log(f"done at step {step}: {result.tokens_per_second:,.0f} tokens/s")
    return result
