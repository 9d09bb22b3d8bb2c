"""`setup_run(config, log)`: everything a run needs before its first step, in one `Run`.

Set-up checks the run directory (same model?), plans where the run starts from what the checkpointer finds there
(start.py: fresh, resume, converted params, train.init_from, LoRA over a base, or already complete), builds the
mesh, tokenizer, data iterators, sharded state and jitted steps, and follows the plan. The loop (loop.py) then only
steps `run.state` and calls its hooks. The run directory travels as the RunDir `setup_run` opens (Run.directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from diffjax import lora, storage
from diffjax.config import RUNTIME_FIELDS, ModelConfig
from diffjax.config_values import build_config
from diffjax.convert.hub import refuse_the_cache
from diffjax.data import make_eval_batches, make_train_dataset, open_documents
from diffjax.generate import sample
from diffjax.ops.context_parallel import context_order
from diffjax.params_checkpoint import load_params
from diffjax.run_dir import RunDir, RunDirInUseError, TrainerLock
from diffjax.sharding import batch_shards
from diffjax.state_layout import BASE_CHECKSUMS, PARAMS, RNG
from diffjax.tokenizers import make_tokenizer
from diffjax.train.batching import BatchPlan, plan_batch
from diffjax.train.config import SECTIONS, RunConfig, read_yaml, save_run_config
from diffjax.train.mesh import allgather_json, describe, initialize_distributed, make_mesh, process_batch_shard
from diffjax.train.metrics import read_records, training_flops_per_token
from diffjax.train.optimizer import OptimizerConfig, make_optimizer, schedule_change
from diffjax.train.start import Start, StartPlan, StartSettings, plan_start
from diffjax.train.state_checkpoints import Checkpointer, Restored, abstract_like, restore_params
from diffjax.train.step import ShardedTraining, setup_sharded_state, sharded_lora_init


@dataclasses.dataclass
class TrainResult:
    step: int  # the step the run ended at
    losses: dict[int, float]  # train loss per step run in this call
    eval_losses: dict[int, float]
    tokens_per_second: float | None
    sample: str | None
    interrupted: str | None = None  # the signal's name when stopped by SIGTERM / SIGINT


class TrainingClock:
    """Seconds spent training: the loop stops it while it evaluates or saves, so throughput counts steps only."""

    def __init__(self):
        self.stopped_for = 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.stopped_for

    @contextlib.contextmanager
    def stopped(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stopped_for += time.perf_counter() - start


@dataclasses.dataclass
class Run:
    """A run set up: what the loop steps and what hooks may read. `state` and `step` move as it trains."""

    config: RunConfig
    directory: RunDir  # the run directory (train.run_dir), as given
    log: Callable[[str], None]  # silent on all but process 0
    lock: TrainerLock  # the run directory's, held by process 0 until close()
    checkpointer: Checkpointer
    last_saved: int | None  # the newest checkpoint on disk
    start_step: int
    mesh: jax.sharding.Mesh
    plan: BatchPlan
    tokenizer: Any
    training: ShardedTraining
    train_step: Callable  # jitted (state, batch) -> (state, device metrics); donates the state
    eval_step: Callable  # jitted (params, batch, step) -> (loss sum, counted tokens)
    state: dict
    data_iter: Any  # grain iterator of this process's rows; its position is checkpointed
    eval_batches: list[dict[str, jax.Array]]  # fixed, on the devices
    step: int = 0
    clock: TrainingClock = dataclasses.field(default_factory=TrainingClock)
    # LoRA (config.lora.rank > 0): the frozen part of the base model, not in `state` (train_step and eval_step
    # pass it to the jitted steps)
    frozen: Any = None
    drawn: list = dataclasses.field(default_factory=list)  # this process's rows of the next steps, drawn already

    def model_params(self) -> dict:
        """The params the model runs with now: state["params"], or with LoRA the base merged with the adapters."""
        if self.frozen is None:
            return self.state[PARAMS]
        return lora.model_params(self.state[PARAMS], self.frozen, self.config.lora)

    def close(self) -> None:
        """Waits for the last save, then gives up the run directory (train() calls it as the run ends)."""
        try:
            self.checkpointer.close()
        finally:
            self.lock.release()

    @property
    def run_dir(self) -> Path:
        return self.directory.path

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def tokens_per_step(self) -> int:
        return self.plan.global_batch * self.config.data.seq_len

    def next_batch(self) -> dict[str, jax.Array]:
        """The next step's batch, [accum, micro rows, T] per key, split over the mesh."""
        with setup_errors():  # a malformed record is the user's to fix
            local = self.drawn.pop(0) if self.drawn else next(self.data_iter)
        micro_rows = self.plan.global_batch // self.plan.accum_steps
        stacked = {key: value.reshape(self.plan.accum_steps, -1, value.shape[-1]) for key, value in local.items()}
        return _global_batch(stacked, self.training.step_batch_sharding, micro_rows, batch_axis=1)

    def evaluate(self) -> float | None:
        """Mean loss per token over the held-out batches (None without held-out data)."""
        if not self.eval_batches:
            return None
        total, count = 0.0, 0.0
        step = jnp.int32(self.step)  # the next step's: what the model computes now
        for batch in self.eval_batches:
            loss_sum, tokens = self.eval_step(self.state[PARAMS], batch, step)
            total, count = total + float(loss_sum), count + float(tokens)
        return total / max(count, 1.0)

    def sample_text(self) -> str:
        train = self.config.train
        model = nnx.merge(self.training.graphdef, self.model_params())
        key = jax.random.fold_in(jax.random.wrap_key_data(self.state[RNG]), 0)
        prompt = self.tokenizer.encode(train.sample_prompt)
        # The prompt and the sample share the model's context (max_seq_len): a longer sample is cut there.
        num_tokens = min(train.sample_tokens, self.config.model.max_seq_len - len(prompt))
        ids = sample(model, prompt, num_tokens, key=key, temperature=train.sample_temperature,
                     # a padded vocabulary's extra ids, and the tokenizer's gaps, do not decode
                     allowed_vocab_size=self.tokenizer.vocab_size, blocked_ids=self.tokenizer.undecodable_ids())
        return train.sample_prompt + self.tokenizer.decode(ids)


