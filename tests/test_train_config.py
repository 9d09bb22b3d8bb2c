"""Run configs: YAML files with `base:`, dotted overrides, errors that name the key, the paper's
configs, batch plans, the analytic FLOP count against XLA's own count, and gradient accumulation."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax import attention_kinds
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM
from diffjax.train import load_run_config, plan_batch
from diffjax.train.config import RunConfig, parse_overrides
from diffjax.train.metrics import matmul_params, training_flops_per_token
from diffjax.train.step import init_state, make_train_step

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER = CONFIGS / "paper"
VOCAB = ["model.vocab_size=257"]  # skip building the tokenizer where the test is not about it


def test_overrides_are_typed_by_the_field():
    config = load_run_config(CONFIGS / "tiny.yaml", VOCAB + [
        "model.num_layers=2", "optim.lr=3e-4", "optim.clip_norm=none", "train.batch_size=null",
        "train.batch_tokens=4096", "data.paths=[a.txt, b.txt]", "train.tensorboard=false", "optim.b2=0.98",
    ])
    assert config.model.num_layers == 2 and config.optim.lr == 3e-4 and config.optim.clip_norm is None
    assert config.global_batch_size == 4096 // config.data.seq_len
    assert config.data.paths == ("a.txt", "b.txt") and config.train.tensorboard is False
    assert parse_overrides(["a.b.c=1", "a.d=x=y"]) == {"a": {"b": {"c": "1"}, "d": "x=y"}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.num_layer=3"], r"unknown config key model\.num_layer \(did you mean model\.num_layers\?\); valid keys under "
                                r"model: .*num_layers"),
        (["training.steps=3"], r"unknown config key training \(did you mean train\?\); valid keys: checkpoint, data, lora, "
                               r"model, optim, parallel, train"),
        (["optim.lr=fast"], r"optim\.lr must be a number, got 'fast'"),
        (["model.d_model=1.5"], r"model\.d_model must be an integer"),
        (["train.steps=0"], r"train\.steps must be an integer >= 1"),
        (["train.tensorboard=maybe"], r"train\.tensorboard must be true or false"),
        (["optim.decay=exp"], r"optim\.decay must be one of"),
        (["data.source=csv"], r"data\.source must be one of"),
        (["data.tokenizer.kind=bpe"], r"data\.tokenizer\.kind must be one of"),
        (["train.batch_tokens=1000"], r"exactly one of train\.batch_size"),
        (["train.batch_size=null", "train.batch_tokens=1000"], r"train\.batch_tokens \(1000\) must be a multiple of data\.seq_len"),
        (["data.seq_len=512"], r"data\.seq_len \(512\) exceeds model\.max_seq_len"),
        (["train.steps"], r"must look like section\.key=value"),
        (["checkpoint.keep=0"], r"checkpoint\.keep must be an integer >= 1"),
        (["train.profile_steps=[3,2]"], r"train\.profile_steps must be \[first, last\] steps with 1 <= first <= last"),
        (["train.profile_steps=5"], r"train\.profile_steps must be \[first, last\]"),
    ],
)
def test_bad_keys_and_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(CONFIGS / "tiny.yaml", VOCAB + overrides)


@pytest.mark.parametrize("overrides, meant", [
    (["train.stesp=3"], "unknown config key train.stesp (did you mean train.steps?)"),  # a typo in the key
    (["trian.steps=3"], "unknown config key trian (did you mean train?)"),  # in the section
    (["train.lr=1e-3"], "unknown config key train.lr (did you mean optim.lr?)"),  # the key under another section
    (["optim.steps=3"], "unknown config key optim.steps (did you mean train.steps?)"),
    (["train.wandb.projct=p"], "unknown config key train.wandb.projct (did you mean train.wandb.project?)"),
    (["model.attention=dif"], "got 'dif' (did you mean diff?)"),  # kind names
    (["model.mlp=gate"], "mlp must be one of ('gated', 'polynorm', 'moe'), got 'gate' (did you mean gated?)"),
    (["model.attention=gda", "model.attention_options.num_noise_head=2"],
     "unknown config key attention_options.num_noise_head (did you mean attention_options.num_noise_heads?)"),
    (["model.attention_impl=pallas"], "got 'pallas' (did you mean pallas_tpu or pallas_gpu"),
    (["model.dtype=bf16"], "got 'bf16' (did you mean bfloat16?)"),
    (["data.tokenizer.kind=sentencepeice"], "got 'sentencepeice' (did you mean sentencepiece?)"),
    (["model.num_heads=4", "model.d_model=128"], None),  # no error, nothing suggested
])
def test_a_mistyped_name_says_what_was_meant(overrides, meant):
    if meant is None:
        load_run_config(CONFIGS / "tiny.yaml", VOCAB + overrides)
        return
    with pytest.raises(ValueError) as raised:
        load_run_config(CONFIGS / "tiny.yaml", VOCAB + overrides)
    assert meant in str(raised.value)


def _float_keys(cls, prefix: str) -> list[str]:
    """The dotted keys of every float setting under a config dataclass (nested sections included)."""
    import dataclasses
    import typing

    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        nested = [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
        if nested:
            keys += _float_keys(nested[0], f"{prefix}{name}.")
        elif hint is float or float in typing.get_args(hint):
            keys.append(prefix + name)
    return keys


def _every_float_setting() -> list[list[str]]:
    """Overrides that set each float of the run config, and each float option of every kind (its kind chosen)."""
    from diffjax.config import BLOCK_PARTS

    settings = [[key] for key in _float_keys(RunConfig, "")]
    for part, table in BLOCK_PARTS.items():
        for row in table.rows():
            if row.options is not None:
                settings += [[f"model.{part}={row.name}", key]
                             for key in _float_keys(row.options, f"model.{part}_options.")]
    return settings


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_no_float_setting_takes_nan_or_an_infinity(value):
    """Issue 62 item 2: model.mtp_loss_weight=nan was taken (and the resumed run diverged). Every float setting, of
    the config's sections and of every kind's options, is refused in one line naming it; so is one built in Python."""
    settings = _every_float_setting()
    assert {"model.mtp_loss_weight", "optim.lr", "data.eval_fraction", "train.sample_temperature"} <= \
        {keys[-1] for keys in settings} and len(settings) > 30
    for *kind, key in settings:
        with pytest.raises(ValueError) as raised:
            load_run_config(CONFIGS / "tiny.yaml", VOCAB + kind + [f"{key}={value}"])
        assert f"{key.removeprefix('model.')} must be a finite number, got '{value}'" in str(raised.value), key
    import dataclasses

    from diffjax.data.config import DataConfig
    from diffjax.train.config import TrainConfig
    from diffjax.train.optimizer_config import OptimizerConfig

    for cls, section in ((ModelConfig, ""), (OptimizerConfig, "optim."), (TrainConfig, "train."), (DataConfig, "data.")):
        for key in _float_keys(cls, section):
            with pytest.raises(ValueError, match=f"{key} must be a finite number, got {float(value)!r}"):
                dataclasses.replace(cls(), **{key.removeprefix(section): float(value)})


def test_a_mistyped_yaml_key_or_config_name_says_what_was_meant(tmp_path):
    (tmp_path / "run.yaml").write_text("base: %s\ntrain:\n  setps: 10\n" % (CONFIGS / "tiny.yaml"))
    with pytest.raises(ValueError, match=r"unknown config key train\.setps \(did you mean train\.steps\?\)"):
        load_run_config(tmp_path / "run.yaml", VOCAB)
    with pytest.raises(FileNotFoundError, match=r"config 'paper/diff-1\.4' is neither a file nor a shipped config "
                                                r"\(did you mean paper/diff-1\.4b"):
        load_run_config("paper/diff-1.4", VOCAB)
    with pytest.raises(FileNotFoundError) as raised:  # nothing close: the list alone
        load_run_config("zzz", VOCAB)
    assert "did you mean" not in str(raised.value) and "the shipped ones: motif3/published" in str(raised.value)


def test_missing_and_cyclic_config_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_run_config(tmp_path / "nope.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        load_run_config(tmp_path / "a.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_run_config(tmp_path / "list.yaml")


def test_config_round_trips_through_its_dict(tmp_path):
    from diffjax.train.config import build_config, save_run_config, read_yaml

    config = load_run_config(PAPER / "transformer-2.8b.yaml")
    save_run_config(config, tmp_path / "saved.yaml")
    assert build_config(RunConfig, read_yaml(tmp_path / "saved.yaml")) == config


# Table 9 (DIFF sizes) and Table 8 (3B): (config, d_model, layers, diff heads, lr, nominal size).
PAPER_ROWS = [
    ("830m", 1536, 24, 8, 1.5e-4, 0.83e9),
    ("1.4b", 2048, 24, 8, 1.5e-4, 1.4e9),
    ("2.8b", 2560, 32, 10, 1.5e-4, 2.8e9),
    ("6.8b", 4096, 32, 16, 7.5e-5, 6.8e9),
    ("13.1b", 5120, 40, 20, 7.5e-5, 13.1e9),
]


@pytest.mark.parametrize("name, d_model, layers, heads, lr, size", PAPER_ROWS)
def test_paper_scaling_configs(name, d_model, layers, heads, lr, size):
    diff = load_run_config(PAPER / f"diff-{name}.yaml")
    base = load_run_config(PAPER / f"transformer-{name}.yaml")
    m = diff.model
    assert (m.d_model, m.num_layers, m.num_heads, m.attention) == (d_model, layers, heads, "diff")
    assert (base.model.num_heads, base.model.attention, base.model.head_dim) == (2 * heads, "standard", m.head_dim)
    assert abs(m.param_count(include_lm_head=False) / size - 1) < 0.02
    # The twins match in parameters (lambda vectors and subln aside) and differ only in attention.
    assert abs(base.model.param_count() / m.param_count() - 1) < 1e-4
    for config in (diff, base):
        assert config.data.seq_len == 2048 and config.train.batch_tokens == 262144 and config.train.steps == 40000
        o = config.optim
        assert (o.lr, o.b1, o.b2, o.warmup_steps, o.decay, o.weight_decay) == (lr, 0.9, 0.98, 375, "linear", 0.05)
        assert config.data.tokenizer.encoding == "cl100k_base" and config.model.vocab_size == 100288
    assert diff.train.run_dir != base.train.run_dir


# Shared DIFF, Table 3 (hidden, layers, heads, rank) and Table 1 (3B); head_dim: our choice (configs' comments).
SHARED_DIFF_ROWS = {"830m": (1536, 24, 8, 96, 96), "1.4b": (2048, 24, 10, 128, 96), "2.8b": (2880, 32, 14, 256, 96),
                    "6.8b": (4096, 35, 20, 320, 96), "13.1b": (5120, 44, 30, 448, 80), "3b": (2880, 30, 14, 256, 96)}


def test_variant_paper_configs(measured):
    for name, (d_model, layers, heads, rank, head_dim) in SHARED_DIFF_ROWS.items():
        config = load_run_config(PAPER / f"shared-diff-{name}.yaml")
        m = config.model
        assert (m.attention, m.d_model, m.num_layers, m.num_heads, m.attention_options.rank, m.head_dim) == (
            "shared_diff", d_model, layers, heads, rank, head_dim)
        twin = load_run_config(PAPER / f"diff-{'3b' if name == '3b' else name}.yaml")
        assert (config.optim, config.data.seq_len, config.train.steps) == (twin.optim, twin.data.seq_len, twin.train.steps)
        measured(f"shared-diff-{name}: params (one embedding) / 1e9", m.param_count(include_lm_head=False) / 1e9)
    assert load_run_config(PAPER / "shared-diff-3b.yaml").model.mlp_dim == 7680
    for name in ("830m", "1.4b"):
        v2, diff = load_run_config(PAPER / f"diff-v2-{name}.yaml"), load_run_config(PAPER / f"diff-{name}.yaml")
        assert (v2.model.attention, v2.model.num_heads, v2.model.head_dim) == ("diff_v2", 2 * diff.model.num_heads, diff.model.head_dim)
        D, L, h = diff.model.d_model, diff.model.num_layers, v2.model.num_heads
        # V2 = DIFF's parameters + a second query half (D^2) and lambda_proj (D h) per layer, less V1's vectors.
        assert v2.model.param_count() - diff.model.param_count() == L * (D * D + D * h - 6 * diff.model.head_dim)
        assert v2.optim == diff.optim and v2.train.run_dir != diff.train.run_dir


def test_paper_3b_and_64k_configs():
    diff = load_run_config(PAPER / "diff-3b.yaml")
    m, o = diff.model, diff.optim
    assert (m.d_model, m.num_layers, m.num_heads, m.head_dim, m.mlp_dim) == (3072, 28, 12, 128, 8192)
    assert (o.lr, o.b1, o.b2, o.warmup_steps, o.decay, o.min_lr, o.weight_decay) == (3.2e-4, 0.9, 0.95, 1000, "linear", 1.28e-5, 0.1)
    assert diff.data.seq_len == 4096 and diff.train.batch_tokens == 4 * 2**20
    base = load_run_config(PAPER / "transformer-3b.yaml")
    assert (base.model.num_heads, base.model.head_dim, base.model.attention) == (24, 128, "standard")
    for name in ("diff-3b-64k", "transformer-3b-64k"):
        long = load_run_config(PAPER / f"{name}.yaml")
        assert long.model.rope_theta == 640000.0 and long.optim.lr == 8e-5 and long.data.seq_len == 65536
        assert long.model.max_seq_len >= 65536


def test_batch_tokens_resolve_to_devices_and_accumulation():
    config = load_run_config(PAPER / "diff-830m.yaml")
    assert config.global_batch_size == 128
    one = plan_batch(128, batch_shards=1, micro_batch_per_device=8)
    assert (one.per_shard_batch, one.micro_batch_per_device, one.accum_steps) == (128, 8, 16)
    eight = plan_batch(128, batch_shards=8, micro_batch_per_device=8)
    assert (eight.per_shard_batch, eight.accum_steps) == (16, 2)
    assert plan_batch(128, batch_shards=8).accum_steps == 1
    with pytest.raises(ValueError, match=r"128 sequences does not split evenly over 3 batch shards"):
        plan_batch(128, batch_shards=3)
    with pytest.raises(ValueError, match=r"micro_batch_per_device \(5\) must divide the per-device batch \(16"):
        plan_batch(128, batch_shards=8, micro_batch_per_device=5)


@pytest.mark.parametrize("attention", attention_kinds.names())
def test_analytic_flops_match_xla_cost_analysis(attention, measured):
    """Forward FLOPs of the analytic convention (with the full T x T square, which is what the XLA
    reference computes) against XLA's own count of the compiled forward pass, for every kind in the table."""
    heads = 4 // attention_kinds.get(attention).value_width  # head_dim 64: matmuls dominate as in real models
    config = ModelConfig(vocab_size=512, d_model=256, num_layers=2, num_heads=heads, attention=attention, max_seq_len=256)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    B, T = 2, 256
    tokens = jnp.zeros((B, T), jnp.int32)
    graphdef, params = nnx.split(model)
    compiled = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, tokens).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # training_flops_per_token = 3 x forward with context T / 2; undo both for the full square.
    full_square_forward = (training_flops_per_token(config, 2 * T) - 6 * matmul_params(config)) / 3 + 2 * matmul_params(config)
    ratio = cost["flops"] / (full_square_forward * B * T)
    measured(f"XLA / analytic forward FLOPs ({attention})", ratio - 1, 0.02)
    assert abs(ratio - 1) < 0.02  # XLA also counts softmax, norms and elementwise ops


