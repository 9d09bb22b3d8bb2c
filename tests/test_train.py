"""The first trainer: built-in corpus and batching, optimizer, and `python train.py` end to end
(tokenizers: tests/test_tokenizers.py)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.data import builtin_corpus, random_windows, sequential_windows, split_train_eval, stdlib_source_files
from diffjax.model import TransformerLM
from diffjax.train import OptimizerConfig, make_optimizer, make_schedule, weight_decay_mask

REPO_ROOT = Path(__file__).resolve().parents[1]
LN_256 = math.log(256)


# --- corpus and batching --------------------------------------------------------------------


def test_builtin_corpus_is_deterministic_and_nonempty():
    first = builtin_corpus(max_bytes=300_000)
    second = builtin_corpus(max_bytes=300_000)
    assert first == second
    assert len(first) == 300_000  # the stdlib has far more than this
    assert b"def " in first and b"import " in first
    # A smaller budget is a prefix of a larger one (same order, cut at the budget).
    assert builtin_corpus(max_bytes=10_000) == first[:10_000]


def test_stdlib_source_files_are_sorted_and_skip_tests_and_third_party():
    files = stdlib_source_files()
    root = Path(os.__file__).resolve().parent
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert "os.py" in relative and "json/decoder.py" in relative
    for name in relative:
        parts = name.split("/")
        assert "site-packages" not in parts and "test" not in parts and "tests" not in parts, name
        assert name.endswith(".py")


def test_split_train_eval():
    data = np.arange(1000)
    train, held_out = split_train_eval(data, 0.1)
    assert len(train) == 900 and len(held_out) == 100
    np.testing.assert_array_equal(np.concatenate([train, held_out]), data)
    train, held_out = split_train_eval(b"abcdefghij", 0.0)
    assert train == b"abcdefghij" and held_out == b""
    with pytest.raises(ValueError):
        split_train_eval(data, 1.0)


def test_random_windows_are_deterministic_contiguous_slices():
    tokens = np.arange(10_000, dtype=np.int32)
    windows = random_windows(tokens, 8, 64, np.random.default_rng(3))
    again = random_windows(tokens, 8, 64, np.random.default_rng(3))
    assert windows.shape == (8, 64) and windows.dtype == np.int32
    np.testing.assert_array_equal(windows, again)
    # tokens[i] == i, so a contiguous slice is a run of consecutive integers inside the array.
    np.testing.assert_array_equal(np.diff(windows, axis=1), 1)
    assert windows.min() >= 0 and windows.max() < len(tokens)
    assert len(set(windows[:, 0].tolist())) > 1  # different offsets per row
    # The whole range of starts is reachable, the last full window included.
    short = np.arange(70, dtype=np.int32)
    starts = {int(w[0]) for w in random_windows(short, 2000, 64, np.random.default_rng(0))}
    assert starts == set(range(7))
    with pytest.raises(ValueError):
        random_windows(short, 1, 71, np.random.default_rng(0))


def test_sequential_windows():
    windows = sequential_windows(np.arange(100), 16, max_windows=4)
    assert windows.shape == (4, 16) and windows.dtype == np.int32
    np.testing.assert_array_equal(windows.reshape(-1), np.arange(64))
    assert sequential_windows(np.arange(100), 16).shape == (6, 16)


# --- learning-rate schedule -----------------------------------------------------------------


def _expected_lr(step, peak, warmup, total, min_ratio, decay):
    """The stated formula, computed independently of optax."""
    if step < warmup:
        return peak * step / warmup
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (min_ratio + (1.0 - min_ratio) * shape)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 10])
def test_lr_schedule_matches_formula(decay, warmup):
    peak, total, ratio = 3e-3, 100, 0.1
    schedule = make_schedule(
        OptimizerConfig(peak_lr=peak, warmup_steps=warmup, total_steps=total, decay=decay, min_lr_ratio=ratio)
    )
    for step in range(0, 131):
        expected = _expected_lr(step, peak, warmup, total, ratio, decay)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step
    assert float(schedule(warmup)) == pytest.approx(peak, rel=1e-6)  # the peak at the end of warmup
    if warmup:
        assert float(schedule(0)) == 0.0
        assert float(schedule(warmup - 1)) < peak
    assert float(schedule(total)) == pytest.approx(ratio * peak, rel=1e-5)  # the floor
    assert float(schedule(10 * total)) == pytest.approx(ratio * peak, rel=1e-5)
    values = [float(schedule(s)) for s in range(warmup, total + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))  # monotone decay


def test_optimizer_config_validates():
    with pytest.raises(ValueError):
        OptimizerConfig(decay="step")
    with pytest.raises(ValueError):
        OptimizerConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError):
        OptimizerConfig(peak_lr=0.0)


# --- weight-decay mask ----------------------------------------------------------------------

NO_DECAY_NAMES = {"scale", "subln_scale", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=16)


def _flat_params(model):
    return {path: param for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_weight_decay_mask_excludes_exactly_the_1d_params(attention):
    model = TransformerLM(ModelConfig(attention=attention, **TINY), rngs=nnx.Rngs(0))
    params = _flat_params(model)
    mask_state = weight_decay_mask(nnx.state(model, nnx.Param))
    mask = {path: bool(variable.get_value()) for path, variable in nnx.to_flat_state(mask_state)}
    assert set(mask) == set(params)
    excluded = {path for path, decayed in mask.items() if not decayed}
    expected = {path for path in params if path[-1] in NO_DECAY_NAMES}
    assert excluded == expected
    per_layer = 2 + (5 if attention == "diff" else 0)  # two RMSNorms (+ four lambdas and subln)
    assert len(excluded) == TINY["num_layers"] * per_layer + 1  # + final norm
    included = {path[-1] for path, decayed in mask.items() if decayed}
    assert {"q_kernel", "k_kernel", "v_kernel", "o_kernel", "gate_kernel", "up_kernel", "down_kernel"} <= included
    assert {"embedding", "lm_head"} <= included


@pytest.mark.parametrize("decay_1d", [False, True])
def test_adamw_decays_only_masked_params(decay_1d):
    """With zero gradients Adam's step is 0, so one update is pure decoupled decay: p <- p (1 - lr wd)."""
    model = TransformerLM(ModelConfig(**TINY), rngs=nnx.Rngs(0))
    # Move the 1-D params away from 1.0 / small values so that decay on them would show.
    for path, param in _flat_params(model).items():
        if param[...].ndim == 1:
            param[...] = param[...] + 0.5
    before = {path: np.asarray(param[...]) for path, param in _flat_params(model).items()}
    lr, wd = 0.1, 0.5
    tx, _ = make_optimizer(
        OptimizerConfig(peak_lr=lr, warmup_steps=0, total_steps=10, weight_decay=wd, decay_1d_params=decay_1d)
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    optimizer.update(model, zeros)
    for path, param in _flat_params(model).items():
        old = before[path]
        decayed = path[-1] not in NO_DECAY_NAMES or decay_1d
        expected = old * (1 - lr * wd) if decayed else old
        np.testing.assert_allclose(np.asarray(param[...]), expected, rtol=1e-6, atol=1e-7, err_msg=str(path))


# --- end to end -----------------------------------------------------------------------------


def test_train_script_learns():
    """`python train.py` for a few steps: progress lines, eval lines, and a final loss far below ln 256."""
    result = subprocess.run(
        [sys.executable, "train.py", "--steps", "40", "--log-every", "10", "--eval-every", "20", "--seed", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    progress = re.findall(r"^step\s+(\d+)/40 \| loss ([\d.]+) \| .*lr .* tok/s .*eta", out, flags=re.M)
    assert [int(step) for step, _ in progress] == [1, 10, 20, 30, 40], out
    first_loss = float(progress[0][1])
    assert abs(first_loss - LN_256) < 0.15, out  # starts near uniform over bytes
    evals = re.findall(r"^step (\d+): eval loss ([\d.]+)$", out, flags=re.M)
    assert [int(step) for step, _ in evals] == [20, 40], out
    final = re.search(r"^final train loss ([\d.]+) \(ln 256 = ([\d.]+)\), eval loss ([\d.]+)$", out, flags=re.M)
    assert final, out
    train_loss, ln256, eval_loss = map(float, final.groups())
    assert ln256 == pytest.approx(LN_256, abs=1e-3)
    assert train_loss < 4.0 and eval_loss < 4.0, out
    assert eval_loss == pytest.approx(float(evals[-1][1]), abs=1e-3)
