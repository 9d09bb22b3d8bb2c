"""benchmarks/retrieval.py end to end at toy size (two kinds, two seeds, a few steps: nothing is learned, so the
retrieval verdicts must say so), and its verdict rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import retrieval  # noqa: E402

TOY = {
    "models": {"Transformer": {"attention": "standard", "num_heads": 4}, "DIFF V1": {"attention": "diff", "num_heads": 2}},
    "reference": "DIFF V1", "seeds": [0, 1], "jobs": 2,
    "run": {"model": {"d_model": 32, "num_layers": 1, "max_seq_len": 64},
            "data": {"seq_len": 64, "eval_fraction": 0.0, "shuffle_window_tokens": 4096},
            "optim": {"lr": 3.0e-3, "warmup_steps": 2},
            "train": {"steps": 3, "batch_size": 4, "log_every": 1, "eval_every": 0, "sample_tokens": 0,
                      "progress": "lines", "tensorboard": False},
            "checkpoint": {"every": 3, "keep": 1}},
    "mix": {"recall_examples": 40, "pair_counts": [2, 4], "max_queries": None, "key_letters": 1, "value_digits": 1,
            "text_bytes": 20000, "held_out_bytes": 80000, "seed": 1},
    "analysis": {"pair_counts": [2, 4], "num_queries": 2, "samples": 2, "text_tokens": 512, "bits": 4, "batch_size": 8},
}


@pytest.mark.single_leg  # subprocess trainings; the analyses it calls are tested on both legs
@pytest.mark.slow
def test_the_benchmark_trains_every_kind_and_seed_and_writes_its_tables(tmp_path):
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({**TOY, "out_dir": str(tmp_path / "out")}))
    assert retrieval.main(["--config", str(config), "--results", str(tmp_path / "results")]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["figures"]) == {f"{label} seed {seed}" for label in TOY["models"] for seed in (0, 1)}
    models = result["models"]
    assert abs(models["Transformer"]["params"] / models["DIFF V1"]["params"] - 1) < 0.01  # matched by mlp_dim
    for figures in result["figures"].values():
        assert 0 <= figures["recall"] <= 1 and figures["text_loss"] > 0 and figures["top_logit"] > 0
    verdicts = result["verdicts"]["DIFF V1"]
    assert verdicts["recall"] == verdicts["answer"] == "not learned"  # 3 steps learn nothing
    assert verdicts["text_loss"] in ("reproduced", "reversed", "too close to call")
    report = (tmp_path / "results.md").read_text()
    assert "| recall accuracy, all pair counts and depths ↑ |" in report and "not learned" in report
    # A finished run is not trained again: a rerun only analyses.
    mtime = (tmp_path / "out" / "diff-v1-seed0.log").stat().st_mtime
    assert retrieval.main(["--config", str(config)]) == 0
    assert (tmp_path / "out" / "diff-v1-seed0.log").stat().st_mtime == mtime


def test_the_verdict_needs_every_seed_on_one_side():
    assert retrieval.verdict([0.9, 0.8, 0.85], [0.5, 0.79, 0.4], True, True) == "reproduced"
    assert retrieval.verdict([0.9, 0.8, 0.85], [0.5, 0.81, 0.4], True, True) == "too close to call"
    assert retrieval.verdict([10.0, 12.0], [30.0, 40.0], False, True) == "reproduced"  # lower is better
    assert retrieval.verdict([0.1, 0.2], [0.5, 0.6], True, True) == "reversed"
    assert retrieval.verdict([0.9], [0.1], True, False) == "not learned"
