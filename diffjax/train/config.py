"""The run configuration: model, data, optimizer, training and checkpoint sections.

A run is described by one YAML file (a path, or a config shipped in configs/ by name) plus dotted
`key=value` overrides, e.g.

    diffjax-train --config tiny model.num_layers=2 optim.lr=1e-3

Every section is a frozen dataclass; unknown keys and bad values are errors that name the key
and list what is allowed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from diffjax import attention_kinds, storage
from diffjax.config import ModelConfig
from diffjax.config_values import build_config, nonfinite_problems, plain, read_yaml_mapping
from diffjax.data.config import DataConfig
from diffjax.lora_config import LoraConfig
from diffjax.mesh_axes import ParallelConfig
from diffjax.train.config_files import config_file
from diffjax.train.optimizer_config import OptimizerConfig

PROGRESS_STYLES = ("auto", "bar", "lines")
NONFINITE_MODES = ("stop", "skip")
SECTIONS = ("model", "data", "optim", "train", "checkpoint", "parallel", "lora")


def _check_int(config, name: str, *, minimum: int, section: str = "train"):
    value = getattr(config, name)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{section}.{name} must be an integer >= {minimum}, got {value!r}")


WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (train.wandb; the `wandb` extra: pip install "diffjax[wandb]"). On when `project` is
    set and mode is not "disabled"; off by default. It logs what metrics.jsonl holds, under the same names as
    TensorBoard (train/loss, train/lambda/layer_0, eval/loss, ...), at the training step, and the run config as the
    W&B run's config; a resumed run continues the same W&B run (diffjax.train.wandb_log)."""

    project: str | None = None
    """The W&B project to log to; None: no W&B logging."""
    entity: str | None = None
    """A W&B user or team; None: your default entity."""
    name: str | None = None
    """The W&B run's display name; None: the run directory's name."""
    group: str | None = None
    """The W&B group the run belongs to."""
    tags: tuple[str, ...] = ()
    """The W&B run's tags."""
    mode: str | None = None
    """W&B's mode: "online"; "offline" (files only, in <run_dir>/wandb/: upload later with `wandb sync`); "disabled"
    (off even with a project); None: $WANDB_MODE, else online."""

    def __post_init__(self):
        if isinstance(self.tags, (list, str)):
            object.__setattr__(self, "tags", tuple([self.tags] if isinstance(self.tags, str) else self.tags))
        for name in ("project", "entity", "name", "group"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"train.wandb.{name} must be a non-empty string or null, got {value!r}")
        if not all(isinstance(tag, str) and tag for tag in self.tags):
            raise ValueError(f"train.wandb.tags must be a list of non-empty strings, got {list(self.tags)!r}")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"train.wandb.mode must be one of {WANDB_MODES} or null ($WANDB_MODE, else online), "
                             f"got {self.mode!r}")
        if self.project is None and self.mode != "disabled":
            given = [name for name in ("entity", "name", "group", "tags", "mode") if getattr(self, name)]
            if given:
                raise ValueError(f"train.wandb.{given[0]} is set but train.wandb.project is not: set "
                                 "train.wandb.project=<name> to log to Weights & Biases (or mode=disabled)")

    @property
    def enabled(self) -> bool:
        return self.project is not None and self.mode != "disabled"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop (a run config's `train` section): steps, batch, run directory, logging, evals, the final
    sample and what a non-finite step does."""

    steps: int = 400
    """Optimizer steps of the run."""
    batch_size: int | None = 16
    """Global batch in sequences (or give batch_tokens, not both), split over the mesh's batch shards."""
    batch_tokens: int | None = None
    """Global batch in tokens, a multiple of data.seq_len (instead of batch_size)."""
    micro_batch_per_device: int | None = None
    """Sequences per device per micro-batch (gradient accumulation over the rest); None: the whole per-device batch
    at once."""
    seed: int = 0
    """Seed of the model init, the data order and sampling."""
    run_dir: str = "runs/tiny"
    """The run directory (local or gs://): config, checkpoints, metrics; rerunning on it resumes."""
    init_from: str | None = None
    """A run directory or checkpoint whose params a fresh run starts from (continued training, the 64K extension,
    LoRA's base); optimizer state and step start anew."""
    log_every: int = 10
    """Steps between progress lines (every step is recorded in metrics.jsonl / TensorBoard)."""
    eval_every: int = 100
    """Steps between held-out evals; 0: only at the end."""
    progress: str = "auto"
    """Progress display: "bar" (tqdm), "lines", or "auto" (a bar on a terminal, else lines)."""
    tensorboard: bool = True
    """Write TensorBoard events into <run_dir>/tensorboard/."""
    peak_tflops_per_device: float | None = None
    """The device's peak TFLOP/s, for MFU; None: looked up from the device kind."""
    sample_tokens: int = 200
    """Tokens of text generated at the end of the run (0: none)."""
    sample_prompt: str = "def "
    """The prompt of the final sample."""
    sample_temperature: float = 0.8
    """Temperature of the final sample (0: greedy)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient is not finite: "stop" the run (nothing from that step on is saved) or "skip" it
    (params and optimizer state unchanged, logged as skipped)."""
    max_skipped_steps: int = 10
    """skip mode: this many consecutive skipped steps stop the run (exit 3)."""
    loss_chunk: int | None = None
    """Tokens per chunk of the LM head and cross-entropy (the float32 logits never exist at once; same loss); 0: no
    chunks; None: 4096 when model.vocab_size >= 32768."""
    profile_steps: tuple[int, int] | None = None
    """[first, last]: a jax.profiler trace of these steps (1-based, inclusive) into <run_dir>/tensorboard/; None: no
    trace."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging (off unless train.wandb.project is set)."""

    def __post_init__(self):
        if problems := nonfinite_problems(self, "train."):
            raise ValueError(problems[0])
        if isinstance(self.wandb, dict):
            object.__setattr__(self, "wandb", build_config(WandbConfig, self.wandb, prefix="train.wandb"))
        if isinstance(self.profile_steps, list):
            object.__setattr__(self, "profile_steps", tuple(self.profile_steps))
        window = self.profile_steps
        if window is not None and not (isinstance(window, tuple) and len(window) == 2
                                       and all(isinstance(s, int) and not isinstance(s, bool) for s in window)
                                       and 1 <= window[0] <= window[1]):
            raise ValueError(f"train.profile_steps must be [first, last] steps with 1 <= first <= last, or null; "
                             f"got {window!r}")
        if (self.batch_size is None) == (self.batch_tokens is None):
            raise ValueError(
                "give exactly one of train.batch_size (sequences) and train.batch_tokens (tokens); "
                f"got batch_size={self.batch_size!r}, batch_tokens={self.batch_tokens!r}"
            )
        for name in ("steps", "log_every"):
            _check_int(self, name, minimum=1)
        for name in ("batch_size", "batch_tokens", "micro_batch_per_device"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        _check_int(self, "max_skipped_steps", minimum=1)
        for name in ("eval_every", "sample_tokens") + (("loss_chunk",) if self.loss_chunk is not None else ()):
            _check_int(self, name, minimum=0)
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"train.on_nonfinite must be one of {NONFINITE_MODES}, got {self.on_nonfinite!r}")
        if self.progress not in PROGRESS_STYLES:
            raise ValueError(f"train.progress must be one of {PROGRESS_STYLES}, got {self.progress!r}")
        if self.peak_tflops_per_device is not None and not self.peak_tflops_per_device > 0:
            raise ValueError(f"train.peak_tflops_per_device must be > 0 or None, got {self.peak_tflops_per_device!r}")
        if not self.sample_temperature >= 0:
            raise ValueError(f"train.sample_temperature must be >= 0 (0: greedy), got {self.sample_temperature!r}")
        if not self.run_dir:
            raise ValueError("train.run_dir must not be empty")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of the train state (a run config's `checkpoint` section)."""

    every: int = 100
    """Steps between checkpoints (the last step and a SIGTERM / SIGINT always save)."""
    keep: int = 3
    """The newest this many checkpoints are kept."""
    async_save: bool = True
    """Write checkpoints in a background thread while training goes on."""

    def __post_init__(self):
        _check_int(self, "every", minimum=1, section="checkpoint")
        _check_int(self, "keep", minimum=1, section="checkpoint")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A training run: one YAML file (configs/) plus dotted key=value overrides, one section per field."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoraConfig = LoraConfig()
    """LoRA fine-tuning of the model train.init_from names (diffjax.lora); rank 0 (the default): off."""

    def __post_init__(self):
        if self.lora.enabled and not self.train.init_from:
            raise ValueError("lora.rank > 0 fine-tunes a base model: set train.init_from to its run directory (a "
                             "trained run, or an HF model converted with `diffjax-convert hf-to-diffjax`)")
        if self.train.batch_tokens is not None and self.train.batch_tokens % self.data.seq_len:
            raise ValueError(
                f"train.batch_tokens ({self.train.batch_tokens}) must be a multiple of data.seq_len ({self.data.seq_len})"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        if self.optim.lambda_warmup_steps and attention_kinds.get(self.model.attention).maps != 2:
            raise ValueError(f"optim.lambda_warmup_steps applies to differential attention; model.attention "
                             f"{self.model.attention!r} has no lambda (set it to 0)")

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step."""
        if self.train.batch_size is not None:
            return self.train.batch_size
        return self.train.batch_tokens // self.data.seq_len

    def to_dict(self) -> dict[str, Any]:
        # (the lora section only when on: a run without LoRA writes the config.yaml it did before LoRA existed)
        return {
            "model": self.model.to_dict(),
            **{name: plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS[1:]
               if name != "lora" or self.lora.enabled},
        }


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """['model.num_layers=4', 'optim.lr=3e-4'] -> {'model': {'num_layers': '4'}, 'optim': {'lr': '3e-4'}}.

    Values stay strings unless they are YAML lists / mappings; `config_values.convert` turns them into the
    field's type (so '3e-4' is a float wherever a float is expected).
    """
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. optim.lr=3e-4)")
        value: Any = raw
        if raw.startswith(("[", "{")):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as error:
                raise ValueError(f"override {item!r}: the value is not a valid YAML list or mapping "
                                 f"({getattr(error, 'problem', None) or error}), e.g. data.paths='[a.txt, b.txt]'") from None
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with an earlier override of {part}")
        node[leaf] = value
    return nested


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's mapping; a top-level `base: other.yaml` (relative to the file) is read first
    and this file's values are merged over it."""
    path = storage.as_path(path)
    path = path if storage.is_url(path) else path.resolve()  # (a gs:// config.yaml: a resumed gs:// run's)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path in _seen:
        raise ValueError(f"config files include each other in a cycle: {' -> '.join(map(str, _seen + (path,)))}")
    values = read_yaml_mapping(path)
    base = values.pop("base", None)
    if base is not None:
        values = merge(read_yaml(path.parent / base, _seen + (path,)), values)
    return values


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The run config from a YAML file or a shipped config's name (`tiny`, `paper/diff-1.4b`; or the defaults) with
    dotted overrides applied on top.

    `model.vocab_size` left out (or "auto") becomes the tokenizer's vocabulary size.
    """
    values = merge(read_yaml(config_file(path)) if path is not None else {}, parse_overrides(list(overrides)))
    model = values.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(f"model must be a mapping of ModelConfig fields, got {model!r}")
    if model.get("vocab_size", "auto") == "auto":
        data = build_config(DataConfig, values.get("data") or {}, prefix="data")
        from diffjax.tokenizers import make_tokenizer  # reads tokenizer files: only when needed

        values = merge(values, {"model": {"vocab_size": make_tokenizer(data.tokenizer).vocab_size}})
    return build_config(RunConfig, values)


def save_run_config(config: RunConfig, path: str | Path) -> None:
    """Written atomically: a kill mid-write leaves the previous config.yaml, never a cut one."""
    storage.write_text_atomically(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
