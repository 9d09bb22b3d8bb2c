"""The layers import one way: the model and ops load nothing of the trainer, checkpointing or PyTorch."""

import subprocess
import sys

import pytest

TRAINER_PACKAGES = ("grain", "orbax", "torch", "transformers", "tensorboardX", "tiktoken", "sentencepiece")


def loaded_packages(code: str) -> set[str]:
    """Top-level packages in sys.modules after running `code` in a fresh interpreter."""
    script = code + "\nimport sys\nprint(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("code", [
    "import diffjax.ops",
    # (the package itself imports the model; checkpoint and the converter behind load_hf come on top)
    "import diffjax.model, diffjax.checkpoint, diffjax; diffjax.load_hf; diffjax.save_hf",
])
def test_core_imports_load_no_trainer_packages(code):
    assert loaded_packages(code).isdisjoint(TRAINER_PACKAGES), code



def loaded_diffjax_modules(code: str) -> set[str]:
    script = code + "\nimport sys\nprint(' '.join(sorted(name for name in sys.modules if name.startswith('diffjax'))))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("code, refused", [
    ("import diffjax.config", ("diffjax.model", "diffjax.generate", "diffjax.train", "diffjax.ops")),
    ("import diffjax.ops", ("diffjax.model", "diffjax.generate", "diffjax.train")),
    ("import diffjax", ("diffjax.model", "diffjax.generate", "diffjax.train", "diffjax.ops", "diffjax.config")),
])
def test_the_package_face_is_lazy(code, refused):
    """`import diffjax.config` / `diffjax.ops` import neither the model, generate nor the trainer (the package's
    names are imported on first use); `import diffjax.config` does not even load jax."""
    loaded = loaded_diffjax_modules(code)
    assert not {name for name in loaded for prefix in refused if name == prefix or name.startswith(prefix + ".")}, loaded
    if code == "import diffjax.config":
        assert "jax" not in loaded_packages(code)


def test_building_a_model_config_loads_no_jax():
    """ModelConfig checks attention_impl against diffjax.attention_impls, which needs no jax: a config is built
    (each kind's own checks included) without loading jax or flax."""
    code = "from diffjax.config import ModelConfig\nModelConfig()\nModelConfig(attention='standard')"
    assert not {"jax", "flax"} & loaded_packages(code)


def test_the_package_names_still_resolve():
    script = ("import diffjax, numpy as np\nfrom flax import nnx\n"
              "m = diffjax.TransformerLM(diffjax.ModelConfig(d_model=32, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))\n"
              "print(np.asarray(diffjax.generate(m, [[1, 2]], 2)).shape, diffjax.load_hf.__name__, "
              "'diff_attention' in dir(diffjax))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["(1,", "2)", "load_hf", "True"]


def test_the_run_config_loads_no_jax():
    """The run config's sections are jax-free (their code lives beside them: diffjax.lora_config / lora,
    train.optimizer_config / optimizer, mesh_axes / train.mesh; diffjax.data's names load on use), so `--help-keys`,
    the docs build and config checks pay for no jax, optax, grain or flax."""
    code = "from diffjax.train.config import RunConfig, load_run_config\nload_run_config('tiny', ['model.mlp=moe'])"
    assert not {"jax", "jaxlib", "optax", "grain", "flax", "orbax"} & loaded_packages(code)