@contextlib.contextmanager
def setup_errors():
    """Marks the errors raised while a run is set up (a setting that does not fit the devices, data,
    tokenizer or checkpoints), so train.py can print them as one line instead of a traceback."""
    try:
        yield
    except (ValueError, OSError) as error:
        error.during_setup = True
        raise


def setup_run(config: RunConfig, log: Callable[[str], None] = print) -> Run | TrainResult:
    """The run set up (restored from its newest checkpoint, if any), or the TrainResult of a run already
    complete: rerunning it redoes nothing."""
    initialize_distributed(config.parallel)
    if jax.process_index() != 0:  # one process speaks and writes metrics for all
        log = lambda _: None  # noqa: E731
    with setup_errors():
        if not storage.is_url(config.train.run_dir):  # (a model's snapshot there would get a run beside its weights)
            refuse_the_cache(config.train.run_dir)
        created = _outermost_missing(storage.as_path(config.train.run_dir))
        directory = RunDir.for_training(config.train.run_dir)
        lock = _lock_run_dir(directory, log)
    with contextlib.ExitStack() as opened:  # undone (checkpointer closed, lock released) unless a Run takes them
        if created is not None and jax.process_index() == 0:
            opened.callback(_remove_if_nothing_written, created)  # (last: after the lock file is gone)
        opened.callback(lock.release)
        with setup_errors():
            run = _set_up(config, log, directory, lock, opened)
        if isinstance(run, Run):
            opened.pop_all()  # Run.close() gives them back
    return run


def _outermost_missing(path) -> Path | None:
    """The outermost directory of a local `path` that does not exist yet (runs/ of a new runs/tiny); None: it exists
    (or is gs://, which has no empty directories)."""
    if storage.is_url(path) or path.exists():
        return None
    path = Path(path).absolute()
    while not path.parent.exists():
        path = path.parent
    return path