def test_diff_attention_costs_one_and_a_half_baseline_attention():
    diff = ModelConfig(d_model=1024, num_layers=1, num_heads=8)
    base = diff.replace(attention="standard", num_heads=16)
    attention = lambda c: training_flops_per_token(c, 4096) - 6 * matmul_params(c)
    assert attention(diff) == pytest.approx(1.5 * attention(base))
    assert matmul_params(diff) == matmul_params(base)


def test_gradient_accumulation_equals_one_big_batch():
    """accum 4 x micro 2 gives the same update as one batch of 8 (token-weighted loss)."""
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=32)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)  # new params = params - gradients
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, schedule, config))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (8, 32)).astype(np.int32)
    # Rows with different numbers of counted tokens, so a per-micro-batch mean would differ.
    segment_ids = np.ones((8, 32), np.int32)
    segment_ids[:3, 20:] = 0
    positions = np.broadcast_to(np.arange(32), (8, 32)).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
    big_state, big = step(init_state(model, tx, jax.random.key(0)), {k: v[None] for k, v in batch.items()})
    small_state, small = step(init_state(model, tx, jax.random.key(0)), {k: v.reshape(4, 2, 32) for k, v in batch.items()})
    assert float(small["loss_tokens"]) == float(big["loss_tokens"]) == 8 * 31 - 3 * 12
    np.testing.assert_allclose(float(small["loss"]), float(big["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(small_state["params"]), jax.tree.leaves(big_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_config_yaml_is_never_left_half_written(tmp_path, monkeypatch):
    """A crash (here: a full disk) while config.yaml is rewritten leaves the previous one, not a cut one."""
    import errno
    import io

    import diffjax.storage
    from diffjax.train.config import save_run_config

    path = tmp_path / "config.yaml"
    config = load_run_config(CONFIGS / "tiny.yaml", [])
    save_run_config(config, path)
    before = path.read_text()

    class HalfThenFull(io.FileIO):  # where diffjax.storage writes a file before renaming it into place
        def write(self, data):
            super().write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diffjax.storage, "open", lambda file, mode: io.TextIOWrapper(HalfThenFull(file, mode)),
                        raising=False)
    with pytest.raises(OSError):
        save_run_config(load_run_config(CONFIGS / "tiny.yaml", ["optim.lr=1e-2"]), path)
    assert path.read_text() == before
