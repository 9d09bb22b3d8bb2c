"""The analyses' figures: each CLI, given --output X.json, writes the JSON and a drawn (not blank) PNG beside it, with
one panel, bar or line per checkpoint; without matplotlib it says so in one line and still writes the JSON. And
benchmarks/plot_results.py draws the committed benchmark results."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from flax import nnx

pytest.importorskip("matplotlib")

from diffjax import ModelConfig, TransformerLM  # noqa: E402
from diffjax.analysis import attention_scores, figures, needles, outliers, quantization, recall  # noqa: E402
from diffjax.checkpoint import save_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=257, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=256,
                   attention_impl="xla", init_std=0.2, lambda_std=0.3)
NEEDLE = ["--needles", "2", "--samples", "1", "--depths", "0,100", "--digits", "3", "--batch-size", "2"]
# (main, its arguments besides --checkpoint and --output, what each panel holds per checkpoint)
CLIS = {
    "needles": (needles.main, ["--lengths", "120,180", *NEEDLE], "image"),
    "recall": (recall.main, ["--pairs", "4,8", "--queries", "1", "--samples", "1", "--depths", "0,100"], "image"),
    "attention_scores": (attention_scores.main, ["--length", "180", *NEEDLE], "bars"),
    "outliers": (outliers.main, ["--tokens", "128", "--seq-len", "32", "--batch-size", "2"], "bars"),
    "quantization": (quantization.main, ["--tokens", "128", "--seq-len", "32", "--batch-size", "2", "--length", "120",
                                         "--needles", "2", "--samples", "1", "--digits", "3"], "line"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    """--checkpoint / --label arguments for a tiny DIFF model and its baseline twin (saved once for the module),
    with --text: a held-out file for the analyses that sample text."""
    root = tmp_path_factory.mktemp("figures")
    argv = []
    for label, config in (("diff", TINY), ("baseline", TINY.replace(attention="standard", num_heads=4, num_kv_heads=2))):
        model = nnx.jit(lambda config=config: TransformerLM(config, rngs=nnx.Rngs(0)))()
        save_params(root / label, nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config)
        argv += ["--checkpoint", str(root / label), "--label", label]
    text = root / "held_out.jsonl"
    text.write_text("".join(json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 4}) + "\n"
                            for i in range(8)))
    return argv + ["--text", str(text)]


def _argv(name: str, checkpoints: list[str], output: Path) -> list[str]:
    main, extra, _ = CLIS[name]
    uses_text = name in ("outliers", "quantization")
    return (checkpoints if uses_text else checkpoints[:-2]) + extra + ["--output", str(output)]


def assert_drawn(path: Path) -> None:
    """A PNG (by its signature) whose pixels are not all one colour."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pixels = imread(path)[..., :3]
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.var() > 1e-3, f"{path} is blank"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLIS))
def test_each_cli_writes_its_json_and_its_figure_with_every_checkpoint(name, checkpoints, tmp_path, capsys, monkeypatch):
    drawn = []
    save = figures.save
    monkeypatch.setattr(figures, "save", lambda figure, path: (drawn.append(figure), save(figure, path)))
    output = tmp_path / "out" / f"{name}.json"  # a directory that does not exist yet
    assert CLIS[name][0](_argv(name, checkpoints, output)) == 0
    figure_path = output.with_suffix(".png")
    assert f"wrote {output} and {figure_path}" in capsys.readouterr().out
    written = json.loads(output.read_text())
    assert written["analysis"] == name and [m["label"] for m in written["models"]] == ["diff", "baseline"]
    assert written["models"][0]["model"].startswith("DIFF (2 diff heads")
    assert_drawn(figure_path)
    # Both checkpoints are in the one figure: a heat map each, or in every panel a bar group / line each.
    (figure,) = drawn
    panels = [ax for ax in figure.axes if ax.get_label() != "<colorbar>"]
    if CLIS[name][2] == "image":
        assert [ax.get_title() for ax in panels] == ["diff", "baseline"] and all(len(ax.images) == 1 for ax in panels)
    else:
        for ax in panels:
            handles, labels = ax.get_legend_handles_labels()
            assert labels == ["diff", "baseline"]
            assert len(ax.lines if CLIS[name][2] == "line" else ax.patches) == (2 if CLIS[name][2] == "line" else
                                                                               2 * len(ax.get_xticks()))


@pytest.mark.slow
def test_without_matplotlib_one_line_and_the_json(checkpoints, tmp_path, capsys, monkeypatch):
    for module in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, module, None)  # import matplotlib... now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    output = tmp_path / "outliers.json"
    assert outliers.main(_argv("outliers", checkpoints[:2] + checkpoints[-2:], output)) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == figures.NOTE and f"wrote {output}\n" in captured.out
    assert json.loads(output.read_text())["models"][0]["top"]["hidden states"]
    assert not output.with_suffix(".png").exists()


def test_output_must_name_a_json_file_in_a_directory_that_can_be_made(tmp_path, capsys):
    """Both refused before any checkpoint is read (none exists here)."""
    checkpoint = ["--checkpoint", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_info:
        outliers.main(checkpoint + ["--output", str(tmp_path / "figure.png")])
    assert exit_info.value.code == 2 and "expected a path ending in .json" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert outliers.main(checkpoint + ["--output", str(tmp_path / "file" / "x.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output {tmp_path / 'file' / 'x.json'}: cannot make its directory")


def test_plot_results_draws_the_committed_benchmark_results(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    names = [f"{kind}_{platform}.json" for kind in ("retrieval", "generate", "attention") for platform in ("cpu", "gpu")]
    present = [name for name in names if (ROOT / "benchmarks" / "results" / name).exists()]
    for name in present:
        shutil.copy(ROOT / "benchmarks" / "results" / name, tmp_path / name)
    assert plot_results.main(["--results", str(tmp_path)]) == 0
    for name in present:
        assert_drawn((tmp_path / name).with_suffix(".png"))
    assert sorted(path.name for path in tmp_path.glob("*.png")) == sorted(name[:-5] + ".png" for name in present)