def _remove_if_nothing_written(path: Path) -> None:
    """Removes the directories this start created (the run directory, and runs/ above it if new) if the start
    failed before writing a file there: a refused start leaves no empty runs/<name>/ behind."""
    if path.is_dir() and not any(not p.is_dir() for p in path.rglob("*")):
        shutil.rmtree(path, ignore_errors=True)


def _lock_run_dir(run: RunDir, log) -> TrainerLock:
    """Process 0 takes the run directory's lock (RunDir.lock_for_training) before anything is written there;
    every process learns whether it did, so a refused multi-process run stops everywhere with the same line."""
    lock, refused = None, None
    if jax.process_index() == 0:
        try:
            lock = run.lock_for_training()
        except RunDirInUseError as error:
            refused = str(error)
    refused = allgather_json(refused)[0]
    if refused is not None:
        raise RunDirInUseError(refused)
    if lock is None:  # the other processes of a multi-process run hold nothing
        return TrainerLock(run.lock_file, None)
    if lock.took_over:
        log(lock.describe_takeover())
    return lock


def _set_up(config: RunConfig, log, directory: RunDir, lock: TrainerLock,
            opened: contextlib.ExitStack) -> Run | TrainResult:
    """Where the run starts (start.plan_start), then everything it needs, then the start the plan says."""
    changed = changed_settings(directory, config)
    checkpointer = Checkpointer(directory, config.checkpoint)
    opened.callback(checkpointer.close)
    survey = checkpointer.survey(log)
    final = _final_record(directory, config, survey.newest)
    plan = plan_start(dataclasses.replace(survey, final_record=final is not None), StartSettings.of(config))
    if changed and plan.kind is Start.RESUME:  # (a converted model's first training resumes nothing)
        log(f"note: resuming with changed {', '.join(changed)}")
        if note := _schedule_change(directory, config, plan.step):
            log(note)
    if plan.kind is Start.COMPLETE:
        log(f"the run in {directory.path} is complete (step {plan.step} of train.steps = {config.train.steps}); "
            "nothing to do")
        eval_losses = {plan.step: final["loss"]} if final["kind"] == "eval" else {}
        return TrainResult(step=plan.step, losses={}, eval_losses=eval_losses, tokens_per_second=None, sample=None)

    tokenizer = _tokenizer(config, directory)
    mesh = make_mesh(config.parallel)
    context_order(config.data.seq_len, mesh.shape["context"])  # the sequence must split over the context axis
    batch_plan = plan_batch(config.global_batch_size, batch_shards=batch_shards(mesh),
                            micro_batch_per_device=config.train.micro_batch_per_device)
    tx, schedule = make_optimizer(config.optim, config.train.steps, config.model)
    if plan.lora_base:
        training, state, frozen = _lora_state(config, plan.lora_base, tx, mesh, log)
    else:
        training, state = setup_sharded_state(config.model, tx, config.train.seed, mesh)
        frozen = None
    data_iter, eval_batches = _data(config, tokenizer, training, batch_plan)
    state, start_step, last_saved = _start_from(plan, checkpointer, state, data_iter, config, log)
    # The first batch now, before config.yaml: data that cannot be read (a broken record) stops the start while the
    # run directory holds nothing, so a new one is removed again
    first_batch = next(data_iter)
    if jax.process_index() == 0:
        save_run_config(config, directory.config_file)

    train_step, eval_step = _jitted_steps(config, training, tx, schedule, frozen)
    run = Run(
        config=config, directory=directory, log=log, lock=lock, checkpointer=checkpointer, last_saved=last_saved,
        start_step=start_step, step=start_step, mesh=mesh, plan=batch_plan, tokenizer=tokenizer, training=training,
        train_step=train_step, eval_step=eval_step, state=state, data_iter=data_iter, eval_batches=eval_batches,
        frozen=frozen, drawn=[first_batch],
    )
    _log_set_up(run)
    return run


def _final_record(directory: RunDir, config: RunConfig, step: int | None) -> dict | None:
    """The run's final record at checkpoint `step` in metrics.jsonl: its final eval, or without held-out data its
    last train step. None without one, before train.steps, and in a multi-process run (only process 0 writes
    metrics; every process plans alike)."""
    if step is None or step < config.train.steps or jax.process_count() > 1:
        return None
    final_kind = "eval" if config.data.eval_fraction > 0 else "train"
    final = [r for r in read_records(directory.metrics_file) if r["step"] == step and r["kind"] == final_kind]
    return final[-1] if final else None


