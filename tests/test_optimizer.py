"""The learning-rate schedule against its formula, the weight-decay mask, and AdamW's decoupled decay."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM
from diffjax.train import OptimizerConfig, make_optimizer, make_schedule, weight_decay_mask


def _expected_lr(step, lr, warmup, total, min_lr, decay):
    """The stated formula, computed independently of optax."""
    if step < warmup:
        return lr * step / warmup
    if decay == "constant":
        return lr
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * shape


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 10])
def test_lr_schedule_matches_formula(decay, warmup):
    lr, total, min_lr = 3e-3, 100, 1.28e-4
    schedule = make_schedule(OptimizerConfig(lr=lr, warmup_steps=warmup, decay=decay, min_lr=min_lr), total)
    for step in range(0, 131):
        expected = _expected_lr(step, lr, warmup, total, min_lr, decay)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step
    assert float(schedule(warmup)) == pytest.approx(lr, rel=1e-6)  # the peak at the end of warmup
    floor = lr if decay == "constant" else min_lr
    assert float(schedule(10 * total)) == pytest.approx(floor, rel=1e-5)
    values = [float(schedule(s)) for s in range(warmup, total + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))  # monotone decay


def test_decay_steps_overrides_the_run_length():
    schedule = make_schedule(OptimizerConfig(lr=1.0, warmup_steps=0, decay="linear", min_lr=0.0, decay_steps=50), 1000)
    assert float(schedule(25)) == pytest.approx(0.5)
    assert float(schedule(50)) == pytest.approx(0.0)


def test_extending_a_run_says_how_its_schedule_changes():
    """A finished 400-step run extended to 800 at step 400 (the progress line's 401): both rates from the formula."""
    from diffjax.train.optimizer import schedule_change

    config = OptimizerConfig(lr=3e-3, warmup_steps=20, decay="cosine", min_lr=3e-4)
    note = schedule_change(config, 400, config, 800, 400)
    before, after = (_expected_lr(400, 3e-3, 20, total, 3e-4, "cosine") for total in (400, 800))
    assert before == pytest.approx(3e-4) and after > 1e-3
    assert note == (f"note: the learning-rate schedule changes on resume: step 401 trains at lr {after:.2e} (the run's "
                    f"schedule: {before:.2e}); warm-up ends at step 20, the cosine decay reaches min_lr 3.0e-04 at step "
                    "800 (was 400); optim.decay_steps=400 keeps the run's schedule")
    kept = OptimizerConfig(lr=3e-3, warmup_steps=20, decay="cosine", min_lr=3e-4, decay_steps=400)
    assert schedule_change(config, 400, kept, 800, 400) is None  # decay_steps keeps it: nothing to say
    assert schedule_change(config, 400, config, 400, 123) is None
    assert "step 11 trains at lr 3.00e-03 (the run's schedule: 1.50e-03); warm-up ends at step 10 (was 20)" in \
        schedule_change(config, 400, OptimizerConfig(lr=3e-3, warmup_steps=10, min_lr=3e-4), 400, 10)


@pytest.mark.parametrize(
    "changes, key",
    [({"decay": "step"}, "optim.decay"), ({"min_lr": 1.0}, "optim.min_lr"), ({"lr": 0.0}, "optim.lr"),
     ({"b2": 1.0}, "optim.b2"), ({"no_decay": ("(",)}, "optim.no_decay"), ({"warmup_steps": -1}, "optim.warmup_steps"),
     ({"lr_multipliers": ("lambda_",)}, "optim.lr_multipliers"), ({"lr_multipliers": ("[=2",)}, "optim.lr_multipliers"),
     ({"lambda_warmup_steps": -5}, "optim.lambda_warmup_steps")],
)
def test_optimizer_config_errors_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        OptimizerConfig(**changes)


NO_DECAY_NAMES = {"scale", "subln_scale", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=16)


def _params(attention="diff"):
    model = TransformerLM(ModelConfig(attention=attention, **TINY), rngs=nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _flat(tree):
    return {tuple(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_default_mask_excludes_norms_subln_and_lambdas(attention):
    params = _params(attention)
    mask = _flat(weight_decay_mask(params))
    excluded = {path for path, decayed in mask.items() if not decayed}
    assert excluded == {path for path in mask if path[-1] in NO_DECAY_NAMES}
    per_layer = 2 + (5 if attention == "diff" else 0)  # two RMSNorms (+ four lambdas and subln)
    assert len(excluded) == per_layer + 1  # (stacked over layers) + final norm
    # Exactly the vectors (1-D, or [layers, n] in the stacked blocks): the default names cover every one.
    assert excluded == {path for path, leaf in _flat(params).items() if leaf.ndim == 1 + (path[0] == "blocks")}


def test_mask_is_configurable():
    mask = _flat(weight_decay_mask(_params(), no_decay=(r"embed", r"lm_head")))
    excluded = {path for path, decayed in mask.items() if not decayed}
    assert excluded == {("embed", "embedding"), ("lm_head",)}
    assert all(_flat(weight_decay_mask(_params(), no_decay=())).values())


@pytest.mark.parametrize("no_decay", [None, ()])
def test_adamw_decays_only_masked_params(no_decay):
    """With zero gradients Adam's step is 0, so one update is pure decoupled decay: p <- p (1 - lr wd)."""
    params = jax.tree.map(lambda p: p + 0.5, _params())
    lr, wd = 0.1, 0.5
    config = OptimizerConfig(lr=lr, warmup_steps=0, decay="constant", weight_decay=wd, min_lr=0.0,
                             **({} if no_decay is None else {"no_decay": no_decay}))
    tx, _ = make_optimizer(config, 10)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = _flat(optax.apply_updates(params, updates))
    for path, old in _flat(params).items():
        decayed = no_decay == () or path[-1] not in NO_DECAY_NAMES
        expected = np.asarray(old) * (1 - lr * wd) if decayed else np.asarray(old)
        np.testing.assert_allclose(np.asarray(new[path]), expected, rtol=1e-6, atol=1e-7, err_msg=str(path))


def test_lr_multipliers_scale_each_matching_parameters_update():
    """"pattern=factor": the first pattern found in a parameter's path sets its learning rate to factor x lr (the
    whole AdamW update, decay included); 0 freezes it; parameters matching none are untouched by the option."""
    params = _params()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)

    def updates(multipliers):
        tx, _ = make_optimizer(OptimizerConfig(warmup_steps=0, lr_multipliers=multipliers), total_steps=10)
        return _flat(tx.update(grads, tx.init(params), params)[0])

    plain = updates(())
    scaled = updates(("lambda_q=3", "lambda_=0", "embed=2"))
    assert set(plain) == set(scaled)
    for key, update in scaled.items():
        name = ".".join(key)
        factor = 3 if "lambda_q" in name else 0 if "lambda_" in name else 2 if "embed" in name else 1
        np.testing.assert_allclose(update, factor * plain[key], rtol=1e-6, err_msg=name)
        assert np.abs(plain[key]).max() > 0, name
