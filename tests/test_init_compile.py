"""The train-state init compiles in seconds at any depth: the key is an argument (nothing random is
constant-folded) and the layers' init is one vmapped layer (the program does not grow with depth)."""

import jax

from diffjax.config import ModelConfig
from diffjax.train.mesh import ParallelConfig, make_mesh
from diffjax.train.optimizer import OptimizerConfig, make_optimizer
from diffjax.train.step import sharded_init


def lowered_init(num_layers: int):
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=num_layers, num_heads=2, max_seq_len=32)
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    _, init = sharded_init(config, tx, make_mesh(ParallelConfig(data=1), jax.devices()[:1]))
    return init.lower(jax.random.key(0))


def test_init_takes_the_key_as_a_parameter_and_does_not_grow_with_depth():
    shallow, deep = lowered_init(4), lowered_init(24)
    assert len(shallow.args_info[0]) == 1, "init must take the key as its one argument"
    main = next(line for line in shallow.as_text().splitlines() if "func.func public @main" in line)
    assert "key<fry>" in main or "tensor<2xui32>" in main, main  # the key is a parameter, not a constant
    # The depth appears only in shapes: allow a few characters per changed dimension, not a block per layer.
    assert len(deep.as_text()) <= len(shallow.as_text()) + 2000, (len(shallow.as_text()), len(deep.as_text()))