def _start_from(plan: StartPlan, checkpointer: Checkpointer, state: dict, data_iter, config: RunConfig,
                log) -> tuple[dict, int, int | None]:
    """Follows the plan: (the train state, the step training starts at, the newest checkpoint on disk)."""
    if plan.kind is Start.RESUME:
        restored = checkpointer.restore_newest(plan.step, abstract_like(state), log)
        if isinstance(restored, Restored):
            return _resumed(restored, state, data_iter, plan, checkpointer, log)
        # Orbax read no train state from plan.step down (each was set aside): plan again from what is left
        plan = plan_start(restored, StartSettings.of(config))
    if plan.kind is Start.CONVERTED:  # a converted / exported model: train on from its params
        step_dir = checkpointer.run.step_dir(plan.step)
        state[PARAMS] = load_params(step_dir, abstract_like(state[PARAMS]))
        log(f"initialized the params from the params-only checkpoint {step_dir}; training starts at step 0")
    elif plan.kind is Start.INIT_FROM:
        state[PARAMS] = restore_params(plan.init_from, abstract_like(state))
        log(f"initialized the params from {plan.init_from}")
    return state, 0, plan.step


def _resumed(restored: Restored, state: dict, data_iter, plan: StartPlan, checkpointer: Checkpointer,
             log) -> tuple[dict, int, int]:
    step_dir = checkpointer.run.step_dir(restored.step)
    if plan.lora_base:  # the adapters fit the base they were trained on only
        lora.check_same_base(jax.device_get(restored.state[BASE_CHECKSUMS]), jax.device_get(state[BASE_CHECKSUMS]),
                             step_dir, plan.lora_base, "resume with the base it was trained on (or choose another "
                             "train.run_dir)")
    if restored.data_state is None:
        log("note: the checkpoint's data position was saved by a different number of processes; "
            "this run's data order starts afresh")
    else:
        data_iter.set_state(restored.data_state)
    log(f"resumed from {step_dir} (step {restored.step})")
    return restored.state, restored.step, restored.step


def _tokenizer(config: RunConfig, directory: RunDir):
    """data.tokenizer's, refused where it does not fit the model or the converted model in the run directory."""
    tokenizer = make_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, {tokenizer.name}); leave model.vocab_size out to use the tokenizer's"
        )
    converted_tokenizer = directory.hf / "tokenizer.json"
    if config.data.tokenizer.kind == "byte" and converted_tokenizer.exists():
        raise ValueError(
            f"data.tokenizer is the byte tokenizer, but {directory.path} holds a converted model whose tokenizer is "
            f"{converted_tokenizer} (vocab_size {config.model.vocab_size}): set data.tokenizer to "
            f"{{kind: hf, path: {converted_tokenizer.parent}}} (conversions since 2026-11-25 name it in config.yaml)"
        )
    return tokenizer


