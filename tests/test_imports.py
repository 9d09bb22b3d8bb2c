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

