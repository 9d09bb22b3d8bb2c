"""Every config key has a meaning: `train.py --help-keys` prints each key's value, type, default, allowed values and
its attribute docstring, and the documentation's configuration reference is generated from the same rows
(diffjax.train.keys), so a new field without a docstring fails here rather than reaching users unexplained."""

from __future__ import annotations

import dataclasses

import pytest

from diffjax import attention_impls, attention_kinds, mlp_kinds, residual_kinds
from diffjax.train.config import RunConfig, load_run_config
from diffjax.train.keys import attribute_docstrings, config_keys, describe_keys, kinds_with_options, option_keys



@dataclasses.dataclass(frozen=True)
class Documented:
    size: int = 2
    """How many."""
    commented: str = "a"  # a trailing comment is not a description
    nested: int = 0

    def method(self):
        """Not a field's."""


def test_attribute_docstrings_are_the_literal_after_each_field():
    assert attribute_docstrings(Documented) == {"size": "How many."}
    keys = {key.name: key for key in config_keys(Documented(size=3), "toy.")}
    assert (keys["toy.size"].value, keys["toy.size"].default, keys["toy.size"].type) == (3, 2, "int")
    assert keys["toy.commented"].description == ""


def every_key() -> list:
    return config_keys(RunConfig()) + [key for part, row in kinds_with_options() for key in option_keys(part, row)]


def test_every_key_has_a_description():
    keys = every_key()
    assert len(keys) > 100 and any(key.name == "model.attention_options.num_noise_heads" for key in keys)
    missing = [key.name for key in keys if not key.description]
    assert not missing, (f"config fields without a description: {missing}; give each an attribute docstring (a "
                         f"string literal on the line after the field)")


@pytest.mark.parametrize("overrides", [[], ["model.attention=gda", "model.mlp=moe", "model.residual=mhc"]],
                         ids=["tiny", "kinds-with-options"])
def test_help_keys_prints_value_type_default_allowed_values_and_meaning(overrides):
    run = load_run_config("tiny", ["train.steps=7", *overrides])
    lines = describe_keys(run).split("\n")
    listed = dict(zip(lines[::2], lines[1::2]))
    assert len(listed) == len(lines) // 2 == len(config_keys(run))
    for key_line, about in listed.items():
        assert key_line.startswith("  ") and " = " in key_line and about.startswith("      "), key_line
        assert about.split(". ", 1)[1].strip(), f"{key_line.strip()}: no description"
    assert "int; default 400. Optimizer steps" in listed["  train.steps = 7"]
    for key, names in [("model.attention", attention_kinds.names()), ("model.mlp", mlp_kinds.names()),
                       ("model.residual", residual_kinds.names()), ("model.attention_impl", attention_impls.IMPLS)]:
        line = next(about for key_line, about in listed.items() if key_line.startswith(f"  {key} = "))
        assert f"one of: {', '.join(names)}." in line, line
    if overrides:
        assert any(line.startswith("  model.mlp_options.num_experts = ") for line in listed)


def test_an_option_s_allowed_values_are_its_class_s_listed_and_checked():
    """A kind's Options class names the fields whose value is one of a set (`choices`): --help-keys lists them (the
    MoE's score_func, and a toy kind's registered here, with no edit to diffjax.train.keys) and ModelConfig refuses
    another value in one line."""
    from diffjax import kinds
    from diffjax.config import ModelConfig
    from diffjax.train.keys import Key

    @dataclasses.dataclass(frozen=True)
    class ToyOptions(kinds.Options):
        gate: str = "relu"
        """The gate."""

        choices = {"gate": ("relu", "gelu")}

    toy = dataclasses.replace(mlp_kinds.get("gated"), name="toy_choices_mlp", options=ToyOptions)
    mlp_kinds.register(toy)
    try:
        listed = {key.name: key.allowed for key in every_key()}
        assert listed["model.mlp_options.score_func"] == mlp_kinds.SCORE_FUNCS
        assert listed["model.mlp_options.gate"] == ("relu", "gelu")
        assert Key("model.mlp_options.gate", "str", "relu", "relu", "").allowed == ("relu", "gelu")
        with pytest.raises(ValueError, match=r"^invalid ModelConfig: mlp_options.gate must be one of \('relu', "
                                             r"'gelu'\), got 'tanh'$"):
            ModelConfig(mlp=toy.name, mlp_options={"gate": "tanh"})
    finally:
        mlp_kinds.unregister(toy.name)