def _data(config: RunConfig, tokenizer, training: ShardedTraining, plan: BatchPlan) -> tuple[Any, list]:
    """(this process's train data iterator, the held-out batches on the devices). Each process loads only the
    batch rows its devices hold."""
    shard_index, shard_count = process_batch_shard(
        training.step_batch_sharding, (plan.accum_steps, plan.global_batch // plan.accum_steps, config.data.seq_len),
        batch_axis=1,
    )
    documents = open_documents(config.data)
    _check_not_empty(documents, config)
    shard = {"shard_index": shard_index, "shard_count": shard_count, "source": documents}
    data_iter = iter(make_train_dataset(config.data, tokenizer, batch_size=plan.global_batch // shard_count,
                                        seed=config.train.seed, **shard))
    eval_rows = plan.micro_batch_per_device * plan.batch_shards
    eval_batches = [  # fixed: on the devices once
        _global_batch(batch, training.eval_batch_sharding, eval_rows)
        for batch in make_eval_batches(config.data, tokenizer, batch_size=eval_rows // shard_count, **shard)
    ]
    return data_iter, eval_batches


def _jitted_steps(config: RunConfig, training: ShardedTraining, tx, schedule, frozen) -> tuple[Callable, Callable]:
    train_step = training.jit_train_step(tx, schedule, config.model, config.train.on_nonfinite, config.train.loss_chunk,
                                         config)
    eval_step = training.jit_eval_step(config.model, config.train.loss_chunk, config)
    if frozen is not None:  # the frozen base rides along as the steps' last argument
        train_step = partial(_with_frozen, train_step, frozen)
        eval_step = partial(_with_frozen, eval_step, frozen)
    return train_step, eval_step


def _with_frozen(step, frozen, *args):
    return step(*args, frozen)


def _log_set_up(run: Run) -> None:
    config, log = run.config, run.log
    log(_describe_model(config))
    log(f"mesh: {describe(run.mesh)} over {jax.process_count()} process(es)")
    if run.training.unsharded:
        log(f"note: kept whole because the mesh axes do not divide them: {'; '.join(run.training.unsharded)}")
    log(f"data: {config.data.source}, tokenizer {run.tokenizer.name}; batch {run.plan.describe(config.data.seq_len)}")
    log(f"run directory: {run.run_dir}")
    if not run.eval_batches:
        log(f"note: no held-out documents (data.eval_fraction = {config.data.eval_fraction}): no eval loss")


def _describe_model(config: RunConfig) -> str:
    model = config.model
    return (
        f"model: {model.attention} attention, d_model {model.d_model}, {model.num_layers} layers, "
        f"{model.num_heads} heads of dim {model.head_dim}"
        f"{_options_note(model)}, {_params_note(model)}; "
        f"{training_flops_per_token(model, config.data.seq_len) / 1e6:,.1f} MFLOP per trained token"
    )


def _lora_state(config: RunConfig, base_path: str, tx, mesh, log) -> tuple[ShardedTraining, dict, dict]:
    """(ShardedTraining, the fresh train state, the frozen base) of a LoRA run: the base is read from
    train.init_from (at every start: checkpoints hold only the trainable part), split into the params that train
    too (lora.trainable) and the frozen rest."""
    training, base_target, init = sharded_lora_init(config.model, config.lora, tx, mesh)
    base = restore_params(base_path, {PARAMS: base_target})
    checksums = jax.jit(lora.checksums)(base)
    chosen, frozen = lora.split_base(base, config.lora)
    state = init(jax.random.key(config.train.seed), chosen, checksums)
    del base
    sizes = {name: sum(x.size for x in jax.tree.leaves(tree)) for name, tree in
             (("adapters", state[PARAMS][lora.ADAPTERS]), ("base", chosen), ("frozen", frozen))}
    kernels = sorted({path[-1] for path in lora.kernel_specs(config.model, config.lora)})
    log(f"LoRA: rank {config.lora.rank}, alpha {config.lora.alpha:g} on {', '.join(kernels)}; training "
        f"{sizes['adapters']:,} adapter params + {sizes['base']:,} base params "
        f"({', '.join(config.lora.trainable) or 'lora.trainable: none'}), {sizes['frozen']:,} frozen from "
        f"{base_path}")
    return training, state, frozen


def changed_settings(directory: RunDir, config: RunConfig) -> list[str]:
    """The keys `config` sets otherwise than the run directory's config.yaml ([] without one). A run directory
    belongs to one model: ValueError for a different model section (fields that only change how it computes, such
    as remat or the attention kernel, may change) or LoRA section."""
    saved_path = directory.config_file
    if not saved_path.exists():
        return []
    saved, current = read_yaml(saved_path), config.to_dict()
    changed = _check_same_model(directory, saved, current, saved_path)
    _check_same_lora(directory, saved, config, saved_path)
    for section in SECTIONS[1:]:
        if section == "lora":
            continue  # (the same: _check_same_lora)
        # Only the keys the saved config names: a conversion's config.yaml names a few (the trainer's names every one).
        saved_section = saved.get(section) or {}
        changed += [f"{section}.{k}" for k in current[section] if k in saved_section and saved_section[k] != current[section][k]
                    and f"{section}.{k}" != "train.run_dir"]  # (this directory: another spelling of it changes nothing)
    return changed


def _schedule_change(directory: RunDir, config: RunConfig, step: int) -> str | None:
    """optimizer.schedule_change's note for resuming at `step` against the schedule config.yaml describes."""
    saved = read_yaml(directory.config_file)
    try:
        old_optim = build_config(OptimizerConfig, saved.get("optim") or {}, prefix="optim")
    except ValueError:  # (a config.yaml of an older diffjax: nothing to compare with)
        return None
    old_steps = (saved.get("train") or {}).get("steps", config.train.steps)
    return schedule_change(old_optim, old_steps, config.optim, config.train.steps, step)


def _check_same_model(directory: RunDir, saved: dict, current: dict, saved_path: Path) -> list[str]:
    """Refuses a different model section; returns the model fields that changed and may (model.<runtime field>)."""
    # A field the saved config predates has its default there.
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.init}
    # (older config files name a kind's options at the top of the model section: read them as options)
    saved_model, current_model = {**defaults, **ModelConfig.legacy_values(saved.get("model", {}))}, current["model"]
    saved_model["global_layers"] = list(saved_model["global_layers"])
    keys = set(saved_model) | set(current_model)
    differing = sorted(k for k in keys - set(RUNTIME_FIELDS) if saved_model.get(k) != current_model.get(k))
    if differing:
        raise ValueError(
            f"run directory {directory.path} holds a run of a different model (model.{', model.'.join(differing)} "
            f"differ from {saved_path}); choose another train.run_dir or restore those values"
        )
    return [f"model.{k}" for k in sorted(keys) if saved_model.get(k) != current_model.get(k)]


def _check_same_lora(directory: RunDir, saved: dict, config: RunConfig, saved_path: Path) -> None:
    """A run directory trains with or without LoRA, of one rank, alpha, targets and trainable base params."""
    defaults = dataclasses.asdict(lora.LoraConfig())
    saved_lora = {**defaults, **(saved.get("lora") or {})}
    current = dataclasses.asdict(config.lora)
    listed = lambda value: list(value) if isinstance(value, (list, tuple)) else value  # noqa: E731
    differing = [k for k in current if listed(saved_lora[k]) != listed(current[k])]
    if differing:
        raise ValueError(
            f"run directory {directory.path} holds a run with different LoRA settings (lora.{', lora.'.join(differing)} "
            f"differ from {saved_path}); choose another train.run_dir or restore those values")


def _global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, global_rows: int, batch_axis: int = 0) -> dict[str, jax.Array]:
    """This process's rows -> one global array per key, split over the mesh's batch axes."""
    def make(value):
        shape = list(value.shape)
        shape[batch_axis] = global_rows
        return jax.make_array_from_process_local_data(sharding, value, tuple(shape))

    return {key: make(value) for key, value in local.items()}


