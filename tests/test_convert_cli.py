"""`python -m diffjax.convert ...` end to end: each subcommand once, exit statuses 0 / 1 / 2.

(tests/test_convert_streaming.py also runs hf-to-diffjax and diffjax-to-hf in subprocesses.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from diffjax.convert.__main__ import main  # noqa: E402
from diffjax.checkpoint import save_params  # noqa: E402
from diffjax.params_checkpoint import nested  # noqa: E402
from diffjax.convert.verify import load_diffjax_as  # noqa: E402
from hf_models import make_hf_model, random_tokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "diffjax.convert", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = make_hf_model("diffllama", num_key_value_heads=4)
    model.save_pretrained(root / "hf")
    done = run_cli("hf-to-diffjax", root / "hf", root / "diffjax")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "peak memory" in done.stderr
    return root, model


@pytest.mark.slow
def test_verify_passes_and_diffjax_to_hf(converted, capsys):
    root, model = converted
    assert main(["verify", str(root / "hf"), "--diffjax", str(root / "diffjax"), "--prompts", "2", "--seq-len", "24"]) == 0
    table = capsys.readouterr().out
    assert "layer 2" in table and "KL(torch || diffjax)" in table and "top-1 agreement: 100.00%" in table
    assert table.rstrip().endswith("PASS")
    assert main(["diffjax-to-hf", str(root / "diffjax"), str(root / "back"), "--shard-size", "50KB"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "back", attn_implementation="eager")
    tokens = torch.tensor(random_tokens(model.config.vocab_size), dtype=torch.long)
    with torch.no_grad():
        np.testing.assert_array_equal(exported(tokens).logits.numpy(), model(tokens).logits.numpy())


@pytest.mark.slow
def test_verify_exits_nonzero_on_a_corrupted_checkpoint(converted):
    root, _ = converted
    model = load_diffjax_as(root / "diffjax", "float32")
    params = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    key = ("blocks", "mlp", "down_kernel")
    params[key] = params[key].copy()
    params[key][2] *= np.float32(1.5)  # one weight tensor (layer 2's) off by 50%
    save_params(root / "corrupt", nested(params), model.config)
    done = run_cli("verify", root / "hf", "--diffjax", root / "corrupt", "--prompts", "2", "--seq-len", "24")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: logits max rel diff" in done.stdout


def test_bad_input_exits_2_with_one_line(converted):
    root, _ = converted
    done = run_cli("hf-to-diffjax", root / "hf", root / "diffjax")  # exists already
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "is not empty" in lines[0] and "--overwrite" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_errors_in_process_exit_2(tmp_path, capsys):
    assert main(["hf-to-diffjax", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # (not tmp_path itself: DST inside SRC is refused first)
    assert main(["diffjax-to-hf", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "no checkpoint under" in capsys.readouterr().err


@pytest.mark.slow
def test_a_conversion_names_its_tokenizer_for_training_and_generation(tmp_path, capsys):
    """hf-to-diffjax carries the checkpoint's tokenizer.json: config.yaml names it (data.tokenizer kind hf), so
    training on from the conversion and the generate CLI use it. Before, the config named none: training fell
    back to bytes and died decoding its sample; generate asked for --prompt-ids."""
    import json

    import yaml
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from diffjax.convert import hf_to_diffjax
    from diffjax.generate.__main__ import main as generate_main
    from diffjax.train import load_run_config, train

    source = tmp_path / "hf"
    make_hf_model("llama", vocab_size=320).save_pretrained(source)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = ["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))

    run_dir = tmp_path / "run"
    hf_to_diffjax(source, run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["tokenizer"] == {"kind": "hf", "path": str((run_dir / "hf").absolute())}

    assert generate_main(["--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("def f")
    config = load_run_config(run_dir / "config.yaml", [
        f"train.run_dir={run_dir}", "train.steps=1", "train.batch_size=2", "train.sample_tokens=4", "train.eval_every=0",
        "train.progress=lines", "data.seq_len=32", "data.builtin_bytes=20000", "data.shuffle_window_tokens=4096",
        "data.eval_fraction=0", "parallel.data=1"])
    result = train(config, log=lambda _: None)
    assert np.isfinite(list(result.losses.values())).all() and result.sample
    # An older conversion's config names no tokenizer: refused in one line before training, not a crash at sampling.
    saved["data"].pop("tokenizer")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ValueError, match=r"data.tokenizer is the byte tokenizer, but .* holds a converted model"):
        train(load_run_config(run_dir / "config.yaml", [f"train.run_dir={run_dir}", "train.steps=2", "parallel.data=1"]),
              log=lambda _: None)
