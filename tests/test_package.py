"""The package as installed: run configs shipped as package data and named (`--config paper/diff-1.4b`), the
console scripts of pyproject.toml, one version. (.ci/wheel checks the built wheel itself, outside the checkout.)"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import runpy
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffjax.train.cli import main, run
from diffjax.train.config_files import SHIPPED, config_file, shipped_names

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_config_names_resolve_to_the_shipped_files(tmp_path, monkeypatch):
    assert SHIPPED == REPO_ROOT / "configs"
    assert config_file("tiny") == SHIPPED / "tiny.yaml"
    assert config_file("paper/diff-1.4b") == SHIPPED / "paper" / "diff-1.4b.yaml"
    assert config_file("motif3/small.yaml") == SHIPPED / "motif3" / "small.yaml"
    monkeypatch.chdir(tmp_path)  # outside the checkout the repository's path still names the shipped file
    assert config_file("configs/paper/diff-1.4b.yaml") == SHIPPED / "paper" / "diff-1.4b.yaml"
    mine = tmp_path / "tiny"  # an existing file wins over a shipped name
    mine.write_text("train: {steps: 1}\n")
    assert config_file(mine) == mine and config_file(str(mine)) == str(mine)
    names = shipped_names()
    assert {"tiny", "paper/diff-1.4b", "paper/transformer-830m", "motif3/small", "motif3/published"} <= set(names)
    assert names == sorted(p.relative_to(SHIPPED).with_suffix("").as_posix() for p in SHIPPED.rglob("*.yaml"))


def test_the_wheel_maps_configs_into_the_package():
    """configs/ at the root ships as the package diffjax.configs; `packages` is then an explicit list (setuptools'
    find cannot see a mapped directory), so it must name every package directory of diffjax/."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"diffjax.configs": "configs"}
    assert setuptools["package-data"]["diffjax.configs"] == ["**/*.yaml"]
    on_disk = {".".join(init.parent.relative_to(REPO_ROOT).parts) for init in (REPO_ROOT / "diffjax").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"diffjax.configs"}


def test_an_installed_wheels_configs_win(tmp_path):
    """Installed, the configs are diffjax/configs/ (package data), even beside a site-packages/configs/ of another
    distribution; in a checkout (this one) they are configs/ beside diffjax/."""
    site = tmp_path / "site-packages"
    shutil.copytree(REPO_ROOT / "diffjax", site / "diffjax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "configs", site / "diffjax" / "configs")
    (site / "configs").mkdir()
    (site / "configs" / "foreign.yaml").write_text("{}\n")
    probe = "from diffjax.train.config_files import SHIPPED, config_file; print(SHIPPED); print(config_file('tiny'))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert result.stdout.split() == [str(site / "diffjax" / "configs"), str(site / "diffjax" / "configs" / "tiny.yaml")]


def test_every_shipped_config_is_a_run_config():
    """Only run configs ship (a benchmark's settings file would be a name that diffjax-train refuses)."""
    from diffjax.train.config import SECTIONS, read_yaml

    for name in shipped_names():
        assert set(read_yaml(config_file(name))) <= set(SECTIONS), name


def test_tiny_mtp_is_tiny_with_two_mtp_depths():
    """Issue 62 item 8: a shipped config trains with MTP (and `diffjax-generate --draft mtp` has a model to draft
    with): tiny, its depths, steps (as long as tiny's 400 by the FLOPs) and run directory apart."""
    from diffjax.train.config import load_run_config
    from diffjax.train.metrics import training_flops_per_token

    configs = [load_run_config(name) for name in ("tiny", "tiny-mtp")]
    work = [config.train.steps * training_flops_per_token(config.model, config.data.seq_len) for config in configs]
    assert 0.9 < work[1] / work[0] < 1.1
    tiny, mtp = (config.to_dict() for config in configs)
    assert mtp["train"].pop("steps") == 250 and tiny["train"].pop("steps") == 400
    assert mtp["model"].pop("mtp_depths") == 2 and tiny["model"].pop("mtp_depths") == 0
    assert mtp["train"].pop("run_dir") == "runs/tiny-mtp" and tiny["train"].pop("run_dir") == "runs/tiny"
    assert mtp == tiny


def test_an_unknown_config_name_is_one_line_listing_the_shipped_ones(capsys):
    assert main(["--config", "paper/diff-1.5b", "--help-keys"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("config error: config 'paper/diff-1.5b' is neither a file nor a shipped config"), err
    assert all(name in err for name in shipped_names()), err


def test_help_keys_default_is_tiny(capsys):
    assert main(["--help-keys"]) == 0
    default = capsys.readouterr().out
    assert main(["--help-keys", "--config", str(SHIPPED / "tiny.yaml")]) == 0
    assert capsys.readouterr().out == default and "  train.steps = 400" in default


def test_console_scripts_name_the_command_lines():
    scripts = PYPROJECT["project"]["scripts"]
    assert {"diffjax-train", "diffjax-convert", "diffjax-generate", "diffjax-eval"} <= set(scripts)
    for script, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script
    assert scripts["diffjax-train"] == "diffjax.train.cli:run"
    assert runpy.run_path(str(REPO_ROOT / "train.py"))["run"] is run  # python train.py runs the same function


def test_one_version_source():
    import diffjax

    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "diffjax.__version__"}
    assert importlib.metadata.version("diffjax") == diffjax.__version__
    assert (REPO_ROOT / "diffjax" / "py.typed").is_file()
    assert f"## [{diffjax.__version__}]" in (REPO_ROOT / "CHANGELOG.md").read_text()


def test_diffjax_train_entry_point_help_keys(capsys):
    """The installed console script (`pip install -e .` puts it beside the interpreter) runs this checkout's
    trainer: `diffjax-train --help-keys` prints what main(["--help-keys"]) prints."""
    installed = {entry.name for entry in importlib.metadata.entry_points(group="console_scripts")}
    script = shutil.which("diffjax-train", path=str(Path(sys.executable).parent))
    if "diffjax-train" not in installed or script is None:
        pytest.skip("diffjax is not installed with its console scripts here (pip install -e . installs them)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([script, "--help-keys", "optim.lr=1e-3"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert main(["--help-keys", "optim.lr=1e-3"]) == 0
    assert result.stdout == capsys.readouterr().out and "  optim.lr = 0.001" in result.stdout