def _check_not_empty(documents, config: RunConfig, sample: int = 64) -> None:
    """An empty corpus packs into rows with nothing to predict (and takes ages to pack): refuse it rather than
    'train' at loss 0. The first `sample` documents tell, without reading a large corpus (or stream)."""
    first = list(itertools.islice(iter(documents), sample))  # (each read: a broken record stops the start now)
    if not any(first):
        where = (f"data.paths {list(config.data.paths)}" if config.data.paths else
                 f"data.hf_dataset {config.data.hf_dataset!r}" if config.data.hf_dataset else
                 f"data.source {config.data.source!r}")
        what = "all empty" if len(first) < sample else f"empty (the first {sample})"
        raise ValueError(f"the training data has no text to learn from ({where}: its documents are {what})")


def _params_note(model: ModelConfig) -> str:
    """'1,234 params', and a mixture of experts' '(567 active)'."""
    total, active = model.param_count(), model.param_count(active=True)
    return f"{total:,} params" + ("" if active == total else f" ({active:,} active)")


def _options_note(model: ModelConfig) -> str:
    """' (2 noise heads)': what the model's kinds' own options say of it, for the set-up log."""
    notes = [options.describe() for options in (model.attention_options, model.mlp_options, model.residual_options)
             if options is not None and options.describe()]
    return f" ({', '.join(notes)})" if notes else ""
