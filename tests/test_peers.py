"""benchmarks/peers.py: transformers' DiffLlama with torch.optim.AdamW against diffjax's train step on the same
weights. The benchmark refuses to time frameworks whose first two losses disagree; on a tiny model the whole path
runs and both layouts' losses equal PyTorch's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402


def test_losses_that_disagree_stop_the_benchmark():
    agree = {"pytorch": [6.4255280, 5.5852375], "diffjax unrolled": [6.4255281, 5.5852370]}
    assert peers.check_losses(agree) == []
    problems = peers.check_losses({**agree, "diffjax scanned": [6.4255280, 5.59]})
    assert problems == ["diffjax scanned step 2: loss 5.5900000 vs PyTorch 5.5852375 (relative 8.5e-04 > 1e-05)"]


@pytest.mark.slow
@pytest.mark.single_leg
def test_the_tiny_benchmark_times_both_frameworks_on_equal_losses(tmp_path):
    out = tmp_path / "peers.json"
    assert peers.main(["--tiny", "--repeats", "1", "--warmup", "2", "--skip-startup", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"pytorch", "diffjax unrolled", "diffjax scanned"}
    first = result["losses"]["pytorch"][:2]
    for name in ("diffjax unrolled", "diffjax scanned"):
        assert result["losses"][name][:2] == pytest.approx(first, rel=peers.LOSS_RTOL)
        assert result["rows"][name]["steps_per_s"] > 0 and result["compile_s"][name] > 0
    assert "| diffjax scanned |" in out.with_suffix(".md").read_text()
