"""Every reader of a checkpoint checks it against its digest (issue 30 item 1): load_model, load_params, the
converter's export, generate, the analyses and train.init_from refuse a damaged step in one line naming the
file; from a run directory they read the newest intact step instead, naming the damaged one and the step read; a
malformed digest is damage, and so is a missing one where the run's other checkpoints have theirs; a run without any
digest is read once adopted (issue 45; the trainer's checkpoints: test_missing_digest.py). A tiny params-only
checkpoint (the converter's format), no training."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax.checkpoint import load_model, load_params, save_params
from diffjax.config import ModelConfig
from diffjax.integrity import find_damage
from diffjax.model import TransformerLM

CONFIG = ModelConfig(vocab_size=257, d_model=16, num_layers=1, num_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)))
    step_dir = save_params(tmp_path_factory.mktemp("clean") / "run", params, CONFIG)
    return step_dir.parent.parent, params


def _largest_state_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged_run(clean_run, tmp_path):
    """A copy of the clean run whose step 0 has one flipped byte in its largest file; (run dir, that file)."""
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run[0], run_dir)
    damaged = _largest_state_file(run_dir / "checkpoints" / "0")
    _flip_a_byte(damaged)
    return run_dir, damaged.relative_to(run_dir / "checkpoints" / "0")


@pytest.mark.parametrize("digest, expected", [
    ("flipped byte", r"state/\S+ differs from what was saved"),
    ([1, 2], r"digest.json is malformed \(a JSON list, not an object\)"),
    (None, r"digest.json is malformed \(a JSON NoneType, not an object\)"),
    ({"state/_METADATA": "abc"}, r"digest.json is malformed \(the entry of 'state/_METADATA' is 'abc', not \[size, sha256\]\)"),
    ({}, r"\S+ is not in its digest.json \(\d+ more files neither\)"),  # with a flipped byte: undetectable before
    ("{not json", r"digest.json is unreadable"),
])
def test_each_kind_of_damage_is_found(clean_run, tmp_path, digest, expected):
    step_dir = tmp_path / "0"
    shutil.copytree(clean_run[0] / "checkpoints" / "0", step_dir)
    assert find_damage(step_dir) is None
    if digest != "flipped byte":
        text = digest if isinstance(digest, str) else json.dumps(digest)
        (step_dir / "digest.json").write_text(text)
    if digest in ("flipped byte", {}):
        _flip_a_byte(_largest_state_file(step_dir))
    assert find_damage(step_dir) is not None
    assert __import__("re").search(expected, find_damage(step_dir)), find_damage(step_dir)


def test_load_model_and_load_params_refuse_a_damaged_step(damaged_run):
    from diffjax.checkpoint import DamagedCheckpointError

    run_dir, damaged_file = damaged_run
    step_dir = run_dir / "checkpoints" / "0"
    for read in (load_model, load_params):
        with pytest.raises(DamagedCheckpointError, match=rf"checkpoint {step_dir} is damaged: {damaged_file} differs"):
            read(step_dir)
    with pytest.raises(DamagedCheckpointError, match=rf"every checkpoint in {run_dir / 'checkpoints'} is damaged: 0 \("):
        load_model(run_dir)


def test_a_run_directory_is_read_at_its_newest_intact_step(clean_run, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run[0], run_dir)
    shutil.copytree(run_dir / "checkpoints" / "0", run_dir / "checkpoints" / "5")  # a newer step, then damaged
    _flip_a_byte(_largest_state_file(run_dir / "checkpoints" / "5"))
    with caplog.at_level(logging.WARNING, logger="diffjax.checkpoint"):
        model = load_model(run_dir)
    assert "skipped the damaged checkpoint(s) 5 (" in caplog.text
    assert (f"reading {run_dir / 'checkpoints' / '0'} (step 0), not the newest checkpoint of {run_dir / 'checkpoints'} "
            "(step 5)") in caplog.text
    loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), clean_run[1])
    assert (run_dir / "checkpoints" / "5").is_dir()  # readers move nothing


def _one_line_error(capsys, code: int) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_the_command_line_readers_refuse_a_damaged_checkpoint_in_one_line(damaged_run, tmp_path, capsys):
    from diffjax.analysis import outliers
    from diffjax.convert.__main__ import main as convert
    from diffjax.generate.__main__ import main as generate

    run_dir, damaged_file = damaged_run
    step_dir = run_dir / "checkpoints" / "0"
    message = f"checkpoint {step_dir} is damaged: {damaged_file} differs from what was saved"
    assert message in _one_line_error(capsys, convert(["diffjax-to-hf", str(step_dir), str(tmp_path / "hf")]))
    assert not (tmp_path / "hf").exists()
    assert message in _one_line_error(capsys, generate(["--checkpoint", str(step_dir), "--prompt-ids", "1,2"]))
    assert message in _one_line_error(capsys, outliers.main(["--checkpoint", str(step_dir), "--tokens", "64"]))


def test_a_broken_config_yaml_is_one_line_for_every_reader(clean_run, tmp_path, capsys):
    """generate, the export, the analyses, eval and train.init_from of a run directory whose config.yaml is not
    valid YAML. Before: 56-80 lines of YAML traceback (issue 55 item 9); the trainer said one line already."""
    from diffjax.analysis import outliers
    from diffjax.convert.__main__ import main as convert
    from diffjax.generate.__main__ import main as generate
    from test_robustness import _main
    from test_trainer import SMALL

    run_dir = tmp_path / "run"
    shutil.copytree(clean_run[0], run_dir)
    lines = (run_dir / "config.yaml").read_text().splitlines()
    (run_dir / "config.yaml").write_text("\n".join(lines + ["model: {d_model: 16", "  broken: ["]) + "\n")
    message = (f"error: config file {run_dir / 'config.yaml'} line {len(lines) + 2}, column 9: not valid YAML (expected "
               "',' or '}', but got ':')")
    assert _one_line_error(capsys, convert(["diffjax-to-hf", str(run_dir), str(tmp_path / "hf")])) == message
    assert _one_line_error(capsys, generate(["--checkpoint", str(run_dir), "--prompt-ids", "1,2"])) == message
    assert _one_line_error(capsys, outliers.main(["--checkpoint", str(run_dir), "--tokens", "64"])) == message
    assert _one_line_error(capsys, _main(*SMALL, f"train.run_dir={tmp_path / 'new'}", f"train.init_from={run_dir}")) \
        == message
    if __import__("importlib").util.find_spec("lm_eval"):
        from diffjax.eval.lm_eval_adapter import load_for_eval

        with pytest.raises(ValueError, match=r"^config file .* line \d+, column 9: not valid YAML"):
            load_for_eval(run_dir)  # (diffjax-eval prints its ValueErrors as one line)


def test_init_from_a_damaged_checkpoint_is_refused(damaged_run, tmp_path, capsys):
    from test_robustness import _main
    from test_trainer import SMALL

    run_dir, damaged_file = damaged_run
    step_dir = run_dir / "checkpoints" / "0"
    model = [f"model.{key}={value}" for key, value in CONFIG.to_dict().items() if key in ("d_model", "num_layers", "num_heads")]
    code = _main(*SMALL, *model, f"train.run_dir={tmp_path / 'new'}", f"train.init_from={step_dir}")
    err = _one_line_error(capsys, code)
    assert err.startswith("error: train.init_from: checkpoint") and f"{damaged_file} differs" in err, err


def test_a_missing_digest_is_damage_in_a_digested_run_and_asks_for_adoption_in_a_run_without_any(clean_run, tmp_path):
    from diffjax.checkpoint import NotAdoptedError, adopt
    from diffjax.integrity import MISSING_DIGEST

    run_dir = tmp_path / "run"
    shutil.copytree(clean_run[0], run_dir)
    newer = run_dir / "checkpoints" / "5"
    shutil.copytree(run_dir / "checkpoints" / "0", newer)
    (newer / "digest.json").unlink()
    assert find_damage(newer) == MISSING_DIGEST  # step 0 has its digest
    (run_dir / "checkpoints" / "0" / "digest.json").unlink()
    for step_dir in (newer, run_dir / "checkpoints" / "0"):
        with pytest.raises(NotAdoptedError, match=rf"adopt the run .*: diffjax-checkpoint adopt {run_dir}$"):
            find_damage(step_dir)
    with pytest.raises(NotAdoptedError, match=rf"^checkpoint: checkpoint {newer} has no digest.json, nor has any"):
        load_model(run_dir)
    assert adopt(run_dir) == [run_dir / "checkpoints" / "0", newer]
    assert find_damage(newer) is None and adopt(run_dir) == []
    jax.tree.map(np.testing.assert_array_equal, load_params(run_dir), clean_run[1])


@pytest.mark.parametrize("async_save", [True, False])
def test_the_digest_is_written_before_the_checkpoint_becomes_visible(tmp_path, monkeypatch, async_save):
    """Sync saves too: a digest written after Orbax's rename would leave, for a kill between the two, a checkpoint
    without its digest (set aside, or on a run's first save, a call for adoption)."""
    from diffjax import integrity
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    written_into = []
    real_write = integrity.write_digest
    monkeypatch.setattr(integrity, "write_digest", lambda step_dir: (written_into.append(step_dir.name),
                                                                     real_write(step_dir)))
    checkpointer = Checkpointer(tmp_path / "run", CheckpointConfig(async_save=async_save))
    checkpointer.save(3, {"w": np.arange(4.0)}, {"epoch": 0})
    checkpointer.close()
    assert len(written_into) == 1 and written_into[0] != "3"  # the temporary directory, before the rename
    assert find_damage(tmp_path / "run" / "checkpoints" / "3") is None


def test_a_streamed_checkpoint_is_save_params_file_for_file_and_an_incomplete_one_is_not_kept(tmp_path):
    """save_params_streamed (the Motif 3 converter's writer) writes save_params' files byte for byte from pieces
    (a stacked leaf layer by layer); a fill that leaves a leaf unwritten or fails keeps no step and no config.yaml."""
    from diffjax.params_checkpoint import save_params_streamed
    from diffjax.run_dir import DIGEST_FILE

    rng = np.random.default_rng(0)
    params = {"blocks": {"w": rng.standard_normal((3, 4, 5)).astype(np.float32)},
              "embed": rng.standard_normal((7, 4)).astype(jax.numpy.bfloat16)}
    leaves = {("blocks", "w"): ((3, 4, 5), np.dtype(np.float32)), ("embed",): ((7, 4), params["embed"].dtype)}

    def fill(write):
        for i in reversed(range(3)):
            write(("blocks", "w"), i, params["blocks"]["w"][i])
        write(("embed",), None, params["embed"])

    whole = save_params(tmp_path / "whole", params, ModelConfig())
    streamed = save_params_streamed(tmp_path / "streamed", leaves, fill, ModelConfig())
    digests = [{k: v for k, v in json.loads((step / DIGEST_FILE).read_text()).items() if "_CHECKPOINT_METADATA" not in k}
               for step in (whole, streamed)]
    assert digests[0] == digests[1] and any("params.blocks.w" in name for name in digests[0])
    restored = load_params(tmp_path / "streamed")
    assert jax.tree.all(jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), restored, params))

    def partial(write):
        write(("embed",), None, params["embed"])
        write(("blocks", "w"), 0, params["blocks"]["w"][0])

    with pytest.raises(ValueError, match=r"no values were written for blocks\.w"):
        save_params_streamed(tmp_path / "partial", leaves, partial, ModelConfig())

    def failing(write):
        write(("embed",), None, params["embed"])
        raise OSError("the shard could not be read")

    with pytest.raises(OSError, match="could not be read"):
        save_params_streamed(tmp_path / "failed", leaves, failing, ModelConfig())
    with pytest.raises(ValueError, match=r"params\.embed has shape \(4, 7\), expected \(7, 4\)"):
        save_params_streamed(tmp_path / "misshaped", leaves, lambda write: write(("embed",), None, params["embed"].T),
                             ModelConfig())
    for run in ("partial", "failed", "misshaped"):
        assert not (tmp_path / run / "checkpoints" / "0").exists() and not (tmp_path / run / "config.yaml").exists()
