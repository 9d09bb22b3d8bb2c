"""Where a run starts (diffjax/train/start.py) as a table: what the run directory holds and the run's settings ->
the start, or the refusal. Pure: no jax, no Orbax, no files. The trainer tests (test_trainer.py, test_robustness.py,
test_lora.py) run each kind of start end to end."""

import subprocess
import sys

import pytest

from diffjax.run_dir import RunDir
from diffjax.train.start import RunDirState, Start, StartPlan, StartSettings, plan_start

RUN = RunDir("/runs/r")
BASE = "/runs/base"
PLAIN = StartSettings(steps=8)
INIT_FROM = StartSettings(steps=8, init_from=BASE)
LORA = StartSettings(steps=8, init_from=BASE, lora=True)

SILENT_RESTART = (r"^no intact checkpoint remains in /runs/r/checkpoints: 2, 4 are in /runs/r/damaged-checkpoints "
                  r"\(nothing was deleted\)\. To start this run over from step 0, move /runs/r/damaged-checkpoints out "
                  r"of /runs/r \(metrics.jsonl is kept beside the new one\); or choose another train.run_dir$")
LORA_ONTO_PARAMS = (r"^/runs/r holds a params-only checkpoint \(a converted or exported model\): a LoRA run keeps its "
                    r"adapters in a run directory of its own; set train.init_from to this directory and train.run_dir "
                    r"to a new one$")

# (what the directory holds, the settings, the start or the refusal's message)
CASES = {
    "empty: fresh": (dict(), PLAIN, StartPlan(Start.FRESH)),
    "empty with init_from: its params": (dict(), INIT_FROM, StartPlan(Start.INIT_FROM, init_from=BASE)),
    "empty LoRA: fresh adapters over the base": (dict(), LORA, StartPlan(Start.FRESH, lora_base=BASE)),
    "train state: resume": (dict(newest=4), PLAIN, StartPlan(Start.RESUME, step=4)),
    "train state beats init_from": (dict(newest=4), INIT_FROM, StartPlan(Start.RESUME, step=4)),
    "LoRA train state: resume over the base": (dict(newest=4), LORA, StartPlan(Start.RESUME, step=4, lora_base=BASE)),
    "params only: converted": (dict(newest=0, params_only=True), PLAIN, StartPlan(Start.CONVERTED, step=0)),
    "params only beats init_from": (dict(newest=0, params_only=True), INIT_FROM, StartPlan(Start.CONVERTED, step=0)),
    "damaged set aside, an intact one left: resume": (
        dict(newest=2, set_aside=("4",)), PLAIN, StartPlan(Start.RESUME, step=2)),
    "at train.steps with the final record: complete": (
        dict(newest=8, final_record=True), PLAIN, StartPlan(Start.COMPLETE, step=8)),
    "beyond train.steps with the final record: complete": (
        dict(newest=10, final_record=True), PLAIN, StartPlan(Start.COMPLETE, step=10)),
    "at train.steps, final record lost to a kill: resume (to redo the final eval)": (
        dict(newest=8), PLAIN, StartPlan(Start.RESUME, step=8)),
    "a final record before train.steps (a shorter earlier run): resume": (
        dict(newest=4, final_record=True), PLAIN, StartPlan(Start.RESUME, step=4)),
    "complete is judged before LoRA's refusal": (
        dict(newest=8, params_only=True, final_record=True), LORA, StartPlan(Start.COMPLETE, step=8)),
    "refused: damaged set aside, none intact": (dict(set_aside=("2", "4")), PLAIN, SILENT_RESTART),
    "refused: damaged set aside, none intact, even with init_from": (
        dict(set_aside=("2", "4")), INIT_FROM, SILENT_RESTART),
    "refused: damaged set aside, none intact, LoRA": (dict(set_aside=("2", "4")), LORA, SILENT_RESTART),
    "refused: LoRA onto a params-only checkpoint": (dict(newest=0, params_only=True), LORA, LORA_ONTO_PARAMS),
}


@pytest.mark.parametrize("holds, settings, expected", CASES.values(), ids=CASES.keys())
def test_where_a_run_starts(holds, settings, expected):
    directory = RunDirState(RUN, **holds)
    if isinstance(expected, StartPlan):
        assert plan_start(directory, settings) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            plan_start(directory, settings)


def test_the_settings_come_from_the_run_config():
    """StartSettings.of reads train.steps, train.init_from and lora.rank (a RunConfig needs jax: in a subprocess)."""
    script = ("from diffjax.train.config import load_run_config\nfrom diffjax.train.start import StartSettings\n"
              "print(StartSettings.of(load_run_config(None, ['train.steps=5'])))\n"
              f"print(StartSettings.of(load_run_config(None, ['train.steps=6', 'train.init_from={BASE}', 'lora.rank=2'])))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["StartSettings(steps=5, init_from=None, lora=False)",
                                f"StartSettings(steps=6, init_from='{BASE}', lora=True)"]


def test_the_plan_imports_no_jax():
    script = ("import sys\nimport diffjax.train.start\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'orbax', 'numpy', 'grain'}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
