"""pytest plugin for the GPU session's `tests` phase (benchmarks/gpu_session.sh): the gpu tests in order of value,
resumable across device calls, each one's outcome and duration logged as it finishes.

    python -m pytest -m gpu -p gpu_tests_plugin --gpu-log LOG.tsv [--gpu-done DONE.tsv] [--gpu-evidence DIR] ...
    (benchmarks/ on PYTHONPATH)

Order (ORDER): the compiled DIFF kernels against XLA, the single-map kernels, the context path (query offsets), the
other tunings, then dispatch under shard_map, the model-level test, and the triton composition (not Hopper's route).
--gpu-log: one line per test reached, `outcome<TAB>seconds<TAB>node id`, written when it finishes (setup, call and
teardown together), so a call cut off by its time limit keeps every finished test's line. --gpu-done: such a log from
an earlier call; its tests are deselected (a second call runs what the first did not reach). --gpu-evidence: a
directory holding this call's earlier phases' results; a test one of them proved (PROVEN) is skipped with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ORDER = ("test_pallas_gpu_compiled_forward_and_grads", "test_pallas_gpu_single_compiled_forward_and_grads",
         "test_pallas_gpu_compiled_query_offset", "test_pallas_gpu_compiled_other_tunings",
         "test_pallas_gpu_through_ops_dispatch_and_shard_map", "test_model_loss_and_grads_pallas_gpu_match_xla_bf16",
         "test_triton_compiled_on_gpu_matches_reference")


def _sweep_checked_long_causal_d128(evidence: Path) -> bool:
    """The sweep timed the DIFF kernels at T 8192 (causal, d 128, dv 256, per-token lambda, no segment ids) and
    checked its default Tuning's output and gradients against XLA in float32: the long causal d 128 case, longer."""
    path = evidence / "pallas_gpu_sweep.json"
    if not path.exists():
        return False
    sweep = json.loads(path.read_text())
    checks = sweep.get("reference_check") or {}
    return (not sweep["dry_run"] and not sweep["single"] and sweep["causal"] and (sweep["d"], sweep["dv"]) == (128, 256)
            and sweep["T"] >= 4096 and all(checks.get(mode, {}).get("ok") for mode in ("fwd", "fwd+bwd")))


# node id (under tests/) -> (what proves it, the check on this call's evidence directory)
PROVEN = {
    "test_ops_pallas_gpu.py::test_pallas_gpu_compiled_forward_and_grads[causal-long-d128]":
        ("the sweep's reference check at T 8192 (pallas_gpu_sweep.json)", _sweep_checked_long_causal_d128),
}


def pytest_addoption(parser):
    group = parser.getgroup("gpu session")
    group.addoption("--gpu-log", type=Path, help="append `outcome<TAB>seconds<TAB>node id` per finished test")
    group.addoption("--gpu-done", type=Path, help="a --gpu-log of an earlier call: deselect the tests it reached")
    group.addoption("--gpu-evidence", type=Path, help="this call's phase results (PROVEN's checks read them)")


def rank(item) -> int:
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    return ORDER.index(name) if name in ORDER else len(ORDER)


def done_ids(path: Path | None) -> set[str]:
    if path is None or not path.exists():
        return set()
    return {line.rstrip("\n").split("\t")[-1] for line in path.read_text().splitlines() if line.strip()}


def pytest_collection_modifyitems(config, items):
    done = done_ids(config.getoption("gpu_done"))
    kept = [item for item in items if item.nodeid not in done]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    evidence = config.getoption("gpu_evidence")
    for item in kept:
        proof = next((p for node, p in PROVEN.items() if item.nodeid.endswith(node)), None)
        if evidence is not None and proof and proof[1](evidence):
            item.add_marker(pytest.mark.skip(reason=f"proven in this call by {proof[0]}"))
    items[:] = sorted(kept, key=rank)


class _Log:
    """Outcome and summed duration per test, one line when its teardown is reported (on the xdist controller, or
    the only process)."""

    def __init__(self, path: Path):
        self.path, self.open = path, {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def pytest_runtest_logreport(self, report):
        outcome, seconds = self.open.get(report.nodeid, ("passed", 0.0))
        if report.outcome != "passed" and outcome == "passed":
            outcome = "error" if report.failed and report.when != "call" else report.outcome
        self.open[report.nodeid] = (outcome, seconds + report.duration)
        if report.when == "teardown":
            outcome, seconds = self.open.pop(report.nodeid)
            with self.path.open("a") as f:
                f.write(f"{outcome}\t{seconds:.1f}\t{report.nodeid}\n")


def pytest_configure(config):
    path = config.getoption("gpu_log")
    if path is not None and not hasattr(config, "workerinput"):  # xdist workers report to the controller
        config.pluginmanager.register(_Log(path), "gpu_tests_log")
